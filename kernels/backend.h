// The op set every backend implements. CpuBackend (kernels/cpu) is the reference: fp32
// arithmetic, storage in the dtype of each output tensor (bf16/fp16 rounded to nearest even),
// deterministic (every reduction in a fixed order that does not depend on the thread count).
// Other backends are tested against it.
//
// Conventions
// - All tensors are row-major. "N" is the number of token rows (batch * sequence).
// - Inputs may be any float dtype; they are read as fp32. Outputs are rounded to their dtype.
// - Parameter gradients (dweight, dbias, dtok_embed, ...) are fp32 and ACCUMULATED (+=), so
//   micro-batches sum into them. Activation gradients are written unless stated otherwise.
// - Statistics saved for backward (mean, rstd, lse) are fp32.
// - Shapes are checked; a mismatch throws std::invalid_argument naming the op and the shapes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/op_check.h"
#include "kernels/rope_frequencies.h"
#include "kernels/tensor.h"

namespace keel {

// Shape of one causal self-attention call. Query head h reads key/value head
// h / (n_heads / n_kv_heads) (grouped-query attention; n_kv_heads == n_heads is plain MHA).
//
// Document masking (packed sequences, Megatron's reset_attention_mask + reset_position_ids):
// `positions`, when given, is I32 [B*T] on the backend's device, the position of each row
// within its document: 0 at every sequence's first row and at each document's first row, else
// one more than the row before (data/documents.h makes them). Row i of a sequence then attends
// only keys j in [i - positions[i], i], its own document, and RoPE turns it by positions[i].
// Empty: position n % T and plain causal attention over the whole sequence.
//
// ALiBi (kernels/alibi.h): `alibi_slopes`, when given, is F32 [n_heads] on the backend's device,
// the slope m_h of each (local) query head; every score gets S_ij += m_h * (j - i), computed in
// fp32 as float(j - i) * m_h after the scaled dot product (and in attention_decode with i the
// new row's absolute position). j - i is the same within a document, so it composes with
// document masking. Empty: no bias.
//
// Sliding window (Mistral's sliding_window, Megatron's --window-size): `window` > 0 limits row i
// to the `window` keys ending at i, j > i - window, on top of the above (kernels/attention_window.h
// gives each row's first key). In attention_decode i is the new row's absolute position. 0: no
// limit.
struct AttnShape {
  int B = 0, T = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  Tensor positions{};
  Tensor alibi_slopes{};
  int window = 0;
  int64_t qkv_cols() const { return static_cast<int64_t>(n_heads + 2 * n_kv_heads) * head_dim; }
};

// One AdamW update (PyTorch's torch.optim.AdamW semantics, decoupled weight decay):
//   g = grad * grad_scale                       (grad_scale folds loss-scale removal and clipping)
//   p -= lr * weight_decay * p
//   m = beta1 m + (1 - beta1) g ;  v = beta2 v + (1 - beta2) g^2
//   p -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// A run of one call's elements that share a weight decay: [the previous run's end, end).
struct AdamWDecayRun {
  int64_t end = 0;
  float weight_decay = 0;
};

struct AdamWParams {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  // Weight decay by runs of elements (ends ascending, the last one the call's element count),
  // so that one call updates neighbouring tensors of both decay groups (adamw_update: one or
  // two launches a step instead of one per run). Empty: weight_decay for every element.
  std::span<const AdamWDecayRun> decay_runs;
  int64_t step = 1;  // 1-based Adam step count (bias correction)
  float grad_scale = 1;
  // Stochastic rounding of a bf16 working copy written from an fp32 master (off by default;
  // ignored without a master or for fp16/fp32 working copies, which round to nearest even).
  // The value rounds up with probability equal to its distance from the lower bf16 neighbour
  // over the spacing, the random bits a hash of (rounding_seed, step, rounding_index0 + i) for
  // element i of the call (kernels/stochastic_rounding.h): reproducible, unbiased in
  // expectation, and the same bits on the CPU and the GPU. Give each tensor its own seed, and
  // rounding_index0 = the offset of this call's first element within its tensor, so the result
  // does not depend on how the tensor is split into calls (ZeRO shards).
  bool stochastic_rounding = false;
  uint64_t rounding_seed = 0;
  int64_t rounding_index0 = 0;
};

// The runs of an adamw call over n elements: p.decay_runs, or one run of p.weight_decay. Throws
// std::invalid_argument naming the backend, the run and its end when the ends do not ascend
// strictly to n.
std::vector<AdamWDecayRun> adamw_decay_runs(const char* backend, const AdamWParams& p, int64_t n);
// 1 - lr * weight_decay, formed in double and rounded once (what every backend multiplies by).
inline float adamw_decay_factor(float lr, float weight_decay) {
  return static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
}

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  // What fixes the bits of the results: two runs whose backends give the same string, on the
  // same shapes and layout, compute bit-identical numbers (restart verification demands equal
  // bits only then). The CPU reference is thread-count independent; a GPU's bits depend on the
  // GPU model and the library versions that pick its algorithms.
  virtual std::string arithmetic() const { return name(); }

  // ---- memory ----
  virtual void* allocate(size_t bytes) = 0;  // zero-filled, 64-byte aligned
  virtual void release(void* p) = 0;
  // Bytes held through allocate() (and a backend's own scratch) now, and the most held at once
  // since the backend was made: on a GPU what keel takes of the device, on the CPU reference the
  // same allocations, so that the planner's memory model is checked without a GPU. 0: not counted.
  virtual size_t used_bytes() const { return 0; }
  virtual size_t peak_bytes() const { return 0; }
  virtual void copy_to_host(void* dst, const Tensor& src) = 0;      // raw bytes, src.bytes()
  virtual void copy_from_host(const Tensor& dst, const void* src) = 0;
  virtual void synchronize() {}

  // ---- elementwise ----
  virtual void convert(const Tensor& dst, const Tensor& src) = 0;  // equal numel; float dtypes
  virtual void fill(const Tensor& dst, float value) = 0;
  virtual void add(const Tensor& out, const Tensor& a, const Tensor& b) = 0;  // out = a + b
  virtual void scale(const Tensor& x, float s) = 0;                            // x *= s

  // ---- matmul ----
  // out[M,N] = op(a)[M,K] @ op(b)[K,N] (+ bias[N]), op(x) = x^T when trans_x (x stored [K,M]).
  // accumulate: out += (op(a) @ op(b)); the product is summed in fp32 before being added.
  // A linear layer y = x W^T + b with W stored [out, in] is matmul(y, x, W, false, true, false, &b);
  // its backward is matmul(dx, dy, W, false, false) and matmul(dW, dy, x, true, false, true).
  virtual void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                      bool accumulate = false, const Tensor* bias = nullptr) = 0;
  // A linear layer added to the residual stream (the blocks' output projections without TP):
  //   out = residual + (op(a) @ op(b) (+ bias)),  out and residual separate buffers.
  // The reference composes matmul and add, so it rounds the projection to out's dtype before the
  // add; a fused backend (the CUDA backend: cuBLASLt reading residual as C with beta 1) sums in
  // fp32 and rounds once, within one storage rounding of the reference. Saves the add's pass
  // over three [rows, d] tensors.
  virtual void matmul_residual(const Tensor& out, const Tensor& residual, const Tensor& a, const Tensor& b,
                               bool trans_a, bool trans_b, const Tensor* bias = nullptr) {
    if (out.data == residual.data && out.numel() > 0)  // the matmul would overwrite the residual first
      fail_op("Backend", "matmul_residual", "out and residual must be different buffers",
              {{"out", out}, {"residual", residual}});
    matmul(out, a, b, trans_a, trans_b, false, bias);
    add(out, residual, out);
  }
  // dbias[N] = sum_rows dout, added to dbias when accumulate (a gradient's later contributions).
  virtual void bias_backward(const Tensor& dbias, const Tensor& dout, bool accumulate) = 0;
  // A linear layer's parameter gradients from its output gradient dout [rows, out] and input
  // in [rows, in]: dweight[out, in] = dout^T @ in, as matmul(dweight, dout, in, true, false,
  // accumulate_w), and dbias[out] = sum_rows dout, as bias_backward(dbias, dout, accumulate_b).
  // A backend may form both in one pass over dout (the CUDA backend: cuBLASLt's BGRADB epilogue
  // sums dout's columns while the product reads them), saving bias_backward's read of dout.
  virtual void matmul_bias_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dout, const Tensor& in,
                                bool accumulate_w, bool accumulate_b) {
    matmul(dweight, dout, in, true, false, accumulate_w);
    bias_backward(dbias, dout, accumulate_b);
  }

  // ---- embedding ----
  // out[n,:] = tok_embed[tokens[n] - vocab_start, :] when that row is local (vocab-parallel
  // shard [vocab_start, vocab_start + V_local)), else 0; plus pos_embed[p(n), :] if given, where
  // p(n) = positions[n] (I32 [N], document positions as in AttnShape) or, without them, n % T.
  // Backward: dpos_embed[p] += the rows n with p(n) == p, summed in increasing n.
  virtual void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& tok_embed,
                                 const Tensor& pos_embed, int T, int64_t vocab_start, const Tensor& positions) = 0;
  virtual void embedding_backward(const Tensor& dtok_embed, const Tensor& dpos_embed, const Tensor& dout,
                                  const Tensor& tokens, int T, int64_t vocab_start, const Tensor& positions) = 0;

  // ---- norms (over the last dimension) ----
  // LayerNorm: out = (x - mean) * rstd * weight + bias, rstd = 1/sqrt(var + eps) (biased var).
  virtual void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                                 const Tensor& weight, const Tensor& bias, float eps) = 0;
  // din is written, or added to when accumulate_din (the residual stream's gradient). The
  // parameter gradients dweight = sum_rows dout * xhat and dbias = sum_rows dout are written, or
  // added to when accumulate_dparams.
  virtual void layernorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dbias,
                                  const Tensor& dout, const Tensor& in, const Tensor& weight,
                                  const Tensor& mean, const Tensor& rstd, bool accumulate_din,
                                  bool accumulate_dparams) = 0;
  // RMSNorm: out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps).
  virtual void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                               float eps) = 0;
  virtual void rmsnorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dout, const Tensor& in,
                                const Tensor& weight, const Tensor& rstd, bool accumulate_din,
                                bool accumulate_dparams) = 0;

  // ---- activations ----
  // GELU, tanh approximation (GPT-2's "gelu_new"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  virtual void gelu_forward(const Tensor& out, const Tensor& in) = 0;
  virtual void gelu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) = 0;
  // A linear layer into GELU (GPT-2's MLP input projection), which a backend may fuse (the CUDA
  // backend: cuBLASLt's GELU epilogues, saving a read and a write of the activation each way):
  //   matmul_gelu:          pre = op(a) @ op(b) (+ bias), as matmul;  act = gelu(pre)
  //   matmul_gelu_backward: din = gelu'(pre) * (op(a) @ op(b))       (written, like gelu_backward)
  // The reference composes the unfused ops, so it rounds pre (or the product) to its dtype
  // before the GELU; a fused backend applies the GELU to the fp32 value, within one storage
  // rounding of the reference.
  virtual void matmul_gelu(const Tensor& act, const Tensor& pre, const Tensor& a, const Tensor& b, bool trans_a,
                           bool trans_b, const Tensor* bias = nullptr) {
    matmul(pre, a, b, trans_a, trans_b, false, bias);
    gelu_forward(act, pre);
  }
  virtual void matmul_gelu_backward(const Tensor& din, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                                    const Tensor& pre) {
    matmul(din, a, b, trans_a, trans_b);
    gelu_backward(din, din, pre);
  }
  // SwiGLU on a packed [N, 2F] input (gate columns first, then up): out = silu(gate) * up.
  virtual void swiglu_forward(const Tensor& out, const Tensor& in) = 0;
  virtual void swiglu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) = 0;
  // Both in one pass, for selective recomputation (model/transformer.h): the gradient reads the
  // input anyway, so the activation is rebuilt beside it. out gets swiglu_forward's bits, din
  // swiglu_backward's; din must not alias in or out.
  virtual void swiglu_backward_rebuild(const Tensor& din, const Tensor& out, const Tensor& dout, const Tensor& in) {
    swiglu_forward(out, in);
    swiglu_backward(din, dout, in);
  }

  // ---- attention ----
  // qkv is [B*T, (n_heads + 2 n_kv_heads) * head_dim]: per row all query heads, then key heads,
  // then value heads, each head_dim wide. Position of row n is n % T, or s.positions[n].
  // RoPE, Hugging Face "rotate_half" convention: within a head, element i < hd/2 pairs with
  // i + hd/2, rotated by angle pos * inv_freq[i] (kernels/rope_frequencies.h: theta^(-2i/hd),
  // optionally with Llama 3's scaling). Applied in place to q and k; backward applies the
  // inverse rotation in place to dq and dk.
  virtual void rope_forward(const Tensor& qkv, const AttnShape& s, const Rope& rope) = 0;
  virtual void rope_backward(const Tensor& dqkv, const AttnShape& s, const Rope& rope) = 0;
  // The q and k heads of qkv copied to (to_heads) or from `heads` [B*T*(n_heads + n_kv_heads),
  // head_dim], one head per row: q head h of row n at row n * n_heads + h, then k head h of row n
  // at row B*T*n_heads + n * n_kv_heads + h (kernels/qk_heads.h); v is left alone. Same dtype,
  // exact. Per-head ops (Qwen3's QK-norm: rmsnorm over each head) then run as plain row ops on
  // the q and k rows.
  virtual void qk_heads_copy(const Tensor& heads, const Tensor& qkv, const AttnShape& s, bool to_heads) = 0;
  // out[B*T, n_heads*hd] = causal softmax(q k^T / sqrt(hd)) v, per head (within each document
  // when s.positions is given); lse[B, n_heads, T] is the log-sum-exp of each score row (all
  // backward needs; no T x T matrix is kept).
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s) = 0;
  // dqkv (written) from dout, the forward's qkv (after RoPE), out and lse.
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, const AttnShape& s) = 0;

  // ---- inference: attention over a KV cache (generation) ----
  // n new rows of one sequence at positions pos .. pos+n-1, the keys and values of positions
  // 0 .. pos-1 already in the cache. qkv [n, (n_heads + 2 n_kv_heads) * head_dim] holds the new
  // rows' projections before RoPE (s.B = 1, s.T = n). In order, the op
  //   1. applies RoPE in place to their q and k at the absolute positions (rope_forward's
  //      convention; a rope that does not rotate (theta <= 0): GPT-2's learned positions),
  //   2. writes their k and v into rows pos .. pos+n-1 of k_cache and v_cache
  //      ([max_len, n_kv_heads * head_dim] each, any float dtype),
  //   3. out[n, n_heads * head_dim] = softmax(q k^T / sqrt(hd)) v per head, new row i attending
  //      to cache rows 0 .. pos+i (with s.window, the last `window` of them).
  // Row for row this equals rope_forward + attention_forward over the whole sequence.
  virtual void attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                const AttnShape& s, int64_t pos, const Rope& rope) = 0;

  // ---- softmax cross-entropy (vocab-parallel ready) ----
  // logits [N, V_local] hold vocab columns [vocab_start, vocab_start + V_local).
  // Per row: row_max = max_j logits, sumexp = sum_j exp(logits - row_max),
  // target_logit = logits[target - vocab_start] if the target is local, else 0.
  // Rows with target < 0 are ignored (masked out of the loss); their stats are still computed.
  virtual void xent_stats(const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit,
                          const Tensor& logits, const Tensor& targets, int64_t vocab_start) = 0;
  // Vocab-parallel combination: sumexp *= exp(local_max - global_max), so each rank's sum is
  // relative to the max over all vocab shards before the sums are added across them.
  virtual void xent_rescale(const Tensor& sumexp, const Tensor& local_max, const Tensor& global_max) = 0;
  // lse = row_max + log(sumexp); losses[n] = lse - target_logit, or 0 for ignored rows.
  // (Under tensor parallelism the stats are first combined across the vocab shards.)
  virtual void xent_loss(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                         const Tensor& target_logit, const Tensor& targets) = 0;
  // In place: logits[n,j] <- (exp(logits[n,j] - lse[n]) - [j + vocab_start == target[n]]) * dloss,
  // and 0 for ignored rows. dloss is d(total loss)/d(row loss), e.g. loss_scale / n_valid_tokens.
  virtual void xent_backward(const Tensor& logits, const Tensor& lse, const Tensor& targets, float dloss,
                             int64_t vocab_start) = 0;
  // The loss and its gradient in one call when the whole vocabulary is local (no vocab
  // parallelism, so nothing is combined across ranks between the two): xent_stats, xent_loss,
  // then xent_backward in place, as composed here. A fused backend (the CUDA backend: one pass
  // per row, the logits read once from memory and again from L2) gives the same bits.
  virtual void xent_loss_backward(const Tensor& losses, const Tensor& lse, const Tensor& row_max,
                                  const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits,
                                  const Tensor& targets, float dloss) {
    xent_stats(row_max, sumexp, target_logit, logits, targets, 0);
    xent_loss(losses, lse, row_max, sumexp, target_logit, targets);
    xent_backward(logits, lse, targets, dloss, 0);
  }

  // ---- optimizer and reductions ----
  // master (fp32) may be empty: then the working tensor itself is updated (the unsafe
  // "parameters only in bf16" mode). If working aliases master it is not written twice.
  virtual void adamw(const Tensor& master, const Tensor& working, const Tensor& grad, const Tensor& m,
                     const Tensor& v, const AdamWParams& p) = 0;
  virtual double sum(const Tensor& x) = 0;
  virtual double sum_squares(const Tensor& x) = 0;
  virtual float max_abs(const Tensor& x) = 0;  // inf/nan propagate
  virtual int64_t count_nonfinite(const Tensor& x) = 0;
  virtual int64_t count_zeros(const Tensor& x) = 0;
  // sum_squares, count_zeros and count_nonfinite of x, the same values as the three calls; a GPU
  // reads x once instead of three times (the gradient-norm pass over all parameters).
  struct GradStats {
    double sum_squares = 0;
    int64_t zeros = 0, nonfinite = 0;
  };
  virtual GradStats grad_stats(const Tensor& x) { return {sum_squares(x), count_zeros(x), count_nonfinite(x)}; }
};

std::unique_ptr<Backend> make_cpu_backend();

#ifdef KEEL_HAVE_CUDA
// The CUDA backend on GPU `device` (kernels/cuda; the caller picks the device, e.g. the local
// rank's, and should make it current with cudaSetDevice first). Throws std::runtime_error when
// the device cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device);
#endif

}  // namespace keel
