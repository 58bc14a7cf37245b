#include "train/parallel/mpi_comm.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "data/checksum.h"
#include "train/parallel/hang_report.h"

#ifdef KEEL_HAVE_MPI
#include <mpi.h>
#endif

namespace keel::parallel {

double default_comm_timeout() {
  const char* text = std::getenv("KEEL_COMM_TIMEOUT");
  if (!text || !*text) return 600.0;
  char* end = nullptr;
  double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v >= 0) || std::isinf(v))
    throw std::invalid_argument(std::string("KEEL_COMM_TIMEOUT=\"") + text +
                                "\" is not a number of seconds (0 disables the watchdog)");
  return v;
}

CommGroups make_host_comms(const Grid& grid, const MpiRuntime& runtime) {
  if (!runtime.active()) {
    if (grid.world_size() != 1)
      throw std::invalid_argument("parallel grid " + grid.layout() + " needs " + std::to_string(grid.world_size()) +
                                  " ranks, but this process was not started by an MPI launcher: run it under mpirun -np " +
                                  std::to_string(grid.world_size()) + " or srun -n " +
                                  std::to_string(grid.world_size()));
    return make_local_comms();
  }
  if (grid.world_size() != runtime.world_size() || grid.rank() != runtime.world_rank())
    throw std::invalid_argument("parallel grid for rank " + std::to_string(grid.rank()) + " of " +
                                std::to_string(grid.world_size()) + " does not match MPI's rank " +
                                std::to_string(runtime.world_rank()) + " of " + std::to_string(runtime.world_size()));
  // Same order on every rank: each constructor is collective over the world.
  CommGroups g;
  g.world = std::make_unique<MpiComm>(grid, GroupKind::World);
  g.tp = std::make_unique<MpiComm>(grid, GroupKind::TP);
  g.pp = std::make_unique<MpiComm>(grid, GroupKind::PP);
  g.dp = std::make_unique<MpiComm>(grid, GroupKind::DP);
  g.embedding = std::make_unique<MpiComm>(grid, GroupKind::Embedding);
  return g;
}

#ifdef KEEL_HAVE_MPI

bool mpi_built() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kDataTag = 7;     // point-to-point payloads on the group communicator
constexpr int kQueryTag = 1;    // watchdog side channel: "what are you doing?"
constexpr int kReplyTag = 2;    // ... and the answer
constexpr int kDumpTag = 3;     // hang channel (world): "write your hang dump"
constexpr int kDumpAckTag = 4;  // ... "written" (the asker waits for it before the job is aborted)
constexpr int kTextTag = 5;     // world, at start-up: a rank's config for rank 0 (first_rank_differing)
constexpr int64_t kSmallAllReduce = 8192;  // n * size at or below: one all-gather, reduce everywhere
constexpr auto kServeInterval = std::chrono::milliseconds(20);

bool g_runtime_exists = false;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string mpi_error_text(int err) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(err, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::BF16:
    case DType::F16: return MPI_UINT16_T;  // moved as bits; keel does the arithmetic
    case DType::I32: return MPI_INT32_T;
  }
  return MPI_BYTE;
}

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

// An operation on the wire (OpInfo as plain bytes).
struct OpWire {
  int32_t valid = 0;
  char op[16] = {};
  char group[16] = {};
  int32_t group_index = 0, group_rank = 0, send_peer = -1, recv_peer = -1, send_world = -1, recv_world = -1;
  int64_t seq = 0, send_seq = 0, recv_seq = 0, elements = 0;
  char dtype[8] = {};
  char state[12] = {};
  double start = 0, end = 0;
};

void copy_name(char* dst, size_t cap, std::string_view src) {
  const size_t n = std::min(cap - 1, src.size());
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

OpWire to_wire(const OpRecord* r) {
  OpWire w;
  if (!r) return w;
  const OpInfo o = op_info(*r);
  w.valid = 1;
  copy_name(w.op, sizeof w.op, o.op);
  copy_name(w.group, sizeof w.group, o.group);
  w.group_index = o.group_index;
  w.group_rank = o.group_rank;
  w.send_peer = o.send_peer;
  w.recv_peer = o.recv_peer;
  w.send_world = o.send_world;
  w.recv_world = o.recv_world;
  w.seq = o.seq;
  w.send_seq = o.send_seq;
  w.recv_seq = o.recv_seq;
  w.elements = o.elements;
  copy_name(w.dtype, sizeof w.dtype, o.dtype);
  copy_name(w.state, sizeof w.state, o.state);
  w.start = o.start;
  w.end = o.end;
  return w;
}

std::optional<OpInfo> from_wire(const OpWire& w) {
  if (!w.valid) return std::nullopt;
  OpInfo o;
  o.op = std::string(w.op, strnlen(w.op, sizeof w.op));
  o.group = std::string(w.group, strnlen(w.group, sizeof w.group));
  o.group_index = w.group_index;
  o.group_rank = w.group_rank;
  o.send_peer = w.send_peer;
  o.recv_peer = w.recv_peer;
  o.send_world = w.send_world;
  o.recv_world = w.recv_world;
  o.seq = w.seq;
  o.send_seq = w.send_seq;
  o.recv_seq = w.recv_seq;
  o.elements = w.elements;
  o.dtype = std::string(w.dtype, strnlen(w.dtype, sizeof w.dtype));
  o.state = std::string(w.state, strnlen(w.state, sizeof w.state));
  o.start = w.start;
  o.end = w.end;
  return o;
}

// What one rank tells another about itself when the watchdog asks. Plain bytes: every rank
// runs the same binary.
struct PeerReport {
  int64_t collectives = 0;       // collectives started on the asked group
  int64_t sends_to_asker = 0;    // sends posted to the asker on that group
  int64_t recvs_from_asker = 0;  // receives posted from the asker on that group
  int64_t busy_seq = 0;          // number of the collective it waits in (0: none or point to point)
  int32_t busy = 0;              // waiting in some keel operation at all
  char busy_group[16] = {};
  char busy_op[16] = {};
  char busy_text[224] = {};      // "all_reduce #2 on dp (1000 x f32) for 1.0 s"
  OpWire waiting;                // the operation it waits in (hang report wording)
  OpWire last_completed;         // its last completed operation
};

// Process-wide hang channel: a duplicate of MPI_COMM_WORLD on which a rank whose watchdog fired
// asks every other rank to write its dump. Made with the first MpiComm (a collective call on
// every rank), freed with the last.
struct HangChannel {
  MPI_Comm comm = MPI_COMM_NULL;
  int users = 0;
  bool leaked = false;   // a communicator timed out: requests may be pending, leave it to MPI_Abort
  std::string job;       // the same on every rank of this job: tells dumps of two hangs apart
  int world_rank = 0, world_size = 1;
  std::string host;
};
HangChannel g_hang;

}  // namespace

// ---- per-communicator state ----------------------------------------------------------------

struct MpiComm::Impl {
  GroupKind kind{};
  std::string name;
  int group_index = 0;       // which group of its kind (Grid::group_index): "dp group 1"
  std::vector<int> members;  // world ranks by group rank
  int rank = 0, size = 1, world_rank = 0;
  std::string host;
  MPI_Comm comm = MPI_COMM_NULL;  // the collectives
  MPI_Comm side = MPI_COMM_NULL;  // the watchdog's questions and answers
  double timeout = 600;
  int64_t chunk_elements = int64_t{1} << 22;
  int64_t collectives = 0;
  std::vector<int64_t> sends_to, recvs_from;  // per group rank
  bool broken = false;                          // timed out: requests still pending
  std::optional<CollectiveFault> fault;         // KEEL_FAULT_SKIP_COLLECTIVE aimed at this rank and group
  bool fault_fired = false;
  int64_t fault_calls = 0;                      // calls of the fault's op so far (call=N)

