// The reduce pass: non-finite flag and sum of squares (or max |g|) of one chunk
// of gradients, in the canonical order of docs/architecture.md §5 on every target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/reduce.cpp"
#include <algorithm>
#include <cmath>
#include <cstring>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "runtime/cpu/convert-inl.h"
#include "runtime/cpu/kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Element i of the chunk is accumulated into lane i mod 32: kVecs vectors of
// Lanes(d) lanes hold lanes 0..31 in order. The lanes are then combined by a
// fixed pairwise tree. Must match the GPU reduce (a warp is 32 lanes).
constexpr std::size_t kLanes = 32;

// The sum of squares of finite gradients whose fp32 squares overflow (|g| above
// ~1.8e19: huge loss scales with f32 or bf16 gradients). Same canonical order,
// on values first multiplied by 2^-e, e the exponent just above max |g|, so every
// square is <= 1; the result is the fp32 sum times 2^2e, in fp64. Power-of-two
// scaling keeps it reproducible on every target (and for the GPU to match).
template <DType G>
double RescaledSumOfSquares(const void* grad, std::size_t n, float maxabs) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  constexpr std::size_t kN = hn::MaxLanes(d);
  constexpr std::size_t kVecs = kLanes / kN;
  const int e = std::ilogb(maxabs) + 1;  // maxabs * 2^-e < 1
  const V s = hn::Set(d, std::ldexp(1.0f, -e));
  V acc[kVecs];
  for (std::size_t k = 0; k < kVecs; ++k) acc[k] = hn::Zero(d);
  for (std::size_t i = 0; i < n; i += kLanes) {
    alignas(64) float buf[kLanes] = {};  // zero-padded tail; every block through the buffer (a rare path)
    std::memcpy(buf, static_cast<const char*>(grad) + i * dtype_size(G), std::min(kLanes, n - i) * dtype_size(G));
    for (std::size_t k = 0; k < kVecs; ++k) {
      const V g = hn::Mul(LoadAs<G>(d, buf, k * kN), s);
      acc[k] = hn::Add(acc[k], hn::Mul(g, g));
    }
  }
  alignas(64) float lanes[kLanes];
  for (std::size_t k = 0; k < kVecs; ++k) hn::Store(acc[k], d, lanes + k * kN);
  for (std::size_t width = kLanes / 2; width >= 1; width /= 2)
    for (std::size_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return std::ldexp(static_cast<double>(lanes[0]), 2 * e);
}

template <DType G, NormKind K>
ReducePartial ReduceChunk(const void* grad, std::size_t n) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  constexpr std::size_t kN = hn::MaxLanes(d);
  static_assert(kLanes % kN == 0, "vector width must divide 32");
  constexpr std::size_t kVecs = kLanes / kN;
  // L2: a sum of squares is finite only if every element is, so no separate
  // check is needed unless it is not (then an exact scan tells inf/NaN from
  // overflow). Inf-norm: the max ignores NaNs (acc < |g| is false for a NaN: the
  // CUDA kernels' sf_max, on every ISA; Highway's Max leaves NaN handling to the
  // ISA), so track 0 * g, which becomes NaN on any inf or NaN.
  V acc[kVecs];
  V poison[kVecs];
  for (std::size_t k = 0; k < kVecs; ++k) acc[k] = poison[k] = hn::Zero(d);
  const V zero = hn::Zero(d);

  const auto accumulate = [&](const void* base, std::size_t i) {
    for (std::size_t k = 0; k < kVecs; ++k) {
      const V g = LoadAs<G>(d, base, i + k * kN);
      if constexpr (K == NormKind::l2) {
        acc[k] = hn::Add(acc[k], hn::Mul(g, g));
      } else {
        const V a = hn::Abs(g);
        acc[k] = hn::IfThenElse(hn::Lt(acc[k], a), a, acc[k]);
        poison[k] = hn::Add(poison[k], hn::Mul(g, zero));
      }
    }
  };
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) accumulate(grad, i);
  if (i < n) {  // tail: zero-padded copy (zeros add nothing to either result)
    alignas(64) float buf[kLanes] = {};
    std::memcpy(buf, static_cast<const char*>(grad) + i * dtype_size(G), (n - i) * dtype_size(G));
    accumulate(buf, 0);
  }

  alignas(64) float lanes[kLanes];
  alignas(64) float bad[kLanes];
  for (std::size_t k = 0; k < kVecs; ++k) {
    hn::Store(acc[k], d, lanes + k * kN);
    hn::Store(poison[k], d, bad + k * kN);
  }
  ReducePartial out;
  if constexpr (K == NormKind::l2) {
    for (std::size_t width = kLanes / 2; width >= 1; width /= 2)
      for (std::size_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    out.sumsq = lanes[0];
    if (!std::isfinite(lanes[0])) {  // rare: an inf/NaN element, or squares overflowing fp32
      V maxabs = zero;
      for (std::size_t j = 0; j < n && !out.nonfinite; j += kN) {
        alignas(64) float buf[kN] = {};
        std::memcpy(buf, static_cast<const char*>(grad) + j * dtype_size(G), std::min(kN, n - j) * dtype_size(G));
        const V g = LoadAs<G>(d, buf, 0);
        out.nonfinite = !hn::AllTrue(d, hn::IsFinite(g));
        maxabs = hn::Max(maxabs, hn::Abs(g));
      }
      if (!out.nonfinite) out.sumsq = RescaledSumOfSquares<G>(grad, n, hn::GetLane(hn::MaxOfLanes(d, maxabs)));
    }
  } else {
    for (std::size_t lane = 0; lane < kLanes; ++lane) out.nonfinite |= !(bad[lane] == 0.0f);
    float m = 0.0f;
    for (std::size_t lane = 0; lane < kLanes; ++lane) m = lanes[lane] > m ? lanes[lane] : m;
    out.maxabs = m;
  }
  return out;
}

ReduceFn GetReduceKernel(int grad_type, int kind) {
  static constexpr ReduceFn kTable[3][2] = {
      {&ReduceChunk<DType::f32, NormKind::l2>, &ReduceChunk<DType::f32, NormKind::inf>},
      {&ReduceChunk<DType::f16, NormKind::l2>, &ReduceChunk<DType::f16, NormKind::inf>},
      {&ReduceChunk<DType::bf16, NormKind::l2>, &ReduceChunk<DType::bf16, NormKind::inf>},
  };
  return kTable[grad_type][kind];
}

const char* GetTargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace stepfuse::cpu {
HWY_EXPORT(GetReduceKernel);
HWY_EXPORT(GetTargetName);

ReduceFn reduce_kernel(DType grad_type, NormKind kind) {
  return HWY_DYNAMIC_DISPATCH(GetReduceKernel)(static_cast<int>(grad_type), static_cast<int>(kind));
}
const char* dispatch_target_name() { return HWY_DYNAMIC_DISPATCH(GetTargetName)(); }
}  // namespace stepfuse::cpu

namespace stepfuse {
const char* cpu_target() { return cpu::dispatch_target_name(); }
}  // namespace stepfuse
#endif
