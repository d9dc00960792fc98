// The CPU backend's kernels: conversions, the canonical reduction order,
// bitwise identity across Highway targets and between the fused loops and the
// blocked interpreter.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "f16_oracle.hpp"
#include "hwy/targets.h"
#include "hwy_targets.hpp"
#include "jit/builtins.hpp"
#include "runtime/cpu/kernels.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using test::bits;
using test::from_bits;
using test::PerTarget;
using test::targets;

// Oracles independent of the library: the compiler's _Float16 or F16C (correctly
// rounded conversions, tests/f16_oracle.hpp) and bf16 rounding in integer arithmetic.
std::uint16_t oracle_f16(float f) {
  std::uint16_t b = test::oracle_float_to_f16(f);
  if (std::isnan(f)) b = static_cast<std::uint16_t>((b & 0x8000) | 0x7E00);  // canonical quiet NaN
  return b;
}
float oracle_f16_to_f32(std::uint16_t b) { return test::oracle_f16_to_float(b); }
std::uint16_t oracle_bf16(float f) {
  const std::uint32_t u = bits(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  const std::uint64_t rounded = static_cast<std::uint64_t>(u) + 0x7FFF + ((u >> 16) & 1);
  return static_cast<std::uint16_t>(rounded >> 16);
}


std::vector<float> interesting_floats() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.996f, 65520.0f, -65520.0f, 1e-8f, 6.0e-8f,
                          5.96e-8f, 2.98e-8f, 2.9802322e-8f, 6.1035156e-5f, 6.1e-5f, 3.0e38f, INFINITY, -INFINITY,
                          NAN, -NAN, 1.00048828125f, 1.0009765625f + 0.00048828125f, 3.3895314e38f, 1.17549435e-38f,
                          1.0e-40f, -1.0e-45f};
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) v.push_back(from_bits(static_cast<std::uint32_t>(rng())));
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int i = 0; i < 50000; ++i) v.push_back(u(rng));
  for (std::uint32_t h = 0; h < 0x10000; ++h) {  // exact ties around every f16 value
    const float f = oracle_f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isfinite(f)) {
      v.push_back(std::nextafter(f, INFINITY));
      v.push_back(std::nextafter(f, -INFINITY));
    }
  }
  return v;
}

TEST(Conversions, F16AndBf16RoundToNearestEvenOnEveryTarget) {
  const std::vector<float> in = interesting_floats();
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    SCOPED_TRACE(hwy::TargetName(target));
    std::vector<std::uint16_t> h(in.size()), b(in.size());
    cpu::narrow(in.data(), DType::f16, h.data(), in.size());
    cpu::narrow(in.data(), DType::bf16, b.data(), in.size());
    std::size_t bad_h = 0, bad_b = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (h[i] != oracle_f16(in[i]) && ++bad_h < 5)
        ADD_FAILURE() << "f16(" << in[i] << " = 0x" << std::hex << bits(in[i]) << ") = 0x" << h[i] << ", expected 0x"
                      << oracle_f16(in[i]);
      if (b[i] != oracle_bf16(in[i]) && ++bad_b < 5)
        ADD_FAILURE() << "bf16(0x" << std::hex << bits(in[i]) << ") = 0x" << b[i] << ", expected 0x" << oracle_bf16(in[i]);
    }
    EXPECT_EQ(bad_h, 0u);
    EXPECT_EQ(bad_b, 0u);
  }
}

TEST(Conversions, WideningIsExactForEvery16BitPattern) {
  std::vector<std::uint16_t> all(0x10000);
  for (std::uint32_t i = 0; i < 0x10000; ++i) all[i] = static_cast<std::uint16_t>(i);
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    SCOPED_TRACE(hwy::TargetName(target));
    std::vector<float> f(all.size()), b(all.size());
    cpu::widen(DType::f16, all.data(), f.data(), all.size());
    cpu::widen(DType::bf16, all.data(), b.data(), all.size());
    for (std::uint32_t i = 0; i < 0x10000; ++i) {
      const float expect = oracle_f16_to_f32(static_cast<std::uint16_t>(i));
      if (std::isnan(expect)) ASSERT_TRUE(std::isnan(f[i])) << std::hex << i;
      else ASSERT_EQ(bits(f[i]), bits(expect)) << "f16 0x" << std::hex << i;
      ASSERT_EQ(bits(b[i]), i << 16) << "bf16 0x" << std::hex << i;
    }
  }
}

