// An optimizer's step over a backend: configuration, scalar rules, validation, results.
#include "runtime/step_engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "jit/base/format.hpp"
#include "jit/program_analysis.hpp"
#include "jit/step_scalars.h"
#include "jit/step_stage.h"
#include "jit/update_program_rules.hpp"
#include "runtime/cpu/fused_backend.hpp"
#include "runtime/cpu/q8.hpp"
#include "runtime/cpu/unfused_backend.hpp"
#include "stepfuse/cuda.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {

[[noreturn]] void bad_argument(const std::string& message) { throw Error(ErrorCode::invalid_argument, message); }

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= static_cast<unsigned>(DType::bf16); }

// Where a param is, as the caller wrote it: "params[3]" or "groups[1].params[0]".
struct ParamNames {
  const std::vector<std::size_t>* group_begin = nullptr;  // null: one unnamed group
  std::string operator()(std::size_t i) const {
    if (group_begin == nullptr) return "params[" + std::to_string(i) + "]";
    std::size_t g = 0;
    while (g + 1 < group_begin->size() && (*group_begin)[g + 1] <= i) ++g;
    return "groups[" + std::to_string(g) + "].params[" + std::to_string(i - (*group_begin)[g]) + "]";
  }
};

// The most elements one tensor may have: keeps every size and offset computation
// (rounding to 16 elements, bytes of an fp32 copy, chunk counts) far from
// overflowing int64, and an absurd numel an Error instead of a failed allocation.
constexpr std::int64_t kMaxNumel = std::int64_t{1} << 48;

void validate_params(const std::vector<Param>& params, const ParamNames& name) {
  if (params.empty()) bad_argument("Optimizer: the parameter list is empty (pass at least one Param)");
  struct Range {
    std::uintptr_t begin, end;
    std::size_t param;
    const char* field;
  };
  std::vector<Range> ranges;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    for (const auto& [view, field] : {std::pair{&p.weight, "weight"}, std::pair{&p.grad, "grad"}}) {
      const std::string at = name(i) + "." + field;
      if (!valid_dtype(view->dtype))
        bad_argument(at + ".dtype = " + std::to_string(static_cast<int>(view->dtype)) +
                     " is not a DType (use DType::f32, f16 or bf16)");
      if (view->numel < 0) bad_argument(at + ".numel = " + std::to_string(view->numel) + " is negative");
      if (view->numel > kMaxNumel)
        bad_argument(at + ".numel = " + std::to_string(view->numel) + " is more than one tensor may have (2^48)");
      if (view->numel > 0 && view->data == nullptr)
        bad_argument(at + ".data is null with numel = " + std::to_string(view->numel));
      if (view->numel > 0) {
        const auto begin = reinterpret_cast<std::uintptr_t>(view->data);
        ranges.push_back({begin, begin + static_cast<std::uintptr_t>(view->numel) * dtype_size(view->dtype), i, field});
      }
    }
    if (p.weight.numel != p.grad.numel)
      bad_argument(name(i) + ".weight.numel = " + std::to_string(p.weight.numel) + " but " + name(i) +
                   ".grad.numel = " + std::to_string(p.grad.numel) + " (they must match)");
  }
  // The same weight twice: say so in the caller's terms first.
  std::unordered_map<const void*, std::size_t> weights;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].weight.numel == 0) continue;
    const auto [it, fresh] = weights.emplace(params[i].weight.data, i);
    if (!fresh)
      bad_argument(name(i) + ".weight is the same tensor as " + name(it->second) +
                   ".weight (each tensor may appear once, in one group)");
  }
  // No two tensors may share memory: a weight listed twice would be updated twice,
  // a shared gradient unscaled twice, and overlapping ranges race between threads.
  std::sort(ranges.begin(), ranges.end(), [](const Range& x, const Range& y) { return x.begin < y.begin; });
  for (std::size_t k = 1, last = 0; k < ranges.size(); ++k) {
    const Range& prev = ranges[last];
    const Range& r = ranges[k];
    if (r.begin < prev.end) {
      const std::string a = name(prev.param) + "." + prev.field, b = name(r.param) + "." + r.field;
      if (prev.param == r.param)
        bad_argument(a + " and " + b + " share memory (a gradient needs its own buffer)");
      if (r.begin == prev.begin && std::string_view(r.field) == prev.field)
        bad_argument(b + " is the same tensor as " + a + " (each tensor may appear once, in one group)");
      bad_argument(b + " overlaps " + a + " in memory (tensors must not share memory)");
    }
    if (r.end > prev.end) last = k;
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
    bad_argument("OptimizerOptions::norm_type = " + format_number(o.norm_type) + " (use 2.0 or INFINITY)");
  if (o.max_grad_norm && !(std::isfinite(*o.max_grad_norm) && *o.max_grad_norm > 0))
    bad_argument("OptimizerOptions::max_grad_norm = " + format_number(*o.max_grad_norm) +
                 " (must be finite and > 0; leave it empty for no clipping)");
  if (o.num_threads < 0 || o.num_threads > 1024)
    bad_argument("OptimizerOptions::num_threads = " + std::to_string(o.num_threads) + " (use 0 for the default, or 1 to 1024)");
  if (static_cast<unsigned>(o.fusion) > static_cast<unsigned>(Fusion::interpreted))
    bad_argument("OptimizerOptions::fusion = " + std::to_string(static_cast<int>(o.fusion)) + " is not a Fusion value");
}

