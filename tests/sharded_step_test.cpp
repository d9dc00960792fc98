// The sharded step (OptimizerOptions::communicator) with N in-process ranks: every
// rank gets the one-process StepResult, and each shard's update is bitwise the
// one-process step over the whole model, for every built-in, dtype setup, norm,
// rank count and partition (whole tensors, or slices on chunk boundaries). The
// collective checks: a rank that refuses (at construction or in a step) makes
// every rank throw, never wait. tests/mpi/ runs the same step across processes.
#include <gtest/gtest.h>

#include <array>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "local_communicator.hpp"
#include "sharded_support.hpp"

namespace stepfuse {
namespace {

using namespace sharded_test;  // NOLINT: the shared model, partitions and cases
using testing::expect_every_rank_throws;
using testing::LocalGroup;

// What one rank saw: per step its result; at the end its params' state and masters.
struct RankRecord {
  std::vector<StepResult> results;
  std::vector<std::vector<float>> state;   // per piece, per state name (in state_names() order), flattened
  std::vector<std::vector<float>> master;  // per piece
};

// Runs `steps` loss-scaled steps of `config` one-process and sharded over `parts`,
// and expects every rank's results, the weights, state and masters bitwise equal.
void expect_sharded_equals_one_process(const OptimizerConfig& config, const DtypeSetup& setup, const Norm& norm,
                                       const Partition& parts, const GradSource& src, int steps, const std::string& what,
                                       Fusion fusion = Fusion::fused, bool stochastic_rounding = false,
                                       StateFormat state = StateFormat::f32) {
  const int ranks = static_cast<int>(parts.size());
  Model one(setup.weight, setup.grad), sharded(setup.weight, setup.grad);
  OptimizerOptions oo = base_options(norm, fusion);
  oo.master_weights = setup.masters;
  oo.stochastic_rounding = stochastic_rounding;
  oo.seed = 0x5EED;
  oo.state_format = state;
  std::vector<Param> all;
  for (std::size_t t = 0; t < kSizes.size(); ++t) all.push_back({one.w[t], one.g[t]});
  Optimizer reference(config, all, oo);
  std::vector<StepResult> expected;
  for (int k = 0; k < steps; ++k) {
    fill_grads(one, src, k, whole_model());
    expected.push_back(reference.step_scaled(src.S));
  }

  bool need_slices = false;
  for (const auto& rank : parts)
    for (const Piece& p : rank) need_slices |= p.numel != kSizes[p.tensor];
  std::vector<RankRecord> records(static_cast<std::size_t>(ranks));
  LocalGroup group(ranks);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    const std::vector<Piece>& mine = parts[static_cast<std::size_t>(r)];
    OptimizerOptions o = oo;
    o.communicator = comm;
    std::vector<Param> params;
    for (const Piece& p : mine) {
      params.push_back({slice_of(sharded.w[p.tensor], p.offset, p.numel), slice_of(sharded.g[p.tensor], p.offset, p.numel)});
      if (need_slices) o.slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
    }
    Optimizer opt(config, params, o);
    RankRecord& rec = records[static_cast<std::size_t>(r)];
    for (int k = 0; k < steps; ++k) {
      fill_grads(sharded, src, k, mine);
      rec.results.push_back(opt.step_scaled(src.S));
    }
    for (std::size_t i = 0; i < mine.size(); ++i) {
      rec.state.push_back(state_of(opt, i, 0, mine[i].numel));
      const std::span<const float> m = opt.master(i);
      rec.master.emplace_back(m.begin(), m.end());
    }
  });
  for (int r = 0; r < ranks; ++r) {
    if (errors[static_cast<std::size_t>(r)]) {
      try {
        std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << what << ": rank " << r << " threw: " << e.what();
      }
      return;
    }
  }
  // Two at construction, then one per step (the unfused baseline's separate
  // finite-check and norm passes make one each when it clips).
  const int per_step = fusion == Fusion::unfused && norm.max_grad_norm ? 2 : 1;
  EXPECT_EQ(group.collectives(), 2 + per_step * steps) << what << ": collectives";
  EXPECT_EQ(sharded.w.snapshot(), one.w.snapshot()) << what << ": weights";
  for (int r = 0; r < ranks; ++r) {
    const RankRecord& rec = records[static_cast<std::size_t>(r)];
    const std::string rw = what + ", rank " + std::to_string(r);
    for (int k = 0; k < steps; ++k)
      expect_same_result(rec.results[static_cast<std::size_t>(k)], expected[static_cast<std::size_t>(k)],
                         rw + ", step " + std::to_string(k));
    const std::vector<Piece>& mine = parts[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(rec.state[i], state_of(reference, mine[i].tensor, mine[i].offset, mine[i].numel)) << rw << " piece " << i << " state";
      const std::span<const float> m = reference.master(mine[i].tensor);
      const std::vector<float> want = m.empty() ? std::vector<float>{}
                                                : std::vector<float>(m.begin() + mine[i].offset, m.begin() + mine[i].offset + mine[i].numel);
      EXPECT_EQ(rec.master[i], want) << rw << " piece " << i << " master";
    }
  }
}

