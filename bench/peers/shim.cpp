// A minimal C shim over stepfuse for bench/peers/peers.py (ctypes): not a stable ABI.
//
// Just enough to drive the fused step from Python on memory the caller owns (torch
// tensors' data pointers): build an optimizer over arrays of weight/gradient pointers,
// step it (plain, scaled, or through a GradScaler), read its state back for the
// correctness check, destroy it. A proper C ABI (sf_*, with a C test program) is a
// separate piece of work; nothing here is installed or promised to stay.
//
// Every function catches every exception and returns a status (0 = ok); the message of
// the last failure on this thread is sf_peer_last_error().
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "../default_configs.hpp"  // default_config_named
#include "stepfuse/stepfuse.hpp"

#define SF_PEER_API extern "C" __attribute__((visibility("default")))

namespace {

namespace sf = stepfuse;

// Status codes: 1 + stepfuse::ErrorCode for library errors, so Python can tell a bad
// argument from an unsupported configuration.
constexpr int kOk = 0;
constexpr int kOtherError = 100;  // std::bad_alloc, or anything not a stepfuse::Error

thread_local std::string last_error;

int fail(int code, std::string message) {
  last_error = std::move(message);
  return code;
}

// Runs `body`, turning any exception into a status and a message.
template <class F>
int guarded(F&& body) {
  try {
    body();
    return kOk;
  } catch (const sf::Error& e) {
    return fail(1 + static_cast<int>(e.code()), std::string(sf::error_code_name(e.code())) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return fail(kOtherError, "out of memory");
  } catch (const std::exception& e) {
    return fail(kOtherError, e.what());
  } catch (...) {
    return fail(kOtherError, "unknown exception");
  }
}

// One settable hyperparameter of an optimizer config: a double or a flag (0/1).
struct Field {
  std::string_view name;
  double* value = nullptr;
  bool* flag = nullptr;
};

// The names are the fields of stepfuse/optim.hpp (PyTorch's names).
std::vector<Field> fields(sf::optim::SGD& c) {
  return {{"lr", &c.lr}, {"momentum", &c.momentum}, {"dampening", &c.dampening}, {"weight_decay", &c.weight_decay},
          {"nesterov", nullptr, &c.nesterov}, {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::Adam& c) {
  return {{"lr", &c.lr}, {"beta1", &c.beta1}, {"beta2", &c.beta2}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"amsgrad", nullptr, &c.amsgrad}, {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::AdamW& c) {
  return {{"lr", &c.lr}, {"beta1", &c.beta1}, {"beta2", &c.beta2}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"amsgrad", nullptr, &c.amsgrad}, {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::Adagrad& c) {
  return {{"lr", &c.lr}, {"lr_decay", &c.lr_decay}, {"weight_decay", &c.weight_decay},
          {"initial_accumulator_value", &c.initial_accumulator_value}, {"eps", &c.eps},
          {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::RMSprop& c) {
  return {{"lr", &c.lr}, {"alpha", &c.alpha}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"momentum", &c.momentum}, {"centered", nullptr, &c.centered}, {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::Lion& c) {
  return {{"lr", &c.lr}, {"beta1", &c.beta1}, {"beta2", &c.beta2}, {"weight_decay", &c.weight_decay},
          {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::NAdam& c) {
  return {{"lr", &c.lr}, {"beta1", &c.beta1}, {"beta2", &c.beta2}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"momentum_decay", &c.momentum_decay}, {"decoupled_weight_decay", nullptr, &c.decoupled_weight_decay},
          {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::RAdam& c) {
  return {{"lr", &c.lr}, {"beta1", &c.beta1}, {"beta2", &c.beta2}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"decoupled_weight_decay", nullptr, &c.decoupled_weight_decay}, {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::Adamax& c) {
  return {{"lr", &c.lr}, {"beta1", &c.beta1}, {"beta2", &c.beta2}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::Adadelta& c) {
  return {{"lr", &c.lr}, {"rho", &c.rho}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::Rprop& c) {
  return {{"lr", &c.lr}, {"eta_minus", &c.eta_minus}, {"eta_plus", &c.eta_plus}, {"step_size_min", &c.step_size_min},
          {"step_size_max", &c.step_size_max}, {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::ASGD& c) {
  return {{"lr", &c.lr}, {"lambd", &c.lambd}, {"alpha", &c.alpha}, {"t0", &c.t0}, {"weight_decay", &c.weight_decay},
          {"maximize", nullptr, &c.maximize}};
}
std::vector<Field> fields(sf::optim::LAMB& c) {
  return {{"lr", &c.lr}, {"beta1", &c.beta1}, {"beta2", &c.beta2}, {"eps", &c.eps}, {"weight_decay", &c.weight_decay},
          {"maximize", nullptr, &c.maximize}};
}

sf::OptimizerConfig default_config(std::string_view kind) {
  if (std::optional<sf::OptimizerConfig> config = sf::bench::default_config_named(kind)) return *config;
  throw sf::Error(sf::ErrorCode::invalid_argument,
                  "unknown optimizer '" + std::string(kind) +
                      "' (sgd, adam, adamw, adagrad, rmsprop, lion, nadam, radam, adamax, adadelta, rprop, asgd)");
}

sf::DType dtype_of(int code) {
  switch (code) {
    case 0: return sf::DType::f32;
    case 1: return sf::DType::f16;
    case 2: return sf::DType::bf16;
    default:
      throw sf::Error(sf::ErrorCode::invalid_argument,
                      "dtype code " + std::to_string(code) + " (0 f32, 1 f16, 2 bf16)");
  }
}

sf::Fusion fusion_of(int code) {
  switch (code) {
    case 0: return sf::Fusion::fused;
    case 1: return sf::Fusion::unfused;
    case 2: return sf::Fusion::interpreted;
    default:
      throw sf::Error(sf::ErrorCode::invalid_argument,
                      "fusion code " + std::to_string(code) + " (0 fused, 1 unfused, 2 interpreted)");
  }
}

}  // namespace

struct sf_peer_optimizer {
  sf::Optimizer opt;
};
struct sf_peer_scaler {
  sf::GradScaler scaler;
};

// The message of the last failed call on this thread ("" if none failed yet).
SF_PEER_API const char* sf_peer_last_error() { return last_error.c_str(); }
SF_PEER_API const char* sf_peer_version() { return sf::version(); }
SF_PEER_API const char* sf_peer_cpu_target() { return sf::cpu_target(); }

// Builds an optimizer over n_params caller-owned tensors: weights[i] / grads[i] hold
// numels[i] elements of dtype weight_dtypes[i] / grad_dtypes[i] (0 f32, 1 f16, 2 bf16).
// kind: "adamw", "adam", "sgd", "adagrad", "rmsprop", "lion", "nadam", "radam", "adamax",
// "adadelta", "rprop", "asgd", with PyTorch's defaults;
// hyper_names[k] = hyper_values[k] overrides one (flags as 0/1; an unknown name is an
// error). max_grad_norm: 0 = no clipping. threads: 0 = the library default. fusion: 0
// fused, 1 unfused, 2 interpreted. Allocates the state; the tensors must outlive it.
SF_PEER_API int sf_peer_optimizer_create(const char* kind, const char* const* hyper_names, const double* hyper_values,
                                         int n_hyper, std::int64_t n_params, void* const* weights, void* const* grads,
                                         const std::int64_t* numels, const int* weight_dtypes, const int* grad_dtypes,
                                         double max_grad_norm, int threads, int fusion, sf_peer_optimizer** out) {
  return guarded([&] {
    if (out == nullptr || kind == nullptr) throw sf::Error(sf::ErrorCode::invalid_argument, "null kind or out");
    *out = nullptr;
    sf::OptimizerConfig config = default_config(kind);
    for (int k = 0; k < n_hyper; ++k) {
      std::visit(
          [&](auto& c) {
            for (const Field& f : fields(c)) {
              if (f.name != hyper_names[k]) continue;
              if (f.value != nullptr) *f.value = hyper_values[k];
              else *f.flag = hyper_values[k] != 0.0;
              return;
            }
            throw sf::Error(sf::ErrorCode::invalid_argument, std::string("unknown hyperparameter '") + hyper_names[k] +
                                                                 "' for " + std::string(sf::optimizer_name(config)));
          },
          config);
    }
    std::vector<sf::Param> params(static_cast<std::size_t>(n_params));
    for (std::int64_t i = 0; i < n_params; ++i)
      params[i] = {{weights[i], numels[i], dtype_of(weight_dtypes[i])},
                   {grads[i], numels[i], dtype_of(grad_dtypes[i])}};
    sf::OptimizerOptions options;
    if (max_grad_norm > 0) options.max_grad_norm = max_grad_norm;
    options.num_threads = threads;
    options.fusion = fusion_of(fusion);
    *out = new sf_peer_optimizer{sf::Optimizer(config, std::move(params), options)};
  });
}

SF_PEER_API void sf_peer_optimizer_destroy(sf_peer_optimizer* opt) { delete opt; }

SF_PEER_API int sf_peer_optimizer_num_threads(const sf_peer_optimizer* opt) { return opt->opt.num_threads(); }

// One step. loss_scale > 0: Optimizer::step_scaled(loss_scale) (unscale, inf/NaN check,
// clip, update); loss_scale == 0: Optimizer::step() on unscaled gradients. *applied: 1
// if the step was applied, 0 if it was skipped for inf/NaN.
SF_PEER_API int sf_peer_optimizer_step(sf_peer_optimizer* opt, double loss_scale, int* applied) {
  return guarded([&] {
    if (loss_scale > 0) {
      *applied = opt->opt.step_scaled(loss_scale).applied ? 1 : 0;
    } else {
      opt->opt.step();
      *applied = opt->opt.last_result().applied ? 1 : 0;
    }
  });
}

// What the last step did (StepResult).
SF_PEER_API int sf_peer_optimizer_last_result(const sf_peer_optimizer* opt, int* applied, int* found_inf,
                                              double* grad_norm, double* clip_coef) {
  return guarded([&] {
    const sf::StepResult& r = opt->opt.last_result();
    *applied = r.applied ? 1 : 0;
    *found_inf = r.found_inf ? 1 : 0;
    *grad_norm = r.grad_norm;
    *clip_coef = r.clip_coef;
  });
}

// Copies state `name` ("exp_avg", ...) of parameter `param` into out[0..numel).
SF_PEER_API int sf_peer_optimizer_copy_state(const sf_peer_optimizer* opt, std::int64_t param, const char* name,
                                             float* out, std::int64_t numel) {
  return guarded([&] {
    if (param < 0 || static_cast<std::size_t>(param) >= opt->opt.num_params())
      throw sf::Error(sf::ErrorCode::invalid_argument, "param index " + std::to_string(param) + " out of range");
    const std::span<const float> s = opt->opt.state(static_cast<std::size_t>(param), name);
    if (static_cast<std::int64_t>(s.size()) != numel)
      throw sf::Error(sf::ErrorCode::invalid_argument, "state '" + std::string(name) + "' has " +
                                                           std::to_string(s.size()) + " elements, not " +
                                                           std::to_string(numel));
    std::memcpy(out, s.data(), s.size_bytes());
  });
}

// A stepfuse::GradScaler (PyTorch's torch.amp.GradScaler semantics), device "cpu".
SF_PEER_API int sf_peer_scaler_create(double init_scale, double growth_factor, double backoff_factor,
                                      std::int64_t growth_interval, sf_peer_scaler** out) {
  return guarded([&] {
    *out = nullptr;
    *out = new sf_peer_scaler{sf::GradScaler("cpu", init_scale, growth_factor, backoff_factor, growth_interval)};
  });
}

SF_PEER_API void sf_peer_scaler_destroy(sf_peer_scaler* scaler) { delete scaler; }

SF_PEER_API double sf_peer_scaler_get_scale(const sf_peer_scaler* scaler) { return scaler->scaler.get_scale(); }

// One iteration's end, as a training loop does it: scaler.step(opt) (the fused unscale +
// inf/NaN check + clip + update, gradients by the current scale) then scaler.update().
// *applied: whether the step was applied.
SF_PEER_API int sf_peer_scaler_step_and_update(sf_peer_scaler* scaler, sf_peer_optimizer* opt, int* applied) {
  return guarded([&] {
    *applied = scaler->scaler.step(opt->opt) ? 1 : 0;
    scaler->scaler.update();
  });
}
