// An optimizer's step over a backend: configuration, scalar rules, validation, results.
#include "runtime/step_engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_set>

#include "jit/base/format.hpp"
#include "jit/update_program_rules.hpp"
#include "runtime/cpu/fused_backend.hpp"
#include "runtime/cpu/unfused_backend.hpp"
#include "stepfuse/cuda.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {

[[noreturn]] void bad_argument(const std::string& message) { throw Error(ErrorCode::invalid_argument, message); }

std::string param_name(std::size_t i, const char* field) {
  return "params[" + std::to_string(i) + "]." + field;
}

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= static_cast<unsigned>(DType::bf16); }

void validate_params(const std::vector<Param>& params) {
  if (params.empty()) bad_argument("Optimizer: the parameter list is empty (pass at least one Param)");
  std::unordered_set<const void*> seen;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    for (const auto& [view, field] : {std::pair{&p.weight, "weight"}, std::pair{&p.grad, "grad"}}) {
      if (!valid_dtype(view->dtype))
        bad_argument(param_name(i, field) + ".dtype = " + std::to_string(static_cast<int>(view->dtype)) +
                     " is not a DType (use DType::f32, f16 or bf16)");
      if (view->numel < 0) bad_argument(param_name(i, field) + ".numel = " + std::to_string(view->numel) + " is negative");
      if (view->numel > 0 && view->data == nullptr)
        bad_argument(param_name(i, field) + ".data is null with numel = " + std::to_string(view->numel));
    }
    if (p.weight.numel != p.grad.numel)
      bad_argument(param_name(i, "weight") + ".numel = " + std::to_string(p.weight.numel) + " but " +
                   param_name(i, "grad") + ".numel = " + std::to_string(p.grad.numel) + " (they must match)");
    if (p.weight.data != nullptr && p.weight.numel > 0 && !seen.insert(p.weight.data).second)
      bad_argument(param_name(i, "weight") + ".data appears in more than one Param (each tensor may appear once)");
    if (p.weight.numel > 0 && p.weight.data == p.grad.data)
      bad_argument(param_name(i, "grad") + ".data is the same buffer as the weight");
  }
}

void validate_options(const OptimizerOptions& o) {
  if (o.device.kind == Device::Kind::cuda) {
    if (const CudaStatus cs = cuda_available(); !cs)
      throw Error(ErrorCode::unsupported, "OptimizerOptions::device = cuda:" + std::to_string(o.device.index) +
                                              ": the CUDA backend cannot run here: " + cs.reason + " (use Device::cpu())");
    if (o.fusion != Fusion::fused)
      throw Error(ErrorCode::unsupported, "OptimizerOptions::fusion: the unfused and interpreted modes run on the CPU "
                                          "only (use Fusion::fused with Device::cuda)");
  } else if (o.device.kind != Device::Kind::cpu) {
    bad_argument("OptimizerOptions::device.kind = " + std::to_string(static_cast<int>(o.device.kind)) +
                 " is not a Device kind (use Device::cpu() or Device::cuda(i))");
  }
  if (o.cuda_stream != nullptr && o.device.kind != Device::Kind::cuda)
    bad_argument("OptimizerOptions::cuda_stream is set but the device is the CPU (set device = Device::cuda(i))");
  if (o.norm_type != 2.0 && o.norm_type != INFINITY)
    bad_argument("OptimizerOptions::norm_type = " + format_number(o.norm_type) + " (use 2.0 or INFINITY)");
  if (o.max_grad_norm && !(std::isfinite(*o.max_grad_norm) && *o.max_grad_norm > 0))
    bad_argument("OptimizerOptions::max_grad_norm = " + format_number(*o.max_grad_norm) +
                 " (must be finite and > 0; leave it empty for no clipping)");
  if (o.num_threads < 0 || o.num_threads > 1024)
    bad_argument("OptimizerOptions::num_threads = " + std::to_string(o.num_threads) + " (use 0 for the default, or 1 to 1024)");
  if (static_cast<unsigned>(o.fusion) > static_cast<unsigned>(Fusion::interpreted))
    bad_argument("OptimizerOptions::fusion = " + std::to_string(static_cast<int>(o.fusion)) + " is not a Fusion value");
}

}  // namespace

StepEngine::StepEngine(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options)
    : config_(std::move(config)), params_(std::move(params)), options_(options) {
  jit::validate_config(config_);
  validate_params(params_);
  validate_options(options_);
  builtin_ = jit::select_builtin(config_);
  program_ = &jit::builtin_program(builtin_);
  jit::scalar_rules(config_, *program_, rules_);
  float init[kMaxStreams] = {};
  for (int s = 0; s < program_->num_streams; ++s) init[s] = jit::initial_state_value(config_, *program_, s);
  setup(init);
}