  // Reused buffers: steady-state calls allocate nothing.
  std::vector<unsigned char> recv_scratch;
  std::vector<float> acc_scratch;
  std::vector<int> counts, displs, rcounts, rdispls;
  std::vector<const void*> sources;

  // The operation now waiting, for the watchdog and for peers that ask. It is also an entry
  // of the process's OpRecorder ring (groups of more than one rank), finished when the
  // operation returns: completed, or failed when an exception leaves it.
  struct Op {
    const char* name = nullptr;
    int64_t seq = 0;  // collective number on this group (collectives only)
    int send_peer = -1, recv_peer = -1;  // group ranks (point to point only)
    int64_t send_seq = 0, recv_seq = 0;  // number of this send to / recv from that peer
    int64_t elements = 0;
    DType dtype = DType::F32;
    Clock::time_point start;
    uint64_t record = 0;    // OpRecorder id; 0: not recorded
    int uncaught = 0;       // std::uncaught_exceptions() when it began
    bool p2p() const { return send_peer >= 0 || recv_peer >= 0; }
    Op() = default;
    Op(const Op&) = delete;
    Op& operator=(const Op&) = delete;
    ~Op() {
      if (record)
        op_recorder().finish(record, std::uncaught_exceptions() > uncaught ? OpState::Failed : OpState::Completed);
    }
  };

  // Asynchronous operations (post_async), oldest first, until seen finished.
  struct AsyncOp {
    std::unique_ptr<Op> op;  // its record completes when this is destroyed
    std::function<bool()> done;
  };
  std::deque<AsyncOp> async_ops;
  // Pops the finished asynchronous operations at the front (their records complete).
  void retire_async();

  std::string label() const {
    std::string s = name + " [world ranks";
    for (size_t i = 0; i < members.size(); ++i) s += (i ? ", " : " ") + std::to_string(members[i]);
    return s + "]";
  }
  std::string who(int group_rank) const {
    return name + " rank " + std::to_string(group_rank) + " (world " + std::to_string(members[group_rank]) + ")";
  }

  void check(int err, const char* call, const Op& op) const;
  // True when KEEL_FAULT_SKIP_COLLECTIVE says this rank skips this collective: the caller
  // returns at once, as code that never called it would (its count does not advance).
  bool skip_for_fault(const char* op_name);
  // async: run by another transport (no MPI count limit).
  void begin(Op& op, const char* name, int64_t elements, DType dt, int send_peer = -1, int recv_peer = -1,
             bool async = false);
  // n <= 2. statuses: n of them, or nullptr.
  void wait(MPI_Request* reqs, int n, const Op& op, MPI_Status* statuses = nullptr);
  void test(MPI_Request* reqs, int n, const Op& op, MPI_Status* statuses, int* done);
  [[noreturn]] void on_timeout(const Op& op);
  std::string describe(const Op& op) const;  // "all_reduce #3 on group dp [world ranks 1, 3] (...)"
  std::string short_text(const Op& op) const;  // "all_reduce #3 on dp (1000 x f32) for 1.2 s"
  unsigned char* scratch_bytes(size_t bytes) {
    if (recv_scratch.size() < bytes) recv_scratch.resize(bytes);
    return recv_scratch.data();
  }
  float* scratch_floats(int64_t n) {
    if (acc_scratch.size() < static_cast<size_t>(n)) acc_scratch.resize(static_cast<size_t>(n));
    return acc_scratch.data();
  }
  // dst = the group's `size` blocks of n elements, back to back in `blocks` in rank order,
  // reduced in that order (reduce_host): the same bits on whichever rank reduces them.
  void reduce_blocks(void* dst, const unsigned char* blocks, int64_t n, DType dt, ReduceOp rop) {
    for (int i = 0; i < size; ++i) sources[static_cast<size_t>(i)] = blocks + static_cast<size_t>(i * n) * dtype_size(dt);
    reduce_host(dst, sources.data(), size, dt, n, rop, scratch_floats(n));
  }
};

void MpiComm::Impl::retire_async() {
  while (!async_ops.empty() && async_ops.front().done()) async_ops.pop_front();
}

