// What every built-in optimizer definition needs: the IR, a scalar writer, a
// hyperparameter checker, and the OptimizerTraits it specialises.
#pragma once

#include <array>
#include <cmath>
#include <string>
#include <string_view>

#include "jit/base/format.hpp"
#include "jit/step_scalars.h"
#include "stepfuse/error.hpp"
#include "stepfuse/optim.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse::jit {

// PyTorch's L2 weight decay, g + wd * p, added only where the scalar `wd` is not 0, as
// PyTorch adds it only then: at 0 an inf weight stays inf rather than turning g into
// NaN through 0 * inf.
constexpr Value l2_decayed(ProgramBuilder& b, Value g, Value p, std::string_view wd_name) {
  const Value wd = b.scalar(wd_name);
  return b.select(wd, b.add(g, b.mul(wd, p)), g);
}

// Writes the rule of a per-step scalar by name into the program's scalar slots.
// Names the program does not declare are ignored, so one definition serves
// every variant. Evaluating a rule (jit/step_scalars.h) gives a double that is
// rounded once to fp32, as PyTorch rounds a Python float to a tensor's fp32.
struct ScalarWriter {
  const Program& program;
  sf_scalar_rule* out;
  void set(std::string_view name, double value) const { rule(name, SF_RULE_FIXED, value, 0.0); }
  void rule(std::string_view name, sf_rule_kind kind, double a, double b = 0.0, double c = 0.0) const {
    const int s = program.find_scalar(name);
    if (s >= 0) out[s] = sf_scalar_rule{kind, 0, a, b, c, 0.0};
  }
  // gscale, the gradient multiplier of this step; negated to maximize.
  void gscale(bool maximize) const { rule("gscale", SF_RULE_GSCALE, maximize ? -1.0 : 1.0); }
};

// Checks one hyperparameter; `rule` is PyTorch's wording of the constraint. Throws
// Error(invalid_argument) naming the optimizer, the hyperparameter and its value.
class Checker {
 public:
  explicit Checker(std::string_view optimizer) : optimizer_(optimizer) {}
  void at_least(std::string_view name, double v, double lo) const {
    if (!std::isfinite(v) || v < lo) fail(name, v, "must be finite and >= " + text(lo));
  }
  void unit_interval(std::string_view name, double v) const {  // [0, 1)
    if (!std::isfinite(v) || v < 0.0 || v >= 1.0) fail(name, v, "must be in [0, 1)");
  }
  void closed_unit_interval(std::string_view name, double v) const {  // [0, 1]
    if (!std::isfinite(v) || v < 0.0 || v > 1.0) fail(name, v, "must be in [0, 1]");
  }
  void finite(std::string_view name, double v) const {
    if (!std::isfinite(v)) fail(name, v, "must be finite");
  }
  [[noreturn]] void fail(std::string_view name, double v, const std::string& rule) const {
    fail_text(name, text(v), rule);
  }
  [[noreturn]] void fail(std::string_view name, bool v, const std::string& rule) const {
    fail_text(name, v ? "true" : "false", rule);
  }
  [[noreturn]] void fail_text(std::string_view name, const std::string& v, const std::string& rule) const {
    throw Error(ErrorCode::invalid_argument,
                std::string(optimizer_) + ": invalid " + std::string(name) + " = " + v + " (" + rule + ")");
  }
  static std::string text(double v) { return detail::format_number(v); }

 private:
  std::string_view optimizer_;
};

// A hyperparameter Keras's optimizer registers with _set_hyper (besides
// learning_rate, which every one has), and the config field it is.
struct KerasHyper {
  std::string_view keras;
  std::string_view field;
};

// What a built-in optimizer is, specialised for its config type in its program
// file (jit/builtin/<name>.hpp) and listed once in jit/builtin/registry.hpp.
// A specialisation derives from TraitsDefaults and declares:
//   name                  std::string_view, as optimizer_name() returns it
//   programs              const Program* array: every program its configs run
//                         (optimizers may share programs: AdamW runs Adam's)
//   variant(c)            the index in `programs` of the one config c runs
//   validate(c, checker)  every check PyTorch's constructor makes, and finiteness
//   scalars(c, writer)    the rule of each per-step scalar
//   fields(c, f)          f(name, member) for every member, by PyTorch name, in
//                         declaration order (booleans as bool&, the rest double&)
//   keras_hypers          std::array<KerasHyper, N> (LossScaleOptimizer)
// and, where the default does not do, initial_state(c, program, stream).
template <class Config>
struct OptimizerTraits;

struct TraitsDefaults {
  template <class Config>
  static int variant(const Config&) { return 0; }
  // The stream's declared initial value (Adagrad's sum starts at a hyperparameter instead).
  template <class Config>
  static float initial_state(const Config&, const Program& program, int stream) {
    return program.streams[stream].init;
  }
  // Whether that initial value is PyTorch's at the first step rather than at construction
  // (Rprop's step_size: the lr of its first step), so a config set before it is followed.
  static constexpr bool kInitialStateAtFirstStep = false;
};

}  // namespace stepfuse::jit
