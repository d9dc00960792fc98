// The template evaluator: unrolls a constexpr update program into one fused
// Highway loop (straight-line vector code, values in registers) per dtype
// combination. Re-included once per target; no include guard on purpose.

#if defined(STEPFUSE_CPU_FUSED_UPDATE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STEPFUSE_CPU_FUSED_UPDATE_INL_H_
#undef STEPFUSE_CPU_FUSED_UPDATE_INL_H_
#else
#define STEPFUSE_CPU_FUSED_UPDATE_INL_H_
#endif

#include <cstring>
#include <utility>

#include "hwy/highway.h"
#include "jit/program_analysis.hpp"
#include "runtime/cpu/convert-inl.h"
#include "runtime/cpu/kernels.hpp"
#include "runtime/cpu/stochastic_round-inl.h"
#include "runtime/cpu/vector_ops-inl.h"
#include "stepfuse/program.hpp"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Stream pointers as used inside the loop (copied to locals so they hoist).
struct Streams {
  const void* grad;
  void* weight;
  float* master;
  float* state[kMaxStreams];
  const float* norms;  // phase 2 of a two-phase program: the tensor's norms
  // M == kStochasticWeights: the random bits of element i are sr_bits[i - sr_begin]; with
  // kBf16State, the j-th bf16 state stream the program stores has its own at
  // sr_bits[j * sr_stride + i - sr_begin] (UpdateArgs::sr_stride)
  const std::uint16_t* sr_bits;
  std::size_t sr_begin;
  std::size_t sr_stride;
};

// The weight modes (template parameter M): how the param stream is kept.
inline constexpr int kPlainWeights = 0;       // the weights themselves, rounded to nearest when narrower
inline constexpr int kMasterWeights = 1;      // fp32 masters; the weights are their copies, rounded to nearest
inline constexpr int kStochasticWeights = 2;  // bf16 weights, rounded stochastically (jit/stochastic_round.h)
inline constexpr int kCompensatedWeights = 3; // bf16 weights + bf16 compensations in the master slot
// Added to a weight mode: the program's state streams are stored as bf16 (all but
// those it keeps in full precision), loaded and stored in registers. The mode's
// weight part is M & 3.
inline constexpr int kBf16State = 4;
// Added to kStochasticWeights | kBf16State: that state rounds to nearest even, not
// stochastically (OptimizerOptions::stochastic_state_rounding off).
inline constexpr int kNearestState = 8;
template <int M>
inline constexpr int kWeightMode = M & 3;
// Whether stream k of P is stored as bf16 in mode M.
template <const Program& P, int M>
constexpr bool Bf16Stream(int k) {
  return (M & kBf16State) != 0 && P.streams[k].role == StreamRole::state &&
         P.streams[k].values != StateValues::full_precision;
}
// Streams the program stores, as a bit mask (the tail copies only these back).
template <const Program& P>
constexpr unsigned StoredStreams() {
  unsigned mask = 0;
  for (int i = 0; i < P.num_instrs; ++i)
    if (P.code[i].op == Op::store) mask |= 1u << P.code[i].attr;
  return mask;
}
// Whether stream k of P is a bf16 state stream P stores rounding stochastically in mode M
// (beside stochastically rounded weights, unless kNearestState).
template <const Program& P, int M>
constexpr bool SrStateStream(int k) {
  return kWeightMode<M> == kStochasticWeights && (M & kNearestState) == 0 && Bf16Stream<P, M>(k) &&
         (StoredStreams<P>() >> k & 1u) != 0;
}
// Stochastic weights with bf16 state: the place (1, 2, ...) of stream k's random bits
// among the streams SrStateStream, in stream order (the weights' are place 0).
template <const Program& P, int M>
constexpr int SrStatePlace(int k) {
  int place = 1;
  for (int j = 0; j < k && j < P.num_streams; ++j) place += SrStateStream<P, M>(j);
  return place;
}
// Bytes per element of the master slot in mode M (none: 0).
template <int M>
inline constexpr std::size_t kMasterBytes = kWeightMode<M> == kMasterWeights ? 4 : kWeightMode<M> == kCompensatedWeights ? 2 : 0;

