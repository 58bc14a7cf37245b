// The DP overlap's bookkeeping against a communicator that records what it is asked to do:
// the gradient buckets (train/parallel/grad_buckets.h: which elements reduce to which owner, in
// which order) and the weight gather (train/parallel/param_gather.h: which buckets broadcast
// from which owners, and where it waits). The end-to-end checks (the same bits as one
// reduce_scatter or all_gather, under every kind of layout) are test_multirank "[overlap]".
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "train/parallel/grad_buckets.h"
#include "train/parallel/param_gather.h"

using namespace keel;
using namespace keel::parallel;

namespace {

// A DP group of `size` ranks that only records: reductions as (first element, elements, root);
// broadcasts and joins, in order, as text ("b FIRST N ROOT", "join").
class RecordingComm final : public Comm {
 public:
  explicit RecordingComm(int size, const float* base) : size_(size), base_(base) {}
  using Call = std::tuple<int64_t, int64_t, int>;
  std::vector<Call> calls;
  std::vector<std::string> log;
  int joins = 0;

  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string_view name() const override { return "dp"; }
  Device device() const override { return Device::CPU; }
  void reduce_async(const Tensor& t, int root) override {
    calls.emplace_back(static_cast<const float*>(t.data) - base_, t.numel(), root);
  }
  void broadcast_async(const Tensor& t, int root) override {
    log.push_back("b " + std::to_string(static_cast<const float*>(t.data) - base_) + " " + std::to_string(t.numel()) +
                  " " + std::to_string(root));
  }
  void join_async() override {
    ++joins;
    log.push_back("join");
  }
  void reduce(const Tensor&, int) override { FAIL("the buckets reduce asynchronously"); }
  void all_reduce(const Tensor&, ReduceOp) override { FAIL("not used"); }
  void reduce_scatter(const Tensor&, const Tensor&) override { FAIL("not used"); }
  void all_gather(const Tensor&, const Tensor&) override { FAIL("not used"); }
  void broadcast(const Tensor&, int) override { FAIL("the weight gather broadcasts asynchronously"); }
  void send(const Tensor&, int) override { FAIL("not used"); }
  void recv(const Tensor&, int) override { FAIL("not used"); }
  void sendrecv(const Tensor&, int, const Tensor&, int) override { FAIL("not used"); }
  void barrier() override {}