// The canonical order of docs/architecture.md §5, written plainly: element i of a chunk into
// fp32 lane i mod 32, lanes combined by the pairwise tree.
double canonical_sumsq(const float* g, std::size_t n) {
  float lanes[32] = {};
  for (std::size_t i = 0; i < n; ++i) lanes[i % 32] += g[i] * g[i];
  for (std::size_t w = 16; w >= 1; w /= 2)
    for (std::size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

TEST(Reduce, SumOfSquaresFollowsTheCanonicalOrderOnEveryTarget) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (std::size_t n : {0u, 1u, 5u, 31u, 32u, 33u, 1000u, 16384u}) {
    std::vector<float> g(n);
    for (float& x : g) x = dist(rng);
    const double expect = canonical_sumsq(g.data(), n);
    for (std::int64_t target : targets()) {
      PerTarget scope(target);
      const cpu::ReducePartial p = cpu::reduce_kernel(DType::f32, cpu::NormKind::l2)(g.data(), n);
      EXPECT_EQ(p.sumsq, expect) << "n=" << n << " on " << hwy::TargetName(target);
      EXPECT_FALSE(p.nonfinite);
      const cpu::ReducePartial m = cpu::reduce_kernel(DType::f32, cpu::NormKind::inf)(g.data(), n);
      float maxabs = 0;
      for (float x : g) maxabs = std::max(maxabs, std::fabs(x));
      EXPECT_EQ(m.maxabs, maxabs);
    }
  }
}

// Huge finite gradients (a loss scale near the top of the fp32 range) whose fp32
// squares overflow: the sum is taken in the canonical order on values scaled by
// 2^-e (e just above the exponent of max |g|) and scaled back in fp64. Not inf,
// not flagged, identical on every target, and close to the exact sum.
TEST(Reduce, SquaresOverflowingFp32GiveTheRescaledCanonicalSum) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (DType t : {DType::f32, DType::bf16}) {
    for (std::size_t n : {1u, 33u, 1000u, 16384u}) {
      for (float magnitude : {3e19f, 1e30f, 1e38f}) {
        std::vector<float> g(n);
        for (float& x : g) x = dist(rng) * (magnitude * 0.2f);
        g[n / 2] = magnitude;  // at least one square overflows fp32
        std::vector<std::uint16_t> lp(n);
        const void* data = g.data();
        if (t != DType::f32) {
          cpu::narrow(g.data(), t, lp.data(), n);
          cpu::widen(t, lp.data(), g.data(), n);  // the values the kernel sees
          data = lp.data();
        }
        float maxabs = 0;
        for (float x : g) maxabs = std::max(maxabs, std::fabs(x));
        const int e = std::ilogb(maxabs) + 1;
        std::vector<float> scaled(n);
        double exact = 0;
        for (std::size_t i = 0; i < n; ++i) {
          scaled[i] = g[i] * std::ldexp(1.0f, -e);
          exact += static_cast<double>(g[i]) * g[i];
        }
        const double expect = std::ldexp(canonical_sumsq(scaled.data(), n), 2 * e);
        EXPECT_NEAR(expect, exact, 1e-5 * exact);
        for (std::int64_t target : targets()) {
          PerTarget scope(target);
          const cpu::ReducePartial p = cpu::reduce_kernel(t, cpu::NormKind::l2)(data, n);
          EXPECT_FALSE(p.nonfinite) << dtype_name(t) << " n=" << n << " on " << hwy::TargetName(target);
          EXPECT_EQ(p.sumsq, expect) << dtype_name(t) << " n=" << n << " |g|~" << magnitude << " on "
                                     << hwy::TargetName(target);
        }
      }
    }
  }
}

