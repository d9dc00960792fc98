// The fused CPU backend: one reduce pass and one update pass per step, by the
// compile-time fused Highway kernels of a built-in program, by LLVM-compiled
// kernels (adopted when a background compile finishes, or compiled at once with
// CpuBackend::llvm), or by the blocked interpreter (Fusion::interpreted, and
// custom programs).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "jit/builtins.hpp"
#include "runtime/backend.hpp"
#include "runtime/cpu/host_buffers.hpp"
#include "runtime/cpu/interpreter.hpp"
#include "runtime/cpu/llvm_backend.hpp"

namespace stepfuse::cpu {

class FusedBackend final : public HostBackend {
 public:
  // builtin: the program's compile-time fused kernels (Fusion::fused), or nullopt
  // for the interpreter (Fusion::interpreted, or a custom program). program_owner:
  // what `program` refers to (a custom program's storage; null for a built-in),
  // kept alive by a background LLVM compile.
  FusedBackend(const Program& program, std::optional<jit::Builtin> builtin, const std::vector<Param>& params,
               const OptimizerOptions& options, const float* state_init,
               std::shared_ptr<const void> program_owner = {});

  StepResult step(const detail::StepRequest& request, std::vector<double>& tensor_norms) override;
  std::string_view name() const override;

 private:
  // Kernels per tensor: each tensor may have its own weight/grad dtypes.
  struct TensorKernels {
    ReduceFn reduce = nullptr;           // for the options' norm type, on the stored grads
    UpdateFn update = nullptr;           // Highway or LLVM
    JitL2Fn llvm_l2 = nullptr;           // LLVM reduce (then `reduce` is its rare path)
    JitInfFn llvm_inf = nullptr;
  };
  static ReducePartial reduce_chunk(const TensorKernels& k, const void* grad, std::size_t n);
  // The LLVM kernels now, or a background build.
  void setup_llvm(const Program& program, std::shared_ptr<const void> program_owner);
  void install_llvm(const jit::CpuKernels& kernels);
  void poll_llvm();  // adopts a finished background build (at the start of a step)

  std::vector<TensorKernels> kernels_;
  std::unique_ptr<InterpreterSet> interpreters_;  // the interpreter's (then kernels_[t].update is null)
  detail::AlignedBuffer scratch_;                 // the interpreter's per-thread blocks
  jit::CpuSpec llvm_spec_;                        // what the LLVM kernels are compiled for
  bool llvm_active_ = false;                      // the LLVM kernels run the step
  std::shared_ptr<JitBuild> llvm_build_;          // automatic: the background compile, until adopted
};

}  // namespace stepfuse::cpu
