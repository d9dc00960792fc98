// The unfused CPU backend: unscale, finite check, norm, clip and the update's
// ops, each a pass over memory.
#include "runtime/cpu/unfused_backend.hpp"

#include <algorithm>
#include <cmath>

#include "jit/step_stage.h"

namespace stepfuse::cpu {

namespace {
std::vector<const Program*> tensor_programs(const detail::StepPrograms& programs) {
  std::vector<const Program*> out;
  for (const std::uint32_t g : programs.tensor_group) out.push_back(programs.groups[g].program);
  return out;
}
}  // namespace

UnfusedBackend::UnfusedBackend(const detail::StepPrograms& programs, const std::vector<Param>& params,
                               const OptimizerOptions& options)
    : HostBackend(programs, params, options), interpreters_(tensor_programs(programs), host_.layout(), /*f32_grads=*/true) {
  const std::size_t elems = static_cast<std::size_t>(host_.layout().state_elems);
  scratch_ = detail::AlignedBuffer(static_cast<std::size_t>(interpreters_.max_slots()) * elems);
  grad_tmp_ = detail::AlignedBuffer(elems);
  tmp_args_ = host_.args();
  for (std::size_t i = 0; i < params_.size(); ++i) tmp_args_[i].grad = grad_tmp_.data() + host_.layout().offsets[i];
  two_phase_ = TwoPhase(tensor_programs(programs), host_.layout(), /*lanes=*/true);
  // bf16 and q8 state: decoded into an fp32 temporary per stream before the update
  // ops and encoded back after them (the eager way); both arg sets point there.
  staged_args_ = host_.args();
  bool any = false;
  for (std::size_t i = 0; i < params_.size(); ++i) any |= host_.staged(i);
  if (any) state_tmp_ = detail::AlignedBuffer(static_cast<std::size_t>(kMaxStreams) * elems);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    for (const HostBuffers::StagedStream& s : host_.staged_streams(i))
      staged_args_[i].state[s.stream] = tmp_args_[i].state[s.stream] =
          state_tmp_.data() + static_cast<std::size_t>(s.stream) * elems + host_.layout().offsets[i];
    stores_.push_back(stored_streams(programs.program_of(i)));
  }
}

void UnfusedBackend::decode_state() {
  const jit::Layout& l = host_.layout();
  host_.for_chunks([&](std::size_t c, int) {
    const jit::Chunk& ch = l.chunks[c];
    for (const HostBuffers::StagedStream& s : host_.staged_streams(ch.tensor))
      HostBuffers::decode(s.slot, static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len),
                          staged_args_[ch.tensor].state[s.stream] + ch.begin);
  });
}

void UnfusedBackend::encode_state(bool phase1) {
  const jit::Layout& l = host_.layout();
  host_.for_chunks([&](std::size_t c, int) {
    const jit::Chunk& ch = l.chunks[c];
    const unsigned stored = phase1 ? stores_[ch.tensor].phase1 : stores_[ch.tensor].update;
    for (const HostBuffers::StagedStream& s : host_.staged_streams(ch.tensor))
      if (stored & (1u << s.stream))
        HostBuffers::encode(staged_args_[ch.tensor].state[s.stream] + ch.begin, s.slot,
                            static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len),
                            host_.rounding(ch.tensor, static_cast<std::size_t>(ch.begin), s.stream));
  });
}

