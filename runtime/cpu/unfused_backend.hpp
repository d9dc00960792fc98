// The unfused CPU backend (Fusion::unfused): the eager baseline, pass by pass, as
// GradScaler.unscale_ + clip_grad_norm_ + a for-each optimizer run it, every pass
// vectorized and threaded. What the benchmarks compare the fused step against.
#pragma once

#include <vector>

#include "runtime/backend.hpp"
#include "runtime/cpu/host_buffers.hpp"
#include "runtime/cpu/interpreter.hpp"

namespace stepfuse::cpu {

class UnfusedBackend final : public detail::Backend {
 public:
  UnfusedBackend(const Program& program, const std::vector<Param>& params, const OptimizerOptions& options,
                 const float* state_init);

  StepResult step(const detail::StepRequest& request, std::vector<double>& tensor_norms) override;
  StepResult read_result(std::vector<double>*) const override { return {}; }  // never pending
  std::int64_t step_count() const override { return step_count_; }
  void set_step_count(std::int64_t n) override { step_count_ = n; }
  const jit::Layout& layout() const override { return host_.layout(); }
  float* state_data(int stream) const override { return host_.state(stream); }
  float* masters_data() const override { return host_.masters(); }
  std::string_view name() const override { return "unfused"; }
  int threads() const override { return host_.pool().size(); }

 private:
  float* tmp_at(const jit::Chunk& ch) const {
    return grad_tmp_.data() + host_.layout().offsets[ch.tensor] + ch.begin;
  }

  const std::vector<Param>& params_;
  const OptimizerOptions& options_;
  int num_scalars_;
  float scalars_[kMaxScalars] = {};
  HostBuffers host_;
  InterpreterSet interpreters_;        // over fp32 gradients: the caller's or the temporary
  detail::AlignedBuffer scratch_;      // model-sized slots, one per interpreter temporary
  detail::AlignedBuffer grad_tmp_;     // the unscaled, clipped fp32 gradients
  std::vector<UpdateArgs> tmp_args_;   // host_.args() reading grad_tmp_
  std::int64_t step_count_ = 0;
};

}  // namespace stepfuse::cpu