// Streams of a tensor's args, for a call over elements begin, begin + 1, ...
HWY_INLINE Streams StreamsOf(const UpdateArgs& a, std::size_t begin) {
  return {a.grad, a.weight, a.master,
          {a.state[0], a.state[1], a.state[2], a.state[3], a.state[4], a.state[5], a.state[6], a.state[7]},
          a.norms, a.sr_bits, begin, static_cast<std::size_t>(a.sr_stride)};
}

// Executes instruction I of program P on lanes [i, i + Lanes(d)). Phase 1 of a
// two-phase program: `acc` holds the reduction slots' accumulators of these
// lanes, and in a tail (kTail) only the first `live` lanes are real elements.
template <const Program& P, int I, DType W, DType G, int M, bool kTail = false, class D, class V>
HWY_INLINE void Exec(D d, V* v, const V* s, const Streams& st, std::size_t i, V* acc = nullptr,
                     std::size_t live = 0) {
  constexpr Instr in = P.code[I];
  constexpr int WM = kWeightMode<M>;
  if constexpr (in.op == Op::load) {
    constexpr StreamRole role = P.streams[in.attr].role;
    if constexpr (role == StreamRole::grad) v[I] = LoadAs<G>(d, st.grad, i);
    else if constexpr (role == StreamRole::param && WM == kMasterWeights) v[I] = hn::LoadU(d, st.master + i);
    else if constexpr (role == StreamRole::param && WM == kCompensatedWeights) v[I] = LoadCompensated(d, st.weight, st.master, i);
    else if constexpr (role == StreamRole::param) v[I] = LoadAs<W>(d, st.weight, i);
    else if constexpr (Bf16Stream<P, M>(in.attr)) v[I] = LoadAs<DType::bf16>(d, st.state[in.attr], i);
    else v[I] = hn::LoadU(d, st.state[in.attr] + i);
  } else if constexpr (in.op == Op::store) {
    constexpr StreamRole role = P.streams[in.attr].role;
    if constexpr (role == StreamRole::param) {
      if constexpr (WM == kMasterWeights) hn::StoreU(v[in.a], d, st.master + i);
      if constexpr (WM == kCompensatedWeights) StoreCompensated(d, v[in.a], st.weight, st.master, i);
      else if constexpr (WM == kStochasticWeights) StoreBf16Stochastic(d, v[in.a], st.weight, i, st.sr_bits + (i - st.sr_begin));
      else StoreAs<W>(d, v[in.a], st.weight, i);
    } else if constexpr (SrStateStream<P, M>(in.attr)) {
      StoreBf16Stochastic(d, v[in.a], st.state[in.attr], i,
                          st.sr_bits + SrStatePlace<P, M>(in.attr) * st.sr_stride + (i - st.sr_begin));
    } else if constexpr (Bf16Stream<P, M>(in.attr)) {
      StoreAs<DType::bf16>(d, v[in.a], st.state[in.attr], i);
    } else {
      hn::StoreU(v[in.a], d, st.state[in.attr] + i);
    }
  } else if constexpr (in.op == Op::constant) {
    v[I] = hn::Set(d, in.imm);
  } else if constexpr (in.op == Op::scalar) {
    v[I] = s[in.attr];
  } else if constexpr (in.op == Op::tensor_norm) {
    v[I] = hn::Set(d, st.norms[in.attr]);
  } else if constexpr (in.op == Op::reduce_sumsq) {
    // The reduce pass's canonical accumulation (acc + x * x, two roundings); padding adds 0.
    V x = v[in.a];
    if constexpr (kTail) x = hn::IfThenElseZero(hn::FirstN(d, live), x);
    acc[in.attr] = hn::Add(acc[in.attr], hn::Mul(x, x));
  } else if constexpr (op_arity(in.op) == 1) {
    v[I] = Unary<in.op, in.attr>(d, v[in.a]);
  } else if constexpr (op_arity(in.op) == 2) {
    v[I] = Binary<in.op>(d, v[in.a], v[in.b]);
  } else {
    v[I] = Ternary<in.op>(d, v[in.a], v[in.b], v[in.c]);
  }
}

template <const Program& P, DType W, DType G, int M, class D, class V, std::size_t... I>
HWY_INLINE void Body(D d, const V* s, const Streams& st, std::size_t i, std::index_sequence<I...>) {
  V v[sizeof...(I)];
  (Exec<P, static_cast<int>(I), W, G, M>(d, v, s, st, i), ...);
}

