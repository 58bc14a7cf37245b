// Attention over a KV cache for generation: RoPE at absolute positions, append to the cache,
// causal softmax attention of the new rows. The arithmetic repeats rope.cpp and
// attention_forward step for step (the same rotation code with the table of the new rows'
// positions, the same order of every sum), so a decode is bit for bit the matching rows of a
// full forward when the cache has qkv's dtype.
#include <cmath>
#include <vector>

#include "kernels/attention_window.h"
#include "kernels/cpu/cpu_backend.h"
// last: the score's product and sum round separately, as in attention.cpp
#include "kernels/fp_contract_off.h"

namespace keel {

namespace cpu {
// rope.cpp: rotates row n of qkv by row n % T of the cos/sin table.
void rope_rotate(const Tensor& qkv, const AttnShape& s, const std::vector<float>& table, bool inverse);
}  // namespace cpu

using cpu::Named;

void CpuBackend::attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                  const AttnShape& s, int64_t pos, const Rope& rope) {
  const char* op = "attention_decode";
  cpu::check_attn(op, s, {"qkv", qkv});
  cpu::check_float(op, {"out", out});
  cpu::check_float(op, {"k_cache", k_cache});
  cpu::check_float(op, {"v_cache", v_cache});
  const int64_t n = s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  const int64_t cols = s.qkv_cols(), kv_cols = nkv * hd;
  if (s.B != 1) cpu::fail(op, "decodes one sequence (B = 1), got " + cpu::attn_str(s), {{"qkv", qkv}});
  if (!s.positions.empty())
    cpu::fail(op, "decodes one document: document positions are for training", {{"positions", s.positions}});
  if (cpu::rows(out) != n || out.cols() != nh * hd)
    cpu::fail(op, "out must be [n, n_heads*head_dim] for " + cpu::attn_str(s), {{"out", out}, {"qkv", qkv}});
  for (Named c : {Named{"k_cache", k_cache}, Named{"v_cache", v_cache}})
    if (c.t.cols() != kv_cols)
      cpu::fail(op, std::string(c.name) + " must be [max_len, n_kv_heads*head_dim] for " + cpu::attn_str(s), {c});
  const int64_t max_len = cpu::rows(k_cache);
  if (cpu::rows(v_cache) != max_len || pos < 0 || pos + n > max_len)
    cpu::fail(op, "positions [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ") do not fit the caches",
              {{"k_cache", k_cache}, {"v_cache", v_cache}});

  // 1. RoPE on the new rows' q and k at their absolute positions pos .. pos + n - 1
  if (rope.rotates()) cpu::rope_rotate(qkv, s, rope_cos_sin(rope_inv_freq(s.head_dim, rope), pos, n), false);

  // 2. append k and v (as stored in qkv, rounded to the caches' dtype)
  {
    std::vector<float> row(static_cast<size_t>(kv_cols));
    for (int64_t r = 0; r < n; ++r) {
      cpu::load_f32(qkv, r * cols + nh * hd, kv_cols, row.data());
      cpu::store_f32(k_cache, (pos + r) * kv_cols, kv_cols, row.data());
      cpu::load_f32(qkv, r * cols + (nh + nkv) * hd, kv_cols, row.data());
      cpu::store_f32(v_cache, (pos + r) * kv_cols, kv_cols, row.data());
    }
  }

  // 3. attention of each new row over the cache, in attention_forward's order of operations
  const int64_t len = pos + n;
  std::vector<float> keys(static_cast<size_t>(len * kv_cols)), values(keys.size());
  cpu::load_f32(k_cache, 0, len * kv_cols, keys.data());
  cpu::load_f32(v_cache, 0, len * kv_cols, values.data());
  // head-major copies [nkv][len][hd] so each head's rows are contiguous
  std::vector<float> k(keys.size()), v(values.size());
  for (int64_t j = 0; j < len; ++j)
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t d = 0; d < hd; ++d) {
        k[(h * len + j) * hd + d] = keys[j * kv_cols + h * hd + d];
        v[(h * len + j) * hd + d] = values[j * kv_cols + h * hd + d];
      }
  const int64_t group = nh / nkv;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const float* slopes = cpu::check_alibi(op, s);
  const int64_t work = n * nh * len * hd;
#pragma omp parallel if (work >= cpu::kMinParallelWork)
  {
    std::vector<float> p(static_cast<size_t>(len)), o(static_cast<size_t>(hd)), q(static_cast<size_t>(hd));
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < n * nh; ++idx) {
      const int64_t r = idx / nh, h = idx % nh, last = pos + r;
      const int64_t first = attention_first_key(nullptr, last, s.window);
      cpu::load_f32(qkv, r * cols + h * hd, hd, q.data());
      const float* kh = k.data() + (h / group) * len * hd;
      const float* vh = v.data() + (h / group) * len * hd;
      float m = -INFINITY;
      for (int64_t j = first; j <= last; ++j) {
        p[j] = cpu::dot(q.data(), kh + j * hd, hd) * scale + cpu::alibi_bias(slopes, h, last, j);
        m = std::max(m, p[j]);
      }
      float l = 0;
      for (int64_t j = first; j <= last; ++j) {
        p[j] = std::exp(p[j] - m);
        l += p[j];
      }
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t j = first; j <= last; ++j) cpu::axpy(p[j], vh + j * hd, o.data(), hd);
      for (int64_t d = 0; d < hd; ++d) o[d] /= l;
      cpu::store_f32(out, r * nh * hd + h * hd, hd, o.data());
    }
  }
}

}  // namespace keel
