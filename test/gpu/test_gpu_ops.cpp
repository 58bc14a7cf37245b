// CUDA backend, op by op, against the CPU reference on the same random inputs (same storage
// dtypes). Tolerances are on ||gpu - cpu|| / ||cpu||, per op:
//   bit-identical  convert, fill, add, scale, embedding forward and backward, rope, adamw
//                  (same single rounding of the same fp32 operations in the same order)
//   f32 outputs    1e-6 .. 1e-5: the same math summed in another order (a few fp32 ulps)
//   matmul f32     1e-5; bf16/f16 inputs into f32: 1e-4 (tensor-core fp32 accumulation)
//   bf16 outputs   4e-3, f16 outputs 1e-3: the fp32 results differ by ulps, and the rare
//                  element whose value sits on a rounding boundary flips by one storage ulp
//   sums           1e-12 (fp64 accumulation in both, different order)
// Outputs are poisoned with NaN before each op (unless accumulated into), so an element the
// GPU fails to write shows as an infinite error. Every op is also run twice: bit-identical.
#include <array>
#include <cstring>

#include "gpu_test_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/wgmma_check.h"
#include "kernels/document_positions.h"

using namespace keel;
using namespace keel::test;

namespace {

constexpr DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};

HostTensor rand_tensor(DType dt, std::initializer_list<int64_t> shape, uint32_t seed, float scale = 1.0f) {
  HostTensor h(dt, shape);
  h.set(randn(h.numel(), seed, scale));
  return h;
}

HostTensor nan_tensor(DType dt, std::initializer_list<int64_t> shape) { return filled(dt, shape, NAN); }

// Shapes for the fused-epilogue matmuls (matmul_gelu, matmul_residual): out [M, N] = [M, K] x
// [K, N], the matrix beside out (pre, residual) at `offset` elements. Fused; N % 8 != 0; the
// side matrix at an odd element offset (not 16-byte aligned); a single row.
struct EpilogueShape {
  int64_t M, N, K, offset;
};
constexpr EpilogueShape kEpilogueShapes[] = {{300, 264, 96, 0}, {129, 36, 70, 0}, {64, 96, 40, 1}, {1, 8, 16, 0}};

}  // namespace

TEST_CASE("gpu: allocate gives zeroed aligned memory, copies are raw bytes", "[gpu][memory]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  CHECK(be.device() == Device::CUDA);
  INFO(be.name());
  for (size_t bytes : {size_t{1}, size_t{100}, size_t{4096}, size_t{100000}, size_t{10} << 20}) {
    void* p = be.allocate(bytes);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0);
    Tensor raw(p, DType::F32, {static_cast<int64_t>(bytes / 4)}, Device::CUDA);
    std::vector<float> back(bytes / 4, 1.0f);
    be.copy_to_host(back.data(), raw);
    size_t nonzero = 0;
    for (float f : back) nonzero += f != 0.0f;
    CHECK(nonzero == 0);
    be.release(p);
  }
  HostTensor h = rand_tensor(DType::BF16, {37}, 1);
  DeviceTensor d = DeviceTensor::of(be, h);
  CHECK(bits_differ(d.host(), h) == 0);
}

TEST_CASE("gpu: convert, fill, add, scale are bit-identical to the CPU", "[gpu][elementwise]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t n = 100003;
  std::vector<float> a = randn(n, 1, 1000.0f), b = randn(n, 2, 1000.0f);
  a[0] = 70000.0f;  // fp16 overflow
  a[1] = -65520.0f;
  a[2] = 1e-6f;     // fp16 subnormal
  for (DType src : kFloatTypes)
    for (DType dst : kFloatTypes) {
      INFO(dname(src) << " -> " << dname(dst));
      HostTensor x = make(src, {n}, a);
      HostTensor ref = nan_tensor(dst, {n});
      cpu().convert(ref.t, x.t);
      DeviceTensor dx = DeviceTensor::of(be, x), dy = DeviceTensor::of(be, nan_tensor(dst, {n}));
      be.convert(dy.t, dx.t);
      KEEL_CHECK_BITS("convert", std::string(dname(src)) + "->" + dname(dst), dy.host(), ref);
    }
  for (DType dt : kFloatTypes) {
    INFO(dname(dt));
    HostTensor ref = nan_tensor(dt, {n});
    cpu().fill(ref.t, 3.14159f);
    DeviceTensor d = DeviceTensor::of(be, nan_tensor(dt, {n}));
    be.fill(d.t, 3.14159f);
    KEEL_CHECK_BITS("fill", dname(dt), d.host(), ref);
    be.fill(d.t, 0.0f);
    cpu().fill(ref.t, 0.0f);
    KEEL_CHECK_BITS("fill", dname(dt), d.host(), ref);

    HostTensor x = make(dt, {n}, a), y = make(dt, {n}, b), z = nan_tensor(dt, {n});
    cpu().add(z.t, x.t, y.t);
    DeviceTensor dx = DeviceTensor::of(be, x), dy = DeviceTensor::of(be, y), dz = DeviceTensor::of(be, nan_tensor(dt, {n}));
    be.add(dz.t, dx.t, dy.t);
    KEEL_CHECK_BITS("add", dname(dt), dz.host(), z);
    be.add(dx.t, dx.t, dy.t);  // in place
    KEEL_CHECK_BITS("add", std::string(dname(dt)) + " in place", dx.host(), z);

    HostTensor s = clone(y);
    cpu().scale(s.t, 0.37f);
    be.scale(dy.t, 0.37f);
    KEEL_CHECK_BITS("scale", dname(dt), dy.host(), s);
  }
  // mixed dtypes: bf16 + f16 -> f32, f32 + bf16 -> bf16
  {
    HostTensor x = make(DType::BF16, {n}, a), y = make(DType::F16, {n}, b);
    for (DType out : {DType::F32, DType::BF16}) {
      HostTensor z = nan_tensor(out, {n});
      cpu().add(z.t, x.t, y.t);
      DeviceTensor dx = DeviceTensor::of(be, x), dy = DeviceTensor::of(be, y), dz = DeviceTensor::of(be, nan_tensor(out, {n}));
      be.add(dz.t, dx.t, dy.t);
      KEEL_CHECK_BITS("add", std::string("bf16+f16->") + dname(out), dz.host(), z);
    }
  }
}

TEST_CASE("gpu: sum, sum_squares, max_abs, count_nonfinite, count_zeros, grad_stats", "[gpu][reductions]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t n = 1000003;  // several chunks, ragged end
  for (DType dt : kFloatTypes) {
    INFO(dname(dt));
    std::vector<float> v = randn(n, 3, 5.0f);
    for (int64_t i = 0; i < n; i += 997) v[i] = 0.0f;
    HostTensor x = make(dt, {n}, v);
    DeviceTensor d = DeviceTensor::of(be, x);
    const double s = cpu().sum(x.t), ss = cpu().sum_squares(x.t);
    // sum: the error relative to sqrt(n) ||x||, the scale of its rounding (the sum itself may be near 0)
    KEEL_CHECK_ERR("sum", dname(dt), std::abs(be.sum(d.t) - s) / std::max(1.0, std::sqrt(ss) * std::sqrt(double(n))), 1e-12);
    KEEL_CHECK_ERR("sum_squares", dname(dt), std::abs(be.sum_squares(d.t) - ss) / ss, 1e-12);
    CHECK(be.max_abs(d.t) == cpu().max_abs(x.t));
    CHECK(be.count_zeros(d.t) == cpu().count_zeros(x.t));
    CHECK(be.count_nonfinite(d.t) == 0);
    // repeat: bit-identical
    const double s1 = be.sum(d.t), s2 = be.sum(d.t);
    CHECK(std::memcmp(&s1, &s2, sizeof s1) == 0);

    v[12345] = INFINITY;
    v[777777] = -INFINITY;
    HostTensor y = make(dt, {n}, v);
    DeviceTensor dy = DeviceTensor::of(be, y);
    CHECK(be.count_nonfinite(dy.t) == 2);
    CHECK(std::isinf(be.max_abs(dy.t)));
    v[500000] = NAN;
    HostTensor z = make(dt, {n}, v);
    DeviceTensor dz = DeviceTensor::of(be, z);
    CHECK(std::isnan(be.max_abs(dz.t)));  // NaN wins over inf
    CHECK(be.count_nonfinite(dz.t) == 3);
    CHECK(std::isnan(be.sum(dz.t)));

    // grad_stats: the three reductions in one pass, the same values bit for bit
    for (const DeviceTensor* t : {&d, &dy, &dz}) {
      const Backend::GradStats g = be.grad_stats(t->t);
      const double ss_sep = be.sum_squares(t->t);
      CHECK(std::memcmp(&g.sum_squares, &ss_sep, sizeof ss_sep) == 0);
      CHECK(g.zeros == be.count_zeros(t->t));
      CHECK(g.nonfinite == be.count_nonfinite(t->t));
    }
  }
  HostTensor empty(DType::F32, {0});
  DeviceTensor de(be, empty.t);
  CHECK(be.sum(de.t) == 0.0);
  CHECK(be.max_abs(de.t) == 0.0f);
}

TEST_CASE("gpu: matmul matches the CPU for every transpose, dtype, bias and accumulate", "[gpu][matmul]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  struct Types {
    DType a, b, out, bias;
  };
  const Types types[] = {
      {DType::F32, DType::F32, DType::F32, DType::F32},     {DType::BF16, DType::BF16, DType::BF16, DType::BF16},
      {DType::BF16, DType::BF16, DType::F32, DType::F32},   {DType::F16, DType::F16, DType::F16, DType::F16},
      {DType::F16, DType::F16, DType::F32, DType::F32},     {DType::BF16, DType::F32, DType::F32, DType::F32},
      {DType::F32, DType::F32, DType::BF16, DType::F32},    {DType::BF16, DType::BF16, DType::BF16, DType::F32},
  };
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{64, 96, 128}, {300, 270, 700}, {1, 5, 3}, {129, 65, 33}, {7, 9, 0}};
  uint32_t seed = 10;
  for (const Types& ty : types)
    for (const Shape& sh : shapes)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int acc = 0; acc < 2; ++acc)
            for (int bias = 0; bias < 2; ++bias) {
              const auto [M, N, K] = sh;
              INFO("a " << dname(ty.a) << " b " << dname(ty.b) << " out " << dname(ty.out) << " bias "
                        << dname(ty.bias) << " M " << M << " N " << N << " K " << K << " trans " << ta << tb
                        << " acc " << acc << " bias " << bias);
              HostTensor a = ta ? rand_tensor(ty.a, {K, M}, ++seed) : rand_tensor(ty.a, {M, K}, ++seed);
              HostTensor b = tb ? rand_tensor(ty.b, {N, K}, ++seed) : rand_tensor(ty.b, {K, N}, ++seed);
              HostTensor bv = rand_tensor(ty.bias, {N}, ++seed);
              HostTensor out0 = acc ? rand_tensor(ty.out, {M, N}, ++seed) : nan_tensor(ty.out, {M, N});
              HostTensor ref = clone(out0);
              cpu().matmul(ref.t, a.t, b.t, ta, tb, acc, bias ? &bv.t : nullptr);
              DeviceTensor da = DeviceTensor::of(be, a), db = DeviceTensor::of(be, b), dbias = DeviceTensor::of(be, bv);
              DeviceTensor dout = DeviceTensor::of(be, out0);
              be.matmul(dout.t, da.t, db.t, ta, tb, acc, bias ? &dbias.t : nullptr);
              HostTensor got = dout.host();
              const double f32_tol = ty.a == DType::F32 && ty.b == DType::F32 ? 1e-5 : 1e-4;
              KEEL_CHECK_ERR("matmul", std::string(dname(ty.a)) + "," + dname(ty.b) + "->" + dname(ty.out),
                             rel_err(got, ref), storage_tol(ty.out, f32_tol));
              // same call again: the same bits
              dout.upload(out0);
              be.matmul(dout.t, da.t, db.t, ta, tb, acc, bias ? &dbias.t : nullptr);
              CHECK(bits_differ(dout.host(), got) == 0);
            }
}

