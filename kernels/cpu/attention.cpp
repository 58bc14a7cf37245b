// Causal self-attention with grouped-query heads, flash-attention style: the forward keeps only
// the log-sum-exp of each score row; the backward recomputes probabilities from it.
//
// For one query head h (key/value head h / group) and query position i, keys j <= i from the
// row's first key on (kernels/attention_window.h: its document's start under document masking,
// and no more than `window` keys back with a sliding window):
//   S_ij = (q_i . k_j) / sqrt(hd) [+ m_h (j - i) with ALiBi],  lse_i = log sum_j exp(S_ij),
//   P_ij = exp(S_ij - lse_i)
//   o_i = sum_j P_ij v_j
// Backward with D_i = dO_i . o_i:
//   dP_ij = dO_i . v_j,  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = sum_j dS_ij k_j / sqrt(hd)
//   dk_j = sum_{h in group} sum_{i >= j} dS_ij q_i / sqrt(hd),  dv_j = sum_{h in group} sum_{i >= j} P_ij dO_i
//   (i up to the last row whose first key is at most j)
// dq is computed per query row and dk/dv per key row (each by one thread, heads of the group in
// order, then i in order), so nothing is accumulated across threads.
#include <cmath>
#include <vector>

#include "kernels/attention_window.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/document_positions.h"
// last: the score's product and sum round separately, as in attention_decode.cpp
#include "kernels/fp_contract_off.h"

namespace keel {

using cpu::Named;

namespace cpu {

std::string attn_str(const AttnShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " n_heads=" + std::to_string(s.n_heads) +
         " n_kv_heads=" + std::to_string(s.n_kv_heads) + " head_dim=" + std::to_string(s.head_dim) +
         (s.window != 0 ? std::string(" window=") + std::to_string(s.window) : std::string());
}

void check_attn(const char* op, const AttnShape& s, Named qkv) {
  if (s.B <= 0 || s.T <= 0 || s.n_heads <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0 ||
      s.n_heads % s.n_kv_heads != 0 || s.window < 0)
    fail(op,
         "invalid attention shape " + attn_str(s) +
             " (all positive, n_heads % n_kv_heads == 0, window 0 (none) or positive)",
         {qkv});
  check_float(op, qkv);
  if (cpu::rows(qkv.t) != static_cast<int64_t>(s.B) * s.T || qkv.t.cols() != s.qkv_cols())
    fail(op, std::string(qkv.name) + " must be [B*T, (n_heads + 2 n_kv_heads) * head_dim] for " + attn_str(s), {qkv});
  check_positions(op, s.positions, static_cast<int64_t>(s.B) * s.T, s.T);
  check_alibi(op, s);
}

void check_rope(const char* op, const AttnShape& s, Named qkv) {
  check_attn(op, s, qkv);
  if (s.head_dim % 2 != 0) fail(op, "RoPE needs an even head_dim: " + attn_str(s), {qkv});
}

const float* check_alibi(const char* op, const AttnShape& s) {
  if (s.alibi_slopes.empty()) return nullptr;
  check_dtype(op, {"alibi_slopes", s.alibi_slopes}, DType::F32);
  if (s.alibi_slopes.numel() != s.n_heads)
    fail(op, "alibi_slopes must hold one slope per query head (" + std::to_string(s.n_heads) + ")",
         {{"alibi_slopes", s.alibi_slopes}});
  return s.alibi_slopes.as<const float>();
}

const int32_t* check_positions(const char* op, const Tensor& positions, int64_t N, int T) {
  if (positions.empty()) return nullptr;
  check_dtype(op, {"positions", positions}, DType::I32);
  if (positions.numel() != N)
    fail(op, "positions must hold one entry per token row (" + std::to_string(N) + ")", {{"positions", positions}});
  const int32_t* p = positions.as<const int32_t>();
  if (const std::string why = document_positions_error(p, N, T); !why.empty()) fail(op, why, {{"positions", positions}});
  return p;
}

}  // namespace cpu

namespace {

// fp32 copies of the heads, head-major so that each head's rows are contiguous:
// q [B][n_heads][T][hd], k and v [B][n_kv_heads][T][hd].
struct Heads {
  std::vector<float> q, k, v;
};

Heads unpack_heads(const Tensor& qkv, const AttnShape& s) {
  const int64_t hd = s.head_dim, T = s.T, cols = s.qkv_cols();
  Heads h;
  h.q.resize(static_cast<size_t>(s.B) * s.n_heads * T * hd);
  h.k.resize(static_cast<size_t>(s.B) * s.n_kv_heads * T * hd);
  h.v.resize(h.k.size());
#pragma omp parallel if (s.B * T * cols >= cpu::kMinParallelWork)
  {
    std::vector<float> row(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < static_cast<int64_t>(s.B) * T; ++n) {
      const int64_t b = n / T, t = n % T;
      const float* x = cpu::read_f32(qkv, n * cols, cols, row.data());
      for (int64_t hh = 0; hh < s.n_heads; ++hh)
        std::copy(x + hh * hd, x + (hh + 1) * hd, h.q.data() + ((b * s.n_heads + hh) * T + t) * hd);
      for (int64_t hh = 0; hh < s.n_kv_heads; ++hh) {
        const float* k = x + (s.n_heads + hh) * hd;
        const float* v = x + (s.n_heads + s.n_kv_heads + hh) * hd;
        std::copy(k, k + hd, h.k.data() + ((b * s.n_kv_heads + hh) * T + t) * hd);
        std::copy(v, v + hd, h.v.data() + ((b * s.n_kv_heads + hh) * T + t) * hd);
      }
    }
  }
  return h;
}

float softmax_scale(int hd) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))); }

