// The built-in optimizers: program selection, per-step scalars, hyperparameter checks.
#include "jit/builtins.hpp"

#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>

#include "jit/builtin/adagrad.hpp"
#include "jit/builtin/adam.hpp"
#include "jit/builtin/lion.hpp"
#include "jit/builtin/rmsprop.hpp"
#include "jit/builtin/sgd.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

std::string_view optimizer_name(const OptimizerConfig& config) {
  static constexpr std::string_view kNames[] = {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Lion"};
  return kNames[config.index()];
}

namespace jit {

const Program& builtin_program(Builtin b) {
  switch (b) {
    case Builtin::sgd: return kSgd;
    case Builtin::sgd_momentum: return kSgdMomentum;
    case Builtin::sgd_nesterov: return kSgdNesterov;
    case Builtin::adam: return kAdam;
    case Builtin::adam_amsgrad: return kAdamAmsgrad;
    case Builtin::adagrad: return kAdagrad;
    case Builtin::rmsprop: return kRmsprop;
    case Builtin::rmsprop_centered: return kRmspropCentered;
    case Builtin::rmsprop_momentum: return kRmspropMomentum;
    case Builtin::rmsprop_centered_momentum: return kRmspropCenteredMomentum;
    case Builtin::lion: return kLion;
    case Builtin::count: break;
  }
  throw Error(ErrorCode::invalid_argument, "unknown built-in program");
}

Builtin select_builtin(const OptimizerConfig& config) {
  return std::visit(
      [](const auto& c) -> Builtin {
        using T = std::decay_t<decltype(c)>;
        if constexpr (std::is_same_v<T, optim::SGD>)
          return c.momentum == 0 ? Builtin::sgd : c.nesterov ? Builtin::sgd_nesterov : Builtin::sgd_momentum;
        else if constexpr (std::is_same_v<T, optim::Adam> || std::is_same_v<T, optim::AdamW>)
          return c.amsgrad ? Builtin::adam_amsgrad : Builtin::adam;
        else if constexpr (std::is_same_v<T, optim::Adagrad>)
          return Builtin::adagrad;
        else if constexpr (std::is_same_v<T, optim::RMSprop>)
          return c.centered ? (c.momentum > 0 ? Builtin::rmsprop_centered_momentum : Builtin::rmsprop_centered)
                            : (c.momentum > 0 ? Builtin::rmsprop_momentum : Builtin::rmsprop);
        else
          return Builtin::lion;
      },
      config);
}

namespace {

// Checks one hyperparameter; `what` is PyTorch's wording of the constraint.
class Checker {
 public:
  explicit Checker(std::string_view optimizer) : optimizer_(optimizer) {}
  void at_least(std::string_view name, double v, double lo) const {
    if (!std::isfinite(v) || v < lo) fail(name, v, "must be finite and >= " + text(lo));
  }
  void unit_interval(std::string_view name, double v) const {  // [0, 1)
    if (!std::isfinite(v) || v < 0.0 || v >= 1.0) fail(name, v, "must be in [0, 1)");
  }
  [[noreturn]] void fail(std::string_view name, double v, const std::string& rule) const {
    throw Error(ErrorCode::invalid_argument, std::string(optimizer_) + ": invalid " + std::string(name) + " = " +
                                                 text(v) + " (" + rule + ")");
  }
  static std::string text(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return buf;
  }

 private:
  std::string_view optimizer_;
};

}  // namespace

void validate_config(const OptimizerConfig& config) {
  const Checker ck(optimizer_name(config));
  std::visit(
      [&](const auto& c) {
        using T = std::decay_t<decltype(c)>;
        ck.at_least("lr", c.lr, 0.0);
        ck.at_least("weight_decay", c.weight_decay, 0.0);
        if constexpr (std::is_same_v<T, optim::SGD>) {
          ck.at_least("momentum", c.momentum, 0.0);
          ck.at_least("dampening", c.dampening, -INFINITY);
          if (c.nesterov && (c.momentum <= 0 || c.dampening != 0))
            ck.fail("nesterov", 1.0, "Nesterov momentum requires momentum > 0 and dampening = 0; got momentum = " +
                                         Checker::text(c.momentum) + ", dampening = " + Checker::text(c.dampening));
        } else if constexpr (std::is_same_v<T, optim::Adam> || std::is_same_v<T, optim::AdamW>) {
          ck.at_least("eps", c.eps, 0.0);
          ck.unit_interval("beta1", c.beta1);
          ck.unit_interval("beta2", c.beta2);
        } else if constexpr (std::is_same_v<T, optim::Adagrad>) {
          ck.at_least("lr_decay", c.lr_decay, 0.0);
          ck.at_least("initial_accumulator_value", c.initial_accumulator_value, 0.0);
          ck.at_least("eps", c.eps, 0.0);
        } else if constexpr (std::is_same_v<T, optim::RMSprop>) {
          ck.at_least("eps", c.eps, 0.0);
          ck.at_least("momentum", c.momentum, 0.0);
          ck.at_least("alpha", c.alpha, 0.0);
        } else {
          ck.unit_interval("beta1", c.beta1);
          ck.unit_interval("beta2", c.beta2);
        }
      },
      config);
}

void scalar_rules(const OptimizerConfig& config, const Program& program, sf_scalar_rule* out) {
  for (int s = 0; s < program.num_scalars; ++s) out[s] = sf_scalar_rule{SF_RULE_FIXED, 0, 0.0, 0.0};
  std::visit(
      [&](const auto& c) {
        using T = std::decay_t<decltype(c)>;
        if constexpr (std::is_same_v<T, optim::SGD>) sgd_scalars(c, program, out);
        else if constexpr (std::is_same_v<T, optim::Adam>) adam_scalars(c, false, program, out);
        else if constexpr (std::is_same_v<T, optim::AdamW>) adam_scalars(c, true, program, out);
        else if constexpr (std::is_same_v<T, optim::Adagrad>) adagrad_scalars(c, program, out);
        else if constexpr (std::is_same_v<T, optim::RMSprop>) rmsprop_scalars(c, program, out);
        else lion_scalars(c, program, out);
      },
      config);
}

void eval_scalars(const sf_scalar_rule* rules, int n, std::int64_t step, double gscale, float* out) {
  for (int s = 0; s < n; ++s) out[s] = static_cast<float>(sf_eval_rule(&rules[s], step, gscale));
}

void fill_scalars(const OptimizerConfig& config, const Program& program, std::int64_t step, double gscale,
                  float* out) {
  sf_scalar_rule rules[kMaxScalars];
  scalar_rules(config, program, rules);
  eval_scalars(rules, program.num_scalars, step, gscale, out);
}

float initial_state_value(const OptimizerConfig& config, const Program& program, int stream) {
  if (const auto* a = std::get_if<optim::Adagrad>(&config); a && program.streams[stream].name == "sum")
    return static_cast<float>(a->initial_accumulator_value);
  return program.streams[stream].init;
}

}  // namespace jit
}  // namespace stepfuse
