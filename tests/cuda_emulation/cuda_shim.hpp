// Test-only: just enough of CUDA C++ for the generated kernels (jit/cuda/emit_cuda.cpp)
// to compile as host C++ and run on the CPU, each CUDA thread a std::thread.
//
// Force-included (-include) before a generated source. __CUDACC__ stays undefined,
// so the embedded prelude takes its host branch (jit/cuda/device_prelude.cuh).
//
// How a launch runs (emulate()): the blocks of the grid one after another (in
// order, or in a seeded shuffle), each by blockDim.x pooled threads that set the
// thread_local threadIdx/blockIdx/blockDim/gridDim and call the kernel.
//  - __shared__ is `static`: because ONE BLOCK RUNS AT A TIME, a function-static
//    is that block's shared memory (carried over between blocks like the
//    uninitialized shared memory of a real block, and never shared by two live blocks).
//  - __syncthreads() is a std::barrier over the block's threads; warp intrinsics go
//    through a per-warp array and a per-warp barrier of its 32 threads, because the
//    warps of a block may diverge in which intrinsics they call (a warp whose chunk
//    is past the end skips the reduction): a block-wide barrier would deadlock.
//  - A thread that returns leaves both barriers (arrive_and_drop), as an exited
//    thread stops counting for __syncthreads on the GPU (sm_70+).
//  - Warp intrinsics (__syncwarp too) must name the full mask and run in a full warp of 32 (the
//    generated code uses only SF_FULL_MASK); anything else aborts.
//  - float4/uint4/uint2 accesses check their alignment and abort when it is wrong, as a
//    GPU faults ("misaligned address") where x86 would not.
// Not a CUDA implementation: no streams, no memory model beyond C++'s (the pool's
// hand-offs and the barriers order everything), and no concurrency between blocks,
// so what goes wrong only when blocks overlap (a last-block-done counter read by
// the wrong block, say) shows only where the test makes its results visible.
#pragma once

#include <math.h>  // ::sqrt(double), as the generated sources call it

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <semaphore>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

// ---- qualifiers ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__ __restrict
#define __shared__ static  // one block at a time: see above

namespace sf_emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_shim: %s\n", what);
  std::abort();
}

// A GPU faults on a misaligned vector access ("misaligned address"); x86 would not.
template <std::size_t kAlign>
void check_aligned(const void* p, const char* type) {
  if (reinterpret_cast<std::uintptr_t>(p) % kAlign != 0) {
    std::fprintf(stderr, "cuda_shim: misaligned %s access at %p\n", type, p);
    std::abort();
  }
}

}  // namespace sf_emu