namespace {

// Process-wide: every live communicator (to answer questions on all of them while waiting in
// any one) and the operation this process is waiting in.
std::vector<MpiComm::Impl*> g_comms;
const MpiComm::Impl* g_busy_comm = nullptr;
const MpiComm::Impl::Op* g_busy_op = nullptr;

struct BusyScope {
  BusyScope(const MpiComm::Impl* c, const MpiComm::Impl::Op* op) {
    g_busy_comm = c;
    g_busy_op = op;
  }
  ~BusyScope() {
    g_busy_comm = nullptr;
    g_busy_op = nullptr;
  }
};

const OpRecord* busy_record() { return g_busy_op ? op_recorder().find(g_busy_op->record) : nullptr; }

// Writes <dump dir>/hang-rank<R>.json: this rank's ring, the counters of its groups, the
// operation it waits in, and (from the rank whose watchdog fired) the diagnosis. Written to a
// temporary name and renamed, so a job aborted meanwhile leaves no half file. Returns the path,
// or "" when dumps are off or writing failed (said on stderr: the diagnosis matters more).
std::string write_hang_dump(const std::string& reason, int asked_by, double timeout, const nlohmann::json* diagnosis) {
  const std::string dir = hang_dump_directory();
  if (dir.empty()) return "";
  namespace fs = std::filesystem;
  nlohmann::json groups = nlohmann::json::array();
  for (const MpiComm::Impl* c : g_comms)
    groups.push_back({{"group", c->name},
                      {"index", c->group_index},
                      {"rank", c->rank},
                      {"members", c->members},
                      {"collectives", c->collectives},
                      {"sends_to", c->sends_to},
                      {"recvs_from", c->recvs_from}});
  nlohmann::json ops = nlohmann::json::array();
  for (const OpRecord& r : op_recorder().snapshot()) ops.push_back(op_json(op_info(r)));
  const OpRecord* waiting = busy_record();
  const std::optional<OpRecord> done = op_recorder().last_completed();
  nlohmann::json j = {{"format", "keel-hang-dump"},
                      {"version", 1},
                      {"job", g_hang.job},
                      {"world_rank", g_hang.world_rank},
                      {"world_size", g_hang.world_size},
                      {"host", g_hang.host},
                      {"pid", static_cast<int64_t>(::getpid())},
                      {"reason", reason},
                      {"dumped_at", unix_now()},
                      {"timeout_s", timeout},
                      {"waiting", waiting ? op_json(op_info(*waiting)) : nlohmann::json()},
                      {"last_completed", done ? op_json(op_info(*done)) : nlohmann::json()},
                      {"groups", groups},
                      {"ops", ops}};
  if (asked_by >= 0) j["asked_by"] = asked_by;
  if (diagnosis) j["diagnosis"] = *diagnosis;
  const fs::path path = fs::path(dir) / hang_dump_file_name(g_hang.world_rank);
  const fs::path tmp = path.string() + ".tmp";
  std::error_code ec;
  fs::create_directories(dir, ec);
  {
    std::ofstream out(tmp);
    out << j.dump(1) << '\n';
    out.flush();
    if (!out) ec = std::make_error_code(std::errc::io_error);
  }
  if (!ec) fs::rename(tmp, path, ec);
  if (ec) {
    std::fprintf(stderr, "keel: world rank %d could not write its hang dump %s: %s\n", g_hang.world_rank,
                 path.c_str(), ec.message().c_str());
    return "";
  }
  return path.string();
}

// Answers every pending "what are you doing?" on every communicator, and every request for a
// hang dump. Best effort: failures here must not mask the real problem, so MPI errors are ignored.
void serve_queries() {
  if (g_hang.comm != MPI_COMM_NULL) {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kDumpTag, g_hang.comm, &flag, &st) != MPI_SUCCESS || !flag) break;
      int64_t request[2] = {0, 0};
      if (MPI_Recv(request, 2, MPI_INT64_T, st.MPI_SOURCE, kDumpTag, g_hang.comm, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        break;
      // Written before the answer: the asker aborts the job once everyone has answered. When
      // many ranks time out together they all ask: write once per operation waited in.
      static uint64_t dumped_while_in = 0;
      static int32_t written = 0;
      const uint64_t in = g_busy_op ? g_busy_op->record : 0;
      if (in == 0 || in != dumped_while_in) {
        const double timeout = g_busy_comm ? g_busy_comm->timeout : 0.0;
        written = write_hang_dump("asked", st.MPI_SOURCE, timeout, nullptr).empty() ? 0 : 1;
        dumped_while_in = in;
      }
      MPI_Send(&written, 1, MPI_INT32_T, st.MPI_SOURCE, kDumpAckTag, g_hang.comm);
    }
  }
  for (MpiComm::Impl* c : g_comms) {
    if (c->side == MPI_COMM_NULL) continue;
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, c->side, &flag, &st) != MPI_SUCCESS || !flag) break;
      int64_t query[2] = {0, 0};
      if (MPI_Recv(query, 2, MPI_INT64_T, st.MPI_SOURCE, kQueryTag, c->side, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
      const int asker = st.MPI_SOURCE;
      PeerReport r;
      r.collectives = c->collectives;
      r.sends_to_asker = c->sends_to[static_cast<size_t>(asker)];
      r.recvs_from_asker = c->recvs_from[static_cast<size_t>(asker)];
      if (g_busy_comm && g_busy_op) {
        r.busy = 1;
        r.busy_seq = g_busy_op->p2p() ? 0 : g_busy_op->seq;
        copy_name(r.busy_group, sizeof(r.busy_group), g_busy_comm->name);
        copy_name(r.busy_op, sizeof(r.busy_op), g_busy_op->name);
        copy_name(r.busy_text, sizeof(r.busy_text), g_busy_comm->short_text(*g_busy_op));
      }
      r.waiting = to_wire(busy_record());
      const std::optional<OpRecord> done = op_recorder().last_completed();
      r.last_completed = to_wire(done ? &*done : nullptr);
      MPI_Send(&r, sizeof(r), MPI_BYTE, asker, kReplyTag, c->side);
    }
  }
}

std::string describe_busy(const PeerReport& r) {
  if (!r.busy) return "it is not waiting in any keel operation";
  return "it is waiting in " + std::string(r.busy_text);
}

}  // namespace

void MpiComm::Impl::check(int err, const char* call, const Op& op) const {
  if (err == MPI_SUCCESS) return;
  throw std::runtime_error(std::string(call) + " failed in " + describe(op) + " on world rank " +
                           std::to_string(world_rank) + ": " + mpi_error_text(err));
}

namespace {
std::string op_head(const MpiComm::Impl& c, const MpiComm::Impl::Op& op, bool long_names) {
  auto peer_name = [&](int r) { return long_names ? c.who(r) : "world rank " + std::to_string(c.members[static_cast<size_t>(r)]); };
  std::string s = op.name;
  if (!op.p2p()) return s + " #" + std::to_string(op.seq);
  if (op.send_peer >= 0 && op.recv_peer >= 0)
    return s + " (send #" + std::to_string(op.send_seq) + " to " + peer_name(op.send_peer) + ", recv #" +
           std::to_string(op.recv_seq) + " from " + peer_name(op.recv_peer) + ")";
  if (op.send_peer >= 0) return s + " #" + std::to_string(op.send_seq) + " to " + peer_name(op.send_peer);
  return s + " #" + std::to_string(op.recv_seq) + " from " + peer_name(op.recv_peer);
}
std::string op_size(const MpiComm::Impl::Op& op) {
  return std::to_string(op.elements) + " x " + std::string(dtype_name(op.dtype));
}
bool sizeless(const MpiComm::Impl::Op& op) { return std::strcmp(op.name, "barrier") == 0; }
}  // namespace

std::string MpiComm::Impl::describe(const Op& op) const {
  std::string s = op_head(*this, op, true) + " on group " + label() + " (this is " + name + " rank " +
                  std::to_string(rank) + " of " + std::to_string(size) + ")";
  if (!sizeless(op))
    s += ", " + op_size(op) + " (" + std::to_string(op.elements * static_cast<int64_t>(dtype_size(op.dtype))) +
         " bytes)";
  return s;
}

std::string MpiComm::Impl::short_text(const Op& op) const {
  return op_head(*this, op, false) + " on " + name + (sizeless(op) ? "" : " (" + op_size(op) + ")") + " for " +
         fmt_seconds(seconds_since(op.start));
}

void MpiComm::Impl::begin(Op& op, const char* op_name, int64_t elements, DType dt, int send_peer, int recv_peer,
                          bool async) {
  op.name = op_name;
  op.send_peer = send_peer;
  op.recv_peer = recv_peer;
  op.elements = elements;
  op.dtype = dt;
  op.start = Clock::now();
  if (send_peer >= 0) op.send_seq = ++sends_to[static_cast<size_t>(send_peer)];
  if (recv_peer >= 0) op.recv_seq = ++recvs_from[static_cast<size_t>(recv_peer)];
  if (!op.p2p()) op.seq = ++collectives;
  if (size > 1) {  // a group of one never waits: nothing worth a slot
    OpRecord& r = op_recorder().post(std::chrono::duration_cast<std::chrono::nanoseconds>(op.start.time_since_epoch()).count());
    r.op = op_name;
    r.group = group_name(kind).data();  // a string literal: outlives this communicator
    r.group_index = group_index;
    r.group_rank = rank;
    r.seq = op.p2p() ? 0 : op.seq;
    r.send_peer = send_peer;
    r.recv_peer = recv_peer;
    r.send_world = send_peer >= 0 ? members[static_cast<size_t>(send_peer)] : -1;
    r.recv_world = recv_peer >= 0 ? members[static_cast<size_t>(recv_peer)] : -1;
    r.send_seq = op.send_seq;
    r.recv_seq = op.recv_seq;
    r.elements = elements;
    r.dtype = dt;
    op.record = r.id;
    op.uncaught = std::uncaught_exceptions();
  }
  if (broken)
    throw std::runtime_error(describe(op) + ": the communicator is unusable after an earlier timeout");
  // MPI counts are ints; the tensors that reach host MPI are far below this.
  if (elements > INT_MAX && !async)
    throw std::invalid_argument(describe(op) + ": more than 2^31-1 elements in one host MPI operation");
}

