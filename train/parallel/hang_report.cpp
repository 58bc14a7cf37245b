#include "train/parallel/hang_report.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>
#include <stdexcept>

namespace keel::parallel {

namespace fs = std::filesystem;
using nlohmann::json;

// ---- dump directory ------------------------------------------------------------------------

namespace {
std::string g_dump_dir;
}

void set_hang_dump_directory(const std::string& dir) { g_dump_dir = dir; }

std::string hang_dump_directory() {
  const char* env = std::getenv("KEEL_HANG_DUMP_DIR");
  if (env && *env) return env;
  return g_dump_dir;
}

std::string hang_dump_file_name(int world_rank) { return "hang-rank" + std::to_string(world_rank) + ".json"; }

// ---- clocks --------------------------------------------------------------------------------

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double steady_ns_to_unix(int64_t ns) {
  if (ns == 0) return 0;
  return unix_now() - static_cast<double>(steady_now_ns() - ns) * 1e-9;
}

// ---- operations ----------------------------------------------------------------------------

std::string_view op_state_name(OpState s) {
  switch (s) {
    case OpState::Posted: return "posted";
    case OpState::Completed: return "completed";
    case OpState::Failed: return "failed";
  }
  return "?";
}

bool OpInfo::same_op(const OpInfo& o) const {
  if (op != o.op || group != o.group || group_index != o.group_index) return false;
  if (!p2p()) return seq == o.seq;
  return group_rank == o.group_rank && send_peer == o.send_peer && recv_peer == o.recv_peer &&
         send_seq == o.send_seq && recv_seq == o.recv_seq;
}

std::string op_title(const OpInfo& o) {
  const std::string group_ref = o.group + " group " + std::to_string(o.group_index);
  if (!o.p2p()) return o.op + " #" + std::to_string(o.seq) + " of " + group_ref;
  // Pipeline ranks are stages: "stage 3 -> 4" reads like the schedule.
  const std::string unit = o.group == "pp" ? "stage" : "rank";
  const std::string me = std::to_string(o.group_rank);
  std::string s = o.group + " " + o.op;
  if (o.send_peer >= 0 && o.recv_peer >= 0)
    s += " " + unit + " " + me + ": send #" + std::to_string(o.send_seq) + " -> " + std::to_string(o.send_peer) +
         ", recv #" + std::to_string(o.recv_seq) + " <- " + std::to_string(o.recv_peer);
  else if (o.send_peer >= 0)
    s += " #" + std::to_string(o.send_seq) + " " + unit + " " + me + " -> " + std::to_string(o.send_peer);
  else
    s += " #" + std::to_string(o.recv_seq) + " " + unit + " " + me + " <- " + std::to_string(o.recv_peer);
  return s + " (" + group_ref + ")";
}

OpInfo op_info(const OpRecord& r) {
  OpInfo o;
  o.op = r.op;
  o.group = r.group;
  o.group_index = r.group_index;
  o.group_rank = r.group_rank;
  o.seq = r.seq;
  o.send_peer = r.send_peer;
  o.recv_peer = r.recv_peer;
  o.send_world = r.send_world;
  o.recv_world = r.recv_world;
  o.send_seq = r.send_seq;
  o.recv_seq = r.recv_seq;
  o.elements = r.elements;
  o.dtype = std::string(dtype_name(r.dtype));
  o.state = std::string(op_state_name(r.state));
  o.start = steady_ns_to_unix(r.start_ns);
  o.end = r.state == OpState::Posted ? 0 : steady_ns_to_unix(r.end_ns);
  return o;
}

json op_json(const OpInfo& o) {
  json j = {{"op", o.op},       {"group", o.group}, {"group_index", o.group_index}, {"group_rank", o.group_rank},
            {"elements", o.elements}, {"dtype", o.dtype}, {"state", o.state}, {"start", o.start}};
  if (o.p2p()) {
    if (o.send_peer >= 0) j["send"] = {{"peer", o.send_peer}, {"world", o.send_world}, {"seq", o.send_seq}};
    if (o.recv_peer >= 0) j["recv"] = {{"peer", o.recv_peer}, {"world", o.recv_world}, {"seq", o.recv_seq}};
  } else {
    j["seq"] = o.seq;
  }
  if (o.end > 0) j["end"] = o.end;
  j["title"] = op_title(o);  // for people reading the file; ignored when read back
  return j;
}

OpInfo op_from_json(const json& j) {
  try {
    OpInfo o;
    o.op = j.at("op").get<std::string>();
    o.group = j.at("group").get<std::string>();
    o.group_index = j.at("group_index").get<int>();
    o.group_rank = j.value("group_rank", 0);
    o.seq = j.value("seq", int64_t{0});
    if (j.contains("send")) {
      o.send_peer = j["send"].at("peer").get<int>();
      o.send_world = j["send"].at("world").get<int>();
      o.send_seq = j["send"].at("seq").get<int64_t>();
    }
    if (j.contains("recv")) {
      o.recv_peer = j["recv"].at("peer").get<int>();
      o.recv_world = j["recv"].at("world").get<int>();
      o.recv_seq = j["recv"].at("seq").get<int64_t>();
    }
    o.elements = j.value("elements", int64_t{0});
    o.dtype = j.value("dtype", std::string("f32"));
    o.state = j.value("state", std::string("posted"));
    o.start = j.value("start", 0.0);
    o.end = j.value("end", 0.0);
    return o;
  } catch (const json::exception& e) {
    throw std::runtime_error("operation record " + j.dump() + ": " + e.what());
  }
}

// ---- the ring --------------------------------------------------------------------------------

OpRecord& OpRecorder::post(int64_t start_ns) {
  OpRecord& r = ring_[next_id_ % kCapacity];
  r = OpRecord{};
  r.id = ++next_id_;
  r.start_ns = start_ns;
  return r;
}

const OpRecord* OpRecorder::find(uint64_t id) const {
  if (id == 0) return nullptr;
  const OpRecord& r = ring_[(id - 1) % kCapacity];
  return r.id == id ? &r : nullptr;
}

void OpRecorder::finish(uint64_t id, OpState state) {
  if (id == 0) return;
  OpRecord& r = ring_[(id - 1) % kCapacity];
  if (r.id != id) return;
  r.state = state;
  r.end_ns = steady_now_ns();
}

std::vector<OpRecord> OpRecorder::snapshot() const {
  std::vector<OpRecord> out;
  const uint64_t first = next_id_ > kCapacity ? next_id_ - kCapacity : 0;
  for (uint64_t id = first + 1; id <= next_id_; ++id) out.push_back(ring_[(id - 1) % kCapacity]);
  return out;
}

std::optional<OpRecord> OpRecorder::last_completed() const {
  const uint64_t first = next_id_ > kCapacity ? next_id_ - kCapacity : 0;
  for (uint64_t id = next_id_; id > first; --id) {
    const OpRecord& r = ring_[(id - 1) % kCapacity];
    if (r.state == OpState::Completed) return r;
  }
  return std::nullopt;
}

void OpRecorder::clear() {
  ring_ = {};
  next_id_ = 0;
}

OpRecorder& op_recorder() {
  static OpRecorder recorder;
  return recorder;
}

// ---- fault injection -------------------------------------------------------------------------

std::optional<CollectiveFault> parse_collective_fault(const std::string& text) {
  if (text.empty()) return std::nullopt;
  const std::string where = "KEEL_FAULT_SKIP_COLLECTIVE=\"" + text + "\"";
  CollectiveFault f;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      throw std::invalid_argument(where + ": \"" + item + "\" is not key=value (expected rank=R,op=OP,group=G,seq=N or call=N)");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    auto number = [&](int64_t lo) {
      char* end = nullptr;
      const long long v = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || v < lo)
        throw std::invalid_argument(where + ": " + key + " must be an integer >= " + std::to_string(lo));
      return static_cast<int64_t>(v);
    };
    if (key == "rank") f.world_rank = static_cast<int>(number(0));
    else if (key == "seq") f.seq = number(1);
    else if (key == "call") f.call = number(1);
    else if (key == "op") f.op = value;
    else if (key == "group") f.group = value;
    else throw std::invalid_argument(where + ": unknown key \"" + key + "\" (expected rank, op, group, seq or call)");
    at = comma + 1;
  }
  static const std::set<std::string> ops = {"all_reduce", "reduce_scatter", "reduce", "all_gather", "broadcast",
                                            "barrier"};
  static const std::set<std::string> groups = {"world", "tp", "pp", "dp", "embedding"};
  if (f.world_rank < 0 || f.op.empty() || f.group.empty() || (f.seq > 0) == (f.call > 0))
    throw std::invalid_argument(where + ": needs rank, op, group, and one of seq or call");
  if (!ops.count(f.op))
    throw std::invalid_argument(where + ": op must be a collective (all_reduce, reduce_scatter, reduce, all_gather, broadcast, barrier)");
  if (!groups.count(f.group)) throw std::invalid_argument(where + ": group must be world, tp, pp, dp or embedding");
  return f;
}

