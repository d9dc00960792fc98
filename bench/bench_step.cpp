// Google Benchmark suite of full optimizer steps: per optimizer and dtype, fused vs unfused vs interpreted, 1 and 2 threads.
//
// Each case builds its buffers and optimizer once, checks that one step did something
// sensible (applied, every weight and master finite, most of them moved, the gradients
// untouched) before timing, then times step_scaled (reduce pass + update) or step() (update
// pass alone). bytes_per_second is the bytes the step must move (bench/step_bytes.hpp) per
// second of wall time, the same figure stepfuse-bench reports, so it can be read against the
// machine's bandwidth; items_per_second is parameters per second.
//
// Cases: step/<optimizer>/<dtypes>/<mode>/threads:<n> for every optimizer x {f32,
// bf16w_f32m_bf16g} x {fused, unfused, interpreted} x {1, 2} threads on 8.4 M parameters
// (bench/step_case.hpp), plus plain_step/AdamW/f32 (update pass alone, every mode; the
// fused update pass of every optimizer and dtype is in bench_update),
// small_tensors_1000x1024/AdamW/f32 (the tensor-count sweep is in bench_overhead), and
// groups/AdamW/<dtypes>/<mode>/{1group,2groups}: the same step on a transformer-like list
// (bench/step_case.hpp's layered_tensors) with one param group and with two (weight decay
// on the matrices, none on the 1-D tensors), registered side by side so that one run
// (--benchmark_filter=groups/) shows what a second group costs. Google Benchmark times the
// cases one after another, not interleaved: on a busy machine, stepfuse-bench --groups
// compare measures the same ratio with each iteration's pair of steps back to back.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "param_groups.hpp"
#include "step_case.hpp"
#include "stepfuse/stepfuse.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;

namespace {

struct NamedCase {
  std::string name;
  sb::StepCase c;
};

std::vector<NamedCase> all_cases() {
  const std::vector<sb::NamedOptimizer> optimizers = sb::suite_optimizers();
  // bf16 weights get fp32 masters (the default), as a bf16 AMP model keeps them.
  const sb::NamedDtypes dtypes[] = {{"f32", sf::DType::f32, sf::DType::f32},
                                    {"bf16w_f32m_bf16g", sf::DType::bf16, sf::DType::bf16}};
  const std::pair<const char*, sf::Fusion> modes[] = {
      {"fused", sf::Fusion::fused}, {"unfused", sf::Fusion::unfused}, {"interpreted", sf::Fusion::interpreted}};

  // The param-group cases' list, in group order (matrices, then 1-D tensors) for one group
  // and for two alike.
  std::vector<sb::TensorShape> layered = sb::layered_tensors();
  const std::size_t split = sb::to_group_order(layered);

  std::vector<NamedCase> cases;
  for (const auto& [mname, mode] : modes) {
    // Full AMP step (reduce pass + update), every optimizer and dtype combination.
    for (const auto& d : dtypes)
      for (const auto& o : optimizers)
        cases.push_back({std::string("step/") + o.name + "/" + d.name + "/" + mname,
                         {o.config, d.weights, d.grads, mode, sb::large_tensors(), /*scaled=*/true}});
    // Update pass alone: a plain step, no loss scale, no clipping.
    cases.push_back({std::string("plain_step/AdamW/f32/") + mname,
                     {sf::optim::AdamW{}, sf::DType::f32, sf::DType::f32, mode, sb::large_tensors(), false}});
    // Small-tensor overhead.
    cases.push_back({std::string("small_tensors_1000x1024/AdamW/f32/") + mname,
                     {sf::optim::AdamW{}, sf::DType::f32, sf::DType::f32, mode, sb::numbered_tensors("s", 1000, 1024), true}});
    // One param group against two, full AMP step.
    for (const auto& d : dtypes)
      for (const int groups : {1, 2})
        cases.push_back({std::string("groups/AdamW/") + d.name + "/" + mname + (groups == 1 ? "/1group" : "/2groups"),
                         {sf::optim::AdamW{}, d.weights, d.grads, mode, layered, /*scaled=*/true,
                          groups == 1 ? std::size_t{0} : split}});
  }
  return cases;
}

const bool registered = [] {
  for (NamedCase& nc : all_cases()) {
    sb::register_step_case(nc.name, std::move(nc.c));
  }
  return true;
}();

}  // namespace
