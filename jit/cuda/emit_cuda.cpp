// The CUDA emitter: the update program becomes one straight-line element
// function per dtype combination; fixed kernel text around it does the loads,
// stores, the reduce pass and the scalar stage (see device_abi.h).
#include "jit/cuda/emit_cuda.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string_view>

#include "jit/embedded_files.hpp"
#include "jit/program_analysis.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::jit {

namespace {

// Bumped whenever the generated code changes meaning (part of every cache key).
constexpr int kEmitterVersion = 15;  // 2: sf_reduce takes the loss scale as a double; 3: vector reduce, tiled finalize;
                                    // 4: the step stage from jit/step_stage.h, kernel text from jit/cuda/kernels/,
                                    //    one element function per spec; 5: two-phase programs (sf_phase1,
                                    //    sf_phase_combine, sf_update's norms); 6: param groups (sf_tensor.group,
                                    //    the group rules and scalars in device memory, read at every launch);
                                    // 7: program variants per param group (sf_body_v<n>, shared state buffers);
                                    // 8: sf_finish shared by sf_finalize and the sharded step's kernels;
                                    // 9, 10: stochastic rounding of bf16 weights (jit/stochastic_round.h,
                                    //    sf_tensor.model_index, sf_hyper.seed, the group's step);
                                    // 11: compensated bf16 weights (sf_tensor.master holds the compensations)
                                    // 12: bf16 and q8 state (sf_tensor.state, sf_hyper.q8_maps, update_span_q8.cuh)
                                    // 13: bf16 state of stochastically rounded weights rounds stochastically
                                    //    (sf_sr_state_step; sf_phase1 passes the seed and step)
                                    // 14: sf_scalar_rule.d (NAdam's product offset), sf_group_rules grows
                                    // 15: the step stage skips a scale whose fp32 reciprocal overflows;
                                    //    L2 weight decay only where it is not 0 (select)

std::string_view dtype_tag(DType t) { return dtype_name(t); }  // f32, f16, bf16

// Replaces every "{KEY}" in `text`.
std::string fill(std::string text, std::initializer_list<std::pair<std::string_view, std::string>> subs) {
  for (const auto& [key, value] : subs) {
    std::string k(1, '{');  // (not "{" + key: g++ 12 warns falsely, -Wrestrict)
    k.append(key).push_back('}');
    for (std::size_t at = text.find(k); at != std::string::npos; at = text.find(k, at + value.size()))
      text.replace(at, k.size(), value);
  }
  return text;
}

std::string float_literal(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "sf_float(0x%08Xu) /* %.9g */", std::bit_cast<std::uint32_t>(x), static_cast<double>(x));
  return buf;
}

std::string v(int id) { return std::string(1, 'v').append(std::to_string(id)); }

// What an element function is: the whole of a one-phase program (sf_body), or
// one phase of a two-phase program (phase 1: sf_body1, which writes the values to
// reduce to red[slot]; phase 2: sf_body, which reads the tensor's norms nm[slot]).
enum class Part { whole, phase1, phase2 };

