// Test-only: the specs whose generated CUDA sources are compiled into
// cuda_emulation_test (by emit_sources.cpp at build time). The test builds
// tensor lists with these dtype combinations, and finds each list's kernels by
// the canonical text of the spec plan_cuda_layout() makes for it.
#pragma once

#include <cstddef>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "jit/builtin/registry.hpp"
#include "jit/builtins.hpp"
#include "jit/cuda/cuda_layout.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/program_analysis.hpp"
#include "stepfuse/optimizer.hpp"
#include "tests/reference/lars_program.hpp"

namespace sf_emu {

using stepfuse::DType;
using stepfuse::jit::DtypeCombo;

// Tensor i of a mixed list has combination combos[i % size], so the first-use
// order (the spec's combo order) is this order.
inline const std::vector<DtypeCombo> kMixedMasters = {
    {DType::f32, DType::f32, false},  {DType::bf16, DType::bf16, true}, {DType::f16, DType::f16, true},
    {DType::bf16, DType::f32, true},  {DType::f32, DType::bf16, false}};
inline const std::vector<DtypeCombo> kMixedNoMasters = {
    {DType::f32, DType::f32, false}, {DType::bf16, DType::bf16, false}, {DType::f16, DType::f16, false}};
inline const std::vector<DtypeCombo> kBf16Masters = {{DType::bf16, DType::bf16, true}};
// Stochastic rounding (OptimizerOptions::stochastic_rounding, no masters): f32 weights
// stay exact, bf16 ones round stochastically.
inline const std::vector<DtypeCombo> kMixedStochastic = {
    {DType::f32, DType::f32, false}, {DType::bf16, DType::bf16, false, true}, {DType::bf16, DType::f32, false, true}};
inline const std::vector<DtypeCombo> kBf16Stochastic = {{DType::bf16, DType::bf16, false, true}};
inline const std::vector<DtypeCombo> kF16Masters = {{DType::f16, DType::f16, true}};
// Compensated weights (OptimizerOptions::compensated_weights, no masters): f32 weights
// stay as they are, bf16 ones carry a bf16 compensation in the master buffer.
inline const std::vector<DtypeCombo> kMixedCompensated = {{DType::f32, DType::f32, false},
                                                          {DType::bf16, DType::bf16, false, false, true},
                                                          {DType::bf16, DType::f16, false, false, true}};
inline const std::vector<DtypeCombo> kBf16Compensated = {{DType::bf16, DType::bf16, false, false, true}};

// The sharded tests' model: f32 tensors and bf16 ones with masters, each rank's list
// starting with an f32 one and holding a bf16 one (so every rank has this spec).
inline const std::vector<DtypeCombo> kShardCombos = {{DType::f32, DType::f32, false}, {DType::bf16, DType::bf16, true}};
// The same model with its bf16 weights rounded stochastically (no masters).
inline const std::vector<DtypeCombo> kShardStochastic = {{DType::f32, DType::f32, false},
                                                         {DType::bf16, DType::bf16, false, true}};

struct EmulatedSpec {
  std::string name;  // a C identifier
  stepfuse::jit::CudaSpec spec;
};

inline stepfuse::jit::CudaSpec make_spec(stepfuse::jit::Builtin b, std::vector<DtypeCombo> combos, bool flat, bool aligned16,
                                         stepfuse::jit::CudaNorm norm = stepfuse::jit::CudaNorm::l2) {
  stepfuse::jit::CudaSpec s;
  s.program = stepfuse::jit::builtin_program(b);
  s.combos = std::move(combos);
  s.flat = flat;
  s.aligned16 = aligned16;
  s.norm = norm;
  return s;
}

// Param groups whose programs differ: the spec CudaBackend makes (jit::assign_groups) for
// the suite's aligned model of mixed combinations (tensor i: combos[i % size]) in groups of
// `sizes` consecutive tensors, group g running programs[g].
inline stepfuse::jit::CudaSpec groups_spec(const std::vector<stepfuse::jit::Builtin>& programs,
                                           const std::vector<std::size_t>& sizes, const std::vector<DtypeCombo>& combos) {
  std::vector<stepfuse::jit::TensorShape> shapes;
  std::vector<std::uint32_t> tensor_group;
  for (std::size_t g = 0; g < sizes.size(); ++g)
    for (std::size_t j = 0; j < sizes[g]; ++j) {
      shapes.push_back({1, combos[shapes.size() % combos.size()]});
      tensor_group.push_back(static_cast<std::uint32_t>(g));
    }
  stepfuse::jit::CudaLayout l = stepfuse::jit::plan_cuda_layout(stepfuse::jit::builtin_program(programs[0]), shapes,
                                                               stepfuse::jit::CudaNorm::l2, false, true);
  std::vector<const stepfuse::Program*> group_programs;
  for (const stepfuse::jit::Builtin b : programs) group_programs.push_back(&stepfuse::jit::builtin_program(b));
  stepfuse::jit::assign_groups(l, group_programs, tensor_group);
  return l.spec;
}

// ---- state stored as bf16 or q8 (OptimizerOptions::state_format) ----

// The suite's model for compressed state: tensors of these sizes, some at least
// min_q8_numel (4096) elements (q8), some smaller (f32 whatever the options say), over
// several reduce chunks and update blocks, with short q8 blocks at their ends.
inline const std::vector<std::int64_t> kPackedSizes = {1, 4097, 3, 16385, 0, 40000, 33, 5, 4096, 17, 2, 8200};

// How a tensor of n elements stores each stream of program p (as StepEngine resolves
// the options: the blanket format, full-precision streams f32, state_formats by name,
// q8 below min_q8_numel f32).
inline std::array<stepfuse::StateFormat, stepfuse::kMaxStreams> state_formats_of(const stepfuse::Program& p, std::int64_t n,
                                                                                  const stepfuse::OptimizerOptions& o) {
  using stepfuse::StateFormat;
  std::array<StateFormat, stepfuse::kMaxStreams> out;
  out.fill(StateFormat::f32);
  for (int s = 0; s < p.num_streams; ++s) {
    if (p.streams[s].role != stepfuse::StreamRole::state) continue;
    StateFormat f = p.streams[s].values == stepfuse::StateValues::full_precision ? StateFormat::f32 : o.state_format;
    for (const auto& [name, format] : o.state_formats)
      if (name == p.streams[s].name) f = format;
    if (f == StateFormat::q8 && n < o.min_q8_numel) f = StateFormat::f32;
    out[static_cast<std::size_t>(s)] = f;
  }
  return out;
}

// Options storing state as `format`, some streams otherwise (state_formats).
inline stepfuse::OptimizerOptions state_options(stepfuse::StateFormat format,
                                                std::vector<std::pair<std::string, stepfuse::StateFormat>> streams = {}) {
  stepfuse::OptimizerOptions o;
  o.state_format = format;
  o.state_formats = std::move(streams);
  return o;
}

// The spec CudaBackend makes for the suite's model of kPackedSizes (tensor i: combos[i %
// size]) in groups of `group_sizes` consecutive tensors running `programs`, with options o.
inline stepfuse::jit::CudaSpec packed_spec(const std::vector<const stepfuse::Program*>& programs,
                                           const std::vector<std::size_t>& group_sizes,
                                           const std::vector<DtypeCombo>& combos, const stepfuse::OptimizerOptions& o,
                                           bool aligned16 = true) {
  std::vector<stepfuse::jit::TensorShape> shapes;
  std::vector<std::uint32_t> tensor_group;
  std::vector<std::array<stepfuse::StateFormat, stepfuse::kMaxStreams>> formats;
  for (std::size_t g = 0; g < group_sizes.size(); ++g)
    for (std::size_t j = 0; j < group_sizes[g]; ++j) {
      const std::int64_t n = kPackedSizes[shapes.size()];
      shapes.push_back({n, combos[shapes.size() % combos.size()]});
      tensor_group.push_back(static_cast<std::uint32_t>(g));
      formats.push_back(state_formats_of(*programs[g], n, o));
    }
  stepfuse::jit::CudaLayout l = stepfuse::jit::plan_cuda_layout(
      *programs[0], shapes, o.norm_type == INFINITY ? stepfuse::jit::CudaNorm::inf : stepfuse::jit::CudaNorm::l2, false,
      aligned16);
  stepfuse::jit::assign_groups(l, programs, tensor_group);
  stepfuse::jit::assign_state_formats(l, formats, o.stochastic_state_rounding);
  return l.spec;
}
inline stepfuse::jit::CudaSpec packed_spec(stepfuse::jit::Builtin b, const std::vector<DtypeCombo>& combos,
                                           const stepfuse::OptimizerOptions& o, bool aligned16 = true) {
  return packed_spec({&stepfuse::jit::builtin_program(b)}, {kPackedSizes.size()}, combos, o, aligned16);
}

// The built-ins with one phase and state that may be compressed: each runs with q8
// state in EmulatedQ8.
inline std::vector<stepfuse::jit::Builtin> q8_builtins() {
  std::vector<stepfuse::jit::Builtin> out;
  for (int b = 0; b < stepfuse::jit::kNumBuiltins; ++b) {
    const stepfuse::Program& p = stepfuse::jit::builtin_program(static_cast<stepfuse::jit::Builtin>(b));
    bool state = false;
    for (int s = 0; s < p.num_streams; ++s)
      state = state || (p.streams[s].role == stepfuse::StreamRole::state &&
                        p.streams[s].values != stepfuse::StateValues::full_precision);
    if (state && !stepfuse::jit::is_two_phase(p)) out.push_back(static_cast<stepfuse::jit::Builtin>(b));
  }
  return out;
}

// Every built-in program with the mixed combinations (table layout, aligned, L2),
// then the layout and norm variants, on Adam; then two-phase variants.
inline std::vector<EmulatedSpec> emulated_specs() {
  using stepfuse::jit::Builtin;
  using stepfuse::jit::CudaNorm;
  constexpr Builtin kAdam = stepfuse::jit::builtin_named("adam"), kLion = stepfuse::jit::builtin_named("lion");
  std::vector<EmulatedSpec> out;
  for (int b = 0; b < stepfuse::jit::kNumBuiltins; ++b) {
    const auto builtin = static_cast<Builtin>(b);
    out.push_back({std::string(stepfuse::jit::builtin_program(builtin).name), make_spec(builtin, kMixedMasters, false, true)});
  }
  out.push_back({"adam_no_masters", make_spec(kAdam, kMixedNoMasters, false, true)});
  out.push_back({"adam_stochastic", make_spec(kAdam, kMixedStochastic, false, true)});
  out.push_back({"adam_stochastic_unaligned", make_spec(kAdam, kMixedStochastic, false, false)});
  out.push_back({"adam_flat_stochastic", make_spec(kAdam, kBf16Stochastic, true, true)});
  out.push_back({"adam_compensated", make_spec(kAdam, kMixedCompensated, false, true)});
  out.push_back({"adam_compensated_unaligned", make_spec(kAdam, kMixedCompensated, false, false)});
  out.push_back({"adam_flat_compensated", make_spec(kAdam, kBf16Compensated, true, true)});
  out.push_back({"adam_unaligned", make_spec(kAdam, kMixedMasters, false, false)});
  out.push_back({"adam_inf", make_spec(kAdam, kMixedMasters, false, true, CudaNorm::inf)});
  out.push_back({"adam_flat", make_spec(kAdam, kBf16Masters, true, true)});
  out.push_back({"adam_flat_unaligned", make_spec(kAdam, kF16Masters, true, false)});
  out.push_back({"lion_flat_inf", make_spec(kLion, kBf16Masters, true, true, CudaNorm::inf)});
  // Two-phase programs: LAMB unaligned with the inf-norm, and a user's LARS (custom).
  constexpr Builtin kLamb = stepfuse::jit::builtin_named("lamb");
  out.push_back({"lamb_unaligned_inf", make_spec(kLamb, kMixedMasters, false, false, CudaNorm::inf)});
  out.push_back({"lamb_compensated_unaligned", make_spec(kLamb, kMixedCompensated, false, false)});
  stepfuse::jit::CudaSpec lars = make_spec(kLamb, kMixedMasters, false, true);
  lars.program = stepfuse::ref::kLars;
  out.push_back({"lars", lars});
  // Param groups running different variants of a program (EmulatedStep.ProgramVariantsPerGroupMatchTheCpu).
  using stepfuse::jit::builtin_named;
  out.push_back({"adam_groups", groups_spec({builtin_named("adam"), builtin_named("adam_amsgrad"), builtin_named("adam")},
                                            {4, 3, 4}, kMixedMasters)});
  out.push_back({"rmsprop_groups", groups_spec({builtin_named("rmsprop"), builtin_named("rmsprop_centered_momentum"),
                                                builtin_named("rmsprop")},
                                               {5, 3, 3}, kMixedMasters)});
  out.push_back({"sgd_groups", groups_spec({builtin_named("sgd_momentum"), builtin_named("sgd"), builtin_named("sgd_nesterov")},
                                           {4, 4, 3}, kMixedMasters)});
  // The sharded step (OptimizerOptions::communicator): L2 and inf norms; LAMB's two phases.
  const auto sharded = [](stepfuse::jit::CudaSpec spec) {
    spec.sharded = true;
    return spec;
  };
  out.push_back({"adam_sharded", sharded(make_spec(kAdam, kShardCombos, false, true))});
  out.push_back({"adam_inf_sharded", sharded(make_spec(kAdam, kShardCombos, false, true, CudaNorm::inf))});
  out.push_back({"lamb_sharded", sharded(make_spec(kLamb, kShardCombos, false, true))});
  out.push_back({"adam_sharded_stochastic", sharded(make_spec(kAdam, kShardStochastic, false, true))});
  // Compressed state: every one-phase built-in with q8 state; bf16 state (Adam, and LAMB's
  // two phases); the q8 step with bf16 weights rounded stochastically; unaligned; per-stream
  // formats; groups running variants; LAMB with q8.
  using stepfuse::StateFormat;
  const stepfuse::OptimizerOptions q8 = state_options(StateFormat::q8);
  for (const Builtin b : q8_builtins())
    out.push_back({std::string(stepfuse::jit::builtin_program(b).name) + "_q8", packed_spec(b, kMixedMasters, q8)});
  out.push_back({"adam_bf16_state", packed_spec(kAdam, kMixedMasters, state_options(StateFormat::bf16))});
  out.push_back({"lamb_bf16_state", packed_spec(kLamb, kMixedMasters, state_options(StateFormat::bf16))});
  out.push_back({"adam_q8_stochastic", packed_spec(kAdam, kMixedStochastic, q8)});
  out.push_back({"adam_q8_unaligned", packed_spec(kAdam, kMixedMasters, q8, false)});
  out.push_back({"adam_q8_bf16_second_moment",
                 packed_spec(kAdam, kMixedMasters, state_options(StateFormat::q8, {{"exp_avg_sq", StateFormat::bf16}}))});
  {  // The sharded step with q8 state in every tensor (min_q8_numel = 0).
    stepfuse::jit::CudaSpec spec = sharded(make_spec(kAdam, kShardCombos, false, true));
    std::array<StateFormat, stepfuse::kMaxStreams> q8_moments;
    q8_moments.fill(StateFormat::f32);
    q8_moments[2] = q8_moments[3] = StateFormat::q8;  // exp_avg, exp_avg_sq
    spec.combo_formats.assign(spec.combos.size(), q8_moments);
    out.push_back({"adam_sharded_q8", spec});
  }
  out.push_back({"adam_groups_q8", packed_spec({&stepfuse::jit::builtin_program(builtin_named("adam")),
                                                &stepfuse::jit::builtin_program(builtin_named("adam_amsgrad")),
                                                &stepfuse::jit::builtin_program(builtin_named("adam"))},
                                               {4, 4, 4}, kMixedMasters, q8)});
  // LAMB's two phases with q8 state: phase 1 stores its moments a strided block at a time.
  out.push_back({"lamb_q8", packed_spec(kLamb, kMixedMasters, q8)});
  // bf16 state beside bf16 weights rounded stochastically: rounded stochastically too, with
  // each stream's own bits (the 4-element stores, the unaligned one-element ones, and LAMB's
  // phase 1, which stores its moments).
  stepfuse::OptimizerOptions bf16_sr = state_options(StateFormat::bf16);
  bf16_sr.master_weights = false;
  bf16_sr.stochastic_rounding = true;
  out.push_back({"adam_bf16_state_stochastic", packed_spec(kAdam, kMixedStochastic, bf16_sr)});
  out.push_back({"adam_bf16_state_stochastic_unaligned", packed_spec(kAdam, kMixedStochastic, bf16_sr, false)});
  out.push_back({"lamb_bf16_state_stochastic", packed_spec(kLamb, kMixedStochastic, bf16_sr)});
  stepfuse::OptimizerOptions bf16_nearest = bf16_sr;  // stochastic weights, nearest bf16 state
  bf16_nearest.stochastic_state_rounding = false;
  out.push_back({"adam_bf16_state_nearest_beside_stochastic", packed_spec(kAdam, kMixedStochastic, bf16_nearest)});
  return out;
}

}  // namespace sf_emu
