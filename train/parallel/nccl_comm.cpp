#include "train/parallel/nccl_comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "train/parallel/hang_report.h"
#include "train/parallel/mpi_comm.h"

#ifdef KEEL_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace keel::parallel {

#ifdef KEEL_HAVE_NCCL

bool nccl_built() { return true; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
  }
  return ncclFloat32;
}

}  // namespace

struct NcclComm::Impl {
  std::string name;
  int rank = 0, size = 1, world_rank = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  float* barrier_word = nullptr;  // device scratch for barrier()'s all-reduce
  double timeout = 600;
  int64_t calls = 0;
  bool aborted = false;
  // The last operation enqueued: what error messages name.
  std::string last_op = "nothing";
  // The host communicator of the same group (the bootstrap, when it is an MpiComm): every
  // operation goes in its books (MpiComm::post_async) with a CUDA event that tells when it
  // finished on the stream, so the hang watchdog and dumps cover NCCL like MPI. Null for a
  // world of one process (LocalComm bootstrap), where nothing can hang on another rank.
  MpiComm* books = nullptr;

  // Aborts the communicator (its queued and running kernels exit); idempotent. ncclCommAbort
  // frees it: comm is cleared so that nothing calls NCCL with it again.
  void abort() {
    if (comm && !aborted) ncclCommAbort(comm);
    comm = nullptr;
    aborted = true;
  }
  std::string where() const {
    return name + " (nccl rank " + std::to_string(rank) + " of " + std::to_string(size) + ", world rank " +
           std::to_string(world_rank) + ")";
  }
  // Before enqueueing an operation: counts it, and posts it to the books with an event that
  // enqueued() records behind it. False: a test fault says this rank skips it (do not enqueue).
  bool note(const char* op, const Tensor& t, int send_peer = -1, int recv_peer = -1) {
    ++calls;
    const int peer = send_peer >= 0 ? send_peer : recv_peer;
    last_op = std::string(op) + " #" + std::to_string(calls) + " (" + std::to_string(t.numel()) + " x " +
              std::string(dtype_name(t.dtype)) + (peer >= 0 ? ", peer " + std::to_string(peer) : "") + ")";
    if (aborted) throw std::runtime_error("nccl " + where() + ": " + last_op + " after the communicator was aborted");
    pending_event.reset();
    if (!books) return true;
    // A group of one keeps no books (nothing to wait for): no event needed.
    if (books->size() == 1) return books->post_async(op, t.numel(), t.dtype, send_peer, recv_peer, {});
    cudaEvent_t ev = nullptr;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    // Shared by the books' entry (destroyed when the operation is retired) and pending_event
    // (until enqueued() has recorded it). An event never recorded (the enqueue failed)
    // queries as complete.
    std::shared_ptr<CUevent_st> owned(ev, [](cudaEvent_t e) { cudaEventDestroy(e); });
    if (!books->post_async(op, t.numel(), t.dtype, send_peer, recv_peer,
                           [owned] { return cudaEventQuery(owned.get()) != cudaErrorNotReady; }))
      return false;
    pending_event = std::move(owned);
    return true;
  }
  // Guards a host call into NCCL that may wait for peers inside itself (communicator setup, and
  // the connection setup of a first operation between two ranks): see BlockingCallWatch.
  BlockingCallWatch watch(const char* call) const { return BlockingCallWatch(call, last_op, watch_label, timeout); }
  std::string watch_label;  // "world rank R, NCCL group ...": who a blocked call's report names
  // After enqueueing on `on` (stream, or side): the event that marks the operation finished.
  void enqueued(cudaStream_t on) {
    if (pending_event) check(cudaEventRecord(pending_event.get(), on), "cudaEventRecord");
    pending_event.reset();
  }
  void enqueued() { enqueued(stream); }
  // The asynchronous operations' stream, and the events that order it after stream (fork) and
  // stream after it (join). Made on first use; side_pending: work on side that stream does not
  // wait for yet.
  cudaStream_t side = nullptr;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;
  bool side_pending = false;
  void join() {
    if (!side_pending) return;
    check(cudaEventRecord(join_event, side), "cudaEventRecord");
    check(cudaStreamWaitEvent(stream, join_event, 0), "cudaStreamWaitEvent");
    side_pending = false;
  }
  // Where an operation goes. On stream, after the side stream's work: NCCL must meet one
  // communicator's operations in the same order on every rank, and two streams in flight at
  // once would leave that order to each device. On side (of the highest priority), after
  // everything enqueued on stream so far (the last writes of what it sends).
  cudaStream_t main_stream() {
    join();
    return stream;
  }
  cudaStream_t side_stream() {
    if (!side) {
      int least = 0, greatest = 0;  // greatest: the numerically lowest, the highest priority
      check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
      check(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, greatest), "cudaStreamCreateWithPriority");
      check(cudaEventCreateWithFlags(&fork_event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      check(cudaEventCreateWithFlags(&join_event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
    check(cudaEventRecord(fork_event, stream), "cudaEventRecord");
    check(cudaStreamWaitEvent(side, fork_event, 0), "cudaStreamWaitEvent");
    side_pending = true;
    return side;
  }
  std::shared_ptr<CUevent_st> pending_event;
  void check(ncclResult_t r, const char* call) const {
    if (r == ncclSuccess) return;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    // The comm argument is unused by NCCL: the detail is there also when creating it failed
    // (e.g. "Duplicate GPU detected" when two ranks picked the same device).
    const char* detail = ncclGetLastError(comm);
#else
    const char* detail = nullptr;
#endif
    throw std::runtime_error(std::string(call) + " failed on group " + where() + " in " + last_op + ": " +
                             ncclGetErrorString(r) + (detail && *detail ? std::string(" (") + detail + ")" : ""));
  }
  void check(cudaError_t e, const char* call) const {
    if (e == cudaSuccess) return;
    throw std::runtime_error(std::string(call) + " failed on group " + where() + " in " + last_op + ": " +
                             cudaGetErrorString(e));
  }
};

namespace {
// Every live NcclComm of this process: they share one stream, so a stuck operation on any of
// them holds up the others' work behind it, and a timeout aborts them all.
std::vector<NcclComm::Impl*> g_live_nccl;
}  // namespace

void abort_nccl_comms() {
  for (NcclComm::Impl* m : g_live_nccl) m->abort();
}

void poll_nccl_async_ops() {
  try {
    // A failure NCCL detected itself (a network error, a peer gone) ends the wait at once
    // instead of after the watchdog's timeout.
    for (NcclComm::Impl* m : g_live_nccl) {
      if (m->aborted || !m->comm) continue;
      ncclResult_t async_err = ncclSuccess;
      m->check(ncclCommGetAsyncError(m->comm, &async_err), "ncclCommGetAsyncError");
      m->check(async_err, "NCCL (asynchronous error)");
    }
    poll_async_ops();
  } catch (...) {
    // Stuck or failed operations never complete: abort now, so that no later wait (a
    // destructor's stream synchronisation, a cudaFree) blocks on them. (CommTimeout has
    // already marked the process as timed out.)
    abort_nccl_comms();
    throw;
  }
}

NcclComm::NcclComm(Comm& bootstrap, CUstream_st* stream) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.name = std::string(bootstrap.name());
  m.rank = bootstrap.rank();
  m.size = bootstrap.size();
  m.world_rank = LaunchInfo::from_environment().world_rank;
  m.stream = stream;
  m.timeout = default_comm_timeout();
  m.books = dynamic_cast<MpiComm*>(&bootstrap);
  m.watch_label = "world rank " + std::to_string(m.world_rank) + ", NCCL group " + m.where();

  // The id travels over the host communicator: 128 bytes seen as 32 int32.
  static_assert(sizeof(ncclUniqueId) % 4 == 0, "ncclUniqueId is moved as int32 words");
  ncclUniqueId id{};
  if (m.rank == 0) m.check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  if (bootstrap.device() != Device::CPU)
    throw std::invalid_argument("NcclComm(" + m.name + "): the bootstrap communicator must move host memory");
  bootstrap.broadcast(Tensor(&id, DType::I32, {static_cast<int64_t>(sizeof(id) / 4)}), 0);
  m.last_op = "cudaMalloc (barrier word)";
  m.check(cudaMalloc(&m.barrier_word, sizeof(float)), "cudaMalloc");
  m.last_op = "communicator setup";
  ncclResult_t r = ncclSuccess;
  {
    // Waits for every rank of the group: a missing one would leave this rank here, silent.
    const BlockingCallWatch watch = m.watch("ncclCommInitRank");
    r = ncclCommInitRank(&m.comm, m.size, id, m.rank);
  }
  if (r != ncclSuccess) {
    cudaFree(m.barrier_word);  // the destructor does not run for a constructor that throws
    m.barrier_word = nullptr;
    m.comm = nullptr;
    m.check(r, "ncclCommInitRank");
  }
  m.last_op = "nothing";
  g_live_nccl.push_back(impl_.get());
}

NcclComm::~NcclComm() {
  Impl& m = *impl_;
  g_live_nccl.erase(std::remove(g_live_nccl.begin(), g_live_nccl.end(), &m), g_live_nccl.end());
  // After a timeout (here or on any communicator of this process), or while an exception
  // unwinds (this rank leaves; its peers may never match what it enqueued), operations may
  // still be pending: abort them, as destroying finalizes, which waits for them forever.
  if (m.comm && !m.aborted && (comm_timed_out() || std::uncaught_exceptions() > 0)) m.abort();
  if (m.comm && !m.aborted) ncclCommDestroy(m.comm);
  if (m.fork_event) cudaEventDestroy(m.fork_event);
  if (m.join_event) cudaEventDestroy(m.join_event);
  if (m.side) cudaStreamDestroy(m.side);
  // Last: cudaFree waits for the device, which a pending NCCL kernel would hold up.
  if (m.barrier_word) cudaFree(m.barrier_word);
}

int NcclComm::rank() const { return impl_->rank; }
int NcclComm::size() const { return impl_->size; }
std::string_view NcclComm::name() const { return impl_->name; }
CUstream_st* NcclComm::stream() const { return impl_->stream; }
void NcclComm::set_stream(CUstream_st* stream) { impl_->stream = stream; }
void NcclComm::set_timeout(double seconds) {
  if (!(seconds >= 0)) throw std::invalid_argument("NcclComm::set_timeout: seconds must be >= 0 (0 disables)");
  impl_->timeout = seconds;
}
double NcclComm::timeout() const { return impl_->timeout; }
int64_t NcclComm::calls() const { return impl_->calls; }

void NcclComm::all_reduce(const Tensor& t, ReduceOp op) {
  check::reduction(*this, "all_reduce", t);
  Impl& m = *impl_;
  if (!m.note("all_reduce", t) || t.numel() == 0) return;
  const BlockingCallWatch watch = m.watch("ncclAllReduce");
  m.check(ncclAllReduce(t.data, t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype),
                        op == ReduceOp::Sum ? ncclSum : ncclMax, m.comm, m.main_stream()),
          "ncclAllReduce");
  m.enqueued();
}

void NcclComm::reduce_scatter(const Tensor& out, const Tensor& in) {
  check::reduce_scatter(*this, out, in);
  Impl& m = *impl_;
  if (!m.note("reduce_scatter", in) || out.numel() == 0) return;
  const BlockingCallWatch watch = m.watch("ncclReduceScatter");
  m.check(ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.numel()), nccl_type(in.dtype), ncclSum, m.comm,
                            m.main_stream()),
          "ncclReduceScatter");
  m.enqueued();
}

