// Hang diagnosis without MPI (train/parallel/hang_report.h): the wording of operations, the
// ring, the fault-injection spec, and the offline report built from hand-made dumps (the
// multi-rank tests in test/parallel/mpi make real ones).
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/child.h"
#include "common/temp_dir.h"
#include "train/parallel/hang_report.h"

using namespace keel;
using namespace keel::parallel;
using nlohmann::json;

namespace {

OpInfo collective(const std::string& op, const std::string& group, int index, int64_t seq, double start = 100) {
  OpInfo o;
  o.op = op;
  o.group = group;
  o.group_index = index;
  o.seq = seq;
  o.start = start;
  o.state = "completed";
  o.end = start + 0.01;
  return o;
}

OpInfo send(int group_index, int stage, int to_stage, int to_world, int64_t n, double start = 100) {
  OpInfo o;
  o.op = "send";
  o.group = "pp";
  o.group_index = group_index;
  o.group_rank = stage;
  o.send_peer = to_stage;
  o.send_world = to_world;
  o.send_seq = n;
  o.start = start;
  return o;
}

OpInfo posted(OpInfo o) {
  o.state = "posted";
  o.end = 0;
  return o;
}

json group(const std::string& name, int index, int rank, std::vector<int> members, int64_t collectives,
           std::vector<int64_t> sends_to = {}, std::vector<int64_t> recvs_from = {}) {
  if (sends_to.empty()) sends_to.assign(members.size(), 0);
  if (recvs_from.empty()) recvs_from.assign(members.size(), 0);
  return {{"group", name},          {"index", index},       {"rank", rank},
          {"members", members},     {"collectives", collectives}, {"sends_to", sends_to},
          {"recvs_from", recvs_from}};
}

json dump(int rank, int world, const std::vector<OpInfo>& ops, const json& groups, const std::string& reason = "asked",
          double dumped_at = 105, const std::string& job = "job-1") {
  json j = {{"format", "keel-hang-dump"}, {"version", 1},       {"job", job},          {"world_rank", rank},
            {"world_size", world},        {"host", "node" + std::to_string(rank / 8)}, {"pid", 1000 + rank},
            {"reason", reason},           {"dumped_at", dumped_at}, {"timeout_s", 5.0}, {"groups", groups}};
  if (reason == "asked") j["asked_by"] = 12;
  json arr = json::array();
  std::optional<OpInfo> waiting, done;
  for (const OpInfo& o : ops) {
    arr.push_back(op_json(o));
    if (o.state == "posted") waiting = o;
    if (o.state == "completed") done = o;
  }
  j["ops"] = arr;
  j["waiting"] = waiting ? op_json(*waiting) : json();
  j["last_completed"] = done ? op_json(*done) : json();
  return j;
}

}  // namespace

TEST_CASE("hang report: one wording for every kind of operation", "[parallel][hang]") {
  CHECK(op_title(collective("all_reduce", "tp", 3, 411)) == "all_reduce #411 of tp group 3");
  CHECK(op_title(send(2, 3, 4, 16, 412)) == "pp send #412 stage 3 -> 4 (pp group 2)");
  OpInfo recv;
  recv.op = "recv";
  recv.group = "tp";
  recv.group_rank = 1;
  recv.recv_peer = 0;
  recv.recv_seq = 7;
  CHECK(op_title(recv) == "tp recv #7 rank 1 <- 0 (tp group 0)");
  OpInfo both = send(2, 3, 4, 16, 5);
  both.op = "sendrecv";
  both.recv_peer = 4;
  both.recv_world = 16;
  both.recv_seq = 6;
  CHECK(op_title(both) == "pp sendrecv stage 3: send #5 -> 4, recv #6 <- 4 (pp group 2)");
  // Round trip through the dump format.
  const OpInfo back = op_from_json(op_json(both));
  CHECK(back.same_op(both));
  CHECK(op_title(back) == op_title(both));
}

