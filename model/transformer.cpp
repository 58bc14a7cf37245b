#include "model/transformer.h"

#include <stdexcept>

namespace keel {

Transformer::Transformer(const ParamTable& table, Backend& backend, DType act_dtype, int micro_batch, int seq_len)
    : table_(table), cfg_(table_.config()), be_(backend), act_(act_dtype), B_(micro_batch), T_(seq_len) {
  if (seq_len > cfg_.max_seq_len)
    throw std::invalid_argument("sequence length " + std::to_string(seq_len) + " exceeds the model's max_seq_len " +
                                std::to_string(cfg_.max_seq_len));
  N_ = static_cast<int64_t>(B_) * T_;
  const int64_t d = cfg_.d_model, F = cfg_.ffn_hidden, V = cfg_.embed_rows();
  attn_shape_ = {B_, T_, cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_dim()};
  const int64_t qkv_cols = attn_shape_.qkv_cols(), q = cfg_.q_dim();
  const int64_t fc_cols = cfg_.is_llama() ? 2 * F : F;
  const bool ln = cfg_.is_gpt2();

  tokens_ = alloc(DType::I32, {N_});
  targets_ = alloc(DType::I32, {N_});
  const ModelShard& sh = table_.shard();
  layers_.resize(sh.end_layer - sh.first_layer);
  for (auto& a : layers_) {
    a.res_in = alloc(act_, {N_, d});
    a.norm1 = alloc(act_, {N_, d});
    if (ln) a.mean1 = alloc(DType::F32, {N_});
    a.rstd1 = alloc(DType::F32, {N_});
    a.qkv = alloc(act_, {N_, qkv_cols});
    a.attn = alloc(act_, {N_, q});
    a.lse = alloc(DType::F32, {B_, cfg_.n_heads, T_});
    a.res_mid = alloc(act_, {N_, d});
    a.norm2 = alloc(act_, {N_, d});
    if (ln) a.mean2 = alloc(DType::F32, {N_});
    a.rstd2 = alloc(DType::F32, {N_});
    a.fc = alloc(act_, {N_, fc_cols});
    a.act = alloc(act_, {N_, F});
  }
  res_final_ = alloc(act_, {N_, d});
  normf_ = alloc(act_, {N_, d});
  if (ln) meanf_ = alloc(DType::F32, {N_});
  rstdf_ = alloc(DType::F32, {N_});
  logits_ = alloc(act_, {N_, V});
  row_max_ = alloc(DType::F32, {N_});
  sumexp_ = alloc(DType::F32, {N_});
  target_logit_ = alloc(DType::F32, {N_});
  lse_rows_ = alloc(DType::F32, {N_});
  row_loss_ = alloc(DType::F32, {N_});

  dres_ = alloc(act_, {N_, d});
  dnorm_ = alloc(act_, {N_, d});
  dqkv_ = alloc(act_, {N_, qkv_cols});
  dattn_ = alloc(act_, {N_, q});
  dfc_ = alloc(act_, {N_, fc_cols});
  dact_ = alloc(act_, {N_, F});
  proj_out_ = alloc(act_, {N_, d});
}

Transformer::~Transformer() {
  for (void* p : allocations_) be_.release(p);
}

Tensor Transformer::alloc(DType t, std::initializer_list<int64_t> dims) {
  Tensor x(nullptr, t, dims, be_.device());
  x.data = be_.allocate(x.bytes());
  allocations_.push_back(x.data);
  return x;
}

void Transformer::bind(const Tensor& weights, const Tensor& grads) {
  if (weights.numel() != table_.local_numel() || grads.numel() != table_.local_numel())
    throw std::invalid_argument("Transformer::bind: flat buffers have " + std::to_string(weights.numel()) + " / " +
                                std::to_string(grads.numel()) + " elements, the parameter table needs " +
                                std::to_string(table_.local_numel()));
  if (grads.dtype != DType::F32) throw std::invalid_argument("Transformer::bind: gradients must be f32");
  weights_ = weights;
  grads_ = grads;
}

Tensor Transformer::view(const Tensor& flat, const std::string& name) const {
  const ParamSpec& p = table_.at(name);
  Tensor t = flat;
  t.data = static_cast<char*>(flat.data) + p.offset * dtype_size(flat.dtype);
  t.ndim = static_cast<int>(p.local_shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = p.local_shape[i];
  return t;
}

Tensor Transformer::weight(const std::string& name) const { return view(weights_, name); }
Tensor Transformer::grad(const std::string& name) const { return view(grads_, name); }

Tensor Transformer::fused(const Tensor& flat, const std::string& first, int64_t rows, int64_t cols) const {
  Tensor t = view(flat, first);
  t.ndim = cols > 0 ? 2 : 1;
  t.shape = {rows, cols, 0, 0};
  if (cols <= 0) t.shape = {rows, 0, 0, 0};
  return t;
}

Tensor Transformer::head_weight(const Tensor& flat) const {
  return view(flat, cfg_.tied_embeddings ? "tok_embed" : "lm_head");
}

void Transformer::norm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                               const std::string& prefix) {
  if (cfg_.is_gpt2())
    be_.layernorm_forward(out, mean, rstd, in, weight(prefix + ".weight"), weight(prefix + ".bias"), cfg_.norm_eps);
  else
    be_.rmsnorm_forward(out, rstd, in, weight(prefix + ".weight"), cfg_.norm_eps);
}

// din += d(norm)/d(in) applied to dout (din is the residual gradient, so it accumulates).
void Transformer::norm_backward(const Tensor& din, const Tensor& dout, const Tensor& in, const Tensor& mean,
                                const Tensor& rstd, const std::string& prefix) {
  if (cfg_.is_gpt2())
    be_.layernorm_backward(din, grad(prefix + ".weight"), grad(prefix + ".bias"), dout, in, weight(prefix + ".weight"),
                           mean, rstd, true);
  else
    be_.rmsnorm_backward(din, grad(prefix + ".weight"), dout, in, weight(prefix + ".weight"), rstd, true);
}

Transformer::LossSum Transformer::forward(const int32_t* tokens, const int32_t* targets) {
  if (weights_.empty()) throw std::logic_error("Transformer::forward before bind()");
  be_.copy_from_host(tokens_, tokens);
  be_.copy_from_host(targets_, targets);
  const bool gpt2 = cfg_.is_gpt2();
  const int64_t d = cfg_.d_model, q = cfg_.q_dim(), kv = cfg_.kv_dim(), F = cfg_.ffn_hidden;
  const int first = table_.shard().first_layer;

  Tensor none;
  be_.embedding_forward(layers_.empty() ? res_final_ : layers_[0].res_in, tokens_, weight("tok_embed"),
                        gpt2 ? weight("pos_embed") : none, T_, 0);

  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerActs& a = layers_[l];
    const std::string p = "layers." + std::to_string(first + static_cast<int>(l)) + ".";
    const Tensor& next = l + 1 < layers_.size() ? layers_[l + 1].res_in : res_final_;

    // attention block: res_mid = res_in + wo(attn(rope(qkv(norm(res_in)))))
    norm_forward(a.norm1, a.mean1, a.rstd1, a.res_in, p + "attn_norm");
    Tensor bqkv = gpt2 ? fused(weights_, p + "attn.bq", q + 2 * kv, 0) : none;
    be_.matmul(a.qkv, a.norm1, fused(weights_, p + "attn.wq", q + 2 * kv, d), false, true, false,
               gpt2 ? &bqkv : nullptr);
    if (cfg_.is_llama()) be_.rope_forward(a.qkv, attn_shape_, cfg_.rope_theta);
    be_.attention_forward(a.attn, a.lse, a.qkv, attn_shape_);
    Tensor bo = gpt2 ? weight(p + "attn.bo") : none;
    be_.matmul(proj_out_, a.attn, weight(p + "attn.wo"), false, true, false, gpt2 ? &bo : nullptr);
    be_.add(a.res_mid, a.res_in, proj_out_);

    // MLP block: res_out = res_mid + down(act(up(norm(res_mid))))
    norm_forward(a.norm2, a.mean2, a.rstd2, a.res_mid, p + "mlp_norm");
    if (gpt2) {
      Tensor b_fc = weight(p + "mlp.b_fc"), b_proj = weight(p + "mlp.b_proj");
      be_.matmul(a.fc, a.norm2, weight(p + "mlp.w_fc"), false, true, false, &b_fc);
      be_.gelu_forward(a.act, a.fc);
      be_.matmul(proj_out_, a.act, weight(p + "mlp.w_proj"), false, true, false, &b_proj);
    } else {
      be_.matmul(a.fc, a.norm2, fused(weights_, p + "mlp.w_gate", 2 * F, d), false, true);
      be_.swiglu_forward(a.act, a.fc);
      be_.matmul(proj_out_, a.act, weight(p + "mlp.w_down"), false, true);
    }
    be_.add(next, a.res_mid, proj_out_);
  }

