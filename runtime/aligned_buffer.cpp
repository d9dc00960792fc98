// AlignedBuffer's allocation: large buffers on 2 MiB boundaries with transparent
// huge pages asked for (runtime/aligned_buffer.hpp).
#include "runtime/aligned_buffer.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace stepfuse::detail {

void* allocate_buffer(std::size_t bytes) {
  bytes = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  if (bytes < kHugePageMinBytes) return std::aligned_alloc(64, bytes);
  const std::size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = std::aligned_alloc(kHugePageBytes, rounded);
#if defined(__linux__)
  // A hint: where THP is off (or the kernel refuses), the buffer keeps 4 KiB pages.
  if (p != nullptr) (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace stepfuse::detail
