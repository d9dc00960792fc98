// The C ABI of custom update programs (include/stepfuse/stepfuse.h): the builder, sf_program, custom optimizers.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/c_api_support.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/update_program.hpp"

using namespace stepfuse::c_api;  // guard, need, the checks and conversions (runtime/c_api_support.hpp)

// The C enums are the C++ ones, value for value.
static_assert(SF_ROLE_GRAD == static_cast<int>(stepfuse::StreamRole::grad) &&
              SF_ROLE_PARAM == static_cast<int>(stepfuse::StreamRole::param) &&
              SF_ROLE_STATE == static_cast<int>(stepfuse::StreamRole::state));
static_assert(SF_STATE_VALUES_ANY == static_cast<int>(stepfuse::StateValues::any) &&
              SF_STATE_VALUES_NONNEGATIVE == static_cast<int>(stepfuse::StateValues::nonnegative) &&
              SF_STATE_VALUES_FULL_PRECISION == static_cast<int>(stepfuse::StateValues::full_precision));
static_assert(SF_SCALAR_FIXED == static_cast<int>(stepfuse::ScalarRule::Kind::fixed) &&
              SF_SCALAR_GSCALE == static_cast<int>(stepfuse::ScalarRule::Kind::gscale) &&
              SF_SCALAR_FIRST_STEP == static_cast<int>(stepfuse::ScalarRule::Kind::first_step) &&
              SF_SCALAR_DIV_ONE_MINUS_POW == static_cast<int>(stepfuse::ScalarRule::Kind::div_one_minus_pow) &&
              SF_SCALAR_SQRT_ONE_MINUS_POW == static_cast<int>(stepfuse::ScalarRule::Kind::sqrt_one_minus_pow) &&
              SF_SCALAR_DIV_LINEAR == static_cast<int>(stepfuse::ScalarRule::Kind::div_linear) &&
              SF_SCALAR_ONE_MINUS_POW == static_cast<int>(stepfuse::ScalarRule::Kind::one_minus_pow) &&
              SF_SCALAR_NADAM_GRAD_COEF == static_cast<int>(stepfuse::ScalarRule::Kind::nadam_grad_coef) &&
              SF_SCALAR_NADAM_MOMENTUM_COEF == static_cast<int>(stepfuse::ScalarRule::Kind::nadam_momentum_coef) &&
              SF_SCALAR_RADAM_RECT == static_cast<int>(stepfuse::ScalarRule::Kind::radam_rect) &&
              SF_SCALAR_ASGD_ETA == static_cast<int>(stepfuse::ScalarRule::Kind::asgd_eta) &&
              SF_SCALAR_ASGD_DECAY == static_cast<int>(stepfuse::ScalarRule::Kind::asgd_decay) &&
              SF_SCALAR_ASGD_MU == static_cast<int>(stepfuse::ScalarRule::Kind::asgd_mu));
static_assert(SF_OP_ADD == static_cast<int>(stepfuse::Op::add) && SF_OP_SUB == static_cast<int>(stepfuse::Op::sub) &&
              SF_OP_MUL == static_cast<int>(stepfuse::Op::mul) && SF_OP_DIV == static_cast<int>(stepfuse::Op::div) &&
              SF_OP_FMA == static_cast<int>(stepfuse::Op::fma) && SF_OP_NEG == static_cast<int>(stepfuse::Op::neg) &&
              SF_OP_ABS == static_cast<int>(stepfuse::Op::abs) && SF_OP_SQRT == static_cast<int>(stepfuse::Op::sqrt) &&
              SF_OP_MAX == static_cast<int>(stepfuse::Op::max) && SF_OP_MIN == static_cast<int>(stepfuse::Op::min) &&
              SF_OP_SIGN == static_cast<int>(stepfuse::Op::sign) &&
              SF_OP_SELECT == static_cast<int>(stepfuse::Op::select) &&
              SF_OP_LT == static_cast<int>(stepfuse::Op::cmp_lt) && SF_OP_LE == static_cast<int>(stepfuse::Op::cmp_le) &&
              SF_OP_EQ == static_cast<int>(stepfuse::Op::cmp_eq));

