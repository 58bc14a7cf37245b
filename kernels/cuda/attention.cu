// Causal self-attention with grouped-query heads: op entry points, the plain fp32 kernels, and
// attention over a KV cache (decode).
//
// Which kernels run: with KEEL_ATTENTION=cudnn, cuDNN's SDPA graphs where they take the call
// (attention_cudnn.h); else the fused tensor-core kernels of attention_flash.cu when the call allows
// (bf16/fp16 storage shared by all operands, head_dim up to 160, aligned, the blocks'
// shared memory within the device's limit) and KEEL_ATTENTION is not "simple"; otherwise the plain
// kernels below, which compute in fp32 from any storage dtype (fp32 mode, head sizes above 160, and
// the reference the fused kernels are tested against).
//
// Math (per query head h, kv head h / group, query row i, keys j <= i):
//   S_ij = (q_i . k_j) / sqrt(hd) [+ m_h (j - i) with ALiBi],  lse_i = log sum_j exp(S_ij),
//   o_i = sum_j exp(S_ij - lse_i) v_j
//   D_i = dO_i . o_i,  dS_ij = P_ij (dO_i . v_j - D_i)
//   dq_i = sum_j dS_ij k_j / sqrt(hd),  dk_j = sum_{h in group} sum_{i>=j} dS_ij q_i / sqrt(hd),
//   dv_j = sum_{h in group} sum_{i>=j} P_ij dO_i
//
// The key range of row i starts at its first key (kernels/attention_window.h: its document's
// first row under document masking, i - positions[i], and no more than AttnShape::window keys
// back with a sliding window); the query range of key j ends at the last row whose first key is
// at most j.
// ALiBi (AttnShape::alibi_slopes): the plain kernels add the bias exactly as the CPU reference,
// S = round(dot * scale) + round(float(j - i) * m_h) (__fmul_rn / __fadd_rn: no contraction into
// an fma), in the forward and in both backward recomputations of P; there is no gradient for it.
//
// Plain kernels, one warp per output row (the CPU reference's decomposition):
//   forward  warp per (b, h, i): keys in chunks of 32, one key per lane (its score a dot product
//            over hd), an online softmax over the chunks (max and sum by warp butterflies), then
//            the chunk's values added in key order into the lanes' output columns (d = lane, +32, ...).
//   dq       warp per (b, h, i): per chunk, lane j computes P_ij and dS_ij; dq += dS_ij k_j in j order.
//   dk, dv   warp per (b, kv head, j): the group's heads in order, queries i = j .. T-1 in chunks of
//            32 (one per lane), dv += P_ij dO_i and dk += dS_ij q_i in i order.
//   delta    warp per (b, i, h): D = dO . o.
// Every sum has a fixed order: deterministic. head_dim <= 256 (8 output columns per lane).
#include <cmath>
#include <vector>

#include "kernels/attention_window.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/attention_flash.cuh"

