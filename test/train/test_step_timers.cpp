// Step timers and the straggler report (train/step_timers.h): what a timed communicator call
// books and where, the device drains around phases, the summary over ranks, and the real
// binary's timers line and metrics records.
#include <catch2/catch.hpp>

#include <chrono>
#include <thread>

#include "common/batches.h"
#include "common/process.h"
#include "common/run_config.h"
#include "common/workspace.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/param_table.h"
#include "train/step_timers.h"
#include "train/trainer.h"

using namespace keel;
using parallel::GroupKind;

namespace {

// A communicator of `size` ranks whose all-reduce takes `ms` and that counts its device waits.
class SlowComm final : public parallel::Comm {
 public:
  SlowComm(int size, int ms) : size_(size), ms_(ms) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string_view name() const override { return "dp"; }
  Device device() const override { return Device::CPU; }
  void all_reduce(const Tensor&, parallel::ReduceOp) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    ++calls;
  }
  void reduce_scatter(const Tensor&, const Tensor&) override { ++calls; }
  void reduce(const Tensor&, int) override { ++calls; }
  void all_gather(const Tensor&, const Tensor&) override { ++calls; }
  void broadcast(const Tensor&, int) override { ++calls; }
  void send(const Tensor&, int) override { ++calls; }
  void recv(const Tensor&, int) override { ++calls; }
  void sendrecv(const Tensor&, int, const Tensor&, int) override { ++calls; }
  void barrier() override { ++calls; }
  void wait_idle() override { ++waits; }
  int calls = 0, waits = 0;

 private:
  int size_, ms_;
};

double column(const std::vector<double>& ms, const std::string& name) {
  const auto& cols = StepTimers::columns();
  const auto it = std::find(cols.begin(), cols.end(), name);
  REQUIRE(it != cols.end());
  return ms[static_cast<size_t>(it - cols.begin())];
}

RankTimes rank_times(int rank, int pp, double compute_ms, double dp_comm_ms = 1.0) {
  RankTimes r;
  r.world_rank = rank;
  r.pp = pp;
  r.dp = rank % 4;
  r.host = "node" + std::to_string(rank / 4);
  r.ms.assign(StepTimers::columns().size(), 0.0);
  const auto& cols = StepTimers::columns();
  auto set = [&](const std::string& name, double v) {
    r.ms[static_cast<size_t>(std::find(cols.begin(), cols.end(), name) - cols.begin())] = v;
  };
  set("step", 100 + compute_ms);
  set("forward-backward", compute_ms + 2);
  set("compute", compute_ms);
  set("optimizer", 3);
  set("dp-comm", dp_comm_ms);
  return r;
}

}  // namespace

TEST_CASE("a timed communicator call is booked to its group and its phase, untimed calls are not",
          "[timers]") {
  int drains = 0;
  StepTimers timers([&] { ++drains; });
  SlowComm slow(2, 30);
  TimedComm dp(slow, GroupKind::DP, timers);
  const Tensor none(nullptr, DType::F32, {0}, Device::CPU);

  timers.start_step(false);
  {
    const StepTimers::Scope s = timers.phase(StepTimers::ForwardBackward);
    dp.all_reduce(none);
  }
  CHECK(slow.calls == 1);
  CHECK(slow.waits == 0);  // an untimed step never waits for the device
  CHECK(drains == 0);
  for (double x : timers.sample(0)) CHECK(x == 0);

  timers.start_step(true);
  {
    const StepTimers::Scope s = timers.phase(StepTimers::ForwardBackward);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // "compute"
    dp.all_reduce(none);                                          // 30 ms of communication
  }
  {
    const StepTimers::Scope s = timers.phase(StepTimers::Optimizer);
    dp.all_reduce(none);
  }
  CHECK(slow.waits == 4);  // before and after each timed call
  CHECK(drains == 4);      // at the start and end of each phase
  const std::vector<double> ms = timers.sample(123.0);
  REQUIRE(ms.size() == StepTimers::columns().size());
  CHECK(column(ms, "step") == 123.0);
  const double fb = column(ms, "forward-backward"), comm = column(ms, "dp-comm"), compute = column(ms, "compute");
  INFO("forward-backward " << fb << " ms, dp-comm " << comm << " ms, compute " << compute << " ms");
  CHECK(comm >= 60.0);                         // both calls, whatever phase they were in
  CHECK(fb >= 50.0);
  // Only the first call was inside forward-backward: compute is the sleep before it (and the
  // drains' bookkeeping), not the communication.
  CHECK(compute >= 20.0);
  CHECK(compute <= fb - 30.0);
  CHECK(column(ms, "optimizer") >= 30.0);
  CHECK(column(ms, "tp-comm") == 0);

  // A group of one rank does not communicate: never timed, never waited on.
  SlowComm alone(1, 0);
  TimedComm one(alone, GroupKind::TP, timers);
  timers.start_step(true);
  one.all_reduce(none);
  CHECK(alone.calls == 1);
  CHECK(alone.waits == 0);
  CHECK(column(timers.sample(0), "tp-comm") == 0);
}

