// Helpers for the CUDA backend tests: skip without a GPU, device copies of host tensors, and
// comparisons with the CPU reference.
//
// Every GPU test starts with KEEL_GPU_OR_SKIP(): where no GPU is visible it prints
// "skipped: no GPU" (a Catch2 warning, shown in the report) and returns, so the run passes and
// says why. The comparisons run the CPU backend on the same inputs (same storage dtypes, so the
// reference rounds exactly as the GPU should) and measure ||gpu - cpu|| / ||cpu|| in double.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/scoped_env.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kernels/kernel_test_util.h"

#define KEEL_GPU_OR_SKIP()                                                   \
  do {                                                                       \
    if (::keel::cuda_device_count() == 0) {                                  \
      WARN("skipped: no GPU (keel::cuda_device_count() == 0)");              \
      return;                                                                \
    }                                                                        \
  } while (0)

namespace keel::test {

#ifdef KEEL_HAVE_CUDA
// One CUDA backend on device 0 for the whole binary (fused attention kernels where they apply).
inline Backend& gpu() {
  static std::unique_ptr<Backend> be = make_cuda_backend(0);
  return *be;
}
// A CUDA backend made with env's variable set to value (nullptr: unset): a backend reads its
// environment when it is made.
inline std::unique_ptr<Backend> backend_with(const ScopedEnv& env, const char* value) {
  env.set(value);
  return make_cuda_backend(0);
}
// A second one that always takes the plain fp32 attention kernels (KEEL_ATTENTION=simple).
inline Backend& gpu_simple_attention() {
  static std::unique_ptr<Backend> be = backend_with(ScopedEnv("KEEL_ATTENTION"), "simple");
  return *be;
}
// A third that sends attention calls to cuDNN where it takes them (KEEL_ATTENTION=cudnn); where
// cuDNN cannot be loaded (the emulator) it runs keel's fused kernels.
inline Backend& gpu_cudnn_attention() {
  static std::unique_ptr<Backend> be = backend_with(ScopedEnv("KEEL_ATTENTION"), "cudnn");
  return *be;
}
// KEEL_REQUIRE_CUDNN=1 (scripts/gpu_session.sh sets it): a cuDNN test fails, rather than checks
// the fallback, where cuDNN did not load.
inline bool cudnn_required() {
  const char* v = std::getenv("KEEL_REQUIRE_CUDNN");
  return v && *v && std::string(v) != "0";
}
#endif

inline Backend& cpu() {
  static std::unique_ptr<Backend> be = make_cpu_backend();
  return *be;
}

// A host tensor with the dtype and shape of t (contents zero).
inline HostTensor host_like(const Tensor& t) {
  HostTensor h(t.dtype, {t.numel()});
  h.t.ndim = t.ndim;
  h.t.shape = t.shape;
  return h;
}

// A device tensor owned by the test, released at scope exit. With shift > 0 it starts `shift`
// elements into its own buffer (shift 1: never 16-byte aligned, so the elementwise kernels take
// their one-element path on it).
struct DeviceTensor {
  Backend* be = nullptr;
  void* buffer = nullptr;
  Tensor t;