// Weight-gradient shapes (K = tokens, small M and N) are where cuBLASLt's heuristics offer
// split-K algorithms. Into bf16 only ones that reduce fp32 partials in a separate pass are
// allowed; into fp32 any (KEEL_SPLITK_ANY, default on: INPLACE and OUTPUT_TYPE partials are fp32
// there too), or with KEEL_SPLITK_ANY=0 the separate pass as well. Either way, written and
// accumulated (the gradients' +=) into an fp32 output as into a bf16 one: within the CPU's
// tolerance, and bit for bit again on a second call.
TEST_CASE("gpu: matmul with a long K (split-K candidates) matches the CPU and repeats bit for bit", "[gpu][matmul]") {
  KEEL_GPU_OR_SKIP();
  const int64_t M = 64, N = 96, K = 65536;
  const ScopedEnv env("KEEL_SPLITK_ANY");
  for (const char* any : {"1", "0"}) {
    const std::unique_ptr<Backend> owned = backend_with(env, any);
    Backend& be = *owned;
    REQUIRE(dynamic_cast<CudaBackend&>(be).splitk_any() == (any[0] == '1'));
    for (DType dt : {DType::F32, DType::BF16}) {
      HostTensor a = rand_tensor(dt, {K, M}, 21), b = rand_tensor(dt, {K, N}, 22);  // dW = a^T b
      for (DType out : {DType::F32, dt})
        for (const bool acc : {false, true}) {
          const std::string what = std::string(dname(dt)) + "->" + dname(out) + " K=65536" +
                                   (acc ? " accumulate" : "") + " KEEL_SPLITK_ANY=" + any;
          HostTensor start = acc ? rand_tensor(out, {M, N}, 23, 4.0f) : nan_tensor(out, {M, N});
          HostTensor ref = clone(start);
          cpu().matmul(ref.t, a.t, b.t, true, false, acc);
          DeviceTensor da = DeviceTensor::of(be, a), db = DeviceTensor::of(be, b), dout = DeviceTensor::of(be, start);
          be.matmul(dout.t, da.t, db.t, true, false, acc);
          const HostTensor got = dout.host();
          KEEL_CHECK_ERR("matmul", what, rel_err(got, ref), storage_tol(out, dt == DType::F32 ? 1e-5 : 1e-4));
          dout.upload(start);
          be.matmul(dout.t, da.t, db.t, true, false, acc);
          CHECK(bits_differ(dout.host(), got) == 0);
        }
    }
  }
}

TEST_CASE("gpu: matmul on views at odd element offsets (unaligned operands)", "[gpu][matmul]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t M = 33, N = 17, K = 41;
  for (DType dt : {DType::BF16, DType::F32}) {
    INFO(dname(dt));
    HostTensor a = rand_tensor(dt, {M * K + 1}, 1), b = rand_tensor(dt, {N * K + 3}, 2), bias = rand_tensor(dt, {N + 1}, 3);
    auto at = [](const Tensor& base, int64_t off, std::initializer_list<int64_t> shape) {
      Tensor t = base;
      t.data = static_cast<char*>(base.data) + off * dtype_size(base.dtype);
      return Tensor(t.data, t.dtype, shape, t.device);
    };
    HostTensor ref = nan_tensor(dt, {M, N});
    Tensor bias_h = at(bias.t, 1, {N});
    cpu().matmul(ref.t, at(a.t, 1, {M, K}), at(b.t, 3, {N, K}), false, true, false, &bias_h);
    DeviceTensor da = DeviceTensor::of(be, a), db = DeviceTensor::of(be, b), dbias = DeviceTensor::of(be, bias);
    DeviceTensor dout = DeviceTensor::of(be, nan_tensor(dt, {M, N}));
    Tensor bias_d = at(dbias.t, 1, {N});
    be.matmul(dout.t, at(da.t, 1, {M, K}), at(db.t, 3, {N, K}), false, true, false, &bias_d);
    KEEL_CHECK_ERR("matmul", std::string(dname(dt)) + " odd offsets", rel_err(dout.host(), ref), storage_tol(dt, 1e-5));
  }
}

TEST_CASE("gpu: bias_backward sums rows like the CPU", "[gpu][matmul]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  for (DType dt : kFloatTypes)
    for (int64_t rows : {1, 63, 64, 1000, 4099})
      for (bool acc : {true, false}) {
        INFO(dname(dt) << " rows " << rows << " accumulate " << acc);
        const int64_t C = 300;
        // Written (not accumulating) over NaN: an element left unwritten shows.
        HostTensor dout = rand_tensor(dt, {rows, C}, 5);
        HostTensor db = acc ? rand_tensor(DType::F32, {C}, 6) : nan_tensor(DType::F32, {C});
        HostTensor ref = clone(db);
        cpu().bias_backward(ref.t, dout.t, acc);
        DeviceTensor dd = DeviceTensor::of(be, dout), ddb = DeviceTensor::of(be, db);
        be.bias_backward(ddb.t, dd.t, acc);
        HostTensor got = ddb.host();
        KEEL_CHECK_ERR("bias_backward", std::string(dname(dt)) + "->f32", rel_err(got, ref), 1e-5);
        ddb.upload(db);
        be.bias_backward(ddb.t, dd.t, acc);
        CHECK(bits_differ(ddb.host(), got) == 0);
      }
}

// A column sum over no rows is zero: stored (over NaN, so an unwritten gradient shows) when not
// accumulating, left as it was when accumulating, as the CPU does. For bias_backward,
// matmul_bias_grad (K = 0 rows: no cuBLASLt call) and both norms' parameter gradients.
TEST_CASE("gpu: column sums over no rows store zero gradients, as the CPU", "[gpu][norms][matmul]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t C = 40, out_cols = 24;
  for (DType dt : kFloatTypes)
    for (bool acc : {false, true}) {
      INFO(dname(dt) << " accumulate " << acc);
      const HostTensor none(dt, {0, C}), stats(DType::F32, {0}), w = rand_tensor(dt, {C}, 1);
      const HostTensor g0 = acc ? rand_tensor(DType::F32, {C}, 2) : nan_tensor(DType::F32, {C});
      DeviceTensor dnone(be, none.t), ddin(be, none.t), dstats(be, stats.t), dw = DeviceTensor::of(be, w);
      // each op's gradients on the CPU and the GPU from the same start g0, compared bit for bit
      const auto check = [&](const char* op, auto&& cpu_op, auto&& gpu_op) {
        HostTensor ref_w = clone(g0), ref_b = clone(g0);
        cpu_op(ref_w.t, ref_b.t);
        DeviceTensor got_w = DeviceTensor::of(be, g0), got_b = DeviceTensor::of(be, g0);
        gpu_op(got_w.t, got_b.t);
        KEEL_CHECK_BITS(op, dname(dt), got_w.host(), ref_w);
        KEEL_CHECK_BITS(op, dname(dt), got_b.host(), ref_b);
      };
      check("bias_backward", [&](const Tensor&, const Tensor& db) { cpu().bias_backward(db, none.t, acc); },
            [&](const Tensor&, const Tensor& db) { be.bias_backward(db, dnone.t, acc); });
      check("layernorm_backward",
            [&](const Tensor& gw, const Tensor& gb) {
              cpu().layernorm_backward(none.t, gw, gb, none.t, none.t, w.t, stats.t, stats.t, false, acc);
            },
            [&](const Tensor& gw, const Tensor& gb) {
              be.layernorm_backward(ddin.t, gw, gb, dnone.t, dnone.t, dw.t, dstats.t, dstats.t, false, acc);
            });
      check("rmsnorm_backward",
            [&](const Tensor& gw, const Tensor&) {
              cpu().rmsnorm_backward(none.t, gw, none.t, none.t, w.t, stats.t, false, acc);
            },
            [&](const Tensor& gw, const Tensor&) {
              be.rmsnorm_backward(ddin.t, gw, dnone.t, dnone.t, dw.t, dstats.t, false, acc);
            });
      // matmul_bias_grad: dweight [out_cols, C] = dout^T in over no rows, dbias [out_cols]
      const HostTensor dout(dt, {0, out_cols}), gw0 = acc ? rand_tensor(DType::F32, {out_cols, C}, 3)
                                                          : nan_tensor(DType::F32, {out_cols, C});
      const HostTensor gb0 = acc ? rand_tensor(DType::F32, {out_cols}, 4) : nan_tensor(DType::F32, {out_cols});
      HostTensor ref_w = clone(gw0), ref_b = clone(gb0);
      cpu().matmul_bias_grad(ref_w.t, ref_b.t, dout.t, none.t, acc, acc);
      DeviceTensor ddout(be, dout.t), got_w = DeviceTensor::of(be, gw0), got_b = DeviceTensor::of(be, gb0);
      be.matmul_bias_grad(got_w.t, got_b.t, ddout.t, dnone.t, acc, acc);
      KEEL_CHECK_BITS("matmul_bias_grad dweight", dname(dt), got_w.host(), ref_w);
      KEEL_CHECK_BITS("matmul_bias_grad dbias", dname(dt), got_b.host(), ref_b);
    }
}

