// Warpgroup tensor-core products on Hopper (wgmma.mma_async, sm_90a): the four warps of a
// 128-thread block compute D[64 x N] (+)= A[64 x 16] B[16 x N] in one asynchronous instruction
// whose B (and optionally A) the tensor cores read straight from shared memory, once for the
// whole warpgroup; the mma.sync kernels instead load every B fragment into each warp's
// registers by ldmatrix, four times per block, which is what bounds them by shared-memory
// bandwidth and issue slots.
//
// Register layouts (PTX ISA, "Register Fragments" of wgmma .m64nNk16), warp w of the group,
// g = lane / 4, t = lane % 4:
//   D (fp32): d[n][0..1] = (row 16w + g, cols 8n + 2t, +1), d[n][2..3] = (row 16w + g + 8, same
//             cols): the mma.sync m16n8 accumulators of the warp's 16 rows, side by side.
//   A (bf16/f16 pairs): the mma.sync m16n8k16 A fragment of rows 16w..16w+15.
// So the element-wise code written for mma.sync fragments carries over unchanged.
//
// Shared-memory operands use the layout without swizzling: "core matrices" of 8 rows x 16
// bytes stored as 128 contiguous bytes. A tile of R rows x C columns (C contiguous in global
// memory, 16-bit elements) is kept as core matrices in row-major order of their (r / 8, c / 8):
//   element (r, c) at byte ((r / 8) (C / 8) + c / 8) 128 + (r % 8) 16 + (c % 8) 2
// A descriptor (PTX ISA, "Matrix Descriptor Format") gives the start address, the byte
// distance between core matrices adjacent in K (leading dimension byte offset, LBO) and in M
// or N (stride dimension byte offset, SBO), all in units of 16 bytes, swizzle mode 0. The same
// tile serves as
//   a K-major operand (rows = M or N, columns = K): LBO 128, SBO 16 C; k-step kk at +256 kk;
//   an MN-major operand (rows = K, columns = M or N; B only, imm-trans-b = 1): LBO 16 C,
//   SBO 128; k-step kk at +32 C kk.
// The instruction reads shared memory through the async proxy: writes by ordinary or cp.async
// stores become visible to it after fence.proxy.async (fence_async_proxy) and a barrier.
//
// The instructions exist only for sm_90a (and the CUDA emulator, which executes them at the
// wait, reading shared memory then); other targets compile the kernels with trapping stand-ins, and the host launches them
// only where wgmma_available (wgmma_check.h) found the sm_90a code running.
#pragma once

#include "kernels/cuda/cuda_common.cuh"

#if defined(KEEL_CUDA_EMULATOR) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KEEL_HAS_WGMMA 1
#else
#define KEEL_HAS_WGMMA 0
#endif

namespace keel::cuda {

// ---- core-matrix tiles ----

// Rows [row0, row0 + R) of a row-major source (C elements per row at g + row * ld) into the
// core-matrix tile s; rows >= n_rows are zero-filled. The block's kThreads threads copy 16-byte
// chunks q = thread + pass kThreads, chunk q being (row 8 (q / (8 C / 8)) + q % 8, columns
// 8 ((q / 8) % (C / 8)) ...): its destination is byte 16 q, so the 8 threads of a phase write
// one contiguous core matrix (no bank conflicts) and a warp reads 8 rows x 64 contiguous bytes.
template <class T, int C, int R, int kThreads>
__device__ __forceinline__ void cm_tile_async(T* s, const T* g, int row0, int n_rows, int64_t ld) {
  constexpr int kChunks = C / 8;  // 16-byte chunks per row
  static_assert(C % 8 == 0 && R % 8 == 0 && (R * kChunks) % kThreads == 0, "a tile is whole passes of the block");
#pragma unroll
  for (int p = 0; p < R * kChunks / kThreads; ++p) {
    const int q = p * kThreads + static_cast<int>(threadIdx.x);
    const int r = q / (8 * kChunks) * 8 + q % 8, ch = (q / 8) % kChunks;
    const bool valid = row0 + r < n_rows;
    // rows past the end read nothing, from an address inside the tensor
    cp_async16(s + q * 8, valid ? g + static_cast<int64_t>(row0 + r) * ld + ch * 8 : g, valid);
  }
}

// ---- descriptors ----

// Swizzle-free descriptor of the operand at p (16-byte aligned shared memory).
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
#ifdef KEEL_CUDA_EMULATOR
  // the emulated shared window starts at the block's dynamic shared memory
  const auto addr = static_cast<uint32_t>(static_cast<const unsigned char*>(p) - keel_emu::dynamic_shared());
#else
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32;
}
// A core-matrix tile of C columns as a K-major operand (its columns are K), or as an MN-major
// one (its rows are K).
template <int C>
__device__ __forceinline__ uint64_t desc_kmajor(const void* tile) {
  return smem_desc(tile, 128, 16 * C);
}
template <int C>
__device__ __forceinline__ uint64_t desc_mnmajor(const void* tile) {
  return smem_desc(tile, 16 * C, 128);
}
// The descriptor of the operand `bytes` (a multiple of 16) further on. Shared memory is below
// 256 KiB, so the 14-bit address field does not carry into LBO.
__device__ __forceinline__ uint64_t desc_plus(uint64_t d, uint32_t bytes) { return d + (bytes >> 4); }
// The K-major and MN-major operands of k-step kk (16 values of K) of a tile of C columns.
__device__ __forceinline__ uint64_t kmajor_step(uint64_t d, int kk) {
  return desc_plus(d, 256u * kk);
}
template <int C>
__device__ __forceinline__ uint64_t mnmajor_step(uint64_t d, int kk) {
  return desc_plus(d, 32u * C * kk);
}

