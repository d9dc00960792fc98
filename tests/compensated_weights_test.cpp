// Compensated bf16 weights (OptimizerOptions::compensated_weights): the split of a
// parameter into a bf16 weight and a bf16 compensation against an independent
// integer oracle on every Highway target; the optimizer's trajectory against an
// fp32-weight optimizer whose weights are split and rejoined after every step; the
// results bitwise equal across Highway targets, thread counts, the interpreter, the
// unfused baseline and the LLVM backend; small updates accumulating as with masters;
// skipped steps, param groups and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "cpu_paths.hpp"
#include "hwy_targets.hpp"
#include "runtime/cpu/kernels.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using test::bits;
using test::from_bits;
using test::PerTarget;
using test::targets;

float widen_bf16(std::uint16_t h) { return from_bits(static_cast<std::uint32_t>(h) << 16); }

// Round to nearest even, written as integer arithmetic on the dropped half.
std::uint16_t oracle_bf16(float x) {
  const std::uint32_t u = bits(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  const std::uint32_t down = u >> 16, dropped = u & 0xFFFF;
  const bool up = dropped > 0x8000 || (dropped == 0x8000 && (down & 1) != 0);
  return static_cast<std::uint16_t>(up ? down + 1 : down);
}

// The documented split: the nearest bf16 weight, and the nearest bf16 to what it
// left (computed in double: the difference is exact in fp32 anyway), 0 when that
// is not finite.
struct Split {
  std::uint16_t weight, comp;
};
Split oracle_split(float x) {
  const std::uint16_t hi = oracle_bf16(x);
  const double rest = static_cast<double>(x) - static_cast<double>(widen_bf16(hi));
  const bool finite = std::isfinite(rest);
  return {hi, finite ? oracle_bf16(static_cast<float>(rest)) : std::uint16_t{0}};
}
float join(std::uint16_t w, std::uint16_t c) { return widen_bf16(w) + widen_bf16(c); }

const std::size_t kLengths[] = {0, 1, 3, 8, 15, 16, 17, 31, 33, 100, 1031};

TEST(CompensatedWeights, SplitMatchesTheOracleOnEveryTarget) {
  std::mt19937 rng(17);
  std::vector<float> src(1031);
  for (float& x : src) x = from_bits(static_cast<std::uint32_t>(rng()));
  // The edges: exact bf16 values, ties, the largest finite bf16 and what overflows it,
  // subnormals, infinities and NaN.
  const float edges[] = {0.0f, -0.0f, 1.0f, 1.0f + 0x1.0p-8f, 1.0f + 0x1.0p-8f + 0x1.0p-20f, 0x1.FEp127f,
                         0x1.FFp127f, 0x1.FFFFFEp127f, 0x1.0p-140f, -0x1.2345p-130f, INFINITY, -INFINITY, NAN};
  std::copy(std::begin(edges), std::end(edges), src.begin());
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    for (std::size_t n : kLengths) {
      std::vector<std::uint16_t> w(n + 1, 0xABCD), c(n + 1, 0xABCD);
      cpu::narrow_compensated(src.data(), w.data(), c.data(), n);
      for (std::size_t j = 0; j < n; ++j) {
        const Split want = oracle_split(src[j]);
        ASSERT_EQ(w[j], want.weight) << hwy::TargetName(target) << " n=" << n << " element " << j << " = " << src[j];
        ASSERT_EQ(c[j], want.comp) << hwy::TargetName(target) << " n=" << n << " element " << j << " = " << src[j];
      }
      EXPECT_EQ(w[n], 0xABCD) << "wrote past the end";
      EXPECT_EQ(c[n], 0xABCD) << "wrote past the end";
      std::vector<float> back(n + 1, -1.0f);
      cpu::widen_compensated(w.data(), c.data(), back.data(), n);
      for (std::size_t j = 0; j < n; ++j)
        ASSERT_EQ(bits(back[j]), bits(join(w[j], c[j]))) << hwy::TargetName(target) << " element " << j;
      EXPECT_EQ(back[n], -1.0f) << "wrote past the end";
    }
  }
}