// matmul_gelu / matmul_gelu_backward. Where cuBLASLt's GELU epilogues run (N % 8 == 0, pre
// 16-byte aligned) the GELU is applied to the fp32 product, so the reference is that: the CPU's
// product in fp32, then the CPU's GELU rounding once into the output dtype. The fallback (N % 8
// != 0, or pre at an odd offset) is matmul then the GELU kernel, which rounds pre (or the
// product) first, so its reference is the CPU's own composition. The tolerances are the
// matmul's on both paths (the fused path against the other reference measures 2-3e-3 in bf16:
// the references differ by one storage rounding). In fp32 the 1e-5 bound also tells cuBLASLt's
// GELU from the exact erf GELU, which differs from the tanh form by up to 5e-4.
// The backward's error is taken over the norm of the product it scales (gelu'(pre) * prod):
// gelu' crosses zero near x = -0.75, where any fp32 evaluation of it (cuBLASLt's or the CPU's)
// has unbounded relative error, so over ||din|| a few such elements of a small case decide the
// result (on an H100: 1.3e-5 in fp32 over 8 elements, 4e-6 over 79k). |gelu'| <= 1.13, so a
// wrong formula, operand or rounding shows the same over ||prod|| as over ||din||.
TEST_CASE("gpu: matmul_gelu and matmul_gelu_backward match the CPU (GELU epilogues and fallback)", "[gpu][matmul]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  uint32_t seed = 500;
  for (DType dt : kFloatTypes)
    for (const EpilogueShape& sh : kEpilogueShapes)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int bias = 0; bias < 2; ++bias) {
            const auto [M, N, K, off] = sh;
            const std::string what = std::string(dname(dt)) + " M " + std::to_string(M) + " N " + std::to_string(N) +
                                     " K " + std::to_string(K) + (off ? " pre unaligned" : "") + " trans " +
                                     std::to_string(ta) + std::to_string(tb) + (bias ? " bias" : "");
            INFO(what);
            HostTensor a = ta ? rand_tensor(dt, {K, M}, ++seed) : rand_tensor(dt, {M, K}, ++seed);
            HostTensor b = tb ? rand_tensor(dt, {N, K}, ++seed, 0.3f) : rand_tensor(dt, {K, N}, ++seed, 0.3f);
            HostTensor bv = rand_tensor(dt, {N}, ++seed);
            const Tensor* bias_h = bias ? &bv.t : nullptr;
            const bool fused = N % 8 == 0 && off == 0;
            // fused reference: fp32 product (+ bias), pre rounded once, act = gelu(fp32 pre) rounded
            // once; fallback: pre rounded, act = gelu(pre)
            HostTensor pre32 = nan_tensor(DType::F32, {M, N}), pre_ref = nan_tensor(dt, {M, N});
            HostTensor act_ref = nan_tensor(dt, {M, N});
            cpu().matmul(pre32.t, a.t, b.t, ta, tb, false, bias_h);
            cpu().convert(pre_ref.t, pre32.t);
            cpu().gelu_forward(act_ref.t, fused ? pre32.t : pre_ref.t);

            DeviceTensor da = DeviceTensor::of(be, a), db = DeviceTensor::of(be, b), dbias = DeviceTensor::of(be, bv);
            DeviceTensor dact = DeviceTensor::of(be, nan_tensor(dt, {M, N}));
            DeviceTensor pre_buf = DeviceTensor::of(be, nan_tensor(dt, {M * N + off}));
            const Tensor pre(static_cast<char*>(pre_buf.t.data) + off * dtype_size(dt), dt, {M, N}, Device::CUDA);
            be.matmul_gelu(dact.t, pre, da.t, db.t, ta, tb, bias ? &dbias.t : nullptr);
            const double tol = storage_tol(dt, dt == DType::F32 ? 1e-5 : 1e-4);
            HostTensor pre_got = host_like(pre), act_got = dact.host();
            be.copy_to_host(pre_got.t.data, pre);
            KEEL_CHECK_ERR("matmul_gelu (pre)", what, rel_err(pre_got, pre_ref), tol);
            KEEL_CHECK_ERR("matmul_gelu (act)", what, rel_err(act_got, act_ref), tol);
            be.matmul_gelu(dact.t, pre, da.t, db.t, ta, tb, bias ? &dbias.t : nullptr);  // again: same bits
            CHECK(bits_differ(dact.host(), act_got) == 0);

            // backward: din = gelu'(pre) * (op(g) @ op(w)), with g [M, K2] and w giving N columns
            const int64_t K2 = K + 8;
            HostTensor g = ta ? rand_tensor(dt, {K2, M}, ++seed) : rand_tensor(dt, {M, K2}, ++seed);
            HostTensor w = tb ? rand_tensor(dt, {N, K2}, ++seed, 0.3f) : rand_tensor(dt, {K2, N}, ++seed, 0.3f);
            HostTensor prod32 = nan_tensor(DType::F32, {M, N}), din_ref = nan_tensor(dt, {M, N});
            HostTensor din_composed = nan_tensor(dt, {M, N});  // product rounded to dt, then gelu'
            cpu().matmul(prod32.t, g.t, w.t, ta, tb);
            cpu().matmul_gelu_backward(din_composed.t, g.t, w.t, ta, tb, pre_got.t);
            if (fused)
              cpu().gelu_backward(din_ref.t, prod32.t, pre_got.t);  // gelu' of the pre the GPU stored
            else
              din_ref = clone(din_composed);
            DeviceTensor dg = DeviceTensor::of(be, g), dw = DeviceTensor::of(be, w);
            DeviceTensor ddin = DeviceTensor::of(be, nan_tensor(dt, {M, N}));
            be.matmul_gelu_backward(ddin.t, dg.t, dw.t, ta, tb, pre);
            const HostTensor din_got = ddin.host();
            KEEL_CHECK_ERR("matmul_gelu_backward", what, err_over(din_got, din_ref, prod32), tol);
            // Which reference cuBLASLt's DGELU epilogue follows (logged, not checked): whether it
            // rounds the product to the output dtype before the multiply (an H100's did, within
            // 1e-4 of this reference: bench/GPU_ERRORS.md).
            if (fused && dt != DType::F32)
              log_comparison("matmul_gelu_backward vs product rounded first (not checked)", what,
                             err_over(din_got, din_composed, prod32), tol, "rel");
            ddin.upload(nan_tensor(dt, {M, N}));
            be.matmul_gelu_backward(ddin.t, dg.t, dw.t, ta, tb, pre);
            CHECK(bits_differ(ddin.host(), din_got) == 0);
          }
}

// matmul_residual: out = residual + (op(a) @ op(b) (+ bias)). Where cuBLASLt reads the residual
// as C (residual of out's dtype) the sum is formed in fp32 and rounded once, so the reference is
// the CPU's fp32 product (+ bias) plus the residual, rounded once; a residual of another dtype
// takes the composition (matmul, then add), whose reference is the CPU's own. A residual at an
// odd element offset may run either way (cuBLASLt may or may not have an algorithm for a 2-byte
// aligned C), so there the nearer of the two references is held to the tolerance. Tolerances
// are the matmul's: the two references differ by one storage rounding (2-3e-3 in bf16).
TEST_CASE("gpu: matmul_residual matches the CPU (residual as cuBLASLt's C, and the composition)", "[gpu][matmul]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  uint32_t seed = 900;
  for (DType dt : kFloatTypes)
    for (int mixed = 0; mixed < 2; ++mixed) {
      if (mixed && dt == DType::F32) continue;
      const DType res_dt = mixed ? DType::F32 : dt;  // an fp32 residual stream into bf16/fp16: composed
      for (const EpilogueShape& sh : kEpilogueShapes)
        for (int ta = 0; ta < 2; ++ta)
          for (int bias = 0; bias < 2; ++bias) {
            const auto [M, N, K, off] = sh;
            const std::string what = std::string(dname(dt)) + " residual " + dname(res_dt) + " M " +
                                     std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K) +
                                     (off ? " residual unaligned" : "") + " trans_a " + std::to_string(ta) +
                                     (bias ? " bias" : "");
            INFO(what);
            HostTensor a = ta ? rand_tensor(dt, {K, M}, ++seed) : rand_tensor(dt, {M, K}, ++seed);
            HostTensor w = rand_tensor(dt, {N, K}, ++seed, 0.3f);  // a linear layer's weight: trans_b
            HostTensor bv = rand_tensor(dt, {N}, ++seed);
            HostTensor res = rand_tensor(res_dt, {M * N + off}, ++seed, 2.0f);
            const Tensor res_h(static_cast<char*>(res.t.data) + off * dtype_size(res_dt), res_dt, {M, N}, Device::CPU);
            const Tensor* bias_h = bias ? &bv.t : nullptr;
            // fused: fp32 product (+ bias) + residual, rounded once; composed: the CPU's own op
            HostTensor prod32 = nan_tensor(DType::F32, {M, N}), fused_ref = nan_tensor(dt, {M, N});
            cpu().matmul(prod32.t, a.t, w.t, ta, true, false, bias_h);
            cpu().add(fused_ref.t, prod32.t, res_h);
            HostTensor composed_ref = nan_tensor(dt, {M, N});
            cpu().matmul_residual(composed_ref.t, res_h, a.t, w.t, ta, true, bias_h);

            DeviceTensor da = DeviceTensor::of(be, a), dw = DeviceTensor::of(be, w), dbias = DeviceTensor::of(be, bv);
            DeviceTensor dres = DeviceTensor::of(be, res), dout = DeviceTensor::of(be, nan_tensor(dt, {M, N}));
            const Tensor res_d(static_cast<char*>(dres.t.data) + off * dtype_size(res_dt), res_dt, {M, N},
                               Device::CUDA);
            be.matmul_residual(dout.t, res_d, da.t, dw.t, ta, true, bias ? &dbias.t : nullptr);
            const HostTensor got = dout.host();
            const double tol = storage_tol(dt, dt == DType::F32 ? 1e-5 : 1e-4);
            const double err_fused = rel_err(got, fused_ref), err_composed = rel_err(got, composed_ref);
            if (res_dt != dt)
              KEEL_CHECK_ERR("matmul_residual (composed)", what, err_composed, tol);
            else if (off == 0)
              KEEL_CHECK_ERR("matmul_residual", what, err_fused, tol);
            else
              KEEL_CHECK_ERR("matmul_residual (either path)", what, std::min(err_fused, err_composed), tol);
            CHECK(bits_differ(dres.host(), res) == 0);  // the residual is read, never written
            dout.upload(nan_tensor(dt, {M, N}));
            be.matmul_residual(dout.t, res_d, da.t, dw.t, ta, true, bias ? &dbias.t : nullptr);  // same bits
            CHECK(bits_differ(dout.host(), got) == 0);
          }
    }
}