bool MpiComm::Impl::skip_for_fault(const char* op_name) {
  if (!fault || fault_fired || fault->op != op_name) return false;
  ++fault_calls;
  if (fault->seq ? collectives + 1 != fault->seq : fault_calls != fault->call) return false;
  fault_fired = true;
  std::fprintf(stderr, "keel: KEEL_FAULT_SKIP_COLLECTIVE: world rank %d skips %s #%lld of %s group %d (test fault)\n",
               world_rank, op_name, static_cast<long long>(collectives + 1), name.c_str(), group_index);
  std::fflush(stderr);
  return true;
}

// Polls until all requests complete. Spins briefly (latency), then yields and sleeps so that
// oversubscribed ranks leave the cores to the ones still computing. After kServeInterval it
// also answers other ranks' watchdog questions; after `timeout` it reports and throws.
void MpiComm::Impl::wait(MPI_Request* reqs, int n, const Op& op, MPI_Status* statuses) {
  BusyScope busy(this, &op);
  int done = 0;
  for (int spin = 0; spin < 200; ++spin) {
    test(reqs, n, op, statuses, &done);
    if (done) return;
  }
  Clock::time_point last_serve = Clock::now();
  for (;;) {
    test(reqs, n, op, statuses, &done);
    if (done) return;
    const Clock::time_point now = Clock::now();
    if (now - last_serve >= kServeInterval) {
      serve_queries();
      last_serve = now;
    }
    const double waited = std::chrono::duration<double>(now - op.start).count();
    if (timeout > 0 && waited > timeout) on_timeout(op);
    if (waited > 0.002)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    else
      std::this_thread::yield();
  }
}

void MpiComm::Impl::test(MPI_Request* reqs, int n, const Op& op, MPI_Status* statuses, int* done) {
  MPI_Status st[2];
  const int err = MPI_Testall(n, reqs, done, st);
  if (err == MPI_ERR_IN_STATUS) {
    // The real error (e.g. a message longer than the receive buffer) is in the statuses.
    for (int i = 0; i < n; ++i)
      if (st[i].MPI_ERROR != MPI_SUCCESS && st[i].MPI_ERROR != MPI_ERR_PENDING) check(st[i].MPI_ERROR, "MPI_Testall", op);
  }
  check(err, "MPI_Testall", op);
  if (*done && statuses)
    for (int i = 0; i < n; ++i) statuses[i] = st[i];
}

