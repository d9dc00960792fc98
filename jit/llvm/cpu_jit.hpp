// The CPU JIT: a spec's object code (jit/llvm/emit_llvm.hpp) from the kernel
// cache or compiled, linked into the process by ORC LLJIT, as function pointers.
//
// Linked code is never unloaded: like the CUDA modules, the kernels of a spec
// live as long as the process, and every optimizer with that spec shares them.
// Without LLVM (llvm_built() false) every function here throws Error(unsupported).
#pragma once

#include <memory>
#include <vector>

#include "jit/llvm/emit_llvm.hpp"

namespace stepfuse::jit {

struct CpuKernels {
  std::vector<void*> update;  // sf_cpu_update_* per spec.combos, in order
  std::vector<void*> reduce;  // sf_cpu_reduce_* per spec.reduce_grads, in order
  std::vector<void*> phase1;  // a two-phase program: sf_cpu_phase1_* per spec.combos, in order (else empty)
  std::vector<void*> update_bf16_state;  // sf_cpu_update_*_bs per spec.bf16_state, in order
  std::vector<void*> phase1_bf16_state;  // a two-phase program: sf_cpu_phase1_*_bs per spec.bf16_state
  enum class Source { linked, memory_cache, disk_cache, compiled };
  Source source = Source::compiled;  // how this call got them (linked: this process had them)
};

// The kernels of `spec` for this machine (CpuTarget::host()): already linked,
// else the object from the kernel cache (memory, then disk), else compiled now
// (and cached). Thread-safe; concurrent calls for one spec compile it once.
std::shared_ptr<const CpuKernels> cpu_kernels(const CpuSpec& spec);
// The same, but null instead of compiling when no cache has the object.
std::shared_ptr<const CpuKernels> cpu_kernels_if_cached(const CpuSpec& spec);
// The kernels compiled for another CPU of this architecture (tests: code for an older
// CPU, with narrower vectors, runs here too). Calling code this CPU cannot run crashes.
std::shared_ptr<const CpuKernels> cpu_kernels_for(const CpuSpec& spec, const CpuTarget& target);

}  // namespace stepfuse::jit
