// Document masking (kernels/document_positions.h): with the rows' document positions, RoPE,
// attention and the learned position embedding treat each packed document as a sequence of its
// own. On the CPU reference every loop over a document's rows runs in the order it would alone,
// so each document's rows must equal a separate call on that document bit for bit: forward
// outputs, lse, and the backward's dq, dk, dv.
#include "kernel_test_util.h"

#include "kernels/alibi.h"
#include "kernels/document_positions.h"

using namespace keel;
using namespace keel::test;

namespace {

// Bits of rows [r0, r0 + n) of a [rows, cols] tensor.
std::vector<uint32_t> row_bits(const HostTensor& x, int64_t r0, int64_t n) {
  const int64_t cols = x.t.cols();
  std::vector<uint32_t> b;
  for (int64_t i = r0 * cols; i < (r0 + n) * cols; ++i) b.push_back(x.bits(i));
  return b;
}
std::vector<uint32_t> all_bits(const HostTensor& x) { return row_bits(x, 0, x.t.rows()); }

struct AttnPass {
  HostTensor out, lse, dqkv;
};

// rope -> attention forward, then attention backward -> rope backward, on copies of qkv / dout.
AttnPass attention_pass(Backend& be, const HostTensor& qkv_in, const HostTensor& dout, const AttnShape& s,
                        const Rope& rope) {
  const int64_t rows = static_cast<int64_t>(s.B) * s.T, cols = s.qkv_cols();
  HostTensor qkv = rows_of(qkv_in, 0, rows);
  AttnPass p{HostTensor(qkv.t.dtype, {rows, static_cast<int64_t>(s.n_heads) * s.head_dim}),
             HostTensor(DType::F32, {s.B, s.n_heads, s.T}), HostTensor(qkv.t.dtype, {rows, cols})};
  be.rope_forward(qkv.t, s, rope);
  be.attention_forward(p.out.t, p.lse.t, qkv.t, s);
  be.attention_backward(p.dqkv.t, dout.t, qkv.t, p.out.t, p.lse.t, s);
  be.rope_backward(p.dqkv.t, s, rope);
  return p;
}

}  // namespace

TEST_CASE("document positions restart after each end-of-document token and at each sequence", "[documents]") {
  // two sequences of T = 6; eod = 9 (it belongs to the document it ends)
  const std::vector<int32_t> tokens = {4, 9, 5, 5, 9, 9, /**/ 3, 3, 3, 9, 1, 2};
  CHECK(document_positions(tokens.data(), 12, 6, 9) == std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 0, 1});
  CHECK(document_positions(tokens.data(), 12, 6, 7) == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5});
  const std::vector<int32_t> good = {0, 1, 0, 0, 1, 2};
  CHECK(document_positions_error(good.data(), 6, 3).empty());
  CHECK(document_positions_error(good.data(), 6, 4) == "6 rows are not whole sequences of T=4");
  const std::vector<int32_t> skip = {0, 1, 3, 0};
  CHECK(document_positions_error(skip.data(), 4, 4) ==
        "positions[2] = 3 is not a document position (0 or positions[1] + 1 = 2)");
  const std::vector<int32_t> late = {0, 1, 2, 3};  // a second sequence must start at 0
  CHECK(document_positions_error(late.data(), 4, 2) == "positions[2] = 2 is not a document position (each sequence "
                                                       "starts at 0)");
}

