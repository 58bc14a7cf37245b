// Fused causal self-attention with grouped-query heads on the tensor cores, after the
// FlashAttention-2 algorithm (Dao, 2023): tiles of Q, K, V in shared memory, scores and
// probabilities in registers, an online softmax, only the log-sum-exp saved; the backward
// recomputes the probabilities tile by tile. No T x T matrix is ever stored.
//
// Notation for one query head h (kv head h / group), query rows i, key rows j <= i:
//   S_ij = (q_i . k_j) * scale,  scale = 1/sqrt(hd);  lse_i = log sum_j exp(S_ij);  P_ij = exp(S_ij - lse_i)
//   O_i = sum_j P_ij v_j;  D_i = dO_i . O_i;  dS_ij = P_ij (dO_i . v_j - D_i)
//   dq_i = scale sum_j dS_ij k_j;  dk_j = scale sum_{h in group} sum_i dS_ij q_i;  dv_j = sum_{h in group} sum_i P_ij dO_i
// Exponentials are taken base 2 with scores pre-multiplied by scale * log2(e), by ex2.approx.ftz
// (one MUFU instruction; exp2f adds four to keep subnormal results, probabilities below 2^-126
// that no sum here can see); lse is stored in natural-log units.
// ALiBi (AttnShape::alibi_slopes): S_ij += m_h (j - i). In log2 units that is
// fma(float(j - i), m_h log2(e), S_ij scale log2(e)), from each accumulator element's (row, key)
// the masks already compute; the forward's lse then includes the bias, and the backward's
// recomputed P (the only place it enters there: the bias has no gradient) adds it alike. Kernels
// are instantiated with and without it (template flag kAlibi), so the plain causal path keeps
// its code and registers; which tiles are skipped does not change.
//
// Matrix products: warp-level mma.sync.m16n8k16 with bf16 (or fp16) operands and fp32
// accumulators (sm_80 and sm_90), operands loaded from shared memory by ldmatrix. Fragment
// layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A (16x16, row-major): reg0 = (row g,   cols 2t, 2t+1)   reg1 = (row g+8, cols 2t, 2t+1)
//                         reg2 = (row g,   cols 2t+8, +9)   reg3 = (row g+8, cols 2t+8, +9)
//   B (16x8, "col"):      reg0 = (rows 2t, 2t+1, col g)      reg1 = (rows 2t+8, 2t+9, col g)
//   C (16x8, fp32):       c0, c1 = (row g, cols 2t, 2t+1)    c2, c3 = (row g+8, cols 2t, 2t+1)
// Each 32-bit register packs two 16-bit values, the lower column (or row) in the low half.
// A C fragment pair (n-tiles 2k, 2k+1) of probabilities is exactly the A fragment of the k-th
// 16-wide slice of P, which is how P (and dS) feed the next product without leaving registers.
// On sm_90a the forward and dk-dv kernels also come in a wgmma version (template flag kWgmma,
// CudaBackend::attention_wgmma; wgmma.cuh): the warpgroup's 64 rows are one instruction's M,
// B (and the first product's A) read by the tensor cores from core-matrix tiles in shared
// memory; its accumulators are laid out per thread exactly as the mma.sync ones above, so only
// the products and the tile layout differ. The wgmma kernels' blocks are two warpgroups: the
// forward's 128 query rows share each K and V tile (forward_groups), the dk-dv kernel's 128 keys
// each step's Q and dO (dkdv_groups).
//
// Kernels and their parallel decomposition (4 warps per block, each warp owns 16 rows; the blocks
// of a grid are (tile, head, batch) in one of two orders, BlockCoord, with the tiles that have the
// most work first):
//   forward  block (query tile of 64 rows, head, batch); loops over key tiles 0..diagonal with K/V
//            double-buffered by cp.async; per warp: S = Q K^T (16x64), online softmax, O += P V.
//   dq       block (query tile of 64 rows, head, batch); loops over key tiles 0..diagonal:
//            S, dP = dO V^T, dS, dQ += dS K. One block owns each dq row: no accumulation across blocks.
//   dk, dv   block (key tile of 64 rows, 128 with wgmma, kv head, batch); loops over the group's query heads in
//            order and, for each, over query tiles of 32 rows from the diagonal to the end:
//            S^T = K Q^T, dP^T = V dO^T, dS^T, dV += P^T dO, dK += dS^T Q. One block owns each
//            dk/dv row, and the loop order is fixed: deterministic, no atomics.
// The backward has two ways to get dq. Counting a 64x64xhd tile product as one unit U:
//   staged (default) the dk-dv kernel runs first and also stores its rounded dS tiles (64 keys x
//            64 queries, 8 KiB in bf16) to scratch; then dq_staged, per query tile, loops over
//            key tiles: dQ += dS K. 4U + 1U, plus a write and a read of the causal half of dS
//            (B * nh * T^2 / 2 * 2 bytes, launched in chunks of heads and sequences that fit
//            the budget CudaBackend::attention_ds_budget).
//   recompute the dq kernel above, before the dk-dv kernel: S, dP and dS again, 3U + 4U.
// Both sum dq over key tiles in a fixed order in one block: deterministic either way.
// Tiles beyond T are zero-filled and masked; causal masking applies on tiles crossing the diagonal.
// Document masking (AttnShape::positions, pos) and sliding windows (AttnShape::window): row i
// attends keys from start_i = attention_first_key(i) (kernels/attention_window.h: i - pos[i],
// and at least i - window + 1). The starts never decrease with i, so a query tile's keys begin
// at the tile of its first row's start (forward, dq: earlier key tiles are skipped), a key
// tile's queries end where a row's start passes the tile's last key (dk-dv: the later query
// tiles are skipped), and tiles where some start falls inside are masked element by element.
// P and dS are rounded to the storage type for the second product of each pair (as
// FlashAttention does); all sums are fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <type_traits>

#include "kernels/attention_window.h"
#include "kernels/cuda/attention_flash.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace keel::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockQ = 64;      // query rows per block (forward, dq)
constexpr int kBlockK = 64;      // key rows per tile / per dk-dv block
constexpr int kBlockQBwd = 32;   // query rows per step of the dk-dv kernel
constexpr int kDsTile = kBlockQ * kBlockK;  // elements of one staged dS tile
constexpr int kPad = 8;          // shared-memory row padding (elements): conflict-free fragment loads
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Blocks per SM the forward and dk-dv kernels are compiled for: at head_dim 64 four, so at most
// 128 registers a thread (16 warps per SM; of these only the wgmma staged dk-dv spills: four
// values kept across its loop, and with ALiBi a few loads a step; bench/PTXAS.md), at 128
// whatever their accumulators take (shared memory allows 2).
constexpr int min_blocks_per_sm(int head_dim) { return head_dim == 64 ? 4 : 1; }

// ---- fragments and tensor-core products ----

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two m16n8 fp32 accumulator tiles (columns 16kk..16kk+7 and 16kk+8..16kk+15 of a 16-row
// block) as the A operand (m16k16) of the next mma: the accumulator layout of a thread is
// exactly the A fragment layout, rounded to T in pairs.
template <class T>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
#ifdef KEEL_CUDA_EMULATOR
  keel_emu::mma_m16n8k16(c, a, b0, b1, true);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef KEEL_CUDA_EMULATOR
  keel_emu::mma_m16n8k16(c, a, b0, b1, false);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Fragments come from shared memory by ldmatrix (sm_75+): one instruction loads four 8x8 b16
// matrices. Lane l supplies the address of row l % 8 of matrix l / 8 (each row 16 contiguous,
// 16-byte aligned bytes); every lane then holds, in register i, two elements of matrix i:
//   plain:   (row l / 4, cols 2(l % 4), 2(l % 4) + 1)
//   .trans:  (rows 2(l % 4), 2(l % 4) + 1, col l / 4)
// Rows of the padded tiles start 144 (hd 64) or 272 (hd 128) bytes apart, so the 8 rows a
// phase reads fall in 8 distinct 4-bank groups: conflict-free.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* row) {
#ifdef KEEL_CUDA_EMULATOR
  keel_emu::ldmatrix_x4(r, row, false);
#else
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#endif
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* row) {
#ifdef KEEL_CUDA_EMULATOR
  keel_emu::ldmatrix_x4(r, row, true);
#else
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#endif
}

// A fragment of the 16x16 block at `base` of a row-major shared array with row stride ld.
// Matrices 0..3 = (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15): exactly a[0..3].
template <class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* base, int ld, int lane) {
  ldsm_x4(a, base + (lane % 8 + (lane & 8)) * ld + (lane / 16) * 8);
}

