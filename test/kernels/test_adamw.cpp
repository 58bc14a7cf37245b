// AdamW: PyTorch's formula step by step, the fp32-master mode and the unsafe bf16-only mode.
#include "kernel_test_util.h"

// The hand computation below must round every product and sum to fp32 on its own, as PyTorch's
// elementwise kernels do (the backend's adamw.cpp does the same).
#include "kernels/fp_contract_off.h"  // last: no fused multiply-add below

using namespace keel;
using namespace keel::test;

namespace {

// One torch.optim.AdamW step (single-tensor path) on fp32 values:
//   param.mul_(1 - lr * wd); exp_avg = b1 m + (1 - b1) g; exp_avg_sq = b2 v + (1 - b2) g g
//   denom = (exp_avg_sq.sqrt() / sqrt(bias_correction2)).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
// Python-float scalars are formed in double, then used as fp32 in the tensor ops.
void hand_adamw(std::vector<float>& p, const std::vector<float>& grad, std::vector<float>& m, std::vector<float>& v,
                const AdamWParams& hp) {
  const float decay = static_cast<float>(1.0 - static_cast<double>(hp.lr) * hp.weight_decay);
  const double bc1 = 1.0 - std::pow(static_cast<double>(hp.beta1), static_cast<double>(hp.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(hp.beta2), static_cast<double>(hp.step));
  const float step_size = static_cast<float>(hp.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float one_minus_b1 = static_cast<float>(1.0 - static_cast<double>(hp.beta1));
  const float one_minus_b2 = static_cast<float>(1.0 - static_cast<double>(hp.beta2));
  for (size_t i = 0; i < p.size(); ++i) {
    const float g = grad[i] * hp.grad_scale;
    p[i] = p[i] * decay;
    m[i] = hp.beta1 * m[i] + one_minus_b1 * g;
    v[i] = hp.beta2 * v[i] + one_minus_b2 * g * g;
    const float denom = std::sqrt(v[i]) / bc2_sqrt + hp.eps;
    p[i] = p[i] - (step_size * m[i]) / denom;
  }
}

}  // namespace

// Bit-exact: both sides perform the same fp32 operations in the same order.
TEST_CASE("adamw matches a hand computation of PyTorch's AdamW step", "[adamw]") {
  auto be = make_cpu_backend();
  const int64_t n = 1000;
  const std::vector<float> p0 = randn(n, 1, 0.1f);
  AdamWParams hp;
  hp.lr = 3e-3f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;
  hp.grad_scale = 0.5f;

  std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f);
  HostTensor master = make(DType::F32, {n}, p0), working = make(DType::BF16, {n}, p0);
  HostTensor alias = make(DType::F32, {n}, p0);                               // working == master
  HostTensor unsafe32 = make(DType::F32, {n}, p0);                            // empty master, fp32
  HostTensor mt(DType::F32, {n}), vt(DType::F32, {n}), ma(DType::F32, {n}), va(DType::F32, {n});
  HostTensor mu(DType::F32, {n}), vu(DType::F32, {n});
  for (int64_t step = 1; step <= 3; ++step) {
    CAPTURE(step);
    hp.step = step;
    const std::vector<float> g = randn(n, 10 + static_cast<uint32_t>(step));
    HostTensor grad = make(DType::F32, {n}, g);
    hand_adamw(p, g, m, v, hp);
    be->adamw(master.t, working.t, grad.t, mt.t, vt.t, hp);
    be->adamw(alias.t, alias.t, grad.t, ma.t, va.t, hp);
    be->adamw(Tensor(), unsafe32.t, grad.t, mu.t, vu.t, hp);
    CHECK(master.values() == p);
    CHECK(mt.values() == m);
    CHECK(vt.values() == v);
    CHECK(alias.values() == p);
    CHECK(unsafe32.values() == p);
    int not_rounded = 0;
    for (int64_t i = 0; i < n; ++i) not_rounded += working.at(i) != round_to(DType::BF16, p[i]);
    CHECK(not_rounded == 0);
  }
  // and the formula itself, in double: relative 1e-6 (three steps of a few fp32 roundings each)
  std::vector<double> pd(p0.begin(), p0.end()), md(n, 0.0), vd(n, 0.0);
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = randn(n, 10 + static_cast<uint32_t>(step));
    for (int64_t i = 0; i < n; ++i) {
      const double gi = static_cast<double>(g[i]) * hp.grad_scale;
      pd[i] *= 1.0 - static_cast<double>(hp.lr) * hp.weight_decay;
      md[i] = hp.beta1 * md[i] + (1.0 - hp.beta1) * gi;
      vd[i] = hp.beta2 * vd[i] + (1.0 - hp.beta2) * gi * gi;
      const double mhat = md[i] / (1.0 - std::pow(static_cast<double>(hp.beta1), step));
      const double vhat = vd[i] / (1.0 - std::pow(static_cast<double>(hp.beta2), step));
      pd[i] -= hp.lr * mhat / (std::sqrt(vhat) + hp.eps);
    }
  }
  CHECK(rel_error(master.values(), pd) < 1e-6);
}

