// keel's CPU model against the PyTorch/HF oracle (scripts/make_fixtures.py): logits, loss and
// every parameter gradient of a tiny GPT-2, a tiny Llama with GQA, a tiny BLOOM (gpt2 blocks
// with ALiBi over 6 heads and an embedding LayerNorm; HF's BloomForCausalLM) and a tiny Qwen2
// (llama with q/k/v biases and a tied head; HF's Qwen2ForCausalLM) and a tiny Qwen3 (per-head q/k
// RMSNorms before RoPE, 4 heads of 16 on a d_model of 32; HF's Qwen3ForCausalLM), in fp32.
//
// Tolerances: the oracle is float64; keel computes in fp32 with sums of at most a few hundred
// terms, so relative errors are a few 1e-7. We require ||keel - oracle|| / ||oracle|| <= 1e-5
// per tensor (the "~1e-5 relative"), and |loss - oracle| <= 1e-5 * loss.
#include <catch2/catch.hpp>

#include "common/fixture.h"
#include "model/transformer.h"

using namespace keel;

namespace {

void check_fixture(const std::string& name) {
  test::Fixture fx(name);
  ParamTable table(fx.model);
  auto be = make_cpu_backend();
  std::vector<float> weights = fx.flat(table, "param");
  std::vector<float> grads(weights.size(), 0.0f);
  Transformer model(table, *be, DType::F32, fx.B, fx.T);
  model.bind(Tensor(weights.data(), DType::F32, {table.local_numel()}),
             Tensor(grads.data(), DType::F32, {table.local_numel()}));

  auto inputs = fx.inputs();
  auto targets = fx.targets();
  auto r = model.forward(inputs.data(), targets.data());
  REQUIRE(r.n_valid == fx.B * fx.T - 2);  // two targets are masked with -1 in the fixture
  const double loss = r.loss_sum / static_cast<double>(r.n_valid);
  const double ref_loss = fx.read<float>("loss")[0];
  INFO(name << " loss " << loss << " vs oracle " << ref_loss);
  CHECK(std::abs(loss - ref_loss) <= 1e-5 * ref_loss);

  auto ref_logits = fx.read<float>("logits");
  REQUIRE(model.logits().numel() == static_cast<int64_t>(ref_logits.size()));
  const double logit_err = test::rel_error(model.logits().as<float>(), ref_logits.data(), ref_logits.size());
  INFO(name << " logits relative error " << logit_err);
  CHECK(logit_err <= 1e-5);

  model.backward(1.0f / static_cast<float>(r.n_valid));
  const auto [worst, worst_name] = test::check_gradients(fx, table, grads, name);
  WARN(name << ": loss diff " << std::abs(loss - ref_loss) << ", logits rel err " << logit_err
            << ", worst gradient rel err " << worst << " (" << worst_name << ")");
}

}  // namespace

TEST_CASE("tiny GPT-2 matches the HF oracle: logits, loss, every gradient", "[model][oracle]") {
  check_fixture("gpt2_tiny");
}

TEST_CASE("tiny Llama with GQA matches the HF oracle: logits, loss, every gradient", "[model][oracle]") {
  check_fixture("llama_tiny");
}

TEST_CASE("tiny BLOOM (ALiBi, embedding LayerNorm) matches the HF oracle: logits, loss, every gradient",
          "[model][oracle]") {
  check_fixture("bloom_tiny");
}

TEST_CASE("tiny Qwen2 (q/k/v biases, tied head) matches the HF oracle: logits, loss, every gradient",
          "[model][oracle][qwen]") {
  check_fixture("qwen2_tiny");
}

TEST_CASE("tiny Qwen3 (q/k norms, head_dim apart from d_model / n_heads) matches the HF oracle: logits, loss, every "
          "gradient",
          "[model][oracle][qwen]") {
  check_fixture("qwen3_tiny");
}

// A sliding window of 5 keys over 16 positions.
TEST_CASE("tiny Mistral (sliding window) matches the HF oracle: logits, loss, every gradient", "[model][oracle][window]") {
  check_fixture("mistral_tiny");
}

