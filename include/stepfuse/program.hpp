// Update programs: the small SSA IR in which every optimizer's math is written once.
//
// A program is a straight-line list of elementwise fp32 operations over named
// streams (the gradient, the parameter, optimizer state) and per-step scalars
// (learning rate, bias corrections, the gradient multiplier...). Every backend
// runs or compiles this one definition. Programs are literal types, so the
// built-in optimizers are `constexpr` data that a template evaluator unrolls
// into fused SIMD loops at compile time; the same data serves at run time.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "stepfuse/types.hpp"

namespace stepfuse {

inline constexpr int kMaxStreams = 8;
inline constexpr int kMaxScalars = 16;
inline constexpr int kMaxInstrs = 128;
// Per-tensor reduction slots of a two-phase program (reduce_sumsq, tensor_norm).
inline constexpr int kMaxNormSlots = 4;

enum class StreamRole : std::uint8_t {
  grad,   // the gradient: loaded (converted to fp32), never stored
  param,  // the parameter's fp32 value: the master copy when masters are kept
  state,  // optimizer state, fp32, owned by the optimizer
};

// What a state stream's values allow in storage (OptimizerOptions::state_format):
// the q8 format quantizes a non-negative stream with an unsigned code (twice the
// resolution), and a full-precision stream stays fp32 whatever the options say.
enum class StateValues : std::uint8_t {
  any,             // signed values (first moments, momentum buffers)
  nonnegative,     // never negative (second moments, sums of squares, step sizes)
  full_precision,  // needs fp32 (a running average of the weights, say)
};

struct StreamDecl {
  std::string_view name;
  StreamRole role = StreamRole::state;
  float init = 0.0f;  // initial value of a state stream
  StateValues values = StateValues::any;  // state streams only
};

enum class Op : std::uint8_t {
  load,      // v = stream[i]                         (stream = attr)
  store,     // stream[i] = a                         (stream = attr; produces no value)
  constant,  // v = imm
  scalar,    // v = scalars[attr]
  add, sub, mul, div,
  fma,       // v = a * b + c, one rounding (bitwise reproducible only where FMA is native)
  neg, abs, sqrt, max, min,
  sign,      // -1, 0 or +1 (NaN stays NaN)
  select,    // v = a != 0 ? b : c   (a is usually a comparison)
  cmp_lt, cmp_le, cmp_eq,  // v = 1.0 when true, else 0.0
  convert,   // v = a rounded to dtype attr (round to nearest even) and widened back
  // Two-phase programs (per-tensor reductions; docs/update-programs.md): phase 1
  // runs per element and sums squares per tensor, the sums are combined in the
  // canonical order, then phase 2 runs per element and reads each tensor's norms.
  phase,         // the phase marker: phase 1 before it, phase 2 after (no operands, no value)
  reduce_sumsq,  // phase 1: adds a * a to the tensor's sum of reduction slot attr (no value)
  tensor_norm,   // phase 2: v = sqrt(the tensor's sum of slot attr), in fp64, rounded to fp32
};
inline constexpr int kNumOps = static_cast<int>(Op::tensor_norm) + 1;

std::string_view op_name(Op op);

// How many value operands an op reads (0..3).
constexpr int op_arity(Op op) {
  switch (op) {
    case Op::load: case Op::constant: case Op::scalar: case Op::phase: case Op::tensor_norm: return 0;
    case Op::store: case Op::neg: case Op::abs: case Op::sqrt: case Op::sign: case Op::convert:
    case Op::reduce_sumsq: return 1;
    case Op::fma: case Op::select: return 3;
    default: return 2;
  }
}
constexpr bool op_has_value(Op op) { return op != Op::store && op != Op::phase && op != Op::reduce_sumsq; }

// One instruction. The value it produces has the instruction's index as its id.
struct Instr {
  Op op = Op::constant;
  std::uint8_t attr = 0;   // stream index, scalar index, dtype or reduction slot
  std::uint16_t a = 0, b = 0, c = 0;  // operand value ids
  float imm = 0.0f;
};

struct Program {
  std::string_view name;
  StreamDecl streams[kMaxStreams] = {};
  std::string_view scalars[kMaxScalars] = {};
  Instr code[kMaxInstrs] = {};
  std::uint8_t num_streams = 0;
  std::uint8_t num_scalars = 0;
  std::uint16_t num_instrs = 0;