class ShardedBuiltin : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedBuiltin, EveryRankGetsTheOneProcessStepBitwise) {
  const Case& c = GetParam();
  GradSource src;
  for (const DtypeSetup& setup : kSetups)
    for (const Norm& norm : kNorms)
      for (int ranks = 1; ranks <= 3; ++ranks) {
        const std::string what = std::string(c.name) + " " + std::string(dtype_name(setup.weight)) + "/" +
                                 std::string(dtype_name(setup.grad)) + (setup.masters ? "+masters" : "") + " clip " +
                                 (norm.max_grad_norm ? std::to_string(*norm.max_grad_norm) : "off") + " norm " +
                                 std::to_string(norm.norm_type) + ", " + std::to_string(ranks) + " ranks";
        expect_sharded_equals_one_process(c.config, setup, norm, whole_tensors(ranks), src, 3, what + ", whole tensors");
        if (c.splittable && ranks > 1)
          expect_sharded_equals_one_process(c.config, setup, norm, sliced(ranks), src, 3, what + ", slices");
      }
}

INSTANTIATE_TEST_SUITE_P(Builtins, ShardedBuiltin, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(ShardedStep, UnfusedAndInterpretedStepsAreShardedToo) {
  GradSource src;
  for (const Fusion f : {Fusion::unfused, Fusion::interpreted})
    for (const Norm& norm : kNorms)
      expect_sharded_equals_one_process(optim::AdamW{.lr = 1e-2}, kSetups[1], norm, sliced(3), src, 3,
                                        std::string(f == Fusion::unfused ? "unfused" : "interpreted") + " clip " +
                                            (norm.max_grad_norm ? "on" : "off"),
                                        f);
}

// Stochastic rounding draws each element's bits by its index in the whole model, so
// every partition gives the one process's bf16 weights and bf16 state (each backend's
// own loops).
TEST(ShardedStep, StochasticRoundingCountsElementsInTheWholeModel) {
  GradSource src;
  const DtypeSetup bf16_no_masters = kSetups[3];
  ASSERT_TRUE(bf16_no_masters.weight == DType::bf16 && !bf16_no_masters.masters);
  for (const Fusion f : {Fusion::fused, Fusion::interpreted, Fusion::unfused})
    for (const Norm& norm : kNorms) {
      const std::string what = std::string(f == Fusion::fused ? "fused" : f == Fusion::unfused ? "unfused" : "interpreted") +
                               " clip " + (norm.max_grad_norm ? "on" : "off");
      expect_sharded_equals_one_process(optim::AdamW{.lr = 1e-2}, bf16_no_masters, norm, sliced(3), src, 3,
                                        what + ", slices", f, /*stochastic_rounding=*/true);
      expect_sharded_equals_one_process(optim::SGD{.lr = 0.1, .momentum = 0.9}, bf16_no_masters, norm,
                                        whole_tensors(2), src, 3, what + ", whole tensors", f, true);
      // bf16 state beside them rounds stochastically too, by the same model indices.
      expect_sharded_equals_one_process(optim::AdamW{.lr = 1e-2}, bf16_no_masters, norm, sliced(3), src, 3,
                                        what + ", slices, bf16 state", f, true, StateFormat::bf16);
    }
}

// bf16 and q8 state: blocks start at the model tensor's element 0 and slices on chunk
// boundaries, and q8's size threshold is the model tensor's, so a slice of 232
// elements of a 33000-element tensor stores q8 as the one process does.
TEST(ShardedStep, StoredStateIsTheOneProcessStateBitwise) {
  GradSource src;
  Partition tail(3);
  for (std::size_t t = 0; t < kSizes.size(); ++t)
    if (t != 5) tail[t % 3].push_back({t, 0, kSizes[t]});
  tail[0].push_back({5, 0, 16384});
  tail[1].push_back({5, 16384, 16384});
  tail[2].push_back({5, 32768, 33000 - 32768});
  for (const StateFormat f : {StateFormat::bf16, StateFormat::q8})
    for (const Fusion fusion : {Fusion::fused, Fusion::unfused}) {
      const std::string what = std::string(state_format_name(f)) + (fusion == Fusion::fused ? " fused" : " unfused");
      expect_sharded_equals_one_process(optim::AdamW{.lr = 1e-2}, kSetups[0], kNorms[1], tail, src, 3, what + ", tail slice",
                                        fusion, false, f);
      expect_sharded_equals_one_process(optim::AdamW{.lr = 1e-2}, kSetups[1], kNorms[1], sliced(3), src, 3,
                                        what + ", slices", fusion, false, f);
    }
}

TEST(ShardedStep, InfOnOneRankSkipsTheStepOnEveryRank) {
  GradSource src;
  src.inf_step = 1;
  src.inf_tensor = 5;  // on the last rank of whole_tensors(3); rank 0 of sliced(3)
  for (const Norm& norm : kNorms) {
    expect_sharded_equals_one_process(optim::AdamW{.lr = 1e-2}, kSetups[0], norm, whole_tensors(3), src, 3, "whole");
    expect_sharded_equals_one_process(optim::Adam{.lr = 1e-2}, kSetups[1], norm, sliced(3), src, 3, "sliced");
  }
}

// The order in which the ranks' partials are combined is the model's, not the
// ranks': 48 tensors dealt to 3 ranks like cards (tensor t on rank t % 3, placed
// by slices), with magnitudes for which the order of the fp64 sum shows in the
// norm — a one-process optimizer over the tensors in reverse order (its combine
// in reverse) gets other bits, which the test first checks it does.
TEST(ShardedStep, PartialsAreCombinedInTheModelsOrderNotTheRanks) {
  std::vector<std::int64_t> sizes;
  for (int t = 0; t < 48; ++t) sizes.push_back(100 + (t * 7919) % 40000);
  const int steps = 8;
  GradSource src;
  const auto one_process = [&](bool reversed) {
    Model m(DType::f32, DType::f32, sizes);
    std::vector<Param> params;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t t = reversed ? sizes.size() - 1 - k : k;
      params.push_back({m.w[t], m.g[t]});
    }
    Optimizer opt(optim::AdamW{}, params, base_options(kNorms[1]));
    std::vector<double> norms;
    for (int k = 0; k < steps; ++k) {
      for (std::size_t t = 0; t < sizes.size(); ++t)
        for (std::int64_t j = 0; j < sizes[t]; ++j) m.g.set(t, j, src.value(k, t, j));
      norms.push_back(opt.step_scaled(src.S).grad_norm);
    }
    return norms;
  };
  const std::vector<double> forward = one_process(false), reverse = one_process(true);
  ASSERT_NE(forward, reverse) << "the data does not tell the orders apart";

  Model m(DType::f32, DType::f32, sizes);
  std::vector<std::vector<double>> norms(3);
  LocalGroup group(3);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    OptimizerOptions o = base_options(kNorms[1]);
    o.communicator = comm;
    std::vector<Param> params;
    std::vector<std::size_t> mine;
    for (std::size_t t = static_cast<std::size_t>(r); t < sizes.size(); t += 3) {
      mine.push_back(t);
      params.push_back({m.w[t], m.g[t]});
      o.slices.push_back({static_cast<std::int64_t>(t), 0});
    }
    Optimizer opt(optim::AdamW{}, params, o);
    for (int k = 0; k < steps; ++k) {
      for (const std::size_t t : mine)
        for (std::int64_t j = 0; j < sizes[t]; ++j) m.g.set(t, j, src.value(k, t, j));
      norms[static_cast<std::size_t>(r)].push_back(opt.step_scaled(src.S).grad_norm);
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(norms[static_cast<std::size_t>(r)], forward) << "rank " << r;
  }
}

