// stepfuse::Optimizer: the public front-end over the step engine.
#include "stepfuse/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "jit/base/format.hpp"
#include "jit/step_scalars.h"
#include "runtime/cpu/host_buffers.hpp"
#include "runtime/cpu/q8.hpp"
#include "runtime/step_engine.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

namespace {

// Builds the engine. Sharded, construction is collective (runtime/shard.hpp): a
// rank whose own construction throws tells the others before rethrowing, so
// every rank throws and none waits for it.
template <class... Args>
std::unique_ptr<detail::StepEngine> make_engine(const OptimizerOptions& options, Args&&... args) {
  std::unique_ptr<detail::StepEngine> engine;
  try {
    engine = std::make_unique<detail::StepEngine>(std::forward<Args>(args)...);
  } catch (...) {
    if (options.communicator) detail::Shard::refuse(options, std::current_exception());
    throw;
  }
  if (options.communicator) engine->connect_shard();
  return engine;
}

}  // namespace

Optimizer::Optimizer(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options)
    : engine_(make_engine(options, std::vector<ParamGroup>{{std::move(params), std::move(config)}}, options,
                          /*name_groups=*/false)) {}
Optimizer::Optimizer(std::vector<ParamGroup> groups, OptimizerOptions options)
    : engine_(make_engine(options, std::move(groups), options, /*name_groups=*/true)) {}
Optimizer::Optimizer(UpdateProgram program, std::vector<Param> params, OptimizerOptions options)
    : engine_(make_engine(options, std::move(program), std::move(params), options)) {}
Optimizer::~Optimizer() = default;
Optimizer::Optimizer(Optimizer&&) noexcept = default;
Optimizer& Optimizer::operator=(Optimizer&&) noexcept = default;

void Optimizer::step() { engine_->step(1.0, false); }
StepResult Optimizer::step_scaled(double loss_scale) { return engine_->step(loss_scale, true); }

const OptimizerConfig& Optimizer::config() const { return engine_->config(); }
void Optimizer::set_config(const OptimizerConfig& config) {
  // Every group, or none: check them all before changing any.
  for (std::size_t g = 0; g < engine_->num_groups(); ++g) engine_->check_config(g, config);
  for (std::size_t g = 0; g < engine_->num_groups(); ++g) engine_->set_config(g, config);
}

std::size_t Optimizer::num_groups() const { return engine_->num_groups(); }
const OptimizerConfig& Optimizer::config(std::size_t group) const {
  engine_->check_group(group, "config");
  return engine_->config(group);
}
void Optimizer::set_config(std::size_t group, const OptimizerConfig& config) { engine_->set_config(group, config); }
std::size_t Optimizer::group_of(std::size_t param) const {
  if (param >= engine_->params().size())
    throw Error(ErrorCode::invalid_argument, "group_of: param index " + std::to_string(param) +
                                                 " is out of range (the optimizer has " +
                                                 std::to_string(engine_->params().size()) + " params)");
  return engine_->group_of(param);
}
std::span<const Param> Optimizer::group_params(std::size_t group) const {
  engine_->check_group(group, "group_params");
  return std::span<const Param>(engine_->params()).subspan(engine_->group_begin(group),
                                                           engine_->group_end(group) - engine_->group_begin(group));
}
std::int64_t Optimizer::group_step_count(std::size_t group) const {
  engine_->check_group(group, "group_step_count");
  return engine_->group_step_count(group);
}
std::optional<StateFormat> Optimizer::group_state_format(std::size_t group) const {
  engine_->check_group(group, "group_state_format");
  return engine_->group_state_format(group);
}

void Optimizer::set_grads(std::span<const TensorView> grads) { engine_->set_grads(grads); }

