#include "kernels/attention_settings.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace keel {

size_t mib_setting_from_env(const char* var, size_t fallback, const char* meaning) {
  const char* mb = std::getenv(var);
  if (!mb || !*mb) return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(mb, &end, 10);
  if (*end != '\0' || errno != 0 || !std::isdigit(static_cast<unsigned char>(mb[0])) || v > (1ull << 24))
    throw std::invalid_argument(std::string(var) + " must be a whole number of MiB from 0 to 16777216 (" + meaning +
                                "), got '" + mb + "'");
  return static_cast<size_t>(v) << 20;
}

const char* attention_kernels_name(AttentionKernels k) {
  switch (k) {
    case AttentionKernels::Fused: return "fused";
    case AttentionKernels::Simple: return "simple";
    case AttentionKernels::Cudnn: return "cudnn";
  }
  return "?";
}

AttentionSettings attention_settings_from_env() {
  AttentionSettings s;
  s.ds_budget = mib_setting_from_env("KEEL_ATTN_DS_MB", kDefaultAttentionDsBudget,
                                     "the fused attention backward's dS scratch; 0: recompute instead");
  const char* v = std::getenv("KEEL_ATTENTION");
  if (!v || !*v || std::strcmp(v, "fused") == 0) s.kernels = AttentionKernels::Fused;
  else if (std::strcmp(v, "simple") == 0) s.kernels = AttentionKernels::Simple;
  else if (std::strcmp(v, "cudnn") == 0) s.kernels = AttentionKernels::Cudnn;
  else
    throw std::invalid_argument(std::string("KEEL_ATTENTION must be fused (keel's fused kernels, the default), simple "
                                            "(the plain fp32 kernels) or cudnn (cuDNN's flash attention), got '") +
                                v + "'");
  // read only where it is used, as the backend does: a stale value elsewhere stops nothing
  if (s.kernels == AttentionKernels::Cudnn)
    s.cudnn_workspace_cap = mib_setting_from_env("KEEL_CUDNN_WORKSPACE_MB", kDefaultCudnnWorkspaceCap,
                                                 "the most workspace a cuDNN attention graph may take");
  return s;
}

AttentionDsChunks attention_ds_chunks(int64_t B, int64_t T, int64_t n_heads, int64_t n_kv_heads, size_t elem_bytes,
                                      size_t budget) {
  const size_t tile = static_cast<size_t>(kAttentionDsTileRows * kAttentionDsTileRows) * elem_bytes;
  const size_t per_head = static_cast<size_t>(attention_ds_tiles_per_head(T)) * tile;
  const size_t per_kv = n_kv_heads > 0 ? per_head * static_cast<size_t>(n_heads / n_kv_heads) : 0;
  AttentionDsChunks c;
  if (per_kv == 0 || budget < per_kv) return c;
  c.kv = static_cast<int>(std::min<size_t>(static_cast<size_t>(n_kv_heads), budget / per_kv));
  c.seqs = c.kv < n_kv_heads
               ? 1
               : static_cast<int>(std::min<size_t>(static_cast<size_t>(B), budget / (per_kv * n_kv_heads)));
  c.bytes = per_kv * static_cast<size_t>(c.kv) * static_cast<size_t>(c.seqs);
  return c;
}

size_t attention_backward_scratch_bytes(const AttentionSettings& settings, int64_t B, int64_t T, int64_t n_heads,
                                        int64_t n_kv_heads, int64_t head_dim, size_t act_bytes) {
  const size_t rows = static_cast<size_t>(B) * static_cast<size_t>(T);
  // delta = rowsum(dO * O), fp32 per query row and head, beside whatever the kernels stage
  const size_t delta = rows * static_cast<size_t>(n_heads) * 4;
  const size_t wide = static_cast<size_t>(attention_padded_head_dim(head_dim));
  // the plain kernels (chosen, or fp32): delta alone
  if (settings.kernels == AttentionKernels::Simple || act_bytes != 2) return delta;
  // the fused kernels (head_dim up to 160, else the plain ones): their staged dS chunk, and for a
  // head_dim they pad, padded copies of qkv, dqkv and dO
  size_t fused = delta;
  if (wide > 0) fused += attention_ds_chunks(B, T, n_heads, n_kv_heads, 2, settings.ds_budget).bytes;
  if (wide > 0 && wide != static_cast<size_t>(head_dim))
    fused += rows * wide * 2 * static_cast<size_t>(2 * (n_heads + 2 * n_kv_heads) + n_heads);
  if (settings.kernels == AttentionKernels::Fused) return fused;
  const size_t dp = static_cast<size_t>(B) * static_cast<size_t>(n_heads) * static_cast<size_t>(T) *
                    static_cast<size_t>(T) * 2;
  const bool cudnn_takes = head_dim % 8 == 0 && head_dim <= 256 && dp <= settings.cudnn_workspace_cap;
  return std::max(fused, cudnn_takes ? dp : size_t{0});
}

}  // namespace keel
