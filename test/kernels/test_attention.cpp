// RoPE and causal GQA attention, with and without ALiBi.
#include "kernel_test_util.h"
#include "kernels/alibi.h"

// The Hugging Face recipe below rounds each product and sum to fp32 (PyTorch's elementwise
// kernels do not fuse multiply-adds), so this file must not contract them either.
#include "kernels/fp_contract_off.h"  // last: no fused multiply-add below

using namespace keel;
using namespace keel::test;

namespace {

// Rotation of the q and k heads in double with the exact angle pos * theta^(-2i/hd).
std::vector<double> ref_rope(const HostTensor& qkv, const AttnShape& s, double theta) {
  const int64_t cols = s.qkv_cols(), hd = s.head_dim, half = hd / 2;
  std::vector<double> y = to_double(qkv.values());
  for (int64_t n = 0; n < static_cast<int64_t>(s.B) * s.T; ++n)
    for (int64_t h = 0; h < s.n_heads + s.n_kv_heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(n % s.T) * std::pow(theta, -2.0 * i / hd);
        const int64_t a = n * cols + h * hd + i, b = a + half;
        const double xa = qkv.at(a), xb = qkv.at(b);
        y[a] = xa * std::cos(angle) - xb * std::sin(angle);
        y[b] = xb * std::cos(angle) + xa * std::sin(angle);
      }
  return y;
}

struct AttnRef {
  std::vector<double> out, lse;
};

// Causal softmax attention per (b, h, i) in double; query head h reads kv head h / group.
// slopes: ALiBi's slope per query head (score += slope * (j - i)), or empty. With s.window > 0
// row i sees keys j > i - window only (a sliding window).
AttnRef ref_attention(const HostTensor& qkv, const AttnShape& s, const std::vector<float>& slopes = {}) {
  const int64_t B = s.B, T = s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim, cols = s.qkv_cols();
  AttnRef r;
  r.out.assign(B * T * nh * hd, 0.0);
  r.lse.assign(B * nh * T, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t kvh = h / (nh / nkv);
        auto q = [&](int64_t d) { return static_cast<double>(qkv.at((b * T + i) * cols + h * hd + d)); };
        auto k = [&](int64_t j, int64_t d) { return static_cast<double>(qkv.at((b * T + j) * cols + (nh + kvh) * hd + d)); };
        auto v = [&](int64_t j, int64_t d) {
          return static_cast<double>(qkv.at((b * T + j) * cols + (nh + nkv + kvh) * hd + d));
        };
        std::vector<double> sc(i + 1);
        double m = -INFINITY;
        const int64_t j0 = s.window > 0 ? std::max<int64_t>(0, i - s.window + 1) : 0;
        for (int64_t j = j0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += q(d) * k(j, d);
          sc[j] = dot / std::sqrt(static_cast<double>(hd));
          if (!slopes.empty()) sc[j] += static_cast<double>(slopes[h]) * static_cast<double>(j - i);
          m = std::max(m, sc[j]);
        }
        double l = 0;
        for (int64_t j = j0; j <= i; ++j) l += std::exp(sc[j] - m);
        for (int64_t d = 0; d < hd; ++d) {
          double o = 0;
          for (int64_t j = j0; j <= i; ++j) o += std::exp(sc[j] - m) / l * v(j, d);
          r.out[(b * T + i) * nh * hd + h * hd + d] = o;
        }
        r.lse[(b * nh + h) * T + i] = m + std::log(l);
      }
  return r;
}

}  // namespace

// Tolerance 1e-5 (relative): the kernel uses HF's fp32 angle (pos * fp32 inv_freq), which differs
// from the exact angle by ~1.5e-7 * angle (<= 2.4e-6 rad at pos 15); plus two fp32 roundings.
TEST_CASE("rope forward matches a double reference and leaves v alone", "[rope]") {
  auto be = make_cpu_backend();
  const AttnShape s{2, 16, 4, 2, 8};
  const int64_t rows = s.B * s.T, cols = s.qkv_cols();
  for (DType dt : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dt));
    HostTensor qkv = make(dt, {rows, cols}, randn(rows * cols, 1));
    const std::vector<double> ref = ref_rope(qkv, s, 10000.0);
    std::vector<uint32_t> v_before;
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = (s.n_heads + s.n_kv_heads) * s.head_dim; c < cols; ++c) v_before.push_back(qkv.bits(n * cols + c));
    be->rope_forward(qkv.t, s, 10000.0f);
    // bf16 storage: one rounding of at most 2^-9 relative per element on top
    CHECK(rel_error(qkv.values(), ref) < (dt == DType::F32 ? 1e-5 : 2.1e-3));
    std::vector<uint32_t> v_after;
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = (s.n_heads + s.n_kv_heads) * s.head_dim; c < cols; ++c) v_after.push_back(qkv.bits(n * cols + c));
    CHECK(v_before == v_after);
  }
}

