// Rotary position embedding, Hugging Face Llama "rotate_half" convention, in place on the query
// and key heads of a packed qkv tensor.
//
// Within a head of hd values, element i < hd/2 pairs with i + hd/2 and both turn by
// angle = pos * inv_freq[i]:
//   y_i        = x_i cos - x_{i+hd/2} sin
//   y_{i+hd/2} = x_{i+hd/2} cos + x_i sin
// Backward applies the transpose (the inverse rotation) to the gradient.
//
// The table follows HF's fp32 recipe: inv_freq = 1 / theta^(float(2i) / hd) in fp32, angle =
// float(pos) * inv_freq in fp32, cos/sin of that fp32 angle (computed in double and rounded, i.e.
// correctly rounded; PyTorch's own pow/cos are within 1 ulp of these). Products and sums are
// rounded one by one as in PyTorch (no fused multiply-add), hence the pragma below.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

// After the includes, so that only this file's own functions are affected.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace keel {

namespace {

// cos_sin[(pos * half + i) * 2 + {0, 1}] for pos in [0, T), i in [0, hd/2)
std::vector<float> rope_table(int T, int hd, float theta) {
  const int half = hd / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(hd);
    const float power = static_cast<float>(std::pow(static_cast<double>(theta), static_cast<double>(exponent)));
    inv_freq[i] = 1.0f / power;
  }
  std::vector<float> table(static_cast<size_t>(T) * half * 2);
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(T) * half >= cpu::kMinParallelWork)
  for (int pos = 0; pos < T; ++pos)
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos) * inv_freq[i];
      table[(static_cast<size_t>(pos) * half + i) * 2] = static_cast<float>(std::cos(static_cast<double>(angle)));
      table[(static_cast<size_t>(pos) * half + i) * 2 + 1] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  return table;
}

// Rotates the n_heads + n_kv_heads query/key heads of every row; inverse = backward rotation.
void rotate(const Tensor& qkv, const AttnShape& s, float theta, bool inverse) {
  const int hd = s.head_dim, half = hd / 2;
  const std::vector<float> table = rope_table(s.T, hd, theta);
  const int64_t rows = static_cast<int64_t>(s.B) * s.T;
  const int64_t cols = s.qkv_cols();
  const int64_t rotated = static_cast<int64_t>(s.n_heads + s.n_kv_heads) * hd;  // q and k, not v
#pragma omp parallel if (rows * rotated >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(rotated));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      const float* cs = table.data() + static_cast<size_t>(n % s.T) * half * 2;
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

}  // namespace

void CpuBackend::rope_forward(const Tensor& qkv, const AttnShape& s, float theta) {
  cpu::check_attn("rope_forward", s, {"qkv", qkv});
  rotate(qkv, s, theta, false);
}

void CpuBackend::rope_backward(const Tensor& dqkv, const AttnShape& s, float theta) {
  cpu::check_attn("rope_backward", s, {"dqkv", dqkv});
  rotate(dqkv, s, theta, true);
}

}  // namespace keel
