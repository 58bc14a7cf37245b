// CpuBackend: helpers, memory, elementwise ops and whole-tensor reductions.
#include "kernels/cpu/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <vector>

namespace keel {

namespace cpu {

static void check_present(const char* op, Named a) {
  if (a.t.device != Device::CPU) fail(op, std::string(a.name) + " is not a CPU tensor", {a});
  if (a.t.empty() && a.t.numel() != 0) fail(op, std::string(a.name) + " has no data", {a});
}

void check_float(const char* op, Named a) {
  check_present(op, a);
  if (!is_float(a.t.dtype)) fail(op, std::string(a.name) + " must be f32, bf16 or f16", {a});
}

void check_dtype(const char* op, Named a, DType want) {
  check_present(op, a);
  if (a.t.dtype != want)
    fail(op, std::string(a.name) + " must be " + std::string(dtype_name(want)), {a});
}

void load_f32(const Tensor& t, int64_t offset, int64_t n, float* dst) {
  switch (t.dtype) {
    case DType::F32: std::memcpy(dst, t.as<const float>() + offset, static_cast<size_t>(n) * 4); break;
    case DType::BF16: {
      const uint16_t* p = t.as<const uint16_t>() + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(p[i]);
      break;
    }
    case DType::F16: {
      const uint16_t* p = t.as<const uint16_t>() + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(p[i]);
      break;
    }
    default: throw std::invalid_argument("CpuBackend: load_f32 of a non-float tensor " + t.shape_str());
  }
}

void store_f32(const Tensor& t, int64_t offset, int64_t n, const float* src) {
  switch (t.dtype) {
    case DType::F32: std::memmove(t.as<float>() + offset, src, static_cast<size_t>(n) * 4); break;
    case DType::BF16: {
      uint16_t* p = t.as<uint16_t>() + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = f32_to_bf16(src[i]);
      break;
    }
    case DType::F16: {
      uint16_t* p = t.as<uint16_t>() + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = f32_to_f16(src[i]);
      break;
    }
    default: throw std::invalid_argument("CpuBackend: store_f32 to a non-float tensor " + t.shape_str());
  }
}

ScratchF32::~ScratchF32() { std::free(p_); }

float* ScratchF32::get(int64_t n) {
  if (n > cap_) {
    std::free(p_);
    size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
    p_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!p_) {
      cap_ = 0;
      throw std::bad_alloc();
    }
    cap_ = n;
  }
  return p_;
}

}  // namespace cpu

using cpu::Named;
using cpu::require;

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

std::string CpuBackend::name() const {
  return "cpu (fp32 reference, " + std::to_string(omp_get_max_threads()) + " OpenMP threads)";
}

// ---- memory ----

void* CpuBackend::allocate(size_t bytes) {
  size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  sizes_[p] = rounded;
  used_bytes_ += rounded;
  peak_bytes_ = std::max(peak_bytes_, used_bytes_);
  return p;
}

void CpuBackend::release(void* p) {
  if (!p) return;
  if (auto it = sizes_.find(p); it != sizes_.end()) {  // not thrown: release runs in destructors
    used_bytes_ -= it->second;
    sizes_.erase(it);
  }
  std::free(p);
}

void CpuBackend::copy_to_host(void* dst, const Tensor& src) {
  require(src.device == Device::CPU, "copy_to_host", "src is not a CPU tensor", {{"src", src}});
  if (src.bytes()) std::memcpy(dst, src.data, src.bytes());
}

void CpuBackend::copy_from_host(const Tensor& dst, const void* src) {
  require(dst.device == Device::CPU, "copy_from_host", "dst is not a CPU tensor", {{"dst", dst}});
  if (dst.bytes()) std::memcpy(dst.data, src, dst.bytes());
}

// ---- elementwise ----
// Work is cut into fixed chunks: inputs are widened to fp32, the fp32 result is computed by the
// same code whatever the dtypes, then rounded once into the output.

namespace {
constexpr int64_t kChunk = 2048;
template <class Fn>
void for_chunks(int64_t n, Fn&& fn) { cpu::for_chunks(n, kChunk, fn); }
}  // namespace

void CpuBackend::convert(const Tensor& dst, const Tensor& src) {
  const char* op = "convert";
  cpu::check_float(op, {"dst", dst});
  cpu::check_float(op, {"src", src});
  require(dst.numel() == src.numel(), op, "dst and src differ in element count", {{"dst", dst}, {"src", src}});
  if (dst.data == src.data) {
    require(dst.dtype == src.dtype, op, "in-place conversion between dtypes", {{"dst", dst}, {"src", src}});
    return;
  }
  for_chunks(dst.numel(), [&](int64_t begin, int64_t n) {
    if (dst.dtype == src.dtype) {
      std::memcpy(static_cast<char*>(dst.data) + begin * dtype_size(dst.dtype),
                  static_cast<const char*>(src.data) + begin * dtype_size(src.dtype), n * dtype_size(dst.dtype));
      return;
    }
    float buf[kChunk];
    cpu::load_f32(src, begin, n, buf);
    cpu::store_f32(dst, begin, n, buf);
  });
}