// B fragments of two adjacent n-tiles (16 k x 16 n) whose element (k, n) is base[n * ld + k]
// (k contiguous: K or Q rows indexed by n, the head dimension by k): b[0], b[1] for n 0-7,
// b[2], b[3] for n 8-15. Matrices 0..3 = (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
// (n 8-15, k 8-15); the plain layout gives lane l the pair (k = 2t, 2t+1; n = g).
template <class T>
__device__ __forceinline__ void load_b_nmajor_x2(uint32_t (&b)[4], const T* base, int ld, int lane) {
  ldsm_x4(b, base + (lane % 8 + (lane / 16) * 8) * ld + (lane & 8));
}

// B fragments of two adjacent n-tiles whose element (k, n) is base[k * ld + n] (n contiguous:
// V, K, Q or dO rows indexed by k, the head dimension by n). Matrices 0..3 = (k 0-7, n 0-7),
// (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15); .trans gives lane l (k = 2t, 2t+1; n = g).
template <class T>
__device__ __forceinline__ void load_b_kmajor_x2(uint32_t (&b)[4], const T* base, int ld, int lane) {
  ldsm_x4_trans(b, base + (lane % 8 + (lane & 8)) * ld + (lane / 16) * 8);
}

// c[n] += A B_n over the N (even) n-tiles of a 16 x 8N product whose B (16 x 8N, k x n) is in
// shared memory: element (k, n) at base[n * ld + k] (nmajor) or base[k * ld + n] (kmajor).
template <class T, int N>
__device__ __forceinline__ void mma_b_nmajor(float (&c)[N][4], const uint32_t (&a)[4], const T* base, int ld,
                                             int lane) {
#pragma unroll
  for (int n = 0; n < N; n += 2) {
    uint32_t b[4];
    load_b_nmajor_x2(b, base + n * 8 * ld, ld, lane);
    mma16816<T>(c[n], a, b[0], b[1]);
    mma16816<T>(c[n + 1], a, b[2], b[3]);
  }
}
template <class T, int N>
__device__ __forceinline__ void mma_b_kmajor(float (&c)[N][4], const uint32_t (&a)[4], const T* base, int ld,
                                             int lane) {
#pragma unroll
  for (int n = 0; n < N; n += 2) {
    uint32_t b[4];
    load_b_kmajor_x2(b, base + n * 8, ld, lane);
    mma16816<T>(c[n], a, b[0], b[1]);
    mma16816<T>(c[n + 1], a, b[2], b[3]);
  }
}

// Two products over the head dimension (KT k-steps of 16) with mma.sync: c1 = A1 B1^T and
// c2 = A2 B2^T, A1 and A2 the warp's 16 rows (row-major tiles from the row at a1, a2, stride
// LD), B1 and B2 n-major tiles of 8N rows: S and dP of the dq kernel, S^T and dP^T of dk-dv.
template <class T, int KT, int N, int LD>
__device__ __forceinline__ void mma_pair_nmajor(float (&c1)[N][4], float (&c2)[N][4], const T* a1, const T* a2,
                                                const T* b1, const T* b2, int lane) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) c1[n][e] = c2[n][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    uint32_t f1[4], f2[4];
    load_a(f1, a1 + kk * 16, LD, lane);
    load_a(f2, a2 + kk * 16, LD, lane);
    mma_b_nmajor<T>(c1, f1, b1 + kk * 16, LD, lane);
    mma_b_nmajor<T>(c2, f2, b2 + kk * 16, LD, lane);
  }
}

// The A fragments of all K / 16 k-steps of a 16 x K accumulator (P or dS), for wgmma.
template <class T, int K16>
__device__ __forceinline__ void acc_to_a_steps(uint32_t (&a)[K16][4], const float (&c)[2 * K16][4]) {
#pragma unroll
  for (int kk = 0; kk < K16; ++kk) acc_to_a<T>(a[kk], c[2 * kk], c[2 * kk + 1]);
}

// Row r (0: the lane's row g, 1: row g + 8) of a 16 x 8N accumulator times mul, rounded to T,
// to dst[0, 8N) (the lane writes its column pairs 2t, 2t+1 of each n-tile).
template <class T, int N>
__device__ __forceinline__ void store_acc_row(T* dst, const float (&c)[N][4], int r, float mul, int t) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t) = pack2<T>(c[n][2 * r] * mul, c[n][2 * r + 1] * mul);
}

// ---- asynchronous tile copies ----

// Rows [row0, row0 + kRows) of one head (HD contiguous elements at g_head + row * cols) into
// shared rows of stride HD + kPad; rows >= T_len are zero-filled.
// Thread x copies chunk x % kChunks of rows x / kChunks + p kThreads / kChunks, pass p (unrolled).
template <class T, int HD, int kRows>
__device__ __forceinline__ void async_tile(T* s, const T* g_head, int row0, int T_len, int64_t cols) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  constexpr int LD = HD + kPad;
  if constexpr (kThreads % kChunks != 0) {
    static_assert(kRows * kChunks % kThreads == 0, "a tile is whole passes of the block");
#pragma unroll
    for (int p = 0; p < kRows * kChunks / kThreads; ++p) {
      const int q = p * kThreads + static_cast<int>(threadIdx.x), r = q / kChunks, ch = q % kChunks;
      const bool valid = row0 + r < T_len;
      cp_async16(s + r * LD + ch * 8, valid ? g_head + static_cast<int64_t>(row0 + r) * cols + ch * 8 : g_head, valid);
    }
  } else {
    constexpr int kRowsPerPass = kThreads / kChunks;
    static_assert(kRows % kRowsPerPass == 0, "a tile is whole passes of the block");
    const int r0 = threadIdx.x / kChunks, ch = threadIdx.x % kChunks;
    const T* src = g_head + static_cast<int64_t>(row0 + r0) * cols + ch * 8;
    T* dst = s + r0 * LD + ch * 8;
#pragma unroll
    for (int p = 0; p < kRows / kRowsPerPass; ++p) {
      const bool valid = row0 + r0 + p * kRowsPerPass < T_len;
      // rows past T read nothing, from an address inside the tensor
      cp_async16(dst + p * kRowsPerPass * LD, valid ? src + p * kRowsPerPass * cols : g_head, valid);
    }
  }
}

// Rows [row0, row0 + kRows) of a head into a tile as the kernel's products read it: padded
// rows for mma.sync, core matrices for wgmma (wgmma.cuh); rows >= T_len zero-filled. Copied by
// the block's kBlockThreads threads (kThreads unless a wgmma block has more warpgroups).
template <class T, int HD, int kRows, bool kWgmma, int kBlockThreads = kThreads>
__device__ __forceinline__ void load_head_tile(T* dst, const T* src, int row0, int T_len, int64_t ld) {
  static_assert(kWgmma || kBlockThreads == kThreads, "the mma.sync kernels' blocks are kThreads");
  if constexpr (kWgmma) cm_tile_async<T, HD, kRows, kBlockThreads>(dst, src, row0, T_len, ld);
  else async_tile<T, HD, kRows>(dst, src, row0, T_len, ld);
}

