// Fused update kernels of built-in programs 0, 0 + kUpdateSlices, ... for every Highway target.
#define STEPFUSE_UPDATE_SLICE 0
#define STEPFUSE_UPDATE_LOOKUP GetUpdateKernel0
#define STEPFUSE_UPDATE_DISPATCH update_kernel_0
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_kernels_0.cpp"
#include "runtime/cpu/update_kernels-inl.h"