// The program as one straight-line function on fp32 values in registers.
std::string element_function(const Program& p, const std::string& name, Part part = Part::whole) {
  std::ostringstream o;
  o << "/* " << p.name
    << (part == Part::whole ? ": the update program, one element. */\n"
        : part == Part::phase1 ? ": phase 1 of the update program, one element. */\n"
                               : ": phase 2 of the update program, one element. */\n")
    << "SF_HD SF_INLINE void " << name
    << "(const float* SF_RESTRICT sc, float g, float* SF_RESTRICT p, float* SF_RESTRICT st"
    << (part == Part::phase1 ? ", float* SF_RESTRICT red" : part == Part::phase2 ? ", const float* SF_RESTRICT nm" : "")
    << ") {\n";
  if (part != Part::whole) o << "  (void)sc; (void)g; (void)p; (void)st;\n";  // a phase may use none of them
  for (int i = 0; i < p.num_instrs; ++i) {
    const Instr& in = p.code[i];
    const std::string a = v(in.a), b = v(in.b), c = v(in.c);
    std::string expr;
    switch (in.op) {
      case Op::load: {
        const StreamRole role = p.streams[in.attr].role;
        expr = role == StreamRole::grad ? "g" : role == StreamRole::param ? "*p" : "st[" + std::to_string(in.attr) + "]";
        break;
      }
      case Op::store:
        o << "  " << (p.streams[in.attr].role == StreamRole::param ? std::string("*p") : "st[" + std::to_string(in.attr) + "]")
          << " = " << a << ";  /* " << p.streams[in.attr].name << " */\n";
        continue;
      case Op::reduce_sumsq:
        o << "  red[" << static_cast<int>(in.attr) << "] = " << a << ";\n";
        continue;
      case Op::phase:  // the parts of a two-phase program have none (jit::phase_program)
        throw Error(ErrorCode::invalid_argument, "CUDA emitter: a phase marker inside one phase");
      case Op::tensor_norm: expr = "nm[" + std::to_string(in.attr) + "]"; break;
      case Op::constant: expr = float_literal(in.imm); break;
      case Op::scalar: expr = "sc[" + std::to_string(in.attr) + "] /* " + std::string(p.scalars[in.attr]) + " */"; break;
      case Op::add: expr = a + " + " + b; break;
      case Op::sub: expr = a + " - " + b; break;
      case Op::mul: expr = a + " * " + b; break;
      case Op::div: expr = a + " / " + b; break;
      case Op::fma: expr = "SF_FMAF(" + a + ", " + b + ", " + c + ")"; break;
      case Op::neg: expr = "sf_neg(" + a + ")"; break;
      case Op::abs: expr = "sf_abs(" + a + ")"; break;
      case Op::sqrt: expr = "SF_SQRTF(" + a + ")"; break;
      case Op::max: expr = "sf_max(" + a + ", " + b + ")"; break;
      case Op::min: expr = "sf_min(" + a + ", " + b + ")"; break;
      case Op::sign: expr = "sf_sign(" + a + ")"; break;
      case Op::select: expr = "sf_select(" + a + ", " + b + ", " + c + ")"; break;
      case Op::cmp_lt: expr = "sf_lt(" + a + ", " + b + ")"; break;
      case Op::cmp_le: expr = "sf_le(" + a + ", " + b + ")"; break;
      case Op::cmp_eq: expr = "sf_eq(" + a + ", " + b + ")"; break;
      case Op::convert:
        expr = static_cast<DType>(in.attr) == DType::f16    ? "sf_round_f16(" + a + ")"
               : static_cast<DType>(in.attr) == DType::bf16 ? "sf_round_bf16(" + a + ")"
                                                            : a;
        break;
    }
    o << "  const float " << v(i) << " = " << expr << ";\n";
  }
  o << "}\n";
  return o.str();
}

// The kernels' text (jit/cuda/kernels/), with {KEY} holes that fill() fills.
constexpr std::string_view kVectorIo = embedded_file("jit/cuda/kernels/vector_io.cuh");
constexpr std::string_view kReduceCommon = embedded_file("jit/cuda/kernels/reduce_common.cuh");
constexpr std::string_view kReduceChunkL2 = embedded_file("jit/cuda/kernels/reduce_chunk_l2.cuh");
constexpr std::string_view kReduceChunkInf = embedded_file("jit/cuda/kernels/reduce_chunk_inf.cuh");
constexpr std::string_view kReduceKernel = embedded_file("jit/cuda/kernels/reduce_kernel.cuh");
constexpr std::string_view kShardAbi = embedded_file("jit/cuda/shard_abi.h");
constexpr std::string_view kShardKernel = embedded_file("jit/cuda/kernels/shard_kernel.cuh");
constexpr std::string_view kUpdateSpan = embedded_file("jit/cuda/kernels/update_span.cuh");
constexpr std::string_view kUpdateSpanQ8 = embedded_file("jit/cuda/kernels/update_span_q8.cuh");
constexpr std::string_view kUpdateKernel = embedded_file("jit/cuda/kernels/update_kernel.cuh");
constexpr std::string_view kPhase1Chunk = embedded_file("jit/cuda/kernels/phase1_chunk.cuh");
constexpr std::string_view kPhase1ChunkQ8 = embedded_file("jit/cuda/kernels/phase1_chunk_q8.cuh");
constexpr std::string_view kQ8Strided = embedded_file("jit/cuda/kernels/q8_strided.cuh");
constexpr std::string_view kPhase1Kernel = embedded_file("jit/cuda/kernels/phase1_kernel.cuh");
constexpr std::string_view kScalerKernels = embedded_file("jit/cuda/kernels/scaler_kernels.cuh");
constexpr std::string_view kScaleKernels = embedded_file("jit/cuda/kernels/scale_kernels.cuh");

// Indents each line; no newline after the last (the template supplies it).
std::string indent(const std::string& lines, int n) {
  std::string pad(static_cast<std::size_t>(n), ' '), out;
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);) out += (out.empty() ? "" : "\n") + pad + line;
  return out;
}

// The element function of variant v: sf_body, sf_body_v1, ...
std::string body_name(int v) { return v == 0 ? "sf_body" : "sf_body_v" + std::to_string(v); }

int variant_of(const CudaSpec& spec, std::size_t k) { return spec.combo_variant.empty() ? 0 : spec.combo_variant[k]; }