// What stochastic rounding and compensated weights share: they are for bf16 weights
// (no f16 ones), and some param must have one. `at` names the optimizer and the option,
// `what` says whom the option is for, `verb` what it would do to a bf16 weight.
void validate_bf16_option(const std::vector<Param>& params, const OptimizerOptions& o, const std::string& at,
                          std::string_view option, std::string_view what, std::string_view verb) {
  bool any_bf16 = false;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].weight.dtype == DType::f16)
      bad_argument(at + ": params[" + std::to_string(i) + "] has f16 weights; " + std::string(what) +
                   " for bf16 weights (keep fp32 masters for f16 weights, or store them as bf16)");
    any_bf16 |= params[i].weight.dtype == DType::bf16;
  }
  if (!any_bf16 && !o.communicator)  // (a sharded optimizer's rank may hold f32 params only)
    bad_argument(at + " is set but no param has bf16 weights (f32 weights are stored exactly; there is nothing to " +
                 std::string(verb) + ": leave " + std::string(option) + " off)");
}

// Stochastic rounding: bf16 weights without masters, and at least one of them.
void validate_rounding(const std::vector<Param>& params, const OptimizerOptions& o, std::string_view optimizer) {
  if (!o.stochastic_rounding) return;
  const std::string at = std::string(optimizer) + ": OptimizerOptions::stochastic_rounding";
  // (The weights first: without bf16 weights the master_weights advice would only lead to this error.)
  validate_bf16_option(params, o, at, "stochastic_rounding", "stochastic rounding is", "round");
  if (o.master_weights)
    bad_argument(at + " is set with master_weights = true (the weights are then rounded from their fp32 masters, "
                      "to nearest; stochastic rounding is the alternative to masters: set master_weights = false)");
}

// Compensated weights: bf16 weights without masters or stochastic rounding, and at least one of them.
void validate_compensation(const std::vector<Param>& params, const OptimizerOptions& o, std::string_view optimizer) {
  if (!o.compensated_weights) return;
  const std::string at = std::string(optimizer) + ": OptimizerOptions::compensated_weights";
  validate_bf16_option(params, o, at, "compensated_weights", "compensated weights are", "compensate");
  if (o.master_weights)
    bad_argument(at + " is set with master_weights = true (a bf16 compensation replaces the fp32 master: "
                      "set master_weights = false, or leave compensated_weights off to keep masters)");
  if (o.stochastic_rounding)
    bad_argument(at + " is set with stochastic_rounding = true (the compensation keeps what rounding to nearest "
                      "loses; choose one of the two)");
}

std::string stream_name(const void* stream) {
  return stream == nullptr ? "null (the legacy default stream)" : format_pointer(stream);
}

