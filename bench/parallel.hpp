// A minimal fork-join helper for the benchmarks' own loops (fills, bandwidth probes, checks).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace stepfuse::bench {

// Runs fn(thread, begin, end) over [0, n) split into `threads` contiguous ranges whose
// starts are multiples of `align` elements (so SIMD loops start aligned), one range per
// thread; the calling thread runs the last one. Spawns threads-1 std::threads per call
// (tens of microseconds: fine for passes over large arrays, not for tiny work).
template <class Fn>
void parallel_for(std::int64_t n, int threads, Fn&& fn, std::int64_t align = 16) {
  threads = std::max(threads, 1);
  const std::int64_t per = (n / threads + align - 1) / align * align;
  auto range = [&](int t) {
    const std::int64_t b = std::min<std::int64_t>(n, per * t);
    const std::int64_t e = t == threads - 1 ? n : std::min<std::int64_t>(n, per * (t + 1));
    return std::pair{b, e};
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 0; t < threads - 1; ++t)
    pool.emplace_back([&fn, t, r = range(t)] { fn(t, r.first, r.second); });
  const auto last = range(threads - 1);
  fn(threads - 1, last.first, last.second);
  for (auto& th : pool) th.join();
}

}  // namespace stepfuse::bench
