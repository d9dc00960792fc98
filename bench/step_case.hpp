// The optimizer-step case the Google Benchmark suites share: build it, check one step, time it, report rates.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model_buffers.hpp"
#include "presets.hpp"
#include "step_bytes.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse::bench {

// The loss scale of the suites' AMP steps: a power of two, as GradScaler keeps it.
inline constexpr double kSuiteLossScale = 1024.0;

// One step configuration: optimizer, dtypes, mode, tensor list.
struct StepCase {
  OptimizerConfig config;
  DType weights = DType::f32;  // f16/bf16 weights get fp32 masters (the library's default)
  DType grads = DType::f32;
  Fusion fusion = Fusion::fused;
  std::vector<TensorShape> shapes;
  // true: step_scaled(kSuiteLossScale) with clipping at max norm 1 (reduce pass + update);
  // false: a plain step() on unscaled gradients, no clipping (the update pass alone).
  bool scaled = true;
  // 0: one param group. Else two (bench/param_groups.hpp): shapes [0, group_split) with
  // `config`, the rest with it without weight decay (shapes in group order: to_group_order).
  std::size_t group_split = 0;
};

// `count` tensors named prefix0, prefix1, ... of `numel` elements each.
std::vector<TensorShape> numbered_tensors(const char* prefix, int count, std::int64_t numel);

// 8 tensors of 1 Mi elements: 8.4 M parameters, whose step touches >= 64 MiB (fp32 SGD)
// and 128 MiB for Adam-type optimizers, beyond the 32 MiB L3 of the machines this runs on,
// and small enough to set up quickly for each of the ~150 cases of bench_step/bench_update.
std::vector<TensorShape> large_tensors();

// The same size with a transformer's mix of ranks, for param groups: 8 layers of a
// 1024x1024 weight, its 1024 bias and a 1024 norm's weight and bias (32 tensors,
// 8,413,184 parameters, 24 of them 1-D), in layer order.
std::vector<TensorShape> layered_tensors();

// An optimizer configuration with its name in the suites' case names.
struct NamedOptimizer {
  const char* name;
  OptimizerConfig config;
};
// Every built-in optimizer at the library's defaults, and SGD with momentum 0.9
// ("SGD_momentum"): AdamW, Adam, SGD, SGD_momentum, Adagrad, RMSprop, Lion.
std::vector<NamedOptimizer> suite_optimizers();

// Weight and gradient dtypes with their name in the suites' case names
// ("bf16w_f32m_bf16g": bf16 weights, which get fp32 masters, and bf16 gradients).
struct NamedDtypes {
  const char* name;
  DType weights, grads;
};

// A flat copy of the weights or the gradients of `b` as stored, in global element order:
// what the checks compare a step's results with. Allocates weight_bytes() or grad_bytes();
// copies with `threads` threads.
class StoredCopy {
 public:
  enum class Of { weights, grads };
  StoredCopy(const ModelBuffers& b, Of what, int threads);
  const std::byte* bytes(std::int64_t i) const { return data_.get() + i * static_cast<std::int64_t>(dtype_size(dtype_)); }
  float at(std::int64_t i) const { return load_as_f32(data_.get(), dtype_, i); }

 private:
  DType dtype_;
  std::unique_ptr<std::byte[]> data_;
};

// After one step from the weights in `before`: every weight and fp32 master is finite, and
// most of the values that carry the update moved: the fp32 masters where there are any
// (they start as the widened weights; a bf16 weight need not move under an SGD update of
// 1e-6, its master must), weight + compensation for compensated bf16 weights (the
// compensations start at 0: the weight or its compensation must move), else the weights.
// Returns "" when so, else what is wrong.
// Reads with `threads` threads.
std::string check_update_effect(const Optimizer& opt, const ModelBuffers& b, const StoredCopy& before, int threads);

// "" when every gradient is bitwise what `before` holds (no mode may write the caller's
// gradients), else how many differ.
std::string check_grads_unchanged(const ModelBuffers& b, const StoredCopy& before, int threads);

// A StepCase built and checked, ready to time. The constructor allocates and fills the
// buffers, builds the optimizer, takes one step and checks it (applied, check_update_effect,
// check_grads_unchanged); error() says what failed ("" when nothing did). Later steps reuse
// the same gradients: no mode writes them, so every timed step sees the same inputs.
class PreparedStep {
 public:
  PreparedStep(const StepCase& c, int threads);

  const std::string& error() const { return error_; }
  // The rest only when error() is empty. One more step; false when it was skipped
  // (non-finite gradients: never with these inputs).
  bool step();

  std::int64_t params() const { return buf_->total_numel(); }
  std::size_t tensors() const { return buf_->num_tensors(); }
  // The bytes the step must move per parameter (bench/step_bytes.hpp).
  const StepBytes& bytes() const { return bytes_; }

 private:
  bool scaled_;
  std::optional<ModelBuffers> buf_;
  std::optional<Optimizer> opt_;
  StepBytes bytes_;
  std::string error_;
};

// bytes_per_second (bytes the step must move, per second), items_per_second (parameters
// per second), "B/param" and "tensors" for a case that ran state.iterations() steps.
void report_step_rates(benchmark::State& state, const PreparedStep& p);

// The whole benchmark body of a step case: PreparedStep, SkipWithError on a failed check,
// the timed loop of steps, report_step_rates. Register it with UseRealTime(): the library's
// worker threads do the work, so this thread's CPU time means nothing.
void run_step_case(benchmark::State& state, const StepCase& c, int threads);

// Registers `c` as benchmark `name`, run on 1 and 2 threads (real time, milliseconds).
void register_step_case(const std::string& name, StepCase c);

}  // namespace stepfuse::bench
