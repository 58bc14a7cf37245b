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

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/fixture.h"
#include "common/run_config.h"
#include "train/optimizer.h"
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

// adamw_update runs neighbouring tensors of one weight-decay group as one call (fewer launches).
// Each element must still get exactly the update of its own tensor's call: compared bit for bit
// with one call per tensor, for GPT-2 (biases and norms between the matrices) and Llama, fp32
// and bf16 with masters, on the whole state and on the second of two ZeRO-1 shards (whose
// boundary cuts a tensor).
TEST_CASE("adamw_update gives every element the bits of a call per tensor", "[train][optimizer]") {
  auto be = make_cpu_backend();
  for (const char* family : {"gpt2", "llama"})
    for (const char* mode : {"fp32", "bf16"})
      for (int dp : {1, 2}) {
        INFO(family << " " << mode << " dp " << dp);
        const RunConfig cfg = test::make_config(test::tiny_run_json(family), {{"precision", {{"mode", mode}}}});
        const ParamTable table(cfg.model);
        ParamState merged(table, *be, cfg.precision.mode, dp, dp - 1), per_tensor(table, *be, cfg.precision.mode, dp, dp - 1);
        merged.init(7);
        per_tensor.init(7);
        std::mt19937 rng(3);
        std::normal_distribution<float> normal;
        for (int step = 1; step <= 2; ++step) {
          std::vector<float> g(static_cast<size_t>(merged.grads.numel()));
          for (float& x : g) x = normal(rng);
          be->copy_from_host(merged.grads, g.data());
          be->copy_from_host(per_tensor.grads, g.data());
          adamw_update(merged, table, *be, cfg.optimizer, 1e-2, 0.5f);
          // The reference: one Backend::adamw call per tensor's part of the shard.
          per_tensor.adam_step += 1;
          AdamWParams a;
          a.lr = 1e-2f;
          a.beta1 = static_cast<float>(cfg.optimizer.beta1);
          a.beta2 = static_cast<float>(cfg.optimizer.beta2);
          a.eps = static_cast<float>(cfg.optimizer.eps);
          a.step = per_tensor.adam_step;
          a.grad_scale = 0.5f;
          int calls = 0;
          for (const ParamSpec& p : table.params()) {
            const int64_t b = std::max(p.offset, per_tensor.optim_begin());
            const int64_t e = std::min(p.offset + p.numel, per_tensor.optim_end());
            if (b >= e) continue;
            a.weight_decay = p.decay ? static_cast<float>(cfg.optimizer.weight_decay) : 0.0f;
            const Tensor master = per_tensor.has_master() ? per_tensor.flat_view(per_tensor.master, b, e - b) : Tensor();
            be->adamw(master, per_tensor.flat_view(per_tensor.working, b, e - b),
                      per_tensor.flat_view(per_tensor.grads, b, e - b), per_tensor.flat_view(per_tensor.m, b, e - b),
                      per_tensor.flat_view(per_tensor.v, b, e - b), a);
            ++calls;
          }
          CHECK(calls > 3);
        }
        // Working weights, masters (laid out like the table), then the moments, as raw bits.
        auto bits = [&](ParamState& s) {
          const size_t n = static_cast<size_t>(table.local_numel());
          std::vector<float> all(2 * n + static_cast<size_t>(s.m.numel() + s.v.numel()), 0.0f);
          s.working_to_host(all.data());
          s.master_to_host(all.data() + n);
          be->copy_to_host(all.data() + 2 * n, s.m);
          be->copy_to_host(all.data() + 2 * n + s.m.numel(), s.v);
          std::vector<uint32_t> out(all.size());
          std::memcpy(out.data(), all.data(), all.size() * sizeof(float));
          return out;
        };
        CHECK(bits(merged) == bits(per_tensor));
      }
}
