#include "model/grad_writes.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

namespace keel {

GradWrites::GradWrites(Backend& be, const Tensor& flat) : be_(be), flat_(flat.elements(0, flat.numel())) {
  if (flat.dtype != DType::F32)
    throw std::invalid_argument("GradWrites: the gradient buffer must be f32, not " + flat.shape_str());
  finish_step();  // until a step begins, ops add (what a caller that zero-fills itself expects)
}

void GradWrites::begin_step() { written_.clear(); }

GradWrites::Range GradWrites::range_of(const Tensor& g) const {
  const auto* base = static_cast<const char*>(flat_.data);
  const auto* p = static_cast<const char*>(g.data);
  const int64_t bytes = p - base;
  if (g.dtype != DType::F32 || g.device != flat_.device || p < base || bytes % 4 != 0 ||
      bytes / 4 + g.numel() > flat_.numel())
    throw std::logic_error("GradWrites: " + g.shape_str() + " is not a view of the gradient buffer " +
                           flat_.shape_str());
  return {bytes / 4, bytes / 4 + g.numel()};
}

bool GradWrites::untouched(Range r) const {
  auto it = written_.upper_bound(r.begin);  // the first range starting after r.begin
  if (it != written_.end() && it->first < r.end) return false;
  return it == written_.begin() || std::prev(it)->second <= r.begin;
}

void GradWrites::mark(Range r) {
  if (r.begin >= r.end) return;
  // Merge with every range that overlaps or touches [r.begin, r.end).
  auto it = written_.upper_bound(r.begin);
  if (it != written_.begin() && std::prev(it)->second >= r.begin) {
    if (std::prev(it)->second >= r.end) return;  // already covered: every later contribution
    --it;
  }
  while (it != written_.end() && it->first <= r.end) {
    r.begin = std::min(r.begin, it->first);
    r.end = std::max(r.end, it->second);
    it = written_.erase(it);
  }
  written_.emplace(r.begin, r.end);
}

void GradWrites::zero_unwritten(Range r) {
  int64_t at = r.begin;
  auto it = written_.upper_bound(r.begin);
  if (it != written_.begin() && std::prev(it)->second > r.begin) at = std::prev(it)->second;
  for (; at < r.end; ++it) {
    const int64_t gap_end = it == written_.end() ? r.end : std::min(r.end, it->first);
    if (gap_end > at) be_.fill(flat_.elements(at, gap_end), 0.0f);
    if (it == written_.end()) break;
    at = std::max(at, it->second);
  }
  mark(r);
}

bool GradWrites::must_add(std::initializer_list<Tensor> grads) {
  bool all_untouched = true;
  for (const Tensor& g : grads)
    if (!g.empty() && !untouched(range_of(g))) all_untouched = false;
  for (const Tensor& g : grads) {
    if (g.empty()) continue;
    if (all_untouched)
      mark(range_of(g));
    else
      zero_unwritten(range_of(g));
  }
  return !all_untouched;
}

void GradWrites::prepare_to_add(const Tensor& g) {
  if (!g.empty()) zero_unwritten(range_of(g));
}

void GradWrites::finish_step() { zero_unwritten({0, flat_.numel()}); }

int64_t GradWrites::written() const {
  int64_t n = 0;
  for (const auto& [b, e] : written_) n += e - b;
  return n;
}

}  // namespace keel