// The local part of a sharded optimizer's checks (the collective part is Shard's).
void validate_shard(const std::vector<Param>& params, const OptimizerOptions& o) {
  if (!o.communicator) {
    if (!o.slices.empty())
      bad_argument("OptimizerOptions::slices is set but there is no communicator (slices place a sharded "
                   "optimizer's params in the model; set OptimizerOptions::communicator, or leave slices empty)");
    return;
  }
  const Communicator& c = *o.communicator;
  if (c.size() < 1 || c.rank() < 0 || c.rank() >= c.size())
    bad_argument("OptimizerOptions::communicator '" + std::string(c.name()) + "': rank " + std::to_string(c.rank()) +
                 " of size " + std::to_string(c.size()) + " (need 0 <= rank < size)");
  if (o.device.kind == Device::Kind::cuda && c.device().kind != Device::Kind::cuda)
    throw Error(ErrorCode::unsupported,
                "OptimizerOptions::communicator '" + std::string(c.name()) +
                    "' works on host memory, but a CUDA optimizer's sharded step runs its collective on the device, "
                    "with no host sync (use stepfuse::nccl_communicator over a comm of cuda:" +
                    std::to_string(o.device.index) + ", on the optimizer's stream)");
  if (o.device.kind == Device::Kind::cuda && c.device().index != o.device.index)
    bad_argument("OptimizerOptions::communicator '" + std::string(c.name()) + "' works on cuda:" +
                 std::to_string(c.device().index) + " but the optimizer is on cuda:" + std::to_string(o.device.index) +
                 " (give each GPU's optimizer the communicator of that GPU)");
  if (o.device.kind == Device::Kind::cuda && c.cuda_stream() != o.cuda_stream)
    bad_argument("OptimizerOptions::communicator '" + std::string(c.name()) + "' enqueues its collectives on stream " +
                 stream_name(c.cuda_stream()) + " but OptimizerOptions::cuda_stream is " + stream_name(o.cuda_stream) +
                 " (the step's collective runs between its kernels: give the communicator the optimizer's stream, "
                 "e.g. nccl_communicator(comm, stream) with options.cuda_stream = stream)");
  if (o.device.kind == Device::Kind::cpu && c.device().kind != Device::Kind::cpu)
    throw Error(ErrorCode::unsupported, "OptimizerOptions::communicator '" + std::string(c.name()) +
                                            "' works on device memory, but a CPU optimizer's collectives use host "
                                            "memory (use a CPU communicator: MPI, or torch.distributed's gloo)");
  if (!o.slices.empty() && o.slices.size() != params.size())
    bad_argument("OptimizerOptions::slices has " + std::to_string(o.slices.size()) + " entries for " +
                 std::to_string(params.size()) + " params (one TensorSlice per param, in params() order; or none)");
}

}  // namespace

bool StepPrograms::compressed() const {
  for (const auto& t : formats)
    for (StateFormat f : t)
      if (f != StateFormat::f32) return true;
  return false;
}

void StepPrograms::index_states() {
  state_names.clear();
  state_values.clear();
  state_slot.assign(groups.size(), {});
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const Program& p = *groups[g].program;
    state_slot[g].fill(-1);
    for (int s = 0; s < p.num_streams; ++s) {
      if (p.streams[s].role != StreamRole::state) continue;
      int b = state_index(p.streams[s].name);
      if (b < 0) {
        b = num_states();
        state_names.push_back(p.streams[s].name);
        state_values.push_back(p.streams[s].values);
      }
      state_slot[g][static_cast<std::size_t>(s)] = b;
    }
  }
}

StepEngine::StepEngine(std::vector<ParamGroup> groups, OptimizerOptions options, bool name_groups)
    : options_(options) {
  if (groups.empty()) bad_argument("Optimizer: no param groups (pass at least one ParamGroup)");
  std::vector<std::size_t> begins;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    ParamGroup& pg = groups[g];
    const std::string where = name_groups ? "groups[" + std::to_string(g) + "]" : std::string("Optimizer");
    if (pg.params.empty())
      bad_argument(where + ": the parameter list is empty (pass at least one Param" +
                   (name_groups ? std::string(", or leave the group out)") : std::string(")")));
    if (pg.config.index() != groups[0].config.index())
      bad_argument(where + ".config is " + std::string(optimizer_name(pg.config)) + " but groups[0].config is " +
                   std::string(optimizer_name(groups[0].config)) +
                   " (every group of one Optimizer has the same optimizer kind; use one Optimizer per kind)");
    try {
      jit::validate_config(pg.config);
    } catch (const Error& e) {
      if (!name_groups) throw;
      throw Error(e.code(), where + ".config: " + message_of(e));
    }
    Group group;
    group.config = pg.config;
    group.builtin = jit::select_builtin(pg.config);
    group.state_format = pg.state_format;
    group.begin = params_.size();
    begins.push_back(params_.size());
    for (Param& p : pg.params) params_.push_back(p);
    group.end = params_.size();
    groups_.push_back(std::move(group));
  }
  validate_params(params_, ParamNames{name_groups ? &begins : nullptr});
  validate_shard(params_, options_);  // first: a communicator of the wrong memory is wrong on any machine
  validate_options(options_);
  rules_.resize(groups_.size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& group = groups_[g];
    StepPrograms::Group pg;
    pg.program = &jit::builtin_program(group.builtin);
    if (options_.fusion == Fusion::fused) pg.fused = group.builtin;
    for (int s = 0; s < pg.program->num_streams; ++s)
      pg.state_init[s] = jit::initial_state_value(group.config, *pg.program, s);
    jit::scalar_rules(group.config, *pg.program, rules_[g].rules);
    programs_.groups.push_back(pg);
    programs_.tensor_group.insert(programs_.tensor_group.end(), group.end - group.begin, static_cast<std::uint32_t>(g));
  }
  setup();
}

