// The fused CPU backend: reduce pass -> step stage -> update pass.
#include "runtime/cpu/fused_backend.hpp"

#include <cmath>
#include <string>

#include "jit/base/warning.hpp"
#include "jit/step_stage.h"
#include "stepfuse/error.hpp"

namespace stepfuse::cpu {

FusedBackend::FusedBackend(const Program& program, std::optional<jit::Builtin> builtin, const std::vector<Param>& params,
                           const OptimizerOptions& options, const float* state_init,
                           std::shared_ptr<const void> program_owner)
    : HostBackend(program, params, options, state_init) {
  const NormKind norm_kind = options_.norm_type == INFINITY ? NormKind::inf : NormKind::l2;
  const jit::Layout& l = host_.layout();
  kernels_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const jit::DtypeCombo& c = l.combos[static_cast<std::size_t>(l.tensor_combo[i])];
    TensorKernels& k = kernels_[i];
    k.reduce = reduce_kernel(c.grad, norm_kind);
    if (!builtin) continue;
    k.update = fused_update_kernel(*builtin, c.weight, c.grad, c.master);
    if (k.update == nullptr)
      throw Error(ErrorCode::unsupported, "no fused CPU kernel for " + std::string(program.name) + " with " +
                                              std::string(dtype_name(c.weight)) + " weights and " +
                                              std::string(dtype_name(c.grad)) + " grads");
  }
  if (!builtin) {
    interpreters_ = std::make_unique<InterpreterSet>(program, l, /*f32_grads=*/false);
    scratch_ = detail::AlignedBuffer(static_cast<std::size_t>(interpreters_->max_slots()) * Interpreter::kBlock *
                                     static_cast<std::size_t>(threads()));
  }
  if (options_.fusion == Fusion::fused) setup_llvm(program, std::move(program_owner));
}

void FusedBackend::setup_llvm(const Program& program, std::shared_ptr<const void> program_owner) {
  const CpuBackend choice = resolve_cpu_backend(options_.cpu_backend);
  if (choice == CpuBackend::highway || (choice == CpuBackend::automatic && !jit::llvm_built())) return;
  llvm_spec_.program = program;
  llvm_spec_.inf_norm = options_.norm_type == INFINITY;
  llvm_spec_.contract = options_.llvm_contract;
  llvm_spec_.combos = host_.layout().combos;
  llvm_spec_.reduce_grads = host_.layout().reduce_grads;
  if (choice == CpuBackend::llvm) {
    install_llvm(*jit::cpu_kernels(llvm_spec_));  // compiles now; throws what LLVM reports
    return;
  }
  try {
    if (auto cached = jit::cpu_kernels_if_cached(llvm_spec_)) {
      install_llvm(*cached);
      return;
    }
  } catch (const std::exception& e) {
    detail::warn_once(std::string("llvm_load:") + e.what(),
                      std::string("stepfuse: the LLVM CPU backend is not usable, using Highway: ") + e.what());
    return;
  }
  llvm_build_ = build_in_background(llvm_spec_, std::move(program_owner));
}

void FusedBackend::install_llvm(const jit::CpuKernels& k) {
  const jit::Layout& l = host_.layout();
  for (std::size_t i = 0; i < params_.size(); ++i) {  // the spec's combos and grads are the layout's
    const auto ci = static_cast<std::size_t>(l.tensor_combo[i]);
    const auto gi = static_cast<std::size_t>(l.tensor_reduce[i]);
    TensorKernels& t = kernels_[i];
    t.update = reinterpret_cast<UpdateFn>(k.update[ci]);
    if (llvm_spec_.inf_norm) t.llvm_inf = reinterpret_cast<JitInfFn>(k.reduce[gi]);
    else t.llvm_l2 = reinterpret_cast<JitL2Fn>(k.reduce[gi]);
  }
  interpreters_.reset();  // a custom program's interpreter, replaced by its compiled kernels
  llvm_active_ = true;
  llvm_build_.reset();
}

void FusedBackend::poll_llvm() {
  if (!llvm_build_ || !llvm_build_->ready()) return;
  if (llvm_build_->kernels()) {
    install_llvm(*llvm_build_->kernels());
    return;
  }
  detail::warn_once("llvm_compile:" + llvm_build_->error(),
                    "stepfuse: compiling the LLVM CPU kernels failed, staying on " + std::string(name()) + ": " +
                        llvm_build_->error());
  llvm_build_.reset();
}

std::string_view FusedBackend::name() const {
  if (llvm_active_ || (llvm_build_ && llvm_build_->ready() && llvm_build_->kernels())) return "llvm";
  return interpreters_ ? "interpreter" : "highway";
}

// One chunk's partial: the LLVM kernel's when there is one (its rare cases, a
// non-finite sum of squares, rescanned by the Highway kernel, as Highway itself
// does), else the Highway kernel's. Bitwise the same either way.
ReducePartial FusedBackend::reduce_chunk(const TensorKernels& k, const void* grad, std::size_t n) {
  if (k.llvm_l2) {
    const float sumsq = k.llvm_l2(grad, n);
    if (std::isfinite(sumsq)) return {sumsq, 0.0f, false};
  } else if (k.llvm_inf) {
    std::uint32_t nonfinite = 0;
    const float maxabs = k.llvm_inf(grad, n, &nonfinite);
    return {0.0, maxabs, nonfinite != 0};
  }
  return k.reduce(grad, n);
}

StepResult FusedBackend::step(const detail::StepRequest& request, std::vector<double>& tensor_norms) {
  poll_llvm();
  const jit::Layout& l = host_.layout();
  const bool clip = options_.max_grad_norm.has_value();
  HostBuffers::Reduction red{false, NAN};
  if (request.scaled || clip || options_.track_grad_norm) {
    red = host_.reduce(
        [&](std::size_t c) {
          const jit::Chunk& ch = l.chunks[c];
          return reduce_chunk(kernels_[ch.tensor], host_.grad_at(ch, params_), static_cast<std::size_t>(ch.len));
        },
        options_.norm_type == INFINITY, tensor_norms);
    for (double& n : tensor_norms) n /= request.loss_scale;
  } else {
    tensor_norms.assign(params_.size(), NAN);
  }
  // The step stage (jit/step_stage.h), as the CUDA reduce kernel runs it.
  const sf_stage stage = sf_step_stage(red.found_inf, request.scaled || clip, red.norm, request.loss_scale,
                                       options_.max_grad_norm.value_or(0.0), step_count_);
  StepResult r;
  r.found_inf = red.found_inf;
  r.grad_norm = stage.grad_norm;
  r.clip_coef = stage.clip_coef;
  if (!stage.applied) return r;
  sf_eval_scalars(request.rules, num_scalars_, stage.step, stage.gscale, scalars_);
  const std::vector<UpdateArgs>& args = host_.args();
  if (interpreters_) {
    const std::size_t per_thread = static_cast<std::size_t>(interpreters_->max_slots()) * Interpreter::kBlock;
    host_.for_chunks([&](std::size_t c, int t) {
      const jit::Chunk& ch = l.chunks[c];
      (*interpreters_)[interpreters_->group_of(ch.tensor)].run_blocked(
          args[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len),
          scratch_.data() + per_thread * static_cast<std::size_t>(t));
    });
  } else {
    host_.for_chunks([&](std::size_t c, int) {
      const jit::Chunk& ch = l.chunks[c];
      kernels_[ch.tensor].update(args[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len));
    });
  }
  step_count_ = stage.step;
  r.applied = true;
  return r;
}

}  // namespace stepfuse::cpu
