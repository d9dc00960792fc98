// GradScaler: dynamic loss scaling with the semantics of PyTorch's torch.amp.GradScaler,
// over the fused step.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stepfuse/optimizer.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse {

namespace detail {
class CudaScalerState;
}

// Usage, once per iteration:
//
//   stepfuse::GradScaler scaler("cpu");          // once, before training ("cuda", the
//                                                // default, warns once where no GPU is usable)
//   ... forward; backward of scaler.scale(loss) writes gradients scaled by S ...
//   scaler.step(opt);     // unscale + inf/NaN check + clip + update, fused; skipped on inf/NaN
//   scaler.update();      // back off after a skipped step, grow after growth_interval good ones
//
// step() runs the whole mixed-precision step in one reduce pass and one update
// pass over the optimizer's tensors; the gradients are unscaled in fp32 inside the
// kernels and never written. unscale_() is the optional in-place division for
// code that inspects or changes the gradients between backward and step().
//
// The scale is an fp32 value and its updates round as PyTorch's do, so a run
// follows torch.amp.GradScaler step for step (tests/golden holds traces of it).
// Not thread-safe: one scaler per training loop.
class GradScaler {
 public:
  // device: "cuda" or "cpu", where the scale lives. With "cuda" and a usable GPU,
  // the scale, the growth tracker and found_inf move to the GPU the first time an
  // optimizer on it is stepped (or a device tensor is scaled): step() and update()
  // then run there as kernels and never wait for the device, so a whole iteration
  // can be captured in a CUDA graph; the getters (get_scale(), state_dict(),
  // scale(double)) wait for it. "cuda" where no GPU is usable keeps the scale on
  // the CPU and warns once per process (see set_warning_handler), so the default
  // works everywhere. Any other string is an Error. Copies of a scaler whose
  // scale is on a GPU share that scale (for steps, updates and the setters); a
  // copy's load_state_dict() gives it a scale of its own.
  // Enabled, throws Error(invalid_argument) for init_scale not finite and > 0,
  // growth_factor not finite and > 1, backoff_factor not in (0, 1),
  // growth_interval < 1. Disabled, it checks only the device (as PyTorch, a
  // disabled scaler takes any values and never uses them).
  explicit GradScaler(std::string_view device = "cuda", double init_scale = 65536.0, double growth_factor = 2.0,
                      double backoff_factor = 0.5, std::int64_t growth_interval = 2000, bool enabled = true);

  // loss * S (the value whose gradients the backward pass should compute).
  // Returns loss unmodified when disabled.
  double scale(double loss) const;
  // Multiplies a tensor (or each tensor of a list) in place by S, rounding to its
  // storage dtype. No-op when disabled.
  void scale_(TensorView outputs) const;
  void scale_(std::span<const TensorView> outputs) const;

  // Divides the optimizer's gradients in place by S (multiplies by the fp32
  // reciprocal, as PyTorch does) and records whether any was inf/NaN. On the CPU it
  // is all or nothing. On a GPU it enqueues one kernel per gradient: if one cannot be
  // enqueued, the Error leaves the gradients before it unscaled, and until a second
  // unscale_() finishes the others (it does not unscale any twice), step() is
  // Error(invalid_state). Optional:
  // for code that inspects or clips gradients before step(). f16/bf16 gradients
  // are rounded back to their storage format (values below its range flush to
  // zero; the fused step() has no such loss). A second call for the same
  // optimizer before update(), or a call after step(), is Error(invalid_state).
  // No-op when disabled.
  void unscale_(Optimizer& opt);

  // The fused step: unless unscale_(opt) ran this iteration, unscales, checks for
  // inf/NaN, clips (OptimizerOptions::max_grad_norm) and updates in one reduce and
  // one update pass. On inf/NaN nothing is written (weights, state, masters, step
  // count) and it returns false. For an optimizer on a GPU the step is enqueued
  // and the skip decided on the device: it returns true, and last_step_result()
  // waits for the outcome. After unscale_(opt) it does not unscale again and
  // skips if unscale_ found inf/NaN (or the gradients are not finite now). A second step() for the same optimizer before
  // update() is Error(invalid_state). Disabled: a plain opt.step(). A scale that
  // backed off to 2^-128 or below, or to 0 (144 skipped steps in a row from 65536),
  // whose fp32 reciprocal overflows, skips every step, writing nothing, until
  // update(new_scale) sets one: with found_inf on the CPU (so the scale keeps backing
  // off); on a GPU the device skips the step but counts it as a good one.
  // Returns whether the step was applied.
  bool step(Optimizer& opt);