// How combination k stores its program's stream s (CudaSpec::combo_formats).
StateFormat format_of(const CudaSpec& spec, std::size_t k, int s) {
  return spec.combo_formats.empty() ? StateFormat::f32 : spec.combo_formats[k][static_cast<std::size_t>(s)];
}
bool combo_has_q8(const CudaSpec& spec, std::size_t k) {
  if (spec.combo_formats.empty()) return false;
  const auto& f = spec.combo_formats[k];
  return std::find(f.begin(), f.end(), StateFormat::q8) != f.end();
}
bool spec_has_q8(const CudaSpec& spec) {
  for (std::size_t k = 0; k < spec.combo_formats.size(); ++k)
    if (combo_has_q8(spec, k)) return true;
  return false;
}
// Where stream s's state lives: a buffer of sf_streams (index `slot`), or the tensor's own (packed).
std::string state_base(const CudaSpec& spec, int s, int slot) {
  return spec.combo_formats.empty() ? "ss->s[" + std::to_string(slot) + "]" : "t->state->data[" + std::to_string(s) + "]";
}
// A q8 stream's map in the update kernel's shared copy (q8s): the unsigned one for nonnegative values.
std::string q8_map(const Program& prog, int s) {
  return prog.streams[s].values == StateValues::nonnegative ? "q8s + 2 * SF_Q8_BLOCK" : "q8s";
}

// The store of `value` to f32 or bf16 state stream s of combination c, at the element
// `x` past `begin` (state index so + x): four elements (sf_store4_*) or one. bf16 state
// of stochastically rounded weights rounds stochastically (unless the spec says
// nearest: CudaSpec::stochastic_state), with the stream's own bits
// (jit/stochastic_round.h, sf_sr_state_step).
std::string state_store(bool four, const CudaSpec& spec, const DtypeCombo& c, StateFormat f, int s,
                        const std::string& base, const std::string& x, const std::string& value) {
  const std::string fn = four ? "sf_store4_" : "sf_store_";
  if (f == StateFormat::bf16 && c.stochastic && spec.stochastic_state)
    return fn + "bf16_sr(" + base + ", so + " + x + ", " + value + ", t->model_index + begin + " + x +
           ", sr_seed, sf_sr_state_step(sr_step, " + std::to_string(s) + "));\n";
  return fn + (f == StateFormat::bf16 ? "bf16" : "f32") + "(" + base + ", so + " + x + ", " + value + ");\n";
}

