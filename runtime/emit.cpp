// The emit API (stepfuse/emit.hpp): a spec's kernels, their ABI and their tables
// for a compiler that launches them itself.
#include "stepfuse/emit.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "jit/cuda/emit_cuda.hpp"
#include "jit/cuda/kernel_abi.hpp"
#include "jit/cuda/nvrtc_compile.hpp"
#include "runtime/cuda/cuda_layout.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

namespace {

[[noreturn]] void bad(const char* fn, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, std::string(fn) + ": " + message);
}

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= static_cast<unsigned>(DType::bf16); }

// The spec's combinations (first-use order, as the runtime plans them) and each tensor's.
struct Combos {
  std::vector<jit::CudaCombo> combos;
  std::vector<int> of_tensor;
};

Combos check_request(const char* fn, const EmitRequest& r) {
  if (r.target.kind == EmitTarget::Kind::cpu)
    throw Error(ErrorCode::unsupported, std::string(fn) +
                                            ": target cpu: emitting LLVM IR or an object file for a CPU target needs the "
                                            "LLVM backend (not built); emit for a CUDA target (EmitTarget::cubin / ptx)");
  if (r.target.kind != EmitTarget::Kind::cuda_cubin && r.target.kind != EmitTarget::Kind::cuda_ptx)
    bad(fn, "target.kind = " + std::to_string(static_cast<int>(r.target.kind)) + " is not an EmitTarget::Kind");
  if (r.target.sm < 10 || r.target.sm > 999 || r.target.sm % 10 > 9)
    bad(fn, "target.sm = " + std::to_string(r.target.sm) + " is not a compute capability (major*10 + minor, e.g. 90)");
  if (r.tensors.empty()) bad(fn, "tensors is empty (describe at least one tensor)");
  if (r.norm_type != 2.0 && r.norm_type != INFINITY)
    bad(fn, "norm_type = " + std::to_string(r.norm_type) + " (use 2.0 or INFINITY)");
  Combos c;
  for (std::size_t i = 0; i < r.tensors.size(); ++i) {
    const EmitTensor& t = r.tensors[i];
    const std::string at = "tensors[" + std::to_string(i) + "]";
    if (!valid_dtype(t.weight)) bad(fn, at + ".weight = " + std::to_string(static_cast<int>(t.weight)) + " is not a DType");
    if (!valid_dtype(t.grad)) bad(fn, at + ".grad = " + std::to_string(static_cast<int>(t.grad)) + " is not a DType");
    if (t.master && t.weight == DType::f32)
      bad(fn, at + ".master is set with f32 weights (fp32 masters are kept for f16/bf16 weights only)");
    const jit::CudaCombo combo{t.weight, t.grad, t.master};
    auto it = std::find(c.combos.begin(), c.combos.end(), combo);
    if (it == c.combos.end()) it = c.combos.insert(c.combos.end(), combo);
    c.of_tensor.push_back(static_cast<int>(it - c.combos.begin()));
  }
  if (r.flat && c.combos.size() != 1)
    bad(fn, "flat = true needs every tensor to have the same weight/grad dtypes and master setting (it has " +
                std::to_string(c.combos.size()) + " combinations): one flat range has one storage");
  return c;
}

jit::CudaTarget cuda_target(const EmitTarget& t) {
  return {t.sm, t.kind == EmitTarget::Kind::cuda_cubin ? jit::CudaOutput::cubin : jit::CudaOutput::ptx};
}

}  // namespace

EmittedKernel emit(const EmitRequest& request) {
  const Combos c = check_request("emit", request);
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
  k.abi = jit::describe_cuda_abi(spec, request.program, c.of_tensor, target, nvrtc_version);
  k.abi_header = jit::cuda_abi_header();
  return k;
}

KernelTables plan_kernel_tables(const EmitRequest& request, std::span<const std::int64_t> numels) {
  constexpr const char* fn = "plan_kernel_tables";
  EmitRequest any_target = request;  // the tables do not depend on the target
  any_target.target = EmitTarget::cubin(90);
  const Combos c = check_request(fn, any_target);
  if (numels.size() != request.tensors.size())
    bad(fn, "numels has " + std::to_string(numels.size()) + " entries but the request describes " +
                std::to_string(request.tensors.size()) + " tensors");
  std::vector<detail::CudaTensorShape> shapes;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) bad(fn, "numels[" + std::to_string(i) + "] = " + std::to_string(numels[i]) + " is negative");
    const EmitTensor& t = request.tensors[i];
    shapes.push_back({numels[i], {t.weight, t.grad, t.master}});
  }
  const detail::CudaLayout l =
      detail::plan_cuda_layout(request.program.program(), shapes,
                               request.norm_type == INFINITY ? jit::CudaNorm::inf : jit::CudaNorm::l2, request.flat,
                               request.aligned16);
  KernelTables t;
  t.tensors = l.tensors;
  t.master_offsets = l.master_offsets;
  t.chunks = l.chunks;
  t.blocks = l.blocks;
  t.state_elems = l.state_elems;
  t.master_elems = l.master_elems;
  t.flat_numel = l.flat_numel;
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
