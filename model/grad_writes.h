// Which elements of the flat fp32 gradient buffer a training step has written so far.
//
// The first op of a step to produce a parameter's gradient stores it (a weight-gradient matmul
// with beta = 0, a norm or bias gradient written rather than added); later contributions (more
// micro-batches, the tied head and embedding) add to it. A step then needs no zero fill of the
// whole buffer (4 bytes a parameter: 5 GB, 1.6 ms of H100 bandwidth on a 1.2B model), and its
// weight-gradient matmuls do not read that zero back. finish_step zero-fills whatever no op
// wrote, so the reductions after it always see a whole, current gradient.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>

#include "kernels/backend.h"

namespace keel {

class GradWrites {
 public:
  // flat: the F32 gradient buffer that every view handed in below lies inside.
  GradWrites(Backend& be, const Tensor& flat);

  void begin_step();  // nothing written yet

  // For an op that produces the gradients `grads` (views of the buffer; empty ones are
  // skipped) and can either store or add: must it add? false when none of them was written
  // this step: the op stores, and they count as written from now on. Otherwise true, after
  // zero-filling whatever part of them was not written yet.
  bool must_add(std::initializer_list<Tensor> grads);
  bool must_add(const Tensor& g) { return must_add({g}); }
  // For an op that can only add (a scatter, such as embedding_backward): zero-fills what of g
  // is not written yet; g counts as written from now on.
  void prepare_to_add(const Tensor& g);

  // Zero-fills every element not written since begin_step (gradients no op produced, padding).
  // Until the next begin_step everything counts as written, so ops add.
  void finish_step();

  // Elements written since begin_step (for tests).
  int64_t written() const;

 private:
  struct Range {
    int64_t begin, end;
  };
  Range range_of(const Tensor& g) const;
  bool untouched(Range r) const;       // no element of r written
  void zero_unwritten(Range r);        // fill the gaps of r, then mark r
  void mark(Range r);

  Backend& be_;
  Tensor flat_;
  std::map<int64_t, int64_t> written_;  // disjoint, non-adjacent [begin, end), keyed by begin
};

}  // namespace keel