// RoPE rotates column pairs (i, i + head_dim/2): an odd head_dim, which attention takes, is
// refused naming the op and the shape.
TEST_CASE("rope refuses an odd head_dim", "[rope][errors]") {
  auto be = make_cpu_backend();
  const AttnShape s{1, 4, 2, 2, 5};
  HostTensor qkv = make(DType::F32, {4, s.qkv_cols()}, randn(4 * s.qkv_cols(), 1));
  CHECK_THROWS_WITH(be->rope_forward(qkv.t, s, 10000.0f),
                    Catch::Contains("rope_forward") && Catch::Contains("even head_dim") && Catch::Contains("head_dim=5"));
  CHECK_THROWS_WITH(be->rope_backward(qkv.t, s, 10000.0f),
                    Catch::Contains("rope_backward") && Catch::Contains("even head_dim"));
}

TEST_CASE("qk_heads_copy lays the q and k heads out one per row and back, leaving v alone", "[rope][qk_norm]") {
  auto be = make_cpu_backend();
  const AttnShape s{2, 5, 4, 2, 6};
  const int64_t rows = s.B * s.T, cols = s.qkv_cols(), hd = s.head_dim, nh = s.n_heads, nkv = s.n_kv_heads;
  for (DType dt : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dt));
    HostTensor qkv = make(dt, {rows, cols}, randn(rows * cols, 3));
    HostTensor heads = make(dt, {rows * (nh + nkv), hd}, std::vector<float>(rows * (nh + nkv) * hd, 0.0f));
    be->qk_heads_copy(heads.t, qkv.t, s, true);
    // q head h of row n at row n * nh + h; k head h at rows * nh + n * nkv + h (bit for bit).
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t h = 0; h < nh + nkv; ++h)
        for (int64_t i = 0; i < hd; ++i) {
          const int64_t r = h < nh ? n * nh + h : rows * nh + n * nkv + (h - nh);
          REQUIRE(heads.bits(r * hd + i) == qkv.bits(n * cols + h * hd + i));
        }
    // Back: changed heads land in q and k; v keeps its bits.
    HostTensor back = make(dt, {rows, cols}, randn(rows * cols, 4));
    std::vector<uint32_t> v_before;
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = (nh + nkv) * hd; c < cols; ++c) v_before.push_back(back.bits(n * cols + c));
    be->qk_heads_copy(heads.t, back.t, s, false);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = 0; c < cols; ++c) {
        if (c < (nh + nkv) * hd) REQUIRE(back.bits(n * cols + c) == qkv.bits(n * cols + c));
        else REQUIRE(back.bits(n * cols + c) == v_before[static_cast<size_t>(n * (cols - (nh + nkv) * hd) + c - (nh + nkv) * hd)]);
      }
    HostTensor wrong = make(dt, {rows * nh, hd}, std::vector<float>(rows * nh * hd, 0.0f));
    CHECK_THROWS_WITH(be->qk_heads_copy(wrong.t, qkv.t, s, true), Catch::Contains("qk_heads_copy") &&
                                                                      Catch::Contains("heads must be"));
  }
}

// Hugging Face's recipe in fp32: inv_freq = 1 / theta ** (arange(0, hd, 2).float() / hd),
// freqs = pos.float() * inv_freq, cos/sin of freqs, q*cos + rotate_half(q)*sin with each product
// and sum rounded to fp32. At positions up to 4095 the fp32 angle differs from the exact one by
// ~1e-4 rad, so matching this recipe bit for bit is a real check. (This file is compiled without
// FMA contraction, so the expressions below round like PyTorch's elementwise kernels; cos/sin are
// taken correctly rounded, which PyTorch's are within 1 ulp of.)
TEST_CASE("rope follows Hugging Face's fp32 recipe at large positions", "[rope]") {
  auto be = make_cpu_backend();
  const AttnShape s{1, 4096, 1, 1, 64};
  const int64_t rows = s.T, cols = s.qkv_cols(), hd = s.head_dim, half = hd / 2;
  const float theta = 500000.0f;
  HostTensor qkv = make(DType::F32, {rows, cols}, randn(rows * cols, 2));
  const std::vector<float> x = qkv.values();
  be->rope_forward(qkv.t, s, theta);
  int64_t mismatches = 0;
  for (int64_t pos = 0; pos < rows; ++pos)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const float exponent = static_cast<float>(2 * i) / static_cast<float>(hd);
        const float inv_freq = 1.0f / static_cast<float>(std::pow(static_cast<double>(theta), exponent));
        const float angle = static_cast<float>(pos) * inv_freq;
        const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
        const float sn = static_cast<float>(std::sin(static_cast<double>(angle)));
        const int64_t a = pos * cols + h * hd + i, b = a + half;
        const float ca = x[a] * c, sb = x[b] * sn, cb = x[b] * c, sa = x[a] * sn;
        mismatches += qkv.at(a) != ca - sb;
        mismatches += qkv.at(b) != cb + sa;
      }
  CHECK(mismatches == 0);
}

