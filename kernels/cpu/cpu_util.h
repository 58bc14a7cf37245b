// Helpers shared by the CPU backend's ops: argument checks, fp32 loads and rounded stores for
// every storage dtype, and small fixed-order vector loops.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "kernels/op_check.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace keel::cpu {

// Below this much work (elements, or multiply-adds) an op runs on the calling thread: forking
// costs more than it saves. Results do not depend on it (nor on the thread count).
constexpr int64_t kMinParallelWork = int64_t{1} << 15;

// Rows per block in row reductions (parameter gradients): partial sums are formed per block of
// this many rows and then added in block order, so the result never depends on the thread count.
constexpr int64_t kRowBlock = 64;

// ---- argument checks: every failure throws std::invalid_argument("CpuBackend::<op>: ...") ----

using Named = NamedTensor;

[[noreturn]] inline void fail(const char* op, const std::string& what, std::initializer_list<Named> ts) {
  fail_op("CpuBackend", op, what, ts);
}

inline void require(bool ok, const char* op, const char* what, std::initializer_list<Named> ts) {
  if (!ok) fail(op, what, ts);
}

// Product of all but the last dimension. (Tensor::rows() divides numel by cols, which is a
// division by zero when the last dimension is 0.)
inline int64_t rows(const Tensor& t) {
  int64_t r = 1;
  for (int i = 0; i + 1 < t.ndim; ++i) r *= t.shape[i];
  return r;
}

inline bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

// A present CPU tensor of a float dtype (data may be null only when it has no elements).
void check_float(const char* op, Named a);
// A present CPU tensor of exactly this dtype.
void check_dtype(const char* op, Named a, DType want);

// AttnShape fields positive, n_heads a multiple of n_kv_heads, and qkv (or dqkv)
// [B*T, qkv_cols()]; check_rope also wants an even head_dim (RoPE rotates pairs of columns; a
// model without it, BLOOM-104B's 145, may have odd heads). Defined in attention.cpp.
void check_attn(const char* op, const AttnShape& s, Named qkv);
void check_rope(const char* op, const AttnShape& s, Named qkv);
std::string attn_str(const AttnShape& s);  // "B=2 T=16 n_heads=4 n_kv_heads=2 head_dim=8"
// Document positions (AttnShape::positions): empty, or a CPU I32 tensor of N elements, N a
// multiple of T, 0 at each sequence's first row and every other row 0 or one more than the
// row before. Returns the data (nullptr when empty). Defined in attention.cpp.
const int32_t* check_positions(const char* op, const Tensor& positions, int64_t N, int T);
// ALiBi slopes (AttnShape::alibi_slopes): empty, or a CPU F32 tensor of n_heads elements.
// Returns the data (nullptr when empty). Defined in attention.cpp.
const float* check_alibi(const char* op, const AttnShape& s);
// ALiBi's bias of key j for query i under head h's slope (0 without slopes). attention.cpp and
// attention_decode.cpp add it to the scaled dot product, both compiled without FMA contraction,
// so a decode reproduces the training path's scores bit for bit.
inline float alibi_bias(const float* slopes, int64_t h, int64_t i, int64_t j) {
  return slopes ? slopes[h] * static_cast<float>(j - i) : 0.0f;
}

// ---- element access ----

// Read-only views that yield fp32 for each storage dtype.
struct SrcF32 {
  const float* p;
  float operator[](int64_t i) const { return p[i]; }
};
struct SrcBF16 {
  const uint16_t* p;
  float operator[](int64_t i) const { return bf16_to_f32(p[i]); }
};
struct SrcF16 {
  const uint16_t* p;
  float operator[](int64_t i) const { return f16_to_f32(p[i]); }
};

// Calls fn(src) with the view matching t's dtype, so hot loops are compiled once per dtype.
template <class Fn>
decltype(auto) with_source(const Tensor& t, Fn&& fn) {
  switch (t.dtype) {
    case DType::BF16: return fn(SrcBF16{t.as<const uint16_t>()});
    case DType::F16: return fn(SrcF16{t.as<const uint16_t>()});
    default: return fn(SrcF32{t.as<const float>()});
  }
}

// dst[0, n) = t's elements [offset, offset + n) as fp32.
void load_f32(const Tensor& t, int64_t offset, int64_t n, float* dst);
// t's elements [offset, offset + n) = src rounded to t's dtype (round to nearest even).
void store_f32(const Tensor& t, int64_t offset, int64_t n, const float* src);
// Pointer to t's elements [offset, offset + n) as fp32: t's own memory when it is F32, else
// `scratch` filled by load_f32.
inline const float* read_f32(const Tensor& t, int64_t offset, int64_t n, float* scratch) {
  if (t.dtype == DType::F32) return t.as<const float>() + offset;
  load_f32(t, offset, n, scratch);
  return scratch;
}

// ---- fixed-order vector loops (8 interleaved partial sums, combined as a fixed tree) ----

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline float sum_f32(const float* a, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l];
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i];
  return s;
}

// y += a * x
inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// fn(begin, len) over [0, n) cut into fixed chunks of `chunk` elements, in parallel.
template <class Fn>
void for_chunks(int64_t n, int64_t chunk, Fn&& fn) {
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    int64_t begin = c * chunk;
    fn(begin, n - begin < chunk ? n - begin : chunk);
  }
}

// dst[c] = s, or dst[c] += s when accumulating, where s = the sum over b in order of partial[b][c]
// (partial is [nblocks, n]); parallel over c.
inline void add_block_partials(float* dst, const float* partial, int64_t nblocks, int64_t n, bool accumulate) {
#pragma omp parallel for schedule(static) if (nblocks * n >= kMinParallelWork)
  for (int64_t c = 0; c < n; ++c) {
    float s = 0;
    for (int64_t b = 0; b < nblocks; ++b) s += partial[b * n + c];
    dst[c] = accumulate ? dst[c] + s : s;
  }
}

// 64-byte aligned fp32 scratch that is kept between calls and only grows.
class ScratchF32 {
 public:
  ScratchF32() = default;
  ScratchF32(const ScratchF32&) = delete;
  ScratchF32& operator=(const ScratchF32&) = delete;
  ~ScratchF32();
  float* get(int64_t n);  // at least n floats; contents unspecified
 private:
  float* p_ = nullptr;
  int64_t cap_ = 0;
};

}  // namespace keel::cpu
