// ShardedOptimizer (ZeRO-2) across processes, under mpiexec with 1, 2 or 3 ranks over
// the MPI communicator. Each rank holds the whole model and its own gradients, and
// computes itself the one-process step on the averaged gradients; after every step
// its whole weights and the StepResult must be bitwise that step's. MPI sums in an
// order of its own, so the gradients here are small integers times a power of two
// per tensor: every sum over the ranks is exact in any order (in fp32, and in bf16
// for the bf16 wire), and the average is one correctly rounded division in either
// case. (tests/sharded_optimizer_test.cpp covers rounding sums with in-process ranks.)
#include <mpi.h>

#include <gtest/gtest.h>

#include "mpi_world.hpp"

#include <cmath>
#include <cstring>
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "stepfuse/mpi.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using stepfuse::mpi_test::world_rank;
using stepfuse::mpi_test::world_size;

const std::vector<std::int64_t> kSizes = {40000, 100, 16384, 50000, 7, 33000};

// The model's tensors, in one dtype (kept as bf16/f32 bits).
struct Tensors {
  Tensors(DType d, const std::vector<std::int64_t>& sizes) : dtype(d) {
    for (std::int64_t n : sizes) {
      store.emplace_back(static_cast<std::size_t>(n) * dtype_size(d));
      views.push_back({store.back().data(), n, d});
    }
  }
  void set(std::size_t t, std::int64_t j, float x) {
    if (dtype == DType::f32) std::memcpy(store[t].data() + j * 4, &x, 4);
    else {
      const std::uint16_t b = dtype == DType::bf16 ? float_to_bf16(x) : float_to_f16(x);
      std::memcpy(store[t].data() + j * 2, &b, 2);
    }
  }
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> out;
    for (const auto& s : store) out.insert(out.end(), s.begin(), s.end());
    return out;
  }
  DType dtype;
  std::vector<std::vector<unsigned char>> store;
  std::vector<TensorView> views;
};

// Rank r's gradient of step k: an integer in [-32, 32] (exact in bf16, and so is any
// sum of three) times 2^-8, 1 or 2^8 by tensor, times the loss scale (a power of two).
float grad_value(int k, int r, std::size_t t, std::int64_t j, double scale) {
  std::uint64_t x = (static_cast<std::uint64_t>(k) << 52) ^ (static_cast<std::uint64_t>(r) << 46) ^
                    (static_cast<std::uint64_t>(t) << 40) ^ static_cast<std::uint64_t>(j);
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  const int v = static_cast<int>(x % 65) - 32;
  return static_cast<float>(v * std::ldexp(1.0, 8 * (static_cast<int>(t % 3) - 1)) * scale);
}

struct StepSetup {
  DType weight = DType::f32, grad = DType::f32;
  CommType wire = CommType::f32;
  std::optional<double> max_grad_norm = 0.5;
  bool scaler = false;
  int inf_step = -1;  // on the last rank only
  int steps = 4;
};

std::vector<ParamGroup> groups_of(const Tensors& w, const Tensors& g) {
  // Matrices with weight decay, the small tensors (1 and 4) without, another lr.
  ParamGroup a{{}, optim::AdamW{.lr = 1e-2, .weight_decay = 0.1}}, b{{}, optim::AdamW{.lr = 3e-3, .weight_decay = 0}};
  for (std::size_t t = 0; t < kSizes.size(); ++t) (t == 1 || t == 4 ? b : a).params.push_back({w.views[t], g.views[t]});
  return {a, b};
}

OptimizerOptions options_of(const StepSetup& s) {
  OptimizerOptions o;
  o.max_grad_norm = s.max_grad_norm;
  o.cpu_backend = CpuBackend::highway;
  o.num_threads = 1;
  return o;
}

void init(Tensors& w) {
  for (std::size_t t = 0; t < kSizes.size(); ++t)
    for (std::int64_t j = 0; j < kSizes[t]; ++j) w.set(t, j, static_cast<float>(std::sin(0.37 * static_cast<double>(j) + static_cast<double>(t))));
}

void expect_same(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_EQ(a.applied, b.applied) << what;
  EXPECT_EQ(a.found_inf, b.found_inf) << what;
  EXPECT_EQ(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double)), 0) << what << ": " << a.grad_norm << " vs " << b.grad_norm;
  EXPECT_EQ(std::memcmp(&a.clip_coef, &b.clip_coef, sizeof(double)), 0) << what;
}