// rope is linear: h = 1, tolerance 1e-5. Backward is the inverse rotation applied in place.
TEST_CASE("rope backward matches finite differences and inverts forward", "[rope][grad]") {
  auto be = make_cpu_backend();
  const AttnShape s{2, 3, 2, 1, 4};
  const int64_t rows = s.B * s.T, cols = s.qkv_cols();
  HostTensor src = make(DType::F32, {rows, cols}, randn_grid(rows * cols, 10));
  HostTensor work(DType::F32, {rows, cols});
  const std::vector<float> r = randn(rows * cols, 11);
  auto loss = [&] {
    work.set(src.values());
    be->rope_forward(work.t, s, 10000.0f);
    return dot_loss(work, to_double(r));
  };
  HostTensor grad = make(DType::F32, {rows, cols}, r);
  be->rope_backward(grad.t, s, 10000.0f);
  CHECK(rel_error(to_double(grad.values()), numeric_grad(src.t.as<float>(), rows * cols, loss, kStepLinear)) < 1e-5);

  // forward then backward (R^T R = I) gives back the input up to fp32 rounding
  const AttnShape big{2, 32, 4, 2, 16};
  const int64_t brows = big.B * big.T, bcols = big.qkv_cols();
  const std::vector<float> x = randn(brows * bcols, 12);
  HostTensor t = make(DType::F32, {brows, bcols}, x);
  be->rope_forward(t.t, big, 10000.0f);
  be->rope_backward(t.t, big, 10000.0f);
  CHECK(rel_error(t.values(), to_double(x)) < 1e-6);
}

// Tolerances (relative): out 1e-5 (an fp32 dot product of hd terms, exp, and a weighted sum of up
// to T terms: a few sqrt(n) * 6e-8); lse 1e-6 (max + log of an fp32 sum).
TEST_CASE("attention forward matches a double reference (GQA and MHA)", "[attention]") {
  auto be = make_cpu_backend();
  // head_dim 5: odd heads (BLOOM-104B's 145) are a model without RoPE's
  for (AttnShape s : {AttnShape{2, 13, 4, 2, 16}, AttnShape{1, 9, 3, 3, 8}, AttnShape{2, 7, 4, 1, 6},
                      AttnShape{1, 8, 2, 2, 5}})
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(s.B, s.T, s.n_heads, s.n_kv_heads, s.head_dim, dtype_name(dt));
      const int64_t rows = s.B * s.T, cols = s.qkv_cols();
      HostTensor qkv = make(dt, {rows, cols}, randn(rows * cols, 1, 1.5f));
      HostTensor out(DType::F32, {rows, static_cast<int64_t>(s.n_heads) * s.head_dim});
      HostTensor lse(DType::F32, {s.B, s.n_heads, s.T});
      be->attention_forward(out.t, lse.t, qkv.t, s);
      const AttnRef ref = ref_attention(qkv, s);
      CHECK(rel_error(out.values(), ref.out) < 1e-5);
      CHECK(rel_error(lse.values(), ref.lse) < 1e-6);
    }
}

