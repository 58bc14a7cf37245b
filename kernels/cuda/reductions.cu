// Whole-tensor reductions: sum, sum_squares (fp64), max_abs (NaN propagating), count_nonfinite,
// count_zeros, and grad_stats (the last three in one pass).
//
// Two deterministic passes. Pass 1: the tensor is cut into fixed chunks of kChunk elements (a
// function of n only, never of the GPU); block c reduces chunk c, each thread its strided
// elements in order, then the block's threads in a fixed tree -> partial[c]. Pass 2: one block
// reduces the partials the same way. Sums are accumulated in double (like the CPU reference,
// which sums 4096-element blocks in double): the two orders differ by a few units of 2^-53
// relative, so results agree with the CPU to ~1e-15 and are bit-identical from run to run.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

namespace keel {

namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;  // elements per pass-1 block
constexpr int kFinalThreads = 1024;

enum class Kind { Sum, SumSquares, MaxAbs, NonFinite, Zeros, GradStats };

template <Kind K>
struct Acc;
template <>
struct Acc<Kind::Sum> {
  using V = double;
  static __device__ V zero() { return 0.0; }
  static __device__ V one(float x) { return static_cast<double>(x); }
  static __device__ V combine(V a, V b) { return a + b; }
};
template <>
struct Acc<Kind::SumSquares> {
  using V = double;
  static __device__ V zero() { return 0.0; }
  static __device__ V one(float x) {
    const double d = x;
    return d * d;
  }
  static __device__ V combine(V a, V b) { return a + b; }
};
// max |x|, NaN if any element is NaN (fmaxf would drop it): NaN is carried explicitly.
template <>
struct Acc<Kind::MaxAbs> {
  using V = float;
  static __device__ V zero() { return 0.0f; }
  static __device__ V one(float x) { return fabsf(x); }
  static __device__ V combine(V a, V b) {
    if (isnan(a) || isnan(b)) return __int_as_float(0x7fc00000);
    return fmaxf(a, b);
  }
};
template <>
struct Acc<Kind::NonFinite> {
  using V = unsigned long long;
  static __device__ V zero() { return 0; }
  static __device__ V one(float x) { return isfinite(x) ? 0ull : 1ull; }
  static __device__ V combine(V a, V b) { return a + b; }
};
template <>
struct Acc<Kind::Zeros> {
  using V = unsigned long long;
  static __device__ V zero() { return 0; }
  static __device__ V one(float x) { return x == 0.0f ? 1ull : 0ull; }
  static __device__ V combine(V a, V b) { return a + b; }
};

// SumSquares, Zeros and NonFinite at once. Each field sees the same operations in the same order
// as its own kind, so the values are those of the three separate reductions, bit for bit.
struct GradStatsV {
  double ss;
  unsigned long long zeros, nonfinite;
};
template <>
struct Acc<Kind::GradStats> {
  using V = GradStatsV;
  static __device__ V zero() { return {0.0, 0, 0}; }
  static __device__ V one(float x) {
    return {Acc<Kind::SumSquares>::one(x), Acc<Kind::Zeros>::one(x), Acc<Kind::NonFinite>::one(x)};
  }
  static __device__ V combine(V a, V b) { return {a.ss + b.ss, a.zeros + b.zeros, a.nonfinite + b.nonfinite}; }
};

// Tree over the block's threads in a fixed pairing (shared memory, halving strides).
template <Kind K, int kN>
__device__ typename Acc<K>::V block_reduce(typename Acc<K>::V v, typename Acc<K>::V* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int stride = kN / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) shared[threadIdx.x] = Acc<K>::combine(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
  return shared[0];
}

// partial[blockIdx.x] = reduction of x[chunk blockIdx.x]
template <Kind K, class T>
__global__ void __launch_bounds__(kThreads) reduce_chunks_kernel(const T* __restrict__ x, int64_t n,
                                                                  typename Acc<K>::V* __restrict__ partial) {
  using V = typename Acc<K>::V;
  __shared__ V shared[kThreads];
  const int64_t begin = blockIdx.x * kChunk;
  const int64_t end = min(n, begin + kChunk);
  V acc = Acc<K>::zero();
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) acc = Acc<K>::combine(acc, Acc<K>::one(to_f32(x[i])));
  const V total = block_reduce<K, kThreads>(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// *result = reduction of partial[0, count)
template <Kind K>
__global__ void __launch_bounds__(kFinalThreads) reduce_partials_kernel(const typename Acc<K>::V* __restrict__ partial,
                                                                        int64_t count, typename Acc<K>::V* result) {
  using V = typename Acc<K>::V;
  __shared__ V shared[kFinalThreads];
  V acc = Acc<K>::zero();
  for (int64_t i = threadIdx.x; i < count; i += kFinalThreads) acc = Acc<K>::combine(acc, partial[i]);
  const V total = block_reduce<K, kFinalThreads>(acc, shared);
  if (threadIdx.x == 0) *result = total;
}

template <Kind K>
typename Acc<K>::V reduce(CudaBackend& be, const char* op, const Tensor& x) {
  using V = typename Acc<K>::V;
  check_float(op, {"x", x});
  const int64_t n = x.numel();
  const int64_t chunks = std::max<int64_t>(1, ceil_div(n, kChunk));
  auto* partial = static_cast<V*>(be.scratch(static_cast<size_t>(chunks + 1) * sizeof(V), op));
  V* result = partial + chunks;
  cudaStream_t stream = be.stream();
  KEEL_DISPATCH_FLOAT(x.dtype, op, T, {
    reduce_chunks_kernel<K, T><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(x.as<const T>(), n, partial);
  });
  reduce_partials_kernel<K><<<1, kFinalThreads, 0, stream>>>(partial, chunks, result);
  check_launch(be, op, {{"x", x}});
  V out{};
  be.read_back(&out, result, sizeof(V), op);
  be.release(partial);
  return out;
}

}  // namespace
}  // namespace cuda

double CudaBackend::sum(const Tensor& x) { return cuda::reduce<cuda::Kind::Sum>(*this, "sum", x); }

double CudaBackend::sum_squares(const Tensor& x) { return cuda::reduce<cuda::Kind::SumSquares>(*this, "sum_squares", x); }

float CudaBackend::max_abs(const Tensor& x) { return cuda::reduce<cuda::Kind::MaxAbs>(*this, "max_abs", x); }

int64_t CudaBackend::count_nonfinite(const Tensor& x) {
  return static_cast<int64_t>(cuda::reduce<cuda::Kind::NonFinite>(*this, "count_nonfinite", x));
}

int64_t CudaBackend::count_zeros(const Tensor& x) {
  return static_cast<int64_t>(cuda::reduce<cuda::Kind::Zeros>(*this, "count_zeros", x));
}

Backend::GradStats CudaBackend::grad_stats(const Tensor& x) {
  const cuda::GradStatsV v = cuda::reduce<cuda::Kind::GradStats>(*this, "grad_stats", x);
  return {v.ss, static_cast<int64_t>(v.zeros), static_cast<int64_t>(v.nonfinite)};
}

}  // namespace keel
