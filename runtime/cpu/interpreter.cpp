// The blocked interpreter's op loops (Highway, every target) and its driver.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/interpreter.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "runtime/cpu/convert-inl.h"
#include "runtime/cpu/interpreter.hpp"
#include "runtime/cpu/vector_ops-inl.h"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using jit::LKind;

template <bool kScalar, class D>
HWY_INLINE hn::Vec<D> Ld(D d, const ExecSrc& s, std::size_t i) {
  if constexpr (kScalar) return hn::Set(d, s.s);
  else return hn::LoadU(d, s.p + i);
}

// Runs body(src, dst, i) over full vectors, then once over a zero-padded copy
// of the tail, so every element gets the same vector arithmetic.
template <class Body>
HWY_INLINE void Loop(const ExecSrc* src, int nsrc, float* dst, std::size_t n, const Body& body) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) body(src, dst, i);
  if (i == n) return;
  constexpr std::size_t kMax = hn::MaxLanes(d);
  alignas(64) float buf[5][kMax] = {};
  ExecSrc staged[4];
  for (int k = 0; k < nsrc; ++k) {
    staged[k] = src[k];
    if (src[k].p != nullptr) {
      std::memcpy(buf[k], src[k].p + i, (n - i) * sizeof(float));
      staged[k].p = buf[k];
    }
  }
  body(staged, buf[4], 0);
  std::memcpy(dst + i, buf[4], (n - i) * sizeof(float));
}

// Calls f.template operator()<S0, ..., S(K-1)>() with Sk = "operand k is a scalar".
template <int K, bool... Bs, class F>
HWY_INLINE void WithScalarFlags(const ExecSrc* s, const F& f) {
  if constexpr (K == 0) {
    f.template operator()<Bs...>();
  } else {
    if (s[K - 1].p == nullptr) WithScalarFlags<K - 1, true, Bs...>(s, f);
    else WithScalarFlags<K - 1, false, Bs...>(s, f);
  }
}

template <Op kOp, std::uint8_t kAttr>
void RunUnary(const ExecCall& c, std::size_t n) {
  const hn::ScalableTag<float> d;
  WithScalarFlags<1>(c.src, [&]<bool S0>() {
    Loop(c.src, 1, c.dst, n, [&](const ExecSrc* s, float* dst, std::size_t i) {
      hn::StoreU(Unary<kOp, kAttr>(d, Ld<S0>(d, s[0], i)), d, dst + i);
    });
  });
}

template <Op kOp>
void RunBinary(const ExecCall& c, std::size_t n) {
  const hn::ScalableTag<float> d;
  WithScalarFlags<2>(c.src, [&]<bool S0, bool S1>() {
    Loop(c.src, 2, c.dst, n, [&](const ExecSrc* s, float* dst, std::size_t i) {
      hn::StoreU(Binary<kOp>(d, Ld<S0>(d, s[0], i), Ld<S1>(d, s[1], i)), d, dst + i);
    });
  });
}

template <Op kOp>
void RunTernary(const ExecCall& c, std::size_t n) {
  const hn::ScalableTag<float> d;
  WithScalarFlags<3>(c.src, [&]<bool S0, bool S1, bool S2>() {
    Loop(c.src, 3, c.dst, n, [&](const ExecSrc* s, float* dst, std::size_t i) {
      hn::StoreU(Ternary<kOp>(d, Ld<S0>(d, s[0], i), Ld<S1>(d, s[1], i), Ld<S2>(d, s[2], i)), d, dst + i);
    });
  });
}

// Superinstructions: the same roundings as the separate ops they replace.
template <LKind kKind>
void RunFused(const ExecCall& c, std::size_t n) {
  const hn::ScalableTag<float> d;
  if constexpr (kKind == LKind::axpby) {
    WithScalarFlags<4>(c.src, [&]<bool S0, bool S1, bool S2, bool S3>() {
      Loop(c.src, 4, c.dst, n, [&](const ExecSrc* s, float* dst, std::size_t i) {
        const auto ab = hn::Mul(Ld<S0>(d, s[0], i), Ld<S1>(d, s[1], i));
        const auto cd = hn::Mul(Ld<S2>(d, s[2], i), Ld<S3>(d, s[3], i));
        hn::StoreU(hn::Add(ab, cd), d, dst + i);
      });
    });
  } else {
    WithScalarFlags<3>(c.src, [&]<bool S0, bool S1, bool S2>() {
      Loop(c.src, 3, c.dst, n, [&](const ExecSrc* s, float* dst, std::size_t i) {
        const auto ab = hn::Mul(Ld<S0>(d, s[0], i), Ld<S1>(d, s[1], i));
        const auto r = kKind == LKind::madd ? hn::Add(ab, Ld<S2>(d, s[2], i)) : hn::Sub(Ld<S2>(d, s[2], i), ab);
        hn::StoreU(r, d, dst + i);
      });
    });
  }
}

