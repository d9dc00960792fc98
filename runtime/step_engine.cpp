// The step pipeline on the CPU: reduce pass -> scalar stage -> update pass.
#include "runtime/step_engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_set>

#include "jit/step_stage.h"
#include "jit/update_program_rules.hpp"
#include "jit/base/warning.hpp"
#include "stepfuse/cuda.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {

[[noreturn]] void bad_argument(const std::string& message) { throw Error(ErrorCode::invalid_argument, message); }

std::string param_name(std::size_t i, const char* field) {
  return "params[" + std::to_string(i) + "]." + field;
}

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= static_cast<unsigned>(DType::bf16); }

void validate_params(const std::vector<Param>& params) {
  if (params.empty()) bad_argument("Optimizer: the parameter list is empty (pass at least one Param)");
  std::unordered_set<const void*> seen;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    for (const auto& [view, field] : {std::pair{&p.weight, "weight"}, std::pair{&p.grad, "grad"}}) {
      if (!valid_dtype(view->dtype))
        bad_argument(param_name(i, field) + ".dtype = " + std::to_string(static_cast<int>(view->dtype)) +
                     " is not a DType (use DType::f32, f16 or bf16)");
      if (view->numel < 0) bad_argument(param_name(i, field) + ".numel = " + std::to_string(view->numel) + " is negative");
      if (view->numel > 0 && view->data == nullptr)
        bad_argument(param_name(i, field) + ".data is null with numel = " + std::to_string(view->numel));
    }
    if (p.weight.numel != p.grad.numel)
      bad_argument(param_name(i, "weight") + ".numel = " + std::to_string(p.weight.numel) + " but " +
                   param_name(i, "grad") + ".numel = " + std::to_string(p.grad.numel) + " (they must match)");
    if (p.weight.data != nullptr && p.weight.numel > 0 && !seen.insert(p.weight.data).second)
      bad_argument(param_name(i, "weight") + ".data appears in more than one Param (each tensor may appear once)");
    if (p.weight.numel > 0 && p.weight.data == p.grad.data)
      bad_argument(param_name(i, "grad") + ".data is the same buffer as the weight");
  }
}

void validate_options(const OptimizerOptions& o) {
  if (o.device.kind == Device::Kind::cuda) {
    if (const CudaStatus cs = cuda_available(); !cs)
      throw Error(ErrorCode::unsupported, "OptimizerOptions::device = cuda:" + std::to_string(o.device.index) +
                                              ": the CUDA backend cannot run here: " + cs.reason + " (use Device::cpu())");
    if (o.fusion != Fusion::fused)
      throw Error(ErrorCode::unsupported, "OptimizerOptions::fusion: the unfused and interpreted modes run on the CPU "
                                          "only (use Fusion::fused with Device::cuda)");
  } else if (o.device.kind != Device::Kind::cpu) {
    bad_argument("OptimizerOptions::device.kind = " + std::to_string(static_cast<int>(o.device.kind)) +
                 " is not a Device kind (use Device::cpu() or Device::cuda(i))");
  }
  if (o.cuda_stream != nullptr && o.device.kind != Device::Kind::cuda)
    bad_argument("OptimizerOptions::cuda_stream is set but the device is the CPU (set device = Device::cuda(i))");
  if (o.norm_type != 2.0 && o.norm_type != INFINITY)
    bad_argument("OptimizerOptions::norm_type = " + std::to_string(o.norm_type) + " (use 2.0 or INFINITY)");
  if (o.max_grad_norm && !(std::isfinite(*o.max_grad_norm) && *o.max_grad_norm > 0))
    bad_argument("OptimizerOptions::max_grad_norm = " + std::to_string(*o.max_grad_norm) +
                 " (must be finite and > 0; leave it empty for no clipping)");
  if (o.num_threads < 0 || o.num_threads > 1024)
    bad_argument("OptimizerOptions::num_threads = " + std::to_string(o.num_threads) + " (use 0 for the default, or 1 to 1024)");
  if (static_cast<unsigned>(o.fusion) > static_cast<unsigned>(Fusion::interpreted))
    bad_argument("OptimizerOptions::fusion = " + std::to_string(static_cast<int>(o.fusion)) + " is not a Fusion value");
}

}  // namespace

