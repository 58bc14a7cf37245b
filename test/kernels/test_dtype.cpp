// kernels/dtype.h: bf16 and fp16 conversions are round-to-nearest-even, bit for bit.
//
// References: (1) an independent rounding written with double arithmetic (scale by the ulp,
// floor, compare the remainder with one half); (2) GCC's _Float16 conversion where the compiler
// has it. The default run checks a dense structured sample (every sign/exponent/kept-mantissa
// pattern times the dropped-bit patterns that decide rounding: 0, 1, just below/at/above the
// half, all ones, and random ones); "[exhaustive]" checks all 2^32 floats (~6 s on 2 cores).
#include <bit>
#include <cmath>
#include <limits>

#include "kernel_test_util.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

using namespace keel;

namespace {

// Round x (finite) to a binary format with p significant bits, minimum normal exponent emin and
// largest finite value max_finite; ties to even; overflow to infinity.
double reference_round(double x, int p, int emin, double max_finite) {
  if (x == 0) return x;
  int e2;
  std::frexp(x, &e2);                                      // |x| = m 2^e2, m in [0.5, 1)
  const int e = std::max(e2 - 1, emin);                    // exponent of the leading bit (clamped: subnormals)
  const double ulp = std::ldexp(1.0, e - (p - 1));
  const double q = std::fabs(x) / ulp;                     // exact: division by a power of two
  double whole = std::floor(q);
  const double rem = q - whole;                            // exact
  if (rem > 0.5 || (rem == 0.5 && std::fmod(whole, 2.0) == 1.0)) whole += 1;
  double r = whole * ulp;
  if (r > max_finite) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

double ref_bf16(float f) { return reference_round(f, 8, -126, 3.3895313892515355e38); }
double ref_f16(float f) { return reference_round(f, 11, -14, 65504.0); }

bool is_f16_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool is_bf16_nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }

// Checks one float against both references; returns false on a mismatch.
bool conversions_ok(uint32_t u) {
  const float f = std::bit_cast<float>(u);
  const uint16_t b = f32_to_bf16(f), h = f32_to_f16(f);
  if (std::isnan(f)) return is_bf16_nan(b) && is_f16_nan(h);
  const double rb = ref_bf16(f), rh = ref_f16(f);
  const double gb = bf16_to_f32(b), gh = f16_to_f32(h);
  if (gb != rb || std::signbit(gb) != std::signbit(rb)) return false;
  if (gh != rh || std::signbit(gh) != std::signbit(rh)) return false;
#ifdef __FLT16_MAX__
  if (std::bit_cast<uint16_t>(static_cast<_Float16>(f)) != h) return false;
#endif
  return true;
}

}  // namespace

TEST_CASE("fp16 and bf16 boundary cases", "[dtype]") {
  // fp16: 65504 is the largest finite value; 65520 is the tie with 2^16 and rounds up to inf
  CHECK(f32_to_f16(65504.0f) == 0x7bff);
  CHECK(f32_to_f16(65519.99f) == 0x7bff);
  CHECK(f32_to_f16(65520.0f) == 0x7c00);
  CHECK(f32_to_f16(-65520.0f) == 0xfc00);
  CHECK(f32_to_f16(1e6f) == 0x7c00);
  CHECK(f32_to_f16(INFINITY) == 0x7c00);
  CHECK(f32_to_f16(-INFINITY) == 0xfc00);
  // subnormals: unit 2^-24; 2^-25 is the tie between 0 and 2^-24 (0 is even)
  CHECK(f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);
  CHECK(f32_to_f16(-std::ldexp(1.0f, -25)) == 0x8000);
  CHECK(f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(f32_to_f16(3 * std::ldexp(1.0f, -25)) == 0x0002);  // tie between 1 and 2 units: 2
  CHECK(f32_to_f16(std::ldexp(1.0f, -14)) == 0x0400);      // smallest normal
  CHECK(f32_to_f16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)) == 0x0400);  // tie 0x3ff/0x400
  CHECK(f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);      // tie, even
  CHECK(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // tie, even
  CHECK(is_f16_nan(f32_to_f16(NAN)));
  CHECK(is_f16_nan(f32_to_f16(std::bit_cast<float>(0x7f800001u))));  // payload only in dropped bits
  CHECK(f16_to_f32(0x7bff) == 65504.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));

  // bf16: spacing at 1.0 is 2^-7, so a 1e-4 step is lost
  CHECK(bf16_to_f32(0x3f81) - 1.0f == std::ldexp(1.0f, -7));
  CHECK(f32_to_bf16(1.0f + 1e-4f) == 0x3f80);
  CHECK(round_to(DType::BF16, 1.0f - 1e-4f) == 1.0f);
  CHECK(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);      // tie, even
  CHECK(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);  // tie, even
  CHECK(f32_to_bf16(3.4028234663852886e38f) == 0x7f80);            // above max + half ulp: inf
  CHECK(f32_to_bf16(3.3895313892515355e38f) == 0x7f7f);
  CHECK(is_bf16_nan(f32_to_bf16(NAN)));
  CHECK(is_bf16_nan(f32_to_bf16(std::bit_cast<float>(0x7f800001u))));  // must not become inf
  CHECK(is_bf16_nan(f32_to_bf16(std::bit_cast<float>(0xff80ffffu))));
}