  norm_forward(normf_, meanf_, rstdf_, res_final_, "final_norm");
  be_.matmul(logits_, normf_, head_weight(weights_), false, true);
  be_.xent_stats(row_max_, sumexp_, target_logit_, logits_, targets_, 0);
  be_.xent_loss(row_loss_, lse_rows_, row_max_, sumexp_, target_logit_, targets_);

  LossSum r;
  for (int64_t i = 0; i < N_; ++i) r.n_valid += targets[i] >= 0;
  r.loss_sum = be_.sum(row_loss_);
  return r;
}

void Transformer::backward(float dloss) {
  const bool gpt2 = cfg_.is_gpt2();
  const int64_t d = cfg_.d_model, q = cfg_.q_dim(), kv = cfg_.kv_dim(), F = cfg_.ffn_hidden;
  const int first = table_.shard().first_layer;

  // loss -> logits (in place) -> head and final norm
  be_.xent_backward(logits_, lse_rows_, targets_, dloss, 0);
  const Tensor& dlogits = logits_;
  be_.matmul(dnorm_, dlogits, head_weight(weights_), false, false);
  be_.matmul(head_weight(grads_), dlogits, normf_, true, false, true);
  be_.fill(dres_, 0.0f);
  norm_backward(dres_, dnorm_, res_final_, meanf_, rstdf_, "final_norm");

  // dres_ carries d(loss)/d(residual stream) down through the layers.
  for (size_t li = layers_.size(); li-- > 0;) {
    LayerActs& a = layers_[li];
    const std::string p = "layers." + std::to_string(first + static_cast<int>(li)) + ".";

    // MLP block
    if (gpt2) {
      be_.matmul(dact_, dres_, weight(p + "mlp.w_proj"), false, false);
      be_.matmul(grad(p + "mlp.w_proj"), dres_, a.act, true, false, true);
      be_.bias_backward(grad(p + "mlp.b_proj"), dres_);
      be_.gelu_backward(dfc_, dact_, a.fc);
      be_.matmul(dnorm_, dfc_, weight(p + "mlp.w_fc"), false, false);
      be_.matmul(grad(p + "mlp.w_fc"), dfc_, a.norm2, true, false, true);
      be_.bias_backward(grad(p + "mlp.b_fc"), dfc_);
    } else {
      be_.matmul(dact_, dres_, weight(p + "mlp.w_down"), false, false);
      be_.matmul(grad(p + "mlp.w_down"), dres_, a.act, true, false, true);
      be_.swiglu_backward(dfc_, dact_, a.fc);
      be_.matmul(dnorm_, dfc_, fused(weights_, p + "mlp.w_gate", 2 * F, d), false, false);
      be_.matmul(fused(grads_, p + "mlp.w_gate", 2 * F, d), dfc_, a.norm2, true, false, true);
    }
    norm_backward(dres_, dnorm_, a.res_mid, a.mean2, a.rstd2, p + "mlp_norm");

    // attention block
    be_.matmul(dattn_, dres_, weight(p + "attn.wo"), false, false);
    be_.matmul(grad(p + "attn.wo"), dres_, a.attn, true, false, true);
    if (gpt2) be_.bias_backward(grad(p + "attn.bo"), dres_);
    be_.attention_backward(dqkv_, dattn_, a.qkv, a.attn, a.lse, attn_shape_);
    if (cfg_.is_llama()) be_.rope_backward(dqkv_, attn_shape_, cfg_.rope_theta);
    be_.matmul(dnorm_, dqkv_, fused(weights_, p + "attn.wq", q + 2 * kv, d), false, false);
    be_.matmul(fused(grads_, p + "attn.wq", q + 2 * kv, d), dqkv_, a.norm1, true, false, true);
    if (gpt2) be_.bias_backward(fused(grads_, p + "attn.bq", q + 2 * kv, 0), dqkv_);
    norm_backward(dres_, dnorm_, a.res_in, a.mean1, a.rstd1, p + "attn_norm");
  }

  Tensor none;
  be_.embedding_backward(grad("tok_embed"), gpt2 ? grad("pos_embed") : none, dres_, tokens_, T_, 0);
}

// Training FLOPs per token, the PaLM / llm.c convention used for MFU:
//   6 * (parameters that enter a matmul, incl. the head; not the embedding lookups)
//   + 12 * n_layers * seq_len * (n_heads * head_dim)   (QK^T and PV, forward + backward,
//                                                       counted without the causal halving)
double Transformer::flops_per_token() const {
  const double d = cfg_.d_model, q = cfg_.q_dim(), kv = cfg_.kv_dim(), F = cfg_.ffn_hidden;
  const double mlp = cfg_.is_llama() ? 3 * d * F : 2 * d * F;
  const double per_layer = d * (q + 2 * kv) + q * d + mlp;
  const double matmul_params = cfg_.n_layers * per_layer + static_cast<double>(cfg_.embed_rows()) * d;
  return 6 * matmul_params + 12.0 * cfg_.n_layers * T_ * q;
}

}  // namespace keel
