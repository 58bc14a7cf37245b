// LayerNorm and RMSNorm over the last dimension, and bias_backward.
//
// Forward, per row x of C values (one warp per row; the lanes take 16-byte packs of columns,
// pack lane, lane+32, ..., or single columns when a row is not 16-byte aligned; the sums are
// butterfly reductions over the warp, so fixed):
//   LayerNorm: mean = sum(x)/C, var = sum((x-mean)^2)/C (two passes), rstd = 1/sqrt(var+eps),
//              y = (x-mean)*rstd*w + b
//   RMSNorm:   rstd = 1/sqrt(sum(x^2)/C + eps), y = x*rstd*w
// Backward with xhat = normalised x and g = dy*w (one warp per row):
//   LayerNorm: dx = rstd * (g - mean(g) - xhat*mean(g*xhat))
//   RMSNorm:   dx = rstd * (g - xhat*mean(g*xhat))
//   (dx is added to din when accumulating: the residual stream's gradient)
// Parameter gradients dw = sum_rows dy*xhat, db = sum_rows dy (and bias_backward's
// dbias = sum_rows dout), each stored or added to the gradient, are column sums over all rows,
// done without atomics in two passes:
//   1. column_partials: block (column group of 32, row blocks of kRowBlock rows); thread (c, ty)
//      sums rows ty, ty+8, ... of its row block in order; the 8 partials of a column are added
//      in ty order -> partial[row block][c];
//   2. column_finish: dst[c] = (or +=) the sum over row blocks of partial[rb][c], in 16
//      interleaved strands (rb = ty mod 16, each in order) added in strand order.
// Both orders depend on the shapes only. Where a row block's partials of every column fit in
// shared memory (C up to kFusedMaxC), the norms' backwards do pass 1 inside their dx kernel
// (norm_backward_fused_kernel: warp ty takes rows ty, ty+8, ... of a row block, the order of
// pass 1, so the same partials), reading dy and x from DRAM once. Wider rows run pass 1 and the
// dx kernel alternately over chunks of rows (whole row blocks, about 16 MB of dy and x:
// column_sums), so the dx kernel reads the chunk from L2; that changes no partial either.
#include <cmath>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"

