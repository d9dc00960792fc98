// The emit API's description of a CPU target (jit/llvm/kernel_abi.hpp): the JSON
// kernel ABI and the C header, written from the spec and jit/llvm/cpu_abi.h.
#include "jit/llvm/kernel_abi.hpp"

#include <cmath>
#include <cstddef>
#include <string>

#include "jit/abi_json.hpp"
#include "jit/embedded_files.hpp"
#include "jit/llvm/cpu_abi.h"
#include "jit/program_analysis.hpp"
#include "jit/step_scalars.h"
#include "jit/update_program_rules.hpp"
#include "stepfuse/version.hpp"

namespace stepfuse::jit {

static_assert(sizeof(void*) == 8, "the CPU emit ABI is for 64-bit targets");
static_assert(SF_CPU_CHUNK_ELEMS == kChunkElems, "the CPU ABI's chunk is the canonical chunk (jit/layout.hpp)");
static_assert(SF_CPU_MAX_STREAMS == kMaxStreams && SF_CPU_MAX_SCALARS == kMaxScalars &&
                  SF_CPU_MAX_NORM_SLOTS == kMaxNormSlots,
              "the CPU ABI's limits are the update program's (stepfuse/program.hpp)");

namespace {

std::string update_declaration(const std::string& name) {
  return "void " + name + "(const sf_cpu_update_args* args, uint64_t begin, uint64_t n);";
}
std::string phase1_declaration(const std::string& name) {
  return "void " + name + "(const sf_cpu_update_args* args, uint64_t begin, uint64_t n, float* sums);";
}
std::string reduce_declaration(const std::string& name, bool inf_norm) {
  return inf_norm ? "float " + name + "(const void* grad, uint64_t n, uint32_t* nonfinite);"
                  : "float " + name + "(const void* grad, uint64_t n);";
}

}  // namespace

// The CPU spec of a request: update functions per combination, reduce functions
// per grad dtype, both in the layout's first-use order (as the fused CPU backend's).
CpuSpec cpu_spec(const EmitRequest& r, const Layout& c) {
  CpuSpec spec;
  spec.program = r.program.program();
  spec.combos = c.combos;
  spec.reduce_grads = c.reduce_grads;
  spec.inf_norm = r.norm_type == INFINITY;
  spec.contract = false;  // bitwise the stepfuse CPU backends' results
  return spec;
}

// The ABI description of a CPU target ("stepfuse.kernel_abi", the CUDA ABI's format
// family: program, scalar rules, spec, target, constants, types and kernels alike;
// the writer and the shared sections are jit/abi_json.hpp's).
std::string describe_cpu_abi(const EmitRequest& r, const Layout& c, const CpuSpec& spec, const CpuTarget& target,
                             const std::vector<std::string>& names) {
  const bool inf = spec.inf_norm;
  const bool two_phase = is_two_phase(spec.program);
  JsonWriter j;
  begin_kernel_abi(j);
  write_abi_program(j, r.program);

  // ---- the spec ----
  j.begin_object("spec").begin_array("combos");
  for (std::size_t k = 0; k < c.combos.size(); ++k)
    j.begin_object().integer("index", static_cast<long long>(k)).str("weight", dtype_name(c.combos[k].weight))
        .str("grad", dtype_name(c.combos[k].grad)).boolean("master", c.combos[k].master)
        .boolean("stochastic", c.combos[k].stochastic)
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
  j.str("canonical_text", cpu_canonical_text(spec)).end_object();

  j.begin_object("target").str("kind", "cpu").str("triple", target.triple).str("cpu", target.cpu);
  j.str("features", target.features);
  j.integer("vector_width", target.vector_width).str("llvm_version", llvm_version());
  j.str("source", "LLVM IR text as emitted, before optimization (the binary is the same module after the O3 pipeline)");
  j.str("binary", "ELF relocatable object (position-independent code); defines the kernels' symbols; may reference "
                  "libm's fmaf on CPUs without FMA (link with -lm)");
  j.end_object();

  j.begin_object("constants")
      .integer("SF_CPU_CHUNK_ELEMS", static_cast<long long>(SF_CPU_CHUNK_ELEMS))
      .integer("SF_CPU_REDUCE_LANES", 32)
      .integer("SF_CPU_MAX_SCALARS", kMaxScalars)
      .integer("SF_CPU_MAX_STREAMS", SF_CPU_MAX_STREAMS)
      .integer("SF_CPU_MAX_NORM_SLOTS", SF_CPU_MAX_NORM_SLOTS)
      .end_object();

  // ---- types ----
  j.begin_object("types");
  write_type(
      j, "sf_cpu_update_args", sizeof(sf_cpu_update_args), alignof(sf_cpu_update_args),
      "the update functions' argument: one tensor's streams and the step's scalars; pointers are base addresses of the "
      "tensor (element 0)",
      {{"grad", "const void*", offsetof(sf_cpu_update_args, grad), "the gradients (the combo's grad dtype), read"},
       {"weight", "void*", offsetof(sf_cpu_update_args, weight),
        "the weights (the combo's weight dtype): read unless the combo has a master, written"},
       {"master", "float*", offsetof(sf_cpu_update_args, master),
        "fp32 master weights (combos with master): read and written; else unused (null)"},
       {"state", "float*[SF_CPU_MAX_STREAMS]", offsetof(sf_cpu_update_args, state),
        "state[k]: the tensor's buffer of state stream k (program stream index; numel floats), read and written; null "
        "for grad, param and unused slots"},
       {"scalars", "const float*", offsetof(sf_cpu_update_args, scalars),
        "the program's per-step scalars (program.scalars order), from the scalar stage; read"},
       {"norms", "const float*", offsetof(sf_cpu_update_args, norms),
        "a two-phase program's update (phase 2): the tensor's norm of each reduction slot (SF_CPU_MAX_NORM_SLOTS "
        "floats, see step); read. Unused by a one-phase program"},
       {"sr_seed", "uint64_t", offsetof(sf_cpu_update_args, sr_seed),
        "stochastic combos: the optimizer's seed, the Philox key of the rounding (for the caller drawing sr_bits); "
        "else unused"},
       {"sr_step", "uint64_t", offsetof(sf_cpu_update_args, sr_step),
        "stochastic combos: the step of the tensor's group being applied (1-based), the high half of the Philox "
        "counter (for the caller drawing sr_bits); else unused"},
       {"sr_base", "uint64_t", offsetof(sf_cpu_update_args, sr_base),
        "stochastic combos: the model index of the tensor's element 0 (element e of the concatenation of every "
        "tensor in order; for the caller drawing sr_bits); else unused"},
       {"sr_bits", "const uint16_t*", offsetof(sf_cpu_update_args, sr_bits),
        "stochastic combos, per call over [begin, begin + n): element i's 16 random bits at sr_bits[i - begin] "
        "(sf_sr_bits(sr_seed, sr_step, sr_base + i), jit/stochastic_round.h); read. Else unused"}});
  write_type(j, "sf_scalar_rule", sizeof(sf_scalar_rule), alignof(sf_scalar_rule),
                  "how one per-step scalar is computed: sf_eval_rule(rule, step, gscale), rounded to fp32 (the "
                  "caller's scalar stage)",
                  {{"kind", "int", offsetof(sf_scalar_rule, kind), "enum sf_rule_kind"},
                   {"pad_", "int", offsetof(sf_scalar_rule, pad_), "0"},
                   {"a", "double", offsetof(sf_scalar_rule, a), "first parameter"},
                   {"b", "double", offsetof(sf_scalar_rule, b), "second parameter"},
                   {"c", "double", offsetof(sf_scalar_rule, c), "third parameter"},
                   {"d", "double", offsetof(sf_scalar_rule, d),
                    "carried over from earlier steps: 0 for a fresh rule (NAdam's log offset of P_t, "
                    "sf_nadam_product_offset, after beta1 or momentum_decay changed)"}});
  j.end_object();

  // ---- the functions ----
  j.begin_array("kernels");
  for (std::size_t k = 0; k < c.combos.size(); ++k) {
    j.begin_object().str("name", names[k]).str("role", "update").integer("combo", static_cast<long long>(k));
    j.str("c_declaration", update_declaration(names[k])).str("returns", "void");
    j.str("description", "applies the update program to elements [begin, begin + n) of one tensor: reads grad, weight "
                         "(or master) and state, writes weight, master and state. Any range, any split: every element "
                         "gets the same IEEE operations (vector or scalar tail alike)");
    const AbiParam params[] = {
        {"args", "const sf_cpu_update_args*", "the tensor's base pointers and the step's scalars"},
        {"begin", "uint64_t", "first element (within the tensor)"},
        {"n", "uint64_t", "elements (0 allowed)"}};
    write_params(j, params);
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
    const AbiParam params[] = {
        {"grad", "const void*", "the chunk's first gradient (the grad dtype)"},
        {"n", "uint64_t", "elements: SF_CPU_CHUNK_ELEMS, or fewer for a tensor's last chunk"},
        {"nonfinite", "uint32_t*", "out: 1 when an element is inf or NaN, else 0"}};
    write_params(j, std::span(params).first(inf ? 3 : 2));  // nonfinite: the inf-norm reduce only
    j.end_object();
  }
  const std::size_t phase1_first = c.combos.size() + spec.reduce_grads.size();
  for (std::size_t k = 0; two_phase && k < c.combos.size(); ++k) {
    const std::string& name = names[phase1_first + k];
    j.begin_object().str("name", name).str("role", "phase1").integer("combo", static_cast<long long>(k));
    j.str("c_declaration", phase1_declaration(name)).str("returns", "void");
    j.str("description", "phase 1 of the two-phase program over one chunk of one tensor: the values and the state "
                         "stores of phase 1 per element, and sums[r] = the chunk's fp32 sum of squares of reduction "
                         "slot r in the canonical order (element i from begin into lane i mod 32, then lanes[j] += "
                         "lanes[j + w] for w = 16, 8, 4, 2, 1), 0 for slots the program does not reduce");
    const AbiParam params[] = {
        {"args", "const sf_cpu_update_args*", "the tensor's base pointers and the step's scalars (norms unused)"},
        {"begin", "uint64_t", "the chunk's first element within the tensor: a multiple of SF_CPU_CHUNK_ELEMS"},
        {"n", "uint64_t", "elements: SF_CPU_CHUNK_ELEMS, or fewer for a tensor's last chunk"},
        {"sums", "float*", "out: SF_CPU_MAX_NORM_SLOTS floats, the chunk's sum of squares per slot"}};
    write_params(j, params);
    j.end_object();
  }
  j.end_array();

  // ---- memory, the step, threading ----
  write_memory(
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
               "stage.gscale, scalars) with rules[k] = {kind, 0, a, b, c} of program.scalars[k]")
      .str({}, two_phase ? "update, a two-phase program: phase 1: for every chunk of every tensor (reduce.chunks), "
                           "its phase1 function into that chunk's sums; then per tensor and slot r, norm = "
                           "(float)sqrt(the chunk sums added in fp64 in chunk order from 0); then phase 2: for every "
                           "tensor, args as below with norms = its SF_CPU_MAX_NORM_SLOTS norms, its update function "
                           "over [0, numel) in any split"
                         : "update: for every tensor, args = {grad, weight, master, state bases, scalars, and for "
                           "stochastic combos sr_seed, sr_step = the group's step, sr_base, and per call sr_bits, the "
                           "call's elements' random bits}; call its update function over [0, numel) in any split (the "
                           "reduce's chunks are a natural one)")
      .str({}, "steps applied so far = stage.step; new hyperparameters are new rules at the next scalar stage (never "
               "recompile)")
      .end_array();
  j.str("threading", "The functions are reentrant and thread-safe: no global state, no allocation, no locks, no "
                     "syscalls. Chunks are independent: reduce calls may run on any threads in any order, and so may "
                     "update calls on disjoint ranges; the combine then runs in the fixed order above. Every reduce "
                     "call of a step finishes before its scalar stage, and every update call starts after it");
  j.str("scalar_stage", "the caller's: see step; sf_step_stage, sf_eval_scalars and sf_amp_update_scale are in the "
                        "header");
  j.str("abi_header", "EmittedKernel::abi_header: SF_CPU_* constants, sf_cpu_update_args, the scalar rules "
                      "(sf_scalar_rule, sf_eval_rule, sf_eval_scalars), the step stage (sf_step_stage, "
                      "sf_amp_update_scale) and the functions' declarations (C, C++; <stdint.h>, <stddef.h>)");
  j.end_object();
  return j.finish();
}

std::string cpu_abi_header(const EmitRequest& r, const CpuTarget& target, const CpuSpec& spec,
                           const std::vector<std::string>& names) {
  std::string h =
      "/* The C ABI of a fused optimizer step emitted for a CPU by stepfuse " + std::string(version()) +
      " (stepfuse/emit.hpp):\n * update program '" + std::string(r.program.name()) + "', target " + target.describe() +
      ".\n * The functions are defined by the object file emitted with this header; the ABI\n"
      " * description (JSON) says how to call them. C and C++. Generated: do not edit. */\n"
      "#ifndef STEPFUSE_CPU_ABI_H_\n#define STEPFUSE_CPU_ABI_H_\n\n#include <stddef.h>\n#include <stdint.h>\n\n"
      "#ifdef __cplusplus\nextern \"C\" {\n#endif\n\n";
  h += std::string(embedded_file("jit/step_scalars.h"));
  h += std::string(embedded_file("jit/step_stage.h"));
  h += std::string(embedded_file("jit/llvm/cpu_abi.h"));
  h += "/* The functions read the fields at these offsets: a 64-bit target only. */\n"
       "typedef char sf_cpu_update_args_layout_check_[(sizeof(sf_cpu_update_args) == " +
       std::to_string(sizeof(sf_cpu_update_args)) + " && offsetof(sf_cpu_update_args, scalars) == " +
       std::to_string(offsetof(sf_cpu_update_args, scalars)) + ") ? 1 : -1];\n\n" +
       "#ifdef __cplusplus\n} /* extern \"C\" */\n#endif\n#endif /* STEPFUSE_CPU_ABI_H_ */\n\n"
       "/* The functions of this spec. */\n#ifdef __cplusplus\nextern \"C\" {\n#endif\n";
  const std::size_t phase1_first = spec.combos.size() + spec.reduce_grads.size();
  for (std::size_t k = 0; k < names.size(); ++k)
    h += k < spec.combos.size() ? update_declaration(names[k]) + "\n"
         : k < phase1_first     ? reduce_declaration(names[k], spec.inf_norm) + "\n"
                                : phase1_declaration(names[k]) + "\n";
  h += "#ifdef __cplusplus\n} /* extern \"C\" */\n#endif\n";
  return h;
}


}  // namespace stepfuse::jit
