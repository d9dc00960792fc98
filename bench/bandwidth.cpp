// Measures the machine's memory bandwidth in the benchmark's own process (docs/architecture.md §8).
#include "bandwidth.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

#include "parallel.hpp"
#include "runtime/aligned_buffer.hpp"

namespace stepfuse::bench {
namespace {

// The kernels are cloned per ISA and picked at load time (GCC/Clang ifunc), because the
// project is built without -march (it would defeat Highway's dispatch) and an SSE2-only
// reference would understate what the machine can do. Every loop below vectorizes at -O3
// (check with -fopt-info-vec). `restrict` tells the compiler the arrays do not overlap.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__SANITIZE_ADDRESS__)
#define STEPFUSE_BENCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define STEPFUSE_BENCH_CLONES
#endif

// `+ 0.0f` (not an identity for -0.0, so it is not folded away) keeps this a plain vector
// loop: a bare copy becomes a memcpy call, whose large-size path uses non-temporal stores
// and would measure something else than the library's loops do.
STEPFUSE_BENCH_CLONES
void copy_kernel(float* __restrict b, const float* __restrict a, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) b[i] = a[i] + 0.0f;
}

STEPFUSE_BENCH_CLONES
void triad_kernel(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
                  std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// Integer xor so the reduction vectorizes without -ffast-math (a float sum would not), into
// 32 interleaved accumulators like the library's reduce pass (docs/architecture.md §5): measured here
// ~20% faster than a single vector accumulator.
STEPFUSE_BENCH_CLONES
std::uint32_t read_kernel(const std::uint32_t* __restrict a, std::int64_t n) {
  std::uint32_t acc[32] = {};
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 32; ++j) acc[j] ^= a[i + j];
  std::uint32_t x = 0;
  for (; i < n; ++i) x ^= a[i];
  for (int j = 0; j < 32; ++j) x ^= acc[j];
  return x;
}

// AdamW's update-pass traffic (read p, g, m, v; write p, m, v) with cheap arithmetic, so
// it measures memory and not the divider. The values stay bounded over repeated passes.
STEPFUSE_BENCH_CLONES
void adam_like_kernel(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                      std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = 0.9f * m[i] + 0.1f * gi;
    const float vi = 0.999f * v[i] + 0.001f * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] - 1e-3f * (mi + vi);
  }
}

// Allocated as the optimizer allocates its state (huge pages for large arrays): the
// probe's streams get the same TLB reach as the step's, so the step's % of the
// probe's bandwidth is not flattered by the probe walking 4 KiB pages.
float* alloc_floats(std::int64_t n) {
  void* p = stepfuse::detail::allocate_buffer(static_cast<std::size_t>(n) * sizeof(float));
  if (p == nullptr) throw std::bad_alloc();
  return static_cast<float*>(p);
}

volatile std::uint32_t g_sink;  // keeps the read kernel's result alive

}  // namespace

void BandwidthProbe::Free::operator()(float* p) const { std::free(p); }

std::string_view pattern_name(Pattern p) {
  switch (p) {
    case Pattern::copy: return "copy";
    case Pattern::triad: return "triad";
    case Pattern::read: return "read";
    case Pattern::adam_like: return "adam_like";
  }
  return "?";
}

int pattern_bytes_per_element(Pattern p) {
  switch (p) {
    case Pattern::copy: return 8;
    case Pattern::triad: return 12;
    case Pattern::read: return 4;
    case Pattern::adam_like: return 28;
  }
  return 0;
}

BandwidthProbe::BandwidthProbe(std::int64_t n, int threads)
    : n_(n), threads_(threads < 1 ? 1 : threads), a_(alloc_floats(n)), b_(alloc_floats(n)), c_(alloc_floats(n)),
      d_(alloc_floats(n)) {
  // First touch by the same split the kernels use, so pages land near their thread.
  float *a = a_.get(), *b = b_.get(), *c = c_.get(), *d = d_.get();
  parallel_for(n_, threads_, [=](int, std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      a[i] = 1.0f + static_cast<float>(i & 1023) * 1e-3f;
      b[i] = 0.5f;
      c[i] = 0.25f;
      d[i] = 0.125f;
    }
  });
}

BandwidthProbe::~BandwidthProbe() = default;

double BandwidthProbe::run(Pattern p) {
  float *a = a_.get(), *b = b_.get(), *c = c_.get(), *d = d_.get();
  const auto t0 = std::chrono::steady_clock::now();
  parallel_for(n_, threads_, [=](int, std::int64_t lo, std::int64_t hi) {
    const std::int64_t len = hi - lo;
    switch (p) {
      case Pattern::copy: copy_kernel(b + lo, a + lo, len); break;
      case Pattern::triad: triad_kernel(c + lo, a + lo, b + lo, 0.5f, len); break;
      case Pattern::read: g_sink = read_kernel(reinterpret_cast<const std::uint32_t*>(a + lo), len); break;
      case Pattern::adam_like: adam_like_kernel(a + lo, b + lo, c + lo, d + lo, len); break;
    }
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace stepfuse::bench
