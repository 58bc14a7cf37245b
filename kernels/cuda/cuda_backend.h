// CudaBackend: the Backend op set (kernels/backend.h) on one NVIDIA GPU.
//
// Storage bf16 / fp16 / fp32, arithmetic in fp32 (fp64 for the whole-tensor sums), outputs
// rounded once to their dtype, as the CPU reference does. Deterministic: no floating-point
// atomics anywhere; every reduction runs in an order fixed by the shapes alone (never by the
// number of SMs, the launch or the timing), and cuBLASLt runs one algorithm per shape chosen
// once and cached, with split-K reductions restricted to ones done in fp32 in a separate,
// ordered pass. So the same inputs give bit-identical outputs on every run on the same GPU model.
//
// Work is enqueued on one CUDA stream owned by the backend, which NCCL and the LocalComm copies
// use too (a blocking stream, so it also orders with the legacy default stream); ops return
// without waiting except those that hand a value to the host (copy_to_host, sum, sum_squares,
// max_abs, count_*).
// Memory comes from the device's stream-ordered pool (cudaMallocAsync), kept cached.
//
// Debugging: KEEL_CUDA_SYNC=1 synchronizes after every op, so that an asynchronous fault is
// reported by the op that caused it (with its shapes). KEEL_ATTENTION selects the attention
// kernels: unset or "fused" keel's fused tensor-core ones, "simple" the plain fp32 ones, "cudnn"
// cuDNN's SDPA graphs where they take the call (attention_cudnn.h, which also says what
// KEEL_CUDNN_DETERMINISTIC, KEEL_CUDNN_WORKSPACE_MB and KEEL_CUDNN_LIB do; keel's fused kernels for
// the rest, and for everything where cuDNN cannot be loaded, said once on stderr).
// KEEL_GELU_EPILOGUE=0 makes
// matmul_gelu(_backward) run matmul and the GELU kernel instead of cuBLASLt's GELU epilogues,
// KEEL_RESIDUAL_EPILOGUE=0 makes matmul_residual run matmul then add instead of reading the
// residual as cuBLASLt's C, and KEEL_BGRAD_EPILOGUE=0 makes matmul_bias_grad run matmul then
// bias_backward instead of the BGRADB epilogue, and KEEL_XENT_FUSED=0 makes xent_loss_backward
// run its three kernels instead of the fused one, and KEEL_SPLITK_ANY=0 holds fp32-output
// matmuls (the weight gradients) to the split-K scheme of bf16 outputs, fp32 partials reduced
// in a separate pass, instead of any (each to time or rule out its fusion or choice).
// KEEL_ATTN_DS_MB=<MiB> bounds the scratch of the fused attention backward's staged dS (default
// 1024; 0 makes it recompute the probabilities for dq instead). KEEL_ATTN_WGMMA=1 runs the fused
// attention forward and the backward's dk-dv kernel on Hopper's warpgroup instructions (sm_90a;
// elsewhere it has no effect): off by default until it has been measured on an H100.
// KEEL_CUDA_PROFILE=1 times every
// op with CUDA events and prints the device time per op (and per op and shapes) to stderr when
// the backend is destroyed; KEEL_CUDA_PROFILE=<file> writes it there instead. The GPU time
// between a host synchronisation and the first op after it is booked as idle, not to that op.
//
// This header needs no CUDA headers (the train layer includes it to get the stream for NCCL).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "kernels/attention_settings.h"  // KEEL_ATTENTION, KEEL_ATTN_DS_MB, KEEL_CUDNN_WORKSPACE_MB
#include "kernels/backend.h"

struct CUstream_st;  // cudaStream_t

namespace keel {

class CudaBackend;

namespace cuda {
struct MatmulCache;  // cuBLASLt handle, descriptors and chosen algorithms per shape (matmul.cu)
MatmulCache* create_matmul_cache(CudaBackend& be);
void destroy_matmul_cache(MatmulCache* cache) noexcept;
struct CudnnAttention;  // attention_cudnn.h
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::CUDA; }
  std::string name() const override;
  // "cuda <GPU model> sm_XY cublasLt <version>", then in brackets every setting above that gives
  // other bits than the default kernels (KEEL_ATTENTION, KEEL_ATTN_WGMMA, KEEL_ATTN_DS_MB, the
  // epilogues, KEEL_XENT_FUSED, KEEL_SPLITK_ANY): a resume under other settings is verified within
  // rounding, not bit for bit (train/run.cpp).
  std::string arithmetic() const override;

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void copy_to_host(void* dst, const Tensor& src) override;
  void copy_from_host(const Tensor& dst, const void* src) override;
  void synchronize() override;

  void convert(const Tensor& dst, const Tensor& src) override;
  void fill(const Tensor& dst, float value) override;
  void add(const Tensor& out, const Tensor& a, const Tensor& b) override;
  void scale(const Tensor& x, float s) override;

