// Storage emulation: an op writing a bf16 or fp16 tensor stores exactly the fp32 result rounded
// to nearest even, i.e. the same op with an fp32 output followed by f32_to_bf16 / f32_to_f16.
#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

namespace {

// Number of elements of `low` that are not the rounding of the fp32 result `ref`.
int64_t not_rounded(const HostTensor& ref, const HostTensor& low) {
  REQUIRE(ref.numel() == low.numel());
  int64_t bad = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const uint32_t expect = low.t.dtype == DType::BF16 ? f32_to_bf16(ref.at(i)) : f32_to_f16(ref.at(i));
    bad += low.bits(i) != expect;
  }
  return bad;
}

}  // namespace

TEST_CASE("bf16 and fp16 outputs are the fp32 result rounded to nearest even", "[storage]") {
  auto be = make_cpu_backend();
  const int64_t N = 70, C = 48;
  // bf16 inputs (their values are what both runs read)
  HostTensor x = make(DType::BF16, {N, C}, randn(N * C, 1, 2.0f));
  HostTensor w = make(DType::BF16, {C}, randn(C, 2)), bias = make(DType::BF16, {C}, randn(C, 3));
  HostTensor wm = make(DType::BF16, {C, C}, randn(C * C, 4));
  HostTensor dy = make(DType::BF16, {N, C}, randn(N * C, 5));

  for (DType dt : {DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(dt));
    HostTensor ref(DType::F32, {N, C}), low(dt, {N, C});
    HostTensor mean(DType::F32, {N}), rstd(DType::F32, {N}), dw(DType::F32, {C}), db(DType::F32, {C});

    be->matmul(ref.t, x.t, wm.t, false, true, false, &bias.t);
    be->matmul(low.t, x.t, wm.t, false, true, false, &bias.t);
    CHECK(not_rounded(ref, low) == 0);

    be->layernorm_forward(ref.t, mean.t, rstd.t, x.t, w.t, bias.t, 1e-5f);
    be->layernorm_forward(low.t, mean.t, rstd.t, x.t, w.t, bias.t, 1e-5f);
    CHECK(not_rounded(ref, low) == 0);

    be->layernorm_backward(ref.t, dw.t, db.t, dy.t, x.t, w.t, mean.t, rstd.t, false, false);
    be->layernorm_backward(low.t, dw.t, db.t, dy.t, x.t, w.t, mean.t, rstd.t, false, false);
    CHECK(not_rounded(ref, low) == 0);

    be->rmsnorm_forward(ref.t, rstd.t, x.t, w.t, 1e-5f);
    be->rmsnorm_forward(low.t, rstd.t, x.t, w.t, 1e-5f);
    CHECK(not_rounded(ref, low) == 0);

    be->gelu_forward(ref.t, x.t);
    be->gelu_forward(low.t, x.t);
    CHECK(not_rounded(ref, low) == 0);

    be->add(ref.t, x.t, dy.t);
    be->add(low.t, x.t, dy.t);
    CHECK(not_rounded(ref, low) == 0);

    HostTensor sref(DType::F32, {N, C / 2}), slow(dt, {N, C / 2});
    be->swiglu_forward(sref.t, x.t);
    be->swiglu_forward(slow.t, x.t);
    CHECK(not_rounded(sref, slow) == 0);

    HostTensor tokens(DType::I32, {N});
    std::vector<int32_t> tok(N);
    for (int64_t n = 0; n < N; ++n) tok[n] = static_cast<int32_t>(n % 13);
    tokens.set_i32(tok);
    HostTensor table = make(DType::F32, {13, C}, randn(13 * C, 6)), pos = make(DType::F32, {10, C}, randn(10 * C, 7));
    be->embedding_forward(ref.t, tokens.t, table.t, pos.t, 10, 0, Tensor());
    be->embedding_forward(low.t, tokens.t, table.t, pos.t, 10, 0, Tensor());
    CHECK(not_rounded(ref, low) == 0);

    // attention: out and dqkv
    const AttnShape s{2, 9, 4, 2, 8};
    const int64_t rows = s.B * s.T, cols = s.qkv_cols(), oc = int64_t{s.n_heads} * s.head_dim;
    HostTensor qkv = make(DType::BF16, {rows, cols}, randn(rows * cols, 8));
    HostTensor oref(DType::F32, {rows, oc}), olow(dt, {rows, oc}), lse(DType::F32, {s.B, s.n_heads, s.T});
    be->attention_forward(oref.t, lse.t, qkv.t, s);
    be->attention_forward(olow.t, lse.t, qkv.t, s);
    CHECK(not_rounded(oref, olow) == 0);
    HostTensor dO = make(DType::BF16, {rows, oc}, randn(rows * oc, 9));
    HostTensor dref(DType::F32, {rows, cols}), dlow(dt, {rows, cols});
    be->attention_backward(dref.t, dO.t, qkv.t, oref.t, lse.t, s);
    be->attention_backward(dlow.t, dO.t, qkv.t, oref.t, lse.t, s);
    CHECK(not_rounded(dref, dlow) == 0);

    // in place: rope on qkv, xent_backward on logits (same starting values in both dtypes)
    HostTensor rlow = make(dt, {rows, cols}, randn(rows * cols, 10));
    HostTensor rref = make(DType::F32, {rows, cols}, rlow.values());
    be->rope_forward(rref.t, s, 10000.0f);
    be->rope_forward(rlow.t, s, 10000.0f);
    CHECK(not_rounded(rref, rlow) == 0);

    HostTensor targets(DType::I32, {N});
    targets.set_i32(tok);
    HostTensor llow = make(dt, {N, C}, randn(N * C, 11, 3.0f));
    HostTensor lref = make(DType::F32, {N, C}, llow.values());
    HostTensor rmax(DType::F32, {N}), sumexp(DType::F32, {N}), tl(DType::F32, {N}), l(DType::F32, {N}), loss(DType::F32, {N});
    be->xent_stats(rmax.t, sumexp.t, tl.t, lref.t, targets.t, 0);
    be->xent_loss(loss.t, l.t, rmax.t, sumexp.t, tl.t, targets.t);
    be->xent_backward(lref.t, l.t, targets.t, 0.01f, 0);
    be->xent_backward(llow.t, l.t, targets.t, 0.01f, 0);
    CHECK(not_rounded(lref, llow) == 0);
  }
}

