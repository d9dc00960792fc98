// The emit API's description of a fused step emitted for a CPU target: the spec
// of a request, its JSON kernel ABI ("stepfuse.kernel_abi", the format of the
// CUDA targets' jit/cuda/kernel_abi.hpp) and its C header (jit/llvm/cpu_abi.h,
// the scalar rules, the step stage and the functions' declarations).
#pragma once

#include <string>
#include <vector>

#include "jit/layout.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "stepfuse/emit.hpp"

namespace stepfuse::jit {

// Update functions per combination, reduce functions per grad dtype, both in the
// layout's first-use order (as the runtime's LLVM backend builds its spec).
CpuSpec cpu_spec(const EmitRequest& r, const Layout& c);

// `names`: the update functions (one per spec combo), then the reduce functions
// (one per spec grad dtype), as cpu_update_symbol / cpu_reduce_symbol name them, then
// for a two-phase program the phase-1 functions (one per combo, cpu_phase1_symbol).
std::string describe_cpu_abi(const EmitRequest& r, const Layout& c, const CpuSpec& spec, const CpuTarget& target,
                             const std::vector<std::string>& names);
std::string cpu_abi_header(const EmitRequest& r, const CpuTarget& target, const CpuSpec& spec,
                           const std::vector<std::string>& names);

}  // namespace stepfuse::jit