// S_ij as forward computes it; bias = m_h * (j - i) with ALiBi, else 0
inline float score(const float* q, const float* k, int64_t hd, float scale, float bias) {
  return cpu::dot(q, k, hd) * scale + bias;
}

// P_ij, computed the same way by both backward passes
inline float prob(const float* q, const float* k, int64_t hd, float scale, float bias, float lse) {
  return std::exp(score(q, k, hd, scale, bias) - lse);
}

}  // namespace

void CpuBackend::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s) {
  const char* op = "attention_forward";
  cpu::check_attn(op, s, {"qkv", qkv});
  cpu::check_float(op, {"out", out});
  cpu::check_dtype(op, {"lse", lse}, DType::F32);
  const int64_t B = s.B, T = s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  if (cpu::rows(out) != B * T || out.cols() != nh * hd)
    cpu::fail(op, "out must be [B*T, n_heads*head_dim] for " + cpu::attn_str(s), {{"out", out}, {"qkv", qkv}});
  if (lse.numel() != B * nh * T)
    cpu::fail(op, "lse must be [B, n_heads, T] for " + cpu::attn_str(s), {{"lse", lse}});
  const Heads heads = unpack_heads(qkv, s);
  const int64_t group = nh / nkv;
  const float scale = softmax_scale(s.head_dim);
  float* lse_out = lse.as<float>();
  const int32_t* pos = s.positions.empty() ? nullptr : s.positions.as<const int32_t>();
  const float* slopes = cpu::check_alibi(op, s);
  const int64_t work = B * nh * T * (T + 1) / 2 * hd;  // multiply-adds of q.k (and p.v)
#pragma omp parallel if (work >= cpu::kMinParallelWork)
  {
    std::vector<float> p(static_cast<size_t>(T)), o(static_cast<size_t>(hd));
    // one (b, h, i) query row per iteration; rows get longer with i, hence dynamic
#pragma omp for schedule(dynamic, 8)
    for (int64_t idx = 0; idx < B * nh * T; ++idx) {
      const int64_t b = idx / (nh * T), h = (idx / T) % nh, i = idx % T;
      const float* q = heads.q.data() + idx * hd;
      const float* k = heads.k.data() + (b * nkv + h / group) * T * hd;
      const float* v = heads.v.data() + (b * nkv + h / group) * T * hd;
      const int64_t j0 = attention_first_key(pos ? pos + b * T : nullptr, i, s.window);
      float m = -INFINITY;
      for (int64_t j = j0; j <= i; ++j) {
        p[j] = score(q, k + j * hd, hd, scale, cpu::alibi_bias(slopes, h, i, j));
        m = std::max(m, p[j]);
      }
      float l = 0;
      for (int64_t j = j0; j <= i; ++j) {
        p[j] = std::exp(p[j] - m);
        l += p[j];
      }
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t j = j0; j <= i; ++j) cpu::axpy(p[j], v + j * hd, o.data(), hd);
      for (int64_t d = 0; d < hd; ++d) o[d] /= l;
      cpu::store_f32(out, (b * T + i) * nh * hd + h * hd, hd, o.data());
      lse_out[idx] = m + std::log(l);
    }
  }
}

