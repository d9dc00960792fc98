// UpdateProgram: a user's update program with owned names and scalar rules, validated.
#include "stepfuse/update_program.hpp"

#include <cmath>
#include <utility>

#include "jit/base/format.hpp"
#include "jit/builtins.hpp"
#include "jit/update_program_rules.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

// The ScalarRule kinds are the device ABI's rule kinds, value for value.
static_assert(static_cast<int>(ScalarRule::Kind::fixed) == SF_RULE_FIXED &&
              static_cast<int>(ScalarRule::Kind::gscale) == SF_RULE_GSCALE &&
              static_cast<int>(ScalarRule::Kind::first_step) == SF_RULE_FIRST_STEP &&
              static_cast<int>(ScalarRule::Kind::div_one_minus_pow) == SF_RULE_DIV_ONE_MINUS_POW &&
              static_cast<int>(ScalarRule::Kind::sqrt_one_minus_pow) == SF_RULE_SQRT_ONE_MINUS_POW &&
              static_cast<int>(ScalarRule::Kind::div_linear) == SF_RULE_DIV_LINEAR &&
              static_cast<int>(ScalarRule::Kind::one_minus_pow) == SF_RULE_ONE_MINUS_POW &&
              static_cast<int>(ScalarRule::Kind::nadam_grad_coef) == SF_RULE_NADAM_GRAD_COEF &&
              static_cast<int>(ScalarRule::Kind::nadam_momentum_coef) == SF_RULE_NADAM_MOMENTUM_COEF &&
              static_cast<int>(ScalarRule::Kind::radam_rect) == SF_RULE_RADAM_RECT &&
              static_cast<int>(ScalarRule::Kind::asgd_eta) == SF_RULE_ASGD_ETA &&
              static_cast<int>(ScalarRule::Kind::asgd_decay) == SF_RULE_ASGD_DECAY &&
              static_cast<int>(ScalarRule::Kind::asgd_mu) == SF_RULE_ASGD_MU &&
              static_cast<int>(ScalarRule::Kind::asgd_mu) + 1 == SF_RULE_KIND_COUNT);

namespace {

[[noreturn]] void bad(std::string_view program, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, "update program '" + std::string(program) + "': " + message);
}

// Rule parameters in messages and in UpdateProgram::text(): the shortest text that reads back as the value.
std::string num(double v) { return detail::format_number(v); }

// Names appear in generated CUDA (as comments), in checkpoints and in the C ABI.
constexpr std::size_t kMaxNameLength = 64;
bool is_identifier(std::string_view s) {
  if (s.empty() || s.size() > kMaxNameLength) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

void check_name(std::string_view program, std::string_view what, std::string_view name) {
  if (!is_identifier(name))
    bad(program, std::string(what) + " name '" + std::string(name) +
                     "' is not an identifier (use [A-Za-z_][A-Za-z0-9_]*, at most " + std::to_string(kMaxNameLength) +
                     " characters)");
}

int kind_value(ScalarRule::Kind k) { return static_cast<int>(k); }

}  // namespace

double ScalarRule::eval(std::int64_t step, double gscale) const {
  const sf_scalar_rule r = jit::device_rule(*this);
  return sf_eval_rule(&r, step, gscale);
}

std::string_view scalar_rule_name(ScalarRule::Kind kind) {
  switch (kind) {
    case ScalarRule::Kind::fixed: return "fixed";
    case ScalarRule::Kind::gscale: return "gscale";
    case ScalarRule::Kind::first_step: return "first_step";
    case ScalarRule::Kind::div_one_minus_pow: return "div_one_minus_pow";
    case ScalarRule::Kind::sqrt_one_minus_pow: return "sqrt_one_minus_pow";
    case ScalarRule::Kind::div_linear: return "div_linear";
    case ScalarRule::Kind::one_minus_pow: return "one_minus_pow";
    case ScalarRule::Kind::nadam_grad_coef: return "nadam_grad_coef";
    case ScalarRule::Kind::nadam_momentum_coef: return "nadam_momentum_coef";
    case ScalarRule::Kind::radam_rect: return "radam_rect";
    case ScalarRule::Kind::asgd_eta: return "asgd_eta";
    case ScalarRule::Kind::asgd_decay: return "asgd_decay";
    case ScalarRule::Kind::asgd_mu: return "asgd_mu";
  }
  return "?";
}

