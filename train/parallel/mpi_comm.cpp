#include "train/parallel/mpi_comm.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

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
};

}  // namespace

// ---- per-communicator state ----------------------------------------------------------------

struct MpiComm::Impl {
  GroupKind kind{};
  std::string name;
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

  // Reused buffers: steady-state calls allocate nothing.
  std::vector<unsigned char> recv_scratch;
  std::vector<float> acc_scratch;
  std::vector<int> counts, displs, rcounts, rdispls;
  std::vector<const void*> sources;

  // The operation now waiting, for the watchdog and for peers that ask.
  struct Op {
    const char* name = nullptr;
    int64_t seq = 0;  // collective number on this group (collectives only)
    int send_peer = -1, recv_peer = -1;  // group ranks (point to point only)
    int64_t send_seq = 0, recv_seq = 0;  // number of this send to / recv from that peer
    int64_t elements = 0;
    DType dtype = DType::F32;
    Clock::time_point start;
    bool p2p() const { return send_peer >= 0 || recv_peer >= 0; }
  };

  std::string label() const {
    std::string s = name + " [world ranks";
    for (size_t i = 0; i < members.size(); ++i) s += (i ? ", " : " ") + std::to_string(members[i]);
    return s + "]";
  }
  std::string who(int group_rank) const {
    return name + " rank " + std::to_string(group_rank) + " (world " + std::to_string(members[group_rank]) + ")";
  }

  void check(int err, const char* call, const Op& op) const;
  void begin(Op& op, const char* name, int64_t elements, DType dt, int send_peer = -1, int recv_peer = -1);
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
};

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

void copy_name(char* dst, size_t cap, std::string_view src) {
  const size_t n = std::min(cap - 1, src.size());
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

// Answers every pending "what are you doing?" on every communicator. Best effort: failures
// here must not mask the real problem, so MPI errors are ignored.
void serve_queries() {
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

void MpiComm::Impl::begin(Op& op, const char* op_name, int64_t elements, DType dt, int send_peer, int recv_peer) {
  op.name = op_name;
  op.send_peer = send_peer;
  op.recv_peer = recv_peer;
  op.elements = elements;
  op.dtype = dt;
  op.start = Clock::now();
  if (send_peer >= 0) op.send_seq = ++sends_to[static_cast<size_t>(send_peer)];
  if (recv_peer >= 0) op.recv_seq = ++recvs_from[static_cast<size_t>(recv_peer)];
  if (!op.p2p()) op.seq = ++collectives;
  if (broken)
    throw std::runtime_error(describe(op) + ": the communicator is unusable after an earlier timeout");
  // MPI counts are ints; the tensors that reach host MPI are far below this.
  if (elements > INT_MAX)
    throw std::invalid_argument(describe(op) + ": more than 2^31-1 elements in one host MPI operation");
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

// Asks the group (or the peers of a send/recv) what it is doing, prints the picture, throws.
void MpiComm::Impl::on_timeout(const Op& op) {
  broken = true;
  mark_comm_timed_out();
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
  // Wait a while for answers, answering questions meanwhile (the others may be asking us).
  const double answer_wait = std::clamp(timeout / 2, 0.2, 5.0);
  const Clock::time_point ask_start = Clock::now();
  size_t n_answered = 0;
  while (n_answered < asked.size() && seconds_since(ask_start) < answer_wait) {
    for (size_t i = 0; i < asked.size(); ++i) {
      if (answered[i]) continue;
      int flag = 0;
      MPI_Test(&replies[i], &flag, MPI_STATUS_IGNORE);
      if (flag) answered[i] = 1, ++n_answered;
    }
    serve_queries();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (size_t i = 0; i < asked.size(); ++i) {
    if (answered[i]) continue;
    MPI_Cancel(&replies[i]);
    MPI_Wait(&replies[i], MPI_STATUS_IGNORE);
  }

  std::string msg = "keel comm watchdog: world rank " + std::to_string(world_rank) + " (host " + host + ") timed out after " +
                    fmt_seconds(waited) + " in " + describe(op) + "\n";
  std::vector<int> missing;
  for (size_t i = 0; i < asked.size(); ++i) {
    const int peer = asked[i];
    const PeerReport& r = reports[i];
    msg += "  " + who(peer) + ": ";
    if (!answered[i]) {
      msg += "NO ANSWER within " + fmt_seconds(answer_wait) +
             " (busy outside keel's communication: computing, hung in other code, or dead)\n";
      missing.push_back(members[static_cast<size_t>(peer)]);
      continue;
    }
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
      if (behind) missing.push_back(members[static_cast<size_t>(peer)]);
      continue;
    }
    const bool same_point = r.busy && name == r.busy_group && r.busy_seq == op.seq;
    if (r.collectives < op.seq) {
      msg += "NOT ARRIVED: has started " + std::to_string(r.collectives) + " collectives on " + name +
             " (this is #" + std::to_string(op.seq) + "); " + busy + "\n";
      missing.push_back(members[static_cast<size_t>(peer)]);
    } else if (same_point && std::strcmp(r.busy_op, op.name) != 0) {
      msg += "MISMATCH: is in a different collective at this point; " + busy + "\n";
      missing.push_back(members[static_cast<size_t>(peer)]);
    } else if (same_point) {
      msg += "arrived (waiting too)\n";
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
  m.timeout = default_comm_timeout();
  m.host = LaunchInfo::from_environment().host;
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
  g_comms.push_back(impl_.get());
}

MpiComm::~MpiComm() {
  g_comms.erase(std::remove(g_comms.begin(), g_comms.end(), impl_.get()), g_comms.end());
  int finalized = 0;
  MPI_Finalized(&finalized);
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

void MpiComm::all_reduce(const Tensor& t, ReduceOp rop) {
  check::reduction(*this, "all_reduce", t);
  Impl& m = *impl_;
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
    for (int i = 0; i < m.size; ++i) m.sources[static_cast<size_t>(i)] = all + static_cast<size_t>(i * n) * esize;
    reduce_host(data, m.sources.data(), m.size, t.dtype, n, rop, m.scratch_floats(n));
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
    for (int i = 0; i < p; ++i) m.sources[static_cast<size_t>(i)] = blocks + static_cast<size_t>(i) * mine * esize;
    reduce_host(data + static_cast<size_t>(m.displs[static_cast<size_t>(m.rank)]) * esize, m.sources.data(), p, t.dtype,
                mine, rop, m.scratch_floats(mine));
    m.check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, m.counts.data(), m.displs.data(), type, m.comm,
                            &req),
            "MPI_Iallgatherv", op);
    m.wait(&req, 1, op);
  }
}

void MpiComm::reduce_scatter(const Tensor& out, const Tensor& in) {
  check::reduce_scatter(*this, out, in);
  Impl& m = *impl_;
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
    for (int i = 0; i < p; ++i) m.sources[static_cast<size_t>(i)] = blocks + static_cast<size_t>(i) * len * esize;
    reduce_host(static_cast<unsigned char*>(out.data) + static_cast<size_t>(off) * esize, m.sources.data(), p,
                in.dtype, len, ReduceOp::Sum, m.scratch_floats(len));
  }
}

void MpiComm::all_gather(const Tensor& out, const Tensor& in) {
  check::all_gather(*this, out, in);
  Impl& m = *impl_;
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

#endif

}  // namespace keel::parallel
