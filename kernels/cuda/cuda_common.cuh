// Device-side helpers shared by the CUDA backend's kernels: fp32 loads and rounded stores for
// each storage type, deterministic warp/block reductions, the "one dtype for all operands"
// staging helper, and launch-size helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"

// The launch's dynamic shared memory as bytes (16-byte aligned).
#ifdef KEEL_CUDA_EMULATOR
#define KEEL_DYNAMIC_SHARED(name) unsigned char* name = ::keel_emu::dynamic_shared()
#else
#define KEEL_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace keel::cuda {

// ---- storage types: read as fp32, write rounded to nearest even (cvt.rn, as the CPU emulates) ----

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
// NaN gets the CPU's bits (kernels/dtype.h bf16_nan_bits / f16_nan_bits), not whatever NaN cvt
// produces, so that NaNs compare bit-equal too.
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  if (isnan(x)) return __ushort_as_bfloat16(bf16_nan_bits(__float_as_uint(x)));
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  if (isnan(x)) return __ushort_as_half(f16_nan_bits(__float_as_uint(x)));
  return __float2half_rn(x);
}

// Element access with the dtype known only at run time (small tensors, the plain kernels).
__device__ __forceinline__ float load_any(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::F16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_any(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::BF16: static_cast<__nv_bfloat16*>(p)[i] = from_f32<__nv_bfloat16>(v); break;
    case DType::F16: static_cast<__half*>(p)[i] = from_f32<__half>(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// ---- asynchronous copies global -> shared (cp.async, sm_80+): 16 bytes each, in groups ----

#ifdef KEEL_CUDA_EMULATOR
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  keel_emu::cp_async16(smem, gmem, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() { keel_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  keel_emu::cp_async_wait(N);
}
#else
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#endif

// ---- deterministic reductions: butterfly over the warp (every lane gets the same value, the
// pairing fixed by lane numbers), then warps in order through shared memory ----

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- vectorized elementwise loops ----
//
// Elementwise kernels move their operands in packs of kPack<T> elements (16 bytes: one 128-bit
// load or store) when every pointer is 16-byte aligned, else one element at a time. Each
// element gets the same arithmetic either way, so the width never changes a result.
template <class T>
inline constexpr int kPack = 16 / static_cast<int>(sizeof(T));

template <class T, int W>
struct alignas(sizeof(T) * W) Pack {
  T e[W];
};

// 16-byte loads and stores that the caches evict first (ld.global.cs / st.global.cs: data read
// or written for the last time, so it does not push out data that will be read again soon).
// The emulator does plain ones.
template <class P>
__device__ __forceinline__ P load_evict_first(const P* p) {
  static_assert(sizeof(P) == 16, "16-byte packs only");
#ifdef KEEL_CUDA_EMULATOR
  return *p;
#else
  const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
  P v;
  memcpy(&v, &u, sizeof v);
  return v;
#endif
}
template <class P>
__device__ __forceinline__ void store_evict_first(P* p, const P& v) {
  static_assert(sizeof(P) == 16, "16-byte packs only");
#ifdef KEEL_CUDA_EMULATOR
  *p = v;
#else
  uint4 u;
  memcpy(&u, &v, sizeof u);
  __stcs(reinterpret_cast<uint4*>(p), u);
#endif
}

// kEvictFirst: a 16-byte pack moves evict-first (the hint only; narrower packs move plainly).
template <int W, bool kEvictFirst = false, class T>
__device__ __forceinline__ void load_pack(float (&f)[W], const T* p) {
  using P = Pack<T, W>;
  P v;
  if constexpr (kEvictFirst && sizeof(P) == 16) v = load_evict_first(reinterpret_cast<const P*>(p));
  else v = *reinterpret_cast<const P*>(p);
#pragma unroll
  for (int k = 0; k < W; ++k) f[k] = to_f32(v.e[k]);
}
template <int W, bool kEvictFirst = false, class T>
__device__ __forceinline__ void store_pack(T* p, const float (&f)[W]) {
  using P = Pack<T, W>;
  P v;
#pragma unroll
  for (int k = 0; k < W; ++k) v.e[k] = from_f32<T>(f[k]);
  if constexpr (kEvictFirst && sizeof(P) == 16) store_evict_first(reinterpret_cast<P*>(p), v);
  else *reinterpret_cast<P*>(p) = v;
}

template <int W>
using PackWidth = std::integral_constant<int, W>;

// Grid-stride loop over n elements: f(PackWidth<V>{}, i) for i = 0, V, 2V, ... below n - n % V,
// then f(PackWidth<1>{}, i) for the last n % V elements.
template <int V, class F>
__device__ __forceinline__ void for_each_pack(int64_t n, F&& f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t packs = n / V;
  for (int64_t p = tid; p < packs; p += stride) f(PackWidth<V>{}, p * V);
  if constexpr (V > 1)
    for (int64_t i = packs * V + tid; i < n; i += stride) f(PackWidth<1>{}, i);
}

// Elementwise maps over packs of V (for_each_pack), computed in float and rounded once on the
// store: out[i] = f(a[i]), or f(a[i], b[i]). out may alias an input (each element is read before
// it is written, by the same thread).
template <int V, class T, class F>
__device__ __forceinline__ void map_packs(int64_t n, T* out, F f, const T* a) {
  for_each_pack<V>(n, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    float x[W];
    load_pack<W>(x, a + i);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = f(x[k]);
    store_pack<W>(out + i, x);
  });
}
template <int V, class T, class F>
__device__ __forceinline__ void map_packs(int64_t n, T* out, F f, const T* a, const T* b) {
  for_each_pack<V>(n, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    float x[W], y[W];
    load_pack<W>(x, a + i);
    load_pack<W>(y, b + i);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = f(x[k], y[k]);
    store_pack<W>(out + i, x);
  });
}

// True when every pointer is 16-byte aligned (the packed path may be used).
inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (alignment_of(p) < 16) return false;
  return true;
}

// Calls launch(PackWidth<kPack<T>>{}) when `packed`, else launch(PackWidth<1>{}).
template <class T, class Launch>
void with_pack_width(bool packed, Launch&& launch) {
  if (packed) launch(PackWidth<kPack<T>>{});
  else launch(PackWidth<1>{});
}

// ---- launch sizes ----

// Raises a kernel's dynamic shared-memory limit (above 48 KiB it must be asked for). Asked on
// every launch, as FlashAttention does: the attribute belongs to the current device, so a
// once-per-process flag would leave a second device (or backend) of the process without it.
template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes, const char* op) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op,
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
}

