// Whole-array conversions between fp32 and the storage dtypes.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/convert.cpp"
#include <cstring>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "runtime/cpu/convert-inl.h"
#include "runtime/cpu/kernels.hpp"
#include "runtime/cpu/stochastic_round-inl.h"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <DType T>
void WidenT(const void* src, float* dst, std::size_t n) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(LoadAs<T>(d, src, i), d, dst + i);
  if (i == n) return;
  alignas(64) std::uint8_t in[hn::MaxLanes(d) * 4] = {};
  alignas(64) float out[hn::MaxLanes(d)];
  std::memcpy(in, static_cast<const char*>(src) + i * dtype_size(T), (n - i) * dtype_size(T));
  hn::Store(LoadAs<T>(d, in, 0), d, out);
  std::memcpy(dst + i, out, (n - i) * sizeof(float));
}

template <DType T>
void NarrowT(const float* src, void* dst, std::size_t n) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) StoreAs<T>(d, hn::LoadU(d, src + i), dst, i);
  if (i == n) return;
  alignas(64) float in[hn::MaxLanes(d)] = {};
  alignas(64) std::uint8_t out[hn::MaxLanes(d) * 4];
  std::memcpy(in, src + i, (n - i) * sizeof(float));
  StoreAs<T>(d, hn::Load(d, in), out, 0);
  std::memcpy(static_cast<char*>(dst) + i * dtype_size(T), out, (n - i) * dtype_size(T));
}

template <DType T>
void WidenScaledT(const void* src, float* dst, std::size_t n, float s) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  const auto vs = hn::Set(d, s);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(LoadAs<T>(d, src, i), vs), d, dst + i);
  if (i == n) return;
  alignas(64) std::uint8_t in[hn::MaxLanes(d) * 4] = {};
  alignas(64) float out[hn::MaxLanes(d)];
  std::memcpy(in, static_cast<const char*>(src) + i * dtype_size(T), (n - i) * dtype_size(T));
  hn::Store(hn::Mul(LoadAs<T>(d, in, 0), vs), d, out);
  std::memcpy(dst + i, out, (n - i) * sizeof(float));
}

void WidenScaled(int type, const void* src, float* dst, std::size_t n, float s) {
  if (type == 0) WidenScaledT<DType::f32>(src, dst, n, s);
  else if (type == 1) WidenScaledT<DType::f16>(src, dst, n, s);
  else WidenScaledT<DType::bf16>(src, dst, n, s);
}

template <DType T>
void ScaleT(void* data, std::size_t n, float s) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  const auto vs = hn::Set(d, s);
  std::size_t i = 0;
  for (; i + N <= n; i += N) StoreAs<T>(d, hn::Mul(LoadAs<T>(d, data, i), vs), data, i);
  if (i == n) return;
  alignas(64) std::uint8_t buf[hn::MaxLanes(d) * 4] = {};
  std::memcpy(buf, static_cast<const char*>(data) + i * dtype_size(T), (n - i) * dtype_size(T));
  StoreAs<T>(d, hn::Mul(LoadAs<T>(d, buf, 0), vs), buf, 0);
  std::memcpy(static_cast<char*>(data) + i * dtype_size(T), buf, (n - i) * dtype_size(T));
}

void Scale(int type, void* data, std::size_t n, float s) {
  if (type == 0) ScaleT<DType::f32>(data, n, s);
  else if (type == 1) ScaleT<DType::f16>(data, n, s);
  else ScaleT<DType::bf16>(data, n, s);
}

void Widen(int type, const void* src, float* dst, std::size_t n) {
  if (type == 0) WidenT<DType::f32>(src, dst, n);
  else if (type == 1) WidenT<DType::f16>(src, dst, n);
  else WidenT<DType::bf16>(src, dst, n);
}
void Narrow(const float* src, int type, void* dst, std::size_t n) {
  if (type == 0) NarrowT<DType::f32>(src, dst, n);
  else if (type == 1) NarrowT<DType::f16>(src, dst, n);
  else NarrowT<DType::bf16>(src, dst, n);
}

