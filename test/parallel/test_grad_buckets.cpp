// The DP gradient buckets (train/parallel/grad_buckets.h) against a communicator that records
// what it is asked to reduce: which elements, to which owner, in which order. The end-to-end
// check (the same bits as one reduce_scatter, under every kind of layout) is test_multirank
// "[overlap]".
#include <catch2/catch.hpp>

#include <string>
#include <tuple>
#include <vector>

#include "train/parallel/grad_buckets.h"

using namespace keel;
using namespace keel::parallel;

namespace {

// A DP group of `size` ranks that only records reductions: (first element, elements, root).
class RecordingComm final : public Comm {
 public:
  explicit RecordingComm(int size, const float* base) : size_(size), base_(base) {}
  using Call = std::tuple<int64_t, int64_t, int>;
  std::vector<Call> calls;
  int joins = 0;

  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string_view name() const override { return "dp"; }
  Device device() const override { return Device::CPU; }
  void reduce_async(const Tensor& t, int root) override {
    calls.emplace_back(static_cast<const float*>(t.data) - base_, t.numel(), root);
  }
  void join_async() override { ++joins; }
  void reduce(const Tensor&, int) override { FAIL("GradBuckets reduces asynchronously"); }
  void all_reduce(const Tensor&, ReduceOp) override { FAIL("not used"); }
  void reduce_scatter(const Tensor&, const Tensor&) override { FAIL("not used"); }
  void all_gather(const Tensor&, const Tensor&) override { FAIL("not used"); }
  void broadcast(const Tensor&, int) override { FAIL("not used"); }
  void send(const Tensor&, int) override { FAIL("not used"); }
  void recv(const Tensor&, int) override { FAIL("not used"); }
  void sendrecv(const Tensor&, int, const Tensor&, int) override { FAIL("not used"); }
  void barrier() override {}

 private:
  int size_;
  const float* base_;
};

using Call = RecordingComm::Call;

}  // namespace

TEST_CASE("gradient buckets: final ranges reduce to their owners once a bucket is full", "[parallel][overlap]") {
  // 2 ranks, shards of 10: rank 0 owns [0, 10), rank 1 [10, 20). The first 3 elements (a tied
  // embedding) wait for finish(). Groups arrive top down, as backward finishes them.
  std::vector<float> grads(20);
  RecordingComm dp(2, grads.data());
  GradBuckets b(dp, Tensor(grads.data(), DType::F32, {20}), 10, 4, {{0, 3}});
  b.begin_step();
  b.ready(15, 20);  // 5 >= 4: reduced at once, all rank 1's
  CHECK(dp.calls == std::vector<Call>{{15, 5, 1}});
  b.ready(12, 15);  // 3 < 4: waits
  CHECK(dp.calls.size() == 1);
  b.ready(8, 12);  // joins the waiting run: [8, 15), split at the shard edge
  CHECK(dp.calls == std::vector<Call>{{15, 5, 1}, {8, 2, 0}, {10, 5, 1}});
  b.ready(0, 8);  // less the deferred [0, 3): [3, 8)
  CHECK(dp.calls.back() == Call{3, 5, 0});
  CHECK(b.reductions() == 4);
  CHECK(b.early_elements() == 17);
  CHECK(dp.joins == 0);
  b.finish();  // the deferred range, then the join
  CHECK(dp.calls.back() == Call{0, 3, 0});
  CHECK(dp.calls.size() == 5);
  CHECK(dp.joins == 1);
  CHECK(b.early_elements() == 17);

  // Every element was reduced exactly once, by its owner.
  std::vector<int> times(20, 0);
  for (const auto& [first, n, root] : dp.calls)
    for (int64_t i = first; i < first + n; ++i) {
      ++times[static_cast<size_t>(i)];
      CHECK(root == i / 10);
    }
  CHECK(times == std::vector<int>(20, 1));

  // The next step starts over.
  dp.calls.clear();
  b.begin_step();
  CHECK(b.reductions() == 0);
  b.ready(18, 20);
  b.finish();  // nothing was full: all of it at the end, one reduction per owner
  CHECK(dp.calls == std::vector<Call>{{0, 10, 0}, {10, 10, 1}});
  CHECK(b.early_elements() == 0);
}

TEST_CASE("gradient buckets: runs merge in either direction, and a range reported twice is a bug", "[parallel][overlap]") {
  std::vector<float> grads(12);
  RecordingComm dp(3, grads.data());
  GradBuckets b(dp, Tensor(grads.data(), DType::F32, {12}), 4, 6);
  b.begin_step();
  b.ready(2, 4);
  b.ready(6, 8);
  b.ready(4, 6);  // bridges both: [2, 8) = 6
  CHECK(dp.calls == std::vector<Call>{{2, 2, 0}, {4, 4, 1}});
  CHECK_THROWS_WITH(b.ready(7, 9), Catch::Contains("[7, 9)") && Catch::Contains("reported final twice"));
  CHECK_THROWS_WITH(b.ready(10, 13), Catch::Contains("outside the gradient buffer of 12"));
  b.ready(8, 12);
  b.finish();
  CHECK(dp.calls == std::vector<Call>{{2, 2, 0}, {4, 4, 1}, {0, 2, 0}, {8, 4, 2}});
}

TEST_CASE("gradient buckets: bucket 1 reduces every group on its own, and bad layouts are refused", "[parallel][overlap]") {
  std::vector<float> grads(8);
  RecordingComm dp(2, grads.data());
  GradBuckets b(dp, Tensor(grads.data(), DType::F32, {8}), 4, 1);
  b.begin_step();
  b.ready(6, 8);
  b.ready(5, 6);
  b.ready(0, 5);
  CHECK(dp.calls == std::vector<Call>{{6, 2, 1}, {5, 1, 1}, {0, 4, 0}, {4, 1, 1}});
  CHECK(b.early_elements() == 8);
  b.finish();  // nothing left: only the join
  CHECK(dp.calls.size() == 4);
  CHECK(dp.joins == 1);

  CHECK_THROWS_WITH(GradBuckets(dp, Tensor(grads.data(), DType::F32, {8}), 3, 4),
                    Catch::Contains("is not 2 shards of 3 elements"));
  CHECK_THROWS_WITH(GradBuckets(dp, Tensor(grads.data(), DType::F32, {8}), 4, 0),
                    Catch::Contains("at least one element"));
  CHECK_THROWS_WITH(GradBuckets(dp, Tensor(grads.data(), DType::F32, {8}), 4, 2, {{0, 3}, {2, 5}}),
                    Catch::Contains("overlaps another"));
}