// Double buffering over a loop's steps: with a step after this one, stage it (stage(next, buf))
// into the other buffer and wait for all but that newest copy group; at the last step wait for
// everything. Then a barrier, after which the block may read the current buffer (kAsyncProxy:
// wgmma may, too).
template <bool kAsyncProxy = false, class Stage, class Step>
__device__ __forceinline__ void stage_next_and_wait(bool more, const Stage& stage, const Step& next, int buf) {
  if (more) {
    stage(next, buf);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  if constexpr (kAsyncProxy) fence_async_proxy();
  __syncthreads();
}

// ---- document masking and sliding windows ----

const int32_t* positions_of(const AttnShape& s) {
  return s.positions.empty() ? nullptr : s.positions.as<const int32_t>();
}

// ALiBi slopes [nh] (checked by the op: check_alibi), or nullptr
const float* slopes_of(const AttnShape& s) {
  return s.alibi_slopes.empty() ? nullptr : s.alibi_slopes.as<const float>();
}

// Row i's first key, start_i (p: the sequence's document positions, or null).
__device__ __forceinline__ int row_start(const int32_t* p, int i, int window) {
  return static_cast<int>(attention_first_key(p, i, window));
}

// A query tile's starts (all 0 for plain causal attention): the lane's two rows, the tile's
// first row (where its keys begin) and its last row.
struct DocStarts {
  int start[2] = {0, 0};  // rows row_a, row_b (rows past T: 0, they are masked anyway)
  int first_key = 0;      // start of row q0
  int last_start = 0;     // start of row q_last
  __device__ DocStarts(const int32_t* pos, int window, int b, int T_len, int q0, int q_last, int row_a, int row_b) {
    if (!pos && window == 0) return;
    const int32_t* p = pos ? pos + static_cast<int64_t>(b) * T_len : nullptr;
    start[0] = row_a < T_len ? row_start(p, row_a, window) : 0;
    start[1] = row_b < T_len ? row_start(p, row_b, window) : 0;
    first_key = row_start(p, q0, window);
    last_start = row_start(p, q_last, window);
  }
};

// One past the last query row whose start is at most key j (p: one sequence's positions, or
// null; starts never decrease, so a binary search over rows j .. T-1; row j itself qualifies).
// Every thread of the block computes it alike (a few cached loads).
__device__ int queries_end(const int32_t* p, int window, int T_len, int j) {
  int lo = j + 1, hi = T_len;  // rows < lo qualify; rows >= hi do not
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (row_start(p, mid, window) <= j)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// ---- scores ----

// A score S_ij in log2 units from the accumulator's q.k: times scale log2(e), plus with ALiBi
// m_h (j - i) log2(e) (slope_log2 = m_h log2(e); j - i exact in fp32 below 2^24). The forward
// and both backward kernels compute it alike, so the recomputed P matches the forward's lse.
template <bool kAlibi>
__device__ __forceinline__ float score_log2(float qk, float scale_log2, int j_minus_i, float slope_log2) {
  if constexpr (kAlibi) return fmaf(static_cast<float>(j_minus_i), slope_log2, qk * scale_log2);
  else return qk * scale_log2;
}

// 2^x by the special-function unit: relative error about 2^-22, subnormal results flushed to 0,
// ex2(-inf) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef KEEL_CUDA_EMULATOR
  const float r = exp2f(x);
  return r < 1.17549435e-38f ? 0.0f : r;
#else
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
#endif
}

// A tile step either masks element by element (keys past the diagonal or T, or before a row's
// start) or needs no mask at all; the kernels branch once per step (uniformly) between the two
// versions of their element-wise code, so interior tiles, most of the work, pay no index math.
template <bool kMask>
using MaskTag = std::integral_constant<bool, kMask>;
template <class Body>
__device__ __forceinline__ void with_mask(bool mask, const Body& body) {
  if (mask) body(MaskTag<true>{});
  else body(MaskTag<false>{});
}

// P_ij and dS_ij = P_ij (dP_ij - D_i) of one element in place: s holds q.k and becomes P, dp holds
// dO.v and becomes dS. lse2: row i's lse in log2 units; in a masked step p is zeroed unless
// valid (j_minus_i and valid are dead code where unused).
template <bool kMask, bool kAlibi>
__device__ __forceinline__ void prob_and_ds(float& s, float& dp, float lse2, float d, float scale_log2, int j_minus_i,
                                            float slope_log2, bool valid) {
  const float x = kAlibi ? score_log2<kAlibi>(s, scale_log2, j_minus_i, slope_log2) - lse2 : fmaf(s, scale_log2, -lse2);
  float p = fast_exp2(x);
  if constexpr (kMask) p = valid ? p : 0.0f;
  s = p;
  dp = p * (dp - d);
}

// ---- block order ----

// A block's tile, head and sequence, from its place in the grid (grid_of). Blocks start in
// linear order, x fastest. Heads fastest (tiles on z): each tile index runs across every head
// and sequence at once, so the longest tiles of all heads start first and the tail is short.
// Tiles fastest: one head's tiles run together and share its K and V in L2, which pays where the
// K and V of all heads outgrow L2 (kv_outgrow_l2): with heads fastest, each wave then read them
// all from DRAM again (GPT-2 at B 32, 100 MB: the forward moved 2.6x its minimal bytes on an
// H100, and with tiles fastest ran 13% faster; the 1B Llama's 17 MB fit, and it ran 7% slower).
struct BlockCoord {
  int tile, head, seq;
  int tiles, heads;  // the grid's extent in each
};
__device__ __forceinline__ BlockCoord block_coord(bool tiles_fastest) {
  if (tiles_fastest)
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z),
            static_cast<int>(gridDim.x), static_cast<int>(gridDim.y)};
  return {static_cast<int>(blockIdx.z), static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
          static_cast<int>(gridDim.z), static_cast<int>(gridDim.x)};
}
dim3 grid_of(bool tiles_fastest, int64_t tiles, int64_t heads, int64_t seqs) {
  const auto u = [](int64_t v) { return static_cast<unsigned>(v); };
  return tiles_fastest ? dim3(u(tiles), u(heads), u(seqs)) : dim3(u(heads), u(seqs), u(tiles));
}
// Whether the K and V of all sequences and kv heads exceed half of L2 (the rest is the other
// operands' and the outputs').
bool kv_outgrow_l2(const CudaBackend& be, const AttnShape& s, size_t elem_bytes) {
  const size_t kv_bytes = static_cast<size_t>(s.B) * s.T * s.n_kv_heads * s.head_dim * 2 * elem_bytes;
  return kv_bytes > be.l2_bytes() / 2;
}

// ---- forward ----

// Warpgroups (4 warps, 64 query rows each) per forward block: the wgmma version's blocks take
// 128 rows, two warpgroups sharing each K and V tile, which halves the K and V bytes each
// product reads from L2 (64-row blocks read 16 bytes per 1 kFLOP: about 6 TB/s at 400 TFLOP/s).
constexpr int forward_groups(bool wgmma) { return wgmma ? 2 : 1; }
// Warpgroups (4 warps, 64 keys each) per dk-dv block: likewise the wgmma version's blocks take
// 128 keys sharing each step's Q and dO (64-key blocks read 8 KiB per 1 MFLOP: 3.9 TB/s of L2 at
// 400 TFLOP/s).
constexpr int dkdv_groups(bool wgmma) { return wgmma ? 2 : 1; }

