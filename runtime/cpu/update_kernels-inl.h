// Body shared by runtime/cpu/update_kernels_<k>.cpp: instantiates, for every
// Highway target, the fused kernels of the built-in programs k, k + kUpdateSlices,
// k + 2 * kUpdateSlices, ... (jit/builtin/registry.hpp's order) and exports a
// lookup by the program's place in this slice. The including file defines
// STEPFUSE_UPDATE_SLICE (k), STEPFUSE_UPDATE_LOOKUP and STEPFUSE_UPDATE_DISPATCH
// (the name runtime/cpu/update.cpp calls) and sets HWY_TARGET_INCLUDE to itself.
// The programs are dealt round-robin over kUpdateSlices translation units only so
// the ~800 kernel instantiations compile in parallel, in slices of similar size.

#include <cstddef>
#include <utility>

// The phase-1 lookup and dispatch of this slice, named after the update's
// (GetUpdateKernel0Phase1, update_kernel_0_phase1).
#ifndef STEPFUSE_UPDATE_CAT
#define STEPFUSE_UPDATE_CAT_(a, b) a##b
#define STEPFUSE_UPDATE_CAT(a, b) STEPFUSE_UPDATE_CAT_(a, b)
#endif
#define STEPFUSE_PHASE1_LOOKUP STEPFUSE_UPDATE_CAT(STEPFUSE_UPDATE_LOOKUP, Phase1)
#define STEPFUSE_PHASE1_DISPATCH STEPFUSE_UPDATE_CAT(STEPFUSE_UPDATE_DISPATCH, _phase1)

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "jit/builtin/registry.hpp"
#include "runtime/cpu/fused_update-inl.h"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace update_slice {

inline constexpr std::size_t kSlice = STEPFUSE_UPDATE_SLICE, kStride = kUpdateSlices;
static_assert(kSlice < kStride);
inline constexpr std::size_t kNum = jit::kBuiltinPrograms.size();
inline constexpr std::size_t kSize = kNum > kSlice ? (kNum - kSlice + kStride - 1) / kStride : 0;

template <std::size_t... I>
FusedTable<*jit::kBuiltinPrograms[kSlice + I * kStride]...> table_of(std::index_sequence<I...>);

}  // namespace update_slice

UpdateFn STEPFUSE_UPDATE_LOOKUP(int slot, int combo) {
  if constexpr (update_slice::kSize == 0) {
    return nullptr;
  } else {
    using Table = decltype(update_slice::table_of(std::make_index_sequence<update_slice::kSize>{}));
    return Table::Get(slot, combo);
  }
}

Phase1Fn STEPFUSE_PHASE1_LOOKUP(int slot, int combo) {
  if constexpr (update_slice::kSize == 0) {
    return nullptr;
  } else {
    using Table = decltype(update_slice::table_of(std::make_index_sequence<update_slice::kSize>{}));
    return Table::GetPhase1(slot, combo);
  }
}

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace stepfuse::cpu {
HWY_EXPORT(STEPFUSE_UPDATE_LOOKUP);
HWY_EXPORT(STEPFUSE_PHASE1_LOOKUP);
// Declared in runtime/cpu/update.cpp.
UpdateFn STEPFUSE_UPDATE_DISPATCH(int slot, int combo) {
  return HWY_DYNAMIC_DISPATCH(STEPFUSE_UPDATE_LOOKUP)(slot, combo);
}
Phase1Fn STEPFUSE_PHASE1_DISPATCH(int slot, int combo) {
  return HWY_DYNAMIC_DISPATCH(STEPFUSE_PHASE1_LOOKUP)(slot, combo);
}
}  // namespace stepfuse::cpu
#endif