TEST_CASE("the timers summary gives each column's spread and names the slow rank of a stage",
          "[timers]") {
  // pp = 2, four ranks per stage. Stage 1 does more work (the head) and is not a straggler for
  // it; rank 6 is 1.6x its stage.
  std::vector<RankTimes> ranks;
  for (int r = 0; r < 8; ++r) ranks.push_back(rank_times(r, r / 4, r < 4 ? 50.0 : (r == 6 ? 128.0 : 80.0)));
  const TimersSummary s = summarize_timers(ranks, 42, 1.25);
  INFO(s.line);
  CHECK_THAT(s.line, Catch::StartsWith("timers at step 42 (ms, min-max over 8 ranks): step 150.0-228.0 | "
                                       "forward-backward 52.0-130.0 | compute 50.0-128.0 (rank 6) | optimizer "
                                       "3.00-3.00 | dp-comm 1.00-1.00"));
  CHECK_THAT(s.line, !Catch::Contains("data") && !Catch::Contains("tp-comm"));  // all zero: left out
  REQUIRE(s.stragglers.size() == 1);
  CHECK(s.stragglers[0].world_rank == 6);
  CHECK(s.stragglers[0].median_ms == 80.0);
  CHECK(s.stragglers[0].peers == 4);
  CHECK(s.stragglers[0].text ==
        "world rank 6 (tp 0, pp 1, dp 2, host node1) computed for 128.0 ms at step 42, 1.60x the 80.0 ms of a typical "
        "rank of pipeline stage 1 (4 ranks)");
  CHECK(s.record["event"] == "timers");
  CHECK(s.record["step"] == 42);
  CHECK(s.record["ms"]["compute"]["max_rank"] == 6);
  CHECK(s.record["ms"]["compute"]["min"] == 50.0);
  CHECK(s.record["stragglers"][0]["rank"] == 6);
  CHECK(s.record["stragglers"][0]["host"] == "node1");

  SECTION("below the ratio, or 0 (off), nobody is named") {
    CHECK(summarize_timers(ranks, 42, 1.7).stragglers.empty());
    CHECK(summarize_timers(ranks, 42, 0).stragglers.empty());
    CHECK(!summarize_timers(ranks, 42, 0).record.contains("stragglers"));
  }
  SECTION("two ranks in a stage: the slower is compared with the faster") {
    const std::vector<RankTimes> two = {rank_times(0, 0, 10.0), rank_times(1, 0, 13.0)};
    const TimersSummary t = summarize_timers(two, 7, 1.25);
    REQUIRE(t.stragglers.size() == 1);
    CHECK(t.stragglers[0].world_rank == 1);
    CHECK(t.stragglers[0].median_ms == 10.0);
  }
  SECTION("a stage of one rank has nobody to compare with; tiny times are noise") {
    const std::vector<RankTimes> stages = {rank_times(0, 0, 10.0), rank_times(1, 1, 40.0)};
    CHECK(summarize_timers(stages, 7, 1.25).stragglers.empty());
    const std::vector<RankTimes> tiny = {rank_times(0, 0, 0.2), rank_times(1, 0, 0.9)};  // 4.5x but 0.7 ms
    CHECK(summarize_timers(tiny, 7, 1.25).stragglers.empty());
  }
  SECTION("one rank: plain numbers; compute is left out when nothing communicated inside forward-backward") {
    RankTimes one = rank_times(0, 0, 50.0, 0.0);
    one.ms[3] = one.ms[2];  // compute == forward-backward
    const TimersSummary t = summarize_timers({one}, 3, 1.25);
    CHECK(t.line == "timers at step 3 (ms): step 150.0 | forward-backward 52.0 | optimizer 3.00");
  }
  SECTION("a rank that sent the wrong number of values is named") {
    ranks[5].ms.pop_back();
    CHECK_THROWS_WITH(summarize_timers(ranks, 1, 1.25), Catch::Contains("world rank 5 sent 12 values for 13 columns"));
  }
}

