// CpuBackend: the reference implementation of the Backend op set (see kernels/backend.h).
// fp32 arithmetic, outputs rounded to their storage dtype, OpenMP parallel, and deterministic:
// every reduction runs in an order fixed by the shapes alone, never by the thread count.
// One CpuBackend is driven by one thread at a time (it keeps packing buffers between calls).
#pragma once

#include <map>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_util.h"

namespace keel {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::CPU; }
  std::string name() const override;
  std::string arithmetic() const override { return "cpu"; }

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  size_t used_bytes() const override { return used_bytes_; }
  size_t peak_bytes() const override { return peak_bytes_; }
  void copy_to_host(void* dst, const Tensor& src) override;
  void copy_from_host(const Tensor& dst, const void* src) override;

  void convert(const Tensor& dst, const Tensor& src) override;
  void fill(const Tensor& dst, float value) override;
  void add(const Tensor& out, const Tensor& a, const Tensor& b) override;
  void scale(const Tensor& x, float s) override;

  void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
              bool accumulate = false, const Tensor* bias = nullptr) override;
  void bias_backward(const Tensor& dbias, const Tensor& dout, bool accumulate) override;

  void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& tok_embed, const Tensor& pos_embed,
                         int T, int64_t vocab_start, const Tensor& positions) override;
  void embedding_backward(const Tensor& dtok_embed, const Tensor& dpos_embed, const Tensor& dout,
                          const Tensor& tokens, int T, int64_t vocab_start, const Tensor& positions) override;

  void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                         const Tensor& weight, const Tensor& bias, float eps) override;
  void layernorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                          const Tensor& in, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                          bool accumulate_din, bool accumulate_dparams) override;
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                       float eps) override;
  void rmsnorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dout, const Tensor& in,
                        const Tensor& weight, const Tensor& rstd, bool accumulate_din,
                        bool accumulate_dparams) override;

  void gelu_forward(const Tensor& out, const Tensor& in) override;
  void gelu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) override;
  void swiglu_forward(const Tensor& out, const Tensor& in) override;
  void swiglu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) override;

  void rope_forward(const Tensor& qkv, const AttnShape& s, const Rope& rope) override;
  void rope_backward(const Tensor& dqkv, const AttnShape& s, const Rope& rope) override;
  void qk_heads_copy(const Tensor& heads, const Tensor& qkv, const AttnShape& s, bool to_heads) override;
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, const AttnShape& s) override;
  void attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                        const AttnShape& s, int64_t pos, const Rope& rope) override;  // attention_decode.cpp

  void xent_stats(const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits,
                  const Tensor& targets, int64_t vocab_start) override;
  void xent_rescale(const Tensor& sumexp, const Tensor& local_max, const Tensor& global_max) override;
  void xent_loss(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                 const Tensor& target_logit, const Tensor& targets) override;
  void xent_backward(const Tensor& logits, const Tensor& lse, const Tensor& targets, float dloss,
                     int64_t vocab_start) override;

  void adamw(const Tensor& master, const Tensor& working, const Tensor& grad, const Tensor& m, const Tensor& v,
             const AdamWParams& p) override;
  double sum(const Tensor& x) override;
  double sum_squares(const Tensor& x) override;
  float max_abs(const Tensor& x) override;
  int64_t count_nonfinite(const Tensor& x) override;
  int64_t count_zeros(const Tensor& x) override;

 private:
  // matmul operands packed into fp32 panels (kept to avoid re-faulting pages every call)
  cpu::ScratchF32 packed_a_, packed_b_;
  // RoPE cos/sin tables of positions [0, T), built on first use (rope.cpp)
  const std::vector<float>& rope_table(int T, int head_dim, const Rope& rope);
  std::map<RopeTableKey, std::vector<float>> rope_tables_;
  // allocate()'s blocks and their sizes (used_bytes, peak_bytes)
  std::unordered_map<void*, size_t> sizes_;
  size_t used_bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace keel
