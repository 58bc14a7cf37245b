// Rotary position embedding, Hugging Face Llama "rotate_half" convention, in place on the query
// and key heads of a packed qkv tensor.
//
// Within a head of hd values, element i < hd/2 pairs with i + hd/2 and both turn by
// angle = pos * inv_freq[i]:
//   y_i        = x_i cos - x_{i+hd/2} sin
//   y_{i+hd/2} = x_{i+hd/2} cos + x_i sin
// Backward applies the transpose (the inverse rotation) to the gradient.
//
// The cos/sin table: kernels/rope_frequencies.h (HF's fp32 recipe, optional Llama 3 scaling).
// Products and sums are rounded one by one as in PyTorch (no fused multiply-add), hence the
// pragma below.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/qk_heads.h"

#include "kernels/fp_contract_off.h"  // last: no fused multiply-add below

namespace keel {

namespace cpu {

// Rotates the n_heads + n_kv_heads query/key heads of every row n by the cos/sin of table row
// n % T (s.positions[n] under document masking); inverse = backward rotation.
// (attention_decode.cpp uses it with a table that starts at the new rows' absolute position.)
void rope_rotate(const Tensor& qkv, const AttnShape& s, const std::vector<float>& table, bool inverse) {
  const int32_t* pos = s.positions.empty() ? nullptr : s.positions.as<const int32_t>();
  const int hd = s.head_dim, half = hd / 2;
  const int64_t rows = static_cast<int64_t>(s.B) * s.T;
  const int64_t cols = s.qkv_cols();
  const int64_t rotated = static_cast<int64_t>(s.n_heads + s.n_kv_heads) * hd;  // q and k, not v
#pragma omp parallel if (rows * rotated >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(rotated));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      const float* cs = table.data() + static_cast<size_t>(pos ? pos[n] : n % s.T) * half * 2;
      cpu::load_f32(qkv, n * cols, rotated, buf.data());
      for (int64_t h0 = 0; h0 < rotated; h0 += hd) {
        float* x = buf.data() + h0;
        for (int i = 0; i < half; ++i) {
          const float c = cs[2 * i], sn = cs[2 * i + 1];
          const float a = x[i], b = x[i + half];
          if (!inverse) {
            x[i] = a * c - b * sn;
            x[i + half] = b * c + a * sn;
          } else {
            x[i] = a * c + b * sn;
            x[i + half] = b * c - a * sn;
          }
        }
      }
      cpu::store_f32(qkv, n * cols, rotated, buf.data());
    }
  }
}

}  // namespace cpu

const std::vector<float>& CpuBackend::rope_table(int T, int head_dim, const Rope& rope) {
  const RopeTableKey key = rope_table_key(T, head_dim, rope);
  auto it = rope_tables_.find(key);
  if (it == rope_tables_.end()) it = rope_tables_.emplace(key, rope_cos_sin(rope_inv_freq(head_dim, rope), 0, T)).first;
  return it->second;
}

void CpuBackend::rope_forward(const Tensor& qkv, const AttnShape& s, const Rope& rope) {
  cpu::check_rope("rope_forward", s, {"qkv", qkv});
  cpu::rope_rotate(qkv, s, rope_table(s.T, s.head_dim, rope), false);
}

void CpuBackend::rope_backward(const Tensor& dqkv, const AttnShape& s, const Rope& rope) {
  cpu::check_rope("rope_backward", s, {"dqkv", dqkv});
  cpu::rope_rotate(dqkv, s, rope_table(s.T, s.head_dim, rope), true);
}

void CpuBackend::qk_heads_copy(const Tensor& heads, const Tensor& qkv, const AttnShape& s, bool to_heads) {
  const char* op = "qk_heads_copy";
  cpu::check_attn(op, s, {"qkv", qkv});
  const int64_t rows = static_cast<int64_t>(s.B) * s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  if (heads.dtype != qkv.dtype || heads.numel() != rows * (nh + nkv) * hd || heads.cols() != hd)
    cpu::fail(op, "heads must be [B*T*(n_heads + n_kv_heads), head_dim] of qkv's dtype for " + cpu::attn_str(s),
              {{"heads", heads}, {"qkv", qkv}});
  const size_t es = dtype_size(qkv.dtype), head_bytes = static_cast<size_t>(hd) * es;
  char* const hb = static_cast<char*>(heads.data);
  char* const qb = static_cast<char*>(qkv.data);
#pragma omp parallel for schedule(static) if (rows * (nh + nkv) * hd >= cpu::kMinParallelWork)
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t h = 0; h < nh + nkv; ++h) {
      char* a = hb + static_cast<size_t>(qk_head_row(n, h, rows, nh, nkv)) * head_bytes;
      char* b = qb + (static_cast<size_t>(n * s.qkv_cols() + h * hd)) * es;
      if (to_heads) std::memcpy(a, b, head_bytes);
      else std::memcpy(b, a, head_bytes);
    }
}

}  // namespace keel
