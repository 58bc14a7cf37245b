#include "train/parallel/param_gather.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "train/parallel/grad_buckets.h"

namespace keel::parallel {

ParamGather::ParamGather(Comm& dp, const Tensor& working, int64_t shard, int64_t bucket, std::vector<int64_t> group_ends)
    : dp_(dp), working_(working.elements(0, working.numel())), shard_(shard), bucket_(bucket) {
  if (shard < 0 || working.numel() != shard * dp.size())
    throw std::invalid_argument("ParamGather: the weight buffer " + working.shape_str() + " is not " +
                                std::to_string(dp.size()) + " shards of " + std::to_string(shard) + " elements");
  if (bucket < 1) throw std::invalid_argument("ParamGather: the bucket must hold at least one element");
  std::sort(group_ends.begin(), group_ends.end());
  const int64_t n = working_.numel();
  for (int64_t e : group_ends) {
    if (e < 0 || e > n)
      throw std::invalid_argument("ParamGather: group end " + std::to_string(e) + " is outside the weight buffer of " +
                                  std::to_string(n));
    if (e - bucket_begin(ends_.size()) >= bucket && e < n) ends_.push_back(e);
  }
  // The last bucket runs to the buffer's end (the padding of the last shard included, so the
  // buffer is the all_gather's to the last byte).
  if (n > 0) ends_.push_back(n);
  started_ = joined_ = ends_.size();  // nothing to gather before the first update
}

void ParamGather::start(bool ahead) {
  const size_t k = started_++;
  const int64_t b = bucket_begin(k), e = ends_[k];
  for (const OwnedPart& p : owned_parts({b, e}, shard_, dp_.size())) {
    dp_.broadcast_async(working_.elements(p.begin, p.end), p.owner);
    ++now_.broadcasts;
  }
  if (ahead) now_.overlapped += e - b;
}

void ParamGather::join() {
  dp_.join_async();
  joined_ = started_;
  if (joined_ == ends_.size()) done_ = now_;
}

void ParamGather::begin() {
  if (pending())
    throw std::logic_error("ParamGather::begin: the previous gather was not settled (bucket " + std::to_string(joined_) +
                           " of " + std::to_string(ends_.size()) + " not waited for)");
  if (ends_.empty()) return;
  started_ = joined_ = 0;
  now_ = Counts{};
  start(false);
}

void ParamGather::need(int64_t end) {
  if (!pending()) return;
  const size_t k = static_cast<size_t>(std::lower_bound(ends_.begin(), ends_.end(), end) - ends_.begin());
  if (k < joined_) return;
  while (started_ <= k && started_ < ends_.size()) start(false);  // not started ahead: waited for at once
  join();
  if (started_ < ends_.size()) start(true);  // moves while the caller's group computes
}

void ParamGather::settle() {
  if (!pending()) return;
  while (started_ < ends_.size()) start(false);
  join();
}

}  // namespace keel::parallel
