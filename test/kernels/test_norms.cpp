// layernorm and rmsnorm: forward against double references, backward against finite differences.
#include <cmath>

#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

namespace {
const float kNaN = std::nanf("");

constexpr float kEps = 1e-5f;

struct NormRef {
  std::vector<double> out, mean, rstd;
};

// Double reference; rms selects RMSNorm (no mean, no bias).
NormRef ref_norm(const HostTensor& in, const HostTensor& w, const HostTensor* b, int64_t N, int64_t C, bool rms) {
  NormRef r;
  for (int64_t n = 0; n < N; ++n) {
    double mean = 0, var = 0;
    if (!rms) {
      for (int64_t c = 0; c < C; ++c) mean += in.at(n * C + c);
      mean /= C;
    }
    for (int64_t c = 0; c < C; ++c) var += (in.at(n * C + c) - mean) * (in.at(n * C + c) - mean);
    var /= C;
    const double rstd = 1.0 / std::sqrt(var + kEps);
    for (int64_t c = 0; c < C; ++c)
      r.out.push_back((in.at(n * C + c) - mean) * rstd * w.at(c) + (b ? b->at(c) : 0.0));
    r.mean.push_back(mean);
    r.rstd.push_back(rstd);
  }
  return r;
}

// din - din0 (what backward added when accumulating)
std::vector<double> minus(const HostTensor& g, const std::vector<float>& g0) {
  std::vector<double> d(g0.size());
  for (size_t i = 0; i < g0.size(); ++i) d[i] = static_cast<double>(g.at(i)) - g0[i];
  return d;
}

}  // namespace

// Tolerance 2e-6 (relative): each output is a handful of fp32 operations after sums over C
// values, i.e. a few units of 6e-8 times sqrt(C).
TEST_CASE("layernorm and rmsnorm forward match double references", "[norms]") {
  auto be = make_cpu_backend();
  const int64_t N = 70, C = 40;  // N > 64: more than one row block
  for (DType dt : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dt));
    HostTensor in = make(dt, {7, 10, C}, randn(N * C, 1, 2.0f));
    for (int64_t i = 0; i < N * C; ++i) in.put(i, in.at(i) + 0.5f);  // non-zero mean
    HostTensor w = make(dt, {C}, randn(C, 2));
    HostTensor b = make(dt, {C}, randn(C, 3));
    HostTensor out(DType::F32, {7, 10, C}), mean(DType::F32, {N}), rstd(DType::F32, {N});

    be->layernorm_forward(out.t, mean.t, rstd.t, in.t, w.t, b.t, kEps);
    NormRef ln = ref_norm(in, w, &b, N, C, false);
    CHECK(rel_error(out.values(), ln.out) < 2e-6);
    CHECK(rel_error(mean.values(), ln.mean) < 2e-6);
    CHECK(rel_error(rstd.values(), ln.rstd) < 2e-6);

    be->rmsnorm_forward(out.t, rstd.t, in.t, w.t, kEps);
    NormRef rms = ref_norm(in, w, nullptr, N, C, true);
    CHECK(rel_error(out.values(), rms.out) < 2e-6);
    CHECK(rel_error(rstd.values(), rms.rstd) < 2e-6);
  }
}

// L = sum(out * R). Tolerances: 1e-4 for din (nonlinear, h = 1/32: perturbing one input moves the
// C = 16 outputs of its row, fp32 noise ~sqrt(16) * 6e-8 * 1.5/h ~ 1e-5 relative); 1e-5 for
// dweight and dbias (L is linear in them, h = 1, noise ~1e-7).
TEST_CASE("layernorm backward matches finite differences", "[norms][grad]") {
  auto be = make_cpu_backend();
  const int64_t N = 6, C = 16;
  for (bool accumulate : {false, true}) {
    CAPTURE(accumulate);
    HostTensor in = make(DType::F32, {N, C}, randn_grid(N * C, 10));
    HostTensor w = make(DType::F32, {C}, randn_grid(C, 11));
    HostTensor b = make(DType::F32, {C}, randn_grid(C, 12));
    HostTensor out(DType::F32, {N, C}), mean(DType::F32, {N}), rstd(DType::F32, {N});
    const std::vector<float> r = randn(N * C, 13);
    auto loss = [&] {
      be->layernorm_forward(out.t, mean.t, rstd.t, in.t, w.t, b.t, kEps);
      return dot_loss(out, to_double(r));
    };
    loss();
    HostTensor dout = make(DType::F32, {N, C}, r);
    const std::vector<float> din0 = accumulate ? randn(N * C, 14) : std::vector<float>(N * C, 0.0f);
    const std::vector<float> dw0 = accumulate ? randn(C, 15) : std::vector<float>(C, 0.0f);
    const std::vector<float> db0 = accumulate ? randn(C, 16) : std::vector<float>(C, 0.0f);
    // Garbage where written (NaN for the parameter gradients: one left unwritten shows).
    HostTensor din = make(DType::F32, {N, C}, accumulate ? din0 : randn(N * C, 17));
    HostTensor dw = make(DType::F32, {C}, accumulate ? dw0 : std::vector<float>(C, kNaN));
    HostTensor db = make(DType::F32, {C}, accumulate ? db0 : std::vector<float>(C, kNaN));
    be->layernorm_backward(din.t, dw.t, db.t, dout.t, in.t, w.t, mean.t, rstd.t, accumulate, accumulate);

    CHECK(rel_error(minus(din, din0), numeric_grad(in.t.as<float>(), N * C, loss, kStepSmooth)) < 1e-4);
    CHECK(rel_error(minus(dw, dw0), numeric_grad(w.t.as<float>(), C, loss, kStepLinear)) < 1e-5);
    CHECK(rel_error(minus(db, db0), numeric_grad(b.t.as<float>(), C, loss, kStepLinear)) < 1e-5);
  }
}

TEST_CASE("rmsnorm backward matches finite differences", "[norms][grad]") {
  auto be = make_cpu_backend();
  const int64_t N = 6, C = 16;
  for (bool accumulate : {false, true}) {
    CAPTURE(accumulate);
    HostTensor in = make(DType::F32, {N, C}, randn_grid(N * C, 20));
    HostTensor w = make(DType::F32, {C}, randn_grid(C, 21));
    HostTensor out(DType::F32, {N, C}), rstd(DType::F32, {N});
    const std::vector<float> r = randn(N * C, 23);
    auto loss = [&] {
      be->rmsnorm_forward(out.t, rstd.t, in.t, w.t, kEps);
      return dot_loss(out, to_double(r));
    };
    loss();
    HostTensor dout = make(DType::F32, {N, C}, r);
    const std::vector<float> din0 = accumulate ? randn(N * C, 24) : std::vector<float>(N * C, 0.0f);
    const std::vector<float> dw0 = accumulate ? randn(C, 25) : std::vector<float>(C, 0.0f);
    HostTensor din = make(DType::F32, {N, C}, accumulate ? din0 : randn(N * C, 27));
    HostTensor dw = make(DType::F32, {C}, accumulate ? dw0 : std::vector<float>(C, kNaN));
    be->rmsnorm_backward(din.t, dw.t, dout.t, in.t, w.t, rstd.t, accumulate, accumulate);

    CHECK(rel_error(minus(din, din0), numeric_grad(in.t.as<float>(), N * C, loss, kStepSmooth)) < 1e-4);
    CHECK(rel_error(minus(dw, dw0), numeric_grad(w.t.as<float>(), C, loss, kStepLinear)) < 1e-5);
  }
}

// Parameter gradients over many rows (several 64-row blocks) against a double reference of
// dw = sum_n dy * xhat, db = sum_n dy. Tolerance 1e-5: fp32 sums of 300 terms.
TEST_CASE("norm parameter gradients over many rows match double sums", "[norms]") {
  auto be = make_cpu_backend();
  const int64_t N = 300, C = 24;
  HostTensor in = make(DType::F32, {N, C}, randn(N * C, 30));
  HostTensor w = make(DType::F32, {C}, randn(C, 31)), b = make(DType::F32, {C}, randn(C, 32));
  HostTensor dout = make(DType::F32, {N, C}, randn(N * C, 33));
  HostTensor out(DType::F32, {N, C}), mean(DType::F32, {N}), rstd(DType::F32, {N}), din(DType::F32, {N, C});
  HostTensor dw = make(DType::F32, {C}, std::vector<float>(C, kNaN));
  HostTensor db = make(DType::F32, {C}, std::vector<float>(C, kNaN));
  be->layernorm_forward(out.t, mean.t, rstd.t, in.t, w.t, b.t, kEps);
  be->layernorm_backward(din.t, dw.t, db.t, dout.t, in.t, w.t, mean.t, rstd.t, false, false);  // written over NaN
  const NormRef ref = ref_norm(in, w, &b, N, C, false);
  std::vector<double> dw_ref(C, 0.0), db_ref(C, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (in.at(n * C + c) - ref.mean[n]) * ref.rstd[n];
      dw_ref[c] += dout.at(n * C + c) * xhat;
      db_ref[c] += dout.at(n * C + c);
    }
  CHECK(rel_error(dw.values(), dw_ref) < 1e-5);
  CHECK(rel_error(db.values(), db_ref) < 1e-5);
}
