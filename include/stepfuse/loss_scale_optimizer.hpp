// LossScaleOptimizer: dynamic loss scaling with the semantics of
// tf.keras.mixed_precision.LossScaleOptimizer, over the fused step.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "stepfuse/optimizer.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse {

// Wraps an Optimizer (which it references, not owns) and applies loss scaling:
//
//   stepfuse::LossScaleOptimizer lso(opt);        // dynamic, initial scale 2^15
//   lso.minimize([&](double loss_scale) {
//     ... forward, then backward of loss * loss_scale into the optimizer's grads ...
//   });                                            // unscale + check + update + scale update, fused
//
// or, with gradients computed and unscaled by hand:
//
//   double scaled_loss = lso.get_scaled_loss(loss);
//   ... backward of scaled_loss ...
//   lso.get_unscaled_gradients(grad_views);        // divide by the loss scale in place
//   lso.apply_gradients();                         // check, apply or skip, update the scale
//
// Dynamic scale: halves (never below 1) when a step's gradients are not finite,
// and resets the counter; doubles after dynamic_growth_steps finite steps in a
// row. A step with inf/NaN gradients is skipped: nothing is written. The scale
// is an fp32 value, as in Keras.
class LossScaleOptimizer {
 public:
  // Throws Error(invalid_argument) for initial_scale not finite and above 2^-128 or
  // dynamic_growth_steps < 1. `inner` must outlive this object.
  explicit LossScaleOptimizer(Optimizer& inner, bool dynamic = true, double initial_scale = 32768.0,
                              std::int64_t dynamic_growth_steps = 2000);

  // loss * loss_scale().
  double get_scaled_loss(double loss) const;
  // Divides each tensor in place by loss_scale() (multiplies by its fp32
  // reciprocal), rounding to the storage dtype.
  void get_unscaled_gradients(const std::vector<TensorView>& grads) const;
  // The inner optimizer's gradients are unscaled: checks them for inf/NaN, applies
  // the step or skips it, and updates the loss scale. Returns whether it applied.
  bool apply_gradients();
  // Calls backward(loss_scale()), which must write the gradients of loss *
  // loss_scale into the inner optimizer's gradient buffers, then runs the fused
  // step (unscale + check + clip + update in one reduce and one update pass) and
  // updates the loss scale. Returns whether the step was applied.
  bool minimize(const std::function<void(double loss_scale)>& backward);

  double loss_scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  std::int64_t dynamic_counter() const { return counter_; }
  std::int64_t dynamic_growth_steps() const { return growth_steps_; }
  Optimizer& inner_optimizer() { return *inner_; }
  const Optimizer& inner_optimizer() const { return *inner_; }
  // What the last apply_gradients()/minimize() did (applied == false: skipped).
  const StepResult& last_result() const { return last_result_; }

  // Hyperparameters, delegated to the inner optimizer under Keras's names:
  // "learning_rate" (alias "lr") for every optimizer; "beta_1", "beta_2" for Adam,
  // AdamW, Lion, NAdam and Adamax; "momentum" for SGD and RMSprop; "rho" for RMSprop
  // (PyTorch's alpha) and Adadelta. Anything else (e.g. "epsilon", which Keras does not treat as a
  // hyperparameter) is Error(invalid_argument): read or set it on the inner
  // optimizer's config. set_hyper validates as Optimizer::set_config does.
  // A custom-program inner optimizer's hyperparameters are its fixed scalars, each
  // under its own name, "lr" being "learning_rate" (Optimizer::scalar / set_scalar).
  //
  // Keras has no param groups: with several, these address group 0 (the one
  // Keras would see); the overloads taking a group address any group. A group
  // index out of range is Error(invalid_argument).
  double get_hyper(std::string_view name) const { return get_hyper(name, 0); }
  void set_hyper(std::string_view name, double value) { set_hyper(name, value, 0); }
  double get_hyper(std::string_view name, std::size_t group) const;
  void set_hyper(std::string_view name, double value, std::size_t group);
  std::vector<std::string> hyper_names() const;  // the names get_hyper accepts, without aliases

  // Delegated to the inner optimizer.
  double lr() const { return inner_->lr(); }
  void set_lr(double lr) { inner_->set_lr(lr); }
  std::int64_t iterations() const { return inner_->step_count(); }

  // Checkpoint of the inner optimizer together with the loss-scale state
  // (see Optimizer::save for the format and its guarantees; LoadOptions as for
  // Optimizer::load: convert_state loads state saved in another format).
  void save(const std::string& path) const;
  void load(const std::string& path);
  void load(const std::string& path, const LoadOptions& options);

 private:
  friend struct LossScaleCheckpoint;
  void update_scale(bool finite);

  Optimizer* inner_;
  bool dynamic_;
  float scale_;
  std::int64_t growth_steps_;
  std::int64_t counter_ = 0;
  StepResult last_result_;
};

}  // namespace stepfuse