TEST(ShardedStep, ARankThatRefusesItsShardMakesEveryRankThrow) {
  Model m(DType::f32, DType::f32);
  const Partition parts = whole_tensors(3);
  expect_every_rank_throws(
      3,
      [&](int r, const std::shared_ptr<Communicator>& comm) {
        std::vector<Param> params = rank_params(m, parts[static_cast<std::size_t>(r)]);
        if (r == 1) params[0].grad.data = nullptr;  // refused by rank 1's own validation
        OptimizerOptions o = base_options(kNorms[1]);
        o.communicator = comm;
        Optimizer opt(optim::AdamW{}, params, o);
      },
      ErrorCode::invalid_argument, "rank 1 of 3 could not build its shard", 1, "grad.data is null");
}

TEST(ShardedStep, OptionsThatDifferBetweenRanksAreRefusedOnEveryRank) {
  Model m(DType::f32, DType::f32);
  const Partition parts = whole_tensors(2);
  expect_every_rank_throws(
      2,
      [&](int r, const std::shared_ptr<Communicator>& comm) {
        OptimizerOptions o = base_options(r == 0 ? kNorms[1] : kNorms[0]);
        o.communicator = comm;
        Optimizer opt(optim::AdamW{}, rank_params(m, parts[static_cast<std::size_t>(r)]), o);
      },
      ErrorCode::invalid_argument, "OptimizerOptions::max_grad_norm (rank 0: 0.5, rank 1: none) differs between ranks");
  // Stochastic rounding: every rank draws its bits from one seed, and some rank must
  // have a bf16 weight; every rank rounds the bf16 state alike. `seeds[r]`: rank r's seed,
  // `state[r]` its stochastic_state_rounding.
  const auto rounding_on = [&](const Model& model, std::array<std::uint64_t, 2> seeds, const char* message,
                               std::array<bool, 2> state = {true, true}) {
    expect_every_rank_throws(
        2,
        [&](int r, const std::shared_ptr<Communicator>& comm) {
          OptimizerOptions o = base_options(kNorms[0]);
          o.communicator = comm;
          o.master_weights = false;
          o.stochastic_rounding = true;
          o.seed = seeds[static_cast<std::size_t>(r)];
          o.stochastic_state_rounding = state[static_cast<std::size_t>(r)];
          Optimizer opt(optim::AdamW{}, rank_params(model, parts[static_cast<std::size_t>(r)]), o);
        },
        ErrorCode::invalid_argument, message);
  };
  rounding_on(Model(DType::bf16, DType::bf16), {1, 2}, "OptimizerOptions::seed (rank 0: 1, rank 1: 2; stochastic rounding");
  rounding_on(m, {0, 0}, "stochastic_rounding is set but no rank has a bf16 weight");  // (m: f32 weights)
  rounding_on(Model(DType::bf16, DType::bf16), {0, 0}, "OptimizerOptions::stochastic_state_rounding differs between ranks",
              {true, false});
  // Compensated weights: every rank keeps them or none does, and some rank has a bf16 weight.
  const auto compensated_on = [&](const Model& model, std::array<bool, 2> on, const char* message) {
    expect_every_rank_throws(
        2,
        [&](int r, const std::shared_ptr<Communicator>& comm) {
          OptimizerOptions o = base_options(kNorms[0]);
          o.communicator = comm;
          o.master_weights = false;
          o.compensated_weights = on[static_cast<std::size_t>(r)];
          Optimizer opt(optim::AdamW{}, rank_params(model, parts[static_cast<std::size_t>(r)]), o);
        },
        ErrorCode::invalid_argument, message);
  };
  compensated_on(Model(DType::bf16, DType::bf16), {true, false}, "OptimizerOptions::compensated_weights differs between ranks");
  compensated_on(m, {true, true}, "compensated_weights is set but no rank has a bf16 weight");
  // Stored state: the blanket format, the per-stream formats and q8's size threshold.
  const auto state_on = [&](const std::function<void(int, OptimizerOptions&)>& set, const char* message) {
    expect_every_rank_throws(
        2,
        [&](int r, const std::shared_ptr<Communicator>& comm) {
          OptimizerOptions o = base_options(kNorms[0]);
          o.communicator = comm;
          set(r, o);
          Optimizer opt(optim::AdamW{}, rank_params(m, parts[static_cast<std::size_t>(r)]), o);
        },
        ErrorCode::invalid_argument, message);
  };
  state_on([](int r, OptimizerOptions& o) { o.state_format = r == 0 ? StateFormat::q8 : StateFormat::bf16; },
           "OptimizerOptions::state_format (rank 0: q8, rank 1: bf16) differs between ranks");
  state_on(
      [](int r, OptimizerOptions& o) {
        o.state_formats = {{"exp_avg", StateFormat::q8}};
        if (r == 1) o.state_formats.push_back({"exp_avg_sq", StateFormat::bf16});
      },
      "OptimizerOptions::state_formats (the per-stream formats");
  state_on([](int r, OptimizerOptions& o) { o.state_formats = {{r == 0 ? "exp_avg" : "exp_avg_sq", StateFormat::q8}}; },
           "OptimizerOptions::state_formats (the per-stream formats");
  state_on(
      [](int r, OptimizerOptions& o) {
        o.state_format = StateFormat::q8;
        o.min_q8_numel = r == 0 ? 4096 : 1024;
      },
      "OptimizerOptions::min_q8_numel (rank 0: 4096, rank 1: 1024) differs between ranks");
}

