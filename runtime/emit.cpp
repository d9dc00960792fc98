// The emit API (stepfuse/emit.hpp): a spec's kernels, their ABI and their tables
// for a compiler that launches them itself. CUDA targets: jit/cuda (source, NVRTC,
// kernel_abi.cpp's description). CPU targets: jit/llvm (IR, object) and the CPU
// ABI description and header, written here.
#include "stepfuse/emit.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>

#include "jit/abi_json.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/cuda/embedded_files.hpp"
#include "jit/cuda/kernel_abi.hpp"
#include "jit/cuda/nvrtc_compile.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "jit/update_program_rules.hpp"
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
    bad(fn, "norm_type = " + std::to_string(r.norm_type) + " (use 2.0 or INFINITY)");
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

// The byte layout the generated functions read (jit/llvm/emit_llvm.cpp's kArgs*
// offsets) and the header below declares: must match cpu::UpdateArgs.
static_assert(sizeof(void*) == 8, "the CPU emit ABI is for 64-bit targets");
static_assert(offsetof(cpu::UpdateArgs, grad) == 0 && offsetof(cpu::UpdateArgs, weight) == 8 &&
              offsetof(cpu::UpdateArgs, master) == 16 && offsetof(cpu::UpdateArgs, state) == 24 &&
              offsetof(cpu::UpdateArgs, scalars) == 24 + 8 * kMaxStreams && sizeof(cpu::UpdateArgs) == 32 + 8 * kMaxStreams,
              "cpu::UpdateArgs changed: update the CPU emit ABI (header, JSON) and jit/llvm/emit_llvm.cpp");
static_assert(cpu::kChunkElems == SF_CHUNK_ELEMS, "the CPU and CUDA reduce chunks are the same numerics");

jit::CpuTarget cpu_target(const EmitTarget& t) {
  if (t.cpu_name.empty() || t.cpu_name == "native") {
    const jit::CpuTarget host = jit::CpuTarget::host();
    if (t.features.empty()) return host;
    // Later flags win in an LLVM feature string: the caller's override the host's.
    return jit::CpuTarget::named(host.triple, host.cpu, host.features + "," + t.features);
  }
  return jit::CpuTarget::named(t.triple, t.cpu_name, t.features);
}

// The CPU spec of a request: update functions per combination, reduce functions
// per grad dtype, both in the layout's first-use order (as StepEngine::setup_llvm).
jit::CpuSpec cpu_spec(const EmitRequest& r, const jit::Layout& c) {
  jit::CpuSpec spec;
  spec.program = r.program.program();
  spec.combos = c.combos;
  spec.reduce_grads = c.reduce_grads;
  spec.inf_norm = r.norm_type == INFINITY;
  spec.contract = false;  // bitwise the stepfuse CPU backends' results
  return spec;
}

std::string update_declaration(const std::string& name) {
  return "void " + name + "(const sf_cpu_update_args* args, uint64_t begin, uint64_t n);";
}
std::string reduce_declaration(const std::string& name, bool inf_norm) {
  return inf_norm ? "float " + name + "(const void* grad, uint64_t n, uint32_t* nonfinite);"
                  : "float " + name + "(const void* grad, uint64_t n);";
}