StepEngine::StepEngine(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options)
    : config_(std::move(config)), params_(std::move(params)), options_(options) {
  jit::validate_config(config_);
  validate_params(params_);
  validate_options(options_);
  builtin_ = jit::select_builtin(config_);
  program_ = &jit::builtin_program(builtin_);
  jit::scalar_rules(config_, *program_, rules_);
  float init[kMaxStreams] = {};
  for (int s = 0; s < program_->num_streams; ++s) init[s] = jit::initial_state_value(config_, *program_, s);
  setup(init);
}

StepEngine::StepEngine(UpdateProgram program, std::vector<Param> params, OptimizerOptions options)
    : custom_(std::make_unique<UpdateProgram>(std::move(program))), params_(std::move(params)), options_(options) {
  validate_params(params_);
  validate_options(options_);
  program_ = &custom_->program();  // lives in custom_'s storage, as long as the engine
  for (int s = 0; s < program_->num_scalars; ++s) rules_[s] = jit::device_rule(custom_->scalars()[s].rule);
  float init[kMaxStreams] = {};
  for (int s = 0; s < program_->num_streams; ++s) init[s] = program_->streams[s].init;
  setup(init);
}

void StepEngine::no_config(const char* what) {
  throw Error(ErrorCode::invalid_state, std::string(what) +
                                            ": a custom-program optimizer has no OptimizerConfig; use scalar() / "
                                            "set_scalar() (and lr() / set_lr() when the program has a fixed scalar 'lr')");
}

void StepEngine::set_custom_rules(const UpdateProgram& program) {
  if (!custom_) throw Error(ErrorCode::invalid_state, "a built-in optimizer's scalars come from its config; use set_config()");
  if (to_string(program.program()) != to_string(*program_))
    bad_argument("the update program '" + std::string(program.name()) + "' is not the one this optimizer runs ('" +
                 std::string(program_->name) + "'): only its scalar rules can change");
  // Same program text: same scalars in the same order. Keep our storage (program_ points into it).
  *custom_ = custom_->with_rules(program.scalars());
  for (int s = 0; s < program_->num_scalars; ++s) rules_[s] = jit::device_rule(custom_->scalars()[s].rule);
}

