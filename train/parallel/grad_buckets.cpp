#include "train/parallel/grad_buckets.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

namespace keel::parallel {

int64_t grad_bucket_elements(int64_t configured, int64_t dp) {
  return configured > 0 ? configured : std::max<int64_t>(40'000'000, int64_t{1'000'000} * dp);
}

std::vector<OwnedPart> owned_parts(std::pair<int64_t, int64_t> r, int64_t shard, int ranks) {
  std::vector<OwnedPart> parts;
  if (shard == 0) return parts;
  for (int owner = static_cast<int>(r.first / shard); owner < ranks; ++owner) {
    const int64_t b = std::max(r.first, owner * shard), e = std::min(r.second, (owner + 1) * shard);
    if (b >= e) break;
    parts.push_back({b, e, owner});
  }
  return parts;
}

namespace {
std::string text(GradBuckets::Range r) { return "[" + std::to_string(r.first) + ", " + std::to_string(r.second) + ")"; }

bool overlaps(const std::map<int64_t, int64_t>& set, GradBuckets::Range r) {
  auto it = set.lower_bound(r.second);  // the first range starting at or after r's end
  return it != set.begin() && std::prev(it)->second > r.first;
}
}  // namespace

GradBuckets::GradBuckets(Comm& dp, const Tensor& grads, int64_t shard, int64_t bucket, std::vector<Range> deferred)
    : dp_(dp), grads_(grads.elements(0, grads.numel())), shard_(shard), bucket_(bucket), deferred_(std::move(deferred)) {
  if (shard < 0 || grads.numel() != shard * dp.size())
    throw std::invalid_argument("GradBuckets: the gradient buffer " + grads.shape_str() + " is not " +
                                std::to_string(dp.size()) + " shards of " + std::to_string(shard) + " elements");
  if (bucket < 1) throw std::invalid_argument("GradBuckets: the bucket must hold at least one element");
  std::sort(deferred_.begin(), deferred_.end());
  for (size_t i = 0; i < deferred_.size(); ++i)
    if (deferred_[i].first > deferred_[i].second || deferred_[i].first < 0 || deferred_[i].second > grads.numel() ||
        (i > 0 && deferred_[i - 1].second > deferred_[i].first))
      throw std::invalid_argument("GradBuckets: deferred range " + text(deferred_[i]) +
                                  " is empty-reversed, outside the buffer, or overlaps another");
}

void GradBuckets::begin_step() {
  pending_.clear();
  reduced_.clear();
  reductions_ = early_elements_ = 0;
}

void GradBuckets::insert(std::map<int64_t, int64_t>& set, Range r) {
  auto it = set.upper_bound(r.first);
  if (it != set.begin() && std::prev(it)->second >= r.first) --it;
  while (it != set.end() && it->first <= r.second) {
    r.first = std::min(r.first, it->first);
    r.second = std::max(r.second, it->second);
    it = set.erase(it);
  }
  set.emplace(r.first, r.second);
}

void GradBuckets::ready(int64_t begin, int64_t end) {
  if (begin < 0 || end > grads_.numel() || begin > end)
    throw std::logic_error("GradBuckets::ready: " + text({begin, end}) + " is outside the gradient buffer of " +
                           std::to_string(grads_.numel()));
  // The parts outside the deferred ranges.
  std::vector<Range> parts;
  int64_t at = begin;
  for (const Range& d : deferred_) {
    if (d.second <= at || d.first >= end) continue;
    if (d.first > at) parts.push_back({at, d.first});
    at = std::max(at, d.second);
  }
  if (at < end) parts.push_back({at, end});

  for (const Range& p : parts) {
    if (overlaps(pending_, p) || overlaps(reduced_, p))
      throw std::logic_error("GradBuckets::ready: gradients " + text(p) + " were reported final twice in one step");
    insert(pending_, p);
    auto run = std::prev(pending_.upper_bound(p.first));  // the merged run holding p
    if (run->second - run->first < bucket_) continue;
    const Range r{run->first, run->second};
    pending_.erase(run);
    reduce(r);
    early_elements_ += r.second - r.first;
  }
}

void GradBuckets::reduce(Range r) {
  insert(reduced_, r);
  for (const OwnedPart& p : owned_parts(r, shard_, dp_.size())) {
    dp_.reduce_async(grads_.elements(p.begin, p.end), p.owner);
    ++reductions_;
  }
}

void GradBuckets::finish() {
  // The gaps between the reductions already started, in ascending order (every DP rank alike).
  std::vector<Range> gaps;
  int64_t at = 0;
  for (const auto& [b, e] : reduced_) {
    if (b > at) gaps.push_back({at, b});
    at = std::max(at, e);
  }
  if (at < grads_.numel()) gaps.push_back({at, grads_.numel()});
  for (const Range& g : gaps) reduce(g);
  pending_.clear();
  dp_.join_async();
}

}  // namespace keel::parallel