// With a sliding window too (window 4, shorter than most documents): a document alone with the
// same window, as the window and the document bound compose (kernels/attention_window.h).
TEST_CASE("rope and attention with document positions compute each document as if alone, bit for bit",
          "[documents][attention][rope][window]") {
  auto be = make_cpu_backend();
  // Sequence 0: documents of 5, 1, 11 and 7 rows; sequence 1: 9 and 15 (T = 24), GQA.
  const std::vector<std::vector<int>> docs = {{5, 1, 11, 7}, {9, 15}};
  std::vector<int> lengths;
  for (const auto& seq : docs) lengths.insert(lengths.end(), seq.begin(), seq.end());
  const std::vector<int32_t> pos = document_positions_of(2, 24, lengths);
  AttnShape s{2, 24, 4, 2, 8};
  const int64_t rows = s.B * s.T, cols = s.qkv_cols(), ocols = static_cast<int64_t>(s.n_heads) * s.head_dim;
  HostTensor positions(DType::I32, {rows});
  positions.set_i32(pos);
  RopeScaling llama3;
  llama3.kind = RopeScaling::Kind::Llama3;
  llama3.original_max_position = 8;  // so that the three frequency bands show up at head_dim 8
  for (const int window : {0, 4})
  for (const Rope& rope : {Rope(10000.0f), Rope{500000.0f, llama3}})
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(window, dtype_name(dt), rope.scaling.kind == RopeScaling::Kind::Llama3);
      s.window = window;
      const HostTensor qkv = make(dt, {rows, cols}, randn(rows * cols, 21, 1.5f));
      const HostTensor dout = make(dt, {rows, ocols}, randn(rows * ocols, 22));
      AttnShape masked = s;
      masked.positions = positions.t;
      const AttnPass packed = attention_pass(*be, qkv, dout, masked, rope);

      int64_t r0 = 0, compared = 0;
      for (size_t b = 0; b < docs.size(); ++b)
        for (int len : docs[b]) {
          CAPTURE(b, r0, len);
          const AttnShape one{1, len, s.n_heads, s.n_kv_heads, s.head_dim, {}, {}, window};
          const HostTensor dout_doc = rows_of(dout, r0, r0 + len);
          const AttnPass alone = attention_pass(*be, rows_of(qkv, r0, r0 + len), dout_doc, one, rope);
          CHECK(row_bits(packed.out, r0, len) == all_bits(alone.out));
          CHECK(row_bits(packed.dqkv, r0, len) == all_bits(alone.dqkv));
          // lse is [B, n_heads, T]: the document's rows of each head
          const int64_t t0 = r0 - static_cast<int64_t>(b) * s.T;
          for (int h = 0; h < s.n_heads; ++h)
            for (int i = 0; i < len; ++i)
              CHECK(packed.lse.bits((static_cast<int64_t>(b) * s.n_heads + h) * s.T + t0 + i) ==
                    alone.lse.bits(static_cast<int64_t>(h) * len + i));
          r0 += len;
          ++compared;
        }
      CHECK(compared == 6);

      // The same data without the masking differs (the test can fail), and positions that make
      // every sequence one document are the plain causal call, bit for bit.
      const AttnPass causal = attention_pass(*be, qkv, dout, s, rope);
      CHECK(bits_differ(causal.out, packed.out) > 0);
      HostTensor whole(DType::I32, {rows});
      whole.set_i32(document_positions_of(2, 24, {24}));
      AttnShape one_doc = s;
      one_doc.positions = whole.t;
      const AttnPass same = attention_pass(*be, qkv, dout, one_doc, rope);
      CHECK(bits_differ(same.out, causal.out) == 0);
      CHECK(bits_differ(same.lse, causal.lse) == 0);
      CHECK(bits_differ(same.dqkv, causal.dqkv) == 0);
    }
}

// ALiBi's bias depends on j - i only, so a packed document sees the biases it would see alone.
TEST_CASE("attention with ALiBi and document positions computes each document as if alone, bit for bit",
          "[documents][attention][alibi]") {
  auto be = make_cpu_backend();
  const std::vector<int> lengths = {5, 1, 11, 7, 9, 15};  // sequence 0: 5+1+11+7, sequence 1: 9+15
  AttnShape s{2, 24, 6, 3, 8};
  const int64_t rows = s.B * s.T, cols = s.qkv_cols(), ocols = static_cast<int64_t>(s.n_heads) * s.head_dim;
  HostTensor positions(DType::I32, {rows});
  positions.set_i32(document_positions_of(2, 24, lengths));
  HostTensor slopes = make(DType::F32, {s.n_heads}, alibi_slopes(s.n_heads));
  s.alibi_slopes = slopes.t;
  const Rope none(0.0f);
  for (DType dt : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dt));
    const HostTensor qkv = make(dt, {rows, cols}, randn(rows * cols, 23, 1.5f));
    const HostTensor dout = make(dt, {rows, ocols}, randn(rows * ocols, 24));
    AttnShape masked = s;
    masked.positions = positions.t;
    const AttnPass packed = attention_pass(*be, qkv, dout, masked, none);
    int64_t r0 = 0;
    for (int len : lengths) {
      CAPTURE(r0, len);
      AttnShape one{1, len, s.n_heads, s.n_kv_heads, s.head_dim};
      one.alibi_slopes = slopes.t;
      const AttnPass alone = attention_pass(*be, rows_of(qkv, r0, r0 + len), rows_of(dout, r0, r0 + len), one, none);
      CHECK(row_bits(packed.out, r0, len) == all_bits(alone.out));
      CHECK(row_bits(packed.dqkv, r0, len) == all_bits(alone.dqkv));
      r0 += len;
    }
  }
}