// matmul_bias_grad: dW (+)= dout^T in and db (+)= sum_rows dout, through cuBLASLt's BGRADB
// epilogue where it runs (else matmul, then bias_backward). Either way each output is an fp32 sum
// of the same products or values in another order, so the tolerances are the matmul's for dW
// (1e-5 from fp32 inputs, 1e-4 from bf16/fp16) and bias_backward's (1e-5) for db. Both are
// stored over NaN on a first contribution, and added to random values when accumulating; a db
// at an odd element offset (not 16-byte aligned) takes the staged path.
TEST_CASE("gpu: matmul_bias_grad matches matmul and bias_backward on the CPU", "[gpu][matmul]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  struct Shape {
    int64_t rows, out, in, db_offset;
  };
  const Shape shapes[] = {{1000, 264, 96, 0}, {4099, 36, 40, 0}, {64, 96, 72, 1}, {1, 8, 16, 0}};
  uint32_t seed = 1300;
  for (DType dt : kFloatTypes)
    for (const Shape& sh : shapes)
      for (int acc_w = 0; acc_w < 2; ++acc_w)
        for (int acc_b = 0; acc_b < 2; ++acc_b) {
          const auto [R, O, I, off] = sh;
          const std::string what = std::string(dname(dt)) + " rows " + std::to_string(R) + " out " +
                                   std::to_string(O) + " in " + std::to_string(I) + (off ? " db unaligned" : "") +
                                   (acc_w ? " accumulate dW" : "") + (acc_b ? " accumulate db" : "");
          INFO(what);
          HostTensor dout = rand_tensor(dt, {R, O}, ++seed), in = rand_tensor(dt, {R, I}, ++seed);
          HostTensor w0 = acc_w ? rand_tensor(DType::F32, {O, I}, ++seed) : nan_tensor(DType::F32, {O, I});
          // the element before an unaligned db is finite, and must come back unchanged
          std::vector<float> b_init = randn(O + off, ++seed);
          if (!acc_b) std::fill(b_init.begin() + off, b_init.end(), NAN);
          HostTensor b0 = make(DType::F32, {O + off}, b_init);
          HostTensor w_ref = clone(w0), b_ref = clone(b0);
          const Tensor b_ref_view(static_cast<float*>(b_ref.t.data) + off, DType::F32, {O}, Device::CPU);
          cpu().matmul(w_ref.t, dout.t, in.t, true, false, acc_w);
          cpu().bias_backward(b_ref_view, dout.t, acc_b);

          DeviceTensor ddout = DeviceTensor::of(be, dout), din = DeviceTensor::of(be, in);
          DeviceTensor dw = DeviceTensor::of(be, w0), db = DeviceTensor::of(be, b0);
          const Tensor db_view(static_cast<float*>(db.t.data) + off, DType::F32, {O}, Device::CUDA);
          be.matmul_bias_grad(dw.t, db_view, ddout.t, din.t, acc_w, acc_b);
          const HostTensor w_got = dw.host(), b_got = db.host();
          KEEL_CHECK_ERR("matmul_bias_grad (dweight)", what, rel_err(w_got, w_ref), dt == DType::F32 ? 1e-5 : 1e-4);
          KEEL_CHECK_ERR("matmul_bias_grad (dbias)", what, rel_err(b_got, b_ref), 1e-5);
          dw.upload(w0);
          db.upload(b0);
          be.matmul_bias_grad(dw.t, db_view, ddout.t, din.t, acc_w, acc_b);  // again: same bits
          CHECK(bits_differ(dw.host(), w_got) == 0);
          CHECK(bits_differ(db.host(), b_got) == 0);
        }
}

TEST_CASE("gpu: matmul_residual rejects a residual of another shape or aliasing its output, naming both",
          "[gpu][errors]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  using Catch::Contains;
  DeviceTensor out = DeviceTensor::of(be, nan_tensor(DType::BF16, {4, 16})),
               res = DeviceTensor::of(be, nan_tensor(DType::BF16, {4, 8})),
               a = DeviceTensor::of(be, rand_tensor(DType::BF16, {4, 32}, 1)),
               w = DeviceTensor::of(be, rand_tensor(DType::BF16, {16, 32}, 2));
  CHECK_THROWS_WITH(be.matmul_residual(out.t, res.t, a.t, w.t, false, true),
                    Contains("matmul_residual") && Contains("out=[4, 16] bf16") && Contains("residual=[4, 8] bf16"));
  CHECK_THROWS_WITH(be.matmul_residual(out.t, out.t, a.t, w.t, false, true),
                    Contains("matmul_residual") && Contains("different buffers"));
  // the CPU reference refuses the alias too: its matmul would overwrite the residual first
  HostTensor h_out = nan_tensor(DType::F32, {4, 16}), h_a = rand_tensor(DType::F32, {4, 32}, 3),
             h_w = rand_tensor(DType::F32, {16, 32}, 4);
  CHECK_THROWS_WITH(cpu().matmul_residual(h_out.t, h_out.t, h_a.t, h_w.t, false, true),
                    Contains("matmul_residual") && Contains("different buffers"));
}

TEST_CASE("gpu: matmul_gelu rejects a pre of another shape or aliasing its output, naming both", "[gpu][errors]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  using Catch::Contains;
  DeviceTensor a(be, HostTensor(DType::BF16, {4, 8}).t), w(be, HostTensor(DType::BF16, {16, 8}).t);
  DeviceTensor act(be, HostTensor(DType::BF16, {4, 16}).t), pre(be, HostTensor(DType::BF16, {4, 8}).t);
  CHECK_THROWS_WITH(be.matmul_gelu(act.t, pre.t, a.t, w.t, false, true),
                    Contains("matmul_gelu") && Contains("act=[4, 16] bf16") && Contains("pre=[4, 8] bf16"));
  CHECK_THROWS_WITH(be.matmul_gelu(act.t, act.t, a.t, w.t, false, true),
                    Contains("matmul_gelu") && Contains("different buffers"));
  DeviceTensor pre32(be, HostTensor(DType::F32, {4, 16}).t), dx(be, HostTensor(DType::BF16, {4, 8}).t);
  CHECK_THROWS_WITH(be.matmul_gelu_backward(act.t, dx.t, w.t, false, true, pre32.t),
                    Contains("matmul_gelu_backward") && Contains("pre=[4, 16] f32"));
}

TEST_CASE("gpu: layernorm and rmsnorm forward and backward match the CPU", "[gpu][norms]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  for (DType dt : kFloatTypes)
    for (int64_t C : {100, 768, 2048, 8192})
      for (int acc = 0; acc < 2; ++acc) {
        const int64_t N = 700;
        INFO(dname(dt) << " C " << C << " accumulate " << acc);
        HostTensor x = rand_tensor(dt, {N, C}, 1, 2.0f), w = rand_tensor(dt, {C}, 2), b = rand_tensor(dt, {C}, 3);
        HostTensor dy = rand_tensor(dt, {N, C}, 4);
        DeviceTensor dx = DeviceTensor::of(be, x), dw = DeviceTensor::of(be, w), dbv = DeviceTensor::of(be, b);
        DeviceTensor ddy = DeviceTensor::of(be, dy);
        // LayerNorm forward
        HostTensor out = nan_tensor(dt, {N, C}), mean = nan_tensor(DType::F32, {N}), rstd = nan_tensor(DType::F32, {N});
        cpu().layernorm_forward(out.t, mean.t, rstd.t, x.t, w.t, b.t, 1e-5f);
        DeviceTensor dout = DeviceTensor::of(be, nan_tensor(dt, {N, C}));
        DeviceTensor dmean = DeviceTensor::of(be, nan_tensor(DType::F32, {N})), drstd = DeviceTensor::of(be, nan_tensor(DType::F32, {N}));
        be.layernorm_forward(dout.t, dmean.t, drstd.t, dx.t, dw.t, dbv.t, 1e-5f);
        KEEL_CHECK_ERR("layernorm_forward out", dname(dt), rel_err(dout.host(), out), storage_tol(dt, 1e-6));
        KEEL_CHECK_ERR("layernorm_forward mean", dname(dt), rel_err(dmean.host(), mean), 1e-6);
        KEEL_CHECK_ERR("layernorm_forward rstd", dname(dt), rel_err(drstd.host(), rstd), 1e-6);
        // LayerNorm backward (from the CPU's stats, so that only the backward is compared)
        HostTensor din0 = acc ? rand_tensor(dt, {N, C}, 7) : nan_tensor(dt, {N, C});
        // Not accumulating, the gradients are written: NaN where they start shows an unwritten one.
        HostTensor gw0 = acc ? rand_tensor(DType::F32, {C}, 8) : nan_tensor(DType::F32, {C});
        HostTensor gb0 = acc ? rand_tensor(DType::F32, {C}, 9) : nan_tensor(DType::F32, {C});
        HostTensor din = clone(din0), gw = clone(gw0), gb = clone(gb0);
        cpu().layernorm_backward(din.t, gw.t, gb.t, dy.t, x.t, w.t, mean.t, rstd.t, acc, acc);
        DeviceTensor ddin = DeviceTensor::of(be, din0), dgw = DeviceTensor::of(be, gw0), dgb = DeviceTensor::of(be, gb0);
        dmean.upload(mean);
        drstd.upload(rstd);
        be.layernorm_backward(ddin.t, dgw.t, dgb.t, ddy.t, dx.t, dw.t, dmean.t, drstd.t, acc, acc);
        KEEL_CHECK_ERR("layernorm_backward din", dname(dt), rel_err(ddin.host(), din), storage_tol(dt, 1e-5));
        KEEL_CHECK_ERR("layernorm_backward dweight", dname(dt), rel_err(dgw.host(), gw), 1e-5);
        KEEL_CHECK_ERR("layernorm_backward dbias", dname(dt), rel_err(dgb.host(), gb), 1e-5);
        {  // determinism
          const HostTensor got_din = ddin.host(), got_gw = dgw.host(), got_gb = dgb.host();
          ddin.upload(din0);
          dgw.upload(gw0);
          dgb.upload(gb0);
          be.layernorm_backward(ddin.t, dgw.t, dgb.t, ddy.t, dx.t, dw.t, dmean.t, drstd.t, acc, acc);
          CHECK(bits_differ(ddin.host(), got_din) == 0);
          CHECK(bits_differ(dgw.host(), got_gw) == 0);
          CHECK(bits_differ(dgb.host(), got_gb) == 0);
        }
        // RMSNorm forward and backward
        HostTensor rout = nan_tensor(dt, {N, C}), rrstd = nan_tensor(DType::F32, {N});
        cpu().rmsnorm_forward(rout.t, rrstd.t, x.t, w.t, 1e-5f);
        dout.upload(nan_tensor(dt, {N, C}));  // poison again: an element left unwritten shows
        drstd.upload(nan_tensor(DType::F32, {N}));
        be.rmsnorm_forward(dout.t, drstd.t, dx.t, dw.t, 1e-5f);
        KEEL_CHECK_ERR("rmsnorm_forward out", dname(dt), rel_err(dout.host(), rout), storage_tol(dt, 1e-6));
        KEEL_CHECK_ERR("rmsnorm_forward rstd", dname(dt), rel_err(drstd.host(), rrstd), 1e-6);
        HostTensor rdin = clone(din0), rgw = clone(gw0);
        cpu().rmsnorm_backward(rdin.t, rgw.t, dy.t, x.t, w.t, rrstd.t, acc, acc);
        ddin.upload(din0);
        dgw.upload(gw0);
        drstd.upload(rrstd);
        be.rmsnorm_backward(ddin.t, dgw.t, ddy.t, dx.t, dw.t, drstd.t, acc, acc);
        const HostTensor got_din = ddin.host(), got_gw = dgw.host();
        KEEL_CHECK_ERR("rmsnorm_backward din", dname(dt), rel_err(got_din, rdin), storage_tol(dt, 1e-5));
        KEEL_CHECK_ERR("rmsnorm_backward dweight", dname(dt), rel_err(got_gw, rgw), 1e-5);
        // determinism
        ddin.upload(din0);
        dgw.upload(gw0);
        be.rmsnorm_backward(ddin.t, dgw.t, ddy.t, dx.t, dw.t, drstd.t, acc, acc);
        CHECK(bits_differ(ddin.host(), got_din) == 0);
        CHECK(bits_differ(dgw.host(), got_gw) == 0);
        // In place (din is dout, as the Transformer may pass them): the parameter gradients
        // must see dout before dx overwrites it, chunk by chunk of rows (C 8192: 2 chunks of
        // bf16 / f16 rows, 3 of f32; see kernels/cuda/norms.cu), so the same bits as above.
        if (!acc) {
          DeviceTensor inplace = DeviceTensor::of(be, dy);
          dgw.upload(gw0);
          be.rmsnorm_backward(inplace.t, dgw.t, inplace.t, dx.t, dw.t, drstd.t, false, false);
          CHECK(bits_differ(inplace.host(), got_din) == 0);
          CHECK(bits_differ(dgw.host(), got_gw) == 0);
          inplace.upload(dy);
          dgw.upload(gw0);
          dgb.upload(gb0);
          dmean.upload(mean);
          drstd.upload(rstd);
          ddin.upload(din0);
          DeviceTensor ref_gb = DeviceTensor::of(be, gb0);
          be.layernorm_backward(ddin.t, dgw.t, ref_gb.t, ddy.t, dx.t, dw.t, dmean.t, drstd.t, false, false);
          const HostTensor ln_din = ddin.host(), ln_gw = dgw.host(), ln_gb = ref_gb.host();
          dgw.upload(gw0);
          be.layernorm_backward(inplace.t, dgw.t, dgb.t, inplace.t, dx.t, dw.t, dmean.t, drstd.t, false, false);
          CHECK(bits_differ(inplace.host(), ln_din) == 0);
          CHECK(bits_differ(dgw.host(), ln_gw) == 0);
          CHECK(bits_differ(dgb.host(), ln_gb) == 0);
        }
      }
}

