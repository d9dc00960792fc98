// stepfuse::Optimizer: the public front-end over the step engine.
#include "stepfuse/optimizer.hpp"

#include <cmath>
#include <string>

#include "jit/base/format.hpp"
#include "runtime/step_engine.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

Optimizer::Optimizer(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options)
    : engine_(std::make_unique<detail::StepEngine>(std::move(config), std::move(params), options)) {}
Optimizer::Optimizer(UpdateProgram program, std::vector<Param> params, OptimizerOptions options)
    : engine_(std::make_unique<detail::StepEngine>(std::move(program), std::move(params), options)) {}
Optimizer::~Optimizer() = default;
Optimizer::Optimizer(Optimizer&&) noexcept = default;
Optimizer& Optimizer::operator=(Optimizer&&) noexcept = default;

void Optimizer::step() { engine_->step(1.0, false); }
StepResult Optimizer::step_scaled(double loss_scale) { return engine_->step(loss_scale, true); }

const OptimizerConfig& Optimizer::config() const { return engine_->config(); }
void Optimizer::set_config(const OptimizerConfig& config) { engine_->set_config(config); }

namespace {

// A custom program's fixed scalar `lr` (set_lr / lr), or Error(invalid_state).
void require_fixed_lr(const UpdateProgram& p) {
  const int s = p.program().find_scalar("lr");
  if (s < 0)
    throw Error(ErrorCode::invalid_state, "lr: update program '" + std::string(p.name()) +
                                              "' declares no scalar 'lr' (use scalar() / set_scalar() with its scalars' names)");
  if (p.scalars()[s].rule.kind != ScalarRule::Kind::fixed)
    throw Error(ErrorCode::invalid_state, "lr: scalar 'lr' of update program '" + std::string(p.name()) + "' has rule " +
                                              std::string(scalar_rule_name(p.scalars()[s].rule.kind)) +
                                              ", not a fixed value (use set_scalar_rule())");
}

}  // namespace

void Optimizer::set_lr(double lr) {
  if (const UpdateProgram* custom = engine_->custom_program()) {
    require_fixed_lr(*custom);
    if (!(std::isfinite(lr) && lr >= 0))
      throw Error(ErrorCode::invalid_argument, "set_lr: lr = " + detail::format_number(lr) + " (must be finite and >= 0)");
    engine_->set_custom_rules(custom->with_value("lr", lr));
    return;
  }
  OptimizerConfig c = engine_->config();
  std::visit([&](auto& cfg) { cfg.lr = lr; }, c);
  engine_->set_config(c);  // validates (a negative or non-finite lr is an Error; nothing changes)
}
double Optimizer::lr() const {
  if (const UpdateProgram* custom = engine_->custom_program()) {
    require_fixed_lr(*custom);
    return custom->scalar("lr").rule.a;
  }
  return std::visit([](const auto& cfg) { return cfg.lr; }, engine_->config());
}

bool Optimizer::is_custom() const { return engine_->custom_program() != nullptr; }

UpdateProgram Optimizer::update_program() const {
  if (const UpdateProgram* custom = engine_->custom_program()) return *custom;
  return UpdateProgram::from_config(engine_->config());
}

double Optimizer::scalar(std::string_view name) const {
  const UpdateProgram p = update_program();
  const ScalarDef& d = p.scalar(name);
  if (d.rule.kind != ScalarRule::Kind::fixed)
    throw Error(ErrorCode::invalid_argument, "scalar '" + std::string(name) + "' of update program '" +
                                                 std::string(p.name()) + "' has rule " +
                                                 std::string(scalar_rule_name(d.rule.kind)) +
                                                 ", not a fixed value (update_program().scalar(name).rule has it)");
  return d.rule.a;
}

void Optimizer::set_scalar(std::string_view name, double value) {
  const UpdateProgram* custom = engine_->custom_program();
  if (custom == nullptr)
    throw Error(ErrorCode::invalid_state, "set_scalar: a built-in optimizer's scalars come from its config; use set_config()");
  engine_->set_custom_rules(custom->with_value(name, value));  // validates first; nothing changes on an Error
}

void Optimizer::set_scalar_rule(std::string_view name, ScalarRule rule) {
  const UpdateProgram* custom = engine_->custom_program();
  if (custom == nullptr)
    throw Error(ErrorCode::invalid_state,
                "set_scalar_rule: a built-in optimizer's scalars come from its config; use set_config()");
  engine_->set_custom_rules(custom->with_rule(name, rule));
}

std::int64_t Optimizer::step_count() const { return engine_->step_count(); }
double Optimizer::last_grad_norm() const { return engine_->last().grad_norm; }
const StepResult& Optimizer::last_result() const { return engine_->last(); }
const OptimizerOptions& Optimizer::options() const { return engine_->options(); }
int Optimizer::num_threads() const { return engine_->threads(); }
std::string_view Optimizer::backend() const { return engine_->backend(); }

std::string_view cpu_backend_name(CpuBackend backend) {
  switch (backend) {
    case CpuBackend::automatic: return "auto";
    case CpuBackend::highway: return "highway";
    case CpuBackend::llvm: return "llvm";
  }
  return "?";
}
std::size_t Optimizer::num_params() const { return engine_->params().size(); }
const std::vector<Param>& Optimizer::params() const { return engine_->params(); }

std::vector<std::string_view> Optimizer::state_names() const {
  std::vector<std::string_view> names;
  const Program& p = engine_->program();
  for (int s = 0; s < p.num_streams; ++s)
    if (p.streams[s].role == StreamRole::state) names.push_back(p.streams[s].name);
  return names;
}

namespace {
void check_param_index(std::size_t param, std::size_t n) {
  if (param >= n)
    throw Error(ErrorCode::invalid_argument,
                "param index " + std::to_string(param) + " is out of range (the optimizer has " + std::to_string(n) + " params)");
}
}  // namespace

std::span<float> Optimizer::mutable_state(std::size_t param, std::string_view name) {
  check_param_index(param, num_params());
  const int s = engine_->state_stream(name);
  if (s < 0) {
    std::string known;
    for (auto n : state_names()) known += (known.empty() ? "" : ", ") + std::string(n);
    throw Error(ErrorCode::invalid_argument, "state '" + std::string(name) + "' does not exist for " +
                                                 std::string(engine_->program().name) + " (its state: " +
                                                 (known.empty() ? "none" : known) + ")");
  }
  return {engine_->state_data(param, s), static_cast<std::size_t>(engine_->params()[param].weight.numel)};
}
std::span<const float> Optimizer::state(std::size_t param, std::string_view name) const {
  return const_cast<Optimizer*>(this)->mutable_state(param, name);
}
std::span<const float> Optimizer::master(std::size_t param) const {
  check_param_index(param, num_params());
  float* m = engine_->master_data(param);
  if (m == nullptr) return {};
  return {m, static_cast<std::size_t>(engine_->params()[param].weight.numel)};
}
std::string Optimizer::program_text() const { return to_string(engine_->program()); }
const std::vector<double>& Optimizer::last_tensor_grad_norms() const { return engine_->tensor_norms(); }

}  // namespace stepfuse