// Phase 1's body: the same, accumulating the reduce_sumsq values into `acc`.
template <const Program& P, DType W, DType G, int M, bool kTail, class D, class V, std::size_t... I>
HWY_INLINE void Body1(D d, const V* s, const Streams& st, std::size_t i, V* acc, std::size_t live,
                      std::index_sequence<I...>) {
  V v[sizeof...(I) > 0 ? sizeof...(I) : 1];
  (Exec<P, static_cast<int>(I), W, G, M, kTail>(d, v, s, st, i, acc, live), ...);
}

// The last (< Lanes(d)) elements [i, end) of an update, staged through zero-padded
// buffers and run through the same vector body, so every element gets bitwise the
// same arithmetic. `st`: the call's streams (its random bits: st.sr_bits, from
// element st.sr_begin, st.sr_stride apart).
template <const Program& P, DType W, DType G, int M, class D, class V>
HWY_NOINLINE void UpdateTail(D d, const V* s, const UpdateArgs& a, const Streams& st, std::size_t i, std::size_t end) {
  constexpr auto kSeq = std::make_index_sequence<P.num_instrs>();
  constexpr std::size_t kMax = hn::MaxLanes(d);
  const std::size_t rem = end - i;
  alignas(64) float state_buf[kMaxStreams][kMax] = {};
  alignas(64) float master_buf[kMax] = {};
  alignas(64) float weight_buf[kMax] = {};  // big enough for any weight dtype
  alignas(64) float grad_buf[kMax] = {};
  const std::size_t wsize = dtype_size(W), gsize = dtype_size(G);
  std::memcpy(grad_buf, static_cast<const char*>(a.grad) + i * gsize, rem * gsize);
  std::memcpy(weight_buf, static_cast<const char*>(a.weight) + i * wsize, rem * wsize);
  constexpr std::size_t kMB = kMasterBytes<M>;
  if constexpr (kMB > 0) std::memcpy(master_buf, reinterpret_cast<const char*>(a.master) + i * kMB, rem * kMB);
  // The random bits (the weights', then those of the bf16 state streams stored: kMax apart).
  // The buffers' element 0 is the tensor's element i.
  constexpr int kBitPlaces = kWeightMode<M> == kStochasticWeights ? SrStatePlace<P, M>(kMaxStreams) : 1;
  alignas(64) std::uint16_t bits_buf[kBitPlaces * kMax] = {};
  if constexpr (kWeightMode<M> == kStochasticWeights)
    for (int p = 0; p < kBitPlaces; ++p)
      std::memcpy(bits_buf + p * kMax, st.sr_bits + p * st.sr_stride + (i - st.sr_begin), rem * sizeof(std::uint16_t));
  Streams tail{grad_buf, weight_buf, master_buf, {}, a.norms, bits_buf, 0, kMax};
  for (int k = 0; k < P.num_streams; ++k) {
    if (P.streams[k].role != StreamRole::state) continue;
    const std::size_t es = Bf16Stream<P, M>(k) ? 2 : 4;
    std::memcpy(state_buf[k], reinterpret_cast<const char*>(a.state[k]) + i * es, rem * es);
    tail.state[k] = state_buf[k];
  }
  Body<P, W, G, M>(d, s, tail, 0, kSeq);
  constexpr unsigned kStored = StoredStreams<P>();
  for (int k = 0; k < P.num_streams; ++k) {
    if (!(kStored & (1u << k))) continue;
    if (P.streams[k].role == StreamRole::param) {
      std::memcpy(static_cast<char*>(a.weight) + i * wsize, weight_buf, rem * wsize);
      if constexpr (kMB > 0) std::memcpy(reinterpret_cast<char*>(a.master) + i * kMB, master_buf, rem * kMB);
    } else {
      const std::size_t es = Bf16Stream<P, M>(k) ? 2 : 4;
      std::memcpy(reinterpret_cast<char*>(a.state[k]) + i * es, state_buf[k], rem * es);
    }
  }
}

// Stochastic rounding: the elements whose random bits a kernel draws at once, right
// before their update (kept in L1: 4 KiB a stream). Measured on gpt2-124m against
// LLVM's kernel in the same runs (its bits drawn by the caller, 2048 at a time): 2048
// here was 2% faster than it, 128 (one AVX-512 call of RoundingBlocks, meant to overlap
// the Philox rounds with the update's memory traffic) 4-7% slower.
inline constexpr std::size_t kDrawnBits = 2048;