// A norm gain at 1.0 taking updates of ~1e-4 (lr = 1e-4, constant gradient, so m_hat/sqrt(v_hat)
// = 1): in bf16 only (empty master) every update rounds away and the value stays exactly 1.0;
// with an fp32 master the master moves by ~1e-4 per step and the bf16 copy follows as soon as
// the master is below 1 - 2^-9 (half the bf16 spacing below 1.0, which is 2^-8).
TEST_CASE("adamw: bf16-only parameters freeze, fp32 masters move", "[adamw]") {
  auto be = make_cpu_backend();
  const int64_t n = 8;
  AdamWParams hp;
  hp.lr = 1e-4f;
  HostTensor grad = make(DType::F32, {n}, std::vector<float>(n, 0.01f));
  HostTensor unsafe = make(DType::BF16, {n}, std::vector<float>(n, 1.0f));
  HostTensor master = make(DType::F32, {n}, std::vector<float>(n, 1.0f));
  HostTensor working = make(DType::BF16, {n}, std::vector<float>(n, 1.0f));
  HostTensor m1(DType::F32, {n}), v1(DType::F32, {n}), m2(DType::F32, {n}), v2(DType::F32, {n});
  bool moved = false;
  for (int64_t step = 1; step <= 40; ++step) {
    CAPTURE(step);
    hp.step = step;
    be->adamw(Tensor(), unsafe.t, grad.t, m1.t, v1.t, hp);
    be->adamw(master.t, working.t, grad.t, m2.t, v2.t, hp);
    for (int64_t i = 0; i < n; ++i) {
      CHECK(unsafe.at(i) == 1.0f);
      CHECK(master.at(i) == Approx(1.0 - step * 1e-4).epsilon(1e-5));
      const float expect = master.at(i) < 1.0f - std::ldexp(1.0f, -9) ? 1.0f - std::ldexp(1.0f, -8) : 1.0f;
      CHECK(working.at(i) == expect);
    }
    moved |= working.at(0) != 1.0f;
  }
  CHECK(moved);
}

