// The inference forward with a KV cache (model/generator.h) against the float64 HF oracle
// fixtures of scripts/make_fixtures.py: a prompt prefilled in one call and the rest fed one
// token at a time give every position's logits to the oracle's 1e-5 relative (the training
// forward's tolerance), for the tiny Llama (GQA, RoPE) and the tiny GPT-2 (learned positions,
// biases, LayerNorm); sampling is deterministic per seed.
#include <catch2/catch.hpp>

#include "common/cached_decoding.h"
#include "common/fixture.h"
#include "model/generator.h"

using namespace keel;

namespace {

void check_cached_logits(const std::string& name, int prefill) {
  auto be = make_cpu_backend();
  const std::vector<double> errors = test::cached_logits_errors(name, prefill, *be);
  for (size_t b = 0; b < errors.size(); ++b) {
    INFO(name << " sequence " << b << " prefill " << prefill << ": logits relative error " << errors[b]);
    CHECK(errors[b] <= 1e-5);
  }
}

}  // namespace

TEST_CASE("generator: cached decoding reproduces the oracle logits (Llama, GQA)", "[generator]") {
  check_cached_logits("llama_tiny", 1);
  check_cached_logits("llama_tiny", 6);
}

TEST_CASE("generator: cached decoding reproduces the oracle logits (GPT-2)", "[generator]") {
  check_cached_logits("gpt2_tiny", 1);
  check_cached_logits("gpt2_tiny", 6);
}

TEST_CASE("generator: cached decoding reproduces the oracle logits (BLOOM: ALiBi, embedding norm)", "[generator]") {
  check_cached_logits("bloom_tiny", 1);
  check_cached_logits("bloom_tiny", 6);
}

TEST_CASE("generator: cached decoding reproduces the oracle logits (Qwen2 biases, Qwen3 q/k norms and head_dim)",
          "[generator][qwen]") {
  for (const char* name : {"qwen2_tiny", "qwen3_tiny"}) {
    check_cached_logits(name, 1);
    check_cached_logits(name, 6);
  }
}

// Prefill 1 and 6 rows, then one at a time: rows past the window of 5 drop the oldest keys.
TEST_CASE("generator: cached decoding reproduces the oracle logits (Mistral's sliding window)", "[generator][window]") {
  check_cached_logits("mistral_tiny", 1);
  check_cached_logits("mistral_tiny", 6);
}

TEST_CASE("generator: greedy and seeded sampling, within choosable_ids where set", "[generator]") {
  test::Fixture fx("llama_tiny");
  ParamTable table(fx.model);
  auto be = make_cpu_backend();
  std::vector<float> weights = fx.flat(table, "param");
  Generator gen(table, *be, Tensor(weights.data(), DType::F32, {table.local_numel()}), 40);
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65};
  GenerateOptions greedy;
  greedy.max_new_tokens = 20;
  greedy.sampling.temperature = 0;
  // Greedy equals argmax of a fresh full forward at every step, over the ids below
  // choosable_ids where it is set (a tokenizer smaller than the vocabulary).
  const auto check_greedy = [&](const std::vector<int32_t>& generated, int64_t choosable) {
    std::vector<int32_t> seq = prompt;
    for (int32_t tok : generated) {
      gen.reset();
      auto all = gen.forward(seq.data(), static_cast<int>(seq.size()));
      CHECK(tok == std::max_element(all.begin(), all.begin() + choosable) - all.begin());
      seq.push_back(tok);
    }
  };
  auto a = generate(gen, prompt, greedy);
  check_greedy(a, fx.model.vocab_size);
  const int64_t bound = fx.model.vocab_size / 4;
  GenerateOptions bounded = greedy;
  bounded.choosable_ids = bound;
  check_greedy(generate(gen, prompt, bounded), bound);
  GenerateOptions s;
  s.max_new_tokens = 20;
  s.sampling = {1.0f, 0.9f, 0};
  s.seed = 7;
  auto x = generate(gen, prompt, s), y = generate(gen, prompt, s);
  CHECK(x == y);
  s.seed = 8;
  CHECK(generate(gen, prompt, s) != x);
  // stop tokens end generation and are kept
  GenerateOptions stop = greedy;
  stop.stop_ids = {a[3]};
  auto z = generate(gen, prompt, stop);
  CHECK(z.size() <= 4);
  CHECK(z.back() == a[3]);
  CHECK_THROWS_WITH(generate(gen, std::vector<int32_t>(30, 1), greedy), Catch::Contains("exceed the 40 positions"));
  // Sampling hot and flat: without the bound three quarters of the draws fall past it.
  GenerateOptions hot;
  hot.max_new_tokens = 30;
  hot.sampling = {5.0f, 1.0f, 0};
  hot.seed = 11;
  const auto unbounded = generate(gen, prompt, hot);
  CHECK(std::any_of(unbounded.begin(), unbounded.end(), [&](int32_t t) { return t >= bound; }));
  hot.choosable_ids = bound;
  for (int32_t tok : generate(gen, prompt, hot)) CHECK(tok < bound);
}

TEST_CASE("generator: top-k 1 and a tiny top-p are greedy", "[generator]") {
  std::vector<float> logits = {0.1f, 2.0f, 1.9f, -3.0f};
  TokenRng rng(1);
  for (int i = 0; i < 20; ++i) {
    CHECK(choose_token(logits, {1.0f, 1.0f, 1}, rng) == 1);
    CHECK(choose_token(logits, {1.0f, 1e-6f, 0}, rng) == 1);
    CHECK(choose_token(logits, {0.0f, 1.0f, 0}, rng) == 1);
  }
}
