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
#include "runtime/cpu/two_phase.hpp"

namespace stepfuse::cpu {

class FusedBackend final : public HostBackend {
 public:
  // Each group's program runs by its compile-time fused kernels (StepPrograms::
  // Group::fused), else the interpreter; LLVM kernels (one spec per distinct
  // program) replace either. program_owner: what the programs refer to (a custom
  // program's storage; null for built-ins), kept alive by a background LLVM compile.
  FusedBackend(const detail::StepPrograms& programs, const std::vector<Param>& params, const OptimizerOptions& options,
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
    Phase1Fn phase1 = nullptr;           // a two-phase program's phase 1 (Highway or LLVM)
    bool bf16_state = false;             // update and phase1 read and write the bf16 state themselves
    bool draws_bits = false;             // stochastic rounding: update draws its random bits itself (Highway)
  };
  bool all_bf16_state(std::size_t t) const;
  // Whether the bf16 state of stochastically rounded weights rounds stochastically
  // (OptimizerOptions::stochastic_state_rounding).
  bool stochastic_state() const { return options_.stochastic_state_rounding; }
  void prefetch_next(std::size_t c, bool weight) const;
  static ReducePartial reduce_chunk(const TensorKernels& k, const void* grad, std::size_t n);
  std::size_t reduce_chunks(std::size_t c, std::size_t end, ReducePartial* out) const;
  // [grad dtype][w]: the kernels that reduce w chunks at once (Highway's, bitwise as `reduce`).
  ReduceGroupFn reduce_groups_[3][kReduceWays + 1] = {};
  // The LLVM kernels of one distinct program of the groups.
  struct ProgramJit {
    const Program* program = nullptr;
    jit::CpuSpec spec;                 // what its LLVM kernels are compiled for
    bool active = false;               // its LLVM kernels run its tensors
    std::shared_ptr<JitBuild> build;   // automatic: the background compile, until adopted
  };
  // The LLVM kernels now, or background builds.
  void setup_llvm(std::shared_ptr<const void> program_owner);
  void install_llvm(std::size_t jit, const jit::CpuKernels& kernels);
  void poll_llvm();  // adopts finished background builds (at the start of a step)
  bool all_llvm() const;

  std::vector<TensorKernels> kernels_;
  std::vector<ProgramJit> jits_;        // per distinct program
  std::vector<std::size_t> tensor_jit_;  // per tensor: its program's index in jits_
  std::unique_ptr<InterpreterSet> interpreters_;  // the interpreter's (then kernels_[t].update is null)
  detail::AlignedBuffer scratch_;                 // the interpreter's per-thread blocks
  // Stochastic rounding: which tensors round stochastically, and per thread the random
  // bits of the run LLVM's kernel is updating (UpdateArgs::sr_bits; Highway's kernels
  // draw their own).
  static constexpr std::size_t kRoundingRun = 2048;  // elements whose bits are drawn at once
  std::vector<bool> stochastic_;
  // bf16 and q8 state (HostBuffers::stage()): elements per staged run of an update,
  // and per tensor the streams its phases store.
  static constexpr std::size_t kStageRun = 16384;
  std::vector<StoredStreams> stores_;
  // Per tensor whose kernels round its bf16 state stochastically in registers: the
  // streams whose bits follow the weights' in rounding_bits_ (UpdateArgs::sr_stride), for
  // LLVM's kernels.
  std::vector<std::vector<int>> sr_state_streams_;
  std::vector<std::uint16_t> rounding_bits_;
  TwoPhase two_phase_;                            // two-phase programs' chunk sums and norms
};

}  // namespace stepfuse::cpu