StepEngine::StepEngine(UpdateProgram program, std::vector<Param> params, OptimizerOptions options)
    : custom_(std::make_unique<UpdateProgram>(std::move(program))), params_(std::move(params)), options_(options) {
  validate_params(params_);
  validate_options(options_);
  program_ = &custom_->program();  // lives in custom_'s storage, as long as the engine
  for (int s = 0; s < program_->num_scalars; ++s) rules_[s] = jit::device_rule(custom_->scalars()[s].rule);
  float init[kMaxStreams] = {};
  for (int s = 0; s < program_->num_streams; ++s) init[s] = program_->streams[s].init;
  setup(init);
}

void StepEngine::no_config(const char* what) {
  throw Error(ErrorCode::invalid_state, std::string(what) +
                                            ": a custom-program optimizer has no OptimizerConfig; use scalar() / "
                                            "set_scalar() (and lr() / set_lr() when the program has a fixed scalar 'lr')");
}

void StepEngine::set_custom_rules(const UpdateProgram& program) {
  if (!custom_) throw Error(ErrorCode::invalid_state, "a built-in optimizer's scalars come from its config; use set_config()");
  if (to_string(program.program()) != to_string(*program_))
    bad_argument("the update program '" + std::string(program.name()) + "' is not the one this optimizer runs ('" +
                 std::string(program_->name) + "'): only its scalar rules can change");
  // Same program text: same scalars in the same order. Keep our storage (program_ points into it).
  *custom_ = custom_->with_rules(program.scalars());
  for (int s = 0; s < program_->num_scalars; ++s) rules_[s] = jit::device_rule(custom_->scalars()[s].rule);
}

void StepEngine::setup(const float* state_init) {
  if (options_.device.kind == Device::Kind::cuda) {
    auto cuda = std::make_unique<CudaBackend>(*program_, params_, options_, state_init);
    cuda_ = cuda.get();
    backend_ = std::move(cuda);
  } else if (options_.fusion == Fusion::unfused) {
    backend_ = std::make_unique<cpu::UnfusedBackend>(*program_, params_, options_, state_init);
  } else {
    // The compile-time fused kernels for a built-in with Fusion::fused; else the interpreter.
    const std::optional<jit::Builtin> fused =
        options_.fusion == Fusion::fused && !custom_ ? std::optional(builtin_) : std::nullopt;
    // A custom program's names live in its storage, which a background compile keeps alive.
    std::shared_ptr<const void> owner = custom_ ? std::make_shared<const UpdateProgram>(*custom_) : nullptr;
    backend_ = std::make_unique<cpu::FusedBackend>(*program_, fused, params_, options_, state_init, std::move(owner));
  }
  tensor_norms_.assign(params_.size(), NAN);
}

int StepEngine::state_stream(std::string_view name) const {
  const int s = program_->find_stream(name);
  return s >= 0 && program_->streams[s].role == StreamRole::state ? s : -1;
}

void StepEngine::set_config(const OptimizerConfig& config) {
  if (custom_) no_config("set_config()");
  check_config(config);
  config_ = config;
  jit::scalar_rules(config_, *program_, rules_);
}

void StepEngine::check_config(const OptimizerConfig& config) const {
  if (custom_) no_config("set_config()");
  if (config.index() != config_.index())
    bad_argument("set_config: the optimizer is " + std::string(optimizer_name(config_)) + " but the new config is " +
                 std::string(optimizer_name(config)) + " (build a new Optimizer to change the kind)");
  jit::validate_config(config);
  if (jit::select_builtin(config) != builtin_)
    bad_argument("set_config: the new config needs update program '" +
                 std::string(jit::builtin_program(jit::select_builtin(config)).name) + "' but this optimizer runs '" +
                 std::string(program_->name) +
                 "' (amsgrad, nesterov, centered and momentum on/off change the state; build a new Optimizer)");
}

const StepResult& StepEngine::last() const {
  if (last_.pending) last_ = backend_->read_result(&tensor_norms_);
  return last_;
}

const std::vector<double>& StepEngine::tensor_norms() const {
  last();
  return tensor_norms_;
}

const StepResult& StepEngine::step_device_scale(const float* scale, sf_scaler_state* scaler) {
  StepRequest request;
  request.scaled = true;
  request.rules = rules_;
  request.device_scale = scale;
  request.scaler = scaler;
  last_ = backend_->step(request, tensor_norms_);
  return last_;
}

const StepResult& StepEngine::step(double loss_scale, bool scaled) {
  if (!(std::isfinite(loss_scale) && loss_scale > 0))
    bad_argument("step: loss_scale = " + format_number(loss_scale) + " (must be finite and > 0)");
  StepRequest request;
  request.loss_scale = loss_scale;
  request.scaled = scaled;
  request.rules = rules_;
  last_ = backend_->step(request, tensor_norms_);
  return last_;
}

}  // namespace stepfuse::detail