namespace keel {

using cuda::Named;

namespace cuda {
namespace {

constexpr int kWarps = 8;  // rows per block
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;

// Where the rows of a plain attention call live. Query row r of sequence b, head h:
// q + (b * Tq + r) * q_stride + h * hd; key/value row j of sequence b, kv head kvh:
// k + (b * Tk + j) * k_stride + kvh * hd (v likewise); output out + (b * Tq + r) * out_stride + h * hd.
// Row r is at absolute position i = key_offset + r (its last key, the i of ALiBi's m_h (j - i))
// and attends keys attention_first_key(i) .. i: from 0, from its document's start with document
// positions pos ([B*Tq], training only: Tk == Tq, key_offset 0), and within `window` keys.
struct PlainAttn {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // [B, nh, Tq], or null
  DType q_dt, k_dt, v_dt, out_dt;
  int64_t q_stride, k_stride, v_stride, out_stride;
  int B, Tq, Tk, nh, nkv, hd;
  int64_t key_offset;
  const int32_t* pos;
  int window;  // 0: none
  float scale;
};

// ALiBi's bias added to a scaled score, rounded as the CPU reference rounds it (two roundings).
__device__ __forceinline__ float add_alibi(float scaled, int j_minus_i, float slope) {
  return __fadd_rn(scaled, __fmul_rn(static_cast<float>(j_minus_i), slope));
}

template <bool kAlibi>
__global__ void __launch_bounds__(kThreads)
    plain_attention_forward_kernel(PlainAttn a, const float* __restrict__ slopes) {
  __shared__ float sq[kWarps][kMaxHeadDim];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(kWarps) + warp;  // (b, h, r)
  if (idx >= static_cast<int64_t>(a.B) * a.nh * a.Tq) return;
  const int r = static_cast<int>(idx % a.Tq);
  const int h = static_cast<int>((idx / a.Tq) % a.nh);
  const int b = static_cast<int>(idx / (static_cast<int64_t>(a.Tq) * a.nh));
  const int kvh = h / (a.nh / a.nkv);
  const int hd = a.hd;
  const int64_t q_off = (static_cast<int64_t>(b) * a.Tq + r) * a.q_stride + static_cast<int64_t>(h) * hd;
  for (int d = lane; d < hd; d += 32) sq[warp][d] = load_any(a.q, a.q_dt, q_off + d);
  __syncwarp();
  const int64_t kv_row0 = static_cast<int64_t>(b) * a.Tk;
  const int64_t last = a.key_offset + r;
  const int64_t first = attention_first_key(a.pos ? a.pos + static_cast<int64_t>(b) * a.Tq : nullptr, last, a.window);
  float o[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) o[k] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = first; j0 <= last; j0 += 32) {
    const int64_t j = j0 + lane;
    float s = -INFINITY;
    if (j <= last) {
      const int64_t k_off = (kv_row0 + j) * a.k_stride + static_cast<int64_t>(kvh) * hd;
      float dot = 0.0f;
      for (int d = 0; d < hd; ++d) dot += sq[warp][d] * load_any(a.k, a.k_dt, k_off + d);
      s = dot * a.scale;
      // last = i, the row's position; the slope is re-read per chunk (an L1 hit, once per hd-long
      // dot product) rather than held in a register across the loop, which made ptxas spill
      if constexpr (kAlibi) s = add_alibi(s, static_cast<int>(j - last), slopes[h]);
    }
    const float m_new = fmaxf(m, warp_max(s));  // finite: key j0 is always valid
    const float alpha = expf(m - m_new);
    const float p = j <= last ? expf(s - m_new) : 0.0f;
    l = l * alpha + warp_sum(p);
    m = m_new;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) o[k] *= alpha;
    const int n_keys = last - j0 + 1 < 32 ? static_cast<int>(last - j0 + 1) : 32;
    for (int jj = 0; jj < n_keys; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const int64_t v_off = (kv_row0 + j0 + jj) * a.v_stride + static_cast<int64_t>(kvh) * hd;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int d = lane + 32 * k;
        if (d < hd) o[k] += pj * load_any(a.v, a.v_dt, v_off + d);
      }
    }
  }
  const int64_t o_off = (static_cast<int64_t>(b) * a.Tq + r) * a.out_stride + static_cast<int64_t>(h) * hd;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < hd) store_any(a.out, a.out_dt, o_off + d, o[k] / l);
  }
  if (a.lse && lane == 0) a.lse[idx] = m + logf(l);
}

// D[b, h, i] = dO_i . o_i for every (b, i, h); one warp per row.
__global__ void __launch_bounds__(kThreads)
    attention_delta_kernel(float* __restrict__ delta, const void* dout, DType dout_dt, const void* out, DType out_dt,
                           int B, int T, int nh, int hd) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(kWarps) + warp;  // (b, i, h) in memory order
  if (idx >= static_cast<int64_t>(B) * T * nh) return;
  const int h = static_cast<int>(idx % nh);
  const int64_t n = idx / nh;  // b * T + i
  const int64_t off = n * nh * hd + static_cast<int64_t>(h) * hd;
  float s = 0.0f;
  for (int d = lane; d < hd; d += 32) s += load_any(dout, dout_dt, off + d) * load_any(out, out_dt, off + d);
  s = warp_sum(s);
  if (lane == 0) delta[(n / T * nh + h) * T + n % T] = s;
}

