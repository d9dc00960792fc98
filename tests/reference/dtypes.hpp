// Bit-exact f16/bf16/f32 conversions for the tests, written independently of the library.
//
// Everything here is plain scalar double arithmetic on the IEEE definitions of the
// formats, so the tests can check the library's own conversions against it.
// Rounding is to nearest, ties to even, directly from double (no double rounding
// through float), with gradual underflow, overflow to infinity, and inf/NaN kept.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "stepfuse/types.hpp"

namespace stepfuse::ref {

// A binary floating-point format: `precision` significand bits counting the
// implicit leading one, normal exponents in [emin, emax].
struct FloatFormat {
  int precision;
  int emin;
  int emax;
};
inline constexpr FloatFormat kF16Format{11, -14, 15};
inline constexpr FloatFormat kBF16Format{8, -126, 127};
inline constexpr FloatFormat kF32Format{24, -126, 127};

constexpr FloatFormat format_of(DType t) {
  return t == DType::f32 ? kF32Format : t == DType::f16 ? kF16Format : kBF16Format;
}

// The largest finite value of a format.
inline double max_finite(FloatFormat f) {
  return std::ldexp(2.0 - std::ldexp(1.0, 1 - f.precision), f.emax);
}

// x rounded to the nearest value of format `f`, ties to even, as a double.
// Overflow gives +-inf, NaN and inf pass through, zero keeps its sign.
inline double round_to_format(double x, FloatFormat f) {
  if (!std::isfinite(x) || x == 0) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| = m * 2^e with m in [0.5, 1): the leading bit weighs 2^(e-1)
  const int lead = std::max(e - 1, f.emin);  // below emin the spacing stays that of emin
  const double quantum = std::ldexp(1.0, lead - (f.precision - 1));
  // x / quantum and the product back are exact (power-of-two scalings, far from
  // double's own range limits); nearbyint rounds ties to even in the default mode.
  const double r = std::nearbyint(x / quantum) * quantum;
  if (std::fabs(r) > max_finite(f)) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r == 0 ? std::copysign(0.0, x) : r;
}

inline double round_to_dtype(double x, DType t) { return round_to_format(x, format_of(t)); }

// ---- bit patterns -----------------------------------------------------------

inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float float_from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// bf16 is the top half of an f32: same exponent range, 8-bit significand.
inline std::uint16_t bf16_bits(double x) {
  const double r = round_to_format(x, kBF16Format);
  if (std::isnan(r)) return std::signbit(r) ? 0xFFC0 : 0x7FC0;
  return static_cast<std::uint16_t>(float_bits(static_cast<float>(r)) >> 16);  // r is exact in f32
}
inline double bf16_value(std::uint16_t b) { return float_from_bits(std::uint32_t{b} << 16); }

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 fraction bits.
inline std::uint16_t f16_bits(double x) {
  const double r = round_to_format(x, kF16Format);
  const std::uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  if (std::isnan(r)) return sign | 0x7E00;
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14))  // zero or subnormal: a = fraction * 2^-24, fraction exact
    return sign | static_cast<std::uint16_t>(std::ldexp(a, 24));
  int e = 0;
  std::frexp(a, &e);
  const int exponent = e - 1;  // a in [2^exponent, 2^(exponent+1))
  const auto fraction = static_cast<std::uint16_t>(std::ldexp(a, 10 - exponent) - 1024.0);
  return sign | static_cast<std::uint16_t>((exponent + 15) << 10) | fraction;
}
inline double f16_value(std::uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int exponent = (h >> 10) & 0x1F;
  const int fraction = h & 0x3FF;
  if (exponent == 0) return sign * std::ldexp(fraction, -24);
  if (exponent == 31)
    return fraction != 0 ? std::numeric_limits<double>::quiet_NaN()
                         : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(1024 + fraction, exponent - 25);
}

// The 16-bit pattern of x correctly rounded to t (f16 or bf16).
inline std::uint16_t bits16(double x, DType t) { return t == DType::f16 ? f16_bits(x) : bf16_bits(x); }
inline double value16(std::uint16_t b, DType t) { return t == DType::f16 ? f16_value(b) : bf16_value(b); }

// Distance in units in the last place between two 16-bit patterns of the same
// format (adjacent representable values are 1 apart; +0 and -0 are 0 apart).
// NaN against anything but NaN is "infinitely" far.
inline std::int64_t ulp_distance16(std::uint16_t a, std::uint16_t b, DType t) {
  const bool na = std::isnan(value16(a, t)), nb = std::isnan(value16(b, t));
  if (na || nb) return na && nb ? 0 : std::numeric_limits<std::int64_t>::max();
  auto ordered = [](std::uint16_t v) -> std::int64_t {
    return (v & 0x8000) ? -static_cast<std::int64_t>(v & 0x7FFF) : static_cast<std::int64_t>(v);
  };
  return std::llabs(ordered(a) - ordered(b));
}

// ---- element access through a TensorView ----------------------------------

// Element i of a tensor, converted exactly to double.
inline double load(const TensorView& t, std::int64_t i) {
  if (t.dtype == DType::f32) {
    float x;
    std::memcpy(&x, static_cast<const char*>(t.data) + 4 * i, 4);
    return x;
  }
  std::uint16_t b;
  std::memcpy(&b, static_cast<const char*>(t.data) + 2 * i, 2);
  return value16(b, t.dtype);
}

// Stores x correctly rounded to the tensor's dtype.
inline void store(const TensorView& t, std::int64_t i, double x) {
  if (t.dtype == DType::f32) {
    const float f = static_cast<float>(x);  // double -> float rounds to nearest even
    std::memcpy(static_cast<char*>(t.data) + 4 * i, &f, 4);
    return;
  }
  const std::uint16_t b = bits16(x, t.dtype);
  std::memcpy(static_cast<char*>(t.data) + 2 * i, &b, 2);
}

// The raw 16-bit pattern of element i of an f16/bf16 tensor.
inline std::uint16_t load_bits16(const TensorView& t, std::int64_t i) {
  std::uint16_t b;
  std::memcpy(&b, static_cast<const char*>(t.data) + 2 * i, 2);
  return b;
}

}  // namespace stepfuse::ref
