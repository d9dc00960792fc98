// An optimizer's step over a backend: configuration, scalar rules, validation, results.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "jit/builtins.hpp"
#include "runtime/backend.hpp"
#include "runtime/cuda/cuda_backend.hpp"
#include "stepfuse/optimizer.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse::detail {

// An optimizer's step: its configuration (a built-in config or a custom
// program), the scalar rules, validation and the last result, over a backend
// (runtime/backend.hpp) chosen by the options, which owns the state, masters and
// kernels, allocated and planned at construction. A fused step allocates nothing.
class StepEngine {
 public:
  StepEngine(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options);
  // A custom update program: on the CPU the blocked interpreter runs it (in the
  // fused pipeline: Fusion::fused and Fusion::interpreted are the same path for
  // it), on CUDA the kernels generated for it.
  StepEngine(UpdateProgram program, std::vector<Param> params, OptimizerOptions options);
  // Not copied or moved: the backend refers to params() and options().
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  // loss_scale: 1 for a plain step. Returns what the step did (also kept in last()).
  // On CUDA the step is only enqueued: the result is pending until last() reads it.
  const StepResult& step(double loss_scale, bool scaled);
  // CUDA: a scaled step whose loss scale is read on the device (a GradScaler's),
  // recording found_inf in the scaler's device state. Enqueued; nothing waits.
  const StepResult& step_device_scale(const float* scale, sf_scaler_state* scaler);
  bool on_cuda() const { return cuda_ != nullptr; }
  CudaBackend* cuda() const { return cuda_; }

  // Built-ins only: Error(invalid_state) for a custom program.
  const OptimizerConfig& config() const {
    if (custom_) no_config("config()");
    return config_;
  }
  void set_config(const OptimizerConfig& config);
  // The custom program (with its current scalar rules), or null for a built-in.
  const UpdateProgram* custom_program() const { return custom_.get(); }
  // Custom programs: replaces the scalar rules (same program, validated); takes
  // effect at the next step, no recompilation. Error(invalid_argument) if `program`
  // is another program; Error(invalid_state) for a built-in.
  void set_custom_rules(const UpdateProgram& program);
  // Throws what set_config would throw for `config`, changing nothing.
  void check_config(const OptimizerConfig& config) const;
  const OptimizerOptions& options() const { return options_; }
  const std::vector<Param>& params() const { return params_; }
  const Program& program() const { return *program_; }
  std::int64_t step_count() const { return backend_->step_count(); }
  void set_step_count(std::int64_t n) { backend_->set_step_count(n); }  // checkpoint restore
  const StepResult& last() const;
  const std::vector<double>& tensor_norms() const;
  int threads() const { return backend_->threads(); }
  std::string_view backend() const { return backend_->name(); }  // Optimizer::backend()

  int state_stream(std::string_view name) const;  // program stream index, or -1
  // On CUDA these are a host copy, fetched from the device (waiting for it) when
  // the device has changed since; the next step copies it back.
  float* state_data(std::size_t param, int stream) const {
    return backend_->state_data(stream) + backend_->layout().offsets[param];
  }
  // fp32 master copy of a parameter, or null (f32 weights, or masters off).
  float* master_data(std::size_t param) const {
    const std::int64_t at = backend_->layout().master_offsets[param];
    return at < 0 ? nullptr : backend_->masters_data() + at;
  }

 private:
  void setup(const float* state_init);  // the backend, once the program and its rules are known
  [[noreturn]] static void no_config(const char* what);

  OptimizerConfig config_;                // built-ins
  std::unique_ptr<UpdateProgram> custom_;  // custom programs (then config_ is unused)
  jit::Builtin builtin_ = jit::Builtin::none;
  const Program* program_;
  std::vector<Param> params_;
  OptimizerOptions options_;
  sf_scalar_rule rules_[kMaxScalars] = {};  // the config's (or custom program's) scalar rules (jit/step_scalars.h)
  std::unique_ptr<Backend> backend_;
  CudaBackend* cuda_ = nullptr;  // backend_, when it is the CUDA one
  mutable std::vector<double> tensor_norms_;
  mutable StepResult last_;
};

}  // namespace stepfuse::detail