TEST_CASE("hang report: the ring keeps the last 256 operations and finishes only live entries", "[parallel][hang]") {
  OpRecorder rec;
  uint64_t first_id = 0;
  for (int i = 0; i < 300; ++i) {
    OpRecord& r = rec.post(1000 + i);
    r.op = "all_reduce";
    r.group = "dp";
    r.seq = i + 1;
    if (i == 0) first_id = r.id;
    if (i < 299) rec.finish(r.id, OpState::Completed);
  }
  const auto snap = rec.snapshot();
  REQUIRE(snap.size() == OpRecorder::kCapacity);
  CHECK(snap.front().seq == 300 - 256 + 1);
  CHECK(snap.back().seq == 300);
  CHECK(snap.back().state == OpState::Posted);
  REQUIRE(rec.last_completed());
  CHECK(rec.last_completed()->seq == 299);
  CHECK(rec.find(first_id) == nullptr);  // overwritten
  rec.finish(first_id, OpState::Failed);  // no effect on the slot's new owner (operation 257)
  REQUIRE(rec.find(first_id + OpRecorder::kCapacity) != nullptr);
  CHECK(rec.find(first_id + OpRecorder::kCapacity)->state == OpState::Completed);
}

TEST_CASE("hang report: KEEL_FAULT_SKIP_COLLECTIVE is parsed strictly", "[parallel][hang]") {
  auto f = parse_collective_fault("rank=2,op=all_reduce,group=dp,seq=5");
  REQUIRE(f);
  CHECK(f->world_rank == 2);
  CHECK(f->op == "all_reduce");
  CHECK(f->group == "dp");
  CHECK(f->seq == 5);
  CHECK(parse_collective_fault("rank=0,op=reduce_scatter,group=dp,call=2")->call == 2);
  CHECK_FALSE(parse_collective_fault(""));
  CHECK_THROWS_WITH(parse_collective_fault("rank=2,op=all_reduce,group=dp"),
                    Catch::Contains("needs rank, op, group, and one of seq or call"));
  CHECK_THROWS_WITH(parse_collective_fault("rank=2,op=send,group=pp,seq=1"), Catch::Contains("op must be a collective"));
  CHECK_THROWS_WITH(parse_collective_fault("rank=x,op=all_reduce,group=dp,seq=1"), Catch::Contains("rank must be an integer"));
  CHECK_THROWS_WITH(parse_collective_fault("rank=1,colour=red"), Catch::Contains("unknown key \"colour\""));
}

TEST_CASE("hang report: a pipeline send whose receiver never posted it, as the issue words it", "[parallel][hang]") {
  // World rank 12 (stage 3 of pp group 2) waits in its send #412 to stage 4 (world rank 16); rank
  // 16 has received 411 messages from stage 3 and is stuck in a TP all-reduce instead.
  std::vector<int> pp_members = {0, 4, 8, 12, 16};
  const json d12 = dump(12, 20, {collective("all_reduce", "tp", 3, 900), posted(send(2, 3, 4, 16, 412, 100))},
                        json::array({group("pp", 2, 3, pp_members, 0, {0, 0, 0, 0, 412}, {0, 0, 411, 0, 0})}), "timeout", 105);
  const json d16 = dump(16, 20, {collective("all_reduce", "tp", 4, 411), posted(collective("all_reduce", "tp", 4, 412, 101))},
                        json::array({group("pp", 2, 4, pp_members, 0, {0, 0, 0, 0, 0}, {0, 0, 0, 411, 0})}), "asked", 105);
  const HangAnalysis a = analyze_hang({d12, d16});
  REQUIRE(!a.findings.empty());
  CHECK(format_finding(a.findings[0]) ==
        "pp send #412 stage 3 -> 4 (pp group 2) [world ranks 12, 16]: world rank 16 never arrived; it last completed "
        "all_reduce #411 of tp group 4 and is now waiting in all_reduce #412 of tp group 4 (stuck 5.0 s, 1 of 2 ranks "
        "waiting)");
  CHECK(a.world_size == 20);
  CHECK(a.timeout == 5.0);
  CHECK(a.rank_lines[16].find("world rank 16 (host node2, pid 1016): waiting in all_reduce #412 of tp group 4") == 0);
  CHECK(a.rank_lines[3] == "world rank 3: no dump; nobody asked it (it was in no stuck operation's group) or it was "
                           "killed before writing");
}