// ---- findings --------------------------------------------------------------------------------

namespace {

// "0-3, 6, 9-11": runs of three or more collapse.
std::string rank_list(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    if (j >= i + 2) s += std::to_string(ranks[i]) + "-" + std::to_string(ranks[j]);
    else {
      s += std::to_string(ranks[i]);
      if (j == i + 1) s += ", " + std::to_string(ranks[j]);
    }
    i = j + 1;
  }
  return s;
}

std::string world_ranks(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "world rank " : "world ranks ") + rank_list(ranks);
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

}  // namespace

std::string format_finding(const HangFinding& f, bool with_time) {
  std::string s = op_title(f.op) + " [" + world_ranks(f.members) + "]: ";
  if (f.missing.empty()) {
    s += "every rank arrived, yet the operation does not complete (an MPI or network problem, or ranks that "
         "disagree on the message size)";
  } else {
    // Ranks in the same situation share one clause: "world ranks 12, 13 never arrived; they ...".
    struct Clause {
      std::string key;
      std::vector<int> ranks;
      const MissingRank* first;
    };
    std::vector<Clause> clauses;
    // The ranks the operation waits for first; the ones only behind (held up by them) after.
    for (const bool behind_pass : {false, true})
      for (const MissingRank& m : f.missing) {
        if (m.behind != behind_pass) continue;
        const std::string key = std::to_string(m.answered) + std::to_string(m.mismatch) + std::to_string(m.behind) +
                                "|" + (m.late_seconds > 0 ? seconds_text(m.late_seconds) : "") + "|" +
                                (m.slow_in ? op_title(*m.slow_in) : "") + "|" +
                                (m.last_completed ? op_title(*m.last_completed) : "") + "|" +
                                (m.waiting_in ? op_title(*m.waiting_in) : "");
        auto it = std::find_if(clauses.begin(), clauses.end(), [&](const Clause& c) { return c.key == key; });
        if (it == clauses.end()) clauses.push_back({key, {m.world_rank}, &m});
        else it->ranks.push_back(m.world_rank);
      }
    for (size_t i = 0; i < clauses.size(); ++i) {
      const Clause& c = clauses[i];
      const MissingRank& m = *c.first;
      const bool one = c.ranks.size() == 1;
      if (i) s += "; ";
      s += world_ranks(c.ranks);
      if (m.late_seconds > 0) {
        s += " arrived " + seconds_text(m.late_seconds) + " late (after the others' timeout): " +
             (one ? "it was" : "they were") + " stalled or slow ";
        if (m.slow_in)
          s += "in " + op_title(*m.slow_in) + ", which took " + (one ? "it " : "them ") +
               seconds_text(m.slow_in->end - m.slow_in->start);
        else
          s += "outside keel's collectives";
        continue;
      }
      if (m.behind) {
        s += std::string(one ? " is" : " are") + " behind: still waiting in " +
             (m.waiting_in ? op_title(*m.waiting_in) : std::string("?")) + ", an earlier operation of this group";
        continue;
      }
      if (!m.answered) {
        s += " never arrived and gave no answer (busy outside keel's communication: computing, hung in other code, "
             "or dead)";
        continue;
      }
      if (m.mismatch) {
        s += std::string(one ? " is" : " are") + " in a different operation at this point: " +
             (m.waiting_in ? op_title(*m.waiting_in) : std::string("?"));
        continue;
      }
      s += std::string(" never arrived; ") + (one ? "it" : "they") + " last completed " +
           (m.last_completed ? op_title(*m.last_completed) : std::string("no operation at all"));
      if (m.waiting_in)
        s += std::string(" and ") + (one ? "is" : "are") + " now waiting in " + op_title(*m.waiting_in);
      else
        s += std::string(" and ") + (one ? "is" : "are") + " not waiting in any keel operation";
    }
  }
  if (with_time)
    s += " (stuck " + seconds_text(f.stuck_seconds) + ", " + std::to_string(f.waiting.size()) + " of " +
         std::to_string(f.members.size()) + " ranks waiting)";
  return s;
}

