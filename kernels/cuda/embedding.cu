// Token (+ learned position) embedding, vocab-parallel: this rank holds token rows
// [vocab_start, vocab_start + V_local); other tokens contribute zero here.
//
// Forward: out[n, c] = tok_embed[tokens[n] - vocab_start, c] (0 if not local) + pos_embed[p(n), c],
// p(n) = n % T or the document position positions[n], one thread per element.
//
// Backward, deterministic without atomics:
//   dtok_embed[v] += sum over n with tokens[n] - vocab_start == v, in increasing n, of dout[n]
//   1. key[n] = local row of token n (V_local for tokens of other shards), value n;
//   2. a stable radix sort of (key, n) (CUB: stable, integer-only, hence deterministic) groups
//      the rows of each token with their n still increasing;
//   3. one block per (sorted position p that starts a run of equal keys, column chunk): its
//      threads (one per column) add the run's dout rows in order and add the sum to the table.
//   dpos_embed[t] += sum over n = t, t+T, t+2T, ... in order of dout[n] (one thread per (t, c));
//   with document positions, the same sort and run sums as for tokens, keyed by positions[n].
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_common.cuh"

namespace keel {

using cuda::Named;

namespace cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void embedding_forward_kernel(T* __restrict__ out, const int32_t* __restrict__ tokens,
                                         const T* __restrict__ tok_embed, const T* __restrict__ pos_embed,
                                         const int32_t* __restrict__ positions, int64_t N, int64_t C, int64_t V,
                                         int64_t vocab_start, int T_len) {
  const int64_t total = N * C;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / C, c = e - n * C;
    const int64_t v = static_cast<int64_t>(tokens[n]) - vocab_start;
    float x = (v >= 0 && v < V) ? to_f32(tok_embed[v * C + c]) : 0.0f;
    if (pos_embed) x += to_f32(pos_embed[(positions ? positions[n] : n % T_len) * C + c]);
    out[e] = from_f32<T>(x);
  }
}

// key[n] = local row of tokens[n], or V for a token held by another shard (sorts last, skipped).
// (Also keys document positions: tokens = positions, V = T, vocab_start = 0.)
__global__ void embedding_keys_kernel(uint32_t* __restrict__ keys, uint32_t* __restrict__ index,
                                      const int32_t* __restrict__ tokens, int64_t N, int64_t V, int64_t vocab_start) {
  for (int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; n < N;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = static_cast<int64_t>(tokens[n]) - vocab_start;
    keys[n] = static_cast<uint32_t>((v >= 0 && v < V) ? v : V);
    index[n] = static_cast<uint32_t>(n);
  }
}

// Block (p, column chunk): if sorted position p starts a run of key k < V, add the run's rows of
// dout (in sorted order, i.e. increasing n) into dtok_embed[k].
template <class T>
__global__ void embedding_rows_backward_kernel(float* __restrict__ dtok, const T* __restrict__ dout,
                                               const uint32_t* __restrict__ keys, const uint32_t* __restrict__ index,
                                               int64_t N, int64_t C, int64_t V) {
  const int64_t p = blockIdx.x;
  const uint32_t k = keys[p];
  if (k >= V || (p > 0 && keys[p - 1] == k)) return;
  const int64_t c = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  float acc = 0;
  for (int64_t q = p; q < N && keys[q] == k; ++q) acc += to_f32(dout[static_cast<int64_t>(index[q]) * C + c]);
  dtok[static_cast<int64_t>(k) * C + c] += acc;
}

// Positions t < min(T, N) (rows of dpos beyond are untouched, as on the CPU).
template <class T>
__global__ void embedding_pos_backward_kernel(float* __restrict__ dpos, const T* __restrict__ dout, int64_t N,
                                              int64_t C, int64_t T_len, int64_t t_rows) {
  const int64_t total = t_rows * C;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / C, c = e - t * C;
    float acc = 0;
    for (int64_t n = t; n < N; n += T_len) acc += to_f32(dout[n * C + c]);
    dpos[e] += acc;
  }
}

// Checks shared by forward and backward; returns (N tokens, C columns).
std::pair<int64_t, int64_t> check_embedding(const char* op, Named rows_out, const Tensor& tokens, Named table,
                                            const Tensor& pos, const char* pos_name, int T) {
  check_dtype(op, {"tokens", tokens}, DType::I32);
  const int64_t N = tokens.numel(), C = table.t.cols();
  if (rows(rows_out.t) != N || rows_out.t.cols() != C)
    fail(op, std::string(rows_out.name) + " must be [tokens, " + table.name + ".cols()]",
         {rows_out, {"tokens", tokens}, table});
  if (!pos.empty()) {
    if (T <= 0) fail(op, "T must be positive, got " + std::to_string(T), {{pos_name, pos}});
    if (pos.cols() != C || rows(pos) < T)
      fail(op, std::string(pos_name) + " must be [>= T, C] with T=" + std::to_string(T), {{pos_name, pos}, table});
  }
  return {N, C};
}

int bits_for(int64_t max_value) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= max_value) ++bits;
  return bits;
}