// Asks the group (or the peers of a send/recv) what it is doing, asks every rank to write its
// hang dump, prints the picture, writes this rank's dump, throws.
void MpiComm::Impl::on_timeout(const Op& op) {
  broken = true;
  mark_comm_timed_out();
  g_hang.leaked = true;
  const double waited = seconds_since(op.start);

  // Whom to ask: everyone else in the group, or the peers.
  std::vector<int> asked;
  if (op.p2p()) {
    if (op.send_peer >= 0) asked.push_back(op.send_peer);
    if (op.recv_peer >= 0 && op.recv_peer != op.send_peer) asked.push_back(op.recv_peer);
  } else {
    for (int r = 0; r < size; ++r)
      if (r != rank) asked.push_back(r);
  }
  static int64_t query[2];  // static: a query send still in flight when we give up keeps its buffer
  query[0] = op.seq;
  query[1] = world_rank;
  std::vector<PeerReport> reports(asked.size());
  std::vector<MPI_Request> replies(asked.size(), MPI_REQUEST_NULL);
  std::vector<int> answered(asked.size(), 0);
  for (size_t i = 0; i < asked.size(); ++i) {
    MPI_Request send_req;
    if (MPI_Isend(query, 2, MPI_INT64_T, asked[i], kQueryTag, side, &send_req) == MPI_SUCCESS)
      MPI_Request_free(&send_req);
    MPI_Irecv(&reports[i], sizeof(PeerReport), MPI_BYTE, asked[i], kReplyTag, side, &replies[i]);
  }
  // Every other rank of the job: write your dump (those waiting in keel answer; the others cannot).
  static int64_t dump_request[2];
  dump_request[0] = world_rank;
  std::vector<int32_t> acks;
  std::vector<MPI_Request> ack_reqs;
  if (!hang_dump_directory().empty() && g_hang.comm != MPI_COMM_NULL) {
    acks.assign(static_cast<size_t>(g_hang.world_size), 0);
    ack_reqs.assign(acks.size(), MPI_REQUEST_NULL);
    for (int r = 0; r < g_hang.world_size; ++r) {
      if (r == world_rank) continue;
      MPI_Request send_req;
      if (MPI_Isend(dump_request, 2, MPI_INT64_T, r, kDumpTag, g_hang.comm, &send_req) == MPI_SUCCESS)
        MPI_Request_free(&send_req);
      MPI_Irecv(&acks[static_cast<size_t>(r)], 1, MPI_INT32_T, r, kDumpAckTag, g_hang.comm,
                &ack_reqs[static_cast<size_t>(r)]);
    }
  }
  // Wait a while for answers, answering questions meanwhile (the others may be asking us).
  const double answer_wait = std::clamp(timeout / 2, 0.2, 5.0);
  const Clock::time_point ask_start = Clock::now();
  size_t n_answered = 0;
  for (;;) {
    for (size_t i = 0; i < asked.size(); ++i) {
      if (answered[i]) continue;
      int flag = 0;
      MPI_Test(&replies[i], &flag, MPI_STATUS_IGNORE);
      if (flag) answered[i] = 1, ++n_answered;
    }
    bool acks_done = true;
    for (MPI_Request& r : ack_reqs) {
      if (r == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Test(&r, &flag, MPI_STATUS_IGNORE);  // sets r to MPI_REQUEST_NULL when done
      if (!flag) acks_done = false;
    }
    if ((n_answered == asked.size() && acks_done) || seconds_since(ask_start) >= answer_wait) break;
    serve_queries();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (size_t i = 0; i < asked.size(); ++i) {
    if (answered[i]) continue;
    MPI_Cancel(&replies[i]);
    MPI_Wait(&replies[i], MPI_STATUS_IGNORE);
  }
  for (MPI_Request& r : ack_reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
  }

  // The finding, in the words keel doctor hang uses for the dumps.
  HangFinding finding;
  if (const OpRecord* rec = op_recorder().find(op.record)) finding.op = op_info(*rec);
  finding.stuck_seconds = waited;
  finding.waiting.push_back(world_rank);
  if (op.p2p()) {
    finding.members.push_back(world_rank);
    for (int peer : asked) finding.members.push_back(members[static_cast<size_t>(peer)]);
  } else {
    finding.members = members;
  }
  nlohmann::json peers = nlohmann::json::array();

  std::string msg = "keel comm watchdog: world rank " + std::to_string(world_rank) + " (host " + host + ") timed out after " +
                    fmt_seconds(waited) + " in " + describe(op) + "\n";
  std::vector<int> missing, held_up;
  for (size_t i = 0; i < asked.size(); ++i) {
    const int peer = asked[i];
    const int peer_world = members[static_cast<size_t>(peer)];
    const PeerReport& r = reports[i];
    MissingRank miss;
    miss.world_rank = peer_world;
    msg += "  " + who(peer) + ": ";
    if (!answered[i]) {
      msg += "NO ANSWER within " + fmt_seconds(answer_wait) +
             " (busy outside keel's communication: computing, hung in other code, or dead)\n";
      missing.push_back(peer_world);
      miss.answered = false;
      finding.missing.push_back(miss);
      peers.push_back({{"world_rank", peer_world}, {"answered", false}});
      continue;
    }
    miss.last_completed = from_wire(r.last_completed);
    miss.waiting_in = from_wire(r.waiting);
    peers.push_back({{"world_rank", peer_world},
                     {"answered", true},
                     {"collectives", r.collectives},
                     {"sends_to_asker", r.sends_to_asker},
                     {"recvs_from_asker", r.recvs_from_asker},
                     {"waiting", miss.waiting_in ? op_json(*miss.waiting_in) : nlohmann::json()},
                     {"last_completed", miss.last_completed ? op_json(*miss.last_completed) : nlohmann::json()}});
    const std::string busy = describe_busy(r);
    if (op.p2p()) {
      // Did the peer post the operation that matches ours?
      std::string verdict;
      bool behind = false;
      if (peer == op.send_peer && r.recvs_from_asker < op.send_seq) {
        verdict += "NOT ARRIVED: has posted " + std::to_string(r.recvs_from_asker) +
                   " recvs from this rank (this is send #" + std::to_string(op.send_seq) + ")";
        behind = true;
      }
      if (peer == op.recv_peer && r.sends_to_asker < op.recv_seq) {
        verdict += std::string(behind ? "; " : "") + "NOT ARRIVED: has posted " + std::to_string(r.sends_to_asker) +
                   " sends to this rank (this is recv #" + std::to_string(op.recv_seq) + ")";
        behind = true;
      }
      if (!behind) verdict = "has posted the matching operation";
      msg += verdict + "; " + busy + "\n";
      if (behind) {
        missing.push_back(peer_world);
        finding.missing.push_back(miss);
      }
      continue;
    }
    const bool same_point = r.busy && name == r.busy_group && r.busy_seq == op.seq;
    // With overlapped reductions several collectives of a group are in flight: a member still
    // waiting in an earlier one is held up there (by whoever that one waits for), not missing.
    const bool in_earlier = r.busy && name == r.busy_group && r.busy_seq > 0 && r.busy_seq < op.seq;
    if (r.collectives < op.seq && in_earlier) {
      msg += "BEHIND: has started " + std::to_string(r.collectives) + " collectives on " + name + " (this is #" +
             std::to_string(op.seq) + ") and is held up in an earlier one; " + busy + "\n";
      held_up.push_back(peer_world);
      miss.behind = true;
      finding.missing.push_back(miss);
    } else if (r.collectives < op.seq) {
      msg += "NOT ARRIVED: has started " + std::to_string(r.collectives) + " collectives on " + name +
             " (this is #" + std::to_string(op.seq) + "); " + busy + "\n";
      missing.push_back(peer_world);
      finding.missing.push_back(miss);
    } else if (same_point && std::strcmp(r.busy_op, op.name) != 0) {
      msg += "MISMATCH: is in a different collective at this point; " + busy + "\n";
      missing.push_back(peer_world);
      miss.mismatch = true;
      finding.missing.push_back(miss);
    } else if (same_point) {
      msg += "arrived (waiting too)\n";
      finding.waiting.push_back(peer_world);
    } else {
      msg += "got past #" + std::to_string(op.seq) + " (has started " + std::to_string(r.collectives) +
             " collectives on " + name + "); " + busy + "\n";
    }
  }
  if (!missing.empty()) {
    msg += "  not arrived: world rank" + std::string(missing.size() > 1 ? "s" : "");
    for (size_t i = 0; i < missing.size(); ++i) msg += (i ? ", " : " ") + std::to_string(missing[i]);
    msg += "\n";
  }
  if (!held_up.empty()) {
    msg += "  behind (held up in earlier collectives of " + name + ", not missing): world rank" +
           std::string(held_up.size() > 1 ? "s" : "");
    for (size_t i = 0; i < held_up.size(); ++i) msg += (i ? ", " : " ") + std::to_string(held_up[i]);
    msg += "\n";
  }
  std::sort(finding.waiting.begin(), finding.waiting.end());
  const std::string report = format_finding(finding);
  msg += "keel hang report: " + report + "\n";
  nlohmann::json diagnosis = {{"findings", {report}}, {"peers", peers}};
  diagnosis["text"] = msg;
  const std::string dump = write_hang_dump("timeout", -1, timeout, &diagnosis);
  if (!dump.empty()) {
    int written = 1;
    for (size_t r = 0; r < acks.size(); ++r)
      if (static_cast<int>(r) != world_rank) written += acks[r] ? 1 : 0;
    msg += "keel hang dumps: " + std::to_string(written) + " of " + std::to_string(g_hang.world_size) +
           " ranks wrote theirs to " + hang_dump_directory() +
           (written < g_hang.world_size
                ? " (the others did not answer in time: busy outside keel, or dead; one that resumes later may "
                  "still add its own)"
                : "") +
           "; for the whole picture run: keel doctor hang " + hang_dump_directory() + "\n";
  }
  msg += "  (timeout " + fmt_seconds(timeout) +
         ", KEEL_COMM_TIMEOUT. A rank that has not arrived is running different code: a skipped or extra "
         "collective, an exception, or a very slow step.)";
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  throw CommTimeout(msg);
}

// ---- MpiComm -------------------------------------------------------------------------------

MpiComm::MpiComm(const Grid& grid, GroupKind kind) : impl_(std::make_unique<Impl>()) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw std::logic_error("MpiComm(" + std::string(group_name(kind)) +
                           "): MPI is not running; create an MpiRuntime first and launch under mpirun/srun");
  Impl& m = *impl_;
  m.kind = kind;
  m.name = group_name(kind);
  m.members = grid.members(kind);
  m.size = static_cast<int>(m.members.size());
  m.rank = static_cast<int>(std::find(m.members.begin(), m.members.end(), grid.rank()) - m.members.begin());
  m.group_index = grid.group_index(kind);
  m.timeout = default_comm_timeout();
  m.host = LaunchInfo::from_environment().host;
  if (const char* fault = std::getenv("KEEL_FAULT_SKIP_COLLECTIVE")) {
    std::optional<CollectiveFault> f = parse_collective_fault(fault);
    if (f && f->world_rank == grid.rank() && f->group == m.name) m.fault = f;
  }
  m.sends_to.assign(static_cast<size_t>(m.size), 0);
  m.recvs_from.assign(static_cast<size_t>(m.size), 0);
  m.counts.resize(static_cast<size_t>(m.size));
  m.displs.resize(static_cast<size_t>(m.size));
  m.rcounts.resize(static_cast<size_t>(m.size));
  m.rdispls.resize(static_cast<size_t>(m.size));
  m.sources.resize(static_cast<size_t>(m.size));

  auto fail = [&](const char* call, int err) {
    throw std::runtime_error(std::string(call) + " failed creating the " + m.name + " communicator on world rank " +
                             std::to_string(grid.rank()) + ": " + mpi_error_text(err));
  };
  int world_rank = 0, world_size = 0;
  int err = MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  if (err == MPI_SUCCESS) err = MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  if (err != MPI_SUCCESS) fail("MPI_Comm_rank/size", err);
  m.world_rank = world_rank;
  if (world_size != grid.world_size() || world_rank != grid.rank())
    throw std::invalid_argument("MpiComm(" + m.name + "): grid is for rank " + std::to_string(grid.rank()) + " of " +
                                std::to_string(grid.world_size()) + ", MPI says rank " + std::to_string(world_rank) +
                                " of " + std::to_string(world_size));
  // Groups are disjoint, so the lowest member names a group; the key orders ranks as the grid does.
  err = MPI_Comm_split(MPI_COMM_WORLD, m.members.front(), m.rank, &m.comm);
  if (err != MPI_SUCCESS) fail("MPI_Comm_split", err);
  err = MPI_Comm_set_errhandler(m.comm, MPI_ERRORS_RETURN);
  if (err != MPI_SUCCESS) fail("MPI_Comm_set_errhandler", err);
  err = MPI_Comm_dup(m.comm, &m.side);
  if (err != MPI_SUCCESS) fail("MPI_Comm_dup", err);
  int r = -1, s = -1;
  err = MPI_Comm_rank(m.comm, &r);
  if (err == MPI_SUCCESS) err = MPI_Comm_size(m.comm, &s);
  if (err != MPI_SUCCESS) fail("MPI_Comm_rank/size", err);
  if (r != m.rank || s != m.size)
    throw std::logic_error("MpiComm(" + m.name + "): MPI made rank " + std::to_string(r) + " of " + std::to_string(s) +
                           ", the grid says " + std::to_string(m.rank) + " of " + std::to_string(m.size));
  if (g_hang.users == 0) {
    // Collective like the rest of this constructor: every rank makes its first MpiComm together.
    MPI_Comm hang = MPI_COMM_NULL;
    err = MPI_Comm_dup(MPI_COMM_WORLD, &hang);
    if (err != MPI_SUCCESS) fail("MPI_Comm_dup (hang channel)", err);
    if (g_hang.job.empty()) {
      // World rank 0's clock and pid name the job, the same on every rank.
      int64_t id[2] = {static_cast<int64_t>(unix_now() * 1e3), static_cast<int64_t>(::getpid())};
      err = MPI_Bcast(id, 2, MPI_INT64_T, 0, hang);
      if (err != MPI_SUCCESS) fail("MPI_Bcast (hang channel)", err);
      char text[48];
      std::snprintf(text, sizeof text, "%llx-%llx", static_cast<unsigned long long>(id[0]),
                    static_cast<unsigned long long>(id[1]));
      g_hang.job = text;
    }
    g_hang.comm = hang;
    g_hang.world_rank = world_rank;
    g_hang.world_size = world_size;
    g_hang.host = m.host;
  }
  ++g_hang.users;
  g_comms.push_back(impl_.get());
}

MpiComm::~MpiComm() {
  g_comms.erase(std::remove(g_comms.begin(), g_comms.end(), impl_.get()), g_comms.end());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (--g_hang.users == 0 && !finalized && !g_hang.leaked && g_hang.comm != MPI_COMM_NULL) MPI_Comm_free(&g_hang.comm);
  if (g_hang.users == 0) g_hang.comm = MPI_COMM_NULL;
  // After a timeout requests are still pending on these communicators: leave them to MPI_Abort.
  if (finalized || impl_->broken) return;
  if (impl_->side != MPI_COMM_NULL) MPI_Comm_free(&impl_->side);
  if (impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
}

int MpiComm::rank() const { return impl_->rank; }
int MpiComm::size() const { return impl_->size; }
std::string_view MpiComm::name() const { return impl_->name; }
void MpiComm::set_timeout(double seconds) {
  if (!(seconds >= 0)) throw std::invalid_argument("MpiComm::set_timeout: seconds must be >= 0 (0 disables)");
  impl_->timeout = seconds;
}
double MpiComm::timeout() const { return impl_->timeout; }
void MpiComm::set_chunk_elements(int64_t n) { impl_->chunk_elements = std::max<int64_t>(1, n); }
int64_t MpiComm::collective_calls() const { return impl_->collectives; }
const std::vector<int>& MpiComm::members() const { return impl_->members; }

bool MpiComm::post_async(const char* op_name, int64_t elements, DType dt, int send_peer, int recv_peer,
                         std::function<bool()> done) {
  Impl& m = *impl_;
  if (m.skip_for_fault(op_name)) return false;
  if (m.size == 1) return true;  // a group of one never waits: nothing to keep
  auto op = std::make_unique<Impl::Op>();
  m.begin(*op, op_name, elements, dt, send_peer, recv_peer, /*async=*/true);
  m.async_ops.push_back({std::move(op), std::move(done)});
  return true;
}

void poll_async_ops() {
  MpiComm::Impl* oldest_comm = nullptr;
  const MpiComm::Impl::Op* oldest = nullptr;
  for (MpiComm::Impl* c : g_comms) {
    c->retire_async();
    if (c->async_ops.empty()) continue;
    const MpiComm::Impl::Op& op = *c->async_ops.front().op;
    if (!oldest || op.start < oldest->start) oldest = &op, oldest_comm = c;
  }
  // Answer questions as a rank waiting in `oldest` (or in nothing of keel's: computing).
  static Clock::time_point last_serve{};
  const Clock::time_point now = Clock::now();
  if (now - last_serve >= kServeInterval) {
    BusyScope busy(oldest_comm, oldest);
    serve_queries();
    last_serve = now;
  }
  if (oldest && oldest_comm->timeout > 0 && seconds_since(oldest->start) > oldest_comm->timeout) {
    BusyScope busy(oldest_comm, oldest);
    oldest_comm->on_timeout(*oldest);
  }
}

bool async_ops_pending() {
  for (MpiComm::Impl* c : g_comms)
    if (!c->async_ops.empty()) return true;
  return false;
}

void MpiComm::all_reduce(const Tensor& t, ReduceOp rop) {
  check::reduction(*this, "all_reduce", t);
  Impl& m = *impl_;
  if (m.skip_for_fault("all_reduce")) return;
  Impl::Op op;
  m.begin(op, "all_reduce", t.numel(), t.dtype);
  const int64_t n = t.numel();
  if (m.size == 1 || n == 0) return;
  const MPI_Datatype type = mpi_type(t.dtype);
  const size_t esize = dtype_size(t.dtype);
  auto* data = static_cast<unsigned char*>(t.data);

  if (n * m.size <= kSmallAllReduce) {
    // Small (norms, flags, losses): one all-gather, then every rank reduces all contributions in
    // rank order with the same code, so every rank computes the same bits. One round trip.
    unsigned char* all = m.scratch_bytes(static_cast<size_t>(n * m.size) * esize);
    MPI_Request req;
    m.check(MPI_Iallgather(data, static_cast<int>(n), type, all, static_cast<int>(n), type, m.comm, &req),
            "MPI_Iallgather", op);
    m.wait(&req, 1, op);
    m.reduce_blocks(data, all, n, t.dtype, rop);
    return;
  }

  // Large: per chunk, a reduce-scatter (each rank receives its block from everyone and reduces
  // it in rank order) then an all-gather of the reduced blocks into place.
  const int p = m.size;
  for (int64_t base = 0; base < n; base += m.chunk_elements) {
    const int64_t len = std::min(m.chunk_elements, n - base);
    const int64_t q = len / p, extra = len % p;
    for (int j = 0; j < p; ++j) {
      m.counts[static_cast<size_t>(j)] = static_cast<int>(q + (j < extra ? 1 : 0));
      m.displs[static_cast<size_t>(j)] = static_cast<int>(base + j * q + std::min<int64_t>(j, extra));
    }
    const int mine = m.counts[static_cast<size_t>(m.rank)];
    for (int i = 0; i < p; ++i) {
      m.rcounts[static_cast<size_t>(i)] = mine;
      m.rdispls[static_cast<size_t>(i)] = i * mine;
    }
    unsigned char* blocks = m.scratch_bytes(static_cast<size_t>(mine) * p * esize);
    MPI_Request req;
    m.check(MPI_Ialltoallv(data, m.counts.data(), m.displs.data(), type, blocks, m.rcounts.data(), m.rdispls.data(),
                           type, m.comm, &req),
            "MPI_Ialltoallv", op);
    m.wait(&req, 1, op);
    m.reduce_blocks(data + static_cast<size_t>(m.displs[static_cast<size_t>(m.rank)]) * esize, blocks, mine, t.dtype, rop);
    m.check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, m.counts.data(), m.displs.data(), type, m.comm,
                            &req),
            "MPI_Iallgatherv", op);
    m.wait(&req, 1, op);
  }
}

