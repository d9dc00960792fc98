// Library version, at compile time and at run time.
#pragma once

#define STEPFUSE_VERSION_MAJOR 0
#define STEPFUSE_VERSION_MINOR 1
#define STEPFUSE_VERSION_PATCH 0
#define STEPFUSE_VERSION (STEPFUSE_VERSION_MAJOR * 10000 + STEPFUSE_VERSION_MINOR * 100 + STEPFUSE_VERSION_PATCH)

namespace stepfuse {
// "MAJOR.MINOR.PATCH" of the library actually linked.
const char* version();
// The Highway target the CPU backend dispatches to on this machine, e.g. "AVX2".
const char* cpu_target();
// The LLVM version of the CPU JIT backend ("14.0.6"), or "" when this build has
// none (LLVM was not found when it was configured: CpuBackend::llvm then throws).
const char* llvm_version();
// The CPU the LLVM backend compiles for on this machine ("haswell", "znver3"), or ""
// without LLVM.
const char* llvm_cpu();
}  // namespace stepfuse