// The random bits of elements [i, i + m) (m <= kDrawnBits) into bits: the weights' at
// place 0, each bf16 state stream P stores at its place (SrStatePlace), kDrawnBits apart.
template <const Program& P, int M>
HWY_INLINE void DrawBits(const UpdateArgs& a, std::size_t i, std::size_t m, std::uint16_t* bits) {
  const std::uint64_t first = a.sr_base + i;
  FillRoundingBits(a.sr_seed, a.sr_step, first, m, bits);
  for (int k = 0; k < P.num_streams; ++k)
    if (SrStateStream<P, M>(k))
      FillRoundingBits(a.sr_seed, sf_sr_state_step(a.sr_step, k), first, m,
                       bits + static_cast<std::size_t>(SrStatePlace<P, M>(k)) * kDrawnBits);
}

// The update of elements [begin, begin + n) of one tensor. Stochastic weights: the
// kernel draws the random bits itself (a.sr_bits is not read), kDrawnBits at a time.
template <const Program& P, DType W, DType G, int M>
void FusedUpdate(const UpdateArgs& a, std::size_t begin, std::size_t n) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  constexpr auto kSeq = std::make_index_sequence<P.num_instrs>();
  const std::size_t N = hn::Lanes(d);
  V s[P.num_scalars > 0 ? P.num_scalars : 1];
  for (int k = 0; k < P.num_scalars; ++k) s[k] = hn::Set(d, a.scalars[k]);
  Streams st = StreamsOf(a, begin);
  const std::size_t end = begin + n;
  std::size_t i = begin;
  if constexpr (kWeightMode<M> == kStochasticWeights) {
    static_assert(kDrawnBits % hn::MaxLanes(d) == 0, "whole vectors per group of drawn bits");
    alignas(64) std::uint16_t bits[SrStatePlace<P, M>(kMaxStreams) * kDrawnBits];
    st.sr_bits = bits;
    st.sr_stride = kDrawnBits;
    for (; i < end; i += kDrawnBits) {
      const std::size_t m = end - i < kDrawnBits ? end - i : kDrawnBits, vend = i + m / N * N;
      DrawBits<P, M>(a, i, m, bits);
      st.sr_begin = i;
      for (std::size_t j = i; j < vend; j += N) Body<P, W, G, M>(d, s, st, j, kSeq);
      if (vend < i + m) UpdateTail<P, W, G, M>(d, s, a, st, vend, i + m);
    }
    return;
  }
  for (; i + N <= end; i += N) Body<P, W, G, M>(d, s, st, i, kSeq);
  if (i < end) UpdateTail<P, W, G, M>(d, s, a, st, i, end);
}