// ---- vector types: CUDA's alignment, checked on every load and store through them ----
struct alignas(16) float4 {
  float x, y, z, w;
  float4(float x_, float y_, float z_, float w_) : x(x_), y(y_), z(z_), w(w_) {}
  float4(const float4& o) {  // a load
    sf_emu::check_aligned<16>(&o, "float4");
    x = o.x, y = o.y, z = o.z, w = o.w;
  }
  float4& operator=(const float4& o) {  // a store
    sf_emu::check_aligned<16>(this, "float4");
    x = o.x, y = o.y, z = o.z, w = o.w;
    return *this;
  }
};
struct alignas(8) uint2 {
  unsigned x, y;
  uint2(unsigned x_, unsigned y_) : x(x_), y(y_) {}
  uint2(const uint2& o) {
    sf_emu::check_aligned<8>(&o, "uint2");
    x = o.x, y = o.y;
  }
  uint2& operator=(const uint2& o) {
    sf_emu::check_aligned<8>(this, "uint2");
    x = o.x, y = o.y;
    return *this;
  }
};
// uint4: 16-byte gradient loads and the reduce's shared staging slots (an array
// of them is __shared__, hence the default constructor).
struct alignas(16) uint4 {
  unsigned x, y, z, w;
  uint4() = default;
  uint4(const uint4& o) {
    sf_emu::check_aligned<16>(&o, "uint4");
    x = o.x, y = o.y, z = o.z, w = o.w;
  }
  uint4& operator=(const uint4& o) {
    sf_emu::check_aligned<16>(this, "uint4");
    x = o.x, y = o.y, z = o.z, w = o.w;
    return *this;
  }
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

struct uint3 { unsigned x = 0, y = 0, z = 0; };
using dim3 = uint3;

// ---- the thread's coordinates and its block ----
namespace sf_emu {

struct Warp {
  explicit Warp(unsigned lanes) : size(lanes), barrier(static_cast<std::ptrdiff_t>(lanes)) {}
  unsigned size;
  std::barrier<> barrier;
  std::uint64_t slots[32] = {};
};

// One running block: its barrier and its warps.
struct Block {
  explicit Block(unsigned threads) : barrier(static_cast<std::ptrdiff_t>(threads)) {
    for (unsigned w = 0; w * 32 < threads; ++w) warps.push_back(std::make_unique<Warp>(std::min(32u, threads - w * 32)));
  }
  std::barrier<> barrier;
  std::vector<std::unique_ptr<Warp>> warps;
};

inline thread_local Block* tl_block = nullptr;

}  // namespace sf_emu

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

// ---- synchronization and atomics ----
inline void __syncthreads() {
  if (sf_emu::tl_block == nullptr) sf_emu::fail("__syncthreads() in a kernel launched with EmuLaunch::sequential");
  sf_emu::tl_block->barrier.arrive_and_wait();
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }

// ---- warp intrinsics: every lane publishes its value, then reads what it needs ----
namespace sf_emu {

// Lane values of type T go through the warp's slots; returns read(lane, slot),
// where slot(i) is the value lane i published.
template <class T, class Read>
T warp_exchange(unsigned mask, T v, Read read) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t));
  if (tl_block == nullptr) fail("a warp intrinsic in a kernel launched with EmuLaunch::sequential");
  Warp& w = *tl_block->warps[threadIdx.x / 32];
  if (mask != 0xFFFFFFFFu || w.size != 32) fail("a warp intrinsic without the full mask, or in a partial warp");
  const unsigned lane = threadIdx.x % 32;
  std::memcpy(&w.slots[lane], &v, sizeof(T));
  w.barrier.arrive_and_wait();
  const auto slot = [&](unsigned i) {
    T x;
    std::memcpy(&x, &w.slots[i], sizeof(T));
    return x;
  };
  const T out = read(lane, slot);
  w.barrier.arrive_and_wait();  // nobody overwrites a slot before every lane has read
  return out;
}

}  // namespace sf_emu

// A barrier of the warp's 32 lanes (full mask only), ordering their shared-memory accesses.
inline void __syncwarp(unsigned mask) {
  sf_emu::warp_exchange(mask, 0, [](unsigned, auto) { return 0; });
}

// A source lane outside the warp leaves the value unchanged (CUDA's rule for width 32).
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
  return sf_emu::warp_exchange(mask, v, [&](unsigned lane, auto slot) { return lane + delta < 32 ? slot(lane + delta) : v; });
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  return sf_emu::warp_exchange(mask, v, [&](unsigned lane, auto slot) {
    const unsigned src = lane ^ static_cast<unsigned>(lane_mask);
    return src < 32 ? slot(src) : v;
  });
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane) {
  return sf_emu::warp_exchange(mask, v, [&](unsigned, auto slot) { return slot(static_cast<unsigned>(src_lane) & 31u); });
}
inline int __any_sync(unsigned mask, int predicate) {
  return sf_emu::warp_exchange(mask, predicate, [](unsigned, auto slot) {
    int any = 0;
    for (unsigned i = 0; i < 32; ++i) any |= slot(i) != 0;
    return any;
  });
}