void CpuBackend::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                    const Tensor& lse, const AttnShape& s) {
  const char* op = "attention_backward";
  cpu::check_attn(op, s, {"qkv", qkv});
  cpu::check_attn(op, s, {"dqkv", dqkv});
  cpu::check_float(op, {"dout", dout});
  cpu::check_float(op, {"out", out});
  cpu::check_dtype(op, {"lse", lse}, DType::F32);
  const int64_t B = s.B, T = s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  for (Named t : {Named{"dout", dout}, Named{"out", out}})
    if (cpu::rows(t.t) != B * T || t.t.cols() != nh * hd)
      cpu::fail(op, std::string(t.name) + " must be [B*T, n_heads*head_dim] for " + cpu::attn_str(s), {t});
  if (lse.numel() != B * nh * T)
    cpu::fail(op, "lse must be [B, n_heads, T] for " + cpu::attn_str(s), {{"lse", lse}});

  const Heads heads = unpack_heads(qkv, s);
  const int64_t group = nh / nkv;
  const float scale = softmax_scale(s.head_dim);
  const float* lse_in = lse.as<const float>();
  const int64_t cols = s.qkv_cols();
  const int32_t* pos = s.positions.empty() ? nullptr : s.positions.as<const int32_t>();
  const float* slopes = cpu::check_alibi(op, s);

  // dO head-major [B][nh][T][hd] and D = rowsum(dO * O) per (b, h, i)
  std::vector<float> dO(static_cast<size_t>(B * nh * T * hd)), D(static_cast<size_t>(B * nh * T));
  const int64_t work = B * nh * T * (T + 1) / 2 * hd;  // multiply-adds of one score pass
#pragma omp parallel if (B * T * nh * hd >= cpu::kMinParallelWork)
  {
    std::vector<float> dy_buf(static_cast<size_t>(nh * hd)), o_buf(static_cast<size_t>(nh * hd));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < B * T; ++n) {
      const int64_t b = n / T, i = n % T;
      const float* dy = cpu::read_f32(dout, n * nh * hd, nh * hd, dy_buf.data());
      const float* o = cpu::read_f32(out, n * nh * hd, nh * hd, o_buf.data());
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t idx = (b * nh + h) * T + i;
        std::copy(dy + h * hd, dy + (h + 1) * hd, dO.data() + idx * hd);
        D[idx] = cpu::dot(dy + h * hd, o + h * hd, hd);
      }
    }
  }

#pragma omp parallel if (work >= cpu::kMinParallelWork)
  {
    std::vector<float> acc(static_cast<size_t>(hd)), acc2(static_cast<size_t>(hd));
    // pass 1: dq_i, one (b, h, i) query row per iteration
#pragma omp for schedule(dynamic, 8)
    for (int64_t idx = 0; idx < B * nh * T; ++idx) {
      const int64_t b = idx / (nh * T), h = (idx / T) % nh, i = idx % T;
      const float* q = heads.q.data() + idx * hd;
      const float* dy = dO.data() + idx * hd;
      const float* k = heads.k.data() + (b * nkv + h / group) * T * hd;
      const float* v = heads.v.data() + (b * nkv + h / group) * T * hd;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = attention_first_key(pos ? pos + b * T : nullptr, i, s.window); j <= i; ++j) {
        const float p = prob(q, k + j * hd, hd, scale, cpu::alibi_bias(slopes, h, i, j), lse_in[idx]);
        const float ds = p * (cpu::dot(dy, v + j * hd, hd) - D[idx]);
        cpu::axpy(ds, k + j * hd, acc.data(), hd);
      }
      for (int64_t d = 0; d < hd; ++d) acc[d] *= scale;
      cpu::store_f32(dqkv, (b * T + i) * cols + h * hd, hd, acc.data());
    }
    // pass 2: dk_j and dv_j, one (b, kv head, j) key row per iteration; the group's query
    // heads in order, then i = j .. in order while i attends j
#pragma omp for schedule(dynamic, 8)
    for (int64_t kdx = 0; kdx < B * nkv * T; ++kdx) {
      const int64_t b = kdx / (nkv * T), kvh = (kdx / T) % nkv, j = kdx % T;
      const float* k = heads.k.data() + kdx * hd;
      const float* v = heads.v.data() + kdx * hd;
      std::fill(acc.begin(), acc.end(), 0.0f);   // dk
      std::fill(acc2.begin(), acc2.end(), 0.0f);  // dv
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        for (int64_t i = j; i < T && attention_first_key(pos ? pos + b * T : nullptr, i, s.window) <= j; ++i) {
          const int64_t idx = (b * nh + h) * T + i;
          const float* q = heads.q.data() + idx * hd;
          const float* dy = dO.data() + idx * hd;
          const float p = prob(q, k, hd, scale, cpu::alibi_bias(slopes, h, i, j), lse_in[idx]);
          cpu::axpy(p, dy, acc2.data(), hd);
          const float ds = p * (cpu::dot(dy, v, hd) - D[idx]);
          cpu::axpy(ds, q, acc.data(), hd);
        }
      }
      for (int64_t d = 0; d < hd; ++d) acc[d] *= scale;
      cpu::store_f32(dqkv, (b * T + j) * cols + (nh + kvh) * hd, hd, acc.data());
      cpu::store_f32(dqkv, (b * T + j) * cols + (nh + nkv + kvh) * hd, hd, acc2.data());
    }
  }
}

}  // namespace keel
