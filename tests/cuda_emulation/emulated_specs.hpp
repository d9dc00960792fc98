// Test-only: the specs whose generated CUDA sources are compiled into
// cuda_emulation_test (by emit_sources.cpp at build time). The test builds
// tensor lists with these dtype combinations, and finds each list's kernels by
// the canonical text of the spec plan_cuda_layout() makes for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "jit/builtin/registry.hpp"
#include "jit/builtins.hpp"
#include "jit/cuda/cuda_layout.hpp"
#include "jit/cuda/emit_cuda.hpp"
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
  return out;
}

}  // namespace sf_emu
