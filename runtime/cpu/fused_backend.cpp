// The fused CPU backend: reduce pass -> step stage -> update pass.
#include "runtime/cpu/fused_backend.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "jit/base/warning.hpp"
#include "jit/program_analysis.hpp"
#include "jit/step_stage.h"
#include "jit/stochastic_round.h"
#include "stepfuse/error.hpp"

namespace stepfuse::cpu {

FusedBackend::FusedBackend(const detail::StepPrograms& programs, const std::vector<Param>& params,
                           const OptimizerOptions& options, std::shared_ptr<const void> program_owner)
    : HostBackend(programs, params, options) {
  const NormKind norm_kind = options_.norm_type == INFINITY ? NormKind::inf : NormKind::l2;
  for (DType g : {DType::f32, DType::f16, DType::bf16})
    for (std::size_t w = 2; w <= kReduceWays; ++w)
      reduce_groups_[static_cast<int>(g)][w] = reduce_group_kernel(g, norm_kind, w);
  const jit::Layout& l = host_.layout();
  kernels_.resize(params_.size());
  tensor_jit_.resize(params_.size());
  bool interpret = false;
  std::vector<const Program*> tensor_programs(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const detail::StepPrograms::Group& group = programs_.groups[programs_.tensor_group[i]];
    tensor_programs[i] = group.program;
    auto it = std::find_if(jits_.begin(), jits_.end(), [&](const ProgramJit& j) { return j.program == group.program; });
    if (it == jits_.end()) it = jits_.insert(jits_.end(), ProgramJit{group.program, {}, false, nullptr});
    tensor_jit_[i] = static_cast<std::size_t>(it - jits_.begin());
    const jit::DtypeCombo& c = l.combos[static_cast<std::size_t>(l.tensor_combo[i])];
    TensorKernels& k = kernels_[i];
    k.reduce = reduce_kernel(c.grad, norm_kind);
    if (!group.fused) {
      interpret = true;
      continue;
    }
    k.update = fused_update_kernel(*group.fused, c);
    k.phase1 = fused_phase1_kernel(*group.fused, c);  // two-phase programs
    k.draws_bits = true;
    if (all_bf16_state(i)) {  // the kernels that read and write the bf16 state in registers, where there are
      const StateKernel sk = stochastic_state() ? StateKernel::bf16 : StateKernel::bf16_nearest;
      const UpdateFn u = fused_update_kernel(*group.fused, c, sk);
      const Phase1Fn p1 = fused_phase1_kernel(*group.fused, c, sk);
      if (u != nullptr && (k.phase1 == nullptr || p1 != nullptr)) {
        k.update = u;
        k.phase1 = p1;
        k.bf16_state = true;
      }
    }
    if (k.update == nullptr)
      throw Error(ErrorCode::unsupported, "no fused CPU kernel for " + std::string(group.program->name) + " with " +
                                              std::string(dtype_name(c.weight)) + " weights and " +
                                              std::string(dtype_name(c.grad)) + " grads");
  }
  if (interpret) {
    interpreters_ = std::make_unique<InterpreterSet>(tensor_programs, l, /*f32_grads=*/false);
    scratch_ = detail::AlignedBuffer(static_cast<std::size_t>(interpreters_->max_slots()) * Interpreter::kBlock *
                                     static_cast<std::size_t>(threads()));
  }
  two_phase_ = TwoPhase(tensor_programs, l);
  std::size_t bit_streams = 1;  // per thread: the weights' bits, and those of the bf16 state kernels round
  sr_state_streams_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    stochastic_.push_back(l.combos[static_cast<std::size_t>(l.tensor_combo[i])].stochastic);
    stores_.push_back(stored_streams(*tensor_programs[i]));
    if (stochastic_[i] && stochastic_state() && all_bf16_state(i))
      for (const HostBuffers::StagedStream& s : host_.staged_streams(i))
        if (stores_[i].update & (1u << s.stream)) sr_state_streams_[i].push_back(s.stream);  // (in stream order)
    bit_streams = std::max(bit_streams, 1 + sr_state_streams_[i].size());
  }
  if (options_.stochastic_rounding) rounding_bits_.resize(bit_streams * kRoundingRun * static_cast<std::size_t>(threads()));
  if (options_.fusion == Fusion::fused) setup_llvm(std::move(program_owner));
}