StepResult UnfusedBackend::step(const detail::StepRequest& request, std::vector<double>& tensor_norms) {
  // The unscaled gradients go to an fp32 temporary instead of back into the
  // caller's buffers (same traffic, and no precision lost to f16/bf16 storage).
  const jit::Layout& l = host_.layout();
  const bool clip = options_.max_grad_norm.has_value();
  const bool inf_norm = options_.norm_type == INFINITY;
  bool use_tmp = request.scaled || clip;
  for (const Param& p : params_) use_tmp |= p.grad.dtype != DType::f32;
  StepResult r;
  if (use_tmp) {  // unscale pass: tmp = g * (1/S), the reciprocal rounded to fp32 as GradScaler does
    const float inv = static_cast<float>(1.0 / request.loss_scale);
    host_.for_chunks([&](std::size_t c, int) {
      const jit::Chunk& ch = l.chunks[c];
      widen_scaled(params_[ch.tensor].grad.dtype, host_.grad_at(ch, params_), tmp_at(ch), static_cast<std::size_t>(ch.len),
                   request.scaled ? inv : 1.0f);
    });
  }
  if (request.scaled || clip) {  // finite-check pass
    const ReduceFn check = reduce_kernel(DType::f32, NormKind::l2);
    const auto partial = [&](std::size_t c) { return check(tmp_at(l.chunks[c]), static_cast<std::size_t>(l.chunks[c].len)); };
    r.found_inf = host_.reduce(partial, false, tensor_norms).found_inf;
    if (r.found_inf) {
      r.grad_norm = INFINITY;
      tensor_norms.assign(params_.size(), INFINITY);
      return r;
    }
  }
  if (clip || options_.track_grad_norm) {  // norm pass over the unscaled gradients
    // Without the temporary every gradient is f32 (a non-f32 one needs it).
    const ReduceFn norm = reduce_kernel(DType::f32, inf_norm ? NormKind::inf : NormKind::l2);
    const auto partial = [&](std::size_t c) {
      const jit::Chunk& ch = l.chunks[c];
      return norm(use_tmp ? tmp_at(ch) : host_.grad_at(ch, params_), static_cast<std::size_t>(ch.len));
    };
    r.grad_norm = host_.reduce(partial, inf_norm, tensor_norms).norm;
    r.clip_coef = sf_clip_coef(options_.max_grad_norm.value_or(0.0), r.grad_norm);
  } else {
    tensor_norms.assign(params_.size(), NAN);
  }
  if (clip) {  // clip pass: g *= coef (always, as clip_grad_norm_ does)
    const float coef = static_cast<float>(r.clip_coef);
    host_.for_chunks([&](std::size_t c, int) {
      scale_inplace(DType::f32, tmp_at(l.chunks[c]), static_cast<std::size_t>(l.chunks[c].len), coef);
    });
  }
  // The update, one pass per program op over all tensors, temporaries in model-sized slots.
  eval_scalars(request, step_count_ + 1, 1.0);
  if (options_.stochastic_rounding)
    for (std::size_t i = 0; i < tmp_args_.size(); ++i) tmp_args_[i].sr_step = staged_args_[i].sr_step = host_.args()[i].sr_step;
  const bool staged = state_tmp_.size() > 0;
  if (staged) decode_state();
  const std::vector<UpdateArgs>& step_args = use_tmp ? tmp_args_ : staged ? staged_args_ : host_.args();
  // Two-phase programs: every group's phase-1 ops (a reduce op adds into its chunk's
  // lanes), then each tensor's norms, which the update ops below (phase 2) read.
  const std::vector<UpdateArgs>& args = two_phase_.any() ? two_phase_.args(step_args) : step_args;
  if (two_phase_.any()) {
    two_phase_.clear_lanes();
    for (std::size_t group = 0; group < interpreters_.size(); ++group) {
      const Interpreter& interp = interpreters_[group];
      for (int k = 0; k < interp.phase2_begin(); ++k) {
        host_.for_chunks([&](std::size_t c, int) {
          const jit::Chunk& ch = l.chunks[c];
          if (interpreters_.group_of(ch.tensor) != group) return;
          float* slot_ptrs[kMaxInstrs];
          for (int s = 0; s < interp.num_slots(); ++s)
            slot_ptrs[s] = scratch_.data() + static_cast<std::size_t>(s) * static_cast<std::size_t>(l.state_elems) +
                           l.offsets[ch.tensor] + ch.begin;
          interp.run_op(k, args[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len), slot_ptrs,
                        two_phase_.lanes(c));
        });
      }
    }
    host_.for_chunks([&](std::size_t c, int) {
      if (two_phase_.two_phase(l.chunks[c].tensor)) two_phase_.lanes_to_sums(c);
    });
    two_phase_.combine();
    if (staged) {  // phase 2 loads phase 1's stores as stored
      encode_state(/*phase1=*/true);
      decode_state();
    }
  }
  // Tensors with different dtypes or param-group programs run different lowered
  // programs: one after another.
  for (std::size_t group = 0; group < interpreters_.size(); ++group) {
    const Interpreter& interp = interpreters_[group];
    for (int k = interp.phase2_begin(); k < interp.num_ops(); ++k) {  // (a two-phase program's phase 2)
      host_.for_chunks([&](std::size_t c, int) {
        const jit::Chunk& ch = l.chunks[c];
        if (interpreters_.group_of(ch.tensor) != group) return;
        float* slot_ptrs[kMaxInstrs];
        for (int s = 0; s < interp.num_slots(); ++s)
          slot_ptrs[s] = scratch_.data() + static_cast<std::size_t>(s) * static_cast<std::size_t>(l.state_elems) +
                         l.offsets[ch.tensor] + ch.begin;
        interp.run_op(k, args[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len), slot_ptrs);
      });
    }
  }
  if (staged) encode_state(/*phase1=*/false);
  ++step_count_;
  r.applied = true;
  return r;
}

}  // namespace stepfuse::cpu