namespace {
// The group's NAdam config; Error(invalid_state) naming `what` for another optimizer.
const optim::NAdam& nadam_of(const detail::StepEngine& e, std::size_t group, const char* what) {
  e.check_group(group, what);
  const optim::NAdam* c = e.custom_program() == nullptr ? std::get_if<optim::NAdam>(&e.config(group)) : nullptr;
  if (c == nullptr)
    throw Error(ErrorCode::invalid_state,
                std::string(what) + ": group " + std::to_string(group) + " runs " +
                    (e.custom_program() != nullptr ? std::string("a custom program")
                                                   : std::string(optimizer_name(e.config(group)))) +
                    ", not NAdam (mu_product is NAdam's state)");
  return *c;
}
}  // namespace

double Optimizer::nadam_mu_product(std::size_t group) const {
  nadam_of(*engine_, group, "nadam_mu_product");
  return engine_->nadam_product(group);
}

void Optimizer::set_nadam_mu_product(std::size_t group, double mu_product) {
  nadam_of(*engine_, group, "set_nadam_mu_product");
  if (!(mu_product >= 0.0 && mu_product <= 1.0))
    throw Error(ErrorCode::invalid_argument, "set_nadam_mu_product: mu_product = " + detail::format_number(mu_product) +
                                                 " (a product of NAdam's mu_t lies in [0, 1])");
  engine_->set_nadam_product(group, mu_product);
}

double Optimizer::nadam_mu_product_offset(std::size_t group) const {
  nadam_of(*engine_, group, "nadam_mu_product_offset");
  return engine_->product_offset(group);
}

void Optimizer::set_group_step_count(std::size_t group, std::int64_t count) {
  engine_->check_group(group, "set_group_step_count");
  if (count < 0)
    throw Error(ErrorCode::invalid_argument,
                "set_group_step_count: count = " + std::to_string(count) + " (must be >= 0)");
  std::vector<std::int64_t> bases;
  for (std::size_t g = 0; g < engine_->num_groups(); ++g) bases.push_back(engine_->step_base(g));
  bases[group] = engine_->step_count() - count;
  engine_->set_steps(engine_->step_count(), bases);
}

void Optimizer::add_param_group(ParamGroup group) {
  if (engine_->custom_program() != nullptr)
    throw Error(ErrorCode::invalid_state,
                "add_param_group: a custom-program optimizer has one group (build another Optimizer for more tensors)");
  if (engine_->shard() != nullptr)
    throw Error(ErrorCode::unsupported,
                "add_param_group: a sharded optimizer's tensors are fixed at construction (every rank's shard was "
                "checked against the others'); build a new sharded Optimizer on every rank instead");
  detail::StepEngine& old = *engine_;
  std::vector<ParamGroup> groups = old.param_groups();
  groups.push_back(std::move(group));
  // A new engine over every group (validated against the existing tensors; on an
  // Error nothing changed), then the existing groups' state, masters and steps.
  auto next = std::make_unique<detail::StepEngine>(std::move(groups), old.options(), /*name_groups=*/true);
  const detail::StepPrograms& from = old.programs();
  for (std::size_t i = 0; i < old.params().size(); ++i) {
    const auto n = static_cast<std::size_t>(old.params()[i].weight.numel);
    for (int b = 0; b < from.num_states(); ++b) {
      if (!old.has_state(i, b)) continue;
      // (the same stream of the same tensor: the same format, copied as stored)
      const detail::StateSlot src = old.state_slot(i, b);
      const detail::StateSlot dst = next->state_slot(i, next->state_stream(from.state_names[static_cast<std::size_t>(b)]));
      std::memcpy(dst.data, src.data, n * state_format_size(src.format));
      if (src.format == StateFormat::q8) std::copy_n(src.absmax, cpu::q8_blocks(n), dst.absmax);
    }
    if (const float* m = old.master_data(i)) std::copy(m, m + n, next->master_data(i));
    if (const std::uint16_t* c = old.compensation_data(i)) std::copy(c, c + n, next->compensation_data(i));
  }
  std::vector<std::int64_t> bases;
  for (std::size_t g = 0; g < old.num_groups(); ++g) bases.push_back(old.step_base(g));
  bases.push_back(old.step_count());  // the new group starts at step 0
  next->set_steps(old.step_count(), bases);
  for (std::size_t g = 0; g < old.num_groups(); ++g)
    next->set_product_offset(g, old.product_offset(g), old.product_since(g));
  engine_ = std::move(next);
}

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