void sort_findings(std::vector<HangFinding>& findings) {
  std::stable_sort(findings.begin(), findings.end(), [](const HangFinding& a, const HangFinding& b) {
    const double fa = a.members.empty() ? 0 : static_cast<double>(a.waiting.size()) / a.members.size();
    const double fb = b.members.empty() ? 0 : static_cast<double>(b.waiting.size()) / b.members.size();
    if (fa != fb) return fa > fb;
    if (a.stuck_seconds != b.stuck_seconds) return a.stuck_seconds > b.stuck_seconds;
    const std::string ta = op_title(a.op), tb = op_title(b.op);
    if (ta != tb) return ta < tb;
    return a.waiting < b.waiting;
  });
}

// ---- reading dumps ---------------------------------------------------------------------------

HangDumps read_hang_dumps(const std::string& dir_arg) {
  HangDumps out;
  fs::path dir = dir_arg;
  if (!fs::is_directory(dir)) throw std::runtime_error(dir_arg + " is not a directory");
  auto has_dumps = [](const fs::path& d) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d, ec)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("hang-rank", 0) == 0 && e.path().extension() == ".json") return true;
    }
    return false;
  };
  if (!has_dumps(dir) && fs::is_directory(dir / "hang")) dir /= "hang";  // a run directory
  out.dir = dir.string();
  std::vector<json> all;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("hang-rank", 0) == 0 && e.path().extension() == ".json") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  for (const auto& p : files) {
    try {
      std::ifstream in(p);
      json j = json::parse(in);
      if (j.value("format", std::string()) != "keel-hang-dump") {
        out.notes.push_back(p.filename().string() + " is not a keel hang dump: skipped");
        continue;
      }
      all.push_back(std::move(j));
    } catch (const std::exception& e) {
      out.notes.push_back(p.filename().string() + " cannot be read (" + std::string(e.what()) + "): skipped");
    }
  }
  if (all.empty())
    throw std::runtime_error("no hang dumps (hang-rank*.json) in " + dir_arg +
                             (dir.string() != dir_arg ? " or " + dir.string() : std::string()) +
                             (out.notes.empty() ? "" : ": " + out.notes.front()));
  // Dumps of an earlier hang may still lie there: keep the newest job's.
  const json* newest = &all.front();
  for (const json& j : all)
    if (j.value("dumped_at", 0.0) > newest->value("dumped_at", 0.0)) newest = &j;
  const std::string job = newest->value("job", std::string());
  int older = 0;
  for (json& j : all) {
    if (j.value("job", std::string()) == job) out.dumps.push_back(std::move(j));
    else ++older;
  }
  if (older)
    out.notes.push_back(std::to_string(older) + " dump(s) of an earlier job (not " + job + ") left out");
  return out;
}

