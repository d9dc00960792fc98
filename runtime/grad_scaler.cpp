// GradScaler: PyTorch's dynamic loss scaling over the fused step.
#include "stepfuse/grad_scaler.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "jit/base/format.hpp"
#include "jit/step_stage.h"
#include "runtime/cuda/cuda_scaler.hpp"
#include "runtime/detail_access.hpp"
#include "runtime/scale_tensors.hpp"
#include "runtime/thread_pool.hpp"
#include "jit/base/warning.hpp"
#include "stepfuse/cuda.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

namespace {

[[noreturn]] void bad(const std::string& message) { throw Error(ErrorCode::invalid_argument, "GradScaler: " + message); }

std::string num(double v) { return detail::format_number(v); }

void check_scale(const char* what, double v) {
  if (!(std::isfinite(v) && v > 0)) bad(std::string(what) + " = " + num(v) + " (the scale must be finite and > 0)");
  if (!std::isfinite(static_cast<float>(v)) || static_cast<float>(v) == 0.0f)
    bad(std::string(what) + " = " + num(v) + " is outside the range of the fp32 scale");
}

std::vector<TensorView> grads_of(const Optimizer& opt) {
  std::vector<TensorView> grads;
  for (const Param& p : opt.params()) grads.push_back(p.grad);
  return grads;
}

}  // namespace

void GradScaler::check_growth_factor(double v) {
  if (!(std::isfinite(v) && v > 1)) bad("growth_factor = " + num(v) + " (must be finite and > 1)");
}
void GradScaler::check_backoff_factor(double v) {
  if (!(v > 0 && v < 1)) bad("backoff_factor = " + num(v) + " (must be in (0, 1))");
}
void GradScaler::check_growth_interval(std::int64_t v) {
  if (v < 1 || v > INT32_MAX) bad("growth_interval = " + std::to_string(v) + " (must be in [1, 2^31 - 1])");
}

GradScaler::GradScaler(std::string_view device, double init_scale, double growth_factor, double backoff_factor,
                       std::int64_t growth_interval, bool enabled)
    : device_(device),
      growth_factor_(growth_factor),
      backoff_factor_(backoff_factor),
      growth_interval_(growth_interval),
      enabled_(enabled) {
  if (device != "cuda" && device != "cpu")
    bad("device = \"" + std::string(device) + "\" (use \"cuda\" or \"cpu\")");
  if (enabled) {  // (a disabled scaler never uses them: as PyTorch, which checks only when enabled)
    check_scale("init_scale", init_scale);
    check_growth_factor(growth_factor);
    check_backoff_factor(backoff_factor);
    check_growth_interval(growth_interval);
  }
  current_scale_ = static_cast<float>(init_scale);
  if (enabled && device == "cuda") {
    if (const CudaStatus cs = cuda_available(); cs) {
      gpu_usable_ = true;
    } else {
      detail::warn_once("GradScaler.cuda",
                        "GradScaler(device=\"cuda\"): the CUDA backend cannot run here (" + cs.reason +
                            "), so the loss scale is kept on the CPU, where the optimizers run (pass \"cpu\" to "
                            "silence this warning)");
    }
  }
}

void GradScaler::pull() const {
  if (cuda_) cuda_->pull(&current_scale_, &growth_tracker_, static_cast<cuda::CUstream>(cuda_stream_));
}

void GradScaler::push() {
  if (cuda_)
    cuda_->push(current_scale_, growth_tracker_, growth_factor_, backoff_factor_, growth_interval_,
                static_cast<cuda::CUstream>(cuda_stream_));
}

detail::CudaScalerState* GradScaler::device_state_for(const Optimizer& opt) {
  const detail::StepEngine& engine = detail_access::engine(opt);
  if (!gpu_usable_ || !engine.on_cuda()) return nullptr;
  cuda_stream_ = engine.cuda()->stream();
  if (!cuda_) {
    cuda_ = std::make_shared<detail::CudaScalerState>(engine.cuda()->context().device());
    push();
  } else if (cuda_->device() != engine.cuda()->context().device()) {
    throw Error(ErrorCode::invalid_argument,
                "GradScaler: its scale is on cuda:" + std::to_string(cuda_->device()) + " but this optimizer is on cuda:" +
                    std::to_string(engine.cuda()->context().device()) + " (use one GradScaler per GPU)");
  }
  return cuda_.get();
}