void MpiComm::reduce_scatter(const Tensor& out, const Tensor& in) {
  check::reduce_scatter(*this, out, in);
  Impl& m = *impl_;
  if (m.skip_for_fault("reduce_scatter")) return;
  Impl::Op op;
  m.begin(op, "reduce_scatter", in.numel(), in.dtype);
  const int64_t n = out.numel();
  if (n == 0) return;
  if (m.size == 1) {
    if (out.data != in.data) std::memmove(out.data, in.data, out.bytes());
    return;
  }
  const MPI_Datatype type = mpi_type(in.dtype);
  const size_t esize = dtype_size(in.dtype);
  const int p = m.size;
  const int64_t chunk = std::max<int64_t>(1, m.chunk_elements / p);
  for (int64_t off = 0; off < n; off += chunk) {
    const int len = static_cast<int>(std::min(chunk, n - off));
    for (int j = 0; j < p; ++j) {
      m.counts[static_cast<size_t>(j)] = len;
      m.displs[static_cast<size_t>(j)] = static_cast<int>(j * n + off);
      m.rcounts[static_cast<size_t>(j)] = len;
      m.rdispls[static_cast<size_t>(j)] = j * len;
    }
    unsigned char* blocks = m.scratch_bytes(static_cast<size_t>(len) * p * esize);
    MPI_Request req;
    m.check(MPI_Ialltoallv(in.data, m.counts.data(), m.displs.data(), type, blocks, m.rcounts.data(),
                           m.rdispls.data(), type, m.comm, &req),
            "MPI_Ialltoallv", op);
    m.wait(&req, 1, op);
    m.reduce_blocks(static_cast<unsigned char*>(out.data) + static_cast<size_t>(off) * esize, blocks, len, in.dtype,
                    ReduceOp::Sum);
  }
}

