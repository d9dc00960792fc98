// An optimizer's step over a backend: configuration, scalar rules, validation, results.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "jit/builtins.hpp"
#include "runtime/backend.hpp"
#include "runtime/cuda/cuda_backend.hpp"
#include "runtime/shard.hpp"
#include "stepfuse/optimizer.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse::detail {

// An optimizer's step: its configuration (a built-in config or a custom
// program), the scalar rules, validation and the last result, over a backend
// (runtime/backend.hpp) chosen by the options, which owns the state, masters and
// kernels, allocated and planned at construction. A fused step allocates nothing.
class StepEngine {
 public:
  // Built-in optimizers, one or more param groups of one kind. name_groups: say
  // "groups[g].params[i]" in errors (else "params[i]", the one-config constructor's).
  StepEngine(std::vector<ParamGroup> groups, OptimizerOptions options, bool name_groups);
  // A custom update program (one group): on the CPU the blocked interpreter runs
  // it (in the fused pipeline: Fusion::fused and Fusion::interpreted are the same
  // path for it), on CUDA the kernels generated for it.
  StepEngine(UpdateProgram program, std::vector<Param> params, OptimizerOptions options);
  // Not copied or moved: the backend refers to params(), options() and the programs.
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  // Sharded (OptimizerOptions::communicator): the collective part of construction,
  // called once the engine is built on this rank (Optimizer's constructors; a rank
  // whose construction threw calls Shard::refuse instead). Throws on every rank
  // when any rank refused or the ranks' shards do not fit together.
  void connect_shard();
  const Shard* shard() const { return shard_.get(); }

  // loss_scale: 1 for a plain step. Returns what the step did (also kept in last()).
  // On CUDA the step is only enqueued: the result is pending until last() reads it.
  const StepResult& step(double loss_scale, bool scaled);
  // CUDA: a scaled step whose loss scale is read on the device (a GradScaler's),
  // recording found_inf in the scaler's device state. Enqueued; nothing waits.
  const StepResult& step_device_scale(const float* scale, sf_scaler_state* scaler);
  bool on_cuda() const { return cuda_ != nullptr; }
  CudaBackend* cuda() const { return cuda_; }

  // Param groups (a custom program is one group).
  std::size_t num_groups() const { return groups_.size(); }
  std::size_t group_of(std::size_t param) const { return programs_.tensor_group[param]; }
  std::size_t group_begin(std::size_t group) const { return groups_[group].begin; }
  std::size_t group_end(std::size_t group) const { return groups_[group].end; }
  // The group's steps: step_count() minus the steps before it was added.
  std::int64_t group_step_count(std::size_t group) const { return step_count() - rules_[group].step_base; }
  std::int64_t step_base(std::size_t group) const { return rules_[group].step_base; }
  // ParamGroup::state_format of the group (nullopt: it takes OptimizerOptions::state_format).
  std::optional<StateFormat> group_state_format(std::size_t group) const { return groups_[group].state_format; }
  // Checkpoint restore and add_param_group: the global count and each group's base.
  void set_steps(std::int64_t step_count, const std::vector<std::int64_t>& step_bases);
  // The offset a group's NAdam rules carry (sf_scalar_rule::d: the product of mu_t over
  // steps taken with another beta1 or momentum_decay, sf_nadam_product_offset), 0 for
  // a group without them. set_config keeps it up to date; checkpoints and add_param_group
  // carry it over with this setter, which changes nothing for a group without them.
  // (While the group's beta1 is <= 0, the offset is the log of the product when it became
  // so, at group step product_since(): a step applied since then makes the product 0.
  // set_product_offset's `since` defaults to the group's step count.)
  double product_offset(std::size_t group) const;
  std::int64_t product_since(std::size_t group) const;
  // NAdam's mu_product after the group's steps so far (1 for a group without NAdam's
  // rules), and setting it: later steps multiply onto it.
  double nadam_product(std::size_t group) const;
  void set_nadam_product(std::size_t group, double product);
  void set_product_offset(std::size_t group, double offset, std::optional<std::int64_t> since = std::nullopt);
  // Optimizer::set_grads: validated, then the backend's; nothing changes on an Error.
  void set_grads(std::span<const TensorView> grads);
  // Error(invalid_argument) naming the index unless group < num_groups().
  void check_group(std::size_t group, const char* what) const;

