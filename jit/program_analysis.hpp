// Lowering of an update program for the blocked interpreter and the unfused
// baseline: operands resolved to streams, slots, scalars or constants; common
// op chains fused into superinstructions; temporaries packed into few slots.
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
};

// Lowers `program` for the given storage. Loads of fp32 streams read the stream
// in place, and a stored value is written straight into its stream when nothing
// reads the old contents afterwards (no copies through temporaries). The result
// computes bitwise the same values as the program.
LoweredProgram lower(const Program& program, DType weight, DType grad, bool masters);

std::string to_string(const LoweredProgram& lowered);

// Which streams a program loads and which it stores (what a kernel must read and
// write; by program stream index).
struct StreamUse {
  bool loads[kMaxStreams] = {};
  bool stores[kMaxStreams] = {};
};
StreamUse stream_use(const Program& p);

}  // namespace stepfuse::jit