// Blocks for a grid-stride loop over n items with `threads` threads each handling `per_thread`
// items per pass; capped (the results never depend on the grid size for elementwise kernels).
inline unsigned grid_for(int64_t n, int threads, int per_thread = 1) {
  int64_t blocks = ceil_div(n, static_cast<int64_t>(threads) * per_thread);
  if (blocks < 1) blocks = 1;
  if (blocks > 65535LL * 8) blocks = 65535LL * 8;
  return static_cast<unsigned>(blocks);
}

// ---- one storage dtype for all operands of an op ----
//
// Kernels are instantiated for one storage type T shared by their activation-sized operands.
// When a call mixes dtypes (allowed by the contract, rare in practice), the operands that are
// not fp32 are staged into fp32 scratch: inputs are widened (exact), outputs are computed in
// fp32 and rounded once into their own dtype by finish(): the same single rounding the CPU
// reference does. Empty (optional) operands are passed through.
struct Io {
  const Tensor* t;
  bool read, write;
};
inline Io in(const Tensor& t) { return {&t, true, false}; }
inline Io out(const Tensor& t) { return {&t, false, true}; }
inline Io inout(const Tensor& t) { return {&t, true, true}; }

class SameDType {
 public:
  SameDType(CudaBackend& be, const char* op, std::initializer_list<Io> ops);
  ~SameDType();
  SameDType(const SameDType&) = delete;
  SameDType& operator=(const SameDType&) = delete;
  DType dtype() const { return dtype_; }
  const Tensor& operator[](size_t i) const { return views_[i]; }
  bool staged() const { return staged_; }
  // Rounds staged outputs back into their own tensors. Call after the op's kernels.
  void finish();

 private:
  CudaBackend& be_;
  const char* op_;
  DType dtype_ = DType::F32;
  bool staged_ = false;
  std::vector<Io> ops_;
  std::vector<Tensor> views_;
  std::vector<void*> scratch_;
};

// RoPE of every row of qkv (s.B * s.T rows) with the (cos, sin) table indexed by row % s.T, or
// by s.positions[row] under document masking (rope.cu); inverse applies the backward rotation.
void launch_rope(CudaBackend& be, const Tensor& qkv, const AttnShape& s, const float* table, bool inverse,
                 const char* op);

// Launches convert of n elements from src (dtype s) to dst (dtype d) on the backend's stream.
void launch_convert(CudaBackend& be, void* dst, DType d, const void* src, DType s, int64_t n, const char* op);

}  // namespace keel::cuda
