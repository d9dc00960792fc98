// The step pipeline on the CPU: reduce pass -> scalar stage -> update pass.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "jit/builtins.hpp"
#include "runtime/aligned_buffer.hpp"
#include "runtime/cpu/interpreter.hpp"
#include "runtime/cpu/kernels.hpp"
#include "runtime/plan.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse::detail {

// Owns everything a step needs, allocated and planned at construction:
// optimizer state, fp32 masters, the chunk plan, kernel pointers, per-chunk
// partials. A fused step allocates nothing.
class StepEngine {
 public:
  StepEngine(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options);

  // loss_scale: 1 for a plain step. Returns what the step did (also kept in last()).
  const StepResult& step(double loss_scale, bool scaled);

  const OptimizerConfig& config() const { return config_; }
  void set_config(const OptimizerConfig& config);
  const OptimizerOptions& options() const { return options_; }
  const std::vector<Param>& params() const { return params_; }
  const Program& program() const { return *program_; }
  std::int64_t step_count() const { return step_count_; }
  const StepResult& last() const { return last_; }
  const std::vector<double>& tensor_norms() const { return tensor_norms_; }
  int threads() const { return pool_->size(); }

  int state_stream(std::string_view name) const;  // program stream index, or -1
  float* state_data(std::size_t param, int stream) const { return state_[stream].data() + offsets_[param]; }
  float* master_data(std::size_t param) const {
    return masters_.size() ? masters_.data() + offsets_[param] : nullptr;
  }
  bool has_masters() const { return has_masters_; }

 private:
  struct Reduction {
    bool found_inf = false;
    double norm = 0;  // of the gradients as stored (not yet divided by the loss scale)
  };
  // Reduce pass over the gradients as stored, or over the unfused fp32 temporary.
  Reduction reduce(bool from_grad_tmp = false);
  void update_fused(const float* scalars);
  StepResult step_unfused(double loss_scale, bool scaled);
  double clip_coef(double norm) const;

  OptimizerConfig config_;
  jit::Builtin builtin_;
  const Program* program_;
  std::vector<Param> params_;
  OptimizerOptions options_;
  ThreadPool* pool_;
  Plan plan_;
  bool has_masters_ = false;
  std::vector<std::int64_t> offsets_;  // element offset of each tensor in state/master/slot buffers
  std::int64_t total_ = 0;             // padded total
  AlignedBuffer state_[kMaxStreams];
  AlignedBuffer masters_;
  std::vector<cpu::UpdateArgs> args_;  // per tensor; args_[t].scalars -> scalars_
  float scalars_[kMaxScalars] = {};
  cpu::ReduceFn reduce_l2_ = nullptr, reduce_inf_ = nullptr;
  cpu::UpdateFn update_ = nullptr;                  // fused mode
  std::unique_ptr<cpu::Interpreter> interpreter_;   // interpreted and unfused modes
  AlignedBuffer scratch_;                           // interpreted: per-thread blocks; unfused: model-sized slots
  AlignedBuffer grad_tmp_;                          // unfused: unscaled, clipped fp32 gradients
  std::vector<cpu::UpdateArgs> tmp_args_;           // unfused: args_ reading grad_tmp_
  std::vector<cpu::ReducePartial> partials_;        // one per chunk
  std::vector<double> tensor_norms_;
  std::int64_t step_count_ = 0;
  StepResult last_;
};

}  // namespace stepfuse::detail
