// Loads and stores of f32/f16/bf16 streams as fp32 vectors, with exact
// widening and round-to-nearest-even narrowing on every Highway target.
//
// Highway 1.0.3's own f32->bf16 DemoteTo truncates and its f32->f16 DemoteTo
// is wrong on SSE4/SSSE3/EMU128, so both directions are written here with
// integer and IEEE fp32 operations that behave the same on every target.
// Re-included once per target (foreach_target); no include guard on purpose.

#if defined(STEPFUSE_CPU_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STEPFUSE_CPU_CONVERT_INL_H_
#undef STEPFUSE_CPU_CONVERT_INL_H_
#else
#define STEPFUSE_CPU_CONVERT_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "stepfuse/types.hpp"

// Whether this CPU converts f32 to bf16 itself (AVX512_BF16's vcvtneps2bf16: Zen 4,
// Cooper Lake, Sapphire Rapids). No Highway 1.0.3 target implies it, so the AVX-512
// targets test it at run time (once: a const the loops hoist).
#ifndef STEPFUSE_CPU_CONVERT_SHARED_
#define STEPFUSE_CPU_CONVERT_SHARED_
namespace stepfuse::cpu {
#if HWY_ARCH_X86 && (defined(__GNUC__) || defined(__clang__))
inline const bool kCpuHasAvx512Bf16 = __builtin_cpu_supports("avx512bf16");
#else
inline const bool kCpuHasAvx512Bf16 = false;
#endif
}  // namespace stepfuse::cpu
#endif  // STEPFUSE_CPU_CONVERT_SHARED_

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// bf16 bits -> f32: exact (bf16 is the upper half of an f32).
template <class D>
HWY_INLINE hn::Vec<D> WidenBf16(D d, hn::Vec<hn::RebindToUnsigned<D>> h) {
  return hn::BitCast(d, hn::ShiftLeft<16>(h));
}

// f16 bits -> f32: exact for normals, subnormals, infinities and NaNs.
template <class D>
HWY_INLINE hn::Vec<D> WidenF16(D d, hn::Vec<hn::RebindToUnsigned<D>> h) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const auto em = hn::And(h, hn::Set(du, 0x7FFFu));
  const auto shifted = hn::ShiftLeft<13>(em);
  // Exponent rebias by multiplying by 2^112: exact, and turns f16 subnormals
  // (which land on f32 subnormals) into the right f32 normals.
  const auto finite = hn::Mul(hn::BitCast(d, shifted), hn::Set(d, 0x1.0p112f));
  const auto inf_nan = hn::BitCast(d, hn::Or(shifted, hn::Set(du, 0x7F800000u)));
  const auto is_inf_nan = hn::RebindMask(d, hn::Gt(hn::BitCast(di, em), hn::Set(di, 0x7BFF)));
  return hn::Or(hn::IfThenElse(is_inf_nan, inf_nan, finite), hn::BitCast(d, sign));
}

// f32 -> bf16 bits, round to nearest even; NaN stays (quiet) NaN, inf stays inf.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> NarrowBf16(D /*d*/, hn::Vec<D> v) {
  const hn::RebindToUnsigned<D> du;
  const auto u = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7FFFu), lsb)));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
}

// f32 -> f16 bits, round to nearest even (overflow -> inf, NaN -> 0x7E00 with sign).
// The rounding is done by one IEEE fp32 addition of a power of two that aligns
// the f16 mantissa's last bit with the f32 mantissa's last bit.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> NarrowF16(D d, hn::Vec<D> v) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const auto w = hn::BitCast(du, v);
  // |v| * 2^112 * 2^-110: saturates to inf exactly where f16 overflows.
  auto base = hn::Mul(hn::Mul(hn::Abs(v), hn::Set(d, 0x1.0p112f)), hn::Set(d, 0x1.0p-110f));
  const auto exp_w = hn::BitCast(di, hn::And(w, hn::Set(du, 0x7F800000u)));
  const auto bias = hn::Add(hn::Max(exp_w, hn::Set(di, 0x38800000)), hn::Set(di, 0x07800000));
  base = hn::Add(hn::BitCast(d, bias), base);
  const auto bits = hn::BitCast(du, base);
  const auto exp_bits = hn::And(hn::ShiftRight<13>(bits), hn::Set(du, 0x7C00u));
  const auto mantissa_bits = hn::And(bits, hn::Set(du, 0x0FFFu));
  const auto nonsign = hn::Add(exp_bits, mantissa_bits);
  const auto magnitude = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), hn::Set(du, 0x7E00u), nonsign);
  return hn::Or(magnitude, hn::ShiftRight<16>(hn::And(w, hn::Set(du, 0x80000000u))));
}

