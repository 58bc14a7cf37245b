// Softmax cross-entropy in vocab-parallel pieces (logits [N, V_local] hold vocab columns
// [vocab_start, vocab_start + V_local)):
//   xent_stats     per row: row_max, sumexp = sum_j exp(x_j - row_max), target_logit
//   xent_rescale   sumexp *= exp(local_max - global_max)   (before summing across shards)
//   xent_loss      lse = row_max + log(sumexp); loss = lse - target_logit (0 for ignored rows)
//   xent_backward  in place: x_j <- (exp(x_j - lse) - [j == target]) * dloss (0 for ignored rows)
// xent_stats: one block per row, one pass over the row with an online (max, sum) pair per
// thread, the threads' pairs then combined in a fixed tree (warp butterflies, then the warps'
// pairs): deterministic, and one read of the logits instead of two. A thread keeps kDepth packs
// in flight and takes them in order, updating its maximum once per pack (a new pack maximum
// rescales the sum), so the exponentials of a pack are independent of each other.
// xent_backward: one block per row, elementwise. xent_loss_backward (no vocab parallelism):
// both in one kernel, a block taking rows in turn: the stats pass, the loss, then the gradient
// pass, which finds the row still in L2 because the grid holds only as many rows in flight as
// half the L2 takes (the dlogits are stored evict-first, the second read is a last use), so the
// logits are read from DRAM once instead of twice. It runs the same per-row code as the three
// separate kernels, so its bits are theirs. The row kernels move 16-byte packs of logits
// when the rows allow it. The per-row ops on N values: one thread per row.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

namespace keel {

using cuda::Named;

namespace cuda {
namespace {

constexpr int kThreads = 256;     // the per-row-value kernels (xent_rescale, xent_loss)
constexpr int kRowThreads = 1024;  // one block per row: a row in flight per block
constexpr int kDepth = 4;          // packs a thread has in flight

// Combines two (max, sum of exp(x - max)) pairs. A pair whose max is -inf has seen no value
// above -inf: its sum is 0, or NaN when it saw a NaN (the comparisons skip NaN for the max), and
// is added as it is so that the NaN reaches the row's sum as on the CPU. Symmetric in its two
// pairs (bit for bit), so both lanes of a butterfly get the same pair.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  s = (m == -INFINITY ? s : s * expf(m - mn)) + (m2 == -INFINITY ? s2 : s2 * expf(m2 - mn));
  m = mn;
}

__device__ __forceinline__ void warp_combine(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
}

// The row kernels read packs of W logits (16 bytes when W = kPack<T>: every row 16-byte aligned,
// V a multiple of W): thread i takes the packs starting at i*W, i*W + kRowThreads*W, ...
// One row's max and sum of exp(x - max) over its V logits, returned to every thread of the
// block (kRowThreads of them). The sum is NaN when no value is above -inf (all -inf or NaN):
// the CPU's sum then holds exp(-inf - -inf) = NaN terms.
template <class T, int W>
__device__ __forceinline__ void block_row_stats(const T* x, int64_t V, float& row_max, float& row_sum) {
  __shared__ float wm[kRowThreads / 32], ws[kRowThreads / 32];
  float m = -INFINITY, s = 0.0f;
  // One pack into (m, s). fmaxf skips NaN, so m is the largest non-NaN value seen (-inf while
  // there is none). Rescaling from m = -inf multiplies by exp(-inf) = 0 (a NaN sum stays NaN).
  // -inf logits add nothing; a NaN adds NaN, and a +inf adds exp(inf - inf) = NaN, as on the CPU.
  const auto take = [&](const float (&xv)[W]) {
    float pm = -INFINITY;
#pragma unroll
    for (int k = 0; k < W; ++k) pm = fmaxf(pm, xv[k]);
    if (pm > m) {
      s *= expf(m - pm);
      m = pm;
    }
#pragma unroll
    for (int k = 0; k < W; ++k) s += xv[k] == -INFINITY ? 0.0f : expf(xv[k] - m);
  };
  constexpr int64_t kStride = static_cast<int64_t>(kRowThreads) * W;
  int64_t j = threadIdx.x * W;
  for (; j + (kDepth - 1) * kStride < V; j += kDepth * kStride) {
    float a[kDepth][W];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) load_pack<W>(a[d], x + j + d * kStride);
#pragma unroll
    for (int d = 0; d < kDepth; ++d) take(a[d]);
  }
  for (; j < V; j += kStride) {
    float a[W];
    load_pack<W>(a, x + j);
    take(a);
  }
  // Each warp's pair, then the warps' pairs, every warp combining them the same way.
  warp_combine(m, s);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    wm[warp] = m;
    ws[warp] = s;
  }
  __syncthreads();
  m = lane < kRowThreads / 32 ? wm[lane] : -INFINITY;
  s = lane < kRowThreads / 32 ? ws[lane] : 0.0f;
  warp_combine(m, s);
  __syncthreads();  // every warp has read wm and ws: the block's next row may write them
  row_max = m;
  row_sum = (m == -INFINITY && V > 0) ? __int_as_float(0x7fc00000) : s;
}