// The same D with each row read in 16-byte packs of V elements: G = head_dim / V consecutive
// lanes per row (a power of two dividing 32), each summing its pack in order, then a butterfly
// over the G lanes (a fixed pairing: deterministic). Rows [B*T*nh] of head_dim contiguous elements.
template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    attention_delta_packed_kernel(float* __restrict__ delta, const T* __restrict__ dout, const T* __restrict__ out,
                                  int64_t rows, int T_len, int nh, int lanes_log2) {
  const int lanes_per_row = 1 << lanes_log2;
  const int64_t g = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const int64_t row = g >> lanes_log2;  // (b, i, h) in memory order
  const int part = static_cast<int>(g & (lanes_per_row - 1));
  float s = 0.0f;
  if (row < rows) {
    const int64_t off = (row * lanes_per_row + part) * V;
    float a[V], o[V];
    load_pack<V>(a, dout + off);
    load_pack<V>(o, out + off);
#pragma unroll
    for (int k = 0; k < V; ++k) s = fmaf(a[k], o[k], s);
  }
  for (int m = lanes_per_row / 2; m > 0; m /= 2) s += __shfl_xor_sync(0xffffffffu, s, m);  // all lanes take part
  if (row < rows && part == 0) {
    const int64_t n = row / nh, h = row % nh;  // n = b * T + i
    delta[(n / T_len * nh + h) * T_len + n % T_len] = s;
  }
}

struct PlainBwd {
  const void* qkv;
  const void* dout;
  void* dqkv;
  const float* lse;
  const float* delta;
  const int32_t* pos;  // document positions [B*T], or null
  int window;          // sliding window, 0: none
  DType qkv_dt, dout_dt, dqkv_dt;
  int B, T, nh, nkv, hd;
  float scale;
};

template <bool kAlibi>
__global__ void __launch_bounds__(kThreads)
    plain_attention_dq_kernel(PlainBwd a, const float* __restrict__ slopes) {
  __shared__ float sq[kWarps][kMaxHeadDim];
  __shared__ float sdo[kWarps][kMaxHeadDim];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(kWarps) + warp;  // (b, h, i)
  if (idx >= static_cast<int64_t>(a.B) * a.nh * a.T) return;
  const int i = static_cast<int>(idx % a.T);
  const int h = static_cast<int>((idx / a.T) % a.nh);
  const int b = static_cast<int>(idx / (static_cast<int64_t>(a.T) * a.nh));
  const int kvh = h / (a.nh / a.nkv);
  const int hd = a.hd;
  const int64_t cols = static_cast<int64_t>(a.nh + 2 * a.nkv) * hd;
  const int64_t row = static_cast<int64_t>(b) * a.T + i;
  for (int d = lane; d < hd; d += 32) {
    sq[warp][d] = load_any(a.qkv, a.qkv_dt, row * cols + static_cast<int64_t>(h) * hd + d);
    sdo[warp][d] = load_any(a.dout, a.dout_dt, row * a.nh * hd + static_cast<int64_t>(h) * hd + d);
  }
  __syncwarp();
  const float lse_i = a.lse[idx], d_i = a.delta[idx];
  const float slope = kAlibi ? slopes[h] : 0.0f;
  const int64_t k_col = static_cast<int64_t>(a.nh + kvh) * hd, v_col = static_cast<int64_t>(a.nh + a.nkv + kvh) * hd;
  float dq[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) dq[k] = 0.0f;
  const int first =
      static_cast<int>(attention_first_key(a.pos ? a.pos + static_cast<int64_t>(b) * a.T : nullptr, i, a.window));
  for (int j0 = first; j0 <= i; j0 += 32) {
    const int j = j0 + lane;
    float ds = 0.0f;
    if (j <= i) {
      const int64_t kr = (static_cast<int64_t>(b) * a.T + j) * cols;
      float qk = 0.0f, dv = 0.0f;
      for (int d = 0; d < hd; ++d) {
        qk += sq[warp][d] * load_any(a.qkv, a.qkv_dt, kr + k_col + d);
        dv += sdo[warp][d] * load_any(a.qkv, a.qkv_dt, kr + v_col + d);
      }
      float sc = qk * a.scale;
      if constexpr (kAlibi) sc = add_alibi(sc, j - i, slope);
      const float p = expf(sc - lse_i);
      ds = p * (dv - d_i);
    }
    const int n_keys = min(32, i - j0 + 1);
    for (int jj = 0; jj < n_keys; ++jj) {
      const float dsj = __shfl_sync(0xffffffffu, ds, jj);
      const int64_t kr = (static_cast<int64_t>(b) * a.T + j0 + jj) * cols + k_col;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int d = lane + 32 * k;
        if (d < hd) dq[k] += dsj * load_any(a.qkv, a.qkv_dt, kr + d);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < hd) store_any(a.dqkv, a.dqkv_dt, row * cols + static_cast<int64_t>(h) * hd + d, dq[k] * a.scale);
  }
}

