// Stochastic rounding of bf16 weights as Highway vectors: the random bits of
// jit/stochastic_round.h (Philox4x32-10, one call per 8 consecutive model
// elements) for a run of elements, Lanes() Philox calls at a time, and the
// rounding that adds them. Bitwise the scalar reference's on every target.
// Re-included once per target; no include guard on purpose.

#if defined(STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
#undef STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
#else
#define STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
#endif

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "jit/stochastic_round.h"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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

#if HWY_TARGET <= HWY_AVX3
// Philox4x32-10 of 8 counters, one in each 64-bit lane, each word in the low half of its
// lane: vpmuludq gives the whole 64-bit product, so the low half is in place and the
// high half one shift away, and the three-way xors are one vpternlogd each. The high
// halves fill with garbage that nothing reads (vpmuludq reads low halves only).
HWY_INLINE void Philox8Rounds(__m512i& c0, __m512i& c1, __m512i& c2, __m512i& c3, __m512i& d0, __m512i& d1,
                              __m512i& d2, __m512i& d3, std::uint32_t k0, std::uint32_t k1) {
  const __m512i m0 = _mm512_set1_epi64(SF_PHILOX_M0), m1 = _mm512_set1_epi64(SF_PHILOX_M1);
  __m512i vk0 = _mm512_set1_epi32(static_cast<int>(k0)), vk1 = _mm512_set1_epi32(static_cast<int>(k1));
  const __m512i w0 = _mm512_set1_epi32(static_cast<int>(SF_PHILOX_W0));
  const __m512i w1 = _mm512_set1_epi32(static_cast<int>(SF_PHILOX_W1));
  for (int r = 0; r < 10; ++r) {  // two sets of 8 counters interleaved, for the multipliers' latency
    const __m512i p0 = _mm512_mul_epu32(c0, m0), p1 = _mm512_mul_epu32(c2, m1);
    const __m512i q0 = _mm512_mul_epu32(d0, m0), q1 = _mm512_mul_epu32(d2, m1);
    c0 = _mm512_ternarylogic_epi32(_mm512_srli_epi64(p1, 32), c1, vk0, 0x96);  // hi1 ^ c1 ^ k0
    c2 = _mm512_ternarylogic_epi32(_mm512_srli_epi64(p0, 32), c3, vk1, 0x96);  // hi0 ^ c3 ^ k1
    c1 = p1;
    c3 = p0;
    d0 = _mm512_ternarylogic_epi32(_mm512_srli_epi64(q1, 32), d1, vk0, 0x96);
    d2 = _mm512_ternarylogic_epi32(_mm512_srli_epi64(q0, 32), d3, vk1, 0x96);
    d1 = q1;
    d3 = q0;
    vk0 = _mm512_add_epi32(vk0, w0);
    vk1 = _mm512_add_epi32(vk1, w1);
  }
}

// The 8 blocks' words (c0..c3 in the low halves of 64-bit lanes), stored as 4 words a block.
HWY_INLINE void StorePhiloxWords(__m512i c0, __m512i c1, __m512i c2, __m512i c3, std::uint32_t* out) {
  const __m512i low_halves = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  const __m512i w01 = _mm512_permutex2var_epi32(c0, low_halves, c1);  // qword j: c0_j | c1_j << 32
  const __m512i w23 = _mm512_permutex2var_epi32(c2, low_halves, c3);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi64(w01, _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), w23));
  _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi64(w01, _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15), w23));
}
#endif