// Per chunk, every rank's elements are gathered on the root, which reduces them in rank order
// with reduce_scatter's arithmetic: an element reduced here has the same bits as the same
// element of a reduce_scatter whose block the root owns.
void MpiComm::reduce(const Tensor& t, int root) {
  check::reduce(*this, t, root);
  Impl& m = *impl_;
  if (m.skip_for_fault("reduce")) return;
  Impl::Op op;
  m.begin(op, "reduce", t.numel(), t.dtype);
  const int64_t n = t.numel();
  if (n == 0 || m.size == 1) return;
  const MPI_Datatype type = mpi_type(t.dtype);
  const size_t esize = dtype_size(t.dtype);
  const int p = m.size;
  const bool is_root = m.rank == root;
  auto* data = static_cast<unsigned char*>(t.data);
  const int64_t chunk = std::max<int64_t>(1, m.chunk_elements / p);
  for (int64_t off = 0; off < n; off += chunk) {
    const int len = static_cast<int>(std::min(chunk, n - off));
    unsigned char* blocks = is_root ? m.scratch_bytes(static_cast<size_t>(len) * p * esize) : nullptr;
    MPI_Request req;
    m.check(MPI_Igather(data + static_cast<size_t>(off) * esize, len, type, blocks, len, type, root, m.comm, &req),
            "MPI_Igather", op);
    m.wait(&req, 1, op);
    if (!is_root) continue;
    m.reduce_blocks(data + static_cast<size_t>(off) * esize, blocks, len, t.dtype, ReduceOp::Sum);
  }
}

void MpiComm::all_gather(const Tensor& out, const Tensor& in) {
  check::all_gather(*this, out, in);
  Impl& m = *impl_;
  if (m.skip_for_fault("all_gather")) return;
  Impl::Op op;
  m.begin(op, "all_gather", out.numel(), in.dtype);
  const int64_t n = in.numel();
  if (n == 0) return;
  auto* own = static_cast<unsigned char*>(out.data) + static_cast<size_t>(m.rank) * in.bytes();
  if (m.size == 1) {
    if (in.data != own) std::memmove(own, in.data, in.bytes());
    return;
  }
  const MPI_Datatype type = mpi_type(in.dtype);
  const void* send = in.data == own ? MPI_IN_PLACE : in.data;
  MPI_Request req;
  m.check(MPI_Iallgather(send, static_cast<int>(n), type, out.data, static_cast<int>(n), type, m.comm, &req),
          "MPI_Iallgather", op);
  m.wait(&req, 1, op);
}

void MpiComm::broadcast(const Tensor& t, int root) {
  check::broadcast(*this, t, root);
  Impl& m = *impl_;
  if (m.skip_for_fault("broadcast")) return;
  Impl::Op op;
  m.begin(op, "broadcast", t.numel(), t.dtype);
  if (m.size == 1 || t.numel() == 0) return;
  MPI_Request req;
  m.check(MPI_Ibcast(t.data, static_cast<int>(t.numel()), mpi_type(t.dtype), root, m.comm, &req), "MPI_Ibcast", op);
  m.wait(&req, 1, op);
}

namespace {

void check_received(const MpiComm::Impl& m, const MPI_Status& st, const Tensor& t, const MpiComm::Impl::Op& op) {
  int got = 0;
  MPI_Get_count(&st, mpi_type(t.dtype), &got);
  if (got != t.numel())
    throw std::runtime_error(m.describe(op) + ": received " + std::to_string(got) + " elements, expected " +
                             std::to_string(t.numel()) + " (the sender's tensor has another shape)");
}

}  // namespace

void MpiComm::send(const Tensor& t, int peer) {
  check::point_to_point(*this, "send", t, peer);
  Impl& m = *impl_;
  Impl::Op op;
  m.begin(op, "send", t.numel(), t.dtype, peer, -1);
  MPI_Request req;
  m.check(MPI_Isend(t.data, static_cast<int>(t.numel()), mpi_type(t.dtype), peer, kDataTag, m.comm, &req),
          "MPI_Isend", op);
  m.wait(&req, 1, op);
}

void MpiComm::recv(const Tensor& t, int peer) {
  check::point_to_point(*this, "recv", t, peer);
  Impl& m = *impl_;
  Impl::Op op;
  m.begin(op, "recv", t.numel(), t.dtype, -1, peer);
  MPI_Request req;
  m.check(MPI_Irecv(t.data, static_cast<int>(t.numel()), mpi_type(t.dtype), peer, kDataTag, m.comm, &req),
          "MPI_Irecv", op);
  MPI_Status st;
  m.wait(&req, 1, op, &st);
  check_received(m, st, t, op);  // a longer message fails in wait (truncation); a shorter one here
}

