// The kernel ABI description (JSON) of a spec's generated step kernels.
#include "jit/cuda/kernel_abi.hpp"

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string_view>

#include "jit/cuda/embedded_headers.hpp"
#include "jit/update_program_rules.hpp"
#include "stepfuse/version.hpp"

extern "C" {
#include "jit/cuda/device_abi.h"
}

namespace stepfuse::jit {

namespace {

// A small JSON writer: objects and arrays, two-space indentation, one value a line.
class JsonWriter {
 public:
  JsonWriter& begin_object(std::string_view key = {}) { return open(key, '{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array(std::string_view key = {}) { return open(key, '['); }
  JsonWriter& end_array() { return close(']'); }
  JsonWriter& str(std::string_view key, std::string_view v) { return raw(key, quote(v)); }
  JsonWriter& num(std::string_view key, double v) {
    if (!std::isfinite(v)) return raw(key, "null");  // not reached: rules and inits are finite
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return raw(key, buf);
  }
  JsonWriter& integer(std::string_view key, long long v) { return raw(key, std::to_string(v)); }
  JsonWriter& boolean(std::string_view key, bool v) { return raw(key, v ? "true" : "false"); }
  std::string finish() { return out_ + "\n"; }

 private:
  static std::string quote(std::string_view s) {
    std::string q = "\"";
    for (const char c : s) {
      switch (c) {
        case '"': q += "\\\""; break;
        case '\\': q += "\\\\"; break;
        case '\n': q += "\\n"; break;
        case '\t': q += "\\t"; break;
        case '\r': q += "\\r"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
            q += buf;
          } else {
            q += c;
          }
      }
    }
    return q + "\"";
  }
  void item(std::string_view key) {
    if (!first_.empty()) {
      if (!first_.back()) out_ += ",";
      first_.back() = false;
      newline();
    }
    if (!key.empty()) out_ += quote(key) + ": ";
  }
  void newline() {
    out_.push_back('\n');
    out_.append(2 * first_.size(), ' ');
  }
  JsonWriter& raw(std::string_view key, const std::string& text) {
    item(key);
    out_ += text;
    return *this;
  }
  JsonWriter& open(std::string_view key, char bracket) {
    item(key);
    out_ += bracket;
    first_.push_back(true);
    return *this;
  }
  JsonWriter& close(char bracket) {
    const bool empty = first_.back();
    first_.pop_back();
    if (!empty) newline();
    out_ += bracket;
    return *this;
  }
  std::string out_;
  std::vector<bool> first_;  // per open container: nothing written in it yet
};

struct Field {
  const char* name;
  const char* type;
  std::size_t offset;
  const char* what;
};

void write_type(JsonWriter& j, const char* name, std::size_t size, std::size_t align, const char* what,
                std::initializer_list<Field> fields) {
  j.begin_object(name).str("description", what).integer("size", static_cast<long long>(size));
  j.integer("align", static_cast<long long>(align)).begin_array("fields");
  for (const Field& f : fields)
    j.begin_object().str("name", f.name).str("type", f.type).integer("offset", static_cast<long long>(f.offset))
        .str("description", f.what).end_object();
  j.end_array().end_object();
}

#define SF_FIELD(T, f, type, what) Field{#f, type, offsetof(T, f), what}

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
              SF_FIELD(sf_tensor, combo, "int", "index of its dtype combination (spec.combos)")});
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
              SF_FIELD(sf_scalar_rule, b, "double", "second parameter")});
  write_type(j, "sf_hyper", sizeof(sf_hyper), alignof(sf_hyper),
             "the step's hyperparameters, passed to both kernels by value: changing them never recompiles",
             {SF_FIELD(sf_hyper, rules, "sf_scalar_rule[SF_MAX_SCALARS]",
                       "rules[k]: the rule of program scalar k (program.scalars); the rest zero"),
              SF_FIELD(sf_hyper, max_grad_norm, "double", "> 0: clip the global norm to it (clip_grad_norm_); 0: no clipping")});
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
              SF_FIELD(sf_step_state, gscale, "double", "last step: the gradient multiplier clip_coef / loss_scale"),
              SF_FIELD(sf_step_state, scalars, "float[SF_MAX_SCALARS]", "last step: the program's scalars as sf_update used them")});
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

struct Param {
  const char* name;
  const char* type;
  const char* what;
};

void write_kernel(JsonWriter& j, const char* name, const char* grid, const char* block, long long block_threads,
                  const char* when, std::initializer_list<Param> params) {
  j.begin_object().str("name", name).str("grid", grid).str("block", block).integer("block_threads", block_threads);
  j.integer("dynamic_shared_bytes", 0).str("launch", when).begin_array("params");
  int k = 0;
  for (const Param& p : params)
    j.begin_object().integer("index", k++).str("name", p.name).str("type", p.type).str("description", p.what).end_object();
  j.end_array().end_object();
}

std::string_view role_name(StreamRole r) {
  return r == StreamRole::grad ? "grad" : r == StreamRole::param ? "param" : "state";
}

}  // namespace

std::string cuda_abi_header() { return std::string(kEmbeddedPublicDeviceAbi); }

