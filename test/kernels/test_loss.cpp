// Softmax cross-entropy: stats, loss, in-place backward, ignored targets and vocab shards.
#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

namespace {

struct Xent {
  HostTensor row_max, sumexp, target_logit, lse, losses;
  explicit Xent(int64_t N)
      : row_max(DType::F32, {N}), sumexp(DType::F32, {N}), target_logit(DType::F32, {N}), lse(DType::F32, {N}),
        losses(DType::F32, {N}) {}
};

// stats + loss for one (possibly sharded) set of logits
void forward(Backend& be, Xent& x, const HostTensor& logits, const HostTensor& targets, int64_t vocab_start) {
  be.xent_stats(x.row_max.t, x.sumexp.t, x.target_logit.t, logits.t, targets.t, vocab_start);
  be.xent_loss(x.losses.t, x.lse.t, x.row_max.t, x.sumexp.t, x.target_logit.t, targets.t);
}

HostTensor make_targets(const std::vector<int32_t>& t) {
  HostTensor h(DType::I32, {static_cast<int64_t>(t.size())});
  h.set_i32(t);
  return h;
}

}  // namespace

// Against double: lse = log sum exp(x), loss = lse - x[target]. Tolerance 1e-6 relative (an fp32
// sum of V exponentials and one log); row_max and target_logit are copies, compared exactly.
TEST_CASE("xent forward matches a double reference, ignored rows have loss 0", "[xent]") {
  auto be = make_cpu_backend();
  const int64_t N = 6, V = 37;
  const std::vector<int32_t> tgt = {3, -1, 36, 0, -100, 20};
  HostTensor targets = make_targets(tgt);
  for (DType dt : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dt));
    HostTensor logits = make(dt, {N, V}, randn(N * V, 1, 3.0f));
    Xent x(N);
    forward(*be, x, logits, targets, 0);
    std::vector<double> lse(N), loss(N);
    for (int64_t n = 0; n < N; ++n) {
      double m = -INFINITY, s = 0;
      for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<double>(logits.at(n * V + j)));
      for (int64_t j = 0; j < V; ++j) s += std::exp(logits.at(n * V + j) - m);
      CHECK(x.row_max.at(n) == m);
      CHECK(x.target_logit.at(n) == (tgt[n] >= 0 ? logits.at(n * V + tgt[n]) : 0.0f));
      lse[n] = m + std::log(s);
      loss[n] = tgt[n] >= 0 ? lse[n] - logits.at(n * V + tgt[n]) : 0.0;
    }
    CHECK(rel_error(x.lse.values(), lse) < 1e-6);
    CHECK(rel_error(x.losses.values(), loss) < 1e-6);
    CHECK(x.losses.at(1) == 0.0f);
    CHECK(x.losses.at(4) == 0.0f);
  }
}

// Two vocab shards combined as tensor parallelism would (max, rescaled sumexp, summed target
// logit) give the unsharded loss (tolerance 1e-6), and each shard's backward equals its columns of
// the unsharded backward bit for bit (same inputs, same lse, same formula).
TEST_CASE("xent over vocab shards equals the unsharded computation", "[xent]") {
  auto be = make_cpu_backend();
  const int64_t N = 5, V = 20, split = 8;
  const std::vector<int32_t> tgt = {2, 15, -1, 8, 19};
  HostTensor targets = make_targets(tgt);
  const std::vector<float> all = randn(N * V, 2, 2.0f);
  std::vector<float> left, right;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < V; ++j) (j < split ? left : right).push_back(all[n * V + j]);
  HostTensor full = make(DType::F32, {N, V}, all);
  HostTensor lo = make(DType::F32, {N, split}, left), hi = make(DType::F32, {N, V - split}, right);
  Xent xf(N), xl(N), xh(N);
  forward(*be, xf, full, targets, 0);
  forward(*be, xl, lo, targets, 0);
  forward(*be, xh, hi, targets, split);
  std::vector<double> combined(N);
  for (int64_t n = 0; n < N; ++n) {
    const double m = std::max(xl.row_max.at(n), xh.row_max.at(n));
    const double s = xl.sumexp.at(n) * std::exp(xl.row_max.at(n) - m) + xh.sumexp.at(n) * std::exp(xh.row_max.at(n) - m);
    const double t = static_cast<double>(xl.target_logit.at(n)) + xh.target_logit.at(n);
    combined[n] = tgt[n] < 0 ? 0.0 : m + std::log(s) - t;
  }
  CHECK(rel_error(xf.losses.values(), combined) < 1e-6);

  const float dloss = 0.25f;
  be->xent_backward(full.t, xf.lse.t, targets.t, dloss, 0);
  be->xent_backward(lo.t, xf.lse.t, targets.t, dloss, 0);  // shards use the combined (global) lse
  be->xent_backward(hi.t, xf.lse.t, targets.t, dloss, split);
  int mismatches = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < V; ++j)
      mismatches += full.at(n * V + j) != (j < split ? lo.at(n * split + j) : hi.at(n * (V - split) + j - split));
  CHECK(mismatches == 0);
}

// L = dloss * sum_n loss_n, gradient from xent_backward. h = 1/32; one logit moves one row loss
// (noise ~6e-8 * |loss| * 1.5/h ~ 1e-5 relative); tolerance 1e-4. Ignored rows get exactly 0.
TEST_CASE("xent backward matches finite differences, zero for ignored rows", "[xent][grad]") {
  auto be = make_cpu_backend();
  const int64_t N = 4, V = 11;
  const std::vector<int32_t> tgt = {3, -1, 10, 0};
  HostTensor targets = make_targets(tgt);
  for (int64_t vocab_start : {int64_t{0}, int64_t{5}}) {
    CAPTURE(vocab_start);
    HostTensor logits = make(DType::F32, {N, V}, randn_grid(N * V, 3));
    const float dloss = 0.7f;
    Xent x(N);
    auto loss = [&] {
      forward(*be, x, logits, targets, vocab_start);
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += x.losses.at(n);
      return dloss * s;
    };
    const auto fd = numeric_grad(logits.t.as<float>(), N * V, loss, kStepSmooth);
    loss();
    be->xent_backward(logits.t, x.lse.t, targets.t, dloss, vocab_start);  // in place
    CHECK(rel_error(to_double(logits.values()), fd) < 1e-4);
    for (int64_t j = 0; j < V; ++j) CHECK(logits.at(1 * V + j) == 0.0f);
  }
}