TEST_CASE("parameter table: names, roles, decay by role, fused groups back to back", "[model][params]") {
  ModelConfig c;
  c.family = Family::Llama;
  c.vocab_size = 100;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_hidden = 64;
  c.max_seq_len = 16;
  ParamTable t(c);
  for (const ParamSpec& p : t.params()) {
    INFO(p.name);
    const bool is_norm_or_bias = p.role == Role::Norm || p.role == Role::Bias;
    CHECK(p.decay == !is_norm_or_bias);
    if (p.name.find("norm") != std::string::npos) CHECK(p.role == Role::Norm);
  }
  // wq|wk|wv and w_gate|w_up must be contiguous: the model multiplies them as one matrix.
  CHECK(t.at("layers.1.attn.wk").offset == t.at("layers.1.attn.wq").offset + 32 * 32);
  CHECK(t.at("layers.1.attn.wv").offset == t.at("layers.1.attn.wk").offset + 16 * 32);
  CHECK(t.at("layers.0.mlp.w_up").offset == t.at("layers.0.mlp.w_gate").offset + 64 * 32);
  CHECK(t.at("layers.0.attn.wo").split == TpSplit::Cols);
  CHECK(t.at("layers.0.attn.wq").split == TpSplit::Rows);
  CHECK(t.at("tok_embed").split == TpSplit::Rows);
  CHECK(t.at("final_norm.weight").split == TpSplit::None);
  // exact count: embeddings + 2 layers + final norm + untied head
  const int64_t per_layer = 32 + 32 * 32 + 2 * 16 * 32 + 32 * 32 + 32 + 3 * 64 * 32;
  CHECK(t.logical_numel() == 100 * 32 + 2 * per_layer + 32 + 100 * 32);
  CHECK_THROWS_WITH(t.at("layers.9.attn.wq"), Catch::Contains("layers.9.attn.wq"));
}

TEST_CASE("parameter table of a rank with model chunks (interleaved pipeline)", "[model][params]") {
  ModelConfig c;
  c.family = Family::GPT2;
  c.vocab_size = 64;
  c.d_model = 16;
  c.n_layers = 8;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.ffn_hidden = 64;
  c.max_seq_len = 16;
  c.tied_embeddings = true;
  // pp=2 x 2 chunks: 4 virtual stages of 2 layers; rank 0 holds layers 0-1 (+ embedding) and
  // 4-5, rank 1 layers 2-3 and 6-7 (+ head, with the tied embedding's copy).
  const std::vector<ModelShard> r0 = pipeline_chunks(c, 2, 2, 0, {}), r1 = pipeline_chunks(c, 2, 2, 1, {});
  REQUIRE(r0.size() == 2);
  CHECK((r0[0].first_layer == 0 && r0[0].end_layer == 2 && r0[0].has_embedding && !r0[0].has_head));
  CHECK((r0[1].first_layer == 4 && r0[1].end_layer == 6 && !r0[1].has_embedding && !r0[1].has_head));
  CHECK((r1[0].first_layer == 2 && r1[0].end_layer == 4 && !r1[0].has_head));
  CHECK((r1[1].first_layer == 6 && r1[1].end_layer == 8 && r1[1].has_head));
  const ParamTable t0(c, r0), t1(c, r1);
  CHECK(t0.num_chunks() == 2);
  CHECK(t0.contains("layers.5.attn.wq"));
  CHECK_FALSE(t0.contains("layers.2.attn.wq"));
  CHECK(t1.at("tok_embed").tied_copy);
  // The two ranks and the whole model: each tensor once (the tied copy aside), same sizes.
  const ParamTable whole(c);
  int64_t sum = 0;
  for (const ParamTable* t : {&t0, &t1})
    for (const ParamSpec& p : t->params())
      if (!p.tied_copy) sum += p.numel;
  CHECK(sum == whole.logical_numel());
  // A chunk's table: its own tensors at the rank's offsets, the rank's buffer length, its shard.
  for (int ch = 0; ch < 2; ++ch) {
    const ParamTable part = t1.chunk(ch);
    CHECK(part.local_numel() == t1.local_numel());
    CHECK(part.shard().first_layer == r1[static_cast<size_t>(ch)].first_layer);
    for (const ParamSpec& p : part.params()) CHECK(p.offset == t1.at(p.name).offset);
  }
  CHECK(t1.chunk(1).contains("tok_embed"));
  CHECK(t1.chunk(1).contains("final_norm.weight"));
  CHECK_FALSE(t1.chunk(0).contains("final_norm.weight"));
  // More virtual stages than layers: the error says which.
  CHECK_THROWS_WITH(pipeline_chunks(c, 4, 4, 1, {}), Catch::Contains("virtual_stages 4") &&
                                                            Catch::Contains("16 virtual stages"));
}

