// Stochastic rounding of bf16 weights as Highway vectors: the random words of
// jit/stochastic_round.h (Philox4x32-10, one call per four consecutive model
// elements) computed lane by lane, and the rounding that adds their upper 16
// bits. Bitwise the scalar reference's on every target. Re-included once per
// target; no include guard on purpose.

#if defined(STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
#undef STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
#else
#define STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "jit/stochastic_round.h"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Where a tensor's elements are in the model, and the step's Philox key and counter.
struct RoundingKey {
  std::uint64_t seed = 0, step = 0;
  std::uint64_t base = 0;  // the model index of element 0 of the pointers in use
};

#if HWY_TARGET != HWY_SCALAR
// The 64-bit products m * b of every u32 lane, as their high and low halves.
template <class DU>
HWY_INLINE void MulHiLo(DU du, std::uint32_t m, hn::Vec<DU> b, hn::Vec<DU>& hi, hn::Vec<DU>& lo) {
  const hn::Repartition<std::uint64_t, DU> d64;
  const auto vm = hn::Set(du, m);
  const auto even = hn::MulEven(vm, b);  // lanes 0, 2, ...
  const auto odd = hn::MulEven(vm, hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(d64, b))));  // lanes 1, 3, ...
  lo = hn::OddEven(hn::BitCast(du, hn::ShiftLeft<32>(odd)), hn::BitCast(du, even));
  hi = hn::OddEven(hn::BitCast(du, odd), hn::BitCast(du, hn::ShiftRight<32>(even)));
}
#endif

// The random words of model elements first, first + 1, ... (one per lane).
template <class DU>
HWY_INLINE hn::Vec<DU> RoundingWords(DU du, const RoundingKey& key, std::uint64_t first) {
  const std::size_t n = hn::Lanes(du);
#if HWY_TARGET != HWY_SCALAR
  if (const auto lo32 = static_cast<std::uint32_t>(first); lo32 <= 0xFFFFFFFFu - n) {  // no lane's index carries into the high word
    const auto hi32 = static_cast<std::uint32_t>(first >> 32);
    const auto index = hn::Add(hn::Set(du, lo32), hn::Iota(du, 0));
    auto c0 = hn::Or(hn::ShiftRight<2>(index), hn::Set(du, hi32 << 30));  // lo(index >> 2)
    auto c1 = hn::Set(du, hi32 >> 2);                                    // hi(index >> 2)
    auto c2 = hn::Set(du, static_cast<std::uint32_t>(key.step));
    auto c3 = hn::Set(du, static_cast<std::uint32_t>(key.step >> 32));
    auto k0 = static_cast<std::uint32_t>(key.seed), k1 = static_cast<std::uint32_t>(key.seed >> 32);
    for (int r = 0; r < 10; ++r) {
      hn::Vec<DU> hi0, lo0, hi1, lo1;
      MulHiLo(du, SF_PHILOX_M0, c0, hi0, lo0);
      MulHiLo(du, SF_PHILOX_M1, c2, hi1, lo1);
      c0 = hn::Xor(hn::Xor(hi1, c1), hn::Set(du, k0));
      c1 = lo1;
      c2 = hn::Xor(hn::Xor(hi0, c3), hn::Set(du, k1));
      c3 = lo0;
      k0 += SF_PHILOX_W0;
      k1 += SF_PHILOX_W1;
    }
    const auto word = hn::And(index, hn::Set(du, 3u));
    const auto w01 = hn::IfThenElse(hn::Eq(word, hn::Zero(du)), c0, c1);
    const auto w23 = hn::IfThenElse(hn::Eq(word, hn::Set(du, 2u)), c2, c3);
    return hn::IfThenElse(hn::Eq(hn::ShiftRight<1>(word), hn::Zero(du)), w01, w23);
  }
#endif
  // The rare vector whose indices cross a multiple of 2^32 (and the scalar target): lane by lane.
  alignas(64) std::uint32_t words[hn::MaxLanes(du)];
  for (std::size_t j = 0; j < n; ++j) words[j] = sf_sr_word(key.seed, key.step, first + j);
  return hn::Load(du, words);
}

// The bf16 bits of v rounded stochastically, lane j with the word of model element first + j.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> NarrowBf16Stochastic(D /*d*/, hn::Vec<D> v, const RoundingKey& key,
                                                                 std::uint64_t first) {
  const hn::RebindToUnsigned<D> du;
  const auto u = hn::BitCast(du, v);
  const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::ShiftRight<16>(RoundingWords(du, key, first))));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
}

// Stores Lanes(d) fp32 values as bf16 at element i of base, rounded stochastically
// (element i is model element key.base + i).
template <class D>
HWY_INLINE void StoreBf16Stochastic(D d, hn::Vec<D> v, void* base, std::size_t i, const RoundingKey& key) {
  const hn::Rebind<std::uint16_t, D> d16;
  const hn::RebindToSigned<D> di;
  const auto bits = NarrowBf16Stochastic(d, v, key, key.base + i);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, bits)), d16, static_cast<std::uint16_t*>(base) + i);
}

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
