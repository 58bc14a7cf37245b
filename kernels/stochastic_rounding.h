// Stochastic rounding of fp32 to bf16, shared by the CPU and CUDA backends so both produce the
// same bits.
//
// bf16 keeps the top 16 bits of an fp32. Adding a uniform random 16-bit number r to the low 16
// bits and truncating rounds up with probability (low bits) / 2^16, i.e. the distance from the
// lower bf16 neighbour over the spacing: E[round(x)] = x, so updates far below the spacing
// (seed 002's 1e-4 on a norm gain at 1.0, where bf16 spacing is 2^-7) are kept in expectation
// instead of lost every time as with round-to-nearest.
//
// r comes from a counter-based hash of (seed, step, index) (SplitMix64's finaliser over a
// Weyl-style mix of the three), so a run is reproducible and a resume continues the same stream.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace keel {

KEEL_HOST_DEVICE uint32_t rounding_bits(uint64_t seed, uint64_t step, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1) + 0xD1B54A32D192ED03ull * (step + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z);
}

// The bf16 bits of fp32 bits `u` rounded with randomness `random` (its low 16 bits are used).
// Finite values only: the caller rounds inf and NaN to nearest. A value within one spacing of
// the largest bf16 may round up to inf, as it may under round-to-nearest.
KEEL_HOST_DEVICE uint16_t bf16_bits_stochastic(uint32_t u, uint32_t random) {
  return static_cast<uint16_t>((u + (random & 0xffffu)) >> 16);
}

}  // namespace keel