void NarrowBf16StochasticArray(const float* src, std::uint16_t* dst, std::size_t n, std::uint64_t seed,
                               std::uint64_t step, std::uint64_t first) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  constexpr std::size_t kRun = 1024;  // elements whose bits are drawn at once (kept in L1)
  alignas(64) std::uint16_t bits[kRun];
  for (std::size_t at = 0; at < n; at += kRun) {
    const std::size_t len = n - at < kRun ? n - at : kRun;
    FillRoundingBits(seed, step, first + at, len, bits);
    std::size_t i = 0;
    for (; i + N <= len; i += N) StoreBf16Stochastic(d, hn::LoadU(d, src + at + i), dst + at, i, bits + i);
    if (i == len) continue;
    alignas(64) float in[hn::MaxLanes(d)] = {};
    alignas(64) std::uint16_t out[hn::MaxLanes(d)], tail_bits[hn::MaxLanes(d)] = {};
    std::memcpy(in, src + at + i, (len - i) * sizeof(float));
    std::memcpy(tail_bits, bits + i, (len - i) * sizeof(std::uint16_t));
    StoreBf16Stochastic(d, hn::Load(d, in), out, 0, tail_bits);
    std::memcpy(dst + at + i, out, (len - i) * sizeof(std::uint16_t));
  }
}

void WidenCompensatedArray(const std::uint16_t* weight, const std::uint16_t* comp, float* dst, std::size_t n) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(LoadCompensated(d, weight, comp, i), d, dst + i);
  if (i == n) return;
  alignas(64) std::uint16_t w[hn::MaxLanes(d)] = {}, c[hn::MaxLanes(d)] = {};
  alignas(64) float out[hn::MaxLanes(d)];
  std::memcpy(w, weight + i, (n - i) * sizeof(std::uint16_t));
  std::memcpy(c, comp + i, (n - i) * sizeof(std::uint16_t));
  hn::Store(LoadCompensated(d, w, c, 0), d, out);
  std::memcpy(dst + i, out, (n - i) * sizeof(float));
}

void NarrowCompensatedArray(const float* src, std::uint16_t* weight, std::uint16_t* comp, std::size_t n) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) StoreCompensated(d, hn::LoadU(d, src + i), weight, comp, i);
  if (i == n) return;
  alignas(64) float in[hn::MaxLanes(d)] = {};
  alignas(64) std::uint16_t w[hn::MaxLanes(d)], c[hn::MaxLanes(d)];
  std::memcpy(in, src + i, (n - i) * sizeof(float));
  StoreCompensated(d, hn::Load(d, in), w, c, 0);
  std::memcpy(weight + i, w, (n - i) * sizeof(std::uint16_t));
  std::memcpy(comp + i, c, (n - i) * sizeof(std::uint16_t));
}

void RoundingBits(std::uint64_t seed, std::uint64_t step, std::uint64_t first, std::size_t n, std::uint16_t* bits) {
  FillRoundingBits(seed, step, first, n, bits);
}

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace stepfuse::cpu {
HWY_EXPORT(Widen);
HWY_EXPORT(Narrow);
HWY_EXPORT(Scale);
HWY_EXPORT(WidenScaled);
HWY_EXPORT(NarrowBf16StochasticArray);
HWY_EXPORT(RoundingBits);
HWY_EXPORT(WidenCompensatedArray);
HWY_EXPORT(NarrowCompensatedArray);
void widen_compensated(const std::uint16_t* weight, const std::uint16_t* comp, float* dst, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(WidenCompensatedArray)(weight, comp, dst, n);
}
void narrow_compensated(const float* src, std::uint16_t* weight, std::uint16_t* comp, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(NarrowCompensatedArray)(src, weight, comp, n);
}
void rounding_bits(std::uint64_t seed, std::uint64_t step, std::uint64_t first, std::size_t n, std::uint16_t* bits) {
  HWY_DYNAMIC_DISPATCH(RoundingBits)(seed, step, first, n, bits);
}
void narrow_bf16_stochastic(const float* src, std::uint16_t* dst, std::size_t n, std::uint64_t seed,
                            std::uint64_t step, std::uint64_t first) {
  HWY_DYNAMIC_DISPATCH(NarrowBf16StochasticArray)(src, dst, n, seed, step, first);
}
void widen_scaled(DType type, const void* src, float* dst, std::size_t n, float s) {
  HWY_DYNAMIC_DISPATCH(WidenScaled)(static_cast<int>(type), src, dst, n, s);
}
void scale_inplace(DType type, void* data, std::size_t n, float s) {
  HWY_DYNAMIC_DISPATCH(Scale)(static_cast<int>(type), data, n, s);
}
void widen(DType type, const void* src, float* dst, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(Widen)(static_cast<int>(type), src, dst, n);
}
void narrow(const float* src, DType type, void* dst, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(Narrow)(src, static_cast<int>(type), dst, n);
}
}  // namespace stepfuse::cpu
#endif
