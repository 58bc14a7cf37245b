// Data-parallel gather of the updated weights, overlapped with the next step's forward
// (parallel.overlap_param_gather; Megatron's --overlap-param-gather).
//
// Without it, a step ends with one all_gather of the flat working weights: each DP rank sends
// the block it updated (its ZeRO-1 shard) and receives the others'. Here the same blocks move
// a bucket at a time, and only once the next forward is about to read them. The buffer is cut
// into buckets at group boundaries (embedding, each layer, head: the order the forward reads
// them, ascending in the flat buffer), each of at least `bucket` elements but the last.
//   begin()     after the optimizer: every other rank's blocks are stale; starts bucket 0.
//   need(end)   before the forward reads a group ending at `end`: waits for every bucket up
//               to the one holding it, then starts the next, which moves while the group
//               computes (on a GPU: NCCL on a side stream, Comm::broadcast_async).
//   settle()    gathers and waits for the rest. Whatever reads the weights outside a forward
//               (checkpoints, sampling, the replica check) calls it first; so does the
//               optimizer, which rewrites the blocks the broadcasts read.
// Each bucket is broadcast part by part, each part from the rank that owns it. Broadcasts only
// move bytes, so the weights are the same bits as the all_gather's (test_multirank
// "[overlap]"), and a ring broadcast moves as many bytes per rank as the all-gather's share.
// Every DP rank of a stage runs the same forward, so all of them start the same buckets in the
// same order: the broadcasts match without any negotiation.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/tensor.h"
#include "train/parallel/comm.h"

namespace keel::parallel {

class ParamGather {
 public:
  // working: the flat weight buffer, dp.size() blocks of `shard` elements, rank r owning block
  // r. bucket: elements per bucket at least (>= 1). group_ends: where the forward's groups end
  // in the buffer; buckets are cut only there (and at the buffer's end).
  ParamGather(Comm& dp, const Tensor& working, int64_t shard, int64_t bucket, std::vector<int64_t> group_ends);

  void begin();
  void need(int64_t end);
  void settle();
  bool pending() const { return joined_ < ends_.size(); }  // some bucket not yet waited for

  // The buckets: bucket k is [end of k-1 (0 for the first), bucket_ends()[k]).
  const std::vector<int64_t>& bucket_ends() const { return ends_; }
  int64_t bucket() const { return bucket_; }
  int64_t elements() const { return working_.numel(); }
  // The last gather completed: broadcasts started, and elements started ahead of their need
  // (while the forward computed an earlier group). Zero before the first.
  int64_t broadcasts() const { return done_.broadcasts; }
  int64_t overlapped_elements() const { return done_.overlapped; }

 private:
  void start(bool ahead);  // the next bucket
  void join();             // everything started; the gather completes when all are
  int64_t bucket_begin(size_t k) const { return k == 0 ? 0 : ends_[k - 1]; }

  Comm& dp_;
  Tensor working_;
  int64_t shard_, bucket_;
  std::vector<int64_t> ends_;
  size_t started_, joined_;  // buckets started, and waited for, in this gather
  struct Counts {
    int64_t broadcasts = 0, overlapped = 0;
  } now_, done_;  // this gather's, the last completed one's
};

}  // namespace keel::parallel
