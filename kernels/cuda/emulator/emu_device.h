// The CUDA emulator's device side: what a kernel source needs to compile with g++ and run on
// the CPU. Force-included (-include) into every kernels/cuda/*.cu after translate_launches.py
// has turned its <<<...>>> launches into ::keel_emu::config(...).run(kernel, args...).
//
// Execution model: a launch runs its blocks one after another; within a block every CUDA thread
// is a fiber (its own stack), each running until it reaches a barrier or returns, in the order
// of emu_threads.cpp's schedules (KEEL_EMU_SCHEDULE). __syncthreads waits for every live thread
// of the block; the warp-level operations (__syncwarp, shuffles, ldmatrix, mma.sync) wait for
// the lanes of the mask, then exchange values through a per-warp buffer. So the kernels'
// indexing, their shared-memory traffic, their barriers and their warp-level data movement are
// exercised exactly; what is not reproduced is timing (a race shows up only as a missing
// barrier under some schedule), the GPU's transcendental functions' last bits (the host libm's
// are used) and FMA contraction (the emulated build compiles with -ffp-contract=off). A
// deadlock (a barrier some threads never reach) is reported with the kernel's block and the
// waiting threads, then aborts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- CUDA's declaration specifiers: plain C++ here ----
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __constant__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __constant__ static
#define __grid_constant__
// Blocks run one at a time on one host thread (launches are serialized), so a function-local
// static is exactly "one copy per block".
#define __shared__ static

using std::isfinite;
using std::isinf;
using std::isnan;

namespace keel_emu {

// The running CUDA thread's coordinates.
struct ThreadCoords {
  uint3 thread_idx{0, 0, 0};
  uint3 block_idx{0, 0, 0};
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadCoords& coords();

// Barriers: the whole block, or the lanes of `mask` in the calling thread's warp.
void block_barrier();
void warp_barrier(unsigned mask);
// The calling thread's lane (0..31) and the warp's 32 exchange slots of 32 bytes.
int lane_id();
unsigned char* warp_slot(int lane);
// Dynamic shared memory of the running block (the launch's smem bytes, 16-byte aligned).
unsigned char* dynamic_shared();

// Value exchange within a warp: every lane of `mask` publishes v, then reads lane src's.
template <class T>
T exchange(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 32 && std::is_trivially_copyable_v<T>, "shuffle of a value wider than a slot");
  std::memcpy(warp_slot(lane_id()), &v, sizeof(T));
  warp_barrier(mask);
  T r;
  std::memcpy(&r, warp_slot(src), sizeof(T));
  warp_barrier(mask);  // nobody overwrites a slot before every lane has read it
  return r;
}

// Runs f() on every thread of every block of the grid (a launch of `kernel`); returns when all
// have finished.
void run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& f);
// The launch limits of the GPUs keel runs on (sm_80 and later; emu_runtime.cpp): grid.x up to
// 2^31 - 1, grid.y and grid.z up to 65535, a block of at most 1024 threads (x and y up to 1024,
// z up to 64), none of them 0. False, with cudaErrorInvalidConfiguration recorded for
// cudaGetLastError, for a launch outside them: it fails, as it would on a GPU, instead of running.
bool launch_dims_allowed(dim3 grid, dim3 block);
// The launch contract on dynamic shared memory (emu_runtime.cpp): above 48 KiB a kernel needs
// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) first. False (and the error recorded for
// cudaGetLastError, as a failed launch) when it was not raised that far.
bool dynamic_shared_allowed(const void* kernel, size_t smem_bytes);
// The limits a GPU takes from the compiled kernel, checked from inside it (translate_launches.py
// puts the calls there; emu_threads.cpp):
// - kernel_entry, first in every kernel: false, and the launch failed (nothing of it runs), when
//   the block has more threads than max_threads, its __launch_bounds__ (0: none), or when the
//   launch failed already; it also names the running kernel for the launch's messages.
// - static_shared, after every __shared__ variable: adds its bytes to the launch's static shared
//   memory, and fails the launch when that passes 48 KiB (ptxas refuses it) or the kernel's
//   limit with its dynamic shared memory: without cudaFuncAttributeMaxDynamicSharedMemorySize
//   both within 48 KiB, with it the attribute plus the static bytes within 227 KiB (which
//   cudaFuncSetAttribute checks on a GPU). The block that finds it runs to its end; no later
//   block runs.
bool kernel_entry(const char* name, int max_threads);
void static_shared(const void* var, size_t bytes);
// The kernel's cudaFuncAttributeMaxDynamicSharedMemorySize, -1 when never set (emu_runtime.cpp).
int max_dynamic_shared_attribute(const void* kernel);
// A launch that failed: records `error` for cudaGetLastError and prints "keel CUDA emulator:
// " + message on stderr; last_launch_failure() returns the latest such message (for the tests).
void fail_launch(cudaError_t error, const char* message);
const char* last_launch_failure();
// For the tests: while on, the emulated cublasLtMatmul fails with CUBLAS_STATUS_EXECUTION_FAILED
// (as a real one may after a device fault), so that the ops' reports of it can be checked
// (emu_cublaslt.cpp).
void set_cublaslt_matmul_failure(bool on);

