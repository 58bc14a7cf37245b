// MPI for host buffers: the runtime (init/finalize) and a communicator per grid group.
//
// keel runs as a plain process when no launcher started it: MpiRuntime then never touches MPI
// and make_host_comms hands out LocalComms. Under mpirun/srun it initializes MPI and each group
// of the Grid gets an MpiComm over its own MPI_Comm_split communicator.
//
// Reductions are keel's own (the byte movement is MPI's): every output element is reduced by
// one rank, in group-rank order, in fp32, then sent to the others as bytes. So all ranks hold
// bitwise-identical results, and a rerun with the same group size reproduces them exactly,
// whatever algorithm MPI picks.
//
// Watchdog: every operation polls its non-blocking MPI request, and one that has not completed
// after timeout() seconds (KEEL_COMM_TIMEOUT, default 600, 0 = never) asks the other ranks of
// the group what they are doing over a side communicator, prints who is stuck where and who has
// not arrived to stderr, and throws CommTimeout. Ranks answer those questions whenever they are
// themselves waiting in any keel collective; a rank busy outside them is reported as silent.
// A member still waiting in an earlier collective of the same group (overlapped reductions keep
// several in flight) is reported as behind, after the ranks that are really missing.
//
// Hang diagnosis (hang_report.h): every operation on a group of more than one rank is recorded
// in this process's OpRecorder ring. The watchdog's report ends with one line in the words
// `keel doctor hang` uses ("keel hang report: all_reduce #2 of dp group 1 [world ranks 1, 3]:
// world rank 3 never arrived; ..."), and when a dump directory is set (set_hang_dump_directory,
// or KEEL_HANG_DUMP_DIR) the stuck rank writes hang-rank<R>.json there and asks every other rank
// to write theirs before the job is aborted (ranks waiting in keel do; ranks busy elsewhere
// cannot, and the report names them from the others' answers).
// Test-only: KEEL_FAULT_SKIP_COLLECTIVE="rank=R,op=OP,group=G,seq=N" makes world rank R skip
// collective #N of its G group (see parse_collective_fault).
#pragma once

#include <functional>
#include <memory>

#include "train/parallel/comm.h"
#include "train/parallel/grid.h"
#include "train/parallel/hang_report.h"

namespace keel::parallel {

bool mpi_built();  // was keel compiled with MPI (KEEL_HAVE_MPI)?

// Seconds before a stuck collective is reported: KEEL_COMM_TIMEOUT from the environment (a
// number of seconds, 0 disables), else 600. Throws on a malformed value.
double default_comm_timeout();

class MpiRuntime {
 public:
  // Initializes MPI when a launcher started this process (LaunchInfo::launched()), else does
  // nothing. Throws when MPI's world disagrees with the launcher's environment, or when the
  // launcher asks for several ranks and keel was built without MPI. One per process.
  explicit MpiRuntime(int* argc = nullptr, char*** argv = nullptr);
  // MPI_Finalize; or MPI_Abort when a communicator timed out or an exception is unwinding
  // through it, so the other ranks are taken down instead of hanging in finalize.
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  bool active() const { return active_; }  // MPI is initialized and usable
  // World rank/size from MPI when active, local rank and host from the environment.
  const LaunchInfo& launch() const { return launch_; }
  int world_rank() const { return launch_.world_rank; }
  int world_size() const { return launch_.world_size; }

  // Flushes stdout/stderr and ends the whole job (MPI_Abort), or the process without MPI.
  [[noreturn]] static void abort(int code);

  // Collective over the world: every rank passes its text (say, its resolved config). Returns,
  // on every rank, the lowest world rank whose text differs from rank 0's, or -1 when all agree
  // (or without MPI). Rank 0 receives that rank's text in *differing_text. Compares CRC-32Cs,
  // so only the one differing text travels.
  int first_rank_differing(const std::string& text, std::string* differing_text) const;
  // Collective over the world: *text becomes rank 0's on every rank (nothing without MPI).
  void broadcast_text(std::string* text) const;

 private:
  bool active_ = false;
  bool owns_mpi_ = false;  // we called MPI_Init, so we finalize
  LaunchInfo launch_;
};

class MpiComm final : public Comm {
 public:
  // Collective over MPI_COMM_WORLD: every rank constructs the same kinds in the same order.
  // grid.world_size()/rank() must be MPI's.
  MpiComm(const Grid& grid, GroupKind kind);
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override;
  int size() const override;
  std::string_view name() const override;
  Device device() const override { return Device::CPU; }

  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) override;
  void reduce_scatter(const Tensor& out, const Tensor& in) override;
  void reduce(const Tensor& t, int root) override;
  void all_gather(const Tensor& out, const Tensor& in) override;
  void broadcast(const Tensor& t, int root) override;
  void send(const Tensor& t, int peer) override;
  void recv(const Tensor& t, int peer) override;
  void sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) override;
  void barrier() override;

  // Seconds one operation may wait before the watchdog reports it; 0 waits forever.
  void set_timeout(double seconds);
  double timeout() const;
  // Elements reduced per round (bounds the scratch memory, ~this many elements plus as many
  // floats). Small values make tests exercise the chunked path. Default 4M.
  void set_chunk_elements(int64_t n);
  int64_t collective_calls() const;  // collectives started on this group so far
  const std::vector<int>& members() const;  // world ranks, in group-rank order

  // Asynchronous operations on this group run by another transport (NcclComm, on a CUDA
  // stream) are kept in this communicator's books, so the watchdog, the answers to other
  // ranks' questions and the hang dumps see them exactly like its own operations: numbered
  // (collective #N, send #N to a peer), recorded in the OpRecorder ring, and "waited in" until
  // `done()` says they finished (poll_async_ops checks, in posting order). Returns false when
  // KEEL_FAULT_SKIP_COLLECTIVE says this rank skips it: the caller must then not run it.
  // Throws once this communicator has timed out.
  bool post_async(const char* op, int64_t elements, DType dt, int send_peer, int recv_peer,
                  std::function<bool()> done);

  struct Impl;  // MPI state; public so the watchdog's process-wide registry can name it

 private:
  std::unique_ptr<Impl> impl_;
};

// For host code waiting for a device that runs posted asynchronous operations (CudaBackend's
// stream waits, through set_device_wait_hook): retires finished operations, answers other
// ranks' watchdog questions (at most every 20 ms), and when the oldest unfinished operation
// has been pending longer than its group's timeout, diagnoses it as the blocking operations'
// watchdog does (asks the group, prints the report, writes the dumps) and throws CommTimeout.
// Call it every millisecond or so while waiting; the timeout counts from when the operation
// was posted.
void poll_async_ops();
bool async_ops_pending();  // any posted asynchronous operation not yet seen finished?

// One communicator per group of `grid`: MpiComms when MPI is active, LocalComms for a world of
// one without MPI. Collective over the world when MPI is active.
CommGroups make_host_comms(const Grid& grid, const MpiRuntime& runtime);

}  // namespace keel::parallel
