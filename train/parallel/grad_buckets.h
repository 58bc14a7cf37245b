// Data-parallel gradient reduction in buckets, started during the step's last backward
// (parallel.overlap_grad_reduce; Megatron's --overlap-grad-reduce).
//
// Without it, a step sums its gradients over DP with one reduce_scatter after the pipeline:
// rank r receives the sum of the flat block [r S, (r+1) S) it owns (ZeRO-1). Here the same
// sums are computed while the backward still runs: the model reports each group of gradients
// (the head's, a layer's, the embedding's) once it is final, the group's range joins the
// contiguous run of final gradients next to it, and once a run holds `bucket` elements it is
// reduced, each part of it to the rank that owns that part (Comm::reduce_async; on a GPU, a
// side stream runs it while the next layers' backward runs). finish() reduces whatever is left,
// including the deferred ranges (the tied embedding's copies, summed over the embedding group
// only after the pipeline), then joins.
//
// The shard layout, and so the optimizer state and the checkpoints, is the one reduce_scatter
// gives. A ring reduce moves as many bytes per rank as the reduce-scatter does. Over MPI every
// element is summed by its owner in rank order, as reduce_scatter sums it, so the gradients are
// the same bits with and without overlap (test_multirank "[overlap]").
//
// Every DP rank of a stage runs the same schedule and model shard, so all of them form the
// same buckets in the same order: each reduction is matched without any negotiation.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "kernels/tensor.h"
#include "train/parallel/comm.h"

namespace keel::parallel {

class GradBuckets {
 public:
  using Range = std::pair<int64_t, int64_t>;  // [begin, end) of the flat buffer

  // grads: the flat gradient buffer, dp.size() blocks of `shard` elements, rank r owning block
  // r. bucket: final contiguous elements that start a reduction (>= 1). deferred: ranges
  // ready() ignores, left for finish().
  GradBuckets(Comm& dp, const Tensor& grads, int64_t shard, int64_t bucket, std::vector<Range> deferred = {});

  void begin_step();                      // nothing final, nothing reduced
  void ready(int64_t begin, int64_t end);  // these gradients are final for the step
  void finish();                          // reduce all the rest, then join_async

  // This step so far: reductions started (one per owner a bucket touches), and elements
  // reduced before finish().
  int64_t reductions() const { return reductions_; }
  int64_t early_elements() const { return early_elements_; }
  int64_t bucket() const { return bucket_; }
  int64_t elements() const { return grads_.numel(); }  // reduced per step in all

 private:
  void reduce(Range r);  // each owner's part of r, to its owner
  static void insert(std::map<int64_t, int64_t>& set, Range r);  // merged with touching ranges

  Comm& dp_;
  Tensor grads_;
  int64_t shard_, bucket_;
  std::vector<Range> deferred_;  // sorted, disjoint
  std::map<int64_t, int64_t> pending_;  // final, not yet reduced: begin -> end, disjoint
  std::map<int64_t, int64_t> reduced_;  // reduction started
  int64_t reductions_ = 0, early_elements_ = 0;
};

// The bucket of parallel.grad_bucket_size `configured` elements (the gradient buckets' and the
// weight gather's); 0 gives Megatron's default, max(40M, 1M x dp) (larger buckets for more
// ranks, whose collectives take longer to start).
int64_t grad_bucket_elements(int64_t configured, int64_t dp);

// The parts of flat range r in a ZeRO-1 layout of `ranks` shards of `shard` elements, each with
// the rank that owns it, in ascending order.
struct OwnedPart {
  int64_t begin, end;
  int owner;
};
std::vector<OwnedPart> owned_parts(std::pair<int64_t, int64_t> r, int64_t shard, int ranks);

}  // namespace keel::parallel