// `prog`: the combination's program (its variant's), or the phase-2 part of a two-phase
// one (two_phase); `slots`: its streams' buffers (cuda_stream_slots). A combination with
// q8 state runs a warp per q8 block (update_span_q8.cuh), 8 elements a lane: its vector
// accesses are two 4-element ones.
std::string update_span(const Program& prog, const CudaSpec& spec, int k, bool two_phase,
                        const std::array<int, kMaxStreams>& slots) {
  const auto ku = static_cast<std::size_t>(k);
  const DtypeCombo& c = spec.combos[ku];
  const StreamUse use = stream_use(prog);
  const bool q8 = combo_has_q8(spec, ku);
  const std::string G(dtype_tag(c.grad)), W(dtype_tag(c.weight));
  const int gs = prog.grad_stream(), ps = prog.param_stream();
  std::string loadv, load1, gather, scatter, storev, store1, absmax, encode;
  // The 4-element accesses of elements at .. at + 3, into the arrays from `lane` on (the
  // vector path), and the one-element ones of element j.
  const auto vector_accesses = [&](const std::string& at, const std::string& off) {
    if (use.loads[gs]) loadv += "sf_load4_" + G + "(t->grad, begin + " + at + ", g" + off + ");\n";
    if (use.loads[ps])
      loadv += c.compensated ? "sf_load4_bf16_comp(t->weight, t->master, begin + " + at + ", p" + off + ");\n"
               : c.master    ? "sf_load4_f32(t->master, begin + " + at + ", p" + off + ");\n"
                             : "sf_load4_" + W + "(t->weight, begin + " + at + ", p" + off + ");\n";
    if (c.master) storev += "sf_store4_f32(t->master, begin + " + at + ", p" + off + ");\n";
    if (c.compensated)
      storev += "sf_store4_bf16_comp(t->weight, t->master, begin + " + at + ", p" + off + ");\n";
    else if (c.stochastic)  // the model index of element begin + i is t->model_index + begin + i
      storev += "sf_store4_bf16_sr(t->weight, begin + " + at + ", p" + off + ", t->model_index + begin + " + at +
                ", sr_seed, sr_step);\n";
    else
      storev += "sf_store4_" + W + "(t->weight, begin + " + at + ", p" + off + ");\n";
    for (int s = 0; s < prog.num_streams; ++s) {
      if (prog.streams[s].role != StreamRole::state) continue;
      const StateFormat f = format_of(spec, ku, s);
      if (f == StateFormat::q8) continue;
      const std::string S = std::to_string(s), F = f == StateFormat::bf16 ? "bf16" : "f32";
      const std::string base = state_base(spec, s, slots[static_cast<std::size_t>(s)]);
      if (use.loads[s]) loadv += "sf_load4_" + F + "(" + base + ", so + " + at + ", st[" + S + "]" + off + ");\n";
      if (use.stores[s]) storev += state_store(true, spec, c, f, s, base, at, "st[" + S + "]" + off);
    }
  };
  vector_accesses("i", "");
  if (q8) vector_accesses("i + 4", " + 4");
  if (use.loads[gs]) load1 += "g[j] = sf_load_" + G + "(t->grad, begin + i + j);\n";
  if (use.loads[ps])
    load1 += c.compensated ? "p[j] = sf_load_bf16_comp(t->weight, t->master, begin + i + j);\n"
             : c.master    ? "p[j] = sf_load_f32(t->master, begin + i + j);\n"
                           : "p[j] = sf_load_" + W + "(t->weight, begin + i + j);\n";
  if (c.master) store1 += "sf_store_f32(t->master, begin + i + j, p[j]);\n";
  if (c.compensated)
    store1 += "sf_store_bf16_comp(t->weight, t->master, begin + i + j, p[j]);\n";
  else if (c.stochastic)
    store1 += "sf_store_bf16_sr(t->weight, begin + i + j, p[j], t->model_index + begin + i + j, sr_seed, sr_step);\n";
  else
    store1 += "sf_store_" + W + "(t->weight, begin + i + j, p[j]);\n";
  for (int s = 0; s < prog.num_streams; ++s) {
    if (prog.streams[s].role != StreamRole::state) continue;
    const StateFormat f = format_of(spec, ku, s);
    const std::string S = std::to_string(s), base = state_base(spec, s, slots[static_cast<std::size_t>(s)]);
    if (use.loads[s]) gather += "s[" + S + "] = st[" + S + "][j];\n";
    if (use.stores[s]) scatter += "st[" + S + "][j] = s[" + S + "];\n";
    if (f == StateFormat::q8) {
      const std::string map = q8_map(prog, s);
      if (use.loads[s]) {
        absmax += "const float absmax" + S + " = t->state->absmax[" + S + "][block];\n";
        loadv += "sf_q8_load8(" + base + ", so + i, absmax" + S + ", " + map + ", st[" + S + "]);\n";
        load1 += "st[" + S + "][j] = sf_q8_load(" + base + ", so + i + j, absmax" + S + ", " + map + ");\n";
      }
      if (use.stores[s])
        encode += "sf_q8_store8(" + base + ", t->state->absmax[" + S + "], block, so + i, st[" + S + "], n, " + map + ");\n";
      continue;
    }
    const std::string F = f == StateFormat::bf16 ? "bf16" : "f32";
    if (use.loads[s]) load1 += "st[" + S + "][j] = sf_load_" + F + "(" + base + ", so + i + j);\n";
    if (use.stores[s]) store1 += state_store(false, spec, c, f, s, base, "i + j", "st[" + S + "][j]");
  }
  return fill(std::string(q8 ? kUpdateSpanQ8 : kUpdateSpan),
              {{"K", std::to_string(k)},
               {"BODY", body_name(variant_of(spec, ku))},
               {"VECTOR", spec.aligned16 ? "1" : "0"},
               {"STATE_BASE", spec.combo_formats.empty() ? "t->state_offset + begin" : "begin"},
               {"ABSMAX", indent(absmax, 4)},
               {"LOAD4", indent(loadv, 6)},
               {"LOAD8", indent(loadv, 6)},
               {"LOAD1", indent(load1, 8)},
               {"GATHER", indent(gather, 6)},
               {"SCATTER", indent(scatter, 6)},
               {"ENCODE", indent(encode, 4)},
               {"STORE4", indent(storev, 6)},
               {"STORE8", indent(storev, 6)},
               {"STORE1", indent(store1, 8)},
               {"NORMS_PARAM", two_phase ? ",\n                                         const float* SF_RESTRICT nm" : ""},
               {"NORMS_ARG", two_phase ? ", nm" : ""}});
}