StepEngine::StepEngine(UpdateProgram program, std::vector<Param> params, OptimizerOptions options)
    : custom_(std::make_unique<UpdateProgram>(std::move(program))), params_(std::move(params)), options_(options) {
  validate_params(params_, ParamNames{});
  validate_shard(params_, options_);  // first: a communicator of the wrong memory is wrong on any machine
  validate_options(options_);
  Group group;
  group.end = params_.size();
  groups_.push_back(group);
  StepPrograms::Group pg;
  pg.program = &custom_->program();  // lives in custom_'s storage, as long as the engine
  for (int s = 0; s < pg.program->num_streams; ++s) pg.state_init[s] = pg.program->streams[s].init;
  programs_.groups.push_back(pg);
  programs_.tensor_group.assign(params_.size(), 0);
  rules_.resize(1);
  for (int s = 0; s < pg.program->num_scalars; ++s) rules_[0].rules[s] = jit::device_rule(custom_->scalars()[s].rule);
  setup();
}

void StepEngine::no_config(const char* what) {
  throw Error(ErrorCode::invalid_state, std::string(what) +
                                            ": a custom-program optimizer has no OptimizerConfig; use scalar() / "
                                            "set_scalar() (and lr() / set_lr() when the program has a fixed scalar 'lr')");
}

void StepEngine::set_custom_rules(const UpdateProgram& program) {
  if (!custom_) throw Error(ErrorCode::invalid_state, "a built-in optimizer's scalars come from its config; use set_config()");
  if (to_string(program.program()) != to_string(this->program()))
    bad_argument("the update program '" + std::string(program.name()) + "' is not the one this optimizer runs ('" +
                 std::string(this->program().name) + "'): only its scalar rules can change");
  // Same program text: same scalars in the same order. Keep our storage (the programs point into it).
  *custom_ = custom_->with_rules(program.scalars());
  for (int s = 0; s < this->program().num_scalars; ++s) rules_[0].rules[s] = jit::device_rule(custom_->scalars()[s].rule);
  backend_->set_rules(rules_.data());
}

