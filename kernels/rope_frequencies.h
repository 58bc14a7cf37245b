// RoPE's rotation frequencies and cos/sin tables, computed on the host once for every backend
// (the CPU reference and the CUDA tables must be the same bits).
//
// Hugging Face Llama's fp32 recipe: inv_freq[i] = 1 / theta^(float(2i) / hd) in fp32 (the power
// computed in double and rounded; PyTorch's own pow is within 1 ulp of that), angle =
// float(pos) * inv_freq[i] in fp32, cos and sin of that angle computed in double and rounded.
//
// Llama 3.1's frequency scaling ("rope_type": "llama3", used by Llama 3.1 and 3.2): with
// L = original_max_position_embeddings, each frequency's wavelength w = 2 pi / inv_freq decides
//   w < L / high_freq_factor  (high frequencies):  kept,
//   w > L / low_freq_factor   (low frequencies):   divided by factor,
//   in between:  (1 - s) inv_freq / factor + s inv_freq,  s = (L / w - low) / (high - low),
// each step rounded to fp32 in HF's order, so converted Llama 3.x weights see the rotations they
// were trained with.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace keel {

struct RopeScaling {
  enum class Kind { None, Llama3 };
  Kind kind = Kind::None;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;

  bool operator==(const RopeScaling&) const = default;
};

// A plain theta is the unscaled RoPE; theta <= 0 means no rotation (GPT-2's learned positions).
struct Rope {
  float theta = 0.0f;
  RopeScaling scaling;

  Rope() = default;
  Rope(float theta_) : theta(theta_) {}  // NOLINT(google-explicit-constructor): a bare theta is a Rope
  Rope(float theta_, const RopeScaling& s) : theta(theta_), scaling(s) {}
  bool rotates() const { return theta > 0.0f; }
  bool operator==(const Rope&) const = default;
  std::string str() const;  // "theta 500000, llama3 scaling (factor 32, ...)"
};

// inv_freq[i], i < head_dim / 2.
std::vector<float> rope_inv_freq(int head_dim, const Rope& rope);
// cos_sin[(p * half + i) * 2 + {0, 1}] for positions first .. first + n - 1.
std::vector<float> rope_cos_sin(const std::vector<float>& inv_freq, int64_t first, int64_t n);

// What identifies the table of positions [0, T): the backends build it once per key and keep it,
// so a training step looks it up instead of computing T x head_dim/2 cosines per call.
using RopeTableKey = std::tuple<int64_t, int, float, RopeScaling::Kind, double, double, double, int64_t>;
RopeTableKey rope_table_key(int64_t T, int head_dim, const Rope& rope);

}  // namespace keel