// Phase 1 of a two-phase program (P: its part 0, jit::phase_program) over one chunk's
// elements [begin, begin + n) (begin a multiple of 32 within the tensor): the
// values and state stores per element, and per reduction slot the canonical sum
// of squares of docs/architecture.md §5, as the reduce pass computes a chunk's:
// element i into lane i mod 32 (32 / N vectors of N lanes), the last partial group
// zero-padded, then the fixed tree. sums[r]: slot r's sum (0 when not reduced).
template <const Program& P, DType W, DType G, int M>
void FusedPhase1(const UpdateArgs& a, std::size_t begin, std::size_t n, float* sums) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  constexpr std::size_t kLanes = 32, kN = hn::MaxLanes(d);
  static_assert(kLanes % kN == 0, "vector width must divide 32");
  constexpr std::size_t kVecs = kLanes / kN;
  constexpr auto kSeq = std::make_index_sequence<P.num_instrs>();
  V s[P.num_scalars > 0 ? P.num_scalars : 1];
  for (int k = 0; k < P.num_scalars; ++k) s[k] = hn::Set(d, a.scalars[k]);
  V acc[kVecs][kMaxNormSlots];
  for (auto& row : acc)
    for (V& x : row) x = hn::Zero(d);
  const Streams st = StreamsOf(a, begin);
  const std::size_t end = begin + n;
  std::size_t i = begin;
  for (; i + kLanes <= end; i += kLanes)
    for (std::size_t k = 0; k < kVecs; ++k) Body1<P, W, G, M, false>(d, s, st, i + k * kN, acc[k], kN, kSeq);
  if (i < end) {
    // The last (< 32) elements through zero-padded copies, the same vector bodies;
    // lanes past the end are masked out of the sums and not copied back.
    const std::size_t rem = end - i;
    alignas(64) float state_buf[kMaxStreams][kLanes] = {};
    alignas(64) float master_buf[kLanes] = {};
    alignas(64) float weight_buf[kLanes] = {};
    alignas(64) float grad_buf[kLanes] = {};
    const std::size_t wsize = dtype_size(W), gsize = dtype_size(G);
    std::memcpy(grad_buf, static_cast<const char*>(a.grad) + i * gsize, rem * gsize);
    std::memcpy(weight_buf, static_cast<const char*>(a.weight) + i * wsize, rem * wsize);
    constexpr std::size_t kMB = kMasterBytes<M>;
    if constexpr (kMB > 0) std::memcpy(master_buf, reinterpret_cast<const char*>(a.master) + i * kMB, rem * kMB);
    Streams tail{grad_buf, weight_buf, master_buf, {}, a.norms, nullptr, 0, 0};  // (no param store in phase 1)
    for (int k = 0; k < P.num_streams; ++k) {
      if (P.streams[k].role != StreamRole::state) continue;
      const std::size_t es = Bf16Stream<P, M>(k) ? 2 : 4;
      std::memcpy(state_buf[k], reinterpret_cast<const char*>(a.state[k]) + i * es, rem * es);
      tail.state[k] = state_buf[k];
    }
    for (std::size_t k = 0; k < kVecs; ++k) {
      const std::size_t live = rem > k * kN ? rem - k * kN : 0;
      Body1<P, W, G, M, true>(d, s, tail, k * kN, acc[k], live, kSeq);
    }
    constexpr unsigned kStored = StoredStreams<P>();
    for (int k = 0; k < P.num_streams; ++k) {
      if (!(kStored & (1u << k))) continue;
      if (P.streams[k].role == StreamRole::param) {  // (validation keeps the param out of phase 1)
        std::memcpy(static_cast<char*>(a.weight) + i * wsize, weight_buf, rem * wsize);
        if constexpr (kMB > 0) std::memcpy(reinterpret_cast<char*>(a.master) + i * kMB, master_buf, rem * kMB);
      } else {
        const std::size_t es = Bf16Stream<P, M>(k) ? 2 : 4;
        std::memcpy(reinterpret_cast<char*>(a.state[k]) + i * es, state_buf[k], rem * es);
      }
    }
  }
  for (int r = 0; r < kMaxNormSlots; ++r) {
    alignas(64) float lanes[kLanes];
    for (std::size_t k = 0; k < kVecs; ++k) hn::Store(acc[k][r], d, lanes + k * kN);
    for (std::size_t width = kLanes / 2; width >= 1; width /= 2)
      for (std::size_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    sums[r] = lanes[0];
  }
}

// A two-phase program's parts as programs of their own (compile-time data).
template <const Program& P>
inline constexpr Program kPart0 = jit::phase_program(P, 0);
template <const Program& P>
inline constexpr Program kPart1 = jit::phase_program(P, 1);

// The update kernel of P (phase 2 of a two-phase program) and its phase-1 kernel (null for one phase).
template <const Program& P, DType W, DType G, int M>
constexpr UpdateFn UpdateEntry() {
  if constexpr (jit::is_two_phase(P)) return &FusedUpdate<kPart1<P>, W, G, M>;
  else return &FusedUpdate<P, W, G, M>;
}
template <const Program& P, DType W, DType G, int M>
constexpr Phase1Fn Phase1Entry() {
  if constexpr (jit::is_two_phase(P)) return &FusedPhase1<kPart0<P>, W, G, M>;
  else return nullptr;
}

// Table of kernels for the programs Ps..., indexed [program][jit::DtypeCombo::index()]:
// weight-major, then grad, then masters (f32 weights have none); then the
// stochastically rounded bf16 weights, by grad; then the compensated ones, by grad.
static_assert(jit::DtypeCombo{DType::f16, DType::bf16, true}.index() == 11 &&
                  jit::DtypeCombo{DType::bf16, DType::f32, false}.index() == 12 &&
                  jit::DtypeCombo{DType::bf16, DType::f32, false, true}.index() == 18 &&
                  jit::DtypeCombo{DType::bf16, DType::f32, false, false, true}.index() == 21 &&
                  jit::kNumComboIndices == 24,
              "the rows below are in jit::DtypeCombo::index() order");
