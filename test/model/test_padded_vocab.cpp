// Padded vocab rows (model.pad_vocab_to_multiple_of): a model padded on import must compute the
// loss it had unpadded, and its padded rows must never train (model/transformer.cpp gives their
// logits a bias of -inf). On the oracle fixtures' tiny GPT-2 (tied head) and Llama, fp32 and
// bf16: the padded model's loss and every real row's gradient equal the unpadded model's bit for
// bit (the padded columns add exact zeros to the softmax sums and to the head's input gradient),
// and the padded rows' gradients are exactly zero, even with random weights in those rows.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "common/fixture.h"
#include "model/transformer.h"

using namespace keel;

namespace {

struct Result {
  double loss_sum = 0;
  std::vector<float> weights, grads;  // fp32, the table's flat layout
};

Result run(const ParamTable& table, const std::vector<float>& w32, const test::Fixture& fx, DType act) {
  auto be = make_cpu_backend();
  test::Weights w(w32);
  const Tensor weights = w.view(act);
  const int64_t n = table.local_numel();
  std::vector<float> grads(static_cast<size_t>(n), 0.0f);
  Transformer model(table, *be, act, fx.B, fx.T, 1);
  model.bind(weights, Tensor(grads.data(), DType::F32, {n}));
  const std::vector<int32_t> inputs = fx.inputs(), targets = fx.targets();
  const float dloss = 1.0f / static_cast<float>(targets.size());
  Result r;
  r.loss_sum = model.forward(0, inputs.data(), targets.data(), dloss).loss_sum;
  model.backward(0, dloss);
  r.grads = grads;
  return r;
}

}  // namespace

TEST_CASE("padded vocab rows take no share of the softmax and get no gradient", "[model][vocab]") {
  for (const char* name : {"gpt2_tiny", "llama_tiny"}) {
    const test::Fixture fx(name);
    const ParamTable plain(fx.model);
    ModelConfig padded_cfg = fx.model;
    padded_cfg.pad_vocab_multiple = 64;
    padded_cfg.padded_vocab_size = (fx.model.vocab_size / 64 + 1) * 64;  // config.cpp's rounding, tp 1
    REQUIRE(padded_cfg.embed_rows() > fx.model.vocab_size);
    const ParamTable padded(padded_cfg);
    const std::vector<float> w = fx.flat(plain, "param");
    // The padded model: the same weights, random values in the padded rows (which a trained
    // model's padded rows are not, but the loss must not depend on them either way).
    std::vector<float> wp(static_cast<size_t>(padded.local_numel()));
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : wp) x = normal(rng);
    for (const ParamSpec& p : plain.params()) {
      const ParamSpec& q = padded.at(p.name);
      std::memcpy(wp.data() + q.offset, w.data() + p.offset, static_cast<size_t>(p.numel) * sizeof(float));
    }
    for (DType act : {DType::F32, DType::BF16}) {
      INFO(name << " activations " << dtype_name(act));
      const Result a = run(plain, w, fx, act), b = run(padded, wp, fx, act);
      CHECK(b.loss_sum == a.loss_sum);
      int64_t padded_rows_checked = 0;
      for (const ParamSpec& p : plain.params()) {
        INFO(p.name);
        const ParamSpec& q = padded.at(p.name);
        CHECK(std::memcmp(b.grads.data() + q.offset, a.grads.data() + p.offset,
                          static_cast<size_t>(p.numel) * sizeof(float)) == 0);
        for (int64_t i = q.offset + p.numel; i < q.offset + q.numel; ++i, ++padded_rows_checked)
          if (b.grads[static_cast<size_t>(i)] != 0.0f) {
            FAIL_CHECK("padded element " << i - q.offset << " of " << p.name << " has gradient "
                                         << b.grads[static_cast<size_t>(i)]);
            break;
          }
      }
      CHECK(padded_rows_checked > 0);
    }
  }
}
