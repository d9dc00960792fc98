// The reduce pass: non-finite flag and sum of squares (or max |g|) of one chunk
// of gradients, in the canonical order of docs/architecture.md §5 on every target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/reduce.cpp"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

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

// One chunk's accumulators: element i of the chunk goes into lane i mod 32 (see kLanes).
template <DType G, NormKind K>
struct ChunkSums {
  using D = hn::ScalableTag<float>;
  using V = hn::Vec<D>;
  static constexpr std::size_t kN = hn::MaxLanes(D());
  static_assert(kLanes % kN == 0, "vector width must divide 32");
  static constexpr std::size_t kVecs = kLanes / kN;
  // L2: a sum of squares is finite only if every element is, so no separate
  // check is needed unless it is not (then an exact scan tells inf/NaN from
  // overflow). Inf-norm: the max ignores NaNs (acc < |g| is false for a NaN: the
  // CUDA kernels' sf_max, on every ISA; Highway's Max leaves NaN handling to the
  // ISA), so track 0 * g, which becomes NaN on any inf or NaN.
  V acc[kVecs];
  V poison[kVecs];

  HWY_INLINE ChunkSums() {
    for (std::size_t k = 0; k < kVecs; ++k) acc[k] = poison[k] = hn::Zero(D());
  }
  // Elements i .. i + 31 of `base`.
  HWY_INLINE void Add(const void* base, std::size_t i) {
    const D d;
    for (std::size_t k = 0; k < kVecs; ++k) {
      const V g = LoadAs<G>(d, base, i + k * kN);
      if constexpr (K == NormKind::l2) {
        acc[k] = hn::Add(acc[k], hn::Mul(g, g));
      } else {
        const V a = hn::Abs(g);
        acc[k] = hn::IfThenElse(hn::Lt(acc[k], a), a, acc[k]);
        poison[k] = hn::Add(poison[k], hn::Mul(g, hn::Zero(d)));
      }
    }
  }
  // The elements from `i` to the chunk's end n (fewer than 32: a zero-padded copy,
  // zeros add nothing to either result), then the chunk's partial.
  HWY_INLINE ReducePartial Finish(const void* grad, std::size_t i, std::size_t n) {
    const D d;
    if (i < n) {
      alignas(64) float buf[kLanes] = {};
      std::memcpy(buf, static_cast<const char*>(grad) + i * dtype_size(G), (n - i) * dtype_size(G));
      Add(buf, 0);
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
        V maxabs = hn::Zero(d);
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
};

template <DType G, NormKind K>
ReducePartial ReduceChunk(const void* grad, std::size_t n) {
  ChunkSums<G, K> sums;
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) sums.Add(grad, i);
  return sums.Finish(grad, i, n);
}

// kWays chunks at once, their loads alternating: each chunk's partial exactly as
// ReduceChunk's (its own accumulators, in its own order). Short chunks of different
// tensors, each its own allocation, are streams the hardware prefetchers ramp up on
// together rather than one after the other.
template <DType G, NormKind K, std::size_t kWays>
void ReduceChunkGroup(const void* const* grad, const std::size_t* n, ReducePartial* out) {
  ChunkSums<G, K> s[kWays];
  std::size_t common = n[0];
  for (std::size_t j = 1; j < kWays; ++j) common = std::min(common, n[j]);
  std::size_t i = 0;
  for (; i + kLanes <= common; i += kLanes)
    for (std::size_t j = 0; j < kWays; ++j) s[j].Add(grad[j], i);
  for (std::size_t j = 0; j < kWays; ++j) {
    std::size_t k = i;
    for (; k + kLanes <= n[j]; k += kLanes) s[j].Add(grad[j], k);
    out[j] = s[j].Finish(grad[j], k, n[j]);
  }
}

ReduceFn GetReduceKernel(int grad_type, int kind) {
  static constexpr ReduceFn kTable[3][2] = {
      {&ReduceChunk<DType::f32, NormKind::l2>, &ReduceChunk<DType::f32, NormKind::inf>},
      {&ReduceChunk<DType::f16, NormKind::l2>, &ReduceChunk<DType::f16, NormKind::inf>},
      {&ReduceChunk<DType::bf16, NormKind::l2>, &ReduceChunk<DType::bf16, NormKind::inf>},
  };
  return kTable[grad_type][kind];
}

template <DType G, NormKind K>
ReduceGroupFn GroupKernel(std::size_t ways) {
  static_assert(kReduceWays == 4, "the kernels below are for 2, 3 and 4 chunks");
  return ways == 2 ? &ReduceChunkGroup<G, K, 2> : ways == 3 ? &ReduceChunkGroup<G, K, 3> : &ReduceChunkGroup<G, K, 4>;
}

ReduceGroupFn GetReduceGroupKernel(int grad_type, int kind, std::size_t ways) {
  using GetFn = ReduceGroupFn (*)(std::size_t);
  static constexpr GetFn kTable[3][2] = {
      {&GroupKernel<DType::f32, NormKind::l2>, &GroupKernel<DType::f32, NormKind::inf>},
      {&GroupKernel<DType::f16, NormKind::l2>, &GroupKernel<DType::f16, NormKind::inf>},
      {&GroupKernel<DType::bf16, NormKind::l2>, &GroupKernel<DType::bf16, NormKind::inf>},
  };
  return kTable[grad_type][kind](ways);
}

const char* GetTargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace stepfuse::cpu {
HWY_EXPORT(GetReduceKernel);
HWY_EXPORT(GetReduceGroupKernel);
HWY_EXPORT(GetTargetName);

ReduceFn reduce_kernel(DType grad_type, NormKind kind) {
  return HWY_DYNAMIC_DISPATCH(GetReduceKernel)(static_cast<int>(grad_type), static_cast<int>(kind));
}
ReduceGroupFn reduce_group_kernel(DType grad_type, NormKind kind, std::size_t ways) {
  if (ways < 2 || ways > kReduceWays) throw std::invalid_argument("reduce_group_kernel: 2 to kReduceWays chunks");
  return HWY_DYNAMIC_DISPATCH(GetReduceGroupKernel)(static_cast<int>(grad_type), static_cast<int>(kind), ways);
}
const char* dispatch_target_name() { return HWY_DYNAMIC_DISPATCH(GetTargetName)(); }
}  // namespace stepfuse::cpu

namespace stepfuse {
const char* cpu_target() { return cpu::dispatch_target_name(); }
}  // namespace stepfuse
#endif
