// One configuration of every built-in update program, shared by the suites that compare
// two implementations of a step (cuda_gpu_test, llvm_backend_test): hyperparameters away
// from the defaults where they matter, so a constant baked in where a hyperparameter
// belongs shows.
#pragma once

#include <vector>

#include "stepfuse/optim.hpp"

namespace stepfuse::ref {

struct NamedBuiltin {
  const char* name;
  OptimizerConfig config;
};

inline const std::vector<NamedBuiltin>& one_config_per_program() {
  static const std::vector<NamedBuiltin> all = [] {
    optim::SGD sgd;
    sgd.lr = 0.05, sgd.weight_decay = 1e-3;
    optim::SGD momentum;
    momentum.lr = 0.05, momentum.momentum = 0.9, momentum.dampening = 0.1, momentum.weight_decay = 1e-3;
    optim::SGD nesterov;
    nesterov.lr = 0.05, nesterov.momentum = 0.9, nesterov.nesterov = true, nesterov.maximize = true;
    optim::Adam adam;
    adam.lr = 1e-3, adam.weight_decay = 1e-2;
    optim::AdamW adamw;
    adamw.lr = 2e-3, adamw.weight_decay = 5e-2;
    optim::AdamW amsgrad;
    amsgrad.amsgrad = true, amsgrad.maximize = true;
    optim::Adagrad adagrad;
    adagrad.lr = 1e-2, adagrad.lr_decay = 1e-3, adagrad.initial_accumulator_value = 0.1, adagrad.weight_decay = 1e-3;
    optim::RMSprop rmsprop;
    rmsprop.lr = 1e-3;
    optim::RMSprop centered;
    centered.centered = true, centered.weight_decay = 1e-3;
    optim::RMSprop rms_momentum;
    rms_momentum.momentum = 0.9;
    optim::RMSprop centered_momentum;
    centered_momentum.centered = true, centered_momentum.momentum = 0.5;
    optim::Lion lion;
    lion.lr = 1e-4, lion.weight_decay = 0.1;
    optim::NAdam nadam;
    nadam.lr = 3e-3, nadam.weight_decay = 1e-2, nadam.momentum_decay = 5e-3;
    optim::RAdam radam;
    radam.lr = 2e-3, radam.beta2 = 0.95, radam.weight_decay = 1e-2, radam.decoupled_weight_decay = true;
    optim::Adamax adamax;
    adamax.lr = 3e-3, adamax.beta1 = 0.8, adamax.weight_decay = 1e-3;
    optim::Adadelta adadelta;
    adadelta.lr = 0.5, adadelta.rho = 0.8, adadelta.weight_decay = 1e-3;
    optim::Rprop rprop;
    rprop.lr = 1e-3, rprop.eta_minus = 0.4, rprop.eta_plus = 1.3, rprop.step_size_max = 2e-3;
    optim::ASGD asgd;
    asgd.lr = 1e-2, asgd.lambd = 1e-3, asgd.alpha = 0.7, asgd.t0 = 1, asgd.weight_decay = 1e-3;
    optim::LAMB lamb;
    lamb.lr = 2e-3, lamb.beta1 = 0.85, lamb.weight_decay = 0.05;
    return std::vector<NamedBuiltin>{{"SGD", sgd},
                                     {"SGD_momentum", momentum},
                                     {"SGD_nesterov", nesterov},
                                     {"Adam", adam},
                                     {"AdamW", adamw},
                                     {"AdamW_amsgrad", amsgrad},
                                     {"Adagrad", adagrad},
                                     {"RMSprop", rmsprop},
                                     {"RMSprop_centered", centered},
                                     {"RMSprop_momentum", rms_momentum},
                                     {"RMSprop_centered_momentum", centered_momentum},
                                     {"Lion", lion},
                                     {"NAdam", nadam},
                                     {"RAdam", radam},
                                     {"Adamax", adamax},
                                     {"Adadelta", adadelta},
                                     {"Rprop", rprop},
                                     {"ASGD", asgd},
                                     {"LAMB", lamb}};
  }();
  return all;
}

}  // namespace stepfuse::ref