// ---- the offline analysis --------------------------------------------------------------------

namespace {

struct RankDump {
  const json* j = nullptr;
  std::optional<OpInfo> waiting, last_completed;
  std::vector<OpInfo> ops;
  double dumped_at = 0;
};

// What an asking rank learnt from a peer that answered (stored in the asker's diagnosis).
struct PeerAnswer {
  int asker = -1;          // world rank that asked
  OpInfo asker_op;         // what the asker was stuck in
  bool answered = false;
  int64_t collectives = 0, sends_to_asker = 0, recvs_from_asker = 0;
  std::optional<OpInfo> waiting, last_completed;
};

const json* group_entry(const json& dump, const std::string& group, int index) {
  if (!dump.contains("groups") || !dump["groups"].is_array()) return nullptr;
  for (const json& g : dump["groups"])
    if (g.value("group", std::string()) == group && g.value("index", -1) == index) return &g;
  return nullptr;
}

std::string op_key(const OpInfo& o) {  // a kind-level position: same across groups of one kind
  return o.group + "/" + o.op + "/" + std::to_string(o.seq) + "/" + std::to_string(o.send_seq) + "/" +
         std::to_string(o.recv_seq);
}

// Is `o`, recorded by world rank `member`, its side of `stuck`, which world rank `stuck_world`
// waits in? A collective: the same number of the same group. Point to point: the receive that
// matches the stuck send, or the send that matches the stuck receive.
bool is_counterpart(const OpInfo& o, int member, const OpInfo& stuck, int stuck_world) {
  if (o.group != stuck.group || o.group_index != stuck.group_index) return false;
  if (!stuck.p2p()) return !o.p2p() && o.op == stuck.op && o.seq == stuck.seq;
  return (stuck.send_world == member && o.recv_world == stuck_world && o.recv_seq == stuck.send_seq) ||
         (stuck.recv_world == member && o.send_world == stuck_world && o.send_seq == stuck.recv_seq);
}

// Waiting in an earlier collective of the same group: held up there, on its way to this one.
bool behind_in_group(const std::optional<OpInfo>& waiting, const OpInfo& stuck) {
  return waiting && !stuck.p2p() && !waiting->p2p() && waiting->group == stuck.group &&
         waiting->group_index == stuck.group_index && waiting->seq < stuck.seq;
}

}  // namespace

