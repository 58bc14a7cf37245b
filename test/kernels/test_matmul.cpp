// matmul (all transpose combinations, bias, accumulate) and bias_backward.
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstdio>

#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

namespace {

// Stored shapes: a is [M,K] or [K,M] (trans_a), b is [K,N] or [N,K] (trans_b).
HostTensor make_a(DType dt, int64_t M, int64_t K, bool ta, const std::vector<float>& v) {
  return ta ? make(dt, {K, M}, v) : make(dt, {M, K}, v);
}
HostTensor make_b(DType dt, int64_t K, int64_t N, bool tb, const std::vector<float>& v) {
  return tb ? make(dt, {N, K}, v) : make(dt, {K, N}, v);
}

// Naive double reference: out[i][j] = sum_k op(a)[i][k] op(b)[k][j]
std::vector<double> ref_matmul(const HostTensor& a, const HostTensor& b, int64_t M, int64_t N, int64_t K, bool ta,
                               bool tb) {
  const std::vector<float> av = a.values(), bv = b.values();
  std::vector<double> opa(static_cast<size_t>(M * K)), opb(static_cast<size_t>(K * N));  // [M,K], [N,K]
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) opa[i * K + k] = av[ta ? k * M + i : i * K + k];
  for (int64_t j = 0; j < N; ++j)
    for (int64_t k = 0; k < K; ++k) opb[j * K + k] = bv[tb ? j * K + k : k * N + j];
  std::vector<double> out(static_cast<size_t>(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += opa[i * K + k] * opb[j * K + k];
      out[i * N + j] = s;
    }
  return out;
}

}  // namespace

// Tolerance 1e-5 (relative, Euclidean): each output is an fp32 sum of K products, whose rounding
// error grows like sqrt(K) * 6e-8 (~1.5e-6 at K = 600); the old value and bias add one rounding.
TEST_CASE("matmul forward matches a double reference", "[matmul]") {
  auto be = make_cpu_backend();
  struct Size {
    int64_t M, N, K;
  };
  // the large size spans several row/column tasks and k blocks (kKC = 256) and ragged edges
  for (Size sz : {Size{37, 45, 70}, Size{150, 300, 600}, Size{1, 1, 1}, Size{3, 70, 5}})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (DType in_dt : {DType::F32, DType::BF16}) {
          const int64_t M = sz.M, N = sz.N, K = sz.K;
          CAPTURE(M, N, K, ta, tb, dtype_name(in_dt));
          HostTensor a = make_a(in_dt, M, K, ta, randn(M * K, 1));
          HostTensor b = make_b(in_dt, K, N, tb, randn(K * N, 2));
          HostTensor bias = make(DType::F32, {N}, randn(N, 3));
          const std::vector<float> old = randn(M * N, 4);
          HostTensor out = make(DType::F32, {M, N}, old);
          const std::vector<double> prod = ref_matmul(a, b, M, N, K, ta, tb);

          be->matmul(out.t, a.t, b.t, ta, tb);
          CHECK(rel_error(out.values(), prod) < 1e-5);

          std::vector<double> expect(prod);
          for (int64_t i = 0; i < M * N; ++i) expect[i] += old[i] + bias.at(i % N);
          out.set(old);
          be->matmul(out.t, a.t, b.t, ta, tb, /*accumulate=*/true, &bias.t);
          CHECK(rel_error(out.values(), expect) < 1e-5);
        }
}

TEST_CASE("matmul with K = 0 gives bias, or leaves out unchanged when accumulating", "[matmul]") {
  auto be = make_cpu_backend();
  HostTensor a(DType::F32, {3, 0}), b(DType::F32, {0, 4});
  HostTensor bias = make(DType::F32, {4}, {1, 2, 3, 4});
  HostTensor out = make(DType::F32, {3, 4}, randn(12, 5));
  be->matmul(out.t, a.t, b.t, false, false, false, &bias.t);
  for (int64_t i = 0; i < 12; ++i) CHECK(out.at(i) == bias.at(i % 4));
  const std::vector<float> old = randn(12, 6);
  out.set(old);
  be->matmul(out.t, a.t, b.t, false, false, true);
  CHECK(out.values() == old);
}