template <const Program&... Ps>
struct FusedTable {
  // Entry<P, W, G, M>() for every jit::DtypeCombo::index(), null where there is none.
  template <class Fn, template <const Program&, DType, DType, int> class Entry, const Program& P>
  static constexpr Fn Row(int combo) {
    constexpr int kP = kPlainWeights, kM = kMasterWeights, kS = kStochasticWeights, kC = kCompensatedWeights;
    constexpr int kB = kBf16State, kN = kNearestState;
    constexpr Fn fns[jit::kNumComboIndices + jit::kNumBf16StateCombos] = {
        Entry<P, DType::f32, DType::f32, kP>::get(),   nullptr,
        Entry<P, DType::f32, DType::f16, kP>::get(),   nullptr,
        Entry<P, DType::f32, DType::bf16, kP>::get(),  nullptr,
        Entry<P, DType::f16, DType::f32, kP>::get(),   Entry<P, DType::f16, DType::f32, kM>::get(),
        Entry<P, DType::f16, DType::f16, kP>::get(),   Entry<P, DType::f16, DType::f16, kM>::get(),
        Entry<P, DType::f16, DType::bf16, kP>::get(),  Entry<P, DType::f16, DType::bf16, kM>::get(),
        Entry<P, DType::bf16, DType::f32, kP>::get(),  Entry<P, DType::bf16, DType::f32, kM>::get(),
        Entry<P, DType::bf16, DType::f16, kP>::get(),  Entry<P, DType::bf16, DType::f16, kM>::get(),
        Entry<P, DType::bf16, DType::bf16, kP>::get(), Entry<P, DType::bf16, DType::bf16, kM>::get(),
        Entry<P, DType::bf16, DType::f32, kS>::get(),  Entry<P, DType::bf16, DType::f16, kS>::get(),
        Entry<P, DType::bf16, DType::bf16, kS>::get(),
        Entry<P, DType::bf16, DType::f32, kC>::get(),  Entry<P, DType::bf16, DType::f16, kC>::get(),
        Entry<P, DType::bf16, DType::bf16, kC>::get(),
        // bf16 state (jit::bf16_state_index's order)
        Entry<P, DType::f32, DType::f32, kP | kB>::get(),   Entry<P, DType::f32, DType::bf16, kP | kB>::get(),
        Entry<P, DType::bf16, DType::f32, kM | kB>::get(),  Entry<P, DType::bf16, DType::bf16, kM | kB>::get(),
        Entry<P, DType::bf16, DType::bf16, kP | kB>::get(), Entry<P, DType::bf16, DType::bf16, kS | kB>::get(),
        Entry<P, DType::bf16, DType::bf16, kC | kB>::get(), Entry<P, DType::bf16, DType::bf16, kS | kB | kN>::get(),
    };
    return fns[combo];
  }
  template <const Program& P, DType W, DType G, int M>
  struct UpdateOf {
    static constexpr UpdateFn get() { return UpdateEntry<P, W, G, M>(); }
  };
  template <const Program& P, DType W, DType G, int M>
  struct Phase1Of {
    static constexpr Phase1Fn get() { return Phase1Entry<P, W, G, M>(); }
  };
  template <class Fn, template <const Program&, DType, DType, int> class Entry>
  static Fn Lookup(int program, int combo) {
    constexpr Fn (*rows[])(int) = {&Row<Fn, Entry, Ps>...};
    if (program < 0 || program >= static_cast<int>(sizeof...(Ps))) return nullptr;
    if (combo < 0 || combo >= jit::kNumComboIndices + jit::kNumBf16StateCombos) return nullptr;
    return rows[program](combo);
  }
  // The update kernel (a two-phase program's phase 2).
  static UpdateFn Get(int program, int combo) { return Lookup<UpdateFn, UpdateOf>(program, combo); }
  // A two-phase program's phase-1 kernel; null for a one-phase program.
  static Phase1Fn GetPhase1(int program, int combo) { return Lookup<Phase1Fn, Phase1Of>(program, combo); }
};

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // STEPFUSE_CPU_FUSED_UPDATE_INL_H_
