// The built-in optimizers: which program a config runs, its scalars, its checks.
#pragma once

#include <cstdint>

#include "jit/step_scalars.h"
#include "stepfuse/optim.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse::jit {

// A built-in program: its index in the registry's list of every optimizer's
// programs (jit/builtin/registry.hpp: kBuiltinPrograms, builtin_named), which
// also indexes the CPU backend's fused kernels. `none` is no built-in (a custom
// program).
enum class Builtin : std::uint8_t { none = 0xff };
// How many built-in programs there are: Builtin values 0 .. kNumBuiltins - 1.
extern const int kNumBuiltins;

const Program& builtin_program(Builtin b);

// The program a config runs (flags such as amsgrad or nesterov pick the variant).
Builtin select_builtin(const OptimizerConfig& config);

// Throws Error(invalid_argument) naming the hyperparameter and its value for
// everything PyTorch's constructors reject (negative lr, beta outside [0, 1), ...)
// and for non-finite values.
void validate_config(const OptimizerConfig& config);

// The rules that give the program's per-step scalars for a config (one per
// scalar slot; jit/step_scalars.h). Every backend evaluates these same rules.
void scalar_rules(const OptimizerConfig& config, const Program& program, sf_scalar_rule* out);
// Evaluates n rules for applying step `step` (1-based) with the gradient
// multiplier `gscale`, rounding each to fp32.
void eval_scalars(const sf_scalar_rule* rules, int n, std::int64_t step, double gscale, float* out);

// The program's per-step scalars for applying step `step` (1-based) with the
// gradient multiplier `gscale` (1/loss_scale times the clip coefficient):
// scalar_rules() then eval_scalars(). Writes program.num_scalars floats to `out`.
void fill_scalars(const OptimizerConfig& config, const Program& program, std::int64_t step, double gscale,
                  float* out);

// The initial value of a state stream (Adagrad's sum starts at initial_accumulator_value).
float initial_state_value(const OptimizerConfig& config, const Program& program, int stream);
// Whether the optimizer's initial state is PyTorch's at its first step (Rprop), not at construction.
bool initial_state_at_first_step(const OptimizerConfig& config);

}  // namespace stepfuse::jit
