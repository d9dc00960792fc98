// Fused update kernels of the Adagrad family, for every Highway target.
#define STEPFUSE_FAMILY 2
#define STEPFUSE_FAMILY_LOOKUP GetAdagradKernel
#define STEPFUSE_FAMILY_DISPATCH adagrad_kernel
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_adagrad.cpp"
#include "runtime/cpu/update_family-inl.h"
