// RoPE at absolute positions for attention_decode: rope.cpp's recipe (inv_freq = 1 /
// theta^(float(2i)/hd) in fp32, angle = float(pos) * inv_freq, cos/sin correctly rounded),
// applied to rows that sit at positions pos, pos+1, ... of their sequence.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

// As in rope.cpp: products and sums rounded one by one, no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace keel::cpu {

void rope_rows_at(const Tensor& qkv, const AttnShape& s, int64_t pos, float theta) {
  const int64_t n = static_cast<int64_t>(s.B) * s.T, hd = s.head_dim, half = hd / 2;
  const int64_t cols = s.qkv_cols(), rotated = static_cast<int64_t>(s.n_heads + s.n_kv_heads) * hd;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(hd);
    inv_freq[i] = 1.0f / static_cast<float>(std::pow(static_cast<double>(theta), static_cast<double>(exponent)));
  }
  std::vector<float> buf(static_cast<size_t>(rotated)), cs(static_cast<size_t>(2 * half));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos + r % s.T) * inv_freq[i];
      cs[2 * i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      cs[2 * i + 1] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
    load_f32(qkv, r * cols, rotated, buf.data());
    for (int64_t h0 = 0; h0 < rotated; h0 += hd) {
      float* x = buf.data() + h0;
      for (int64_t i = 0; i < half; ++i) {
        const float c = cs[2 * i], sn = cs[2 * i + 1];
        const float a = x[i], b = x[i + half];
        x[i] = a * c - b * sn;
        x[i + half] = b * c + a * sn;
      }
    }
    store_f32(qkv, r * cols, rotated, buf.data());
  }
}

}  // namespace keel::cpu
