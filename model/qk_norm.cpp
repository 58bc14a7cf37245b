#include "model/qk_norm.h"

namespace keel {

namespace {
// Rows [0, q_rows) hold the q heads, the rest the k heads.
int64_t q_rows(const AttnShape& s) { return static_cast<int64_t>(s.B) * s.T * s.n_heads; }
int64_t all_rows(const AttnShape& s) { return static_cast<int64_t>(s.B) * s.T * (s.n_heads + s.n_kv_heads); }
}  // namespace

void qk_norm_forward(Backend& be, const Tensor& qkv, const AttnShape& s, const Tensor& q_w, const Tensor& k_w,
                     float eps, const QkNormBuffers& b) {
  const int64_t nq = q_rows(s), n = all_rows(s);
  be.qk_heads_copy(b.in, qkv, s, true);
  be.rmsnorm_forward(b.scratch.row_slice(0, nq), b.rstd.elements(0, nq), b.in.row_slice(0, nq), q_w, eps);
  be.rmsnorm_forward(b.scratch.row_slice(nq, n), b.rstd.elements(nq, n), b.in.row_slice(nq, n), k_w, eps);
  be.qk_heads_copy(b.scratch, qkv, s, false);
}

void qk_norm_backward(Backend& be, const Tensor& dqkv, const AttnShape& s, const Tensor& q_w, const Tensor& k_w,
                      const Tensor& dq_w, const Tensor& dk_w, const QkNormBuffers& b, bool accumulate) {
  const int64_t nq = q_rows(s), n = all_rows(s);
  be.qk_heads_copy(b.scratch, dqkv, s, true);
  be.rmsnorm_backward(b.dscratch.row_slice(0, nq), dq_w, b.scratch.row_slice(0, nq), b.in.row_slice(0, nq), q_w,
                      b.rstd.elements(0, nq), false, accumulate);
  be.rmsnorm_backward(b.dscratch.row_slice(nq, n), dk_w, b.scratch.row_slice(nq, n), b.in.row_slice(nq, n), k_w,
                      b.rstd.elements(nq, n), false, accumulate);
  be.qk_heads_copy(b.dscratch, dqkv, s, false);
}

}  // namespace keel