TEST(Reduce, FlagsEveryKindOfNonFiniteAnywhere) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (float bad : {INFINITY, -INFINITY, NAN}) {
      for (std::size_t pos : {0u, 17u, 31u, 32u, 99u}) {
        std::vector<float> g(100, 0.5f);
        g[pos] = bad;
        std::vector<std::uint16_t> lp(100);
        const void* data = g.data();
        if (t != DType::f32) {
          cpu::narrow(g.data(), t, lp.data(), g.size());
          data = lp.data();
        }
        for (auto kind : {cpu::NormKind::l2, cpu::NormKind::inf})
          EXPECT_TRUE(cpu::reduce_kernel(t, kind)(data, g.size()).nonfinite)
              << dtype_name(t) << " " << bad << " at " << pos;
      }
    }
  }
}

// The kernels that reduce 2 to kReduceWays chunks at once (many small tensors) give
// each chunk's partial bit for bit as the one-chunk kernel does: every grad dtype and
// norm, every target, chunks of unequal lengths (0, a tail, a whole chunk), with an
// inf, a NaN or squares that overflow fp32 in one of them.
TEST(Reduce, ChunksReducedTogetherGiveEachChunksOwnPartial) {
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  const std::vector<std::vector<std::size_t>> length_sets = {
      {1000, 1000, 1000, 1000}, {5, 16384, 0, 33}, {0, 0, 31, 1}, {4096, 1024, 3000, 2049}};
  static_assert(cpu::kReduceWays == 4, "the length sets above are of 4 chunks");
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (const std::vector<std::size_t>& lens : length_sets) {
      for (int special = 0; special < 4; ++special) {  // none, inf, NaN, overflowing squares (f32, bf16)
        if (special == 3 && t == DType::f16) continue;
        std::vector<std::vector<std::uint8_t>> data;
        std::vector<const void*> ptrs;
        for (std::size_t j = 0; j < lens.size(); ++j) {
          std::vector<float> g(std::max<std::size_t>(1, lens[j]));  // (never empty: no null pointers)
          for (float& x : g) x = dist(rng);
          if (special > 0 && j == 1 && lens[j] > 0) g[lens[j] / 2] = special == 1 ? INFINITY : special == 2 ? NAN : 1e30f;
          data.emplace_back(g.size() * dtype_size(t));
          if (t == DType::f32) std::memcpy(data.back().data(), g.data(), lens[j] * sizeof(float));
          else cpu::narrow(g.data(), t, data.back().data(), lens[j]);
          ptrs.push_back(data.back().data());
        }
        for (std::int64_t target : targets()) {
          PerTarget scope(target);
          for (auto kind : {cpu::NormKind::l2, cpu::NormKind::inf}) {
           for (std::size_t ways = 2; ways <= cpu::kReduceWays; ++ways) {
            cpu::ReducePartial together[cpu::kReduceWays];
            cpu::reduce_group_kernel(t, kind, ways)(ptrs.data(), lens.data(), together);
            for (std::size_t j = 0; j < ways; ++j) {
              const cpu::ReducePartial alone = cpu::reduce_kernel(t, kind)(ptrs[j], lens[j]);
              const std::string where = std::string(dtype_name(t)) + " chunk " + std::to_string(j) + " of " +
                                        std::to_string(lens[j]) + " of " + std::to_string(ways) + ", special " +
                                        std::to_string(special) + " on " +
                                        hwy::TargetName(target);
              std::uint64_t a = 0, b = 0;  // (bit patterns: the sums of a chunk with a NaN are NaN)
              std::memcpy(&a, &together[j].sumsq, sizeof a);
              std::memcpy(&b, &alone.sumsq, sizeof b);
              EXPECT_EQ(a, b) << where;
              EXPECT_EQ(bits(together[j].maxabs), bits(alone.maxabs)) << where;
              EXPECT_EQ(together[j].nonfinite, alone.nonfinite) << where;
            }
           }
          }
        }
      }
    }
  }
}

// A small list with awkward sizes, filled deterministically.
struct Buffers {
  std::vector<std::vector<std::uint8_t>> weights, grads;
  std::vector<Param> params;
  Buffers(const std::vector<std::int64_t>& sizes, DType w, DType g, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (std::int64_t n : sizes) {
      std::vector<float> wf(n), gf(n);
      for (auto& x : wf) x = dist(rng);
      for (auto& x : gf) x = 64.0f * dist(rng);
      weights.emplace_back(n * dtype_size(w) + 1);
      grads.emplace_back(n * dtype_size(g) + 1);
      cpu::narrow(wf.data(), w, weights.back().data(), n);
      cpu::narrow(gf.data(), g, grads.back().data(), n);
      params.push_back({{weights.back().data(), n, w}, {grads.back().data(), n, g}});
    }
  }
};