  void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
              bool accumulate = false, const Tensor* bias = nullptr) override;  // matmul.cu
  void matmul_gelu(const Tensor& act, const Tensor& pre, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                   const Tensor* bias = nullptr) override;  // matmul.cu
  void matmul_gelu_backward(const Tensor& din, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                            const Tensor& pre) override;
  void matmul_residual(const Tensor& out, const Tensor& residual, const Tensor& a, const Tensor& b, bool trans_a,
                       bool trans_b, const Tensor* bias = nullptr) override;  // matmul.cu
  void matmul_bias_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dout, const Tensor& in,
                        bool accumulate_w, bool accumulate_b) override;  // matmul.cu
  void bias_backward(const Tensor& dbias, const Tensor& dout, bool accumulate) override;          // norms.cu

  void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& tok_embed, const Tensor& pos_embed,
                         int T, int64_t vocab_start, const Tensor& positions) override;  // embedding.cu
  void embedding_backward(const Tensor& dtok_embed, const Tensor& dpos_embed, const Tensor& dout,
                          const Tensor& tokens, int T, int64_t vocab_start, const Tensor& positions) override;

  void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                         const Tensor& weight, const Tensor& bias, float eps) override;  // norms.cu
  void layernorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                          const Tensor& in, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                          bool accumulate_din, bool accumulate_dparams) override;
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                       float eps) override;
  void rmsnorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dout, const Tensor& in,
                        const Tensor& weight, const Tensor& rstd, bool accumulate_din,
                        bool accumulate_dparams) override;

  void gelu_forward(const Tensor& out, const Tensor& in) override;  // activations.cu
  void gelu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) override;
  void swiglu_forward(const Tensor& out, const Tensor& in) override;
  void swiglu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) override;
  void swiglu_backward_rebuild(const Tensor& din, const Tensor& out, const Tensor& dout, const Tensor& in) override;

  void rope_forward(const Tensor& qkv, const AttnShape& s, const Rope& rope) override;  // rope.cu
  void rope_backward(const Tensor& dqkv, const AttnShape& s, const Rope& rope) override;
  void qk_heads_copy(const Tensor& heads, const Tensor& qkv, const AttnShape& s, bool to_heads) override;
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, const AttnShape& s) override;  // attention.cu
  void attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                        const AttnShape& s, int64_t pos, const Rope& rope) override;

  void xent_stats(const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits,
                  const Tensor& targets, int64_t vocab_start) override;  // loss.cu
  void xent_rescale(const Tensor& sumexp, const Tensor& local_max, const Tensor& global_max) override;
  void xent_loss(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                 const Tensor& target_logit, const Tensor& targets) override;
  void xent_backward(const Tensor& logits, const Tensor& lse, const Tensor& targets, float dloss,
                     int64_t vocab_start) override;
  void xent_loss_backward(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                          const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                          float dloss) override;

  void adamw(const Tensor& master, const Tensor& working, const Tensor& grad, const Tensor& m, const Tensor& v,
             const AdamWParams& p) override;  // adamw.cu
  double sum(const Tensor& x) override;        // reductions.cu
  double sum_squares(const Tensor& x) override;
  float max_abs(const Tensor& x) override;
  int64_t count_nonfinite(const Tensor& x) override;
  int64_t count_zeros(const Tensor& x) override;
  GradStats grad_stats(const Tensor& x) override;

  // ---- for the train layer ----
  int device_index() const { return device_; }
  CUstream_st* stream() const { return stream_; }
  // High-water mark of the memory keel took from the device pool (bytes), and what it holds now.
  size_t peak_bytes() const override;
  size_t used_bytes() const override;

  // ---- for the op files (kernels/cuda/*.cu) ----
  // Stream-ordered scratch memory, not zeroed; give it back with release() (also stream-ordered,
  // so it may be released right after the last kernel that uses it is enqueued).
  void* scratch(size_t bytes, const char* op);
  // The same, or nullptr where the device is out of memory (for work that has a way without it).
  void* scratch_if_free(size_t bytes, const char* op);
  // The value `bytes` bytes at device address src, copied to the host (synchronizes).
  void read_back(void* dst, const void* src, size_t bytes, const char* op);
  // Waits until the stream has drained; errors name `op` (and `shapes`). With a device wait
  // hook set (kernels/device.h: multi-GPU runs) it polls and calls the hook meanwhile, so a
  // collective that never completes is reported by the hang watchdog; else it blocks.
  void wait_for_stream(const char* op, const std::string& shapes = "");
  // Device table of RoPE (cos, sin) pairs for positions [0, T): [T][head_dim/2][2] floats,
  // computed on the host (kernels/rope_frequencies.h, as the CPU reference) and kept per
  // (T, head_dim, rope).
  const float* rope_table(int T, int head_dim, const Rope& rope);
  bool sync_each_op() const { return sync_each_op_; }  // KEEL_CUDA_SYNC=1
  // KEEL_CUDA_PROFILE: called once per op after its last launch (cuda::check_launch).
  bool profiling() const { return profiler_ != nullptr; }
  void profile_mark(const char* op, const std::string& shapes);
  // Drain the stream and forget what was timed so far: the trainer calls it after its first
  // step, whose one-time costs (lazy module loading, cuBLASLt heuristics, pool growth) would
  // otherwise sit in the means. No-op without KEEL_CUDA_PROFILE.
  void profile_restart();
  bool simple_attention() const { return simple_attention_; }
  // KEEL_ATTENTION=cudnn and cuDNN loaded: attention calls go to cuDNN where it takes them.
  cuda::CudnnAttention* cudnn_attention() const { return cudnn_; }
  // Attention calls cuDNN has run on this backend (the tests check who answered).
  int64_t cudnn_attention_calls() const;
  // Split-K matmuls into fp32 outputs may use any reduction scheme (matmul.cu): KEEL_SPLITK_ANY
  // not 0.
  bool splitk_any() const { return splitk_any_; }
  // Scratch the fused attention backward may take to stage its dS tiles (attention_flash.cu:
  // 5 tile products instead of 7, launched in chunks of heads and sequences that fit):
  // KEEL_ATTN_DS_MB, default 1024 MiB. Below one kv head's tiles (T^2 / 2 * group * 2 bytes),
  // with 0, and where the device has no memory for a chunk's tiles (said once on stderr), its
  // dq kernel recomputes the probabilities instead.
  size_t attention_ds_budget() const { return attn_ds_budget_; }
  void set_attention_ds_budget(size_t bytes) { attn_ds_budget_ = bytes; }
  // The fused attention forward and dk-dv kernels on wgmma (attention_flash.cu): asked for
  // (KEEL_ATTN_WGMMA=1 at construction, or by tests here) and the device runs sm_90a code,
  // which the setter probes once, so the kernels' dispatch reads a flag.
  bool attention_wgmma() const { return attn_wgmma_; }
  void set_attention_wgmma(bool on);
  // Shared memory one block may opt in to on this device (bytes; read once at construction).
  size_t max_smem_per_block() const { return smem_optin_; }
  // L2 cache of this device (bytes; read once at construction). The fused attention picks its
  // block order by it (attention_flash.cu, kv_outgrow_l2) and the fused cross-entropy its rows
  // in flight (loss.cu); tests set it to take either order, or few rows per block.
  size_t l2_bytes() const { return l2_bytes_; }
  void set_l2_bytes(size_t bytes) { l2_bytes_ = bytes; }
  cuda::MatmulCache& matmul_cache() { return *matmul_; }

 private:
  void* raw_alloc(size_t bytes, const char* op, bool null_if_out_of_memory = false);
  struct Profiler;  // cuda_backend.cu
  void profile_harvest();  // after the stream has drained: book the marks' times
  std::unique_ptr<Profiler> profiler_;
  int device_ = 0;
  CUstream_st* stream_ = nullptr;
  bool use_pool_ = true;           // cudaMallocAsync available
  bool sync_each_op_ = false;      // KEEL_CUDA_SYNC
  bool simple_attention_ = false;  // KEEL_ATTENTION=simple
  cuda::CudnnAttention* cudnn_ = nullptr;  // KEEL_ATTENTION=cudnn, owned (attention_cudnn.cpp)
  bool gelu_epilogue_ = true;      // KEEL_GELU_EPILOGUE (not 0)
  bool residual_epilogue_ = true;  // KEEL_RESIDUAL_EPILOGUE (not 0)
  bool bgrad_epilogue_ = true;     // KEEL_BGRAD_EPILOGUE (not 0)
  bool xent_fused_ = true;         // KEEL_XENT_FUSED (not 0)
  bool splitk_any_ = true;         // KEEL_SPLITK_ANY (not 0)
  size_t attn_ds_budget_ = kDefaultAttentionDsBudget;  // KEEL_ATTN_DS_MB
  bool attn_wgmma_ = false;        // KEEL_ATTN_WGMMA=1 on an sm_90a device
  size_t smem_optin_ = 0;
  size_t l2_bytes_ = 0;
  int sm_count_ = 1;
  void* host_scalar_ = nullptr;    // pinned staging for reduction results
  size_t live_bytes_ = 0, peak_bytes_ = 0;
  std::map<void*, size_t> sizes_;  // live allocations (for the memory report)
  cuda::MatmulCache* matmul_ = nullptr;  // owned (create/destroy in matmul.cu)
  std::map<RopeTableKey, void*> rope_tables_;
};

// The stream of a CudaBackend (for NcclComm / LocalComm); throws std::invalid_argument for
// any other backend.
CUstream_st* cuda_stream_of(Backend& backend);
// CudaBackend::profile_restart for a CudaBackend; nothing for any other backend.
void cuda_profile_restart(Backend& backend);

}  // namespace keel