TEST_CASE("timing a step changes nothing it computes", "[timers]") {
  const RunConfig cfg = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "bf16"}}}});
  auto be = make_cpu_backend();
  Trainer timed(cfg, *be), plain(cfg, *be);
  timed.init_weights();
  plain.init_weights();
  for (int it = 1; it <= 3; ++it) {
    const auto batches = test::learnable_batches(2, 4, 32, static_cast<uint32_t>(it));
    timed.timers().start_step(true);
    const StepStats a = timed.step(batches, it);
    const std::vector<RankTimes> times = timed.gather_timers(1.0);
    const StepStats b = plain.step(batches, it);
    CHECK(a.loss == b.loss);
    CHECK(a.grad_norm == b.grad_norm);
    REQUIRE(times.size() == 1);
    CHECK(times[0].ms.size() == StepTimers::columns().size());
    CHECK(column(times[0].ms, "forward-backward") > 0);
    CHECK(column(times[0].ms, "optimizer") > 0);
    CHECK(!timed.timers().timed());  // the gather ended the timing
  }
}

TEST_CASE("keel train prints a timers line on timed steps and records them in the metrics", "[timers][cli][e2e]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 5}}}, {"checkpoint", {{"save_at_end", false}}}});
  const auto r = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "t") +
                                " --set log.timers_interval_s=0");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("keel: timers at step 2 (ms): step ") &&
                           Catch::Contains("keel: timers at step 5 (ms): step ") &&
                           !Catch::Contains("timers at step 1 "));  // the first step warms up
  int timed = 0;
  for (const auto& rec : test::read_metrics(ws.dir / "t/metrics.jsonl"))
    if (rec.value("event", "") == "timers") {
      ++timed;
      CHECK(rec["ms"]["forward-backward"]["max"].get<double>() > 0);
    }
  CHECK(timed == 4);

  // By default the run is timed at its second step, then about once a minute; off with log.timers.
  const auto d = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "d"));
  CHECK_THAT(d.output, Catch::Contains("timers at step 2 ") && !Catch::Contains("timers at step 3 "));
  const auto off = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "off") +
                                  " --set log.timers=false");
  REQUIRE(off.code == 0);
  CHECK_THAT(off.output, !Catch::Contains("timers at step"));
}