// Builds Adam (or `config`) on each rank over `parts` with slices.
void build_sliced(int r, const std::shared_ptr<Communicator>& comm, const Model& m, const Partition& parts,
                  const OptimizerConfig& config = optim::Adam{}) {
  OptimizerOptions o = base_options(kNorms[0]);
  o.communicator = comm;
  for (const Piece& p : parts[static_cast<std::size_t>(r)]) o.slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
  Optimizer opt(config, rank_params(m, parts[static_cast<std::size_t>(r)]), o);
}

TEST(ShardedStep, SlicesThatDoNotTileTheModelAreRefusedOnEveryRank) {
  Model m(DType::f32, DType::f32);
  const auto check = [&](const Partition& parts, ErrorCode code, const std::string& text) {
    expect_every_rank_throws(static_cast<int>(parts.size()),
                             [&](int r, const std::shared_ptr<Communicator>& c) { build_sliced(r, c, m, parts); }, code, text);
  };
  check({{{0, 0, 16384}}, {{0, 16000, 24000}}}, ErrorCode::invalid_argument,
        "model tensor 0: rank 1 params[0] starts at element 16000 (a slice must start at a multiple of 16384");
  check({{{0, 0, 16384}}, {{0, 32768, 7232}}}, ErrorCode::invalid_argument,
        "model tensor 0: rank 1 params[0] starts at element 32768 but no rank holds elements [16384, 32768)");
  check({{{0, 0, 32768}}, {{0, 16384, 23616}}}, ErrorCode::invalid_argument,
        "model tensor 0: rank 1 params[0] (elements [16384, 40000)) overlaps rank 0 params[0] ([0, 32768))");
  check({{{3, 16384, 16384}}, {{1, 0, 100}}}, ErrorCode::invalid_argument,
        "model tensor 3: rank 0 params[0] starts at element 16384 but no rank holds elements [0, 16384)");
  expect_every_rank_throws(
      2, [&](int r, const std::shared_ptr<Communicator>& c) { build_sliced(r, c, m, {{{0, 0, 16384}}, {{0, 16384, 23616}}}, optim::LAMB{}); },
      ErrorCode::unsupported, "its program has two phases");
}