  DeviceTensor(Backend& b, const Tensor& like, int64_t shift = 0) : be(&b), t(like) {
    t.device = b.device();
    const size_t skip = static_cast<size_t>(shift) * dtype_size(like.dtype);
    buffer = b.allocate(std::max<size_t>(t.bytes() + skip, 1));
    t.data = static_cast<char*>(buffer) + skip;
  }
  // A copy of host tensor h (raw bytes).
  static DeviceTensor of(Backend& b, const HostTensor& h, int64_t shift = 0) {
    DeviceTensor d(b, h.t, shift);
    b.copy_from_host(d.t, h.t.data);
    return d;
  }
  DeviceTensor(DeviceTensor&& o) noexcept : be(o.be), buffer(o.buffer), t(o.t) { o.buffer = nullptr; }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() {
    if (buffer) be->release(buffer);
  }
  HostTensor host() const {
    HostTensor h = host_like(t);
    be->copy_to_host(h.t.data, t);
    return h;
  }
  void upload(const HostTensor& h) { be->copy_from_host(t, h.t.data); }
};

// A host copy of h (same dtype and shape, same bits).
inline HostTensor clone(const HostTensor& h) {
  HostTensor c = host_like(h.t);
  std::memcpy(c.t.data, h.t.data, h.t.bytes());
  return c;
}

inline HostTensor filled(DType dt, std::initializer_list<int64_t> shape, float value) {
  HostTensor h(dt, shape);
  for (int64_t i = 0; i < h.numel(); ++i) h.put(i, value);
  return h;
}

// ||got - ref|| / ||ref|| over the values (double); +inf when either holds a NaN or an inf
// where the other does not hold the same.
inline double rel_err(const HostTensor& got, const HostTensor& ref) {
  REQUIRE(got.numel() == ref.numel());
  double num = 0, den = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.at(i), b = ref.at(i);
    if (!std::isfinite(a) || !std::isfinite(b)) {
      if (std::isnan(a) || std::isnan(b) || a != b) return INFINITY;
      continue;
    }
    num += (a - b) * (a - b);
    den += b * b;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// ||got - ref|| / ||scale|| over the values (double), for results whose own norm can be far
// below their inputs' (a derivative near its zero); +inf as rel_err.
inline double err_over(const HostTensor& got, const HostTensor& ref, const HostTensor& scale) {
  REQUIRE(scale.numel() == ref.numel());
  double ref2 = 0, scale2 = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    ref2 += static_cast<double>(ref.at(i)) * ref.at(i);
    scale2 += static_cast<double>(scale.at(i)) * scale.at(i);
  }
  const double e = rel_err(got, ref);
  return scale2 > 0 && ref2 > 0 ? e * std::sqrt(ref2 / scale2) : e;
}

// ---- the per-op error log ----
// Every comparison below is also appended to the file named by KEEL_GPU_ERRORS, one TSV line
// per comparison: op, case, measured, tolerance, kind ("rel": ||gpu - cpu|| / ||cpu||; "bits":
// elements whose bits differ, tolerance 0). scripts/gpu_session.sh turns it into the per-op
// error table (worst case per op and dtype).
inline void log_comparison(const std::string& op, const std::string& what, double measured, double tol,
                           const char* kind) {
  static std::mutex mu;
  const char* path = std::getenv("KEEL_GPU_ERRORS");
  if (!path || !*path) return;
  std::lock_guard<std::mutex> lock(mu);
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%s\t%s\t%.3e\t%.3e\t%s\n", op.c_str(), what.c_str(), measured, tol, kind);
    std::fclose(f);
  }
}

}  // namespace keel::test

// CHECK(err <= tol), with both numbers in the report and the error log.
#define KEEL_CHECK_ERR(op, what, err, tol)                                        \
  do {                                                                            \
    const double keel_err_ = (err), keel_tol_ = (tol);                            \
    ::keel::test::log_comparison((op), (what), keel_err_, keel_tol_, "rel");      \
    INFO((op) << " [" << (what) << "]: error " << keel_err_ << ", tolerance " << keel_tol_); \
    CHECK(keel_err_ <= keel_tol_);                                                \
  } while (0)

// CHECK that two host tensors hold the same bits, logged as a count of differing elements.
#define KEEL_CHECK_BITS(op, what, got, ref)                                       \
  do {                                                                            \
    const int64_t keel_nbits_ = ::keel::test::bits_differ((got), (ref));          \
    ::keel::test::log_comparison((op), (what), static_cast<double>(keel_nbits_), 0.0, "bits"); \
    INFO((op) << " [" << (what) << "]: " << keel_nbits_ << " elements differ in their bits"); \
    CHECK(keel_nbits_ == 0);                                                      \
  } while (0)

namespace keel::test {

// The dtypes the tests sweep.
inline const char* dname(DType t) { return std::string_view(dtype_name(t)).data(); }

// A tolerance on ||gpu - cpu|| / ||cpu|| for an output stored in `out` whose fp32 value the
// two backends compute in different orders: the fp32 differences (a few ulps) are far below the
// storage rounding of bf16/f16, where only rare one-ulp flips remain.
inline double storage_tol(DType out, double f32_tol) {
  switch (out) {
    case DType::BF16: return 4e-3;  // 2^-8 spacing
    case DType::F16: return 1e-3;   // 2^-11 spacing
    default: return f32_tol;
  }
}

}  // namespace keel::test