// The ABI description of a CPU target ("stepfuse.kernel_abi", the CUDA ABI's format
// family: program, scalar rules, spec, target, constants, types and kernels alike;
// the writer and the shared sections are jit/abi_json.hpp's).
std::string describe_cpu_abi(const EmitRequest& r, const jit::Layout& c, const jit::CpuSpec& spec, const jit::CpuTarget& target,
                             const std::vector<std::string>& names) {
  const bool inf = spec.inf_norm;
  jit::JsonWriter j;
  jit::begin_kernel_abi(j);
  jit::write_abi_program(j, r.program);

  // ---- the spec ----
  j.begin_object("spec").begin_array("combos");
  for (std::size_t k = 0; k < c.combos.size(); ++k)
    j.begin_object().integer("index", static_cast<long long>(k)).str("weight", dtype_name(c.combos[k].weight))
        .str("grad", dtype_name(c.combos[k].grad)).boolean("master", c.combos[k].master)
        .str("update", names[k]).end_object();
  j.end_array().begin_array("reduce_grads");
  for (std::size_t k = 0; k < spec.reduce_grads.size(); ++k)
    j.begin_object().integer("index", static_cast<long long>(k)).str("grad", dtype_name(spec.reduce_grads[k]))
        .str("reduce", names[c.combos.size() + k]).end_object();
  j.end_array().begin_array("tensor_combos");
  for (const int k : c.tensor_combo) j.integer({}, k);
  j.end_array().begin_array("tensors");
  for (std::size_t i = 0; i < r.tensors.size(); ++i)
    j.begin_object().integer("index", static_cast<long long>(i))
        .str("update", names[static_cast<std::size_t>(c.tensor_combo[i])])
        .str("reduce", names[c.combos.size() + static_cast<std::size_t>(c.tensor_reduce[i])]).end_object();
  j.end_array().boolean("flat", r.flat).boolean("aligned16", r.aligned16);
  j.str("layout", "flat and aligned16 are CUDA layout options: the CPU functions take any element range of one tensor "
                  "and any alignment (unaligned vector accesses), so a CPU target ignores them");
  j.str("norm", inf ? "inf" : "l2").boolean("contract", spec.contract);
  j.str("canonical_text", jit::cpu_canonical_text(spec)).end_object();

  j.begin_object("target").str("kind", "cpu").str("triple", target.triple).str("cpu", target.cpu);
  j.str("features", target.features);
  j.integer("vector_width", target.vector_width).str("llvm_version", jit::llvm_version());
  j.str("source", "LLVM IR text as emitted, before optimization (the binary is the same module after the O3 pipeline)");
  j.str("binary", "ELF relocatable object (position-independent code); defines the kernels' symbols; may reference "
                  "libm's fmaf on CPUs without FMA (link with -lm)");
  j.end_object();

  j.begin_object("constants")
      .integer("SF_CPU_CHUNK_ELEMS", static_cast<long long>(cpu::kChunkElems))
      .integer("SF_CPU_REDUCE_LANES", 32)
      .integer("SF_CPU_MAX_SCALARS", kMaxScalars)
      .integer("SF_CPU_MAX_STREAMS", kMaxStreams)
      .end_object();

  // ---- types ----
  j.begin_object("types");
  jit::write_type(
      j, "sf_cpu_update_args", sizeof(cpu::UpdateArgs), alignof(cpu::UpdateArgs),
      "the update functions' argument: one tensor's streams and the step's scalars; pointers are base addresses of the "
      "tensor (element 0)",
      {{"grad", "const void*", offsetof(cpu::UpdateArgs, grad), "the gradients (the combo's grad dtype), read"},
       {"weight", "void*", offsetof(cpu::UpdateArgs, weight),
        "the weights (the combo's weight dtype): read unless the combo has a master, written"},
       {"master", "float*", offsetof(cpu::UpdateArgs, master),
        "fp32 master weights (combos with master): read and written; else unused (null)"},
       {"state", "float*[SF_CPU_MAX_STREAMS]", offsetof(cpu::UpdateArgs, state),
        "state[k]: the tensor's buffer of state stream k (program stream index; numel floats), read and written; null "
        "for grad, param and unused slots"},
       {"scalars", "const float*", offsetof(cpu::UpdateArgs, scalars),
        "the program's per-step scalars (program.scalars order), from the scalar stage; read"}});
  jit::write_type(j, "sf_scalar_rule", sizeof(sf_scalar_rule), alignof(sf_scalar_rule),
                  "how one per-step scalar is computed: sf_eval_rule(rule, step, gscale), rounded to fp32 (the "
                  "caller's scalar stage)",
                  {{"kind", "int", offsetof(sf_scalar_rule, kind), "enum sf_rule_kind"},
                   {"pad_", "int", offsetof(sf_scalar_rule, pad_), "0"},
                   {"a", "double", offsetof(sf_scalar_rule, a), "first parameter"},
                   {"b", "double", offsetof(sf_scalar_rule, b), "second parameter"}});
  j.end_object();

  // ---- the functions ----
  j.begin_array("kernels");
  for (std::size_t k = 0; k < c.combos.size(); ++k) {
    j.begin_object().str("name", names[k]).str("role", "update").integer("combo", static_cast<long long>(k));
    j.str("c_declaration", update_declaration(names[k])).str("returns", "void");
    j.str("description", "applies the update program to elements [begin, begin + n) of one tensor: reads grad, weight "
                         "(or master) and state, writes weight, master and state. Any range, any split: every element "
                         "gets the same IEEE operations (vector or scalar tail alike)");
    const jit::AbiParam params[] = {
        {"args", "const sf_cpu_update_args*", "the tensor's base pointers and the step's scalars"},
        {"begin", "uint64_t", "first element (within the tensor)"},
        {"n", "uint64_t", "elements (0 allowed)"}};
    jit::write_params(j, params);
    j.end_object();
  }
  for (std::size_t k = 0; k < spec.reduce_grads.size(); ++k) {
    const std::string& name = names[c.combos.size() + k];
    j.begin_object().str("name", name).str("role", inf ? "reduce_inf" : "reduce_l2");
    j.str("grad", dtype_name(spec.reduce_grads[k]));
    j.str("c_declaration", reduce_declaration(name, inf)).str("returns", "float");
    if (inf)
      j.str("description", "max |g| of one chunk's n gradients as stored (still loss-scaled); *nonfinite = 1 when one "
                           "is inf or NaN, else 0");
    else
      j.str("description", "the fp32 sum of squares of one chunk's n gradients as stored (still loss-scaled), in the "
                           "canonical order: element i into lane i mod 32, 32 at a time (the last step zero-padded), "
                           "then lanes[j] += lanes[j + w] for w = 16, 8, 4, 2, 1. Not finite: an element is inf or NaN, "
                           "or the squares overflowed fp32; the caller rescans the chunk (see reduce)");
    const jit::AbiParam params[] = {
        {"grad", "const void*", "the chunk's first gradient (the grad dtype)"},
        {"n", "uint64_t", "elements: SF_CPU_CHUNK_ELEMS, or fewer for a tensor's last chunk"},
        {"nonfinite", "uint32_t*", "out: 1 when an element is inf or NaN, else 0"}};
    jit::write_params(j, std::span(params).first(inf ? 3 : 2));  // nonfinite: the inf-norm reduce only
    j.end_object();
  }
  j.end_array();

  // ---- memory, the step, threading ----
  jit::write_memory(
      j, "memory",
      {{"weights, grads", "the combo's dtypes", "numel per tensor (the caller's)", "the caller's"},
       {"state", "float", "per tensor, numel floats per state stream (program.streams with role state); any alignment",
        "every element to the stream's init, before the first step"},
       {"masters", "float", "per tensor whose combo has a master: numel floats",
        "the weights widened to fp32, before the first step"},
       {"scalars", "float", "program.scalars (at most SF_CPU_MAX_SCALARS)",
        "written by the scalar stage before every step's updates"}});
  j.begin_object("reduce")
      .str("chunks", "each tensor in chunks of SF_CPU_CHUNK_ELEMS elements from its start (the last shorter): chunk c is "
                     "grad + c * SF_CPU_CHUNK_ELEMS elements, n = min(SF_CPU_CHUNK_ELEMS, numel - c * "
                     "SF_CPU_CHUNK_ELEMS). Part of the numerics: other splits give other roundings")
      .str("combine", inf ? "per tensor, in chunk order: acc = max(acc, (double)partial) from 0; then over tensors in "
                            "order: total = max(total, acc); norm = total / loss_scale"
                          : "per tensor, in chunk order: acc += (double)partial in fp64 from 0 (the tensor's sum of "
                            "squares); then over tensors in order: total += acc; norm = sqrt(total) / loss_scale")
      .str("nonfinite", inf ? "found_inf when any chunk's *nonfinite is 1"
                            : "a partial that is not finite means an inf/NaN gradient or fp32 overflow of the squares "
                              "(|g| above about 1.8e19): rescan the chunk; an inf or NaN element is found_inf; else the "
                              "canonical partial is the same lanes and tree over g * 2^-e (e = ilogb(max |g|) + 1) "
                              "times 2^(2e) in fp64 (any fp64 sum of squares is within rounding of it)")
      .str("bitwise", "with these chunks and this combine order the norm is bitwise stepfuse's own CPU backends'")
      .end_object();
  j.begin_array("step")
      .str({}, "setup (once): allocate and initialize the memory; steps applied so far = 0")
      .str({}, "reduce, on a step that divides by a loss scale S, clips or reports the norm: every chunk of every tensor, "
               "then the combine (reduce.combine); found_inf with loss scaling or clipping skips the step (no update "
               "calls; the step count is unchanged)")
      .str({}, "scalar stage: stage = sf_step_stage(found_inf, check_finite, norm, S, max_grad_norm or 0, steps "
               "applied so far), with check_finite = 1 when the step is loss-scaled or clips (a plain step passes "
               "found_inf = 0, norm = NaN, S = 1); when stage.applied, sf_eval_scalars(rules, num_scalars, stage.step, "
               "stage.gscale, scalars) with rules[k] = {kind, 0, a, b} of program.scalars[k]")
      .str({}, "update: for every tensor, args = {grad, weight, master, state bases, scalars}; call its update "
               "function over [0, numel) in any split (the reduce's chunks are a natural one)")
      .str({}, "steps applied so far = stage.step; new hyperparameters are new rules at the next scalar stage (never "
               "recompile)")
      .end_array();
  j.str("threading", "The functions are reentrant and thread-safe: no global state, no allocation, no locks, no "
                     "syscalls. Chunks are independent: reduce calls may run on any threads in any order, and so may "
                     "update calls on disjoint ranges; the combine then runs in the fixed order above. Every reduce "
                     "call of a step finishes before its scalar stage, and every update call starts after it");
  j.str("scalar_stage", "the caller's: see step; sf_step_stage, sf_eval_scalars and sf_grad_scaler_update are in the "
                        "header");
  j.str("abi_header", "EmittedKernel::abi_header: SF_CPU_* constants, sf_cpu_update_args, the scalar rules "
                      "(sf_scalar_rule, sf_eval_rule, sf_eval_scalars), the step stage (sf_step_stage, "
                      "sf_grad_scaler_update) and the functions' declarations (C, C++; <stdint.h>, <stddef.h>)");
  j.end_object();
  return j.finish();
}

