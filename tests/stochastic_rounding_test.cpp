// Stochastic rounding of bf16 weights (OptimizerOptions::stochastic_rounding):
// the generator against Philox's published answers, the rounding against an
// independent integer oracle, unbiasedness, and the optimizer's results bitwise
// equal across Highway targets, thread counts, the interpreter, the unfused
// baseline and the LLVM backend, keyed by the element's index in the model.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "cpu_paths.hpp"
#include "hwy_targets.hpp"
#include "jit/stochastic_round.h"
#include "runtime/cpu/kernels.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using test::bits;
using test::from_bits;
using test::PerTarget;
using test::targets;
float widen_bf16(std::uint16_t h) { return from_bits(static_cast<std::uint32_t>(h) << 16); }

// Random123's known-answer vectors for philox4x32-10 (counter, key -> output).
TEST(Philox, MatchesThePublishedKnownAnswers) {
  struct Kat {
    unsigned c[4], k[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    unsigned out[4];
    sf_philox4x32_10(k.c, k.k, out);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(out[j], k.out[j]) << "word " << j;
  }
}

TEST(Philox, ElementBitsFollowTheDocumentedCounter) {
  const unsigned long long seed = 0x0123456789ABCDEFull, step = 0x100000002ull, index = 0x5'0000'000Full;
  const unsigned c[4] = {static_cast<unsigned>(index >> 3), static_cast<unsigned>(index >> 35), 2u, 1u};
  const unsigned k[2] = {0x89ABCDEFu, 0x01234567u};
  unsigned out[4];
  sf_philox4x32_10(c, k, out);
  // The block of 8 elements index - 7 .. index: word w holds elements 2w (low half) and 2w + 1 (high half).
  for (unsigned j = 0; j < 8; ++j)
    EXPECT_EQ(sf_sr_bits(seed, step, index - 7 + j), j & 1 ? out[j / 2] >> 16 : out[j / 2] & 0xFFFFu) << j;
  EXPECT_NE(sf_sr_bits(seed, step + 1, index), out[3] >> 16);
  EXPECT_NE(sf_sr_bits(seed + (1ull << 32), step, index), out[3] >> 16);
  // Four at a time, within one block or straddling two.
  for (unsigned long long first = index - 12; first <= index + 1; ++first) {
    unsigned r[4];
    sf_sr_bits4(seed, step, first, r);
    for (unsigned j = 0; j < 4; ++j) EXPECT_EQ(r[j], sf_sr_bits(seed, step, first + j)) << first << " + " << j;
  }
}

// The rounding against an oracle written differently: round down, then up with
// probability (the dropped 16 bits) / 2^16, decided by the 16 random bits r.
std::uint16_t oracle_round(float x, std::uint32_t r) {
  const std::uint32_t u = bits(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  const std::uint32_t down = u >> 16, frac = u & 0xFFFF;
  return static_cast<std::uint16_t>(frac + r >= 0x10000 ? down + 1 : down);
}

TEST(StochasticRounding, ScalarRoundingMatchesTheOracle) {
  std::mt19937 rng(3);
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, -NAN, 3.3895314e38f, -3.3895314e38f,
                           1e-40f, -1e-45f, 1.17549435e-38f};
  for (int i = 0; i < 100000; ++i) xs.push_back(from_bits(static_cast<std::uint32_t>(rng())));
  for (float x : xs)
    for (std::uint32_t r : {0u, 1u, 0x8000u, 0xFFFEu, 0xFFFFu, static_cast<std::uint32_t>(rng() & 0xFFFF)})
      ASSERT_EQ(sf_bf16_round_stochastic(x, r), oracle_round(x, r)) << x << " r=" << r;
  // bf16 values are never moved; inf stays inf; NaN stays NaN.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float x = widen_bf16(static_cast<std::uint16_t>(h));
    if (std::isnan(x)) continue;
    ASSERT_EQ(sf_bf16_round_stochastic(x, 0xFFFFu), h);
  }
  EXPECT_TRUE(std::isnan(widen_bf16(sf_bf16_round_stochastic(from_bits(0x7F800001u), 0xFFFFu))));
}