void StepEngine::setup(const float* state_init) {
  std::int64_t elements = 0;
  for (const Param& p : params_) elements += p.weight.numel;
  if (options_.device.kind == Device::Kind::cuda) {
    // The device does the work; the host keeps only a copy of the state made on demand.
    cuda_ = std::make_unique<CudaBackend>(*program_, params_, options_, state_init);
    layout_ = cuda_->layout();
    pool_ = &ThreadPool::shared(1);
    tensor_norms_.assign(params_.size(), NAN);
    return;
  }
  int threads = options_.num_threads > 0 ? options_.num_threads : ThreadPool::default_threads();
  if (options_.num_threads == 0) {
    // Small lists: waking threads costs more than it saves below ~256 K elements a
    // thread (measured with stepfuse-bench flat:N). Results do not depend on it.
    constexpr std::int64_t kMinElementsPerThread = std::int64_t{1} << 18;
    threads = static_cast<int>(std::clamp<std::int64_t>(elements / kMinElementsPerThread, 1, threads));
  }
  pool_ = &ThreadPool::shared(threads);
  std::vector<jit::TensorShape> shapes;
  for (const Param& p : params_)
    shapes.push_back({p.weight.numel, {p.weight.dtype, p.grad.dtype, options_.master_weights && p.weight.dtype != DType::f32}});
  layout_ = jit::plan_layout(shapes);
  thread_chunks_ = jit::split_chunks(layout_.chunks, threads);

  // State and masters, allocated once; filled by the threads that will use them.
  for (int s = 0; s < program_->num_streams; ++s)
    if (program_->streams[s].role == StreamRole::state)
      state_[s] = AlignedBuffer(static_cast<std::size_t>(layout_.state_elems));
  if (layout_.master_elems > 0) masters_ = AlignedBuffer(static_cast<std::size_t>(layout_.master_elems));
  pool_->run([&](int t) {
    for (std::size_t c = thread_chunks_[t]; c < thread_chunks_[t + 1]; ++c) {
      const jit::Chunk& ch = layout_.chunks[c];
      const std::int64_t at = layout_.offsets[ch.tensor] + ch.begin;
      for (int s = 0; s < program_->num_streams; ++s)
        if (state_[s].size()) std::fill_n(state_[s].data() + at, ch.len, state_init[s]);
      if (layout_.master_offsets[ch.tensor] >= 0) {
        const Param& p = params_[ch.tensor];
        cpu::widen(p.weight.dtype, static_cast<const char*>(p.weight.data) + ch.begin * dtype_size(p.weight.dtype),
                   masters_.data() + layout_.master_offsets[ch.tensor] + ch.begin, static_cast<std::size_t>(ch.len));
      }
    }
  });

  args_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    cpu::UpdateArgs& a = args_[i];
    a.grad = params_[i].grad.data;
    a.weight = params_[i].weight.data;
    a.master = master_data(i);
    for (int s = 0; s < program_->num_streams; ++s)
      a.state[s] = state_[s].size() ? state_[s].data() + layout_.offsets[i] : nullptr;
    a.scalars = scalars_;
  }
  partials_.resize(layout_.chunks.size());
  tensor_norms_.assign(params_.size(), NAN);
  // One kernel (or interpreter) per dtype combination present in the list.
  const cpu::NormKind norm_kind = options_.norm_type == INFINITY ? cpu::NormKind::inf : cpu::NormKind::l2;
  std::vector<int> group_of_combo(jit::kNumComboIndices, -1);
  kernels_.resize(params_.size());
  // Custom programs have no compile-time fused kernel: the interpreter runs them in the fused pipeline.
  fused_kernels_ = options_.fusion == Fusion::fused && !custom_;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const DType w = params_[i].weight.dtype, g = params_[i].grad.dtype;
    const bool m = layout_.master_offsets[i] >= 0;
    TensorKernels& k = kernels_[i];
    k.reduce = cpu::reduce_kernel(g, norm_kind);
    if (fused_kernels_) {
      k.update = cpu::fused_update_kernel(builtin_, w, g, m);
      if (k.update == nullptr)
        throw Error(ErrorCode::unsupported, "no fused CPU kernel for " + std::string(program_->name) + " with " +
                                                std::string(dtype_name(w)) + " weights and " + std::string(dtype_name(g)) +
                                                " grads");
      continue;
    }
    // The unfused update reads fp32 gradients: the caller's (f32, plain step) or the temporary.
    const DType lowered_grad = options_.fusion == Fusion::unfused ? DType::f32 : g;
    int& group = group_of_combo[static_cast<std::size_t>(jit::DtypeCombo{w, lowered_grad, m}.index())];
    if (group < 0) {
      group = static_cast<int>(interpreters_.size());
      interpreters_.push_back(std::make_unique<cpu::Interpreter>(*program_, w, lowered_grad, m));
      max_slots_ = std::max(max_slots_, interpreters_.back()->num_slots());
    }
    k.group = group;
    k.interp = interpreters_[group].get();
  }
  if (options_.fusion == Fusion::fused) setup_llvm();
  if (options_.fusion != Fusion::unfused && !fused_kernels_) {  // interpreted (or a custom program, fused)
    scratch_ = AlignedBuffer(static_cast<std::size_t>(max_slots_) * cpu::Interpreter::kBlock * threads);
  } else if (options_.fusion == Fusion::unfused) {
    scratch_ = AlignedBuffer(static_cast<std::size_t>(max_slots_) * static_cast<std::size_t>(layout_.state_elems));
    grad_tmp_ = AlignedBuffer(static_cast<std::size_t>(layout_.state_elems));
    tmp_args_ = args_;
    for (std::size_t i = 0; i < params_.size(); ++i) tmp_args_[i].grad = grad_tmp_.data() + layout_.offsets[i];
  }
}

void StepEngine::setup_llvm() {
  const CpuBackend choice = cpu::resolve_cpu_backend(options_.cpu_backend);
  if (choice == CpuBackend::highway || (choice == CpuBackend::automatic && !jit::llvm_built())) return;
  llvm_spec_.program = *program_;
  llvm_spec_.inf_norm = options_.norm_type == INFINITY;
  llvm_spec_.contract = options_.llvm_contract;
  llvm_spec_.combos = layout_.combos;
  llvm_spec_.reduce_grads = layout_.reduce_grads;
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
  llvm_build_ = cpu::build_in_background(llvm_spec_);
}

