// Measures the machine's memory bandwidth in the benchmark's own process (docs/architecture.md §8).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

namespace stepfuse::bench {

// The access patterns the probe times, with the bytes each moves per element
// (STREAM's convention: bytes named by the loop, write-allocate traffic not counted).
enum class Pattern {
  copy,       // b[i] = a[i]                                   4 r + 4 w =  8 B
  triad,      // a[i] = b[i] + s * c[i]                        8 r + 4 w = 12 B
  read,       // x ^= a[i]  (the reduce pass's access pattern) 4 r       =  4 B
  adam_like,  // m, v, p updated in place from g: 4 reads + 3 writes  = 28 B (fp32 AdamW's update pass)
};
inline constexpr Pattern kAllPatterns[] = {Pattern::copy, Pattern::triad, Pattern::read, Pattern::adam_like};

std::string_view pattern_name(Pattern p);
int pattern_bytes_per_element(Pattern p);

// Four float arrays of n elements, first touched by the threads that time them, and
// plain loops over them: compiled at -O3, vectorized, and cloned for AVX2 (the ISA the
// library dispatches to here) with a baseline fallback, so the reference is not a
// scalar or SSE2-only loop. Allocates 16 * n bytes in the constructor; run() allocates
// nothing.
class BandwidthProbe {
 public:
  BandwidthProbe(std::int64_t n, int threads);
  ~BandwidthProbe();
  BandwidthProbe(const BandwidthProbe&) = delete;
  BandwidthProbe& operator=(const BandwidthProbe&) = delete;

  // Runs one pass of `p` over all n elements with the probe's threads; returns seconds.
  double run(Pattern p);
  // Bytes one pass of `p` moves.
  double bytes(Pattern p) const { return static_cast<double>(pattern_bytes_per_element(p)) * n_; }

  std::int64_t size() const { return n_; }
  int threads() const { return threads_; }

 private:
  std::int64_t n_;
  int threads_;
  struct Free { void operator()(float* p) const; };
  std::unique_ptr<float, Free> a_, b_, c_, d_;
};

}  // namespace stepfuse::bench