TEST_CASE("the learned position embedding follows document positions", "[documents][embedding]") {
  auto be = make_cpu_backend();
  const int T = 8, C = 5, V = 11;
  const std::vector<int32_t> pos = document_positions_of(3, T, {3, 5, 1, 6, 1, 8});
  const int64_t N = static_cast<int64_t>(pos.size());
  std::vector<int32_t> tok;
  for (int64_t n = 0; n < N; ++n) tok.push_back(static_cast<int32_t>((n * 7) % V));
  HostTensor tokens(DType::I32, {N}), positions(DType::I32, {N});
  tokens.set_i32(tok);
  positions.set_i32(pos);
  const HostTensor table = make(DType::F32, {V, C}, randn(V * C, 31));
  const HostTensor pos_table = make(DType::F32, {T, C}, randn(T * C, 32));
  HostTensor out(DType::F32, {N, C});
  be->embedding_forward(out.t, tokens.t, table.t, pos_table.t, T, 0, positions.t);
  for (int64_t n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) CHECK(out.at(n * C + c) == table.at(tok[n] * C + c) + pos_table.at(pos[n] * C + c));

  // backward: dpos[p] += the rows at position p in increasing n, one fp32 sum per row of dpos
  const HostTensor dout = make(DType::F32, {N, C}, randn(N * C, 33));
  HostTensor dtok(DType::F32, {V, C}), dpos(DType::F32, {T, C});
  be->embedding_backward(dtok.t, dpos.t, dout.t, tokens.t, T, 0, positions.t);
  for (int p = 0; p < T; ++p)
    for (int c = 0; c < C; ++c) {
      float acc = 0;
      for (int64_t n = 0; n < N; ++n)
        if (pos[n] == p) acc += dout.at(n * C + c);
      CHECK(dpos.at(p * C + c) == 0.0f + acc);
    }
  // positions n % T are the plain call, bit for bit
  HostTensor plain_pos(DType::I32, {N});
  plain_pos.set_i32(document_positions_of(3, T, {T}));
  HostTensor dtok2(DType::F32, {V, C}), dpos2(DType::F32, {T, C}), dtok3(DType::F32, {V, C}), dpos3(DType::F32, {T, C});
  be->embedding_backward(dtok2.t, dpos2.t, dout.t, tokens.t, T, 0, plain_pos.t);
  be->embedding_backward(dtok3.t, dpos3.t, dout.t, tokens.t, T, 0, Tensor());
  CHECK(bits_differ(dpos2, dpos3) == 0);
  CHECK(bits_differ(dtok2, dtok3) == 0);
  CHECK(bits_differ(dpos2, dpos) > 0);
}

TEST_CASE("positions that are not document positions are refused, naming the row", "[documents][errors]") {
  auto be = make_cpu_backend();
  AttnShape s{1, 4, 2, 1, 4};
  HostTensor qkv = make(DType::F32, {4, s.qkv_cols()}, randn(4 * s.qkv_cols(), 41));
  HostTensor out(DType::F32, {4, 8}), lse(DType::F32, {1, 2, 4});
  HostTensor bad(DType::I32, {4});
  bad.set_i32({0, 1, 1, 0});
  s.positions = bad.t;
  CHECK_THROWS_WITH(be->attention_forward(out.t, lse.t, qkv.t, s),
                    Catch::Contains("attention_forward") &&
                        Catch::Contains("positions[2] = 1 is not a document position (0 or positions[1] + 1 = 2)"));
  CHECK_THROWS_WITH(be->rope_forward(qkv.t, s, Rope(10000.0f)), Catch::Contains("rope_forward"));
  HostTensor short_pos(DType::I32, {3});
  short_pos.set_i32({0, 1, 2});
  s.positions = short_pos.t;
  CHECK_THROWS_WITH(be->attention_forward(out.t, lse.t, qkv.t, s), Catch::Contains("one entry per token row (4)"));
  // decoding is one document: positions there are a mistake
  HostTensor kc(DType::F32, {8, 4}), vc(DType::F32, {8, 4});
  AttnShape d{1, 4, 2, 1, 4};
  HostTensor seq(DType::I32, {4});
  seq.set_i32({0, 1, 2, 3});
  d.positions = seq.t;
  CHECK_THROWS_WITH(be->attention_decode(out.t, qkv.t, kc.t, vc.t, d, 0, Rope(10000.0f)),
                    Catch::Contains("document positions are for training"));
}