namespace keel {

using cuda::Named;

namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 8;  // rows per block in the row kernels
// Rows per partial sum of the column reductions. 32 gives the fused norm backward of a 1B Llama
// ([8192, 2048]) 256 blocks, two per SM of an H100; 64 gave it 128 blocks for 132 SMs, and it ran
// at 12.6% occupancy, 73 us against a DRAM floor of 33 (session 25).
constexpr int kRowBlock = 32;
constexpr int kColGroup = 32;  // columns per column-reduction block (one per lane)
constexpr int kRowLanes = 8;   // threads along rows in a column-reduction block

// Blocks of the row kernels for N rows (one warp per row).
unsigned row_blocks(int64_t N) { return static_cast<unsigned>(std::max<int64_t>(1, ceil_div(N, kWarpsPerBlock))); }

// Row kernels: lane l takes the packs of V columns starting at l*V, l*V + 32V, ... (V =
// kPack<T> when C is a multiple of it and every pointer is 16-byte aligned, else 1).
template <class T, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layernorm_forward_kernel(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                             const T* __restrict__ in, const T* __restrict__ weight, const T* __restrict__ bias,
                             int64_t N, int C, float eps) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = in + row * C;
  float s = 0;
  for (int c = lane * V; c < C; c += 32 * V) {
    float xv[V];
    load_pack<V>(xv, x + c);
#pragma unroll
    for (int k = 0; k < V; ++k) s += xv[k];
  }
  const float mu = warp_sum(s) / static_cast<float>(C);
  float v = 0;
  for (int c = lane * V; c < C; c += 32 * V) {
    float xv[V];
    load_pack<V>(xv, x + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float d = xv[k] - mu;
      v += d * d;
    }
  }
  const float var = warp_sum(v) / static_cast<float>(C);
  const float rs = 1.0f / sqrtf(var + eps);
  T* y = out + row * C;
  for (int c = lane * V; c < C; c += 32 * V) {
    float xv[V], w[V], b[V];
    load_pack<V>(xv, x + c);
    load_pack<V>(w, weight + c);
    if (bias) load_pack<V>(b, bias + c);
#pragma unroll
    for (int k = 0; k < V; ++k) xv[k] = (xv[k] - mu) * rs * w[k] + (bias ? b[k] : 0.0f);
    store_pack<V>(y + c, xv);
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

template <class T, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    rmsnorm_forward_kernel(T* __restrict__ out, float* __restrict__ rstd, const T* __restrict__ in,
                           const T* __restrict__ weight, int64_t N, int C, float eps) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = in + row * C;
  float s = 0;
  for (int c = lane * V; c < C; c += 32 * V) {
    float xv[V];
    load_pack<V>(xv, x + c);
#pragma unroll
    for (int k = 0; k < V; ++k) s += xv[k] * xv[k];
  }
  const float rs = 1.0f / sqrtf(warp_sum(s) / static_cast<float>(C) + eps);
  T* y = out + row * C;
  for (int c = lane * V; c < C; c += 32 * V) {
    float xv[V], w[V];
    load_pack<V>(xv, x + c);
    load_pack<V>(w, weight + c);
#pragma unroll
    for (int k = 0; k < V; ++k) xv[k] = xv[k] * rs * w[k];
    store_pack<V>(y + c, xv);
  }
  if (lane == 0) rstd[row] = rs;
}

// Sums per warp of norm_backward_fused_kernel: C rounded up to whole passes of the warp (32
// lanes x V columns).
template <int V>
__host__ __device__ constexpr int64_t fused_width(int64_t C) {
  return (C + 32 * V - 1) / (32 * V) * (32 * V);
}
// Where column c's sum sits in a warp's row of them: c = 32V j + V lane + k (pass j, lane,
// element k of the lane's pack) at word (j V + k) 32 + lane. A lane's V columns of a pack are
// then V words of one bank, not V banks shared with every fourth lane (an 8-way conflict on each
// add at V 8).
template <int V>
__device__ __forceinline__ int fused_slot(int c) {
  const int j = c / (32 * V), r = c % (32 * V);
  return (j * V + r % V) * 32 + r / V;
}

// dx of one row by one warp; kLayerNorm selects the mean(g) term and the centring by mean.
// kSums: also add the row's dy*xhat (and dy: LayerNorm) into the warp's sums sw (sb) at
// fused_slot, as column_partials_kernel forms them (g * ((x - mean) * rstd), or g * (x * rstd)).
// The row's dy is read before its dx is written: din may be dout.
template <class T, bool kLayerNorm, int V, bool kSums>
__device__ __forceinline__ void norm_backward_row(T* din, const T* dout, const T* __restrict__ in,
                                                  const T* __restrict__ weight, const float* __restrict__ mean,
                                                  const float* __restrict__ rstd, int64_t row, int C, bool accumulate,
                                                  float* sw, float* sb) {
  const int lane = threadIdx.x % 32;
  const T* x = in + row * C;
  const T* dy = dout + row * C;
  const float mu = kLayerNorm ? mean[row] : 0.0f;
  const float rs = rstd[row];
  float sg = 0, sgx = 0;
  for (int c = lane * V; c < C; c += 32 * V) {
    float xv[V], g[V], w[V];
    load_pack<V>(xv, x + c);
    load_pack<V>(g, dy + c);
    load_pack<V>(w, weight + c);
    const int slot0 = c / (32 * V) * V * 32 + lane;  // fused_slot(c + k) = slot0 + 32 k
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = (xv[k] - mu) * rs;
      const float gk = g[k] * w[k];
      sg += gk;
      sgx += gk * xhat;
      if constexpr (kSums) {
        sw[slot0 + 32 * k] += g[k] * xhat;
        if (kLayerNorm) sb[slot0 + 32 * k] += g[k];
      }
    }
  }
  const float mean_g = kLayerNorm ? warp_sum(sg) / static_cast<float>(C) : 0.0f;
  const float mean_gx = warp_sum(sgx) / static_cast<float>(C);
  T* dx = din + row * C;
  for (int c = lane * V; c < C; c += 32 * V) {
    float xv[V], g[V], w[V], prev[V];
    load_pack<V>(xv, x + c);
    load_pack<V>(g, dy + c);
    load_pack<V>(w, weight + c);
    if (accumulate) load_pack<V>(prev, dx + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = (xv[k] - mu) * rs;
      float d = rs * (g[k] * w[k] - mean_g - xhat * mean_gx);
      if (accumulate) d += prev[k];
      xv[k] = d;
    }
    store_pack<V>(dx + c, xv);
  }
}

