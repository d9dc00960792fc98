// The runtime version query.
#include "stepfuse/version.hpp"

#include <string>

#include "jit/llvm/emit_llvm.hpp"

#define STEPFUSE_STR2(x) #x
#define STEPFUSE_STR(x) STEPFUSE_STR2(x)

namespace stepfuse {
const char* version() {
  return STEPFUSE_STR(STEPFUSE_VERSION_MAJOR) "." STEPFUSE_STR(STEPFUSE_VERSION_MINOR) "." STEPFUSE_STR(
      STEPFUSE_VERSION_PATCH);
}

const char* llvm_version() {
  static const std::string v = jit::llvm_version();
  return v.c_str();
}

const char* llvm_cpu() {
  static const std::string cpu = jit::llvm_built() ? jit::CpuTarget::host().cpu : std::string();
  return cpu.c_str();
}
}  // namespace stepfuse
