// The sharded step across processes, under mpiexec with 1, 2 or 3 ranks over an
// MPI communicator: every rank computes the one-process step over the whole model
// itself and checks that its own shard's update and the StepResult are bitwise
// that step's, for every built-in, dtype setup and norm, whole tensors and slices;
// inf on one rank only; GradScaler growth and backoff; a rank that refuses its
// shard or a step's input makes every rank throw. (tests/sharded_step_test.cpp
// runs the same with in-process ranks, and under the sanitizers.)
#include <mpi.h>

#include <gtest/gtest.h>

#include "mpi_world.hpp"

#include <string>
#include <vector>

#include "sharded_support.hpp"
#include "stepfuse/mpi.hpp"

namespace stepfuse {
namespace {

using namespace sharded_test;  // NOLINT: the shared model, partitions and cases

using stepfuse::mpi_test::world_rank;
using stepfuse::mpi_test::world_size;

// This rank's shard of `parts`, stepped `steps` times with loss scale src.S, against
// the one-process step over the whole model.
void expect_my_shard_is_the_one_process_step(const OptimizerConfig& config, const DtypeSetup& setup, const Norm& norm,
                                             const Partition& parts, const GradSource& src, int steps,
                                             const std::string& what) {
  const std::vector<Piece>& mine = parts[static_cast<std::size_t>(world_rank())];
  Model one(setup.weight, setup.grad), sharded(setup.weight, setup.grad);
  OptimizerOptions o = base_options(norm);
  o.master_weights = setup.masters;
  std::vector<Param> all;
  for (std::size_t t = 0; t < kSizes.size(); ++t) all.push_back({one.w[t], one.g[t]});
  Optimizer reference(config, all, o);

  bool need_slices = false;
  for (const auto& rank : parts)
    for (const Piece& p : rank) need_slices |= p.numel != kSizes[p.tensor];
  o.communicator = mpi_communicator(MPI_COMM_WORLD);
  if (need_slices)
    for (const Piece& p : mine) o.slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
  Optimizer opt(config, rank_params(sharded, mine), o);
  for (int k = 0; k < steps; ++k) {
    fill_grads(one, src, k, whole_model());
    const StepResult want = reference.step_scaled(src.S);
    fill_grads(sharded, src, k, mine);
    expect_same_result(opt.step_scaled(src.S), want, what + ", step " + std::to_string(k));
  }
  const auto w_one = one.w.snapshot(), w_sharded = sharded.w.snapshot();
  const std::size_t esize = dtype_size(setup.weight);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const Piece& p = mine[i];
    const auto from = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p.offset) * esize);
    const auto to = from + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p.numel) * esize);
    EXPECT_TRUE(std::equal(w_sharded[p.tensor].begin() + from, w_sharded[p.tensor].begin() + to, w_one[p.tensor].begin() + from))
        << what << ": piece " << i << " weights";
    EXPECT_EQ(state_of(opt, i, 0, p.numel), state_of(reference, p.tensor, p.offset, p.numel)) << what << ": piece " << i << " state";
    const std::span<const float> m = reference.master(p.tensor), mm = opt.master(i);
    if (m.empty()) {
      EXPECT_TRUE(mm.empty()) << what;
    } else {
      EXPECT_TRUE(std::equal(mm.begin(), mm.end(), m.begin() + p.offset)) << what << ": piece " << i << " master";
    }
  }
}

class MpiSharded : public ::testing::TestWithParam<Case> {};

TEST_P(MpiSharded, EveryRanksShardIsTheOneProcessStepBitwise) {
  const Case& c = GetParam();
  const int ranks = world_size();
  if (ranks > 3) GTEST_SKIP() << "the partitions are written for 1 to 3 ranks";
  GradSource src;
  for (const DtypeSetup& setup : kSetups)
    for (const Norm& norm : kNorms) {
      const std::string what = std::string(c.name) + " " + std::string(dtype_name(setup.weight)) + "/" +
                               std::string(dtype_name(setup.grad)) + (setup.masters ? "+masters" : "") + " clip " +
                               (norm.max_grad_norm ? std::to_string(*norm.max_grad_norm) : "off") + " norm " +
                               std::to_string(norm.norm_type);
      expect_my_shard_is_the_one_process_step(c.config, setup, norm, whole_tensors(ranks), src, 3, what + ", whole");
      if (c.splittable && ranks > 1)
        expect_my_shard_is_the_one_process_step(c.config, setup, norm, sliced(ranks), src, 3, what + ", slices");
    }
}