// dx of one row per warp.
template <class T, bool kLayerNorm, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    norm_backward_dx_kernel(T* din, const T* dout, const T* __restrict__ in, const T* __restrict__ weight,
                            const float* __restrict__ mean, const float* __restrict__ rstd, int64_t N, int C,
                            bool accumulate) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= N) return;
  norm_backward_row<T, kLayerNorm, V, false>(din, dout, in, weight, mean, rstd, row, C, accumulate, nullptr,
                                             nullptr);
}

// dx as norm_backward_dx_kernel, and pass 1 of the parameter gradients' column sums, in one
// kernel: block = row block rb of kRowBlock rows, warp w = its rows w, w + 8, ... (the rows
// thread (c, ty = w) sums in column_partials_kernel, in the same order, so the partials are its
// bits). Each warp adds dy*xhat (and dy: LayerNorm) of its rows into its own shared-memory row of
// sums while it reads them for dx; then thread c adds the 8 rows of sums in order into
// partial[rb][c]. Dynamic shared memory: (1 + kLayerNorm) * 8 * fused_width(C) floats.
static_assert(kWarpsPerBlock == kRowLanes && kRowBlock % kWarpsPerBlock == 0,
              "the fused norm backward's warps are column_partials' row lanes");
constexpr int64_t kFusedMaxC = 3072;  // RMSNorm: 96 KiB of sums; LayerNorm takes half the width
template <class T, bool kLayerNorm, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    norm_backward_fused_kernel(T* din, const T* dout, const T* __restrict__ in, const T* __restrict__ weight,
                               const float* __restrict__ mean, const float* __restrict__ rstd, int64_t N, int C,
                               bool accumulate, float* __restrict__ partial_w, float* __restrict__ partial_b) {
  KEEL_DYNAMIC_SHARED(smem_raw);
  float* sums = reinterpret_cast<float*>(smem_raw);  // [kLayerNorm + 1][8 warps][W]: dy*xhat, then dy
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = static_cast<int>(fused_width<V>(C));
  float* sw = sums + static_cast<int64_t>(warp) * W;
  float* sb = kLayerNorm ? sums + static_cast<int64_t>(kWarpsPerBlock + warp) * W : nullptr;
  for (int i = lane; i < W; i += 32) {
    sw[i] = 0.0f;
    if (kLayerNorm) sb[i] = 0.0f;
  }
  __syncwarp();
  const int64_t rb = blockIdx.x, r0 = rb * kRowBlock;
  for (int64_t row = r0 + warp; row < min(N, r0 + kRowBlock); row += kWarpsPerBlock)
    norm_backward_row<T, kLayerNorm, V, true>(din, dout, in, weight, mean, rstd, row, C, accumulate, sw, sb);
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += kWarpsPerBlock * 32) {
    const int slot = fused_slot<V>(c);
    float w = sums[slot], b = kLayerNorm ? sums[kWarpsPerBlock * W + slot] : 0.0f;
#pragma unroll
    for (int k = 1; k < kWarpsPerBlock; ++k) {
      w += sums[k * W + slot];
      if (kLayerNorm) b += sums[(kWarpsPerBlock + k) * W + slot];
    }
    partial_w[rb * C + c] = w;
    if (kLayerNorm) partial_b[rb * C + c] = b;
  }
}

enum class ColMode { Sum, LayerNorm, RmsNorm };