  constexpr int grad_stream() const { return find_role(StreamRole::grad); }
  constexpr int param_stream() const { return find_role(StreamRole::param); }
  constexpr int find_role(StreamRole role) const {
    for (int s = 0; s < num_streams; ++s)
      if (streams[s].role == role) return s;
    return -1;
  }
  constexpr int find_scalar(std::string_view n) const {
    for (int s = 0; s < num_scalars; ++s)
      if (scalars[s] == n) return s;
    return -1;
  }
  constexpr int find_stream(std::string_view n) const {
    for (int s = 0; s < num_streams; ++s)
      if (streams[s].name == n) return s;
    return -1;
  }
};

// The first problem found in a program, or nullptr when it is well formed.
// `where` receives the offending instruction (or -1 for a declaration problem).
// Usable at compile time: a built-in with a problem fails to compile.
constexpr const char* find_problem(const Program& p, int* where);

// Throws Error(invalid_argument) naming the program, the instruction and the problem.
void validate(const Program& program);

// Human-readable listing, one instruction a line:
//   %3 = mul %1, %2        ; e.g.
std::string to_string(const Program& program);

// A value in a program under construction.
struct Value {
  std::uint16_t id = 0;
};
struct Stream {
  std::uint8_t index = 0;
};

// Builds a program one op at a time; every method is constexpr, so a program
// can be built at compile time (the built-ins are) or at run time.
//
//   ProgramBuilder b("sgd");
//   auto g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
//   auto lr = b.scalar("lr");
//   b.store(p, b.sub(b.load(p), b.mul(lr, b.load(g))));
//   Program prog = b.build();   // validates
class ProgramBuilder {
 public:
  constexpr explicit ProgramBuilder(std::string_view name) { p_.name = name; }

  constexpr Stream stream(std::string_view name, StreamRole role, float init = 0.0f,
                          StateValues values = StateValues::any) {
    if (p_.num_streams >= kMaxStreams) {
      note_overflow("too many streams", name);
      return Stream{0};
    }
    p_.streams[p_.num_streams] = {name, role, init, values};
    return Stream{p_.num_streams++};
  }
  // Declares (or finds) a named per-step scalar and returns its value.
  constexpr Value scalar(std::string_view name) {
    int s = p_.find_scalar(name);
    if (s < 0) {
      if (p_.num_scalars >= kMaxScalars) { note_overflow("too many scalars", name); s = 0; }
      else { s = p_.num_scalars; p_.scalars[p_.num_scalars++] = name; }
    }
    return emit({Op::scalar, static_cast<std::uint8_t>(s)});
  }
  constexpr Value load(Stream s) { return emit({Op::load, s.index}); }
  constexpr void store(Stream s, Value v) { emit({Op::store, s.index, v.id}); }
  constexpr Value constant(float x) { Instr i{Op::constant}; i.imm = x; return emit(i); }
  constexpr Value add(Value a, Value b) { return emit({Op::add, 0, a.id, b.id}); }
  constexpr Value sub(Value a, Value b) { return emit({Op::sub, 0, a.id, b.id}); }
  constexpr Value mul(Value a, Value b) { return emit({Op::mul, 0, a.id, b.id}); }
  constexpr Value div(Value a, Value b) { return emit({Op::div, 0, a.id, b.id}); }
  constexpr Value fma(Value a, Value b, Value c) { return emit({Op::fma, 0, a.id, b.id, c.id}); }
  constexpr Value neg(Value a) { return emit({Op::neg, 0, a.id}); }
  constexpr Value abs(Value a) { return emit({Op::abs, 0, a.id}); }
  constexpr Value sqrt(Value a) { return emit({Op::sqrt, 0, a.id}); }
  constexpr Value max(Value a, Value b) { return emit({Op::max, 0, a.id, b.id}); }
  constexpr Value min(Value a, Value b) { return emit({Op::min, 0, a.id, b.id}); }
  constexpr Value sign(Value a) { return emit({Op::sign, 0, a.id}); }
  constexpr Value select(Value cond, Value t, Value f) { return emit({Op::select, 0, cond.id, t.id, f.id}); }
  constexpr Value lt(Value a, Value b) { return emit({Op::cmp_lt, 0, a.id, b.id}); }
  constexpr Value le(Value a, Value b) { return emit({Op::cmp_le, 0, a.id, b.id}); }
  constexpr Value eq(Value a, Value b) { return emit({Op::cmp_eq, 0, a.id, b.id}); }
  constexpr Value convert(Value a, DType to) {
    return emit({Op::convert, static_cast<std::uint8_t>(to), a.id});
  }
  // Two-phase programs: the phase marker, and the per-tensor reductions it
  // separates. reduce_sumsq (phase 1) adds v * v to the tensor's sum of `slot`
  // (0 .. kMaxNormSlots - 1); tensor_norm (phase 2) is the square root of that
  // sum, the same value for every element of the tensor. Phase-1 values do not
  // cross the marker: phase 2 loads (stored state reads as stored) or recomputes.
  constexpr void phase() { emit({Op::phase}); }
  constexpr void reduce_sumsq(int slot, Value v) { emit({Op::reduce_sumsq, slot_attr(slot), v.id}); }
  constexpr Value tensor_norm(int slot) { return emit({Op::tensor_norm, slot_attr(slot)}); }