TEST_CASE("fp16 outputs above 65504 become inf", "[storage]") {
  auto be = make_cpu_backend();
  // matmul: 300 * 300 = 90000 > 65504
  HostTensor a = make(DType::F32, {2, 3}, {100, 100, 100, -100, -100, -100});
  HostTensor b = make(DType::F32, {3, 2}, {300, 1, 300, 1, 300, 1});
  HostTensor out(DType::F16, {2, 2});
  be->matmul(out.t, a.t, b.t, false, false);
  CHECK(out.at(0) == INFINITY);
  CHECK(out.at(1) == 300.0f);
  CHECK(out.at(2) == -INFINITY);
  // gelu(x) = x for large x; 65519 rounds down to 65504, 65520 up to inf
  HostTensor x = make(DType::F32, {3}, {65519.0f, 65520.0f, 70000.0f});
  HostTensor y(DType::F16, {3});
  be->gelu_forward(y.t, x.t);
  CHECK(y.at(0) == 65504.0f);
  CHECK(y.at(1) == INFINITY);
  CHECK(y.at(2) == INFINITY);
  CHECK(be->count_nonfinite(y.t) == 2);
}

TEST_CASE("views: row_slice and elements address the right bytes, and refuse ranges outside", "[storage]") {
  float data[12];
  const Tensor t(data, DType::F32, {3, 4});
  const Tensor rows = t.row_slice(1, 3);
  CHECK(rows.data == data + 4);
  CHECK(rows.shape_str() == "[2, 4] f32");
  const Tensor e = t.elements(5, 9);  // crosses a row boundary: a flat range
  CHECK(e.data == data + 5);
  CHECK(e.shape_str() == "[4] f32");
  CHECK(t.elements(12, 12).numel() == 0);
  CHECK_THROWS_WITH(t.elements(10, 13), Catch::Contains("Tensor::elements: [10, 13) of [3, 4] f32"));
  CHECK_THROWS_WITH(t.row_slice(2, 4), Catch::Contains("Tensor::row_slice: rows [2, 4)"));
}