TEST(ShardedStep, ARankThatRefusesAStepMakesEveryRankThrowAndNothingIsWritten) {
  Model m(DType::f32, DType::f32);
  const Partition parts = whole_tensors(3);
  GradSource src;
  for (std::size_t t = 0; t < kSizes.size(); ++t)
    for (std::int64_t j = 0; j < kSizes[t]; ++j) m.g.set(t, j, src.value(0, t, j));
  const auto before = m.w.snapshot();
  LocalGroup group(3);
  std::vector<std::string> messages(3);
  std::vector<std::int64_t> counts(3);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    OptimizerOptions o = base_options(kNorms[1]);
    o.communicator = comm;
    Optimizer opt(optim::AdamW{}, rank_params(m, parts[static_cast<std::size_t>(r)]), o);
    try {
      opt.step_scaled(r == 2 ? NAN : src.S);
    } catch (const Error& e) {
      messages[static_cast<std::size_t>(r)] = e.what();
    }
    counts[static_cast<std::size_t>(r)] = opt.step_count();
    opt.step_scaled(src.S);  // the ranks are still in step: the next step runs everywhere
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(errors[static_cast<std::size_t>(r)]) << "rank " << r;
    EXPECT_EQ(counts[static_cast<std::size_t>(r)], 0) << "rank " << r;
  }
  EXPECT_NE(messages[2].find("loss_scale = nan"), std::string::npos) << messages[2];
  EXPECT_NE(messages[0].find("rank 2 refused its input to this step"), std::string::npos) << messages[0];
  EXPECT_NE(messages[1].find("rank 2 refused its input to this step"), std::string::npos) << messages[1];
  EXPECT_NE(m.w.snapshot(), before) << "the step after the refused one ran";
}

