// Rotary position embedding, Hugging Face "rotate_half" convention, in place on the query and
// key heads of a packed qkv tensor (v is left alone).
//
// Within a head of hd values, element i < hd/2 pairs with i + hd/2, both turned by the angle of
// (position, i) from CudaBackend::rope_table (the CPU reference's fp32 recipe, computed on the
// host, so the cos/sin values are the CPU's bit for bit):
//   y_i        = x_i cos - x_{i+hd/2} sin        (backward: x_i cos + x_{i+hd/2} sin)
//   y_{i+hd/2} = x_{i+hd/2} cos + x_i sin        (backward: x_{i+hd/2} cos - x_i sin)
// Products and sums are rounded one by one (__fmul_rn / __fadd_rn: no fused multiply-add), as
// the CPU and PyTorch do, so fp32 results are bitwise equal to the CPU's.
// One thread per (row, head, pair i).
#include "kernels/cuda/cuda_common.cuh"

namespace keel {

namespace cuda {
namespace {

template <class T, bool kInverse>
__global__ void rope_kernel(T* qkv, const float* __restrict__ table, int64_t rows, int T_len, int heads, int hd,
                            int64_t cols) {
  const int half = hd / 2;
  const int64_t total = rows * heads * half;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(e % half);
    const int64_t rest = e / half;
    const int h = static_cast<int>(rest % heads);
    const int64_t n = rest / heads;
    const float* cs = table + ((n % T_len) * half + i) * 2;
    const float c = cs[0], sn = cs[1];
    T* x = qkv + n * cols + static_cast<int64_t>(h) * hd;
    const float a = to_f32(x[i]), b = to_f32(x[i + half]);
    if (!kInverse) {
      x[i] = from_f32<T>(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn)));
      x[i + half] = from_f32<T>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn)));
    } else {
      x[i] = from_f32<T>(__fadd_rn(__fmul_rn(a, c), __fmul_rn(b, sn)));
      x[i + half] = from_f32<T>(__fsub_rn(__fmul_rn(b, c), __fmul_rn(a, sn)));
    }
  }
}

}  // namespace

void launch_rope(CudaBackend& be, const Tensor& qkv, const AttnShape& s, const float* table, bool inverse,
                 const char* op) {
  const int64_t rows = static_cast<int64_t>(s.B) * s.T;
  const int heads = s.n_heads + s.n_kv_heads;
  const int64_t total = rows * heads * (s.head_dim / 2);
  if (total == 0) return;
  const unsigned blocks = grid_for(total, 256, 4);
  KEEL_DISPATCH_FLOAT(qkv.dtype, op, T, {
    if (inverse)
      rope_kernel<T, true><<<blocks, 256, 0, be.stream()>>>(qkv.as<T>(), table, rows, s.T, heads, s.head_dim, s.qkv_cols());
    else
      rope_kernel<T, false><<<blocks, 256, 0, be.stream()>>>(qkv.as<T>(), table, rows, s.T, heads, s.head_dim, s.qkv_cols());
  });
}

}  // namespace cuda

void CudaBackend::rope_forward(const Tensor& qkv, const AttnShape& s, float theta) {
  const char* op = "rope_forward";
  cuda::check_attn(op, s, {"qkv", qkv});
  cuda::launch_rope(*this, qkv, s, rope_table(s.T, s.head_dim, theta), false, op);
  cuda::check_launch(*this, op, {{"qkv", qkv}});
}

void CudaBackend::rope_backward(const Tensor& dqkv, const AttnShape& s, float theta) {
  const char* op = "rope_backward";
  cuda::check_attn(op, s, {"dqkv", dqkv});
  cuda::launch_rope(*this, dqkv, s, rope_table(s.T, s.head_dim, theta), true, op);
  cuda::check_launch(*this, op, {{"dqkv", dqkv}});
}

}  // namespace keel