TEST_CASE("GPT-style parameter count equals the closed form l(12h^2+13h) + vh + sh + 2h", "[model][params]") {
  ModelConfig c;
  c.family = Family::GPT2;
  c.vocab_size = 50257;
  c.d_model = 768;
  c.n_layers = 12;
  c.n_heads = 12;
  c.n_kv_heads = 12;
  c.ffn_hidden = 4 * 768;
  c.max_seq_len = 1024;
  c.tied_embeddings = true;
  ParamTable t(c);
  const int64_t h = 768, l = 12, v = 50257, s = 1024;
  CHECK(t.logical_numel() == l * (12 * h * h + 13 * h) + v * h + s * h + 2 * h);  // 124,439,808
}

TEST_CASE("initialisation is a pure function of (seed, name, logical index)", "[model][init]") {
  ModelConfig c;
  c.family = Family::Llama;
  c.vocab_size = 64;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.ffn_hidden = 32;
  c.max_seq_len = 8;
  ParamTable full(c);
  const ParamSpec& wq = full.at("layers.0.attn.wq");
  std::vector<float> a(static_cast<size_t>(wq.numel)), b(a.size());
  init_param(wq, 7, a.data());
  init_param(wq, 7, b.data());
  CHECK(a == b);
  init_param(wq, 8, b.data());
  CHECK(a != b);
  // Each TP shard initialises exactly its slice of the full tensor.
  for (int r = 0; r < 2; ++r) {
    ModelShard sh;
    sh.tp_rank = r;
    sh.tp_size = 2;
    ParamTable part(c, sh);
    for (const char* name : {"layers.0.attn.wq", "layers.0.attn.wo"}) {
      const ParamSpec& pf = full.at(name);
      const ParamSpec& pp = part.at(name);
      std::vector<float> whole(static_cast<size_t>(pf.numel)), shard(static_cast<size_t>(pp.numel));
      init_param(pf, 7, whole.data());
      init_param(pp, 7, shard.data());
      const int64_t rows = pp.local_shape[0], cols = pp.local_shape[1];
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t fi = pp.split == TpSplit::Rows ? pp.shard_begin + i : i;
          const int64_t fj = pp.split == TpSplit::Cols ? pp.shard_begin + j : j;
          REQUIRE(shard[static_cast<size_t>(i * cols + j)] == whole[static_cast<size_t>(fi * pf.shape[1] + fj)]);
        }
    }
  }
  // Statistics: N(0, 0.02) within sampling error over 64*16 = 1024 draws.
  const ParamSpec& emb = full.at("tok_embed");
  std::vector<float> e(static_cast<size_t>(emb.numel));
  init_param(emb, 3, e.data());
  double mean = 0, var = 0;
  for (float x : e) mean += x;
  mean /= static_cast<double>(e.size());
  for (float x : e) var += (x - mean) * (x - mean);
  var /= static_cast<double>(e.size());
  CHECK(std::abs(mean) < 0.003);              // 5 sigma of the mean: 5 * 0.02 / 32
  CHECK(std::abs(std::sqrt(var) - 0.02) < 0.003);
}
