// The CUDA backend's attention settings from the environment, and the device scratch each choice
// takes in a layer's backward: plain C++, so that keel plan and the trainer's memory check count
// what the backend will take without linking it (the backend reads the same settings when made).
//
//   KEEL_ATTENTION           fused (default) | simple | cudnn   which kernels run attention
//   KEEL_ATTN_DS_MB          MiB, default 1024   the fused backward's staged dS tiles; 0: recompute
//   KEEL_CUDNN_WORKSPACE_MB  MiB, default 4096   the most workspace a cuDNN attention graph may take
//
// A value outside these is refused naming the variable and what it takes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace keel {

// An environment setting in whole MiB, as bytes (unset or empty: `fallback`); anything else is
// refused naming the variable, its range and `meaning`.
size_t mib_setting_from_env(const char* var, size_t fallback, const char* meaning);

enum class AttentionKernels { Fused, Simple, Cudnn };
const char* attention_kernels_name(AttentionKernels k);  // "fused", "simple", "cudnn"

inline constexpr size_t kDefaultAttentionDsBudget = size_t{1024} << 20;
inline constexpr size_t kDefaultCudnnWorkspaceCap = size_t{4096} << 20;

struct AttentionSettings {
  AttentionKernels kernels = AttentionKernels::Fused;
  size_t ds_budget = kDefaultAttentionDsBudget;            // KEEL_ATTN_DS_MB
  size_t cudnn_workspace_cap = kDefaultCudnnWorkspaceCap;  // KEEL_CUDNN_WORKSPACE_MB
};
AttentionSettings attention_settings_from_env();

// The fused attention backward's staged dS (kernels/cuda/attention_flash.cu): 2-byte tiles of 64
// keys x 64 queries, the causal ones of each query head, n (n + 1) / 2 for n = ceil(T / 64). It
// launches in chunks of kv heads (with their query heads) and then of sequences that fit the
// budget; with less budget than one kv head's tiles it stages nothing and recomputes instead.
inline constexpr int64_t kAttentionDsTileRows = 64;
inline constexpr int64_t attention_ds_tiles_per_head(int64_t T) {
  const int64_t n = (T + kAttentionDsTileRows - 1) / kAttentionDsTileRows;
  return n * (n + 1) / 2;
}
struct AttentionDsChunks {
  int kv = 0, seqs = 0;  // kv heads and sequences per launch; 0: no staging
  size_t bytes = 0;      // scratch of one chunk
};
AttentionDsChunks attention_ds_chunks(int64_t B, int64_t T, int64_t n_heads, int64_t n_kv_heads, size_t elem_bytes,
                                      size_t budget);

// The width the fused kernels run a head_dim at (64, 128 or 160: those below 64, or between the
// widths, on operand copies zero-padded to it), or 0 above 160 (the plain kernels run it).
inline constexpr int64_t attention_padded_head_dim(int64_t head_dim) {
  return head_dim < 1 ? 0 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : head_dim <= 160 ? 160 : 0;
}

// Device scratch one attention backward of B sequences of T tokens takes (n_heads, n_kv_heads the
// rank's own) under `settings`, with activations of act_bytes (fp32 runs the plain kernels):
//   every kernel but cuDNN's: delta, the fp32 rowsum(dO * O) of each query row and head;
//   fused:  and its staged dS chunk (attention_ds_chunks), and where it pads the head_dim (to 64,
//           128 or 160) the padded copies of qkv, dqkv and dO; above 160 the plain kernels run;
//   cudnn:  the larger of the deterministic backward's dP workspace, B x n_heads x T x T x 2 bytes
//           (Hopper's, the largest), where it fits KEEL_CUDNN_WORKSPACE_MB and the head_dim is
//           one cuDNN takes, and the fused kernels' scratch: they run what cuDNN does not take (a
//           bigger shape, document masking, ALiBi);
//   simple: delta.
// An upper bound: a chunk the device has no memory for is recomputed instead, and cuDNN's other
// algorithms take less.
size_t attention_backward_scratch_bytes(const AttentionSettings& settings, int64_t B, int64_t T, int64_t n_heads,
                                        int64_t n_kv_heads, int64_t head_dim, size_t act_bytes = 2);

}  // namespace keel
