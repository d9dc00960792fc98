// The unfused CPU backend (Fusion::unfused): the eager baseline, pass by pass, as
// GradScaler.unscale_ + clip_grad_norm_ + a for-each optimizer run it, every pass
// vectorized and threaded. What the benchmarks compare the fused step against.
#pragma once

#include <vector>

#include "runtime/backend.hpp"
#include "runtime/cpu/host_buffers.hpp"
#include "runtime/cpu/interpreter.hpp"
#include "runtime/cpu/two_phase.hpp"

namespace stepfuse::cpu {

class UnfusedBackend final : public HostBackend {
 public:
  UnfusedBackend(const detail::StepPrograms& programs, const std::vector<Param>& params, const OptimizerOptions& options);

  StepResult step(const detail::StepRequest& request, std::vector<double>& tensor_norms) override;
  std::string_view name() const override { return "unfused"; }
  // Sharded: the model indices of stochastic rounding, in the temporaries' args too.
  void set_shard(detail::Shard* shard) override {
    HostBackend::set_shard(shard);
    for (std::size_t i = 0; i < tmp_args_.size(); ++i) tmp_args_[i].sr_base = staged_args_[i].sr_base = host_.args()[i].sr_base;
  }

 private:
  float* tmp_at(const jit::Chunk& ch) const {
    return grad_tmp_.data() + host_.layout().offsets[ch.tensor] + ch.begin;
  }

  InterpreterSet interpreters_;        // over fp32 gradients: the caller's or the temporary
  detail::AlignedBuffer scratch_;      // model-sized slots, one per interpreter temporary
  detail::AlignedBuffer grad_tmp_;     // the unscaled, clipped fp32 gradients
  std::vector<UpdateArgs> tmp_args_;   // host_.args() reading grad_tmp_
  TwoPhase two_phase_;                 // two-phase programs' chunk lanes, sums and norms
  // bf16 and q8 state: fp32 temporaries (by program stream, model-sized), host_.args()
  // reading them, and the streams each tensor's phases store.
  void decode_state();
  void encode_state(bool phase1);
  detail::AlignedBuffer state_tmp_;
  std::vector<UpdateArgs> staged_args_;
  std::vector<StoredStreams> stores_;
};

}  // namespace stepfuse::cpu
