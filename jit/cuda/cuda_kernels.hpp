// Generated CUDA kernels, compiled and cached: the spec's step module and the
// utility module for a target, through the kernel cache (memory, then disk,
// then NVRTC). jit/ compiles; runtime/ loads and launches.
#pragma once

#include <memory>
#include <string>

#include "jit/cuda/emit_cuda.hpp"
#include "jit/cuda/nvrtc_compile.hpp"

namespace stepfuse::jit {

struct CudaImage {
  std::shared_ptr<const std::string> bytes;  // CUBIN, or PTX text for the driver to JIT
  CudaTarget target;
};

// The cache key: our format version, the NVRTC version, its options, the target
// and the spec's canonical text.
std::string cuda_cache_key(const std::string& canonical, const CudaTarget& target);

// The compiled step modules of `spec`: the reduce kernel (sf_reduce) and the
// update kernel (sf_update), compiled in parallel when neither is cached.
struct CudaStepImages {
  CudaImage reduce, update;
};
CudaStepImages cuda_step_images(const CudaSpec& spec, const CudaTarget& target);
// Forgets the spec's cached images (in memory and on disk): for images that passed
// every check of the cache but that the driver refused to load, which every later
// process would otherwise load again. The next cuda_step_images() compiles.
void evict_cuda_step_images(const CudaSpec& spec, const CudaTarget& target) noexcept;
// The compiled utility module (sf_update_scale, sf_scale_*, sf_widen_*, sf_fill).
CudaImage cuda_utility_image(const CudaTarget& target);

}  // namespace stepfuse::jit