// A finite parameter is kept to about 16 significant bits: the weight is its
// nearest bf16, and weight + compensation is within a 2^-8 of half a weight ulp.
TEST(CompensatedWeights, SplitKeepsSixteenBits) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int k = 0; k < 100000; ++k) {
    const float x = dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 60) - 30);
    const Split s = oracle_split(x);
    const float ulp = std::ldexp(1.0f, std::ilogb(widen_bf16(s.weight)) - 7);
    ASSERT_LE(std::abs(widen_bf16(s.comp)), 0.5f * ulp) << x;
    ASSERT_LE(std::abs(static_cast<double>(join(s.weight, s.comp)) - x), std::ldexp(0.5 * ulp, -8)) << x;
  }
}

// ---- The optimizer ---------------------------------------------------------------

struct Tensor {
  std::int64_t numel;
  DType weight, grad;
};

// A list of tensors of any dtypes, random weights and (loss-scaled) gradients.
struct Model {
  std::vector<std::vector<std::uint8_t>> weights, grads;
  std::vector<Param> params;
  explicit Model(const std::vector<Tensor>& tensors, unsigned seed = 11) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    weights.reserve(tensors.size());
    grads.reserve(tensors.size());
    for (const Tensor& t : tensors) {
      std::vector<float> w(static_cast<std::size_t>(t.numel)), g(w.size());
      for (float& x : w) x = dist(rng);
      for (float& x : g) x = 64.0f * dist(rng);
      weights.emplace_back(w.size() * dtype_size(t.weight));
      grads.emplace_back(g.size() * dtype_size(t.grad));
      cpu::narrow(w.data(), t.weight, weights.back().data(), w.size());
      cpu::narrow(g.data(), t.grad, grads.back().data(), g.size());
      params.push_back({{weights.back().data(), t.numel, t.weight}, {grads.back().data(), t.numel, t.grad}});
    }
  }
  std::vector<std::uint8_t> flat() const {
    std::vector<std::uint8_t> out;
    for (const auto& w : weights) out.insert(out.end(), w.begin(), w.end());
    return out;
  }
};

OptimizerOptions compensated_options() {
  OptimizerOptions o;
  o.master_weights = false;
  o.compensated_weights = true;
  o.max_grad_norm = 10.0;
  o.cpu_backend = CpuBackend::highway;
  return o;
}

const std::vector<Tensor> kBf16 = {{1, DType::bf16, DType::bf16},
                                   {7, DType::bf16, DType::bf16},
                                   {33, DType::bf16, DType::f32},
                                   {1000, DType::bf16, DType::f16},
                                   {16384 + 5, DType::bf16, DType::bf16}};
// With f32 weights, which have no compensation.
const std::vector<Tensor> kMixed = {{100, DType::f32, DType::f32},
                                    {7, DType::bf16, DType::bf16},
                                    {65, DType::f32, DType::bf16},
                                    {16384 + 5, DType::bf16, DType::f32},
                                    {1031, DType::bf16, DType::f16}};

// The weights and every compensation, concatenated (what must agree bitwise).
std::vector<std::uint8_t> train(const OptimizerConfig& config, OptimizerOptions o, int steps = 3,
                                const std::vector<Tensor>& tensors = kMixed) {
  Model m(tensors);
  Optimizer opt(config, m.params, o);
  for (int i = 0; i < steps; ++i) EXPECT_TRUE(opt.step_scaled(64.0).applied);
  std::vector<std::uint8_t> out = m.flat();
  for (std::size_t p = 0; p < opt.num_params(); ++p) {
    const std::span<const std::uint16_t> c = opt.compensation(p);
    const auto* b = reinterpret_cast<const std::uint8_t*>(c.data());
    out.insert(out.end(), b, b + c.size_bytes());
  }
  return out;
}

std::vector<OptimizerConfig> some_programs() {
  return {optim::AdamW{.lr = 1e-2, .weight_decay = 0.1}, optim::SGD{.lr = 0.1, .momentum = 0.9},
          optim::Lion{.weight_decay = 0.1}, optim::RAdam{.lr = 1e-2}, optim::Adagrad{.lr = 0.1}, optim::LAMB{}};
}

