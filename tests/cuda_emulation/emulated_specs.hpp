// Test-only: the specs whose generated CUDA sources are compiled into
// cuda_emulation_test (by emit_sources.cpp at build time). The test builds
// tensor lists with these dtype combinations, and finds each list's kernels by
// the canonical text of the spec plan_cuda_layout() makes for it.
#pragma once

#include <string>
#include <vector>

#include "jit/builtin/registry.hpp"
#include "jit/builtins.hpp"
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
inline const std::vector<DtypeCombo> kF16Masters = {{DType::f16, DType::f16, true}};

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
  out.push_back({"adam_unaligned", make_spec(kAdam, kMixedMasters, false, false)});
  out.push_back({"adam_inf", make_spec(kAdam, kMixedMasters, false, true, CudaNorm::inf)});
  out.push_back({"adam_flat", make_spec(kAdam, kBf16Masters, true, true)});
  out.push_back({"adam_flat_unaligned", make_spec(kAdam, kF16Masters, true, false)});
  out.push_back({"lion_flat_inf", make_spec(kLion, kBf16Masters, true, true, CudaNorm::inf)});
  // Two-phase programs: LAMB unaligned with the inf-norm, and a user's LARS (custom).
  constexpr Builtin kLamb = stepfuse::jit::builtin_named("lamb");
  out.push_back({"lamb_unaligned_inf", make_spec(kLamb, kMixedMasters, false, false, CudaNorm::inf)});
  stepfuse::jit::CudaSpec lars = make_spec(kLamb, kMixedMasters, false, true);
  lars.program = stepfuse::ref::kLars;
  out.push_back({"lars", lars});
  return out;
}

}  // namespace sf_emu