TEST(ShardedStep, GradScalersOnEveryRankKeepOneScale) {
  const Partition parts = whole_tensors(2);
  Model m(DType::bf16, DType::bf16);
  GradSource src;
  LocalGroup group(2);
  std::vector<std::vector<float>> scales(2);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    OptimizerOptions o = base_options(kNorms[1]);
    o.communicator = comm;
    Optimizer opt(optim::AdamW{.lr = 1e-2}, rank_params(m, parts[static_cast<std::size_t>(r)]), o);
    GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
    for (int k = 0; k < 6; ++k) {
      GradSource s = src;
      s.S = scaler.get_scale();
      s.inf_step = 3;
      s.inf_tensor = 0;  // rank 0 only
      fill_grads(m, s, k, parts[static_cast<std::size_t>(r)]);
      if (k == 4) scaler.unscale_(opt);  // the unscale_ path too
      scaler.step(opt);
      scaler.update();
      scales[static_cast<std::size_t>(r)].push_back(static_cast<float>(scaler.get_scale()));
    }
  });
  for (const auto& e : errors) EXPECT_FALSE(e);
  EXPECT_EQ(scales[0], scales[1]);
  EXPECT_EQ(scales[0], (std::vector<float>{1024, 2048, 2048, 1024, 1024, 2048})) << "grow every 2 good steps, back off at the inf";
}

TEST(ShardedStep, LossScaleOptimizersOnEveryRankKeepOneScale) {
  const Partition parts = sliced(3);
  Model m(DType::f16, DType::f32);
  LocalGroup group(3);
  std::vector<std::vector<double>> scales(3);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    OptimizerOptions o = base_options(kNorms[0]);
    o.communicator = comm;
    for (const Piece& p : parts[static_cast<std::size_t>(r)]) o.slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
    Optimizer opt(optim::Adam{.lr = 1e-3}, rank_params(m, parts[static_cast<std::size_t>(r)]), o);
    LossScaleOptimizer lso(opt, true, 256.0, 2);
    for (int k = 0; k < 6; ++k) {
      lso.minimize([&](double scale) {
        GradSource s;
        s.S = scale;
        s.inf_step = 2;
        s.inf_tensor = 3;  // its last slice is on rank 1 only
        fill_grads(m, s, k, parts[static_cast<std::size_t>(r)]);
      });
      scales[static_cast<std::size_t>(r)].push_back(lso.loss_scale());
    }
  });
  for (const auto& e : errors) EXPECT_FALSE(e);
  EXPECT_EQ(scales[0], scales[1]);
  EXPECT_EQ(scales[0], scales[2]);
  EXPECT_EQ(scales[0], (std::vector<double>{256, 512, 256, 256, 512, 512})) << "Keras: x2 every 2 good steps, /2 at the inf";
}