  // What the last step() did: applied (false = skipped; an LR scheduler should not
  // advance), found_inf, the unscaled gradient norm and the clip coefficient.
  const StepResult& last_step_result() const;

  // Ends the iteration. With no argument: multiplies the scale by backoff_factor if
  // any optimizer's step this iteration found inf/NaN (resetting the growth
  // tracker); otherwise counts one more unskipped iteration and, after
  // growth_interval of them in a row, multiplies the scale by growth_factor (kept
  // only if the result is finite). Error(invalid_state) if no optimizer was
  // stepped or unscaled since the last update(). With new_scale (finite, > 0):
  // sets the scale (the growth tracker is kept). Then every optimizer is ready for
  // a new iteration. No-op when disabled.
  void update(std::optional<double> new_scale = std::nullopt);

  double get_scale() const;  // 1.0 when disabled
  double get_growth_factor() const { return growth_factor_; }
  double get_backoff_factor() const { return backoff_factor_; }
  std::int64_t get_growth_interval() const { return growth_interval_; }
  bool is_enabled() const { return enabled_; }
  // Validated as in the constructor; nothing changes on an Error. Disabled: the
  // value is stored unchecked (the getters return it), as PyTorch's setters do.
  void set_growth_factor(double new_factor);
  void set_backoff_factor(double new_factor);
  void set_growth_interval(std::int64_t new_interval);

  // Exactly five entries: "scale", "growth_factor", "backoff_factor",
  // "growth_interval", "_growth_tracker". Empty when disabled. Call it after update().
  std::map<std::string, double> state_dict() const;
  // Restores a state_dict(). No-op when disabled. An empty map is an Error (it was
  // saved from a disabled scaler), as is a missing entry or an invalid value (a
  // scale of 0, which backoffs reach, is valid);
  // nothing changes on an Error (nor when writing the device scale fails). Extra
  // entries are ignored. A scaler whose device scale is shared (with its copy or
  // original) gets a device scale of its own here: the other's is not written.
  void load_state_dict(const std::map<std::string, double>& state);

  // "cuda" or "cpu", as given; where_scale_lives() is where it actually is.
  const std::string& device() const { return device_; }
  Device where_scale_lives() const;
  std::int64_t growth_tracker() const;

 private:
  // unscaling: a GPU unscale_() failed part-way, after `unscaled` gradients.
  enum class Stage : std::uint8_t { ready, unscaling, unscaled, stepped };
  struct PerOptimizer {
    const Optimizer* opt;
    Stage stage;
    bool found_inf;
    std::size_t unscaled;
  };
  PerOptimizer& state_of(const Optimizer& opt);
  static void check_growth_factor(double v);
  static void check_backoff_factor(double v);
  static void check_growth_interval(std::int64_t v);

  // The device copy is authoritative once it exists: pull() refreshes the host
  // values from it, push() sends them.
  void pull() const;
  void push();
  detail::CudaScalerState* device_state_for(const Optimizer& opt);

  std::string device_;
  bool gpu_usable_ = false;  // "cuda" asked for, and a GPU is usable
  std::shared_ptr<detail::CudaScalerState> cuda_;
  void* cuda_stream_ = nullptr;  // the stream of the last GPU optimizer stepped
  mutable float current_scale_;
  double growth_factor_;
  double backoff_factor_;
  std::int64_t growth_interval_;
  mutable std::int32_t growth_tracker_ = 0;  // an int32 tensor in PyTorch
  bool enabled_;
  std::vector<PerOptimizer> per_optimizer_;  // this iteration's optimizers, in first-use order
  mutable StepResult last_result_;
  const Optimizer* last_stepped_ = nullptr;
};

}  // namespace stepfuse