// This rank's ShardedOptimizer against the one-process Optimizer on the average.
void expect_one_process_step(const StepSetup& s, const std::string& what) {
  const int rank = world_rank(), ranks = world_size();
  Tensors w(s.weight, kSizes), g(s.grad, kSizes), rw(s.weight, kSizes), rg(DType::f32, kSizes);
  init(w);
  init(rw);
  ShardedOptions so;
  so.grad_type = s.wire;
  ShardedOptimizer opt(groups_of(w, g), mpi_communicator(MPI_COMM_WORLD), options_of(s), so);
  Optimizer ref(groups_of(rw, rg), options_of(s));
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2), ref_scaler("cpu", 1024.0, 2.0, 0.5, 2);
  for (int k = 0; k < s.steps; ++k) {
    const double scale = s.scaler ? scaler.get_scale() : 1024.0;
    const bool inf_here = k == s.inf_step;
    for (std::size_t t = 0; t < kSizes.size(); ++t)
      for (std::int64_t j = 0; j < kSizes[t]; ++j) {
        float sum = 0;
        for (int r = 0; r < ranks; ++r) sum += grad_value(k, r, t, j, scale);
        rg.set(t, j, inf_here && t == 3 && j == 5 ? INFINITY : sum / static_cast<float>(ranks));
        g.set(t, j, inf_here && rank == ranks - 1 && t == 3 && j == 5 ? INFINITY : grad_value(k, rank, t, j, scale));
      }
    StepResult got, want;
    if (s.scaler) {
      opt.step(scaler);
      got = scaler.last_step_result();
      ref_scaler.step(ref);
      want = ref_scaler.last_step_result();
      scaler.update();
      ref_scaler.update();
      EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale()) << what << ", step " << k;
    } else {
      got = opt.step_scaled(scale);
      want = ref.step_scaled(scale);
    }
    const std::string at = what + ", rank " + std::to_string(rank) + " of " + std::to_string(ranks) + ", step " + std::to_string(k);
    expect_same(got, want, at);
    EXPECT_EQ(want.applied, k != s.inf_step) << at;
    EXPECT_TRUE(w.bytes() == rw.bytes()) << at << ": weights differ";
  }
  // Every rank's weights are the same bytes: compare hashes through MPI.
  const std::vector<unsigned char> mine = w.bytes();
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : mine) h = (h ^ c) * 0x100000001b3ull;
  std::vector<std::uint64_t> all(static_cast<std::size_t>(ranks));
  MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)], all[0]) << what << ": rank " << r;
  // The bytes it reports: one reduce_scatter of the largest range, one all_gather of its weights.
  std::int64_t count = 0;
  for (const auto& range : opt.ranges()) count = std::max(count, range.size());
  const ShardedOptimizer::Traffic t = opt.traffic();
  EXPECT_EQ(t.grad_reduce_scatter, static_cast<std::size_t>(ranks - 1) * static_cast<std::size_t>(count) * comm_type_size(s.wire));
}

TEST(MpiShardedOptimizer, F32IsTheOneProcessStepOnTheAverage) {
  StepSetup s;
  s.inf_step = 2;
  expect_one_process_step(s, "f32");
}

TEST(MpiShardedOptimizer, Bf16WithMastersOverBothWires) {
  StepSetup s;
  s.weight = s.grad = DType::bf16;
  expect_one_process_step(s, "bf16, f32 wire");
  s.wire = CommType::bf16;
  s.max_grad_norm.reset();
  s.inf_step = 1;
  expect_one_process_step(s, "bf16, bf16 wire");
}

TEST(MpiShardedOptimizer, GradScalerGrowsAndBacksOffOnEveryRank) {
  StepSetup s;
  s.weight = s.grad = DType::bf16;
  s.scaler = true;
  s.steps = 6;
  s.inf_step = 3;
  expect_one_process_step(s, "GradScaler");
}

TEST(MpiShardedOptimizer, AModelThatDiffersOnOneRankMakesEveryRankThrow) {
  const int rank = world_rank(), ranks = world_size();
  std::vector<std::int64_t> sizes = kSizes;
  if (rank == ranks - 1 && ranks > 1) sizes[3] += 1;
  Tensors w(DType::f32, sizes), g(DType::f32, sizes);
  std::vector<Param> params;
  for (std::size_t t = 0; t < sizes.size(); ++t) params.push_back({w.views[t], g.views[t]});
  const auto comm = mpi_communicator(MPI_COMM_WORLD);
  if (ranks == 1) {
    EXPECT_NO_THROW(ShardedOptimizer(optim::AdamW{}, params, comm));
    return;
  }
  try {
    ShardedOptimizer opt(optim::AdamW{}, params, comm);
    ADD_FAILURE() << "rank " << rank << " built it";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(ranks - 1) + "'s model differs from rank 0's"),
              std::string::npos)
        << e.what();
  }
  // Still in step: a good one builds and steps on every rank.
  std::vector<Param> good;
  Tensors w2(DType::f32, kSizes), g2(DType::f32, kSizes);
  for (std::size_t t = 0; t < kSizes.size(); ++t) good.push_back({w2.views[t], g2.views[t]});
  ShardedOptimizer opt(optim::AdamW{}, good, comm);
  EXPECT_TRUE(opt.step_scaled(1.0).applied);
}

}  // namespace
}  // namespace stepfuse