void MpiComm::sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) {
  check::point_to_point(*this, "send", send_t, send_peer);
  check::point_to_point(*this, "recv", recv_t, recv_peer);
  Impl& m = *impl_;
  Impl::Op op;
  m.begin(op, "sendrecv", send_t.numel(), send_t.dtype, send_peer, recv_peer);
  MPI_Request reqs[2];
  m.check(MPI_Irecv(recv_t.data, static_cast<int>(recv_t.numel()), mpi_type(recv_t.dtype), recv_peer, kDataTag,
                    m.comm, &reqs[0]),
          "MPI_Irecv", op);
  m.check(MPI_Isend(send_t.data, static_cast<int>(send_t.numel()), mpi_type(send_t.dtype), send_peer, kDataTag,
                    m.comm, &reqs[1]),
          "MPI_Isend", op);
  MPI_Status st[2];
  m.wait(reqs, 2, op, st);
  check_received(m, st[0], recv_t, op);
}

void MpiComm::barrier() {
  Impl& m = *impl_;
  if (m.skip_for_fault("barrier")) return;
  Impl::Op op;
  m.begin(op, "barrier", 0, DType::F32);
  if (m.size == 1) return;
  MPI_Request req;
  m.check(MPI_Ibarrier(m.comm, &req), "MPI_Ibarrier", op);
  m.wait(&req, 1, op);
}

// ---- runtime ---------------------------------------------------------------------------------

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  if (g_runtime_exists) throw std::logic_error("MpiRuntime: only one per process");
  launch_ = LaunchInfo::from_environment();
  if (!launch_.launched()) {
    g_runtime_exists = true;
    return;  // a plain process: a world of one, MPI untouched
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // FUNNELED: OpenMP threads compute, only the main thread talks to MPI.
    const int init_err = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    if (init_err != MPI_SUCCESS) throw std::runtime_error("MPI_Init_thread failed: " + mpi_error_text(init_err));
    owns_mpi_ = true;
  }
  // Errors come back as codes that keel checks and reports with context, instead of MPI's
  // default of aborting with a bare message.
  int err = MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  if (err == MPI_SUCCESS) err = MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (err == MPI_SUCCESS) err = MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (err != MPI_SUCCESS) throw std::runtime_error("MPI_COMM_WORLD rank/size: " + mpi_error_text(err));
  if (size != launch_.world_size || rank != launch_.world_rank) {
    const std::string msg = "the launcher says rank " + std::to_string(launch_.world_rank) + " of " +
                            std::to_string(launch_.world_size) + " (" + launch_.rank_variable + "), MPI says rank " +
                            std::to_string(rank) + " of " + std::to_string(size) +
                            ": start keel with mpirun/srun (not inside a batch script directly), and with the MPI "
                            "keel was built against";
    if (owns_mpi_) MPI_Finalize();
    throw std::runtime_error(msg);
  }
  active_ = true;
  g_runtime_exists = true;
}

MpiRuntime::~MpiRuntime() {
  g_runtime_exists = false;
  if (!owns_mpi_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Finalize waits for the other ranks; after a timeout, or with an error on its way out of this
  // rank, they are not coming: take the job down instead of hanging.
  if (comm_timed_out() || std::uncaught_exceptions() > 0) abort(1);
  MPI_Finalize();
}

int MpiRuntime::first_rank_differing(const std::string& text, std::string* differing_text) const {
  if (!active_ || launch_.world_size <= 1) return -1;
  const uint32_t mine = data::crc32c(0, text.data(), text.size());
  std::vector<uint32_t> all(static_cast<size_t>(launch_.world_size));
  const int err = MPI_Allgather(&mine, 1, MPI_UINT32_T, all.data(), 1, MPI_UINT32_T, MPI_COMM_WORLD);
  if (err != MPI_SUCCESS) throw std::runtime_error("MPI_Allgather (comparing the ranks' configs): " + mpi_error_text(err));
  const auto differs = std::find_if(all.begin(), all.end(), [&](uint32_t h) { return h != all[0]; });
  if (differs == all.end()) return -1;
  const int r = static_cast<int>(differs - all.begin());
  if (launch_.world_rank == r) {
    const int64_t n = static_cast<int64_t>(text.size());
    MPI_Send(&n, 1, MPI_INT64_T, 0, kTextTag, MPI_COMM_WORLD);
    MPI_Send(text.data(), static_cast<int>(n), MPI_CHAR, 0, kTextTag, MPI_COMM_WORLD);
  } else if (launch_.world_rank == 0 && differing_text) {
    int64_t n = 0;
    MPI_Recv(&n, 1, MPI_INT64_T, r, kTextTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    differing_text->assign(static_cast<size_t>(n), '\0');
    MPI_Recv(differing_text->data(), static_cast<int>(n), MPI_CHAR, r, kTextTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  return r;
}

void MpiRuntime::broadcast_text(std::string* text) const {
  if (!active_ || launch_.world_size <= 1) return;
  int64_t n = static_cast<int64_t>(text->size());
  int err = MPI_Bcast(&n, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  if (err == MPI_SUCCESS) {
    text->resize(static_cast<size_t>(n));
    err = MPI_Bcast(text->data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
  }
  if (err != MPI_SUCCESS) throw std::runtime_error("MPI_Bcast (rank 0's text to every rank): " + mpi_error_text(err));
}

void MpiRuntime::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

#else  // ---- built without MPI: a world of one ----------------------------------------------

bool mpi_built() { return false; }

struct MpiComm::Impl {};

MpiRuntime::MpiRuntime(int*, char***) {
  launch_ = LaunchInfo::from_environment();
  if (launch_.world_size > 1)
    throw std::runtime_error("the launcher started " + std::to_string(launch_.world_size) + " ranks (" +
                             launch_.rank_variable + "), but this keel was built without MPI: install an MPI "
                             "(Debian: libopenmpi-dev) and rebuild with -DKEEL_MPI=ON");
}
MpiRuntime::~MpiRuntime() = default;
int MpiRuntime::first_rank_differing(const std::string&, std::string*) const { return -1; }
void MpiRuntime::broadcast_text(std::string*) const {}
void MpiRuntime::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::exit(code);
}

[[noreturn]] static void no_mpi() { throw std::logic_error("MpiComm: keel was built without MPI"); }
MpiComm::MpiComm(const Grid&, GroupKind) { no_mpi(); }
MpiComm::~MpiComm() = default;
int MpiComm::rank() const { return 0; }
int MpiComm::size() const { return 1; }
std::string_view MpiComm::name() const { return "none"; }
void MpiComm::all_reduce(const Tensor&, ReduceOp) { no_mpi(); }
void MpiComm::reduce_scatter(const Tensor&, const Tensor&) { no_mpi(); }
void MpiComm::reduce(const Tensor&, int) { no_mpi(); }
void MpiComm::all_gather(const Tensor&, const Tensor&) { no_mpi(); }
void MpiComm::broadcast(const Tensor&, int) { no_mpi(); }
void MpiComm::send(const Tensor&, int) { no_mpi(); }
void MpiComm::recv(const Tensor&, int) { no_mpi(); }
void MpiComm::sendrecv(const Tensor&, int, const Tensor&, int) { no_mpi(); }
void MpiComm::barrier() { no_mpi(); }
void MpiComm::set_timeout(double) {}
double MpiComm::timeout() const { return 0; }
void MpiComm::set_chunk_elements(int64_t) {}
int64_t MpiComm::collective_calls() const { return 0; }
const std::vector<int>& MpiComm::members() const { no_mpi(); }
bool MpiComm::post_async(const char*, int64_t, DType, int, int, std::function<bool()>) { no_mpi(); }
void poll_async_ops() {}
bool async_ops_pending() { return false; }

#endif

}  // namespace keel::parallel
