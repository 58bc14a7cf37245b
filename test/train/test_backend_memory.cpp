// The memory a training run holds through its backend (Backend::peak_bytes) against what keel
// plan says it needs (plan::planned_backend_bytes, the start-up breakdown's figure): the planner
// picks layouts and the activation policy from it, so a run that needs more than planned fails
// where the plan said it fits. The CPU reference counts the same allocations a GPU run makes
// (less the CUDA backend's own scratch: dS staging, cuBLASLt workspace), so the whole run, from
// the weights' initialisation to the optimizer's update, is checked here without a GPU.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "common/batches.h"
#include "common/run_config.h"
#include "kernels/cpu/cpu_backend.h"
#include "train/memory_watch.h"
#include "train/plan.h"
#include "train/trainer.h"

using namespace keel;

TEST_CASE("memory: a run's peak on the CPU backend is keel plan's figure, initialisation and update included",
          "[plan][memory]") {
  // Vocabulary-heavy models (the embedding about 80% of the parameters) so that a transient the
  // size of the weights would show: the 1B Llama's initialisation once staged all of them in fp32
  // (4 B/param) on top of the activations, its run's peak, 4.6 GiB over the plan's 31.6.
  for (const std::string family : {"gpt2", "llama"})
    for (const std::string mode : {"fp32", "bf16", "fp16"})
      for (const std::string recompute : {"none", "selective", "full"})
        for (int64_t chunk : {int64_t{0}, int64_t{32}}) {
          INFO(family << ", precision " << mode << ", recompute " << recompute << ", logits_chunk_rows " << chunk);
          const RunConfig cfg = test::make_config(
              test::tiny_run_json(family),
              {{"model", {{"vocab_size", 4096}, {"d_model", 64}, {"ffn_hidden", family == "llama" ? 128 : 256}}},
               {"precision", {{"mode", mode}}},
               {"train", {{"recompute", recompute}, {"logits_chunk_rows", chunk}}}});
          CpuBackend be;
          {
            Trainer tr(cfg, be);
            tr.init_weights();
            const auto batches = test::learnable_batches(2, 4, 32, 3);  // global 8 = 2 micro-batches of 4
            tr.step(batches, 1);
            tr.step(batches, 2);
            const double planned = plan::planned_backend_bytes(cfg, 0, false);
            const double peak = static_cast<double>(be.peak_bytes());
            INFO("peak " << peak << " B, planned " << planned << " B, still held " << be.used_bytes() << " B");
            REQUIRE(planned > 0);
            // Above: what the planner does not know of. Below: what it counts and the run does
            // not hold. Allocations round up to 64 bytes, the plan's small tensors not: 2%.
            CHECK(peak <= planned * 1.02);
            CHECK(peak >= planned * 0.98);
          }
          CHECK(be.used_bytes() == 0);  // the Trainer gave everything back
        }
}

TEST_CASE("memory: the weights' initialisation rounds alike through the moments and through its own staging buffer",
          "[memory]") {
  // A training state stages the fp32 values through its first moments; a forward-only one (keel
  // train --eval-only) has none and takes a buffer of its own: the same working weights, bit for
  // bit, and nothing left held beyond the state.
  for (const std::string mode : {"bf16", "fp16"}) {
    INFO(mode);
    const RunConfig cfg = test::make_config(test::tiny_run_json("llama"), {{"precision", {{"mode", mode}}}});
    CpuBackend be_train, be_eval;
    Trainer train(cfg, be_train), eval(cfg, be_eval, nullptr, nullptr, true);
    const size_t held = be_eval.used_bytes();
    train.init_weights();
    eval.init_weights();
    CHECK(be_eval.used_bytes() == held);
    const int64_t n = train.table().local_numel();
    std::vector<uint16_t> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    be_train.copy_to_host(a.data(), train.state().flat_view(train.state().working, 0, n));
    be_eval.copy_to_host(b.data(), eval.state().flat_view(eval.state().working, 0, n));
    CHECK(a == b);
    CHECK(std::count(a.begin(), a.end(), uint16_t{0}) < n / 2);  // initialised, not left at zero
  }
}

// During a run (train/memory_watch.h): rank 0 reports its peak after step 1 and again only when it
// has grown past the slack (5% and 1 MiB on the CPU, 64 MiB on a GPU); the warning against the
// plan (5% + 64 MiB over) comes once, at the step that first passes it, whatever follows.
TEST_CASE("the memory watch reports the first peak, then growth past its slack, and warns once over the plan",
          "[memory]") {
  constexpr double MiB = 1 << 20;
  MemoryWatch cpu(false);
  const double planned = 1000 * MiB;
  MemoryWatch::News n = cpu.observe(0, planned, 1);
  CHECK_FALSE(n.report);  // a backend that counts nothing
  n = cpu.observe(900 * MiB, 0, 1);
  CHECK_FALSE(n.report);  // no plan for this layout
  n = cpu.observe(900 * MiB, planned, 1);
  CHECK((n.report && n.first && !n.warn));
  n = cpu.observe(1.05 * 900 * MiB + MiB, planned, 2);  // exactly at the slack: no news
  CHECK_FALSE(n.report);
  n = cpu.observe(1000 * MiB, planned, 3);  // grown 100 MiB: news, still within the plan
  CHECK((n.report && !n.first && !n.warn));
  CHECK(n.previous_bytes == 900 * MiB);
  CHECK(n.previous_step == 1);
  n = cpu.observe(1200 * MiB, planned, 7);  // over 1.05 x 1000 + 64 MiB = 1114 MiB: the warning
  CHECK((n.report && n.warn));
  CHECK(n.previous_step == 3);
  n = cpu.observe(1400 * MiB, planned, 9);  // grown again: reported, not warned twice
  CHECK((n.report && !n.warn));

  // On a GPU growth under 64 MiB is the libraries' (cuBLASLt's workspace), not news.
  MemoryWatch gpu(true);
  CHECK(gpu.observe(100 * MiB, planned, 1).report);
  CHECK_FALSE(gpu.observe(160 * MiB, planned, 2).report);
  CHECK(gpu.observe(175 * MiB, planned, 3).report);
}
