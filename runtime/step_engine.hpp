// The step pipeline on the CPU: reduce pass -> scalar stage -> update pass.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "jit/builtins.hpp"
#include "jit/layout.hpp"
#include "runtime/aligned_buffer.hpp"
#include "runtime/cuda/cuda_backend.hpp"
#include "runtime/cpu/interpreter.hpp"
#include "runtime/cpu/kernels.hpp"
#include "runtime/cpu/llvm_backend.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/optimizer.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse::detail {

// Owns everything a step needs, allocated and planned at construction:
// optimizer state, fp32 masters, the chunk plan, kernel pointers, per-chunk
// partials. A fused step allocates nothing.
class StepEngine {
 public:
  StepEngine(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options);
  // A custom update program: on the CPU the blocked interpreter runs it (in the
  // fused pipeline: Fusion::fused and Fusion::interpreted are the same path for
  // it), on CUDA the kernels generated for it.
  StepEngine(UpdateProgram program, std::vector<Param> params, OptimizerOptions options);

  // loss_scale: 1 for a plain step. Returns what the step did (also kept in last()).
  // On CUDA the step is only enqueued: the result is pending until last() reads it.
  const StepResult& step(double loss_scale, bool scaled);
  // CUDA: a scaled step whose loss scale is read on the device (a GradScaler's),
  // recording found_inf in the scaler's device state. Enqueued; nothing waits.
  const StepResult& step_device_scale(const float* scale, sf_scaler_state* scaler);
  bool on_cuda() const { return cuda_ != nullptr; }
  CudaBackend* cuda() const { return cuda_.get(); }

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
  std::int64_t step_count() const { return cuda_ ? cuda_->read_step_count() : step_count_; }
  void set_step_count(std::int64_t n) {  // checkpoint restore
    if (cuda_) cuda_->write_step_count(n);
    step_count_ = n;
  }
  const StepResult& last() const;
  const std::vector<double>& tensor_norms() const;
  int threads() const { return pool_->size(); }
  std::string_view backend() const;  // Optimizer::backend()

  int state_stream(std::string_view name) const;  // program stream index, or -1
  // On CUDA these are a host copy, fetched from the device (waiting for it) when
  // the device has changed since; the next step copies it back.
  float* state_data(std::size_t param, int stream) const {
    host_view();
    return state_[stream].data() + layout_.offsets[param];
  }
  // fp32 master copy of a parameter, or null (f32 weights, or masters off).
  float* master_data(std::size_t param) const {
    if (layout_.master_offsets[param] < 0) return nullptr;
    host_view();
    return masters_.data() + layout_.master_offsets[param];
  }

 private:
  struct Reduction {
    bool found_inf = false;
    double norm = 0;  // of the gradients as stored (not yet divided by the loss scale)
  };
  // Reduce pass over the gradients as stored, or over the unfused fp32 temporary.
  Reduction reduce(bool from_grad_tmp = false);
  void update_fused();
  StepResult step_unfused(double loss_scale, bool scaled);
  double max_grad_norm() const { return options_.max_grad_norm.value_or(0.0); }  // 0: no clipping
  void setup(const float* state_init);  // everything after the program and its rules are known
  [[noreturn]] static void no_config(const char* what);
  void host_view() const;       // CUDA: makes the host copy of state and masters current
  void sync_host_to_device();   // CUDA: copies a host copy that may have changed back
  void setup_llvm();            // CPU, fused: the LLVM kernels now, or a background build
  void install_llvm(const jit::CpuKernels& kernels);
  void poll_llvm();             // adopts a finished background build (at the start of a step)

  OptimizerConfig config_;                // built-ins
  std::unique_ptr<UpdateProgram> custom_;  // custom programs (then config_ is unused)
  bool fused_kernels_ = false;            // CPU: the compile-time fused kernels (built-ins, Fusion::fused)
  jit::Builtin builtin_ = jit::Builtin::none;
  const Program* program_;
  std::vector<Param> params_;
  OptimizerOptions options_;
  ThreadPool* pool_;
  jit::Layout layout_;                      // offsets of state, masters and slots; combinations; chunks
  std::vector<std::size_t> thread_chunks_;  // thread t runs chunks [thread_chunks_[t], thread_chunks_[t + 1])
  mutable AlignedBuffer state_[kMaxStreams];  // CUDA: the host copy, allocated on first use
  mutable AlignedBuffer masters_;
  std::unique_ptr<CudaBackend> cuda_;
  mutable bool host_current_ = false;  // CUDA: the host copy equals the device's
  mutable bool host_touched_ = false;  // CUDA: the host copy was handed out since the last step
  std::vector<cpu::UpdateArgs> args_;  // per tensor; args_[t].scalars -> scalars_
  sf_scalar_rule rules_[kMaxScalars] = {};  // the config's (or custom program's) scalar rules (jit/step_scalars.h)
  float scalars_[kMaxScalars] = {};
  // Kernels per tensor: each tensor may have its own weight/grad dtypes.
  struct TensorKernels {
    cpu::ReduceFn reduce = nullptr;            // for the options' norm type, on the stored grads
    cpu::UpdateFn update = nullptr;            // fused mode
    const cpu::Interpreter* interp = nullptr;  // interpreted and unfused modes
    int group = 0;                             // index into interpreters_
    cpu::JitL2Fn llvm_l2 = nullptr;            // LLVM reduce (then `reduce` is its rare path)
    cpu::JitInfFn llvm_inf = nullptr;
  };
  static cpu::ReducePartial reduce_chunk(const TensorKernels& k, const void* grad, std::size_t n);
  std::vector<TensorKernels> kernels_;
  jit::CpuSpec llvm_spec_;                   // what the LLVM kernels are compiled for
  bool llvm_active_ = false;                 // the LLVM kernels run the step
  std::shared_ptr<cpu::JitBuild> llvm_build_;  // automatic: the background compile, until adopted
  std::vector<std::unique_ptr<cpu::Interpreter>> interpreters_;  // one per dtype combination present
  int max_slots_ = 0;
  AlignedBuffer scratch_;                           // interpreted: per-thread blocks; unfused: model-sized slots
  AlignedBuffer grad_tmp_;                          // unfused: unscaled, clipped fp32 gradients
  std::vector<cpu::UpdateArgs> tmp_args_;           // unfused: args_ reading grad_tmp_
  std::vector<cpu::ReducePartial> partials_;        // one per chunk
  mutable std::vector<double> tensor_norms_;
  std::int64_t step_count_ = 0;
  mutable StepResult last_;
};

}  // namespace stepfuse::detail