// lanes[i mod 32] += x[i] * x[i] for i < n, in element order (the reduce pass's
// canonical lanes: element i of a chunk into lane i mod 32; a partial last group
// zero-padded, which adds nothing). The lanes are 32 / Lanes(d) vectors.
void RunReduce(const ExecCall& c, std::size_t n) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  constexpr std::size_t kLanes = 32, kN = hn::MaxLanes(d);
  static_assert(kLanes % kN == 0, "vector width must divide 32");
  constexpr std::size_t kVecs = kLanes / kN;
  V acc[kVecs];
  for (std::size_t k = 0; k < kVecs; ++k) acc[k] = hn::LoadU(d, c.lanes + k * kN);
  const ExecSrc& s = c.src[0];
  const auto group = [&](const float* x) {
    for (std::size_t k = 0; k < kVecs; ++k) {
      const V v = hn::LoadU(d, x + k * kN);
      acc[k] = hn::Add(acc[k], hn::Mul(v, v));
    }
  };
  alignas(64) float buf[kLanes];
  std::size_t i = 0;
  if (s.p == nullptr) std::fill_n(buf, kLanes, s.s);
  for (; i + kLanes <= n; i += kLanes) group(s.p != nullptr ? s.p + i : buf);
  if (i < n) {
    if (s.p != nullptr) std::memcpy(buf, s.p + i, (n - i) * sizeof(float));
    std::fill(buf + (n - i), buf + kLanes, 0.0f);
    group(buf);
  }
  for (std::size_t k = 0; k < kVecs; ++k) hn::StoreU(acc[k], d, c.lanes + k * kN);
}

void RunCopy(const ExecCall& c, std::size_t n) {
  if (c.src[0].p == nullptr) std::fill_n(c.dst, n, c.src[0].s);
  else if (c.src[0].p != c.dst) std::memmove(c.dst, c.src[0].p, n * sizeof(float));
}

void Exec(const ExecCall& c, std::size_t n) {
  switch (c.kind) {
    case LKind::unary:
      switch (c.op) {
        case Op::neg: return RunUnary<Op::neg, 0>(c, n);
        case Op::abs: return RunUnary<Op::abs, 0>(c, n);
        case Op::sqrt: return RunUnary<Op::sqrt, 0>(c, n);
        case Op::sign: return RunUnary<Op::sign, 0>(c, n);
        case Op::convert:
          if (c.attr == static_cast<int>(DType::f16)) return RunUnary<Op::convert, 1>(c, n);
          if (c.attr == static_cast<int>(DType::bf16)) return RunUnary<Op::convert, 2>(c, n);
          return RunUnary<Op::convert, 0>(c, n);
        default: return;
      }
    case LKind::binary:
      switch (c.op) {
        case Op::add: return RunBinary<Op::add>(c, n);
        case Op::sub: return RunBinary<Op::sub>(c, n);
        case Op::mul: return RunBinary<Op::mul>(c, n);
        case Op::div: return RunBinary<Op::div>(c, n);
        case Op::max: return RunBinary<Op::max>(c, n);
        case Op::min: return RunBinary<Op::min>(c, n);
        case Op::cmp_lt: return RunBinary<Op::cmp_lt>(c, n);
        case Op::cmp_le: return RunBinary<Op::cmp_le>(c, n);
        case Op::cmp_eq: return RunBinary<Op::cmp_eq>(c, n);
        default: return;
      }
    case LKind::ternary:
      if (c.op == Op::fma) return RunTernary<Op::fma>(c, n);
      return RunTernary<Op::select>(c, n);
    case LKind::madd: return RunFused<LKind::madd>(c, n);
    case LKind::msub: return RunFused<LKind::msub>(c, n);
    case LKind::axpby: return RunFused<LKind::axpby>(c, n);
    // The storage conversions of runtime/cpu/convert.cpp (f32 included).
    case LKind::widen:
      if (c.comp != nullptr) return widen_compensated(static_cast<const std::uint16_t*>(c.lp_src), c.comp, c.dst, n);
      return widen(c.lp_type, c.lp_src, c.dst, n);
    case LKind::narrow:
      if (c.comp != nullptr) return narrow_compensated(c.src[0].p, static_cast<std::uint16_t*>(c.lp_dst), c.comp, n);
      if (c.stochastic)
        return narrow_bf16_stochastic(c.src[0].p, static_cast<std::uint16_t*>(c.lp_dst), n, c.sr_seed, c.sr_step, c.sr_first);
      return narrow(c.src[0].p, c.lp_type, c.lp_dst, n);
    case LKind::copy: return RunCopy(c, n);
    case LKind::reduce: return RunReduce(c, n);
  }
}