// What the builder has recorded. Ops are checked for what fits the C types at the
// call (enums, NULLs), the program's structure at build, where validate() names
// the op, its instruction index and the problem.
struct sf_program_builder {
  struct StreamRec {
    std::string name;
    stepfuse::StreamRole role;
    float init;
    stepfuse::StateValues values;
  };
  struct ScalarRec {
    std::string name;
    stepfuse::ScalarRule rule;
  };
  struct InstrRec {
    stepfuse::Op op;
    std::uint32_t attr;  // stream index, scalar index or dtype
    sf_value a, b, c;
    float imm;
  };
  std::string name;
  std::vector<StreamRec> streams;
  std::vector<ScalarRec> scalars;
  std::vector<InstrRec> code;
};

namespace {

std::string quoted(std::string_view s) {
  std::string q(1, '\'');  // (not "'" + s: g++ 12 warns falsely, -Wrestrict)
  q.append(s).push_back('\'');
  return q;
}

sf_value emit(sf_program_builder* b, stepfuse::Op op, std::uint32_t attr, sf_value x, sf_value y, sf_value z, float imm) {
  b->code.push_back({op, attr, x, y, z, imm});
  return static_cast<sf_value>(b->code.size() - 1);
}

// The recorded program as a Program (views into the builder) and its scalar rules,
// or Error(invalid_argument) naming the op and instruction that does not fit.
stepfuse::UpdateProgram build(const sf_program_builder& b) {
  using stepfuse::kMaxInstrs;
  using stepfuse::kMaxScalars;
  using stepfuse::kMaxStreams;
  const std::string where = "update program " + quoted(b.name) + ": ";
  if (b.streams.size() > kMaxStreams)
    throw stepfuse::Error(stepfuse::ErrorCode::invalid_argument,
                          where + "stream " + std::to_string(kMaxStreams) + " " + quoted(b.streams[kMaxStreams].name) +
                              " does not fit: too many streams (a program declares at most " +
                              std::to_string(kMaxStreams) + ")");
  if (b.code.size() > kMaxInstrs)
    throw stepfuse::Error(stepfuse::ErrorCode::invalid_argument,
                          where + "op " + quoted(stepfuse::op_name(b.code[kMaxInstrs].op)) + " (instruction " +
                              std::to_string(kMaxInstrs) + ") does not fit: too many instructions (a program holds at most " +
                              std::to_string(kMaxInstrs) + ")");
  if (b.scalars.size() > kMaxScalars) {
    std::size_t at = 0;
    while (at < b.code.size() && !(b.code[at].op == stepfuse::Op::scalar && b.code[at].attr == kMaxScalars)) ++at;
    throw stepfuse::Error(stepfuse::ErrorCode::invalid_argument,
                          where + "scalar " + quoted(b.scalars[kMaxScalars].name) + " (op 'scalar', instruction " +
                              std::to_string(at) + ") does not fit: too many scalars (a program declares at most " +
                              std::to_string(kMaxScalars) + ")");
  }
  stepfuse::Program p;
  p.name = b.name;
  p.num_streams = static_cast<std::uint8_t>(b.streams.size());
  for (std::size_t s = 0; s < b.streams.size(); ++s) p.streams[s] = {b.streams[s].name, b.streams[s].role, b.streams[s].init, b.streams[s].values};
  p.num_scalars = static_cast<std::uint8_t>(b.scalars.size());
  for (std::size_t s = 0; s < b.scalars.size(); ++s) p.scalars[s] = b.scalars[s].name;
  p.num_instrs = static_cast<std::uint16_t>(b.code.size());
  for (std::size_t i = 0; i < b.code.size(); ++i) {
    const sf_program_builder::InstrRec& r = b.code[i];
    const auto fail = [&](const std::string& problem) {
      throw stepfuse::Error(stepfuse::ErrorCode::invalid_argument,
                            "update program " + quoted(b.name) + " is malformed at op " + quoted(stepfuse::op_name(r.op)) +
                                " (instruction " + std::to_string(i) + "): " + problem);
    };
    // What the fixed-width IR cannot even hold is reported here; the rest by validate().
    if ((r.op == stepfuse::Op::load || r.op == stepfuse::Op::store) && r.attr >= b.streams.size())
      fail("the stream index " + std::to_string(r.attr) + " is out of range (the program declares " +
           std::to_string(b.streams.size()) + " streams)");
    const sf_value operands[3] = {r.a, r.b, r.c};
    for (int k = 0; k < stepfuse::op_arity(r.op); ++k)
      if (operands[k] >= i)
        fail("operand " + std::to_string(k + 1) + " is %" + std::to_string(operands[k]) +
             ", a value not yet defined (operands must come earlier: instruction " + std::to_string(i) +
             (i == 0 ? " cannot use any value)" : " can use %0 to %" + std::to_string(i - 1) + ")"));
    stepfuse::Instr& in = p.code[i];
    in.op = r.op;
    in.attr = static_cast<std::uint8_t>(r.attr);
    in.a = static_cast<std::uint16_t>(r.a);
    in.b = static_cast<std::uint16_t>(r.b);
    in.c = static_cast<std::uint16_t>(r.c);
    in.imm = r.imm;
  }
  std::vector<stepfuse::ScalarDef> defs;
  for (const auto& s : b.scalars) defs.push_back({s.name, s.rule});
  return stepfuse::UpdateProgram(p, std::move(defs));  // validates and copies every name
}

// A reduction slot as a call gives it: 0 .. SF_PROGRAM_MAX_NORM_SLOTS - 1.
std::uint32_t norm_slot(const char* fn, int slot) {
  static_assert(SF_PROGRAM_MAX_NORM_SLOTS == stepfuse::kMaxNormSlots);
  if (slot < 0 || slot >= SF_PROGRAM_MAX_NORM_SLOTS)
    bad_argument(fn, "slot = " + std::to_string(slot) + " is not a reduction slot (use 0 to " +
                         std::to_string(SF_PROGRAM_MAX_NORM_SLOTS - 1) + ")");
  return static_cast<std::uint32_t>(slot);
}

}  // namespace

