// The straggler report through the real binary: under mpirun, one rank made slow (the test-only
// KEEL_FAULT_SLOW_RANK sleeps in its forward-backward, as a throttled GPU would compute) is
// named by world rank, grid position and host, while its peers' waits show as communication.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <numeric>

#include "common/process.h"
#include "common/workspace.h"

using namespace keel;
namespace fs = std::filesystem;

namespace {
nlohmann::json patch() {
  return {{"model", {{"n_layers", 2}}},
          {"train", {{"steps", 4}, {"global_batch", 16}, {"micro_batch", 2}, {"eval_interval", 0}, {"eval_batches", 0}}},
          {"log", {{"timers_interval_s", 0}}},
          {"checkpoint", {{"save_at_end", false}}}};
}

struct TimedStep {
  int64_t step;
  std::vector<int> stragglers;  // world ranks
  nlohmann::json ms;            // per column: min, max, max_rank
};

// The timers records of a run's metrics.
std::vector<TimedStep> timers_records(const std::string& path) {
  std::vector<TimedStep> out;
  for (const auto& rec : test::read_metrics(path)) {
    if (rec.value("event", "") != "timers") continue;
    TimedStep t{rec["step"].get<int64_t>(), {}, rec["ms"]};
    if (rec.contains("stragglers"))
      for (const auto& g : rec["stragglers"]) t.stragglers.push_back(g["rank"].get<int>());
    out.push_back(t);
  }
  return out;
}

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }
}  // namespace

TEST_CASE("a slow rank is named as a straggler with its grid position, and its peers' wait is communication",
          "[mpi][timers]") {
  test::Workspace ws(patch());
  SECTION("dp = 2: the slow replica") {
    const auto r = test::run_keel_mpi(
        2, "train --config " + ws.config + " --out " + (ws.dir / "dp2") + " --set parallel.dp=2",
        "KEEL_FAULT_SLOW_RANK=rank=1,ms=300");
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("keel: timers at step 2 (ms, min-max over 2 ranks): step "));
    CHECK_THAT(r.output, Catch::Contains("keel: WARNING straggler: world rank 1 (tp 0, pp 0, dp 1, host ") &&
                             Catch::Contains("of a typical rank of pipeline stage 0 (2 ranks), slow at 2 timed steps "
                                             "in a row"));
    const auto recs = timers_records(ws.dir / "dp2/metrics.jsonl");
    REQUIRE(recs.size() == 3);  // steps 2, 3, 4
    for (const TimedStep& t : recs) {
      INFO("step " << t.step << ": " << t.ms.dump());
      CHECK(t.stragglers == std::vector<int>{1});
      CHECK(t.ms["compute"]["max_rank"] == 1);
      // The other replica waits for it in the DP reductions: 4 micro-batches x 300 ms.
      CHECK(t.ms["dp-comm"]["max_rank"] == 0);
      CHECK(t.ms["dp-comm"]["max"].get<double>() >= 900);
    }
  }
  SECTION("tp = 2, dp = 2: its TP peer waits in tp-comm, so only the slow rank computes long") {
    const auto r = test::run_keel_mpi(
        4, "train --config " + ws.config + " --out " + (ws.dir / "tp2dp2") + " --set parallel.tp=2 --set parallel.dp=2",
        "KEEL_FAULT_SLOW_RANK=rank=2,ms=300");
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("| tp-comm ") && Catch::Contains("| compute "));
    CHECK_THAT(r.output, Catch::Contains("keel: WARNING straggler: world rank 2 (tp 0, pp 0, dp 1, host ") &&
                             Catch::Contains("pipeline stage 0 (4 ranks)"));
    // The slow rank is named at every timed step and computes longest. Its TP peer (rank 3)
    // waits for it inside forward-backward, and that wait is booked as tp-comm, not compute.
    // (On 2 shared cores, a peer may be named too when the busy-waiting ranks crowd it out.)
    const auto recs = timers_records(ws.dir / "tp2dp2/metrics.jsonl");
    REQUIRE(recs.size() == 3);
    for (const TimedStep& t : recs) {
      INFO("step " << t.step << ": " << t.ms.dump());
      CHECK(contains(t.stragglers, 2));
      CHECK(t.ms["compute"]["max_rank"] == 2);
      CHECK(t.ms["tp-comm"]["max"].get<double>() >= 900);
      CHECK(t.ms["tp-comm"]["max_rank"] != 2);
    }
  }
}