template <bool kAlibi>
__global__ void __launch_bounds__(kThreads)
    plain_attention_dkdv_kernel(PlainBwd a, const float* __restrict__ slopes) {
  __shared__ float sk[kWarps][kMaxHeadDim];
  __shared__ float sv[kWarps][kMaxHeadDim];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(kWarps) + warp;  // (b, kvh, j)
  if (idx >= static_cast<int64_t>(a.B) * a.nkv * a.T) return;
  const int j = static_cast<int>(idx % a.T);
  const int kvh = static_cast<int>((idx / a.T) % a.nkv);
  const int b = static_cast<int>(idx / (static_cast<int64_t>(a.T) * a.nkv));
  const int group = a.nh / a.nkv;
  const int hd = a.hd;
  const int64_t cols = static_cast<int64_t>(a.nh + 2 * a.nkv) * hd;
  const int64_t row_j = static_cast<int64_t>(b) * a.T + j;
  const int64_t k_col = static_cast<int64_t>(a.nh + kvh) * hd, v_col = static_cast<int64_t>(a.nh + a.nkv + kvh) * hd;
  for (int d = lane; d < hd; d += 32) {
    sk[warp][d] = load_any(a.qkv, a.qkv_dt, row_j * cols + k_col + d);
    sv[warp][d] = load_any(a.qkv, a.qkv_dt, row_j * cols + v_col + d);
  }
  __syncwarp();
  float dk[kPerLane], dv[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) dk[k] = dv[k] = 0.0f;
  for (int gh = 0; gh < group; ++gh) {
    const int h = kvh * group + gh;
    const int64_t stat = (static_cast<int64_t>(b) * a.nh + h) * a.T;
    const float slope = kAlibi ? slopes[h] : 0.0f;
    for (int i0 = j; i0 < a.T; i0 += 32) {
      const int i = i0 + lane;
      // queries that attend j only: i's first key at most j (a prefix of the lanes, as first
      // keys never decrease)
      const bool in_doc =
          i < a.T && attention_first_key(a.pos ? a.pos + static_cast<int64_t>(b) * a.T : nullptr, i, a.window) <= j;
      const unsigned lanes = __ballot_sync(0xffffffffu, in_doc);
      if (lanes == 0) break;  // j's document or window ended before i0
      float p = 0.0f, ds = 0.0f;
      if (in_doc) {
        const int64_t row_i = static_cast<int64_t>(b) * a.T + i;
        float qk = 0.0f, dov = 0.0f;
        for (int d = 0; d < hd; ++d) {
          qk += load_any(a.qkv, a.qkv_dt, row_i * cols + static_cast<int64_t>(h) * hd + d) * sk[warp][d];
          dov += load_any(a.dout, a.dout_dt, row_i * a.nh * hd + static_cast<int64_t>(h) * hd + d) * sv[warp][d];
        }
        float sc = qk * a.scale;
        if constexpr (kAlibi) sc = add_alibi(sc, j - i, slope);
        p = expf(sc - a.lse[stat + i]);
        ds = p * (dov - a.delta[stat + i]);
      }
      const int n_q = __popc(lanes);
      for (int ii = 0; ii < n_q; ++ii) {
        const float pi = __shfl_sync(0xffffffffu, p, ii), dsi = __shfl_sync(0xffffffffu, ds, ii);
        const int64_t row_i = static_cast<int64_t>(b) * a.T + i0 + ii;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          const int d = lane + 32 * k;
          if (d < hd) {
            dv[k] += pi * load_any(a.dout, a.dout_dt, row_i * a.nh * hd + static_cast<int64_t>(h) * hd + d);
            dk[k] += dsi * load_any(a.qkv, a.qkv_dt, row_i * cols + static_cast<int64_t>(h) * hd + d);
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < hd) {
      store_any(a.dqkv, a.dqkv_dt, row_j * cols + k_col + d, dk[k] * a.scale);
      store_any(a.dqkv, a.dqkv_dt, row_j * cols + v_col + d, dv[k]);
    }
  }
}

// k_cache / v_cache rows pos .. pos+n-1 = the new rows' k and v (rounded to the caches' dtype).
__global__ void append_kv_kernel(void* k_cache, DType k_dt, void* v_cache, DType v_dt, const void* qkv, DType qkv_dt,
                                 int64_t n, int64_t cols, int64_t k_col, int64_t v_col, int64_t kv_cols, int64_t pos) {
  const int64_t total = n * kv_cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / kv_cols, c = e - r * kv_cols;
    store_any(k_cache, k_dt, (pos + r) * kv_cols + c, load_any(qkv, qkv_dt, r * cols + k_col + c));
    store_any(v_cache, v_dt, (pos + r) * kv_cols + c, load_any(qkv, qkv_dt, r * cols + v_col + c));
  }
}

float softmax_scale(int hd) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))); }

