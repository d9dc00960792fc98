// LossScaleOptimizer: Keras's dynamic loss scaling over the fused step.
#include "stepfuse/loss_scale_optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "jit/base/format.hpp"
#include "jit/config_fields.hpp"
#include "jit/step_stage.h"
#include "runtime/detail_access.hpp"
#include "runtime/scale_tensors.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

namespace {

[[noreturn]] void bad(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, "LossScaleOptimizer: " + message);
}

struct Hyper {
  std::string_view keras;  // Keras's name
  std::string_view field;  // the stepfuse (PyTorch) config field
};

// The hyperparameters each Keras optimizer registers with _set_hyper (the optimizer's
// traits, jit/builtin/<name>.hpp, list those besides learning_rate).
std::vector<Hyper> hypers_of(const OptimizerConfig& config) {
  std::vector<Hyper> h = {{"learning_rate", "lr"}};
  std::visit(
      [&](const auto& c) {
        for (const jit::KerasHyper& k : jit::OptimizerTraits<std::decay_t<decltype(c)>>::keras_hypers)
          h.push_back({k.keras, k.field});
      },
      config);
  return h;
}

// A custom program's hyperparameters: "learning_rate" for a fixed scalar "lr", and
// every fixed scalar under its own name (field = the scalar's name).
std::vector<Hyper> custom_hypers(const UpdateProgram& p) {
  std::vector<Hyper> h;
  for (const ScalarDef& d : p.scalars()) {
    if (d.rule.kind != ScalarRule::Kind::fixed) continue;
    h.push_back({d.name == "lr" ? std::string_view("learning_rate") : std::string_view(d.name), d.name});
  }
  return h;
}

}  // namespace

LossScaleOptimizer::LossScaleOptimizer(Optimizer& inner, bool dynamic, double initial_scale,
                                       std::int64_t dynamic_growth_steps)
    : inner_(&inner), dynamic_(dynamic), growth_steps_(dynamic_growth_steps) {
  // (Kept as fp32, and stepped with: its fp32 reciprocal must be finite too.)
  if (!std::isfinite(static_cast<float>(initial_scale)) || sf_unscalable(static_cast<float>(initial_scale)))
    bad("initial_scale = " + detail::format_number(initial_scale) +
        " (must be finite, above 2^-128 and within fp32 range)");
  if (dynamic_growth_steps < 1)
    bad("dynamic_growth_steps = " + std::to_string(dynamic_growth_steps) + " (must be >= 1)");
  scale_ = static_cast<float>(initial_scale);
}

double LossScaleOptimizer::get_scaled_loss(double loss) const { return loss * static_cast<double>(scale_); }

void LossScaleOptimizer::get_unscaled_gradients(const std::vector<TensorView>& grads) const {
  detail::validate_views(grads, "LossScaleOptimizer::get_unscaled_gradients: grads");
  const float reciprocal = 1.0f / scale_;  // fp32, as Keras computes it
  if (detail::CudaBackend* gpu = detail_access::engine(*inner_).cuda()) {
    gpu->scale_tensors(grads, reciprocal);  // the gradients of an optimizer on a GPU are on it too
    return;
  }
  detail::scale_tensors(grads, reciprocal, false, detail::ThreadPool::shared(inner_->num_threads()));
}

void LossScaleOptimizer::update_scale(bool finite) {
  if (!dynamic_) return;
  const sf_loss_scale next = sf_keras_update_scale({scale_, counter_}, !finite, growth_steps_);
  scale_ = next.scale;
  counter_ = next.growth_tracker;
}

bool LossScaleOptimizer::apply_gradients() {
  // Scale 1: the reduce pass checks the (already unscaled) gradients; the step is
  // skipped, writing nothing, when any is inf or NaN.
  inner_->step_scaled(1.0);
  // The dynamic scale is kept on the host, as Keras keeps it: on a GPU this reads
  // the step's outcome (the one wait per step; GradScaler has none).
  last_result_ = inner_->last_result();
  update_scale(!last_result_.found_inf);
  return last_result_.applied;
}

bool LossScaleOptimizer::minimize(const std::function<void(double loss_scale)>& backward) {
  if (!backward) bad("minimize: backward is empty (pass a function that writes the gradients of loss * loss_scale)");
  backward(static_cast<double>(scale_));
  inner_->step_scaled(static_cast<double>(scale_));
  last_result_ = inner_->last_result();
  update_scale(!last_result_.found_inf);
  return last_result_.applied;
}

std::vector<std::string> LossScaleOptimizer::hyper_names() const {
  std::vector<std::string> names;
  if (inner_->is_custom()) {
    const UpdateProgram p = inner_->update_program();
    for (const Hyper& h : custom_hypers(p)) names.emplace_back(h.keras);
    return names;
  }
  for (const Hyper& h : hypers_of(inner_->config())) names.emplace_back(h.keras);
  return names;
}

namespace {

std::string_view field_for(const std::vector<Hyper>& hypers, std::string_view optimizer, std::string_view name) {
  const std::string_view key = name == "lr" ? "learning_rate" : name;
  for (const Hyper& h : hypers)
    if (h.keras == key) return h.field;
  std::string known;
  for (const Hyper& h : hypers) {
    if (!known.empty()) known += ", ";
    known += h.keras;
  }
  std::string message = "'";
  message += name;
  bad(message + "' is not a hyperparameter of the inner " + std::string(optimizer) +
      " optimizer (its hyperparameters: " + known +
      "; other settings are not delegated: read or change them through inner_optimizer().config() / set_config())");
}

}  // namespace

double LossScaleOptimizer::get_hyper(std::string_view name, std::size_t group) const {
  if (group >= inner_->num_groups()) inner_->group_params(group);  // Error: out of range
  if (inner_->is_custom()) {  // a custom program's fixed scalars (one group)
    const UpdateProgram p = inner_->update_program();
    return inner_->scalar(field_for(custom_hypers(p), "custom update program '" + std::string(p.name()) + "'", name));
  }
  OptimizerConfig config = inner_->config(group);
  return *jit::find_number(config, field_for(hypers_of(config), optimizer_name(config), name));
}

void LossScaleOptimizer::set_hyper(std::string_view name, double value, std::size_t group) {
  if (group >= inner_->num_groups()) inner_->group_params(group);  // Error: out of range
  if (inner_->is_custom()) {
    const UpdateProgram p = inner_->update_program();
    inner_->set_scalar(field_for(custom_hypers(p), "custom update program '" + std::string(p.name()) + "'", name), value);
    return;
  }
  OptimizerConfig config = inner_->config(group);
  *jit::find_number(config, field_for(hypers_of(config), optimizer_name(config), name)) = value;
  inner_->set_config(group, config);  // validates; nothing changes on an Error
}

}  // namespace stepfuse
