// Training numerics at their edges: steps that must not move the weights, and the schedules'
// bookkeeping around them.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "common/batches.h"
#include "common/run_config.h"
#include "train/schedule.h"
#include "train/trainer.h"

using namespace keel;

namespace {

std::vector<float> masters(Trainer& tr) {
  std::vector<float> out(static_cast<size_t>(tr.table().local_numel()));
  tr.state().master_to_host(out.data());
  return out;
}

}  // namespace

TEST_CASE("a global batch with every target masked is skipped, not a phantom update", "[train][loss_mask]") {
  // An SFT window that holds only prompt (loss mask 0 everywhere) has no loss: its gradient is
  // zero, but an AdamW update would still move every weight by the momentum and the weight
  // decay and advance Adam's step. The run must go on as if the batch had not been there (the
  // learning rate follows the iteration, so it is held constant here).
  for (const char* mode : {"fp32", "bf16"}) {
    INFO("precision " << mode);
    const RunConfig cfg = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", mode}}},
                                                                  {"schedule", {{"warmup_steps", 0}, {"decay", "constant"}}}});
    auto be = make_cpu_backend();
    Trainer with_empty(cfg, *be), without(cfg, *be);
    with_empty.init_weights();
    without.init_weights();
    const auto batches = test::learnable_batches(2, 4, 32, 9);
    for (int s = 1; s <= 3; ++s) {
      with_empty.step(batches, s);
      without.step(batches, s);
    }
    auto masked = batches;
    for (MicroBatch& mb : masked) std::fill(mb.targets.begin(), mb.targets.end(), -1);
    const std::vector<float> before = masters(with_empty);
    const StepStats st = with_empty.step(masked, 4);
    CHECK(st.valid_tokens == 0);
    CHECK(st.skipped);
    CHECK_FALSE(st.nonfinite);
    CHECK(std::isnan(st.loss));  // a mean over no tokens, not a loss of 0
    CHECK(st.lr == learning_rate(cfg, 4));  // the schedule's rate is reported, not 0
    CHECK(with_empty.state().adam_step == 3);
    CHECK(masters(with_empty) == before);
    // The next real step is bit for bit the step of a run that never saw the masked batch.
    const StepStats a = with_empty.step(batches, 5), b = without.step(batches, 4);
    CHECK(a.loss == b.loss);
    CHECK(a.grad_norm == b.grad_norm);
    CHECK(masters(with_empty) == masters(without));
  }
}