// kWgmma: both products on Hopper's warpgroup instructions (wgmma.cuh; sm_90a only), each
// warpgroup's 64 query rows their M: S = Q K^T with A = Q and B = K K-major from shared memory,
// O += P V with A = P from registers and B = V N-major; tiles stored as core matrices. A
// warpgroup skips the steps whose keys are all masked for its rows (past its diagonal, or before
// its first row's start), so a 128-row block does the 64-row blocks' products.
template <class T, int HD, bool kAlibi, bool kWgmma>
__global__ void __launch_bounds__(kThreads * forward_groups(kWgmma),
                                  std::max(1, min_blocks_per_sm(HD) / forward_groups(kWgmma)))
    flash_forward_kernel(const T* __restrict__ qkv, T* __restrict__ out, float* __restrict__ lse,
                         const int32_t* __restrict__ pos, int window, const float* __restrict__ slopes, int T_len,
                         int nh, int nkv, float scale_log2, bool tiles_fastest) {
  constexpr int LD = kWgmma ? HD : HD + kPad;  // elements per tile row (core-matrix tiles: no padding)
  constexpr int KT = HD / 16;  // k-steps over the head dimension
  constexpr int NT = HD / 8;   // n-tiles of the output
  constexpr int kRows = kBlockQ * forward_groups(kWgmma);           // query rows per block
  constexpr int kBlockThreads = kThreads * forward_groups(kWgmma);
  KEEL_DYNAMIC_SHARED(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [kRows][LD]
  T* sK = sQ + kRows * LD;         // [2][kBlockK][LD]
  T* sV = sK + 2 * kBlockK * LD;   // [2][kBlockK][LD]

  const BlockCoord c = block_coord(tiles_fastest);
  const int qt = c.tiles - 1 - c.tile;  // longest first
  const int h = c.head, b = c.seq;
  const int kvh = h / (nh / nkv);
  const int64_t cols = static_cast<int64_t>(nh + 2 * nkv) * HD;
  const T* base = qkv + static_cast<int64_t>(b) * T_len * cols;
  const T* q_head = base + h * HD;
  const T* k_head = base + (nh + kvh) * HD;
  const T* v_head = base + (nh + nkv + kvh) * HD;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wg = threadIdx.x / kThreads, warp = threadIdx.x / 32 % kWarps;  // warpgroup, warp in it
  const int q0 = qt * kRows;                 // the block's first row
  const int wq0 = q0 + wg * kBlockQ;         // the warpgroup's
  const int row_a = wq0 + warp * 16 + g, row_b = row_a + 8;
  const int q_last = min(q0 + kRows - 1, T_len - 1);
  const int n_kt = q_last / kBlockK + 1;
  const bool has_rows = wq0 < T_len;  // the last block's second group may have none
  const int wq_last = has_rows ? min(wq0 + kBlockQ - 1, T_len - 1) : -1;  // -1: no steps
  const DocStarts docs(pos, window, b, T_len, has_rows ? wq0 : q0, has_rows ? wq_last : q0, row_a, row_b);
  const int kt_first =
      (pos || window > 0 ? row_start(pos ? pos + static_cast<int64_t>(b) * T_len : nullptr, q0, window) : 0) /
      kBlockK;
  const float slope_log2 = kAlibi ? slopes[h] * kLog2e : 0.0f;  // ALiBi's m_h in log2 units

  load_head_tile<T, HD, kRows, kWgmma, kBlockThreads>(sQ, q_head, q0, T_len, cols);
  load_head_tile<T, HD, kBlockK, kWgmma, kBlockThreads>(sK, k_head, kt_first * kBlockK, T_len, cols);
  load_head_tile<T, HD, kBlockK, kWgmma, kBlockThreads>(sV, v_head, kt_first * kBlockK, T_len, cols);
  cp_async_commit();

  uint32_t qa[KT][4];
  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int kt = kt_first; kt < n_kt; ++kt) {
    const int buf = (kt - kt_first) & 1;
    if (kt + 1 < n_kt) {  // prefetch the next K/V tile into the other buffer
      load_head_tile<T, HD, kBlockK, kWgmma, kBlockThreads>(sK + (buf ^ 1) * kBlockK * LD, k_head, (kt + 1) * kBlockK,
                                                           T_len, cols);
      load_head_tile<T, HD, kBlockK, kWgmma, kBlockThreads>(sV + (buf ^ 1) * kBlockK * LD, v_head, (kt + 1) * kBlockK,
                                                           T_len, cols);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if constexpr (kWgmma) fence_async_proxy();
    __syncthreads();
    if (!kWgmma && kt == kt_first) {
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) load_a(qa[kk], sQ + warp * 16 * LD + kk * 16, LD, lane);
    }
    const T* k_s = sK + buf * kBlockK * LD;
    const T* v_s = sV + buf * kBlockK * LD;
    const int k0 = kt * kBlockK;
    // Skip a step whose keys are all masked for the warpgroup's rows (uniform over the group;
    // never for a one-group block, whose loop ends at its diagonal and starts at its first key).
    if (forward_groups(kWgmma) == 1 || (k0 <= wq_last && k0 + kBlockK > docs.first_key)) {
      // S = Q K^T for the warp's 16 rows x 64 keys
      float s[8][4];
      if constexpr (kWgmma) {
        wgmma_fence();
        wgmma_ss_kmajor<T, kBlockK, KT>(s, desc_kmajor<HD>(sQ + wg * kBlockQ * LD), desc_kmajor<HD>(k_s));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_settle(s);
      } else {
#pragma unroll
        for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) mma_b_nmajor<T>(s, qa[kk], k_s + kk * 16, LD, lane);
      }

      // Row maxima in log2 units. A tile without mask or bias takes them over the raw scores
      // (scale_log2 > 0 commutes with max, and with rounding), and its exponent below is then one
      // fma: (s, scale_log2, -m); otherwise the scores become log2 units here, masked to -inf.
      const bool mask = k0 + kBlockK - 1 > wq0 || k0 + kBlockK > T_len || k0 < docs.last_start;
      const bool raw = !kAlibi && !mask;
      float mx[2] = {-INFINITY, -INFINITY};
      with_mask(mask, [&](auto masked) {
        constexpr bool kMask = decltype(masked)::value;
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (kMask || kAlibi) {
              const int col = k0 + n * 8 + 2 * t + (e & 1);
              const int row = e < 2 ? row_a : row_b;
              float v = score_log2<kAlibi>(s[n][e], scale_log2, col - row, slope_log2);
              if (kMask && (col > row || col >= T_len || col < docs.start[e >> 1])) v = -INFINITY;
              s[n][e] = v;
            }
            mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
          }
      });
      const float mul = raw ? scale_log2 : 1.0f;  // from s to log2 units
      float m_use[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m[r], mx[r] * mul);
        m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing unmasked yet stays at 0
        alpha[r] = fast_exp2(m[r] - m_use[r]);
        m[r] = m_new;
      }
      // P = exp2(S - m), row sums
      float rs[2] = {0.0f, 0.0f};
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = fast_exp2(fmaf(s[n][e], mul, -m_use[e >> 1]));
          s[n][e] = p;
          rs[e >> 1] += p;
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
        l[r] = l[r] * alpha[r] + rs[r];
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
      // O += P V
      if constexpr (kWgmma) {
        uint32_t pa[kBlockK / 16][4];
        acc_to_a_steps<T>(pa, s);
        wgmma_fence();
        wgmma_rs_nmajor<T, HD>(o, pa, desc_mnmajor<HD>(v_s));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_settle(o);  // the next step rescales o: not before the products have landed
      } else {
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          uint32_t pa[4];
          acc_to_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
          mma_b_kmajor<T>(o, pa, v_s + (kk * 16) * LD, LD, lane);
        }
      }
    }  // the warpgroup's step
    __syncthreads();  // all warps are done with this buffer before it is refilled
  }

  // O / l, log-sum-exp
  const float inv_l[2] = {l[0] > 0.0f ? 1.0f / l[0] : 0.0f, l[1] > 0.0f ? 1.0f / l[1] : 0.0f};
  const int64_t out_cols = static_cast<int64_t>(nh) * HD;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r ? row_b : row_a;
    if (row >= T_len) continue;
    T* orow = out + (static_cast<int64_t>(b) * T_len + row) * out_cols + h * HD;
    store_acc_row<T>(orow, o, r, inv_l[r], t);
    if (t == 0) lse[(static_cast<int64_t>(b) * nh + h) * T_len + row] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// ---- backward: dq ----