// Each tensor's storage of each state buffer: a stream named in
// OptimizerOptions::state_formats takes that format, any other its group's or the
// options' blanket format, except that full-precision streams keep f32 under a
// blanket format and q8 applies to tensors of min_q8_numel elements or more.
// Validates the choices first (before anything is allocated).
void StepEngine::resolve_state_formats() {
  const std::string optimizer(custom_ ? custom_->name() : optimizer_name(groups_[0].config));
  const auto known_format = [&](StateFormat f, const std::string& what) {
    if (static_cast<unsigned>(f) > static_cast<unsigned>(StateFormat::q8))
      bad_argument(optimizer + ": " + what + " = " + std::to_string(static_cast<int>(f)) +
                   " is not a StateFormat (use f32, bf16 or q8)");
  };
  known_format(options_.state_format, "OptimizerOptions::state_format");
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].state_format) known_format(*groups_[g].state_format, "groups[" + std::to_string(g) + "].state_format");
  if (options_.min_q8_numel < 0)
    bad_argument(optimizer + ": OptimizerOptions::min_q8_numel = " + std::to_string(options_.min_q8_numel) +
                 " (must be >= 0: q8 applies to tensors of at least that many elements)");
  std::string streams;  // the state streams, for messages
  for (std::string_view n : programs_.state_names) streams += (streams.empty() ? "'" : ", '") + std::string(n) + "'";
  if (streams.empty()) streams = "none";
  for (std::size_t k = 0; k < options_.state_formats.size(); ++k) {
    const auto& [name, format] = options_.state_formats[k];
    const std::string at = optimizer + ": OptimizerOptions::state_formats[" + std::to_string(k) + "] ('" + name + "')";
    known_format(format, at);
    for (std::size_t j = 0; j < k; ++j)
      if (options_.state_formats[j].first == name)
        bad_argument(at + " names the stream a second time (state_formats[" + std::to_string(j) +
                     "] already does; give each stream one format)");
    const int b = programs_.state_index(name);
    if (b < 0) bad_argument(at + ": " + optimizer + " has no state stream '" + name + "' (its state streams: " + streams + ")");
    if (format != StateFormat::f32 && programs_.state_values[static_cast<std::size_t>(b)] == StateValues::full_precision)
      bad_argument(at + " asks for " + std::string(state_format_name(format)) + ", but " + optimizer + " keeps '" + name +
                   "' in full precision (it must stay f32: leave it out of state_formats)");
  }
  // A blanket format that no stream of a group's program can take is a mistake, not a no-op.
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const StateFormat blanket = groups_[g].state_format.value_or(options_.state_format);
    if (blanket == StateFormat::f32) continue;
    const Program& p = *programs_.groups[g].program;
    bool any_state = false, any_takes = false;
    std::string full;
    for (int s = 0; s < p.num_streams; ++s) {
      if (p.streams[s].role != StreamRole::state) continue;
      any_state = true;
      if (p.streams[s].values != StateValues::full_precision) any_takes = true;
      else full += (full.empty() ? "'" : ", '") + std::string(p.streams[s].name) + "'";
    }
    if (any_state && !any_takes)
      bad_argument(optimizer + ": " +
                   (groups_[g].state_format ? "groups[" + std::to_string(g) + "].state_format"
                                            : std::string("OptimizerOptions::state_format")) +
                   " = " + std::string(state_format_name(blanket)) + ", but every state stream of " +
                   std::string(p.name) + " must stay f32 (" + full + " full precision)");
  }
  const std::size_t nb = programs_.state_names.size();
  programs_.formats.assign(params_.size(), std::vector<StateFormat>(nb, StateFormat::f32));
  for (std::size_t t = 0; t < params_.size(); ++t) {
    const std::size_t g = programs_.tensor_group[t];
    for (std::size_t b = 0; b < nb; ++b) {
      if (!has_state(t, static_cast<int>(b))) continue;
      StateFormat f = groups_[g].state_format.value_or(options_.state_format);
      if (programs_.state_values[b] == StateValues::full_precision) f = StateFormat::f32;
      for (const auto& [name, format] : options_.state_formats)
        if (name == programs_.state_names[b]) f = format;
      // (sharded: the size of the model tensor the param is a slice of, as one process sees it)
      const std::int64_t numel = shard_ ? shard_->tensor_of(t).numel : params_[t].weight.numel;
      if (f == StateFormat::q8 && numel < options_.min_q8_numel) f = StateFormat::f32;
      programs_.formats[t][b] = f;
    }
  }
}

void StepEngine::setup() {
  validate_rounding(params_, options_, custom_ ? custom_->name() : optimizer_name(groups_[0].config));
  validate_compensation(params_, options_, custom_ ? custom_->name() : optimizer_name(groups_[0].config));
  programs_.index_states();
  resolve_state_formats();
  if (options_.device.kind == Device::Kind::cuda) {
    auto cuda = std::make_unique<CudaBackend>(programs_, params_, options_);
    cuda_ = cuda.get();
    backend_ = std::move(cuda);
  } else if (options_.fusion == Fusion::unfused) {
    backend_ = std::make_unique<cpu::UnfusedBackend>(programs_, params_, options_);
  } else {
    // A custom program's names live in its storage, which a background compile keeps alive.
    std::shared_ptr<const void> owner = custom_ ? std::make_shared<const UpdateProgram>(*custom_) : nullptr;
    backend_ = std::make_unique<cpu::FusedBackend>(programs_, params_, options_, std::move(owner));
  }
  tensor_norms_.assign(params_.size(), NAN);
  rules_scratch_ = rules_;  // sized once
  backend_->set_rules(rules_.data());
}

void StepEngine::check_group(std::size_t group, const char* what) const {
  if (group >= groups_.size())
    bad_argument(std::string(what) + ": group " + std::to_string(group) + " is out of range (the optimizer has " +
                 std::to_string(groups_.size()) + (groups_.size() == 1 ? " group)" : " groups)"));
}

bool StepEngine::has_state(std::size_t param, int buffer) const {
  const auto& slots = programs_.state_slot[programs_.tensor_group[param]];
  return std::find(slots.begin(), slots.end(), buffer) != slots.end();
}

void StepEngine::set_steps(std::int64_t step_count, const std::vector<std::int64_t>& step_bases) {
  backend_->set_step_count(step_count);
  for (std::size_t g = 0; g < rules_.size() && g < step_bases.size(); ++g) rules_[g].step_base = step_bases[g];
  backend_->set_rules(rules_.data());
}