TEST(ShardedStep, LocalChecks) {
  Model m(DType::f32, DType::f32);
  std::vector<Param> params = rank_params(m, whole_model());
  OptimizerOptions o;
  o.slices = {{0, 0}};
  try {
    Optimizer opt(optim::SGD{}, params, o);
    ADD_FAILURE() << "slices without a communicator";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("there is no communicator"), std::string::npos) << e.what();
  }
  LocalGroup one(1);
  o.communicator = one.communicator(0);
  try {
    Optimizer opt(optim::SGD{}, params, o);
    ADD_FAILURE() << "one slice for six params";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slices has 1 entries for 6 params"), std::string::npos) << e.what();
  }
  o.slices.clear();
  Optimizer opt(optim::SGD{}, params, o);
  try {
    opt.add_param_group({rank_params(m, {}), optim::SGD{}});
    ADD_FAILURE() << "add_param_group on a sharded optimizer";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
  }
}

// A communicator that says it moves device memory of `device` (no collective is reached:
// construction refuses the pairing first).
class DeviceClaim final : public Communicator {
 public:
  explicit DeviceClaim(Device device, void* stream = nullptr) : device_(device), stream_(stream) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view name() const override { return "device-claim"; }
  Device device() const override { return device_; }
  void* cuda_stream() const override { return stream_; }
  void all_gather(const void*, void*, std::size_t, CommType) override { ADD_FAILURE() << "no collective expected"; }
  void all_reduce(void*, std::size_t, CommType, ReduceOp) override { ADD_FAILURE() << "no collective expected"; }
  void reduce_scatter(const void*, void*, std::size_t, CommType, ReduceOp) override {
    ADD_FAILURE() << "no collective expected";
  }

 private:
  Device device_;
  void* stream_;
};

// The optimizer's device and the communicator's memory must match (checked before any
// device or collective is touched, so this runs without a GPU).
TEST(ShardedStep, TheCommunicatorsMemoryMustBeTheOptimizersDevice) {
  Model m(DType::f32, DType::f32);
  const std::vector<Param> params = rank_params(m, whole_model());
  const auto refused = [&](OptimizerOptions o, ErrorCode code, const std::string& words) {
    try {
      Optimizer opt(optim::AdamW{}, params, o);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  LocalGroup one(1);
  OptimizerOptions o;
  o.max_grad_norm = 1.0;
  o.device = Device::cuda(0);
  o.communicator = one.communicator(0);  // host memory
  refused(o, ErrorCode::unsupported, "use stepfuse::nccl_communicator over a comm of cuda:0");
  o.communicator = std::make_shared<DeviceClaim>(Device::cuda(1));
  refused(o, ErrorCode::invalid_argument, "works on cuda:1 but the optimizer is on cuda:0");
  void* const stream = reinterpret_cast<void*>(std::uintptr_t{0x5f00});
  o.communicator = std::make_shared<DeviceClaim>(Device::cuda(0), stream);
  refused(o, ErrorCode::invalid_argument,
          "enqueues its collectives on stream 0x5f00 but OptimizerOptions::cuda_stream is null (the legacy default stream)");
  o.device = Device::cpu();
  refused(o, ErrorCode::unsupported, "works on device memory, but a CPU optimizer's collectives use host memory");

  // ShardedOptimizer (ZeRO-2) stages gradients and weights in host memory.
  const auto zero2_refused = [&](std::shared_ptr<Communicator> comm, OptimizerOptions opts, const std::string& words) {
    try {
      ShardedOptimizer z(optim::AdamW{}, params, std::move(comm), opts);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  zero2_refused(std::make_shared<DeviceClaim>(Device::cuda(0)), {}, "the ShardedOptimizer's collectives pass host memory");
  OptimizerOptions on_gpu;
  on_gpu.device = Device::cuda(0);
  zero2_refused(one.communicator(0), on_gpu, "OptimizerOptions::device is a GPU");
}

}  // namespace
}  // namespace stepfuse