// Pass 1 of the column sums (see the file comment). kMode Sum: partial_w = sum dy.
// LayerNorm: partial_w = sum dy*xhat, partial_b = sum dy. RmsNorm: partial_w = sum dy*xhat.
template <class T, ColMode kMode>
__global__ void __launch_bounds__(kColGroup * kRowLanes)
    column_partials_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                           const float* __restrict__ rstd, int64_t N, int64_t C, float* __restrict__ partial_w,
                           float* __restrict__ partial_b) {
  __shared__ float sw[kRowLanes][kColGroup];
  __shared__ float sb[kRowLanes][kColGroup];
  const int tx = threadIdx.x % kColGroup, ty = threadIdx.x / kColGroup;
  // Column groups along x (2^31 - 1 blocks), row blocks along y (at most 65535 blocks: a
  // block strides over the row blocks; each row block's partial is the same whatever the grid).
  const int64_t c = blockIdx.x * static_cast<int64_t>(kColGroup) + tx;
  const int64_t row_blocks = (N + kRowBlock - 1) / kRowBlock;
  for (int64_t rb = blockIdx.y; rb < row_blocks; rb += gridDim.y) {
    const int64_t r0 = rb * kRowBlock, r1 = min(N, r0 + kRowBlock);
    float aw = 0, ab = 0;
    if (c < C) {
      for (int64_t r = r0 + ty; r < r1; r += kRowLanes) {
        const float g = to_f32(dy[r * C + c]);
        if constexpr (kMode == ColMode::Sum) {
          aw += g;
        } else if constexpr (kMode == ColMode::LayerNorm) {
          aw += g * ((to_f32(x[r * C + c]) - mean[r]) * rstd[r]);
          ab += g;
        } else {
          aw += g * (to_f32(x[r * C + c]) * rstd[r]);
        }
      }
    }
    __syncthreads();  // the previous row block's partials have been read
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && c < C) {
      float w = sw[0][tx], b = sb[0][tx];
#pragma unroll
      for (int k = 1; k < kRowLanes; ++k) {
        w += sw[k][tx];
        b += sb[k][tx];
      }
      partial_w[rb * C + c] = w;
      if (kMode == ColMode::LayerNorm) partial_b[rb * C + c] = b;
    }
  }
}

// Pass 2: dst[c] = the sum of partial[rb][c] over the row blocks (+= when accumulating).
// Block (column group of 32, kFinishLanes lanes along the row blocks): thread (c, ty) sums
// rb = ty, ty + kFinishLanes, ... in order (coalesced across c), and the kFinishLanes sums of a
// column are added in ty order.
// The order depends on the shapes only. (One thread per column summing all row blocks serially
// took tens of microseconds per call: 512 dependent L2 loads at GPT-2's 32K rows.)
constexpr int kFinishLanes = 16;
__global__ void __launch_bounds__(kColGroup * kFinishLanes)
    column_finish_kernel(float* __restrict__ dst, const float* __restrict__ partial, int64_t blocks, int64_t C,
                         bool accumulate) {
  __shared__ float part[kFinishLanes][kColGroup];
  const int tx = threadIdx.x % kColGroup, ty = threadIdx.x / kColGroup;
  const int64_t c = blockIdx.x * static_cast<int64_t>(kColGroup) + tx;
  float s = 0;
  if (c < C) {
#pragma unroll 4
    for (int64_t rb = ty; rb < blocks; rb += kFinishLanes) s += partial[rb * C + c];
  }
  part[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < C) {
    float total = part[0][tx];
#pragma unroll
    for (int k = 1; k < kFinishLanes; ++k) total += part[k][tx];
    dst[c] = accumulate ? dst[c] + total : total;
  }
}

// Pass 2 into dw (and db, from partial_b) over `blocks` row blocks of partials, then the
// partials' scratch (partial, which partial_b lies in) goes back.
void finish_columns(CudaBackend& be, float* partial, float* partial_b, int64_t blocks, int64_t C, float* dw,
                    float* db, bool accumulate) {
  const unsigned fin = static_cast<unsigned>(ceil_div(C, kColGroup));
  column_finish_kernel<<<fin, kColGroup * kFinishLanes, 0, be.stream()>>>(dw, partial, blocks, C, accumulate);
  if (db) column_finish_kernel<<<fin, kColGroup * kFinishLanes, 0, be.stream()>>>(db, partial_b, blocks, C, accumulate);
  be.release(partial);
}

// Rows per chunk of a norm backward (a multiple of kRowBlock): the chunk's dy and x, about
// kL2ChunkBytes, stay in L2 (50 MB on H100, 40 MB on A100) between the column partials kernel,
// which reads them first, and the dx kernel, which reads them again right after. Unchunked, a
// [8192, 2048] bf16 pair (67 MB) would come from DRAM twice.
constexpr int64_t kL2ChunkBytes = int64_t{16} << 20;
int64_t chunk_rows(int64_t C, size_t elem_bytes) {
  const int64_t rows = kL2ChunkBytes / std::max<int64_t>(1, 2 * C * static_cast<int64_t>(elem_bytes));
  return std::max<int64_t>(kRowBlock, rows / kRowBlock * kRowBlock);
}

