// attention_decode (generation with a KV cache) against the training path: a prompt prefilled
// in one call and then one token per call must give exactly the rows that rope_forward +
// attention_forward give for the whole sequence at once (same arithmetic, same order).
#include <catch2/catch.hpp>

#include "kernel_test_util.h"
#include "kernels/alibi.h"

using namespace keel;
using namespace keel::test;

namespace {

void check_decode_equals_forward(AttnShape full, DType dt, const Rope& theta, int64_t prefill, bool alibi = false) {
  auto be = make_cpu_backend();
  HostTensor slopes = make(DType::F32, {full.n_heads}, alibi_slopes(full.n_heads));
  if (alibi) full.alibi_slopes = slopes.t;
  const int64_t T = full.T, cols = full.qkv_cols(), q_cols = static_cast<int64_t>(full.n_heads) * full.head_dim;
  const int64_t kv_cols = static_cast<int64_t>(full.n_kv_heads) * full.head_dim;
  HostTensor qkv = make(dt, {T, cols}, randn(T * cols, 11, 1.5f));

  // the training path over the whole sequence
  HostTensor qkv_full = rows_of(qkv, 0, T);
  HostTensor out_full(dt, {T, q_cols});
  HostTensor lse(DType::F32, {1, full.n_heads, T});
  if (theta.rotates()) be->rope_forward(qkv_full.t, full, theta);
  be->attention_forward(out_full.t, lse.t, qkv_full.t, full);

  // prefill, then one row at a time
  HostTensor k_cache(dt, {T + 3, kv_cols}), v_cache(dt, {T + 3, kv_cols});
  int64_t pos = 0;
  while (pos < T) {
    const int64_t n = pos == 0 ? prefill : 1;
    HostTensor chunk = rows_of(qkv, pos, pos + n);
    HostTensor out(dt, {n, q_cols});
    AttnShape s = full;
    s.B = 1;
    s.T = static_cast<int>(n);
    be->attention_decode(out.t, chunk.t, k_cache.t, v_cache.t, s, pos, theta);
    for (int64_t i = 0; i < n * q_cols; ++i) {
      INFO("row " << pos + i / q_cols << " column " << i % q_cols);
      REQUIRE(out.bits(i) == out_full.bits(pos * q_cols + i));
    }
    pos += n;
  }
}

// Llama 3.1's scaling over an original context of 8 positions: every band within 13 positions.
Rope llama3_short_context() {
  RopeScaling s;
  s.kind = RopeScaling::Kind::Llama3;
  s.original_max_position = 8;
  return Rope(10000.0f, s);
}

}  // namespace

TEST_CASE("attention_decode equals rope + attention_forward row for row, bit for bit", "[attention][decode]") {
  for (AttnShape s : {AttnShape{1, 13, 4, 2, 16}, AttnShape{1, 9, 3, 3, 8}, AttnShape{1, 7, 4, 1, 6}})
    for (DType dt : {DType::F32, DType::BF16})
      for (const Rope& theta : {Rope(10000.0f), Rope(500000.0f), Rope(0.0f), llama3_short_context()})
        for (int64_t prefill : {int64_t{1}, int64_t{5}}) {
          CAPTURE(s.T, s.n_heads, s.n_kv_heads, s.head_dim, dtype_name(dt), theta.str(), prefill);
          check_decode_equals_forward(s, dt, theta, prefill);
        }
}

// ALiBi (no rotation, as BLOOM): the bias of key j for the new row at absolute position i.
TEST_CASE("attention_decode with ALiBi equals attention_forward row for row, bit for bit",
          "[attention][decode][alibi]") {
  for (AttnShape s : {AttnShape{1, 13, 4, 2, 16}, AttnShape{1, 9, 3, 3, 8}, AttnShape{1, 11, 6, 6, 4}})
    for (DType dt : {DType::F32, DType::BF16})
      for (int64_t prefill : {int64_t{1}, int64_t{5}}) {
        CAPTURE(s.T, s.n_heads, s.n_kv_heads, s.head_dim, dtype_name(dt), prefill);
        check_decode_equals_forward(s, dt, Rope(0.0f), prefill, true);
      }
}

// A sliding window: the new row at absolute position i sees cache rows i - window + 1 .. i, as
// the training forward's row i does. Windows shorter than the prompt, than the whole sequence,
// and of one key.
TEST_CASE("attention_decode with a sliding window equals attention_forward row for row, bit for bit",
          "[attention][decode][window]") {
  for (int window : {1, 4, 11})
    for (DType dt : {DType::F32, DType::BF16})
      for (int64_t prefill : {int64_t{1}, int64_t{6}}) {
        AttnShape s{1, 13, 4, 2, 16};
        s.window = window;
        CAPTURE(window, dtype_name(dt), prefill);
        check_decode_equals_forward(s, dt, Rope(10000.0f), prefill);
        check_decode_equals_forward(s, dt, Rope(0.0f), prefill, true);  // with ALiBi
      }
}

TEST_CASE("attention_decode checks its shapes and positions", "[attention][decode]") {
  auto be = make_cpu_backend();
  AttnShape s{1, 2, 2, 1, 4};
  HostTensor qkv(DType::F32, {2, s.qkv_cols()}), out(DType::F32, {2, 8});
  HostTensor kc(DType::F32, {4, 4}), vc(DType::F32, {4, 4});
  CHECK_THROWS_WITH(be->attention_decode(out.t, qkv.t, kc.t, vc.t, s, 3, 10000.0f),
                    Catch::Contains("attention_decode") && Catch::Contains("do not fit the caches"));
  HostTensor bad_cache(DType::F32, {4, 8});
  CHECK_THROWS_WITH(be->attention_decode(out.t, qkv.t, bad_cache.t, vc.t, s, 0, 10000.0f),
                    Catch::Contains("k_cache must be [max_len, n_kv_heads*head_dim]"));
  AttnShape two{2, 1, 2, 1, 4};
  CHECK_THROWS_WITH(be->attention_decode(out.t, qkv.t, kc.t, vc.t, two, 0, 10000.0f), Catch::Contains("B = 1"));
}
