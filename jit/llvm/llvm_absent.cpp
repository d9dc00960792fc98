// Built instead of the LLVM emitter and JIT when LLVM was not found: the CPU
// backend is Highway alone, and asking for LLVM says so.
#include "jit/llvm/cpu_jit.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::jit {
namespace {
[[noreturn]] void absent() {
  throw Error(ErrorCode::unsupported,
              "this build of stepfuse has no LLVM backend (LLVM was not found when it was configured; install "
              "llvm-14-dev or newer and rebuild, or use the Highway backend: STEPFUSE_CPU_BACKEND=highway)");
}
}  // namespace

bool llvm_built() { return false; }
std::string llvm_version() { return ""; }
CpuTarget CpuTarget::host() { absent(); }
CpuTarget CpuTarget::named(const std::string&, const std::string&, const std::string&) { absent(); }
std::string CpuTarget::describe() const { return triple + " " + cpu; }
std::string cpu_update_symbol(const DtypeCombo&) { absent(); }
std::string cpu_phase1_symbol(const DtypeCombo&) { absent(); }
std::string cpu_reduce_symbol(DType, bool) { absent(); }
std::string cpu_canonical_text(const CpuSpec&) { absent(); }
std::string cpu_cache_key(const CpuSpec&, const CpuTarget&) { absent(); }
std::string cpu_module_ir(const CpuSpec&, const CpuTarget&, bool) { absent(); }
std::string cpu_compile_object(const CpuSpec&, const CpuTarget&, CpuObjectKind) { absent(); }
std::shared_ptr<const CpuKernels> cpu_kernels(const CpuSpec&) { absent(); }
std::shared_ptr<const CpuKernels> cpu_kernels_if_cached(const CpuSpec&) { absent(); }
std::shared_ptr<const CpuKernels> cpu_kernels_for(const CpuSpec&, const CpuTarget&) { absent(); }
}  // namespace stepfuse::jit
