// The precision behaviour users hit on GPUs, reproduced with the CPU backend's bit-exact
// bf16/fp16 storage emulation.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "common/batches.h"
#include "common/run_config.h"
#include "train/trainer.h"

using namespace keel;

namespace {

std::vector<float> norm_gains(Trainer& tr, bool working) {
  std::vector<float> all(static_cast<size_t>(tr.table().local_numel()));
  if (working)
    tr.state().working_to_host(all.data());
  else
    tr.state().master_to_host(all.data());
  std::vector<float> out;
  for (const ParamSpec& p : tr.table().params())
    if (p.role == Role::Norm) out.insert(out.end(), all.begin() + p.offset, all.begin() + p.offset + p.numel);
  return out;
}

}  // namespace

TEST_CASE("bf16 without master weights freezes norm gains, the default bf16 policy trains them", "[train][precision]") {
  // Constant lr 1e-4: Adam's update is ~lr per step, far below bf16's spacing at 1.0 (2^-7).
  const nlohmann::json patch = {{"optimizer", {{"lr", 1e-4}, {"min_lr", 1e-4}, {"weight_decay", 0.0}}},
                                {"schedule", {{"warmup_steps", 0}, {"decay", "constant"}}}};
  auto batches = test::learnable_batches(2, 4, 32, 5);
  auto be = make_cpu_backend();
  const int steps = 80;

  nlohmann::json unsafe_patch = patch;
  unsafe_patch["precision"] = {{"mode", "bf16-unsafe-no-master"}};
  Trainer unsafe(test::make_config(test::tiny_run_json(), unsafe_patch), *be);
  unsafe.init_weights();
  REQUIRE_FALSE(unsafe.state().has_master());

  nlohmann::json safe_patch = patch;
  safe_patch["precision"] = {{"mode", "bf16"}};
  Trainer safe(test::make_config(test::tiny_run_json(), safe_patch), *be);
  safe.init_weights();
  REQUIRE(safe.state().has_master());

  std::vector<float> matrices_before(static_cast<size_t>(unsafe.table().local_numel()));
  unsafe.state().working_to_host(matrices_before.data());
  for (int s = 1; s <= steps; ++s) {
    REQUIRE_FALSE(unsafe.step(batches, s).skipped);
    REQUIRE_FALSE(safe.step(batches, s).skipped);
  }

  // Unsafe: every norm gain is still exactly 1.0 although its gradient was never zero...
  for (float g : norm_gains(unsafe, true)) REQUIRE(g == 1.0f);
  // ...while the small matrices (|w| ~ 0.02, bf16 spacing ~1e-4 there) did move.
  std::vector<float> matrices_after(matrices_before.size());
  unsafe.state().working_to_host(matrices_after.data());
  const ParamSpec& wq = unsafe.table().at("layers.0.attn.wq");
  int moved = 0;
  for (int64_t i = wq.offset; i < wq.offset + wq.numel; ++i) moved += matrices_after[i] != matrices_before[i];
  CHECK(moved > wq.numel / 2);

  // Default bf16: the fp32 masters of the gains moved by ~steps * lr, and the bf16 working
  // copies followed wherever the master crossed half a bf16 spacing (2^-8).
  auto master = norm_gains(safe, false);
  auto working = norm_gains(safe, true);
  double max_drift = 0;
  int working_moved = 0;
  for (size_t i = 0; i < master.size(); ++i) {
    max_drift = std::max(max_drift, std::abs(static_cast<double>(master[i]) - 1.0));
    working_moved += working[i] != 1.0f;
    REQUIRE(working[i] == round_to(DType::BF16, master[i]));  // the working copy is the master's rounding
  }
  INFO("largest norm-gain drift in the fp32 masters: " << max_drift);
  CHECK(max_drift > 4e-3);
  CHECK(working_moved > 0);
}

