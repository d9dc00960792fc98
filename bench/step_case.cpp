// The optimizer-step case the Google Benchmark suites share: build it, check one step, time it, report rates.
#include "step_case.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <span>

#include "parallel.hpp"
#include "param_groups.hpp"

namespace stepfuse::bench {

std::vector<TensorShape> numbered_tensors(const char* prefix, int count, std::int64_t numel) {
  std::vector<TensorShape> t;
  t.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    // Built by appending: prefix + std::to_string(i) draws a false -Wrestrict from GCC 12
    // at -O3 (PR 105329).
    std::string name = prefix;
    name += std::to_string(i);
    t.push_back({std::move(name), numel});
  }
  return t;
}

std::vector<TensorShape> large_tensors() { return numbered_tensors("w", 8, std::int64_t{1} << 20); }

std::vector<TensorShape> layered_tensors() {
  constexpr std::int64_t d = 1024;
  std::vector<TensorShape> t;
  for (int l = 0; l < 8; ++l) {
    std::string h = "layer";  // (appended: see numbered_tensors)
    h += std::to_string(l);
    h += ".";
    t.push_back({h + "weight", d * d, {d, d}});
    t.push_back({h + "bias", d, {d}});
    t.push_back({h + "norm.weight", d, {d}});
    t.push_back({h + "norm.bias", d, {d}});
  }
  return t;
}

std::vector<NamedOptimizer> suite_optimizers() {
  return {{"AdamW", optim::AdamW{}},
          {"Adam", optim::Adam{}},
          {"SGD", optim::SGD{}},
          {"SGD_momentum", optim::SGD{.momentum = 0.9}},
          {"Adagrad", optim::Adagrad{}},
          {"RMSprop", optim::RMSprop{}},
          {"Lion", optim::Lion{}}};
}

StoredCopy::StoredCopy(const ModelBuffers& b, Of what, int threads)
    : dtype_(what == Of::weights ? b.weight_dtype() : b.grad_dtype()),
      data_(std::make_unique_for_overwrite<std::byte[]>(what == Of::weights ? b.weight_bytes() : b.grad_bytes())) {
  const auto es = static_cast<std::int64_t>(dtype_size(dtype_));
  parallel_for(b.total_numel(), threads, [&](int, std::int64_t lo, std::int64_t hi) {
    b.for_each_piece(lo, hi, [&](std::size_t t, std::int64_t s, std::int64_t e) {
      const TensorView v = what == Of::weights ? b.weight(t) : b.grad(t);
      std::memcpy(data_.get() + (b.offset(t) + s) * es, static_cast<const std::byte*>(v.data) + s * es,
                  static_cast<std::size_t>((e - s) * es));
    });
  });
}

std::string check_update_effect(const Optimizer& opt, const ModelBuffers& b, const StoredCopy& before, int threads) {
  const std::size_t slots = static_cast<std::size_t>(std::max(threads, 1));
  std::vector<std::int64_t> nonfinite(slots, 0), unchanged(slots, 0);
  parallel_for(b.total_numel(), threads, [&](int th, std::int64_t lo, std::int64_t hi) {
    b.for_each_piece(lo, hi, [&](std::size_t t, std::int64_t s, std::int64_t e) {
      const TensorView w = b.weight(t);
      const std::span<const float> master = opt.master(t);
      const std::span<const std::uint16_t> compensation = opt.compensation(t);
      for (std::int64_t i = s; i < e; ++i) {
        const float x = load_as_f32(w.data, w.dtype, i);
        // The parameter: the master, or weight + compensation (an fp32 add, as the step reads
        // it; the compensations start at 0, so it moved when the weight or its compensation did).
        const float carried = !master.empty()         ? master[static_cast<std::size_t>(i)]
                              : !compensation.empty() ? x + bf16_to_f32(compensation[static_cast<std::size_t>(i)])
                                                      : x;
        nonfinite[th] += !std::isfinite(x) || !std::isfinite(carried);
        unchanged[th] += carried == before.at(b.offset(t) + i);
      }
    });
  });
  std::int64_t bad = 0, same = 0;
  for (std::size_t k = 0; k < slots; ++k) bad += nonfinite[k], same += unchanged[k];
  if (bad > 0) return std::to_string(bad) + " weights, masters or compensated weights are not finite after one step";
  if (2 * same > b.total_numel())
    return std::to_string(same) + " of " + std::to_string(b.total_numel()) +
           (!opt.master(0).empty()         ? " fp32 masters"
            : !opt.compensation(0).empty() ? " weights + compensations"
                                           : " weights") +
           " did not change in one step";
  return "";
}