Device GradScaler::where_scale_lives() const { return cuda_ ? Device::cuda(cuda_->device()) : Device::cpu(); }

std::int64_t GradScaler::growth_tracker() const {
  pull();
  return growth_tracker_;
}

const StepResult& GradScaler::last_step_result() const {
  if (last_result_.pending && last_stepped_ != nullptr) last_result_ = last_stepped_->last_result();
  return last_result_;
}

double GradScaler::scale(double loss) const {
  if (!enabled_) return loss;
  pull();
  return loss * static_cast<double>(current_scale_);
}

void GradScaler::scale_(TensorView outputs) const { scale_(std::span<const TensorView>(&outputs, 1)); }

void GradScaler::scale_(std::span<const TensorView> outputs) const {
  if (!enabled_) return;
  detail::validate_views(outputs, "GradScaler::scale_: outputs");
  int device = 0;
  if (gpu_usable_ && !outputs.empty() && detail::is_device_pointer(outputs[0].data, &device)) {
    // Outputs on a GPU are scaled there by the device scale (created on their GPU if needed).
    auto* self = const_cast<GradScaler*>(this);
    if (!cuda_) {
      self->cuda_ = std::make_shared<detail::CudaScalerState>(device);
      self->push();
    }
    for (const TensorView& t : outputs) cuda_->scale_tensor(t, false, static_cast<cuda::CUstream>(cuda_stream_));
    return;
  }
  pull();
  detail::scale_tensors(outputs, current_scale_, false, detail::ThreadPool::shared(detail::ThreadPool::default_threads()));
}

GradScaler::PerOptimizer& GradScaler::state_of(const Optimizer& opt) {
  for (PerOptimizer& s : per_optimizer_)
    if (s.opt == &opt) return s;
  return per_optimizer_.emplace_back(PerOptimizer{&opt, Stage::ready, false, 0});
}

void GradScaler::unscale_(Optimizer& opt) {
  if (!enabled_) return;
  PerOptimizer& s = state_of(opt);
  if (s.stage == Stage::unscaled)
    throw Error(ErrorCode::invalid_state,
                "GradScaler::unscale_: unscale_() has already been called on this optimizer since the last update()");
  if (s.stage == Stage::stepped)
    throw Error(ErrorCode::invalid_state,
                "GradScaler::unscale_: unscale_() is being called after step() (call it before step(), once per iteration)");
  const std::vector<TensorView> grads = grads_of(opt);
  if (detail::CudaScalerState* dev = device_state_for(opt)) {
    // In place on the GPU, by fp32(1/S) read there; found_inf recorded there. One launch
    // per gradient, and an enqueued launch cannot be taken back: a launch that fails
    // part-way leaves the gradients before it unscaled, so the progress is recorded
    // (stage unscaling) and a retry goes on from there instead of unscaling them twice.
    for (std::size_t i = s.unscaled; i < grads.size(); ++i) {
      dev->scale_tensor(grads[i], true, static_cast<cuda::CUstream>(cuda_stream_));
      s.unscaled = i + 1;
      s.stage = Stage::unscaling;
    }
    s.found_inf = false;  // known on the device only
    s.unscaled = 0;
    s.stage = Stage::unscaled;
    return;
  }
  pull();
  // The reciprocal computed in double and rounded to float, as PyTorch does.
  const float inv = static_cast<float>(1.0 / static_cast<double>(current_scale_));
  // All or nothing: the stage changes only once every gradient is done.
  s.found_inf = detail::scale_tensors(grads, inv, true, detail::ThreadPool::shared(opt.num_threads()));
  s.stage = Stage::unscaled;
}

