// The elementwise ops of the update IR on Highway vectors. One definition,
// used by the fused template evaluator and by the blocked interpreter, so the
// two paths are bitwise identical. Re-included per target; no include guard.
//
// Every op is IEEE-exact and behaves the same on every target (max/min and
// sign are written with compares so NaN and signed-zero handling do not depend
// on the instruction set). fma is a true fused multiply-add only where the
// target has one (not on SSE4/SSSE3), so built-in programs do not use it.

#if defined(STEPFUSE_CPU_VECTOR_OPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STEPFUSE_CPU_VECTOR_OPS_INL_H_
#undef STEPFUSE_CPU_VECTOR_OPS_INL_H_
#else
#define STEPFUSE_CPU_VECTOR_OPS_INL_H_
#endif

#include "hwy/highway.h"
#include "runtime/cpu/convert-inl.h"
#include "stepfuse/program.hpp"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <Op kOp, std::uint8_t kAttr, class D, class V>
HWY_INLINE V Unary(D d, V a) {
  if constexpr (kOp == Op::neg) return hn::Neg(a);
  else if constexpr (kOp == Op::abs) return hn::Abs(a);
  else if constexpr (kOp == Op::sqrt) return hn::Sqrt(a);
  else if constexpr (kOp == Op::sign) {
    const V one_signed = hn::CopySignToAbs(hn::Set(d, 1.0f), a);
    const V zero_or_one = hn::IfThenZeroElse(hn::Eq(a, hn::Zero(d)), one_signed);
    return hn::IfThenElse(hn::IsNaN(a), a, zero_or_one);
  } else {
    static_assert(kOp == Op::convert, "unary op");
    return RoundTo<static_cast<DType>(kAttr)>(d, a);
  }
}

template <Op kOp, class D, class V>
HWY_INLINE V Binary(D d, V a, V b) {
  if constexpr (kOp == Op::add) return hn::Add(a, b);
  else if constexpr (kOp == Op::sub) return hn::Sub(a, b);
  else if constexpr (kOp == Op::mul) return hn::Mul(a, b);
  else if constexpr (kOp == Op::div) return hn::Div(a, b);
  else if constexpr (kOp == Op::max) return hn::IfThenElse(hn::Lt(a, b), b, a);
  else if constexpr (kOp == Op::min) return hn::IfThenElse(hn::Lt(b, a), b, a);
  else if constexpr (kOp == Op::cmp_lt) return hn::IfThenElseZero(hn::Lt(a, b), hn::Set(d, 1.0f));
  else if constexpr (kOp == Op::cmp_le) return hn::IfThenElseZero(hn::Le(a, b), hn::Set(d, 1.0f));
  else {
    static_assert(kOp == Op::cmp_eq, "binary op");
    return hn::IfThenElseZero(hn::Eq(a, b), hn::Set(d, 1.0f));
  }
}

template <Op kOp, class D, class V>
HWY_INLINE V Ternary(D d, V a, V b, V c) {
  if constexpr (kOp == Op::fma) return hn::MulAdd(a, b, c);
  else {
    static_assert(kOp == Op::select, "ternary op");
    // a != 0 ? b : c, a NaN selecting b as in C. Written with Eq: Highway's Ne is an
    // ordered compare on AVX2/AVX3 (NaN != 0 is false there) but not on SSE4/scalar.
    return hn::IfThenElse(hn::Eq(a, hn::Zero(d)), c, b);
  }
}

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // STEPFUSE_CPU_VECTOR_OPS_INL_H_
