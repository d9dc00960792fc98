// Sharded checkpoints across processes: a run sharded over every rank of the job
// saves one file per rank; the first N - 1 ranks (one, unsharded, when the job has
// one rank) load the set cut otherwise (Optimizer::load_shards over a communicator
// of their own) and go on; their shards are bitwise the uninterrupted one-process
// run. (tests/sharded_checkpoint_test.cpp covers the cuts and the errors with
// in-process ranks.)
#include <mpi.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "sharded_support.hpp"
#include "stepfuse/mpi.hpp"

namespace stepfuse {
namespace {

using namespace sharded_test;  // NOLINT: the shared model, partitions and cases

TEST(MpiShardedCheckpoint, SavedOnNRanksLoadsOnNMinusOneAndContinuesBitwise) {
  int rank = 0, ranks = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (ranks > 3) GTEST_SKIP() << "the partitions are written for 1 to 3 ranks";
  // One directory for the job: rank 0's name, broadcast.
  char dir[256] = {};
  if (rank == 0) {
    const std::string d = (std::filesystem::temp_directory_path() / ("stepfuse-mpi-ckpt-" + std::to_string(getpid()))).string();
    std::filesystem::create_directories(d);
    std::snprintf(dir, sizeof(dir), "%s", d.c_str());
  }
  MPI_Bcast(dir, sizeof(dir), MPI_CHAR, 0, MPI_COMM_WORLD);

  const DtypeSetup setup{DType::bf16, DType::bf16, true};
  const OptimizerConfig config = optim::AdamW{.lr = 1e-2};
  const GradSource src;
  constexpr int kBefore = 3, kAfter = 2;

  // The one-process run, on every rank; `at_save` keeps its weights at the save.
  Model one(setup.weight, setup.grad);
  OptimizerOptions o = base_options(kNorms[1]);
  std::vector<Param> all;
  for (std::size_t t = 0; t < kSizes.size(); ++t) all.push_back({one.w[t], one.g[t]});
  Optimizer reference(config, all, o);
  std::vector<StepResult> expected;
  std::vector<std::vector<unsigned char>> at_save;
  for (int k = 0; k < kBefore + kAfter; ++k) {
    if (k == kBefore) at_save = one.w.snapshot();
    fill_grads(one, src, k, whole_model());
    expected.push_back(reference.step_scaled(src.S));
  }

  // Sharded over every rank, whole tensors; each rank saves its file.
  const std::string path = std::string(dir) + "/rank" + std::to_string(rank) + ".safetensors";
  {
    const Partition parts = whole_tensors(ranks);
    const std::vector<Piece>& mine = parts[static_cast<std::size_t>(rank)];
    Model m(setup.weight, setup.grad);
    OptimizerOptions so = o;
    so.communicator = mpi_communicator(MPI_COMM_WORLD);
    Optimizer opt(config, rank_params(m, mine), so);
    for (int k = 0; k < kBefore; ++k) {
      fill_grads(m, src, k, mine);
      opt.step_scaled(src.S);
    }
    opt.save(path);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> files;
  for (int r = 0; r < ranks; ++r) files.push_back(std::string(dir) + "/rank" + std::to_string(r) + ".safetensors");

  // Loaded by ranks - 1 ranks (slices when more than one), or one unsharded optimizer.
  const int loaders = ranks > 1 ? ranks - 1 : 1;
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank < loaders ? 0 : MPI_UNDEFINED, rank, &sub);
  if (sub != MPI_COMM_NULL) {
    const Partition parts = loaders > 1 ? sliced(loaders) : Partition{whole_model()};
    const std::vector<Piece>& mine = parts[static_cast<std::size_t>(rank)];
    Model m(setup.weight, setup.grad);
    m.w.restore(at_save);  // the weights are the caller's: saved with the model
    OptimizerOptions lo = o;
    if (loaders > 1) {
      lo.communicator = mpi_communicator(sub);
      for (const Piece& p : mine) lo.slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
    }
    Optimizer opt(config, rank_params(m, mine), lo);
    opt.load_shards(files);
    EXPECT_EQ(opt.step_count(), kBefore);
    for (int k = kBefore; k < kBefore + kAfter; ++k) {
      fill_grads(m, src, k, mine);
      expect_same_result(opt.step_scaled(src.S), expected[static_cast<std::size_t>(k)], "step " + std::to_string(k));
    }
    const auto w_one = one.w.snapshot(), w = m.w.snapshot();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const Piece& p = mine[i];
      const auto from = static_cast<std::ptrdiff_t>(p.offset * 2), to = from + static_cast<std::ptrdiff_t>(p.numel * 2);
      EXPECT_TRUE(std::equal(w[p.tensor].begin() + from, w[p.tensor].begin() + to, w_one[p.tensor].begin() + from)) << "piece " << i;
      EXPECT_EQ(state_of(opt, i, 0, p.numel), state_of(reference, p.tensor, p.offset, p.numel)) << "piece " << i;
    }
    MPI_Comm_free(&sub);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace stepfuse