bool GradScaler::step(Optimizer& opt) {
  if (!enabled_) {
    opt.step();
    last_result_ = opt.last_result();
    return last_result_.applied;
  }
  PerOptimizer& s = state_of(opt);
  if (s.stage == Stage::stepped)
    throw Error(ErrorCode::invalid_state,
                "GradScaler::step: step() has already been called for this optimizer since the last update() "
                "(call update() to end the iteration first)");
  if (s.stage == Stage::unscaling)
    throw Error(ErrorCode::invalid_state,
                "GradScaler::step: unscale_() failed part-way for this optimizer (" + std::to_string(s.unscaled) +
                    " of " + std::to_string(opt.num_params()) +
                    " gradients were unscaled); call unscale_() again to finish it before step()");
  if (detail::CudaScalerState* dev = device_state_for(opt)) {
    // On the GPU: the scale is read and found_inf recorded by the kernels. After
    // unscale_() the gradients are stepped at scale 1 (a device 1.0), and a
    // non-finite one left by unscale_ still makes the device skip.
    detail::StepEngine& engine = detail_access::engine(opt);
    last_result_ = engine.step_device_scale(s.stage == Stage::ready ? dev->scale() : dev->one(), dev->state());
    last_stepped_ = &opt;
    s.found_inf = false;  // known on the device only
    s.stage = Stage::stepped;
    return true;
  }
  pull();
  last_stepped_ = nullptr;
  if (s.stage == Stage::ready && sf_unscalable(current_scale_)) {
    // A scale that backed off to 2^-128 or below, or to 0 (144 non-finite steps in a row
    // from 65536): its fp32 reciprocal overflows, every gradient would unscale to inf or
    // NaN, so the step is skipped and writes nothing.
    last_result_ = StepResult{};
    last_result_.found_inf = true;
    last_result_.grad_norm = INFINITY;
    s.found_inf = true;
  } else if (s.stage == Stage::ready) {
    // The fused path: unscale, check, clip and update in one reduce and one update pass.
    last_result_ = opt.step_scaled(static_cast<double>(current_scale_));
    s.found_inf = last_result_.found_inf;
  } else if (s.found_inf && detail_access::engine(opt).shard() == nullptr) {  // unscale_ found inf/NaN: skip, write nothing
    last_result_ = StepResult{};
    last_result_.found_inf = true;
    last_result_.grad_norm = INFINITY;
  } else {
    // Already unscaled (and perhaps changed by the caller): the same fused step with
    // scale 1, so the result reports the norm, and gradients made non-finite since
    // unscale_ still skip the step rather than corrupt the weights. A sharded
    // optimizer always comes here, so every rank makes the step's collective: the
    // gradients unscale_ found non-finite still are, and every rank skips.
    last_result_ = opt.step_scaled(1.0);
    s.found_inf = last_result_.found_inf;
  }
  s.stage = Stage::stepped;
  return last_result_.applied;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled_) return;
  if (new_scale) {
    check_scale("update: new_scale", *new_scale);
    pull();  // the tracker
    const float scale = static_cast<float>(*new_scale);
    if (cuda_) cuda_->push(scale, growth_tracker_, growth_factor_, backoff_factor_, growth_interval_,
                           static_cast<cuda::CUstream>(cuda_stream_), /*end_iteration=*/true);
    current_scale_ = scale;  // after the device write, which may throw
  } else if (cuda_) {
    bool recorded = false, found_inf = false;
    for (const PerOptimizer& s : per_optimizer_) {
      recorded |= s.stage != Stage::ready;
      found_inf |= s.stage != Stage::ready && s.found_inf;  // optimizers on the CPU
    }
    if (!recorded)
      throw Error(ErrorCode::invalid_state,
                  "GradScaler::update: no inf checks were recorded prior to update() (call step() or unscale_() for "
                  "each optimizer first)");
    const auto stream = static_cast<cuda::CUstream>(cuda_stream_);
    if (found_inf) cuda_->record_found_inf(stream);  // an optimizer on the CPU found inf/NaN
    cuda_->update(stream);
  } else {
    bool recorded = false, found_inf = false;
    for (const PerOptimizer& s : per_optimizer_) {
      recorded |= s.stage != Stage::ready;
      found_inf |= s.stage != Stage::ready && s.found_inf;
    }
    if (!recorded)
      throw Error(ErrorCode::invalid_state,
                  "GradScaler::update: no inf checks were recorded prior to update() (call step() or unscale_() for "
                  "each optimizer first)");
    // The same rule as the device's sf_update_scale kernel (jit/step_stage.h).
    const sf_loss_scale next = sf_amp_update_scale({current_scale_, growth_tracker_}, found_inf, growth_factor_,
                                                   backoff_factor_, growth_interval_);
    current_scale_ = next.scale;
    growth_tracker_ = static_cast<std::int32_t>(next.growth_tracker);
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  pull();
  return static_cast<double>(current_scale_);
}