// Phase 1 of a two-phase program over one chunk, for combination k (`prog`: phase 1's part).
// A combination with q8 state runs the chunk a q8 block at a time (phase1_chunk_q8.cuh):
// element i of the chunk is j = (i % 256) / 32 of its lane's 8 in the block.
std::string phase1_chunk(const Program& prog, const CudaSpec& spec, int k) {
  const auto ku = static_cast<std::size_t>(k);
  const DtypeCombo& c = spec.combos[ku];
  const StreamUse use = stream_use(prog);
  const bool q8 = combo_has_q8(spec, ku);
  const std::string G(dtype_tag(c.grad)), W(dtype_tag(c.weight));
  const int gs = prog.grad_stream(), ps = prog.param_stream();
  std::string load, store, accumulate, absmax, encode;
  if (use.loads[gs]) load += "g = sf_load_" + G + "(t->grad, begin + i);\n";
  if (use.loads[ps])
    load += c.compensated ? "p = sf_load_bf16_comp(t->weight, t->master, begin + i);\n"
            : c.master    ? "p = sf_load_f32(t->master, begin + i);\n"
                          : "p = sf_load_" + W + "(t->weight, begin + i);\n";
  for (int s = 0; s < prog.num_streams; ++s) {  // (two-phase programs have no variants: slot s is stream s)
    if (prog.streams[s].role != StreamRole::state) continue;
    const std::string S = std::to_string(s), base = state_base(spec, s, s);
    const StateFormat f = format_of(spec, ku, s);
    if (f == StateFormat::q8) {
      const std::string map = q8_map(prog, s);
      if (use.loads[s]) {
        absmax += "const float absmax" + S + " = t->state->absmax[" + S + "][block];\n";
        load += "s[" + S + "] = sf_q8_load(" + base + ", so + i, absmax" + S + ", " + map + ");\n";
      }
      if (use.stores[s]) {
        store += "st[" + S + "][j] = s[" + S + "];\n";
        encode += "sf_q8_store_strided(" + base + ", t->state->absmax[" + S + "], block, so + q + lane, st[" + S +
                  "], n, " + map + ");\n";
      }
      continue;
    }
    const std::string F = f == StateFormat::bf16 ? "bf16" : "f32";
    if (use.loads[s]) load += "s[" + S + "] = sf_load_" + F + "(" + base + ", so + i);\n";
    if (use.stores[s]) store += state_store(false, spec, c, f, s, base, "i", "s[" + S + "]");
  }
  const unsigned slots = reduced_slots(prog);
  for (int r = 0; r < kMaxNormSlots; ++r)
    if (slots & (1u << r)) {
      const std::string R = std::to_string(r);
      accumulate += "acc[" + R + "] = acc[" + R + "] + red[" + R + "] * red[" + R + "];\n";
    }
  if (q8)
    return fill(std::string(kPhase1ChunkQ8), {{"K", std::to_string(k)},
                                              {"ABSMAX", indent(absmax, 4)},
                                              {"LOAD1", indent(load, 6)},
                                              {"STORE1", indent(store, 6)},
                                              {"ACCUMULATE", indent(accumulate, 6)},
                                              {"ENCODE", indent(encode, 4)}});
  return fill(std::string(kPhase1Chunk), {{"K", std::to_string(k)},
                                          {"STATE_BASE", spec.combo_formats.empty() ? "t->state_offset + begin" : "begin"},
                                          {"LOAD1", indent(load, 4)},
                                          {"STORE1", indent(store, 4)},
                                          {"ACCUMULATE", indent(accumulate, 4)}});
}

// A two-phase spec must use the table layout: phase 2 reads each tensor's norms by
// its index in the block table (a flat range has none). Variants: table layout, one
// variant per combination, one-phase programs.
void check_spec(const CudaSpec& spec) {
  for (const DtypeCombo& c : spec.combos)
    if (c.stochastic && (c.weight != DType::bf16 || c.master))
      throw Error(ErrorCode::invalid_argument, "CUDA emitter: a combination with stochastic rounding has " +
                                                   std::string(dtype_name(c.weight)) + (c.master ? " weights and masters" : " weights") +
                                                   " (stochastic rounding is for bf16 weights without fp32 masters)");
  for (const DtypeCombo& c : spec.combos)
    if (c.compensated && (c.weight != DType::bf16 || c.master || c.stochastic))
      throw Error(ErrorCode::invalid_argument, "CUDA emitter: a compensated combination has " +
                                                   std::string(dtype_name(c.weight)) + " weights" +
                                                   (c.master ? " and masters" : "") + (c.stochastic ? " and stochastic rounding" : "") +
                                                   " (compensations are for bf16 weights without masters or stochastic rounding)");
  if (is_two_phase(spec.program) && spec.flat)
    throw Error(ErrorCode::invalid_argument,
                "CUDA emitter: program '" + std::string(spec.program.name) +
                    "' has two phases (per-tensor norms), which need the table layout: flat = false");
  if (!spec.combo_formats.empty()) {
    if (spec.combo_formats.size() != spec.combos.size())
      throw Error(ErrorCode::invalid_argument, "CUDA emitter: combo_formats has " + std::to_string(spec.combo_formats.size()) +
                                                   " entries for " + std::to_string(spec.combos.size()) + " combinations");
    if (spec.flat)
      throw Error(ErrorCode::invalid_argument,
                  "CUDA emitter: state stored as bf16 or q8 is each tensor's own (sf_tensor.state): flat = false");
  }
  if (spec.variants.empty() && spec.combo_variant.empty()) return;
  if (spec.combo_variant.size() != spec.combos.size())
    throw Error(ErrorCode::invalid_argument, "CUDA emitter: combo_variant has " + std::to_string(spec.combo_variant.size()) +
                                                 " entries for " + std::to_string(spec.combos.size()) + " combinations");
  for (const int v : spec.combo_variant)
    if (v < 0 || v > static_cast<int>(spec.variants.size()))
      throw Error(ErrorCode::invalid_argument, "CUDA emitter: combo_variant names variant " + std::to_string(v) + " of " +
                                                   std::to_string(spec.variants.size() + 1));
  if (spec.flat)
    throw Error(ErrorCode::invalid_argument, "CUDA emitter: program variants need the table layout: flat = false");
  for (const Program* p : spec_programs(spec))
    if (is_two_phase(*p))
      throw Error(ErrorCode::unsupported, "CUDA emitter: program '" + std::string(p->name) +
                                              "' has two phases; per-group program variants are one-phase programs only");
}

