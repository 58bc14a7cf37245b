// Forward and backward of one pipeline stage of the network (the whole network when there is
// one stage) for a micro-batch, written once for both families against the Backend op set.
//
// Tensor parallelism (Megatron style): given a TP communicator, attention runs on this rank's
// heads (q and kv heads split alike, so GQA groups stay whole), the MLP is column- then
// row-parallel, and the embedding and the loss are vocab-parallel; the row-parallel outputs
// and the inputs' gradients of column-parallel layers are all-reduced over TP. The full logits
// never exist on one rank.
//
// Sequence parallelism (Megatron's, with TP): the residual stream, the norms and the stage's
// input and output are split by rows (token positions) over the TP ranks: rank r holds rows
// [r N/tp, (r+1) N/tp) of the N = micro_batch * seq_len. The input of a column-parallel matmul
// is all-gathered, and a row-parallel output is reduce-scattered instead of all-reduced (the
// same bytes moved); in backward the reverse. Activations that were replicated on every TP
// rank are stored once, split; the norm gradients are then partial sums over TP, which
// sum_tp_partial_grads() completes after the micro-batches.
//
// Pipeline parallelism: a stage without the embedding reads its input from stage_input(slot)
// (the trainer receives it there); a stage without the head leaves its output in
// stage_output(slot), takes the output's gradient in grad_output() and leaves the gradient of
// its input in grad_input(). Activations are kept per slot so that a 1F1B schedule can hold
// several micro-batches in flight.
//
// Memory: parameters and fp32 gradients live in flat buffers the caller owns (bind());
// activations are allocated once here, so a step allocates nothing.
//
// Activation recomputation (Megatron's full granularity, block method): the first
// `recompute_layers` layers of the stage keep only their input per slot. Their forward writes
// its intermediates into one scratch set shared by all of them, and backward runs the layer's
// forward again from the kept input (up to the MLP activation: the output projection and the
// residual add are not needed) before its backward. The backend is deterministic, so the
// recomputed tensors are the same bits and the gradients equal those of a run without
// recomputation bit for bit; the cost is about one more forward pass of those layers (and,
// under TP, one more all-reduce per layer).
//
// Selective recomputation (what PyTorch's compiler does to element-wise ops; Megatron's
// --recompute-modules layernorm and the MLP activation): the other layers drop the two norm
// outputs and the MLP activation, the cheapest tensors to rebuild per byte, and keep the norms'
// statistics and the MLP input projection. Their forward writes the three into one shared
// scratch pair, and backward rebuilds each from the kept tensors right before the weight
// gradient that reads it: the same ops on the same bits, so again nothing changes but memory.
// (GPT-2's GELU then runs as its own op after the input projection, not fused into it: a fused
// GELU rounds after applying itself to the fp32 product, which no rebuild from the stored
// projection could repeat.) On the 1B Llama this is 192 of a layer's 593 MiB per micro-batch of
// 8192 tokens. The rebuild costs one more pass of the two norms, and a write of the SwiGLU
// output, which its gradient's kernel computes from the input it reads anyway
// (Backend::swiglu_backward_rebuild).
//
// Chunked head (for large vocabularies): the [N, V/tp] logits of a micro-batch can dwarf a
// layer's activations (Llama 3's 128K vocab at 16K tokens: 4 GiB in bf16). When they exceed
// the chunk (logits_chunk_rows), forward computes them a chunk of rows at a time into one
// shared buffer, and, given the loss gradient, runs the head's backward on each chunk right
// away (loss -> logits -> head weight gradient and final-norm output gradient), so the full
// logits never exist and nothing is computed twice. Row results are those of the unchunked
// head bit for bit; only the head weight gradient's fp32 sum is split into per-chunk terms.
//
// Document masking (packed sequences): given the tokens' document positions, attention stays
// within each document and RoPE / GPT-2's learned positions count from the document's start,
// so a document packed after others computes what it would alone.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <vector>

#include "kernels/backend.h"
#include "model/grad_writes.h"
#include "model/param_table.h"