template <class T, int HD, bool kAlibi>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dq_kernel(const T* __restrict__ qkv, const T* __restrict__ dout, const float* __restrict__ lse,
                             const float* __restrict__ delta, const int32_t* __restrict__ pos, int window,
                             const float* __restrict__ slopes, T* __restrict__ dqkv, int T_len, int nh, int nkv,
                             float scale_log2, float scale, bool tiles_fastest) {
  constexpr int LD = HD + kPad;
  constexpr int KT = HD / 16;
  constexpr int NT = HD / 8;
  KEEL_DYNAMIC_SHARED(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockQ * LD;
  T* sK = sdO + kBlockQ * LD;      // [2][kBlockK][LD]
  T* sV = sK + 2 * kBlockK * LD;   // [2][kBlockK][LD]

  const BlockCoord c = block_coord(tiles_fastest);
  const int qt = c.tiles - 1 - c.tile;  // longest first, as in the forward
  const int h = c.head, b = c.seq;
  const int kvh = h / (nh / nkv);
  const int64_t cols = static_cast<int64_t>(nh + 2 * nkv) * HD;
  const int64_t out_cols = static_cast<int64_t>(nh) * HD;
  const T* base = qkv + static_cast<int64_t>(b) * T_len * cols;
  const T* q_head = base + h * HD;
  const T* k_head = base + (nh + kvh) * HD;
  const T* v_head = base + (nh + nkv + kvh) * HD;
  const T* do_head = dout + static_cast<int64_t>(b) * T_len * out_cols + h * HD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q0 = qt * kBlockQ;
  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const int q_last = min(q0 + kBlockQ - 1, T_len - 1);
  const int n_kt = q_last / kBlockK + 1;
  const DocStarts docs(pos, window, b, T_len, q0, q_last, row_a, row_b);
  const int kt_first = docs.first_key / kBlockK;
  const int64_t stat = (static_cast<int64_t>(b) * nh + h) * T_len;
  // per row: lse in log2 units, and D
  const float lse2[2] = {row_a < T_len ? lse[stat + row_a] * kLog2e : 0.0f,
                         row_b < T_len ? lse[stat + row_b] * kLog2e : 0.0f};
  const float dd[2] = {row_a < T_len ? delta[stat + row_a] : 0.0f, row_b < T_len ? delta[stat + row_b] : 0.0f};
  const float slope_log2 = kAlibi ? slopes[h] * kLog2e : 0.0f;  // as in the forward

  async_tile<T, HD, kBlockQ>(sQ, q_head, q0, T_len, cols);
  async_tile<T, HD, kBlockQ>(sdO, do_head, q0, T_len, out_cols);
  async_tile<T, HD, kBlockK>(sK, k_head, kt_first * kBlockK, T_len, cols);
  async_tile<T, HD, kBlockK>(sV, v_head, kt_first * kBlockK, T_len, cols);
  cp_async_commit();

  float dq[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  for (int kt = kt_first; kt < n_kt; ++kt) {
    const int buf = (kt - kt_first) & 1;
    if (kt + 1 < n_kt) {
      async_tile<T, HD, kBlockK>(sK + (buf ^ 1) * kBlockK * LD, k_head, (kt + 1) * kBlockK, T_len, cols);
      async_tile<T, HD, kBlockK>(sV + (buf ^ 1) * kBlockK * LD, v_head, (kt + 1) * kBlockK, T_len, cols);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* k_s = sK + buf * kBlockK * LD;
    const T* v_s = sV + buf * kBlockK * LD;
    const int k0 = kt * kBlockK;

    // S = Q K^T and dP = dO V^T (16 rows x 64 keys per warp)
    float s[8][4], dp[8][4];
    mma_pair_nmajor<T, KT, 8, LD>(s, dp, sQ + warp * 16 * LD, sdO + warp * 16 * LD, k_s, v_s, lane);
    // P and dS = P (dP - D); valid where start_i <= col <= row < T (then col < T too)
    const bool mask = k0 + kBlockK - 1 > q0 || q0 + kBlockQ > T_len || k0 < docs.last_start;
    with_mask(mask, [&](auto masked) {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = k0 + n * 8 + 2 * t + (e & 1);
          const int row = e < 2 ? row_a : row_b;
          prob_and_ds<decltype(masked)::value, kAlibi>(s[n][e], dp[n][e], lse2[e >> 1], dd[e >> 1], scale_log2,
                                                       col - row, slope_log2,
                                                       col <= row && row < T_len && col >= docs.start[e >> 1]);
        }
    });
    // dQ += dS K
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, dp[2 * kk], dp[2 * kk + 1]);
      mma_b_kmajor<T>(dq, a, k_s + (kk * 16) * LD, LD, lane);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r ? row_b : row_a;
    if (row >= T_len) continue;
    T* drow = dqkv + (static_cast<int64_t>(b) * T_len + row) * cols + h * HD;
    store_acc_row<T>(drow, dq, r, scale, t);
  }
}

// ---- backward: dk, dv ----

// Staged dS tiles: per (sequence, query head) of a launch's chunk, the causal tiles (qt, kt),
// kt <= qt, in row order: tile index qt (qt + 1) / 2 + kt, each [64 keys][64 queries].
__device__ __forceinline__ int64_t ds_tile_index(int64_t head_in_chunk, int64_t n_tri, int qt, int kt) {
  return head_in_chunk * n_tri + static_cast<int64_t>(qt) * (qt + 1) / 2 + kt;
}
// The causal tiles of one head: attention_ds_tiles_per_head (kernels/attention_settings.h,
// which keel plan shares).
static_assert(kBlockQ == kAttentionDsTileRows && kBlockK == kAttentionDsTileRows, "a staged dS tile is 64 x 64");

// kStoreDS: also store dS (rounded to T, as the dK product takes it) to `ds` for
// flash_backward_dq_staged_kernel; the grid then covers one chunk, kv heads kv0 + c.head and
// sequences b0 + c.seq, and the query loop runs to whole 64-row tiles, so that every row
// below T of a tile the dq kernel reads is stored (the rows past the last one a key tile
// reaches store zeros).
// kWgmma: the four products on Hopper's warpgroup instructions (wgmma.cuh; sm_90a only): the
// block's 64 keys are the M of S^T = K Q^T and dP^T = V dO^T (A = K, V and B = Q, dO, all
// K-major from shared memory) and of dV += P^T dO and dK += dS^T Q (A = P^T, dS^T from the
// registers they were computed in, B = dO, Q N-major), with the tiles stored as core matrices
// instead of padded rows; the accumulators have the same per-thread layout, so everything
// between the products is the same code. Its blocks are two warpgroups, 128 keys sharing each
// Q and dO step (dkdv_groups); a warpgroup skips the steps whose queries all precede its first
// key or come after the last that sees one, so each does, and stores, exactly what a 64-key
// block of its keys would.
template <class T, int HD, bool kAlibi, bool kStoreDS, bool kWgmma>
__global__ void __launch_bounds__(kThreads * dkdv_groups(kWgmma),
                                  std::max(1, min_blocks_per_sm(HD) / dkdv_groups(kWgmma)))
    flash_backward_dkdv_kernel(const T* __restrict__ qkv, const T* __restrict__ dout, const float* __restrict__ lse,
                               const float* __restrict__ delta, const int32_t* __restrict__ pos, int window,
                               const float* __restrict__ slopes, T* __restrict__ dqkv, T* __restrict__ ds, int kv0,
                               int b0, int T_len, int nh, int nkv, float scale_log2, float scale) {
  constexpr int LD = kWgmma ? HD : HD + kPad;  // elements per tile row (core-matrix tiles: no padding)
  constexpr int KT = HD / 16;
  constexpr int NT = HD / 8;
  constexpr int QN = kBlockQBwd / 8;  // n-tiles of S^T (queries)
  constexpr int kGroups = dkdv_groups(kWgmma);
  constexpr int kKeys = kBlockK * kGroups;  // keys per block
  constexpr int kBlockThreads = kThreads * kGroups;
  KEEL_DYNAMIC_SHARED(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw);  // [kKeys][LD]
  T* sV = sK + kKeys * LD;                 // [kKeys][LD]
  T* sQ = sV + kKeys * LD;             // [2][kBlockQBwd][LD]
  T* sdO = sQ + 2 * kBlockQBwd * LD;   // [2][kBlockQBwd][LD]
  float* sL = reinterpret_cast<float*>(sdO + 2 * kBlockQBwd * LD);  // [2][kBlockQBwd] lse (log2 units)
  float* sD = sL + 2 * kBlockQBwd;                                  // [2][kBlockQBwd]
  int* sS = reinterpret_cast<int*>(sD + 2 * kBlockQBwd);            // [2][kBlockQBwd] row starts

  const BlockCoord c = block_coord(false);
  const int kt = c.tile;  // key block; small kt = most query tiles: started first, for every (kv head, batch)
  const int kvh = kv0 + c.head, b = b0 + c.seq;
  const int group = nh / nkv;
  const int64_t cols = static_cast<int64_t>(nh + 2 * nkv) * HD;
  const int64_t out_cols = static_cast<int64_t>(nh) * HD;
  const T* base = qkv + static_cast<int64_t>(b) * T_len * cols;
  const T* k_head = base + (nh + kvh) * HD;
  const T* v_head = base + (nh + nkv + kvh) * HD;
  const T* do_base = dout + static_cast<int64_t>(b) * T_len * out_cols;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wg = threadIdx.x / kThreads, warp = threadIdx.x / 32 % kWarps;  // warpgroup, warp in it
  const int k0 = kt * kKeys;          // the block's first key
  const int wk0 = k0 + wg * kBlockK;  // the warpgroup's
  const int key_a = wk0 + warp * 16 + g, key_b = key_a + 8;
  const int qi_first = k0 / kBlockQBwd;
  // Queries that see a key up to `last`: i from the first key up to, with document masking or a
  // window, the last row whose start is at most `last` (starts never decrease); with kStoreDS
  // to the end of its 64-row dS tile.
  const int32_t* seq_pos = pos ? pos + static_cast<int64_t>(b) * T_len : nullptr;
  const auto queries_to = [&](int last) {
    const int end = pos || window > 0 ? queries_end(seq_pos, window, T_len, last) : T_len;
    return kStoreDS ? min((end + kBlockQ - 1) / kBlockQ * kBlockQ, (T_len + kBlockQBwd - 1) / kBlockQBwd * kBlockQBwd)
                    : end;
  };
  const int q_end = queries_to(min(k0 + kKeys, T_len) - 1);  // the block's: its last warpgroup's
  // the warpgroup's steps: queries from its first key to its q_end (none if it has no keys)
  const int wq_end = kGroups == 1 ? q_end : wk0 < T_len ? queries_to(min(wk0 + kBlockK, T_len) - 1) : 0;
  const int n_q = (q_end + kBlockQBwd - 1) / kBlockQBwd - qi_first;  // query tiles per head
  const int64_t n_tri = kStoreDS ? attention_ds_tiles_per_head(T_len) : 0;
  const int n_it = group * n_q;
  const int i_begin = qi_first * kBlockQBwd, i_stop = i_begin + n_q * kBlockQBwd;
  const int64_t stat_seq = static_cast<int64_t>(b) * nh * T_len;

  // A step's query head and first row: the group's heads in order, each over its query tiles
  // from the diagonal on (counted up, no divisions).
  struct QueryStep {
    int h, i0;
  };
  const auto advance = [&](QueryStep q) {
    q.i0 += kBlockQBwd;
    if (q.i0 == i_stop) {
      q.i0 = i_begin;
      ++q.h;
    }
    return q;
  };
  // Stage step q into buffer `buf`: Q and dO rows, their lse (log2 units), D and starts.
  const auto stage = [&](QueryStep q, int buf) {
    load_head_tile<T, HD, kBlockQBwd, kWgmma, kBlockThreads>(sQ + buf * kBlockQBwd * LD, base + q.h * HD, q.i0,
                                                             T_len, cols);
    load_head_tile<T, HD, kBlockQBwd, kWgmma, kBlockThreads>(sdO + buf * kBlockQBwd * LD, do_base + q.h * HD, q.i0,
                                                             T_len, out_cols);
    if (threadIdx.x < kBlockQBwd) {
      const int i = q.i0 + threadIdx.x;
      const int64_t stat = stat_seq + static_cast<int64_t>(q.h) * T_len;
      sL[buf * kBlockQBwd + threadIdx.x] = i < T_len ? lse[stat + i] * kLog2e : 0.0f;
      sD[buf * kBlockQBwd + threadIdx.x] = i < T_len ? delta[stat + i] : 0.0f;
      sS[buf * kBlockQBwd + threadIdx.x] = i < T_len ? row_start(seq_pos, i, window) : 0;
    }
  };

  load_head_tile<T, HD, kKeys, kWgmma, kBlockThreads>(sK, k_head, k0, T_len, cols);
  load_head_tile<T, HD, kKeys, kWgmma, kBlockThreads>(sV, v_head, k0, T_len, cols);
  QueryStep cur{kvh * group, i_begin};
  stage(cur, 0);
  cp_async_commit();

  float dk[NT][4], dv[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

  // the warpgroup's keys as the A operand of S^T and dP^T
  const uint64_t k_desc = kWgmma ? desc_kmajor<HD>(sK + wg * kBlockK * LD) : 0;
  const uint64_t v_desc = kWgmma ? desc_kmajor<HD>(sV + wg * kBlockK * LD) : 0;
  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1;
    const QueryStep next = advance(cur);
    stage_next_and_wait<kWgmma>(it + 1 < n_it, stage, next, buf ^ 1);
    const T* q_s = sQ + buf * kBlockQBwd * LD;
    const T* do_s = sdO + buf * kBlockQBwd * LD;
    const float* l_s = sL + buf * kBlockQBwd;
    const float* d_s = sD + buf * kBlockQBwd;
    const int* start_s = sS + buf * kBlockQBwd;
    const int i0 = cur.i0;
    // the step's query head changes every n_q steps: its slope is a broadcast (cached) load
    const float slope_log2 = kAlibi ? slopes[cur.h] * kLog2e : 0.0f;

    // Skip a step whose queries all precede the warpgroup's first key (i0 and wk0 are multiples
    // of 32) or follow the last query that sees one (uniform over the group; never for a
    // one-group block, whose loop spans exactly its steps).
    if (kGroups == 1 || (i0 >= wk0 && i0 < wq_end)) {
      // S^T = K Q^T and dP^T = V dO^T (16 keys x 32 queries per warp)
      float st[QN][4], dpt[QN][4];
      if constexpr (kWgmma) {
        // the first k-step overwrites: no zeroing, which would be register writes between the two
        // batches that the compiler then separates with a wait
        wgmma_fence();
        wgmma_ss_kmajor<T, kBlockQBwd, KT>(st, k_desc, desc_kmajor<HD>(q_s));
        wgmma_ss_kmajor<T, kBlockQBwd, KT>(dpt, v_desc, desc_kmajor<HD>(do_s));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_settle(st);
        wgmma_settle(dpt);
      } else {
        mma_pair_nmajor<T, KT, QN, LD>(st, dpt, sK + warp * 16 * LD, sV + warp * 16 * LD, q_s, do_s, lane);
      }
      // P^T and dS^T; rows are keys j, columns queries i; valid where start_i <= j <= i < T (then
      // j < T too). Masked steps: queries before the tile's last key, past T, or whose start (the
      // last row's is the largest) passes its first key (all of the warpgroup's keys).
      const bool mask = i0 < wk0 + kBlockK - 1 || i0 + kBlockQBwd > T_len || start_s[kBlockQBwd - 1] > wk0;
      with_mask(mask, [&](auto masked) {
#pragma unroll
        for (int n = 0; n < QN; ++n) {
          const int ci = n * 8 + 2 * t;  // the lane's query pair ci, ci + 1
          const float2 l2 = *reinterpret_cast<const float2*>(l_s + ci);
          const float2 d2 = *reinterpret_cast<const float2*>(d_s + ci);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = i0 + ci + (e & 1);
            const int j = e < 2 ? key_a : key_b;
            prob_and_ds<decltype(masked)::value, kAlibi>(st[n][e], dpt[n][e], e & 1 ? l2.y : l2.x, e & 1 ? d2.y : d2.x,
                                                         scale_log2, j - i, slope_log2,
                                                         j <= i && i < T_len && j >= start_s[ci + (e & 1)]);
          }
        }
      });
      if constexpr (kStoreDS) {
        // the lane's keys (rows g, g + 8 of the warp's 16) x its query pairs, as 4-byte stores
        const int64_t head_in_chunk = (static_cast<int64_t>(c.seq) * c.heads + c.head) * group + (cur.h - kvh * group);
        T* tile = ds + ds_tile_index(head_in_chunk, n_tri, i0 / kBlockQ, wk0 / kBlockK) * kDsTile;
        T* dst = tile + (warp * 16 + g) * kBlockQ + i0 % kBlockQ + 2 * t;
#pragma unroll
        for (int n = 0; n < QN; ++n) {
          *reinterpret_cast<uint32_t*>(dst + n * 8) = pack2<T>(dpt[n][0], dpt[n][1]);
          *reinterpret_cast<uint32_t*>(dst + 8 * kBlockQ + n * 8) = pack2<T>(dpt[n][2], dpt[n][3]);
        }
      }
      // dV += P^T dO and dK += dS^T Q (k = the 32 queries)
      if constexpr (kWgmma) {
        uint32_t pa[kBlockQBwd / 16][4], sa[kBlockQBwd / 16][4];
        acc_to_a_steps<T>(pa, st);
        acc_to_a_steps<T>(sa, dpt);
        wgmma_fence();
        wgmma_rs_nmajor<T, HD>(dv, pa, desc_mnmajor<HD>(do_s));
        wgmma_rs_nmajor<T, HD>(dk, sa, desc_mnmajor<HD>(q_s));
        wgmma_commit();
        wgmma_wait<0>();  // the next step's staging refills these tiles
      } else {
#pragma unroll
        for (int kk = 0; kk < kBlockQBwd / 16; ++kk) {
          uint32_t pa[4], sa[4];
          acc_to_a<T>(pa, st[2 * kk], st[2 * kk + 1]);
          acc_to_a<T>(sa, dpt[2 * kk], dpt[2 * kk + 1]);
          mma_b_kmajor<T>(dv, pa, do_s + (kk * 16) * LD, LD, lane);
          mma_b_kmajor<T>(dk, sa, q_s + (kk * 16) * LD, LD, lane);
        }
      }
    }  // the warpgroup's step
    cur = next;
    __syncthreads();
  }
  if constexpr (kWgmma) {
    wgmma_settle(dk);
    wgmma_settle(dv);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = r ? key_b : key_a;
    if (j >= T_len) continue;
    T* row = dqkv + (static_cast<int64_t>(b) * T_len + j) * cols;
    store_acc_row<T>(row + (nh + kvh) * HD, dk, r, scale, t);
    store_acc_row<T>(row + (nh + nkv + kvh) * HD, dv, r, 1.0f, t);  // x 1.0f: exact
  }
}

