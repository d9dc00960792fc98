// Google Benchmark suite of the reduce pass alone: cpu::reduce_kernel per gradient dtype and norm, on one thread and over the plan.
//
// The reduce pass reads every gradient once and returns, per 16 Ki-element chunk, the
// non-finite flag and the sum of squares (L2) or max |g| (inf norm). These cases call the
// kernel directly (runtime/cpu/kernels.hpp, a private header: this target alone gets the
// source root on its include path) over 32 Mi gradients in 8 tensors: 64 MiB in a 16-bit
// format and 128 MiB in fp32, beyond the 32 MiB L3 of the machines this runs on.
//
//   reduce/<grad dtype>/<l2|inf>/chunk_loop          every chunk in order on this thread
//   reduce/<grad dtype>/<l2|inf>/plan/threads:<n>    the engine's way: split_chunks' per-thread
//                                                    chunk ranges on the shared ThreadPool
//
// Both combine the per-chunk partials as the CPU backends do (cpu::HostBuffers::reduce) (fp64, chunks in order
// within a tensor, then tensors in order). Before timing, each case checks the result
// against a plain fp64 reference over the same stored values: the inf norm exactly, the
// sum of squares within the bound of its fp32 accumulation, and the plan's result bitwise
// against the chunk loop's (results do not depend on the thread count). After timing, the
// last result must equal the checked one bitwise. bytes_per_second counts the gradient
// bytes read; items_per_second, gradients per second.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "model_buffers.hpp"
#include "parallel.hpp"
#include "runtime/cpu/kernels.hpp"
#include "jit/layout.hpp"
#include "runtime/thread_pool.hpp"
#include "step_case.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;
namespace cpu = stepfuse::cpu;
namespace detail = stepfuse::detail;
namespace jit = stepfuse::jit;