HangAnalysis analyze_hang(const std::vector<json>& dumps) {
  HangAnalysis a;
  std::map<int, RankDump> ranks;
  std::multimap<int, PeerAnswer> answers;  // by answering world rank
  for (const json& j : dumps) {
    const int r = j.value("world_rank", -1);
    a.world_size = std::max(a.world_size, j.value("world_size", 0));
    if (j.value("reason", std::string()) == "timeout") a.timeout = std::max(a.timeout, j.value("timeout_s", 0.0));
    RankDump d;
    d.j = &j;
    d.dumped_at = j.value("dumped_at", 0.0);
    if (j.contains("waiting") && !j["waiting"].is_null()) d.waiting = op_from_json(j["waiting"]);
    if (j.contains("last_completed") && !j["last_completed"].is_null()) d.last_completed = op_from_json(j["last_completed"]);
    for (const json& o : j.value("ops", json::array())) d.ops.push_back(op_from_json(o));
    const std::optional<OpInfo> stuck_in = d.waiting;
    ranks[r] = std::move(d);
    if (j.contains("diagnosis") && j["diagnosis"].contains("peers") && stuck_in) {
      for (const json& p : j["diagnosis"]["peers"]) {
        PeerAnswer pa;
        pa.asker = r;
        pa.asker_op = *stuck_in;
        pa.answered = p.value("answered", false);
        pa.collectives = p.value("collectives", int64_t{0});
        pa.sends_to_asker = p.value("sends_to_asker", int64_t{0});
        pa.recvs_from_asker = p.value("recvs_from_asker", int64_t{0});
        if (p.contains("waiting") && !p["waiting"].is_null()) pa.waiting = op_from_json(p["waiting"]);
        if (p.contains("last_completed") && !p["last_completed"].is_null())
          pa.last_completed = op_from_json(p["last_completed"]);
        answers.emplace(p.value("world_rank", -1), std::move(pa));
      }
    }
  }

  // One finding per stuck operation (collectives: per group and number; point to point: per rank).
  std::vector<HangFinding> findings;
  for (const auto& [r, d] : ranks) {
    if (!d.waiting) continue;
    auto it = std::find_if(findings.begin(), findings.end(), [&](const HangFinding& f) { return f.op.same_op(*d.waiting); });
    if (it != findings.end()) {
      it->waiting.push_back(r);
      it->stuck_seconds = std::max(it->stuck_seconds, d.dumped_at - d.waiting->start);
      continue;
    }
    HangFinding f;
    f.op = *d.waiting;
    f.waiting.push_back(r);
    f.stuck_seconds = d.dumped_at - d.waiting->start;
    if (f.op.p2p()) {
      f.members.push_back(r);
      if (f.op.send_world >= 0) f.members.push_back(f.op.send_world);
      if (f.op.recv_world >= 0 && f.op.recv_world != f.op.send_world) f.members.push_back(f.op.recv_world);
    } else if (const json* g = group_entry(*d.j, f.op.group, f.op.group_index)) {
      f.members = g->value("members", std::vector<int>{});
    }
    findings.push_back(std::move(f));
  }

  // A rank may reach the operation long after the others: stopped (kill -STOP) or starved, it
  // wakes when the job is aborted, walks into the operation and answers the dump request, so
  // that its dump shows it there (or past it) as if it had been all along. Anyone who got there
  // only after the first waiter's watchdog had fired is the one the others waited for.
  std::map<int, std::pair<OpInfo, double>> late_at;  // world rank -> (operation, seconds late)
  auto late_rank = [&](int r, const OpInfo& counterpart, double seconds, const RankDump* d) {
    MissingRank miss;
    miss.world_rank = r;
    miss.late_seconds = seconds;
    if (d) {
      miss.last_completed = d->last_completed;
      miss.waiting_in = d->waiting;
      // Where the time went: in the operation just before, when that took most of it.
      for (size_t i = 1; i < d->ops.size(); ++i) {
        if (!d->ops[i].same_op(counterpart)) continue;
        const OpInfo& prev = d->ops[i - 1];
        if (prev.end > 0 && prev.end - prev.start >= seconds / 2) miss.slow_in = prev;
        break;
      }
    }
    late_at.emplace(r, std::make_pair(counterpart, seconds));
    return miss;
  };

  for (HangFinding& f : findings) {
    double first_start = 0, fired = 0;
    bool first = true;
    for (int w : f.waiting) {
      const RankDump& d = ranks[w];
      const double timeout_s = d.j->value("timeout_s", 0.0);
      const double fires = timeout_s > 0 ? d.waiting->start + timeout_s : d.dumped_at;
      first_start = first ? d.waiting->start : std::min(first_start, d.waiting->start);
      fired = first ? fires : std::min(fired, fires);
      first = false;
    }
    std::set<int> late;
    std::vector<int> on_time;
    f.stuck_seconds = 0;
    for (int w : f.waiting) {
      const RankDump& d = ranks[w];
      if (d.waiting->start >= fired) {
        late.insert(w);
        continue;
      }
      on_time.push_back(w);
      f.stuck_seconds = std::max(f.stuck_seconds, d.dumped_at - d.waiting->start);
    }
    if (on_time.empty()) {  // cannot happen with a timeout; without one, take the waits as they are
      on_time = f.waiting;
      late.clear();
    }
    for (int w : late) {
      const RankDump& d = ranks[w];
      f.missing.push_back(late_rank(w, *d.waiting, d.waiting->start - first_start, &d));
    }
    f.waiting = on_time;
    const int stuck_rank = f.waiting.front();
    for (int m : f.members) {
      if (late.count(m) || std::find(f.waiting.begin(), f.waiting.end(), m) != f.waiting.end()) continue;
      MissingRank miss;
      miss.world_rank = m;
      bool arrived = false;
      auto own = ranks.find(m);
      if (own != ranks.end()) {
        const RankDump& d = own->second;
        miss.last_completed = d.last_completed;
        miss.waiting_in = d.waiting;
        const json* g = group_entry(*d.j, f.op.group, f.op.group_index);
        if (!f.op.p2p()) {
          const int64_t started = g ? g->value("collectives", int64_t{0}) : 0;
          if (d.waiting && d.waiting->group == f.op.group && d.waiting->group_index == f.op.group_index &&
              d.waiting->seq == f.op.seq && !d.waiting->p2p())
            miss.mismatch = true;  // same point, other collective (same_op would have made it a waiter)
          else
            arrived = started >= f.op.seq;
        } else if (g) {
          // The stuck rank's send must be matched by a receive posted by m (and vice versa).
          const auto recvs = g->value("recvs_from", std::vector<int64_t>{});
          const auto sends = g->value("sends_to", std::vector<int64_t>{});
          const size_t me = static_cast<size_t>(f.op.group_rank);
          arrived = true;
          if (f.op.send_world == m && (me >= recvs.size() || recvs[me] < f.op.send_seq)) arrived = false;
          if (f.op.recv_world == m && (me >= sends.size() || sends[me] < f.op.recv_seq)) arrived = false;
        }
        if (arrived) {
          // Got there, and past it: but in time? (Its ring says when; an overwritten entry: assume so.)
          for (const OpInfo& o : d.ops)
            if (is_counterpart(o, m, f.op, stuck_rank) && o.start >= fired) {
              f.missing.push_back(late_rank(m, o, o.start - first_start, &d));
              break;
            }
          continue;
        }
        miss.behind = behind_in_group(d.waiting, f.op);
      } else {
        // No dump: what it told a rank stuck in this operation, if it answered.
        const PeerAnswer* best = nullptr;
        auto [lo, hi] = answers.equal_range(m);
        for (auto it = lo; it != hi; ++it)
          if (it->second.asker_op.same_op(f.op) || (!best && it->second.asker == stuck_rank)) best = &it->second;
        if (!best || !best->answered) {
          miss.answered = false;
        } else {
          miss.last_completed = best->last_completed;
          miss.waiting_in = best->waiting;
          if (!f.op.p2p()) {
            if (best->waiting && best->waiting->group == f.op.group && best->waiting->group_index == f.op.group_index &&
                best->waiting->seq == f.op.seq && !best->waiting->same_op(f.op))
              miss.mismatch = true;
            else
              arrived = best->collectives >= f.op.seq;
          } else {
            arrived = true;
            if (f.op.send_world == m && best->recvs_from_asker < f.op.send_seq) arrived = false;
            if (f.op.recv_world == m && best->sends_to_asker < f.op.recv_seq) arrived = false;
          }
          if (arrived) {
            for (const auto& said : {best->waiting, best->last_completed})
              if (said && is_counterpart(*said, m, f.op, stuck_rank) && said->start >= fired) {
                f.missing.push_back(late_rank(m, *said, said->start - first_start, nullptr));
                break;
              }
            continue;
          }
          miss.behind = behind_in_group(best->waiting, f.op);
        }
      }
      if (!arrived) f.missing.push_back(std::move(miss));
    }
    std::sort(f.missing.begin(), f.missing.end(),
              [](const MissingRank& x, const MissingRank& y) { return x.world_rank < y.world_rank; });
  }

  // Which missing rank skipped the operation? A rank whose last completed operation was
  // followed, on most other ranks that did it, by this finding's operation (the same position
  // of the group kind, in any group of that kind), while it went elsewhere, ran different code.
  sort_findings(findings);
  std::vector<std::vector<std::string>> why(findings.size());
  struct Skip {
    int rank;             // the rank said to have skipped the finding's operation
    std::string after;    // its last completed operation
    size_t voters;        // the ranks whose next operation says so
  };
  std::vector<std::vector<Skip>> skips(findings.size());
  for (size_t fi = 0; fi < findings.size(); ++fi) {
    const HangFinding& f = findings[fi];
    for (const MissingRank& m : f.missing) {
      if (!m.last_completed || !m.waiting_in || m.mismatch || m.late_seconds > 0) continue;
      const std::string prev = op_key(*m.last_completed), expected = op_key(f.op);
      if (op_key(*m.waiting_in) == expected) continue;
      std::map<std::string, std::vector<int>> next_by_rank;  // what the others did right after prev
      size_t others = 0;
      for (const auto& [r, d] : ranks) {
        if (r == m.world_rank) continue;
        for (size_t i = 0; i + 1 < d.ops.size(); ++i)
          if (d.ops[i].state == "completed" && op_key(d.ops[i]) == prev) {
            next_by_rank[op_key(d.ops[i + 1])].push_back(r);
            ++others;
            break;
          }
      }
      auto hit = next_by_rank.find(expected);
      if (hit == next_by_rank.end() || hit->second.size() * 2 <= others) continue;
      const int64_t number = f.op.p2p() ? std::max(f.op.send_seq, f.op.recv_seq) : f.op.seq;
      skips[fi].push_back({m.world_rank, op_title(*m.last_completed), hit->second.size()});
      why[fi].push_back(world_ranks({m.world_rank}) + " skipped it: after " + op_title(*m.last_completed) + ", " +
                        world_ranks(hit->second) + " called " + f.op.op + " #" + std::to_string(number) + " of " +
                        f.op.group + " next, world rank " + std::to_string(m.world_rank) + " called " +
                        op_title(*m.waiting_in));
    }
  }

  // Two ranks alone, each waiting in an operation the other never called after the same one,
  // each verdict resting on the other rank alone: the dumps are symmetric, either of them may have
  // gone off the common path (two-rank groups, tp=2 or dp=2, meet this often). Neither is named.
  for (size_t fi = 0; fi < findings.size(); ++fi)
    for (size_t gi = fi + 1; gi < findings.size(); ++gi) {
      if (skips[fi].size() != 1 || skips[gi].size() != 1 || why[fi].size() != 1 || why[gi].size() != 1) continue;
      const Skip &x = skips[fi][0], &y = skips[gi][0];
      const HangFinding &f = findings[fi], &g = findings[gi];
      auto waits_in = [](const HangFinding& h, int r) { return std::count(h.waiting.begin(), h.waiting.end(), r) > 0; };
      if (x.voters != 1 || y.voters != 1 || x.after != y.after || !waits_in(f, y.rank) || !waits_in(g, x.rank)) continue;
      why[fi] = {world_ranks({x.rank}) + " or " + world_ranks({y.rank}) + " skipped an operation, and the dumps cannot "
                 "tell which: after " + x.after + ", " + world_ranks({y.rank}) + " called " + op_title(f.op) + " and " +
                 world_ranks({x.rank}) + " called " + op_title(g.op) + ", and no third rank did either. The code "
                 "paths that lead to the two calls (the ranks' stacks, the step's branches) decide it"};
      why[gi].clear();
    }

  // Wait chains. A missing rank that waits in another stuck operation (or is behind in this
  // group) is a victim: follow it there. An operation with a missing rank that is silent, waits
  // nowhere, came late, is elsewhere at this point or skipped it, or with every member there,
  // is where a chain ends: the cause is there. Next come the ones whose chain cannot be followed
  // (a missing rank waits in an operation whose members no dump lists), then the victims. Among
  // equals, the one the most ranks wait on, directly or down a chain, heads the report.
  const size_t n = findings.size();
  std::vector<std::vector<size_t>> waits_on(n);
  enum : int { kVictim = 0, kChainLost = 1, kCause = 2 };
  std::vector<int> chain_end(n, kVictim);
  for (size_t fi = 0; fi < n; ++fi) {
    const HangFinding& f = findings[fi];
    if ((f.missing.empty() && !f.members.empty()) || !why[fi].empty()) chain_end[fi] = kCause;
    for (const MissingRank& m : f.missing) {
      if (!m.answered || m.mismatch || m.late_seconds > 0 || !m.waiting_in) {
        chain_end[fi] = kCause;
        continue;
      }
      bool followed = false;
      for (size_t gi = 0; gi < n; ++gi)
        if (gi != fi && findings[gi].op.same_op(*m.waiting_in) && !findings[gi].members.empty()) {
          waits_on[fi].push_back(gi);
          followed = true;
        }
      if (!followed) chain_end[fi] = std::max(chain_end[fi], static_cast<int>(kChainLost));
    }
  }
  std::vector<std::set<int>> blocked(n);  // ranks waiting in it or in an operation that leads to it
  for (size_t fi = 0; fi < n; ++fi) {
    std::vector<char> seen(n, 0);
    std::vector<size_t> todo = {fi};
    seen[fi] = 1;
    while (!todo.empty()) {
      const size_t gi = todo.back();
      todo.pop_back();
      blocked[gi].insert(findings[fi].waiting.begin(), findings[fi].waiting.end());
      for (size_t next : waits_on[gi])
        if (!seen[next]) seen[next] = 1, todo.push_back(next);
    }
  }
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    if (why[x].empty() != why[y].empty()) return !why[x].empty();
    if (chain_end[x] != chain_end[y]) return chain_end[x] > chain_end[y];
    return blocked[x].size() > blocked[y].size();
  });
  for (size_t i : order) {
    a.findings.push_back(findings[i]);
    for (const auto& reason : why[i]) a.notes.push_back(reason);
  }

  // One line per rank.
  for (int r = 0; r < a.world_size; ++r) {
    std::string line = "world rank " + std::to_string(r);
    auto own = ranks.find(r);
    if (own != ranks.end()) {
      const RankDump& d = own->second;
      const json& j = *d.j;
      line += " (host " + j.value("host", std::string("?")) + ", pid " + std::to_string(j.value("pid", 0)) + "): ";
      if (d.waiting)
        line += "waiting in " + op_title(*d.waiting) + " for " + seconds_text(d.dumped_at - d.waiting->start);
      else
        line += "not waiting in any keel operation";
      line += "; last completed " + (d.last_completed ? op_title(*d.last_completed) : std::string("nothing"));
      if (auto late = late_at.find(r); late != late_at.end())
        line += "; it reached " + op_title(late->second.first) + " " + seconds_text(late->second.second) + " late";
      line += j.value("reason", std::string()) == "timeout"
                  ? " [its own watchdog fired]"
                  : " [dumped when world rank " + std::to_string(j.value("asked_by", -1)) + " asked]";
    } else {
      auto [lo, hi] = answers.equal_range(r);
      const PeerAnswer* said = nullptr;
      for (auto it = lo; it != hi; ++it)
        if (!said || (it->second.answered && !said->answered)) said = &it->second;
      line += ": no dump";
      if (said && said->answered) {
        line += "; told world rank " + std::to_string(said->asker) + " it was " +
                (said->waiting ? "waiting in " + op_title(*said->waiting) : std::string("not waiting in keel")) +
                ", last completed " + (said->last_completed ? op_title(*said->last_completed) : std::string("nothing"));
      } else if (said) {
        line += " and no answer to world rank " + std::to_string(said->asker) +
                ": busy outside keel's communication (computing, hung in other code) or dead";
      } else {
        line += "; nobody asked it (it was in no stuck operation's group) or it was killed before writing";
      }
    }
    a.rank_lines.push_back(line);
  }
  return a;
}

