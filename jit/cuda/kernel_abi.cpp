// The kernel ABI description (JSON) of a spec's generated step kernels.
#include "jit/cuda/kernel_abi.hpp"

#include <cstddef>

#include "jit/abi_json.hpp"
#include "jit/embedded_files.hpp"
#include "jit/step_scalars.h"  // sf_scalar_rule, which device_abi.h uses

extern "C" {
#include "jit/cuda/device_abi.h"
}

namespace stepfuse::jit {

namespace {

#define SF_FIELD(T, f, type, what) AbiField{#f, type, offsetof(T, f), what}

void write_types(JsonWriter& j) {
  j.begin_object("types");
  write_type(j, "sf_tensor", sizeof(sf_tensor), alignof(sf_tensor),
             "one parameter tensor; an array of them (one per tensor, in order) is the tensor table",
             {SF_FIELD(sf_tensor, grad, "const void*", "device address of the gradients (stored as the combo's grad dtype)"),
              SF_FIELD(sf_tensor, weight, "void*", "device address of the weights (the combo's weight dtype)"),
              SF_FIELD(sf_tensor, master, "float*", "device address of the fp32 master copy, or null when the combo has none"),
              SF_FIELD(sf_tensor, state_offset, "long long", "element offset of this tensor in every state buffer"),
              SF_FIELD(sf_tensor, numel, "long long", "elements"),
              SF_FIELD(sf_tensor, first_chunk, "long long", "index of its first reduce chunk"),
              SF_FIELD(sf_tensor, num_chunks, "int", "its reduce chunks: ceil(numel / SF_CHUNK_ELEMS)"),
              SF_FIELD(sf_tensor, combo, "int", "index of its dtype combination (spec.combos)"),
              SF_FIELD(sf_tensor, group, "int", "its param group: index into sf_hyper.groups (0 without groups)"),
              SF_FIELD(sf_tensor, pad_, "int", "0"),
              SF_FIELD(sf_tensor, model_index, "long long",
                       "the model index of its element 0 (the params' elements counted in order): the counter of "
                       "stochastic rounding for combos with it"),
              SF_FIELD(sf_tensor, state, "const sf_tensor_state*",
                       "null: the spec stores every state stream as f32 (the emit API's specs do)")});
  write_type(j, "sf_span", sizeof(sf_span), alignof(sf_span), "a reduce chunk or an update block of one tensor",
             {SF_FIELD(sf_span, begin, "long long", "first element, within the tensor"),
              SF_FIELD(sf_span, tensor, "int", "index into the tensor table"),
              SF_FIELD(sf_span, len, "int", "elements (at most SF_CHUNK_ELEMS or SF_UPDATE_ELEMS)")});
  write_type(j, "sf_streams", sizeof(sf_streams), alignof(sf_streams),
             "the state buffers by program stream index, passed to sf_update by value",
             {SF_FIELD(sf_streams, s, "float*[SF_MAX_STREAMS]",
                       "s[k]: device address of state stream k's buffer (state_elems floats); null for grad, param and unused slots")});
  write_type(j, "sf_partial", sizeof(sf_partial), alignof(sf_partial), "a reduce chunk's partial result (scratch)",
             {SF_FIELD(sf_partial, sumsq, "double", "sum of squares of the stored gradients, canonical order"),
              SF_FIELD(sf_partial, maxabs, "float", "max |g| (inf-norm)"),
              SF_FIELD(sf_partial, nonfinite, "int", "an element was inf or NaN")});
  write_type(j, "sf_scalar_rule", sizeof(sf_scalar_rule), alignof(sf_scalar_rule),
             "how one per-step scalar is computed: sf_eval_rule(rule, step, gscale), rounded to fp32",
             {SF_FIELD(sf_scalar_rule, kind, "int", "enum sf_rule_kind (see scalar_rule_kinds)"),
              SF_FIELD(sf_scalar_rule, pad_, "int", "0"), SF_FIELD(sf_scalar_rule, a, "double", "first parameter"),
              SF_FIELD(sf_scalar_rule, b, "double", "second parameter"),
              SF_FIELD(sf_scalar_rule, c, "double", "third parameter"),
              SF_FIELD(sf_scalar_rule, d, "double",
                       "carried over from earlier steps: 0 for a fresh rule (NAdam's log offset of P_t, "
                       "sf_nadam_product_offset, after beta1 or momentum_decay changed)")});
  write_type(j, "sf_group_rules", sizeof(sf_group_rules), alignof(sf_group_rules),
             "a param group's scalar rules, in device memory (one group without groups)",
             {SF_FIELD(sf_group_rules, rules, "sf_scalar_rule[SF_MAX_SCALARS]",
                       "rules[k]: the rule of program scalar k (program.scalars); the rest zero"),
              SF_FIELD(sf_group_rules, step_base, "long long",
                       "steps applied before the group was added: its step is step_state.step + 1 - step_base (0 for "
                       "groups present from the start)")});
  write_type(j, "sf_hyper", sizeof(sf_hyper), alignof(sf_hyper),
             "the step's hyperparameters, passed to the kernels by value; the rules are read from device memory at "
             "every launch, so a captured CUDA graph sees rules changed between replays (a new lr) without re-capture",
             {SF_FIELD(sf_hyper, groups, "const sf_group_rules*", "device: num_groups rules"),
              SF_FIELD(sf_hyper, scalars, "float*",
                       "device scratch: num_groups * SF_MAX_SCALARS floats, the step's scalars per group"),
              SF_FIELD(sf_hyper, max_grad_norm, "double", "> 0: clip the global norm to it (clip_grad_norm_); 0: no clipping"),
              SF_FIELD(sf_hyper, num_groups, "int", ">= 1"), SF_FIELD(sf_hyper, pad_, "int", "0"),
              SF_FIELD(sf_hyper, seed, "unsigned long long",
                       "stochastic rounding of bf16 weights (combos with it): the Philox key; else unused"),
              SF_FIELD(sf_hyper, q8_maps, "const float*",
                       "q8 state (combos with it): the code maps in device memory; null otherwise (the emit API's specs)")});
  write_type(j, "sf_step_state", sizeof(sf_step_state), alignof(sf_step_state),
             "per-optimizer device state owned by the kernels: zero it once before the first step, then leave it",
             {SF_FIELD(sf_step_state, step, "long long", "steps applied so far (skipped steps do not count)"),
              SF_FIELD(sf_step_state, blocks_done, "unsigned int", "internal: reduce blocks finished in this step"),
              SF_FIELD(sf_step_state, update_blocks_done, "unsigned int", "internal: plain-step update blocks finished"),
              SF_FIELD(sf_step_state, found_inf, "int", "last step: a gradient was inf or NaN"),
              SF_FIELD(sf_step_state, applied, "int", "last step: the update was applied"),
              SF_FIELD(sf_step_state, loss_scale, "double", "last step: the loss scale it divided by"),
              SF_FIELD(sf_step_state, grad_norm, "double", "last step: norm of the unscaled gradients; +inf if not finite; NaN if not computed"),
              SF_FIELD(sf_step_state, clip_coef, "double", "last step: the clip coefficient"),
              SF_FIELD(sf_step_state, gscale, "double", "last step: the gradient multiplier clip_coef / loss_scale")});
  write_type(j, "sf_scaler_state", sizeof(sf_scaler_state), alignof(sf_scaler_state),
             "optional: a GradScaler's state on the device; sf_reduce records found_inf in it",
             {SF_FIELD(sf_scaler_state, scale, "float", "the loss scale (pass &scale as scale_ptr)"),
              SF_FIELD(sf_scaler_state, growth_tracker, "int", "good steps in a row"),
              SF_FIELD(sf_scaler_state, found_inf, "int", "set to 1 by a step that found inf/NaN; the caller clears it"),
              SF_FIELD(sf_scaler_state, recorded, "int", "set to 1 by every step; the caller clears it"),
              SF_FIELD(sf_scaler_state, growth_factor, "double", "caller's"),
              SF_FIELD(sf_scaler_state, backoff_factor, "double", "caller's"),
              SF_FIELD(sf_scaler_state, growth_interval, "int", "caller's"), SF_FIELD(sf_scaler_state, pad_, "int", "0")});
  j.end_object();
}

#undef SF_FIELD

void write_kernel(JsonWriter& j, const char* name, const char* grid, const char* block, long long block_threads,
                  const char* when, std::initializer_list<AbiParam> params) {
  j.begin_object().str("name", name).str("grid", grid).str("block", block).integer("block_threads", block_threads);
  j.integer("dynamic_shared_bytes", 0).str("launch", when);
  write_params(j, {params.begin(), params.size()});
  j.end_object();
}

}  // namespace

std::string cuda_abi_header() { return std::string(kEmbeddedPublicDeviceAbi); }

std::string describe_cuda_abi(const CudaSpec& spec, const UpdateProgram& program, const std::vector<int>& tensor_combos,
                              const CudaTarget& target, const std::string& nvrtc_version) {
  JsonWriter j;
  begin_kernel_abi(j);
  write_abi_program(j, program);

  // ---- the spec ----
  j.begin_object("spec").begin_array("combos");
  for (std::size_t k = 0; k < spec.combos.size(); ++k)
    j.begin_object().integer("index", static_cast<long long>(k)).str("weight", dtype_name(spec.combos[k].weight))
        .str("grad", dtype_name(spec.combos[k].grad)).boolean("master", spec.combos[k].master)
        .boolean("stochastic", spec.combos[k].stochastic).end_object();
  j.end_array().begin_array("tensor_combos");
  for (const int c : tensor_combos) j.integer({}, c);
  j.end_array().boolean("flat", spec.flat).boolean("aligned16", spec.aligned16);
  j.str("norm", spec.norm == CudaNorm::l2 ? "l2" : "inf").str("canonical_text", canonical_text(spec)).end_object();

  j.begin_object("target").str("kind", "cuda").str("output", target.output == CudaOutput::cubin ? "cubin" : "ptx");
  j.str("arch", arch_name(target)).integer("sm", target.sm).str("nvrtc_version", nvrtc_version).begin_array("nvrtc_options");
  for (const std::string& o : nvrtc_options(target)) j.str({}, o);
  j.end_array().end_object();

  j.begin_object("constants")
      .integer("SF_CHUNK_ELEMS", SF_CHUNK_ELEMS)
      .integer("SF_REDUCE_WARPS", SF_REDUCE_WARPS)
      .integer("SF_UPDATE_THREADS", SF_UPDATE_THREADS)
      .integer("SF_UPDATE_ELEMS", SF_UPDATE_ELEMS)
      .integer("SF_MAX_SCALARS", SF_MAX_SCALARS)
      .integer("SF_MAX_STREAMS", SF_MAX_STREAMS)
      .end_object();
  write_types(j);

  // ---- the kernels ----
  j.begin_array("kernels");
  write_kernel(
      j, "sf_reduce", "max(1, ceil(num_chunks / SF_REDUCE_WARPS))", "32 * SF_REDUCE_WARPS", 32 * SF_REDUCE_WARPS,
      "first, on every step that divides by a loss scale, clips or reports the norm (not on a plain step)",
      {{"tensors", "const sf_tensor*", "device: the tensor table"},
       {"num_tensors", "int", "entries in the tensor table"},
       {"chunks", "const sf_span*", "device: the chunk table"},
       {"num_chunks", "int", "entries in the chunk table (0 allowed)"},
       {"partials", "sf_partial*", "device scratch: max(num_chunks, 1) entries, overwritten every step"},
       {"tensor_sums", "double*", "device scratch: num_tensors entries; after a step, per-tensor sum of squares (or max |g|) of the stored gradients"},
       {"st", "sf_step_state*", "device: the step state (zeroed once, before the first step)"},
       {"hyper", "sf_hyper", "by value: the group rules, the scalars scratch and max_grad_norm"},
       {"scale_ptr", "const float*", "device address of the loss scale (a GradScaler's), or null to use scale_value"},
       {"scale_value", "double", "the loss scale S > 0 when scale_ptr is null (1 for gradients already unscaled)"},
       {"check_finite", "int", "1: skip the update when a gradient is inf/NaN (loss scaling or clipping); 0: report only"},
       {"scaler", "sf_scaler_state*", "optional device GradScaler state that records found_inf, or null"}});
  write_kernel(
      j, "sf_update", spec.flat ? "max(1, ceil(flat_numel / SF_UPDATE_ELEMS))" : "the number of update blocks (blocks table)",
      "SF_UPDATE_THREADS", SF_UPDATE_THREADS, "after sf_reduce on the same stream (plain = 0), or alone for a plain step (plain = 1)",
      {{"tensors", "const sf_tensor*", "device: the tensor table"},
       {"blocks", "const sf_span*", spec.flat ? "unused in the flat layout (may be null)" : "device: the update block table"},
       {"flat_numel", "long long", spec.flat ? "elements in the flat range (the sum of numel)" : "unused in the table layout (0)"},
       {"streams", "sf_streams", "by value: the state buffers by program stream index"},
       {"st", "sf_step_state*", "device: the same step state as sf_reduce's"},
       {"hyper", "sf_hyper", "by value: the same as sf_reduce's"},
       {"plain", "int", "0 after sf_reduce; 1 for a plain step (the update evaluates the rules with gscale = 1)"}});
  j.end_array();

  // ---- memory and tables ----
  write_memory(
      j, "device_memory",
      {{"state", "float", "one buffer of state_elems floats per state stream (program.streams with role state)",
        "every element to the stream's init, before the first step"},
       {"masters", "float", "master_elems floats: tensor i at master_offsets[i] (combos with master only)",
        "the weights widened to fp32, before the first step"},
       {"partials", "sf_partial", "max(num_chunks, 1)", "no"},
       {"tensor_sums", "double", "num_tensors", "no"},
       {"step_state", "sf_step_state", "1",
        "zero, once; the kernels keep the step count and the last step's results in it"},
       {"group_rules", "sf_group_rules", "num_groups (1 without groups)",
        "the rules, copied from the host; copy again (stream-ordered) to change hyperparameters"},
       {"scalars", "float", "num_groups * SF_MAX_SCALARS", "no"},
       {"tables", "sf_tensor, sf_span", "the tensor table, the chunk table and (table layout) the block table",
        "copied from the host"}});
  j.begin_object("tables")
      .str("state_elems", spec.flat ? "sum of numel (the flat layout concatenates exactly)"
                                    : "sum over tensors of numel rounded up to a multiple of 16")
      .str("state_offset", "tensor i's offset: the sum of the (rounded) sizes of the tensors before it")
      .str("master_offsets", "the same running sum over the tensors whose combo has a master; -1 for the others")
      .str("chunks", "for each tensor in order, spans {begin, tensor, len} of SF_CHUNK_ELEMS elements (the last shorter); "
                     "first_chunk and num_chunks index them")
      .str("blocks", spec.flat ? "unused (flat layout)"
                               : "for each tensor in order, spans of SF_UPDATE_ELEMS elements; one idle {0, 0, 0} block when "
                                 "there are none")
      .str("planner", "stepfuse::plan_kernel_tables() / sf_emit_tables() compute all of it from the sizes")
      .end_object();

  j.begin_array("step")
      .str({}, "setup (once): allocate and initialize device_memory, copy the tables, zero step_state")
      .str({}, "fill group_rules[g].rules[k] = program.scalars[k] as {kind, 0, a, b, c} (step_base 0) and copy it to the "
               "device; sf_hyper = {group_rules, scalars, max_grad_norm = the clip threshold or 0, num_groups}")
      .str({}, "scaled or clipped step: sf_reduce(..., scale_value = S, check_finite = 1, ...) then sf_update(..., plain = 0), "
               "in order on one stream; nothing needs the host in between (a CUDA graph can hold both)")
      .str({}, "plain step (gradients unscaled, no clipping, no norm): sf_update(..., plain = 1) alone")
      .str({}, "results, when wanted: read step_state after the stream: applied, found_inf, grad_norm, clip_coef, step")
      .str({}, "new hyperparameters: copy new rules into group_rules between steps, ordered on the stream (never "
               "recompile; a captured graph picks them up at its next replay)")
      .end_array();
  j.str("scalar_stage",
        "In sf_reduce's last block to finish: the partials are combined in chunk order per tensor in fp64, then tensors in "
        "order (the CPU backend's order, so the norm is bitwise the CPU's), giving found_inf and the norm of the stored "
        "gradients; then stage = sf_step_stage(found_inf, check_finite, norm, S, hyper.max_grad_norm, st->step) and, when "
        "stage.applied, for every group g, sf_eval_scalars(hyper.groups[g].rules, num_scalars, stage.step - "
        "hyper.groups[g].step_base, stage.gscale, hyper.scalars + g * SF_MAX_SCALARS). When it is not "
        "applied sf_update returns at once (nothing is written). In plain mode every sf_update block evaluates the rules "
        "for sf_step_stage(0, 0, NaN, 1, 0, st->step) itself, and its last block counts the step. sf_update_scale is "
        "sf_amp_update_scale.");
  j.str("abi_header", "stepfuse/device_abi.h (EmittedKernel::abi_header): the structs, constants, the scalar rules "
                      "(sf_eval_rule, sf_eval_scalars) and the step stage (sf_step_stage, sf_amp_update_scale)");
  j.end_object();
  return j.finish();
}

}  // namespace stepfuse::jit