// The 128 random bits of Lanes(du) consecutive 8-element blocks, `first` and on,
// stored to out (4 words a block, the blocks in order: as 16-bit values, the bits
// of their elements in order).
template <class DU>
HWY_INLINE void RoundingBlocks(DU du, std::uint64_t seed, std::uint64_t step, std::uint64_t first, std::uint32_t* out) {
  const std::size_t n = hn::Lanes(du);
  const std::uint32_t k[2] = {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
#if HWY_TARGET != HWY_SCALAR
  if (const auto lo32 = static_cast<std::uint32_t>(first); lo32 <= 0xFFFFFFFFu - n) {  // no carry into the high word
#if HWY_TARGET <= HWY_AVX3
    if (n == 16) {
      __m512i c0 = _mm512_add_epi64(_mm512_set1_epi64(lo32), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
      __m512i d0 = _mm512_add_epi64(_mm512_set1_epi64(lo32), _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15));
      __m512i c1 = _mm512_set1_epi64(static_cast<std::uint32_t>(first >> 32)), d1 = c1;
      __m512i c2 = _mm512_set1_epi64(static_cast<std::uint32_t>(step)), d2 = c2;
      __m512i c3 = _mm512_set1_epi64(static_cast<std::uint32_t>(step >> 32)), d3 = c3;
      Philox8Rounds(c0, c1, c2, c3, d0, d1, d2, d3, k[0], k[1]);
      StorePhiloxWords(c0, c1, c2, c3, out);
      StorePhiloxWords(d0, d1, d2, d3, out + 32);
      return;
    }
#endif
    auto c0 = hn::Add(hn::Set(du, lo32), hn::Iota(du, 0));
    auto c1 = hn::Set(du, static_cast<std::uint32_t>(first >> 32));
    auto c2 = hn::Set(du, static_cast<std::uint32_t>(step));
    auto c3 = hn::Set(du, static_cast<std::uint32_t>(step >> 32));
    std::uint32_t k0 = k[0], k1 = k[1];
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
    hn::StoreInterleaved4(c0, c1, c2, c3, du, out);
    return;
  }
#endif
  // The rare group of blocks that crosses a multiple of 2^32 (and the scalar target): one by one.
  for (std::size_t j = 0; j < n; ++j) {
    const std::uint64_t b = first + j;
    const std::uint32_t c[4] = {static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(b >> 32),
                                static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32)};
    sf_philox4x32_10(c, k, out + 4 * j);
  }
}

// The random bits of model elements first .. first + n - 1 into bits[0, n): what
// sf_sr_bits gives each, one Philox call per 8 elements, Lanes() calls at a time.
inline void FillRoundingBits(std::uint64_t seed, std::uint64_t step, std::uint64_t first, std::size_t n,
                             std::uint16_t* bits) {
  static_assert(std::endian::native == std::endian::little, "a block's words read as 16-bit values in element order");
  const hn::ScalableTag<std::uint32_t> du;
  const std::size_t blocks_per_call = hn::Lanes(du), elems_per_call = 8 * blocks_per_call;
  alignas(64) std::uint32_t words[4 * hn::MaxLanes(du)];
  const std::uint64_t block0 = first >> 3;
  const std::size_t skip = static_cast<std::size_t>(first & 7), end = skip + n;  // elements from block0's first
  for (std::size_t at = 0; at < end; at += elems_per_call) {
    RoundingBlocks(du, seed, step, block0 + at / 8, words);
    const std::size_t from = at < skip ? skip : at, to = at + elems_per_call < end ? at + elems_per_call : end;
    std::memcpy(bits + (from - skip), reinterpret_cast<const std::uint16_t*>(words) + (from - at),
                (to - from) * sizeof(std::uint16_t));
  }
}

// The bf16 bits of v rounded stochastically with the 16-bit values r (in u32 lanes).
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> NarrowBf16Stochastic(D /*d*/, hn::Vec<D> v,
                                                                 hn::Vec<hn::RebindToUnsigned<D>> r) {
  const hn::RebindToUnsigned<D> du;
  const auto u = hn::BitCast(du, v);
  const auto rounded = hn::ShiftRight<16>(hn::Add(u, r));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
}

// Stores Lanes(d) fp32 values as bf16 at element i of base, rounded stochastically
// with the random bits bits[0, Lanes(d)).
template <class D>
HWY_INLINE void StoreBf16Stochastic(D d, hn::Vec<D> v, void* base, std::size_t i, const std::uint16_t* bits) {
  const hn::Rebind<std::uint16_t, D> d16;
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const auto r = hn::PromoteTo(du, hn::LoadU(d16, bits));
  const auto out = NarrowBf16Stochastic(d, v, r);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, out)), d16, static_cast<std::uint16_t*>(base) + i);
}

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // STEPFUSE_CPU_STOCHASTIC_ROUND_INL_H_
