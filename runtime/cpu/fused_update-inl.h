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
#include "runtime/cpu/convert-inl.h"
#include "runtime/cpu/kernels.hpp"
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
};

// Executes instruction I of program P on lanes [i, i + Lanes(d)).
template <const Program& P, int I, DType W, DType G, bool M, class D, class V>
HWY_INLINE void Exec(D d, V* v, const V* s, const Streams& st, std::size_t i) {
  constexpr Instr in = P.code[I];
  if constexpr (in.op == Op::load) {
    constexpr StreamRole role = P.streams[in.attr].role;
    if constexpr (role == StreamRole::grad) v[I] = LoadAs<G>(d, st.grad, i);
    else if constexpr (role == StreamRole::param && M) v[I] = hn::LoadU(d, st.master + i);
    else if constexpr (role == StreamRole::param) v[I] = LoadAs<W>(d, st.weight, i);
    else v[I] = hn::LoadU(d, st.state[in.attr] + i);
  } else if constexpr (in.op == Op::store) {
    constexpr StreamRole role = P.streams[in.attr].role;
    if constexpr (role == StreamRole::param) {
      if constexpr (M) hn::StoreU(v[in.a], d, st.master + i);
      StoreAs<W>(d, v[in.a], st.weight, i);
    } else {
      hn::StoreU(v[in.a], d, st.state[in.attr] + i);
    }
  } else if constexpr (in.op == Op::constant) {
    v[I] = hn::Set(d, in.imm);
  } else if constexpr (in.op == Op::scalar) {
    v[I] = s[in.attr];
  } else if constexpr (op_arity(in.op) == 1) {
    v[I] = Unary<in.op, in.attr>(d, v[in.a]);
  } else if constexpr (op_arity(in.op) == 2) {
    v[I] = Binary<in.op>(d, v[in.a], v[in.b]);
  } else {
    v[I] = Ternary<in.op>(d, v[in.a], v[in.b], v[in.c]);
  }
}

template <const Program& P, DType W, DType G, bool M, class D, class V, std::size_t... I>
HWY_INLINE void Body(D d, const V* s, const Streams& st, std::size_t i, std::index_sequence<I...>) {
  V v[sizeof...(I)];
  (Exec<P, static_cast<int>(I), W, G, M>(d, v, s, st, i), ...);
}

// Streams the program stores, as a bit mask (the tail copies only these back).
template <const Program& P>
constexpr unsigned StoredStreams() {
  unsigned mask = 0;
  for (int i = 0; i < P.num_instrs; ++i)
    if (P.code[i].op == Op::store) mask |= 1u << P.code[i].attr;
  return mask;
}

template <const Program& P, DType W, DType G, bool M>
void FusedUpdate(const UpdateArgs& a, std::size_t begin, std::size_t n) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  constexpr auto kSeq = std::make_index_sequence<P.num_instrs>();
  const std::size_t N = hn::Lanes(d);
  V s[P.num_scalars > 0 ? P.num_scalars : 1];
  for (int k = 0; k < P.num_scalars; ++k) s[k] = hn::Set(d, a.scalars[k]);
  const Streams st{a.grad, a.weight, a.master,
                   {a.state[0], a.state[1], a.state[2], a.state[3], a.state[4], a.state[5], a.state[6], a.state[7]}};
  const std::size_t end = begin + n;
  std::size_t i = begin;
  for (; i + N <= end; i += N) Body<P, W, G, M>(d, s, st, i, kSeq);
  if (i == end) return;

  // Tail: stage the last (< N) elements through zero-padded buffers and run the
  // same vector body, so every element gets bitwise the same arithmetic.
  constexpr std::size_t kMax = hn::MaxLanes(d);
  const std::size_t rem = end - i;
  alignas(64) float state_buf[kMaxStreams][kMax] = {};
  alignas(64) float master_buf[kMax] = {};
  alignas(64) float weight_buf[kMax] = {};  // big enough for any weight dtype
  alignas(64) float grad_buf[kMax] = {};
  const std::size_t wsize = dtype_size(W), gsize = dtype_size(G);
  std::memcpy(grad_buf, static_cast<const char*>(a.grad) + i * gsize, rem * gsize);
  std::memcpy(weight_buf, static_cast<const char*>(a.weight) + i * wsize, rem * wsize);
  if constexpr (M) std::memcpy(master_buf, a.master + i, rem * sizeof(float));
  Streams tail{grad_buf, weight_buf, master_buf, {}};
  for (int k = 0; k < P.num_streams; ++k) {
    if (P.streams[k].role != StreamRole::state) continue;
    std::memcpy(state_buf[k], a.state[k] + i, rem * sizeof(float));
    tail.state[k] = state_buf[k];
  }
  Body<P, W, G, M>(d, s, tail, 0, kSeq);
  constexpr unsigned kStored = StoredStreams<P>();
  for (int k = 0; k < P.num_streams; ++k) {
    if (!(kStored & (1u << k))) continue;
    if (P.streams[k].role == StreamRole::param) {
      std::memcpy(static_cast<char*>(a.weight) + i * wsize, weight_buf, rem * wsize);
      if constexpr (M) std::memcpy(a.master + i, master_buf, rem * sizeof(float));
    } else {
      std::memcpy(a.state[k] + i, state_buf[k], rem * sizeof(float));
    }
  }
}

// Table of kernels for the programs Ps..., indexed [program][jit::DtypeCombo::index()]:
// weight-major, then grad, then masters (f32 weights have none).
static_assert(jit::DtypeCombo{DType::f16, DType::bf16, true}.index() == 11 &&
                  jit::DtypeCombo{DType::bf16, DType::f32, false}.index() == 12,
              "the rows below are in jit::DtypeCombo::index() order");
template <const Program&... Ps>
struct FusedTable {
  template <const Program& P>
  static constexpr UpdateFn Row(int combo) {
    constexpr UpdateFn fns[jit::kNumComboIndices] = {
        &FusedUpdate<P, DType::f32, DType::f32, false>,   nullptr,
        &FusedUpdate<P, DType::f32, DType::f16, false>,   nullptr,
        &FusedUpdate<P, DType::f32, DType::bf16, false>,  nullptr,
        &FusedUpdate<P, DType::f16, DType::f32, false>,   &FusedUpdate<P, DType::f16, DType::f32, true>,
        &FusedUpdate<P, DType::f16, DType::f16, false>,   &FusedUpdate<P, DType::f16, DType::f16, true>,
        &FusedUpdate<P, DType::f16, DType::bf16, false>,  &FusedUpdate<P, DType::f16, DType::bf16, true>,
        &FusedUpdate<P, DType::bf16, DType::f32, false>,  &FusedUpdate<P, DType::bf16, DType::f32, true>,
        &FusedUpdate<P, DType::bf16, DType::f16, false>,  &FusedUpdate<P, DType::bf16, DType::f16, true>,
        &FusedUpdate<P, DType::bf16, DType::bf16, false>, &FusedUpdate<P, DType::bf16, DType::bf16, true>,
    };
    return fns[combo];
  }
  static UpdateFn Get(int program, int combo) {
    constexpr UpdateFn (*rows[])(int) = {&Row<Ps>...};
    if (program < 0 || program >= static_cast<int>(sizeof...(Ps))) return nullptr;
    if (combo < 0 || combo >= jit::kNumComboIndices) return nullptr;
    return rows[program](combo);
  }
};

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // STEPFUSE_CPU_FUSED_UPDATE_INL_H_