TEST_CASE("hang report: ranks with no dump are named from the stuck rank's answers", "[parallel][hang]") {
  // dp group 0 = world ranks 0-3; rank 0 timed out in all_reduce #9. Rank 1 answered (it is in
  // a tp all-reduce, 8 dp collectives started) but left no dump; rank 2 never answered; rank 3
  // got past #9 (10 started).
  json d0 = dump(0, 4, {collective("all_reduce", "dp", 0, 8), posted(collective("all_reduce", "dp", 0, 9))},
                 json::array({group("dp", 0, 0, {0, 1, 2, 3}, 9)}), "timeout");
  d0["diagnosis"] = {
      {"findings", json::array()},
      {"peers",
       {{{"world_rank", 1}, {"answered", true}, {"collectives", 8},
         {"waiting", op_json(posted(collective("all_reduce", "tp", 0, 77)))},
         {"last_completed", op_json(collective("all_reduce", "dp", 0, 8))}},
        {{"world_rank", 2}, {"answered", false}},
        {{"world_rank", 3}, {"answered", true}, {"collectives", 10}, {"waiting", nullptr}, {"last_completed", nullptr}}}}};
  const HangAnalysis a = analyze_hang({d0});
  REQUIRE(a.findings.size() == 1);
  CHECK(format_finding(a.findings[0], false) ==
        "all_reduce #9 of dp group 0 [world ranks 0-3]: world rank 1 never arrived; it last completed all_reduce #8 of dp "
        "group 0 and is now waiting in all_reduce #77 of tp group 0; world rank 2 never arrived and gave no answer (busy "
        "outside keel's communication: computing, hung in other code, or dead)");
  CHECK(a.rank_lines[2] == "world rank 2: no dump and no answer to world rank 0: busy outside keel's communication "
                           "(computing, hung in other code) or dead");
}

TEST_CASE("hang report: dumps are read from a run directory, older jobs and broken files are left out",
          "[parallel][hang]") {
  test::TempDir dir("hang-dumps");
  std::filesystem::create_directories(dir / "hang");
  std::ofstream(dir / "hang/hang-rank0.json")
      << dump(0, 2, {posted(collective("barrier", "world", 0, 1))}, json::array({group("world", 0, 0, {0, 1}, 1)}), "timeout", 200).dump();
  std::ofstream(dir / "hang/hang-rank1.json")
      << dump(1, 2, {posted(collective("barrier", "world", 0, 1))}, json::array({group("world", 0, 1, {0, 1}, 1)}), "asked", 50, "old").dump();
  std::ofstream(dir / "hang/hang-rank2.json") << "{ not json";
  const HangDumps d = read_hang_dumps(dir.path.string());
  CHECK(d.dir == dir / "hang");
  REQUIRE(d.dumps.size() == 1);
  CHECK(d.dumps[0]["world_rank"] == 0);
  REQUIRE(d.notes.size() == 2);
  CHECK(d.notes[0].find("hang-rank2.json cannot be read") == 0);
  CHECK(d.notes[1] == "1 dump(s) of an earlier job (not job-1) left out");
  const std::string text = format_hang_analysis(analyze_hang(d.dumps), d);
  CHECK(text.find("hang: barrier #1 of world group 0 [world ranks 0, 1]: world rank 1 never arrived and gave no answer") !=
        std::string::npos);
  CHECK_THROWS_WITH(read_hang_dumps(dir / "nothing"), Catch::Contains("is not a directory"));
}

// ---- wait chains and late ranks: dumps shaped like those of real runs --------------------

namespace {

OpInfo ended(OpInfo o, double end) {  // a completed operation that took until `end`
  o.state = "completed";
  o.end = end;
  return o;
}

// The watchdog's record of asking: which peers answered (the others were silent).
json peers_said(std::initializer_list<std::pair<int, bool>> answered) {
  json peers = json::array();
  for (const auto& [rank, yes] : answered) peers.push_back({{"world_rank", rank}, {"answered", yes}});
  return {{"findings", json::array()}, {"peers", peers}};
}

}  // namespace

