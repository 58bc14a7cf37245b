// Token (+ learned position) embedding, vocab-parallel: this rank holds token rows
// [vocab_start, vocab_start + V_local); tokens outside that range contribute zero here.
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace keel {

using cpu::Named;

namespace {

// Checks shared by forward and backward; returns (N tokens, C columns).
std::pair<int64_t, int64_t> check_embedding(const char* op, Named rows_out, const Tensor& tokens, Named table,
                                            const Tensor& pos, const char* pos_name, int T) {
  cpu::check_dtype(op, {"tokens", tokens}, DType::I32);
  const int64_t N = tokens.numel(), C = table.t.cols();
  if (cpu::rows(rows_out.t) != N || rows_out.t.cols() != C)
    cpu::fail(op, std::string(rows_out.name) + " must be [tokens, " + table.name + ".cols()]",
              {rows_out, {"tokens", tokens}, table});
  if (!pos.empty()) {
    if (T <= 0) cpu::fail(op, "T must be positive, got " + std::to_string(T), {{pos_name, pos}});
    if (pos.cols() != C || cpu::rows(pos) < T)
      cpu::fail(op, std::string(pos_name) + " must be [>= T, C] with T=" + std::to_string(T), {{pos_name, pos}, table});
  }
  return {N, C};
}

}  // namespace

void CpuBackend::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& tok_embed,
                                   const Tensor& pos_embed, int T, int64_t vocab_start, const Tensor& positions) {
  const char* op = "embedding_forward";
  cpu::check_float(op, {"out", out});
  cpu::check_float(op, {"tok_embed", tok_embed});
  if (!pos_embed.empty()) cpu::check_float(op, {"pos_embed", pos_embed});
  auto [N, C] = check_embedding(op, {"out", out}, tokens, {"tok_embed", tok_embed}, pos_embed, "pos_embed", T);
  const int32_t* doc_pos = pos_embed.empty() ? nullptr : cpu::check_positions(op, positions, N, T);
  const int64_t V = cpu::rows(tok_embed);
  const int32_t* tok = tokens.as<const int32_t>();
#pragma omp parallel if (N * C >= cpu::kMinParallelWork)
  {
    std::vector<float> row(static_cast<size_t>(C)), pos(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t v = static_cast<int64_t>(tok[n]) - vocab_start;
      if (v >= 0 && v < V)
        cpu::load_f32(tok_embed, v * C, C, row.data());
      else
        std::fill(row.begin(), row.end(), 0.0f);
      if (!pos_embed.empty()) {
        cpu::load_f32(pos_embed, (doc_pos ? doc_pos[n] : n % T) * C, C, pos.data());
        for (int64_t c = 0; c < C; ++c) row[c] += pos[c];
      }
      cpu::store_f32(out, n * C, C, row.data());
    }
  }
}

namespace {

// Rows n of each key in [0, K) (keys outside are skipped), in increasing n: a stable counting
// sort, so each key's rows can be summed by one thread in a fixed order (no atomics).
struct Buckets {
  std::vector<int64_t> start, order;  // key k's rows: order[start[k] .. start[k+1])
};

template <class KeyOf>
Buckets bucket_rows(int64_t N, int64_t K, KeyOf key_of) {
  Buckets b;
  b.start.assign(static_cast<size_t>(K + 1), 0);
  for (int64_t n = 0; n < N; ++n)
    if (const int64_t k = key_of(n); k >= 0 && k < K) ++b.start[k + 1];
  for (int64_t k = 0; k < K; ++k) b.start[k + 1] += b.start[k];
  b.order.resize(static_cast<size_t>(b.start[K]));
  std::vector<int64_t> next(b.start.begin(), b.start.end() - 1);
  for (int64_t n = 0; n < N; ++n)
    if (const int64_t k = key_of(n); k >= 0 && k < K) b.order[next[k]++] = n;
  return b;
}

// table[k] += sum of the rows of key k, in order.
void add_bucket_sums(float* table, const Buckets& b, const Tensor& dout, int64_t C) {
  const int64_t K = static_cast<int64_t>(b.start.size()) - 1;
#pragma omp parallel if (static_cast<int64_t>(b.order.size()) * C >= cpu::kMinParallelWork)
  {
    std::vector<float> acc(static_cast<size_t>(C)), buf(static_cast<size_t>(C));
#pragma omp for schedule(dynamic, 16)
    for (int64_t k = 0; k < K; ++k) {
      if (b.start[k] == b.start[k + 1]) continue;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = b.start[k]; i < b.start[k + 1]; ++i) {
        const float* g = cpu::read_f32(dout, b.order[i] * C, C, buf.data());
        for (int64_t c = 0; c < C; ++c) acc[c] += g[c];
      }
      for (int64_t c = 0; c < C; ++c) table[k * C + c] += acc[c];
    }
  }
}

}  // namespace

// dtok_embed[v] += sum over tokens n == v (in order of n) of dout[n];
// dpos_embed[p] += sum over n at position p (n % T, or positions[n]; in order of n) of dout[n].
void CpuBackend::embedding_backward(const Tensor& dtok_embed, const Tensor& dpos_embed, const Tensor& dout,
                                    const Tensor& tokens, int T, int64_t vocab_start, const Tensor& positions) {
  const char* op = "embedding_backward";
  cpu::check_dtype(op, {"dtok_embed", dtok_embed}, DType::F32);
  if (!dpos_embed.empty()) cpu::check_dtype(op, {"dpos_embed", dpos_embed}, DType::F32);
  cpu::check_float(op, {"dout", dout});
  auto [N, C] = check_embedding(op, {"dout", dout}, tokens, {"dtok_embed", dtok_embed}, dpos_embed, "dpos_embed", T);
  const int32_t* doc_pos = dpos_embed.empty() ? nullptr : cpu::check_positions(op, positions, N, T);
  const int32_t* tok = tokens.as<const int32_t>();
  add_bucket_sums(dtok_embed.as<float>(),
                  bucket_rows(N, cpu::rows(dtok_embed), [&](int64_t n) { return int64_t{tok[n]} - vocab_start; }),
                  dout, C);
  if (!dpos_embed.empty())
    add_bucket_sums(dpos_embed.as<float>(),
                    bucket_rows(N, T, [&](int64_t n) { return doc_pos ? int64_t{doc_pos[n]} : n % T; }), dout, C);
}

}  // namespace keel
