// The LLVM CPU backend as the step engine sees it: the choice of backend
// (OptimizerOptions::cpu_backend, STEPFUSE_CPU_BACKEND) and compiles on a
// background thread for CpuBackend::automatic.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "jit/llvm/cpu_jit.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse::cpu {

// The generated reduce functions (jit/llvm/emit_llvm.hpp has their contracts).
using JitL2Fn = float (*)(const void* grad, std::uint64_t n);
using JitInfFn = float (*)(const void* grad, std::uint64_t n, std::uint32_t* nonfinite);

// The options' backend, else STEPFUSE_CPU_BACKEND, else automatic.
// Error(invalid_argument) for an unknown value in the environment.
CpuBackend resolve_cpu_backend(const std::optional<CpuBackend>& option);

// In a child of fork() whose parent had builds queued or compiling: starts the child's
// own compile thread for them (once). Otherwise one relaxed load.
void resume_after_fork();

// One spec compiling on the process's compile thread (one thread, specs in turn).
class JitBuild {
 public:
  bool ready() const {
    if (ready_.load(std::memory_order_acquire)) return true;
    resume_after_fork();
    return false;
  }
  // After ready(): the kernels, or null and error() says why.
  const std::shared_ptr<const jit::CpuKernels>& kernels() const { return kernels_; }
  const std::string& error() const { return error_; }

 private:
  friend class CompileThread;
  std::atomic<bool> ready_ = false;
  std::shared_ptr<const jit::CpuKernels> kernels_;
  std::string error_;
  std::shared_ptr<const void> keep_alive_;  // what the spec's program refers to
};

// Queues `spec` for the compile thread. A build nobody holds any more when its
// turn comes is dropped. keep_alive: held as long as the build, so what the spec's
// program refers to (a custom program's storage: its names) outlives a compile that
// is still running when the optimizer is destroyed.
std::shared_ptr<JitBuild> build_in_background(jit::CpuSpec spec, std::shared_ptr<const void> keep_alive = {});

}  // namespace stepfuse::cpu