namespace keel {

namespace parallel {
class Comm;
}

// What a stage recomputes in backward instead of keeping (see the top).
struct RecomputePolicy {
  int full_layers = 0;     // the first layers keep only their input (0: none; more than the stage has: all)
  bool selective = false;  // the other layers drop their norm outputs and MLP activation
};

class Transformer {
 public:
  // act_dtype: storage of activations and activation gradients (f32, bf16 or f16).
  // slots: micro-batches whose activations are kept at once. tp: the tensor-parallel group
  // (nullptr: no tensor parallelism; the table must then be unsharded). recompute: how many of
  // the stage's layers, from its first, recompute all their activations in backward, and
  // whether the others rebuild their norm outputs and MLP activation.
  // sequence_parallel: split the replicated rows over TP (needs tp and N divisible by its size).
  // logits_chunk_rows: token rows of logits computed at once (0: auto_logits_chunk_rows; N or
  // more: never chunk).
  // document_masking: forward may be given the tokens' document positions (packed documents then
  // attend only within themselves and count positions from their start:
  // kernels/document_positions.h); a buffer for them is kept per slot.
  // scratch_from: another model chunk of this rank (interleaved pipeline) whose backward and
  // recomputation scratch this one reuses; they must never run at the same time. It must
  // outlive this one.
  Transformer(const ParamTable& table, Backend& backend, DType act_dtype, int micro_batch, int seq_len, int slots = 1,
              parallel::Comm* tp = nullptr, RecomputePolicy recompute = {}, bool sequence_parallel = false,
              int64_t logits_chunk_rows = 0, bool document_masking = false,
              const Transformer* scratch_from = nullptr);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  // Flat buffers laid out by the ParamTable: working weights (any float dtype) and fp32 grads.
  // They may be longer than the table (padding); only the table's range is used. Empty grads:
  // forward only (evaluation), and backward throws. writes (optional, over the same grads): the
  // step's record of written gradients, so that the first contribution to a gradient stores
  // it and later ones add (model/grad_writes.h); without it every contribution adds, and the
  // caller zero-fills the gradients before a step.
  void bind(const Tensor& weights, const Tensor& grads, GradWrites* writes = nullptr);

  struct LossSum {
    double loss_sum = 0;  // sum of per-token losses over the valid (target >= 0) rows
    int64_t n_valid = 0;  // number of valid rows
  };
  // tokens: host array of micro_batch * seq_len, needed by the stage holding the embedding;
  // targets: likewise, needed by the stage holding the head (the only one that returns a loss).
  // dloss: the value backward(slot, dloss) will get, when a backward follows (training). A
  // chunked head needs it to run its backward chunk by chunk here; an unchunked one ignores it.
  // positions: host array of micro_batch * seq_len document positions (document masking; every
  // stage needs them), or nullptr: plain causal attention over each sequence.
  LossSum forward(int slot, const int32_t* tokens, const int32_t* targets, std::optional<float> dloss = std::nullopt,
                  const int32_t* positions = nullptr);
  // Accumulates into the grads. On the stage with the head, from the loss: dloss folds the
  // averaging (1 / valid tokens in the global batch) and the fp16 loss scale. On other
  // stages, from grad_output(), which the caller fills first.
  void backward(int slot, float dloss);

  LossSum forward(const int32_t* tokens, const int32_t* targets, std::optional<float> dloss = std::nullopt,
                  const int32_t* positions = nullptr) {
    return forward(0, tokens, targets, dloss, positions);
  }
  void backward(float dloss) { backward(0, dloss); }

  Tensor stage_input(int slot) const;   // [rows, d]: where a received activation goes
  Tensor stage_output(int slot) const;  // [rows, d]: what to send to the next stage
  // (rows: B*T, or this rank's B*T/tp under sequence parallelism)
  Tensor grad_output() const { return dres_; }  // d(loss)/d(stage output), before backward
  Tensor grad_input() const { return dres_; }   // d(loss)/d(stage input), after backward

  // Health probes: when set, called after every op of forward and backward with its output
  // (layer -1: embedding / head). Used to find the first op that overflows, and for per-layer
  // activation and gradient statistics. Unset, it costs a branch per op.
  struct OpProbe {
    bool backward;
    int layer;
    const char* op;
    const Tensor& out;
  };
  // The op names of a layer's output (the per-layer activation statistics read them): the MLP's
  // residual add, or without TP the output projection (w_out) fused with it.
  static constexpr const char* kLayerOutputOp = "layer output (residual add)";
  static constexpr const char* kLayerOutputFusedOp = "layer output (mlp output projection w_out + residual add)";
  using ProbeFn = std::function<void(const OpProbe&)>;
  void set_probe(ProbeFn fn) { probe_ = std::move(fn); }

