// The float64 reference optimizer step: the tests' independent second copy of the math.
//
// Plain scalar double code written straight from PyTorch's documented algorithms
// (torch.optim.SGD, Adam, AdamW, Adagrad, RMSprop, NAdam, RAdam, Adamax, Adadelta,
// Rprop, ASGD; torch.nn.utils.clip_grad_norm_;
// the GradScaler's unscale and inf check) and, for Lion, from Chen et al. 2023,
// "Symbolic Discovery of Optimization Algorithms", and for LAMB from You et al. 2020
// as NVIDIA Apex's FusedLAMB computes it. It deliberately uses nothing
// from jit/ or runtime/: a bug in an update program must not be copied into its
// oracle. Only the public hyperparameter structs (stepfuse/optim.hpp) are shared.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "stepfuse/optim.hpp"

namespace stepfuse::ref {

// One parameter tensor: its (master) weights and its optimizer state, in double.
// State names match the library's: SGD "momentum_buffer" (momentum != 0);
// Adam/AdamW "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad); Adagrad "sum";
// RMSprop "square_avg", "momentum_buffer" (momentum > 0), "grad_avg" (centered);
// Lion "exp_avg"; NAdam/RAdam "exp_avg", "exp_avg_sq"; Adamax "exp_avg", "exp_inf";
// Adadelta "square_avg", "acc_delta"; Rprop "prev", "step_size"; ASGD "ax";
// LAMB "exp_avg", "exp_avg_sq".
struct RefTensor {
  std::vector<double> param;
  std::map<std::string, std::vector<double>> state;
  // NAdam: mu_product after the steps before this one, as torch keeps it (a step multiplies
  // in its own mu_t); unset: the product of mu_1 .. mu_(step-1) under the config's values.
  std::optional<double> mu_product;
};

struct RefStepInput {
  double loss_scale = 1;                // the gradients are multiplied by it
  std::optional<double> max_grad_norm;  // clip_grad_norm_ on the unscaled gradients
  double norm_type = 2;                 // 2 or infinity
  std::int64_t step = 1;                // 1-based index of the step being applied
};

struct RefStepResult {
  bool found_inf = false;         // some gradient element is inf or NaN: nothing changed
  double grad_norm = NAN;         // norm of the unscaled gradients (NaN when found_inf)
  double clip_coef = 1;           // min(1, max_norm / (norm + 1e-6)), or 1 without clipping
  // Per tensor, the gradient the optimizer update saw: g / S * clip_coef (before
  // maximize and weight decay). Empty when found_inf.
  std::vector<std::vector<double>> effective_grads;
};

// The constant torch.nn.utils.clip_grad_norm_ adds to the norm before dividing.
inline constexpr double kClipEpsilon = 1e-6;

// The state a tensor keeps under `config`, in a fixed (alphabetical) order.
std::vector<std::string> state_names(const OptimizerConfig& config);
// The value every element of state `name` starts at (0, Adagrad's initial_accumulator_value,
// Rprop's lr for "step_size"). The library stores it in fp32.
double initial_state_value(const OptimizerConfig& config, std::string_view name);
// A tensor with the given weights and freshly initialized state.
RefTensor make_tensor(const OptimizerConfig& config, std::vector<double> param);
// The learning rate of any configuration.
double learning_rate(const OptimizerConfig& config);

// True when any element of any gradient is inf or NaN.
bool any_non_finite(const std::vector<std::vector<double>>& grads);
// The total norm of a list of gradients, as clip_grad_norm_ defines it: the
// norm of the per-tensor norms (L2: sqrt of the sum of squares; inf: max |g|).
double total_norm(const std::vector<std::vector<double>>& grads, double norm_type);
// clip_grad_norm_'s multiplier: min(1, max_norm / (norm + 1e-6)).
double clip_coefficient(double norm, double max_norm);

// One optimizer update of one tensor with the (unscaled, clipped) gradient `grad`,
// `step` being the 1-based index of this step (bias corrections, Adagrad's lr decay,
// SGD's first-step momentum buffer, NAdam's momentum cache, RAdam's rectification,
// ASGD's eta and mu).
void update(const OptimizerConfig& config, RefTensor& tensor, const std::vector<double>& grad,
            std::int64_t step);

// The whole pipeline over every tensor: inf/NaN check (on a hit nothing changes and
// found_inf is returned), unscale g / S, total norm, clip coefficient, then update()
// with g / S * clip_coef. `scaled_grads[i]` are tensor i's gradients exactly as
// stored (converted exactly to double), still multiplied by the loss scale.
RefStepResult step(const OptimizerConfig& config, std::vector<RefTensor>& tensors,
                   const std::vector<std::vector<double>>& scaled_grads, const RefStepInput& input);

}  // namespace stepfuse::ref