int max_scalars(const CudaSpec& spec) {
  int n = 0;
  for (const Program* p : spec_programs(spec)) n = std::max(n, static_cast<int>(p->num_scalars));
  return n;
}

}  // namespace

std::string canonical_text(const CudaSpec& spec) {
  std::ostringstream o;
  o << "stepfuse cuda emitter " << kEmitterVersion << "\n"
    << "norm " << (spec.norm == CudaNorm::l2 ? "l2" : "inf") << "\n"
    << "flat " << spec.flat << "\naligned16 " << spec.aligned16 << "\n"
    << (spec.sharded ? "sharded\n" : "") << (spec.stochastic_state ? "" : "nearest state\n")
    << "combos";
  for (const DtypeCombo& c : spec.combos)
    o << " " << dtype_name(c.weight) << "/" << dtype_name(c.grad) << (c.master ? "/master" : "") << (c.stochastic ? "/stochastic" : "")
      << (c.compensated ? "/compensated" : "");
  o << "\nscalars " << static_cast<int>(spec.program.num_scalars) << "\nstreams";
  for (int s = 0; s < spec.program.num_streams; ++s)
    o << " " << spec.program.streams[s].name << ":" << static_cast<int>(spec.program.streams[s].role);
  o << "\nprogram\n" << to_string(spec.program);
  for (std::size_t v = 0; v < spec.variants.size(); ++v) {
    const Program& p = spec.variants[v];
    o << "variant " << v + 1 << "\nscalars " << static_cast<int>(p.num_scalars) << "\nstreams";
    for (int s = 0; s < p.num_streams; ++s) o << " " << p.streams[s].name << ":" << static_cast<int>(p.streams[s].role);
    o << "\nprogram\n" << to_string(p);
  }
  if (!spec.combo_formats.empty()) {
    o << "combo state formats";
    for (const auto& f : spec.combo_formats) {
      o << " ";
      for (const StateFormat x : f) o << state_format_name(x)[0];  // f, b, q
    }
    o << "\n";
  }
  if (!spec.combo_variant.empty()) {
    o << "combo variants";
    for (const int v : spec.combo_variant) o << " " << v;
    o << "\n";
  }
  return o.str();
}

std::vector<const Program*> spec_programs(const CudaSpec& spec) {
  std::vector<const Program*> out{&spec.program};
  for (const Program& p : spec.variants) out.push_back(&p);
  return out;
}

std::vector<std::array<int, kMaxStreams>> cuda_stream_slots(const CudaSpec& spec) {
  const std::vector<const Program*> programs = spec_programs(spec);
  std::vector<std::array<int, kMaxStreams>> slots(programs.size());
  std::vector<std::string_view> names(kMaxStreams);  // each buffer's stream name ("" : free)
  int next = spec.program.num_streams;                  // variant 0 keeps its indices
  for (std::size_t v = 0; v < programs.size(); ++v) {
    const Program& p = *programs[v];
    slots[v].fill(-1);
    for (int s = 0; s < p.num_streams; ++s) {
      if (p.streams[s].role != StreamRole::state) continue;
      const std::string_view name = p.streams[s].name;
      if (v == 0) {
        slots[v][static_cast<std::size_t>(s)] = s;
        names[static_cast<std::size_t>(s)] = name;
        continue;
      }
      const auto same = std::find(names.begin(), names.end(), name);
      if (same != names.end()) {
        slots[v][static_cast<std::size_t>(s)] = static_cast<int>(same - names.begin());
        continue;
      }
      if (next >= kMaxStreams)
        throw Error(ErrorCode::unsupported,
                    "CUDA emitter: the program variants of '" + std::string(spec.program.name) + "' have more than " +
                        std::to_string(kMaxStreams) + " streams together (grad, param and every state)");
      names[static_cast<std::size_t>(next)] = name;
      slots[v][static_cast<std::size_t>(s)] = next++;
    }
  }
  return slots;
}

const std::string& cuda_embedded_headers() {
  static const std::string text =
      std::string(embedded_file("jit/cuda/device_prelude.cuh")) + "\n" + std::string(embedded_file("jit/step_scalars.h")) +
      "\n" + std::string(embedded_file("jit/step_stage.h")) + "\n" + std::string(embedded_file("jit/stochastic_round.h")) +
      "\n" + std::string(embedded_file("jit/cuda/device_abi.h")) + "\n";
  return text;
}

