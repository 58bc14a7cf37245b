// Host-side helpers shared by the CUDA backend's op files: argument checks that throw
// std::invalid_argument("CudaBackend::<op>: ... (shapes)"), CUDA / cuBLAS error reports that
// throw std::runtime_error naming the op, the failing call and the shapes, and the dtype
// dispatch used to instantiate kernels for f32 / bf16 / f16 storage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/op_check.h"
#include "kernels/tensor.h"

namespace keel::cuda {

using Named = NamedTensor;

inline std::string describe(std::initializer_list<Named> ts) { return describe_tensors(ts); }

[[noreturn]] inline void fail(const char* op, const std::string& what, std::initializer_list<Named> ts) {
  fail_op("CudaBackend", op, what, ts);
}

inline void require(bool ok, const char* op, const char* what, std::initializer_list<Named> ts) {
  if (!ok) fail(op, what, ts);
}

// A CUDA runtime error in `call` while running `op` on tensors of the given shapes.
[[noreturn]] inline void fail_cuda(const char* op, const char* call, cudaError_t e, const std::string& shapes) {
  throw std::runtime_error(std::string("CudaBackend::") + op + ": " + call + " failed: " + cudaGetErrorName(e) + " (" +
                           cudaGetErrorString(e) + ")" + (shapes.empty() ? "" : " [" + shapes + "]"));
}

inline void check_cuda(cudaError_t e, const char* op, const char* call, const std::string& shapes = "") {
  if (e != cudaSuccess) fail_cuda(op, call, e, shapes);
}

// After an op's launches: a launch error (bad configuration, too much shared memory) is reported
// with the op and its shapes; under KEEL_CUDA_SYNC=1 the stream is drained too, so that a fault
// while the kernels ran is reported by this op rather than by a later one.
inline void check_launch(CudaBackend& be, const char* op, std::initializer_list<Named> ts) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail_cuda(op, "kernel launch", e, describe(ts));
  if (be.profiling()) be.profile_mark(op, describe(ts));
  if (be.sync_each_op()) {
    e = cudaStreamSynchronize(be.stream());
    if (e != cudaSuccess) fail_cuda(op, "kernel execution (KEEL_CUDA_SYNC=1)", e, describe(ts));
  }
}

inline bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

inline void check_present(const char* op, Named a) {
  if (a.t.device != Device::CUDA) fail(op, std::string(a.name) + " is not a CUDA tensor", {a});
  if (a.t.empty() && a.t.numel() != 0) fail(op, std::string(a.name) + " has no data", {a});
}

// A present CUDA tensor of a float dtype (data may be null only when it has no elements).
inline void check_float(const char* op, Named a) {
  check_present(op, a);
  if (!is_float(a.t.dtype)) fail(op, std::string(a.name) + " must be f32, bf16 or f16", {a});
}

inline void check_dtype(const char* op, Named a, DType want) {
  check_present(op, a);
  if (a.t.dtype != want) fail(op, std::string(a.name) + " must be " + std::string(dtype_name(want)), {a});
}

// Product of all but the last dimension (Tensor::rows() divides by cols, which may be 0).
inline int64_t rows(const Tensor& t) {
  int64_t r = 1;
  for (int i = 0; i + 1 < t.ndim; ++i) r *= t.shape[i];
  return r;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline std::string attn_str(const AttnShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " n_heads=" + std::to_string(s.n_heads) +
         " n_kv_heads=" + std::to_string(s.n_kv_heads) + " head_dim=" + std::to_string(s.head_dim) +
         (s.window != 0 ? std::string(" window=") + std::to_string(s.window) : std::string());
}

// Document positions (AttnShape::positions): empty, or a CUDA I32 tensor of N elements in whole
// sequences of T. Their values are not read back (that would sync): the kernels trust them to
// be document positions (kernels/document_positions.h), which the Transformer checks on the
// host before it copies them over. Returns the device pointer (nullptr when empty).
inline const int32_t* check_positions(const char* op, const Tensor& positions, int64_t N, int T) {
  if (positions.empty()) return nullptr;
  check_dtype(op, {"positions", positions}, DType::I32);
  if (positions.numel() != N || T <= 0 || N % T != 0)
    fail(op, "positions must hold one entry per token row (" + std::to_string(N) + ", sequences of T=" +
                 std::to_string(T) + ")", {{"positions", positions}});
  return positions.as<const int32_t>();
}

// ALiBi slopes (AttnShape::alibi_slopes): empty, or a CUDA F32 tensor with one slope per (local)
// query head. Returns the device pointer (nullptr when empty: no bias).
inline const float* check_alibi(const char* op, const AttnShape& s) {
  if (s.alibi_slopes.empty()) return nullptr;
  check_dtype(op, {"alibi_slopes", s.alibi_slopes}, DType::F32);
  if (s.alibi_slopes.numel() != s.n_heads)
    fail(op, "alibi_slopes must hold one slope per query head (" + std::to_string(s.n_heads) + ") for " + attn_str(s),
         {{"alibi_slopes", s.alibi_slopes}});
  return s.alibi_slopes.as<const float>();
}

// AttnShape fields positive, n_heads a multiple of n_kv_heads, and qkv (or dqkv) [B*T,
// qkv_cols()]; positions and alibi_slopes empty or well formed. (check_rope: and head_dim even.)
inline void check_attn(const char* op, const AttnShape& s, Named qkv) {
  if (s.B <= 0 || s.T <= 0 || s.n_heads <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0 ||
      s.n_heads % s.n_kv_heads != 0 || s.window < 0)
    fail(op,
         "invalid attention shape " + attn_str(s) +
             " (all positive, n_heads % n_kv_heads == 0, window 0 (none) or positive)",
         {qkv});
  check_float(op, qkv);
  if (rows(qkv.t) != static_cast<int64_t>(s.B) * s.T || qkv.t.cols() != s.qkv_cols())
    fail(op, std::string(qkv.name) + " must be [B*T, (n_heads + 2 n_kv_heads) * head_dim] for " + attn_str(s), {qkv});
  check_positions(op, s.positions, static_cast<int64_t>(s.B) * s.T, s.T);
  check_alibi(op, s);
}

inline void check_rope(const char* op, const AttnShape& s, Named qkv) {
  check_attn(op, s, qkv);
  if (s.head_dim % 2 != 0) fail(op, "RoPE needs an even head_dim: " + attn_str(s), {qkv});
}

// Largest power of two (up to 256) dividing the address: what cuBLASLt and vector loads may assume.
inline unsigned alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  unsigned al = 1;
  while (al < 256 && (a & al) == 0) al <<= 1;
  return al;
}

}  // namespace keel::cuda

// Runs the statement with `T` the storage type of `dtype` (float, __nv_bfloat16, __half).
#define KEEL_DISPATCH_FLOAT(dtype, op, T, ...)                                                      \
  switch (dtype) {                                                                                  \
    case ::keel::DType::F32: {                                                                      \
      using T = float;                                                                              \
      __VA_ARGS__;                                                                                  \
      break;                                                                                        \
    }                                                                                               \
    case ::keel::DType::BF16: {                                                                     \
      using T = __nv_bfloat16;                                                                      \
      __VA_ARGS__;                                                                                  \
      break;                                                                                        \
    }                                                                                               \
    case ::keel::DType::F16: {                                                                      \
      using T = __half;                                                                             \
      __VA_ARGS__;                                                                                  \
      break;                                                                                        \
    }                                                                                               \
    default:                                                                                        \
      throw std::invalid_argument(std::string("CudaBackend::") + (op) + ": dispatch on a non-float dtype"); \
  }
