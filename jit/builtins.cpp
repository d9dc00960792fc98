// The built-in optimizers: program selection, per-step scalars, hyperparameter
// checks, each from the optimizer's traits in the registry (jit/builtin/registry.hpp).
#include "jit/builtins.hpp"

#include <string>
#include <type_traits>
#include <variant>

#include "jit/builtin/registry.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

std::string_view optimizer_name(const OptimizerConfig& config) {
  return std::visit([](const auto& c) { return jit::OptimizerTraits<std::decay_t<decltype(c)>>::name; }, config);
}

namespace jit {

const int kNumBuiltins = static_cast<int>(kBuiltinPrograms.size());

const Program& builtin_program(Builtin b) {
  const auto i = static_cast<std::size_t>(b);
  if (i >= kBuiltinPrograms.size())
    throw Error(ErrorCode::invalid_argument, "unknown built-in program " + std::to_string(i));
  return *kBuiltinPrograms[i];
}

Builtin select_builtin(const OptimizerConfig& config) {
  return std::visit(
      [](const auto& c) {
        using T = std::decay_t<decltype(c)>;
        return kBuiltinsOf<T>[static_cast<std::size_t>(OptimizerTraits<T>::variant(c))];
      },
      config);
}

void validate_config(const OptimizerConfig& config) {
  std::visit(
      [](const auto& c) {
        using T = OptimizerTraits<std::decay_t<decltype(c)>>;
        T::validate(c, Checker(T::name));
      },
      config);
}

void scalar_rules(const OptimizerConfig& config, const Program& program, sf_scalar_rule* out) {
  for (int s = 0; s < program.num_scalars; ++s) out[s] = sf_scalar_rule{SF_RULE_FIXED, 0, 0.0, 0.0, 0.0, 0.0};
  std::visit([&](const auto& c) { OptimizerTraits<std::decay_t<decltype(c)>>::scalars(c, ScalarWriter{program, out}); },
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

bool initial_state_at_first_step(const OptimizerConfig& config) {
  return std::visit([](const auto& c) { return OptimizerTraits<std::decay_t<decltype(c)>>::kInitialStateAtFirstStep; },
                    config);
}

float initial_state_value(const OptimizerConfig& config, const Program& program, int stream) {
  return std::visit(
      [&](const auto& c) { return OptimizerTraits<std::decay_t<decltype(c)>>::initial_state(c, program, stream); },
      config);
}

}  // namespace jit
}  // namespace stepfuse