// ---- instructions ----

// WgmmaOp<T, N>::ss<kTransB>(d, a_desc, b_desc, accumulate) and ::rs<kTransB>(d, a_regs,
// b_desc, accumulate): D = A B (accumulate 0) or D += A B over one k-step of 16; B K-major
// (kTransB 0) or N-major (1); A K-major from shared memory (ss) or in registers (rs).
template <class T, int N>
struct WgmmaOp;

#if defined(KEEL_CUDA_EMULATOR)
template <class T, int N>
struct WgmmaOp {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  template <int kTransB>
  static void ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
    keel_emu::wgmma_m64k16(&d[0][0], N, nullptr, a, b, kTransB != 0, accumulate != 0, kBf16);
  }
  template <int kTransB>
  static void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    keel_emu::wgmma_m64k16(&d[0][0], N, a, 0, b, kTransB != 0, accumulate != 0, kBf16);
  }
};
#elif KEEL_HAS_WGMMA
#include "kernels/cuda/wgmma_instructions.inc"
#else
template <class T, int N>
struct WgmmaOp {
  template <int kTransB>
  static __device__ __forceinline__ void ss(float (&)[N / 8][4], uint64_t, uint64_t, int) {
    __trap();
  }
  template <int kTransB>
  static __device__ __forceinline__ void rs(float (&)[N / 8][4], const uint32_t (&)[4], uint64_t, int) {
    __trap();
  }
};
#endif

// D = A B over kSteps k-steps of 16, A and B K-major tiles (descriptors at k-step 0), and
// D += A B with A from registers (a[kk]: k-step kk's fragment) and B an N-major tile of N
// columns. Issued only: the caller fences before and commits and waits after the batch.
template <class T, int N, int kSteps>
__device__ __forceinline__ void wgmma_ss_kmajor(float (&d)[N / 8][4], uint64_t a, uint64_t b) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) WgmmaOp<T, N>::template ss<0>(d, kmajor_step(a, kk), kmajor_step(b, kk), kk > 0);
}
template <class T, int N, int kSteps>
__device__ __forceinline__ void wgmma_rs_nmajor(float (&d)[N / 8][4], const uint32_t (&a)[kSteps][4], uint64_t b) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) WgmmaOp<T, N>::template rs<1>(d, a[kk], mnmajor_step<N>(b, kk), 1);
}

// Before the first wgmma of a batch: orders the warpgroup's register writes (accumulators,
// A fragments) before the instructions read them.
__device__ __forceinline__ void wgmma_fence() {
#if KEEL_HAS_WGMMA && !defined(KEEL_CUDA_EMULATOR)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Close the batch issued since the last commit, and wait until at most kPending batches are
// still running (0: all done; their accumulators may be read and their shared memory reused).
__device__ __forceinline__ void wgmma_commit() {
#if defined(KEEL_CUDA_EMULATOR)
  keel_emu::wgmma_commit();
#elif KEEL_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if defined(KEEL_CUDA_EMULATOR)
  keel_emu::wgmma_wait(kPending);
#elif KEEL_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// The compiler must not move reads of accumulators above the wait (it does not know the
// asynchronous instructions write them): each register passes through an empty asm after it.
template <int N>
__device__ __forceinline__ void wgmma_settle(float (&d)[N][4]) {
#if !defined(KEEL_CUDA_EMULATOR)
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e])::"memory");
#endif
}
// This thread's shared-memory writes (plain or cp.async, after their wait) made visible to the
// async proxy that wgmma reads through; a barrier then publishes them to the warpgroup.
__device__ __forceinline__ void fence_async_proxy() {
#if KEEL_HAS_WGMMA && !defined(KEEL_CUDA_EMULATOR)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

}  // namespace keel::cuda