void StepEngine::install_llvm(const jit::CpuKernels& k) {
  for (std::size_t i = 0; i < params_.size(); ++i) {  // the spec's combos and grads are the layout's
    const auto ci = static_cast<std::size_t>(layout_.tensor_combo[i]);
    const auto gi = static_cast<std::size_t>(layout_.tensor_reduce[i]);
    TensorKernels& t = kernels_[i];
    t.update = reinterpret_cast<cpu::UpdateFn>(k.update[ci]);
    if (llvm_spec_.inf_norm) t.llvm_inf = reinterpret_cast<cpu::JitInfFn>(k.reduce[gi]);
    else t.llvm_l2 = reinterpret_cast<cpu::JitL2Fn>(k.reduce[gi]);
  }
  llvm_active_ = true;
  llvm_build_.reset();
}

void StepEngine::poll_llvm() {
  if (!llvm_build_ || !llvm_build_->ready()) return;
  if (llvm_build_->kernels()) {
    install_llvm(*llvm_build_->kernels());
    return;
  }
  detail::warn_once("llvm_compile:" + llvm_build_->error(),
                    "stepfuse: compiling the LLVM CPU kernels failed, staying on Highway: " + llvm_build_->error());
  llvm_build_.reset();
}

std::string_view StepEngine::backend() const {
  if (cuda_) return "cuda";
  if (options_.fusion == Fusion::unfused) return "unfused";
  if (llvm_active_ || (llvm_build_ && llvm_build_->ready() && llvm_build_->kernels())) return "llvm";
  return fused_kernels_ ? "highway" : "interpreter";
}

int StepEngine::state_stream(std::string_view name) const {
  const int s = program_->find_stream(name);
  return s >= 0 && program_->streams[s].role == StreamRole::state ? s : -1;
}

void StepEngine::set_config(const OptimizerConfig& config) {
  if (custom_) no_config("set_config()");
  check_config(config);
  config_ = config;
  jit::scalar_rules(config_, *program_, rules_);
}

void StepEngine::check_config(const OptimizerConfig& config) const {
  if (custom_) no_config("set_config()");
  if (config.index() != config_.index())
    bad_argument("set_config: the optimizer is " + std::string(optimizer_name(config_)) + " but the new config is " +
                 std::string(optimizer_name(config)) + " (build a new Optimizer to change the kind)");
  jit::validate_config(config);
  if (jit::select_builtin(config) != builtin_)
    bad_argument("set_config: the new config needs update program '" +
                 std::string(jit::builtin_program(jit::select_builtin(config)).name) + "' but this optimizer runs '" +
                 std::string(program_->name) +
                 "' (amsgrad, nesterov, centered and momentum on/off change the state; build a new Optimizer)");
}