// ---- backward: dq from the staged dS ----

// Block (query tile of 64 rows, query head h0 + c.head, sequence b0 + c.seq); per warp
// 16 rows: dQ += dS K over key tiles from the tile of the first row's start to the diagonal, in
// order. dS comes from scratch as stored by the dk-dv kernel ([key][query] per tile, so its A
// fragments are loaded transposed); K from qkv. Both double-buffered by cp.async.
template <class T, int HD>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dq_staged_kernel(const T* __restrict__ qkv, const T* __restrict__ ds,
                                    const int32_t* __restrict__ pos, int window, T* __restrict__ dqkv, int h0, int b0,
                                    int T_len, int nh, int nkv, float scale, bool tiles_fastest) {
  constexpr int LD = HD + kPad;
  constexpr int LDS = kBlockQ + kPad;  // a staged tile's rows: 64 queries
  constexpr int NT = HD / 8;
  KEEL_DYNAMIC_SHARED(smem_raw);
  T* sS = reinterpret_cast<T*>(smem_raw);  // [2][kBlockK][LDS]
  T* sK = sS + 2 * kBlockK * LDS;         // [2][kBlockK][LD]

  const BlockCoord c = block_coord(tiles_fastest);
  const int qt = c.tiles - 1 - c.tile;  // longest first, as in the forward
  const int h = h0 + c.head, b = b0 + c.seq;
  const int kvh = h / (nh / nkv);
  const int64_t cols = static_cast<int64_t>(nh + 2 * nkv) * HD;
  const T* k_head = qkv + static_cast<int64_t>(b) * T_len * cols + (nh + kvh) * HD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q0 = qt * kBlockQ;
  const int32_t* seq_pos = pos ? pos + static_cast<int64_t>(b) * T_len : nullptr;
  const int kt_first = pos || window > 0 ? row_start(seq_pos, q0, window) / kBlockK : 0;
  const int64_t head_in_chunk = static_cast<int64_t>(c.seq) * c.heads + c.head;
  const T* tiles = ds + ds_tile_index(head_in_chunk, attention_ds_tiles_per_head(T_len), qt, 0) * kDsTile;

  auto stage = [&](int kt, int buf) {
    async_tile<T, kBlockQ, kBlockK>(sS + buf * kBlockK * LDS, tiles + static_cast<int64_t>(kt) * kDsTile, 0, kBlockK,
                                    kBlockQ);
    async_tile<T, HD, kBlockK>(sK + buf * kBlockK * LD, k_head, kt * kBlockK, T_len, cols);
  };
  stage(kt_first, 0);
  cp_async_commit();

  float dq[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  for (int kt = kt_first; kt <= qt; ++kt) {
    const int buf = (kt - kt_first) & 1;
    stage_next_and_wait(kt < qt, stage, kt + 1, buf ^ 1);
    const T* s_s = sS + buf * kBlockK * LDS;
    const T* k_s = sK + buf * kBlockK * LD;
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      // A = dS (16 query rows x 16 keys) from the [key][query] tile: .trans of matrices (keys
      // 0-7 | 8-15) x (queries 0-7 | 8-15), lane l giving key row l % 8 + 8 (l / 16), query
      // column 8 ((l / 8) % 2), which yields a[0..3] in the A fragment order.
      uint32_t a[4];
      ldsm_x4_trans(a, s_s + (kk * 16 + lane % 8 + (lane / 16) * 8) * LDS + warp * 16 + (lane & 8));
      mma_b_kmajor<T>(dq, a, k_s + (kk * 16) * LD, LD, lane);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + warp * 16 + g + 8 * r;
    if (row >= T_len) continue;
    T* drow = dqkv + (static_cast<int64_t>(b) * T_len + row) * cols + h * HD;
    store_acc_row<T>(drow, dq, r, scale, t);
  }
}

// ---- launchers ----

template <class T, int HD, bool kWgmma = false>
size_t forward_smem() {
  return static_cast<size_t>(kBlockQ * forward_groups(kWgmma) + 4 * kBlockK) * (kWgmma ? HD : HD + kPad) * sizeof(T);
}
template <class T, int HD>
size_t dq_smem() {
  return static_cast<size_t>(2 * kBlockQ + 4 * kBlockK) * (HD + kPad) * sizeof(T);
}
template <class T, int HD>
size_t dq_staged_smem() {
  return static_cast<size_t>(2 * kBlockK) * (kBlockQ + kPad + HD + kPad) * sizeof(T);
}
template <class T, int HD, bool kWgmma = false>
size_t dkdv_smem() {
  return static_cast<size_t>(2 * kBlockK * dkdv_groups(kWgmma) + 4 * kBlockQBwd) * (kWgmma ? HD : HD + kPad) *
             sizeof(T) +
         6 * kBlockQBwd * sizeof(float);
}

template <class T, int HD, bool kAlibi, bool kWgmma>
void forward_impl(CudaBackend& be, const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s,
                  float scale) {
  const size_t smem = forward_smem<T, HD, kWgmma>();
  allow_smem(flash_forward_kernel<T, HD, kAlibi, kWgmma>, smem, "attention_forward");
  const bool tiles_fastest = kv_outgrow_l2(be, s, sizeof(T));
  constexpr int kGroups = forward_groups(kWgmma);
  const dim3 grid = grid_of(tiles_fastest, ceil_div(s.T, kBlockQ * kGroups), s.n_heads, s.B);
  flash_forward_kernel<T, HD, kAlibi, kWgmma><<<grid, kThreads * kGroups, smem, be.stream()>>>(
      qkv.as<const T>(), out.as<T>(), lse.as<float>(), positions_of(s), s.window, slopes_of(s), s.T, s.n_heads,
      s.n_kv_heads, scale * kLog2e, tiles_fastest);
}

// A staged backward's launches: kv heads and sequences per chunk (whole groups of query heads),
// each chunk's dS within the budget (attention_ds_chunks, kernels/attention_settings.h, which
// keel plan shares). kv == 0: not even one kv head's tiles fit.
template <class T, int HD, bool kAlibi, bool kWgmma>
void backward_impl(CudaBackend& be, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                   const float* delta, const AttnShape& s, float scale) {
  const char* op = "attention_backward";
  const int group = s.n_heads / s.n_kv_heads;
  const unsigned n_tiles = static_cast<unsigned>(ceil_div(s.T, kBlockK));  // = query tiles (kBlockQ == kBlockK)
  constexpr int kGroups = dkdv_groups(kWgmma);
  const unsigned n_key_blocks = static_cast<unsigned>(ceil_div(s.T, kBlockK * kGroups));
  const size_t smem_dkdv = dkdv_smem<T, HD, kWgmma>();
  // the dq kernels by kv_outgrow_l2; the dk-dv kernel always heads fastest: its blocks are few
  // and long where GQA groups heads (2.6 waves on the 1B Llama), and the tail decides
  const bool tiles_fastest = kv_outgrow_l2(be, s, sizeof(T));
  const AttentionDsChunks chunks = attention_ds_chunks(s.B, s.T, s.n_heads, s.n_kv_heads, sizeof(T),
                                                       be.attention_ds_budget());
  T* ds = chunks.kv > 0 ? static_cast<T*>(be.scratch_if_free(chunks.bytes, op)) : nullptr;
  if (chunks.kv > 0 && !ds) {
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr,
                   "keel: attention_backward: no device memory for %.1f MiB of staged dS tiles: recomputing them "
                   "instead (slower; KEEL_ATTN_DS_MB bounds the staging, 0 turns it off)\n",
                   chunks.bytes / 1048576.0);
    });
  }
  if (ds) {
    const size_t smem_dq = dq_staged_smem<T, HD>();
    allow_smem(flash_backward_dkdv_kernel<T, HD, kAlibi, true, kWgmma>, smem_dkdv, op);
    allow_smem(flash_backward_dq_staged_kernel<T, HD>, smem_dq, op);
    for (int b0 = 0; b0 < s.B; b0 += chunks.seqs)
      for (int kv0 = 0; kv0 < s.n_kv_heads; kv0 += chunks.kv) {
        const int kv = std::min(chunks.kv, s.n_kv_heads - kv0), seqs = std::min(chunks.seqs, s.B - b0);
        flash_backward_dkdv_kernel<T, HD, kAlibi, true, kWgmma>
            <<<grid_of(false, n_key_blocks, kv, seqs), kThreads * kGroups, smem_dkdv, be.stream()>>>(
                qkv.as<const T>(), dout.as<const T>(), lse.as<const float>(), delta, positions_of(s), s.window,
                slopes_of(s), dqkv.as<T>(), ds, kv0, b0, s.T, s.n_heads, s.n_kv_heads, scale * kLog2e, scale);
        flash_backward_dq_staged_kernel<T, HD>
            <<<grid_of(tiles_fastest, n_tiles, kv * group, seqs), kThreads, smem_dq, be.stream()>>>(
            qkv.as<const T>(), ds, positions_of(s), s.window, dqkv.as<T>(), kv0 * group, b0, s.T, s.n_heads,
            s.n_kv_heads, scale, tiles_fastest);
      }
    be.release(ds);
    return;
  }
  const size_t smem_dq = dq_smem<T, HD>();
  allow_smem(flash_backward_dq_kernel<T, HD, kAlibi>, smem_dq, op);
  allow_smem(flash_backward_dkdv_kernel<T, HD, kAlibi, false, kWgmma>, smem_dkdv, op);
  const dim3 grid_q = grid_of(tiles_fastest, n_tiles, s.n_heads, s.B);
  flash_backward_dq_kernel<T, HD, kAlibi><<<grid_q, kThreads, smem_dq, be.stream()>>>(
      qkv.as<const T>(), dout.as<const T>(), lse.as<const float>(), delta, positions_of(s), s.window, slopes_of(s),
      dqkv.as<T>(), s.T, s.n_heads, s.n_kv_heads, scale * kLog2e, scale, tiles_fastest);
  const dim3 grid_k = grid_of(false, n_key_blocks, s.n_kv_heads, s.B);
  flash_backward_dkdv_kernel<T, HD, kAlibi, false, kWgmma><<<grid_k, kThreads * kGroups, smem_dkdv, be.stream()>>>(
      qkv.as<const T>(), dout.as<const T>(), lse.as<const float>(), delta, positions_of(s), s.window, slopes_of(s),
      dqkv.as<T>(), nullptr, 0, 0, s.T, s.n_heads, s.n_kv_heads, scale * kLog2e, scale);
}