// Loads Lanes(d) elements of a stream stored as T, starting at element i, as fp32.
template <DType T, class D>
HWY_INLINE hn::Vec<D> LoadAs(D d, const void* base, std::size_t i) {
  if constexpr (T == DType::f32) {
    return hn::LoadU(d, static_cast<const float*>(base) + i);
  } else {
    const hn::RebindToUnsigned<D> du;
    const hn::Rebind<std::uint16_t, D> d16;
    const auto h = hn::PromoteTo(du, hn::LoadU(d16, static_cast<const std::uint16_t*>(base) + i));
    if constexpr (T == DType::bf16) return WidenBf16(d, h);
    else return WidenF16(d, h);
  }
}

// Stores Lanes(d) fp32 values as T (rounded to nearest even) at element i.
template <DType T, class D>
HWY_INLINE void StoreAs(D d, hn::Vec<D> v, void* base, std::size_t i) {
  if constexpr (T == DType::f32) {
    hn::StoreU(v, d, static_cast<float*>(base) + i);
  } else {
#if HWY_TARGET <= HWY_AVX3
    // vcvtneps2bf16 rounds to nearest even and quiets NaNs as NarrowBf16 does (checked
    // on all 2^32 floats), in one instruction instead of nine, but reads subnormal
    // inputs as zero: a vector with one takes NarrowBf16. (Inline assembly: the
    // AVX3 targets are compiled without AVX512_BF16.)
    if constexpr (T == DType::bf16 && hn::MaxLanes(d) == 16) {
      if (kCpuHasAvx512Bf16 && _mm512_fpclass_ps_mask(v.raw, 0x20) == 0) {  // 0x20: subnormal
        __m256i h;
        asm("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(v.raw));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i), h);
        return;
      }
    }
#endif
    const hn::Rebind<std::uint16_t, D> d16;
    const hn::RebindToSigned<D> di;
    const auto bits = T == DType::bf16 ? NarrowBf16(d, v) : NarrowF16(d, v);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, bits)), d16, static_cast<std::uint16_t*>(base) + i);
  }
}

// v rounded to T and widened back (the IR's convert op).
template <DType T, class D>
HWY_INLINE hn::Vec<D> RoundTo(D d, hn::Vec<D> v) {
  if constexpr (T == DType::f32) return v;
  else if constexpr (T == DType::bf16) return WidenBf16(d, NarrowBf16(d, v));
  else return WidenF16(d, NarrowF16(d, v));
}

// Compensated bf16 weights (docs/low-precision.md): the parameter is the bf16
// weight plus its bf16 compensation, one fp32 addition.
template <class D>
HWY_INLINE hn::Vec<D> LoadCompensated(D d, const void* weight, const void* comp, std::size_t i) {
  return hn::Add(LoadAs<DType::bf16>(d, weight, i), LoadAs<DType::bf16>(d, comp, i));
}

// Stores the parameter v as the bf16 weight nearest it and, as the compensation,
// the rest (v - weight, exact in fp32) rounded to the nearest bf16; where the
// weight is not finite (v is inf or NaN, or overflows bf16) the compensation is 0.
template <class D>
HWY_INLINE void StoreCompensated(D d, hn::Vec<D> v, void* weight, void* comp, std::size_t i) {
  const hn::Rebind<std::uint16_t, D> d16;
  const hn::RebindToSigned<D> di;
  const auto hi = NarrowBf16(d, v);
  const auto rest = hn::Sub(v, WidenBf16(d, hi));
  const auto lo = NarrowBf16(d, hn::IfThenElseZero(hn::IsFinite(rest), rest));
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, hi)), d16, static_cast<std::uint16_t*>(weight) + i);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, lo)), d16, static_cast<std::uint16_t*>(comp) + i);
}

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // STEPFUSE_CPU_CONVERT_INL_H_
