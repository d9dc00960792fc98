// Fused update kernels of built-in programs 2, 2 + kUpdateSlices, ... for every Highway target.
#define STEPFUSE_UPDATE_SLICE 2
#define STEPFUSE_UPDATE_LOOKUP GetUpdateKernel2
#define STEPFUSE_UPDATE_DISPATCH update_kernel_2
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_kernels_2.cpp"
#include "runtime/cpu/update_kernels-inl.h"
