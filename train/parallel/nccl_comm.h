// NCCL for device buffers: the same Comm interface, enqueued on a CUDA stream.
//
// Differences from MpiComm a caller must know:
// - Asynchronous: each call enqueues the NCCL operation on stream() and returns; the result is
//   ready for later work on that stream (or after synchronize()). barrier() does synchronize.
// - Reduction arithmetic is NCCL's: its own order (ring/tree), BF16/F16 rounded at each step
//   of the reduction rather than once; deterministic for a fixed topology and NCCL version, but
//   not bitwise equal to MpiComm. Reduce fp32 buffers (keel's gradients are fp32) when that matters.
// - Hang diagnosis: when the bootstrap is an MpiComm (any run under mpirun/srun), every
//   operation is posted to its books (MpiComm::post_async) with a CUDA event behind it, so it
//   is numbered, recorded in the OpRecorder ring and "waited in" until the event completes.
//   Host code waiting on the GPU polls poll_nccl_async_ops (synchronize() here; the CUDA
//   backend's waits through the device wait hook that train/run.cpp installs), which checks
//   NCCL's asynchronous errors and runs parallel::poll_async_ops: it answers other ranks'
//   watchdog questions and, when an operation is still unfinished after the group's timeout
//   (KEEL_COMM_TIMEOUT, default 600 s), gives the same report and dumps as a stuck MPI
//   operation and throws CommTimeout. Every NCCL communicator of the process is then aborted
//   at once (they share the stream), not destroyed, since destroying would wait for the stuck
//   operation; the destructor also aborts instead of destroying while an exception unwinds.
//   KEEL_FAULT_SKIP_COLLECTIVE applies here too. Without books (a LocalComm bootstrap)
//   synchronize() has its own plain watchdog naming the last operation enqueued.
// - Max does not propagate NaN: NCCL reduces floats with fmaxf/__hmax, which return the other
//   operand. Reduce a count or a 0/1 flag (I32) when a non-finite value must be seen.
// Built when KEEL_CUDA is on and NCCL is found (KEEL_HAVE_NCCL); otherwise the constructor throws.
#pragma once

#include <memory>
#include <string>

#include "train/parallel/comm.h"

namespace keel::parallel {

bool nccl_built();  // was keel compiled with NCCL?
// The NCCL library's version ("2.27.3"; empty without NCCL): its reductions' order depends on it.
std::string nccl_version();

class NcclComm final : public Comm {
 public:
  // Collective over the ranks of `bootstrap` (a host communicator of the same group, e.g. the
  // MpiComm of it; a LocalComm for a group of one): its rank 0 creates the NCCL id and
  // broadcasts it. Uses the CUDA device current on this thread: select it first (local rank).
  NcclComm(Comm& bootstrap, CUstream_st* stream);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override;
  int size() const override;
  std::string_view name() const override;
  Device device() const override { return Device::CUDA; }

  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) override;
  void reduce_scatter(const Tensor& out, const Tensor& in) override;
  void reduce(const Tensor& t, int root) override;
  void all_gather(const Tensor& out, const Tensor& in) override;
  void broadcast(const Tensor& t, int root) override;
  void send(const Tensor& t, int peer) override;
  void recv(const Tensor& t, int peer) override;
  void sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) override;
  void barrier() override;  // a 1-element all-reduce, then synchronize()
  void wait_idle() override {
    join_async();
    synchronize();
  }
  // On a side stream of high priority (made on first use): it waits for an event recorded on
  // stream() at the call, and join_async() makes stream() wait for an event recorded on it.
  // Every other operation joins first: NCCL runs one communicator's operations in the order
  // they were issued, and two streams in flight at once would leave that order to the device.
  void reduce_async(const Tensor& t, int root) override;
  void broadcast_async(const Tensor& t, int root) override;
  void join_async() override;

  CUstream_st* stream() const;
  void set_stream(CUstream_st* stream);
  // Waits until the work enqueued on stream() is done, under the watchdog.
  void synchronize();
  void set_timeout(double seconds);  // 0 waits forever
  double timeout() const;
  int64_t calls() const;  // operations enqueued so far

  struct Impl;

 private:
  // On stream() or the side stream.
  void enqueue_reduce(const Tensor& t, int root, bool on_side);
  void enqueue_broadcast(const Tensor& t, int root, bool on_side);
  std::unique_ptr<Impl> impl_;
};

// NcclComms for every group of `host` (made by make_host_comms), all on `stream`.
// Collective over the world.
CommGroups make_nccl_comms(const CommGroups& host, CUstream_st* stream);

// The device wait hook for a process with NcclComms (train/run.cpp installs it): throws when a
// live NcclComm reports an asynchronous NCCL error, then runs poll_async_ops; whatever it
// throws (CommTimeout, the NCCL error) aborts every live NcclComm first.
void poll_nccl_async_ops();
// Aborts every live NcclComm of this process (their pending operations end; they are unusable).
void abort_nccl_comms();

}  // namespace keel::parallel
