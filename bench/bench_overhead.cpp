// Google Benchmark suite of a step's fixed costs, per tensor and per step: fused AdamW steps over N tensors, 1 thread.
//
// Model: time of one step = a + b * N + c * E for N tensors of E elements in all, where
//   a  per-step cost: dispatching the reduce and update passes, combining the partials,
//      the scalar stage;
//   b  per-tensor cost: every tensor is at least one chunk, so one reduce and one update
//      kernel call, a partial and a tensor norm each (a tensor longer than 16 Ki elements
//      adds the same per chunk);
//   c  per-element cost (the bandwidth-bound part).
// Every case is a full AMP step (step_scaled with clipping: reduce pass + update) of fp32
// AdamW on one thread, checked before timing like every step case (bench/step_case.hpp).
//
//   overhead/AdamW/f32/const_total_1M/tensors:N    N tensors of 1e6 / N elements: E is fixed,
//       so the slope over N is b, the per-tensor cost (the intercept is a + c * 1e6)
//   overhead/AdamW/f32/const_numel_1024/tensors:N  N tensors of 1024 elements: the intercept
//       is a, the per-step cost (the slope is b + 1024 c)
//   overhead/AdamW/f32/floor_1x1/{scaled,plain}    one tensor of one element: a alone, with
//       and without the reduce pass (a plain step runs none)
//   overhead/AdamW/f32/fit/{const_total_1M,const_numel_1024}
//       times the five N of a series round-robin (drift hits them alike; the second of
//       two back-to-back steps, so in the per-N cases' cache state) and fits
//       time = intercept + slope * N by least squares on relative residuals (weights
//       1 / time^2, so N = 1 counts as much as N = 10000). Counters, in seconds (the
//       console prints them with an SI prefix: 861n is 861 ns): slope_s, intercept_s, and
//       the median step time of each N (N1_s ... N10000_s).
// Read the fits as orders of magnitude: the model's c is not one constant, since the
// series cross cache levels (const_numel: 16 B x 1024 x N of weights, grads and state, 16 MiB
// at N = 1000, 160 MiB at N = 10000), and const_total's slope comes out larger than a
// whole floor_1x1 step: at N = 10000 a step walks 40 000 streams of 100 elements (grad,
// weight and two states per tensor, each tensor allocated apart), too short for the prefetchers, so b there is likely
// memory latency more than bookkeeping. The const_numel intercept is small beside one tensor's cost and the fit may
// even put it below zero: floor_1x1 measures a directly.
// The per-N cases report step_time (per step) and time_per_tensor (time per step / N:
// the average, which also carries a share of a and c * E; the fits separate them), plus
// bytes_per_second and items_per_second (parameters per second) as every step case does.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "step_case.hpp"
#include "stepfuse/stepfuse.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;