// column_sums' per_chunk for sums with no second pass over the rows (bias_backward): one chunk.
struct WholeRows {
  void operator()(int64_t, int64_t) const {}
};

// Both passes of one kind of column sum into dw (and db for LayerNorm), pass 1 a chunk of rows
// at a time; after each chunk's partials, per_chunk(r0, rows) (the norms' dx kernel on those
// rows, which may overwrite dy there: the partials have read them). The chunks start on row
// blocks, so each row block's partial, and the result, are the same bits for any chunk size.
// No rows: pass 2 alone, over no partials, stores zeros (or adds nothing), as the CPU does.
template <class T, ColMode kMode, class PerChunk>
void column_sums(CudaBackend& be, const char* op, const T* dy, const T* x, const float* mean, const float* rstd,
                 int64_t N, int64_t C, float* dw, float* db, bool accumulate, const PerChunk& per_chunk) {
  if (C == 0) return;
  const int64_t blocks = ceil_div(N, kRowBlock);
  const int nbuf = kMode == ColMode::LayerNorm ? 2 : 1;
  auto* partial = static_cast<float*>(be.scratch(static_cast<size_t>(nbuf * blocks * C) * sizeof(float), op));
  float* partial_b = kMode == ColMode::LayerNorm ? partial + blocks * C : nullptr;
  const int64_t step = std::is_same_v<PerChunk, WholeRows> ? N : chunk_rows(C, sizeof(T));
  for (int64_t r0 = 0; r0 < N; r0 += step) {
    const int64_t n = std::min(step, N - r0), rb0 = r0 / kRowBlock;
    const dim3 grid(static_cast<unsigned>(ceil_div(C, kColGroup)),
                    static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kRowBlock), 65535)));
    column_partials_kernel<T, kMode><<<grid, kColGroup * kRowLanes, 0, be.stream()>>>(
        dy + r0 * C, x ? x + r0 * C : nullptr, mean ? mean + r0 : nullptr, rstd ? rstd + r0 : nullptr, n, C,
        partial + rb0 * C, partial_b ? partial_b + rb0 * C : nullptr);
    per_chunk(r0, n);
  }
  finish_columns(be, partial, partial_b, blocks, C, dw, db, accumulate);
}

// A norm's backward (kLayerNorm: LayerNorm, with mean and db; else RMSNorm): dx into din, and
// dweight (dbias) stored or added. Where a row block's sums fit in shared memory (C <=
// kFusedMaxC, half that for LayerNorm) norm_backward_fused_kernel, else (and for no rows)
// column_sums with the dx kernel per chunk of rows; then pass 2. Either way dout is read before
// din (which may be dout) is written over it.
template <class T, bool kLayerNorm>
void norm_backward(CudaBackend& be, const char* op, T* din, const T* dout, const T* in, const T* weight,
                   const float* mean, const float* rstd, int64_t N, int64_t C, bool packed, float* dw, float* db,
                   bool accumulate_din, bool accumulate_dparams) {
  if (N == 0 || C > (kLayerNorm ? kFusedMaxC / 2 : kFusedMaxC)) {
    constexpr ColMode kMode = kLayerNorm ? ColMode::LayerNorm : ColMode::RmsNorm;
    column_sums<T, kMode>(be, op, dout, in, mean, rstd, N, C, dw, db, accumulate_dparams, [&](int64_t r0, int64_t n) {
      with_pack_width<T>(packed, [&](auto v) {
        norm_backward_dx_kernel<T, kLayerNorm, decltype(v)::value>
            <<<row_blocks(n), kWarpsPerBlock * 32, 0, be.stream()>>>(din + r0 * C, dout + r0 * C, in + r0 * C, weight,
                                                                     mean ? mean + r0 : nullptr, rstd + r0, n,
                                                                     static_cast<int>(C), accumulate_din);
      });
    });
    return;
  }
  const int64_t blocks = ceil_div(N, kRowBlock);
  const int nbuf = kLayerNorm ? 2 : 1;
  auto* partial = static_cast<float*>(be.scratch(static_cast<size_t>(nbuf * blocks * C) * sizeof(float), op));
  float* partial_b = kLayerNorm ? partial + blocks * C : nullptr;
  with_pack_width<T>(packed, [&](auto v) {
    constexpr int V = decltype(v)::value;
    auto* kernel = norm_backward_fused_kernel<T, kLayerNorm, V>;
    const size_t smem = static_cast<size_t>(nbuf * kWarpsPerBlock * fused_width<V>(C)) * sizeof(float);
    allow_smem(kernel, smem, op);
    kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, smem, be.stream()>>>(
        din, dout, in, weight, mean, rstd, N, static_cast<int>(C), accumulate_din, partial, partial_b);
  });
  finish_columns(be, partial, partial_b, blocks, C, dw, db, accumulate_dparams);
}