TEST_CASE("hang report: a stopped rank that wakes at the abort and answers late is named, not the network",
          "[parallel][hang]") {
  // dp 4 on the world group, KEEL_COMM_TIMEOUT=20. World rank 0 is stopped (kill -STOP) inside
  // all_reduce #299. Ranks 1-3 wait in #300 from t=100, their watchdogs fire at 120 and they dump
  // at 125. The abort sends SIGCONT: rank 0 finishes #299, passes #300 at once (the others are
  // there), posts #301 and answers the dump request: its dump alone looks on time.
  const std::vector<int> world = {0, 1, 2, 3};
  std::vector<json> dumps;
  json d0 = dump(0, 4,
                 {ended(collective("all_reduce", "world", 0, 299, 100.0), 125.0),
                  ended(collective("all_reduce", "world", 0, 300, 125.0), 125.0),
                  posted(collective("all_reduce", "world", 0, 301, 125.0))},
                 json::array({group("world", 0, 0, world, 301)}), "asked", 125.02);
  d0["asked_by"] = 1;
  d0["timeout_s"] = 20.0;
  dumps.push_back(d0);
  for (int r = 1; r < 4; ++r) {
    json d = dump(r, 4, {ended(collective("all_reduce", "world", 0, 299, 99.99), 100.0),
                         posted(collective("all_reduce", "world", 0, 300, 100.0))},
                  json::array({group("world", 0, r, world, 300)}), "timeout", 125.0);
    d["timeout_s"] = 20.0;
    d["diagnosis"] = peers_said({{0, false}});
    dumps.push_back(d);
  }
  const HangAnalysis a = analyze_hang(dumps);
  REQUIRE(a.findings.size() == 2);
  CHECK(format_finding(a.findings[0]) ==
        "all_reduce #300 of world group 0 [world ranks 0-3]: world rank 0 arrived 25.0 s late (after the others' "
        "timeout): it was stalled or slow in all_reduce #299 of world group 0, which took it 25.0 s (stuck 25.0 s, 3 "
        "of 4 ranks waiting)");
  // What it did after waking is a consequence: the others are still in #300, behind it.
  CHECK(format_finding(a.findings[1], false) ==
        "all_reduce #301 of world group 0 [world ranks 0-3]: world ranks 1-3 are behind: still waiting in all_reduce "
        "#300 of world group 0, an earlier operation of this group");
  CHECK(a.rank_lines[0].find("; it reached all_reduce #300 of world group 0 25.0 s late [dumped when world rank 1 "
                             "asked]") != std::string::npos);

  // A rank that arrives after a delay shorter than the timeout was not what the others waited
  // for: the same dumps with rank 0 only 5 s late keep "every rank arrived".
  for (json& d : dumps)
    if (d["world_rank"] == 0) {
      d["ops"][0]["end"] = 105.0;
      d["ops"][1]["start"] = 105.0;
      d["ops"][1]["end"] = 105.0;
    }
  CHECK(format_finding(analyze_hang(dumps).findings.at(0), false) ==
        "all_reduce #300 of world group 0 [world ranks 0-3]: every rank arrived, yet the operation does not complete "
        "(an MPI or network problem, or ranks that disagree on the message size)");
}

