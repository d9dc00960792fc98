// Validation and printing of update programs.
#include <cstdio>
#include <string>

#include "stepfuse/error.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::load: return "load";
    case Op::store: return "store";
    case Op::constant: return "const";
    case Op::scalar: return "scalar";
    case Op::add: return "add";
    case Op::sub: return "sub";
    case Op::mul: return "mul";
    case Op::div: return "div";
    case Op::fma: return "fma";
    case Op::neg: return "neg";
    case Op::abs: return "abs";
    case Op::sqrt: return "sqrt";
    case Op::max: return "max";
    case Op::min: return "min";
    case Op::sign: return "sign";
    case Op::select: return "select";
    case Op::cmp_lt: return "lt";
    case Op::cmp_le: return "le";
    case Op::cmp_eq: return "eq";
    case Op::convert: return "convert";
  }
  return "?";
}

namespace {

std::string_view role_name(StreamRole r) {
  switch (r) {
    case StreamRole::grad: return "grad";
    case StreamRole::param: return "param";
    case StreamRole::state: return "state";
  }
  return "?";
}

std::string float_text(float x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(x));
  return buf;
}

std::string instr_text(const Program& p, int i) {
  const Instr& in = p.code[i];
  const auto v = [](int id) { return std::string("%").append(std::to_string(id)); };
  const auto stream = [&](int s) {
    return s < p.num_streams ? std::string(p.streams[s].name) : std::string("<stream ").append(std::to_string(s)) + ">";
  };
  std::string s = op_has_value(in.op) ? v(i) + " = " : std::string();
  s += op_name(in.op);
  switch (in.op) {
    case Op::load: return s + " " + stream(in.attr);
    case Op::store: return s + " " + stream(in.attr) + ", " + v(in.a);
    case Op::constant: return s + " " + float_text(in.imm);
    case Op::scalar:
      return s + " " + (in.attr < p.num_scalars ? std::string(p.scalars[in.attr]) : std::string("<scalar ").append(std::to_string(in.attr)) + ">");
    case Op::convert:
      return s + " " + v(in.a) + " to " +
             (in.attr <= 2 ? std::string(dtype_name(static_cast<DType>(in.attr))) : std::string("<dtype ").append(std::to_string(in.attr)) + ">");
    default: break;
  }
  const std::uint16_t ops[3] = {in.a, in.b, in.c};
  for (int k = 0; k < op_arity(in.op); ++k) s += (k ? ", " : " ") + v(ops[k]);
  return s;
}

}  // namespace

std::string to_string(const Program& p) {
  std::string out = "program " + std::string(p.name) + "\n";
  for (int s = 0; s < p.num_streams; ++s) {
    out += "  stream " + std::string(p.streams[s].name) + " : " + std::string(role_name(p.streams[s].role));
    if (p.streams[s].role == StreamRole::state && p.streams[s].init != 0.0f) out += " = " + float_text(p.streams[s].init);
    out += "\n";
  }
  for (int s = 0; s < p.num_scalars; ++s) out += "  scalar " + std::string(p.scalars[s]) + "\n";
  for (int i = 0; i < p.num_instrs && i < kMaxInstrs; ++i) out += "  " + instr_text(p, i) + "\n";
  return out;
}

void validate(const Program& p) {
  int where = -1;
  const char* problem = find_problem(p, &where);
  if (problem == nullptr) return;
  std::string msg = "update program '" + std::string(p.name) + "' is malformed: " + problem;
  if (where >= 0) msg += std::string(" (instruction ").append(std::to_string(where)) + ": " + instr_text(p, where) + ")";
  throw Error(ErrorCode::invalid_argument, msg);
}

void ProgramBuilder::fail(const char* what) {
  throw Error(ErrorCode::invalid_argument, std::string("update program builder: ") + what + " (the limits are " +
                                               std::to_string(kMaxStreams) + std::string(" streams, ").append(std::to_string(kMaxScalars)) +
                                               std::string(" scalars, ").append(std::to_string(kMaxInstrs)) + " instructions)");
}

void ProgramBuilder::fail_validate(const Program& p) {
  validate(p);
  throw Error(ErrorCode::invalid_argument, "update program is malformed");  // unreachable: validate threw
}

}  // namespace stepfuse
