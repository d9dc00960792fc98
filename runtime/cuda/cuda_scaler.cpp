// A GradScaler's state on the device.
#include "runtime/cuda/cuda_scaler.hpp"

#include <algorithm>

#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {
const cuda::DriverApi& api() { return *cuda::driver(); }  // callers hold a CudaContext: the driver is loaded
}  // namespace

CudaScalerState::CudaScalerState(int device)
    : ctx_(device), buffer_(sizeof(sf_scaler_state)), one_(sizeof(float)) {
  // Zeroed (found_inf, recorded) before push() fills the rest; the context is
  // synchronized so no stream, blocking or not, can run a kernel before the copies land.
  const float one = 1.0f;
  const sf_scaler_state zero{};
  cuda::check(api().cuMemcpyHtoD(one_.get(), &one, sizeof one), "cuMemcpyHtoD");
  cuda::check(api().cuMemcpyHtoD(buffer_.get(), &zero, sizeof zero), "cuMemcpyHtoD");
  cuda::check(api().cuCtxSynchronize(), "cuCtxSynchronize");
}

void CudaScalerState::push(float scale, std::int32_t tracker, double growth_factor, double backoff_factor,
                           std::int64_t growth_interval, cuda::CUstream stream, bool end_iteration) {
  ctx_.make_current();
  cuda::check(api().cuStreamSynchronize(stream), "cuStreamSynchronize");
  sf_scaler_state s{};
  s.scale = scale;
  s.growth_tracker = tracker;
  s.growth_factor = growth_factor;
  s.backoff_factor = backoff_factor;
  s.growth_interval = static_cast<int>(growth_interval);
  // found_inf and recorded belong to the iteration in progress: keep them.
  sf_scaler_state old{};
  cuda::check(api().cuMemcpyDtoH(&old, buffer_.get(), sizeof old), "cuMemcpyDtoH");
  s.found_inf = end_iteration ? 0 : old.found_inf;
  s.recorded = end_iteration ? 0 : old.recorded;
  // On the stream, then waited for: a synchronous copy from pageable memory may
  // return before it lands, unordered with a non-blocking stream's kernels.
  cuda::check(api().cuMemcpyHtoDAsync(buffer_.get(), &s, sizeof s, stream), "cuMemcpyHtoDAsync");
  cuda::check(api().cuStreamSynchronize(stream), "cuStreamSynchronize");
}

void CudaScalerState::pull(float* scale, std::int32_t* tracker, cuda::CUstream stream) const {
  ctx_.make_current();
  cuda::check(api().cuStreamSynchronize(stream), "cuStreamSynchronize");
  sf_scaler_state s{};
  cuda::check(api().cuMemcpyDtoH(&s, buffer_.get(), sizeof s), "cuMemcpyDtoH");
  *scale = s.scale;
  *tracker = s.growth_tracker;
}

void CudaScalerState::record_found_inf(cuda::CUstream stream) {
  ctx_.make_current();
  cuda::check(api().cuStreamSynchronize(stream), "cuStreamSynchronize");
  const int one = 1;
  cuda::check(api().cuMemcpyHtoDAsync(buffer_.get() + offsetof(sf_scaler_state, found_inf), &one, sizeof one, stream),
              "cuMemcpyHtoDAsync");
  cuda::check(api().cuStreamSynchronize(stream), "cuStreamSynchronize");
}

void CudaScalerState::update(cuda::CUstream stream) {
  ctx_.make_current();
  sf_scaler_state* s = state();
  void* args[] = {&s};
  launch(cuda_utilities(ctx_).update_scale, "sf_update_scale", 1, 1, stream, args);
}

void CudaScalerState::scale_tensor(const TensorView& t, bool reciprocal, cuda::CUstream stream) {
  if (t.numel == 0) return;
  ctx_.make_current();
  void* data = t.data;
  long long n = t.numel;
  const float* scale = this->scale();
  int recip = reciprocal ? 1 : 0;
  int* found = reciprocal ? &state()->found_inf : nullptr;
  void* args[] = {&data, &n, &scale, &recip, &found};
  const unsigned grid = static_cast<unsigned>(std::clamp<long long>((n + 255) / 256, 1, 65535 * 8));
  launch(cuda_utilities(ctx_).scale[static_cast<int>(t.dtype)], "sf_scale", grid, 256, stream, args);
}

bool is_device_pointer(const void* p, int* device) {
  const cuda::DriverApi* a = cuda::driver();
  if (a == nullptr || p == nullptr) return false;
  unsigned type = 0;
  const auto ptr = static_cast<cuda::CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
  if (a->cuPointerGetAttribute(&type, cuda::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) != cuda::CUDA_SUCCESS) return false;
  if (type != cuda::CU_MEMORYTYPE_DEVICE && type != cuda::CU_MEMORYTYPE_UNIFIED) return false;
  int ordinal = 0;
  constexpr int kDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
  if (a->cuPointerGetAttribute(&ordinal, kDeviceOrdinal, ptr) != cuda::CUDA_SUCCESS) ordinal = 0;
  *device = ordinal;
  return true;
}

}  // namespace stepfuse::detail
