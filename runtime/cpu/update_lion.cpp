// Fused update kernels of the Lion family, for every Highway target.
#define STEPFUSE_FAMILY 4
#define STEPFUSE_FAMILY_LOOKUP GetLionKernel
#define STEPFUSE_FAMILY_DISPATCH lion_kernel
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_lion.cpp"
#include "runtime/cpu/update_family-inl.h"
