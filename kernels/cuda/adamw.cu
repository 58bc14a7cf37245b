// AdamW on fp32 masters, writing the working copy; PyTorch's torch.optim.AdamW order of
// operations, exactly as the CPU reference (kernels/cpu/adamw.cpp):
//   g = grad * grad_scale
//   p = p * (1 - lr*wd)
//   m = beta1 m + (1 - beta1) g ;  v = beta2 v + ((1 - beta2) g) g
//   p = p - ((lr / (1 - beta1^step)) * m) / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// The scalars are formed on the host in double and rounded to fp32 (the CPU's code); on the
// device every product, quotient, sum and the square root is rounded on its own (__fmul_rn,
// __fdiv_rn, __fadd_rn, __fsqrt_rn: no fused multiply-add), so masters, moments and the
// working copy are bitwise equal to the CPU's. A thread takes 4 consecutive elements a pass of a
// grid-stride loop, as 16-byte loads and stores of the fp32 operands (8-byte of 16-bit ones),
// where their alignment allows (at 93% of DRAM bandwidth one element a thread, a 1B Llama's
// AdamW had too few bytes in flight: session 25).
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

// The working copy of W elements from element i: rounded to nearest, or (bf16) stochastically.
template <int W, class T>
__device__ __forceinline__ void store_working(T* w, int64_t i, const float (&x)[W], const AdamScalars&, bool) {
  store_pack<W>(w + i, x);
}
template <int W>
__device__ __forceinline__ void store_working(__nv_bfloat16* w, int64_t i, const float (&x)[W],
                                              const AdamScalars& s, bool stochastic) {
  if (!stochastic) return store_pack<W>(w + i, x);
  Pack<__nv_bfloat16, W> out;
#pragma unroll
  for (int k = 0; k < W; ++k)
    out.e[k] = bf16_stochastic(x[k], rounding_bits(s.seed, s.step, s.index0 + static_cast<uint64_t>(i + k)));
  *reinterpret_cast<Pack<__nv_bfloat16, W>*>(w + i) = out;
}

// Elements per thread and pass of the packed kernel: 16 bytes of each fp32 operand (master, m,
// v), 8 of a 16-bit one. Each element gets the same arithmetic as alone, so results do not
// depend on it.
constexpr int kAdamPack = 4;

// One launch over n = runs.end[count - 1] elements. V = kAdamPack: elements [0, head) one by one
// (head < V, so that every operand's packs from element head on are aligned), then packs of V
// from head, then the last few one by one; V = 1: every element alone. master may be null (the
// working copy is then the parameter); write_working false when the working copy is the master
// itself.
template <class T, class G, int V>
__global__ void adamw_kernel(float* master, T* working, const G* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, const __grid_constant__ DecayRuns runs, AdamScalars s, int head,
                             bool write_working, bool stochastic) {
  const int64_t n = runs.end[runs.count - 1];
  int r = 0;  // the run of the element: a thread's elements only grow, so the search goes on from the last one
  const auto update = [&](auto width, int64_t i) {  // elements [i, i + W)
    constexpr int W = decltype(width)::value;
    float p[W], g[W], mi[W], vi[W], x[W];
    if (master) load_pack<W>(p, master + i);
    else load_pack<W>(p, working + i);
    load_pack<W>(g, grad + i);
    load_pack<W>(mi, m + i);
    load_pack<W>(vi, v + i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      while (i + k >= runs.end[r]) ++r;
      const float gk = __fmul_rn(g[k], s.grad_scale);
      x[k] = __fmul_rn(p[k], runs.decay[r]);
      mi[k] = __fadd_rn(__fmul_rn(s.beta1, mi[k]), __fmul_rn(s.one_minus_b1, gk));
      vi[k] = __fadd_rn(__fmul_rn(s.beta2, vi[k]), __fmul_rn(__fmul_rn(s.one_minus_b2, gk), gk));
      const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi[k]), s.bc2_sqrt), s.eps);
      x[k] = __fsub_rn(x[k], __fdiv_rn(__fmul_rn(s.step_size, mi[k]), denom));
    }
    store_pack<W>(m + i, mi);
    store_pack<W>(v + i, vi);
    if (master) store_pack<W>(master + i, x);
    if (write_working) store_working<W>(working, i, x, s, stochastic);
  };
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  head = static_cast<int>(min(static_cast<int64_t>(head), n));  // fewer elements than the head
  if (tid < head) update(PackWidth<1>{}, tid);
  for_each_pack<V>(n - head, [&](auto width, int64_t i) { update(width, head + i); });
}

// Elements before the first from which every operand (empty ones ignored) is aligned to a pack
// of kAdamPack elements, or -1 when no offset below kAdamPack aligns them all (then the kernel
// takes the elements one by one).
int packed_head(std::initializer_list<const Tensor*> operands) {
  for (int head = 0; head < kAdamPack; ++head) {
    bool aligned = true;
    for (const Tensor* t : operands) {
      const size_t size = dtype_size(t->dtype);
      if (t->data && alignment_of(static_cast<const char*>(t->data) + head * size) < kAdamPack * size) aligned = false;
    }
    if (aligned) return head;
  }
  return -1;
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
    const int64_t end = runs[r0 + launch.count - 1].end;
    const Tensor master_l = has_master ? master.elements(begin, end) : Tensor(), working_l = working.elements(begin, end),
                 grad_l = grad.elements(begin, end), m_l = m.elements(begin, end), v_l = v.elements(begin, end);
    const int head = cuda::packed_head({&master_l, &working_l, &grad_l, &m_l, &v_l});
    const unsigned blocks = cuda::grid_for(end - begin, 256, cuda::kAdamPack);
    KEEL_DISPATCH_FLOAT(working.dtype, op, T, {
      KEEL_DISPATCH_FLOAT(grad.dtype, op, G, {
        const auto run = [&](auto kernel, int head_elements) {
          kernel<<<blocks, 256, 0, stream_>>>(master_l.as<float>(), working_l.as<T>(), grad_l.as<const G>(),
                                              m_l.as<float>(), v_l.as<float>(), launch, s, head_elements,
                                              write_working, stochastic);
        };
        if (head >= 0) run(cuda::adamw_kernel<T, G, cuda::kAdamPack>, head);
        else run(cuda::adamw_kernel<T, G, 1>, 0);
      });
    });
  }
  cuda::check_launch(*this, op, {{"master", master}, {"working", working}, {"grad", grad}});
}

}  // namespace keel
