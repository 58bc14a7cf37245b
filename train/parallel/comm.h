// A communicator: one group of ranks (the TP, PP, DP or embedding group of a rank, or the
// world) and the collectives the trainer needs, on keel::Tensor views.
//
//   MpiComm  (mpi_comm.h)  host buffers, over MPI; what CPU runs and the multi-rank tests use
//   NcclComm (nccl_comm.h) device buffers, over NCCL on a CUDA stream
//   LocalComm (here)       a group of one rank; needs no MPI at all
//
// Semantics shared by every implementation (sizes in elements, ranks within the group):
//   all_reduce(t, op)        t = op over ranks of t, in place (Sum or Max)
//   reduce_scatter(out, in)  in holds size() blocks of out.numel(); rank r gets the sum of block r;
//                            out may be in's own block r (in place)
//   reduce(t, root)          root's t = sum over ranks of t (in place); the other ranks' t is unchanged
//   all_gather(out, in)      out = the in of rank 0, then rank 1, ...; in may be out's own block
//   broadcast(t, root)       t = root's t
//   send(t, peer) / recv(t, peer)   point to point, matched in order per (sender, receiver)
//   sendrecv(s, to, r, from) both at once (a pipeline stage sending forward while receiving
//                            backward must not wait for one before posting the other)
//   barrier()
// Dtypes: reductions take F32, BF16, F16 (and I32); movement ops take any dtype.
// Reductions of BF16/F16 are done in fp32 and rounded once (round-to-nearest-even, as the GPU
// rounds) wherever the implementation does the arithmetic itself (MpiComm: always; NcclComm
// leaves it to NCCL, see nccl_comm.h). MpiComm's sums are in group-rank order, so the result
// is bitwise identical on every rank and in every run with the same group size.
// Max propagates NaN (a NaN anywhere gives NaN) in MpiComm and LocalComm, so a non-finite check
// over ranks is reliable there; NcclComm's does not (NCCL's float max is fmaxf): see nccl_comm.h.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include "kernels/tensor.h"
#include "train/parallel/grid.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace keel::parallel {

enum class ReduceOp { Sum, Max };
std::string_view reduce_op_name(ReduceOp op);

// Thrown when a collective did not complete within the communicator's timeout; what() is the
// full diagnostic (already printed to stderr when thrown). The communicator is unusable
// afterwards: the run should end (MpiRuntime aborts the job rather than hang in finalize).
class CommTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Process-wide: has any communicator timed out? (MpiRuntime then aborts instead of finalizing.)
void mark_comm_timed_out();
bool comm_timed_out();

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view name() const = 0;  // the group: "tp", "pp", "dp", "embedding", "world"
  virtual Device device() const = 0;          // where tensors handed to it must live

  virtual void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) = 0;
  virtual void reduce_scatter(const Tensor& out, const Tensor& in) = 0;
  virtual void reduce(const Tensor& t, int root) = 0;
  virtual void all_gather(const Tensor& out, const Tensor& in) = 0;
  virtual void broadcast(const Tensor& t, int root) = 0;
  virtual void send(const Tensor& t, int peer) = 0;
  virtual void recv(const Tensor& t, int peer) = 0;
  virtual void sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) = 0;
  virtual void barrier() = 0;
  // Returns once the work this communicator enqueued has finished (device communicators run
  // asynchronously on a stream; host communicators are done when their calls return). Lets a
  // timer measure a collective's real duration (train/step_timers.h).
  virtual void wait_idle() {}
  // Collectives overlapped with compute (DP gradient buckets, train/parallel/grad_buckets.h;
  // the DP weight gather, train/parallel/param_gather.h): reduce_async is reduce(t, root) and
  // broadcast_async is broadcast(t, root), but a device communicator runs them on a side
  // stream, after the work enqueued so far and alongside the work enqueued after it;
  // join_async() makes later work wait for all of them. Until then nobody may touch t. Any
  // other operation of the communicator joins them first. Host communicators finish them
  // before returning. wait_idle() includes them.
  virtual void reduce_async(const Tensor& t, int root) { reduce(t, root); }
  virtual void broadcast_async(const Tensor& t, int root) { broadcast(t, root); }
  virtual void join_async() {}
};

// Argument checks every implementation runs first. They throw std::invalid_argument naming the
// collective, the group and the shapes ("all_gather on tp (size 4): out [10] f32 must hold 4 x
// in [3] f32 = 12 elements").
namespace check {
void reduction(const Comm& c, std::string_view op, const Tensor& t);
void reduce_scatter(const Comm& c, const Tensor& out, const Tensor& in);
void reduce(const Comm& c, const Tensor& t, int root);
void all_gather(const Comm& c, const Tensor& out, const Tensor& in);
void broadcast(const Comm& c, const Tensor& t, int root);
void point_to_point(const Comm& c, std::string_view op, const Tensor& t, int peer);
}  // namespace check

// A group of one rank: reductions and broadcast leave the data as it is, reduce_scatter and
// all_gather copy in to out (on the given CUDA stream for device tensors), send/recv are
// errors (there is nobody to talk to; a pipeline of one stage never sends).
class LocalComm final : public Comm {
 public:
  explicit LocalComm(std::string name = "world", Device device = Device::CPU, CUstream_st* stream = nullptr)
      : name_(std::move(name)), device_(device), stream_(stream) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view name() const override { return name_; }
  Device device() const override { return device_; }

  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) override;
  void reduce_scatter(const Tensor& out, const Tensor& in) override;
  void reduce(const Tensor& t, int root) override;
  void all_gather(const Tensor& out, const Tensor& in) override;
  void broadcast(const Tensor& t, int root) override;
  void send(const Tensor& t, int peer) override;
  void recv(const Tensor& t, int peer) override;
  void sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) override;
  void barrier() override {}

 private:
  void copy(const char* op, const Tensor& out, const Tensor& in);
  std::string name_;
  Device device_;
  CUstream_st* stream_;
};

// The communicators of one rank, one per group of the grid.
struct CommGroups {
  std::unique_ptr<Comm> world, tp, pp, dp, embedding;
  Comm& operator[](GroupKind kind) const;
};

// All five groups as LocalComms: the world of one rank.
CommGroups make_local_comms(Device device = Device::CPU, CUstream_st* stream = nullptr);

// ---- host reduction (MpiComm's arithmetic; exposed for tests) ------------------------------

// dst = ((src[0] op src[1]) op src[2]) ... elementwise, n elements of dtype dt each, in exactly
// that order. F32/BF16/F16 reduce in fp32 (`scratch`: n floats, used for BF16/F16) and round
// once at the end; I32 sums wrap around like the GPU's. dst may alias src[0].
void reduce_host(void* dst, const void* const* src, int nsrc, DType dt, int64_t n, ReduceOp op, float* scratch);

}  // namespace keel::parallel
