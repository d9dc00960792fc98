// The interface of a step backend (docs/architecture.md §4). StepEngine keeps
// the configuration, the scalar rules, validation and the last result; a backend
// owns the memory of a step (state, masters, tables, kernels) and runs it: CPU
// fused (runtime/cpu/fused_backend: Highway, LLVM or the interpreter), CPU
// unfused (runtime/cpu/unfused_backend) and CUDA (runtime/cuda/cuda_backend).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "jit/builtins.hpp"
#include "jit/layout.hpp"
#include "jit/step_scalars.h"
#include "stepfuse/optimizer.hpp"

extern "C" {
#include "jit/cuda/device_abi.h"
}

namespace stepfuse::detail {

class Shard;

// What runs on each tensor: the programs of an optimizer's param groups. Groups of
// one optimizer run variants of one kind (Adam and Adam with amsgrad, say), so
// their programs may have different state streams; the state buffers are the
// union of them by name, each over the whole layout, and a group's program
// stream s reads buffer state_slot[g][s].
struct StepPrograms {
  struct Group {
    const Program* program = nullptr;
    std::optional<jit::Builtin> fused;        // the built-in's fused CPU kernels; nullopt: interpret
    float state_init[kMaxStreams] = {};        // initial value per program stream
  };
  std::vector<Group> groups;
  std::vector<std::uint32_t> tensor_group;      // per tensor: its group
  std::vector<std::string_view> state_names;     // the state buffers, first-use order
  std::vector<std::array<int, kMaxStreams>> state_slot;  // per group, per program stream: buffer, or -1
  std::vector<StateValues> state_values;         // per buffer: what its stream's values allow
  // Per tensor, per buffer: how it is stored (f32 where the tensor's program lacks the buffer).
  std::vector<std::vector<StateFormat>> formats;
  bool compressed() const;  // some tensor stores some buffer as bf16 or q8

  const Program& program_of(std::size_t tensor) const { return *groups[tensor_group[tensor]].program; }
  int state_index(std::string_view name) const {  // a buffer's index, or -1
    for (std::size_t i = 0; i < state_names.size(); ++i)
      if (state_names[i] == name) return static_cast<int>(i);
    return -1;
  }
  int num_states() const { return static_cast<int>(state_names.size()); }
  // Fills state_names and state_slot from groups.
  void index_states();
};

// Where and how one tensor's state buffer is stored.
struct StateSlot {
  StateFormat format = StateFormat::f32;
  void* data = nullptr;       // f32 values, bf16 bit patterns or q8 codes, from the tensor's element 0
  float* absmax = nullptr;    // q8: one per kQ8Block elements
  bool nonnegative = false;   // q8: the unsigned code (StateValues::nonnegative)
};

// A group's per-step scalar rules, and the global step count when it was added
// (its step t is the optimizer's minus step_base).
struct GroupRules {
  sf_scalar_rule rules[kMaxScalars] = {};
  std::int64_t step_base = 0;
  // Host only: NAdam with beta1 <= 0, the group step since which it is (StepEngine::product_since).
  std::int64_t product_since = 0;
};

// One step, as StepEngine asks for it.
struct StepRequest {
  double loss_scale = 1.0;    // S: finite and > 0 (1 for a plain step)
  bool scaled = false;        // the gradients carry S: a step that finds inf/NaN is skipped
  const GroupRules* groups = nullptr;  // per group of the StepPrograms
  // CUDA only: S read on the device (a GradScaler's scale; then `scaled`), and the
  // scaler's device state, where the step records found_inf.
  const float* device_scale = nullptr;
  sf_scaler_state* scaler = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Runs one step (the CPU) or enqueues it (CUDA: the result is `pending`, and
  // read_result() waits for it). CPU backends write the per-tensor norms of the
  // unscaled gradients (NaN when not computed) to `tensor_norms`.
  virtual StepResult step(const StepRequest& request, std::vector<double>& tensor_norms) = 0;
  // The result of a pending step, and its per-tensor norms; waits for the device.
  virtual StepResult read_result(std::vector<double>* tensor_norms) const = 0;

  // The groups' rules changed (construction, set_config, a checkpoint restore): CUDA
  // copies them to the device, ordered on its stream, where every launch (and every
  // replay of a captured graph) reads them. CPU backends read StepRequest::groups.
  virtual void set_rules(const GroupRules* groups) { (void)groups; }

  // Steps applied so far (on CUDA read from, or written to, the device).
  virtual std::int64_t step_count() const = 0;
  virtual void set_step_count(std::int64_t n) = 0;

  // Where each tensor's state and master live (tensor i at layout().offsets[i]).
  virtual const jit::Layout& layout() const = 0;
  // Host views of a state buffer (by StepPrograms::state_names index) and of the masters,
  // laid out by layout(). CUDA: a host copy, fetched from the device (waiting for
  // it) when the device has changed since, and copied back before the next step.
  virtual float* state_data(int stream) const = 0;
  virtual float* masters_data() const = 0;
  // Where tensor `tensor` keeps state buffer `stream`: by default f32 in state_data(),
  // at layout().offsets[tensor]; the CPU backends also store bf16 and q8.
  virtual StateSlot state_slot(int stream, std::size_t tensor) const {
    return {StateFormat::f32, state_data(stream) + layout().offsets[tensor], nullptr, false};
  }

  // The gradients moved (Optimizer::set_grads): `params` (the engine's, already
  // holding the new pointers, same sizes and dtypes) is what the next step reads.
  // Throws Error(unsupported), changing nothing, when the new pointers do not fit
  // the kernels this backend specialized (CUDA: alignment or one flat buffer).
  virtual void set_grads(const std::vector<Param>& params) = 0;

  // Sharded steps (runtime/shard.hpp): the reduce pass's combine becomes the
  // model's, over every rank. The CPU backends; CUDA refuses a communicator before.
  virtual void set_shard(Shard* shard) = 0;

  // What runs the steps: "highway", "llvm", "interpreter", "unfused" or "cuda".
  virtual std::string_view name() const = 0;
  virtual int threads() const = 0;
};

}  // namespace stepfuse::detail
