// GELU (tanh approximation, GPT-2's "gelu_new"; kernels/gelu.h) and SwiGLU, forward and backward.
// Elementwise in fp32 with the CPU reference's formulas (no reductions):
//   swiglu: in [N, 2F] = gate | up, out = silu(gate) * up, silu(g) = g / (1 + exp(-g));
//   with s = sigmoid(g): d gate = dy * up * s (1 + g (1 - s)),  d up = dy * g s
// tanhf and expf are CUDA's accurate versions (<= 2 ulp), so results agree with the CPU to a few
// fp32 ulps before the output rounding.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/gelu.h"

namespace keel {

using cuda::Named;

namespace cuda {
namespace {

constexpr int kThreads = 256;
// Elementwise in packs of V (cuda_common.cuh): V = kPack<T> when every pointer is 16-byte
// aligned (and, for SwiGLU, F % V == 0, so a pack never straddles the gate | up boundary).
template <class T, int V>
__global__ void gelu_forward_kernel(T* out, const T* in, int64_t n) {
  map_packs<V>(n, out, [](float x) { return gelu(x); }, in);
}

// din may alias dout.
template <class T, int V>
__global__ void gelu_backward_kernel(T* din, const T* dout, const T* in, int64_t n) {
  map_packs<V>(n, din, [](float dy, float x) { return dy * gelu_grad(x); }, dout, in);
}

// Output element e = (row n, column j < F); the pack's V columns share the row.
template <class T, int V>
__global__ void swiglu_forward_kernel(T* __restrict__ out, const T* __restrict__ in, int64_t N, int64_t F) {
  for_each_pack<V>(N * F, [&](auto width, int64_t e) {
    constexpr int W = decltype(width)::value;
    const int64_t n = e / F, j = e - n * F;
    float g[W], u[W];
    load_pack<W>(g, in + n * 2 * F + j);
    load_pack<W>(u, in + n * 2 * F + F + j);
#pragma unroll
    for (int k = 0; k < W; ++k) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    store_pack<W>(out + e, g);
  });
}

// With out (selective recomputation's rebuild; else nullptr), also out = swiglu(in) by the
// forward's formula.
template <class T, int V>
__global__ void swiglu_backward_kernel(T* din, const T* dout, const T* in, int64_t N, int64_t F, T* out) {
  // din may alias in: the thread of element (n, j) alone reads and then writes (n, j) and (n, F+j).
  for_each_pack<V>(N * F, [&](auto width, int64_t e) {
    constexpr int W = decltype(width)::value;
    const int64_t n = e / F, j = e - n * F;
    float g[W], u[W], dy[W];
    load_pack<W>(g, in + n * 2 * F + j);
    load_pack<W>(u, in + n * 2 * F + F + j);
    load_pack<W>(dy, dout + e);
    if (out) {
      float y[W];
#pragma unroll
      for (int k = 0; k < W; ++k) y[k] = g[k] / (1.0f + expf(-g[k])) * u[k];  // as swiglu_forward_kernel
      store_pack<W>(out + e, y);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float s = 1.0f / (1.0f + expf(-g[k]));
      const float dgate = dy[k] * u[k] * (s * (1.0f + g[k] * (1.0f - s)));
      u[k] = dy[k] * (g[k] * s);  // d up
      g[k] = dgate;
    }
    store_pack<W>(din + n * 2 * F + j, g);
    store_pack<W>(din + n * 2 * F + F + j, u);
  });
}

void check_same(const char* op, Named a, Named b) {
  check_float(op, a);
  check_float(op, b);
  if (a.t.numel() != b.t.numel() || a.t.cols() != b.t.cols())
    fail(op, std::string(a.name) + " and " + b.name + " must have the same shape", {a, b});
}

// SwiGLU shapes: in/din [N, 2F], out/dout [N, F]. Returns {N, F}.
std::pair<int64_t, int64_t> check_swiglu(const char* op, Named packed, Named half) {
  check_float(op, packed);
  check_float(op, half);
  if (rows(packed.t) != rows(half.t) || packed.t.cols() != 2 * half.t.cols())
    fail(op, std::string(packed.name) + " must be [N, 2F] for " + half.name + " [N, F]", {packed, half});
  return {rows(half.t), half.t.cols()};
}

}  // namespace
}  // namespace cuda

void CudaBackend::gelu_forward(const Tensor& out, const Tensor& in) {
  const char* op = "gelu_forward";
  cuda::check_same(op, {"out", out}, {"in", in});
  const int64_t n = in.numel();
  if (n == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(out), cuda::in(in)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    cuda::with_pack_width<T>(cuda::aligned16({u[0].data, u[1].data}), [&](auto v) {
      cuda::gelu_forward_kernel<T, decltype(v)::value>
          <<<cuda::grid_for(cuda::ceil_div(n, int64_t{v}), cuda::kThreads), cuda::kThreads, 0, stream_>>>(
              u[0].as<T>(), u[1].as<const T>(), n);
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"out", out}, {"in", in}});
}

void CudaBackend::gelu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) {
  const char* op = "gelu_backward";
  cuda::check_same(op, {"din", din}, {"in", in});
  cuda::check_same(op, {"dout", dout}, {"in", in});
  const int64_t n = in.numel();
  if (n == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(din), cuda::in(dout), cuda::in(in)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    cuda::with_pack_width<T>(cuda::aligned16({u[0].data, u[1].data, u[2].data}), [&](auto v) {
      cuda::gelu_backward_kernel<T, decltype(v)::value>
          <<<cuda::grid_for(cuda::ceil_div(n, int64_t{v}), cuda::kThreads), cuda::kThreads, 0, stream_>>>(
              u[0].as<T>(), u[1].as<const T>(), u[2].as<const T>(), n);
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"din", din}, {"dout", dout}, {"in", in}});
}

