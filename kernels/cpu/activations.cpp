// GELU (tanh approximation, kernels/gelu.h) and SwiGLU.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/gelu.h"

namespace keel {

using cpu::Named;

namespace {

constexpr int64_t kChunk = 2048;
void check_same(const char* op, Named a, Named b) {
  cpu::check_float(op, a);
  cpu::check_float(op, b);
  if (a.t.numel() != b.t.numel() || a.t.cols() != b.t.cols())
    cpu::fail(op, std::string(a.name) + " and " + b.name + " must have the same shape", {a, b});
}

// SwiGLU shapes: in/din [N, 2F], out/dout [N, F]. Returns {N, F}.
std::pair<int64_t, int64_t> check_swiglu(const char* op, Named packed, Named half) {
  cpu::check_float(op, packed);
  cpu::check_float(op, half);
  if (cpu::rows(packed.t) != cpu::rows(half.t) || packed.t.cols() != 2 * half.t.cols())
    cpu::fail(op, std::string(packed.name) + " must be [N, 2F] for " + half.name + " [N, F]", {packed, half});
  return {cpu::rows(half.t), half.t.cols()};
}

}  // namespace

void CpuBackend::gelu_forward(const Tensor& out, const Tensor& in) {
  check_same("gelu_forward", {"out", out}, {"in", in});
  cpu::for_chunks(in.numel(), kChunk, [&](int64_t begin, int64_t n) {
    float buf[kChunk];
    cpu::load_f32(in, begin, n, buf);
    for (int64_t i = 0; i < n; ++i) buf[i] = gelu(buf[i]);
    cpu::store_f32(out, begin, n, buf);
  });
}

void CpuBackend::gelu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) {
  check_same("gelu_backward", {"din", din}, {"in", in});
  check_same("gelu_backward", {"dout", dout}, {"in", in});
  cpu::for_chunks(in.numel(), kChunk, [&](int64_t begin, int64_t n) {
    float x[kChunk], dy[kChunk];
    cpu::load_f32(in, begin, n, x);
    cpu::load_f32(dout, begin, n, dy);
    for (int64_t i = 0; i < n; ++i) x[i] = dy[i] * gelu_grad(x[i]);
    cpu::store_f32(din, begin, n, x);
  });
}

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g))
void CpuBackend::swiglu_forward(const Tensor& out, const Tensor& in) {
  auto [N, F] = check_swiglu("swiglu_forward", {"in", in}, {"out", out});
#pragma omp parallel if (N * F >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(2 * F)), y(static_cast<size_t>(F));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = cpu::read_f32(in, n * 2 * F, 2 * F, buf.data());
      for (int64_t j = 0; j < F; ++j) {
        const float g = x[j], u = x[F + j];
        y[j] = g / (1.0f + std::exp(-g)) * u;
      }
      cpu::store_f32(out, n * F, F, y.data());
    }
  }
}

// With s = sigmoid(g): d gate = dy * up * s (1 + g (1 - s)),  d up = dy * g s
void CpuBackend::swiglu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) {
  auto [N, F] = check_swiglu("swiglu_backward", {"in", in}, {"dout", dout});
  check_swiglu("swiglu_backward", {"din", din}, {"dout", dout});
#pragma omp parallel if (N * F >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(2 * F)), dybuf(static_cast<size_t>(F)), dx(static_cast<size_t>(2 * F));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = cpu::read_f32(in, n * 2 * F, 2 * F, buf.data());
      const float* dy = cpu::read_f32(dout, n * F, F, dybuf.data());
      for (int64_t j = 0; j < F; ++j) {
        const float g = x[j], u = x[F + j];
        const float s = 1.0f / (1.0f + std::exp(-g));
        dx[j] = dy[j] * u * (s * (1.0f + g * (1.0f - s)));
        dx[F + j] = dy[j] * (g * s);
      }
      cpu::store_f32(din, n * 2 * F, 2 * F, dx.data());
    }
  }
}

}  // namespace keel