void NcclComm::reduce(const Tensor& t, int root) { enqueue_reduce(t, root, false); }
void NcclComm::reduce_async(const Tensor& t, int root) { enqueue_reduce(t, root, true); }

void NcclComm::enqueue_reduce(const Tensor& t, int root, bool on_side) {
  check::reduce(*this, t, root);
  Impl& m = *impl_;
  if (!m.note("reduce", t) || t.numel() == 0) return;
  const cudaStream_t s = on_side ? m.side_stream() : m.main_stream();
  const BlockingCallWatch watch = m.watch("ncclReduce");
  m.check(ncclReduce(t.data, t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype), ncclSum, root, m.comm, s),
          "ncclReduce");
  m.enqueued(s);
}

void NcclComm::join_async() { impl_->join(); }

void NcclComm::all_gather(const Tensor& out, const Tensor& in) {
  check::all_gather(*this, out, in);
  Impl& m = *impl_;
  if (!m.note("all_gather", out) || in.numel() == 0) return;
  const BlockingCallWatch watch = m.watch("ncclAllGather");
  // In place when in is this rank's block of out: NCCL detects that from the pointers.
  m.check(ncclAllGather(in.data, out.data, static_cast<size_t>(in.numel()), nccl_type(in.dtype), m.comm, m.main_stream()),
          "ncclAllGather");
  m.enqueued();
}