namespace jit {

sf_scalar_rule device_rule(const ScalarRule& r) {
  return sf_scalar_rule{kind_value(r.kind), 0, r.a, r.b, r.c, 0.0};
}

std::string rule_text(const ScalarRule& r) {
  switch (r.kind) {
    case ScalarRule::Kind::fixed: return num(r.a);
    case ScalarRule::Kind::gscale: return "gscale * " + num(r.a);
    case ScalarRule::Kind::first_step: return "step == 1 ? " + num(r.a) + " : " + num(r.b);
    case ScalarRule::Kind::div_one_minus_pow: return num(r.a) + " / (1 - " + num(r.b) + "^step)";
    case ScalarRule::Kind::sqrt_one_minus_pow: return "sqrt(1 - " + num(r.b) + "^step)";
    case ScalarRule::Kind::div_linear: return num(r.a) + " / (1 + (step - 1) * " + num(r.b) + ")";
    case ScalarRule::Kind::one_minus_pow: return "1 - " + num(r.b) + "^step";
    case ScalarRule::Kind::nadam_grad_coef:
      return "nadam_grad_coef(lr " + num(r.a) + ", beta1 " + num(r.b) + ", momentum_decay " + num(r.c) + ")";
    case ScalarRule::Kind::nadam_momentum_coef:
      return "nadam_momentum_coef(lr " + num(r.a) + ", beta1 " + num(r.b) + ", momentum_decay " + num(r.c) + ")";
    case ScalarRule::Kind::radam_rect: return "radam_rect(beta2 " + num(r.b) + ")";
    case ScalarRule::Kind::asgd_eta:
      return num(r.a) + " / (1 + " + num(r.b) + " * " + num(r.a) + " * (step - 1))^" + num(r.c);
    case ScalarRule::Kind::asgd_decay:
      return "1 - " + num(r.b) + " * " + num(r.a) + " / (1 + " + num(r.b) + " * " + num(r.a) + " * (step - 1))^" +
             num(r.c);
    case ScalarRule::Kind::asgd_mu: return "step == 1 ? 1 : 1 / max(1, step - 1 - " + num(r.a) + ")";
  }
  return "?";
}

void check_rule(std::string_view program, std::string_view name, const ScalarRule& r) {
  const std::string what = "scalar '" + std::string(name) + "' (rule " + std::string(scalar_rule_name(r.kind)) + ")";
  const auto finite = [&](double v, const char* field) {
    if (!std::isfinite(v)) bad(program, what + ": " + field + " = " + num(v) + " is not finite");
  };
  switch (r.kind) {
    case ScalarRule::Kind::fixed:
    case ScalarRule::Kind::first_step:
      finite(r.a, "a");
      finite(r.b, "b");
      return;
    case ScalarRule::Kind::gscale:
      finite(r.a, "multiplier");
      if (r.a == 0.0) bad(program, what + ": the multiplier is 0, which would discard the gradient (use 1, or -1 to maximize)");
      return;
    case ScalarRule::Kind::div_one_minus_pow:
    case ScalarRule::Kind::sqrt_one_minus_pow:
      finite(r.a, "a");
      if (!(r.b >= 0.0 && r.b < 1.0)) bad(program, what + ": the base b = " + num(r.b) + " must be in [0, 1)");
      return;
    case ScalarRule::Kind::div_linear:
      finite(r.a, "a");
      if (!(std::isfinite(r.b) && r.b >= 0.0)) bad(program, what + ": the decay b = " + num(r.b) + " must be finite and >= 0");
      return;
    case ScalarRule::Kind::one_minus_pow:
    case ScalarRule::Kind::radam_rect:
      if (!(r.b >= 0.0 && r.b < 1.0)) bad(program, what + ": the base b = " + num(r.b) + " must be in [0, 1)");
      return;
    case ScalarRule::Kind::nadam_grad_coef:
    case ScalarRule::Kind::nadam_momentum_coef:
      finite(r.a, "the learning rate a");
      if (!(r.b >= 0.0 && r.b < 1.0)) bad(program, what + ": beta1 b = " + num(r.b) + " must be in [0, 1)");
      if (!(std::isfinite(r.c) && r.c >= 0.0))
        bad(program, what + ": the momentum decay c = " + num(r.c) + " must be finite and >= 0");
      return;
    case ScalarRule::Kind::asgd_eta:
    case ScalarRule::Kind::asgd_decay:
      finite(r.a, "the learning rate a");
      finite(r.b, "lambd b");
      finite(r.c, "the exponent c");
      // The base 1 + b * a * (t - 1) stays >= 1 for every step.
      if (!(r.a * r.b >= 0.0))
        bad(program, what + ": a * b = " + num(r.a) + " * " + num(r.b) + " must be >= 0 (the base 1 + b * a * (t - 1) "
                            "must stay positive)");
      return;
    case ScalarRule::Kind::asgd_mu:
      finite(r.a, "t0 a");
      return;
  }
  bad(program, what + ": unknown rule kind " + std::to_string(kind_value(r.kind)) + " (use ScalarRule::Kind)");
}

}  // namespace jit