std::string cpu_abi_header(const EmitRequest& r, const jit::CpuTarget& target, const jit::CpuSpec& spec,
                           const std::vector<std::string>& names) {
  std::string h =
      "/* The C ABI of a fused optimizer step emitted for a CPU by stepfuse " + std::string(version()) +
      " (stepfuse/emit.hpp):\n * update program '" + std::string(r.program.name()) + "', target " + target.describe() +
      ".\n * The functions are defined by the object file emitted with this header; the ABI\n"
      " * description (JSON) says how to call them. C and C++. Generated: do not edit. */\n"
      "#ifndef STEPFUSE_CPU_ABI_H_\n#define STEPFUSE_CPU_ABI_H_\n\n#include <stddef.h>\n#include <stdint.h>\n\n"
      "#ifdef __cplusplus\nextern \"C\" {\n#endif\n\n";
  h += std::string(jit::embedded_file("jit/step_scalars.h"));
  h += std::string(jit::embedded_file("jit/step_stage.h"));
  h += "\n/* Elements per reduce chunk: part of the numerics (the canonical order). */\n"
       "#define SF_CPU_CHUNK_ELEMS " + std::to_string(cpu::kChunkElems) +
       "\n#define SF_CPU_REDUCE_LANES 32\n#define SF_CPU_MAX_STREAMS " + std::to_string(kMaxStreams) +
       "\n#define SF_CPU_MAX_SCALARS " + std::to_string(kMaxScalars) +
       "\n\n/* One tensor's base pointers (element 0) and the step's scalars. */\n"
       "typedef struct sf_cpu_update_args {\n"
       "  const void* grad;                    /* grad dtype */\n"
       "  void* weight;                        /* weight dtype */\n"
       "  float* master;                       /* fp32 master copy, or NULL when the combo has none */\n"
       "  float* state[SF_CPU_MAX_STREAMS];    /* by program stream index: state streams' buffers, else NULL */\n"
       "  const float* scalars;                /* the program's per-step scalars */\n"
       "} sf_cpu_update_args;\n"
       "/* The functions read the fields at these offsets: a 64-bit target only. */\n"
       "typedef char sf_cpu_update_args_layout_check_[(sizeof(sf_cpu_update_args) == " +
       std::to_string(sizeof(cpu::UpdateArgs)) + " && offsetof(sf_cpu_update_args, scalars) == " +
       std::to_string(offsetof(cpu::UpdateArgs, scalars)) + ") ? 1 : -1];\n\n"
       "#ifdef __cplusplus\n} /* extern \"C\" */\n#endif\n#endif /* STEPFUSE_CPU_ABI_H_ */\n\n"
       "/* The functions of this spec. */\n#ifdef __cplusplus\nextern \"C\" {\n#endif\n";
  for (std::size_t k = 0; k < names.size(); ++k)
    h += k < spec.combos.size() ? update_declaration(names[k]) + "\n"
                                     : reduce_declaration(names[k], spec.inf_norm) + "\n";
  h += "#ifdef __cplusplus\n} /* extern \"C\" */\n#endif\n";
  return h;
}

EmittedKernel emit_cpu(const EmitRequest& request, const jit::Layout& c) {
  const jit::CpuTarget target = cpu_target(request.target);
  const jit::CpuSpec spec = cpu_spec(request, c);
  std::vector<std::string> names;
  for (const jit::DtypeCombo& k : spec.combos) names.push_back(jit::cpu_update_symbol(k));
  for (const DType g : spec.reduce_grads) names.push_back(jit::cpu_reduce_symbol(g, spec.inf_norm));
  EmittedKernel k;
  k.source = jit::cpu_module_ir(spec, target, /*optimized=*/false);
  if (request.compile) k.binary = jit::cpu_compile_object(spec, target);
  k.arch = target.cpu;
  k.abi = describe_cpu_abi(request, c, spec, target, names);
  k.abi_header = cpu_abi_header(request, target, spec, names);
  k.kernel_names = std::move(names);
  return k;
}

}  // namespace

EmittedKernel emit(const EmitRequest& request) {
  const jit::Layout c = check_request("emit", request);
  if (request.target.kind == EmitTarget::Kind::cpu) return emit_cpu(request, c);
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
