// The interface of a step backend (docs/architecture.md §4). StepEngine keeps
// the configuration, the scalar rules, validation and the last result; a backend
// owns the memory of a step (state, masters, tables, kernels) and runs it: CPU
// fused (runtime/cpu/fused_backend: Highway, LLVM or the interpreter), CPU
// unfused (runtime/cpu/unfused_backend) and CUDA (runtime/cuda/cuda_backend).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "jit/layout.hpp"
#include "jit/step_scalars.h"
#include "stepfuse/optimizer.hpp"

extern "C" {
#include "jit/cuda/device_abi.h"
}

namespace stepfuse::detail {

// One step, as StepEngine asks for it.
struct StepRequest {
  double loss_scale = 1.0;    // S: finite and > 0 (1 for a plain step)
  bool scaled = false;        // the gradients carry S: a step that finds inf/NaN is skipped
  const sf_scalar_rule* rules = nullptr;  // the program's scalar rules, one per program scalar
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

  // Steps applied so far (on CUDA read from, or written to, the device).
  virtual std::int64_t step_count() const = 0;
  virtual void set_step_count(std::int64_t n) = 0;

  // Where each tensor's state and master live (tensor i at layout().offsets[i]).
  virtual const jit::Layout& layout() const = 0;
  // Host views of a state stream (by program stream index) and of the masters,
  // laid out by layout(). CUDA: a host copy, fetched from the device (waiting for
  // it) when the device has changed since, and copied back before the next step.
  virtual float* state_data(int stream) const = 0;
  virtual float* masters_data() const = 0;

  // What runs the steps: "highway", "llvm", "interpreter", "unfused" or "cuda".
  virtual std::string_view name() const = 0;
  virtual int threads() const = 0;
};

}  // namespace stepfuse::detail
