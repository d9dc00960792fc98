// Fused update kernels of built-in programs 4, 4 + kUpdateSlices, ... for every Highway target.
#define STEPFUSE_UPDATE_SLICE 4
#define STEPFUSE_UPDATE_LOOKUP GetUpdateKernel4
#define STEPFUSE_UPDATE_DISPATCH update_kernel_4
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/update_kernels_4.cpp"
#include "runtime/cpu/update_kernels-inl.h"
