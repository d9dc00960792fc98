// Compiling generated CUDA kernels through the kernel cache.
#include "jit/cuda/cuda_kernels.hpp"

#include "jit/kernel_cache.hpp"

namespace stepfuse::jit {

namespace {
// Bumped when the meaning of cached bytes changes without the key text changing.
constexpr int kCudaCacheFormat = 1;
}  // namespace

std::string cuda_cache_key(const std::string& canonical, const CudaTarget& target) {
  std::string key = "stepfuse cuda kernel, cache format " + std::to_string(kCudaCacheFormat) + "\nnvrtc " +
                    nvrtc_version_string() + "\noptions";
  for (const std::string& o : nvrtc_options(target)) key.append(" ").append(o);
  key.append("\ntarget ").append(arch_name(target)).append("\n").append(canonical);
  return key;
}

CudaImage cuda_step_image(const CudaSpec& spec, const CudaTarget& target) {
  const std::string key = cuda_cache_key(canonical_text(spec), target);
  auto bytes = KernelCache::shared().get(
      key, [&] { return nvrtc_compile(emit_cuda(spec), std::string(spec.program.name) + "_step.cu", target); });
  return {std::move(bytes), target};
}

CudaImage cuda_utility_image(const CudaTarget& target) {
  static const std::string source = emit_cuda_utilities();
  const std::string key = cuda_cache_key(source, target);  // small: the source is its own spec
  auto bytes = KernelCache::shared().get(key, [&] { return nvrtc_compile(source, "stepfuse_utilities.cu", target); });
  return {std::move(bytes), target};
}

}  // namespace stepfuse::jit
