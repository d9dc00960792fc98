// Google Benchmark suite of full optimizer steps: per optimizer and dtype, fused vs unfused, 1 and 2 threads.
//
// Each case builds its buffers and optimizer once, checks that one step did something
// sensible (applied, every weight finite, most weights moved) before timing, then times
// step_scaled (reduce pass + update) or step() (update pass alone). bytes_per_second is the
// bytes the step must move (bench/step_bytes.hpp) per second of wall time, the same figure
// stepfuse-bench reports, so it can be read against the machine's bandwidth.
#include <benchmark/benchmark.h>

#include <optional>
#include <string>
#include <vector>

#include "model_buffers.hpp"
#include "presets.hpp"
#include "step_bytes.hpp"
#include "stepfuse/stepfuse.hpp"
#include "verify.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;

namespace {

constexpr double kLossScale = 1024.0;

struct Case {
  std::string name;
  sf::OptimizerConfig config;
  sf::DType weights = sf::DType::f32, grads = sf::DType::f32;
  sf::Fusion fusion = sf::Fusion::fused;
  std::vector<sb::TensorShape> shapes;
  bool scaled = true;  // step_scaled(S) with clipping (reduce + update); false: plain step() (update only)
};

// Tensor names are built by appending: "w" + std::to_string(i) draws a false -Wrestrict
// from GCC 12 at -O3 (PR 105329).
std::vector<sb::TensorShape> numbered(const char* prefix, int count, std::int64_t numel) {
  std::vector<sb::TensorShape> t;
  for (int i = 0; i < count; ++i) {
    std::string name = prefix;
    name += std::to_string(i);
    t.push_back({std::move(name), numel});
  }
  return t;
}

// 8 tensors of 2 Mi elements: 64 MiB per fp32 array, far beyond any cache, small enough
// to set up quickly for every case.
std::vector<sb::TensorShape> large_tensors() { return numbered("w", 8, std::int64_t{1} << 21); }

// The small-tensor overhead case: 1000 tensors of 1024 elements.
std::vector<sb::TensorShape> small_tensors() { return numbered("s", 1000, 1024); }

void run_case(benchmark::State& state, const Case& c) {
  const int threads = static_cast<int>(state.range(0));
  sb::ModelBuffers buf(c.shapes, c.weights, c.grads);
  buf.fill_weights(threads);
  buf.fill_grads(c.scaled ? kLossScale : 1.0, threads);
  // The unfused mode unscales and clips the gradients in place; it gets them back from
  // this pristine copy before every step, outside the timed region.
  std::optional<sb::ModelBuffers> pristine;
  const bool restore = c.fusion == sf::Fusion::unfused && c.scaled;
  if (restore) {
    pristine.emplace(c.shapes, c.weights, c.grads);
    pristine->fill_grads(kLossScale, threads);
  }

  sf::OptimizerOptions opts;
  opts.fusion = c.fusion;
  opts.num_threads = threads;
  if (c.scaled) opts.max_grad_norm = 1.0;
  std::optional<sf::Optimizer> opt;
  try {
    opt.emplace(c.config, buf.params(), opts);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  auto step = [&]() -> bool {
    if (c.scaled) return opt->step_scaled(kLossScale).applied;
    opt->step();
    return true;
  };

  // Check before timing.
  if (!step()) {
    state.SkipWithError("the first step was skipped on finite gradients");
    return;
  }
  if (const std::string problem = sb::check_step_effect(buf, threads); !problem.empty()) {
    state.SkipWithError(problem.c_str());
    return;
  }

  for (auto _ : state) {
    if (restore) {
      state.PauseTiming();
      buf.copy_grads_from(*pristine, threads);
      state.ResumeTiming();
    }
    const bool applied = step();
    benchmark::DoNotOptimize(applied);
    if (!applied) {
      state.SkipWithError("a step was skipped on finite gradients");
      break;
    }
  }

  const sb::StepBytes bytes = sb::step_bytes(c.weights, c.grads, /*masters=*/true,
                                             static_cast<int>(opt->state_names().size()), c.scaled);
  const auto n = static_cast<double>(buf.total_numel());
  state.SetBytesProcessed(static_cast<std::int64_t>(static_cast<double>(state.iterations()) * bytes.per_param() * n));
  state.counters["B/param"] = bytes.per_param();
  state.counters["tensors"] = static_cast<double>(buf.num_tensors());  // time / tensors = cost per tensor
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  struct Named {
    const char* name;
    sf::OptimizerConfig config;
  };
  sf::optim::SGD sgd_momentum;
  sgd_momentum.momentum = 0.9;
  const Named optimizers[] = {
      {"AdamW", sf::optim::AdamW{}},     {"Adam", sf::optim::Adam{}},       {"SGD", sf::optim::SGD{}},
      {"SGD_momentum", sgd_momentum},     {"Adagrad", sf::optim::Adagrad{}}, {"RMSprop", sf::optim::RMSprop{}},
      {"Lion", sf::optim::Lion{}},
  };
  const std::pair<const char*, sf::Fusion> modes[] = {{"fused", sf::Fusion::fused}, {"unfused", sf::Fusion::unfused}};
  for (const auto& [mname, mode] : modes) {
    // Full AMP step (reduce pass + update), fp32, every optimizer.
    for (const auto& o : optimizers)
      cases.push_back({std::string("step/") + o.name + "/f32/" + mname, o.config, sf::DType::f32, sf::DType::f32, mode,
                       large_tensors(), true});
    // Mixed precision: bf16 weights + fp32 masters + bf16 grads.
    cases.push_back({std::string("step/AdamW/bf16w_f32m_bf16g/") + mname, sf::optim::AdamW{}, sf::DType::bf16,
                     sf::DType::bf16, mode, large_tensors(), true});
    // Update pass alone: a plain step, no loss scale, no clipping.
    cases.push_back({std::string("plain_step/AdamW/f32/") + mname, sf::optim::AdamW{}, sf::DType::f32, sf::DType::f32,
                     mode, large_tensors(), false});
    // Small-tensor overhead.
    cases.push_back({std::string("small_tensors_1000x1024/AdamW/f32/") + mname, sf::optim::AdamW{}, sf::DType::f32,
                     sf::DType::f32, mode, small_tensors(), true});
  }
  return cases;
}

const bool registered = [] {
  for (const Case& c : all_cases()) {
    benchmark::RegisterBenchmark(c.name.c_str(), [c](benchmark::State& st) { run_case(st, c); })
        ->ArgName("threads")
        ->Arg(1)
        ->Arg(2)
        ->UseRealTime()  // the library's worker threads do the work: CPU time of this thread means nothing
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace
