// Qwen3's QK-norm (Megatron's --qk-layernorm, RMSNorm flavour): after the q/k/v projection and
// before RoPE, every head of q and of k goes through an RMSNorm over head_dim, q heads with
// q_norm.weight and k heads with k_norm.weight (each [head_dim], shared by the heads).
//
// Built from existing ops: qk_heads_copy lays the q and k heads out one per row, rmsnorm runs on
// the q rows and on the k rows, and the normalised heads are copied back into qkv. Backward
// mirrors it. The norm's input (the rows before it) and 1/rms are kept for backward.
#pragma once

#include "kernels/backend.h"

namespace keel {

// Buffers of one micro-batch's QK-norm, rows = B*T*(n_heads + n_kv_heads) of head_dim (the q
// rows first; see Backend::qk_heads_copy).
struct QkNormBuffers {
  Tensor in;       // the heads before the norm [rows, hd] (kept for backward)
  Tensor rstd;     // F32 [rows] (kept for backward)
  Tensor scratch;  // [rows, hd]: the normalised heads in forward, their gradient in backward
  Tensor dscratch; // [rows, hd]: backward's input gradient (may be empty in forward-only use)
};

// In place on qkv's q and k heads.
void qk_norm_forward(Backend& be, const Tensor& qkv, const AttnShape& s, const Tensor& q_w, const Tensor& k_w,
                     float eps, const QkNormBuffers& b);
// In place on dqkv's q and k heads (d normalised -> d input); dq_w, dk_w are written, or added
// to when accumulate.
void qk_norm_backward(Backend& be, const Tensor& dqkv, const AttnShape& s, const Tensor& q_w, const Tensor& k_w,
                      const Tensor& dq_w, const Tensor& dk_w, const QkNormBuffers& b, bool accumulate);

}  // namespace keel