TEST_CASE("hang report: a rank stopped outside keel shows up late in the collective it walks into after the abort",
          "[parallel][hang]") {
  // tp 2, pp 2 (tp groups {0, 1} and {2, 3}, pp groups {0, 2} and {1, 3}); world rank 2 is
  // stopped while computing. Stage 0 (ranks 0, 1) waits in its pipeline sendrecv with stage 1,
  // rank 3 in tp all_reduce #5038. After SIGCONT rank 2 posts #5038, 25 s after rank 3, and dumps.
  auto sendrecv = [](int index, int to_world) {
    OpInfo o = send(index, 0, 1, to_world, 421, 100.0);
    o.op = "sendrecv";
    o.recv_peer = 1;
    o.recv_world = to_world;
    o.recv_seq = 419;
    return o;
  };
  std::vector<json> dumps;
  for (int r : {0, 1}) {
    json d = dump(r, 4, {collective("all_reduce", "tp", 0, 3785, 99.9), posted(sendrecv(r, r + 2))},
                  json::array({group("tp", 0, r, {0, 1}, 3785), group("pp", r, 0, {r, r + 2}, 0, {0, 421}, {0, 419})}),
                  "timeout", 125.0);
    d["timeout_s"] = 20.0;
    dumps.push_back(d);
  }
  dumps[0]["diagnosis"] = peers_said({{2, false}});
  json d2 = dump(2, 4, {collective("all_reduce", "tp", 1, 5037, 99.8), posted(collective("all_reduce", "tp", 1, 5038, 125.0))},
                 json::array({group("tp", 1, 0, {2, 3}, 5038), group("pp", 0, 1, {0, 2}, 0, {418, 0}, {420, 0})}), "asked",
                 125.03);
  d2["timeout_s"] = 20.0;
  json d3 = dump(3, 4, {collective("all_reduce", "tp", 1, 5037, 99.8), posted(collective("all_reduce", "tp", 1, 5038, 99.9))},
                 json::array({group("tp", 1, 1, {2, 3}, 5038), group("pp", 1, 1, {1, 3}, 0, {418, 0}, {420, 0})}),
                 "timeout", 125.0);
  d3["timeout_s"] = 20.0;
  d3["diagnosis"] = peers_said({{2, false}});
  dumps.push_back(d2);
  dumps.push_back(d3);
  const HangAnalysis a = analyze_hang(dumps);
  REQUIRE(a.findings.size() == 3);
  CHECK(format_finding(a.findings[0]) ==
        "all_reduce #5038 of tp group 1 [world ranks 2, 3]: world rank 2 arrived 25.1 s late (after the others' "
        "timeout): it was stalled or slow outside keel's collectives (stuck 25.1 s, 1 of 2 ranks waiting)");
  // The pipeline ends wait on the two ranks of that tp group: victims, listed after it.
  CHECK(a.findings[1].op.group == "pp");
  CHECK(a.findings[2].op.group == "pp");
}

TEST_CASE("hang report: the headline follows wait chains to the dead rank, whatever the order of the dumps",
          "[parallel][hang]") {
  // tp 2, pp 2; world rank 2 is killed (kill -9) and leaves no dump. Rank 0 waits in its pipeline
  // send to rank 2, rank 1 in tp all_reduce #2818 for rank 0, rank 3 in tp all_reduce #3750 for
  // rank 2. Each waits for one rank of two; rank 1 has waited longest (by 10 ms), which once put
  // its all-reduce, and rank 0, in the headline.
  json d0 = dump(0, 4, {collective("all_reduce", "tp", 0, 2817, 99.99), posted(send(0, 0, 1, 2, 313, 100.0))},
                 json::array({group("tp", 0, 0, {0, 1}, 2817), group("pp", 0, 0, {0, 2}, 0, {0, 313}, {0, 312})}),
                 "timeout", 125.0);
  d0["diagnosis"] = peers_said({{2, false}});
  json d1 = dump(1, 4, {collective("all_reduce", "tp", 0, 2817, 99.98), ended(send(1, 0, 1, 3, 313, 99.985), 99.99),
                        posted(collective("all_reduce", "tp", 0, 2818, 99.99))},
                 json::array({group("tp", 0, 1, {0, 1}, 2818), group("pp", 1, 0, {1, 3}, 0, {0, 313}, {0, 312})}),
                 "timeout", 125.0);
  json d3 = dump(3, 4, {collective("all_reduce", "tp", 1, 3749, 99.9), posted(collective("all_reduce", "tp", 1, 3750, 100.0))},
                 json::array({group("tp", 1, 1, {2, 3}, 3750)}), "timeout", 125.0);
  d3["diagnosis"] = peers_said({{2, false}});
  const std::string dead_pp =
      "pp send #313 stage 0 -> 1 (pp group 0) [world ranks 0, 2]: world rank 2 never arrived and gave no answer (busy "
      "outside keel's communication: computing, hung in other code, or dead)";
  const std::string dead_tp =
      "all_reduce #3750 of tp group 1 [world ranks 2, 3]: world rank 2 never arrived and gave no answer (busy outside "
      "keel's communication: computing, hung in other code, or dead)";
  const std::string victim =
      "all_reduce #2818 of tp group 0 [world ranks 0, 1]: world rank 0 never arrived; it last completed all_reduce "
      "#2817 of tp group 0 and is now waiting in pp send #313 stage 0 -> 1 (pp group 0)";
  // Two ranks wait on the pipeline send (rank 0 in it, rank 1 through rank 0), one on tp group 1.
  for (const std::vector<json>& dumps : {std::vector<json>{d0, d1, d3}, std::vector<json>{d3, d1, d0},
                                         std::vector<json>{d1, d3, d0}}) {
    const HangAnalysis a = analyze_hang(dumps);
    REQUIRE(a.findings.size() == 3);
    CHECK(format_finding(a.findings[0], false) == dead_pp);
    CHECK(format_finding(a.findings[1], false) == dead_tp);
    CHECK(format_finding(a.findings[2], false) == victim);
  }
}