TEST_CASE("a pipeline whose stages' measured compute differs is told the split that evens it", "[timers][pipeline]") {
  // pp = 4, two DP ranks a stage, 4 layers each at 10 ms a layer; the last stage's head adds
  // 35 ms. Its peer straggles (90 ms): the stage's median is the typical rank's.
  std::vector<RankTimes> ranks;
  const double stage_ms[4] = {40, 40, 40, 75};
  for (int s = 0; s < 4; ++s)
    for (int d = 0; d < 2; ++d) ranks.push_back(rank_times(2 * s + d, s, s == 3 && d == 1 ? 90.0 : stage_ms[s]));
  const std::optional<PipelineBalance> b = pipeline_balance(ranks, {4, 4, 4, 4});
  REQUIRE(b);
  CHECK(b->stage_ms == std::vector<double>{40, 40, 40, 75});
  // 195 ms of work over 4 stages: 5 layers on each of the first three, 1 beside the head.
  CHECK(b->layers == std::vector<int>{5, 5, 5, 1});
  CHECK(b->slowest_after_ms == 50.0);
  CHECK(b->text ==
        "a step's compute takes 40.0-75.0 ms a pipeline stage, stage 3 (4 layers + head) the slowest, a layer about "
        "10.0 ms; parallel.pipeline_layers [5,5,5,1] would even them (slowest stage about 50.0 ms)");

  // The embedding's stage carries the load: layers move off the first stage instead.
  const std::vector<RankTimes> first = {rank_times(0, 0, 60), rank_times(1, 1, 30), rank_times(2, 2, 30),
                                        rank_times(3, 3, 30)};
  const std::optional<PipelineBalance> f = pipeline_balance(first, {3, 3, 3, 3});
  REQUIRE(f);
  CHECK(f->layers == std::vector<int>{0, 4, 4, 4});
  CHECK(f->text.find("stage 0 (3 layers + embedding) the slowest") != std::string::npos);

  // Within 10% of even, fewer than 3 stages (no middle stage to time a layer by), a stage nobody
  // reported, or the split already in place: nothing to tell.
  CHECK(!pipeline_balance({rank_times(0, 0, 40), rank_times(1, 1, 40), rank_times(2, 2, 40), rank_times(3, 3, 43)},
                          {4, 4, 4, 4}));
  CHECK(!pipeline_balance({rank_times(0, 0, 40), rank_times(1, 1, 75)}, {4, 4}));
  CHECK(!pipeline_balance({rank_times(0, 0, 40), rank_times(1, 1, 40), rank_times(3, 3, 75)}, {4, 4, 4, 4}));
  CHECK(!pipeline_balance({rank_times(0, 0, 50), rank_times(1, 1, 50), rank_times(2, 2, 50), rank_times(3, 3, 45)},
                          {5, 5, 5, 1}));

  // On a GPU each stage's layers stay within what its memory holds: with room for only 4 layers
  // on stage 0 (it keeps the most micro-batches in flight) the others take the rest.
  const std::optional<PipelineBalance> capped = pipeline_balance(ranks, {4, 4, 4, 4}, {4, 8, 8, 8});
  REQUIRE(capped);
  CHECK(capped->layers == std::vector<int>{4, 5, 5, 2});
  CHECK(capped->slowest_after_ms == 55.0);
  CHECK_THAT(capped->text, Catch::EndsWith("parallel.pipeline_layers [4,5,5,2] would even them as far as each "
                                           "stage's memory allows (keel plan) (slowest stage about 55.0 ms)"));
  // Caps that do not bind leave the advice and its text as they were; caps that hold no better
  // split, or fewer layers than the model has, give none.
  const std::optional<PipelineBalance> loose = pipeline_balance(ranks, {4, 4, 4, 4}, {16, 16, 16, 16});
  REQUIRE(loose);
  CHECK(loose->text == b->text);
  CHECK(!pipeline_balance(ranks, {4, 4, 4, 4}, {4, 4, 4, 4}));
  CHECK(!pipeline_balance(ranks, {4, 4, 4, 4}, {4, 4, 4, 3}));

  // Interleaved, 2 chunks a rank (virtual stages c * 4 + s, 2 layers each): the same ranks'
  // compute gives the same layers per rank, 5, 5, 5 and 1, spread over each rank's chunks.
  const std::optional<PipelineBalance> v = pipeline_balance(ranks, {2, 2, 2, 2, 2, 2, 2, 2}, {}, 2);
  REQUIRE(v);
  CHECK(v->layers == std::vector<int>{2, 2, 2, 1, 3, 3, 3, 0});
  CHECK(v->slowest_after_ms == 50.0);
  CHECK_THAT(v->text, Catch::Contains("stage 3 (4 layers in 2 chunks + head) the slowest") &&
                          Catch::Contains("parallel.pipeline_layers [2,2,2,1,3,3,3,0] would even them"));
  // (a list that is not a whole number of chunks a rank gives nothing)
  CHECK(!pipeline_balance(ranks, {2, 2, 2, 2, 2, 2, 2}, {}, 2));
}

TEST_CASE("balanced_pipeline_layers: each layer where it slows the pipeline least, a layer on every middle stage",
          "[pipeline]") {
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 8) == std::vector<int>{2, 2, 2, 2});
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 6) == std::vector<int>{1, 1, 2, 2});  // ties: later stages
  CHECK(balanced_pipeline_layers({0, 0, 0, 10}, 1, 8) == std::vector<int>{2, 3, 3, 0});
  CHECK(balanced_pipeline_layers({0, 0, 0, 100}, 1, 2) == std::vector<int>{0, 1, 1, 0});
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 1).empty());  // two middle stages, one layer
  CHECK(balanced_pipeline_layers({5}, 1, 7) == std::vector<int>{7});
  // The slowest stage is as fast as any split makes it: brute force over 3 stages and 9 layers.
  const std::vector<double> fixed = {0.5, 0.2, 3.7};
  const std::vector<int> got = balanced_pipeline_layers(fixed, 1.3, 9);
  auto slowest = [&](const std::vector<int>& l) {
    double m = 0;
    for (size_t s = 0; s < 3; ++s) m = std::max(m, fixed[s] + l[s] * 1.3);
    return m;
  };
  double best = 1e9;
  for (int a = 0; a <= 9; ++a)
    for (int b = 1; a + b <= 9; ++b) best = std::min(best, slowest({a, b, 9 - a - b}));
  CHECK(slowest(got) == best);
}