struct UpdateProgram::Storage {
  std::string name;
  std::string stream_names[kMaxStreams];
  std::string scalar_names[kMaxScalars];
  Program program;
};

UpdateProgram::UpdateProgram(std::shared_ptr<const Storage> storage, std::vector<ScalarDef> scalars)
    : storage_(std::move(storage)), scalars_(std::move(scalars)) {}

UpdateProgram::UpdateProgram(const Program& program, std::vector<ScalarDef> scalars) {
  // The structure first: validate() names the instruction, its op and the problem.
  validate(program);
  const std::string_view pname = program.name;
  check_name(pname, "the program", pname);
  auto storage = std::make_shared<Storage>();
  storage->name = std::string(program.name);
  storage->program = program;
  storage->program.name = storage->name;
  for (int s = 0; s < program.num_streams; ++s) {
    const StreamDecl& d = program.streams[s];
    check_name(pname, "stream " + std::to_string(s), d.name);
    if (!std::isfinite(d.init))
      bad(pname, "stream " + std::to_string(s) + " '" + std::string(d.name) + "': init = " + num(d.init) + " is not finite");
    if (d.role != StreamRole::state && d.init != 0.0f)
      bad(pname, "stream " + std::to_string(s) + " '" + std::string(d.name) +
                     "': init = " + num(d.init) + ", but only state streams have an initial value");
    storage->stream_names[s] = std::string(d.name);
    storage->program.streams[s].name = storage->stream_names[s];
  }
  for (int s = 0; s < program.num_scalars; ++s) {
    check_name(pname, "scalar " + std::to_string(s), program.scalars[s]);
    storage->scalar_names[s] = std::string(program.scalars[s]);
    storage->program.scalars[s] = storage->scalar_names[s];
  }

  // One definition per declared scalar, in the program's order.
  std::string declared;
  for (int s = 0; s < program.num_scalars; ++s) declared += (s ? ", " : "") + storage->scalar_names[s];
  if (declared.empty()) declared = "none";
  std::vector<ScalarDef> ordered(program.num_scalars);
  std::vector<bool> seen(program.num_scalars, false);
  for (ScalarDef& d : scalars) {
    const int s = storage->program.find_scalar(d.name);
    if (s < 0)
      bad(pname, "a rule is given for scalar '" + d.name + "', which the program does not declare (its scalars: " +
                     declared + ")");
    if (seen[s]) bad(pname, "scalar '" + d.name + "' has two rules (give each scalar one)");
    seen[s] = true;
    jit::check_rule(pname, d.name, d.rule);
    ordered[s] = std::move(d);
  }
  bool has_gscale = false;
  for (int s = 0; s < program.num_scalars; ++s) {
    if (!seen[s]) {
      // The instruction that declares it, so the message points at an op.
      int at = 0;
      while (at < program.num_instrs && !(program.code[at].op == Op::scalar && program.code[at].attr == s)) ++at;
      bad(pname, "scalar '" + storage->scalar_names[s] + "' (op 'scalar', instruction " + std::to_string(at) +
                     ") has no rule: give it one, e.g. UpdateProgram::fixed(\"" + storage->scalar_names[s] + "\", value)");
    }
    has_gscale |= ordered[s].rule.kind == ScalarRule::Kind::gscale;
  }
  if (!has_gscale)
    bad(pname, "no scalar has the gscale rule: the gradient must be multiplied by the step's gradient multiplier "
               "(UpdateProgram::gscale(\"gscale\"), then mul(load(grad), scalar(\"gscale\"))), or unscaling and "
               "clipping would not reach the update");
  storage_ = std::move(storage);
  scalars_ = std::move(ordered);
}

UpdateProgram UpdateProgram::from_config(const OptimizerConfig& config) {
  jit::validate_config(config);
  const Program& program = jit::builtin_program(jit::select_builtin(config));
  sf_scalar_rule rules[kMaxScalars];
  jit::scalar_rules(config, program, rules);
  std::vector<ScalarDef> defs;
  for (int s = 0; s < program.num_scalars; ++s)
    defs.push_back({std::string(program.scalars[s]),
                    ScalarRule{static_cast<ScalarRule::Kind>(rules[s].kind), rules[s].a, rules[s].b, rules[s].c}});
  return UpdateProgram(program, std::move(defs));
}

