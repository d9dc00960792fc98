// Fused update kernels of the Rmsprop family, for every Highway target.
#define STEPFUSE_FAMILY 3
#define STEPFUSE_FAMILY_LOOKUP GetRmspropKernel
#define STEPFUSE_FAMILY_DISPATCH rmsprop_kernel
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_rmsprop.cpp"
#include "runtime/cpu/update_family-inl.h"
