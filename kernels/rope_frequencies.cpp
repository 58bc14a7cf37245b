#include "kernels/rope_frequencies.h"

#include <cmath>
#include <cstdio>

#include "kernels/fp_contract_off.h"  // last: no fused multiply-add below

namespace keel {

std::string Rope::str() const {
  char buf[200];
  if (scaling.kind == RopeScaling::Kind::None) {
    std::snprintf(buf, sizeof buf, "theta %g", static_cast<double>(theta));
  } else {
    std::snprintf(buf, sizeof buf, "theta %g, llama3 scaling (factor %g, low_freq_factor %g, high_freq_factor %g, "
                  "original_max_position_embeddings %lld)", static_cast<double>(theta), scaling.factor,
                  scaling.low_freq_factor, scaling.high_freq_factor, static_cast<long long>(scaling.original_max_position));
  }
  return buf;
}

std::vector<float> rope_inv_freq(int head_dim, const Rope& rope) {
  const int half = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float power = static_cast<float>(std::pow(static_cast<double>(rope.theta), static_cast<double>(exponent)));
    inv_freq[static_cast<size_t>(i)] = 1.0f / power;
  }
  if (rope.scaling.kind != RopeScaling::Kind::Llama3) return inv_freq;
  // HF's tensor ops are fp32 with the Python scalars rounded to fp32; the two wavelength
  // bounds are compared in fp32 too.
  const RopeScaling& s = rope.scaling;
  const float factor = static_cast<float>(s.factor), low = static_cast<float>(s.low_freq_factor);
  const float context = static_cast<float>(s.original_max_position);
  const float low_wavelen = static_cast<float>(static_cast<double>(s.original_max_position) / s.low_freq_factor);
  const float high_wavelen = static_cast<float>(static_cast<double>(s.original_max_position) / s.high_freq_factor);
  const float band = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  const float two_pi = static_cast<float>(2.0 * M_PI);
  for (float& f : inv_freq) {
    const float wavelen = two_pi / f;
    const float scaled = wavelen > low_wavelen ? f / factor : f;
    if (wavelen < high_wavelen || wavelen > low_wavelen) {
      f = scaled;
      continue;
    }
    const float smooth = (context / wavelen - low) / band;
    f = (1.0f - smooth) * scaled / factor + smooth * scaled;
  }
  return inv_freq;
}

RopeTableKey rope_table_key(int64_t T, int head_dim, const Rope& rope) {
  const RopeScaling& s = rope.scaling;
  return {T, head_dim, rope.theta, s.kind, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position};
}

std::vector<float> rope_cos_sin(const std::vector<float>& inv_freq, int64_t first, int64_t n) {
  const size_t half = inv_freq.size();
  std::vector<float> table(static_cast<size_t>(n) * half * 2);
  for (int64_t p = 0; p < n; ++p)
    for (size_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(first + p) * inv_freq[i];  // one fp32 product
      table[(static_cast<size_t>(p) * half + i) * 2] = static_cast<float>(std::cos(static_cast<double>(angle)));
      table[(static_cast<size_t>(p) * half + i) * 2 + 1] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  return table;
}

}  // namespace keel