TEST_CASE("fp16 overflow: the scale backs off, overflowing steps are skipped and counted, training continues",
          "[train][precision]") {
  // An initial scale of 2^40 makes the scaled loss gradient overflow fp16 (max 65504) at once.
  const nlohmann::json patch = {
      {"precision",
       {{"mode", "fp16"},
        {"loss_scale", {{"initial", 1099511627776.0}, {"hysteresis", 1}, {"min", 1.0}, {"growth_interval", 1000}}}}},
      {"schedule", {{"warmup_steps", 0}, {"decay", "constant"}}},
      {"optimizer", {{"lr", 3e-3}, {"min_lr", 3e-3}}}};
  auto be = make_cpu_backend();
  Trainer tr(test::make_config(test::tiny_run_json(), patch), *be);
  tr.init_weights();
  auto batches = test::learnable_batches(2, 4, 32, 9);

  int skipped = 0, applied = 0;
  double first_applied_loss = 0, last_loss = 0;
  float prev_scale = tr.scaler().scale();
  for (int s = 1; s <= 60; ++s) {
    StepStats st = tr.step(batches, s);
    if (s == 1) CHECK(st.skipped);
    if (st.skipped) {
      ++skipped;
      CHECK(st.nonfinite);
      CHECK(tr.scaler().scale() == Approx(prev_scale / 2));  // hysteresis 1: cut at every overflow
    } else {
      if (applied == 0) first_applied_loss = st.loss;
      ++applied;
      CHECK(std::isfinite(st.grad_norm));
      last_loss = st.loss;
    }
    prev_scale = tr.scaler().scale();
  }
  INFO("skipped " << skipped << ", applied " << applied << ", final scale " << tr.scaler().scale());
  CHECK(skipped >= 10);  // 2^40 has to come down below ~2^21 before gradients fit in fp16
  CHECK(applied >= 20);
  CHECK(tr.state().adam_step == applied);  // skipped steps do not advance Adam
  CHECK(last_loss < first_applied_loss - 0.5);
}

TEST_CASE("fp16 loss scale at its minimum with a persistent overflow is reported with the op that overflowed",
          "[train][precision]") {
  // Also with activation recomputation: its rebuilt forward probes nothing, so the report still
  // names the original forward op.
  for (const char* recompute : {"none", "full"}) {
    INFO("train.recompute " << recompute);
    const nlohmann::json patch = {
        {"precision", {{"mode", "fp16"}, {"loss_scale", {{"initial", 4.0}, {"hysteresis", 1}, {"min", 2.0}}}}},
        {"train", {{"recompute", recompute}}}};
    auto be = make_cpu_backend();
    Trainer tr(test::make_config(test::tiny_run_json(), patch), *be);
    tr.init_weights();
    // Poison one weight so that every forward pass overflows regardless of the scale.
    std::vector<float> w(static_cast<size_t>(tr.table().local_numel()));
    tr.state().master_to_host(w.data());
    w[static_cast<size_t>(tr.table().at("layers.0.attn.wq").offset)] = 1e30f;
    tr.state().load_fp32(w.data());
    auto batches = test::learnable_batches(1, 4, 32, 3);
    StepStats first = tr.step(batches, 1);  // scale 4 -> 2
    CHECK(first.skipped);
    CHECK_FALSE(first.scale_exhausted);
    StepStats second = tr.step(batches, 2);  // at the minimum and still overflowing
    CHECK(second.skipped);
    CHECK(second.scale_exhausted);
    // The report names where the first inf appeared: the poisoned weight's matmul in layer 0.
    INFO(second.nonfinite_report);
    CHECK_THAT(second.nonfinite_report, Catch::Contains("forward, layer 0, qkv projection"));
  }
}

TEST_CASE("the same config and seed give bit-identical losses, another seed does not", "[train][determinism]") {
  auto be = make_cpu_backend();
  auto run = [&](uint64_t seed, const char* mode) {
    Trainer tr(test::make_config(test::tiny_run_json(), {{"train", {{"seed", seed}}}, {"precision", {{"mode", mode}}}}),
               *be);
    tr.init_weights();
    auto batches = test::learnable_batches(2, 4, 32, 11);
    std::vector<double> losses;
    for (int s = 1; s <= 5; ++s) losses.push_back(tr.step(batches, s).loss);
    return losses;
  };
  for (const char* mode : {"fp32", "bf16"}) {
    INFO(mode);
    CHECK(run(1, mode) == run(1, mode));
    CHECK(run(1, mode) != run(2, mode));
  }
}