void NcclComm::broadcast(const Tensor& t, int root) { enqueue_broadcast(t, root, false); }
void NcclComm::broadcast_async(const Tensor& t, int root) { enqueue_broadcast(t, root, true); }

void NcclComm::enqueue_broadcast(const Tensor& t, int root, bool on_side) {
  check::broadcast(*this, t, root);
  Impl& m = *impl_;
  if (!m.note("broadcast", t) || t.numel() == 0) return;
  const cudaStream_t s = on_side ? m.side_stream() : m.main_stream();
  const BlockingCallWatch watch = m.watch("ncclBroadcast");
  m.check(ncclBroadcast(t.data, t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype), root, m.comm, s),
          "ncclBroadcast");
  m.enqueued(s);
}

void NcclComm::send(const Tensor& t, int peer) {
  check::point_to_point(*this, "send", t, peer);
  Impl& m = *impl_;
  if (!m.note("send", t, peer)) return;
  const BlockingCallWatch watch = m.watch("ncclSend");
  m.check(ncclSend(t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype), peer, m.comm, m.main_stream()), "ncclSend");
  m.enqueued();
}

void NcclComm::recv(const Tensor& t, int peer) {
  check::point_to_point(*this, "recv", t, peer);
  Impl& m = *impl_;
  if (!m.note("recv", t, -1, peer)) return;
  const BlockingCallWatch watch = m.watch("ncclRecv");
  m.check(ncclRecv(t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype), peer, m.comm, m.main_stream()), "ncclRecv");
  m.enqueued();
}