namespace {
bool is_nadam_rule(const sf_scalar_rule& r) {
  return r.kind == SF_RULE_NADAM_GRAD_COEF || r.kind == SF_RULE_NADAM_MOMENTUM_COEF;
}

// The group's first NAdam rule (its NAdam rules share beta1, momentum_decay and offset), or null.
const sf_scalar_rule* nadam_rule(const GroupRules& gr) {
  for (const sf_scalar_rule& r : gr.rules)
    if (is_nadam_rule(r)) return &r;
  return nullptr;
}

// NAdam's product after `steps` group steps under rule r of group rules `gr`. While beta1
// <= 0 the rules' product is 0 (mu_t = 0), and their offset keeps the log of the product
// when beta1 became so: a step taken since made it 0 for good, as in PyTorch; none keeps it.
double product_under(const sf_scalar_rule& r, const GroupRules& gr, std::int64_t steps) {
  if (r.b > 0.0) return sf_nadam_mu_product(r.b, r.c, steps, r.d);
  return steps > gr.product_since ? 0.0 : static_cast<double>(static_cast<float>(sf_exp(r.d)));
}

// The offset with which rule r (beta1 = r.b, momentum_decay = r.c) continues from `product`
// after `steps` group steps (while beta1 <= 0: the product's log).
double offset_for(const sf_scalar_rule& r, double product, std::int64_t steps) {
  if (r.b > 0.0) return sf_nadam_product_offset(product, r.b, r.c, steps);
  return product > 0.0 ? sf_log(product) : -std::numeric_limits<double>::infinity();
}
}  // namespace

double StepEngine::nadam_product(std::size_t group) const {
  const sf_scalar_rule* r = nadam_rule(rules_[group]);
  return r != nullptr ? product_under(*r, rules_[group], group_step_count(group)) : 1.0;
}

void StepEngine::set_nadam_product(std::size_t group, double product) {
  const sf_scalar_rule* r = nadam_rule(rules_[group]);
  if (r == nullptr) return;
  const std::int64_t steps = group_step_count(group);
  set_product_offset(group, offset_for(*r, product, steps), steps);
}

double StepEngine::product_offset(std::size_t group) const {
  const sf_scalar_rule* r = nadam_rule(rules_[group]);
  return r != nullptr ? r->d : 0.0;
}

std::int64_t StepEngine::product_since(std::size_t group) const { return rules_[group].product_since; }

void StepEngine::set_product_offset(std::size_t group, double offset, std::optional<std::int64_t> since) {
  if (nadam_rule(rules_[group]) == nullptr) return;
  for (sf_scalar_rule& r : rules_[group].rules)
    if (is_nadam_rule(r)) r.d = offset;
  rules_[group].product_since = since ? *since : group_step_count(group);
  backend_->set_rules(rules_.data());
}

void StepEngine::set_grads(std::span<const TensorView> grads) {
  if (grads.size() != params_.size())
    bad_argument("set_grads: " + std::to_string(grads.size()) + " gradients for " + std::to_string(params_.size()) +
                 " params (pass one per param, in params() order)");
  std::vector<Param> next = params_;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const TensorView& g = grads[i];
    const TensorView& old = params_[i].grad;
    if (g.numel != old.numel)
      bad_argument("set_grads: grads[" + std::to_string(i) + "].numel = " + std::to_string(g.numel) + " but params[" +
                   std::to_string(i) + "] has " + std::to_string(old.numel) + " elements");
    if (g.dtype != old.dtype)
      bad_argument("set_grads: grads[" + std::to_string(i) + "].dtype = " +
                   (valid_dtype(g.dtype) ? std::string(dtype_name(g.dtype)) : std::to_string(static_cast<int>(g.dtype))) +
                   " but the optimizer was built with " + std::string(dtype_name(old.dtype)) +
                   " (its kernels are specialized for it; build a new Optimizer to change it)");
    next[i].grad.data = g.data;
  }
  // The same checks as at construction: null data, a gradient overlapping a weight or another gradient.
  std::vector<std::size_t> begins;
  for (const Group& group : groups_) begins.push_back(group.begin);
  try {
    validate_params(next, ParamNames{groups_.size() > 1 ? &begins : nullptr});
  } catch (const Error& e) {
    throw Error(e.code(), "set_grads: " + message_of(e));
  }
  const std::vector<Param> previous = std::exchange(params_, std::move(next));
  try {
    backend_->set_grads(params_);
  } catch (...) {
    params_ = previous;
    throw;
  }
}

std::vector<ParamGroup> StepEngine::param_groups() const {
  if (custom_) no_config("param groups");
  std::vector<ParamGroup> out;
  for (const Group& g : groups_)
    out.push_back({std::vector<Param>(params_.begin() + static_cast<std::ptrdiff_t>(g.begin),
                                      params_.begin() + static_cast<std::ptrdiff_t>(g.end)),
                   g.config, g.state_format});
  return out;
}