TEST_CASE("balanced_pipeline_layers over interleaved ranks: each rank's layers spread over its chunks", "[pipeline]") {
  // 4 ranks of 2 chunks (virtual stages c * 4 + s). Rank 0's first chunk and rank 3's last are the
  // model's ends and may hold none; every other virtual stage keeps a layer. The ranks' totals
  // are those of the 1F1B greedy on the same times (5, 5, 5, 1 here).
  CHECK(balanced_pipeline_layers({0, 0, 0, 10}, 1, 16, {}, 2) == std::vector<int>{2, 2, 2, 1, 3, 3, 3, 0});
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 16, {}, 2) == std::vector<int>{2, 2, 2, 2, 2, 2, 2, 2});
  // The fewest layers: one on each of the 6 middle virtual stages.
  CHECK(balanced_pipeline_layers({0, 0, 0, 100}, 1, 6, {}, 2) == std::vector<int>{0, 1, 1, 1, 1, 1, 1, 0});
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 5, {}, 2).empty());
  // Caps bound a rank's total: rank 0 holds 4, ranks 1 and 2 take 5 and 6.
  CHECK(balanced_pipeline_layers({0, 0, 0, 10}, 1, 16, {4, 16, 16, 16}, 2) == std::vector<int>{2, 2, 3, 1, 2, 3, 3, 0});
  // Against brute force over every split of 12 layers into 3 ranks of 3 chunks: the slowest rank
  // is as fast as any, and each rank's chunks differ by at most one layer (the model's ends aside).
  const std::vector<double> fixed = {0.7, 0.0, 2.2};
  const std::vector<int> got = balanced_pipeline_layers(fixed, 1.0, 12, {}, 3);
  REQUIRE(got.size() == 9);
  std::vector<int> rank(3, 0);
  for (size_t i = 0; i < 9; ++i) rank[i % 3] += got[i];
  CHECK(rank[0] + rank[1] + rank[2] == 12);
  double best = 1e9;
  for (int a = 2; a <= 12; ++a)
    for (int b = 3; a + b <= 10; ++b)
      best = std::min(best, std::max({fixed[0] + a, fixed[1] + b, fixed[2] + (12 - a - b)}));
  CHECK(std::max({fixed[0] + rank[0], fixed[1] + rank[1], fixed[2] + rank[2]}) == best);
  for (size_t i = 1; i + 1 < 9; ++i) CHECK(got[i] >= 1);
}

TEST_CASE("balanced_pipeline_layers within each stage's cap", "[pipeline]") {
  // Uncapped {2,3,3,0}; stage 0 holds one layer at most: stages 1 and 2 take the rest.
  CHECK(balanced_pipeline_layers({0, 0, 0, 10}, 1, 8, {1, 9, 9, 9}) == std::vector<int>{1, 3, 4, 0});
  // Caps that do not bind change nothing.
  CHECK(balanced_pipeline_layers({0, 0, 0, 10}, 1, 8, {8, 8, 8, 8}) == std::vector<int>{2, 3, 3, 0});
  // No split: caps that hold fewer layers than the model has, a middle stage that holds none, a
  // first stage whose embedding alone does not fit (-1), or a cap list of another length.
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 8, {2, 2, 2, 1}).empty());
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 8, {4, 0, 4, 4}).empty());
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 8, {-1, 8, 8, 8}).empty());
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 8, {8, 8, 8}).empty());
  CHECK(balanced_pipeline_layers({0, 0, 0, 0}, 1, 8, {2, 2, 2, 2}) == std::vector<int>{2, 2, 2, 2});
  // The slowest stage is as fast as any split within the caps makes it: brute force over 4
  // stages, 11 layers and every cap of up to 5 layers on the first two stages.
  const std::vector<double> fixed = {0.4, 0.1, 0.3, 2.9};
  auto slowest = [&](const std::vector<int>& l) {
    double m = 0;
    for (size_t s = 0; s < 4; ++s) m = std::max(m, fixed[s] + l[s] * 1.1);
    return m;
  };
  for (int c0 = 0; c0 <= 5; ++c0)
    for (int c1 = 1; c1 <= 5; ++c1) {
      const std::vector<int> caps = {c0, c1, 11, 11};
      const std::vector<int> got = balanced_pipeline_layers(fixed, 1.1, 11, caps);
      double best = 1e9;
      for (int a = 0; a <= c0; ++a)
        for (int b = 1; b <= c1; ++b)
          for (int c = 1; a + b + c <= 11; ++c) best = std::min(best, slowest({a, b, c, 11 - a - b - c}));
      INFO("caps " << c0 << ", " << c1);
      REQUIRE(got.size() == 4);
      CHECK(got[0] <= c0);
      CHECK(got[1] <= c1);
      CHECK(got[0] + got[1] + got[2] + got[3] == 11);
      CHECK(slowest(got) == best);
    }
}