void NcclComm::sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) {
  check::point_to_point(*this, "send", send_t, send_peer);
  check::point_to_point(*this, "recv", recv_t, recv_peer);
  Impl& m = *impl_;
  if (!m.note("sendrecv", send_t, send_peer, recv_peer)) return;
  const BlockingCallWatch watch = m.watch("ncclSend/ncclRecv");
  // One group: NCCL posts both before either waits, so two stages exchanging cannot deadlock.
  const cudaStream_t s = m.main_stream();
  m.check(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t rs = ncclSend(send_t.data, static_cast<size_t>(send_t.numel()), nccl_type(send_t.dtype), send_peer,
                             m.comm, s);
  ncclResult_t rr = ncclRecv(recv_t.data, static_cast<size_t>(recv_t.numel()), nccl_type(recv_t.dtype), recv_peer,
                             m.comm, s);
  ncclResult_t re = ncclGroupEnd();
  m.check(rs, "ncclSend");
  m.check(rr, "ncclRecv");
  m.check(re, "ncclGroupEnd");
  m.enqueued();
}

void NcclComm::barrier() {
  Impl& m = *impl_;
  Tensor word(m.barrier_word, DType::F32, {1}, Device::CUDA);
  if (!m.note("barrier", word)) return;
  const BlockingCallWatch watch = m.watch("ncclAllReduce");
  m.check(ncclAllReduce(m.barrier_word, m.barrier_word, 1, ncclFloat32, ncclSum, m.comm, m.main_stream()), "ncclAllReduce");
  m.enqueued();
  synchronize();
}

void NcclComm::synchronize() {
  Impl& m = *impl_;
  if (m.aborted)
    throw std::runtime_error("nccl " + m.where() + ": synchronize after the communicator was aborted (last operation " +
                             m.last_op + ")");
  const Clock::time_point start = Clock::now();
  for (;;) {
    cudaError_t e = cudaStreamQuery(m.stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) m.check(e, "cudaStreamQuery");
    ncclResult_t async_err = ncclSuccess;
    m.check(ncclCommGetAsyncError(m.comm, &async_err), "ncclCommGetAsyncError");
    m.check(async_err, "NCCL (asynchronous error)");
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (m.books) {
      // The books' watchdog: the oldest unfinished operation on any group, diagnosed across
      // ranks (throws CommTimeout, after aborting the NCCL communicators).
      poll_nccl_async_ops();
    } else if (m.timeout > 0 && waited > m.timeout) {
      char head[96];
      std::snprintf(head, sizeof(head), "timed out after %.1f s", waited);
      const std::string msg = "keel comm watchdog (nccl): world rank " + std::to_string(m.world_rank) + " " + head +
                              " waiting for group " + m.where() + "; last operation enqueued: " + m.last_op +
                              ". Some rank of the group has not enqueued the matching operation (or is stuck "
                              "before it); the NCCL communicator is aborted. (timeout: KEEL_COMM_TIMEOUT)";
      std::fprintf(stderr, "%s\n", msg.c_str());
      std::fflush(stderr);
      mark_comm_timed_out();
      abort_nccl_comms();  // all of them: they share the stream, the stuck one may be another's
      throw CommTimeout(msg);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(waited > 0.01 ? 200 : 10));
  }
}

CommGroups make_nccl_comms(const CommGroups& host, CUstream_st* stream) {
  CommGroups g;
  g.world = std::make_unique<NcclComm>(*host.world, stream);
  g.tp = std::make_unique<NcclComm>(*host.tp, stream);
  g.pp = std::make_unique<NcclComm>(*host.pp, stream);
  g.dp = std::make_unique<NcclComm>(*host.dp, stream);
  g.embedding = std::make_unique<NcclComm>(*host.embedding, stream);
  return g;
}

#else  // ---- built without NCCL ------------------------------------------------------------------

bool nccl_built() { return false; }

std::string nccl_version() { return ""; }

struct NcclComm::Impl {};

[[noreturn]] static void no_nccl() {
  throw std::logic_error("NcclComm: keel was built without NCCL (needs KEEL_CUDA=ON and NCCL; set NCCL_HOME)");
}
NcclComm::NcclComm(Comm&, CUstream_st*) { no_nccl(); }
NcclComm::~NcclComm() = default;
int NcclComm::rank() const { return 0; }
int NcclComm::size() const { return 1; }
std::string_view NcclComm::name() const { return "none"; }
void NcclComm::all_reduce(const Tensor&, ReduceOp) { no_nccl(); }
void NcclComm::reduce_scatter(const Tensor&, const Tensor&) { no_nccl(); }
void NcclComm::reduce(const Tensor&, int) { no_nccl(); }
void NcclComm::reduce_async(const Tensor&, int) { no_nccl(); }
void NcclComm::broadcast_async(const Tensor&, int) { no_nccl(); }
void NcclComm::join_async() {}
void NcclComm::all_gather(const Tensor&, const Tensor&) { no_nccl(); }
void NcclComm::broadcast(const Tensor&, int) { no_nccl(); }
void NcclComm::send(const Tensor&, int) { no_nccl(); }
void NcclComm::recv(const Tensor&, int) { no_nccl(); }
void NcclComm::sendrecv(const Tensor&, int, const Tensor&, int) { no_nccl(); }
void NcclComm::barrier() { no_nccl(); }
CUstream_st* NcclComm::stream() const { return nullptr; }
void NcclComm::set_stream(CUstream_st*) {}
void NcclComm::synchronize() {}
void NcclComm::set_timeout(double) {}
double NcclComm::timeout() const { return 0; }
int64_t NcclComm::calls() const { return 0; }
CommGroups make_nccl_comms(const CommGroups&, CUstream_st*) { no_nccl(); }
void abort_nccl_comms() {}
void poll_nccl_async_ops() { poll_async_ops(); }

#endif

}  // namespace keel::parallel