// One chunk's partial: the LLVM kernel's when there is one (its rare cases, a
// non-finite sum of squares, rescanned by the Highway kernel, as Highway itself
// does), else the Highway kernel's. Bitwise the same either way.
cpu::ReducePartial StepEngine::reduce_chunk(const TensorKernels& k, const void* grad, std::size_t n) {
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

StepEngine::Reduction StepEngine::reduce(bool from_grad_tmp) {
  const bool inf_norm = options_.norm_type == INFINITY;
  const cpu::ReduceFn tmp_fn = cpu::reduce_kernel(DType::f32, inf_norm ? cpu::NormKind::inf : cpu::NormKind::l2);
  pool_->run([&](int t) {
    for (std::size_t c = thread_chunks_[t]; c < thread_chunks_[t + 1]; ++c) {
      const jit::Chunk& ch = layout_.chunks[c];
      const Param& p = params_[ch.tensor];
      if (from_grad_tmp)
        partials_[c] = tmp_fn(grad_tmp_.data() + layout_.offsets[ch.tensor] + ch.begin, static_cast<std::size_t>(ch.len));
      else
        partials_[c] = reduce_chunk(kernels_[ch.tensor],
                                    static_cast<const char*>(p.grad.data) + ch.begin * dtype_size(p.grad.dtype),
                                    static_cast<std::size_t>(ch.len));
    }
  });
  // Combine in a fixed order: chunks in order within a tensor (fp64), then tensors in order.
  Reduction r;
  double total = 0;
  for (std::size_t t = 0; t < params_.size(); ++t) {
    double acc = 0;
    for (std::size_t c = layout_.tensor_chunks[t]; c < layout_.tensor_chunks[t + 1]; ++c) {
      r.found_inf |= partials_[c].nonfinite;
      acc = inf_norm ? std::max(acc, static_cast<double>(partials_[c].maxabs)) : acc + partials_[c].sumsq;
    }
    tensor_norms_[t] = inf_norm ? acc : std::sqrt(acc);
    total = inf_norm ? std::max(total, acc) : total + acc;
  }
  r.norm = inf_norm ? total : std::sqrt(total);
  return r;
}

void StepEngine::update_fused() {
  if (fused_kernels_ || llvm_active_) {
    pool_->run([&](int t) {
      for (std::size_t c = thread_chunks_[t]; c < thread_chunks_[t + 1]; ++c) {
        const jit::Chunk& ch = layout_.chunks[c];
        kernels_[ch.tensor].update(args_[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len));
      }
    });
    return;
  }
  const std::size_t per_thread = static_cast<std::size_t>(max_slots_) * cpu::Interpreter::kBlock;
  pool_->run([&](int t) {
    float* scratch = scratch_.data() + per_thread * static_cast<std::size_t>(t);
    for (std::size_t c = thread_chunks_[t]; c < thread_chunks_[t + 1]; ++c) {
      const jit::Chunk& ch = layout_.chunks[c];
      kernels_[ch.tensor].interp->run_blocked(args_[ch.tensor], static_cast<std::size_t>(ch.begin),
                                              static_cast<std::size_t>(ch.len), scratch);
    }
  });
}

const StepResult& StepEngine::last() const {
  if (last_.pending) last_ = cuda_->read_result(&tensor_norms_);
  return last_;
}

const std::vector<double>& StepEngine::tensor_norms() const {
  last();
  return tensor_norms_;
}

void StepEngine::host_view() const {
  if (!cuda_) return;
  if (!host_current_) {
    for (int s = 0; s < program_->num_streams; ++s)
      if (program_->streams[s].role == StreamRole::state && state_[s].size() == 0)
        state_[s] = AlignedBuffer(static_cast<std::size_t>(std::max<std::int64_t>(layout_.state_elems, 1)));
    if (layout_.master_elems > 0 && masters_.size() == 0)
      masters_ = AlignedBuffer(static_cast<std::size_t>(layout_.master_elems));
    float* state[kMaxStreams] = {};
    for (int s = 0; s < program_->num_streams; ++s) state[s] = state_[s].data();
    cuda_->download(state, masters_.data());
    host_current_ = true;
  }
  host_touched_ = true;
}

void StepEngine::sync_host_to_device() {
  if (!host_touched_) return;
  const float* state[kMaxStreams] = {};
  for (int s = 0; s < program_->num_streams; ++s) state[s] = state_[s].data();
  cuda_->upload(state, masters_.data());
  host_touched_ = false;
}

const StepResult& StepEngine::step_device_scale(const float* scale, sf_scaler_state* scaler) {
  sync_host_to_device();
  CudaStepRequest request;
  request.scale_ptr = scale;
  request.scaler = scaler;
  request.scaled = true;
  cuda_->step(request, rules_, program_->num_scalars);
  host_current_ = false;
  last_ = StepResult{};
  last_.pending = true;
  return last_;
}

const StepResult& StepEngine::step(double loss_scale, bool scaled) {
  if (!(std::isfinite(loss_scale) && loss_scale > 0))
    bad_argument("step: loss_scale = " + std::to_string(loss_scale) + " (must be finite and > 0)");
  if (cuda_) {
    sync_host_to_device();
    CudaStepRequest request;
    request.loss_scale = loss_scale;
    request.scaled = scaled;
    cuda_->step(request, rules_, program_->num_scalars);
    host_current_ = false;
    last_ = StepResult{};
    last_.pending = true;
    return last_;
  }
  poll_llvm();
  if (options_.fusion == Fusion::unfused) {
    last_ = step_unfused(loss_scale, scaled);
    return last_;
  }
  StepResult r;
  const bool clip = options_.max_grad_norm.has_value();
  Reduction red{false, NAN};
  if (scaled || clip || options_.track_grad_norm) {
    red = reduce();
    for (double& n : tensor_norms_) n /= loss_scale;
  } else {
    std::fill(tensor_norms_.begin(), tensor_norms_.end(), NAN);
  }
  // The scalar stage (jit/step_stage.h), as the CUDA reduce kernel runs it.
  const sf_stage stage =
      sf_step_stage(red.found_inf, scaled || clip, red.norm, loss_scale, max_grad_norm(), step_count_);
  r.found_inf = red.found_inf;
  r.grad_norm = stage.grad_norm;
  r.clip_coef = stage.clip_coef;
  if (stage.applied) {
    sf_eval_scalars(rules_, program_->num_scalars, stage.step, stage.gscale, scalars_);
    update_fused();
    step_count_ = stage.step;
    r.applied = true;
  }
  last_ = r;
  return last_;
}

StepResult StepEngine::step_unfused(double loss_scale, bool scaled) {
  // The eager baseline, pass by pass, as GradScaler.unscale_ + clip_grad_norm_ +
  // a for-each optimizer run it, except that the unscaled gradients go to an
  // fp32 temporary instead of back into the caller's buffers (same traffic, and
  // no precision lost to f16/bf16 storage). Every pass is vectorized and threaded.
  const auto for_chunks = [&](auto&& body) {
    pool_->run([&](int t) {
      for (std::size_t c = thread_chunks_[t]; c < thread_chunks_[t + 1]; ++c) body(layout_.chunks[c]);
    });
  };
  const auto tmp_at = [&](const jit::Chunk& ch) { return grad_tmp_.data() + layout_.offsets[ch.tensor] + ch.begin; };
  const bool clip = options_.max_grad_norm.has_value();
  bool use_tmp = scaled || clip;
  for (const Param& p : params_) use_tmp |= p.grad.dtype != DType::f32;
  StepResult r;
  if (use_tmp) {  // unscale pass: tmp = g * (1/S), the reciprocal rounded to fp32 as GradScaler does
    const float inv = static_cast<float>(1.0 / loss_scale);
    for_chunks([&](const jit::Chunk& ch) {
      const Param& p = params_[ch.tensor];
      cpu::widen_scaled(p.grad.dtype, static_cast<const char*>(p.grad.data) + ch.begin * dtype_size(p.grad.dtype), tmp_at(ch),
                        static_cast<std::size_t>(ch.len), scaled ? inv : 1.0f);
    });
  }
  if (scaled || clip) {  // finite-check pass
    const cpu::ReduceFn check = cpu::reduce_kernel(DType::f32, cpu::NormKind::l2);
    pool_->run([&](int t) {
      for (std::size_t c = thread_chunks_[t]; c < thread_chunks_[t + 1]; ++c)
        partials_[c] = check(tmp_at(layout_.chunks[c]), static_cast<std::size_t>(layout_.chunks[c].len));
    });
    for (const auto& p : partials_) r.found_inf |= p.nonfinite;
    if (r.found_inf) {
      r.grad_norm = INFINITY;
      std::fill(tensor_norms_.begin(), tensor_norms_.end(), INFINITY);
      return r;
    }
  }
  if (clip || options_.track_grad_norm) {  // norm pass over the unscaled gradients
    r.grad_norm = reduce(use_tmp).norm;
    r.clip_coef = sf_clip_coef(max_grad_norm(), r.grad_norm);
  } else {
    std::fill(tensor_norms_.begin(), tensor_norms_.end(), NAN);
  }
  if (clip) {  // clip pass: g *= coef (always, as clip_grad_norm_ does)
    const float coef = static_cast<float>(r.clip_coef);
    for_chunks([&](const jit::Chunk& ch) { cpu::scale_inplace(DType::f32, tmp_at(ch), static_cast<std::size_t>(ch.len), coef); });
  }
  // The update, one pass per program op over all tensors, temporaries in model-sized slots.
  sf_eval_scalars(rules_, program_->num_scalars, step_count_ + 1, 1.0, scalars_);
  const std::vector<cpu::UpdateArgs>& args = use_tmp ? tmp_args_ : args_;
  // Tensors with different dtypes run different lowered programs: one group after another.
  for (std::size_t group = 0; group < interpreters_.size(); ++group) {
    const cpu::Interpreter& interp = *interpreters_[group];
    for (int k = 0; k < interp.num_ops(); ++k) {
      for_chunks([&](const jit::Chunk& ch) {
        if (kernels_[ch.tensor].group != static_cast<int>(group)) return;
        float* slot_ptrs[kMaxInstrs];
        for (int s = 0; s < interp.num_slots(); ++s)
          slot_ptrs[s] = scratch_.data() + static_cast<std::size_t>(s) * static_cast<std::size_t>(layout_.state_elems) +
                         layout_.offsets[ch.tensor] + ch.begin;
        interp.run_op(k, args[ch.tensor], static_cast<std::size_t>(ch.begin), static_cast<std::size_t>(ch.len), slot_ptrs);
      });
    }
  }
  ++step_count_;
  r.applied = true;
  return r;
}

}  // namespace stepfuse::detail