// x_j <- (exp(x_j - l) - [j == local]) * dloss over one row (l = its lse), or 0 for an
// ignored row (t < 0). kLastUse: the row's last read (evict-first loads and stores: the
// gradient goes to the matmuls in chunks far beyond L2).
template <class T, int W, bool kLastUse>
__device__ __forceinline__ void block_row_backward(T* x, int64_t V, int32_t t, int64_t local, float l, float dloss) {
  const auto grad = [&](float (&p)[W], int64_t j) {
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (t < 0) {  // ignored row: zero gradient
        p[k] = 0.0f;
        continue;
      }
      float q = expf(p[k] - l);
      if (j + k == local) q -= 1.0f;
      p[k] = q * dloss;
    }
  };
  constexpr int64_t kStride = static_cast<int64_t>(kRowThreads) * W;
  int64_t j = threadIdx.x * W;
  for (; j + (kDepth - 1) * kStride < V; j += kDepth * kStride) {
    float a[kDepth][W];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) load_pack<W, kLastUse>(a[d], x + j + d * kStride);
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      grad(a[d], j + d * kStride);
      store_pack<W, kLastUse>(x + j + d * kStride, a[d]);
    }
  }
  for (; j < V; j += kStride) {
    float a[W];
    load_pack<W, kLastUse>(a, x + j);
    grad(a, j);
    store_pack<W, kLastUse>(x + j, a);
  }
}

template <class T, int W>
__global__ void __launch_bounds__(kRowThreads)
    xent_stats_kernel(float* __restrict__ row_max, float* __restrict__ sumexp, float* __restrict__ target_logit,
                      const T* __restrict__ logits, const int32_t* __restrict__ targets, int64_t V,
                      int64_t vocab_start) {
  const int64_t n = blockIdx.x;
  const T* x = logits + n * V;
  float m, s;
  block_row_stats<T, W>(x, V, m, s);
  if (threadIdx.x == 0) {
    const int32_t t = targets[n];
    const int64_t local = static_cast<int64_t>(t) - vocab_start;
    row_max[n] = m;
    sumexp[n] = s;
    target_logit[n] = (t >= 0 && local >= 0 && local < V) ? to_f32(x[local]) : 0.0f;
  }
}

__global__ void xent_rescale_kernel(float* sumexp, const float* local_max, const float* global_max, int64_t N) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n < N) sumexp[n] *= expf(local_max[n] - global_max[n]);
}

__global__ void xent_loss_kernel(void* losses, DType loss_dt, float* lse, const float* row_max, const float* sumexp,
                                 const float* target_logit, const int32_t* targets, int64_t N) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const float l = row_max[n] + logf(sumexp[n]);
  lse[n] = l;
  store_any(losses, loss_dt, n, targets[n] < 0 ? 0.0f : l - target_logit[n]);
}

template <class T, int W>
__global__ void __launch_bounds__(kRowThreads)
    xent_backward_kernel(T* logits, const float* __restrict__ lse, const int32_t* __restrict__ targets, float dloss,
                         int64_t V, int64_t vocab_start) {
  const int64_t n = blockIdx.x;
  const int32_t t = targets[n];
  block_row_backward<T, W, false>(logits + n * V, V, t, static_cast<int64_t>(t) - vocab_start, t < 0 ? 0.0f : lse[n],
                                  dloss);
}