void StepEngine::set_config(std::size_t group, const OptimizerConfig& config) {
  if (custom_) no_config("set_config()");
  check_config(group, config);
  // The device copy first (CUDA refuses during a graph capture): on an Error nothing changed.
  // (Into a scratch of the same size: set_lr allocates nothing.)
  rules_scratch_ = rules_;
  jit::scalar_rules(config, *programs_.groups[group].program, rules_scratch_[group].rules);
  // NAdam's mu_product is the product of every applied step's mu_t under the beta1 and
  // momentum_decay that step ran with (PyTorch multiplies one in per step): when they
  // change, the new rules carry the product so far as their offset. (On CUDA the step
  // count is read from the device: a wait, only when they change.)
  std::int64_t steps = -1;
  for (int k = 0; k < kMaxScalars; ++k) {
    const sf_scalar_rule& was = rules_[group].rules[k];
    sf_scalar_rule& now = rules_scratch_[group].rules[k];
    if (!is_nadam_rule(now) || now.kind != was.kind) continue;
    now.d = was.d;
    if (now.b == was.b && now.c == was.c) continue;
    if (steps < 0) {
      // (Setting the current rules again first: on CUDA that refuses a stream being
      // captured into a graph, with its message, before the step count's read would break
      // the capture.)
      backend_->set_rules(rules_.data());
      steps = group_step_count(group);
    }
    now.d = offset_for(now, product_under(was, rules_[group], steps), steps);
    rules_scratch_[group].product_since = steps;
  }
  backend_->set_rules(rules_scratch_.data());
  groups_[group].config = config;
  std::swap(rules_, rules_scratch_);
  follow_initial_state(group, config);
}

namespace {
// What `value` reads back as from a slot of this format, filled with it (a q8 block of it
// alone: absmax value, every code 1.0).
float stored_as(const StateSlot& like, float value) {
  StateSlot probe = like;
  alignas(64) std::byte bytes[cpu::kQ8Block * sizeof(float)];
  float absmax = 0;
  probe.data = bytes;
  probe.absmax = &absmax;
  std::vector<float> block(cpu::kQ8Block, value), back(cpu::kQ8Block);
  cpu::HostBuffers::encode(block.data(), probe, 0, cpu::kQ8Block);
  cpu::HostBuffers::decode(probe, 0, cpu::kQ8Block, back.data());
  return back[0];
}
}  // namespace

void StepEngine::follow_initial_state(std::size_t group, const OptimizerConfig& config) {
  // (Adagrad's sum takes initial_accumulator_value at construction, as torch's: it does not follow.)
  if (custom_ || cuda_ != nullptr || !jit::initial_state_at_first_step(config)) return;
  StepPrograms::Group& pg = programs_.groups[group];
  const Program& program = *pg.program;
  for (int s = 0; s < program.num_streams; ++s) {
    const float init = jit::initial_state_value(config, program, s);
    if (program.streams[s].role != StreamRole::state || std::memcmp(&init, &pg.state_init[s], sizeof init) == 0)
      continue;
    if (group_step_count(group) != 0) return;  // stepped: the state is its own now
    const int buffer = state_stream(program.streams[s].name);
    const float old = pg.state_init[s];
    for (std::size_t i = groups_[group].begin; i < groups_[group].end; ++i) {
      if (!has_state(i, buffer)) continue;
      const StateSlot slot = state_slot(i, buffer);
      const auto n = static_cast<std::size_t>(params_[i].weight.numel);
      if (slot.format == StateFormat::f32) {
        float* v = static_cast<float*>(slot.data);
        for (std::size_t j = 0; j < n; ++j)
          if (std::memcmp(&v[j], &old, sizeof old) == 0) v[j] = init;
        continue;
      }
      // bf16 or q8, in runs of whole q8 blocks through small buffers (set_lr allocates
      // little): a bf16 element, or a q8 block every element of which, that still reads as
      // the old value takes the new (a bf16 run is stored again whole: exact for the others).
      const float old_stored = stored_as(slot, old);
      constexpr std::size_t kRun = 64 * cpu::kQ8Block;
      std::vector<float> run(std::min(n, kRun)), fresh(std::min(n, cpu::kQ8Block), init);
      const auto is_old = [&](float x) { return std::memcmp(&x, &old_stored, sizeof x) == 0; };
      for (std::size_t at = 0; at < n; at += kRun) {
        const std::size_t m = std::min(kRun, n - at);
        cpu::HostBuffers::decode(slot, at, m, run.data());
        if (slot.format == StateFormat::bf16) {
          bool any = false;
          for (std::size_t j = 0; j < m; ++j)
            if (is_old(run[j])) run[j] = init, any = true;
          if (any) cpu::HostBuffers::encode(run.data(), slot, at, m);
          continue;
        }
        for (std::size_t b = 0; b < m; b += cpu::kQ8Block) {
          const std::size_t len = std::min(cpu::kQ8Block, m - b);
          const auto first = run.begin() + static_cast<std::ptrdiff_t>(b);
          if (std::all_of(first, first + static_cast<std::ptrdiff_t>(len), is_old))
            cpu::HostBuffers::encode(fresh.data(), slot, at + b, len);
        }
      }
    }
    pg.state_init[s] = init;
  }
}