  // The finished program. At compile time a malformed program is a compile
  // error; at run time it throws Error(invalid_argument) saying what is wrong.
  constexpr Program build() const {
    if (overflow_ != nullptr) fail(p_.name, overflow_, overflow_name_, overflow_op_, overflow_index_);
    int where = -1;
    if (find_problem(p_, &where) != nullptr) fail_validate(p_);
    return p_;
  }

 private:
  constexpr Value emit(Instr i) {
    if (p_.num_instrs >= kMaxInstrs) {
      if (overflow_ == nullptr) overflow_ = "too many instructions", overflow_op_ = i.op, overflow_index_ = attempted_;
      ++attempted_;
      return Value{0};
    }
    ++attempted_;
    p_.code[p_.num_instrs] = i;
    return Value{p_.num_instrs++};
  }
  // A slot that does not fit the attr byte becomes 255, which validation rejects.
  static constexpr std::uint8_t slot_attr(int slot) {
    return slot >= 0 && slot < 255 ? static_cast<std::uint8_t>(slot) : std::uint8_t{255};
  }
  // Remembers the first capacity overflow (a stream or scalar declaration), for build().
  constexpr void note_overflow(const char* what, std::string_view name) {
    if (overflow_ != nullptr) return;
    overflow_ = what, overflow_name_ = name, overflow_index_ = attempted_;
  }
  // Says which declaration or instruction went over which limit: the op's name and
  // index for instructions, the name for streams and scalars.
  [[noreturn]] static void fail(std::string_view program, const char* what, std::string_view name, Op op, int index);
  [[noreturn]] static void fail_validate(const Program& p);