void CpuBackend::fill(const Tensor& dst, float value) {
  cpu::check_float("fill", {"dst", dst});
  for_chunks(dst.numel(), [&](int64_t begin, int64_t n) {
    float buf[kChunk];
    std::fill(buf, buf + n, value);
    cpu::store_f32(dst, begin, n, buf);
  });
}

void CpuBackend::add(const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* op = "add";
  cpu::check_float(op, {"out", out});
  cpu::check_float(op, {"a", a});
  cpu::check_float(op, {"b", b});
  require(out.numel() == a.numel() && out.numel() == b.numel(), op, "element counts differ",
          {{"out", out}, {"a", a}, {"b", b}});
  for_chunks(out.numel(), [&](int64_t begin, int64_t n) {
    float x[kChunk], y[kChunk];
    cpu::load_f32(a, begin, n, x);
    cpu::load_f32(b, begin, n, y);
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
    cpu::store_f32(out, begin, n, x);
  });
}

void CpuBackend::scale(const Tensor& x, float s) {
  cpu::check_float("scale", {"x", x});
  for_chunks(x.numel(), [&](int64_t begin, int64_t n) {
    float buf[kChunk];
    cpu::load_f32(x, begin, n, buf);
    for (int64_t i = 0; i < n; ++i) buf[i] *= s;
    cpu::store_f32(x, begin, n, buf);
  });
}

// ---- whole-tensor reductions ----
// Fixed blocks of kReduceBlock elements; each block is reduced in order (8 interleaved double
// partial sums), then the block results are summed in block order.

namespace {
constexpr int64_t kReduceBlock = 4096;

// fn(values, len) for each fixed block of x, results in block order.
template <class T, class Fn>
std::vector<T> map_blocks(const Tensor& x, Fn&& fn) {
  int64_t n = x.numel();
  int64_t nblocks = (n + kReduceBlock - 1) / kReduceBlock;
  std::vector<T> partial(static_cast<size_t>(nblocks));
#pragma omp parallel for schedule(static) if (n >= cpu::kMinParallelWork)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    int64_t begin = blk * kReduceBlock;
    int64_t len = std::min(kReduceBlock, n - begin);
    float buf[kReduceBlock];
    partial[blk] = fn(cpu::read_f32(x, begin, len, buf), len);
  }
  return partial;
}

template <bool kSquare>
double block_sum(const float* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      double v = x[i + l];
      acc[l] += kSquare ? v * v : v;
    }
  double s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (; i < n; ++i) {
    double v = x[i];
    s += kSquare ? v * v : v;
  }
  return s;
}

template <bool kSquare>
double total(const char* op, const Tensor& x) {
  cpu::check_float(op, {"x", x});
  double s = 0;
  for (double p : map_blocks<double>(x, block_sum<kSquare>)) s += p;
  return s;
}

int64_t count_if(const char* op, const Tensor& x, bool (*pred)(float)) {
  cpu::check_float(op, {"x", x});
  int64_t count = 0;
  for (int64_t c : map_blocks<int64_t>(x, [&](const float* v, int64_t n) {
         int64_t k = 0;
         for (int64_t i = 0; i < n; ++i) k += pred(v[i]);
         return k;
       }))
    count += c;
  return count;
}
}  // namespace

double CpuBackend::sum(const Tensor& x) { return total<false>("sum", x); }

double CpuBackend::sum_squares(const Tensor& x) { return total<true>("sum_squares", x); }

float CpuBackend::max_abs(const Tensor& x) {
  cpu::check_float("max_abs", {"x", x});
  // max is order independent; NaN is tracked separately because comparisons drop it.
  float best = 0;
  for (float b : map_blocks<float>(x, [](const float* v, int64_t n) {
         float m = 0;
         bool nan = false;
         for (int64_t i = 0; i < n; ++i) {
           float a = std::fabs(v[i]);
           nan |= a != a;
           m = a > m ? a : m;
         }
         return nan ? std::nanf("") : m;
       })) {
    if (std::isnan(b)) return b;
    best = std::max(best, b);
  }
  return best;
}

int64_t CpuBackend::count_nonfinite(const Tensor& x) {
  return count_if("count_nonfinite", x, [](float v) { return !std::isfinite(v); });
}

int64_t CpuBackend::count_zeros(const Tensor& x) {
  return count_if("count_zeros", x, [](float v) { return v == 0.0f; });
}

}  // namespace keel