namespace {

constexpr int kTensors = 8;
constexpr std::int64_t kNumelPerTensor = std::int64_t{1} << 22;
// The gradients are stored loss-scaled, as the reduce pass sees them in an AMP step.
constexpr double kLossScale = 1024.0;

// The sum of squares of one chunk is accumulated in fp32 in 32 interleaved lanes
// (kChunkElems / 32 terms each, all >= 0), then combined by a 5-level pairwise tree;
// the chunks are summed in fp64. Each term of a sum of non-negative values picks up at
// most (terms + levels + 1) roundings of 2^-24 (the +1: the square itself), which bounds
// the relative error of the whole sum. Must follow kChunkElems and the lane count of
// runtime/cpu/reduce.cpp.
constexpr double kSumsqRelTol = (static_cast<double>(cpu::kChunkElems) / 32 + 5 + 1) * 0x1p-24;

struct Totals {
  double sumsq = 0;  // L2 mode
  float maxabs = 0;  // inf mode
  bool nonfinite = false;
  bool operator==(const Totals&) const = default;
};

int fill_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// The gradients of one dtype and the fp64 reference over the values as stored.
struct Fixture {
  explicit Fixture(sf::DType g) : buf(sb::numbered_tensors("g", kTensors, kNumelPerTensor), g, g) {
    const int threads = fill_threads();
    buf.fill_grads(kLossScale, threads);
    std::vector<Totals> part(static_cast<std::size_t>(threads));
    sb::parallel_for(buf.total_numel(), threads, [&](int th, std::int64_t lo, std::int64_t hi) {
      buf.for_each_piece(lo, hi, [&](std::size_t t, std::int64_t s, std::int64_t e) {
        const sf::TensorView v = buf.grad(t);
        Totals& p = part[static_cast<std::size_t>(th)];
        for (std::int64_t i = s; i < e; ++i) {
          const double x = sb::load_as_f32(v.data, v.dtype, i);
          p.sumsq += x * x;
          p.maxabs = std::max(p.maxabs, static_cast<float>(std::fabs(x)));
          p.nonfinite |= !std::isfinite(x);
        }
      });
    });
    for (const Totals& p : part) {
      reference.sumsq += p.sumsq;
      reference.maxabs = std::max(reference.maxabs, p.maxabs);
      reference.nonfinite |= p.nonfinite;
    }
  }
  sb::ModelBuffers buf;
  Totals reference;
};

// The fixture for `g`, built on first use. Cases are registered grouped by dtype, so one
// fixture is alive at a time (the previous one is freed before the next is allocated).
const Fixture& fixture(sf::DType g) {
  static std::unique_ptr<Fixture> current;
  if (!current || current->buf.grad_dtype() != g) {
    current.reset();
    current = std::make_unique<Fixture>(g);
  }
  return *current;
}

// Partials of chunks [first, last) of the plan, as the CPU backends compute them.
void reduce_chunks(const Fixture& f, const jit::Layout& plan, cpu::ReduceFn fn, std::size_t first,
                   std::size_t last, std::vector<cpu::ReducePartial>& partials) {
  for (std::size_t c = first; c < last; ++c) {
    const jit::Chunk& ch = plan.chunks[c];
    const sf::TensorView g = f.buf.grad(ch.tensor);
    partials[c] = fn(static_cast<const char*>(g.data) + ch.begin * static_cast<std::int64_t>(sf::dtype_size(g.dtype)),
                     static_cast<std::size_t>(ch.len));
  }
}

// Combines the partials in the CPU backends' fixed order: fp64, chunks in order within
// a tensor, then tensors in order.
Totals combine(const jit::Layout& plan, const std::vector<cpu::ReducePartial>& partials) {
  Totals total;
  for (std::size_t t = 0; t + 1 < plan.tensor_chunks.size(); ++t) {
    double acc = 0;
    for (std::size_t c = plan.tensor_chunks[t]; c < plan.tensor_chunks[t + 1]; ++c) {
      acc += partials[c].sumsq;
      total.maxabs = std::max(total.maxabs, partials[c].maxabs);
      total.nonfinite |= partials[c].nonfinite;
    }
    total.sumsq += acc;
  }
  return total;
}

// "" when `got` is the reference's result, else what differs.
std::string check_against_reference(const Totals& got, const Totals& ref, cpu::NormKind kind) {
  char msg[200];
  if (got.nonfinite != ref.nonfinite) return got.nonfinite ? "non-finite flag set on finite gradients" : "non-finite flag missed";
  if (kind == cpu::NormKind::inf) {
    if (got.maxabs == ref.maxabs) return "";
    std::snprintf(msg, sizeof msg, "max |g| = %.9g, reference %.9g (must be equal)", got.maxabs, ref.maxabs);
    return msg;
  }
  if (std::fabs(got.sumsq - ref.sumsq) <= kSumsqRelTol * ref.sumsq) return "";
  std::snprintf(msg, sizeof msg, "sum of squares = %.17g, reference %.17g (relative error %.3g > %.3g)", got.sumsq,
                ref.sumsq, std::fabs(got.sumsq - ref.sumsq) / ref.sumsq, kSumsqRelTol);
  return msg;
}

// threads = 0: the chunk loop on this thread; else the plan on the shared pool of `threads`.
void run_reduce(benchmark::State& state, sf::DType g, cpu::NormKind kind, int threads) {
  const Fixture& f = fixture(g);
  const cpu::ReduceFn fn = cpu::reduce_kernel(g, kind);
  std::vector<jit::TensorShape> shapes;
  for (std::size_t t = 0; t < f.buf.num_tensors(); ++t) shapes.push_back({f.buf.numel(t), {sf::DType::f32, g, false}});
  const jit::Layout plan = jit::plan_layout(shapes);
  const std::vector<std::size_t> thread_chunks = jit::split_chunks(plan.chunks, std::max(threads, 1));
  std::vector<cpu::ReducePartial> partials(plan.chunks.size());
  detail::ThreadPool* pool = threads > 0 ? &detail::ThreadPool::shared(threads) : nullptr;
  const auto chunk_loop = [&] {
    reduce_chunks(f, plan, fn, 0, plan.chunks.size(), partials);
    return combine(plan, partials);
  };
  const auto pass = [&] {
    if (pool == nullptr) return chunk_loop();
    pool->run([&](int t) { reduce_chunks(f, plan, fn, thread_chunks[t], thread_chunks[t + 1], partials); });
    return combine(plan, partials);
  };

  // Check before timing.
  const Totals checked = pass();
  if (const std::string problem = check_against_reference(checked, f.reference, kind); !problem.empty()) {
    state.SkipWithError(problem.c_str());
    return;
  }
  if (pool != nullptr && !(chunk_loop() == checked)) {
    state.SkipWithError("the plan's result differs from the chunk loop's (it must not depend on the threads)");
    return;
  }

  Totals last;
  for (auto _ : state) {
    last = pass();
    benchmark::DoNotOptimize(last);
  }
  if (!(last == checked)) state.SkipWithError("a timed pass returned a different result from the checked one");

  const auto n = static_cast<double>(f.buf.total_numel());
  const auto passes = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(passes * n * static_cast<double>(sf::dtype_size(g))));
  state.SetItemsProcessed(static_cast<std::int64_t>(passes * n));
}

const bool registered = [] {
  const sf::DType dtypes[] = {sf::DType::f32, sf::DType::f16, sf::DType::bf16};
  const std::pair<const char*, cpu::NormKind> kinds[] = {{"l2", cpu::NormKind::l2}, {"inf", cpu::NormKind::inf}};
  for (const sf::DType g : dtypes) {  // grouped by dtype: see fixture()
    for (const auto& [kname, kind] : kinds) {
      const std::string prefix = "reduce/" + std::string(sf::dtype_name(g)) + "/" + kname;
      benchmark::RegisterBenchmark((prefix + "/chunk_loop").c_str(),
                                   [g, kind = kind](benchmark::State& st) { run_reduce(st, g, kind, 0); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark((prefix + "/plan").c_str(),
                                   [g, kind = kind](benchmark::State& st) {
                                     run_reduce(st, g, kind, static_cast<int>(st.range(0)));
                                   })
          ->ArgName("threads")
          ->Arg(1)
          ->Arg(2)
          ->UseRealTime()  // the pool's worker threads do part of the work
          ->Unit(benchmark::kMillisecond);
    }
  }
  return true;
}();

}  // namespace