void check_head_dim(const char* op, const AttnShape& s, const Tensor& qkv) {
  if (s.head_dim > kMaxHeadDim)
    fail(op, "head_dim " + std::to_string(s.head_dim) + " > " + std::to_string(kMaxHeadDim) + " is not supported",
         {{"qkv", qkv}});
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::max<int64_t>(1, ceil_div(rows, kWarps))); }

// D = dO . o by the packed kernel where dout and out share a type, are 16-byte aligned and
// head_dim / V divides 32; else one warp per row.
void launch_attention_delta(float* delta, const Tensor& dout, const Tensor& out, const AttnShape& s,
                            cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(s.B) * s.T * s.n_heads;
  const auto packed = [&](auto type) {
    using T = decltype(type);
    constexpr int V = kPack<T>;
    const int lanes = s.head_dim / V;
    if (s.head_dim % V != 0 || lanes > 32 || (lanes & (lanes - 1)) != 0 || !aligned16({dout.data, out.data}))
      return false;
    const int64_t threads = rows * lanes;
    attention_delta_packed_kernel<T, V><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0,
                                          stream>>>(delta, dout.as<const T>(), out.as<const T>(), rows, s.T,
                                                    s.n_heads, __builtin_ctz(static_cast<unsigned>(lanes)));
    return true;
  };
  if (dout.dtype == out.dtype) {
    if (dout.dtype == DType::BF16 && packed(__nv_bfloat16{})) return;
    if (dout.dtype == DType::F16 && packed(__half{})) return;
    if (dout.dtype == DType::F32 && packed(float{})) return;
  }
  attention_delta_kernel<<<row_blocks(rows), kThreads, 0, stream>>>(delta, dout.data, dout.dtype, out.data, out.dtype,
                                                                    s.B, s.T, s.n_heads, s.head_dim);
}

// The plain kernels with ALiBi (slopes given) or without: the biasless instantiation keeps the
// plain causal code and registers.
void launch_plain_forward(const PlainAttn& a, const float* slopes, int64_t rows, cudaStream_t stream) {
  if (slopes)
    plain_attention_forward_kernel<true><<<row_blocks(rows), kThreads, 0, stream>>>(a, slopes);
  else
    plain_attention_forward_kernel<false><<<row_blocks(rows), kThreads, 0, stream>>>(a, nullptr);
}

