// AdamW on fp32 masters, writing the working copy; PyTorch's torch.optim.AdamW order of
// operations, exactly as the CPU reference (kernels/cpu/adamw.cpp):
//   g = grad * grad_scale
//   p = p * (1 - lr*wd)
//   m = beta1 m + (1 - beta1) g ;  v = beta2 v + ((1 - beta2) g) g
//   p = p - ((lr / (1 - beta1^step)) * m) / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// The scalars are formed on the host in double and rounded to fp32 (the CPU's code); on the
// device every product, quotient, sum and the square root is rounded on its own (__fmul_rn,
// __fdiv_rn, __fadd_rn, __fsqrt_rn: no fused multiply-add), so masters, moments and the
// working copy are bitwise equal to the CPU's. One thread per element (grid-stride loop).
// A call's runs of weight decay (AdamWParams::decay_runs) go kMaxRuns to a launch, their ends
// and decay factors in the kernel's parameters: the optimizer's whole shard is one or two
// launches a step (GPT-2 small: about 100 runs, one per tensor or neighbouring few).
//
// Optional stochastic rounding of a bf16 working copy (AdamWParams::stochastic_rounding), with
// the CPU's bits (kernels/stochastic_rounding.h).
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/stochastic_rounding.h"

namespace keel {

using cuda::Named;

namespace cuda {
namespace {

// Up to kMaxRuns runs of one launch: elements [end[r - 1], end[r]) (end[-1] = 0) are
// multiplied by decay[r].
constexpr int kMaxRuns = 64;
struct DecayRuns {
  int count;
  int64_t end[kMaxRuns];
  float decay[kMaxRuns];
};

struct AdamScalars {
  float beta1, beta2, one_minus_b1, one_minus_b2, step_size, bc2_sqrt, eps, grad_scale;
  uint64_t seed, step, index0;  // index0: index of element 0 within its tensor (the hash's counter)
};

// Round x to bf16 stochastically (finite values; inf/nan round to nearest).
__device__ __forceinline__ __nv_bfloat16 bf16_stochastic(float x, uint32_t random) {
  if (!isfinite(x)) return from_f32<__nv_bfloat16>(x);
  return __ushort_as_bfloat16(bf16_bits_stochastic(__float_as_uint(x), random));
}

template <class T>
__device__ __forceinline__ void store_working(T* w, int64_t i, float x, const AdamScalars&, bool) {
  w[i] = from_f32<T>(x);
}
template <>
__device__ __forceinline__ void store_working<__nv_bfloat16>(__nv_bfloat16* w, int64_t i, float x, const AdamScalars& s,
                                                             bool stochastic) {
  w[i] = stochastic ? bf16_stochastic(x, rounding_bits(s.seed, s.step, s.index0 + static_cast<uint64_t>(i))) : from_f32<__nv_bfloat16>(x);
}

// master may be null (the working copy is then the parameter); write_working false when the
// working copy is the master itself.
template <class T>
__global__ void adamw_kernel(float* master, T* working, const void* grad, DType grad_dt, float* __restrict__ m,
                             float* __restrict__ v, const __grid_constant__ DecayRuns runs, AdamScalars s,
                             bool write_working, bool stochastic) {
  const int64_t n = runs.end[runs.count - 1];
  int r = 0;  // the run of element i: i only grows, so the search goes on from the last one
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    while (i >= runs.end[r]) ++r;
    const float p = master ? master[i] : to_f32(working[i]);
    const float g = __fmul_rn(load_any(grad, grad_dt, i), s.grad_scale);
    float x = __fmul_rn(p, runs.decay[r]);
    const float mi = __fadd_rn(__fmul_rn(s.beta1, m[i]), __fmul_rn(s.one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(s.beta2, v[i]), __fmul_rn(__fmul_rn(s.one_minus_b2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    x = __fsub_rn(x, __fdiv_rn(__fmul_rn(s.step_size, mi), denom));
    if (master) master[i] = x;
    if (write_working) store_working<T>(working, i, x, s, stochastic);
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::adamw(const Tensor& master, const Tensor& working, const Tensor& grad, const Tensor& m,
                        const Tensor& v, const AdamWParams& p) {
  const char* op = "adamw";
  cuda::check_float(op, {"working", working});
  cuda::check_float(op, {"grad", grad});
  cuda::check_dtype(op, {"m", m}, DType::F32);
  cuda::check_dtype(op, {"v", v}, DType::F32);
  const bool has_master = !master.empty();
  if (has_master) cuda::check_dtype(op, {"master", master}, DType::F32);
  const int64_t n = working.numel();
  if (grad.numel() != n || m.numel() != n || v.numel() != n || (has_master && master.numel() != n))
    cuda::fail(op, "element counts differ",
               {{"master", master}, {"working", working}, {"grad", grad}, {"m", m}, {"v", v}});
  if (p.step < 1) cuda::fail(op, "step must be >= 1 (1-based), got " + std::to_string(p.step), {});
  const std::vector<AdamWDecayRun> runs = adamw_decay_runs("CudaBackend", p, n);
  if (n == 0) return;

  // Host scalars exactly as kernels/cpu/adamw.cpp forms them.
  cuda::AdamScalars s{};
  s.one_minus_b1 = static_cast<float>(1.0 - static_cast<double>(p.beta1));
  s.one_minus_b2 = static_cast<float>(1.0 - static_cast<double>(p.beta2));
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step));
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step));
  s.step_size = static_cast<float>(p.lr / bias_correction1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.beta1 = p.beta1;
  s.beta2 = p.beta2;
  s.eps = p.eps;
  s.grad_scale = p.grad_scale;
  s.seed = p.rounding_seed;
  s.step = static_cast<uint64_t>(p.step);
  const bool write_working = !has_master || working.data != master.data;
  const bool stochastic = p.stochastic_rounding && has_master && working.dtype == DType::BF16;

  const size_t grad_bytes = dtype_size(grad.dtype);
  for (size_t r0 = 0; r0 < runs.size(); r0 += cuda::kMaxRuns) {
    // this launch's runs, its elements [begin, end) of the call
    const int64_t begin = r0 == 0 ? 0 : runs[r0 - 1].end;
    cuda::DecayRuns launch{};
    launch.count = static_cast<int>(std::min<size_t>(cuda::kMaxRuns, runs.size() - r0));
    for (int r = 0; r < launch.count; ++r) {
      launch.end[r] = runs[r0 + r].end - begin;
      launch.decay[r] = adamw_decay_factor(p.lr, runs[r0 + r].weight_decay);
    }
    s.index0 = static_cast<uint64_t>(p.rounding_index0 + begin);
    const unsigned blocks = cuda::grid_for(launch.end[launch.count - 1], 256, 4);
    KEEL_DISPATCH_FLOAT(working.dtype, op, T, {
      cuda::adamw_kernel<T><<<blocks, 256, 0, stream_>>>(
          has_master ? master.as<float>() + begin : nullptr, working.as<T>() + begin,
          static_cast<const char*>(grad.data) + begin * grad_bytes, grad.dtype, m.as<float>() + begin,
          v.as<float>() + begin, launch, s, write_working, stochastic);
    });
  }
  cuda::check_launch(*this, op, {{"master", master}, {"working", working}, {"grad", grad}});
}

}  // namespace keel
