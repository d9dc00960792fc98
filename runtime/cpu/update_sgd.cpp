// Fused update kernels of the Sgd family, for every Highway target.
#define STEPFUSE_FAMILY 0
#define STEPFUSE_FAMILY_LOOKUP GetSgdKernel
#define STEPFUSE_FAMILY_DISPATCH sgd_kernel
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_sgd.cpp"
#include "runtime/cpu/update_family-inl.h"
