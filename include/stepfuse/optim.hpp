// Optimizer hyperparameters, with PyTorch's names and defaults.
#pragma once

#include <string_view>
#include <variant>

namespace stepfuse {
namespace optim {

// torch.optim.SGD
struct SGD {
  double lr = 1e-3, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false, maximize = false;
};
// torch.optim.Adam: weight_decay is an L2 penalty added to the gradient.
struct Adam {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool amsgrad = false, maximize = false;
};
// torch.optim.AdamW: weight_decay is decoupled (p *= 1 - lr * weight_decay).
struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  bool amsgrad = false, maximize = false;
};
// torch.optim.Adagrad. Each param group's sum starts from its own config's
// initial_accumulator_value (PyTorch's from the constructor's, in every group; stepfuse.torch
// passes that one).
struct Adagrad {
  double lr = 1e-2, lr_decay = 0, weight_decay = 0, initial_accumulator_value = 0, eps = 1e-10;
  bool maximize = false;
};
// torch.optim.RMSprop
struct RMSprop {
  double lr = 1e-2, alpha = 0.99, eps = 1e-8, weight_decay = 0, momentum = 0;
  bool centered = false, maximize = false;
};
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"),
// with decoupled weight decay as in the paper's reference code.
struct Lion {
  double lr = 1e-4, beta1 = 0.9, beta2 = 0.99, weight_decay = 0;
  bool maximize = false;
};

// torch.optim.NAdam: decoupled_weight_decay as AdamW's (p *= 1 - lr * weight_decay),
// else weight_decay is an L2 penalty added to the gradient.
struct NAdam {
  double lr = 2e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0, momentum_decay = 4e-3;
  bool decoupled_weight_decay = false, maximize = false;
};
// torch.optim.RAdam: decoupled_weight_decay as NAdam's.
struct RAdam {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool decoupled_weight_decay = false, maximize = false;
};
// torch.optim.Adamax
struct Adamax {
  double lr = 2e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool maximize = false;
};
// torch.optim.Adadelta
struct Adadelta {
  double lr = 1.0, rho = 0.9, eps = 1e-6, weight_decay = 0;
  bool maximize = false;
};
// torch.optim.Rprop: etas = (eta_minus, eta_plus), step_sizes = (step_size_min, step_size_max).
// The step_size state starts at the lr of the first applied step (an lr set before it
// is where it starts, as in PyTorch; on the CPU), then follows its own rule.
struct Rprop {
  double lr = 1e-2, eta_minus = 0.5, eta_plus = 1.2, step_size_min = 1e-6, step_size_max = 50;
  bool maximize = false;
};
// torch.optim.ASGD. One difference: a step's eta here comes from this step's lr, where
// PyTorch's step uses the eta its previous step computed (from the previous lr), so an
// lr change takes effect one step earlier here. (stepfuse.torch.ASGD hands the engine
// the lr that gives PyTorch's eta.)
struct ASGD {
  double lr = 1e-2, lambd = 1e-4, alpha = 0.75, t0 = 1e6, weight_decay = 0;
  bool maximize = false;
};
// LAMB (You et al. 2020) as NVIDIA Apex's FusedLAMB (adam_w_mode, bias correction,
// grad averaging; trust ratio ||p|| / ||u|| per tensor when weight_decay != 0). Apex's
// own global grad-norm clipping is OptimizerOptions::max_grad_norm here.
struct LAMB {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-6, weight_decay = 0.01;
  bool maximize = false;
};

}  // namespace optim

// Every built-in optimizer, in sf_optimizer_kind's order (append only). Each has
// its traits in its program file (jit/builtin/<name>.hpp), included by the
// library's registry of built-in optimizers.
using OptimizerConfig =
    std::variant<optim::SGD, optim::Adam, optim::AdamW, optim::Adagrad, optim::RMSprop, optim::Lion,
                 optim::NAdam, optim::RAdam, optim::Adamax, optim::Adadelta, optim::Rprop, optim::ASGD,
                 optim::LAMB>;

// "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Lion", "NAdam", "RAdam", "Adamax",
// "Adadelta", "Rprop", "ASGD" or "LAMB".
std::string_view optimizer_name(const OptimizerConfig& config);

}  // namespace stepfuse
