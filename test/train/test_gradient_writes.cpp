// A step's gradient is whole and current whatever the gradient buffer held before it: each
// gradient's first contribution stores it, later ones add, and the rest is zero-filled
// (model/grad_writes.h) instead of the whole buffer being zeroed first. That the values are the
// right gradients is what the oracle and finite-difference tests check; this one checks that
// no element of the buffer carries over from before the step.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/batches.h"
#include "common/run_config.h"
#include "train/trainer.h"

using namespace keel;

namespace {

struct Outcome {
  std::vector<double> losses, norms;
  std::vector<float> weights;
};

// Three steps of two micro-batches each; with `poison`, the gradient buffer is set to NaN
// before every step (a gradient left unwritten would make the step non-finite and skipped).
Outcome train(const std::string& family, const nlohmann::json& patch, bool poison) {
  auto be = make_cpu_backend();
  Trainer tr(test::make_config(test::tiny_run_json(family), patch), *be);
  tr.init_weights();
  const auto batches = test::learnable_batches(2, 4, 32, 5);
  Outcome o;
  for (int s = 1; s <= 3; ++s) {
    if (poison) be->fill(tr.state().grads, std::nanf(""));
    const StepStats st = tr.step(batches, s);
    CHECK_FALSE(st.skipped);
    o.losses.push_back(st.loss);
    o.norms.push_back(st.grad_norm);
  }
  o.weights.resize(static_cast<size_t>(tr.table().local_numel()));
  tr.state().working_to_host(o.weights.data());
  return o;
}

}  // namespace

TEST_CASE("a step's gradient does not depend on what the gradient buffer held before it", "[train][gradients]") {
  struct Variant {
    const char* name;
    std::string family;
    nlohmann::json patch;
  };
  const std::vector<Variant> variants = {
      {"llama (untied head)", "llama", nlohmann::json::object()},
      {"llama, tied head", "llama", {{"model", {{"tied_embeddings", true}}}}},
      {"gpt2 (tied head, learned positions, biases)", "gpt2", nlohmann::json::object()},
      {"gpt2, chunked head", "gpt2", {{"train", {{"logits_chunk_rows", 48}}}}},
      {"qwen3-like (q/k norms, qkv bias), recomputed", "llama",
       {{"model", {{"qk_norm", true}, {"qkv_bias", true}}}, {"train", {{"recompute", "full"}}}}},
      {"bloom-like (alibi, embedding norm)", "gpt2",
       {{"model", {{"position_embedding", "alibi"}, {"embedding_norm", true}}}}},
      {"bf16", "llama", {{"precision", {{"mode", "bf16"}}}}},
  };
  for (const Variant& v : variants) {
    INFO(v.name);
    const Outcome clean = train(v.family, v.patch, false), poisoned = train(v.family, v.patch, true);
    CHECK(clean.losses == poisoned.losses);
    CHECK(clean.norms == poisoned.norms);
    REQUIRE(clean.weights.size() == poisoned.weights.size());
    CHECK(std::memcmp(clean.weights.data(), poisoned.weights.data(), clean.weights.size() * sizeof(float)) == 0);
    // and the steps trained: the loss moved
    CHECK(clean.losses.back() < clean.losses.front());
  }
}
