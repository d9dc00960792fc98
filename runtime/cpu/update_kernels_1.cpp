// Fused update kernels of built-in programs 1, 1 + kUpdateSlices, ... for every Highway target.
#define STEPFUSE_UPDATE_SLICE 1
#define STEPFUSE_UPDATE_LOOKUP GetUpdateKernel1
#define STEPFUSE_UPDATE_DISPATCH update_kernel_1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_kernels_1.cpp"
#include "runtime/cpu/update_kernels-inl.h"