std::vector<OptimizerConfig> every_program() {
  std::vector<OptimizerConfig> c;
  c.push_back(optim::SGD{.lr = 0.1, .weight_decay = 0.01});
  c.push_back(optim::SGD{.lr = 0.1, .momentum = 0.9, .dampening = 0.1});
  c.push_back(optim::SGD{.lr = 0.1, .momentum = 0.9, .nesterov = true});
  c.push_back(optim::Adam{.weight_decay = 0.01});
  c.push_back(optim::AdamW{.amsgrad = true, .maximize = true});
  c.push_back(optim::Adagrad{.lr_decay = 0.01, .initial_accumulator_value = 0.1});
  c.push_back(optim::RMSprop{});
  c.push_back(optim::RMSprop{.centered = true});
  c.push_back(optim::RMSprop{.momentum = 0.9});
  c.push_back(optim::RMSprop{.weight_decay = 0.1, .momentum = 0.5, .centered = true});
  c.push_back(optim::Lion{.weight_decay = 0.1});
  c.push_back(optim::NAdam{.weight_decay = 0.01, .decoupled_weight_decay = true});
  c.push_back(optim::RAdam{.beta2 = 0.9, .weight_decay = 0.01});
  c.push_back(optim::Adamax{.weight_decay = 0.01, .maximize = true});
  c.push_back(optim::Adadelta{.weight_decay = 0.01});
  c.push_back(optim::Rprop{.step_size_max = 0.011});
  c.push_back(optim::ASGD{.lambd = 0.1, .t0 = 0});
  return c;
}

struct Snapshot {
  std::vector<std::vector<std::uint8_t>> weights;
  std::vector<std::vector<float>> state;
  double norm = 0;
  bool operator==(const Snapshot&) const = default;
};

Snapshot run(const OptimizerConfig& config, DType w, DType g, bool masters, OptimizerOptions o, int steps = 3) {
  const std::vector<std::int64_t> sizes = {1, 7, 33, 1000, 16384 + 5};
  Buffers b(sizes, w, g, 11);
  o.master_weights = masters;
  o.max_grad_norm = 10.0;
  Optimizer opt(config, b.params, o);
  Snapshot s;
  for (int i = 0; i < steps; ++i) s.norm = opt.step_scaled(64.0).grad_norm;
  s.weights = b.weights;
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    for (auto name : opt.state_names()) {
      auto st = opt.state(p, name);
      s.state.emplace_back(st.begin(), st.end());
    }
    auto m = opt.master(p);
    s.state.emplace_back(m.begin(), m.end());
  }
  return s;
}

struct Combo {
  DType w, g;
  bool masters;
};
const Combo kCombos[] = {
    {DType::f32, DType::f32, false},  {DType::f32, DType::f16, false},  {DType::f32, DType::bf16, false},
    {DType::f16, DType::f32, true},   {DType::f16, DType::f16, true},   {DType::f16, DType::f16, false},
    {DType::bf16, DType::bf16, true}, {DType::bf16, DType::bf16, false}, {DType::bf16, DType::f32, true},
    {DType::f16, DType::bf16, true},  {DType::bf16, DType::f16, false},
};

TEST(FusedKernels, BitwiseIdenticalOnEveryHighwayTarget) {
  for (const OptimizerConfig& config : every_program()) {
    for (const Combo& c : {kCombos[0], kCombos[4], kCombos[7]}) {
      std::vector<Snapshot> results;
      for (std::int64_t target : targets()) {
        PerTarget scope(target);
        results.push_back(run(config, c.w, c.g, c.masters, {}));
      }
      for (std::size_t t = 1; t < results.size(); ++t)
        EXPECT_TRUE(results[t] == results[0])
            << optimizer_name(config) << " " << dtype_name(c.w) << "/" << dtype_name(c.g) << ": target "
            << hwy::TargetName(targets()[t]) << " differs from " << hwy::TargetName(targets()[0]);
    }
  }
}