double Optimizer::lr(std::size_t group) const {
  engine_->check_group(group, "lr");
  if (engine_->custom_program() != nullptr) return lr();
  return std::visit([](const auto& cfg) { return cfg.lr; }, engine_->config(group));
}
void Optimizer::set_lr(std::size_t group, double lr) {
  engine_->check_group(group, "set_lr");
  if (engine_->custom_program() != nullptr) return set_lr(lr);
  OptimizerConfig c = engine_->config(group);
  std::visit([&](auto& cfg) { cfg.lr = lr; }, c);
  engine_->set_config(group, c);  // validates (a negative or non-finite lr is an Error; nothing changes)
}

void Optimizer::set_lr(double lr) {
  if (const UpdateProgram* custom = engine_->custom_program()) {
    require_fixed_lr(*custom);
    if (!(std::isfinite(lr) && lr >= 0))
      throw Error(ErrorCode::invalid_argument, "set_lr: lr = " + detail::format_number(lr) + " (must be finite and >= 0)");
    engine_->set_custom_rules(custom->with_value("lr", lr));
    return;
  }
  // Every group, or none: check them all before changing any.
  // (No container: set_lr allocates nothing, as a step does not.)
  const auto with_lr = [&](std::size_t g) {
    OptimizerConfig c = engine_->config(g);
    std::visit([&](auto& cfg) { cfg.lr = lr; }, c);
    return c;
  };
  for (std::size_t g = 0; g < engine_->num_groups(); ++g) engine_->check_config(g, with_lr(g));  // lr < 0: an Error
  for (std::size_t g = 0; g < engine_->num_groups(); ++g) engine_->set_config(g, with_lr(g));
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

std::vector<std::string_view> Optimizer::state_names() const { return engine_->programs().state_names; }

namespace {
void check_param_index(std::size_t param, std::size_t n) {
  if (param >= n)
    throw Error(ErrorCode::invalid_argument,
                "param index " + std::to_string(param) + " is out of range (the optimizer has " + std::to_string(n) + " params)");
}
}  // namespace

int Optimizer::state_buffer(std::size_t param, std::string_view name) const {
  check_param_index(param, num_params());
  const int s = engine_->state_stream(name);
  if (s < 0) {
    std::string known;
    for (auto n : state_names()) known += (known.empty() ? "" : ", ") + std::string(n);
    throw Error(ErrorCode::invalid_argument, "state '" + std::string(name) + "' does not exist for " +
                                                 std::string(engine_->program(engine_->group_of(param)).name) + " (its state: " +
                                                 (known.empty() ? "none" : known) + ")");
  }
  if (!engine_->has_state(param, s))
    throw Error(ErrorCode::invalid_argument,
                "state '" + std::string(name) + "' does not exist for param " + std::to_string(param) + ": its group (" +
                    std::to_string(engine_->group_of(param)) + ") runs " +
                    std::string(engine_->program(engine_->group_of(param)).name) + ", which keeps none");
  return s;
}

std::span<float> Optimizer::mutable_state(std::size_t param, std::string_view name) {
  const detail::StateSlot slot = engine_->state_slot(param, state_buffer(param, name));
  if (slot.format != StateFormat::f32)
    throw Error(ErrorCode::invalid_state,
                "state '" + std::string(name) + "' of param " + std::to_string(param) + " is stored as " +
                    std::string(state_format_name(slot.format)) +
                    ", not f32 (read it with state_values(), or as stored with state_storage() and state_absmax())");
  return {static_cast<float*>(slot.data), static_cast<std::size_t>(engine_->params()[param].weight.numel)};
}
StateFormat Optimizer::state_format(std::size_t param, std::string_view name) const {
  return engine_->state_slot(param, state_buffer(param, name)).format;
}
std::span<std::byte> Optimizer::mutable_state_storage(std::size_t param, std::string_view name) {
  const detail::StateSlot slot = engine_->state_slot(param, state_buffer(param, name));
  return {static_cast<std::byte*>(slot.data),
          static_cast<std::size_t>(engine_->params()[param].weight.numel) * state_format_size(slot.format)};
}
std::span<const std::byte> Optimizer::state_storage(std::size_t param, std::string_view name) const {
  return const_cast<Optimizer*>(this)->mutable_state_storage(param, name);
}
std::span<float> Optimizer::mutable_state_absmax(std::size_t param, std::string_view name) {
  const detail::StateSlot slot = engine_->state_slot(param, state_buffer(param, name));
  if (slot.format != StateFormat::q8) return {};
  const auto n = static_cast<std::size_t>(engine_->params()[param].weight.numel);
  return {slot.absmax, cpu::q8_blocks(n)};
}
std::span<const float> Optimizer::state_absmax(std::size_t param, std::string_view name) const {
  return const_cast<Optimizer*>(this)->mutable_state_absmax(param, name);
}
std::vector<float> Optimizer::state_values(std::size_t param, std::string_view name) const {
  const detail::StateSlot slot = engine_->state_slot(param, state_buffer(param, name));
  const auto n = static_cast<std::size_t>(engine_->params()[param].weight.numel);
  std::vector<float> out(n);
  if (slot.format == StateFormat::f32) std::copy_n(static_cast<const float*>(slot.data), n, out.data());
  else cpu::HostBuffers::decode(slot, 0, n, out.data());
  return out;
}
void Optimizer::set_state_values(std::size_t param, std::string_view name, std::span<const float> values) {
  const detail::StateSlot slot = engine_->state_slot(param, state_buffer(param, name));
  const auto n = static_cast<std::size_t>(engine_->params()[param].weight.numel);
  if (values.size() != n)
    throw Error(ErrorCode::invalid_argument, "set_state_values: " + std::to_string(values.size()) +
                                                 " values for state '" + std::string(name) + "' of param " +
                                                 std::to_string(param) + ", which has " + std::to_string(n) + " elements");
  if (slot.format == StateFormat::f32) std::copy_n(values.data(), n, static_cast<float*>(slot.data));
  else cpu::HostBuffers::encode(values.data(), slot, 0, n);
}

std::span<const float> Optimizer::state(std::size_t param, std::string_view name) const {
  return const_cast<Optimizer*>(this)->mutable_state(param, name);
}
std::span<float> Optimizer::mutable_master(std::size_t param) {
  check_param_index(param, num_params());
  float* m = engine_->master_data(param);
  if (m == nullptr) return {};
  return {m, static_cast<std::size_t>(engine_->params()[param].weight.numel)};
}
std::span<const float> Optimizer::master(std::size_t param) const {
  return const_cast<Optimizer*>(this)->mutable_master(param);
}
std::span<std::uint16_t> Optimizer::mutable_compensation(std::size_t param) {
  check_param_index(param, num_params());
  std::uint16_t* c = engine_->compensation_data(param);
  if (c == nullptr) return {};
  return {c, static_cast<std::size_t>(engine_->params()[param].weight.numel)};
}
std::span<const std::uint16_t> Optimizer::compensation(std::size_t param) const {
  return const_cast<Optimizer*>(this)->mutable_compensation(param);
}
std::string Optimizer::program_text() const { return to_string(engine_->program()); }
const std::vector<double>& Optimizer::last_tensor_grad_norms() const { return engine_->tensor_norms(); }

}  // namespace stepfuse