// Whether every state stream of tensor t's program that may be stored otherwise
// (not full precision) is stored as bf16: then the Highway kernels with bf16 state
// read and write all of them in registers.
bool FusedBackend::all_bf16_state(std::size_t t) const {
  if (!host_.staged(t)) return false;
  const std::uint32_t g = programs_.tensor_group[t];
  const Program& p = *programs_.groups[g].program;
  // (The stochastically rounded state of a two-phase program stages: a program may store
  // state in its phase 1, which runs over a whole chunk, more random bits than a run keeps
  // in L1. LAMB stores in phase 2 and could take the in-register kernels; it does not yet.)
  const jit::Layout& l = host_.layout();
  if (l.combos[static_cast<std::size_t>(l.tensor_combo[t])].stochastic && stochastic_state() && jit::is_two_phase(p))
    return false;
  for (int s = 0; s < p.num_streams; ++s) {
    if (p.streams[s].role != StreamRole::state || p.streams[s].values == StateValues::full_precision) continue;
    const int b = programs_.state_slot[g][static_cast<std::size_t>(s)];
    if (programs_.formats[t][static_cast<std::size_t>(b)] != StateFormat::bf16) return false;
  }
  for (const HostBuffers::StagedStream& s : host_.staged_streams(t))
    if (s.slot.format != StateFormat::bf16) return false;
  return true;
}

void FusedBackend::setup_llvm(std::shared_ptr<const void> program_owner) {
  const CpuBackend choice = resolve_cpu_backend(options_.cpu_backend);
  if (choice == CpuBackend::highway || (choice == CpuBackend::automatic && !jit::llvm_built())) return;
  // Stored state: a tensor whose state is all bf16 gets the `_bs` functions, which
  // read and write it in registers; the others (q8) stage it, as Highway's kernels do.
  const jit::Layout& l = host_.layout();
  for (std::size_t j = 0; j < jits_.size(); ++j) {
    jit::CpuSpec& spec = jits_[j].spec;
    spec.program = *jits_[j].program;
    spec.inf_norm = options_.norm_type == INFINITY;
    spec.contract = options_.llvm_contract;
    spec.combos = l.combos;
    spec.reduce_grads = l.reduce_grads;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (tensor_jit_[i] != j || !all_bf16_state(i)) continue;
      const jit::DtypeCombo& c = l.combos[static_cast<std::size_t>(l.tensor_combo[i])];
      if (std::find(spec.bf16_state.begin(), spec.bf16_state.end(), c) == spec.bf16_state.end())
        spec.bf16_state.push_back(c);
    }
    // (only where it changes code: one cache key for the rest)
    spec.nearest_state = !stochastic_state() && std::any_of(spec.bf16_state.begin(), spec.bf16_state.end(),
                                                            [](const jit::DtypeCombo& c) { return c.stochastic; });
  }
  for (std::size_t j = 0; j < jits_.size(); ++j) {
    if (choice == CpuBackend::llvm) {
      install_llvm(j, *jit::cpu_kernels(jits_[j].spec));  // compiles now; throws what LLVM reports
      continue;
    }
    try {
      if (auto cached = jit::cpu_kernels_if_cached(jits_[j].spec)) {
        install_llvm(j, *cached);
        continue;
      }
    } catch (const std::exception& e) {
      detail::warn_once(std::string("llvm_load:") + e.what(),
                        std::string("stepfuse: the LLVM CPU backend is not usable, using Highway: ") + e.what());
      return;
    }
    jits_[j].build = build_in_background(jits_[j].spec, program_owner);
  }
}

void FusedBackend::install_llvm(std::size_t j, const jit::CpuKernels& k) {
  const jit::Layout& l = host_.layout();
  for (std::size_t i = 0; i < params_.size(); ++i) {  // the spec's combos and grads are the layout's
    if (tensor_jit_[i] != j) continue;
    const auto ci = static_cast<std::size_t>(l.tensor_combo[i]);
    const auto gi = static_cast<std::size_t>(l.tensor_reduce[i]);
    TensorKernels& t = kernels_[i];
    t.update = reinterpret_cast<UpdateFn>(k.update[ci]);
    if (!k.phase1.empty()) t.phase1 = reinterpret_cast<Phase1Fn>(k.phase1[ci]);  // two-phase programs
    t.bf16_state = false;  // (stored state other than all bf16: staged fp32 copies)
    t.draws_bits = false;  // (sf_cpu_update_args::sr_bits)
    const std::vector<jit::DtypeCombo>& bs = jits_[j].spec.bf16_state;
    if (all_bf16_state(i)) {  // the `_bs` functions, which read and write it in registers
      const auto b = static_cast<std::size_t>(std::find(bs.begin(), bs.end(), l.combos[ci]) - bs.begin());
      t.update = reinterpret_cast<UpdateFn>(k.update_bf16_state.at(b));
      if (!k.phase1_bf16_state.empty()) t.phase1 = reinterpret_cast<Phase1Fn>(k.phase1_bf16_state.at(b));
      t.bf16_state = true;
    }
    if (jits_[j].spec.inf_norm) t.llvm_inf = reinterpret_cast<JitInfFn>(k.reduce[gi]);
    else t.llvm_l2 = reinterpret_cast<JitL2Fn>(k.reduce[gi]);
  }
  jits_[j].active = true;
  jits_[j].build.reset();
  if (all_llvm()) interpreters_.reset();  // a custom program's interpreter, replaced by its compiled kernels
}

