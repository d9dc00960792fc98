// Lowering of an update program for the blocked interpreter and the unfused
// baseline: operands resolved to streams, slots, scalars or constants; common
// op chains fused into superinstructions; temporaries packed into few slots.
// And the phases of a two-phase program (per-tensor reductions), as every
// backend splits them: each phase is a one-phase program of its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "stepfuse/program.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::jit {

enum class LKind : std::uint8_t {
  unary,    // dst = op(a)
  binary,   // dst = op(a, b)
  ternary,  // dst = op(a, b, c)           (fma, select)
  madd,     // dst = a*b + c               (mul and add rounded separately, as in the program)
  msub,     // dst = c - a*b
  axpby,    // dst = a*b + c*d
  widen,    // dst = the f16/bf16 stream `attr` (grad or weight) as fp32
  narrow,   // weight stream (f16/bf16) = a, rounded to nearest even
  copy,     // dst = a
  reduce,   // phase 1: the sum of squares of reduction slot `attr` += a * a (canonical lanes; no dst)
};

struct LOperand {
  enum class Kind : std::uint8_t {
    none,
    slot,      // a temporary; index = slot
    grad,      // the fp32 gradient stream, read in place
    param,     // the fp32 parameter stream (master copy, or the f32 weights), in place
    state,     // a state stream; index = program stream index
    scalar,    // index = scalar index
    constant,  // imm
    norm,      // phase 2: the tensor's norm of reduction slot `index` (UpdateArgs::norms)
  };
  Kind kind = Kind::none;
  std::uint8_t index = 0;
  float imm = 0.0f;
  std::uint16_t value = 0;  // the program value it holds (slots only; for allocation)
};

struct LInstr {
  LKind kind = LKind::copy;
  Op op = Op::add;          // for unary/binary/ternary
  std::uint8_t attr = 0;    // convert dtype
  LOperand dst;
  LOperand src[4];
  int num_src = 0;
};

struct LoweredProgram {
  std::vector<LInstr> code;
  int num_slots = 0;
  // A two-phase program: code[0, phase2_begin) is phase 1, the rest phase 2.
  // One phase: 0 (all of code is the update).
  int phase2_begin = 0;
  bool two_phase = false;
};

// Lowers `program` for the given storage. Loads of fp32 streams read the stream
// in place, and a stored value is written straight into its stream when nothing
// reads the old contents afterwards (no copies through temporaries). The result
// computes bitwise the same values as the program. Each phase of a two-phase
// program is lowered on its own (values do not cross the marker).
LoweredProgram lower(const Program& program, DType weight, DType grad, bool masters);

std::string to_string(const LoweredProgram& lowered);

// Which streams a program loads and which it stores (what a kernel must read and
// write; by program stream index).
struct StreamUse {
  bool loads[kMaxStreams] = {};
  bool stores[kMaxStreams] = {};
};
StreamUse stream_use(const Program& p);

// ---- phases ----

// The index of the phase marker, or -1 for a one-phase program.
constexpr int phase_marker(const Program& p) {
  for (int i = 0; i < p.num_instrs; ++i)
    if (p.code[i].op == Op::phase) return i;
  return -1;
}
constexpr bool is_two_phase(const Program& p) { return phase_marker(p) >= 0; }

// One phase of a two-phase program as a program of its own: part 0 is phase 1
// (the instructions before the marker: its reduce_sumsq ops, no param store), part 1
// is phase 2 (after the marker: the tensor_norm ops and the param store). Each has
// the program's name, streams and scalars and its instructions renumbered from 0
// (phase 2's operands refer to phase 2 only, as validation requires). A one-phase
// program's part 1 is the program itself and its part 0 is empty. The parts are not
// valid programs on their own (validate() rejects them); every backend runs part 0,
// combines the sums per tensor, then runs part 1.
constexpr Program phase_program(const Program& p, int part) {
  const int marker = phase_marker(p);
  Program out = p;
  const int from = part == 0 ? 0 : marker + 1;
  const int to = part == 0 ? (marker < 0 ? 0 : marker) : p.num_instrs;
  out.num_instrs = static_cast<std::uint16_t>(to - from);
  for (int i = 0; i < kMaxInstrs; ++i) out.code[i] = Instr{};
  for (int i = from; i < to; ++i) {
    Instr in = p.code[i];
    const int n = op_arity(in.op);
    if (n > 0) in.a = static_cast<std::uint16_t>(in.a - from);
    if (n > 1) in.b = static_cast<std::uint16_t>(in.b - from);
    if (n > 2) in.c = static_cast<std::uint16_t>(in.c - from);
    out.code[i - from] = in;
  }
  return out;
}

// The reduction slots a program (or its phase 1) reduces, as a bit mask (bit r: slot r).
constexpr unsigned reduced_slots(const Program& p) {
  unsigned mask = 0;
  for (int i = 0; i < p.num_instrs; ++i)
    if (p.code[i].op == Op::reduce_sumsq) mask |= 1u << p.code[i].attr;
  return mask;
}

// Which streams each part loads and stores (part 0: phase 1, part 1: phase 2 or
// the whole of a one-phase program), as phase_program() splits them.
struct PhaseStreamUse {
  StreamUse part[2];
};
PhaseStreamUse phase_stream_use(const Program& p);

}  // namespace stepfuse::jit
