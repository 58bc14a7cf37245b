// Five AdamW steps of keel's trainer (fp32 mode: masters are the weights) against PyTorch's
// torch.optim.AdamW run in float64 on the same batch (scripts/make_fixtures.py), with the same
// clipping (torch.nn.utils.clip_grad_norm_) and the same weight-decay groups (by role).
//
// Tolerances: per-step loss and grad norm within 1e-5 relative. For the weights after the steps,
// the fixture records how far PyTorch's own float32 run lands from the float64 oracle, per
// tensor: Adam divides by sqrt(v), so elements with near-zero gradients amplify roundoff
// (GPT-2's key path is the extreme: softmax cancels the key bias exactly, and its fp32 noise
// becomes real updates). keel must be within max(1e-5, 2 x PyTorch-fp32's error) per tensor:
// as accurate as PyTorch in the same precision, up to a factor of two.
#include <catch2/catch.hpp>

#include "common/fixture.h"
#include "common/run_config.h"
#include "train/trainer.h"

using namespace keel;

namespace {

void check_adamw(const std::string& name) {
  test::Fixture fx(name);
  const auto& a = fx.meta["adamw"];
  nlohmann::json cfg_json = test::tiny_run_json();
  cfg_json["model"] = fx.meta["model"];
  cfg_json["optimizer"] = {{"lr", a["lr"]},       {"min_lr", a["lr"]},         {"beta1", a["beta1"]},
                           {"beta2", a["beta2"]}, {"eps", a["eps"]},           {"weight_decay", a["weight_decay"]},
                           {"grad_clip", a["grad_clip"]}};
  cfg_json["schedule"] = {{"warmup_steps", 0}, {"decay", "constant"}};
  cfg_json["train"] = {{"steps", a["steps"]}, {"global_batch", fx.B}, {"micro_batch", fx.B}, {"seq_len", fx.T}};
  RunConfig cfg = parse_config(cfg_json, name + ".json");

  auto be = make_cpu_backend();
  Trainer tr(cfg, *be);
  std::vector<float> init = fx.flat(tr.table(), "param");
  tr.state().load_fp32(init.data());

  std::vector<MicroBatch> batch(1);
  batch[0].inputs = fx.inputs();
  batch[0].targets = fx.targets();
  auto ref_losses = fx.read<float>("step_losses");
  auto ref_norms = fx.read<float>("step_grad_norms");
  for (size_t s = 0; s < ref_losses.size(); ++s) {
    StepStats st = tr.step(batch, static_cast<int64_t>(s) + 1);
    INFO(name << " step " << s + 1 << ": loss " << st.loss << " vs " << ref_losses[s] << ", grad norm " << st.grad_norm
              << " vs " << ref_norms[s]);
    CHECK_FALSE(st.skipped);
    CHECK(std::abs(st.loss - ref_losses[s]) <= 1e-5 * ref_losses[s]);
    CHECK(std::abs(st.grad_norm - ref_norms[s]) <= 1e-5 * ref_norms[s]);
  }
  CHECK(tr.state().adam_step == static_cast<int64_t>(ref_losses.size()));

  std::vector<float> final_ref = fx.flat(tr.table(), "final");
  std::vector<float> final_keel(final_ref.size());
  tr.state().master_to_host(final_keel.data());
  double worst = 0;
  for (const ParamSpec& p : tr.table().params()) {
    const double err =
        test::rel_error(final_keel.data() + p.offset, final_ref.data() + p.offset, static_cast<size_t>(p.numel));
    const double torch_fp32 = fx.meta["results"]["final_fp32_rel_error"][p.name].get<double>();
    INFO(name << " weights of " << p.name << " after the AdamW steps, relative error " << err
              << " (PyTorch fp32: " << torch_fp32 << ")");
    CHECK(err <= std::max(1e-5, 2 * torch_fp32));
    worst = std::max(worst, err);
  }
  WARN(name << ": worst relative error of the weights after " << ref_losses.size() << " AdamW steps: " << worst);
}

}  // namespace

TEST_CASE("AdamW steps of tiny GPT-2 match torch.optim.AdamW", "[train][oracle]") { check_adamw("gpt2_tiny"); }
TEST_CASE("AdamW steps of tiny Llama match torch.optim.AdamW", "[train][oracle]") { check_adamw("llama_tiny"); }
TEST_CASE("AdamW steps of tiny BLOOM (ALiBi, embedding norm) match torch.optim.AdamW", "[train][oracle]") {
  check_adamw("bloom_tiny");
}
TEST_CASE("AdamW steps of tiny Qwen2 (q/k/v biases in the no-decay group) match torch.optim.AdamW",
          "[train][oracle][qwen]") {
  check_adamw("qwen2_tiny");
}
TEST_CASE("AdamW steps of tiny Qwen3 (q/k norms in the no-decay group) match torch.optim.AdamW", "[train][oracle][qwen]") {
  check_adamw("qwen3_tiny");
}
TEST_CASE("AdamW steps of tiny Mistral (a sliding window) match torch.optim.AdamW", "[train][oracle][window]") {
  check_adamw("mistral_tiny");
}