  // [B*T, V_local] after forward, before backward; only when the head is not chunked.
  Tensor logits(int slot = 0) const;
  // [B*T] fp32 after forward, on the stage with the head: each token's loss, -log p(target),
  // 0 where the target is < 0 (the same on every TP rank).
  Tensor row_losses(int slot = 0) const;
  int64_t logits_chunk_rows() const { return head_rows_; }  // N_ when not chunked
  bool head_chunked() const { return head_rows_ < N_; }
  // The automatic chunk: every row when the [rows, vocab_local] logits take at most
  // kLogitsChunkBytes, else the most rows within that, a multiple of 128 (matmul tiles) when
  // at least 128 fit.
  static constexpr int64_t kLogitsChunkBytes = int64_t{1} << 30;
  static int64_t auto_logits_chunk_rows(int64_t rows, int64_t vocab_local, int64_t elem_bytes);
  Tensor weight(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  const ParamTable& table() const { return table_; }
  int micro_batch() const { return B_; }
  int seq_len() const { return T_; }
  int slots() const { return static_cast<int>(slots_.size()); }
  DType act_dtype() const { return act_; }
  int recompute_layers() const { return recompute_layers_; }  // after clamping to the stage's layers
  bool selective_recompute() const { return selective_; }      // some layer rebuilds its norms and activation
  bool sequence_parallel() const { return sp_; }
  bool document_masking() const { return document_masking_; }
  // After all micro-batches' backward: all-reduce over TP the gradients of replicated tensors
  // that each rank summed over its part only: under sequence parallelism the norms' (its rows),
  // with qk_norm the q/k norms' (its heads). No-op without TP.
  // Groups already summed by the grads-ready path below are skipped (and forgotten, for the next step).
  void sum_tp_partial_grads();

  // DP overlap (train/parallel/grad_buckets.h): when set, backward calls fn(begin, end) with a
  // group's range of the flat gradient buffer as soon as the group is complete: the head's
  // (final norm, head matrix or tied copy) after its backward, each layer's after its
  // backward, the embedding's last. Set it only for the step's last backward of this chunk:
  // the gradients are then final. Before the call, what of the range no op wrote is
  // zero-filled (GradWrites) and the group's TP partial sums are done.
  using GradsReadyFn = std::function<void(int64_t begin, int64_t end)>;
  void set_grads_ready(GradsReadyFn fn) { grads_ready_ = std::move(fn); }
  // DP weight gather overlap (train/parallel/param_gather.h): when set, forward calls fn(end)
  // before it reads a group's weights (the embedding's, then each layer's, then the head's),
  // with the end of the group's range in the flat weight buffer; on return the buffer must
  // hold the current weights up to there.
  using ParamsNeededFn = std::function<void(int64_t end)>;
  void set_params_needed(ParamsNeededFn fn) { params_needed_ = std::move(fn); }
  // Where those groups end in the flat buffers, ascending.
  std::vector<int64_t> group_ends() const;
  // Training FLOPs per token of the whole model (forward + backward) at this T: keel::flops_per_token.
  double flops_per_token() const;

 private:
  // What a layer's backward reads. With recomputation a slot keeps only res_in; the rest are
  // views of the shared scratch_ set (see acts()).
  struct LayerActs {
    Tensor res_in;              // residual stream entering the layer [N, d]
    Tensor norm1, mean1, rstd1; // attention-norm output and its saved stats
    Tensor qkv;                 // [N, (nh + 2 nkv) hd] (local heads), after RoPE
    Tensor qk_in, qk_rstd;      // qk_norm: the q and k heads before it [N (nh + nkv), hd], 1/rms
    Tensor attn, lse;           // attention output [N, nh hd], log-sum-exp [B, nh, T]
    Tensor res_mid;             // residual after the attention block
    Tensor norm2, mean2, rstd2;
    Tensor fc;                  // MLP input projection: [N, ffn] (gpt2) or [N, 2 ffn] gate|up (llama)
    Tensor act;                 // [N, ffn]
    // Selective recomputation: norm1, norm2 (one buffer) and act are shared scratch, rebuilt
    // in backward.
    bool rebuilt = false;
  };
  // The views of one flat buffer (weights or grads) the passes use, resolved once at bind()
  // so a step never looks a tensor up by name. wqkv / w_in are the fused operands
  // (wq|wk|wv, w_gate|w_up); absent tensors (GPT-2 only, or Llama only) stay empty.
  struct LayerParams {
    Tensor attn_norm_w, attn_norm_b, wqkv, bqkv, q_norm_w, k_norm_w, wo, bo;
    Tensor mlp_norm_w, mlp_norm_b, w_in, b_in, w_out, b_out;
  };
  struct Params {
    Tensor tok_embed, pos_embed, embed_norm_w, embed_norm_b, final_norm_w, final_norm_b, head;
    std::vector<LayerParams> layers;
  };
  Params resolve(const Tensor& flat) const;

  struct Slot {
    Tensor tokens, targets;
    Tensor positions;  // document masking: I32 [N]
    Tensor embed, embed_mean, embed_rstd;  // model.embedding_norm: the norm's input [rows, d], stats
    AttnShape attn;    // attn_shape_, with `positions` when this micro-batch's forward got them
    std::vector<LayerActs> layers;
    Tensor res_final;           // residual after the last layer: the stage's output
    Tensor normf, meanf, rstdf;
    Tensor logits;  // [N, V_local]; a chunked head shares head_logits_ instead
    Tensor dnormf;  // chunked head: d(loss)/d(final-norm output), partial over TP [N, d]
    Tensor local_max, row_max, sumexp, target_logit, lse_rows, row_loss;
    std::optional<float> head_dloss;  // chunked head: set when forward ran the head's backward
  };

  Tensor alloc(DType t, std::initializer_list<int64_t> dims);
  // A run of consecutive parameters seen as one [rows, cols] operand (wq|wk|wv, w_gate|w_up).
  Tensor fused(const Tensor& flat, const std::string& first, int64_t rows, int64_t cols) const;
  Tensor view(const Tensor& flat, const std::string& name) const;
  void norm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in, const Tensor& w,
                    const Tensor& b);
  // din is added to (the residual stream's gradient) unless accumulate_din is false.
  void norm_backward(const Tensor& din, const Tensor& dout, const Tensor& in, const Tensor& mean, const Tensor& rstd,
                     const Tensor& w, const Tensor& dw, const Tensor& db, bool accumulate_din = true);
  // Must an op producing these gradients add to them, or may it store (the step's first
  // contribution)? See model/grad_writes.h; without a GradWrites, always add.
  bool must_add(std::initializer_list<Tensor> grads);
  // A weight gradient dW (+)= dout^T in, and with db the bias gradient db (+)= sum_rows dout
  // (one op: a backend may read dout once for both); each stored by the step's first contribution.
  void weight_grad(const Tensor& dw, const Tensor& dout, const Tensor& in, const Tensor* db = nullptr);
  void tp_sum(const Tensor& t);  // all-reduce over the TP group (no-op without TP)
  // Sequence parallelism's two moves (identities without it): the full [N, d] of this rank's
  // rows (all-gathered into gathered_), and the rows of a [N, d] partial sum over TP that this
  // rank holds (reduce-scattered into row_sums_; without SP the sum is all-reduced in place).
  const Tensor& gather_rows(const Tensor& local);
  const Tensor& reduce_rows(const Tensor& partial);
  bool tp_lead() const { return table_.shard().tp_rank == 0; }
  // A block's output projection into the residual stream: res_out = res_in + x w^T (+ bias);
  // `what` names the projection for the probe (TP only: without TP it is fused into the add).
  void output_projection(const Tensor& res_out, const Tensor& res_in, const Tensor& x, const Tensor& w,
                         const Tensor* bias, int layer, const char* what);
  // Rows [r0, r1) of the loss from their logits (vocab-parallel), and its backward: dlogits in
  // place, the final-norm output gradient into dnorm (rows r0.. of x's), the head's weight
  // gradient accumulated. x: the final-norm output of all N rows (gathered under SP).
  // Given dloss, loss_forward also turns the logits into dlogits where the whole vocabulary is
  // local (one pass for both: Backend::xent_loss_backward) and returns true; head_backward is
  // then told so (dlogits_ready).
  bool loss_forward(Slot& s, const Tensor& logits, int64_t r0, int64_t r1, std::optional<float> dloss = std::nullopt);
  void head_backward(Slot& s, const Tensor& logits, const Tensor& x, int64_t r0, int64_t r1, float dloss,
                     const Tensor& dnorm, bool dlogits_ready = false);
  bool recomputed(size_t local_layer) const { return static_cast<int64_t>(local_layer) < recompute_layers_; }
  bool rebuilt(size_t local_layer) const { return selective_ && !recomputed(local_layer); }
  // The activations of a slot's local layer: its own, scratch_ around its kept input, or its
  // own with the rebuilt three in rebuilt_norm_ and rebuilt_act_.
  LayerActs acts(const Slot& s, size_t local_layer) const;
  // Every tensor of a layer but its input; without the norm outputs and the MLP activation
  // when `rebuilt`.
  void alloc_layer_acts(LayerActs& a, bool layernorm, int64_t qkv_cols, int64_t fc_cols, bool rebuilt = false);
  void mlp_activation(const LayerActs& a);  // a.act = GELU or SwiGLU of a.fc, as its own op
  // One layer's forward from a.res_in. `out`: where the layer output goes; nullptr when
  // recomputing for backward, which stops after the MLP activation and probes nothing.
  void layer_forward(const LayerActs& a, const LayerParams& w, const AttnShape& shape, int layer, const Tensor* out);