struct LaunchConfig {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;

  template <class... P, class... A>
  void run(void (*kernel)(P...), A&&... args) const {
    static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
    // Arguments are converted to the parameter types at the launch, as the real one copies them.
    std::tuple<std::decay_t<P>...> params(static_cast<std::decay_t<P>>(std::forward<A>(args))...);
    if (!launch_dims_allowed(grid, block) || !dynamic_shared_allowed(reinterpret_cast<const void*>(kernel), smem))
      return;
    run_grid(reinterpret_cast<const void*>(kernel), grid, block, smem, [&] { std::apply(kernel, params); });
  }
};
inline LaunchConfig config(dim3 grid, dim3 block, size_t smem = 0, cudaStream_t stream = nullptr) {
  return {grid, block, smem, stream};
}

// ---- tensor-core and asynchronous-copy instructions (attention_flash.cu) ----
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the address of row l % 8 of
// matrix l / 8; register i of lane l receives matrix i's (row l / 4, cols 2(l % 4), +1), or with
// .trans its (rows 2(l % 4), +1; col l / 4).
void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans);
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, c += A B (fragment layouts in
// attention_flash.cu); products and sums in fp32.
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16);
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} over a warpgroup (threads 128w ..
// 128w + 127 of a block of whole warpgroups, all issuing the same instructions; each group has
// its own queue): d (the thread's N / 2 accumulators,
// kernels/cuda/wgmma.cuh's layout) = A B, or += with accumulate. A: the thread's 4 registers
// (a, read at the issue), or with a == nullptr from shared memory by desc_a, K-major; B by
// desc_b, K-major or (trans_b) N-major. Descriptors are swizzle-free, their addresses offsets
// into the block's dynamic shared memory. Asynchronous as on the GPU: wgmma_commit closes a
// group, and wgmma_wait(n) (the warpgroup's threads, which wait for each other there) executes
// the groups older than the newest n, reading shared memory and the accumulators then; a block
// that ends with instructions not waited for aborts. (wgmma.fence has nothing to order here.)
void wgmma_m64k16(float* d, int n, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool trans_b, bool accumulate,
                  bool bf16);
void wgmma_commit();
void wgmma_wait(int keep_pending);
// cp.async.cg.shared.global of 16 bytes (zeros when src_bytes == 0); the copy lands by the wait
// for its group (when exactly: the schedule's choice, emu_threads.cpp).
void cp_async16(void* smem, const void* gmem, int src_bytes);
void cp_async_commit();
void cp_async_wait(int keep_pending);

}  // namespace keel_emu

// ---- built-in variables ----
#define threadIdx (::keel_emu::coords().thread_idx)
#define blockIdx (::keel_emu::coords().block_idx)
#define blockDim (::keel_emu::coords().block_dim)
#define gridDim (::keel_emu::coords().grid_dim)
inline constexpr int warpSize = 32;

// ---- synchronization and warp primitives ----
inline void __syncthreads() { keel_emu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { keel_emu::warp_barrier(mask); }
namespace keel_emu {
// The lane a relative shuffle reads: src when it lies in the caller's segment of `width` lanes,
// else the caller's own lane (its value comes back unchanged).
inline int segment_source(int lane, int src, int width) {
  return (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane;
}
}  // namespace keel_emu
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = keel_emu::lane_id();
  return keel_emu::exchange(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = keel_emu::lane_id();
  return keel_emu::exchange(mask, v, keel_emu::segment_source(lane, lane ^ lane_mask, width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = keel_emu::lane_id();
  return keel_emu::exchange(mask, v, keel_emu::segment_source(lane, lane + static_cast<int>(delta), width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = keel_emu::lane_id();
  return keel_emu::exchange(mask, v, keel_emu::segment_source(lane, lane - static_cast<int>(delta), width));
}

template <class T>
unsigned __ballot_sync(unsigned mask, T predicate) {
  const int lane = keel_emu::lane_id();
  const unsigned char mine = predicate ? 1 : 0;
  *keel_emu::warp_slot(lane) = mine;
  keel_emu::warp_barrier(mask);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && *keel_emu::warp_slot(l)) bits |= 1u << l;
  keel_emu::warp_barrier(mask);
  return bits;
}

// Device min/max of mixed integer and float types (CUDA's math headers overload them).
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// cudaFuncSetAttribute(kernel, ...) with the kernel's own pointer type (cuda_runtime.h's
// template overload is for nvcc only).
template <class... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

// ---- arithmetic intrinsics: IEEE round-to-nearest, as their _rn names say ----
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __tanhf(float x) { return std::tanh(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
template <class T>
inline T __ldg(const T* p) { return *p; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }
