// A GradScaler's state on the device: the fp32 scale, the growth tracker and the
// found_inf flag, updated by kernels so a step and update() never wait for the GPU.
#pragma once

#include <cstdint>
#include <memory>

#include "runtime/cuda/cuda_backend.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::detail {

class CudaScalerState {
 public:
  explicit CudaScalerState(int device);

  int device() const { return ctx_.device(); }
  sf_scaler_state* state() const { return buffer_.as<sf_scaler_state>(); }
  const float* scale() const { return &state()->scale; }
  const float* one() const { return one_.as<float>(); }  // a device 1.0f: the scale after unscale_()

  // Host <-> device copies; both wait for `stream`. push() keeps the found_inf of
  // the iteration in progress unless `end_iteration`.
  void push(float scale, std::int32_t tracker, double growth_factor, double backoff_factor,
            std::int64_t growth_interval, cuda::CUstream stream, bool end_iteration = false);
  void pull(float* scale, std::int32_t* tracker, cuda::CUstream stream) const;
  void record_found_inf(cuda::CUstream stream);  // an optimizer on the CPU found inf/NaN

  // Enqueued on `stream`.
  void update(cuda::CUstream stream);
  // data *= S, or *= fp32(1/S) with `reciprocal` (found_inf recorded), for device memory.
  void scale_tensor(const TensorView& t, bool reciprocal, cuda::CUstream stream);

 private:
  CudaContext ctx_;
  DeviceBuffer buffer_, one_;
};

// Whether `p` is device memory of a CUDA device (its ordinal in *device).
bool is_device_pointer(const void* p, int* device);

}  // namespace stepfuse::detail