// head_dim (and wgmma) dispatch of the launchers: s.head_dim is 64, 128 or 160 (the padded
// width, attention_padded_head_dim); scale = 1/sqrt(the real head_dim). There are no wgmma kernels at 160.
template <class T, bool kAlibi>
void forward_hd(CudaBackend& be, const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s,
                float scale) {
  const bool wgmma = be.attention_wgmma();
  if (s.head_dim == 64) {
    if (wgmma) forward_impl<T, 64, kAlibi, true>(be, out, lse, qkv, s, scale);
    else forward_impl<T, 64, kAlibi, false>(be, out, lse, qkv, s, scale);
  } else if (s.head_dim == 128) {
    if (wgmma) forward_impl<T, 128, kAlibi, true>(be, out, lse, qkv, s, scale);
    else forward_impl<T, 128, kAlibi, false>(be, out, lse, qkv, s, scale);
  } else {
    forward_impl<T, 160, kAlibi, false>(be, out, lse, qkv, s, scale);
  }
}

template <class T, bool kAlibi>
void backward_hd(CudaBackend& be, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                 const float* delta, const AttnShape& s, float scale) {
  const bool wgmma = be.attention_wgmma();  // for the dk-dv kernel
  if (s.head_dim == 64) {
    if (wgmma) backward_impl<T, 64, kAlibi, true>(be, dqkv, dout, qkv, lse, delta, s, scale);
    else backward_impl<T, 64, kAlibi, false>(be, dqkv, dout, qkv, lse, delta, s, scale);
  } else if (s.head_dim == 128) {
    if (wgmma) backward_impl<T, 128, kAlibi, true>(be, dqkv, dout, qkv, lse, delta, s, scale);
    else backward_impl<T, 128, kAlibi, false>(be, dqkv, dout, qkv, lse, delta, s, scale);
  } else {
    backward_impl<T, 160, kAlibi, false>(be, dqkv, dout, qkv, lse, delta, s, scale);
  }
}