TEST_CASE("gpu: gelu and swiglu forward and backward match the CPU", "[gpu][activations]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t N = 333, F = 517;
  for (DType dt : kFloatTypes) {
    INFO(dname(dt));
    HostTensor x = rand_tensor(dt, {N, F}, 1, 3.0f), dy = rand_tensor(dt, {N, F}, 2);
    HostTensor y = nan_tensor(dt, {N, F}), dx = nan_tensor(dt, {N, F});
    cpu().gelu_forward(y.t, x.t);
    cpu().gelu_backward(dx.t, dy.t, x.t);
    DeviceTensor dxx = DeviceTensor::of(be, x), ddy = DeviceTensor::of(be, dy);
    DeviceTensor dyy = DeviceTensor::of(be, nan_tensor(dt, {N, F})), ddx = DeviceTensor::of(be, nan_tensor(dt, {N, F}));
    be.gelu_forward(dyy.t, dxx.t);
    be.gelu_backward(ddx.t, ddy.t, dxx.t);
    KEEL_CHECK_ERR("gelu_forward", dname(dt), rel_err(dyy.host(), y), storage_tol(dt, 1e-6));
    KEEL_CHECK_ERR("gelu_backward", dname(dt), rel_err(ddx.host(), dx), storage_tol(dt, 1e-6));
    be.gelu_backward(ddy.t, ddy.t, dxx.t);  // in place over dout
    KEEL_CHECK_ERR("gelu_backward", std::string(dname(dt)) + " in place", rel_err(ddy.host(), dx), storage_tol(dt, 1e-6));

    HostTensor packed = rand_tensor(dt, {N, 2 * F}, 3, 3.0f), sy = nan_tensor(dt, {N, F}), sdx = nan_tensor(dt, {N, 2 * F});
    cpu().swiglu_forward(sy.t, packed.t);
    cpu().swiglu_backward(sdx.t, dy.t, packed.t);
    DeviceTensor dp = DeviceTensor::of(be, packed), dsy = DeviceTensor::of(be, nan_tensor(dt, {N, F}));
    DeviceTensor dsdx = DeviceTensor::of(be, nan_tensor(dt, {N, 2 * F}));
    ddy.upload(dy);
    be.swiglu_forward(dsy.t, dp.t);
    be.swiglu_backward(dsdx.t, ddy.t, dp.t);
    KEEL_CHECK_ERR("swiglu_forward", dname(dt), rel_err(dsy.host(), sy), storage_tol(dt, 1e-6));
    KEEL_CHECK_ERR("swiglu_backward", dname(dt), rel_err(dsdx.host(), sdx), storage_tol(dt, 1e-6));
    // The fused rebuild (selective recomputation) must give both ops' bits, which the two
    // comparisons above tie to the CPU.
    DeviceTensor ry = DeviceTensor::of(be, nan_tensor(dt, {N, F})), rdx = DeviceTensor::of(be, nan_tensor(dt, {N, 2 * F}));
    be.swiglu_backward_rebuild(rdx.t, ry.t, ddy.t, dp.t);
    KEEL_CHECK_BITS("swiglu_backward_rebuild out", dname(dt), ry.host(), dsy.host());
    KEEL_CHECK_BITS("swiglu_backward_rebuild din", dname(dt), rdx.host(), dsdx.host());
    CHECK_THROWS_WITH(be.swiglu_backward_rebuild(dp.t, ry.t, ddy.t, dp.t), Catch::Contains("must not alias"));
  }
}

// The elementwise kernels move 16-byte packs when every operand is 16-byte aligned (and, for
// SwiGLU, F is a multiple of the pack) and single elements otherwise; n % pack elements at the
// end take the single path too. Every path must give the same bits.
TEST_CASE("gpu: packed and one-element paths of the elementwise ops give the same bits", "[gpu][elementwise]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t N = 37, F = 512;  // N * F and F are multiples of every pack width; n = N * F + 5 is not
  for (DType dt : kFloatTypes) {
    INFO(dname(dt));
    const int64_t n = N * F + 5;
    HostTensor a = rand_tensor(dt, {n}, 11, 3.0f), b = rand_tensor(dt, {n}, 12);
    // run(shift) -> the result on the host; shift 0: aligned operands, shift 1: unaligned ones
    auto both = [&](const char* op, auto&& run) {
      KEEL_CHECK_BITS(op, std::string(dname(dt)) + " packed vs one-element", run(0), run(1));
    };
    both("add", [&](int64_t shift) {
      DeviceTensor x = DeviceTensor::of(be, a, shift), y = DeviceTensor::of(be, b, shift);
      DeviceTensor z = DeviceTensor::of(be, nan_tensor(dt, {n}), shift);
      be.add(z.t, x.t, y.t);
      return z.host();
    });
    both("scale", [&](int64_t shift) {
      DeviceTensor x = DeviceTensor::of(be, a, shift);
      be.scale(x.t, 0.37f);
      return x.host();
    });
    both("gelu_forward + gelu_backward", [&](int64_t shift) {
      DeviceTensor x = DeviceTensor::of(be, a, shift), y = DeviceTensor::of(be, nan_tensor(dt, {n}), shift);
      DeviceTensor dy = DeviceTensor::of(be, b, shift);
      be.gelu_forward(y.t, x.t);
      be.gelu_backward(dy.t, dy.t, y.t);
      return dy.host();
    });
    HostTensor packed_in = rand_tensor(dt, {N, 2 * F}, 13, 3.0f), dout = rand_tensor(dt, {N, F}, 14);
    both("swiglu_forward + swiglu_backward", [&](int64_t shift) {
      DeviceTensor x = DeviceTensor::of(be, packed_in, shift), y = DeviceTensor::of(be, nan_tensor(dt, {N, F}), shift);
      DeviceTensor dy = DeviceTensor::of(be, dout, shift), dx = DeviceTensor::of(be, nan_tensor(dt, {N, 2 * F}), shift);
      be.swiglu_forward(y.t, x.t);
      be.swiglu_backward(dx.t, dy.t, x.t);
      HostTensor res(dt, {N * 3 * F});  // out | din
      be.copy_to_host(res.t.data, y.t);
      be.copy_to_host(static_cast<char*>(res.t.data) + y.t.bytes(), dx.t);
      return res;
    });
    both("swiglu_backward_rebuild", [&](int64_t shift) {
      DeviceTensor x = DeviceTensor::of(be, packed_in, shift), y = DeviceTensor::of(be, nan_tensor(dt, {N, F}), shift);
      DeviceTensor dy = DeviceTensor::of(be, dout, shift), dx = DeviceTensor::of(be, nan_tensor(dt, {N, 2 * F}), shift);
      be.swiglu_backward_rebuild(dx.t, y.t, dy.t, x.t);
      HostTensor res(dt, {N * 3 * F});  // out | din
      be.copy_to_host(res.t.data, y.t);
      be.copy_to_host(static_cast<char*>(res.t.data) + y.t.bytes(), dx.t);
      return res;
    });
    const AttnShape s{2, 33, 4, 2, 64};
    HostTensor qkv = rand_tensor(dt, {s.B * s.T, s.qkv_cols()}, 15);
    both("rope_forward + rope_backward", [&](int64_t shift) {
      DeviceTensor d = DeviceTensor::of(be, qkv, shift);
      HostTensor res(dt, {2 * qkv.numel()});  // after forward | after backward
      be.rope_forward(d.t, s, 10000.0f);
      be.copy_to_host(res.t.data, d.t);
      be.rope_backward(d.t, s, 10000.0f);
      be.copy_to_host(static_cast<char*>(res.t.data) + d.t.bytes(), d.t);
      return res;
    });
  }
}

