// Order statistics of timing samples: median and spread, the way the benchmarks report them.
#pragma once

#include <vector>

namespace stepfuse::bench {

struct Summary {
  int count = 0;
  double min = 0, p25 = 0, median = 0, p75 = 0, max = 0;
};

// Quantiles by linear interpolation between order statistics (numpy's default).
// An empty sample gives all zeros.
Summary summarize(std::vector<double> samples);

}  // namespace stepfuse::bench
