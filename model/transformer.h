// Forward and backward of the network (a stage of it, once pipeline parallelism lands) for one
// micro-batch, written once for both families against the Backend op set.
//
// Memory: parameters and fp32 gradients live in flat buffers the caller owns (bind());
// activations are allocated once here for (micro_batch, seq_len), so a step allocates nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "model/param_table.h"

namespace keel {

class Transformer {
 public:
  // act_dtype: storage of activations and activation gradients (f32, bf16 or f16).
  Transformer(const ParamTable& table, Backend& backend, DType act_dtype, int micro_batch, int seq_len);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  // Flat buffers laid out by the ParamTable: working weights (any float dtype) and fp32 grads.
  void bind(const Tensor& weights, const Tensor& grads);

  struct LossSum {
    double loss_sum = 0;  // sum of per-token losses over the valid (target >= 0) rows
    int64_t n_valid = 0;  // number of valid rows
  };
  // tokens/targets: host arrays of micro_batch * seq_len. Keeps what backward needs.
  LossSum forward(const int32_t* tokens, const int32_t* targets);
  // Accumulates into the grads: d(dloss * sum of row losses)/d(params). dloss folds the loss
  // averaging (1 / valid tokens in the global batch) and the fp16 loss scale.
  void backward(float dloss);

  Tensor logits() const { return logits_; }  // [B*T, V] after forward, before backward
  Tensor weight(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  const ParamTable& table() const { return table_; }
  int micro_batch() const { return B_; }
  int seq_len() const { return T_; }
  DType act_dtype() const { return act_; }
  // Training FLOPs per token (forward + backward), see the definition in transformer.cpp.
  double flops_per_token() const;

 private:
  struct LayerActs {
    Tensor res_in;              // residual stream entering the layer [N, d]
    Tensor norm1, mean1, rstd1; // attention-norm output and its saved stats
    Tensor qkv;                 // [N, (nh + 2 nkv) hd], after RoPE
    Tensor attn, lse;           // attention output [N, nh hd], log-sum-exp [B, nh, T]
    Tensor res_mid;             // residual after the attention block
    Tensor norm2, mean2, rstd2;
    Tensor fc;                  // MLP input projection: [N, ffn] (gpt2) or [N, 2 ffn] gate|up (llama)
    Tensor act;                 // [N, ffn]
  };

  Tensor alloc(DType t, std::initializer_list<int64_t> dims);
  // A run of consecutive parameters seen as one [rows, cols] operand (wq|wk|wv, w_gate|w_up).
  Tensor fused(const Tensor& flat, const std::string& first, int64_t rows, int64_t cols) const;
  Tensor view(const Tensor& flat, const std::string& name) const;
  void norm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                    const std::string& prefix);
  void norm_backward(const Tensor& din, const Tensor& dout, const Tensor& in, const Tensor& mean,
                     const Tensor& rstd, const std::string& prefix);
  Tensor head_weight(const Tensor& flat) const;

  const ParamTable table_;
  const ModelConfig& cfg_;
  Backend& be_;
  DType act_;
  int B_, T_;
  int64_t N_;
  AttnShape attn_shape_;
  Tensor weights_, grads_;
  std::vector<void*> allocations_;

  Tensor tokens_, targets_;
  std::vector<LayerActs> layers_;
  Tensor res_final_, normf_, meanf_, rstdf_, logits_;
  Tensor row_max_, sumexp_, target_logit_, lse_rows_, row_loss_;
  // backward scratch, reused by every layer
  Tensor dres_, dnorm_, dqkv_, dattn_, dfc_, dact_, proj_out_;
};

}  // namespace keel