bool FusedBackend::all_llvm() const {
  return std::all_of(jits_.begin(), jits_.end(), [](const ProgramJit& j) { return j.active; });
}

void FusedBackend::poll_llvm() {
  for (std::size_t j = 0; j < jits_.size(); ++j) {
    ProgramJit& p = jits_[j];
    if (!p.build || !p.build->ready()) continue;
    if (p.build->kernels()) {
      install_llvm(j, *p.build->kernels());
      continue;
    }
    detail::warn_once("llvm_compile:" + p.build->error(),
                      "stepfuse: compiling the LLVM CPU kernels failed, staying on " + std::string(name()) + ": " +
                          p.build->error());
    p.build.reset();
  }
}

std::string_view FusedBackend::name() const {
  const bool llvm = std::all_of(jits_.begin(), jits_.end(), [](const ProgramJit& j) {
    return j.active || (j.build && j.build->ready() && j.build->kernels());
  });
  if (llvm) return "llvm";
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

// When chunk c is a tensor's last, the first lines (at most 8, within the tensor) of
// the next tensor's gradient (and weight): each tensor is the caller's own
// allocation, where the hardware prefetchers must find the stream again; with many
// small tensors (1-4 K elements) this saved about 2% of the step. The state streams and
// masters need none: they are the optimizer's, contiguous across tensors.
void FusedBackend::prefetch_next(std::size_t c, bool weight) const {
  const std::vector<jit::Chunk>& chunks = host_.layout().chunks;
  if (c + 1 >= chunks.size() || chunks[c + 1].tensor == chunks[c].tensor) return;
  constexpr std::size_t kLines = 8, kLine = 64;
  const Param& p = params_[chunks[c + 1].tensor];
  const auto lines = [&](const TensorView& v) {
    return std::min(kLines, (static_cast<std::size_t>(v.numel) * dtype_size(v.dtype) + kLine - 1) / kLine);
  };
  for (std::size_t k = 0, n = lines(p.grad); k < n; ++k)
    __builtin_prefetch(static_cast<const char*>(p.grad.data) + kLine * k, 0, 3);
  if (!weight) return;
  for (std::size_t k = 0, n = lines(p.weight); k < n; ++k)
    __builtin_prefetch(static_cast<const char*>(p.weight.data) + kLine * k, 1, 3);
}

// Chunk c's partial, or those of chunks c, c + 1, ... (before `end`) of as many
// different tensors with the same grad dtype, up to kReduceWays, at once; returns
// how many. Bitwise the same either way.
std::size_t FusedBackend::reduce_chunks(std::size_t c, std::size_t end, ReducePartial* out) const {
  const std::vector<jit::Chunk>& chunks = host_.layout().chunks;
  const DType grad = params_[chunks[c].tensor].grad.dtype;
  std::size_t ways = 1;
  while (ways < kReduceWays && c + ways < end && chunks[c + ways].tensor != chunks[c + ways - 1].tensor &&
         params_[chunks[c + ways].tensor].grad.dtype == grad)
    ++ways;
  prefetch_next(c + ways - 1, /*weight=*/false);
  if (ways == 1) {
    out[0] = reduce_chunk(kernels_[chunks[c].tensor], host_.grad_at(chunks[c], params_),
                          static_cast<std::size_t>(chunks[c].len));
    return 1;
  }
  const void* grads[kReduceWays];
  std::size_t lens[kReduceWays];
  for (std::size_t j = 0; j < ways; ++j) {
    grads[j] = host_.grad_at(chunks[c + j], params_);
    lens[j] = static_cast<std::size_t>(chunks[c + j].len);
  }
  reduce_groups_[static_cast<int>(grad)][ways](grads, lens, out);
  return ways;
}

StepResult FusedBackend::step(const detail::StepRequest& request, std::vector<double>& tensor_norms) {
  poll_llvm();
  const jit::Layout& l = host_.layout();
  const bool clip = options_.max_grad_norm.has_value();
  HostBuffers::Reduction red{false, NAN};
  if (request.scaled || clip || options_.track_grad_norm) {
    red = host_.reduce_groups(
        [&](std::size_t c, std::size_t end, ReducePartial* out) { return reduce_chunks(c, end, out); },
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
  eval_scalars(request, stage.step, stage.gscale);
  // Two-phase programs: phase 1 over their chunks, then each tensor's norms, which
  // phase 2 (the update below) reads through `args` (runtime/cpu/two_phase.hpp).
  const std::vector<UpdateArgs>& args = two_phase_.any() ? two_phase_.args(host_.args()) : host_.args();
  const std::size_t per_thread = interpreters_ ? static_cast<std::size_t>(interpreters_->max_slots()) * Interpreter::kBlock : 0;
  // A tensor with bf16 or q8 state runs its chunks through HostBuffers::stage():
  // runs of its elements on fp32 copies of those streams, advanced args, begin 0.
  const auto staged = [&](std::size_t t, const UpdateArgs& a, std::size_t begin, std::size_t len, std::size_t run,
                          unsigned stored, int thread, const auto& body) {
    if (!host_.staged(t) || (!interpreters_ && kernels_[t].bf16_state)) return body(a, begin, len);
    host_.stage(a, t, begin, len, run, stored, dtype_size(params_[t].grad.dtype), thread,
                [&](const UpdateArgs& r, std::size_t n) { body(r, 0, n); });
  };
  if (two_phase_.any()) {
    host_.for_chunks([&](std::size_t c, int t) {
      const jit::Chunk& ch = l.chunks[c];
      if (!two_phase_.two_phase(ch.tensor)) return;
      // (phase 1 stages the whole chunk: its sums are the chunk's, in the canonical order)
      staged(ch.tensor, args[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len),
             kChunkElems, stores_[ch.tensor].phase1, t, [&](const UpdateArgs& a, std::size_t begin, std::size_t len) {
               if (interpreters_)
                 (*interpreters_)[interpreters_->group_of(ch.tensor)].run_phase1_blocked(
                     a, begin, len, scratch_.data() + per_thread * static_cast<std::size_t>(t), two_phase_.sums(c));
               else
                 kernels_[ch.tensor].phase1(a, begin, len, two_phase_.sums(c));
             });
    });
    two_phase_.combine();
  }
  host_.for_chunks([&](std::size_t c, int t) {
    const jit::Chunk& ch = l.chunks[c];
    prefetch_next(c, /*weight=*/true);
    staged(ch.tensor, args[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len), kStageRun,
           stores_[ch.tensor].update, t, [&](const UpdateArgs& args_run, std::size_t begin, std::size_t len) {
             if (interpreters_)
               return (*interpreters_)[interpreters_->group_of(ch.tensor)].run_blocked(
                   args_run, begin, len, scratch_.data() + per_thread * static_cast<std::size_t>(t));
             if (!stochastic_[ch.tensor] || kernels_[ch.tensor].draws_bits)
               return kernels_[ch.tensor].update(args_run, begin, len);
             // LLVM's kernels, stochastic rounding: runs of the chunk, each run's random bits (one
             // Philox call per 8 elements, kept in L1), the weights' and those of the bf16 state
             // streams the kernel rounds, then the update of the run reading them.
             UpdateArgs a = args_run;
             static const std::vector<int> kNone;  // (staged state: HostBuffers::stage() rounds it)
             const std::vector<int>& streams = kernels_[ch.tensor].bf16_state ? sr_state_streams_[ch.tensor] : kNone;
             std::uint16_t* bits = rounding_bits_.data() + rounding_bits_.size() / static_cast<std::size_t>(threads()) *
                                                               static_cast<std::size_t>(t);
             a.sr_bits = bits;
             a.sr_stride = kRoundingRun;
             for (std::size_t at = begin; at < begin + len; at += kRoundingRun) {
               const std::size_t n = std::min(kRoundingRun, begin + len - at);
               rounding_bits(a.sr_seed, a.sr_step, a.sr_base + at, n, bits);
               for (std::size_t j = 0; j < streams.size(); ++j)
                 rounding_bits(a.sr_seed, sf_sr_state_step(a.sr_step, streams[j]), a.sr_base + at, n,
                               bits + (j + 1) * kRoundingRun);
               kernels_[ch.tensor].update(a, at, n);
             }
           });
  });
  step_count_ = stage.step;
  r.applied = true;
  return r;
}

}  // namespace stepfuse::cpu