// ---- the launcher ----
namespace sf_emu {

// Persistent worker threads: a block of n threads runs on workers 0..n-1. The
// caller sleeps once per block (on `remaining_`), not once per thread.
class ThreadPool {
 public:
  ~ThreadPool() {
    for (auto& w : workers_) {
      w->stop = true;
      w->start.release();
    }
    for (auto& w : workers_) w->thread.join();
  }
  // Runs job(i) for i in [0, n) on n threads; returns when all have finished.
  void run(unsigned n, const std::function<void(unsigned)>& job) {
    while (workers_.size() < n) {
      auto w = std::make_unique<Worker>();
      w->thread = std::thread([this, self = w.get(), index = static_cast<unsigned>(workers_.size())] {
        for (;;) {
          self->start.acquire();
          if (self->stop) return;
          (*job_)(index);
          if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
        }
      });
      workers_.push_back(std::move(w));
    }
    job_ = &job;
    remaining_.store(n, std::memory_order_relaxed);
    for (unsigned i = 0; i < n; ++i) workers_[i]->start.release();
    for (unsigned r; (r = remaining_.load(std::memory_order_acquire)) != 0;) remaining_.wait(r, std::memory_order_acquire);
  }

 private:
  struct Worker {
    std::thread thread;
    std::binary_semaphore start{0};
    bool stop = false;
  };
  std::vector<std::unique_ptr<Worker>> workers_;
  const std::function<void(unsigned)>* job_ = nullptr;
  std::atomic<unsigned> remaining_{0};
};

inline ThreadPool& pool() {
  static ThreadPool p;
  return p;
}

}  // namespace sf_emu

// The launch shape. order_seed != 0 runs the blocks in a shuffled order (a kernel
// must not depend on which block runs, or finishes, last). sequential: for kernels
// that never synchronize (the grid-stride utility kernels), a block's threads run
// one after another on the calling thread, a valid schedule for them and ~1000x
// cheaper than waking 256 threads; a barrier or warp intrinsic then aborts.
struct EmuLaunch {
  unsigned grid = 1, block = 1;
  std::uint32_t order_seed = 0;
  bool sequential = false;
};

// kernel<<<launch.grid, launch.block>>>(args...), on the CPU; returns when it is done.
template <class... Params, class... Args>
void emulate(void (*kernel)(Params...), EmuLaunch launch, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  if (launch.grid == 0 || launch.block == 0 || launch.block > 1024) sf_emu::fail("bad launch shape");
  const std::tuple<std::decay_t<Params>...> values(std::forward<Args>(args)...);  // the kernel's parameters
  std::vector<unsigned> order(launch.grid);
  for (unsigned b = 0; b < launch.grid; ++b) order[b] = b;
  if (launch.order_seed != 0) {
    std::uint32_t x = launch.order_seed;
    for (unsigned b = launch.grid; b > 1; --b) {  // Fisher-Yates with xorshift32
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      std::swap(order[b - 1], order[x % b]);
    }
  }
  for (unsigned b : order) {
    if (launch.sequential) {
      for (unsigned t = 0; t < launch.block; ++t) {
        threadIdx = {t, 0, 0};
        blockIdx = {b, 0, 0};
        blockDim = {launch.block, 1, 1};
        gridDim = {launch.grid, 1, 1};
        std::apply([&](const auto&... p) { kernel(p...); }, values);
      }
      continue;
    }
    sf_emu::Block block(launch.block);
    const std::function<void(unsigned)> job = [&](unsigned t) {
      threadIdx = {t, 0, 0};
      blockIdx = {b, 0, 0};
      blockDim = {launch.block, 1, 1};
      gridDim = {launch.grid, 1, 1};
      sf_emu::tl_block = &block;
      std::apply([&](const auto&... p) { kernel(p...); }, values);
      block.warps[t / 32]->barrier.arrive_and_drop();
      block.barrier.arrive_and_drop();
      sf_emu::tl_block = nullptr;
    };
    sf_emu::pool().run(launch.block, job);
  }
}