void launch_plain_backward(const PlainBwd& a, const float* slopes, cudaStream_t stream) {
  const int64_t q_rows = static_cast<int64_t>(a.B) * a.nh * a.T, kv_rows = static_cast<int64_t>(a.B) * a.nkv * a.T;
  if (slopes) {
    plain_attention_dq_kernel<true><<<row_blocks(q_rows), kThreads, 0, stream>>>(a, slopes);
    plain_attention_dkdv_kernel<true><<<row_blocks(kv_rows), kThreads, 0, stream>>>(a, slopes);
  } else {
    plain_attention_dq_kernel<false><<<row_blocks(q_rows), kThreads, 0, stream>>>(a, nullptr);
    plain_attention_dkdv_kernel<false><<<row_blocks(kv_rows), kThreads, 0, stream>>>(a, nullptr);
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s) {
  const char* op = "attention_forward";
  cuda::check_attn(op, s, {"qkv", qkv});
  cuda::check_float(op, {"out", out});
  cuda::check_dtype(op, {"lse", lse}, DType::F32);
  const int64_t B = s.B, T = s.T, nh = s.n_heads, hd = s.head_dim;
  if (cuda::rows(out) != B * T || out.cols() != nh * hd)
    cuda::fail(op, "out must be [B*T, n_heads*head_dim] for " + cuda::attn_str(s), {{"out", out}, {"qkv", qkv}});
  if (lse.numel() != B * nh * T) cuda::fail(op, "lse must be [B, n_heads, T] for " + cuda::attn_str(s), {{"lse", lse}});
  cuda::check_head_dim(op, s, qkv);
  if (cudnn_ && cuda::cudnn_attention_forward(*cudnn_, out, lse, qkv, s)) {
    // cuDNN's SDPA graph (KEEL_ATTENTION=cudnn, attention_cudnn.cpp)
  } else if (!simple_attention_ && cuda::flash_supported(*this, s, qkv.dtype, {&qkv, &out}, false)) {
    cuda::flash_forward(*this, out, lse, qkv, s);
  } else {
    cuda::PlainAttn a{};
    a.q = qkv.data;
    a.k = qkv.as<const char>() + nh * hd * dtype_size(qkv.dtype);
    a.v = qkv.as<const char>() + (nh + s.n_kv_heads) * hd * dtype_size(qkv.dtype);
    a.out = out.data;
    a.lse = lse.as<float>();
    a.q_dt = a.k_dt = a.v_dt = qkv.dtype;
    a.out_dt = out.dtype;
    a.q_stride = a.k_stride = a.v_stride = s.qkv_cols();
    a.out_stride = nh * hd;
    a.B = s.B, a.Tq = s.T, a.Tk = s.T, a.nh = s.n_heads, a.nkv = s.n_kv_heads, a.hd = s.head_dim;
    a.key_offset = 0;
    a.pos = s.positions.empty() ? nullptr : s.positions.as<const int32_t>();
    a.window = s.window;
    a.scale = cuda::softmax_scale(s.head_dim);
    cuda::launch_plain_forward(a, cuda::check_alibi(op, s), B * nh * T, stream_);
  }
  cuda::check_launch(*this, op, {{"out", out}, {"lse", lse}, {"qkv", qkv}});
}

void CudaBackend::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                     const Tensor& lse, const AttnShape& s) {
  const char* op = "attention_backward";
  cuda::check_attn(op, s, {"qkv", qkv});
  cuda::check_attn(op, s, {"dqkv", dqkv});
  cuda::check_float(op, {"dout", dout});
  cuda::check_float(op, {"out", out});
  cuda::check_dtype(op, {"lse", lse}, DType::F32);
  const int64_t B = s.B, T = s.T, nh = s.n_heads, hd = s.head_dim;
  for (Named t : {Named{"dout", dout}, Named{"out", out}})
    if (cuda::rows(t.t) != B * T || t.t.cols() != nh * hd)
      cuda::fail(op, std::string(t.name) + " must be [B*T, n_heads*head_dim] for " + cuda::attn_str(s), {t});
  if (lse.numel() != B * nh * T) cuda::fail(op, "lse must be [B, n_heads, T] for " + cuda::attn_str(s), {{"lse", lse}});
  cuda::check_head_dim(op, s, qkv);
  if (cudnn_ && cuda::cudnn_attention_backward(*cudnn_, dqkv, dout, qkv, out, lse, s)) {
    cuda::check_launch(*this, op, {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}});
    return;
  }

  auto* delta = static_cast<float*>(scratch(static_cast<size_t>(B * nh * T) * sizeof(float), op));
  cuda::launch_attention_delta(delta, dout, out, s, stream_);
  if (!simple_attention_ && cuda::flash_supported(*this, s, qkv.dtype, {&qkv, &dqkv, &dout}, true)) {
    cuda::flash_backward(*this, dqkv, dout, qkv, lse, delta, s);
  } else {
    cuda::PlainBwd a{};
    a.qkv = qkv.data;
    a.dout = dout.data;
    a.dqkv = dqkv.data;
    a.lse = lse.as<const float>();
    a.delta = delta;
    a.qkv_dt = qkv.dtype, a.dout_dt = dout.dtype, a.dqkv_dt = dqkv.dtype;
    a.B = s.B, a.T = s.T, a.nh = s.n_heads, a.nkv = s.n_kv_heads, a.hd = s.head_dim;
    a.pos = s.positions.empty() ? nullptr : s.positions.as<const int32_t>();
    a.window = s.window;
    a.scale = cuda::softmax_scale(s.head_dim);
    cuda::launch_plain_backward(a, cuda::check_alibi(op, s), stream_);
  }
  cuda::check_launch(*this, op, {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}});
  release(delta);
}