TEST_CASE("f32 -> bf16/fp16 rounding matches references on a dense sample", "[dtype]") {
  // For fp16 the kept bits of a normal value are the top 10 mantissa bits and the dropped ones the
  // low 13; for bf16 the low 16. The low patterns cover: exact, +1, below half, half, above half,
  // all ones, plus random ones. Every high pattern (sign, exponent, kept mantissa) is swept, which
  // also covers subnormal fp16 (whose rounding point lies in the high bits).
  const uint32_t low13[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x0a5b, 0x1c37};
  const uint32_t low16[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x3a5b, 0xc9e1};
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (int64_t high = 0; high < (int64_t{1} << 19); ++high)
    for (uint32_t lo : low13) bad += !conversions_ok((static_cast<uint32_t>(high) << 13) | lo);
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (int64_t high = 0; high < (int64_t{1} << 16); ++high)
    for (uint32_t lo : low16) bad += !conversions_ok((static_cast<uint32_t>(high) << 16) | lo);
  CHECK(bad == 0);
}

TEST_CASE("f16 -> f32 is exact for all 65536 patterns and round-trips", "[dtype]") {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = f16_to_f32(bits);
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0x1f) {
      bad += m ? !std::isnan(f) : (f != sign * INFINITY);
      if (m) bad += !is_f16_nan(f32_to_f16(f));
      continue;
    }
    // value = (-1)^s 2^(e-15) (1 + m/1024), or 2^-14 (m/1024) for e == 0
    const double expect = e ? sign * std::ldexp(1.0 + m / 1024.0, static_cast<int>(e) - 15)
                            : sign * std::ldexp(m / 1024.0, -14);
    bad += static_cast<double>(f) != expect || std::signbit(f) != (sign < 0);
    bad += f32_to_f16(f) != bits;
#ifdef __FLT16_MAX__
    bad += std::bit_cast<uint32_t>(static_cast<float>(std::bit_cast<_Float16>(bits))) != std::bit_cast<uint32_t>(f);
#endif
  }
  CHECK(bad == 0);
  // bf16 -> f32 is the upper half of the fp32 pattern
  for (uint32_t h = 0; h < 65536; h += 97) CHECK(std::bit_cast<uint32_t>(bf16_to_f32(static_cast<uint16_t>(h))) == h << 16);
}

#if defined(__x86_64__) && defined(__GNUC__)
namespace {
// fp16 of 8 consecutive patterns with the CPU's converter (F16C, round to nearest even).
__attribute__((target("avx,f16c"))) void hardware_f16(const uint32_t* in, uint16_t* out) {
  __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(reinterpret_cast<const float*>(in)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
}
}  // namespace
#endif

// All 2^32 patterns: fp16 against the hardware converter (where present), bf16 against the
// double-arithmetic reference for non-NaN inputs (~6 s on 2 cores; alone:
// `test_kernels "[exhaustive]"`).
TEST_CASE("f32 -> bf16/fp16 rounding over all 2^32 floats", "[exhaustive][dtype]") {
  int64_t bad = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  const bool have_f16c = __builtin_cpu_supports("f16c");
#else
  const bool have_f16c = false;
#endif
#pragma omp parallel for reduction(+ : bad) schedule(dynamic, 64)
  for (int64_t high = 0; high < 65536; ++high) {
    for (uint32_t lo = 0; lo < 65536; lo += 8) {
      uint32_t in[8];
      uint16_t hw[8];
      for (int l = 0; l < 8; ++l) in[l] = (static_cast<uint32_t>(high) << 16) | (lo + l);
#if defined(__x86_64__) && defined(__GNUC__)
      if (have_f16c) hardware_f16(in, hw);
#endif
      for (int l = 0; l < 8; ++l) {
        const float f = std::bit_cast<float>(in[l]);
        const uint16_t h = f32_to_f16(f), b = f32_to_bf16(f);
        if (std::isnan(f)) {
          bad += !is_f16_nan(h) || !is_bf16_nan(b);
          continue;
        }
        if (have_f16c) {
          bad += h != hw[l];
        } else {
          const double r = ref_f16(f);
          bad += f16_to_f32(h) != r || std::signbit(f16_to_f32(h)) != std::signbit(r);
        }
        // bf16: round up exactly when the dropped half is above 0x8000, or at it with an odd kept part
        const uint32_t kept = in[l] >> 16, dropped = in[l] & 0xffff;
        const uint32_t expect = kept + (dropped > 0x8000 || (dropped == 0x8000 && (kept & 1)));
        bad += b != static_cast<uint16_t>(expect);
      }
    }
  }
  CHECK(bad == 0);
}
