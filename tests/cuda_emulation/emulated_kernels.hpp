// Test-only: the generated CUDA kernels compiled into the test as host functions
// (see cuda_shim.hpp and emit_sources.cpp), as typed function pointers.
//
// The pointer types spell out the kernel ABI of jit/cuda/emit_cuda.cpp; each
// generated unit assigns its kernels to them, so a kernel whose parameters change
// fails to compile here instead of being called with the wrong arguments.
#pragma once

#include <span>

#include "jit/step_scalars.h"
extern "C" {
#include "jit/cuda/device_abi.h"
#include "jit/cuda/shard_abi.h"
}

namespace sf_emu {

using ReduceKernel = void (*)(const sf_tensor* tensors, int num_tensors, const sf_span* chunks, int num_chunks,
                              sf_partial* partials, double* tensor_sums, sf_step_state* st, sf_hyper hyper,
                              const float* scale_ptr, double scale_value, int check_finite, sf_scaler_state* scaler);
using UpdateKernel = void (*)(const sf_tensor* tensors, const sf_span* blocks, long long flat_numel, sf_streams streams,
                              sf_step_state* st, sf_hyper hyper, int plain);
// A two-phase program's kernels (jit/cuda/kernels/phase1_kernel.cuh) and its sf_update,
// which takes the tensors' norms.
using Phase1Kernel = void (*)(const sf_tensor* tensors, const sf_span* chunks, int num_chunks, sf_streams streams,
                              float* sums, sf_step_state* st, sf_hyper hyper, int plain);
using CombineKernel = void (*)(const sf_tensor* tensors, int num_tensors, const float* sums, float* norms,
                               const sf_step_state* st, int plain);
using UpdateNormsKernel = void (*)(const sf_tensor* tensors, const sf_span* blocks, long long flat_numel,
                                   sf_streams streams, sf_step_state* st, sf_hyper hyper, int plain, const float* norms);
// A sharded spec's reduce module also has these (jit/cuda/kernels/shard_kernel.cuh).
using ReduceShardKernel = void (*)(const sf_tensor* tensors, int num_tensors, const sf_span* chunks, int num_chunks,
                                   sf_partial* partials, sf_step_state* st, sf_shard shard);
using ShardFinalizeKernel = void (*)(sf_shard shard, double* tensor_sums, int num_tensors, sf_step_state* st,
                                     sf_hyper hyper, const float* scale_ptr, double scale_value, int check_finite,
                                     sf_scaler_state* scaler);
using UpdateScaleKernel = void (*)(sf_scaler_state* s);
using ScaleKernel = void (*)(void* data, long long n, const float* scale, int reciprocal, int* found_inf);
using WidenKernel = void (*)(const void* src, float* dst, long long n);
using FillKernel = void (*)(float* dst, long long n, float value);

// The step kernels of one spec.
struct StepKernels {
  const char* name;       // emulated_specs.hpp
  const char* canonical;  // jit::canonical_text(spec): how a layout finds its kernels
  ReduceKernel reduce;
  UpdateKernel update;  // null for a two-phase program, which has these three instead:
  Phase1Kernel phase1;
  CombineKernel combine;
  UpdateNormsKernel update_norms;
  ReduceShardKernel reduce_shard;      // a sharded spec's; else null
  ShardFinalizeKernel shard_finalize;
};

// The utility module; scale and widen indexed by DType.
struct UtilityKernels {
  UpdateScaleKernel update_scale;
  ScaleKernel scale[3];
  WidenKernel widen[3];
  FillKernel fill;
};

// Defined by the generated sources.
std::span<const StepKernels* const> step_kernels();
const UtilityKernels& utility_kernels();

}  // namespace sf_emu