void CudaBackend::swiglu_forward(const Tensor& out, const Tensor& in) {
  const char* op = "swiglu_forward";
  auto [N, F] = cuda::check_swiglu(op, {"in", in}, {"out", out});
  if (N * F == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(out), cuda::in(in)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    const bool packed = F % cuda::kPack<T> == 0 && cuda::aligned16({u[0].data, u[1].data});
    cuda::with_pack_width<T>(packed, [&](auto v) {
      cuda::swiglu_forward_kernel<T, decltype(v)::value>
          <<<cuda::grid_for(cuda::ceil_div(N * F, int64_t{v}), cuda::kThreads), cuda::kThreads, 0, stream_>>>(
              u[0].as<T>(), u[1].as<const T>(), N, F);
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"out", out}, {"in", in}});
}

void CudaBackend::swiglu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) {
  const char* op = "swiglu_backward";
  auto [N, F] = cuda::check_swiglu(op, {"in", in}, {"dout", dout});
  cuda::check_swiglu(op, {"din", din}, {"dout", dout});
  if (N * F == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(din), cuda::in(dout), cuda::in(in)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    const bool packed = F % cuda::kPack<T> == 0 && cuda::aligned16({u[0].data, u[1].data, u[2].data});
    cuda::with_pack_width<T>(packed, [&](auto v) {
      cuda::swiglu_backward_kernel<T, decltype(v)::value>
          <<<cuda::grid_for(cuda::ceil_div(N * F, int64_t{v}), cuda::kThreads), cuda::kThreads, 0, stream_>>>(
              u[0].as<T>(), u[1].as<const T>(), u[2].as<const T>(), N, F, nullptr);
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"din", din}, {"dout", dout}, {"in", in}});
}

void CudaBackend::swiglu_backward_rebuild(const Tensor& din, const Tensor& out, const Tensor& dout, const Tensor& in) {
  const char* op = "swiglu_backward_rebuild";
  auto [N, F] = cuda::check_swiglu(op, {"in", in}, {"dout", dout});
  cuda::check_swiglu(op, {"din", din}, {"dout", dout});
  cuda::check_swiglu(op, {"in", in}, {"out", out});
  if (din.data == in.data || din.data == out.data)
    cuda::fail(op, "din must not alias in or out", {{"din", din}, {"out", out}, {"in", in}});
  if (N * F == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(din), cuda::out(out), cuda::in(dout), cuda::in(in)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    const bool packed = F % cuda::kPack<T> == 0 && cuda::aligned16({u[0].data, u[1].data, u[2].data, u[3].data});
    cuda::with_pack_width<T>(packed, [&](auto v) {
      cuda::swiglu_backward_kernel<T, decltype(v)::value>
          <<<cuda::grid_for(cuda::ceil_div(N * F, int64_t{v}), cuda::kThreads), cuda::kThreads, 0, stream_>>>(
              u[0].as<T>(), u[2].as<const T>(), u[3].as<const T>(), N, F, u[1].as<T>());
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"din", din}, {"out", out}, {"dout", dout}, {"in", in}});
}

}  // namespace keel