ScalarDef UpdateProgram::fixed(std::string name, double value) {
  return {std::move(name), {ScalarRule::Kind::fixed, value, 0.0}};
}
ScalarDef UpdateProgram::gscale(std::string name, double multiplier) {
  return {std::move(name), {ScalarRule::Kind::gscale, multiplier, 0.0}};
}
ScalarDef UpdateProgram::first_step(std::string name, double first, double later) {
  return {std::move(name), {ScalarRule::Kind::first_step, first, later}};
}
ScalarDef UpdateProgram::bias_correction1_step_size(std::string name, double lr, double beta1) {
  return {std::move(name), {ScalarRule::Kind::div_one_minus_pow, lr, beta1}};
}
ScalarDef UpdateProgram::bias_correction2_sqrt(std::string name, double beta2) {
  return {std::move(name), {ScalarRule::Kind::sqrt_one_minus_pow, 0.0, beta2}};
}
ScalarDef UpdateProgram::lr_decay(std::string name, double lr, double decay) {
  return {std::move(name), {ScalarRule::Kind::div_linear, lr, decay}};
}
ScalarDef UpdateProgram::bias_correction(std::string name, double beta) {
  return {std::move(name), {ScalarRule::Kind::one_minus_pow, 0.0, beta}};
}
ScalarDef UpdateProgram::nadam_grad_coef(std::string name, double lr, double beta1, double momentum_decay) {
  return {std::move(name), {ScalarRule::Kind::nadam_grad_coef, lr, beta1, momentum_decay}};
}
ScalarDef UpdateProgram::nadam_momentum_coef(std::string name, double lr, double beta1, double momentum_decay) {
  return {std::move(name), {ScalarRule::Kind::nadam_momentum_coef, lr, beta1, momentum_decay}};
}
ScalarDef UpdateProgram::radam_rect(std::string name, double beta2) {
  return {std::move(name), {ScalarRule::Kind::radam_rect, 0.0, beta2}};
}
ScalarDef UpdateProgram::asgd_eta(std::string name, double lr, double lambd, double alpha) {
  return {std::move(name), {ScalarRule::Kind::asgd_eta, lr, lambd, alpha}};
}
ScalarDef UpdateProgram::asgd_decay(std::string name, double lr, double lambd, double alpha) {
  return {std::move(name), {ScalarRule::Kind::asgd_decay, lr, lambd, alpha}};
}
ScalarDef UpdateProgram::asgd_mu(std::string name, double t0) {
  return {std::move(name), {ScalarRule::Kind::asgd_mu, t0}};
}

const Program& UpdateProgram::program() const { return storage_->program; }

const ScalarDef& UpdateProgram::scalar(std::string_view name) const {
  for (const ScalarDef& d : scalars_)
    if (d.name == name) return d;
  std::string known;
  for (const ScalarDef& d : scalars_) known += (known.empty() ? "" : ", ") + d.name;
  bad(this->name(), "it has no scalar '" + std::string(name) + "' (its scalars: " + known + ")");
}

UpdateProgram UpdateProgram::with_rule(std::string_view name, ScalarRule rule) const {
  return with_rules({ScalarDef{std::string(name), rule}});
}

UpdateProgram UpdateProgram::with_rules(const std::vector<ScalarDef>& defs) const {
  std::vector<ScalarDef> updated = scalars_;
  for (const ScalarDef& d : defs) {
    const ScalarDef& old = scalar(d.name);
    jit::check_rule(this->name(), d.name, d.rule);
    updated[static_cast<std::size_t>(&old - scalars_.data())].rule = d.rule;
  }
  bool has_gscale = false;
  for (const ScalarDef& d : updated) has_gscale |= d.rule.kind == ScalarRule::Kind::gscale;
  if (!has_gscale)
    bad(this->name(), "no scalar would keep the gscale rule, which would cut the gradient multiplier out of the update");
  return UpdateProgram(storage_, std::move(updated));
}

UpdateProgram UpdateProgram::with_value(std::string_view name, double value) const {
  const ScalarDef& d = scalar(name);
  if (d.rule.kind != ScalarRule::Kind::fixed)
    bad(this->name(), "scalar '" + std::string(name) + "' has rule " + std::string(scalar_rule_name(d.rule.kind)) + " (" +
                          jit::rule_text(d.rule) + "), not a fixed value: change its rule instead");
  return with_rule(name, ScalarRule{ScalarRule::Kind::fixed, value, 0.0});
}

std::string UpdateProgram::text() const {
  std::string out = to_string(program()) + "scalars\n";
  for (const ScalarDef& d : scalars_) out += "  " + d.name + " = " + jit::rule_text(d.rule) + "\n";
  return out;
}

}  // namespace stepfuse
