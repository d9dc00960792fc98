// The emit API (stepfuse/emit.hpp): a spec's kernels, their ABI and their tables
// for a compiler that launches them itself. CUDA targets: jit/cuda (source, NVRTC,
// kernel_abi.cpp's description). CPU targets: jit/llvm (IR, object, and
// kernel_abi.cpp's description and C header).
#include "stepfuse/emit.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>

#include "jit/base/format.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/cuda/kernel_abi.hpp"
#include "jit/cuda/nvrtc_compile.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "jit/llvm/kernel_abi.hpp"
#include "jit/program_analysis.hpp"
#include "runtime/cpu/kernels.hpp"
#include "jit/cuda/cuda_layout.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/version.hpp"

namespace stepfuse {

namespace {

[[noreturn]] void bad(const char* fn, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, std::string(fn) + ": " + message);
}

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= static_cast<unsigned>(DType::bf16); }

// Validates a request; returns its layout plan (combinations and grad dtypes in
// first-use order, and each tensor's), as the runtime plans it.
jit::Layout check_request(const char* fn, const EmitRequest& r) {
  if (r.target.kind == EmitTarget::Kind::cpu) {
    if (!jit::llvm_built())
      throw Error(ErrorCode::unsupported,
                  std::string(fn) +
                      ": target cpu: emitting LLVM IR or an object file for a CPU target needs the LLVM backend (not "
                      "built): LLVM 14 or newer was not found when stepfuse was configured; install llvm-14-dev and "
                      "rebuild stepfuse, or emit for a CUDA target (EmitTarget::cubin / ptx)");
    if (!r.target.triple.empty() && (r.target.cpu_name.empty() || r.target.cpu_name == "native"))
      bad(fn, "target.triple = '" + r.target.triple +
                  "' without a target.cpu_name: name a CPU of that triple (e.g. EmitTarget::cpu(\"x86-64-v3\", triple)); "
                  "an empty or \"native\" CPU means this machine, with its own triple");
  } else if (r.target.kind != EmitTarget::Kind::cuda_cubin && r.target.kind != EmitTarget::Kind::cuda_ptx) {
    bad(fn, "target.kind = " + std::to_string(static_cast<int>(r.target.kind)) + " is not an EmitTarget::Kind");
  } else if (r.target.sm < 10 || r.target.sm > 999 || r.target.sm % 10 > 9) {
    bad(fn, "target.sm = " + std::to_string(r.target.sm) + " is not a compute capability (major*10 + minor, e.g. 90)");
  }
  if (r.tensors.empty()) bad(fn, "tensors is empty (describe at least one tensor)");
  if (r.norm_type != 2.0 && r.norm_type != INFINITY)
    bad(fn, "norm_type = " + detail::format_number(r.norm_type) + " (use 2.0 or INFINITY)");
  std::vector<jit::TensorShape> shapes;
  for (std::size_t i = 0; i < r.tensors.size(); ++i) {
    const EmitTensor& t = r.tensors[i];
    const std::string at = "tensors[" + std::to_string(i) + "]";
    if (!valid_dtype(t.weight)) bad(fn, at + ".weight = " + std::to_string(static_cast<int>(t.weight)) + " is not a DType");
    if (!valid_dtype(t.grad)) bad(fn, at + ".grad = " + std::to_string(static_cast<int>(t.grad)) + " is not a DType");
    if (t.master && t.weight == DType::f32)
      bad(fn, at + ".master is set with f32 weights (fp32 masters are kept for f16/bf16 weights only)");
    shapes.push_back({0, {t.weight, t.grad, t.master}});  // sizes come later (plan_kernel_tables)
  }
  jit::Layout c = jit::plan_layout(shapes, r.flat);
  if (r.flat && c.combos.size() != 1)
    bad(fn, "flat = true needs every tensor to have the same weight/grad dtypes and master setting (it has " +
                std::to_string(c.combos.size()) + " combinations): one flat range has one storage");
  return c;
}

jit::CudaTarget cuda_target(const EmitTarget& t) {
  return {t.sm, t.kind == EmitTarget::Kind::cuda_cubin ? jit::CudaOutput::cubin : jit::CudaOutput::ptx};
}

// ---- CPU targets --------------------------------------------------------------------

jit::CpuTarget cpu_target(const EmitTarget& t) {
  if (t.cpu_name.empty() || t.cpu_name == "native") {
    const jit::CpuTarget host = jit::CpuTarget::host();
    if (t.features.empty()) return host;
    // Later flags win in an LLVM feature string: the caller's override the host's.
    return jit::CpuTarget::named(host.triple, host.cpu, host.features + "," + t.features);
  }
  return jit::CpuTarget::named(t.triple, t.cpu_name, t.features);
}