std::string format_hang_analysis(const HangAnalysis& a, const HangDumps& source) {
  std::string s = "keel doctor hang: " + std::to_string(source.dumps.size()) + " dump(s) in " + source.dir +
                  ", world of " + std::to_string(a.world_size) + " ranks, watchdog timeout " + seconds_text(a.timeout) +
                  "\n";
  if (a.findings.empty()) s += "no rank was waiting in a keel operation when the dumps were written\n";
  for (size_t i = 0; i < a.findings.size(); ++i)
    s += std::string(i == 0 ? "hang: " : "also stuck: ") + format_finding(a.findings[i]) + "\n";
  for (const auto& n : a.notes) s += "  " + n + "\n";
  s += "ranks:\n";
  for (const auto& l : a.rank_lines) s += "  " + l + "\n";
  for (const auto& n : source.notes) s += "note: " + n + "\n";
  return s;
}

// ---- BlockingCallWatch ------------------------------------------------------------------

namespace {

// Lock-free on the watched thread. The helper fires only after setting `firing` and seeing the
// same arm still in place; a disarm that sees `firing` waits for the process to end, so the
// strings the report reads cannot change under it (all seq_cst: one of the two sees the other).
struct BlockingWatchState {
  std::atomic<bool> armed{false}, firing{false};
  std::atomic<uint64_t> generation{0};
  std::atomic<int64_t> since_ns{0};
  std::atomic<double> timeout_s{0};
  std::atomic<const char*> call{""};
  std::atomic<const std::string*> op{nullptr}, who{nullptr};
};

// Never destroyed: the helper thread may still read it while the process exits.
BlockingWatchState& blocking_watch_state() {
  static BlockingWatchState* state = [] {
    auto* s = new BlockingWatchState;
    std::thread([s] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (!s->armed.load()) continue;
        const uint64_t gen = s->generation.load();
        const double waited = static_cast<double>(steady_now_ns() - s->since_ns.load()) * 1e-9;
        if (waited < s->timeout_s.load()) continue;
        s->firing.store(true);
        if (!s->armed.load() || s->generation.load() != gen) {  // returned meanwhile
          s->firing.store(false);
          continue;
        }
        std::fprintf(stderr,
                     "keel hang report: %s: %s for %s has not returned after %g s. This call waits inside itself "
                     "for the other ranks of the group: one of them never reached it (stuck elsewhere, crashed, or "
                     "started with another layout), or the network cannot connect them. Ending this process so "
                     "that the launcher ends the job.\n",
                     s->who.load()->c_str(), s->call.load(), s->op.load()->c_str(), s->timeout_s.load());
        std::fflush(stderr);
        std::_Exit(1);
      }
    }).detach();
    return s;
  }();
  return *state;
}

}  // namespace

BlockingCallWatch::BlockingCallWatch(const char* call, const std::string& op, const std::string& who,
                                     double timeout_s) {
  BlockingWatchState& s = blocking_watch_state();
  s.call.store(call, std::memory_order_relaxed);
  s.op.store(&op, std::memory_order_relaxed);
  s.who.store(&who, std::memory_order_relaxed);
  s.timeout_s.store(timeout_s, std::memory_order_relaxed);
  s.since_ns.store(steady_now_ns(), std::memory_order_relaxed);
  s.generation.fetch_add(1);
  s.armed.store(true);
}

BlockingCallWatch::~BlockingCallWatch() {
  BlockingWatchState& s = blocking_watch_state();
  s.armed.store(false);
  while (s.firing.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the helper is ending us
}

}  // namespace keel::parallel