namespace {

constexpr int kCounts[] = {1, 10, 100, 1000, 10000};
constexpr std::int64_t kConstTotal = 1'000'000;  // divisible by every count above
constexpr std::int64_t kConstNumel = 1024;

enum class Series { const_total, const_numel };

sb::StepCase overhead_case(int tensors, std::int64_t numel, bool scaled = true) {
  return {sf::optim::AdamW{}, sf::DType::f32, sf::DType::f32, sf::Fusion::fused,
          sb::numbered_tensors("t", tensors, numel), scaled};
}

sb::StepCase series_case(Series s, int tensors) {
  return overhead_case(tensors, s == Series::const_total ? kConstTotal / tensors : kConstNumel);
}

// step_time and time_per_tensor, in seconds, from the benchmark's own timing: an
// iteration-invariant rate of `value` is value * iterations / seconds; inverted, seconds
// per (value * iteration). The console shows inverted rates in seconds ("2.1ms").
void add_time_counters(benchmark::State& state, int tensors) {
  const auto per_step = benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert;
  state.counters["step_time"] = benchmark::Counter(1, per_step);
  state.counters["time_per_tensor"] = benchmark::Counter(tensors, per_step);
}

void run_point(benchmark::State& state, const sb::StepCase& c) {
  sb::run_step_case(state, c, /*threads=*/1);
  if (!state.error_occurred()) add_time_counters(state, static_cast<int>(c.shapes.size()));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

void run_fit(benchmark::State& state, Series s) {
  std::vector<std::unique_ptr<sb::PreparedStep>> steps;
  for (const int n : kCounts) {
    steps.push_back(std::make_unique<sb::PreparedStep>(series_case(s, n), /*threads=*/1));
    if (!steps.back()->error().empty()) {
      std::string msg = "N = ";
      msg += std::to_string(n);
      msg += ": ";
      msg += steps.back()->error();
      state.SkipWithError(msg.c_str());
      return;
    }
  }
  std::vector<std::vector<double>> seconds(steps.size());
  // One round: two steps of every N, the second one timed. The untimed one brings the
  // case's data back into the caches the previous N evicted, so each N is timed in the
  // cache state its own per-N case sees (back-to-back steps), not colder. False when a
  // step was skipped.
  const auto round = [&] {
    double total = 0;
    for (std::size_t k = 0; k < steps.size(); ++k) {
      if (!steps[k]->step()) return false;
      const auto t0 = std::chrono::steady_clock::now();
      const bool applied = steps[k]->step();
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      if (!applied) return false;
      seconds[k].push_back(dt.count());
      total += dt.count();
    }
    state.SetIterationTime(total);
    return true;
  };
  for (auto _ : state) {
    if (!round()) {
      state.SkipWithError("a step was skipped on finite gradients");
      break;
    }
  }

  // Weighted least squares of time = a + b * N with weights 1 / time^2.
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0, bytes = 0, params = 0;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const double x = kCounts[k], y = median(seconds[k]);
    if (y <= 0) continue;  // no samples (an error above)
    const double w = 1 / (y * y);
    sw += w, sx += w * x, sy += w * y, sxx += w * x * x, sxy += w * x * y;
    std::string name = "N";  // appended: "N" + std::to_string draws GCC 12's false -Wrestrict (PR 105329)
    name += std::to_string(kCounts[k]);
    name += "_s";
    state.counters[name] = y;
    bytes += steps[k]->bytes().per_param() * static_cast<double>(steps[k]->params());
    params += static_cast<double>(steps[k]->params());
  }
  const double det = sw * sxx - sx * sx;
  if (det > 0) {
    const double b = (sw * sxy - sx * sy) / det, a = (sy - b * sx) / sw;
    state.counters["slope_s"] = b;
    state.counters["intercept_s"] = a;
  }
  const auto rounds = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(rounds * bytes));
  state.SetItemsProcessed(static_cast<std::int64_t>(rounds * params));
}

const bool registered = [] {
  const std::pair<const char*, Series> series[] = {{"const_total_1M", Series::const_total},
                                                   {"const_numel_1024", Series::const_numel}};
  for (const auto& [sname, s] : series) {
    auto* b = benchmark::RegisterBenchmark((std::string("overhead/AdamW/f32/") + sname).c_str(),
                                           [s = s](benchmark::State& st) {
                                             run_point(st, series_case(s, static_cast<int>(st.range(0))));
                                           });
    b->ArgName("tensors");
    for (const int n : kCounts) b->Arg(n);
    b->UseRealTime()->Unit(benchmark::kMicrosecond);
  }
  for (const bool scaled : {true, false})
    benchmark::RegisterBenchmark(scaled ? "overhead/AdamW/f32/floor_1x1/scaled" : "overhead/AdamW/f32/floor_1x1/plain",
                                 [scaled](benchmark::State& st) { run_point(st, overhead_case(1, 1, scaled)); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  for (const auto& [sname, s] : series)
    benchmark::RegisterBenchmark((std::string("overhead/AdamW/f32/fit/") + sname).c_str(),
                                 [s = s](benchmark::State& st) { run_fit(st, s); })
        ->UseManualTime()  // the sum of the timed steps, without the bookkeeping between them
        ->Unit(benchmark::kMicrosecond);
  return true;
}();

}  // namespace
