// Softmax cross-entropy in vocab-parallel pieces (logits [N, V_local] hold vocab columns
// [vocab_start, vocab_start + V_local)):
//   xent_stats     per row: row_max, sumexp = sum_j exp(x_j - row_max), target_logit
//   xent_rescale   sumexp *= exp(local_max - global_max)   (before summing across shards)
//   xent_loss      lse = row_max + log(sumexp); loss = lse - target_logit (0 for ignored rows)
//   xent_backward  in place: x_j <- (exp(x_j - lse) - [j == target]) * dloss (0 for ignored rows)
// xent_stats: one block per row, one pass over the row with an online (max, sum) pair per
// thread, the threads' pairs then combined in a fixed tree: deterministic, and one read of the
// logits instead of two. A thread takes its packs two at a time (both loads in flight before
// either is used) and updates its maximum once per pack (a new pack maximum rescales the sum),
// so the exponentials of a pack are independent of each other. xent_backward: one block per
// row, elementwise. Both move 16-byte packs of logits when the rows allow it. The per-row ops on N values: one thread per row.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

namespace keel {

using cuda::Named;

namespace cuda {
namespace {

constexpr int kThreads = 256;

// Combines two (max, sum of exp(x - max)) pairs. A pair whose max is -inf has seen no value
// above -inf: its sum is 0, or NaN when it saw a NaN (the comparisons skip NaN for the max), and
// is added as it is so that the NaN reaches the row's sum as on the CPU.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  s = (m == -INFINITY ? s : s * expf(m - mn)) + (m2 == -INFINITY ? s2 : s2 * expf(m2 - mn));
  m = mn;
}

// The row kernels read packs of W logits (16 bytes when W = kPack<T>: every row 16-byte aligned,
// V a multiple of W): thread i takes the packs starting at i*W, i*W + kThreads*W, ...
template <class T, int W>
__global__ void __launch_bounds__(kThreads)
    xent_stats_kernel(float* __restrict__ row_max, float* __restrict__ sumexp, float* __restrict__ target_logit,
                      const T* __restrict__ logits, const int32_t* __restrict__ targets, int64_t V,
                      int64_t vocab_start) {
  __shared__ float sm[kThreads], ss[kThreads];
  const int64_t n = blockIdx.x;
  const T* x = logits + n * V;
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
  constexpr int64_t kStride = static_cast<int64_t>(kThreads) * W;
  int64_t j = threadIdx.x * W;
  for (; j + kStride < V; j += 2 * kStride) {
    float a[W], b[W];
    load_pack<W>(a, x + j);
    load_pack<W>(b, x + j + kStride);
    take(a);
    take(b);
  }
  if (j < V) {
    float a[W];
    load_pack<W>(a, x + j);
    take(a);
  }
  sm[threadIdx.x] = m;
  ss[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      float a = sm[threadIdx.x], b = ss[threadIdx.x];
      combine(a, b, sm[threadIdx.x + stride], ss[threadIdx.x + stride]);
      sm[threadIdx.x] = a;
      ss[threadIdx.x] = b;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int32_t t = targets[n];
    const int64_t local = static_cast<int64_t>(t) - vocab_start;
    row_max[n] = sm[0];
    // No value above -inf (all -inf or NaN): the CPU's sum holds exp(-inf - -inf) = NaN terms.
    sumexp[n] = (sm[0] == -INFINITY && V > 0) ? __int_as_float(0x7fc00000) : ss[0];
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
__global__ void __launch_bounds__(kThreads)
    xent_backward_kernel(T* logits, const float* __restrict__ lse, const int32_t* __restrict__ targets, float dloss,
                         int64_t V, int64_t vocab_start) {
  const int64_t n = blockIdx.x;
  T* x = logits + n * V;
  const int32_t t = targets[n];
  const float l = t < 0 ? 0.0f : lse[n];
  const int64_t local = static_cast<int64_t>(t) - vocab_start;
  for (int64_t j = threadIdx.x * W; j < V; j += kThreads * W) {
    float p[W];
    load_pack<W>(p, x + j);
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
    store_pack<W>(x + j, p);
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
      cuda::xent_stats_kernel<T, decltype(w)::value><<<static_cast<unsigned>(N), cuda::kThreads, 0, stream_>>>(
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
  cuda::xent_rescale_kernel<<<static_cast<unsigned>(cuda::ceil_div(N, 256)), 256, 0, stream_>>>(
      sumexp.as<float>(), local_max.as<const float>(), global_max.as<const float>(), N);
  cuda::check_launch(*this, op, {{"sumexp", sumexp}});
}

void CudaBackend::xent_loss(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                            const Tensor& target_logit, const Tensor& targets) {
  const char* op = "xent_loss";
  cuda::check_float(op, {"losses", losses});
  for (Named t : {Named{"lse", lse}, Named{"row_max", row_max}, Named{"sumexp", sumexp},
                  Named{"target_logit", target_logit}})
    cuda::check_dtype(op, t, DType::F32);
  const int64_t N = cuda::check_rows(op, targets, {{"losses", losses}, {"lse", lse}, {"row_max", row_max},
                                                   {"sumexp", sumexp}, {"target_logit", target_logit}});
  if (N == 0) return;
  cuda::xent_loss_kernel<<<static_cast<unsigned>(cuda::ceil_div(N, 256)), 256, 0, stream_>>>(
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
      cuda::xent_backward_kernel<T, decltype(w)::value><<<static_cast<unsigned>(N), cuda::kThreads, 0, stream_>>>(
          logits.as<T>(), lse.as<const float>(), targets.as<const int32_t>(), dloss, V, vocab_start);
    });
  });
  cuda::check_launch(*this, op, {{"logits", logits}, {"targets", targets}});
}

}  // namespace keel