  void probe(bool backward, int layer, const char* op, const Tensor& out) {
    if (probe_ && !recomputing_) probe_({backward, layer, op, out});
  }

  ProbeFn probe_;
  bool recomputing_ = false;
  // Profiler range names (kernels/profile_range.h): forward, backward, recompute of each layer.
  std::vector<std::string> range_names_;
  const char* range_name(size_t local_layer, int what) const { return range_names_[3 * local_layer + what].c_str(); }
  const ParamTable table_;
  const ModelConfig& cfg_;
  Backend& be_;
  DType act_;
  int B_, T_;
  int64_t N_;
  int64_t rows_;  // rows of the residual stream held here: N_, or N_ / tp under SP
  int recompute_layers_;
  bool selective_ = false;
  int64_t head_rows_;  // logits rows computed at once (N_: not chunked)
  bool sp_ = false;
  bool document_masking_ = false;
  parallel::Comm* tp_;
  bool tensor_parallel_;
  // This rank's sizes (TP-local).
  int64_t q_, kv_, ffn_, vocab_local_, vocab_start_ = 0;
  Tensor head_bias_;  // -inf on this rank's padded vocab columns, 0 elsewhere; empty without any
  const Tensor* head_bias() const { return head_bias_.empty() ? nullptr : &head_bias_; }
  AttnShape attn_shape_;  // without positions (each slot has its own copy); ALiBi's slopes of the local heads
  Tensor weights_, grads_;
  Params w_, g_;  // views of weights_ and grads_
  GradWrites* writes_ = nullptr;
  // Grads-ready groups: layers 0..L-1 of the stage, then the head (L) and the embedding (L+1).
  // Their flat ranges (empty: the stage does not hold the group), and which had their TP
  // partial sums done early this step.
  GradsReadyFn grads_ready_;
  ParamsNeededFn params_needed_;
  std::vector<std::pair<int64_t, int64_t>> group_range_;
  std::vector<bool> tp_summed_;
  size_t head_group() const { return group_range_.size() - 2; }
  size_t embedding_group() const { return group_range_.size() - 1; }
  void sum_tp_group(size_t group);  // the group's replicated gradients, over TP
  void group_done(size_t group);    // grads-ready: complete the group, then report it
  void need_params(size_t group) const {
    if (params_needed_ && group_range_[group].first < group_range_[group].second) params_needed_(group_range_[group].second);
  }
  std::vector<void*> allocations_;
  std::vector<Slot> slots_;
  LayerActs scratch_;  // intermediates of the recomputed layers (res_in left empty)
  // Selective recomputation's scratch: [rows, d] for either norm output, [N, ffn] for the
  // activation (scratch_'s norm1 and act when this rank also recomputes whole layers).
  Tensor rebuilt_norm_, rebuilt_act_;
  Tensor head_logits_;  // chunked head: [head_rows_, V_local], shared by every slot
  // backward scratch, shared by every slot and layer
  Tensor dres_, dnorm_, dqkv_, dattn_, dfc_, dact_, proj_out_;
  Tensor qk_scratch_, dqk_scratch_;  // qk_norm: [N (nh + nkv), hd] each
  Tensor gathered_, row_sums_;  // sequence parallelism: [N, d] and [rows, d]
};

}  // namespace keel