std::string describe_cuda_abi(const CudaSpec& spec, const UpdateProgram& program, const std::vector<int>& tensor_combos,
                              const CudaTarget& target, const std::string& nvrtc_version) {
  const Program& p = spec.program;
  JsonWriter j;
  j.begin_object().str("format", "stepfuse.kernel_abi").integer("format_version", kKernelAbiVersion);
  j.str("stepfuse_version", version());

  // ---- the program: streams and per-step scalars ----
  bool loads[kMaxStreams] = {}, stores[kMaxStreams] = {};
  for (int i = 0; i < p.num_instrs; ++i) {
    if (p.code[i].op == Op::load) loads[p.code[i].attr] = true;
    if (p.code[i].op == Op::store) stores[p.code[i].attr] = true;
  }
  j.begin_object("program").str("name", p.name).str("text", to_string(p)).begin_array("streams");
  for (int s = 0; s < p.num_streams; ++s)
    j.begin_object().integer("index", s).str("name", p.streams[s].name).str("role", role_name(p.streams[s].role))
        .num("init", p.streams[s].init).boolean("loaded", loads[s]).boolean("stored", stores[s]).end_object();
  j.end_array().begin_array("scalars");
  for (int s = 0; s < p.num_scalars; ++s) {
    const ScalarDef& d = program.scalars()[static_cast<std::size_t>(s)];
    j.begin_object().integer("index", s).str("name", d.name).str("rule", scalar_rule_name(d.rule.kind));
    j.integer("kind", static_cast<int>(d.rule.kind)).num("a", d.rule.a).num("b", d.rule.b).str("value", rule_text(d.rule));
    j.end_object();
  }
  j.end_array().end_object();
  j.begin_object("scalar_rule_kinds")
      .str("0", "SF_RULE_FIXED: a")
      .str("1", "SF_RULE_GSCALE: a * gscale (gscale = clip_coef / loss_scale)")
      .str("2", "SF_RULE_FIRST_STEP: step == 1 ? a : b")
      .str("3", "SF_RULE_DIV_ONE_MINUS_POW: a / (1 - b^step)")
      .str("4", "SF_RULE_SQRT_ONE_MINUS_POW: sqrt(1 - b^step)")
      .str("5", "SF_RULE_DIV_LINEAR: a / (1 + (step - 1) * b)")
      .str("evaluation", "in double with + - * / sqrt only (powers by repeated squaring, sf_powi), step = the 1-based "
                         "index of the step being applied, then rounded once to fp32; sf_eval_rule in the header")
      .end_object();

  // ---- the spec ----
  j.begin_object("spec").begin_array("combos");
  for (std::size_t k = 0; k < spec.combos.size(); ++k)
    j.begin_object().integer("index", static_cast<long long>(k)).str("weight", dtype_name(spec.combos[k].weight))
        .str("grad", dtype_name(spec.combos[k].grad)).boolean("master", spec.combos[k].master).end_object();
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
       {"hyper", "sf_hyper", "by value: the scalar rules and max_grad_norm"},
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
  j.begin_array("device_memory");
  j.begin_object().str("name", "state").str("type", "float")
      .str("count", "one buffer of state_elems floats per state stream (program.streams with role state)")
      .str("initialize", "every element to the stream's init, before the first step").end_object();
  j.begin_object().str("name", "masters").str("type", "float")
      .str("count", "master_elems floats: tensor i at master_offsets[i] (combos with master only)")
      .str("initialize", "the weights widened to fp32, before the first step").end_object();
  j.begin_object().str("name", "partials").str("type", "sf_partial").str("count", "max(num_chunks, 1)")
      .str("initialize", "no").end_object();
  j.begin_object().str("name", "tensor_sums").str("type", "double").str("count", "num_tensors").str("initialize", "no").end_object();
  j.begin_object().str("name", "step_state").str("type", "sf_step_state").str("count", "1")
      .str("initialize", "zero, once; the kernels keep the step count and the last step's results in it").end_object();
  j.begin_object().str("name", "tables").str("type", "sf_tensor, sf_span")
      .str("count", "the tensor table, the chunk table and (table layout) the block table").str("initialize", "copied from the host")
      .end_object();
  j.end_array();
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
      .str({}, "fill sf_hyper: rules[k] = program.scalars[k] as {kind, 0, a, b}; max_grad_norm = the clip threshold or 0")
      .str({}, "scaled or clipped step: sf_reduce(..., scale_value = S, check_finite = 1, ...) then sf_update(..., plain = 0), "
               "in order on one stream; nothing needs the host in between (a CUDA graph can hold both)")
      .str({}, "plain step (gradients unscaled, no clipping, no norm): sf_update(..., plain = 1) alone")
      .str({}, "results, when wanted: read step_state after the stream: applied, found_inf, grad_norm, clip_coef, step")
      .str({}, "new hyperparameters: change the rules in the next launch's sf_hyper (never recompile)")
      .end_array();
  j.str("scalar_stage",
        "In sf_reduce's last block to finish: the partials are combined in chunk order per tensor in fp64, then tensors in "
        "order (the CPU backend's order, so the norm is bitwise the CPU's); found_inf; norm = sqrt(total) / S (inf-norm: "
        "max / S); clip = min(1, max_grad_norm / (norm + 1e-6)) when max_grad_norm > 0; gscale = clip / S; each scalar k = "
        "(float)sf_eval_rule(&hyper.rules[k], step + 1, gscale) into st->scalars, then st->step += 1 and st->applied = 1. "
        "On inf/NaN with check_finite: applied = 0 and sf_update returns at once (nothing is written). In plain mode every "
        "sf_update block evaluates the rules itself with gscale = 1, and its last block counts the step.");
  j.str("abi_header", "stepfuse/device_abi.h (EmittedKernel::abi_header): the structs, constants and sf_eval_rule");
  j.end_object();
  return j.finish();
}

}  // namespace stepfuse::jit