extern "C" {

sf_status sf_program_builder_create(const char* name, sf_program_builder** out) {
  constexpr const char* fn = "sf_program_builder_create";
  return guard(fn, [&] {
    need_all(fn, name, "name", out, "out");
    *out = new sf_program_builder{name, {}, {}, {}};
  });
}

void sf_program_builder_destroy(sf_program_builder* builder) { delete builder; }

namespace {

// sf_program_builder_stream and sf_program_builder_stream_ex, named `fn`.
sf_status builder_stream(const char* fn, sf_program_builder* builder, const char* name, sf_stream_role role, float init,
                         sf_state_values values, int* stream) {
  return guard(fn, [&] {
    need_all(fn, builder, "builder", name, "name", stream, "stream");
    const int r = enum_in_range(fn, role, SF_ROLE_GRAD, SF_ROLE_STATE, "role",
                                "an sf_stream_role (SF_ROLE_GRAD, SF_ROLE_PARAM, SF_ROLE_STATE)");
    const int v = enum_in_range(fn, values, SF_STATE_VALUES_ANY, SF_STATE_VALUES_FULL_PRECISION, "values",
                                "an sf_state_values (SF_STATE_VALUES_ANY, SF_STATE_VALUES_NONNEGATIVE, "
                                "SF_STATE_VALUES_FULL_PRECISION)");
    builder->streams.push_back(
        {name, static_cast<stepfuse::StreamRole>(r), init, static_cast<stepfuse::StateValues>(v)});
    *stream = static_cast<int>(builder->streams.size() - 1);
  });
}

}  // namespace

sf_status sf_program_builder_stream(sf_program_builder* builder, const char* name, sf_stream_role role, float init,
                                    int* stream) {
  return builder_stream("sf_program_builder_stream", builder, name, role, init, SF_STATE_VALUES_ANY, stream);
}

sf_status sf_program_builder_stream_ex(sf_program_builder* builder, const char* name, sf_stream_role role, float init,
                                       sf_state_values values, int* stream) {
  return builder_stream("sf_program_builder_stream_ex", builder, name, role, init, values, stream);
}

namespace {

// sf_program_builder_scalar and sf_program_builder_scalar3, named `fn`.
sf_status builder_scalar(const char* fn, sf_program_builder* builder, const char* name, sf_scalar_rule_kind rule,
                         double a, double b, double c, sf_value* out) {
  return guard(fn, [&] {
    need_all(fn, builder, "builder", name, "name", out, "out");
    const int k = enum_in_range(fn, rule, SF_SCALAR_FIXED, SF_SCALAR_ASGD_MU, "rule", "an sf_scalar_rule_kind");
    const stepfuse::ScalarRule r{static_cast<stepfuse::ScalarRule::Kind>(k), a, b, c};
    std::size_t s = 0;
    while (s < builder->scalars.size() && builder->scalars[s].name != name) ++s;
    if (s == builder->scalars.size()) {
      builder->scalars.push_back({name, r});
    } else if (!(builder->scalars[s].rule == r)) {
      bad_argument(fn, "scalar " + quoted(name) + " was declared with another rule (" +
                           std::string(stepfuse::scalar_rule_name(builder->scalars[s].rule.kind)) +
                           "); each use of a scalar gives the same rule");
    }
    *out = emit(builder, stepfuse::Op::scalar, static_cast<std::uint32_t>(s), 0, 0, 0, 0.0f);
  });
}

}  // namespace

sf_status sf_program_builder_scalar(sf_program_builder* builder, const char* name, sf_scalar_rule_kind rule, double a,
                                    double b, sf_value* out) {
  return builder_scalar("sf_program_builder_scalar", builder, name, rule, a, b, 0.0, out);
}

sf_status sf_program_builder_scalar3(sf_program_builder* builder, const char* name, sf_scalar_rule_kind rule, double a,
                                     double b, double c, sf_value* out) {
  return builder_scalar("sf_program_builder_scalar3", builder, name, rule, a, b, c, out);
}

sf_status sf_program_builder_load(sf_program_builder* builder, int stream, sf_value* out) {
  constexpr const char* fn = "sf_program_builder_load";
  return guard(fn, [&] {
    need_all(fn, builder, "builder", out, "out");
    if (stream < 0) bad_argument(fn, "stream = " + std::to_string(stream) + " is negative");
    *out = emit(builder, stepfuse::Op::load, static_cast<std::uint32_t>(stream), 0, 0, 0, 0.0f);
  });
}

sf_status sf_program_builder_store(sf_program_builder* builder, int stream, sf_value value) {
  constexpr const char* fn = "sf_program_builder_store";
  return guard(fn, [&] {
    need(fn, builder, "builder");
    if (stream < 0) bad_argument(fn, "stream = " + std::to_string(stream) + " is negative");
    emit(builder, stepfuse::Op::store, static_cast<std::uint32_t>(stream), value, 0, 0, 0.0f);
  });
}

sf_status sf_program_builder_constant(sf_program_builder* builder, float x, sf_value* out) {
  constexpr const char* fn = "sf_program_builder_constant";
  return guard(fn, [&] {
    need_all(fn, builder, "builder", out, "out");
    *out = emit(builder, stepfuse::Op::constant, 0, 0, 0, 0, x);
  });
}

sf_status sf_program_builder_op(sf_program_builder* builder, sf_op op, sf_value a, sf_value b, sf_value c,
                                sf_value* out) {
  constexpr const char* fn = "sf_program_builder_op";
  return guard(fn, [&] {
    need_all(fn, builder, "builder", out, "out");
    const int o = enum_in_range(fn, op, SF_OP_ADD, SF_OP_EQ, "op",
                                "an sf_op (SF_OP_ADD .. SF_OP_EQ; loads, stores, constants, scalars and converts have "
                                "their own functions)");
    const auto kind = static_cast<stepfuse::Op>(o);
    const int arity = stepfuse::op_arity(kind);
    *out = emit(builder, kind, 0, a, arity > 1 ? b : 0, arity > 2 ? c : 0, 0.0f);
  });
}

sf_status sf_program_builder_convert(sf_program_builder* builder, sf_value a, sf_dtype to, sf_value* out) {
  constexpr const char* fn = "sf_program_builder_convert";
  return guard(fn, [&] {
    need_all(fn, builder, "builder", out, "out");
    const int d = enum_in_range(fn, to, SF_F32, SF_BF16, "to", "an sf_dtype");
    *out = emit(builder, stepfuse::Op::convert, static_cast<std::uint32_t>(d), a, 0, 0, 0.0f);
  });
}

sf_status sf_program_builder_phase(sf_program_builder* builder) {
  constexpr const char* fn = "sf_program_builder_phase";
  return guard(fn, [&] {
    need(fn, builder, "builder");
    emit(builder, stepfuse::Op::phase, 0, 0, 0, 0, 0.0f);
  });
}

sf_status sf_program_builder_reduce_sumsq(sf_program_builder* builder, int slot, sf_value value) {
  constexpr const char* fn = "sf_program_builder_reduce_sumsq";
  return guard(fn, [&] {
    need(fn, builder, "builder");
    emit(builder, stepfuse::Op::reduce_sumsq, norm_slot(fn, slot), value, 0, 0, 0.0f);
  });
}

sf_status sf_program_builder_tensor_norm(sf_program_builder* builder, int slot, sf_value* out) {
  constexpr const char* fn = "sf_program_builder_tensor_norm";
  return guard(fn, [&] {
    need_all(fn, builder, "builder", out, "out");
    *out = emit(builder, stepfuse::Op::tensor_norm, norm_slot(fn, slot), 0, 0, 0, 0.0f);
  });
}

sf_status sf_program_builder_build(const sf_program_builder* builder, sf_program** out) {
  constexpr const char* fn = "sf_program_builder_build";
  return guard(fn, [&] {
    need_all(fn, builder, "builder", out, "out");
    *out = new sf_program{build(*builder)};
  });
}

void sf_program_destroy(sf_program* program) { delete program; }

sf_status sf_program_text(const sf_program* program, char* buf, size_t cap, size_t* needed) {
  constexpr const char* fn = "sf_program_text";
  return guard(fn, [&] {
    need(fn, program, "program");
    copy_text(fn, program->program.text(), "the text", buf, cap, needed);
  });
}

sf_status sf_optimizer_create_custom(const sf_program* program, const sf_param* params, size_t num_params,
                                     const sf_optimizer_options* options, sf_optimizer** out) {
  constexpr const char* fn = "sf_optimizer_create_custom";
  return guard(fn, [&] {
    need(fn, program, "program");
    const stepfuse::OptimizerOptions opts = to_options(fn, options);
    need(fn, out, "out");
    std::vector<stepfuse::Param> ps = to_params(fn, params, num_params);
    *out = make_optimizer(stepfuse::Optimizer(program->program, std::move(ps), opts));
  });
}

sf_status sf_optimizer_get_scalar(const sf_optimizer* opt, const char* name, double* value) {
  constexpr const char* fn = "sf_optimizer_get_scalar";
  return get_value(fn, opt, "opt", value, "value", [&] { return opt->opt.scalar(need(fn, name, "name")); });
}

sf_status sf_optimizer_set_scalar(sf_optimizer* opt, const char* name, double value) {
  constexpr const char* fn = "sf_optimizer_set_scalar";
  return guard(fn, [&] { need(fn, opt, "opt")->opt.set_scalar(need(fn, name, "name"), value); });
}

}  // extern "C"
