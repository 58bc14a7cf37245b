#include "model/generator.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "kernels/alibi.h"
#include "model/qk_norm.h"

namespace keel {

Generator::Generator(const ParamTable& table, Backend& backend, const Tensor& weights, int max_len, DType act_dtype)
    : table_(table), cfg_(table_.config()), be_(backend), weights_(weights), act_(act_dtype), max_len_(max_len) {
  const ModelShard& sh = table_.shard();
  if (sh.tp_size != 1 || sh.first_layer != 0 || (sh.end_layer >= 0 && sh.end_layer != cfg_.n_layers) ||
      !sh.has_embedding || !sh.has_head)
    throw std::invalid_argument("Generator needs the whole model (one rank, every layer)");
  if (weights.numel() != table_.local_numel())
    throw std::invalid_argument("Generator: the weight buffer has " + std::to_string(weights.numel()) +
                                " elements, the parameter table needs " + std::to_string(table_.local_numel()));
  if (max_len < 1 || max_len > cfg_.max_seq_len)
    throw std::invalid_argument("Generator: max_len " + std::to_string(max_len) + " is outside [1, max_seq_len = " +
                                std::to_string(cfg_.max_seq_len) + "] of the model");
  const int64_t L = max_len, d = cfg_.d_model, F = cfg_.ffn_hidden;
  const int64_t qkv_cols = cfg_.q_dim() + 2 * cfg_.kv_dim();
  tokens_ = alloc(DType::I32, {L});
  x_ = alloc(act_, {L, d});
  normed_ = alloc(act_, {L, d});
  qkv_ = alloc(act_, {L, qkv_cols});
  attn_ = alloc(act_, {L, cfg_.q_dim()});
  proj_ = alloc(act_, {L, d});
  fc_ = alloc(act_, {L, cfg_.is_llama() ? 2 * F : F});
  act_out_ = alloc(act_, {L, F});
  mean_ = alloc(DType::F32, {L});
  rstd_ = alloc(DType::F32, {L});
  logits_ = alloc(DType::F32, {L, cfg_.embed_rows()});
  if (cfg_.qk_norm) {
    const int64_t qk_rows = L * (cfg_.n_heads + cfg_.n_kv_heads);
    qk_in_ = alloc(act_, {qk_rows, cfg_.head_dim()});
    qk_scratch_ = alloc(act_, {qk_rows, cfg_.head_dim()});
    qk_rstd_ = alloc(DType::F32, {qk_rows});
  }
  if (cfg_.alibi) {
    alibi_slopes_ = alloc(DType::F32, {cfg_.n_heads});
    be_.copy_from_host(alibi_slopes_, alibi_slopes(cfg_.n_heads).data());
  }
  for (int l = 0; l < cfg_.n_layers; ++l) {
    k_cache_.push_back(alloc(act_, {L, cfg_.kv_dim()}));
    v_cache_.push_back(alloc(act_, {L, cfg_.kv_dim()}));
  }
}

Generator::~Generator() {
  for (void* p : allocations_) be_.release(p);
}

Tensor Generator::alloc(DType t, std::initializer_list<int64_t> dims) {
  Tensor x(nullptr, t, dims, be_.device());
  x.data = be_.allocate(x.bytes());
  allocations_.push_back(x.data);
  return x;
}

Tensor Generator::view(const std::string& name) const { return param_view(weights_, table_.at(name)); }

// Consecutive parameters (wq|wk|wv, w_gate|w_up, bq|bk|bv) seen as one operand.
Tensor Generator::fused(const std::string& first, int64_t rows, int64_t cols) const {
  Tensor t = view(first);
  t.ndim = cols > 0 ? 2 : 1;
  t.shape = {rows, cols > 0 ? cols : 0, 0, 0};
  return t;
}

namespace {
// The first n elements of a 1-D tensor.
Tensor head_of(const Tensor& t, int64_t n) {
  Tensor h = t;
  h.shape[0] = n;
  return h;
}
}  // namespace

void Generator::norm(const Tensor& out, const Tensor& in, const std::string& prefix, int64_t n) {
  if (cfg_.is_gpt2())
    be_.layernorm_forward(out, head_of(mean_, n), head_of(rstd_, n), in, view(prefix + ".weight"),
                          view(prefix + ".bias"), cfg_.norm_eps);
  else
    be_.rmsnorm_forward(out, head_of(rstd_, n), in, view(prefix + ".weight"), cfg_.norm_eps);
}

void Generator::rewind(int64_t position) {
  if (position < 0 || position > pos_)
    throw std::invalid_argument("Generator::rewind: position " + std::to_string(position) + " is not among the " +
                                std::to_string(pos_) + " tokens fed");
  pos_ = position;
}

std::vector<float> Generator::forward(const int32_t* tokens, int n, bool all_rows) {
  if (n < 1) throw std::invalid_argument("Generator::forward: no tokens");
  if (pos_ + n > max_len_)
    throw std::invalid_argument("Generator: positions up to " + std::to_string(pos_ + n) +
                                " exceed the " + std::to_string(max_len_) + " the caches were made for");
  const bool gpt2 = cfg_.is_gpt2();
  const int64_t d = cfg_.d_model, q = cfg_.q_dim(), kv = cfg_.kv_dim(), F = cfg_.ffn_hidden;
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size)
      throw std::invalid_argument("Generator: token " + std::to_string(tokens[i]) + " is outside the vocabulary (" +
                                  std::to_string(cfg_.vocab_size) + ")");

