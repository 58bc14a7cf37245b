// matmul and bias_backward.
//
// out[M,N] = op(a)[M,K] @ op(b)[K,N]. Both operands are first packed into fp32 panels:
//   A panel p: Ap[k][r] = op(a)[p*kMR + r][k]   (kMR rows side by side for each k)
//   B panel q: Bp[k][c] = op(b)[k][q*kNR + c]   (kNR columns contiguous for each k)
// A micro-kernel keeps a kMR x kNR block of C in vector registers and walks k in order,
// broadcasting one A value per row and multiplying it into the contiguous B row. The output is
// cut into kMC x kNC tasks (parallel); inside a task k is blocked by kKC so that one B panel
// slice stays in L1 while the A panels stream from L2. Partial sums carry over between k
// blocks in an fp32 tile, so every output element is summed over k = 0, 1, ..., K-1 in order,
// whatever the blocking or thread count.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace keel {

namespace {

#if defined(__AVX512F__)
constexpr int kVec = 16, kMR = 8;  // 16 accumulators of 32 zmm registers
#elif defined(__AVX__)
constexpr int kVec = 8, kMR = 6;  // 12 accumulators of 16 ymm registers
#else
constexpr int kVec = 4, kMR = 4;
#endif
constexpr int kNV = 2;                // vectors per micro-tile row
constexpr int64_t kNR = kVec * kNV;   // micro-tile columns
constexpr int64_t kKC = 256;          // k block: a kKC x kNR B slice is 32 KiB with AVX-512
constexpr int64_t kMC = kMR * 16;     // task rows
constexpr int64_t kNC = kNR * 8;      // task columns

typedef float VecF __attribute__((vector_size(kVec * sizeof(float))));

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_vec(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }

// c[kMR][kNR] (row stride ldc) = (first ? 0 : c) + sum over k in order of ap[k][r] * bp[k][col].
inline void micro_kernel(int64_t kc, const float* __restrict ap, const float* __restrict bp, float* __restrict c,
                         int64_t ldc, bool first) {
  VecF acc[kMR][kNV];
#pragma GCC unroll 16
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) acc[r][v] = first ? VecF{} : load_vec(c + r * ldc + v * kVec);
  for (int64_t k = 0; k < kc; ++k) {
    VecF b[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) b[v] = load_vec(bp + k * kNR + v * kVec);
#pragma GCC unroll 16
    for (int r = 0; r < kMR; ++r) {
      float a = ap[k * kMR + r];
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) store_vec(c + r * ldc + v * kVec, acc[r][v]);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Both packers are worksharing loops without a barrier, called inside the matmul's parallel region.
template <class Src>
void pack_a(Src a, bool trans, int64_t M, int64_t K, float* packed) {
#pragma omp for schedule(static) nowait
  for (int64_t p = 0; p < ceil_div(M, kMR); ++p) {
    float* dst = packed + p * K * kMR;
    int64_t i0 = p * kMR;
    int64_t rows = std::min<int64_t>(kMR, M - i0);
    if (trans) {  // a stored [K, M]: row k holds op(a)[., k] contiguously
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < kMR; ++r) dst[k * kMR + r] = r < rows ? a[k * M + i0 + r] : 0.0f;
    } else {  // a stored [M, K]
      for (int64_t r = 0; r < kMR; ++r)
        for (int64_t k = 0; k < K; ++k) dst[k * kMR + r] = r < rows ? a[(i0 + r) * K + k] : 0.0f;
    }
  }
}

template <class Src>
void pack_b(Src b, bool trans, int64_t K, int64_t N, float* packed) {
#pragma omp for schedule(static) nowait
  for (int64_t q = 0; q < ceil_div(N, kNR); ++q) {
    float* dst = packed + q * K * kNR;
    int64_t j0 = q * kNR;
    int64_t cols = std::min<int64_t>(kNR, N - j0);
    if (trans) {  // b stored [N, K]
      for (int64_t c = 0; c < kNR; ++c)
        for (int64_t k = 0; k < K; ++k) dst[k * kNR + c] = c < cols ? b[(j0 + c) * K + k] : 0.0f;
    } else {  // b stored [K, N]
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < kNR; ++c) dst[k * kNR + c] = c < cols ? b[k * N + j0 + c] : 0.0f;
    }
  }
}

}  // namespace

