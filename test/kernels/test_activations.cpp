// GELU (tanh approximation) and SwiGLU.
#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

namespace {

double ref_gelu(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double ref_silu(double g) { return g / (1.0 + std::exp(-g)); }

}  // namespace

// Tolerance 2e-6 (relative): fp32 tanh/exp are within a couple of ulps and each formula adds
// about five fp32 roundings (6e-8 each).
TEST_CASE("gelu and swiglu forward match double references", "[activations]") {
  auto be = make_cpu_backend();
  const int64_t N = 33, F = 70;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(dt));
    HostTensor x = make(dt, {N, 2 * F}, randn(N * 2 * F, 1, 3.0f));  // wide range incl. saturation
    HostTensor g(DType::F32, {N, 2 * F});
    be->gelu_forward(g.t, x.t);
    std::vector<double> ref(N * 2 * F);
    for (int64_t i = 0; i < N * 2 * F; ++i) ref[i] = ref_gelu(x.at(i));
    CHECK(rel_error(g.values(), ref) < 2e-6);

    HostTensor s(DType::F32, {N, F});
    be->swiglu_forward(s.t, x.t);
    std::vector<double> sref(N * F);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < F; ++j) sref[n * F + j] = ref_silu(x.at(n * 2 * F + j)) * x.at(n * 2 * F + F + j);
    CHECK(rel_error(s.values(), sref) < 2e-6);
  }
}

// L = sum(out * R), h = 1/32. Each input moves exactly one output, so the fp32 noise is
// ~6e-8 * 1.5/h ~ 3e-6 relative; tolerance 1e-4.
TEST_CASE("gelu and swiglu backward match finite differences", "[activations][grad]") {
  auto be = make_cpu_backend();
  const int64_t N = 4, F = 9;
  HostTensor x = make(DType::F32, {N, 2 * F}, randn_grid(N * 2 * F, 10, 2.0f));

  HostTensor g(DType::F32, {N, 2 * F});
  const std::vector<float> rg = randn(N * 2 * F, 11);
  auto gelu_loss = [&] {
    be->gelu_forward(g.t, x.t);
    return dot_loss(g, to_double(rg));
  };
  HostTensor dg = make(DType::F32, {N, 2 * F}, rg), dx(DType::F32, {N, 2 * F});
  be->gelu_backward(dx.t, dg.t, x.t);
  CHECK(rel_error(to_double(dx.values()), numeric_grad(x.t.as<float>(), N * 2 * F, gelu_loss, kStepSmooth)) < 1e-4);

  HostTensor s(DType::F32, {N, F});
  const std::vector<float> rs = randn(N * F, 12);
  auto swiglu_loss = [&] {
    be->swiglu_forward(s.t, x.t);
    return dot_loss(s, to_double(rs));
  };
  HostTensor ds = make(DType::F32, {N, F}, rs);
  be->swiglu_backward(dx.t, ds.t, x.t);
  CHECK(rel_error(to_double(dx.values()), numeric_grad(x.t.as<float>(), N * 2 * F, swiglu_loss, kStepSmooth)) < 1e-4);
}

TEST_CASE("gelu backward may write in place over dout", "[activations]") {
  auto be = make_cpu_backend();
  const int64_t n = 50;
  HostTensor x = make(DType::F32, {n}, randn(n, 1));
  HostTensor d = make(DType::F32, {n}, randn(n, 2)), expect(DType::F32, {n});
  be->gelu_backward(expect.t, d.t, x.t);
  be->gelu_backward(d.t, d.t, x.t);
  CHECK(d.values() == expect.values());
}