  Program p_{};
  const char* overflow_ = nullptr;
  std::string_view overflow_name_;  // the stream or scalar that did not fit
  Op overflow_op_ = Op::constant;   // the instruction that did not fit
  int overflow_index_ = 0;          // its index (instructions emitted before it)
  int attempted_ = 0;               // instructions emitted, including those that did not fit
};

constexpr const char* find_problem(const Program& p, int* where) {
  *where = -1;
  if (p.name.empty()) return "the program has no name";
  if (p.num_streams > kMaxStreams || p.num_scalars > kMaxScalars || p.num_instrs > kMaxInstrs)
    return "a count exceeds the fixed capacity";
  int grads = 0, params = 0;
  for (int s = 0; s < p.num_streams; ++s) {
    if (p.streams[s].name.empty()) return "a stream has an empty name";
    // Every enum field is checked where a program enters: a value outside the enumerators
    // (a cast, a byte from a file) would otherwise reach the backends.
    if (static_cast<int>(p.streams[s].role) > static_cast<int>(StreamRole::state)) return "a stream has an unknown role";
    if (static_cast<int>(p.streams[s].values) > static_cast<int>(StateValues::full_precision))
      return "a stream has unknown StateValues";
    if (p.streams[s].role != StreamRole::state && p.streams[s].values != StateValues::any)
      return "a grad or param stream has StateValues other than any (they describe state streams)";
    for (int t = 0; t < s; ++t)
      if (p.streams[t].name == p.streams[s].name) return "two streams have the same name";
    grads += p.streams[s].role == StreamRole::grad;
    params += p.streams[s].role == StreamRole::param;
  }
  if (grads != 1) return "a program needs exactly one stream with role grad";
  if (params != 1) return "a program needs exactly one stream with role param";
  for (int s = 0; s < p.num_scalars; ++s)
    if (p.scalars[s].empty()) return "a scalar has an empty name";
  bool stored[kMaxStreams] = {};        // stored anywhere so far
  bool stored_phase[kMaxStreams] = {};  // stored in the current phase (a later load there is an error)
  bool param_stored = false;
  int phase_at = -1, param_store_at = -1, first_reduce = -1;
  bool reduced[kMaxNormSlots] = {};
  for (int i = 0; i < p.num_instrs; ++i) {
    *where = i;
    const Instr& in = p.code[i];
    if (static_cast<int>(in.op) >= kNumOps) return "unknown op";
    const int n = op_arity(in.op);
    const std::uint16_t ops[3] = {in.a, in.b, in.c};
    for (int k = 0; k < n; ++k) {
      if (ops[k] >= i) return "an operand refers to a value not yet defined (operands must come earlier)";
      if (p.code[ops[k]].op == Op::store) return "an operand refers to a store, which has no value";
      if (!op_has_value(p.code[ops[k]].op))
        return "an operand refers to the phase marker or a reduce_sumsq, which have no value";
      if (ops[k] < phase_at)
        return "an operand refers to a phase-1 value (values do not cross the phase marker: load or compute it again in phase 2)";
    }
    if (in.op == Op::load || in.op == Op::store) {
      if (in.attr >= p.num_streams) return "the stream index is out of range";
      if (in.op == Op::load && stored_phase[in.attr])
        return "a load follows a store to the same stream (use the stored value instead)";
      if (in.op == Op::store) {
        if (p.streams[in.attr].role == StreamRole::grad) return "the grad stream is read-only";
        if (stored[in.attr]) return "a stream is stored twice";
        stored[in.attr] = stored_phase[in.attr] = true;
        if (p.streams[in.attr].role == StreamRole::param) param_stored = true, param_store_at = i;
      }
    }
    if (in.op == Op::scalar && in.attr >= p.num_scalars) return "the scalar index is out of range";
    if (in.op == Op::convert && in.attr > static_cast<int>(DType::bf16)) return "convert to an unknown dtype";
    if (in.attr != 0 && in.op != Op::load && in.op != Op::store && in.op != Op::scalar && in.op != Op::convert &&
        in.op != Op::reduce_sumsq && in.op != Op::tensor_norm)
      return "the op takes no stream, scalar, dtype or slot, but its attr is not 0";
    if (in.op == Op::phase) {
      if (phase_at >= 0) return "a program has at most one phase marker";
      phase_at = i;
      for (bool& s : stored_phase) s = false;  // phase 2 loads what phase 1 stored
    }
    if (in.op == Op::reduce_sumsq || in.op == Op::tensor_norm) {
      if (in.attr >= kMaxNormSlots) return "the reduction slot is out of range";
      if (in.op == Op::reduce_sumsq) {
        if (phase_at >= 0)
          return "reduce_sumsq after the phase marker (reductions belong to phase 1; phase 2 reads their norms)";
        if (reduced[in.attr]) return "a reduction slot is reduced twice (add the values first, or use another slot)";
        reduced[in.attr] = true;
        if (first_reduce < 0) first_reduce = i;
      } else {
        if (phase_at < 0) return "tensor_norm before the phase marker (a tensor's norms are known in phase 2 only)";
        if (!reduced[in.attr]) return "tensor_norm reads a slot that phase 1 never reduces";
      }
    }
  }
  *where = -1;
  if (!param_stored) return "the program never stores the param stream";
  if (phase_at >= 0 && param_store_at < phase_at) {
    *where = param_store_at;
    return "the param stream is stored in phase 1 (with a phase marker the param is stored in phase 2, once the "
           "per-tensor norms are known)";
  }
  if (first_reduce >= 0 && phase_at < 0) {
    *where = first_reduce;
    return "reduce_sumsq without a phase marker after it (its per-tensor norm could never be read)";
  }
  if (phase_at >= 0 && first_reduce < 0) {
    *where = phase_at;
    return "a phase marker without a reduce_sumsq before it (phase 2 would have no norm to read)";
  }
  return nullptr;
}

}  // namespace stepfuse