// xent_stats, xent_loss and xent_backward of rows blockIdx.x, blockIdx.x + gridDim.x, ...
// (the whole vocabulary local), with the arithmetic of those kernels.
template <class T, int W>
__global__ void __launch_bounds__(kRowThreads)
    xent_loss_backward_kernel(void* losses, DType loss_dt, float* __restrict__ lse, float* __restrict__ row_max,
                              float* __restrict__ sumexp, float* __restrict__ target_logit, T* logits,
                              const int32_t* __restrict__ targets, float dloss, int64_t N, int64_t V) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    T* x = logits + n * V;
    const int32_t t = targets[n];
    // The target's logit, read before the stats' barriers (the gradient pass overwrites it).
    const float tl = threadIdx.x == 0 && t >= 0 && t < V ? to_f32(x[t]) : 0.0f;
    float m, s;
    block_row_stats<T, W>(x, V, m, s);
    const float l = m + logf(s);
    if (threadIdx.x == 0) {
      row_max[n] = m;
      sumexp[n] = s;
      target_logit[n] = tl;
      lse[n] = l;
      store_any(losses, loss_dt, n, t < 0 ? 0.0f : l - tl);
    }
    block_row_backward<T, W, true>(x, V, t, t, t < 0 ? 0.0f : l, dloss);
  }
}

// Every per-row tensor must hold N values; returns N.
int64_t check_rows(const char* op, const Tensor& targets, std::initializer_list<Named> per_row) {
  check_dtype(op, {"targets", targets}, DType::I32);
  const int64_t N = targets.numel();
  for (const Named& t : per_row)
    if (t.t.numel() != N) fail(op, std::string(t.name) + " must have one value per target", {t, {"targets", targets}});
  return N;
}

// xent_loss's per-row tensors: losses (any float dtype), the fp32 statistics, one value per
// target each; returns N.
int64_t check_loss_rows(const char* op, const Tensor& losses, const Tensor& lse, const Tensor& row_max,
                        const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets) {
  check_float(op, {"losses", losses});
  for (Named t : {Named{"lse", lse}, Named{"row_max", row_max}, Named{"sumexp", sumexp},
                  Named{"target_logit", target_logit}})
    check_dtype(op, t, DType::F32);
  return check_rows(op, targets, {{"losses", losses}, {"lse", lse}, {"row_max", row_max}, {"sumexp", sumexp},
                                  {"target_logit", target_logit}});
}

// logits must hold one row per target (N rows, at most 2^31: one block per row).
void check_logits(const char* op, const Tensor& logits, const Tensor& targets, int64_t N) {
  if (rows(logits) != N) fail(op, "logits must have one row per target", {{"logits", logits}, {"targets", targets}});
  if (N > 0x7fffffff) fail(op, "more than 2^31 rows", {{"logits", logits}});
}

// The row kernels read 16-byte packs when every row starts 16-byte aligned.
template <class T>
bool rows_packed(const Tensor& logits) {
  return logits.cols() % kPack<T> == 0 && aligned16({logits.data});
}

}  // namespace
}  // namespace cuda

void CudaBackend::xent_stats(const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit,
                             const Tensor& logits, const Tensor& targets, int64_t vocab_start) {
  const char* op = "xent_stats";
  cuda::check_float(op, {"logits", logits});
  for (Named t : {Named{"row_max", row_max}, Named{"sumexp", sumexp}, Named{"target_logit", target_logit}})
    cuda::check_dtype(op, t, DType::F32);
  const int64_t N =
      cuda::check_rows(op, targets, {{"row_max", row_max}, {"sumexp", sumexp}, {"target_logit", target_logit}});
  cuda::check_logits(op, logits, targets, N);
  if (N == 0) return;
  const int64_t V = logits.cols();
  KEEL_DISPATCH_FLOAT(logits.dtype, op, T, {
    cuda::with_pack_width<T>(cuda::rows_packed<T>(logits), [&](auto w) {
      cuda::xent_stats_kernel<T, decltype(w)::value><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream_>>>(
          row_max.as<float>(), sumexp.as<float>(), target_logit.as<float>(), logits.as<const T>(),
          targets.as<const int32_t>(), V, vocab_start);
    });
  });
  cuda::check_launch(*this, op, {{"logits", logits}, {"targets", targets}});
}

