// wgmma_available and wgmma_tile_product (wgmma_check.h).
#include <map>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/wgmma.cuh"
#include "kernels/cuda/wgmma_check.h"

namespace keel::cuda {

namespace {

// 1 in the sm_90a build of keel's device code (and the emulator's), 0 in the others: the
// device runs whichever its architecture selects.
__global__ void wgmma_probe_kernel(int* out) { *out = KEEL_HAS_WGMMA; }

// two adjacent 16-bit elements (4-byte aligned) as one register
template <class T>
__device__ __forceinline__ uint32_t pair_bits(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// One warpgroup: stage a (64 x 64) and b as core-matrix tiles, then four k-steps.
template <class T, int N, bool kNMajor, bool kRegA>
__global__ void __launch_bounds__(128) wgmma_tile_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                         float* __restrict__ c) {
  KEEL_DYNAMIC_SHARED(smem);
  T* sA = reinterpret_cast<T*>(smem);
  T* sB = sA + 64 * 64;
  cm_tile_async<T, 64, 64, 128>(sA, a, 0, 64, 64);
  if constexpr (kNMajor) cm_tile_async<T, N, 64, 128>(sB, b, 0, 64, N);
  else cm_tile_async<T, 64, N, 128>(sB, b, 0, N, 64);
  cp_async_commit();
  cp_async_wait<0>();
  fence_async_proxy();
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t ar[4][4];  // A fragments of k-steps 0..3: (row g | g + 8, cols 2t, 2t+1 | +8)
  if constexpr (kRegA)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        ar[kk][r] = pair_bits(a + (16 * warp + g + 8 * (r & 1)) * 64 + 16 * kk + 2 * t + 8 * (r >> 1));
  const uint64_t da = desc_kmajor<64>(sA);
  const uint64_t db = kNMajor ? desc_mnmajor<N>(sB) : desc_kmajor<64>(sB);
  float d[N / 8][4];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t bk = kNMajor ? mnmajor_step<N>(db, kk) : kmajor_step(db, kk);
    if constexpr (kRegA) WgmmaOp<T, N>::template rs<kNMajor>(d, ar[kk], bk, kk > 0);
    else WgmmaOp<T, N>::template ss<kNMajor>(d, kmajor_step(da, kk), bk, kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_settle(d);
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[(16 * warp + g + 8 * (e / 2)) * N + 8 * n + 2 * t + e % 2] = d[n][e];
}

template <class T, int N>
void launch_tile(CudaBackend& be, const Tensor& c, const Tensor& a, const Tensor& b, bool regs, bool n_major) {
  const size_t smem = static_cast<size_t>(64 * 64 + 64 * N) * sizeof(T);
  const auto go = [&](auto kernel) {
    allow_smem(kernel, smem, "wgmma_tile_product");
    kernel<<<1, 128, smem, be.stream()>>>(a.as<const T>(), b.as<const T>(), c.as<float>());
  };
  if (regs) {
    if (n_major) go(wgmma_tile_kernel<T, N, true, true>);
    else go(wgmma_tile_kernel<T, N, false, true>);
  } else {
    if (n_major) go(wgmma_tile_kernel<T, N, true, false>);
    else go(wgmma_tile_kernel<T, N, false, false>);
  }
}

}  // namespace

bool wgmma_available(int device) {
  static std::mutex mu;
  static std::map<int, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = known.find(device); it != known.end()) return it->second;
  const char* op = "wgmma probe";
  check_cuda(cudaSetDevice(device), op, "cudaSetDevice");
  int* flag = nullptr;
  check_cuda(cudaMalloc(&flag, sizeof(int)), op, "cudaMalloc");
  wgmma_probe_kernel<<<1, 1>>>(flag);
  int host = 0;
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(flag);
  check_cuda(launched, op, "launch");
  check_cuda(copied, op, "cudaMemcpy");
  return known[device] = host == 1;
}

void wgmma_tile_product(CudaBackend& be, const Tensor& c, const Tensor& a, const Tensor& b, bool a_from_registers,
                        bool b_n_major) {
  const char* op = "wgmma_tile_product";
  const int64_t n = c.ndim == 2 ? c.dim(1) : 0;
  const bool shapes_ok = a.ndim == 2 && a.dim(0) == 64 && a.dim(1) == 64 && c.ndim == 2 && c.dim(0) == 64 &&
                         (n == 32 || n == 64 || n == 128) && b.ndim == 2 &&
                         (b_n_major ? b.dim(0) == 64 && b.dim(1) == n : b.dim(0) == n && b.dim(1) == 64);
  if (!shapes_ok)
    fail(op, "wants c [64, N] with N 32, 64 or 128, a [64, 64], b [N, 64] (or [64, N] N-major)",
         {{"c", c}, {"a", a}, {"b", b}});
  check_dtype(op, {"c", c}, DType::F32);
  if ((a.dtype != DType::BF16 && a.dtype != DType::F16) || b.dtype != a.dtype)
    fail(op, "a and b must both be bf16 or both f16", {{"a", a}, {"b", b}});
  if (!wgmma_available(be.device_index())) fail(op, "this device does not run keel's sm_90a code (wgmma)", {});
  const auto by_n = [&](auto tag) {
    using T = decltype(tag);
    if (n == 32) launch_tile<T, 32>(be, c, a, b, a_from_registers, b_n_major);
    else if (n == 64) launch_tile<T, 64>(be, c, a, b, a_from_registers, b_n_major);
    else launch_tile<T, 128>(be, c, a, b, a_from_registers, b_n_major);
  };
  if (a.dtype == DType::BF16) by_n(__nv_bfloat16{});
  else by_n(__half{});
  check_launch(be, op, {{"c", c}, {"a", a}, {"b", b}});
}

}  // namespace keel::cuda