// Backward of out = op(a) op(b) (L = sum(out * R)) through matmul itself, for every transpose
// combination, accumulating into non-zero gradient buffers. Finite differences with h = 1 (L is
// linear in every input, so there is no truncation error); the fp32 noise of the outputs gives
// ~3e-7 relative error, hence the tolerance of 1e-5.
TEST_CASE("matmul gradients (all transposes, accumulate) match finite differences", "[matmul][grad]") {
  auto be = make_cpu_backend();
  const int64_t M = 5, N = 6, K = 7;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      CAPTURE(ta, tb);
      HostTensor a = make_a(DType::F32, M, K, ta, randn_grid(M * K, 10));
      HostTensor b = make_b(DType::F32, K, N, tb, randn_grid(K * N, 11));
      HostTensor bias = make(DType::F32, {N}, randn_grid(N, 12));
      HostTensor out(DType::F32, {M, N});
      const std::vector<float> r = randn(M * N, 13);
      HostTensor R = make(DType::F32, {M, N}, r);
      auto loss = [&] {
        be->matmul(out.t, a.t, b.t, ta, tb, false, &bias.t);
        return dot_loss(out, to_double(r));
      };

      // gradients, added to buffers that already hold g0
      const std::vector<float> g0a = randn(M * K, 14), g0b = randn(K * N, 15);
      HostTensor da = make_a(DType::F32, M, K, ta, g0a), db = make_b(DType::F32, K, N, tb, g0b);
      HostTensor dbias = make(DType::F32, {N}, std::vector<float>(N, 0.5f));
      if (!ta)
        be->matmul(da.t, R.t, b.t, false, !tb, true);  // dA = R op(b)^T
      else
        be->matmul(da.t, b.t, R.t, tb, true, true);    // dA^T = op(b) R^T
      if (!tb)
        be->matmul(db.t, a.t, R.t, !ta, false, true);  // dB = op(a)^T R
      else
        be->matmul(db.t, R.t, a.t, true, ta, true);    // dB^T = R^T op(a)
      be->bias_backward(dbias.t, R.t, true);

      auto added = [](const HostTensor& g, const std::vector<float>& g0) {
        std::vector<double> d(g0.size());
        for (size_t i = 0; i < g0.size(); ++i) d[i] = static_cast<double>(g.at(i)) - g0[i];
        return d;
      };
      const auto fd_a = numeric_grad(a.t.as<float>(), M * K, loss, kStepLinear);
      const auto fd_b = numeric_grad(b.t.as<float>(), K * N, loss, kStepLinear);
      const auto fd_bias = numeric_grad(bias.t.as<float>(), N, loss, kStepLinear);
      CHECK(rel_error(added(da, g0a), fd_a) < 1e-5);
      CHECK(rel_error(added(db, g0b), fd_b) < 1e-5);
      CHECK(rel_error(added(dbias, std::vector<float>(N, 0.5f)), fd_bias) < 1e-5);
    }
}

// bias_backward: dbias = (or +=) column sums. 300 rows span several 64-row blocks. Tolerance
// 1e-6: an fp32 sum of 300 O(1) values (blocked) has rounding error of a few 1e-7 relative at most.
TEST_CASE("bias_backward sums rows into dbias", "[matmul]") {
  auto be = make_cpu_backend();
  const int64_t rows = 300, N = 19;
  for (DType dt : {DType::F32, DType::BF16})
    for (bool accumulate : {true, false}) {
      CAPTURE(accumulate);
      HostTensor dout = make(dt, {3, 100, N}, randn(rows * N, 20));
      // Written over NaN when not accumulating: an element left unwritten shows.
      const std::vector<float> g0 = accumulate ? randn(N, 21) : std::vector<float>(N, std::nanf(""));
      HostTensor dbias = make(DType::F32, {N}, g0);
      be->bias_backward(dbias.t, dout.t, accumulate);
      std::vector<double> expect(N);
      for (int64_t c = 0; c < N; ++c) {
        expect[c] = accumulate ? g0[c] : 0.0;
        for (int64_t n = 0; n < rows; ++n) expect[c] += dout.at(n * N + c);
      }
      CHECK(rel_error(dbias.values(), expect) < 1e-6);
    }
}