// The compensated optimizer computes on weight + compensation exactly what an
// optimizer over those values as f32 weights computes: so it equals an f32-weight
// optimizer whose weights are split (oracle_split) and rejoined after every step.
TEST(CompensatedWeights, FollowsTheFp32StepSplitAfterEveryStep) {
  for (const OptimizerConfig& config : some_programs()) {
    Model m(kBf16);
    std::vector<std::vector<float>> ref_w, ref_g;
    std::vector<Param> ref_params;
    for (const Param& p : m.params) {
      ref_w.emplace_back(static_cast<std::size_t>(p.weight.numel));
      ref_g.emplace_back(ref_w.back().size());
    }
    for (std::size_t t = 0; t < m.params.size(); ++t) {
      cpu::widen(DType::bf16, m.params[t].weight.data, ref_w[t].data(), ref_w[t].size());
      cpu::widen(m.params[t].grad.dtype, m.params[t].grad.data, ref_g[t].data(), ref_g[t].size());
      ref_params.push_back({{ref_w[t].data(), m.params[t].weight.numel, DType::f32},
                            {ref_g[t].data(), m.params[t].weight.numel, DType::f32}});
    }
    OptimizerOptions ro;
    ro.max_grad_norm = 10.0;
    Optimizer ref(config, ref_params, ro), opt(config, m.params, compensated_options());
    bool any_comp = false;
    for (int step = 1; step <= 4; ++step) {
      const StepResult a = ref.step_scaled(64.0), b = opt.step_scaled(64.0);
      ASSERT_EQ(a.grad_norm, b.grad_norm);
      for (std::size_t t = 0; t < m.params.size(); ++t) {
        const auto* w = static_cast<const std::uint16_t*>(m.params[t].weight.data);
        const std::span<const std::uint16_t> c = opt.compensation(t);
        ASSERT_EQ(c.size(), ref_w[t].size());
        for (std::size_t j = 0; j < ref_w[t].size(); ++j) {
          const Split s = oracle_split(ref_w[t][j]);
          ref_w[t][j] = join(s.weight, s.comp);
          ASSERT_EQ(w[j], s.weight) << optimizer_name(config) << " step " << step << " tensor " << t << " element " << j;
          ASSERT_EQ(c[j], s.comp) << optimizer_name(config) << " step " << step << " tensor " << t << " element " << j;
          any_comp |= c[j] != 0;
        }
      }
    }
    EXPECT_TRUE(any_comp) << optimizer_name(config) << ": every compensation stayed 0";
  }
}

TEST(CompensatedWeights, BitwiseIdenticalAcrossTargetsThreadsAndModes) {
  for (const OptimizerConfig& config : some_programs())
    test::expect_same_on_every_cpu_path(
        compensated_options(), [&](const OptimizerOptions& o) { return train(config, o); }, std::string(optimizer_name(config)));
}

TEST(CompensatedWeights, CustomProgramsAsBuiltIns) {
  const UpdateProgram program = UpdateProgram::from_config(optim::AdamW{.lr = 1e-2});
  Model a(kMixed), b(kMixed);
  Optimizer builtin(optim::AdamW{.lr = 1e-2}, a.params, compensated_options());
  Optimizer custom(program, b.params, compensated_options());
  for (int i = 0; i < 3; ++i) {
    builtin.step_scaled(64.0);
    custom.step_scaled(64.0);
  }
  EXPECT_EQ(a.flat(), b.flat());
  for (std::size_t p = 0; p < builtin.num_params(); ++p)
    EXPECT_TRUE(std::ranges::equal(builtin.compensation(p), custom.compensation(p))) << p;
}

