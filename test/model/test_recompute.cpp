// Activation recomputation (model/transformer.h) changes memory, never the math: the backend is
// deterministic, so the recomputed intermediates are the same bits and every loss, parameter
// gradient and input gradient must equal a run without recomputation bit for bit. Checked on
// the oracle fixtures' tiny GPT-2 (tied head, biases) and Llama (GQA, RoPE) with fp32 and bf16
// activations, two pipeline slots in flight (the 1F1B pattern: two forwards, then two
// backwards, so the shared scratch is overwritten between a slot's forward and its backward),
// and recomputation of none, one (of two) and all layers.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "common/fixture.h"
#include "model/transformer.h"

using namespace keel;

namespace {

struct Pass {
  std::vector<double> loss_sums;
  std::vector<uint8_t> grads;       // fp32 parameter gradients, as bytes
  std::vector<uint8_t> grad_input;  // d(loss)/d(embedding output) of the last backward
  std::vector<std::string> probes;  // every probed op with its output's bytes
  int recompute_layers = 0;
};

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  return {p, p + t.bytes()};
}

Pass run(const test::Fixture& fx, DType act, int recompute_layers) {
  const ParamTable table(fx.model);
  auto be = make_cpu_backend();
  const std::vector<float> w32 = fx.flat(table, "param");
  std::vector<uint16_t> w16;
  for (float x : w32) w16.push_back(f32_to_bf16(x));
  const int64_t n = table.local_numel();
  const Tensor weights = act == DType::F32 ? Tensor(const_cast<float*>(w32.data()), DType::F32, {n})
                                           : Tensor(w16.data(), DType::BF16, {n});
  std::vector<float> grads(static_cast<size_t>(n), 0.0f);
  Transformer model(table, *be, act, fx.B, fx.T, /*slots=*/2, nullptr, recompute_layers);
  model.bind(weights, Tensor(grads.data(), DType::F32, {n}));

  Pass p;
  p.recompute_layers = model.recompute_layers();
  model.set_probe([&](const Transformer::OpProbe& op) {
    const std::vector<uint8_t> b = bytes_of(op.out);
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the output bytes
    for (uint8_t c : b) h = (h ^ c) * 1099511628211ull;
    p.probes.push_back(std::string(op.backward ? "bwd " : "fwd ") + std::to_string(op.layer) + " " + op.op + " " +
                       std::to_string(h));
  });
  // Two micro-batches: the fixture's, and the same tokens with the targets rolled by one.
  const std::vector<int32_t> inputs = fx.inputs();
  const std::vector<int32_t> targets0 = fx.targets();
  std::vector<int32_t> targets1(targets0.size());
  for (size_t i = 0; i < targets0.size(); ++i) targets1[i] = targets0[(i + 1) % targets0.size()];
  const auto r0 = model.forward(0, inputs.data(), targets0.data());
  const auto r1 = model.forward(1, inputs.data(), targets1.data());
  p.loss_sums = {r0.loss_sum, r1.loss_sum};
  const float dloss = 1.0f / static_cast<float>(r0.n_valid + r1.n_valid);
  model.backward(0, dloss);
  model.backward(1, dloss);
  p.grads = bytes_of(Tensor(grads.data(), DType::F32, {n}));
  p.grad_input = bytes_of(model.grad_input());
  return p;
}

void check_same(const Pass& ref, const Pass& got) {
  INFO("recompute_layers " << got.recompute_layers);
  CHECK(got.loss_sums == ref.loss_sums);
  CHECK(got.grads == ref.grads);
  CHECK(got.grad_input == ref.grad_input);
  // The recomputed forward probes nothing: a health probe sees each op once, with the same bits.
  CHECK(got.probes == ref.probes);
}

}  // namespace

TEST_CASE("activation recomputation gives the same losses and gradients bit for bit", "[model][recompute]") {
  for (const char* name : {"gpt2_tiny", "llama_tiny"}) {
    const test::Fixture fx(name);
    REQUIRE(fx.model.n_layers == 2);
    for (DType act : {DType::F32, DType::BF16}) {
      INFO(name << " activations " << dtype_name(act));
      const Pass none = run(fx, act, 0);
      REQUIRE(none.recompute_layers == 0);
      REQUIRE(none.grads.size() > 0);
      // Not a vacuous comparison: the two micro-batches and the gradients are non-trivial.
      CHECK(none.loss_sums[0] != none.loss_sums[1]);
      CHECK(none.probes.size() > 20);
      const Pass first = run(fx, act, 1);
      CHECK(first.recompute_layers == 1);
      check_same(none, first);
      const Pass all = run(fx, act, 99);  // more than the stage has: all of them
      CHECK(all.recompute_layers == 2);
      check_same(none, all);
    }
  }
}

TEST_CASE("a negative recompute_layers is refused", "[model][recompute]") {
  const test::Fixture fx("llama_tiny");
  const ParamTable table(fx.model);
  auto be = make_cpu_backend();
  CHECK_THROWS_WITH(Transformer(table, *be, DType::F32, fx.B, fx.T, 1, nullptr, -1),
                    Catch::Contains("recompute_layers"));
}