// The reference matmul_residual is the composition it replaces in the Transformer: the
// projection rounded to out's dtype, then the add, so a CPU run's bits do not depend on whether
// the layer calls it or the two ops. Checked against a double reference too, at the bf16
// tolerance of two roundings.
TEST_CASE("matmul_residual is matmul then add, and refuses a residual aliasing out", "[matmul]") {
  auto be = make_cpu_backend();
  const int64_t M = 37, N = 24, K = 50;
  for (DType dt : {DType::F32, DType::BF16})
    for (bool bias : {false, true}) {
      CAPTURE(dtype_name(dt), bias);
      HostTensor a = make(dt, {M, K}, randn(M * K, 30)), w = make(dt, {N, K}, randn(N * K, 31, 0.3f));
      HostTensor b = make(dt, {N}, randn(N, 32)), res = make(dt, {M, N}, randn(M * N, 33, 2.0f));
      HostTensor got = make(dt, {M, N}, std::vector<float>(M * N, std::nanf("")));
      HostTensor proj = make(dt, {M, N}, std::vector<float>(M * N, std::nanf("")));
      HostTensor composed = make(dt, {M, N}, std::vector<float>(M * N, std::nanf("")));
      be->matmul_residual(got.t, res.t, a.t, w.t, false, true, bias ? &b.t : nullptr);
      be->matmul(proj.t, a.t, w.t, false, true, false, bias ? &b.t : nullptr);
      be->add(composed.t, res.t, proj.t);
      CHECK(bits_differ(got, composed) == 0);
      std::vector<double> expect = ref_matmul(a, w, M, N, K, false, true);
      for (int64_t i = 0; i < M * N; ++i) expect[i] += res.at(i) + (bias ? b.at(i % N) : 0.0);
      CHECK(rel_error(got.values(), expect) < (dt == DType::F32 ? 1e-6 : 8e-3));
      CHECK(bits_differ(res, make(dt, {M, N}, randn(M * N, 33, 2.0f))) == 0);  // read, not written
    }
  HostTensor x = make(DType::F32, {4, 16}, randn(64, 1)), a = make(DType::F32, {4, 8}, randn(32, 2)),
             w = make(DType::F32, {16, 8}, randn(128, 3));
  CHECK_THROWS_WITH(be->matmul_residual(x.t, x.t, a.t, w.t, false, true),
                    Catch::Contains("matmul_residual") && Catch::Contains("different buffers") &&
                        Catch::Contains("residual=[4, 16] f32"));
}

// The reference matmul_bias_grad is the two ops it stands for (a CPU run's bits do not depend on
// whether the layer calls it or them), in both modes: stored over NaN, and added.
TEST_CASE("matmul_bias_grad is matmul then bias_backward", "[matmul]") {
  auto be = make_cpu_backend();
  const int64_t R = 150, O = 24, I = 40;
  for (DType dt : {DType::F32, DType::BF16})
    for (bool accumulate : {false, true}) {
      CAPTURE(dtype_name(dt), accumulate);
      HostTensor dout = make(dt, {R, O}, randn(R * O, 40)), in = make(dt, {R, I}, randn(R * I, 41));
      const std::vector<float> w0 = accumulate ? randn(O * I, 42) : std::vector<float>(O * I, std::nanf(""));
      const std::vector<float> b0 = accumulate ? randn(O, 43) : std::vector<float>(O, std::nanf(""));
      HostTensor dw = make(DType::F32, {O, I}, w0), db = make(DType::F32, {O}, b0);
      HostTensor dw_ref = make(DType::F32, {O, I}, w0), db_ref = make(DType::F32, {O}, b0);
      be->matmul_bias_grad(dw.t, db.t, dout.t, in.t, accumulate, accumulate);
      be->matmul(dw_ref.t, dout.t, in.t, true, false, accumulate);
      be->bias_backward(db_ref.t, dout.t, accumulate);
      CHECK(bits_differ(dw, dw_ref) == 0);
      CHECK(bits_differ(db, db_ref) == 0);
      CHECK(std::isfinite(db.values()[0]));
    }
}