// The setters write the device first, then the host: a device write that throws
// leaves both as they were.
void GradScaler::set_growth_factor(double new_factor) {
  if (enabled_) check_growth_factor(new_factor);
  pull();
  if (cuda_)
    cuda_->push(current_scale_, growth_tracker_, new_factor, backoff_factor_, growth_interval_,
                static_cast<cuda::CUstream>(cuda_stream_));
  growth_factor_ = new_factor;
}
void GradScaler::set_backoff_factor(double new_factor) {
  if (enabled_) check_backoff_factor(new_factor);
  pull();
  if (cuda_)
    cuda_->push(current_scale_, growth_tracker_, growth_factor_, new_factor, growth_interval_,
                static_cast<cuda::CUstream>(cuda_stream_));
  backoff_factor_ = new_factor;
}
void GradScaler::set_growth_interval(std::int64_t new_interval) {
  if (enabled_) check_growth_interval(new_interval);
  pull();
  if (cuda_)
    cuda_->push(current_scale_, growth_tracker_, growth_factor_, backoff_factor_, new_interval,
                static_cast<cuda::CUstream>(cuda_stream_));
  growth_interval_ = new_interval;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!enabled_) return {};
  pull();
  return {{"scale", static_cast<double>(current_scale_)},
          {"growth_factor", growth_factor_},
          {"backoff_factor", backoff_factor_},
          {"growth_interval", static_cast<double>(growth_interval_)},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!enabled_) return;
  if (state.empty())
    bad("load_state_dict: the state dict is empty, possibly because it was saved from a disabled GradScaler "
        "(a disabled scaler's state_dict() is {})");
  const auto get = [&](const char* key) {
    const auto it = state.find(key);
    if (it == state.end())
      bad(std::string("load_state_dict: the state dict has no \"") + key +
          "\" entry (pass a map returned by state_dict(), with its five entries)");
    return it->second;
  };
  const auto integer = [&](const char* key, double v, double lo, double hi) {
    if (!(v >= lo && v <= hi && v == std::floor(v)))
      bad(std::string("load_state_dict: \"") + key + "\" = " + num(v) + " (must be an integer in [" + num(lo) + ", " +
          num(hi) + "])");
    return static_cast<std::int64_t>(v);
  };
  // Validate everything, then assign: nothing changes on an Error.
  const double scale = get("scale"), growth = get("growth_factor"), backoff = get("backoff_factor");
  if (!(scale == 0.0 && !std::signbit(scale)))
    check_scale("load_state_dict: scale", scale);  // (+0: a scale that backed off to 0)
  check_growth_factor(growth);
  check_backoff_factor(backoff);
  const std::int64_t interval = integer("growth_interval", get("growth_interval"), 1, INT32_MAX);
  const std::int64_t tracker = integer("_growth_tracker", get("_growth_tracker"), 0, INT32_MAX);
  // Then the device (which may throw), then the host. A device scale this scaler shares
  // with a copy is not written: this one gets a scale of its own, so loading into a copy
  // (as a checkpoint load does, to commit only once everything else succeeded) leaves
  // the original as it was.
  std::shared_ptr<detail::CudaScalerState> device = cuda_;
  if (device && device.use_count() > 1) device = std::make_shared<detail::CudaScalerState>(device->device());
  if (device)
    device->push(static_cast<float>(scale), static_cast<std::int32_t>(tracker), growth, backoff, interval,
                 static_cast<cuda::CUstream>(cuda_stream_));
  cuda_ = std::move(device);
  current_scale_ = static_cast<float>(scale);
  growth_factor_ = growth;
  backoff_factor_ = backoff;
  growth_interval_ = interval;
  growth_tracker_ = static_cast<std::int32_t>(tracker);
}

}  // namespace stepfuse