struct NormDims {
  int64_t N, C;
};

// Shared checks (as the CPU's): row-wise tensors match in's shape, stats are F32 with one value
// per row, per-column tensors have C elements (empty optional ones are skipped).
NormDims check_norm(const char* op, const Tensor& x, std::initializer_list<Named> rowwise,
                    std::initializer_list<Named> stats, std::initializer_list<Named> per_col) {
  check_float(op, {"in", x});
  const int64_t N = rows(x), C = x.cols();
  for (const Named& t : rowwise) {
    check_float(op, t);
    if (rows(t.t) != N || t.t.cols() != C) fail(op, std::string(t.name) + " must match in's shape", {t, {"in", x}});
  }
  for (const Named& t : stats) {
    check_dtype(op, t, DType::F32);
    if (t.t.numel() != N) fail(op, std::string(t.name) + " must have one value per row", {t, {"in", x}});
  }
  for (const Named& t : per_col) {
    if (t.t.empty() && t.t.numel() == 0) continue;
    if (t.t.numel() != C) fail(op, std::string(t.name) + " must have in.cols() elements", {t, {"in", x}});
  }
  if (C > (int64_t{1} << 30)) fail(op, "rows longer than 2^30 are not supported", {{"in", x}});
  return {N, C};
}

}  // namespace
}  // namespace cuda

void CudaBackend::layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                                    const Tensor& weight, const Tensor& bias, float eps) {
  const char* op = "layernorm_forward";
  cuda::check_float(op, {"weight", weight});
  if (!bias.empty()) cuda::check_float(op, {"bias", bias});
  auto [N, C] = cuda::check_norm(op, in, {{"out", out}}, {{"mean", mean}, {"rstd", rstd}},
                                 {{"weight", weight}, {"bias", bias}});
  if (weight.numel() != C) cuda::fail(op, "weight must have in.cols() elements", {{"weight", weight}, {"in", in}});
  if (N == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(out), cuda::in(in), cuda::in(weight), cuda::in(bias)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    const T* b = bias.empty() ? nullptr : u[3].as<const T>();
    const bool packed = C % cuda::kPack<T> == 0 && cuda::aligned16({u[0].data, u[1].data, u[2].data, b});
    cuda::with_pack_width<T>(packed, [&](auto v) {
      cuda::layernorm_forward_kernel<T, decltype(v)::value>
          <<<cuda::row_blocks(N), cuda::kWarpsPerBlock * 32, 0, stream_>>>(
              u[0].as<T>(), mean.as<float>(), rstd.as<float>(), u[1].as<const T>(), u[2].as<const T>(), b, N,
              static_cast<int>(C), eps);
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"out", out}, {"in", in}, {"weight", weight}});
}

void CudaBackend::layernorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                                     const Tensor& in, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                                     bool accumulate_din, bool accumulate_dparams) {
  const char* op = "layernorm_backward";
  cuda::check_float(op, {"weight", weight});
  cuda::check_dtype(op, {"dweight", dweight}, DType::F32);
  if (!dbias.empty()) cuda::check_dtype(op, {"dbias", dbias}, DType::F32);
  auto [N, C] = cuda::check_norm(op, in, {{"din", din}, {"dout", dout}}, {{"mean", mean}, {"rstd", rstd}},
                                 {{"weight", weight}, {"dweight", dweight}, {"dbias", dbias}});
  if (weight.numel() != C || dweight.numel() != C)
    cuda::fail(op, "weight and dweight must have in.cols() elements",
               {{"weight", weight}, {"dweight", dweight}, {"in", in}});
  cuda::SameDType u(*this, op,
                    {accumulate_din ? cuda::inout(din) : cuda::out(din), cuda::in(dout), cuda::in(in), cuda::in(weight)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    const bool packed = C % cuda::kPack<T> == 0 && cuda::aligned16({u[0].data, u[1].data, u[2].data, u[3].data});
    cuda::norm_backward<T, true>(*this, op, u[0].as<T>(), u[1].as<const T>(), u[2].as<const T>(), u[3].as<const T>(),
                                 mean.as<const float>(), rstd.as<const float>(), N, C, packed, dweight.as<float>(),
                                 dbias.empty() ? nullptr : dbias.as<float>(), accumulate_din, accumulate_dparams);
  });
  u.finish();
  cuda::check_launch(*this, op, {{"din", din}, {"dout", dout}, {"in", in}});
}

void CudaBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                                  float eps) {
  const char* op = "rmsnorm_forward";
  cuda::check_float(op, {"weight", weight});
  auto [N, C] = cuda::check_norm(op, in, {{"out", out}}, {{"rstd", rstd}}, {{"weight", weight}});
  if (weight.numel() != C) cuda::fail(op, "weight must have in.cols() elements", {{"weight", weight}, {"in", in}});
  if (N == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(out), cuda::in(in), cuda::in(weight)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    const bool packed = C % cuda::kPack<T> == 0 && cuda::aligned16({u[0].data, u[1].data, u[2].data});
    cuda::with_pack_width<T>(packed, [&](auto v) {
      cuda::rmsnorm_forward_kernel<T, decltype(v)::value>
          <<<cuda::row_blocks(N), cuda::kWarpsPerBlock * 32, 0, stream_>>>(
              u[0].as<T>(), rstd.as<float>(), u[1].as<const T>(), u[2].as<const T>(), N, static_cast<int>(C), eps);
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"out", out}, {"in", in}, {"weight", weight}});
}

void CudaBackend::rmsnorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dout, const Tensor& in,
                                   const Tensor& weight, const Tensor& rstd, bool accumulate_din,
                                   bool accumulate_dparams) {
  const char* op = "rmsnorm_backward";
  cuda::check_float(op, {"weight", weight});
  cuda::check_dtype(op, {"dweight", dweight}, DType::F32);
  auto [N, C] = cuda::check_norm(op, in, {{"din", din}, {"dout", dout}}, {{"rstd", rstd}},
                                 {{"weight", weight}, {"dweight", dweight}});
  if (weight.numel() != C || dweight.numel() != C)
    cuda::fail(op, "weight and dweight must have in.cols() elements",
               {{"weight", weight}, {"dweight", dweight}, {"in", in}});
  cuda::SameDType u(*this, op,
                    {accumulate_din ? cuda::inout(din) : cuda::out(din), cuda::in(dout), cuda::in(in), cuda::in(weight)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    const bool packed = C % cuda::kPack<T> == 0 && cuda::aligned16({u[0].data, u[1].data, u[2].data, u[3].data});
    cuda::norm_backward<T, false>(*this, op, u[0].as<T>(), u[1].as<const T>(), u[2].as<const T>(),
                                  u[3].as<const T>(), nullptr, rstd.as<const float>(), N, C, packed,
                                  dweight.as<float>(), nullptr, accumulate_din, accumulate_dparams);
  });
  u.finish();
  cuda::check_launch(*this, op, {{"din", din}, {"dout", dout}, {"in", in}});
}

void CudaBackend::bias_backward(const Tensor& dbias, const Tensor& dout, bool accumulate) {
  const char* op = "bias_backward";
  cuda::check_dtype(op, {"dbias", dbias}, DType::F32);
  cuda::check_float(op, {"dout", dout});
  const int64_t N = cuda::rows(dout), C = dout.cols();
  if (dbias.numel() != C) cuda::fail(op, "dbias must have dout.cols() elements", {{"dbias", dbias}, {"dout", dout}});
  KEEL_DISPATCH_FLOAT(dout.dtype, op, T, {
    cuda::column_sums<T, cuda::ColMode::Sum>(*this, op, dout.as<const T>(), nullptr, nullptr, nullptr, N, C,
                                             dbias.as<float>(), nullptr, accumulate, cuda::WholeRows{});
  });
  cuda::check_launch(*this, op, {{"dbias", dbias}, {"dout", dout}});
}

}  // namespace keel
