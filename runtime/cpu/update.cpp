// Registry of the fused update kernels: built-in program -> family table.
#include "runtime/cpu/kernels.hpp"

namespace stepfuse::cpu {

// Defined in runtime/cpu/update_<family>.cpp; `program` is the index within the family.
UpdateFn sgd_kernel(int program, int combo);
UpdateFn adam_kernel(int program, int combo);
UpdateFn adagrad_kernel(int program, int combo);
UpdateFn rmsprop_kernel(int program, int combo);
UpdateFn lion_kernel(int program, int combo);

UpdateFn fused_update_kernel(jit::Builtin program, DType weight, DType grad, bool masters) {
  using jit::Builtin;
  const int combo = update_combo(weight, grad, masters);
  const int b = static_cast<int>(program);
  // Family order must match the FusedTable lists in runtime/cpu/update_family-inl.h.
  if (program <= Builtin::sgd_nesterov) return sgd_kernel(b - static_cast<int>(Builtin::sgd), combo);
  if (program <= Builtin::adam_amsgrad) return adam_kernel(b - static_cast<int>(Builtin::adam), combo);
  if (program == Builtin::adagrad) return adagrad_kernel(0, combo);
  if (program <= Builtin::rmsprop_centered_momentum)
    return rmsprop_kernel(b - static_cast<int>(Builtin::rmsprop), combo);
  if (program == Builtin::lion) return lion_kernel(0, combo);
  return nullptr;
}

}  // namespace stepfuse::cpu
