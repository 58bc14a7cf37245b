#include "model/transformer.h"

#include <stdexcept>

#include "train/parallel/comm.h"

namespace keel {

Transformer::Transformer(const ParamTable& table, Backend& backend, DType act_dtype, int micro_batch, int seq_len,
                         int slots, parallel::Comm* tp)
    : table_(table), cfg_(table_.config()), be_(backend), act_(act_dtype), B_(micro_batch), T_(seq_len), tp_(tp) {
  if (seq_len > cfg_.max_seq_len)
    throw std::invalid_argument("sequence length " + std::to_string(seq_len) + " exceeds the model's max_seq_len " +
                                std::to_string(cfg_.max_seq_len));
  const ModelShard& sh = table_.shard();
  const int tp_size = sh.tp_size;
  if (tp_size > 1 && (!tp_ || tp_->size() != tp_size))
    throw std::invalid_argument("Transformer: the parameter table is split over " + std::to_string(tp_size) +
                                " TP ranks but no TP communicator of that size was given");
  tensor_parallel_ = tp_size > 1;
  N_ = static_cast<int64_t>(B_) * T_;
  const int64_t d = cfg_.d_model;
  const int hd = cfg_.head_dim();
  q_ = cfg_.q_dim() / tp_size;
  kv_ = cfg_.kv_dim() / tp_size;
  ffn_ = cfg_.ffn_hidden / tp_size;
  vocab_local_ = cfg_.embed_rows() / tp_size;
  vocab_start_ = vocab_local_ * sh.tp_rank;
  attn_shape_ = {B_, T_, cfg_.n_heads / tp_size, cfg_.n_kv_heads / tp_size, hd};
  const int64_t qkv_cols = attn_shape_.qkv_cols();
  const int64_t fc_cols = cfg_.is_llama() ? 2 * ffn_ : ffn_;
  const bool ln = cfg_.is_gpt2();

  slots_.resize(static_cast<size_t>(std::max(1, slots)));
  for (Slot& s : slots_) {
    if (sh.has_embedding) s.tokens = alloc(DType::I32, {N_});
    if (sh.has_head) s.targets = alloc(DType::I32, {N_});
    s.layers.resize(static_cast<size_t>(sh.end_layer - sh.first_layer));
    for (auto& a : s.layers) {
      a.res_in = alloc(act_, {N_, d});
      a.norm1 = alloc(act_, {N_, d});
      if (ln) a.mean1 = alloc(DType::F32, {N_});
      a.rstd1 = alloc(DType::F32, {N_});
      a.qkv = alloc(act_, {N_, qkv_cols});
      a.attn = alloc(act_, {N_, q_});
      a.lse = alloc(DType::F32, {B_, attn_shape_.n_heads, T_});
      a.res_mid = alloc(act_, {N_, d});
      a.norm2 = alloc(act_, {N_, d});
      if (ln) a.mean2 = alloc(DType::F32, {N_});
      a.rstd2 = alloc(DType::F32, {N_});
      a.fc = alloc(act_, {N_, fc_cols});
      a.act = alloc(act_, {N_, ffn_});
    }
    s.res_final = alloc(act_, {N_, d});
    if (sh.has_head) {
      s.normf = alloc(act_, {N_, d});
      if (ln) s.meanf = alloc(DType::F32, {N_});
      s.rstdf = alloc(DType::F32, {N_});
      s.logits = alloc(act_, {N_, vocab_local_});
      s.row_max = alloc(DType::F32, {N_});
      if (tensor_parallel_) s.local_max = alloc(DType::F32, {N_});
      s.sumexp = alloc(DType::F32, {N_});
      s.target_logit = alloc(DType::F32, {N_});
      s.lse_rows = alloc(DType::F32, {N_});
      s.row_loss = alloc(DType::F32, {N_});
    }
  }
  dres_ = alloc(act_, {N_, d});
  dnorm_ = alloc(act_, {N_, d});
  if (sh.end_layer > sh.first_layer) {
    dqkv_ = alloc(act_, {N_, qkv_cols});
    dattn_ = alloc(act_, {N_, q_});
    dfc_ = alloc(act_, {N_, fc_cols});
    dact_ = alloc(act_, {N_, ffn_});
    proj_out_ = alloc(act_, {N_, d});
  }
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
  if (weights.numel() < table_.local_numel() || grads.numel() < table_.local_numel())
    throw std::invalid_argument("Transformer::bind: flat buffers have " + std::to_string(weights.numel()) + " / " +
                                std::to_string(grads.numel()) + " elements, the parameter table needs " +
                                std::to_string(table_.local_numel()));
  if (grads.dtype != DType::F32) throw std::invalid_argument("Transformer::bind: gradients must be f32");
  weights_ = weights;
  grads_ = grads;
}

Tensor Transformer::view(const Tensor& flat, const std::string& name) const { return param_view(flat, table_.at(name)); }

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

Tensor Transformer::stage_input(int slot) const {
  const Slot& s = slots_.at(static_cast<size_t>(slot));
  return s.layers.empty() ? s.res_final : s.layers[0].res_in;
}

Tensor Transformer::stage_output(int slot) const { return slots_.at(static_cast<size_t>(slot)).res_final; }

void Transformer::tp_sum(const Tensor& t) {
  if (tensor_parallel_) tp_->all_reduce(t);
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

// Vocab-parallel cross-entropy: each TP rank holds the logits of its vocab slice. The row max
// and the softmax denominator are combined over TP (max, then the local sums rescaled to the
// global max and added), and the target's logit comes from the rank that owns it.
void Transformer::loss_forward(Slot& s) {
  if (!tensor_parallel_) {
    be_.xent_stats(s.row_max, s.sumexp, s.target_logit, s.logits, s.targets, 0);
  } else {
    be_.xent_stats(s.local_max, s.sumexp, s.target_logit, s.logits, s.targets, vocab_start_);
    be_.convert(s.row_max, s.local_max);
    tp_->all_reduce(s.row_max, parallel::ReduceOp::Max);
    be_.xent_rescale(s.sumexp, s.local_max, s.row_max);
    tp_->all_reduce(s.sumexp);
    tp_->all_reduce(s.target_logit);
  }
  be_.xent_loss(s.row_loss, s.lse_rows, s.row_max, s.sumexp, s.target_logit, s.targets);
}

Transformer::LossSum Transformer::forward(int slot_index, const int32_t* tokens, const int32_t* targets) {
  if (weights_.empty()) throw std::logic_error("Transformer::forward before bind()");
  Slot& s = slots_.at(static_cast<size_t>(slot_index));
  const ModelShard& sh = table_.shard();
  const bool gpt2 = cfg_.is_gpt2();
  const int64_t d = cfg_.d_model;
  Tensor none;

  if (sh.has_embedding) {
    if (!tokens) throw std::invalid_argument("Transformer::forward: the embedding stage needs tokens");
    be_.copy_from_host(s.tokens, tokens);
    // Vocab-parallel: each rank embeds the tokens of its slice (others give 0), the sum over TP
    // is the embedding. Positions are added once, by TP rank 0.
    be_.embedding_forward(stage_input(slot_index), s.tokens, weight("tok_embed"),
                          gpt2 && tp_lead() ? weight("pos_embed") : none, T_, vocab_start_);
    tp_sum(stage_input(slot_index));
    probe(false, -1, "embedding", stage_input(slot_index));
  }

  for (size_t l = 0; l < s.layers.size(); ++l) {
    LayerActs& a = s.layers[l];
    const std::string p = "layers." + std::to_string(sh.first_layer + static_cast<int>(l)) + ".";
    const Tensor& next = l + 1 < s.layers.size() ? s.layers[l + 1].res_in : s.res_final;
    const int layer = sh.first_layer + static_cast<int>(l);

    // attention block: res_mid = res_in + wo(attn(rope(qkv(norm(res_in)))))
    norm_forward(a.norm1, a.mean1, a.rstd1, a.res_in, p + "attn_norm");
    probe(false, layer, "attn_norm", a.norm1);
    Tensor bqkv = gpt2 ? fused(weights_, p + "attn.bq", q_ + 2 * kv_, 0) : none;
    be_.matmul(a.qkv, a.norm1, fused(weights_, p + "attn.wq", q_ + 2 * kv_, d), false, true, false,
               gpt2 ? &bqkv : nullptr);
    probe(false, layer, "qkv projection", a.qkv);
    if (cfg_.is_llama()) {
      be_.rope_forward(a.qkv, attn_shape_, cfg_.rope_theta);
      probe(false, layer, "rope", a.qkv);
    }
    be_.attention_forward(a.attn, a.lse, a.qkv, attn_shape_);
    probe(false, layer, "attention", a.attn);
    // Row-parallel output: partial sums over TP; the replicated bias is added once (TP rank 0).
    Tensor bo = gpt2 ? weight(p + "attn.bo") : none;
    be_.matmul(proj_out_, a.attn, weight(p + "attn.wo"), false, true, false, gpt2 && tp_lead() ? &bo : nullptr);
    tp_sum(proj_out_);
    probe(false, layer, "attention output projection", proj_out_);
    be_.add(a.res_mid, a.res_in, proj_out_);
    probe(false, layer, "attention residual add", a.res_mid);

    // MLP block: res_out = res_mid + down(act(up(norm(res_mid))))
    norm_forward(a.norm2, a.mean2, a.rstd2, a.res_mid, p + "mlp_norm");
    probe(false, layer, "mlp_norm", a.norm2);
    if (gpt2) {
      Tensor b_fc = weight(p + "mlp.b_fc"), b_proj = weight(p + "mlp.b_proj");
      be_.matmul(a.fc, a.norm2, weight(p + "mlp.w_fc"), false, true, false, &b_fc);
      probe(false, layer, "mlp input projection", a.fc);
      be_.gelu_forward(a.act, a.fc);
      probe(false, layer, "gelu", a.act);
      be_.matmul(proj_out_, a.act, weight(p + "mlp.w_proj"), false, true, false, tp_lead() ? &b_proj : nullptr);
    } else {
      be_.matmul(a.fc, a.norm2, fused(weights_, p + "mlp.w_gate", 2 * ffn_, d), false, true);
      probe(false, layer, "mlp gate/up projection", a.fc);
      be_.swiglu_forward(a.act, a.fc);
      probe(false, layer, "swiglu", a.act);
      be_.matmul(proj_out_, a.act, weight(p + "mlp.w_down"), false, true);
    }
    tp_sum(proj_out_);
    probe(false, layer, "mlp output projection", proj_out_);
    be_.add(next, a.res_mid, proj_out_);
    probe(false, layer, "layer output (residual add)", next);
  }

  LossSum r;
  if (!sh.has_head) return r;
  if (!targets) throw std::invalid_argument("Transformer::forward: the head stage needs targets");
  be_.copy_from_host(s.targets, targets);
  norm_forward(s.normf, s.meanf, s.rstdf, s.res_final, "final_norm");
  probe(false, -1, "final_norm", s.normf);
  be_.matmul(s.logits, s.normf, head_weight(weights_), false, true);
  probe(false, -1, "logits (head)", s.logits);
  loss_forward(s);
  probe(false, -1, "cross-entropy loss", s.row_loss);
  for (int64_t i = 0; i < N_; ++i) r.n_valid += targets[i] >= 0;
  r.loss_sum = be_.sum(s.row_loss);
  return r;
}

void Transformer::backward(int slot_index, float dloss) {
  Slot& s = slots_.at(static_cast<size_t>(slot_index));
  const ModelShard& sh = table_.shard();
  const bool gpt2 = cfg_.is_gpt2();
  const int64_t d = cfg_.d_model;

  if (sh.has_head) {
    // loss -> logits (in place) -> head and final norm
    be_.xent_backward(s.logits, s.lse_rows, s.targets, dloss, vocab_start_);
    const Tensor& dlogits = s.logits;
    probe(true, -1, "d logits (loss gradient x loss scale)", dlogits);
    be_.matmul(dnorm_, dlogits, head_weight(weights_), false, false);
    tp_sum(dnorm_);  // each rank saw only its vocab slice
    probe(true, -1, "d final_norm output (head backward)", dnorm_);
    be_.matmul(head_weight(grads_), dlogits, s.normf, true, false, true);
    be_.fill(dres_, 0.0f);
    norm_backward(dres_, dnorm_, s.res_final, s.meanf, s.rstdf, "final_norm");
    probe(true, -1, "d final_norm input", dres_);
  }
  // else: the caller has put d(loss)/d(stage output) into dres_ (grad_output()).

  // dres_ carries d(loss)/d(residual stream) down through the layers.
  for (size_t li = s.layers.size(); li-- > 0;) {
    LayerActs& a = s.layers[li];
    const std::string p = "layers." + std::to_string(sh.first_layer + static_cast<int>(li)) + ".";
    const int layer = sh.first_layer + static_cast<int>(li);

    // MLP block
    if (gpt2) {
      be_.matmul(dact_, dres_, weight(p + "mlp.w_proj"), false, false);
      be_.matmul(grad(p + "mlp.w_proj"), dres_, a.act, true, false, true);
      be_.bias_backward(grad(p + "mlp.b_proj"), dres_);
      probe(true, layer, "d gelu output (mlp output projection backward)", dact_);
      be_.gelu_backward(dfc_, dact_, a.fc);
      probe(true, layer, "d mlp input projection (gelu backward)", dfc_);
      be_.matmul(dnorm_, dfc_, weight(p + "mlp.w_fc"), false, false);
      be_.matmul(grad(p + "mlp.w_fc"), dfc_, a.norm2, true, false, true);
      be_.bias_backward(grad(p + "mlp.b_fc"), dfc_);
    } else {
      be_.matmul(dact_, dres_, weight(p + "mlp.w_down"), false, false);
      be_.matmul(grad(p + "mlp.w_down"), dres_, a.act, true, false, true);
      probe(true, layer, "d swiglu output (mlp output projection backward)", dact_);
      be_.swiglu_backward(dfc_, dact_, a.fc);
      probe(true, layer, "d gate/up projection (swiglu backward)", dfc_);
      be_.matmul(dnorm_, dfc_, fused(weights_, p + "mlp.w_gate", 2 * ffn_, d), false, false);
      be_.matmul(fused(grads_, p + "mlp.w_gate", 2 * ffn_, d), dfc_, a.norm2, true, false, true);
    }
    tp_sum(dnorm_);  // column-parallel input gradient: partial over TP
    probe(true, layer, "d mlp_norm output (mlp input projection backward)", dnorm_);
    norm_backward(dres_, dnorm_, a.res_mid, a.mean2, a.rstd2, p + "mlp_norm");
    probe(true, layer, "d attention residual (mlp_norm backward)", dres_);

    // attention block
    be_.matmul(dattn_, dres_, weight(p + "attn.wo"), false, false);
    be_.matmul(grad(p + "attn.wo"), dres_, a.attn, true, false, true);
    if (gpt2) be_.bias_backward(grad(p + "attn.bo"), dres_);
    probe(true, layer, "d attention output (output projection backward)", dattn_);
    be_.attention_backward(dqkv_, dattn_, a.qkv, a.attn, a.lse, attn_shape_);
    probe(true, layer, "d qkv (attention backward)", dqkv_);
    if (cfg_.is_llama()) {
      be_.rope_backward(dqkv_, attn_shape_, cfg_.rope_theta);
      probe(true, layer, "d qkv (rope backward)", dqkv_);
    }
    be_.matmul(dnorm_, dqkv_, fused(weights_, p + "attn.wq", q_ + 2 * kv_, d), false, false);
    be_.matmul(fused(grads_, p + "attn.wq", q_ + 2 * kv_, d), dqkv_, a.norm1, true, false, true);
    if (gpt2) be_.bias_backward(fused(grads_, p + "attn.bq", q_ + 2 * kv_, 0), dqkv_);
    tp_sum(dnorm_);
    probe(true, layer, "d attn_norm output (qkv projection backward)", dnorm_);
    norm_backward(dres_, dnorm_, a.res_in, a.mean1, a.rstd1, p + "attn_norm");
    probe(true, layer, "layer input gradient (attn_norm backward)", dres_);
  }

  if (sh.has_embedding) {
    Tensor none;
    // Every TP rank accumulates the rows of its vocab slice, and the (replicated) position
    // gradient in full, so all replicas of pos_embed see the same gradient.
    be_.embedding_backward(grad("tok_embed"), gpt2 ? grad("pos_embed") : none, dres_, s.tokens, T_, vocab_start_);
  }
  // else: dres_ (grad_input()) now holds d(loss)/d(stage input) for the previous stage.
}

// Training FLOPs per token of the whole model, the PaLM / llm.c convention used for MFU:
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