ExecFn GetExec() { return &Exec; }

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace stepfuse::cpu {
HWY_EXPORT(GetExec);

Interpreter::Interpreter(const Program& program, DType weight, DType grad, bool masters, bool stochastic,
                         bool compensated)
    : lowered_(jit::lower(program, weight, grad, masters)),
      weight_(weight),
      grad_(grad),
      stochastic_(stochastic),
      compensated_(compensated),
      exec_(HWY_DYNAMIC_DISPATCH(GetExec)()) {}

ExecCall Interpreter::resolve(const jit::LInstr& li, const UpdateArgs& a, std::size_t begin, float* const* slots,
                              float* lanes) const {
  using K = jit::LOperand::Kind;
  const auto at = [&](const jit::LOperand& o) -> float* {
    switch (o.kind) {
      case K::slot: return slots[o.index];
      case K::grad: return const_cast<float*>(static_cast<const float*>(a.grad)) + begin;
      case K::param: return (a.master != nullptr ? a.master : static_cast<float*>(a.weight)) + begin;  // (f32 only)
      case K::state: return a.state[o.index] + begin;
      default: return nullptr;
    }
  };
  ExecCall c;
  c.kind = li.kind;
  c.op = li.op;
  c.attr = li.attr;
  c.dst = at(li.dst);
  for (int k = 0; k < li.num_src; ++k) {
    const jit::LOperand& o = li.src[k];
    if (o.kind == K::scalar) c.src[k] = {nullptr, a.scalars[o.index]};
    else if (o.kind == K::constant) c.src[k] = {nullptr, o.imm};
    else if (o.kind == K::norm) c.src[k] = {nullptr, a.norms[o.index]};
    else c.src[k] = {at(o), 0.0f};
  }
  if (li.kind == jit::LKind::widen) {
    const bool is_grad = li.src[0].kind == K::grad;
    c.lp_type = is_grad ? grad_ : weight_;
    c.lp_src = static_cast<const char*>(is_grad ? a.grad : a.weight) + begin * dtype_size(c.lp_type);
    if (!is_grad && compensated_) c.comp = reinterpret_cast<std::uint16_t*>(a.master) + begin;
  } else if (li.kind == jit::LKind::narrow) {
    c.lp_type = weight_;
    c.lp_dst = static_cast<char*>(a.weight) + begin * dtype_size(weight_);
    if (stochastic_) c.stochastic = true, c.sr_seed = a.sr_seed, c.sr_step = a.sr_step, c.sr_first = a.sr_base + begin;
    if (compensated_) c.comp = reinterpret_cast<std::uint16_t*>(a.master) + begin;
  } else if (li.kind == jit::LKind::reduce) {
    c.lanes = lanes + static_cast<std::size_t>(li.attr) * 32;
  }
  return c;
}

void Interpreter::run_blocked(const UpdateArgs& args, std::size_t begin, std::size_t n, float* scratch) const {
  float* slots[kMaxInstrs];
  for (int s = 0; s < lowered_.num_slots; ++s) slots[s] = scratch + static_cast<std::size_t>(s) * kBlock;
  const auto first = lowered_.code.begin() + lowered_.phase2_begin;
  for (std::size_t b = begin; b < begin + n; b += kBlock) {
    const std::size_t len = begin + n - b < kBlock ? begin + n - b : kBlock;
    for (auto li = first; li != lowered_.code.end(); ++li) exec_(resolve(*li, args, b, slots), len);
  }
}

void Interpreter::run_phase1_blocked(const UpdateArgs& args, std::size_t begin, std::size_t n, float* scratch,
                                     float* sums) const {
  static_assert(kBlock % 32 == 0, "every block starts at lane 0 of the canonical reduce lanes");
  float* slots[kMaxInstrs];
  for (int s = 0; s < lowered_.num_slots; ++s) slots[s] = scratch + static_cast<std::size_t>(s) * kBlock;
  alignas(64) float lanes[kMaxNormSlots * 32] = {};
  const auto last = lowered_.code.begin() + lowered_.phase2_begin;
  for (std::size_t b = begin; b < begin + n; b += kBlock) {
    const std::size_t len = begin + n - b < kBlock ? begin + n - b : kBlock;
    for (auto li = lowered_.code.begin(); li != last; ++li) exec_(resolve(*li, args, b, slots, lanes), len);
  }
  for (int r = 0; r < kMaxNormSlots; ++r) sums[r] = canonical_lane_tree(lanes + r * 32);
}

void Interpreter::run_op(int k, const UpdateArgs& args, std::size_t begin, std::size_t n, float* const* slots,
                         float* lanes) const {
  exec_(resolve(lowered_.code[k], args, begin, slots, lanes), n);
}

float canonical_lane_tree(float* lanes) {
  for (int width = 16; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

InterpreterSet::InterpreterSet(const std::vector<const Program*>& tensor_programs, const jit::Layout& layout,
                               bool f32_grads) {
  std::vector<std::pair<const Program*, int>> keys;  // per interpreter: (program, combo index)
  for (std::size_t t = 0; t < layout.tensor_combo.size(); ++t) {
    jit::DtypeCombo c = layout.combos[static_cast<std::size_t>(layout.tensor_combo[t])];
    if (f32_grads) c.grad = DType::f32;
    const std::pair key{tensor_programs[t], c.index()};
    auto it = std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) {
      keys.push_back(key);
      interpreters_.push_back(std::make_unique<Interpreter>(*key.first, c.weight, c.grad, c.master, c.stochastic,
                                                                    c.compensated));
      max_slots_ = std::max(max_slots_, interpreters_.back()->num_slots());
      it = keys.end() - 1;
    }
    group_of_tensor_.push_back(static_cast<std::size_t>(it - keys.begin()));
  }
}

}  // namespace stepfuse::cpu
#endif