void CudaBackend::attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                   const AttnShape& s, int64_t pos, const Rope& rope) {
  const char* op = "attention_decode";
  cuda::check_attn(op, s, {"qkv", qkv});
  cuda::check_float(op, {"out", out});
  cuda::check_float(op, {"k_cache", k_cache});
  cuda::check_float(op, {"v_cache", v_cache});
  const int64_t n = s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  const int64_t cols = s.qkv_cols(), kv_cols = nkv * hd;
  if (s.B != 1) cuda::fail(op, "decodes one sequence (B = 1), got " + cuda::attn_str(s), {{"qkv", qkv}});
  if (!s.positions.empty())
    cuda::fail(op, "decodes one document: document positions are for training", {{"positions", s.positions}});
  if (cuda::rows(out) != n || out.cols() != nh * hd)
    cuda::fail(op, "out must be [n, n_heads*head_dim] for " + cuda::attn_str(s), {{"out", out}, {"qkv", qkv}});
  for (Named c : {Named{"k_cache", k_cache}, Named{"v_cache", v_cache}})
    if (c.t.cols() != kv_cols)
      cuda::fail(op, std::string(c.name) + " must be [max_len, n_kv_heads*head_dim] for " + cuda::attn_str(s), {c});
  const int64_t max_len = cuda::rows(k_cache);
  if (cuda::rows(v_cache) != max_len || pos < 0 || pos + n > max_len)
    cuda::fail(op, "positions [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ") do not fit the caches",
               {{"k_cache", k_cache}, {"v_cache", v_cache}});
  cuda::check_head_dim(op, s, qkv);

  // 1. RoPE at absolute positions pos .. pos+n-1: the CPU's table recipe for those positions
  void* table = nullptr;
  if (rope.rotates()) {
    const std::vector<float> cs = rope_cos_sin(rope_inv_freq(s.head_dim, rope), pos, n);
    table = scratch(cs.size() * sizeof(float), op);
    cuda::check_cuda(cudaMemcpyAsync(table, cs.data(), cs.size() * sizeof(float), cudaMemcpyHostToDevice, stream_), op,
                     "cudaMemcpyAsync (rope table)");
    cuda::launch_rope(*this, qkv, s, static_cast<const float*>(table), false, op);
  }
  // 2. append k and v
  if (n > 0)
    cuda::append_kv_kernel<<<cuda::grid_for(n * kv_cols, 256), 256, 0, stream_>>>(
        k_cache.data, k_cache.dtype, v_cache.data, v_cache.dtype, qkv.data, qkv.dtype, n, cols, nh * hd,
        (nh + nkv) * hd, kv_cols, pos);
  // 3. attention of the new rows over cache rows 0 .. pos + i (the last s.window of them)
  cuda::PlainAttn a{};
  a.q = qkv.data;
  a.k = k_cache.data;
  a.v = v_cache.data;
  a.out = out.data;
  a.lse = nullptr;
  a.q_dt = qkv.dtype, a.k_dt = k_cache.dtype, a.v_dt = v_cache.dtype, a.out_dt = out.dtype;
  a.q_stride = cols, a.k_stride = kv_cols, a.v_stride = kv_cols, a.out_stride = nh * hd;
  a.B = 1, a.Tq = static_cast<int>(n), a.Tk = static_cast<int>(max_len), a.nh = s.n_heads, a.nkv = s.n_kv_heads;
  a.hd = s.head_dim;
  a.key_offset = pos;  // row r is at position pos + r: ALiBi's i
  a.pos = nullptr;
  a.window = s.window;
  a.scale = cuda::softmax_scale(s.head_dim);
  if (n > 0) cuda::launch_plain_forward(a, cuda::check_alibi(op, s), n * nh, stream_);
  cuda::check_launch(*this, op, {{"out", out}, {"qkv", qkv}, {"k_cache", k_cache}});
  if (table) release(table);
}

}  // namespace keel