// Model indices near 0, odd ones, blocks whose index crosses 2^32 within one
// vector of Philox calls, and near 2^64.
const std::uint64_t kFirsts[] = {0,
                                 1,
                                 7,
                                 9,
                                 0xFFFFFFF0ull,
                                 (0xFFFFFFF0ull << 3) + 5,
                                 0x7'FFFF'FFFFull,
                                 0x1'FFFF'FFF9ull,
                                 0xFFFF'FFFF'FFFF'F000ull};
const std::size_t kLengths[] = {1, 7, 15, 16, 17, 127, 129, 1000, 2049};

TEST(StochasticRounding, VectorBitsAreTheScalarReferenceOnEveryTarget) {
  // (both halves of the key and of the step nonzero in the second seed)
  for (const std::uint64_t seed : {std::uint64_t{42}, std::uint64_t{0x9E37'79B9'7F4A'7C15ull}})
    for (std::int64_t target : targets()) {
      PerTarget scope(target);
      for (std::uint64_t first : kFirsts)
        for (std::size_t n : kLengths) {
          std::vector<std::uint16_t> got(n + 1, 0xABCD);
          cpu::rounding_bits(seed, 0x1'0000'0007ull, first, n, got.data());
          for (std::size_t j = 0; j < n; ++j)
            ASSERT_EQ(got[j], sf_sr_bits(seed, 0x1'0000'0007ull, first + j))
                << hwy::TargetName(target) << " seed=" << seed << " first=" << first << " n=" << n << " element " << j;
          EXPECT_EQ(got[n], 0xABCD) << "wrote past the end";
        }
    }
}

TEST(StochasticRounding, VectorRoundingIsTheScalarReferenceOnEveryTarget) {
  std::mt19937 rng(5);
  std::vector<float> src(2049);
  for (float& x : src) x = from_bits(static_cast<std::uint32_t>(rng()));
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    for (std::uint64_t first : kFirsts)
      for (std::size_t n : kLengths) {
        std::vector<std::uint16_t> got(n);
        cpu::narrow_bf16_stochastic(src.data(), got.data(), n, 42, 7, first);
        for (std::size_t j = 0; j < n; ++j)
          ASSERT_EQ(got[j], sf_bf16_round_stochastic(src[j], sf_sr_bits(42, 7, first + j)))
              << hwy::TargetName(target) << " first=" << first << " n=" << n << " element " << j;
      }
  }
}

// 10^6 roundings of one value between two bf16 neighbours: the mean error is
// within 3 standard deviations of 0 (round to nearest would be off by 0.3 ulp).
TEST(StochasticRounding, IsUnbiased) {
  const float lo = 1.0f, ulp = 0x1.0p-7f;
  for (double frac : {0.3, 0.5, 0.9, 0.01}) {
    const float x = lo + static_cast<float>(frac) * ulp;
    const double p = (static_cast<double>(x) - lo) / ulp;  // the exact fraction x holds
    constexpr std::size_t kN = 1000000;
    std::vector<float> src(kN, x);
    std::vector<std::uint16_t> out(kN);
    cpu::narrow_bf16_stochastic(src.data(), out.data(), kN, 1234, 1, 0);
    double sum = 0;
    for (std::uint16_t h : out) {
      const float y = widen_bf16(h);
      ASSERT_TRUE(y == lo || y == lo + ulp) << y;
      sum += (static_cast<double>(y) - x) / ulp;
    }
    const double mean = sum / kN, sigma = std::sqrt(p * (1 - p) / kN);
    EXPECT_LT(std::abs(mean), 3 * sigma) << "fraction " << frac << ": mean error " << mean << " ulp";
  }
}

// ---- The optimizer ---------------------------------------------------------------

struct Model {
  std::vector<std::vector<std::uint16_t>> weights;  // bf16
  std::vector<std::vector<std::uint16_t>> grads;    // bf16
  std::vector<Param> params;
  explicit Model(const std::vector<std::int64_t>& sizes, unsigned seed = 11) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    weights.reserve(sizes.size());
    grads.reserve(sizes.size());
    for (std::int64_t n : sizes) {
      std::vector<float> w(n), g(n);
      for (float& x : w) x = dist(rng);
      for (float& x : g) x = 64.0f * dist(rng);
      weights.emplace_back(n);
      grads.emplace_back(n);
      cpu::narrow(w.data(), DType::bf16, weights.back().data(), n);
      cpu::narrow(g.data(), DType::bf16, grads.back().data(), n);
      params.push_back({{weights.back().data(), n, DType::bf16}, {grads.back().data(), n, DType::bf16}});
    }
  }
  // All weights, concatenated in params order.
  std::vector<std::uint16_t> flat() const {
    std::vector<std::uint16_t> out;
    for (const auto& w : weights) out.insert(out.end(), w.begin(), w.end());
    return out;
  }
};

OptimizerOptions rounding_options(std::uint64_t seed = 7) {
  OptimizerOptions o;
  o.master_weights = false;
  o.stochastic_rounding = true;
  o.seed = seed;
  o.max_grad_norm = 10.0;
  o.cpu_backend = CpuBackend::highway;
  return o;
}

const std::vector<std::int64_t> kSizes = {1, 7, 33, 1000, 16384 + 5};

std::vector<std::uint16_t> train(const OptimizerConfig& config, OptimizerOptions o, int steps = 3,
                                 const std::vector<std::int64_t>& sizes = kSizes) {
  Model m(sizes);
  Optimizer opt(config, m.params, o);
  for (int i = 0; i < steps; ++i) EXPECT_TRUE(opt.step_scaled(64.0).applied);
  return m.flat();
}

std::vector<OptimizerConfig> some_programs() {
  return {optim::AdamW{.lr = 1e-2}, optim::SGD{.lr = 0.1, .momentum = 0.9}, optim::Lion{.weight_decay = 0.1},
          optim::RAdam{.lr = 1e-2}, optim::LAMB{}};
}

TEST(StochasticRounding, BitwiseIdenticalAcrossTargetsThreadsAndModes) {
  for (const OptimizerConfig& config : some_programs())
    test::expect_same_on_every_cpu_path(
        rounding_options(), [&](const OptimizerOptions& o) { return train(config, o); }, std::string(optimizer_name(config)));
}

TEST(StochasticRounding, CustomProgramsRoundAsBuiltIns) {
  // A custom program runs on the interpreter (Highway) or its LLVM kernels.
  const UpdateProgram program = UpdateProgram::from_config(optim::AdamW{.lr = 1e-2});
  Model a(kSizes), b(kSizes);
  Optimizer builtin(optim::AdamW{.lr = 1e-2}, a.params, rounding_options());
  Optimizer custom(program, b.params, rounding_options());
  for (int i = 0; i < 3; ++i) {
    builtin.step_scaled(64.0);
    custom.step_scaled(64.0);
  }
  EXPECT_EQ(a.flat(), b.flat());
}

TEST(StochasticRounding, ReproducibleAndKeyedBySeed) {
  const OptimizerConfig adamw = optim::AdamW{.lr = 1e-2};
  EXPECT_EQ(train(adamw, rounding_options(7)), train(adamw, rounding_options(7)));
  EXPECT_NE(train(adamw, rounding_options(7)), train(adamw, rounding_options(8)));
  OptimizerOptions nearest = rounding_options();
  nearest.stochastic_rounding = false;
  EXPECT_NE(train(adamw, rounding_options(7)), train(adamw, nearest));
}

// An element's random bits depend on its index in the model, not on how the
// model is cut into tensors: one tensor of 2000 and the same data as three.
TEST(StochasticRounding, KeyedByTheElementsIndexInTheModel) {
  OptimizerOptions o = rounding_options();
  o.max_grad_norm.reset();  // elementwise: the cut does not change the update
  const OptimizerConfig sgd = optim::SGD{.lr = 0.1, .momentum = 0.9};
  Model whole({2000}), cut({300, 1, 1699});
  std::vector<std::uint16_t> w = whole.flat(), g;
  for (const auto& x : whole.grads) g.insert(g.end(), x.begin(), x.end());
  std::size_t at = 0;
  for (std::size_t t = 0; t < cut.weights.size(); ++t) {  // the same data in three tensors
    std::copy_n(w.begin() + static_cast<std::ptrdiff_t>(at), cut.weights[t].size(), cut.weights[t].begin());
    std::copy_n(g.begin() + static_cast<std::ptrdiff_t>(at), cut.grads[t].size(), cut.grads[t].begin());
    at += cut.weights[t].size();
  }
  Optimizer a(sgd, whole.params, o), b(sgd, cut.params, o);
  for (int i = 0; i < 4; ++i) {
    a.step_scaled(64.0);
    b.step_scaled(64.0);
  }
  EXPECT_EQ(whole.flat(), cut.flat());
}

// Updates far below half a bf16 ulp: round to nearest never moves the weight;
// stochastic rounding moves it by the right amount on average.
TEST(StochasticRounding, SmallUpdatesAccumulateOnAverage) {
  constexpr std::int64_t kN = 100000;
  constexpr int kSteps = 50;
  const float w0 = 1.0f, ulp = 0x1.0p-7f, update = 0.05f * ulp;  // 1/20 of an ulp per step
  for (bool stochastic : {false, true}) {
    std::vector<std::uint16_t> w(kN), g(kN);
    std::vector<float> ones(kN, w0), grad(kN, 1.0f);
    cpu::narrow(ones.data(), DType::bf16, w.data(), kN);
    cpu::narrow(grad.data(), DType::bf16, g.data(), kN);
    OptimizerOptions o;
    o.master_weights = false;
    o.stochastic_rounding = stochastic;
    Optimizer opt(optim::SGD{.lr = update, .maximize = true}, {{{w.data(), kN, DType::bf16}, {g.data(), kN, DType::bf16}}}, o);
    for (int s = 0; s < kSteps; ++s) opt.step();
    double sum = 0;
    for (std::uint16_t h : w) sum += widen_bf16(h);
    const double mean_moved = (sum / kN - w0) / ulp;  // in ulps; the exact drift is kSteps * 0.05 = 2.5
    if (stochastic) EXPECT_NEAR(mean_moved, kSteps * 0.05, 0.05);
    else EXPECT_EQ(mean_moved, 0.0);
  }
}

TEST(StochasticRounding, SkippedStepsWriteNothing) {
  Model m(kSizes);
  Optimizer opt(optim::AdamW{.lr = 1e-2}, m.params, rounding_options());
  opt.step_scaled(64.0);
  const std::vector<std::uint16_t> before = m.flat();
  m.grads[3][17] = 0x7FC0;  // NaN
  EXPECT_FALSE(opt.step_scaled(64.0).applied);
  EXPECT_EQ(m.flat(), before);
}

// A checkpoint holds the step count, so a loaded optimizer draws the same bits.
TEST(StochasticRounding, ContinuesBitwiseAfterACheckpoint) {
  const std::string path = ::testing::TempDir() + "stochastic_rounding_checkpoint.safetensors";
  Model a(kSizes), b(kSizes);
  Optimizer first(optim::AdamW{.lr = 1e-2}, a.params, rounding_options());
  for (int i = 0; i < 2; ++i) first.step_scaled(64.0);
  first.save(path);
  b.weights = a.weights;
  Optimizer second(optim::AdamW{.lr = 1e-2}, b.params, rounding_options());
  second.load(path);
  first.step_scaled(64.0);
  second.step_scaled(64.0);
  EXPECT_EQ(a.flat(), b.flat());
  std::remove(path.c_str());
}

TEST(StochasticRounding, RefusesWhatItCannotRound) {
  const auto message = [](const OptimizerOptions& o, DType w) {
    std::vector<std::uint16_t> wb(8), gb(8);
    std::vector<float> wf(8), gf(8);
    const bool narrow = w != DType::f32;
    Param p{{narrow ? static_cast<void*>(wb.data()) : wf.data(), 8, w},
            {narrow ? static_cast<void*>(gb.data()) : gf.data(), 8, w}};
    try {
      Optimizer opt(optim::AdamW{}, {p}, o);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  OptimizerOptions o;
  o.stochastic_rounding = true;  // with masters
  EXPECT_NE(message(o, DType::bf16).find("AdamW: OptimizerOptions::stochastic_rounding is set with master_weights = true"),
            std::string::npos)
      << message(o, DType::bf16);
  o.master_weights = false;
  EXPECT_NE(message(o, DType::f16).find("f16 weights"), std::string::npos) << message(o, DType::f16);
  EXPECT_NE(message(o, DType::f32).find("no param has bf16 weights"), std::string::npos) << message(o, DType::f32);
  EXPECT_EQ(message(o, DType::bf16), "no error");
}

}  // namespace
}  // namespace stepfuse
