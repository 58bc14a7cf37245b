// The KV-cached inference forward (model/generator.h) against the float64 HF oracle logits of
// a fixture, on any backend: each sequence prefilled with `prefill` tokens in one call, then fed
// one token at a time. Shared by the CPU test (test/model) and the GPU test (test/gpu).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/fixture.h"
#include "model/generator.h"

namespace keel::test {

// The relative error of every sequence's logits (all positions).
inline std::vector<double> cached_logits_errors(const std::string& name, int prefill, Backend& be) {
  Fixture fx(name);
  ParamTable table(fx.model);
  const std::vector<float> weights = fx.flat(table, "param");
  std::shared_ptr<void> mem(be.allocate(weights.size() * sizeof(float)), [&be](void* p) { be.release(p); });
  const Tensor w(mem.get(), DType::F32, {table.local_numel()}, be.device());
  be.copy_from_host(w, weights.data());
  Generator gen(table, be, w, fx.T);
  const auto inputs = fx.inputs();
  const auto ref = fx.read<float>("logits");  // [B, T, V]
  const int64_t V = fx.model.vocab_size;
  std::vector<double> errors;
  for (int b = 0; b < fx.B; ++b) {
    gen.reset();
    const int32_t* row = inputs.data() + static_cast<size_t>(b) * fx.T;
    std::vector<float> got = gen.forward(row, prefill, /*all_rows=*/true);
    for (int t = prefill; t < fx.T; ++t) {
      auto next = gen.forward(row + t, 1);
      got.insert(got.end(), next.begin(), next.end());
    }
    REQUIRE(got.size() == static_cast<size_t>(fx.T * V));
    errors.push_back(rel_error(got.data(), ref.data() + static_cast<size_t>(b) * fx.T * V, got.size()));
  }
  return errors;
}

}  // namespace keel::test