// Stochastic rounding of the bf16 working copy (lr 0: the master stays where it is, so the
// working copy is the master rounded once per call). The tolerances are 5 standard deviations
// of the binomial counts: a correct implementation fails them about once in 10^6 runs, and the
// bits are a fixed function of the seed, so a pass is a pass for good.
TEST_CASE("adamw: stochastic rounding of bf16 working copies is unbiased, reproducible and split-invariant",
          "[adamw][stochastic]") {
  auto be = make_cpu_backend();
  const int64_t n = 40000;
  AdamWParams hp;
  hp.lr = 0;
  hp.step = 7;
  hp.stochastic_rounding = true;
  hp.rounding_seed = 99;
  auto run = [&](const HostTensor& master, int64_t step, int64_t split) {
    HostTensor working(DType::BF16, {n}), grad(DType::F32, {n}), m(DType::F32, {n}), v(DType::F32, {n});
    AdamWParams p = hp;
    p.step = step;
    for (int64_t begin = 0; begin < n; begin += split) {  // calls over [begin, begin + split)
      const int64_t len = std::min(split, n - begin);
      auto part = [&](const HostTensor& t) { return Tensor(static_cast<char*>(t.t.data) + begin * dtype_size(t.t.dtype), t.t.dtype, {len}, Device::CPU); };
      p.rounding_index0 = begin;
      be->adamw(part(master), part(working), part(grad), part(m), part(v), p);
    }
    return working;
  };

  SECTION("a quarter of a spacing above 1.0 rounds up a quarter of the time; so does its negative") {
    // 1 + 2^-9 is a quarter of bf16's spacing 2^-7 above 1.0: round-to-nearest always gives 1.0.
    for (float sign : {1.0f, -1.0f}) {
      const float x = sign * (1.0f + std::ldexp(1.0f, -9)), up = sign * (1.0f + std::ldexp(1.0f, -7));
      HostTensor master = make(DType::F32, {n}, std::vector<float>(n, x));
      const HostTensor w = run(master, 7, n);
      int64_t ups = 0, other = 0;
      for (int64_t i = 0; i < n; ++i) {
        ups += w.at(i) == up;
        other += w.at(i) != up && w.at(i) != sign;
      }
      CHECK(other == 0);
      const double sd = std::sqrt(n * 0.25 * 0.75);
      CHECK(std::abs(static_cast<double>(ups) - 0.25 * n) < 5 * sd);
      CHECK(master.at(0) == x);  // the master itself is untouched
    }
  }

  SECTION("random values: always a bf16 neighbour, the mean error is zero within noise") {
    const std::vector<float> values = randn(n, 5, 3.0f);
    HostTensor master = make(DType::F32, {n}, values);
    const HostTensor w = run(master, 7, n);
    double bias = 0, spacing = 0;
    int64_t not_neighbour = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = std::bit_cast<uint32_t>(values[i]);
      const float lo = std::bit_cast<float>(bits & 0xffff0000u), hi = std::bit_cast<float>((bits & 0xffff0000u) + 0x10000u);
      not_neighbour += w.at(i) != lo && w.at(i) != hi;
      bias += static_cast<double>(w.at(i)) - values[i];
      spacing += std::abs(static_cast<double>(hi) - lo);
    }
    CHECK(not_neighbour == 0);
    // Each error is uniform-ish within one spacing (sd <= spacing / 2): the mean over n is
    // within 5 sd / sqrt(n) of zero when unbiased.
    CHECK(std::abs(bias) / spacing < 2.5 / std::sqrt(static_cast<double>(n)));
  }

  SECTION("the same seed and step give the same bits however the tensor is split; another step does not") {
    HostTensor master = make(DType::F32, {n}, randn(n, 6, 1.0f));
    const HostTensor whole = run(master, 7, n);
    CHECK(bits_differ(run(master, 7, n), whole) == 0);
    CHECK(bits_differ(run(master, 7, 1000), whole) == 0);
    CHECK(bits_differ(run(master, 7, 333), whole) == 0);
    CHECK(bits_differ(run(master, 8, n), whole) > n / 10);  // a fresh draw per step
  }

  SECTION("inf and NaN round to nearest; fp16 and fp32 working copies ignore the option") {
    std::vector<float> special(n, 1.5f);
    special[0] = INFINITY;
    special[1] = -INFINITY;
    special[2] = NAN;
    HostTensor master = make(DType::F32, {n}, special);
    const HostTensor w = run(master, 7, n);
    CHECK(w.at(0) == INFINITY);
    CHECK(w.at(1) == -INFINITY);
    CHECK(std::isnan(w.at(2)));
    HostTensor m(DType::F32, {n}), v(DType::F32, {n}), grad(DType::F32, {n});
    HostTensor rnd = make(DType::F32, {n}, randn(n, 8, 1.0f)), f16(DType::F16, {n});
    be->adamw(rnd.t, f16.t, grad.t, m.t, v.t, hp);
    int not_nearest = 0;
    for (int64_t i = 0; i < n; ++i) not_nearest += f16.at(i) != round_to(DType::F16, rnd.at(i));
    CHECK(not_nearest == 0);
  }
}