  auto rows = [n](const Tensor& t) { return t.row_slice(0, n); };
  const Tensor tok = head_of(tokens_, n);
  be_.copy_from_host(tok, tokens);
  const Tensor x = rows(x_), h = rows(normed_), qkv = rows(qkv_), attn = rows(attn_), proj = rows(proj_),
               fc = rows(fc_), act = rows(act_out_);

  Tensor pos_embed;
  if (cfg_.learned_positions()) pos_embed = view("pos_embed").row_slice(pos_, pos_ + n);  // positions pos_ ..
  if (cfg_.embedding_norm) {
    be_.embedding_forward(h, tok, view("tok_embed"), pos_embed, n, 0, Tensor());
    norm(x, h, "embed_norm", n);
  } else {
    be_.embedding_forward(x, tok, view("tok_embed"), pos_embed, n, 0, Tensor());
  }

  AttnShape shape{1, n, cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_dim()};
  shape.alibi_slopes = alibi_slopes_;
  shape.window = cfg_.sliding_window;
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    norm(h, x, p + "attn_norm", n);
    Tensor bqkv = cfg_.has_qkv_bias() ? fused(p + "attn.bq", q + 2 * kv, 0) : Tensor();
    be_.matmul(qkv, h, fused(p + "attn.wq", q + 2 * kv, d), false, true, false,
               cfg_.has_qkv_bias() ? &bqkv : nullptr);
    if (cfg_.qk_norm) {
      const int64_t r = static_cast<int64_t>(n) * (cfg_.n_heads + cfg_.n_kv_heads);
      qk_norm_forward(be_, qkv, shape, view(p + "attn.q_norm.weight"), view(p + "attn.k_norm.weight"), cfg_.norm_eps,
                      {qk_in_.row_slice(0, r), qk_rstd_.elements(0, r), qk_scratch_.row_slice(0, r), {}});
    }
    be_.attention_decode(attn, qkv, k_cache_[l], v_cache_[l], shape, pos_, cfg_.rope());
    Tensor bo = gpt2 ? view(p + "attn.bo") : Tensor();
    be_.matmul(proj, attn, view(p + "attn.wo"), false, true, false, gpt2 ? &bo : nullptr);
    be_.add(x, x, proj);