TEST_CASE("gpu: qk_heads_copy is the CPU's bit for bit, both ways", "[gpu][qk_norm]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const AttnShape s{2, 37, 8, 2, 128};  // Qwen3's head size, GQA 8/2
  const int64_t rows = static_cast<int64_t>(s.B) * s.T, hrows = rows * (s.n_heads + s.n_kv_heads);
  for (DType dt : kFloatTypes) {
    INFO(dname(dt));
    HostTensor qkv = rand_tensor(dt, {rows, s.qkv_cols()}, 21), heads = rand_tensor(dt, {hrows, s.head_dim}, 22);
    HostTensor cpu_heads = nan_tensor(dt, {hrows, s.head_dim});
    cpu().qk_heads_copy(cpu_heads.t, qkv.t, s, true);
    DeviceTensor dq = DeviceTensor::of(be, qkv), dh = DeviceTensor::of(be, nan_tensor(dt, {hrows, s.head_dim}));
    be.qk_heads_copy(dh.t, dq.t, s, true);
    KEEL_CHECK_BITS("qk_heads_copy", std::string(dname(dt)) + " to heads", dh.host(), cpu_heads);
    DeviceTensor dh2 = DeviceTensor::of(be, heads);
    be.qk_heads_copy(dh2.t, dq.t, s, false);
    cpu().qk_heads_copy(heads.t, qkv.t, s, false);
    KEEL_CHECK_BITS("qk_heads_copy", std::string(dname(dt)) + " from heads", dq.host(), qkv);
  }
}

TEST_CASE("gpu: embedding forward and backward are bit-identical to the CPU (vocab shard)", "[gpu][embedding]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int T = 500, B = 4;
  const int64_t N = static_cast<int64_t>(B) * T, V = 300, C = 96, vocab_start = 100;
  std::vector<int32_t> tok(static_cast<size_t>(N));
  std::mt19937 rng(7);
  for (auto& t : tok) t = static_cast<int32_t>(rng() % 500);  // some below / above the shard
  for (int i = 0; i < 200; ++i) tok[static_cast<size_t>(rng() % N)] = 150;  // one frequent token
  HostTensor tokens(DType::I32, {N});
  tokens.set_i32(tok);
  // Document positions (kernels/document_positions.h): token 150 ends a document.
  HostTensor doc_pos(DType::I32, {N});
  doc_pos.set_i32(document_positions(tok.data(), N, T, 150));
  for (DType dt : kFloatTypes) {
    for (int with_pos = 0; with_pos < 3; ++with_pos) {  // none, learned positions, by document
      INFO(dname(dt) << " pos " << with_pos);
      HostTensor table = rand_tensor(dt, {V, C}, 1), pos = rand_tensor(dt, {T, C}, 2);
      Tensor none;
      const Tensor cpu_docs = with_pos == 2 ? doc_pos.t : none;
      const std::string what = std::string(dname(dt)) + (with_pos == 2 ? " documents" : "");
      HostTensor out = nan_tensor(dt, {N, C});
      cpu().embedding_forward(out.t, tokens.t, table.t, with_pos ? pos.t : none, T, vocab_start, cpu_docs);
      DeviceTensor dtok = DeviceTensor::of(be, tokens), dtab = DeviceTensor::of(be, table), dpos = DeviceTensor::of(be, pos);
      DeviceTensor ddocs = DeviceTensor::of(be, doc_pos);
      const Tensor gpu_docs = with_pos == 2 ? ddocs.t : none;
      DeviceTensor dout = DeviceTensor::of(be, nan_tensor(dt, {N, C}));
      be.embedding_forward(dout.t, dtok.t, dtab.t, with_pos ? dpos.t : none, T, vocab_start, gpu_docs);
      KEEL_CHECK_BITS("embedding_forward", what, dout.host(), out);

      HostTensor dy = rand_tensor(dt, {N, C}, 3);
      HostTensor gt0 = rand_tensor(DType::F32, {V, C}, 4), gp0 = rand_tensor(DType::F32, {T, C}, 5);
      HostTensor gt = clone(gt0), gp = clone(gp0);
      cpu().embedding_backward(gt.t, with_pos ? gp.t : none, dy.t, tokens.t, T, vocab_start, cpu_docs);
      DeviceTensor ddy = DeviceTensor::of(be, dy), dgt = DeviceTensor::of(be, gt0), dgp = DeviceTensor::of(be, gp0);
      be.embedding_backward(dgt.t, with_pos ? dgp.t : none, ddy.t, dtok.t, T, vocab_start, gpu_docs);
      KEEL_CHECK_BITS("embedding_backward token table", what + "->f32", dgt.host(), gt);
      KEEL_CHECK_BITS("embedding_backward positions", what + "->f32", dgp.host(), gp);
    }
  }
}

TEST_CASE("gpu: softmax cross-entropy pieces match the CPU (vocab shard, ignored rows)", "[gpu][xent]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  for (DType dt : kFloatTypes)
    for (int64_t V : {100, 1000, 50304}) {  // 100: fewer columns than threads per row
      INFO(dname(dt) << " V " << V);
      const int64_t N = 77, vocab_start = 200;
      HostTensor logits = rand_tensor(dt, {N, V}, 1, 4.0f);
      std::vector<int32_t> tg(static_cast<size_t>(N));
      std::mt19937 rng(3);
      for (auto& t : tg) t = static_cast<int32_t>(rng() % (V + 400));
      tg[3] = -1;
      tg[10] = -1;
      tg[11] = static_cast<int32_t>(vocab_start);  // first local column
      HostTensor targets(DType::I32, {N});
      targets.set_i32(tg);
      auto stat = [&] { return nan_tensor(DType::F32, {N}); };
      HostTensor mx = stat(), se = stat(), tl = stat();
      cpu().xent_stats(mx.t, se.t, tl.t, logits.t, targets.t, vocab_start);
      DeviceTensor dl = DeviceTensor::of(be, logits), dtg = DeviceTensor::of(be, targets);
      DeviceTensor dmx = DeviceTensor::of(be, stat()), dse = DeviceTensor::of(be, stat()), dtl = DeviceTensor::of(be, stat());
      be.xent_stats(dmx.t, dse.t, dtl.t, dl.t, dtg.t, vocab_start);
      KEEL_CHECK_BITS("xent_stats row max", dname(dt), dmx.host(), mx);  // a max is exact
      // sumexp against float64 (from the same row max): the CPU's own fp32 sum drifts by 7e-6
      // at V = 50304 (eight running sums of V/8 terms), the GPU's tree of short sums by ~2e-7
      // (measured on the CUDA emulator).
      {
        const HostTensor got = dse.host();
        std::vector<float> g(static_cast<size_t>(N));
        std::vector<double> ref(static_cast<size_t>(N));
        for (int64_t n = 0; n < N; ++n) {
          double sum = 0;
          for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(logits.at(n * V + j)) - mx.at(n));
          ref[static_cast<size_t>(n)] = sum;
          g[static_cast<size_t>(n)] = got.at(n);
        }
        KEEL_CHECK_ERR("xent_stats sumexp (vs float64)", dname(dt), rel_error(g, ref), 1e-6);
      }
      KEEL_CHECK_BITS("xent_stats target logit", dname(dt), dtl.host(), tl);
      // rescale against a larger "global" max
      HostTensor gmax = clone(mx);
      for (int64_t i = 0; i < N; ++i) gmax.put(i, mx.at(i) + 0.5f);
      HostTensor se2 = clone(se);
      cpu().xent_rescale(se2.t, mx.t, gmax.t);
      DeviceTensor dg = DeviceTensor::of(be, gmax);
      dse.upload(se);
      dmx.upload(mx);
      be.xent_rescale(dse.t, dmx.t, dg.t);
      KEEL_CHECK_ERR("xent_rescale", "f32", rel_err(dse.host(), se2), 1e-6);
      // loss from the CPU's stats
      HostTensor losses = stat(), lse = stat();
      cpu().xent_loss(losses.t, lse.t, mx.t, se.t, tl.t, targets.t);
      DeviceTensor dlosses = DeviceTensor::of(be, stat()), dlse = DeviceTensor::of(be, stat());
      dse.upload(se);
      be.xent_loss(dlosses.t, dlse.t, dmx.t, dse.t, dtl.t, dtg.t);
      KEEL_CHECK_ERR("xent_loss losses", "f32", rel_err(dlosses.host(), losses), 1e-6);
      KEEL_CHECK_ERR("xent_loss lse", "f32", rel_err(dlse.host(), lse), 1e-6);
      CHECK(dlosses.host().at(3) == 0.0f);
      // backward in place
      HostTensor grad = clone(logits);
      cpu().xent_backward(grad.t, lse.t, targets.t, 0.01f, vocab_start);
      dlse.upload(lse);
      be.xent_backward(dl.t, dlse.t, dtg.t, 0.01f, vocab_start);
      KEEL_CHECK_ERR("xent_backward", dname(dt), rel_err(dl.host(), grad), storage_tol(dt, 1e-6));
    }
}

// A diverging run must stay visible: a NaN or +inf logit, or a row of -inf, gives a NaN sum of
// exponentials on the GPU exactly where the CPU gives one; -inf logits among finite ones (masked
// columns) add nothing.
TEST_CASE("gpu: cross-entropy statistics keep non-finite logits non-finite, as the CPU", "[gpu][xent]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  for (int64_t V : {100, 101, 5000}) {  // 101: rows not 16-byte aligned (one logit at a time)
    INFO("V " << V);
    const int64_t N = 6;
    HostTensor logits = rand_tensor(DType::F32, {N, V}, 9, 3.0f);
    logits.put(0 * V + V / 2, NAN);       // row 0: one NaN
    logits.put(1 * V + 7, INFINITY);      // row 1: one +inf
    for (int64_t j = 0; j < V; ++j) logits.put(2 * V + j, -INFINITY);  // row 2: all -inf
    for (int64_t j = 0; j < V; j += 2) logits.put(4 * V + j, -INFINITY);  // row 4: every other -inf
    for (int64_t j = 0; j < V; ++j) logits.put(5 * V + j, j == V - 3 ? NAN : -INFINITY);  // row 5: NaN among -inf
    HostTensor targets(DType::I32, {N});  // row 3: finite
    targets.set_i32({1, 2, 3, 4, 5, 6});
    auto stat = [&] { return nan_tensor(DType::F32, {N}); };
    HostTensor mx = stat(), se = stat(), tl = stat();
    cpu().xent_stats(mx.t, se.t, tl.t, logits.t, targets.t, 0);
    DeviceTensor dl = DeviceTensor::of(be, logits), dtg = DeviceTensor::of(be, targets);
    DeviceTensor dmx = DeviceTensor::of(be, stat()), dse = DeviceTensor::of(be, stat()), dtl = DeviceTensor::of(be, stat());
    be.xent_stats(dmx.t, dse.t, dtl.t, dl.t, dtg.t, 0);
    const HostTensor gse = dse.host();
    for (int64_t n = 0; n < N; ++n) {
      INFO("row " << n << ": cpu sumexp " << se.at(n) << ", gpu " << gse.at(n));
      CHECK(std::isnan(gse.at(n)) == std::isnan(se.at(n)));
    }
    CHECK(std::isnan(se.at(0)));
    CHECK(std::isnan(se.at(1)));
    CHECK(std::isnan(se.at(2)));
    CHECK(std::isnan(se.at(5)));
    for (int64_t n : {3, 4}) CHECK(std::abs(gse.at(n) - se.at(n)) <= 1e-6 * se.at(n));
    KEEL_CHECK_BITS("xent_stats row max", "non-finite rows", dmx.host(), mx);
  }
}

