// Order statistics of timing samples: median and spread, the way the benchmarks report them.
#include "stats.hpp"

#include <algorithm>
#include <cmath>

namespace stepfuse::bench {

Summary summarize(std::vector<double> s) {
  Summary r;
  if (s.empty()) return r;
  std::sort(s.begin(), s.end());
  auto q = [&](double f) {
    const double pos = f * static_cast<double>(s.size() - 1);
    const auto lo = static_cast<std::size_t>(std::floor(pos));
    const std::size_t hi = std::min(lo + 1, s.size() - 1);
    return s[lo] + (s[hi] - s[lo]) * (pos - static_cast<double>(lo));
  };
  r.count = static_cast<int>(s.size());
  r.min = s.front();
  r.p25 = q(0.25);
  r.median = q(0.5);
  r.p75 = q(0.75);
  r.max = s.back();
  return r;
}

}  // namespace stepfuse::bench