void CpuBackend::matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                        bool accumulate, const Tensor* bias) {
  const char* op = "matmul";
  cpu::check_float(op, {"out", out});
  cpu::check_float(op, {"a", a});
  cpu::check_float(op, {"b", b});
  // Every tensor is seen as (rows, cols): leading dimensions fold into rows.
  const int64_t M = trans_a ? a.cols() : cpu::rows(a);
  const int64_t K = trans_a ? cpu::rows(a) : a.cols();
  const int64_t Kb = trans_b ? b.cols() : cpu::rows(b);
  const int64_t N = trans_b ? cpu::rows(b) : b.cols();
  auto shapes = [&]() {
    return std::string(" (trans_a=") + (trans_a ? "1" : "0") + ", trans_b=" + (trans_b ? "1" : "0") + ")";
  };
  if (K != Kb) cpu::fail(op, "inner dimensions differ" + shapes(), {{"out", out}, {"a", a}, {"b", b}});
  if (cpu::rows(out) != M || out.cols() != N)
    cpu::fail(op, "out must be [" + std::to_string(M) + ", " + std::to_string(N) + "]" + shapes(),
              {{"out", out}, {"a", a}, {"b", b}});
  std::vector<float> bias_f32;
  if (bias && !bias->empty()) {
    cpu::check_float(op, {"bias", *bias});
    if (bias->numel() != N) cpu::fail(op, "bias must have N elements", {{"out", out}, {"bias", *bias}});
    bias_f32.resize(static_cast<size_t>(N));
    cpu::load_f32(*bias, 0, N, bias_f32.data());
  }
  if (M == 0 || N == 0) return;

  const int64_t m_panels = ceil_div(M, kMR), n_panels = ceil_div(N, kNR);
  float* ap = packed_a_.get(std::max<int64_t>(1, m_panels * kMR * K));
  float* bp = packed_b_.get(std::max<int64_t>(1, n_panels * kNR * K));

  const int64_t m_tasks = ceil_div(M, kMC), n_tasks = ceil_div(N, kNC);
#pragma omp parallel if (M * N * std::max<int64_t>(K, 1) >= 32 * cpu::kMinParallelWork)
  {
    cpu::with_source(a, [&](auto src) { pack_a(src, trans_a, M, K, ap); });
    cpu::with_source(b, [&](auto src) { pack_b(src, trans_b, K, N, bp); });
#pragma omp barrier
    std::vector<float> tile(static_cast<size_t>(kMC * kNC));
    std::vector<float> row(static_cast<size_t>(kNC));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < m_tasks * n_tasks; ++task) {
      const int64_t i0 = (task / n_tasks) * kMC, j0 = (task % n_tasks) * kNC;
      const int64_t rows = std::min(kMC, M - i0), cols = std::min(kNC, N - j0);
      const int64_t row_panels = ceil_div(rows, kMR), col_panels = ceil_div(cols, kNR);
      if (K == 0) std::fill(tile.begin(), tile.end(), 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kKC) {
        const int64_t kc = std::min(kKC, K - k0);
        for (int64_t q = 0; q < col_panels; ++q) {
          const float* bq = bp + (j0 / kNR + q) * K * kNR + k0 * kNR;
          for (int64_t p = 0; p < row_panels; ++p) {
            const float* ap_p = ap + (i0 / kMR + p) * K * kMR + k0 * kMR;
            micro_kernel(kc, ap_p, bq, tile.data() + p * kMR * kNC + q * kNR, kNC, k0 == 0);
          }
        }
      }
      // epilogue: (old out) + product (+ bias), rounded once to out's dtype
      for (int64_t r = 0; r < rows; ++r) {
        const float* t = tile.data() + r * kNC;
        const int64_t offset = (i0 + r) * N + j0;
        if (accumulate) {
          cpu::load_f32(out, offset, cols, row.data());
          for (int64_t c = 0; c < cols; ++c) row[c] += t[c];
        } else {
          std::copy(t, t + cols, row.data());
        }
        if (!bias_f32.empty())
          for (int64_t c = 0; c < cols; ++c) row[c] += bias_f32[j0 + c];
        cpu::store_f32(out, offset, cols, row.data());
      }
    }
  }
}

// dbias[c] += sum over rows of dout[., c]: per block of kRowBlock rows in order, then blocks in order.
void CpuBackend::bias_backward(const Tensor& dbias, const Tensor& dout, bool accumulate) {
  const char* op = "bias_backward";
  cpu::check_dtype(op, {"dbias", dbias}, DType::F32);
  cpu::check_float(op, {"dout", dout});
  const int64_t rows = cpu::rows(dout), N = dout.cols();
  if (dbias.numel() != N) cpu::fail(op, "dbias must have dout.cols() elements", {{"dbias", dbias}, {"dout", dout}});
  const int64_t nblocks = ceil_div(rows, cpu::kRowBlock);
  std::vector<float> partial(static_cast<size_t>(nblocks * N), 0.0f);
#pragma omp parallel if (rows * N >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(N));
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* acc = partial.data() + blk * N;
      for (int64_t n = blk * cpu::kRowBlock; n < std::min(rows, (blk + 1) * cpu::kRowBlock); ++n) {
        const float* x = cpu::read_f32(dout, n * N, N, buf.data());
        for (int64_t c = 0; c < N; ++c) acc[c] += x[c];
      }
    }
  }
  cpu::add_block_partials(dbias.as<float>(), partial.data(), nblocks, N, accumulate);
}

}  // namespace keel
