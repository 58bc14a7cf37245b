// Shared helpers for the CPU backend tests: host tensors that own their memory, random inputs,
// error norms and finite-difference gradients.
#pragma once

#include <catch2/catch.hpp>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "kernels/backend.h"

namespace keel::test {

// A tensor together with the host memory it views. Move-only (the view points into `storage`).
struct HostTensor {
  std::vector<uint32_t> storage;
  Tensor t;

  HostTensor(DType dtype, std::initializer_list<int64_t> shape) {
    t = Tensor(nullptr, dtype, shape);
    storage.assign((t.bytes() + 3) / 4 + 1, 0u);
    t.data = storage.data();
  }
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;
  HostTensor(const HostTensor&) = delete;

  int64_t numel() const { return t.numel(); }

  // Stores values rounded to the tensor's dtype.
  void set(const std::vector<float>& v) {
    REQUIRE(static_cast<int64_t>(v.size()) == numel());
    for (int64_t i = 0; i < numel(); ++i) put(i, v[i]);
  }
  void set_i32(const std::vector<int32_t>& v) {
    REQUIRE(t.dtype == DType::I32);
    REQUIRE(static_cast<int64_t>(v.size()) == numel());
    std::memcpy(t.data, v.data(), v.size() * 4);
  }
  void put(int64_t i, float x) {
    switch (t.dtype) {
      case DType::F32: t.as<float>()[i] = x; break;
      case DType::BF16: t.as<uint16_t>()[i] = f32_to_bf16(x); break;
      case DType::F16: t.as<uint16_t>()[i] = f32_to_f16(x); break;
      default: FAIL("put on a non-float tensor");
    }
  }
  float at(int64_t i) const {
    switch (t.dtype) {
      case DType::F32: return t.as<const float>()[i];
      case DType::BF16: return bf16_to_f32(t.as<const uint16_t>()[i]);
      case DType::F16: return f16_to_f32(t.as<const uint16_t>()[i]);
      default: return static_cast<float>(t.as<const int32_t>()[i]);
    }
  }
  std::vector<float> values() const {
    std::vector<float> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[i] = at(i);
    return v;
  }
  // Raw storage bits of element i (for bit-exact comparisons).
  uint32_t bits(int64_t i) const {
    if (dtype_size(t.dtype) == 2) return t.as<const uint16_t>()[i];
    return t.as<const uint32_t>()[i];
  }
};

// Number of elements whose stored bits differ.
inline int64_t bits_differ(const HostTensor& a, const HostTensor& b) {
  REQUIRE(a.numel() == b.numel());
  REQUIRE(a.t.dtype == b.t.dtype);
  int64_t n = 0;
  for (int64_t i = 0; i < a.numel(); ++i) n += a.bits(i) != b.bits(i);
  return n;
}

inline HostTensor make(DType dtype, std::initializer_list<int64_t> shape, const std::vector<float>& v) {
  HostTensor h(dtype, shape);
  h.set(v);
  return h;
}

// Rows [r0, r1) of a [rows, cols] host tensor as a new host tensor of the same dtype.
inline HostTensor rows_of(const HostTensor& t, int64_t r0, int64_t r1) {
  const int64_t cols = t.t.cols();
  HostTensor out(t.t.dtype, {r1 - r0, cols});
  for (int64_t i = 0; i < (r1 - r0) * cols; ++i) out.put(i, t.at(r0 * cols + i));
  return out;
}

// Document positions (kernels/document_positions.h) of B sequences of T rows cut into documents
// whose lengths are taken in turn from `lengths`: a document that would cross a sequence's end
// is cut there, and the next sequence starts with the next length.
inline std::vector<int32_t> document_positions_of(int B, int T, const std::vector<int>& lengths) {
  std::vector<int32_t> p;
  size_t k = 0;
  for (int b = 0; b < B; ++b)
    for (int t = 0, len = 0, at = 0; t < T; ++t, ++at) {
      if (at == len) len = lengths[k++ % lengths.size()], at = 0;
      p.push_back(at);
    }
  return p;
}

// Standard normal values times `scale`, from a fixed seed.
inline std::vector<float> randn(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = scale * dist(rng);
  return v;
}

// Like randn but on a grid of 2^-12, so that x +- k/32 is exact in fp32 (|x| < 2^11): the
// finite-difference steps below are then exactly the intended ones.
inline std::vector<float> randn_grid(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::vector<float> v = randn(n, seed, scale);
  for (auto& x : v) x = std::nearbyint(x * 4096.0f) / 4096.0f;
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ||out - ref|| / ||ref|| (Euclidean norms, in double)
inline double rel_error(const std::vector<float>& out, const std::vector<double>& ref) {
  REQUIRE(out.size() == ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}
inline double rel_error(const std::vector<double>& a, const std::vector<double>& ref) {
  REQUIRE(a.size() == ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// L = sum_i out_i * r_i, in double from the stored output values.
inline double dot_loss(const HostTensor& out, const std::vector<double>& r) {
  REQUIRE(static_cast<int64_t>(r.size()) == out.numel());
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += static_cast<double>(out.at(i)) * r[i];
  return s;
}

// Finite-difference steps (powers of two, so x + k h is exact for randn_grid inputs).
constexpr float kStepSmooth = 1.0f / 32.0f;  // nonlinear ops
constexpr float kStepLinear = 1.0f;          // ops linear in the perturbed input: no truncation error

// dL/dx[i] for each of the n fp32 values at x, by the fourth-order central difference
//   (-L(x+2h) + 8 L(x+h) - 8 L(x-h) + L(x-2h)) / (12 h).
// Truncation error is h^4/30 * L^(5): about 3e-8 with h = 1/32 for smooth O(1) ops, zero for
// linear ones. What remains is the fp32 rounding noise of the op's outputs (about 6e-8 relative
// per output) amplified by 1.5/h: that sets the tolerances of the gradient tests, not the
// observed errors. Inputs should come from randn_grid so that every x + k h is exact.
inline std::vector<double> numeric_grad(float* x, int64_t n, const std::function<double()>& loss, float h) {
  std::vector<double> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float orig = x[i];
    double l[4];
    const float steps[4] = {2 * h, h, -h, -2 * h};
    for (int s = 0; s < 4; ++s) {
      x[i] = orig + steps[s];
      l[s] = loss();
    }
    x[i] = orig;
    g[i] = (-l[0] + 8 * l[1] - 8 * l[2] + l[3]) / (12.0 * h);
  }
  return g;
}

// Runs fn with omp_set_num_threads(n), restoring the previous setting even if fn throws.
template <class Fn>
void with_threads(int n, Fn&& fn) {
  struct Restore {
    int before = omp_get_max_threads();
    ~Restore() { omp_set_num_threads(before); }
  } restore;
  omp_set_num_threads(n);
  fn();
}

}  // namespace keel::test