void CudaBackend::xent_rescale(const Tensor& sumexp, const Tensor& local_max, const Tensor& global_max) {
  const char* op = "xent_rescale";
  for (Named t : {Named{"sumexp", sumexp}, Named{"local_max", local_max}, Named{"global_max", global_max}})
    cuda::check_dtype(op, t, DType::F32);
  const int64_t N = sumexp.numel();
  if (local_max.numel() != N || global_max.numel() != N)
    cuda::fail(op, "all three need one value per row",
               {{"sumexp", sumexp}, {"local_max", local_max}, {"global_max", global_max}});
  if (N == 0) return;
  cuda::xent_rescale_kernel<<<static_cast<unsigned>(cuda::ceil_div(N, cuda::kThreads)), cuda::kThreads, 0, stream_>>>(
      sumexp.as<float>(), local_max.as<const float>(), global_max.as<const float>(), N);
  cuda::check_launch(*this, op, {{"sumexp", sumexp}});
}

void CudaBackend::xent_loss(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                            const Tensor& target_logit, const Tensor& targets) {
  const char* op = "xent_loss";
  const int64_t N = cuda::check_loss_rows(op, losses, lse, row_max, sumexp, target_logit, targets);
  if (N == 0) return;
  cuda::xent_loss_kernel<<<static_cast<unsigned>(cuda::ceil_div(N, cuda::kThreads)), cuda::kThreads, 0, stream_>>>(
      losses.data, losses.dtype, lse.as<float>(), row_max.as<const float>(), sumexp.as<const float>(),
      target_logit.as<const float>(), targets.as<const int32_t>(), N);
  cuda::check_launch(*this, op, {{"losses", losses}, {"targets", targets}});
}

void CudaBackend::xent_backward(const Tensor& logits, const Tensor& lse, const Tensor& targets, float dloss,
                                int64_t vocab_start) {
  const char* op = "xent_backward";
  cuda::check_float(op, {"logits", logits});
  cuda::check_dtype(op, {"lse", lse}, DType::F32);
  const int64_t N = cuda::check_rows(op, targets, {{"lse", lse}});
  cuda::check_logits(op, logits, targets, N);
  if (N == 0) return;
  const int64_t V = logits.cols();
  KEEL_DISPATCH_FLOAT(logits.dtype, op, T, {
    cuda::with_pack_width<T>(cuda::rows_packed<T>(logits), [&](auto w) {
      cuda::xent_backward_kernel<T, decltype(w)::value><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream_>>>(
          logits.as<T>(), lse.as<const float>(), targets.as<const int32_t>(), dloss, V, vocab_start);
    });
  });
  cuda::check_launch(*this, op, {{"logits", logits}, {"targets", targets}});
}

void CudaBackend::xent_loss_backward(const Tensor& losses, const Tensor& lse, const Tensor& row_max,
                                     const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits,
                                     const Tensor& targets, float dloss) {
  if (!xent_fused_) {
    Backend::xent_loss_backward(losses, lse, row_max, sumexp, target_logit, logits, targets, dloss);
    return;
  }
  const char* op = "xent_loss_backward";
  cuda::check_float(op, {"logits", logits});
  const int64_t N = cuda::check_loss_rows(op, losses, lse, row_max, sumexp, target_logit, targets);
  cuda::check_logits(op, logits, targets, N);
  if (N == 0) return;
  const int64_t V = logits.cols();
  // Rows in flight: as many as half the L2 holds (a row's second read should find it there),
  // at most one per SM (a block of kRowThreads at up to 64 registers fills an SM's register
  // file; a second wave would leave SMs idle), at least one.
  const int64_t row_bytes = std::max<int64_t>(1, V * static_cast<int64_t>(dtype_size(logits.dtype)));
  const int64_t in_flight = std::clamp<int64_t>(static_cast<int64_t>(l2_bytes_ / 2) / row_bytes, 1, sm_count_);
  const unsigned blocks = static_cast<unsigned>(std::min(N, in_flight));
  KEEL_DISPATCH_FLOAT(logits.dtype, op, T, {
    cuda::with_pack_width<T>(cuda::rows_packed<T>(logits), [&](auto w) {
      cuda::xent_loss_backward_kernel<T, decltype(w)::value><<<blocks, cuda::kRowThreads, 0, stream_>>>(
          losses.data, losses.dtype, lse.as<float>(), row_max.as<float>(), sumexp.as<float>(),
          target_logit.as<float>(), logits.as<T>(), targets.as<const int32_t>(), dloss, N, V);
    });
  });
  cuda::check_launch(*this, op, {{"logits", logits}, {"targets", targets}});
}

}  // namespace keel