void StepEngine::check_config(std::size_t group, const OptimizerConfig& config) const {
  if (custom_) no_config("set_config()");
  check_group(group, "set_config");
  const OptimizerConfig& now = groups_[group].config;
  // Built only for a message: checking a valid config allocates nothing.
  const auto where = [&] {
    return groups_.size() > 1 ? "set_config(group " + std::to_string(group) + ")" : std::string("set_config");
  };
  if (config.index() != now.index())
    bad_argument(where() + ": the optimizer is " + std::string(optimizer_name(now)) + " but the new config is " +
                 std::string(optimizer_name(config)) + " (build a new Optimizer to change the kind)");
  try {
    jit::validate_config(config);
  } catch (const Error& e) {
    if (groups_.size() == 1) throw;
    throw Error(e.code(), where() + ": " + message_of(e));
  }
  if (jit::select_builtin(config) != groups_[group].builtin)
    bad_argument(where() + ": the new config needs update program '" +
                 std::string(jit::builtin_program(jit::select_builtin(config)).name) + "' but " +
                 (groups_.size() > 1 ? "this group" : std::string("this optimizer")) + " runs '" +
                 std::string(programs_.groups[group].program->name) +
                 "' (amsgrad, nesterov, centered and momentum on/off change the state; build a new Optimizer or add "
                 "a param group)");
}

const StepResult& StepEngine::last() const {
  if (last_.pending) last_ = backend_->read_result(&tensor_norms_);
  return last_;
}

const std::vector<double>& StepEngine::tensor_norms() const {
  last();
  return tensor_norms_;
}

const StepResult& StepEngine::step_device_scale(const float* scale, sf_scaler_state* scaler) {
  StepRequest request;
  request.scaled = true;
  request.groups = rules_.data();
  request.device_scale = scale;
  request.scaler = scaler;
  last_ = backend_->step(request, tensor_norms_);
  return last_;
}

void StepEngine::connect_shard() {
  std::vector<bool> two_phase;
  for (std::size_t i = 0; i < params_.size(); ++i) two_phase.push_back(jit::is_two_phase(programs_.program_of(i)));
  shard_ = std::make_unique<Shard>(options_, params_, two_phase);
  // q8 applies by the size of the model's tensor, known now: a slice smaller than
  // min_q8_numel of a larger tensor stores q8 as the one-process step does. (Nothing
  // has stepped yet: a backend planned for other formats is planned again.)
  const std::vector<std::vector<StateFormat>> planned = programs_.formats;
  resolve_state_formats();
  if (programs_.formats != planned) setup();
  backend_->set_shard(shard_.get());
}

const StepResult& StepEngine::step(double loss_scale, bool scaled) {
  // (A scale whose fp32 reciprocal overflows, below about 2^-128, would unscale every
  // gradient to inf: refused like 0.)
  if (!std::isfinite(loss_scale) || sf_unscalable(loss_scale)) {
    // Sharded: the other ranks are in (or on their way to) the step's collective.
    // If even that fails (a transport error), the loss scale is still the Error to report.
    if (shard_ && (scaled || options_.max_grad_norm || options_.track_grad_norm)) {
      try {
        if (cuda_ != nullptr)
          cuda_->refuse_shard_step();
        else
          shard_->refuse_step();
      } catch (const std::exception&) {
      }
    }
    bad_argument("step: loss_scale = " + format_number(loss_scale) +
                 " (must be finite and above 2^-128: its fp32 reciprocal must be finite)");
  }
  StepRequest request;
  request.loss_scale = loss_scale;
  request.scaled = scaled;
  request.groups = rules_.data();
  last_ = backend_->step(request, tensor_norms_);
  return last_;
}

}  // namespace stepfuse::detail