std::string check_grads_unchanged(const ModelBuffers& b, const StoredCopy& before, int threads) {
  const std::size_t slots = static_cast<std::size_t>(std::max(threads, 1));
  std::vector<std::int64_t> changed(slots, 0);
  const auto es = static_cast<std::int64_t>(dtype_size(b.grad_dtype()));
  parallel_for(b.total_numel(), threads, [&](int th, std::int64_t lo, std::int64_t hi) {
    b.for_each_piece(lo, hi, [&](std::size_t t, std::int64_t s, std::int64_t e) {
      const auto* g = static_cast<const std::byte*>(b.grad(t).data);
      if (std::memcmp(g + s * es, before.bytes(b.offset(t) + s), static_cast<std::size_t>((e - s) * es)) == 0) return;
      for (std::int64_t i = s; i < e; ++i)  // rare: count them
        changed[th] += std::memcmp(g + i * es, before.bytes(b.offset(t) + i), static_cast<std::size_t>(es)) != 0;
    });
  });
  std::int64_t n = 0;
  for (const std::int64_t c : changed) n += c;
  return n == 0 ? "" : std::to_string(n) + " gradients were written by the step (no mode may write them)";
}

PreparedStep::PreparedStep(const StepCase& c, int threads) : scaled_(c.scaled) {
  const double grad_scale = c.scaled ? kSuiteLossScale : 1.0;
  try {
    buf_.emplace(c.shapes, c.weights, c.grads);
    buf_->fill_weights(threads);
    buf_->fill_grads(grad_scale, threads);
    OptimizerOptions opts;
    opts.fusion = c.fusion;
    opts.num_threads = threads;
    if (c.scaled) opts.max_grad_norm = 1.0;
    if (c.group_split > 0)
      opt_.emplace(decay_groups(buf_->params(), c.group_split, c.config), opts);
    else
      opt_.emplace(c.config, buf_->params(), opts);
    bytes_ = step_bytes(UpdateProgram::from_config(c.config).program(), c.weights, c.grads, /*masters=*/true, c.scaled);
  } catch (const std::exception& e) {
    error_ = e.what();
    return;
  }
  // Copies of the inputs for the checks, freed before anything is timed.
  const StoredCopy weights_before(*buf_, StoredCopy::Of::weights, threads);
  const StoredCopy grads_before(*buf_, StoredCopy::Of::grads, threads);
  if (!step()) {
    error_ = "the first step was skipped on finite gradients";
    return;
  }
  error_ = check_update_effect(*opt_, *buf_, weights_before, threads);
  if (error_.empty()) error_ = check_grads_unchanged(*buf_, grads_before, threads);
}

bool PreparedStep::step() {
  if (scaled_) return opt_->step_scaled(kSuiteLossScale).applied;
  opt_->step();
  return opt_->last_result().applied;
}

void report_step_rates(benchmark::State& state, const PreparedStep& p) {
  const auto steps = static_cast<double>(state.iterations());
  const auto n = static_cast<double>(p.params());
  state.SetBytesProcessed(static_cast<std::int64_t>(steps * p.bytes().per_param() * n));
  state.SetItemsProcessed(static_cast<std::int64_t>(steps * n));
  state.counters["B/param"] = p.bytes().per_param();
  state.counters["tensors"] = static_cast<double>(p.tensors());
}

void run_step_case(benchmark::State& state, const StepCase& c, int threads) {
  PreparedStep p(c, threads);
  if (!p.error().empty()) {
    state.SkipWithError(p.error().c_str());  // before the loop: the loop does not run
    return;
  }
  for (auto _ : state) {
    const bool applied = p.step();
    benchmark::DoNotOptimize(applied);
    if (!applied) {
      state.SkipWithError("a step was skipped on finite gradients");
      break;
    }
  }
  report_step_rates(state, p);
}

}  // namespace stepfuse::bench

namespace stepfuse::bench {

void register_step_case(const std::string& name, StepCase c) {
  benchmark::RegisterBenchmark(name.c_str(),
                               [c = std::move(c)](benchmark::State& st) {
                                 run_step_case(st, c, static_cast<int>(st.range(0)));
                               })
      ->ArgName("threads")
      ->Arg(1)
      ->Arg(2)
      ->UseRealTime()  // the library's worker threads do the work: CPU time of this thread means nothing
      ->Unit(benchmark::kMillisecond);
}

}  // namespace stepfuse::bench
