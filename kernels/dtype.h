// Storage formats and their bit-exact conversions.
//
// Arithmetic in keel is always fp32; bf16 and fp16 are *storage* formats. The conversions
// below are round-to-nearest-even, exactly as the GPU's cvt.rn does, so the CPU backend can
// reproduce what a bf16 or fp16 run does to values (e.g. a norm gain at 1.0 that cannot move
// by 1e-4 in bf16, whose spacing at 1.0 is 2^-7; an fp16 value above 65504 becoming inf).
#pragma once

#include <bit>
#include <cstdint>
#include <string_view>

namespace keel {

enum class DType : uint8_t { F32, BF16, F16, I32 };

constexpr size_t dtype_size(DType t) { return t == DType::BF16 || t == DType::F16 ? 2 : 4; }

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
  }
  return "?";
}

// The bits a NaN with fp32 bits u gets in bf16 (its top bits, quiet bit forced so that the
// truncation cannot turn it into inf) and in fp16 (sign | 0x7e00). The CUDA kernels store NaNs
// with these too (cuda_common.cuh), so NaNs compare bit-equal across backends.
constexpr uint16_t bf16_nan_bits(uint32_t u) { return static_cast<uint16_t>((u >> 16) | 0x40u); }
constexpr uint16_t f16_nan_bits(uint32_t u) { return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u); }

// bf16 keeps the top 16 bits of an fp32; rounding adds 0x7fff plus the lowest kept bit
// (ties to even).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_nan_bits(u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Largest finite 65504; values from
// 65520 up round to inf (65520 is the tie between 65504 and 2^16, and 65504's mantissa is odd).
// Subnormals have a unit of 2^-24.
inline uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return f16_nan_bits(x);
  if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax >= 0x38800000u) {  // normal in fp16: rebias exponent 127 -> 15, round mantissa 23 -> 10 bits
    uint32_t v = (ax + 0xfffu + ((ax >> 13) & 1u)) >> 13;
    return static_cast<uint16_t>(sign | (v - ((127u - 15u) << 10)));
  }
  if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // below 2^-25 (or the tie at it): zero
  // Subnormal: value = mant24 * 2^(e-150); in units of 2^-24 that is mant24 >> (126 - e).
  uint32_t e = ax >> 23;
  uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e;
  uint32_t q = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  // subnormal (or zero): mant * 2^-24, exact in fp32
  float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

// Value of `f` after a round trip through the storage format `t` (identity for f32).
inline float round_to(DType t, float f) {
  switch (t) {
    case DType::BF16: return bf16_to_f32(f32_to_bf16(f));
    case DType::F16: return f16_to_f32(f32_to_f16(f));
    default: return f;
  }
}

// Largest finite value of a float format (for overflow headroom reports).
constexpr float dtype_max(DType t) {
  switch (t) {
    case DType::BF16: return 3.3895313892515355e38f;
    case DType::F16: return 65504.0f;
    default: return 3.4028234663852886e38f;
  }
}

}  // namespace keel
