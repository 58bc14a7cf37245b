#include "model/transformer.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "kernels/alibi.h"
#include "kernels/document_positions.h"
#include "kernels/profile_range.h"
#include "model/qk_norm.h"
#include "train/parallel/comm.h"

namespace keel {

Transformer::Transformer(const ParamTable& table, Backend& backend, DType act_dtype, int micro_batch, int seq_len,
                         int slots, parallel::Comm* tp, RecomputePolicy recompute, bool sequence_parallel,
                         int64_t logits_chunk_rows, bool document_masking, const Transformer* scratch_from)
    : table_(table),
      cfg_(table_.config()),
      be_(backend),
      act_(act_dtype),
      B_(micro_batch),
      T_(seq_len),
      document_masking_(document_masking),
      tp_(tp) {
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
  sp_ = sequence_parallel && tensor_parallel_;
  if (sp_ && N_ % tp_size != 0)
    throw std::invalid_argument("sequence parallelism splits the " + std::to_string(N_) +
                                " token rows of a micro-batch over " + std::to_string(tp_size) +
                                " TP ranks: micro_batch * seq_len must be a multiple of tp");
  rows_ = sp_ ? N_ / tp_size : N_;
  const int64_t d = cfg_.d_model;
  const int hd = cfg_.head_dim();
  q_ = cfg_.q_dim() / tp_size;
  kv_ = cfg_.kv_dim() / tp_size;
  ffn_ = cfg_.ffn_hidden / tp_size;
  vocab_local_ = cfg_.embed_rows() / tp_size;
  vocab_start_ = vocab_local_ * sh.tp_rank;
  attn_shape_ = {B_, T_, cfg_.n_heads / tp_size, cfg_.n_kv_heads / tp_size, hd};
  attn_shape_.window = cfg_.sliding_window;
  const int64_t qkv_cols = attn_shape_.qkv_cols();
  const int64_t fc_cols = cfg_.is_llama() ? 2 * ffn_ : ffn_;
  const bool ln = cfg_.is_gpt2();
  const int stage_layers = sh.end_layer - sh.first_layer;
  if (recompute.full_layers < 0) throw std::invalid_argument("Transformer: recompute_layers must be >= 0");
  recompute_layers_ = std::min(recompute.full_layers, stage_layers);
  selective_ = recompute.selective && recompute_layers_ < stage_layers;
  if (logits_chunk_rows < 0) throw std::invalid_argument("Transformer: logits_chunk_rows must be >= 0 (0: automatic)");
  head_rows_ = logits_chunk_rows > 0
                   ? std::min(N_, logits_chunk_rows)
                   : auto_logits_chunk_rows(N_, vocab_local_, static_cast<int64_t>(dtype_size(act_)));

  // Padded vocab rows (pad_vocab_to_multiple_of) are no token: their logits get a bias of -inf,
  // so they take no share of the softmax (a model padded on import computes the loss it had
  // unpadded) and, with zero gradients, their head rows never train. As llm.c's classifier
  // leaves its padded columns out.
  const int64_t padded_from = std::clamp(cfg_.vocab_size - vocab_start_, int64_t{0}, vocab_local_);
  if (sh.has_head && padded_from < vocab_local_) {
    head_bias_ = alloc(act_, {vocab_local_});  // zero-filled
    be_.fill(head_bias_.elements(padded_from, vocab_local_), -std::numeric_limits<float>::infinity());
  }

  if (cfg_.alibi) {
    // This rank's heads are heads [tp_rank * n_local, ...) of the model (TP splits q by heads).
    const std::vector<float> all = alibi_slopes(cfg_.n_heads);
    attn_shape_.alibi_slopes = alloc(DType::F32, {attn_shape_.n_heads});
    be_.copy_from_host(attn_shape_.alibi_slopes, all.data() + static_cast<size_t>(sh.tp_rank) * attn_shape_.n_heads);
  }

  slots_.resize(static_cast<size_t>(std::max(1, slots)));
  for (Slot& s : slots_) {
    if (sh.has_embedding) s.tokens = alloc(DType::I32, {N_});
    if (sh.has_embedding && cfg_.embedding_norm) {
      s.embed = alloc(act_, {rows_, d});
      if (ln) s.embed_mean = alloc(DType::F32, {rows_});
      s.embed_rstd = alloc(DType::F32, {rows_});
    }
    if (sh.has_head) s.targets = alloc(DType::I32, {N_});
    s.attn = attn_shape_;
    if (document_masking_) s.positions = alloc(DType::I32, {N_});
    s.layers.resize(static_cast<size_t>(stage_layers));
    for (size_t l = 0; l < s.layers.size(); ++l) {
      s.layers[l].res_in = alloc(act_, {rows_, d});
      if (!recomputed(l)) alloc_layer_acts(s.layers[l], ln, qkv_cols, fc_cols, rebuilt(l));
    }
    s.res_final = alloc(act_, {rows_, d});
    if (sh.has_head) {
      s.normf = alloc(act_, {rows_, d});
      if (ln) s.meanf = alloc(DType::F32, {rows_});
      s.rstdf = alloc(DType::F32, {rows_});
      if (head_chunked())
        s.dnormf = alloc(act_, {N_, d});
      else
        s.logits = alloc(act_, {N_, vocab_local_});
      s.row_max = alloc(DType::F32, {N_});
      if (tensor_parallel_) s.local_max = alloc(DType::F32, {N_});
      s.sumexp = alloc(DType::F32, {N_});
      s.target_logit = alloc(DType::F32, {N_});
      s.lse_rows = alloc(DType::F32, {N_});
      s.row_loss = alloc(DType::F32, {N_});
    }
  }
  // The scratch below lives only within one forward or backward: model chunks of one rank
  // (which never run at the same time) share it when scratch_from is given.
  if (scratch_from && (scratch_from->N_ != N_ || scratch_from->rows_ != rows_ || scratch_from->act_ != act_ ||
                       &scratch_from->be_ != &be_))
    throw std::invalid_argument("Transformer: scratch can be shared only between chunks of the same shapes and backend");
  auto scratch = [&](Tensor& mine, const Tensor Transformer::*member, DType t, std::initializer_list<int64_t> dims) {
    const Tensor* theirs = scratch_from ? &(scratch_from->*member) : nullptr;
    mine = theirs && theirs->data ? *theirs : alloc(t, dims);
  };
  if (recompute_layers_ > 0) {
    if (scratch_from && scratch_from->recompute_layers_ > 0)
      scratch_ = scratch_from->scratch_;
    else
      alloc_layer_acts(scratch_, ln, qkv_cols, fc_cols);
  }
  // The rebuilt tensors never live at the same time as a recomputed layer's, nor across layers.
  if (selective_) {
    const Transformer* with_full = recompute_layers_ > 0 ? this
                                   : scratch_from && scratch_from->recompute_layers_ > 0 ? scratch_from
                                                                                          : nullptr;
    if (with_full) {
      rebuilt_norm_ = with_full->scratch_.norm1;
      rebuilt_act_ = with_full->scratch_.act;
    } else {
      scratch(rebuilt_norm_, &Transformer::rebuilt_norm_, act_, {rows_, d});
      scratch(rebuilt_act_, &Transformer::rebuilt_act_, act_, {N_, ffn_});
    }
  }
  if (sh.has_head && head_chunked()) scratch(head_logits_, &Transformer::head_logits_, act_, {head_rows_, vocab_local_});
  scratch(dres_, &Transformer::dres_, act_, {rows_, d});
  scratch(dnorm_, &Transformer::dnorm_, act_, {N_, d});
  if (sh.end_layer > sh.first_layer) {
    scratch(dqkv_, &Transformer::dqkv_, act_, {N_, qkv_cols});
    scratch(dattn_, &Transformer::dattn_, act_, {N_, q_});
    scratch(dfc_, &Transformer::dfc_, act_, {N_, fc_cols});
    if (!ln) scratch(dact_, &Transformer::dact_, act_, {N_, ffn_});  // GPT-2's MLP backward fuses it away
    if (cfg_.qk_norm) {
      const int64_t qk_rows = N_ * (attn_shape_.n_heads + attn_shape_.n_kv_heads);
      scratch(qk_scratch_, &Transformer::qk_scratch_, act_, {qk_rows, hd});
      scratch(dqk_scratch_, &Transformer::dqk_scratch_, act_, {qk_rows, hd});
    }
  }
  // proj_out_: row-parallel outputs (TP only: without it the projections add straight into the
  // residual stream), and under SP the embedding's partial sums before the scatter.
  if ((tensor_parallel_ && sh.end_layer > sh.first_layer) || (sp_ && sh.has_embedding))
    scratch(proj_out_, &Transformer::proj_out_, act_, {N_, d});
  if (sp_) {
    scratch(gathered_, &Transformer::gathered_, act_, {N_, d});
    scratch(row_sums_, &Transformer::row_sums_, act_, {rows_, d});
  }
  for (int l = sh.first_layer; l < sh.end_layer; ++l)
    for (const char* what : {"forward", "backward", "recompute"})
      range_names_.push_back("layer " + std::to_string(l) + " " + what);

  // The grads-ready groups' ranges: the table lays out each group's tensors back to back.
  const size_t n_groups = static_cast<size_t>(sh.end_layer - sh.first_layer) + 2;
  group_range_.assign(n_groups, {0, 0});
  tp_summed_.assign(n_groups, false);
  std::vector<int64_t> group_numel(n_groups, 0);
  for (const ParamSpec& p : table_.params()) {
    const size_t g = p.layer >= 0           ? static_cast<size_t>(p.layer - sh.first_layer)
                     : embedding_tensor(p) ? n_groups - 1
                                           : n_groups - 2;
    auto& [b, e] = group_range_[g];
    if (group_numel[g] == 0) b = e = p.offset;
    b = std::min(b, p.offset);
    e = std::max(e, p.offset + p.numel);
    group_numel[g] += p.numel;
  }
  for (size_t g = 0; g < n_groups; ++g)
    if (group_range_[g].second - group_range_[g].first != group_numel[g])
      throw std::logic_error("Transformer: the gradients of group " + std::to_string(g) +
                             " are not contiguous in the flat buffer");
}

void Transformer::alloc_layer_acts(LayerActs& a, bool layernorm, int64_t qkv_cols, int64_t fc_cols, bool rebuilt) {
  const int64_t d = cfg_.d_model;
  if (!rebuilt) a.norm1 = alloc(act_, {rows_, d});
  if (layernorm) a.mean1 = alloc(DType::F32, {rows_});
  a.rstd1 = alloc(DType::F32, {rows_});
  a.qkv = alloc(act_, {N_, qkv_cols});
  if (cfg_.qk_norm) {
    const int64_t qk_rows = N_ * (attn_shape_.n_heads + attn_shape_.n_kv_heads);
    a.qk_in = alloc(act_, {qk_rows, cfg_.head_dim()});
    a.qk_rstd = alloc(DType::F32, {qk_rows});
  }
  a.attn = alloc(act_, {N_, q_});
  a.lse = alloc(DType::F32, {B_, attn_shape_.n_heads, T_});
  a.res_mid = alloc(act_, {rows_, d});
  if (!rebuilt) a.norm2 = alloc(act_, {rows_, d});
  if (layernorm) a.mean2 = alloc(DType::F32, {rows_});
  a.rstd2 = alloc(DType::F32, {rows_});
  a.fc = alloc(act_, {N_, fc_cols});
  if (!rebuilt) a.act = alloc(act_, {N_, ffn_});
}

int64_t Transformer::auto_logits_chunk_rows(int64_t rows, int64_t vocab_local, int64_t elem_bytes) {
  const int64_t row_bytes = std::max<int64_t>(1, vocab_local * elem_bytes);
  if (rows * row_bytes <= kLogitsChunkBytes) return rows;
  const int64_t fit = kLogitsChunkBytes / row_bytes;
  return fit >= 128 ? fit / 128 * 128 : std::max<int64_t>(1, fit);
}

Tensor Transformer::row_losses(int slot) const { return slots_.at(static_cast<size_t>(slot)).row_loss; }

Tensor Transformer::logits(int slot) const {
  if (head_chunked())
    throw std::logic_error("Transformer::logits: the head computes its logits in chunks of " +
                           std::to_string(head_rows_) + " rows; the whole [" + std::to_string(N_) + ", " +
                           std::to_string(vocab_local_) + "] never exists");
  return slots_.at(static_cast<size_t>(slot)).logits;
}

Transformer::LayerActs Transformer::acts(const Slot& s, size_t local_layer) const {
  if (rebuilt(local_layer)) {
    LayerActs a = s.layers[local_layer];
    a.norm1 = a.norm2 = rebuilt_norm_;
    a.act = rebuilt_act_;
    a.rebuilt = true;
    return a;
  }
  if (!recomputed(local_layer)) return s.layers[local_layer];
  LayerActs a = scratch_;
  a.res_in = s.layers[local_layer].res_in;
  return a;
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

void Transformer::bind(const Tensor& weights, const Tensor& grads, GradWrites* writes) {
  const bool forward_only = grads.empty();
  if (weights.numel() < table_.local_numel() || (!forward_only && grads.numel() < table_.local_numel()))
    throw std::invalid_argument("Transformer::bind: flat buffers have " + std::to_string(weights.numel()) + " / " +
                                std::to_string(grads.numel()) + " elements, the parameter table needs " +
                                std::to_string(table_.local_numel()));
  if (!forward_only && grads.dtype != DType::F32) throw std::invalid_argument("Transformer::bind: gradients must be f32");
  weights_ = weights;
  grads_ = grads;
  w_ = resolve(weights_);
  g_ = forward_only ? Params{} : resolve(grads_);
  writes_ = forward_only ? nullptr : writes;
}

bool Transformer::must_add(std::initializer_list<Tensor> grads) { return !writes_ || writes_->must_add(grads); }

void Transformer::weight_grad(const Tensor& dw, const Tensor& dout, const Tensor& in, const Tensor* db) {
  const bool add_w = must_add({dw});
  if (db)
    be_.matmul_bias_grad(dw, *db, dout, in, add_w, must_add({*db}));
  else
    be_.matmul(dw, dout, in, true, false, add_w);
}

Transformer::Params Transformer::resolve(const Tensor& flat) const {
  const ModelShard& sh = table_.shard();
  const bool gpt2 = cfg_.is_gpt2();
  const int64_t d = cfg_.d_model;
  auto v = [&](const std::string& name) { return view(flat, name); };
  Params p;
  if (sh.has_embedding || table_.contains("tok_embed")) p.tok_embed = v("tok_embed");
  if (sh.has_embedding && cfg_.learned_positions()) p.pos_embed = v("pos_embed");
  if (sh.has_embedding && cfg_.embedding_norm) {
    p.embed_norm_w = v("embed_norm.weight");
    if (gpt2) p.embed_norm_b = v("embed_norm.bias");
  }
  if (sh.has_head) {
    p.final_norm_w = v("final_norm.weight");
    if (gpt2) p.final_norm_b = v("final_norm.bias");
    p.head = v(cfg_.tied_embeddings ? "tok_embed" : "lm_head");
  }
  for (int i = sh.first_layer; i < sh.end_layer; ++i) {
    const std::string n = "layers." + std::to_string(i) + ".";
    LayerParams l;
    l.attn_norm_w = v(n + "attn_norm.weight");
    l.wqkv = fused(flat, n + "attn.wq", q_ + 2 * kv_, d);
    if (cfg_.has_qkv_bias()) l.bqkv = fused(flat, n + "attn.bq", q_ + 2 * kv_, 0);
    if (cfg_.qk_norm) {
      l.q_norm_w = v(n + "attn.q_norm.weight");
      l.k_norm_w = v(n + "attn.k_norm.weight");
    }
    l.wo = v(n + "attn.wo");
    l.mlp_norm_w = v(n + "mlp_norm.weight");
    if (gpt2) {
      l.attn_norm_b = v(n + "attn_norm.bias");
      l.bo = v(n + "attn.bo");
      l.mlp_norm_b = v(n + "mlp_norm.bias");
      l.w_in = v(n + "mlp.w_fc");
      l.b_in = v(n + "mlp.b_fc");
      l.w_out = v(n + "mlp.w_proj");
      l.b_out = v(n + "mlp.b_proj");
    } else {
      l.w_in = fused(flat, n + "mlp.w_gate", 2 * ffn_, d);
      l.w_out = v(n + "mlp.w_down");
    }
    p.layers.push_back(l);
  }
  return p;
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

Tensor Transformer::stage_input(int slot) const {
  const Slot& s = slots_.at(static_cast<size_t>(slot));
  return s.layers.empty() ? s.res_final : s.layers[0].res_in;
}

Tensor Transformer::stage_output(int slot) const { return slots_.at(static_cast<size_t>(slot)).res_final; }

void Transformer::tp_sum(const Tensor& t) {
  if (tensor_parallel_) tp_->all_reduce(t);
}

void Transformer::norm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                               const Tensor& w, const Tensor& b) {
  if (cfg_.is_gpt2())
    be_.layernorm_forward(out, mean, rstd, in, w, b, cfg_.norm_eps);
  else
    be_.rmsnorm_forward(out, rstd, in, w, cfg_.norm_eps);
}

const Tensor& Transformer::gather_rows(const Tensor& local) {
  if (!sp_) return local;
  tp_->all_gather(gathered_, local);
  return gathered_;
}

const Tensor& Transformer::reduce_rows(const Tensor& partial) {
  if (!sp_) {
    tp_sum(partial);
    return partial;
  }
  tp_->reduce_scatter(row_sums_, partial);
  return row_sums_;
}

void Transformer::sum_tp_group(size_t group) {
  if (!tensor_parallel_) return;
  auto sum = [&](const Tensor& g) {
    if (!g.empty()) tp_->all_reduce(g);
  };
  if (group < g_.layers.size()) {
    const LayerParams& g = g_.layers[group];
    if (sp_)
      for (const Tensor* t : {&g.attn_norm_w, &g.attn_norm_b, &g.mlp_norm_w, &g.mlp_norm_b}) sum(*t);
    for (const Tensor* t : {&g.q_norm_w, &g.k_norm_w}) sum(*t);  // empty without qk_norm
  } else if (sp_ && group == head_group()) {
    for (const Tensor* t : {&g_.final_norm_w, &g_.final_norm_b}) sum(*t);
  } else if (sp_ && group == embedding_group()) {
    for (const Tensor* t : {&g_.embed_norm_w, &g_.embed_norm_b}) sum(*t);
  }
}

void Transformer::sum_tp_partial_grads() {
  // The same groups in the same order on every TP rank (each tensor is summed on its own, so
  // the order does not change any bits).
  for (size_t g = 0; g < tp_summed_.size(); ++g)
    if (!tp_summed_[g]) sum_tp_group(g);
  tp_summed_.assign(tp_summed_.size(), false);
}

std::vector<int64_t> Transformer::group_ends() const {
  std::vector<int64_t> ends;
  for (const auto& [b, e] : group_range_)
    if (b < e) ends.push_back(e);
  std::sort(ends.begin(), ends.end());
  return ends;
}

void Transformer::group_done(size_t group) {
  const auto [b, e] = group_range_[group];
  if (!grads_ready_ || b == e) return;
  if (writes_) writes_->prepare_to_add(grads_.elements(b, e));  // zero-fills what no op wrote
  sum_tp_group(group);
  tp_summed_[group] = true;
  grads_ready_(b, e);
}

// din += d(norm)/d(in) applied to dout (din is the residual gradient, so it accumulates),
// or din = it.
void Transformer::norm_backward(const Tensor& din, const Tensor& dout, const Tensor& in, const Tensor& mean,
                                const Tensor& rstd, const Tensor& w, const Tensor& dw, const Tensor& db,
                                bool accumulate_din) {
  const bool add = must_add({dw, db});
  if (cfg_.is_gpt2())
    be_.layernorm_backward(din, dw, db, dout, in, w, mean, rstd, accumulate_din, add);
  else
    be_.rmsnorm_backward(din, dw, dout, in, w, rstd, accumulate_din, add);
}

// Vocab-parallel cross-entropy: each TP rank holds the logits of its vocab slice. The row max
// and the softmax denominator are combined over TP (max, then the local sums rescaled to the
// global max and added), and the target's logit comes from the rank that owns it.
bool Transformer::loss_forward(Slot& s, const Tensor& logits, int64_t r0, int64_t r1, std::optional<float> dloss) {
  const Tensor row_max = s.row_max.elements(r0, r1), sumexp = s.sumexp.elements(r0, r1),
               target_logit = s.target_logit.elements(r0, r1), targets = s.targets.elements(r0, r1);
  if (!tensor_parallel_ && dloss) {
    be_.xent_loss_backward(s.row_loss.elements(r0, r1), s.lse_rows.elements(r0, r1), row_max, sumexp, target_logit,
                           logits, targets, *dloss);
    return true;
  }
  if (!tensor_parallel_) {
    be_.xent_stats(row_max, sumexp, target_logit, logits, targets, 0);
  } else {
    const Tensor local_max = s.local_max.elements(r0, r1);
    be_.xent_stats(local_max, sumexp, target_logit, logits, targets, vocab_start_);
    be_.convert(row_max, local_max);
    tp_->all_reduce(row_max, parallel::ReduceOp::Max);
    be_.xent_rescale(sumexp, local_max, row_max);
    tp_->all_reduce(sumexp);
    tp_->all_reduce(target_logit);
  }
  be_.xent_loss(s.row_loss.elements(r0, r1), s.lse_rows.elements(r0, r1), row_max, sumexp, target_logit, targets);
  return false;
}

void Transformer::head_backward(Slot& s, const Tensor& logits, const Tensor& x, int64_t r0, int64_t r1, float dloss,
                                const Tensor& dnorm, bool dlogits_ready) {
  if (!dlogits_ready)
    be_.xent_backward(logits, s.lse_rows.elements(r0, r1), s.targets.elements(r0, r1), dloss, vocab_start_);
  const Tensor& dlogits = logits;
  probe(true, -1, "d logits (loss gradient x loss scale)", dlogits);
  be_.matmul(dnorm, dlogits, w_.head, false, false);
  weight_grad(g_.head, dlogits, x.row_slice(r0, r1));
}

// res_out = res_in + x W^T (+ b). Without TP one fused op (no projection tensor: the probe sees
// only the sum). With TP the row-parallel partial products are summed over the group (or
// reduce-scattered under SP) first, and the replicated bias is added once (TP rank 0).
void Transformer::output_projection(const Tensor& res_out, const Tensor& res_in, const Tensor& x, const Tensor& w,
                                    const Tensor* bias, int layer, const char* what) {
  if (!tensor_parallel_) {
    be_.matmul_residual(res_out, res_in, x, w, false, true, bias);
    return;
  }
  be_.matmul(proj_out_, x, w, false, true, false, tp_lead() ? bias : nullptr);
  const Tensor& projected = reduce_rows(proj_out_);
  probe(false, layer, what, projected);
  be_.add(res_out, res_in, projected);
}

void Transformer::layer_forward(const LayerActs& a, const LayerParams& w, const AttnShape& shape, int layer,
                                const Tensor* out) {
  const bool gpt2 = cfg_.is_gpt2();
  // attention block: res_mid = res_in + wo(attn(rope(qkv(norm(res_in)))))
  norm_forward(a.norm1, a.mean1, a.rstd1, a.res_in, w.attn_norm_w, w.attn_norm_b);
  probe(false, layer, "attn_norm", a.norm1);
  be_.matmul(a.qkv, gather_rows(a.norm1), w.wqkv, false, true, false, cfg_.has_qkv_bias() ? &w.bqkv : nullptr);
  probe(false, layer, "qkv projection", a.qkv);
  if (cfg_.qk_norm) {
    qk_norm_forward(be_, a.qkv, shape, w.q_norm_w, w.k_norm_w, cfg_.norm_eps, {a.qk_in, a.qk_rstd, qk_scratch_, {}});
    probe(false, layer, "q/k norms", a.qkv);
  }
  if (cfg_.rope().rotates()) {
    be_.rope_forward(a.qkv, shape, cfg_.rope());
    probe(false, layer, "rope", a.qkv);
  }
  be_.attention_forward(a.attn, a.lse, a.qkv, shape);
  probe(false, layer, "attention", a.attn);
  output_projection(a.res_mid, a.res_in, a.attn, w.wo, gpt2 ? &w.bo : nullptr, layer, "attention output projection");
  // Without TP the projection and the add are one op: a value that overflows there may be wo's.
  probe(false, layer, tensor_parallel_ ? "attention residual add" : "attention output projection (wo) + residual add",
        a.res_mid);

  // MLP block: res_out = res_mid + down(act(up(norm(res_mid))))
  norm_forward(a.norm2, a.mean2, a.rstd2, a.res_mid, w.mlp_norm_w, w.mlp_norm_b);
  probe(false, layer, "mlp_norm", a.norm2);
  if (gpt2) {
    if (a.rebuilt) {  // the GELU as backward will rebuild it: from the stored fc
      be_.matmul(a.fc, gather_rows(a.norm2), w.w_in, false, true, false, &w.b_in);
      mlp_activation(a);
    } else {
      be_.matmul_gelu(a.act, a.fc, gather_rows(a.norm2), w.w_in, false, true, &w.b_in);  // fc, then gelu(fc)
    }
    probe(false, layer, "mlp input projection", a.fc);
    probe(false, layer, "gelu", a.act);
  } else {
    be_.matmul(a.fc, gather_rows(a.norm2), w.w_in, false, true, false, nullptr);
    probe(false, layer, "mlp gate/up projection", a.fc);
    mlp_activation(a);
    probe(false, layer, "swiglu", a.act);
  }
  if (!out) return;  // recomputing: backward needs nothing further
  output_projection(*out, a.res_mid, a.act, w.w_out, gpt2 ? &w.b_out : nullptr, layer, "mlp output projection");
  probe(false, layer, tensor_parallel_ ? kLayerOutputOp : kLayerOutputFusedOp, *out);
}

void Transformer::mlp_activation(const LayerActs& a) {
  if (cfg_.is_gpt2())
    be_.gelu_forward(a.act, a.fc);
  else
    be_.swiglu_forward(a.act, a.fc);
}

Transformer::LossSum Transformer::forward(int slot_index, const int32_t* tokens, const int32_t* targets,
                                          std::optional<float> dloss, const int32_t* positions) {
  if (weights_.empty()) throw std::logic_error("Transformer::forward before bind()");
  if (dloss && grads_.empty()) throw std::logic_error("Transformer::forward: a dloss (training) needs gradients to bind");
  Slot& s = slots_.at(static_cast<size_t>(slot_index));
  const ModelShard& sh = table_.shard();
  Tensor none;
  s.attn.positions = Tensor();
  if (positions) {
    if (!document_masking_)
      throw std::logic_error("Transformer::forward: document positions given to a model built without document masking");
    // The GPU kernels trust the positions (they skip key tiles by them); check them here.
    if (const std::string why = document_positions_error(positions, N_, T_); !why.empty())
      throw std::invalid_argument("Transformer::forward: " + why);
    be_.copy_from_host(s.positions, positions);
    s.attn.positions = s.positions;
  }

  if (sh.has_embedding) {
    const ProfileRange range("embedding forward");
    if (!tokens) throw std::invalid_argument("Transformer::forward: the embedding stage needs tokens");
    need_params(embedding_group());
    be_.copy_from_host(s.tokens, tokens);
    // Vocab-parallel: each rank embeds the tokens of its slice (others give 0), the sum over TP
    // is the embedding. Positions are added once, by TP rank 0.
    // Under SP the [N, d] partial sums go to proj_out_ first, and this rank keeps its rows.
    // With embedding_norm the sum goes to s.embed, and its norm is the stage's input.
    const Tensor in = stage_input(slot_index);
    const Tensor embed = cfg_.embedding_norm ? s.embed : in;
    be_.embedding_forward(sp_ ? proj_out_ : embed, s.tokens, w_.tok_embed, tp_lead() ? w_.pos_embed : none, T_,
                          vocab_start_, s.attn.positions);
    if (sp_)
      tp_->reduce_scatter(embed, proj_out_);
    else
      tp_sum(embed);
    probe(false, -1, "embedding", embed);
    if (cfg_.embedding_norm) {
      norm_forward(in, s.embed_mean, s.embed_rstd, embed, w_.embed_norm_w, w_.embed_norm_b);
      probe(false, -1, "embed_norm", in);
    }
  }

  for (size_t l = 0; l < s.layers.size(); ++l) {
    const ProfileRange range(range_name(l, 0));
    const Tensor& next = l + 1 < s.layers.size() ? s.layers[l + 1].res_in : s.res_final;
    need_params(l);
    layer_forward(acts(s, l), w_.layers[l], s.attn, sh.first_layer + static_cast<int>(l), &next);
  }

  LossSum r;
  if (!sh.has_head) return r;
  const ProfileRange range(head_chunked() && dloss ? "head + loss forward and backward (chunked)" : "head + loss forward");
  if (!targets) throw std::invalid_argument("Transformer::forward: the head stage needs targets");
  need_params(head_group());
  be_.copy_from_host(s.targets, targets);
  norm_forward(s.normf, s.meanf, s.rstdf, s.res_final, w_.final_norm_w, w_.final_norm_b);
  probe(false, -1, "final_norm", s.normf);
  const Tensor& x = gather_rows(s.normf);
  s.head_dloss.reset();
  if (!head_chunked()) {
    be_.matmul(s.logits, x, w_.head, false, true, false, head_bias());
    probe(false, -1, "logits (head)", s.logits);
    loss_forward(s, s.logits, 0, N_);
  } else {
    // The loss and, for training, the head's backward a chunk of rows at a time (see the top).
    for (int64_t r0 = 0; r0 < N_; r0 += head_rows_) {
      const int64_t r1 = std::min(N_, r0 + head_rows_);
      const Tensor logits = head_logits_.row_slice(0, r1 - r0);
      be_.matmul(logits, x.row_slice(r0, r1), w_.head, false, true, false, head_bias());
      probe(false, -1, "logits (head)", logits);
      const bool dlogits_ready = loss_forward(s, logits, r0, r1, dloss);
      if (dloss) head_backward(s, logits, x, r0, r1, *dloss, s.dnormf.row_slice(r0, r1), dlogits_ready);
    }
    s.head_dloss = dloss;
  }
  probe(false, -1, "cross-entropy loss", s.row_loss);
  for (int64_t i = 0; i < N_; ++i) r.n_valid += targets[i] >= 0;
  r.loss_sum = be_.sum(s.row_loss);
  return r;
}

void Transformer::backward(int slot_index, float dloss) {
  if (grads_.empty()) throw std::logic_error("Transformer::backward: bound without gradients (forward only)");
  Slot& s = slots_.at(static_cast<size_t>(slot_index));
  const ModelShard& sh = table_.shard();
  const bool gpt2 = cfg_.is_gpt2();

  if (sh.has_head) {
    const ProfileRange range("head backward");
    // loss -> logits (in place) -> head and final norm; a chunked head did its part in forward
    Tensor dnorm_partial = dnorm_;
    if (!head_chunked()) {
      head_backward(s, s.logits, gather_rows(s.normf), 0, N_, dloss, dnorm_);
    } else {
      if (!s.head_dloss || *s.head_dloss != dloss)
        throw std::logic_error("Transformer::backward: the chunked head runs its backward in forward, which must be "
                               "given the same dloss (" + std::to_string(dloss) + ")");
      s.head_dloss.reset();
      dnorm_partial = s.dnormf;
    }
    const Tensor& dnormf = reduce_rows(dnorm_partial);  // each rank saw only its vocab slice
    probe(true, -1, "d final_norm output (head backward)", dnormf);
    norm_backward(dres_, dnormf, s.res_final, s.meanf, s.rstdf, w_.final_norm_w, g_.final_norm_w, g_.final_norm_b,
                  false);
    probe(true, -1, "d final_norm input", dres_);
    group_done(head_group());
  }
  // else: the caller has put d(loss)/d(stage output) into dres_ (grad_output()).

  // dres_ carries d(loss)/d(residual stream) down through the layers.
  for (size_t li = s.layers.size(); li-- > 0;) {
    const LayerActs a = acts(s, li);
    const LayerParams& w = w_.layers[li];
    const LayerParams& g = g_.layers[li];
    const int layer = sh.first_layer + static_cast<int>(li);
    if (recomputed(li)) {
      const ProfileRange range(range_name(li, 2));
      recomputing_ = true;  // its forward already probed these ops
      struct Reset {
        bool& flag;
        ~Reset() { flag = false; }
      } reset{recomputing_};
      layer_forward(a, w, s.attn, layer, nullptr);
    }
    const ProfileRange range(range_name(li, 1));  // to the end of the layer's backward

    // MLP block (under SP, dres_all is the gathered rows until norm2 is gathered)
    const Tensor& dres_all = gather_rows(dres_);
    if (gpt2) {
      if (a.rebuilt) mlp_activation(a);
      weight_grad(g.w_out, dres_all, a.act, &g.b_out);
      // d fc = gelu'(fc) * (dres W_out): the output projection's input gradient through the GELU
      be_.matmul_gelu_backward(dfc_, dres_all, w.w_out, false, false, a.fc);
      probe(true, layer, "d mlp input projection (output projection and gelu backward)", dfc_);
    } else {
      be_.matmul(dact_, dres_all, w.w_out, false, false);
      probe(true, layer, "d swiglu output (mlp output projection backward)", dact_);
      if (a.rebuilt)  // the activation for the weight gradient below, from the same read of fc
        be_.swiglu_backward_rebuild(dfc_, a.act, dact_, a.fc);
      else
        be_.swiglu_backward(dfc_, dact_, a.fc);
      probe(true, layer, "d gate/up projection (swiglu backward)", dfc_);
      weight_grad(g.w_out, dres_all, a.act);
    }
    be_.matmul(dnorm_, dfc_, w.w_in, false, false);
    // (norm_forward rewrites the kept statistics with the same bits)
    if (a.rebuilt) norm_forward(a.norm2, a.mean2, a.rstd2, a.res_mid, w.mlp_norm_w, w.mlp_norm_b);
    weight_grad(g.w_in, dfc_, gather_rows(a.norm2), gpt2 ? &g.b_in : nullptr);
    const Tensor& dnorm2 = reduce_rows(dnorm_);  // column-parallel input gradient: partial over TP
    probe(true, layer, "d mlp_norm output (mlp input projection backward)", dnorm2);
    norm_backward(dres_, dnorm2, a.res_mid, a.mean2, a.rstd2, w.mlp_norm_w, g.mlp_norm_w, g.mlp_norm_b);
    probe(true, layer, "d attention residual (mlp_norm backward)", dres_);

    // attention block
    const Tensor& dmid_all = gather_rows(dres_);
    be_.matmul(dattn_, dmid_all, w.wo, false, false);
    weight_grad(g.wo, dmid_all, a.attn, gpt2 ? &g.bo : nullptr);
    probe(true, layer, "d attention output (output projection backward)", dattn_);
    be_.attention_backward(dqkv_, dattn_, a.qkv, a.attn, a.lse, s.attn);
    probe(true, layer, "d qkv (attention backward)", dqkv_);
    if (cfg_.rope().rotates()) {
      be_.rope_backward(dqkv_, s.attn, cfg_.rope());
      probe(true, layer, "d qkv (rope backward)", dqkv_);
    }
    if (cfg_.qk_norm) {
      qk_norm_backward(be_, dqkv_, s.attn, w.q_norm_w, w.k_norm_w, g.q_norm_w, g.k_norm_w,
                       {a.qk_in, a.qk_rstd, qk_scratch_, dqk_scratch_}, must_add({g.q_norm_w, g.k_norm_w}));
      probe(true, layer, "d qkv (q/k norms backward)", dqkv_);
    }
    be_.matmul(dnorm_, dqkv_, w.wqkv, false, false);
    if (a.rebuilt) norm_forward(a.norm1, a.mean1, a.rstd1, a.res_in, w.attn_norm_w, w.attn_norm_b);
    weight_grad(g.wqkv, dqkv_, gather_rows(a.norm1), cfg_.has_qkv_bias() ? &g.bqkv : nullptr);
    const Tensor& dnorm1 = reduce_rows(dnorm_);
    probe(true, layer, "d attn_norm output (qkv projection backward)", dnorm1);
    norm_backward(dres_, dnorm1, a.res_in, a.mean1, a.rstd1, w.attn_norm_w, g.attn_norm_w, g.attn_norm_b);
    probe(true, layer, "layer input gradient (attn_norm backward)", dres_);
    group_done(li);
  }

  if (sh.has_embedding) {
    const ProfileRange range("embedding backward");
    Tensor dembed = dres_;
    if (cfg_.embedding_norm) {
      dembed = dnorm_.row_slice(0, rows_);  // free once the layers are done
      norm_backward(dembed, dres_, s.embed, s.embed_mean, s.embed_rstd, w_.embed_norm_w, g_.embed_norm_w,
                    g_.embed_norm_b, false);
      probe(true, -1, "d embedding (embed_norm backward)", dembed);
    }
    // Every TP rank accumulates the rows of its vocab slice, and the (replicated) position
    // gradient in full, so all replicas of pos_embed see the same gradient.
    if (writes_) {  // a scatter-add: rows no token hit keep their value
      writes_->prepare_to_add(g_.tok_embed);
      writes_->prepare_to_add(g_.pos_embed);
    }
    be_.embedding_backward(g_.tok_embed, g_.pos_embed, gather_rows(dembed), s.tokens, T_, vocab_start_,
                           s.attn.positions);
    group_done(embedding_group());
  }
  // else: dres_ (grad_input()) now holds d(loss)/d(stage input) for the previous stage.
}

double Transformer::flops_per_token() const { return keel::flops_per_token(cfg_, T_); }

}  // namespace keel
