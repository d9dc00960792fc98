// Fused update kernels of built-in programs 3, 3 + kUpdateSlices, ... for every Highway target.
#define STEPFUSE_UPDATE_SLICE 3
#define STEPFUSE_UPDATE_LOOKUP GetUpdateKernel3
#define STEPFUSE_UPDATE_DISPATCH update_kernel_3
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_kernels_3.cpp"
#include "runtime/cpu/update_kernels-inl.h"