// xent_loss_backward, fused on the GPU (a block takes rows in turn, as many in flight as half
// the L2 holds), gives the bits of xent_stats, xent_loss and xent_backward on the same device
// for every grid: the device's L2 size, an L2 of six rows (three blocks, 25-26 rows each) and
// none (one block takes every row). Against the CPU's composition: the sum of exponentials
// drifts by up to 7e-6 in the CPU's fp32 sum at V = 50304 (see above), which moves lse and so
// the loss (~log V) and each probability by up to 1e-5 relative: the bound for fp32; bf16 and
// f16 gradients are held to their storage rounding.
TEST_CASE("gpu: fused cross-entropy loss and gradient give the bits of its three kernels", "[gpu][xent]") {
  KEEL_GPU_OR_SKIP();
  auto& be = dynamic_cast<CudaBackend&>(gpu());
  const size_t l2 = be.l2_bytes();
  const float dloss = 0.01f;
  for (DType dt : kFloatTypes)
    for (int64_t V : {100, 101, 1000, 50304}) {  // 101: rows not 16-byte aligned
      const int64_t N = 77;
      HostTensor logits = rand_tensor(dt, {N, V}, 5, 4.0f);
      std::vector<int32_t> tg(static_cast<size_t>(N));
      std::mt19937 rng(7);
      for (auto& t : tg) t = static_cast<int32_t>(rng() % V);
      tg[3] = -1;  // ignored rows
      tg[40] = -1;
      tg[11] = 0;  // first and last column
      tg[12] = static_cast<int32_t>(V - 1);
      HostTensor targets(DType::I32, {N});
      targets.set_i32(tg);
      auto stat = [&] { return nan_tensor(DType::F32, {N}); };
      // The non-finite rows (a NaN, a +inf, all -inf) go only into the comparison of bits.
      HostTensor odd = clone(logits);
      odd.put(20 * V + V / 2, NAN);
      odd.put(21 * V + 1, INFINITY);
      for (int64_t j = 0; j < V; ++j) odd.put(22 * V + j, -INFINITY);
      for (const HostTensor* in : {&logits, &odd}) {
        const bool finite = in == &logits;
        const size_t row_bytes = static_cast<size_t>(V) * dtype_size(dt);
        DeviceTensor dtg = DeviceTensor::of(be, targets);
        DeviceTensor cl = DeviceTensor::of(be, *in), cmx = DeviceTensor::of(be, stat()),
                     cse = DeviceTensor::of(be, stat()), ctl = DeviceTensor::of(be, stat()),
                     closs = DeviceTensor::of(be, stat()), clse = DeviceTensor::of(be, stat());
        be.xent_stats(cmx.t, cse.t, ctl.t, cl.t, dtg.t, 0);
        be.xent_loss(closs.t, clse.t, cmx.t, cse.t, ctl.t, dtg.t);
        be.xent_backward(cl.t, clse.t, dtg.t, dloss, 0);
        for (size_t grid_l2 : {l2, 6 * row_bytes, size_t{0}}) {
          INFO(dname(dt) << " V " << V << (finite ? "" : " non-finite rows") << ", L2 taken as " << grid_l2);
          DeviceTensor fl = DeviceTensor::of(be, *in), fmx = DeviceTensor::of(be, stat()),
                       fse = DeviceTensor::of(be, stat()), ftl = DeviceTensor::of(be, stat()),
                       floss = DeviceTensor::of(be, stat()), flse = DeviceTensor::of(be, stat());
          be.set_l2_bytes(grid_l2);
          be.xent_loss_backward(floss.t, flse.t, fmx.t, fse.t, ftl.t, fl.t, dtg.t, dloss);
          be.set_l2_bytes(l2);
          const std::string what = std::string(dname(dt)) + (finite ? "" : " non-finite rows");
          KEEL_CHECK_BITS("xent_loss_backward dlogits", what, fl.host(), cl.host());
          KEEL_CHECK_BITS("xent_loss_backward losses", what, floss.host(), closs.host());
          KEEL_CHECK_BITS("xent_loss_backward lse", what, flse.host(), clse.host());
          KEEL_CHECK_BITS("xent_loss_backward row max", what, fmx.host(), cmx.host());
          KEEL_CHECK_BITS("xent_loss_backward sumexp", what, fse.host(), cse.host());
          KEEL_CHECK_BITS("xent_loss_backward target logit", what, ftl.host(), ctl.host());
        }
        if (!finite) {
          const HostTensor l = closs.host(), g = cl.host();
          for (int64_t n : {20, 21, 22}) {
            INFO("row " << n);
            CHECK(std::isnan(l.at(n)));
            CHECK(std::isnan(g.at(n * V + 1)));
          }
          continue;
        }
        HostTensor grad = clone(logits), mx = stat(), se = stat(), tl = stat(), losses = stat(), lse = stat();
        cpu().xent_loss_backward(losses.t, lse.t, mx.t, se.t, tl.t, grad.t, targets.t, dloss);
        KEEL_CHECK_ERR("xent_loss_backward losses", dname(dt), rel_err(closs.host(), losses), 1e-5);
        KEEL_CHECK_ERR("xent_loss_backward dlogits", dname(dt), rel_err(cl.host(), grad), storage_tol(dt, 1e-5));
        CHECK(closs.host().at(3) == 0.0f);
        const HostTensor g = cl.host();
        int64_t nonzero = 0;  // an ignored row's gradient
        for (int64_t j = 0; j < V; ++j) nonzero += g.at(3 * V + j) != 0.0f;
        CHECK(nonzero == 0);
      }
    }
}

namespace {

// A random AdamW starting state of n elements: fp32 master, gradients of grad_dt, moments
// (v >= 0), and the working copy in `working` rounded from the master.
struct AdamState {
  HostTensor master, working, grad, m, v;
};
AdamState random_adam_state(int64_t n, DType working, DType grad_dt) {
  AdamState st{rand_tensor(DType::F32, {n}, 1), HostTensor(working, {n}), rand_tensor(grad_dt, {n}, 2, 0.1f),
               rand_tensor(DType::F32, {n}, 3, 0.01f), rand_tensor(DType::F32, {n}, 4, 0.01f)};
  for (int64_t i = 0; i < n; ++i) st.v.put(i, std::abs(st.v.at(i)));
  cpu().convert(st.working.t, st.master.t);
  return st;
}

}  // namespace

TEST_CASE("gpu: adamw is bit-identical to the CPU in every precision layout", "[gpu][adamw]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t n = 100003;
  struct Layout {
    const char* name;
    DType working;
    bool master;
    bool alias;  // working is the master itself (fp32 mode)
  };
  const Layout layouts[] = {{"bf16 + fp32 master", DType::BF16, true, false},
                            {"f16 + fp32 master", DType::F16, true, false},
                            {"fp32 (working = master)", DType::F32, true, true},
                            {"bf16 only (no master)", DType::BF16, false, false}};
  for (const Layout& L : layouts)
    for (int64_t step : {1, 7}) {
      INFO(L.name << " step " << step);
      AdamWParams p;
      p.lr = 3e-3f;
      p.weight_decay = 0.1f;
      p.step = step;
      p.grad_scale = 0.5f;
      const auto [master, working, grad, m, v] = random_adam_state(n, L.working, DType::F32);
      HostTensor cm = clone(master), cw = clone(working), cmm = clone(m), cv = clone(v);
      Tensor none;
      const Tensor& c_master = L.master ? (L.alias ? cw.t : cm.t) : none;
      cpu().adamw(c_master, cw.t, grad.t, cmm.t, cv.t, p);
      DeviceTensor dmaster = DeviceTensor::of(be, master), dw = DeviceTensor::of(be, working);
      DeviceTensor dg = DeviceTensor::of(be, grad), dm = DeviceTensor::of(be, m), dv = DeviceTensor::of(be, v);
      const Tensor& g_master = L.master ? (L.alias ? dw.t : dmaster.t) : none;
      be.adamw(g_master, dw.t, dg.t, dm.t, dv.t, p);
      KEEL_CHECK_BITS("adamw working", L.name, dw.host(), cw);
      KEEL_CHECK_BITS("adamw m", L.name, dm.host(), cmm);
      KEEL_CHECK_BITS("adamw v", L.name, dv.host(), cv);
      if (L.master && !L.alias) KEEL_CHECK_BITS("adamw master", L.name, dmaster.host(), cm);
    }
}