// dp 2 (world and dp group both ranks 0 and 1): one rank skipped world all_reduce #20 and went on
// to dp all_reduce #17. Each rank waits in an operation the other never called, after the same
// all_gather: nothing in the dumps says which went off the common path. Both were named as the
// rank that skipped, world rank 0 (the innocent one here) in the headline's note.
TEST_CASE("hang report: two ranks that each wait where the other never came are not told apart by a guess",
          "[parallel][hang]") {
  const json groups0 = json::array({group("dp", 0, 0, {0, 1}, 16), group("world", 0, 0, {0, 1}, 20)});
  const json groups1 = json::array({group("dp", 0, 1, {0, 1}, 17), group("world", 0, 1, {0, 1}, 19)});
  json d0 = dump(0, 2, {collective("all_reduce", "world", 0, 19, 99.0), collective("all_gather", "dp", 0, 16, 99.5),
                        posted(collective("all_reduce", "world", 0, 20, 100.0))},
                 groups0, "timeout", 103.0);
  json d1 = dump(1, 2, {collective("all_reduce", "world", 0, 19, 99.0), collective("all_gather", "dp", 0, 16, 99.5),
                        posted(collective("all_reduce", "dp", 0, 17, 100.0))},
                 groups1, "timeout", 103.0);
  const HangAnalysis a = analyze_hang({d0, d1});
  std::string notes;
  for (const auto& n : a.notes) notes += n + "\n";
  INFO(notes);
  CHECK(notes.find("skipped it") == std::string::npos);
  CHECK(notes == "world rank 0 or world rank 1 skipped an operation, and the dumps cannot tell which: after all_gather "
                 "#16 of dp group 0, world rank 1 called all_reduce #17 of dp group 0 and world rank 0 called all_reduce "
                 "#20 of world group 0, and no third rank did either. The code paths that lead to the two calls (the "
                 "ranks' stacks, the step's branches) decide it\n");
  REQUIRE(a.findings.size() == 2);
}