// A sliding window of W keys (Mistral): the same tolerances as plain causal attention (fewer
// terms per row). W = 1 is each row's own value; W >= T is plain causal attention, bit for bit.
TEST_CASE("attention forward with a sliding window matches a double reference", "[attention][window]") {
  auto be = make_cpu_backend();
  for (AttnShape s : {AttnShape{2, 13, 4, 2, 16}, AttnShape{1, 9, 3, 3, 8}, AttnShape{2, 17, 4, 1, 6}})
    for (int window : {1, 3, 8})
      for (DType dt : {DType::F32, DType::BF16}) {
        s.window = window;
        CAPTURE(s.B, s.T, s.n_heads, s.n_kv_heads, s.head_dim, window, dtype_name(dt));
        const int64_t rows = s.B * s.T, cols = s.qkv_cols(), ocols = static_cast<int64_t>(s.n_heads) * s.head_dim;
        HostTensor qkv = make(dt, {rows, cols}, randn(rows * cols, 1, 1.5f));
        HostTensor out(DType::F32, {rows, ocols}), lse(DType::F32, {s.B, s.n_heads, s.T});
        be->attention_forward(out.t, lse.t, qkv.t, s);
        const AttnRef ref = ref_attention(qkv, s);
        CHECK(rel_error(out.values(), ref.out) < 1e-5);
        CHECK(rel_error(lse.values(), ref.lse) < 1e-6);
        // the window matters (the test can fail): plain causal attention differs
        AttnShape causal = s;
        causal.window = 0;
        CHECK(rel_error(out.values(), ref_attention(qkv, causal).out) > 1e-2);
        if (window == 1) {  // softmax over one key: the row's own value head
          const int64_t group = s.n_heads / s.n_kv_heads;
          for (int64_t n = 0; n < rows; ++n)
            for (int64_t h = 0; h < s.n_heads; ++h)
              for (int64_t d = 0; d < s.head_dim; ++d)
                CHECK(out.at(n * ocols + h * s.head_dim + d) ==
                      Approx(qkv.at(n * cols + (s.n_heads + s.n_kv_heads + h / group) * s.head_dim + d)).epsilon(1e-6));
        }
      }
  // W >= T: no row reaches the window's edge, so it is plain causal attention bit for bit
  AttnShape s{2, 9, 4, 2, 8};
  const int64_t rows = s.B * s.T, cols = s.qkv_cols(), ocols = static_cast<int64_t>(s.n_heads) * s.head_dim;
  HostTensor qkv = make(DType::BF16, {rows, cols}, randn(rows * cols, 3, 1.5f));
  HostTensor a(DType::BF16, {rows, ocols}), b(DType::BF16, {rows, ocols}), lse(DType::F32, {s.B, s.n_heads, s.T});
  be->attention_forward(a.t, lse.t, qkv.t, s);
  s.window = 9;
  be->attention_forward(b.t, lse.t, qkv.t, s);
  CHECK(bits_differ(a, b) == 0);
  s.window = -1;
  CHECK_THROWS_WITH(be->attention_forward(b.t, lse.t, qkv.t, s),
                    Catch::Contains("attention_forward") && Catch::Contains("window=-1") &&
                        Catch::Contains("window 0 (none) or positive"));
}

// L = sum(out * R) w.r.t. every q, k and v value. h = 1/32; one input moves up to T * hd outputs
// (~ sqrt(40) * 6e-8 * 1.5/h ~ 2e-5 noise relative); tolerance 1e-4. With ALiBi too (slopes up
// to 0.5 over T <= 7 keep the scores O(1)), 6 heads being a non-power-of-two count.
TEST_CASE("attention backward matches finite differences (GQA and MHA, with and without ALiBi, a sliding window)",
          "[attention][grad][alibi][window]") {
  auto be = make_cpu_backend();
  for (const bool alibi : {false, true})
    for (AttnShape s : {AttnShape{2, 5, 4, 2, 8}, AttnShape{2, 5, 2, 2, 8}, AttnShape{1, 6, 4, 1, 4},
                        AttnShape{1, 7, 6, 3, 4}, AttnShape{2, 7, 4, 2, 4, {}, {}, 3}, AttnShape{1, 6, 2, 2, 5}}) {
    CAPTURE(alibi, s.n_heads, s.n_kv_heads, s.head_dim, s.window);
    const HostTensor slopes = make(DType::F32, {s.n_heads}, alibi_slopes(s.n_heads));
    if (alibi) s.alibi_slopes = slopes.t;
    const int64_t rows = s.B * s.T, cols = s.qkv_cols(), ocols = static_cast<int64_t>(s.n_heads) * s.head_dim;
    HostTensor qkv = make(DType::F32, {rows, cols}, randn_grid(rows * cols, 10));
    HostTensor out(DType::F32, {rows, ocols}), lse(DType::F32, {s.B, s.n_heads, s.T});
    const std::vector<float> r = randn(rows * ocols, 11);
    auto loss = [&] {
      be->attention_forward(out.t, lse.t, qkv.t, s);
      return dot_loss(out, to_double(r));
    };
    loss();
    HostTensor dout = make(DType::F32, {rows, ocols}, r);
    HostTensor dqkv = make(DType::F32, {rows, cols}, randn(rows * cols, 12));  // overwritten
    be->attention_backward(dqkv.t, dout.t, qkv.t, out.t, lse.t, s);
    const auto fd = numeric_grad(qkv.t.as<float>(), rows * cols, loss, kStepSmooth);
    CHECK(rel_error(to_double(dqkv.values()), fd) < 1e-4);
  }
}