TEST_CASE("a pipeline stage that computes far longer than the others is told the split that evens it, once",
          "[mpi][timers][pipeline]") {
  // pp = 4 over 8 layers. The test fault makes every layer cost 5 ms a micro-batch on every rank
  // and the last stage 10 ms more (as a heavy head would compute: two layers' worth), so the
  // stages compute 80, 80, 80 and 160 ms a step of 8 micro-batches. From the second timed step
  // in a row the log gives a parallel.pipeline_layers that takes a layer off the last stage,
  // once, and the metrics the measurement. Interleaved (2 chunks a rank, a layer each), a stage
  // is a rank, and the split lists all 8 virtual stages in model order.
  nlohmann::json p = patch();
  p["model"]["n_layers"] = 8;
  p["train"]["steps"] = 5;
  test::Workspace ws(p);
  const std::string fault = "KEEL_FAULT_SLOW_RANK=rank=3,ms=10,per_layer_ms=5";
  struct Case {
    std::string name, sets, slowest;
    std::vector<int> now;
  };
  for (const Case& c : {Case{"pp4", " --set parallel.pp=4", "stage 3 (2 layers + head)", {2, 2, 2, 2}},
                        Case{"v2", " --set parallel.pp=4 --set parallel.virtual_stages=2",
                             "stage 3 (2 layers in 2 chunks + head)", {1, 1, 1, 1, 1, 1, 1, 1}}}) {
    INFO(c.name);
    const auto r = test::run_keel_mpi(4, "train --config " + ws.config + " --out " + (ws.dir / c.name) + c.sets, fault);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("keel: pipeline balance at step 3: a step's compute takes ") &&
                             Catch::Contains("ms a pipeline stage, " + c.slowest + " the slowest, a layer about "));
    std::vector<nlohmann::json> told;
    for (const auto& rec : test::read_metrics(ws.dir / (c.name + "/metrics.jsonl")))
      if (rec.value("event", "") == "pipeline_balance") told.push_back(rec);
    REQUIRE(told.size() == 1);  // once a run
    CHECK(told[0]["step"] == 3);
    CHECK(told[0]["pipeline_layers_now"] == nlohmann::json(c.now));
    const std::vector<int> split = told[0]["pipeline_layers"];
    REQUIRE(split.size() == c.now.size());
    CHECK(std::accumulate(split.begin(), split.end(), 0) == 8);
    int last_rank = 0;  // its virtual stages: 3, 7, ...
    for (size_t i = 3; i < split.size(); i += 4) last_rank += split[i];
    CHECK(last_rank < 2);
    for (size_t i = 1; i + 1 < split.size(); ++i) CHECK(split[i] >= 1);
    CHECK(told[0]["stage_compute_ms"][3].get<double>() >= 160);
    CHECK(told[0]["slowest_after_ms"].get<double>() <= 0.9 * told[0]["stage_compute_ms"][3].get<double>());
    // Under the split it gave, no split computes 10% faster: nothing to tell.
    const auto again = test::run_keel_mpi(4, "train --config " + ws.config + " --out " + (ws.dir / (c.name + "split")) +
                                                 c.sets + " --set parallel.pipeline_layers=" + nlohmann::json(split).dump(),
                                          fault);
    INFO(again.output);
    REQUIRE(again.code == 0);
    CHECK_THAT(again.output, Catch::Contains("keel: timers at step 5") && !Catch::Contains("pipeline balance"));
  }
}
