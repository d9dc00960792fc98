// The fused update kernels by built-in program: program b is in slice
// b % kUpdateSlices, at place b / kUpdateSlices (runtime/cpu/update_kernels-inl.h).
#include <iterator>

#include "runtime/cpu/kernels.hpp"

namespace stepfuse::cpu {

// Defined in runtime/cpu/update_kernels_<k>.cpp; `slot` is the place in the slice.
UpdateFn update_kernel_0(int slot, int combo);
UpdateFn update_kernel_1(int slot, int combo);
UpdateFn update_kernel_2(int slot, int combo);
UpdateFn update_kernel_3(int slot, int combo);
UpdateFn update_kernel_4(int slot, int combo);
Phase1Fn update_kernel_0_phase1(int slot, int combo);
Phase1Fn update_kernel_1_phase1(int slot, int combo);
Phase1Fn update_kernel_2_phase1(int slot, int combo);
Phase1Fn update_kernel_3_phase1(int slot, int combo);
Phase1Fn update_kernel_4_phase1(int slot, int combo);

namespace {
// The tables' column: the combo, or its bf16-state variant after the others (-1: none).
int column(const jit::DtypeCombo& combo, StateKernel state) {
  if (state == StateKernel::f32) return combo.index();
  const int k = jit::bf16_state_index(combo, state == StateKernel::bf16_nearest);
  return k < 0 ? -1 : jit::kNumComboIndices + k;
}
}  // namespace

UpdateFn fused_update_kernel(jit::Builtin program, const jit::DtypeCombo& combo, StateKernel state) {
  static constexpr UpdateFn (*kSlices[])(int, int) = {&update_kernel_0, &update_kernel_1, &update_kernel_2,
                                                      &update_kernel_3, &update_kernel_4};
  static_assert(std::size(kSlices) == kUpdateSlices, "one runtime/cpu/update_kernels_<k>.cpp per slice");
  const int b = static_cast<int>(program);
  if (b >= jit::kNumBuiltins) return nullptr;
  const int c = column(combo, state);
  if (c < 0) return nullptr;
  return kSlices[b % kUpdateSlices](b / kUpdateSlices, c);
}

Phase1Fn fused_phase1_kernel(jit::Builtin program, const jit::DtypeCombo& combo, StateKernel state) {
  static constexpr Phase1Fn (*kSlices[])(int, int) = {&update_kernel_0_phase1, &update_kernel_1_phase1,
                                                      &update_kernel_2_phase1, &update_kernel_3_phase1,
                                                      &update_kernel_4_phase1};
  static_assert(std::size(kSlices) == kUpdateSlices, "one runtime/cpu/update_kernels_<k>.cpp per slice");
  const int b = static_cast<int>(program);
  if (b >= jit::kNumBuiltins) return nullptr;
  const int c = column(combo, state);
  if (c < 0) return nullptr;
  return kSlices[b % kUpdateSlices](b / kUpdateSlices, c);
}

}  // namespace stepfuse::cpu
