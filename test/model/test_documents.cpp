// Document masking through the whole model: a micro-batch of packed documents, given their
// document positions, computes for each document what the model computes on that document
// alone. Checked on the oracle fixtures' tiny GPT-2 (learned positions, which must restart per
// document) and Llama (RoPE, GQA), with fp32 and bf16 activations:
//   - every row's logits equal those of the document run alone, bit for bit (each op works row
//     by row, and attention's loops over a document run in the same order either way);
//   - the parameter gradients equal the sum of the separate runs' gradients within 1e-6
//     relative (the same products, summed over rows in another grouping: fp32 re-association);
//   - recomputing the layers in backward uses the same positions (bit for bit).
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <vector>

#include "common/fixture.h"
#include "kernels/kernel_test_util.h"
#include "kernels/document_positions.h"
#include "model/transformer.h"

using namespace keel;

namespace {


// The tiny Llama fixture's table, weights, a gradient buffer and its tokens and targets.
struct TinyLlama {
  test::Fixture fx{"llama_tiny"};
  ParamTable table{fx.model};
  test::Weights w{fx.flat(table, "param")};
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::vector<float> grads = std::vector<float>(static_cast<size_t>(table.local_numel()), 0.0f);
  std::vector<int32_t> tokens = fx.inputs(), targets = fx.targets();
  Tensor grad_view() { return Tensor(grads.data(), DType::F32, {table.local_numel()}); }
};

struct Result {
  std::vector<uint8_t> logits;  // bytes of every row's logits, in row order
  std::vector<float> grads;
  double loss_sum = 0;
};

// One forward (and backward) of B sequences of T tokens starting at tokens[0] / targets[0].
void run_into(Result& r, const test::Fixture& fx, const ParamTable& table, test::Weights& w, DType act, int B, int T,
              const int32_t* tokens, const int32_t* targets, const int32_t* positions, float dloss,
              int recompute_layers = 0) {
  auto be = make_cpu_backend();
  if (r.grads.empty()) r.grads.assign(static_cast<size_t>(table.local_numel()), 0.0f);
  Transformer model(table, *be, act, B, T, 1, nullptr, {recompute_layers}, false, 0, positions != nullptr);
  model.bind(w.view(act), Tensor(r.grads.data(), DType::F32, {table.local_numel()}));
  r.loss_sum += model.forward(tokens, targets, dloss, positions).loss_sum;
  const Tensor logits = model.logits();
  const auto* p = static_cast<const uint8_t*>(logits.data);
  r.logits.insert(r.logits.end(), p, p + logits.bytes());
  model.backward(dloss);
}

}  // namespace

TEST_CASE("packed documents with document masking compute what each document computes alone",
          "[model][documents]") {
  // Sequence 0: documents of 5 and 11 tokens; sequence 1: 7, 2 and 7 (the fixtures' T = 16).
  const std::vector<std::vector<int>> docs = {{5, 11}, {7, 2, 7}};
  for (const char* name : {"gpt2_tiny", "llama_tiny"}) {
    const test::Fixture fx(name);
    REQUIRE(fx.B == 2);
    REQUIRE(fx.T == 16);
    const ParamTable table(fx.model);
    test::Weights w{fx.flat(table, "param")};
    const std::vector<int32_t> tokens = fx.inputs(), targets = fx.targets();
    std::vector<int> lengths;
    for (const auto& seq : docs) lengths.insert(lengths.end(), seq.begin(), seq.end());
    const std::vector<int32_t> positions = test::document_positions_of(2, 16, lengths);
    REQUIRE(document_positions_error(positions.data(), 32, 16).empty());
    int64_t valid = 0;
    for (int32_t t : targets) valid += t >= 0;
    const float dloss = 1.0f / static_cast<float>(valid);

    for (DType act : {DType::F32, DType::BF16}) {
      INFO(name << " activations " << dtype_name(act));
      Result packed, alone, causal, recomputed;
      run_into(packed, fx, table, w, act, 2, 16, tokens.data(), targets.data(), positions.data(), dloss);
      int64_t r0 = 0;
      for (const auto& seq : docs)
        for (int len : seq) {
          run_into(alone, fx, table, w, act, 1, len, tokens.data() + r0, targets.data() + r0, nullptr, dloss);
          r0 += len;
        }
      CHECK(packed.logits == alone.logits);
      CHECK(std::abs(packed.loss_sum - alone.loss_sum) <= 1e-6 * std::abs(alone.loss_sum));
      const double grad_err = test::rel_error(packed.grads.data(), alone.grads.data(), packed.grads.size());
      CHECK(grad_err < 1e-6);
      WARN(name << " " << dtype_name(act) << ": gradients vs the separate documents' sum, relative " << grad_err);

      // Not vacuous: without the masking the same tokens give other logits.
      run_into(causal, fx, table, w, act, 2, 16, tokens.data(), targets.data(), nullptr, dloss);
      CHECK(causal.logits != packed.logits);
      CHECK(test::rel_error(causal.grads.data(), packed.grads.data(), packed.grads.size()) > 1e-3);

      // Recomputed layers see the same positions in backward.
      run_into(recomputed, fx, table, w, act, 2, 16, tokens.data(), targets.data(), positions.data(), dloss, 99);
      CHECK(recomputed.logits == packed.logits);
      CHECK(std::memcmp(recomputed.grads.data(), packed.grads.data(), packed.grads.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("document positions are checked before they reach the kernels", "[model][documents]") {
  TinyLlama m;
  const ParamTable& table = m.table;
  const std::vector<int32_t>& tokens = m.tokens;
  const std::vector<int32_t>& targets = m.targets;
  std::vector<int32_t> positions(32);
  for (int n = 0; n < 32; ++n) positions[n] = n % 16;
  positions[20] = 7;  // row 20 follows position 3
  {
    Transformer model(table, *m.be, DType::F32, 2, 16, 1, nullptr, {}, false, 0, true);
    model.bind(m.w.view(DType::F32), m.grad_view());
    CHECK_THROWS_WITH(model.forward(tokens.data(), targets.data(), std::nullopt, positions.data()),
                      Catch::Contains("positions[20] = 7 is not a document position"));
  }
  // A model built without document masking keeps no buffer for them.
  Transformer plain(table, *m.be, DType::F32, 2, 16);
  plain.bind(m.w.view(DType::F32), m.grad_view());
  for (int n = 0; n < 32; ++n) positions[n] = n % 16;
  CHECK_THROWS_WITH(plain.forward(tokens.data(), targets.data(), std::nullopt, positions.data()),
                    Catch::Contains("without document masking"));
}

TEST_CASE("a forward-only model (no gradients bound) gives the same losses and refuses backward", "[model][documents]") {
  TinyLlama m;
  Transformer trained(m.table, *m.be, DType::F32, 2, 16), forward_only(m.table, *m.be, DType::F32, 2, 16);
  trained.bind(m.w.view(DType::F32), m.grad_view());
  forward_only.bind(m.w.view(DType::F32), Tensor());
  const double a = trained.forward(m.tokens.data(), m.targets.data()).loss_sum;
  const double b = forward_only.forward(m.tokens.data(), m.targets.data()).loss_sum;
  CHECK(a == b);  // the same arithmetic, bit for bit
  CHECK_THROWS_WITH(forward_only.backward(1.0f), Catch::Contains("bound without gradients"));
  CHECK_THROWS_WITH(forward_only.forward(m.tokens.data(), m.targets.data(), 1.0f), Catch::Contains("needs gradients"));
}
