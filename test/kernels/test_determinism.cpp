// Same inputs, different OpenMP thread counts: outputs must be bit-identical (every reduction
// runs in an order fixed by the shapes, never by the threads).
#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

namespace {

// Raw bits of every output, for comparison across runs.
std::vector<uint32_t> bits_of(std::initializer_list<const HostTensor*> ts) {
  std::vector<uint32_t> b;
  for (const HostTensor* t : ts)
    for (int64_t i = 0; i < t->numel(); ++i) b.push_back(t->bits(i));
  return b;
}

// Runs `fn` (which returns the bits of its outputs) with 1, 2, 3 and 4 threads.
template <class Fn>
void check_same_for_thread_counts(Fn&& fn) {
  std::vector<uint32_t> one;
  with_threads(1, [&] { one = fn(); });
  for (int threads : {2, 3, 4}) {
    CAPTURE(threads);
    std::vector<uint32_t> other;
    with_threads(threads, [&] { other = fn(); });
    CHECK(other == one);
  }
}

}  // namespace

TEST_CASE("matmul is independent of the thread count", "[determinism]") {
  auto be = make_cpu_backend();
  const int64_t M = 300, N = 270, K = 700;
  HostTensor a = make(DType::F32, {K, M}, randn(M * K, 1)), b = make(DType::BF16, {N, K}, randn(K * N, 2));
  HostTensor bias = make(DType::F32, {N}, randn(N, 3));
  check_same_for_thread_counts([&] {
    HostTensor out = make(DType::F32, {M, N}, randn(M * N, 4));
    be->matmul(out.t, a.t, b.t, true, true, true, &bias.t);
    HostTensor dbias(DType::F32, {N});
    be->bias_backward(dbias.t, out.t, false);
    return bits_of({&out, &dbias});
  });
}

TEST_CASE("norm backward is independent of the thread count", "[determinism]") {
  auto be = make_cpu_backend();
  const int64_t N = 500, C = 96;
  HostTensor x = make(DType::F32, {N, C}, randn(N * C, 1)), dy = make(DType::F32, {N, C}, randn(N * C, 2));
  HostTensor w = make(DType::F32, {C}, randn(C, 3)), b = make(DType::F32, {C}, randn(C, 4));
  check_same_for_thread_counts([&] {
    HostTensor out(DType::F32, {N, C}), mean(DType::F32, {N}), rstd(DType::F32, {N}), din(DType::F32, {N, C});
    HostTensor dw(DType::F32, {C}), db(DType::F32, {C}), rdin(DType::F32, {N, C}), rdw(DType::F32, {C});
    be->layernorm_forward(out.t, mean.t, rstd.t, x.t, w.t, b.t, 1e-5f);
    be->layernorm_backward(din.t, dw.t, db.t, dy.t, x.t, w.t, mean.t, rstd.t, false, false);
    be->rmsnorm_forward(out.t, rstd.t, x.t, w.t, 1e-5f);
    be->rmsnorm_backward(rdin.t, rdw.t, dy.t, x.t, w.t, rstd.t, true, true);
    return bits_of({&din, &dw, &db, &rdin, &rdw});
  });
}

TEST_CASE("embedding backward is independent of the thread count", "[determinism]") {
  auto be = make_cpu_backend();
  const int64_t B = 8, T = 250, C = 64, V = 50, N = B * T;
  std::vector<int32_t> tok(N);
  for (int64_t n = 0; n < N; ++n) tok[n] = static_cast<int32_t>((n * n + 7 * n) % 61);  // repeats, some >= V
  HostTensor tokens(DType::I32, {B, T});
  tokens.set_i32(tok);
  HostTensor dout = make(DType::F32, {N, C}, randn(N * C, 1));
  check_same_for_thread_counts([&] {
    HostTensor dtok(DType::F32, {V, C}), dpos(DType::F32, {T, C});
    be->embedding_backward(dtok.t, dpos.t, dout.t, tokens.t, static_cast<int>(T), 3, Tensor());
    return bits_of({&dtok, &dpos});
  });
}

TEST_CASE("attention backward is independent of the thread count", "[determinism]") {
  auto be = make_cpu_backend();
  const AttnShape s{2, 64, 4, 2, 16};
  const int64_t rows = s.B * s.T, cols = s.qkv_cols(), oc = int64_t{s.n_heads} * s.head_dim;
  HostTensor qkv = make(DType::F32, {rows, cols}, randn(rows * cols, 1));
  HostTensor dout = make(DType::F32, {rows, oc}, randn(rows * oc, 2));
  check_same_for_thread_counts([&] {
    HostTensor out(DType::F32, {rows, oc}), lse(DType::F32, {s.B, s.n_heads, s.T}), dqkv(DType::F32, {rows, cols});
    be->attention_forward(out.t, lse.t, qkv.t, s);
    be->attention_backward(dqkv.t, dout.t, qkv.t, out.t, lse.t, s);
    return bits_of({&out, &lse, &dqkv});
  });
}

TEST_CASE("sum and sum_squares are independent of the thread count", "[determinism]") {
  auto be = make_cpu_backend();
  HostTensor x = make(DType::F32, {1000003}, randn(1000003, 1));
  check_same_for_thread_counts([&] {
    const double s = be->sum(x.t), ss = be->sum_squares(x.t);
    std::vector<uint32_t> b(4);
    std::memcpy(b.data(), &s, 8);
    std::memcpy(b.data() + 2, &ss, 8);
    return b;
  });
}