EmittedKernel emit_cpu(const EmitRequest& request, const jit::Layout& c) {
  const jit::CpuTarget target = cpu_target(request.target);
  const jit::CpuSpec spec = jit::cpu_spec(request, c);
  std::vector<std::string> names;
  for (const jit::DtypeCombo& k : spec.combos) names.push_back(jit::cpu_update_symbol(k));
  for (const DType g : spec.reduce_grads) names.push_back(jit::cpu_reduce_symbol(g, spec.inf_norm));
  if (jit::is_two_phase(spec.program))  // a two-phase program's phase 1 (jit/llvm/emit_llvm.hpp)
    for (const jit::DtypeCombo& k : spec.combos) names.push_back(jit::cpu_phase1_symbol(k));
  EmittedKernel k;
  k.source = jit::cpu_module_ir(spec, target, /*optimized=*/false);
  if (request.compile) k.binary = jit::cpu_compile_object(spec, target);
  k.arch = target.cpu;
  k.abi = jit::describe_cpu_abi(request, c, spec, target, names);
  k.abi_header = jit::cpu_abi_header(request, target, spec, names);
  k.kernel_names = std::move(names);
  return k;
}

}  // namespace

EmittedKernel emit(const EmitRequest& request) {
  const jit::Layout c = check_request("emit", request);
  if (request.target.kind == EmitTarget::Kind::cpu) return emit_cpu(request, c);
  if (jit::is_two_phase(request.program.program()))
    throw Error(ErrorCode::unsupported,
                "emit: update program '" + std::string(request.program.name()) +
                    "' has two phases (per-tensor norms); the CUDA kernel ABI does not describe its sf_phase1 and "
                    "sf_phase_combine kernels yet: emit it for a CPU target (EmitTarget::cpu()), or run it through "
                    "an Optimizer on the GPU");
  jit::CudaSpec spec;
  spec.program = request.program.program();
  spec.combos = c.combos;
  spec.norm = request.norm_type == INFINITY ? jit::CudaNorm::inf : jit::CudaNorm::l2;
  spec.flat = request.flat;
  spec.aligned16 = request.aligned16;
  const jit::CudaTarget target = cuda_target(request.target);

  EmittedKernel k;
  k.source = jit::emit_cuda(spec);
  k.arch = jit::arch_name(target);
  k.kernel_names = {"sf_reduce", "sf_update"};
  std::string nvrtc_version;
  if (request.compile) {
    k.binary = jit::nvrtc_compile(k.source, std::string(request.program.name()) + "_step.cu", target);
    nvrtc_version = jit::nvrtc_version_string();
  }
  k.abi = jit::describe_cuda_abi(spec, request.program, c.tensor_combo, target, nvrtc_version);
  k.abi_header = jit::cuda_abi_header();
  return k;
}

KernelTables plan_kernel_tables(const EmitRequest& request, std::span<const std::int64_t> numels) {
  constexpr const char* fn = "plan_kernel_tables";
  EmitRequest any_target = request;  // the tables do not depend on the target
  any_target.target = EmitTarget::cubin(90);
  const jit::Layout c = check_request(fn, any_target);
  if (numels.size() != request.tensors.size())
    bad(fn, "numels has " + std::to_string(numels.size()) + " entries but the request describes " +
                std::to_string(request.tensors.size()) + " tensors");
  std::vector<jit::TensorShape> shapes;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) bad(fn, "numels[" + std::to_string(i) + "] = " + std::to_string(numels[i]) + " is negative");
    const EmitTensor& t = request.tensors[i];
    shapes.push_back({numels[i], {t.weight, t.grad, t.master}});
  }
  const jit::CudaLayout l =
      jit::plan_cuda_layout(request.program.program(), shapes,
                            request.norm_type == INFINITY ? jit::CudaNorm::inf : jit::CudaNorm::l2, request.flat,
                            request.aligned16);
  KernelTables t;
  t.tensors = l.tensors;
  t.master_offsets = l.layout.master_offsets;
  t.chunks = l.chunks;
  t.blocks = l.blocks;
  t.state_elems = l.layout.state_elems;
  t.master_elems = l.layout.master_elems;
  t.flat_numel = l.flat_numel();
  t.reduce_grid = static_cast<unsigned>(l.reduce_grid());
  t.reduce_block = 32 * SF_REDUCE_WARPS;
  t.update_grid = static_cast<unsigned>(l.num_update_blocks);
  t.update_block = SF_UPDATE_THREADS;
  t.partials_bytes = std::max<std::size_t>(l.chunks.size(), 1) * sizeof(sf_partial);
  t.tensor_sums_bytes = numels.size() * sizeof(double);
  t.step_state_bytes = sizeof(sf_step_state);
  return t;
}

}  // namespace stepfuse