// Updates far below half a bf16 ulp: round to nearest never moves the weight; the
// compensation accumulates them, as fp32 masters do.
TEST(CompensatedWeights, SmallUpdatesAccumulateAsWithMasters) {
  constexpr std::int64_t kN = 1000;
  constexpr int kSteps = 50;
  const float w0 = 1.0f, ulp = 0x1.0p-7f, update = 0.05f * ulp;  // 1/20 of an ulp per step
  enum Mode { nearest, masters, compensated };
  double moved[3] = {};
  for (Mode mode : {nearest, masters, compensated}) {
    std::vector<std::uint16_t> w(kN), g(kN);
    std::vector<float> ones(kN, w0), grad(kN, 1.0f);
    cpu::narrow(ones.data(), DType::bf16, w.data(), kN);
    cpu::narrow(grad.data(), DType::bf16, g.data(), kN);
    OptimizerOptions o;
    o.master_weights = mode == masters;
    o.compensated_weights = mode == compensated;
    Optimizer opt(optim::SGD{.lr = update, .maximize = true}, {{{w.data(), kN, DType::bf16}, {g.data(), kN, DType::bf16}}}, o);
    for (int s = 0; s < kSteps; ++s) opt.step();
    const float p = mode == masters       ? opt.master(0)[0]
                    : mode == compensated ? join(w[0], opt.compensation(0)[0])
                                          : widen_bf16(w[0]);
    moved[mode] = (static_cast<double>(p) - w0) / ulp;  // in ulps; exactly kSteps * 0.05 = 2.5
    for (std::int64_t j = 1; j < kN; ++j) ASSERT_EQ(w[j], w[0]);  // (every element alike)
  }
  EXPECT_EQ(moved[nearest], 0.0);
  EXPECT_NEAR(moved[masters], kSteps * 0.05, 1e-3);  // (fp32 rounding of 50 additions)
  // Each step loses at most half an ulp of the compensation, under 2^-9 of a weight ulp.
  EXPECT_NEAR(moved[compensated], kSteps * 0.05, kSteps * 0x1.0p-9);
}

TEST(CompensatedWeights, SkippedStepsWriteNothing) {
  Model m(kMixed);
  Optimizer opt(optim::AdamW{.lr = 1e-2}, m.params, compensated_options());
  opt.step_scaled(64.0);
  const std::vector<std::uint8_t> before = m.flat();
  const std::vector<std::uint16_t> comp(opt.compensation(3).begin(), opt.compensation(3).end());
  reinterpret_cast<std::uint16_t*>(m.grads[1].data())[5] = 0x7FC0;  // NaN
  EXPECT_FALSE(opt.step_scaled(64.0).applied);
  EXPECT_EQ(m.flat(), before);
  EXPECT_TRUE(std::ranges::equal(opt.compensation(3), comp));
}

// f32 weights have no compensation; compensations start at 0 and survive adding a group.
TEST(CompensatedWeights, AccessorsAndParamGroups) {
  Model m(kMixed), extra({{40, DType::bf16, DType::bf16}}, 5);
  Optimizer opt(optim::AdamW{.lr = 1e-2}, m.params, compensated_options());
  EXPECT_TRUE(opt.compensation(0).empty());
  EXPECT_TRUE(opt.master(1).empty());
  ASSERT_EQ(opt.compensation(1).size(), 7u);
  for (std::uint16_t c : opt.compensation(3)) ASSERT_EQ(c, 0);
  opt.step_scaled(64.0);
  const std::vector<std::uint16_t> comp(opt.compensation(3).begin(), opt.compensation(3).end());
  EXPECT_TRUE(std::any_of(comp.begin(), comp.end(), [](std::uint16_t c) { return c != 0; }));
  opt.add_param_group({extra.params, optim::AdamW{.lr = 1e-3}});
  EXPECT_TRUE(std::ranges::equal(opt.compensation(3), comp));
  EXPECT_EQ(opt.compensation(5).size(), 40u);
  EXPECT_THROW((void)opt.compensation(6), Error);
}

TEST(CompensatedWeights, RefusesWhatItCannotCompensate) {
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
  const auto expect_has = [](const std::string& m, const std::string& part) {
    EXPECT_NE(m.find(part), std::string::npos) << m;
  };
  OptimizerOptions o;
  o.compensated_weights = true;  // with masters
  expect_has(message(o, DType::bf16), "AdamW: OptimizerOptions::compensated_weights is set with master_weights = true");
  o.master_weights = false;
  expect_has(message(o, DType::f16), "AdamW: OptimizerOptions::compensated_weights: params[0] has f16 weights");
  expect_has(message(o, DType::f32), "no param has bf16 weights");
  o.stochastic_rounding = true;
  expect_has(message(o, DType::bf16), "compensated_weights is set with stochastic_rounding = true");
  o.stochastic_rounding = false;
  EXPECT_EQ(message(o, DType::bf16), "no error");
}

}  // namespace
}  // namespace stepfuse
