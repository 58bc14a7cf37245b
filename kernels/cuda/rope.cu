// Rotary position embedding, Hugging Face "rotate_half" convention, in place on the query and
// key heads of a packed qkv tensor (v is left alone).
//
// Within a head of hd values, element i < hd/2 pairs with i + hd/2, both turned by the angle of
// (position, i) from CudaBackend::rope_table (the CPU reference's fp32 recipe, computed on the
// host, so the cos/sin values are the CPU's bit for bit); the position of row n is n % T, or
// its document position (AttnShape::positions):
//   y_i        = x_i cos - x_{i+hd/2} sin        (backward: x_i cos + x_{i+hd/2} sin)
//   y_{i+hd/2} = x_{i+hd/2} cos + x_i sin        (backward: x_{i+hd/2} cos - x_i sin)
// Products and sums are rounded one by one (__fmul_rn / __fadd_rn: no fused multiply-add), as
// the CPU and PyTorch do, so fp32 results are bitwise equal to the CPU's.
// Packs of consecutive pairs i per thread (cuda_common.cuh, for_each_pack).
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/qk_heads.h"

namespace keel {

namespace cuda {
namespace {

// Element e of rows * heads * hd/2 is (row n, head h, pair i); packs of V consecutive pairs
// (V divides hd/2) share n and h.
// pos: document positions (AttnShape::positions) or null (row n at n % T_len).
template <class T, bool kInverse, int V>
__global__ void rope_kernel(T* qkv, const float* __restrict__ table, const int32_t* __restrict__ pos, int64_t rows,
                            int T_len, int heads, int hd, int64_t cols) {
  const int half = hd / 2;
  for_each_pack<V>(rows * heads * half, [&](auto width, int64_t e) {
    constexpr int W = decltype(width)::value;
    const int i = static_cast<int>(e % half);
    const int64_t rest = e / half;
    const int h = static_cast<int>(rest % heads);
    const int64_t n = rest / heads;
    const int64_t p = pos ? pos[n] : n % T_len;
    const float* cs = table + (p * half + i) * 2;  // W (cos, sin) pairs
    T* x = qkv + n * cols + static_cast<int64_t>(h) * hd;
    float a[W], b[W], c[W], sn[W];
    load_pack<W>(a, x + i);
    load_pack<W>(b, x + i + half);
#pragma unroll
    for (int k = 0; k < W; ++k) c[k] = cs[2 * k], sn[k] = cs[2 * k + 1];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float ya = kInverse ? __fadd_rn(__fmul_rn(a[k], c[k]), __fmul_rn(b[k], sn[k]))
                                : __fsub_rn(__fmul_rn(a[k], c[k]), __fmul_rn(b[k], sn[k]));
      const float yb = kInverse ? __fsub_rn(__fmul_rn(b[k], c[k]), __fmul_rn(a[k], sn[k]))
                                : __fadd_rn(__fmul_rn(b[k], c[k]), __fmul_rn(a[k], sn[k]));
      a[k] = ya;
      b[k] = yb;
    }
    store_pack<W>(x + i, a);
    store_pack<W>(x + i + half, b);
  });
}

// Element e of rows * (nh + nkv) * hd is (row n, head h, element i); U is the storage dtype's
// bit pattern (a copy, so exact).
template <class U>
__global__ void qk_heads_copy_kernel(U* heads, U* qkv, int64_t rows, int nh, int nkv, int hd, int64_t cols,
                                     bool to_heads) {
  const int64_t total = rows * (nh + nkv) * hd;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total; e += stride) {
    const int i = static_cast<int>(e % hd);
    const int64_t rest = e / hd;
    const int h = static_cast<int>(rest % (nh + nkv));
    const int64_t n = rest / (nh + nkv);
    U* a = heads + qk_head_row(n, h, rows, nh, nkv) * hd + i;
    U* b = qkv + n * cols + static_cast<int64_t>(h) * hd + i;
    if (to_heads) *a = *b;
    else *b = *a;
  }
}

}  // namespace

void launch_rope(CudaBackend& be, const Tensor& qkv, const AttnShape& s, const float* table, bool inverse,
                 const char* op) {
  const int64_t rows = static_cast<int64_t>(s.B) * s.T;
  const int heads = s.n_heads + s.n_kv_heads;
  const int64_t total = rows * heads * (s.head_dim / 2);
  if (total == 0) return;
  KEEL_DISPATCH_FLOAT(qkv.dtype, op, T, {
    const bool packed = (s.head_dim / 2) % kPack<T> == 0 && s.qkv_cols() % kPack<T> == 0 && aligned16({qkv.data});
    with_pack_width<T>(packed, [&](auto v) {
      constexpr int V = decltype(v)::value;
      const unsigned blocks = grid_for(ceil_div(total, int64_t{V}), 256);
      const int32_t* pos = s.positions.empty() ? nullptr : s.positions.as<const int32_t>();
      if (inverse)
        rope_kernel<T, true, V><<<blocks, 256, 0, be.stream()>>>(qkv.as<T>(), table, pos, rows, s.T, heads,
                                                                 s.head_dim, s.qkv_cols());
      else
        rope_kernel<T, false, V><<<blocks, 256, 0, be.stream()>>>(qkv.as<T>(), table, pos, rows, s.T, heads,
                                                                  s.head_dim, s.qkv_cols());
    });
  });
}

}  // namespace cuda

void CudaBackend::rope_forward(const Tensor& qkv, const AttnShape& s, const Rope& rope) {
  const char* op = "rope_forward";
  cuda::check_rope(op, s, {"qkv", qkv});
  cuda::launch_rope(*this, qkv, s, rope_table(s.T, s.head_dim, rope), false, op);
  cuda::check_launch(*this, op, {{"qkv", qkv}});
}

void CudaBackend::rope_backward(const Tensor& dqkv, const AttnShape& s, const Rope& rope) {
  const char* op = "rope_backward";
  cuda::check_rope(op, s, {"dqkv", dqkv});
  cuda::launch_rope(*this, dqkv, s, rope_table(s.T, s.head_dim, rope), true, op);
  cuda::check_launch(*this, op, {{"dqkv", dqkv}});
}

void CudaBackend::qk_heads_copy(const Tensor& heads, const Tensor& qkv, const AttnShape& s, bool to_heads) {
  const char* op = "qk_heads_copy";
  cuda::check_attn(op, s, {"qkv", qkv});
  const int64_t rows = static_cast<int64_t>(s.B) * s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  if (heads.dtype != qkv.dtype || heads.numel() != rows * (nh + nkv) * hd || heads.cols() != hd)
    cuda::fail(op, "heads must be [B*T*(n_heads + n_kv_heads), head_dim] of qkv's dtype",
               {{"heads", heads}, {"qkv", qkv}});
  const int64_t total = rows * (nh + nkv) * hd;
  if (total == 0) return;
  const unsigned blocks = cuda::grid_for(total, 256);
  if (dtype_size(qkv.dtype) == 2)
    cuda::qk_heads_copy_kernel<uint16_t><<<blocks, 256, 0, stream_>>>(
        heads.as<uint16_t>(), qkv.as<uint16_t>(), rows, s.n_heads, s.n_kv_heads, s.head_dim, s.qkv_cols(), to_heads);
  else
    cuda::qk_heads_copy_kernel<uint32_t><<<blocks, 256, 0, stream_>>>(
        heads.as<uint32_t>(), qkv.as<uint32_t>(), rows, s.n_heads, s.n_kv_heads, s.head_dim, s.qkv_cols(), to_heads);
  cuda::check_launch(*this, op, {{"heads", heads}, {"qkv", qkv}});
}

}  // namespace keel