    norm(h, x, p + "mlp_norm", n);
    if (gpt2) {
      Tensor b_fc = view(p + "mlp.b_fc"), b_proj = view(p + "mlp.b_proj");
      be_.matmul(fc, h, view(p + "mlp.w_fc"), false, true, false, &b_fc);
      be_.gelu_forward(act, fc);
      be_.matmul(proj, act, view(p + "mlp.w_proj"), false, true, false, &b_proj);
    } else {
      be_.matmul(fc, h, fused(p + "mlp.w_gate", 2 * F, d), false, true);
      be_.swiglu_forward(act, fc);
      be_.matmul(proj, act, view(p + "mlp.w_down"), false, true);
    }
    be_.add(x, x, proj);
  }
  norm(h, x, "final_norm", n);

  // The head only for the rows asked for.
  const int64_t first = all_rows ? 0 : n - 1, m = n - first;
  const int64_t V = cfg_.embed_rows(), vocab = cfg_.vocab_size;
  Tensor logits = logits_.row_slice(0, m);
  be_.matmul(logits, h.row_slice(first, n), view(cfg_.tied_embeddings ? "tok_embed" : "lm_head"), false, true);
  std::vector<float> all(static_cast<size_t>(m * V));
  be_.copy_to_host(all.data(), logits);
  pos_ += n;
  if (V == vocab) return all;
  std::vector<float> out(static_cast<size_t>(m * vocab));
  for (int64_t r = 0; r < m; ++r) std::copy_n(all.begin() + r * V, vocab, out.begin() + r * vocab);
  return out;
}

int32_t choose_token(const std::vector<float>& logits, const SamplingOptions& opts, TokenRng& rng) {
  const int64_t V = static_cast<int64_t>(logits.size());
  if (V == 0) throw std::invalid_argument("choose_token: empty logits");
  if (opts.temperature <= 0) return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  // Tokens by decreasing logit (ties by id), then softmax(logit / T) in double over the kept ones.
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  size_t keep = order.size();
  if (opts.top_k > 0) keep = std::min(keep, static_cast<size_t>(opts.top_k));
  std::vector<double> prob(keep);
  const double top = logits[order[0]];
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += prob[i] = std::exp((logits[order[i]] - top) / opts.temperature);
  if (opts.top_p < 1) {
    // The most likely tokens until their mass reaches top_p, and at least one (transformers'
    // min_tokens_to_keep): top_p 0 keeps only the most likely token.
    double mass = prob[0];
    size_t k = 1;
    while (k < keep && mass < opts.top_p * total) mass += prob[k++];
    keep = k;
    total = mass;
  }
  double u = rng.uniform() * total;
  for (size_t i = 0; i < keep; ++i) {
    u -= prob[i];
    if (u < 0) return order[i];
  }
  return order[keep - 1];
}

std::vector<int32_t> generate(Generator& g, const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int32_t)>& on_token) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
  if (static_cast<int64_t>(prompt.size()) + opts.max_new_tokens > g.max_len())
    throw std::invalid_argument("generate: prompt (" + std::to_string(prompt.size()) + " tokens) + max_new_tokens (" +
                                std::to_string(opts.max_new_tokens) + ") exceed the " + std::to_string(g.max_len()) +
                                " positions available");
  g.reset();
  TokenRng rng(opts.seed);
  std::vector<int32_t> out;
  std::vector<float> logits = g.forward(prompt.data(), static_cast<int>(prompt.size()));
  for (int i = 0; i < opts.max_new_tokens; ++i) {
    for (float x : logits)
      if (!std::isfinite(x)) throw NonFiniteLogits(static_cast<int64_t>(prompt.size()) + i);
    if (opts.choosable_ids > 0 && opts.choosable_ids < static_cast<int64_t>(logits.size()))
      logits.resize(static_cast<size_t>(opts.choosable_ids));
    const int32_t next = choose_token(logits, opts.sampling, rng);
    out.push_back(next);
    if (on_token) on_token(next);
    if (std::find(opts.stop_ids.begin(), opts.stop_ids.end(), next) != opts.stop_ids.end()) break;
    if (i + 1 < opts.max_new_tokens) logits = g.forward(&next, 1);
  }
  return out;
}

}  // namespace keel