std::string emit_element_functions(const CudaSpec& spec) {
  // One function for every combination: it works on fp32 values, and the span
  // functions around it do each combination's loads and stores. A two-phase
  // program has one per phase: sf_body1 (phase 1) and sf_body (phase 2).
  if (!is_two_phase(spec.program)) {
    std::string out = cuda_embedded_headers() + element_function(spec.program, "sf_body");
    for (std::size_t v = 0; v < spec.variants.size(); ++v)
      out += element_function(spec.variants[v], body_name(static_cast<int>(v) + 1));
    return out;
  }
  return cuda_embedded_headers() + element_function(phase_program(spec.program, 0), "sf_body1", Part::phase1) +
         element_function(phase_program(spec.program, 1), "sf_body", Part::phase2);
}

namespace {

// The reduce kernel's part of a spec: what it depends on (the grad dtype of
// each combination, the norm, the number of scalars), not the update program.
std::string reduce_part(const CudaSpec& spec) {
  std::string out;
  const bool l2 = spec.norm == CudaNorm::l2;
  out += kReduceCommon;
  bool have_grad[3] = {};
  for (const DtypeCombo& c : spec.combos) {
    if (have_grad[static_cast<int>(c.grad)]) continue;
    have_grad[static_cast<int>(c.grad)] = true;
    const bool wide = c.grad == DType::f32;
    out += fill(std::string(l2 ? kReduceChunkL2 : kReduceChunkInf), {{"G", std::string(dtype_tag(c.grad))},
                                                                         {"E", wide ? "float" : "sf_u16"},
                                                                         {"V", wide ? "4" : "8"}});
  }
  // One case per grad dtype (the combinations sharing it fall through), so each
  // chunk function is inlined once: a 15-combination list compiles ~5x faster.
  std::string reduce_cases;
  for (DType g : {DType::f32, DType::f16, DType::bf16}) {
    if (!have_grad[static_cast<int>(g)]) continue;
    for (std::size_t k = 0; k < spec.combos.size(); ++k)
      if (spec.combos[k].grad == g) reduce_cases += "      case " + std::to_string(k) + ":\n";
    reduce_cases += "        r = sf_reduce_chunk_" + std::string(dtype_tag(g)) + "(t->grad, ch.begin, ch.len, lane, stage[warp]);\n        break;\n";
  }
  if (!reduce_cases.empty()) reduce_cases.pop_back();
  out += fill(std::string(kReduceKernel),
              {{"PARTIAL_VALUE", l2 ? "p->sumsq" : "(double)p->maxabs"},
               {"NORM_COMBINE", l2 ? "acc = acc + v[i];" : "acc = acc < v[i] ? v[i] : acc;"},
               {"TOTAL_COMBINE", l2 ? "total = total + x;" : "total = total < x ? x : total;"},
               {"NORM_OF_TOTAL", l2 ? "sqrt(total)" : "total"},
               {"NUM_SCALARS", std::to_string(max_scalars(spec))},
               {"REDUCE_CASES", reduce_cases}});
  if (spec.sharded)
    out += std::string(kShardAbi) + "\n" +
           fill(std::string(kShardKernel), {{"PARTIAL_VALUE", l2 ? "p->sumsq" : "(double)p->maxabs"},
                                            {"COMBINE", l2 ? "acc + x" : "acc < x ? x : acc"},
                                            {"NORM_OF_TOTAL", l2 ? "sqrt(total)" : "total"}});
  return out;
}

// The update kernel's part: one span function per combination, dispatched on
// the tensor's combo (or one flat range). A two-phase program's also holds
// sf_phase1 and sf_phase_combine (phase1_kernel.cuh), which use the reduce's lane
// tree: with_reduce_common adds its definitions (not when the reduce part is in the
// same source already).
std::string update_part(const CudaSpec& spec, bool with_reduce_common) {
  check_spec(spec);
  const bool two_phase = is_two_phase(spec.program);
  const Program prog = two_phase ? phase_program(spec.program, 1) : spec.program;
  std::string out;
  if (two_phase) {
    if (with_reduce_common) out += kReduceCommon;
    const Program phase1 = phase_program(spec.program, 0);
    if (spec_has_q8(spec)) out += kQ8Strided;
    std::string cases;
    for (std::size_t k = 0; k < spec.combos.size(); ++k) {
      out += phase1_chunk(phase1, spec, static_cast<int>(k));
      cases += "    case " + std::to_string(k) + ": sf_phase1_chunk_" + std::to_string(k) +
               "(t, ch.begin, ch.len, lane, &streams, sc, acc, hyper.seed, sr_step" + (combo_has_q8(spec, k) ? ", q8s" : "") +
               "); break;\n";
    }
    if (!cases.empty()) cases.pop_back();
    // With q8 state, the maps in shared memory (q8s), copied once the step is known to apply.
    const std::string q8_maps =
        spec_has_q8(spec) ? "\n  __shared__ float q8s[4 * SF_Q8_BLOCK];  /* the q8 maps (sf_hyper.q8_maps) */\n"
                            "  for (int k = (int)threadIdx.x; k < 4 * SF_Q8_BLOCK; k += 32 * SF_REDUCE_WARPS) q8s[k] = hyper.q8_maps[k];\n"
                            "  __syncthreads();"
                          : "";
    out += fill(std::string(kPhase1Kernel),
                {{"NUM_SCALARS", std::to_string(prog.num_scalars)}, {"PHASE1_CASES", cases}, {"Q8_MAPS", q8_maps}});
  }
  const std::vector<const Program*> programs = spec_programs(spec);
  const std::vector<std::array<int, kMaxStreams>> slots = cuda_stream_slots(spec);
  for (std::size_t k = 0; k < spec.combos.size(); ++k) {
    const int v = variant_of(spec, k);
    out += update_span(v == 0 ? prog : *programs[static_cast<std::size_t>(v)], spec, static_cast<int>(k), two_phase,
                       slots[static_cast<std::size_t>(v)]);
  }
  std::string dispatch;
  if (spec.flat) {
    dispatch =
        "  const long long begin = (long long)blockIdx.x * SF_UPDATE_ELEMS;\n"
        "  const long long rest = flat_numel - begin;\n"
        "  sf_update_span_0(&tensors[0], begin, rest < SF_UPDATE_ELEMS ? (int)rest : SF_UPDATE_ELEMS, &streams, sc, hyper.seed, sr_step);";
  } else {
    dispatch = "  const sf_span b = blocks[blockIdx.x];\n  const sf_tensor* t = &tensors[b.tensor];\n  switch (t->combo) {\n";
    for (std::size_t k = 0; k < spec.combos.size(); ++k)
      dispatch += "    case " + std::to_string(k) + ": sf_update_span_" + std::to_string(k) + "(t, b.begin, b.len, &streams, sc, hyper.seed, sr_step" +
                  (combo_has_q8(spec, k) ? ", q8s" : "") +
                  (two_phase ? ", norms + (long long)b.tensor * SF_MAX_NORM_SLOTS" : "") + "); break;\n";
    dispatch += "    default: break;\n  }";
  }
  const std::string q8_maps =
      spec_has_q8(spec) ? "  __shared__ float q8s[4 * SF_Q8_BLOCK];  // the q8 maps (sf_hyper.q8_maps)\n"
                          "  for (int k = (int)threadIdx.x; k < 4 * SF_Q8_BLOCK; k += SF_UPDATE_THREADS) q8s[k] = hyper.q8_maps[k];"
                        : "";
  out += fill(std::string(kUpdateKernel), {{"Q8_MAPS", q8_maps},
                                           {"NUM_SCALARS", std::to_string(max_scalars(spec))},
                                           {"DISPATCH", dispatch},
                                           {"EXTRA_PARAMS", two_phase ? ", const float* SF_RESTRICT norms" : ""}});
  return out;
}

std::string header(const std::string& what, const std::string& key) {
  return "/* Generated by stepfuse: " + what + ". Spec:\n" + key + "*/\n";
}

}  // namespace

