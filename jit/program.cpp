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
    case Op::phase: return "phase";
    case Op::reduce_sumsq: return "reduce_sumsq";
    case Op::tensor_norm: return "tensor_norm";
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
    case Op::reduce_sumsq: return s + " r" + std::to_string(in.attr) + ", " + v(in.a);
    case Op::tensor_norm: return s + " r" + std::to_string(in.attr);
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
    if (p.streams[s].values == StateValues::nonnegative) out += " (nonnegative)";
    if (p.streams[s].values == StateValues::full_precision) out += " (full precision)";
    out += "\n";
  }
  for (int s = 0; s < p.num_scalars; ++s) out += "  scalar " + std::string(p.scalars[s]) + "\n";
  for (int i = 0; i < p.num_instrs && i < kMaxInstrs; ++i) out += "  " + instr_text(p, i) + "\n";
  return out;
}

namespace {

std::string quoted(std::string_view s) {
  std::string q(1, '\'');  // (not "'" + s: g++ 12 warns falsely, -Wrestrict)
  q.append(s).push_back('\'');
  return q;
}

std::string stream_label(const Program& p, int s) {
  return "stream " + std::to_string(s) + " " + quoted(p.streams[s].name);
}

// The streams with `role`, as "stream 0 'grad', stream 2 'g2'" (or "none").
std::string streams_with(const Program& p, StreamRole role) {
  std::string out;
  for (int s = 0; s < p.num_streams && s < kMaxStreams; ++s)
    if (p.streams[s].role == role) out += (out.empty() ? "" : ", ") + stream_label(p, s);
  return out.empty() ? "none" : out;
}

// What exactly is wrong, for the problems find_problem() reports in words only.
std::string detail(const Program& p, int where, std::string_view problem) {
  if (where < 0) {
    if (problem.find("role grad") != std::string_view::npos)
      return " (streams with role grad: " + streams_with(p, StreamRole::grad) + ")";
    if (problem.find("role param") != std::string_view::npos)
      return " (streams with role param: " + streams_with(p, StreamRole::param) + ")";
    if (problem.find("never stores") != std::string_view::npos) {
      const int ps = p.param_stream();
      return ps >= 0 ? " (no instruction is 'store " + std::string(p.streams[ps].name) + ", %v'; the update must write " +
                           stream_label(p, ps) + ")"
                     : std::string();
    }
    if (problem.find("same name") != std::string_view::npos) {
      for (int s = 0; s < p.num_streams && s < kMaxStreams; ++s)
        for (int t = 0; t < s; ++t)
          if (p.streams[t].name == p.streams[s].name)
            return " (streams " + std::to_string(t) + " and " + std::to_string(s) + " are both named " +
                   quoted(p.streams[s].name) + ")";
    }
    if (problem.find("stream has an empty name") != std::string_view::npos) {
      for (int s = 0; s < p.num_streams && s < kMaxStreams; ++s)
        if (p.streams[s].name.empty()) return " (stream " + std::to_string(s) + ")";
    }
    if (problem.find("unknown role") != std::string_view::npos) {
      for (int s = 0; s < p.num_streams && s < kMaxStreams; ++s)
        if (static_cast<int>(p.streams[s].role) > static_cast<int>(StreamRole::state))
          return " (" + stream_label(p, s) + " has role " + std::to_string(static_cast<int>(p.streams[s].role)) +
                 "; use grad = 0, param = 1 or state = 2)";
    }
    if (problem.find("scalar has an empty name") != std::string_view::npos) {
      for (int s = 0; s < p.num_scalars && s < kMaxScalars; ++s)
        if (p.scalars[s].empty()) return " (scalar " + std::to_string(s) + ")";
    }
    return {};
  }
  const Instr& in = p.code[where];
  const std::uint16_t ops[3] = {in.a, in.b, in.c};
  const int arity = static_cast<int>(in.op) < kNumOps ? op_arity(in.op) : 0;
  if (problem.find("not yet defined") != std::string_view::npos) {
    for (int k = 0; k < arity; ++k)
      if (ops[k] >= where)
        return " (operand " + std::to_string(k + 1) + " is %" + std::to_string(ops[k]) + "; instruction " +
               std::to_string(where) + (where == 0 ? " cannot use any value)" : " can use %0 to %" + std::to_string(where - 1) + ")");
  }
  if (problem.find("store, which has no value") != std::string_view::npos) {
    for (int k = 0; k < arity; ++k)
      if (ops[k] < where && !op_has_value(p.code[ops[k]].op))
        return " (operand " + std::to_string(k + 1) + " is instruction " + std::to_string(ops[k]) + ": " +
               instr_text(p, ops[k]) + ")";
  }
  if (problem.find("phase-1 value") != std::string_view::npos) {
    int marker = 0;
    while (marker < where && p.code[marker].op != Op::phase) ++marker;
    for (int k = 0; k < arity; ++k)
      if (ops[k] < marker)
        return " (operand " + std::to_string(k + 1) + " is %" + std::to_string(ops[k]) +
               " of phase 1; the phase marker is instruction " + std::to_string(marker) + ")";
  }
  if (problem.find("phase marker or a reduce_sumsq, which") != std::string_view::npos) {
    for (int k = 0; k < arity; ++k)
      if (ops[k] < where && !op_has_value(p.code[ops[k]].op))
        return " (operand " + std::to_string(k + 1) + " is instruction " + std::to_string(ops[k]) + ": " +
               instr_text(p, ops[k]) + ")";
  }
  if (problem.find("reduction slot is out of range") != std::string_view::npos)
    return " (slot " + std::to_string(in.attr) + "; use 0 to " + std::to_string(kMaxNormSlots - 1) + ")";
  if (problem.find("reduced twice") != std::string_view::npos || problem.find("never reduces") != std::string_view::npos) {
    for (int i = 0; i < where; ++i)
      if (p.code[i].op == Op::reduce_sumsq && p.code[i].attr == in.attr)
        return " (slot " + std::to_string(in.attr) + " is reduced by instruction " + std::to_string(i) + ")";
    return " (slot " + std::to_string(in.attr) + ")";
  }
  if (problem.find("param stream is stored in phase 1") != std::string_view::npos) {
    for (int i = where; i < p.num_instrs && i < kMaxInstrs; ++i)
      if (p.code[i].op == Op::phase) return " (the phase marker is instruction " + std::to_string(i) + ")";
  }
  if (problem.find("stream index") != std::string_view::npos)
    return " (stream " + std::to_string(in.attr) + "; the program declares " + std::to_string(p.num_streams) + " streams)";
  if (problem.find("scalar index") != std::string_view::npos)
    return " (scalar " + std::to_string(in.attr) + "; the program declares " + std::to_string(p.num_scalars) + " scalars)";
  if (in.op == Op::load || in.op == Op::store) {
    if (in.attr < p.num_streams) return " (" + stream_label(p, in.attr) + ")";
  }
  if (problem.find("attr is not 0") != std::string_view::npos)
    return " (attr " + std::to_string(in.attr) + "; only load, store, scalar, convert, reduce_sumsq and tensor_norm use it)";
  if (problem.find("unknown dtype") != std::string_view::npos)
    return " (dtype " + std::to_string(in.attr) + "; use f32 = 0, f16 = 1 or bf16 = 2)";
  return {};
}

}  // namespace