// The slopes from the paper's recipe, exactly: powers of two for 8 heads; for 12 heads the 8
// slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...), rounded once.
TEST_CASE("alibi slopes: powers of two and the interleaved tail of a non-power-of-two head count", "[attention][alibi]") {
  CHECK(alibi_slopes(1) == std::vector<float>{0.00390625f});  // 2^-8
  CHECK(alibi_slopes(8) ==
        std::vector<float>{0.5f, 0.25f, 0.125f, 0.0625f, 0.03125f, 0.015625f, 0.0078125f, 0.00390625f});
  const std::vector<float> twelve = alibi_slopes(12);
  REQUIRE(twelve.size() == 12);
  for (int h = 0; h < 8; ++h) CHECK(twelve[static_cast<size_t>(h)] == std::ldexp(1.0f, -(h + 1)));
  for (int k = 0; k < 4; ++k)
    CHECK(twelve[static_cast<size_t>(8 + k)] == static_cast<float>(std::exp2(-0.5 - k)));
  const std::vector<float> six = alibi_slopes(6);  // p = 4: 2^-2, 2^-4, 2^-6, 2^-8, then 2^-1, 2^-3
  CHECK(six == std::vector<float>{0.25f, 0.0625f, 0.015625f, 0.00390625f, 0.5f, 0.125f});
  CHECK_THROWS_WITH(alibi_slopes(0), Catch::Contains("n_heads must be positive"));
}

// Same tolerances as without ALiBi (out 1e-5, lse 1e-6): the bias adds one fp32 product and sum
// per score. The shapes cover GQA, MHA and a TP rank's slice of a non-power-of-two head count.
TEST_CASE("attention forward with ALiBi matches a double reference", "[attention][alibi]") {
  auto be = make_cpu_backend();
  struct Case {
    AttnShape s;
    int model_heads, first_head;  // the rank holds heads [first_head, first_head + s.n_heads)
  };
  for (const Case& c : {Case{{2, 13, 4, 2, 16}, 4, 0}, Case{{1, 9, 6, 6, 8}, 12, 6}, Case{{2, 17, 4, 1, 6}, 80, 40}})
    for (DType dt : {DType::F32, DType::BF16}) {
      AttnShape s = c.s;
      CAPTURE(s.B, s.T, s.n_heads, s.n_kv_heads, c.model_heads, c.first_head, dtype_name(dt));
      const std::vector<float> all = alibi_slopes(c.model_heads);
      const std::vector<float> mine(all.begin() + c.first_head, all.begin() + c.first_head + s.n_heads);
      HostTensor slopes = make(DType::F32, {s.n_heads}, mine);
      s.alibi_slopes = slopes.t;
      const int64_t rows = s.B * s.T, cols = s.qkv_cols();
      HostTensor qkv = make(dt, {rows, cols}, randn(rows * cols, 1, 1.5f));
      HostTensor out(DType::F32, {rows, static_cast<int64_t>(s.n_heads) * s.head_dim});
      HostTensor lse(DType::F32, {s.B, s.n_heads, s.T});
      be->attention_forward(out.t, lse.t, qkv.t, s);
      const AttnRef ref = ref_attention(qkv, s, mine);
      CHECK(rel_error(out.values(), ref.out) < 1e-5);
      CHECK(rel_error(lse.values(), ref.lse) < 1e-6);
      // The bias matters: without it the output is far from the reference.
      const AttnRef plain = ref_attention(qkv, s);
      CHECK(rel_error(out.values(), plain.out) > 1e-2);
    }
}

TEST_CASE("attention refuses ALiBi slopes of the wrong count or dtype", "[attention][alibi][errors]") {
  auto be = make_cpu_backend();
  AttnShape s{1, 4, 4, 2, 8};
  HostTensor qkv(DType::F32, {4, s.qkv_cols()}), out(DType::F32, {4, 32}), lse(DType::F32, {1, 4, 4});
  HostTensor three = make(DType::F32, {3}, {0.5f, 0.25f, 0.125f});
  s.alibi_slopes = three.t;
  CHECK_THROWS_WITH(be->attention_forward(out.t, lse.t, qkv.t, s),
                    Catch::Contains("attention_forward") && Catch::Contains("one slope per query head (4)"));
  HostTensor bf = make(DType::BF16, {4}, alibi_slopes(4));
  s.alibi_slopes = bf.t;
  CHECK_THROWS_WITH(be->attention_forward(out.t, lse.t, qkv.t, s), Catch::Contains("alibi_slopes"));
}