INSTANTIATE_TEST_SUITE_P(Builtins, MpiSharded, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(MpiShardedStep, InfOnOneRankOnlySkipsTheStepOnEveryRank) {
  const int ranks = world_size();
  if (ranks > 3) GTEST_SKIP() << "the partitions are written for 1 to 3 ranks";
  GradSource src;
  src.inf_step = 1;
  src.inf_tensor = 5;  // on the last rank of whole_tensors(n)
  for (const Norm& norm : kNorms) {
    expect_my_shard_is_the_one_process_step(optim::AdamW{.lr = 1e-2}, kSetups[1], norm, whole_tensors(ranks), src, 3, "whole");
    if (ranks > 1) expect_my_shard_is_the_one_process_step(optim::Adam{.lr = 1e-2}, kSetups[0], norm, sliced(ranks), src, 3, "sliced");
  }
}

TEST(MpiShardedStep, GradScalersGrowAndBackOffTogether) {
  const int ranks = world_size();
  if (ranks > 3) GTEST_SKIP() << "the partitions are written for 1 to 3 ranks";
  const Partition parts = whole_tensors(ranks);
  const std::vector<Piece>& mine = parts[static_cast<std::size_t>(world_rank())];
  Model m(DType::bf16, DType::bf16);
  OptimizerOptions o = base_options(kNorms[1]);
  o.communicator = mpi_communicator(MPI_COMM_WORLD);
  Optimizer opt(optim::AdamW{.lr = 1e-2}, rank_params(m, mine), o);
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
  std::vector<float> scales;
  for (int k = 0; k < 6; ++k) {
    GradSource s;
    s.S = scaler.get_scale();
    s.inf_step = 3;
    s.inf_tensor = 0;  // rank 0's
    fill_grads(m, s, k, mine);
    scaler.step(opt);
    scaler.update();
    scales.push_back(static_cast<float>(scaler.get_scale()));
  }
  EXPECT_EQ(scales, (std::vector<float>{1024, 2048, 2048, 1024, 1024, 2048}));
}

TEST(MpiShardedStep, ARankThatRefusesItsShardOrAStepMakesEveryRankThrow) {
  const int ranks = world_size();
  if (ranks > 3) GTEST_SKIP() << "the partitions are written for 1 to 3 ranks";
  const int self = world_rank();
  const int bad = ranks - 1;
  const Partition parts = whole_tensors(ranks);
  const std::vector<Piece>& mine = parts[static_cast<std::size_t>(self)];
  Model m(DType::f32, DType::f32);
  OptimizerOptions o = base_options(kNorms[1]);
  o.communicator = mpi_communicator(MPI_COMM_WORLD);
  std::vector<Param> params = rank_params(m, mine);
  {
    std::vector<Param> broken = params;
    if (self == bad) broken[0].grad.data = nullptr;
    try {
      Optimizer opt(optim::AdamW{}, broken, o);
      ADD_FAILURE() << "rank " << self << " built its shard";
    } catch (const Error& e) {
      const std::string want = self == bad ? "grad.data is null"
                                           : "rank " + std::to_string(bad) + " of " + std::to_string(ranks) + " could not build its shard";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  Optimizer opt(optim::AdamW{}, params, o);
  GradSource src;
  fill_grads(m, src, 0, mine);
  const auto before = m.w.snapshot();
  try {
    opt.step_scaled(self == bad ? -1.0 : src.S);
    ADD_FAILURE() << "rank " << self << " stepped";
  } catch (const Error& e) {
    const std::string want = self == bad ? "loss_scale = -1" : "rank " + std::to_string(bad) + " refused its input to this step";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  EXPECT_EQ(m.w.snapshot(), before);
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_TRUE(opt.step_scaled(src.S).applied) << "the ranks are still in step";
}

}  // namespace
}  // namespace stepfuse