// The kernel takes packs of 4 elements from the first element where every operand is aligned
// for them (after up to 3 alone), or every element alone where no such element exists. Each
// way, with each gradient dtype, gives the CPU's bits. Shifts are in elements from an aligned
// allocation: {1, 1, 1, 1, 1} packs from element 3; {1, 0, 2, 3, 0} has no aligned element.
// The call updates the first n of n + 4 elements of each operand; the last 4 must stay as they
// were (2 elements are fewer than the 3 before the first pack).
TEST_CASE("gpu: adamw gives the CPU's bits however its operands are aligned", "[gpu][adamw]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  struct Shifts {
    const char* name;
    int64_t master, working, grad, m, v;
  };
  const Shifts shifts[] = {{"aligned", 0, 0, 0, 0, 0},
                           {"packed after 3 alone", 1, 1, 1, 1, 1},
                           {"every element alone", 1, 0, 2, 3, 0}};
  const int64_t guard = 4;
  for (const int64_t n : {5001, 2})
    for (const DType grad_dt : {DType::F32, DType::BF16, DType::F16})
      for (const Shifts& sh : shifts) {
        INFO(sh.name << ", " << dname(grad_dt) << " gradients, " << n << " elements");
        AdamWParams p;
        p.lr = 1e-3f;
        p.weight_decay = 0.1f;
        p.step = 2;
        const int64_t all = n + guard;
        const auto [master, working, grad, m, v] = random_adam_state(all, DType::BF16, grad_dt);
        HostTensor cm = clone(master), cw = clone(working), cmm = clone(m), cv = clone(v);
        cpu().adamw(cm.t.elements(0, n), cw.t.elements(0, n), grad.t.elements(0, n), cmm.t.elements(0, n),
                    cv.t.elements(0, n), p);
        DeviceTensor dmaster = DeviceTensor::of(be, master, sh.master), dw = DeviceTensor::of(be, working, sh.working);
        DeviceTensor dg = DeviceTensor::of(be, grad, sh.grad), dm = DeviceTensor::of(be, m, sh.m);
        DeviceTensor dv = DeviceTensor::of(be, v, sh.v);
        be.adamw(dmaster.t.elements(0, n), dw.t.elements(0, n), dg.t.elements(0, n), dm.t.elements(0, n),
                 dv.t.elements(0, n), p);
        KEEL_CHECK_BITS("adamw aligned or not, master", sh.name, dmaster.host(), cm);
        KEEL_CHECK_BITS("adamw aligned or not, working", sh.name, dw.host(), cw);
        KEEL_CHECK_BITS("adamw aligned or not, m", sh.name, dm.host(), cmm);
        KEEL_CHECK_BITS("adamw aligned or not, v", sh.name, dv.host(), cv);
      }
}

// The unbiasedness and split invariance are tested on the CPU (test_adamw.cpp); the GPU must
// give the CPU's bits, for whole tensors and for calls over part of one (rounding_index0).
TEST_CASE("gpu: adamw stochastic rounding gives the CPU's bits", "[gpu][adamw]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  const int64_t n = 200000, half = 70001;
  AdamWParams p;
  p.lr = 1e-3f;
  p.weight_decay = 0.1f;
  p.step = 3;
  p.stochastic_rounding = true;
  p.rounding_seed = 1234;
  HostTensor master = rand_tensor(DType::F32, {n}, 1), grad = rand_tensor(DType::F32, {n}, 2);
  HostTensor zeros(DType::F32, {n});
  HostTensor cm = rand_tensor(DType::F32, {n}, 1), cw(DType::BF16, {n}), cmom(DType::F32, {n}), cv(DType::F32, {n});
  cpu().adamw(cm.t, cw.t, grad.t, cmom.t, cv.t, p);
  for (int64_t split : {n, half}) {
    CAPTURE(split);
    DeviceTensor dmaster = DeviceTensor::of(be, master), dg = DeviceTensor::of(be, grad);
    DeviceTensor dm = DeviceTensor::of(be, zeros), dv = DeviceTensor::of(be, zeros);
    DeviceTensor dw(be, HostTensor(DType::BF16, {n}).t);
    for (int64_t begin = 0; begin < n; begin += split) {
      const int64_t len = std::min(split, n - begin);
      auto part = [&](const DeviceTensor& t) { return t.t.elements(begin, begin + len); };
      AdamWParams q = p;
      q.rounding_index0 = begin;
      be.adamw(part(dmaster), part(dw), part(dg), part(dm), part(dv), q);
    }
    KEEL_CHECK_BITS("adamw stochastic rounding master", "split " + std::to_string(split), dmaster.host(), cm);
    KEEL_CHECK_BITS("adamw stochastic rounding working", "bf16 split " + std::to_string(split), dw.host(), cw);
  }
}

// Weight decay by runs (AdamWParams::decay_runs): the CUDA backend launches kMaxRuns (64) runs
// at a time, each launch at its own offset into the tensors and the rounding counter. 150 runs
// of 1 to 1,400 elements (decays 0.1, 0 and 0.3, neighbours sometimes equal) over three launches
// give the CPU's bits, with round-to-nearest and with stochastic rounding from an offset.
TEST_CASE("gpu: adamw with decay runs over several launches gives the CPU's bits", "[gpu][adamw]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  std::vector<AdamWDecayRun> runs;
  std::mt19937 rng(5);
  int64_t n = 0;
  for (int r = 0; r < 150; ++r) {
    n += 1 + static_cast<int64_t>(rng() % 1400);
    runs.push_back({n, (r % 3 == 0) ? 0.1f : (r % 3 == 1 ? 0.0f : (rng() % 2 ? 0.3f : 0.0f))});
  }
  for (const bool stochastic : {false, true}) {
    INFO((stochastic ? "stochastic rounding" : "round to nearest") << ", " << n << " elements");
    AdamWParams p;
    p.lr = 2e-3f;
    p.weight_decay = 0.7f;  // not used: the runs say
    p.step = 4;
    p.decay_runs = runs;
    p.stochastic_rounding = stochastic;
    p.rounding_seed = 99;
    p.rounding_index0 = stochastic ? 17 : 0;
    const auto [master, working, grad, m, v] = random_adam_state(n, DType::BF16, DType::BF16);
    HostTensor cm = clone(master), cw = clone(working), cmm = clone(m), cv = clone(v);
    cpu().adamw(cm.t, cw.t, grad.t, cmm.t, cv.t, p);
    DeviceTensor dmaster = DeviceTensor::of(be, master), dw = DeviceTensor::of(be, working);
    DeviceTensor dg = DeviceTensor::of(be, grad), dm = DeviceTensor::of(be, m), dv = DeviceTensor::of(be, v);
    be.adamw(dmaster.t, dw.t, dg.t, dm.t, dv.t, p);
    KEEL_CHECK_BITS("adamw decay runs master", "150 runs", dmaster.host(), cm);
    KEEL_CHECK_BITS("adamw decay runs working", "150 runs", dw.host(), cw);
    KEEL_CHECK_BITS("adamw decay runs m", "150 runs", dm.host(), cmm);
    KEEL_CHECK_BITS("adamw decay runs v", "150 runs", dv.host(), cv);
  }
}

TEST_CASE("gpu: ops reject wrong shapes and dtypes naming the op and the shapes", "[gpu][errors]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  using Catch::Contains;
  DeviceTensor a(be, HostTensor(DType::F32, {4, 8}).t), b(be, HostTensor(DType::F32, {7, 5}).t);
  DeviceTensor out(be, HostTensor(DType::F32, {4, 5}).t);
  CHECK_THROWS_AS(be.matmul(out.t, a.t, b.t, false, false), std::invalid_argument);
  CHECK_THROWS_WITH(be.matmul(out.t, a.t, b.t, false, false),
                    Contains("CudaBackend::matmul") && Contains("[4, 8] f32") && Contains("[7, 5] f32"));
  HostTensor host(DType::F32, {4, 5});
  CHECK_THROWS_WITH(be.gelu_forward(out.t, host.t), Contains("gelu_forward") && Contains("not a CUDA tensor"));
  DeviceTensor mean(be, HostTensor(DType::F32, {4}).t), rstd(be, HostTensor(DType::F32, {3}).t), w(be, HostTensor(DType::F32, {8}).t);
  CHECK_THROWS_WITH(be.layernorm_forward(a.t, mean.t, rstd.t, a.t, w.t, Tensor(), 1e-5f),
                    Contains("layernorm_forward") && Contains("rstd=[3] f32"));
  const AttnShape s{1, 4, 4, 3, 8};
  DeviceTensor qkv(be, HostTensor(DType::F32, {4, 80}).t), o(be, HostTensor(DType::F32, {4, 32}).t);
  DeviceTensor lse(be, HostTensor(DType::F32, {1, 4, 4}).t);
  CHECK_THROWS_WITH(be.attention_forward(o.t, lse.t, qkv.t, s), Contains("attention_forward") && Contains("n_kv_heads=3"));
}

// CudaBackend::arithmetic() is what a resume compares (train/run.cpp): with the same layout, build
// and arithmetic, the probe loss must match bit for bit, else within rounding. So every setting
// that gives other bits must show in it (or a resume under that setting would be refused for
// differing bits), and the defaults must add nothing (or checkpoints saved before would lose
// their bitwise check).
TEST_CASE("gpu: arithmetic() names every setting that gives other bits, and the defaults add nothing", "[gpu]") {
  KEEL_GPU_OR_SKIP();
  const std::string plain = backend_with(ScopedEnv("KEEL_ATTENTION"), nullptr)->arithmetic();
  CHECK(plain.rfind("cuda ", 0) == 0);
  CHECK(plain.find('[') == std::string::npos);
  const std::vector<std::array<const char*, 3>> settings = {
      {"KEEL_ATTENTION", "simple", "attention simple"},      {"KEEL_ATTN_DS_MB", "0", "attention dS 0 MiB"},
      {"KEEL_GELU_EPILOGUE", "0", "no gelu epilogue"},       {"KEEL_RESIDUAL_EPILOGUE", "0", "no residual epilogue"},
      {"KEEL_BGRAD_EPILOGUE", "0", "no bgrad epilogue"},     {"KEEL_XENT_FUSED", "0", "xent unfused"},
      {"KEEL_SPLITK_ANY", "0", "split-k restricted"},
  };
  for (const auto& [var, value, shown] : settings) {
    INFO(var << "=" << value);
    const ScopedEnv env(var);
    CHECK(backend_with(env, value)->arithmetic() == plain + " [" + shown + "]");
  }
  {  // two at once, in a fixed order
    const ScopedEnv gelu("KEEL_GELU_EPILOGUE"), xent("KEEL_XENT_FUSED");
    gelu.set("0");
    CHECK(backend_with(xent, "0")->arithmetic() == plain + " [no gelu epilogue, xent unfused]");
  }
  {  // the wgmma kernels where the device runs them (sm_90a); elsewhere the setting changes nothing
    const ScopedEnv env("KEEL_ATTN_WGMMA");
    CHECK(backend_with(env, "1")->arithmetic() == (cuda::wgmma_available(0) ? plain + " [attention wgmma]" : plain));
  }
  {  // cuDNN where it loaded, with its version; else keel's fused kernels run, the default bits
    const ScopedEnv env("KEEL_ATTENTION");
    const std::unique_ptr<Backend> be = backend_with(env, "cudnn");
    if (dynamic_cast<CudaBackend&>(*be).cudnn_attention())
      CHECK_THAT(be->arithmetic(), Catch::Matchers::StartsWith(plain + " [attention cudnn "));
    else
      CHECK(be->arithmetic() == plain);
  }
}