// table[k] += the rows n of dout whose key ids[n] - offset is k (keys outside [0, K) skipped),
// summed in increasing n: steps 1-3 of the top comment.
void sorted_row_sums(CudaBackend& be, const Tensor& table, const Tensor& dout, const int32_t* ids, int64_t K,
                     int64_t offset, const char* op) {
  const int64_t N = rows(dout), C = dout.cols();
  auto* buf = static_cast<uint32_t*>(be.scratch(static_cast<size_t>(4 * N) * sizeof(uint32_t), op));
  uint32_t *keys = buf, *index = buf + N, *keys_sorted = buf + 2 * N, *index_sorted = buf + 3 * N;
  embedding_keys_kernel<<<grid_for(N, kThreads), kThreads, 0, be.stream()>>>(keys, index, ids, N, K, offset);
  const int bits = bits_for(K);
  size_t temp_bytes = 0;
  check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, keys_sorted, index, index_sorted,
                                             static_cast<int>(N), 0, bits, be.stream()),
             op, "cub::DeviceRadixSort::SortPairs (size query)");
  void* temp = be.scratch(std::max<size_t>(temp_bytes, 1), op);
  check_cuda(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, keys_sorted, index, index_sorted,
                                             static_cast<int>(N), 0, bits, be.stream()),
             op, "cub::DeviceRadixSort::SortPairs");
  SameDType u(be, op, {in(dout)});
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(ceil_div(C, kThreads)));
  KEEL_DISPATCH_FLOAT(u.dtype(), op, TT, {
    embedding_rows_backward_kernel<TT><<<grid, kThreads, 0, be.stream()>>>(
        table.as<float>(), u[0].as<const TT>(), keys_sorted, index_sorted, N, C, K);
  });
  be.release(temp);
  be.release(buf);
}

}  // namespace
}  // namespace cuda

void CudaBackend::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& tok_embed,
                                    const Tensor& pos_embed, int T, int64_t vocab_start, const Tensor& positions) {
  const char* op = "embedding_forward";
  cuda::check_float(op, {"out", out});
  cuda::check_float(op, {"tok_embed", tok_embed});
  if (!pos_embed.empty()) cuda::check_float(op, {"pos_embed", pos_embed});
  auto [N, C] = cuda::check_embedding(op, {"out", out}, tokens, {"tok_embed", tok_embed}, pos_embed, "pos_embed", T);
  const int32_t* doc_pos = pos_embed.empty() ? nullptr : cuda::check_positions(op, positions, N, T);
  if (N * C == 0) return;
  const int64_t V = cuda::rows(tok_embed);
  cuda::SameDType u(*this, op, {cuda::out(out), cuda::in(tok_embed), cuda::in(pos_embed)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, TT, {
    cuda::embedding_forward_kernel<TT><<<cuda::grid_for(N * C, cuda::kThreads, 4), cuda::kThreads, 0, stream_>>>(
        u[0].as<TT>(), tokens.as<const int32_t>(), u[1].as<const TT>(), pos_embed.empty() ? nullptr : u[2].as<const TT>(),
        doc_pos, N, C, V, vocab_start, pos_embed.empty() ? 1 : T);
  });
  u.finish();
  cuda::check_launch(*this, op, {{"out", out}, {"tokens", tokens}, {"tok_embed", tok_embed}});
}

void CudaBackend::embedding_backward(const Tensor& dtok_embed, const Tensor& dpos_embed, const Tensor& dout,
                                     const Tensor& tokens, int T, int64_t vocab_start, const Tensor& positions) {
  const char* op = "embedding_backward";
  cuda::check_dtype(op, {"dtok_embed", dtok_embed}, DType::F32);
  if (!dpos_embed.empty()) cuda::check_dtype(op, {"dpos_embed", dpos_embed}, DType::F32);
  cuda::check_float(op, {"dout", dout});
  auto [N, C] =
      cuda::check_embedding(op, {"dout", dout}, tokens, {"dtok_embed", dtok_embed}, dpos_embed, "dpos_embed", T);
  const int32_t* doc_pos = dpos_embed.empty() ? nullptr : cuda::check_positions(op, positions, N, T);
  if (N * C == 0) return;
  const int64_t V = cuda::rows(dtok_embed);
  if (N >= (int64_t{1} << 31) || V >= (int64_t{1} << 31) - 1)
    cuda::fail(op, "more than 2^31 tokens or vocabulary rows", {{"dout", dout}, {"dtok_embed", dtok_embed}});

  cuda::sorted_row_sums(*this, dtok_embed, dout, tokens.as<const int32_t>(), V, vocab_start, op);
  if (doc_pos) {
    cuda::sorted_row_sums(*this, dpos_embed, dout, doc_pos, T, 0, op);
  } else if (!dpos_embed.empty()) {
    cuda::SameDType u(*this, op, {cuda::in(dout)});
    const int64_t t_rows = std::min<int64_t>(T, N);
    KEEL_DISPATCH_FLOAT(u.dtype(), op, TT, {
      cuda::embedding_pos_backward_kernel<TT><<<cuda::grid_for(t_rows * C, cuda::kThreads), cuda::kThreads, 0, stream_>>>(
          dpos_embed.as<float>(), u[0].as<const TT>(), N, C, T, t_rows);
    });
  }
  cuda::check_launch(*this, op, {{"dtok_embed", dtok_embed}, {"dout", dout}, {"tokens", tokens}});
}

}  // namespace keel
