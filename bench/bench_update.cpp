// Google Benchmark suite of the update pass alone: a plain fused step per optimizer and dtype combination, 1 and 2 threads.
//
// A plain Optimizer::step() without clipping runs no reduce pass (no loss scale to check,
// no norm to take), so its time is the fused update kernels' alone: one pass reading the
// gradients and the fp32 values (masters or weights) and every state stream, and writing
// them back. Each case checks one step before timing (applied, every weight and master
// finite, most moved, the gradients untouched; bench/step_case.hpp) and reports
// bytes_per_second from the bytes the update must move (bench/step_bytes.hpp: no reduce
// pass) and items_per_second = parameters per second.
//
// Cases: update/<optimizer>/<dtypes>/threads:<n>, optimizer in {SGD_momentum, Adam, AdamW,
// Adagrad, RMSprop, Lion}, dtypes in {f32 (weights and grads), bf16w_f32m_bf16g (bf16
// weights, fp32 masters, bf16 grads), f16w_f32m_f16g, f32w_bf16g}, 1 and 2 threads, on
// 8.4 M parameters in 8 tensors. The unfused and interpreted update passes of AdamW are
// bench_step's plain_step cases.
#include <benchmark/benchmark.h>

#include <string>
#include <string_view>
#include <vector>

#include "step_case.hpp"
#include "stepfuse/stepfuse.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;

namespace {

const bool registered = [] {
  const sb::NamedDtypes dtypes[] = {{"f32", sf::DType::f32, sf::DType::f32},
                                    {"bf16w_f32m_bf16g", sf::DType::bf16, sf::DType::bf16},
                                    {"f16w_f32m_f16g", sf::DType::f16, sf::DType::f16},
                                    {"f32w_bf16g", sf::DType::f32, sf::DType::bf16}};
  for (const auto& o : sb::suite_optimizers()) {
    if (std::string_view(o.name) == "SGD") continue;  // SGD with momentum only (the cases above)
    for (const auto& d : dtypes) {
      const sb::StepCase c{o.config, d.weights, d.grads, sf::Fusion::fused, sb::large_tensors(), /*scaled=*/false};
      sb::register_step_case(std::string("update/") + o.name + "/" + d.name, c);
    }
  }
  return true;
}();

}  // namespace