void validate(const Program& p) {
  int where = -1;
  const char* problem = find_problem(p, &where);
  if (problem == nullptr) return;
  std::string msg = "update program " + quoted(p.name) + " is malformed";
  if (where >= 0) {
    // Names the op and the instruction: "at op 'mul' (instruction 3: %3 = mul %0, %4): ..."
    msg += " at op " + quoted(op_name(p.code[where].op)) + " (instruction " + std::to_string(where) + ": " +
           instr_text(p, where) + ")";
  }
  msg += std::string(": ") + problem + detail(p, where, problem);
  throw Error(ErrorCode::invalid_argument, msg);
}

void ProgramBuilder::fail(std::string_view program, const char* what, std::string_view name, Op op, int index) {
  std::string msg = "update program builder " + quoted(program) + ": ";
  const std::string_view w(what);
  if (w == "too many instructions")
    msg += "op " + quoted(op_name(op)) + " (instruction " + std::to_string(index) + ") does not fit: " + what +
           " (a program holds at most " + std::to_string(kMaxInstrs) + " instructions)";
  else if (w == "too many streams")
    msg += "stream " + quoted(name) + " does not fit: " + what + " (a program declares at most " +
           std::to_string(kMaxStreams) + " streams)";
  else
    msg += "scalar " + quoted(name) + " (declared by instruction " + std::to_string(index) + ", op 'scalar') does not fit: " +
           what + " (a program declares at most " + std::to_string(kMaxScalars) + " scalars)";
  throw Error(ErrorCode::invalid_argument, msg);
}

void ProgramBuilder::fail_validate(const Program& p) {
  validate(p);
  throw Error(ErrorCode::invalid_argument, "update program is malformed");  // unreachable: validate threw
}

}  // namespace stepfuse
