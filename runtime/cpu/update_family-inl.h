// Body shared by runtime/cpu/update_<family>.cpp: instantiates the fused
// kernels of one optimizer family for every Highway target and exports a
// lookup. The including file defines STEPFUSE_FAMILY (0..4) and sets
// HWY_TARGET_INCLUDE to itself. Split in five translation units only so the
// ~800 kernel instantiations compile in parallel.

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "jit/builtin/adagrad.hpp"
#include "jit/builtin/adam.hpp"
#include "jit/builtin/lion.hpp"
#include "jit/builtin/rmsprop.hpp"
#include "jit/builtin/sgd.hpp"
#include "runtime/cpu/fused_update-inl.h"

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace family {
#if STEPFUSE_FAMILY == 0
using Table = FusedTable<jit::kSgd, jit::kSgdMomentum, jit::kSgdNesterov>;
#elif STEPFUSE_FAMILY == 1
using Table = FusedTable<jit::kAdam, jit::kAdamAmsgrad>;
#elif STEPFUSE_FAMILY == 2
using Table = FusedTable<jit::kAdagrad>;
#elif STEPFUSE_FAMILY == 3
using Table = FusedTable<jit::kRmsprop, jit::kRmspropCentered, jit::kRmspropMomentum, jit::kRmspropCenteredMomentum>;
#else
using Table = FusedTable<jit::kLion>;
#endif
}  // namespace family
UpdateFn STEPFUSE_FAMILY_LOOKUP(int program, int combo) { return family::Table::Get(program, combo); }
}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace stepfuse::cpu {
HWY_EXPORT(STEPFUSE_FAMILY_LOOKUP);
// Declared in runtime/cpu/update.cpp's registry.
UpdateFn STEPFUSE_FAMILY_DISPATCH(int program, int combo) {
  return HWY_DYNAMIC_DISPATCH(STEPFUSE_FAMILY_LOOKUP)(program, combo);
}
}  // namespace stepfuse::cpu
#endif
