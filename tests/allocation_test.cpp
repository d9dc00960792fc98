// A fused step allocates nothing: every buffer is sized when the optimizer is built.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <new>
#include <thread>
#include <vector>

#include "runtime/aligned_buffer.hpp"
#include "stepfuse/stepfuse.hpp"

namespace {
std::atomic<long> g_allocations{0};
std::atomic<bool> g_counting{false};
}  // namespace

// Counting replacements of the global allocation functions (this test binary only).
// They are a matched malloc/free pair by construction; GCC 12 still warns that
// free() sees a pointer "from operator new" once it inlines these into callers.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
// Every other form too, so that whatever form a library uses (LLVM allocates with the
// aligned and nothrow ones) gets its matching release, and is counted.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n ? n : 1);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (std::max<std::size_t>(n, 1) + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return operator new(n, a);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept { return operator new(n, a, t); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace stepfuse {
namespace {

// Every CPU backend; automatic: counting from the step that switches to the LLVM code
// (the compile thread, which allocates, is idle by then).
std::vector<CpuBackend> backends() {
  if (llvm_version()[0] == '\0') return {CpuBackend::highway};
  return {CpuBackend::highway, CpuBackend::llvm, CpuBackend::automatic};
}

TEST(Allocation, FusedStepsAllocateNothing) {
  for (const OptimizerConfig& config :
       {OptimizerConfig{optim::AdamW{}}, OptimizerConfig{optim::SGD{.momentum = 0.9}}, OptimizerConfig{optim::Lion{}},
        OptimizerConfig{optim::LAMB{}}}) {  // (LAMB: two phases, the per-tensor norms)
    for (Fusion mode : {Fusion::fused, Fusion::interpreted}) {
      for (CpuBackend backend : backends()) {
        if (mode == Fusion::interpreted && backend != CpuBackend::highway) continue;  // no LLVM there
        std::vector<float> w1(100000, 1.0f), g1(100000, 0.5f), w2(37, 1.0f), g2(37, 0.25f);
        OptimizerOptions o;
        o.fusion = mode;
        o.max_grad_norm = 1.0;
        o.num_threads = 2;
        o.cpu_backend = backend;
        Optimizer opt(config, {{{w1.data(), 100000, DType::f32}, {g1.data(), 100000, DType::f32}},
                               {{w2.data(), 37, DType::f32}, {g2.data(), 37, DType::f32}}},
                      o);
        opt.step_scaled(1024.0);  // warm up the pool's threads
        if (backend == CpuBackend::automatic) {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
          while (opt.backend() != "llvm" && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          ASSERT_EQ(opt.backend(), "llvm") << "the background compile did not finish in 120 s";
        }
        g_allocations = 0;
        g_counting = true;
        for (int i = 0; i < 5; ++i) {
          opt.step_scaled(1024.0);
          opt.step();
        }
        opt.set_lr(1e-4);
        g_counting = false;
        EXPECT_EQ(g_allocations.load(), 0) << optimizer_name(config) << " mode " << static_cast<int>(mode)
                                           << " backend " << cpu_backend_name(backend);
        EXPECT_EQ(opt.step_count(), 11);
      }
    }
  }
}

// The VmFlags line of the mapping of /proc/self/smaps that holds p ("" where there is
// no such file or mapping).
std::string vm_flags(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    std::uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-' && line.find(':') > line.find(' '))
      inside = begin <= at && at < end;  // a mapping's first line: "begin-end perms offset ..."
    else if (inside && line.rfind("VmFlags:", 0) == 0)
      return line;
  }
  return "";
}

// State-sized buffers start on a 2 MiB boundary and are advised for transparent huge
// pages (VmFlags "hg", whatever the system's THP mode); small ones stay 64-byte aligned
// and unadvised.
TEST(Allocation, LargeBuffersAskForHugePages) {
  const detail::AlignedBuffer small(1000), large(detail::kHugePageMinBytes / sizeof(float) + 5);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small.data()) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(large.data()) % detail::kHugePageBytes, 0u);
  large.data()[large.size() - 1] = 1.0f;  // usable to its end
  const std::string flags = vm_flags(large.data());
  if (flags.empty()) GTEST_SKIP() << "no /proc/self/smaps here";
  EXPECT_NE((flags + " ").find(" hg "), std::string::npos) << flags;
}

}  // namespace
}  // namespace stepfuse
