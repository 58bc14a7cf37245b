// Token + position embedding, including a vocab shard (vocab_start > 0).
#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

namespace {

struct Case {
  const char* name;
  bool positions;
  int64_t vocab_start, v_local;  // this shard holds tokens [vocab_start, vocab_start + v_local)
};

const Case kCases[] = {{"tokens only", false, 0, 10}, {"tokens + positions", true, 0, 10},
                       {"vocab shard [4, 10) + positions", true, 4, 6}};

}  // namespace

// out = tok_embed[token - vocab_start] (0 when not local) + pos_embed[n % T]: one fp32 addition,
// so the expected values are computed the same way and compared bit for bit.
TEST_CASE("embedding forward", "[embedding]") {
  auto be = make_cpu_backend();
  const int64_t B = 3, T = 4, C = 6, N = B * T;
  for (const Case& c : kCases)
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(c.name, dtype_name(dt));
      std::vector<int32_t> tok(N);
      for (int64_t n = 0; n < N; ++n) tok[n] = static_cast<int32_t>((n * 7 + 3) % 10);
      HostTensor tokens(DType::I32, {B, T});
      tokens.set_i32(tok);
      HostTensor table = make(dt, {c.v_local, C}, randn(c.v_local * C, 1));
      HostTensor pos = make(dt, {T + 2, C}, randn((T + 2) * C, 2));  // more rows than T is allowed
      HostTensor out(dt, {B, T, C});
      be->embedding_forward(out.t, tokens.t, table.t, c.positions ? pos.t : Tensor(), T, c.vocab_start, Tensor());
      int mismatches = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < C; ++j) {
          const int64_t v = tok[n] - c.vocab_start;
          float e = v >= 0 && v < c.v_local ? table.at(v * C + j) : 0.0f;
          if (c.positions) e += pos.at((n % T) * C + j);
          mismatches += out.bits(n * C + j) != HostTensor(make(dt, {1}, {e})).bits(0);
        }
      CHECK(mismatches == 0);
    }
}

// L = sum(out * R) is linear in both tables: h = 1, tolerance 1e-5 (fp32 noise ~1e-7).
// Gradients accumulate into non-zero buffers; non-local tokens contribute nothing.
TEST_CASE("embedding backward matches finite differences", "[embedding][grad]") {
  auto be = make_cpu_backend();
  const int64_t B = 3, T = 4, C = 6, N = B * T;
  for (const Case& c : kCases) {
    CAPTURE(c.name);
    std::vector<int32_t> tok(N);
    for (int64_t n = 0; n < N; ++n) tok[n] = static_cast<int32_t>((n * 7 + 3) % 10);  // repeats
    HostTensor tokens(DType::I32, {N});
    tokens.set_i32(tok);
    HostTensor table = make(DType::F32, {c.v_local, C}, randn_grid(c.v_local * C, 10));
    HostTensor pos = make(DType::F32, {T, C}, randn_grid(T * C, 11));
    HostTensor out(DType::F32, {N, C});
    const std::vector<float> r = randn(N * C, 12);
    const Tensor pos_t = c.positions ? pos.t : Tensor();
    auto loss = [&] {
      be->embedding_forward(out.t, tokens.t, table.t, pos_t, T, c.vocab_start, Tensor());
      return dot_loss(out, to_double(r));
    };
    HostTensor dout = make(DType::F32, {N, C}, r);
    const std::vector<float> g0 = randn(c.v_local * C, 13), p0 = randn(T * C, 14);
    HostTensor dtable = make(DType::F32, {c.v_local, C}, g0), dpos = make(DType::F32, {T, C}, p0);
    be->embedding_backward(dtable.t, c.positions ? dpos.t : Tensor(), dout.t, tokens.t, T, c.vocab_start, Tensor());

    std::vector<double> added(g0.size());
    for (size_t i = 0; i < g0.size(); ++i) added[i] = static_cast<double>(dtable.at(i)) - g0[i];
    CHECK(rel_error(added, numeric_grad(table.t.as<float>(), c.v_local * C, loss, kStepLinear)) < 1e-5);
    if (c.positions) {
      std::vector<double> padded(p0.size());
      for (size_t i = 0; i < p0.size(); ++i) padded[i] = static_cast<double>(dpos.at(i)) - p0[i];
      CHECK(rel_error(padded, numeric_grad(pos.t.as<float>(), T * C, loss, kStepLinear)) < 1e-5);
    } else {
      CHECK(dpos.values() == p0);
    }
  }
}