TEST_CASE("hang report: with overlapped reductions, ranks held up in earlier ones are behind, the stopped one is named",
          "[parallel][hang]") {
  // dp 4 with overlap_grad_reduce: reduces to roots 1, 0, 2 in turn (#1147, #1148, #1149), each
  // rank finishing a reduce it only sends to. World rank 3 is stopped inside #1146. Rank 1 (root
  // of #1147) waits for it; rank 0 (root of #1148) waits for rank 1 and 3, rank 2 for all three.
  // At the abort rank 3 wakes, finishes #1146 and posts #1147 20 s late.
  const std::vector<int> dp = {0, 1, 2, 3};
  auto reduce = [](int64_t seq, double start) { return collective("reduce", "dp", 0, seq, start); };
  json d0 = dump(0, 4, {reduce(1146, 99.99), reduce(1147, 100.002), posted(reduce(1148, 100.004))},
                 json::array({group("dp", 0, 0, dp, 1148)}), "timeout", 120.004);
  json d1 = dump(1, 4, {reduce(1146, 99.99), posted(reduce(1147, 100.0))}, json::array({group("dp", 0, 1, dp, 1147)}),
                 "timeout", 120.0);
  d1["diagnosis"] = peers_said({{0, true}, {2, true}, {3, false}});
  json d2 = dump(2, 4, {reduce(1147, 100.001), reduce(1148, 100.003), posted(reduce(1149, 100.005))},
                 json::array({group("dp", 0, 2, dp, 1149)}), "timeout", 120.005);
  json d3 = dump(3, 4, {ended(reduce(1146, 99.99), 120.006), posted(reduce(1147, 120.01))},
                 json::array({group("dp", 0, 3, dp, 1147)}), "asked", 120.03);
  d3["asked_by"] = 1;
  std::vector<json> dumps = {d0, d1, d2, d3};
  for (json& d : dumps) d["timeout_s"] = 15.0;
  const HangAnalysis a = analyze_hang(dumps);
  REQUIRE(a.findings.size() == 3);
  CHECK(format_finding(a.findings[0]) ==
        "reduce #1147 of dp group 0 [world ranks 0-3]: world rank 3 arrived 20.0 s late (after the others' timeout): "
        "it was stalled or slow in reduce #1146 of dp group 0, which took it 20.0 s (stuck 20.0 s, 1 of 4 ranks "
        "waiting)");
  CHECK(format_finding(a.findings[1], false) ==
        "reduce #1148 of dp group 0 [world ranks 0-3]: world ranks 1, 3 are behind: still waiting in reduce #1147 of "
        "dp group 0, an earlier operation of this group");
  CHECK(format_finding(a.findings[2], false) ==
        "reduce #1149 of dp group 0 [world ranks 0-3]: world rank 0 is behind: still waiting in reduce #1148 of dp "
        "group 0, an earlier operation of this group; world ranks 1, 3 are behind: still waiting in reduce #1147 of dp "
        "group 0, an earlier operation of this group");

  // The live report of the root of #1149 (rank 2), before anyone woke: the silent rank first,
  // the ranks held up in earlier reductions after it, as such.
  HangFinding live;
  live.op = posted(reduce(1149, 100.005));
  live.members = dp;
  live.waiting = {2};
  live.stuck_seconds = 15.0;
  MissingRank r0, r1, r3;
  r0.world_rank = 0;
  r0.behind = true;
  r0.waiting_in = posted(reduce(1148, 100.004));
  r0.last_completed = reduce(1147, 100.002);
  r1.world_rank = 1;
  r1.behind = true;
  r1.waiting_in = posted(reduce(1147, 100.0));
  r1.last_completed = reduce(1146, 99.99);
  r3.world_rank = 3;
  r3.answered = false;
  live.missing = {r0, r1, r3};
  CHECK(format_finding(live) ==
        "reduce #1149 of dp group 0 [world ranks 0-3]: world rank 3 never arrived and gave no answer (busy outside "
        "keel's communication: computing, hung in other code, or dead); world rank 0 is behind: still waiting in reduce "
        "#1148 of dp group 0, an earlier operation of this group; world rank 1 is behind: still waiting in reduce #1147 "
        "of dp group 0, an earlier operation of this group (stuck 15.0 s, 1 of 4 ranks waiting)");
}

// ---- BlockingCallWatch: in a child process, since a firing watch ends the process ----------

using keel::test::ChildResult;
using keel::test::run_child;

TEST_CASE("a host call stuck past its timeout is named, and the process ends instead of hanging",
          "[parallel][hang][watch]") {
  const ChildResult stuck = run_child([] {
    const std::string op = "communicator setup", who = "world rank 3, NCCL group tp (nccl rank 1 of 2)";
    BlockingCallWatch watch("ncclCommInitRank", op, who, 0.3);
    std::this_thread::sleep_for(std::chrono::seconds(20));  // a call that never returns
  });
  INFO(stuck.stderr_text);
  CHECK(stuck.exit_code == 1);
  CHECK(stuck.seconds < 10);
  CHECK_THAT(stuck.stderr_text, Catch::Contains("keel hang report: world rank 3, NCCL group tp (nccl rank 1 of 2): "
                                                "ncclCommInitRank for communicator setup has not returned after 0.3 s") &&
                                    Catch::Contains("Ending this process"));
}

TEST_CASE("host calls that return in time never fire the watch, however long the process runs after",
          "[parallel][hang][watch]") {
  const ChildResult fine = run_child([] {
    for (int call = 0; call < 3; ++call) {
      {
        const std::string op = "all_reduce #" + std::to_string(call), who = "world rank 0";
        BlockingCallWatch watch("ncclAllReduce", op, who, 0.3);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // well past the timeout, unwatched
    }
  });
  INFO(fine.stderr_text);
  CHECK(fine.exit_code == 0);
  CHECK(fine.stderr_text.find("hang report") == std::string::npos);
}
