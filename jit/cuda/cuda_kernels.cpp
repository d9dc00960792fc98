// Compiling generated CUDA kernels through the kernel cache.
#include "jit/cuda/cuda_kernels.hpp"

#include <cstdint>
#include <cstdio>
#include <future>

#define XXH_INLINE_ALL  // header-only, as in jit/kernel_cache.cpp
#include <xxhash.h>

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
  // The embedded headers (element math, scalar rules, step stage, device ABI) are part of
  // every source but not of the spec's text: their digest makes any edit to them
  // a new key.
  const std::string& headers = cuda_embedded_headers();
  const std::uint64_t digest = XXH3_64bits(headers.data(), headers.size());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(digest));
  key.append("\nheaders ").append(hex);
  key.append("\ntarget ").append(arch_name(target)).append("\n").append(canonical);
  return key;
}

CudaStepImages cuda_step_images(const CudaSpec& spec, const CudaTarget& target) {
  const std::string reduce_key = cuda_cache_key(reduce_canonical_text(spec), target);
  const std::string update_key = cuda_cache_key(canonical_text(spec), target);
  KernelCache& cache = KernelCache::shared();
  auto reduce = cache.find(reduce_key);
  auto update = cache.find(update_key);
  if (reduce && update) return {{std::move(reduce), target}, {std::move(update), target}};
  // NVRTC is thread-safe: a cold spec compiles its two kernels side by side.
  std::future<std::shared_ptr<const std::string>> pending;
  if (!reduce)
    pending = std::async(std::launch::async, [&] {
      return cache.get(reduce_key, [&] { return nvrtc_compile(emit_cuda_reduce(spec), "stepfuse_reduce.cu", target); });
    });
  if (!update)
    update = cache.get(update_key,
                       [&] { return nvrtc_compile(emit_cuda_update(spec), std::string(spec.program.name) + "_update.cu", target); });
  if (!reduce) reduce = pending.get();
  return {{std::move(reduce), target}, {std::move(update), target}};
}

void evict_cuda_step_images(const CudaSpec& spec, const CudaTarget& target) noexcept {
  try {
    KernelCache::shared().evict(cuda_cache_key(reduce_canonical_text(spec), target));
    KernelCache::shared().evict(cuda_cache_key(canonical_text(spec), target));
  } catch (...) {  // building the keys allocates: nothing to evict then
  }
}

CudaImage cuda_utility_image(const CudaTarget& target) {
  static const std::string source = emit_cuda_utilities();
  const std::string key = cuda_cache_key(source, target);  // small: the source is its own spec
  auto bytes = KernelCache::shared().get(key, [&] { return nvrtc_compile(source, "stepfuse_utilities.cu", target); });
  return {std::move(bytes), target};
}

}  // namespace stepfuse::jit