TEST(FusedKernels, InterpreterMatchesFusedLoopBitwise) {
  for (const OptimizerConfig& config : every_program()) {
    for (const Combo& c : kCombos) {
      OptimizerOptions fused, interpreted;
      interpreted.fusion = Fusion::interpreted;
      EXPECT_TRUE(run(config, c.w, c.g, c.masters, fused) == run(config, c.w, c.g, c.masters, interpreted))
          << optimizer_name(config) << " " << dtype_name(c.w) << "/" << dtype_name(c.g) << " masters=" << c.masters;
    }
  }
}

TEST(Pipeline, NoModeWritesTheGradients) {
  for (Fusion mode : {Fusion::fused, Fusion::interpreted, Fusion::unfused}) {
    for (const Combo& c : {kCombos[0], kCombos[4], kCombos[8]}) {
      Buffers b({3, 1000, 20000}, c.w, c.g, 5);
      const auto before = b.grads;
      OptimizerOptions o;
      o.fusion = mode;
      o.max_grad_norm = 1.0;
      Optimizer opt(optim::AdamW{}, b.params, o);
      EXPECT_TRUE(opt.step_scaled(1024.0).applied);
      opt.step();
      EXPECT_EQ(b.grads, before) << "mode " << static_cast<int>(mode);
      EXPECT_NE(b.weights, Buffers({3, 1000, 20000}, c.w, c.g, 5).weights);
    }
  }
}

// A list may mix dtype combinations (bf16 matrices beside f32 norms): each tensor
// gets its own kernel, and the result equals one optimizer per tensor, bitwise.
TEST(Pipeline, MixedDtypeListsMatchPerTensorOptimizers) {
  const Combo mix[] = {kCombos[0], kCombos[4], kCombos[6], kCombos[8], kCombos[1]};
  const std::int64_t sizes[] = {1000, 17, 20000, 33, 5};
  for (Fusion mode : {Fusion::fused, Fusion::interpreted, Fusion::unfused}) {
    std::vector<Buffers> together, alone;
    std::vector<Param> params;
    for (int i = 0; i < 5; ++i) {
      together.emplace_back(std::vector<std::int64_t>{sizes[i]}, mix[i].w, mix[i].g, 100 + i);
      alone.emplace_back(std::vector<std::int64_t>{sizes[i]}, mix[i].w, mix[i].g, 100 + i);
      params.push_back(together.back().params[0]);
    }
    OptimizerOptions o;
    o.fusion = mode;
    Optimizer opt(optim::Adam{.weight_decay = 0.1}, params, o);
    opt.step_scaled(8.0);
    opt.step_scaled(8.0);
    for (int i = 0; i < 5; ++i) {
      Optimizer single(optim::Adam{.weight_decay = 0.1}, alone[i].params, o);
      single.step_scaled(8.0);
      single.step_scaled(8.0);
      EXPECT_EQ(together[i].weights, alone[i].weights) << "tensor " << i << " mode " << static_cast<int>(mode);
      const auto a = opt.state(i, "exp_avg_sq"), b = single.state(0, "exp_avg_sq");
      EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
      EXPECT_EQ(opt.master(i).size(), single.master(0).size());
    }
  }
}

TEST(FusedKernels, EveryBuiltinHasAKernelForEveryDtypeCombination) {
  for (int b = 0; b < jit::kNumBuiltins; ++b)
    for (DType w : {DType::f32, DType::f16, DType::bf16})
      for (DType g : {DType::f32, DType::f16, DType::bf16})
        for (bool m : {false, true})
          for (bool sr : {false, true}) {
            const jit::DtypeCombo c = jit::param_combo(w, g, m, sr);
            if (sr && !c.stochastic) continue;  // stochastic rounding is for bf16 weights without masters
            if (w == DType::f32 && m) continue;
            EXPECT_NE(cpu::fused_update_kernel(static_cast<jit::Builtin>(b), c), nullptr)
                << jit::builtin_program(static_cast<jit::Builtin>(b)).name;
          }
}

TEST(Dispatch, ReportsTheTargetInUse) {
  const std::string t = cpu_target();
  EXPECT_FALSE(t.empty());
  EXPECT_EQ(t, hwy::TargetName(targets()[0]));
}

}  // namespace
}  // namespace stepfuse