  // Built-ins only: Error(invalid_state) for a custom program. config() is group 0's.
  const OptimizerConfig& config() const { return config(0); }
  const OptimizerConfig& config(std::size_t group) const {
    if (custom_) no_config("config()");
    return groups_[group].config;
  }
  void set_config(std::size_t group, const OptimizerConfig& config);
  // Throws what set_config would throw for `config`, changing nothing.
  void check_config(std::size_t group, const OptimizerConfig& config) const;
  // A state whose first value comes from the config (Rprop's step_size starts at the lr)
  // takes the new config's until the group's first applied step, as PyTorch sets it at
  // its first step: the elements that still hold the old first value (those written
  // since keep theirs; q8: the blocks whose every element does). On the CPU; a CUDA
  // optimizer keeps the first config's.
  void follow_initial_state(std::size_t group, const OptimizerConfig& config);
  // The groups as ParamGroups (built-ins): what add_param_group rebuilds from.
  std::vector<ParamGroup> param_groups() const;
  // The custom program (with its current scalar rules), or null for a built-in.
  const UpdateProgram* custom_program() const { return custom_.get(); }
  // Custom programs: replaces the scalar rules (same program, validated); takes
  // effect at the next step, no recompilation. Error(invalid_argument) if `program`
  // is another program; Error(invalid_state) for a built-in.
  void set_custom_rules(const UpdateProgram& program);
  const OptimizerOptions& options() const { return options_; }
  const std::vector<Param>& params() const { return params_; }
  // Group 0's program (the only one with one group), and a group's.
  const Program& program() const { return *programs_.groups[0].program; }
  const Program& program(std::size_t group) const { return *programs_.groups[group].program; }
  const StepPrograms& programs() const { return programs_; }
  std::int64_t step_count() const { return backend_->step_count(); }
  const StepResult& last() const;
  const std::vector<double>& tensor_norms() const;
  int threads() const { return backend_->threads(); }
  std::string_view backend() const { return backend_->name(); }  // Optimizer::backend()

  // A state buffer's index by name (the union of the groups' state streams), or -1.
  int state_stream(std::string_view name) const { return programs_.state_index(name); }
  // Whether param's group's program has state buffer `buffer`.
  bool has_state(std::size_t param, int buffer) const;
  // On CUDA these are a host copy, fetched from the device (waiting for it) when
  // the device has changed since; the next step copies it back.
  // A stream stored as f32; null for one stored as bf16 or q8 (state_slot() has it).
  float* state_data(std::size_t param, int buffer) const {
    const StateSlot s = state_slot(param, buffer);
    return s.format == StateFormat::f32 ? static_cast<float*>(s.data) : nullptr;
  }
  // Where and how a param's state buffer is stored.
  StateSlot state_slot(std::size_t param, int buffer) const { return backend_->state_slot(buffer, param); }
  // fp32 master copy of a parameter, or null (f32 weights, masters off, or compensations instead).
  float* master_data(std::size_t param) const {
    const jit::Layout& l = backend_->layout();
    if (l.master_offsets[param] < 0 || l.master_elem_bytes != sizeof(float)) return nullptr;
    return backend_->masters_data() + l.master_offsets[param];
  }
  // bf16 compensation of a parameter (bit patterns), or null (not a compensated bf16 weight).
  std::uint16_t* compensation_data(std::size_t param) const {
    const jit::Layout& l = backend_->layout();
    if (l.master_offsets[param] < 0 || l.master_elem_bytes != sizeof(std::uint16_t)) return nullptr;
    return reinterpret_cast<std::uint16_t*>(backend_->masters_data()) + l.master_offsets[param];
  }

 private:
  struct Group {
    OptimizerConfig config;                // built-ins
    jit::Builtin builtin = jit::Builtin::none;
    std::size_t begin = 0, end = 0;        // its params in params_
    std::optional<StateFormat> state_format;  // ParamGroup::state_format
  };
  void setup();  // the backend, once the programs and their rules are known
  void resolve_state_formats();  // programs_.formats, validated
  [[noreturn]] static void no_config(const char* what);

  std::unique_ptr<UpdateProgram> custom_;  // custom programs (then Group::config is unused)
  std::vector<Group> groups_;
  std::vector<Param> params_;               // every group's, group after group
  OptimizerOptions options_;
  StepPrograms programs_;
  std::vector<GroupRules> rules_;           // per group: its scalar rules (jit/step_scalars.h) and step base
  std::vector<GroupRules> rules_scratch_;   // set_config's next rules, before the backend took them
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Shard> shard_;  // sharded steps
  CudaBackend* cuda_ = nullptr;  // backend_, when it is the CUDA one
  mutable std::vector<double> tensor_norms_;
  mutable StepResult last_;
};

}  // namespace stepfuse::detail