 private:
  int size_;
  const float* base_;
};

using Call = RecordingComm::Call;
using Log = std::vector<std::string>;

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

TEST_CASE("weight gather: buckets cut at group ends start one ahead of the forward", "[parallel][overlap]") {
  // 2 ranks, shards of 20: rank 0 owns [0, 20), rank 1 [20, 40) (the last 2 elements padding).
  // Groups end at 5 (embedding), 12, 19, 26, 33 (layers) and 38 (head); buckets of 10 at least
  // cut at 12, 26 and 38, and the last runs to the buffer's end: [0, 12) [12, 26) [26, 38) [38, 40).
  std::vector<float> w(40);
  RecordingComm dp(2, w.data());
  ParamGather g(dp, Tensor(w.data(), DType::F32, {40}), 20, 10, {19, 5, 12, 33, 26, 38});
  CHECK(g.bucket_ends() == std::vector<int64_t>{12, 26, 38, 40});
  CHECK_FALSE(g.pending());
  g.need(40);  // before any update: nothing to wait for
  CHECK(dp.log.empty());

  g.begin();  // after the optimizer: bucket 0 from its owner
  CHECK(dp.log == Log{"b 0 12 0"});
  CHECK(g.pending());
  g.need(5);  // the embedding: waits for bucket 0, starts bucket 1 (split at the shard edge)
  CHECK(dp.log == Log{"b 0 12 0", "join", "b 12 8 0", "b 20 6 1"});
  g.need(12);  // layer 0: in bucket 0, already waited for
  CHECK(dp.log.size() == 4);
  g.need(19);  // layer 1: bucket 1
  g.need(26);
  g.need(33);  // layer 3: bucket 2; bucket 3 starts
  g.need(38);
  CHECK(dp.log == Log{"b 0 12 0", "join", "b 12 8 0", "b 20 6 1", "join", "b 26 12 1", "join", "b 38 2 1"});
  CHECK(g.pending());  // bucket 3 was started, not waited for
  CHECK(g.broadcasts() == 0);  // no gather completed yet
  g.settle();
  CHECK(dp.log.back() == "join");
  CHECK_FALSE(g.pending());
  CHECK(g.broadcasts() == 5);
  CHECK(g.overlapped_elements() == 14 + 12 + 2);  // buckets 1 to 3 moved ahead of their need

  // Every element moved once, from its owner.
  std::vector<int> times(40, 0);
  for (const std::string& e : dp.log) {
    if (e == "join") continue;
    long long first = 0, n = 0;
    int root = -1;
    REQUIRE(std::sscanf(e.c_str(), "b %lld %lld %d", &first, &n, &root) == 3);
    for (long long i = first; i < first + n; ++i) {
      ++times[static_cast<size_t>(i)];
      CHECK(root == i / 20);
    }
  }
  CHECK(times == std::vector<int>(40, 1));

  // The next update: settled at once (a checkpoint before the next forward), nothing ahead.
  dp.log.clear();
  g.begin();
  g.settle();
  CHECK(dp.log == Log{"b 0 12 0", "b 12 8 0", "b 20 6 1", "b 26 12 1", "b 38 2 1", "join"});
  CHECK(g.overlapped_elements() == 0);
  CHECK(g.broadcasts() == 5);
}

TEST_CASE("weight gather: a need past several buckets starts and waits for all of them", "[parallel][overlap]") {
  std::vector<float> w(40);
  RecordingComm dp(2, w.data());
  ParamGather g(dp, Tensor(w.data(), DType::F32, {40}), 20, 10, {5, 12, 19, 26, 33, 38});
  g.begin();
  g.need(30);  // buckets 0 to 2 (2 started here, not ahead), then bucket 3 ahead
  CHECK(dp.log == Log{"b 0 12 0", "b 12 8 0", "b 20 6 1", "b 26 12 1", "join", "b 38 2 1"});
  g.need(40);  // the end: bucket 3, and the gather is complete
  CHECK(dp.log.back() == "join");
  CHECK_FALSE(g.pending());
  CHECK(g.overlapped_elements() == 2);
  g.settle();  // nothing left
  CHECK(dp.joins == 2);
  // A new update while the last is pending is a bug in the caller.
  g.begin();
  CHECK_THROWS_WITH(g.begin(), Catch::Contains("previous gather was not settled"));
}

TEST_CASE("weight gather: one bucket when it holds everything, and bad layouts are refused", "[parallel][overlap]") {
  std::vector<float> w(8);
  RecordingComm dp(2, w.data());
  ParamGather g(dp, Tensor(w.data(), DType::F32, {8}), 4, 40'000'000, {2, 5, 8});
  CHECK(g.bucket_ends() == std::vector<int64_t>{8});
  g.begin();
  g.need(2);
  CHECK(dp.log == Log{"b 0 4 0", "b 4 4 1", "join"});
  CHECK(g.overlapped_elements() == 0);
  CHECK_FALSE(g.pending());

  CHECK_THROWS_WITH(ParamGather(dp, Tensor(w.data(), DType::F32, {8}), 3, 4, {}),
                    Catch::Contains("is not 2 shards of 3 elements"));
  CHECK_THROWS_WITH(ParamGather(dp, Tensor(w.data(), DType::F32, {8}), 4, 0, {}), Catch::Contains("at least one element"));
  CHECK_THROWS_WITH(ParamGather(dp, Tensor(w.data(), DType::F32, {8}), 4, 2, {3, 9}),
                    Catch::Contains("group end 9 is outside the weight buffer of 8"));
}
