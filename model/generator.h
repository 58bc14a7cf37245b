// Inference forward with a KV cache, for generation (keel sample): the network of
// model/transformer.cpp, forward only, one sequence, fed a prompt in one call and then one
// token per call. Written against the Backend op set (attention_decode does RoPE, the cache
// append and the attention), so a GPU backend runs it unchanged.
//
// Memory: the weights are a flat buffer laid out by the ParamTable (the whole model, any float
// dtype), owned by the caller; activations for max_len rows and the K/V caches
// (n_layers x 2 x max_len x kv_dim) are allocated once here.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/param_table.h"

namespace keel {

class Generator {
 public:
  // act_dtype: storage of activations and caches (f32 reproduces HF's fp32 logits).
  Generator(const ParamTable& table, Backend& backend, const Tensor& weights, int max_len,
            DType act_dtype = DType::F32);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  void reset() { pos_ = 0; }          // forget the sequence (the caches are overwritten)
  // Forget the tokens from `position` on, keeping the cached keys and values before it: scoring
  // several continuations of one context computes the context once.
  void rewind(int64_t position);
  int64_t position() const { return pos_; }  // tokens fed so far
  int max_len() const { return max_len_; }

  // Feeds n tokens at positions position() .. position()+n-1 and returns fp32 logits over the
  // vocabulary (vocab_size columns, padding rows of the head left out): of the last token, or
  // of every fed token (n x vocab_size, row-major) when all_rows.
  std::vector<float> forward(const int32_t* tokens, int n, bool all_rows = false);

  const ParamTable& table() const { return table_; }

 private:
  Tensor alloc(DType t, std::initializer_list<int64_t> dims);
  Tensor view(const std::string& name) const;
  Tensor fused(const std::string& first, int64_t rows, int64_t cols) const;
  void norm(const Tensor& out, const Tensor& in, const std::string& prefix, int64_t n);

  const ParamTable table_;
  const ModelConfig& cfg_;
  Backend& be_;
  Tensor weights_;
  DType act_;
  int max_len_;
  int64_t pos_ = 0;
  std::vector<void*> allocations_;
  Tensor tokens_, x_, normed_, qkv_, attn_, proj_, fc_, act_out_, mean_, rstd_, logits_;
  Tensor alibi_slopes_;  // model.alibi: F32 [n_heads]
  Tensor qk_in_, qk_scratch_, qk_rstd_;  // model.qk_norm (model/qk_norm.h), for max_len rows
  std::vector<Tensor> k_cache_, v_cache_;
};

// Choosing the next token.
struct SamplingOptions {
  float temperature = 0.8f;  // <= 0: greedy (argmax, the first of equal maxima, as torch.argmax)
  float top_p = 0.95f;       // nucleus: the smallest set of most likely tokens with mass >= top_p
                             // (1: all; 0: the most likely one only)
  int top_k = 0;             // > 0: only the k most likely tokens
};

// A portable random stream (mt19937_64, doubles from its top 53 bits): the same seed gives
// the same samples on every machine.
class TokenRng {
 public:
  explicit TokenRng(uint64_t seed) : gen_(seed) {}
  double uniform() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }

 private:
  std::mt19937_64 gen_;
};

int32_t choose_token(const std::vector<float>& logits, const SamplingOptions& opts, TokenRng& rng);

// Logits with inf or NaN (weights holding them, or overflowing): no token can be chosen from
// them, and argmax would pick token 0 forever.
class NonFiniteLogits : public std::runtime_error {
 public:
  explicit NonFiniteLogits(int64_t position)
      : std::runtime_error("non-finite logits at position " + std::to_string(position)), position(position) {}
  int64_t position;  // of the token they would predict, counting the prompt from 0
};

struct GenerateOptions {
  int max_new_tokens = 64;
  SamplingOptions sampling;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;  // generation ends after producing one of these (it is kept)
  // > 0: only ids below it are chosen. The tokenizer's size, where the model's vocabulary is
  // larger (rows no text maps to, as in Qwen2's 151936 for 151665 ids): such an id has no text,
  // and an untrained row can win the draw (llm.c masks its padded ids the same way).
  int64_t choosable_ids = 0;
};

// Prompt in one forward, then one token per step. on_token sees each new token as it comes.
// The prompt plus max_new_tokens must fit the generator's max_len. Throws NonFiniteLogits.
std::vector<int32_t> generate(Generator& g, const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int32_t)>& on_token = {});

}  // namespace keel