std::string reduce_canonical_text(const CudaSpec& spec) {
  std::ostringstream o;
  o << "stepfuse cuda emitter " << kEmitterVersion << ", reduce kernel\n"
    << "norm " << (spec.norm == CudaNorm::l2 ? "l2" : "inf") << "\ngrads";
  for (const DtypeCombo& c : spec.combos) o << " " << dtype_name(c.grad);
  o << "\nscalars " << max_scalars(spec) << "\n" << (spec.sharded ? "sharded\n" : "");
  return o.str();
}

std::string emit_cuda_reduce(const CudaSpec& spec) {
  return header("reduce kernel", reduce_canonical_text(spec)) + cuda_embedded_headers() + std::string(kVectorIo) +
         reduce_part(spec);
}

std::string emit_cuda_update(const CudaSpec& spec) {
  return header("update kernel", canonical_text(spec)) + emit_element_functions(spec) + std::string(kVectorIo) +
         update_part(spec, /*with_reduce_common=*/true);
}

std::string emit_cuda(const CudaSpec& spec) {
  return header("step kernels", canonical_text(spec)) + emit_element_functions(spec) + std::string(kVectorIo) +
         reduce_part(spec) + update_part(spec, /*with_reduce_common=*/false);
}

std::vector<std::string> cuda_update_kernel_names(const Program& program) {
  if (is_two_phase(program)) return {"sf_phase1", "sf_phase_combine", "sf_update"};
  return {"sf_update"};
}

std::string emit_cuda_utilities() {
  std::string out = "/* Generated by stepfuse: utility kernels, emitter version " + std::to_string(kEmitterVersion) + ". */\n";
  out += cuda_embedded_headers();
  out += kScalerKernels;
  for (DType d : {DType::f32, DType::f16, DType::bf16}) out += fill(std::string(kScaleKernels), {{"D", std::string(dtype_tag(d))}});
  return out;
}

}  // namespace stepfuse::jit