// One call with runs of weight decay updates each run as a call of its own would (and the runs'
// decays, not weight_decay, apply); ends that do not ascend to the element count are refused,
// naming the run.
TEST_CASE("adamw: decay runs give each run the bits of its own call, bad runs are named", "[adamw]") {
  auto be = make_cpu_backend();
  const int64_t n = 3000;
  const std::vector<AdamWDecayRun> runs = {{700, 0.1f}, {701, 0.0f}, {2000, 0.1f}, {3000, 0.0f}};
  AdamWParams p;
  p.lr = 1e-2f;
  p.step = 2;
  p.weight_decay = 0.5f;  // overridden by the runs
  // Two copies of one starting state: masters, bf16 working copies, zero moments.
  HostTensor grad(DType::F32, {n});
  HostTensor master(DType::F32, {n}), w(DType::BF16, {n}), m(DType::F32, {n}), v(DType::F32, {n});
  HostTensor one(DType::F32, {n}), one_w(DType::BF16, {n}), one_m(DType::F32, {n}), one_v(DType::F32, {n});
  for (int64_t i = 0; i < n; ++i) {
    master.put(i, 1.0f + 0.001f * static_cast<float>(i % 97));
    one.put(i, master.at(i));
    grad.put(i, 0.01f * static_cast<float>(i % 13) - 0.05f);
  }
  AdamWParams q = p;
  q.decay_runs = runs;
  be->adamw(one.t, one_w.t, grad.t, one_m.t, one_v.t, q);
  int64_t begin = 0;
  for (const AdamWDecayRun& r : runs) {
    auto part = [&](HostTensor& t) {
      return Tensor(static_cast<char*>(t.t.data) + begin * dtype_size(t.t.dtype), t.t.dtype, {r.end - begin});
    };
    AdamWParams single = p;
    single.weight_decay = r.weight_decay;
    be->adamw(part(master), part(w), part(grad), part(m), part(v), single);
    begin = r.end;
  }
  for (int64_t i = 0; i < n; ++i) {
    INFO("element " << i);
    REQUIRE(std::bit_cast<uint32_t>(one.at(i)) == std::bit_cast<uint32_t>(master.at(i)));
    REQUIRE(std::bit_cast<uint32_t>(one_m.at(i)) == std::bit_cast<uint32_t>(m.at(i)));
    REQUIRE(std::bit_cast<uint32_t>(one_v.at(i)) == std::bit_cast<uint32_t>(v.at(i)));
    REQUIRE(std::bit_cast<uint32_t>(one_w.at(i)) == std::bit_cast<uint32_t>(w.at(i)));
  }
  // elements 0, 1261 and 2522 start alike (value and gradient); the runs' decays, not
  // weight_decay, apply: 0.1 for the first two, 0 for the third
  CHECK(master.at(0) == master.at(1261));
  CHECK(master.at(0) != master.at(2522));

  for (const std::vector<AdamWDecayRun>& bad :
       {std::vector<AdamWDecayRun>{{700, 0.1f}, {700, 0.0f}, {3000, 0.1f}},
        std::vector<AdamWDecayRun>{{700, 0.1f}, {2999, 0.0f}}, std::vector<AdamWDecayRun>{{3001, 0.1f}}}) {
    AdamWParams b = p;
    b.decay_runs = bad;
    CHECK_THROWS_WITH(be->adamw(one.t, one_w.t, grad.t, one_m.t, one_v.t, b),
                      Catch::Contains("CpuBackend::adamw") && Catch::Contains("decay_runs[") &&
                          Catch::Contains("element count (3000)"));
  }
}

TEST_CASE("adamw rejects mismatched tensors", "[adamw][errors]") {
  auto be = make_cpu_backend();
  HostTensor p(DType::F32, {4}), g(DType::F32, {5}), m(DType::F32, {4}), v(DType::F32, {4});
  AdamWParams hp;
  REQUIRE_THROWS_AS(be->adamw(Tensor(), p.t, g.t, m.t, v.t, hp), std::invalid_argument);
  HostTensor m16(DType::BF16, {4});
  REQUIRE_THROWS_WITH(be->adamw(Tensor(), p.t, m.t, m16.t, v.t, hp), Catch::Contains("adamw") && Catch::Contains("bf16"));
}