// ---- head dims between the kernels' widths ----
//
// A call whose head_dim is not 64, 128 or 160 (the tiny configs' 32, BLOOM-104B's 145,
// BLOOM-200B's 150, phi's 80 and 96) runs the kernels of the next width up on copies of its
// operands with every head's row zero-padded to that width: the padding adds zero products to
// every dot product, so S, P and dS are the unpadded call's, and the padded columns of out, dq,
// dk and dv (sums of zero rows) are dropped when copied back. The softmax scale stays
// 1/sqrt(head_dim). The copies cost a few element-wise passes over qkv, next to products that
// grow with T (at head_dim 32 the products double: still tensor-core work, where the plain
// kernels are one warp of fp32 FMAs per query row). The width: attention_padded_head_dim
// (kernels/attention_settings.h, which keel plan shares to count the copies).

// dst [rows, heads * wide] from src [rows, heads * hd] (head h's row at h * hd), each head's
// columns hd .. wide - 1 zero; or back (kToPadded false: src padded, dst [rows, heads * hd]).
template <class T, bool kToPadded>
__global__ void repad_heads_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t n, int hd, int wide) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // e indexes the padded layout (to padded) or the unpadded one (back)
    const int64_t head_row = e / (kToPadded ? wide : hd);
    const int d = static_cast<int>(e % (kToPadded ? wide : hd));
    if constexpr (kToPadded) dst[e] = d < hd ? src[head_row * hd + d] : from_f32<T>(0.0f);
    else dst[e] = src[head_row * wide + d];
  }
}

// A device scratch tensor of the padded width, released on scope exit.
struct PaddedCopy {
  CudaBackend& be;
  Tensor t;
  PaddedCopy(CudaBackend& b, DType dt, int64_t rows, int64_t heads, int wide, const char* op) : be(b) {
    t = Tensor(be.scratch(static_cast<size_t>(rows * heads * wide) * dtype_size(dt), op), dt, {rows, heads * wide},
               Device::CUDA);
  }
  ~PaddedCopy() { be.release(t.data); }
  PaddedCopy(const PaddedCopy&) = delete;
  PaddedCopy& operator=(const PaddedCopy&) = delete;
};

// dst <- src, padding (kToPadded) or unpadding each head row of hd elements to wide.
template <bool kToPadded>
void repad_heads(CudaBackend& be, const Tensor& dst, const Tensor& src, int hd, int wide) {
  const int64_t n = dst.numel();
  const unsigned blocks = grid_for(n, 256);
  if (src.dtype == DType::BF16)
    repad_heads_kernel<__nv_bfloat16, kToPadded>
        <<<blocks, 256, 0, be.stream()>>>(dst.as<__nv_bfloat16>(), src.as<const __nv_bfloat16>(), n, hd, wide);
  else
    repad_heads_kernel<__half, kToPadded>
        <<<blocks, 256, 0, be.stream()>>>(dst.as<__half>(), src.as<const __half>(), n, hd, wide);
}

}  // namespace

bool flash_supported(const CudaBackend& be, const AttnShape& s, DType dtype,
                     std::initializer_list<const Tensor*> operands, bool backward) {
  if (dtype != DType::BF16 && dtype != DType::F16) return false;
  const int wide = static_cast<int>(attention_padded_head_dim(s.head_dim));
  if (wide == 0) return false;
  // Grids (grid_of) put tiles, heads and sequences on y or z, which are limited to 65535.
  if (s.B > 65535 || s.n_heads > 65535 || ceil_div(s.T, static_cast<int64_t>(std::min(kBlockQ, kBlockK))) > 65535)
    return false;
  // (a padded call's kernels read its aligned copies)
  for (const Tensor* t : operands)
    if (t->dtype != dtype || (wide == s.head_dim && alignment_of(t->data) < 16)) return false;
  // The blocks' shared memory (bf16 and f16 are both 2 bytes) within the device's opt-in limit:
  // 227 KiB on sm_90, 163 KiB on sm_80, but 99 KiB on sm_86 / sm_89 (and sm_120), where the dq
  // kernel at head_dim 128 (102 KiB) cannot launch. Those calls take the plain kernels.
  // The wgmma kernels (sm_90 only) take their own sizes.
  const auto need = [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    const bool wgmma = be.attention_wgmma() && HD != 160;
    if (!backward) return wgmma ? forward_smem<__half, HD, true>() : forward_smem<__half, HD>();
    const size_t dkdv = wgmma ? dkdv_smem<__half, HD, true>() : dkdv_smem<__half, HD>();
    return std::max({dq_smem<__half, HD>(), dq_staged_smem<__half, HD>(), dkdv});
  };
  const size_t bytes = wide == 64    ? need(std::integral_constant<int, 64>{})
                       : wide == 128 ? need(std::integral_constant<int, 128>{})
                                     : need(std::integral_constant<int, 160>{});
  return bytes <= be.max_smem_per_block();
}

void flash_forward(CudaBackend& be, const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s) {
  const bool alibi = !s.alibi_slopes.empty();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  const auto run = [&](const Tensor& o, const Tensor& x, const AttnShape& sx) {
    if (x.dtype == DType::BF16) {
      if (alibi) forward_hd<__nv_bfloat16, true>(be, o, lse, x, sx, scale);
      else forward_hd<__nv_bfloat16, false>(be, o, lse, x, sx, scale);
    } else {
      if (alibi) forward_hd<__half, true>(be, o, lse, x, sx, scale);
      else forward_hd<__half, false>(be, o, lse, x, sx, scale);
    }
  };
  const int wide = static_cast<int>(attention_padded_head_dim(s.head_dim));
  if (wide == s.head_dim) return run(out, qkv, s);
  const char* op = "attention_forward";
  AttnShape sp = s;
  sp.head_dim = wide;
  const int64_t rows = static_cast<int64_t>(s.B) * s.T;
  PaddedCopy qkv_p(be, qkv.dtype, rows, s.n_heads + 2 * s.n_kv_heads, wide, op);
  PaddedCopy out_p(be, out.dtype, rows, s.n_heads, wide, op);
  repad_heads<true>(be, qkv_p.t, qkv, s.head_dim, wide);
  run(out_p.t, qkv_p.t, sp);
  repad_heads<false>(be, out, out_p.t, s.head_dim, wide);
}

void flash_backward(CudaBackend& be, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                    const float* delta, const AttnShape& s) {
  const bool alibi = !s.alibi_slopes.empty();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  const auto run = [&](const Tensor& dx, const Tensor& dy, const Tensor& x, const AttnShape& sx) {
    if (x.dtype == DType::BF16) {
      if (alibi) backward_hd<__nv_bfloat16, true>(be, dx, dy, x, lse, delta, sx, scale);
      else backward_hd<__nv_bfloat16, false>(be, dx, dy, x, lse, delta, sx, scale);
    } else {
      if (alibi) backward_hd<__half, true>(be, dx, dy, x, lse, delta, sx, scale);
      else backward_hd<__half, false>(be, dx, dy, x, lse, delta, sx, scale);
    }
  };
  const int wide = static_cast<int>(attention_padded_head_dim(s.head_dim));
  if (wide == s.head_dim) return run(dqkv, dout, qkv, s);
  // delta (dO . o per row) is the padded call's: the padded columns of both are zero
  const char* op = "attention_backward";
  AttnShape sp = s;
  sp.head_dim = wide;
  const int64_t rows = static_cast<int64_t>(s.B) * s.T;
  const int qkv_heads = s.n_heads + 2 * s.n_kv_heads;
  PaddedCopy qkv_p(be, qkv.dtype, rows, qkv_heads, wide, op), dqkv_p(be, dqkv.dtype, rows, qkv_heads, wide, op);
  PaddedCopy dout_p(be, dout.dtype, rows, s.n_heads, wide, op);
  repad_heads<true>(be, qkv_p.t, qkv, s.head_dim, wide);
  repad_heads<true>(be, dout_p.t, dout, s.head_dim, wide);
  run(dqkv_p.t, dout_p.t, qkv_p.t, sp);
  repad_heads<false>(be, dqkv, dqkv_p.t, s.head_dim, wide);
}

}  // namespace keel::cuda
