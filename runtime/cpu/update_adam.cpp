// Fused update kernels of the Adam family, for every Highway target.
#define STEPFUSE_FAMILY 1
#define STEPFUSE_FAMILY_LOOKUP GetAdamKernel
#define STEPFUSE_FAMILY_DISPATCH adam_kernel
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_adam.cpp"
#include "runtime/cpu/update_family-inl.h"
