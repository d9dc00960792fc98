// Param groups: one reduce pass, one global norm and skip decision over every
// group, each tensor updated with its group's hyperparameters and program
// variant, add_param_group as torch's, and every error naming the group.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "jit/llvm/cpu_jit.hpp"
#include "reference/reference.hpp"
#include "reference/test_data.hpp"
#include "reference/test_util.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using ref::HostTensors;
using ref::Random;

// Caller-owned weights and gradients of one dtype pair.
struct Tensors {
  Tensors(DType wd, DType gd, const std::vector<std::int64_t>& sizes, std::uint64_t seed)
      : w(wd, sizes, false), g(gd, sizes, false) {
    Random rng(seed);
    for (std::size_t i = 0; i < w.size(); ++i)
      for (std::int64_t j = 0; j < w[i].numel; ++j) w.set(i, j, rng.normal());
  }
  // Gradients N(0, 0.25) times S (a power of two: exact), from `seed`.
  void grads(std::uint64_t seed, double S = 1.0) const {
    Random rng(seed);
    for (std::size_t i = 0; i < g.size(); ++i)
      for (std::int64_t j = 0; j < g[i].numel; ++j) g.set(i, j, 0.5 * rng.normal() * S);
  }
  std::vector<Param> params(std::size_t from, std::size_t to) const {
    std::vector<Param> p;
    for (std::size_t i = from; i < to; ++i) p.push_back({w[i], g[i]});
    return p;
  }
  std::vector<Param> params() const { return params(0, w.size()); }
  HostTensors w, g;
};

// Bitwise: the weights of tensors [from, to) of `a` equal those of `b` from b_from,
// and the state and masters of `oa`'s params [from, to) equal `ob`'s from b_from.
void expect_same(const Tensors& a, const Optimizer& oa, std::size_t from, std::size_t to, const Tensors& b,
                 const Optimizer& ob, std::size_t b_from, const std::string& what) {
  const auto wa = a.w.snapshot(), wb = b.w.snapshot();
  for (std::size_t i = from; i < to; ++i) {
    const std::size_t k = b_from + i - from;
    const std::string t = what + ": tensor " + std::to_string(i);
    EXPECT_EQ(wa[i], wb[k]) << t << " weights";
    EXPECT_EQ(ref::bytes_of(oa.master(i)), ref::bytes_of(ob.master(k))) << t << " master";
    for (std::string_view name : ob.state_names()) {
      std::vector<unsigned char> sb;
      try {
        sb = ref::bytes_of(ob.state(k, name));
      } catch (const Error&) {  // k's group keeps no such state: neither may i's
        EXPECT_THROW((void)oa.state(i, name), Error) << t << " " << name;
        continue;
      }
      EXPECT_EQ(ref::bytes_of(oa.state(i, name)), sb) << t << " " << name;
    }
  }
}

const std::vector<std::int64_t> kSizes = {1000, 37, 16384 + 5, 1, 4096, 300};

optim::AdamW adamw(double lr, double wd, bool amsgrad = false) {
  optim::AdamW c;
  c.lr = lr, c.weight_decay = wd, c.amsgrad = amsgrad;
  return c;
}

OptimizerOptions with_backend(CpuBackend b, int threads = 0) {
  OptimizerOptions o;
  o.cpu_backend = b;
  o.num_threads = threads;
  return o;
}

// Without clipping or a loss scale, groups do not interact: a two-group optimizer
// is bitwise the two one-group optimizers, on every CPU path, with variants
// (amsgrad in one group only) and mixed dtypes.
TEST(ParamGroups, UnclippedGroupsEqualSeparateOptimizers) {
  struct Path {
    const char* name;
    OptimizerOptions options;
  };
  OptimizerOptions interpreted;
  interpreted.fusion = Fusion::interpreted;
  OptimizerOptions unfused;
  unfused.fusion = Fusion::unfused;
  for (const Path& path : {Path{"highway", with_backend(CpuBackend::highway)}, Path{"llvm", with_backend(CpuBackend::llvm)},
                           Path{"interpreted", interpreted}, Path{"unfused", unfused}}) {
    if (std::string_view(path.name) == "llvm" && !jit::llvm_built()) continue;
    for (const DType wd : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(path.name) + (wd == DType::f32 ? " f32" : " bf16"));
      Tensors both(wd, DType::f32, kSizes, 7), first(wd, DType::f32, {kSizes.begin(), kSizes.begin() + 4}, 7),
          second(wd, DType::f32, {kSizes.begin() + 4, kSizes.end()}, 0);
      // `second` must start where `both`'s last two tensors start.
      for (std::size_t i = 4; i < kSizes.size(); ++i)
        for (std::int64_t j = 0; j < kSizes[i]; ++j) second.w.set(i - 4, j, both.w.get(i, j));
      Optimizer grouped({{both.params(0, 4), adamw(1e-2, 0.1)}, {both.params(4, 6), adamw(3e-3, 0.0, true)}},
                        path.options);
      Optimizer a(adamw(1e-2, 0.1), first.params(), path.options);
      Optimizer b(adamw(3e-3, 0.0, true), second.params(), path.options);
      ASSERT_EQ(grouped.num_groups(), 2u);
      EXPECT_EQ(grouped.state_names().size(), 3u);  // exp_avg, exp_avg_sq and group 1's max_exp_avg_sq
      for (int step = 1; step <= 3; ++step) {
        both.grads(100 + step);
        for (std::size_t i = 0; i < 4; ++i)
          std::memcpy(first.g[i].data, both.g[i].data, static_cast<std::size_t>(kSizes[i]) * 4);
        for (std::size_t i = 4; i < 6; ++i)
          std::memcpy(second.g[i - 4].data, both.g[i].data, static_cast<std::size_t>(kSizes[i]) * 4);
        grouped.step();
        a.step();
        b.step();
      }
      expect_same(both, grouped, 0, 4, first, a, 0, "group 0");
      expect_same(both, grouped, 4, 6, second, b, 0, "group 1");
      EXPECT_EQ(grouped.group_step_count(1), 3);
    }
  }
}

// One global norm: groups with the same config clip (and skip) exactly as one group.
TEST(ParamGroups, OneGlobalClipAndSkipOverEveryGroup) {
  for (const double norm_type : {2.0, double{INFINITY}}) {
    Tensors x(DType::f16, DType::f16, kSizes, 3), y(DType::f16, DType::f16, kSizes, 3);
    OptimizerOptions o;
    o.max_grad_norm = 0.5;
    o.norm_type = norm_type;
    Optimizer one(adamw(1e-2, 0.01), x.params(), o);
    Optimizer three({{y.params(0, 2), adamw(1e-2, 0.01)}, {y.params(2, 3), adamw(1e-2, 0.01)},
                     {y.params(3, 6), adamw(1e-2, 0.01)}},
                    o);
    for (int step = 1; step <= 3; ++step) {
      x.grads(10 + step, 1024.0);
      y.grads(10 + step, 1024.0);
      const StepResult r1 = one.step_scaled(1024.0), r3 = three.step_scaled(1024.0);
      EXPECT_TRUE(r3.applied);
      EXPECT_EQ(r1.grad_norm, r3.grad_norm);
      EXPECT_EQ(r1.clip_coef, r3.clip_coef);
      EXPECT_LT(r3.clip_coef, 1.0);
      EXPECT_EQ(one.last_tensor_grad_norms(), three.last_tensor_grad_norms());
    }
    expect_same(y, three, 0, kSizes.size(), x, one, 0, "three groups vs one");
    // An inf in the last group skips every group.
    const auto before = y.w.snapshot();
    y.grads(99, 1024.0);
    y.g.set(5, 7, INFINITY);
    const StepResult r = three.step_scaled(1024.0);
    EXPECT_FALSE(r.applied);
    EXPECT_TRUE(r.found_inf);
    EXPECT_EQ(y.w.snapshot(), before);
    EXPECT_EQ(three.step_count(), 3);
  }
}

// Each group's hyperparameters under a global clip, against the float64 reference.
TEST(ParamGroups, PerGroupHyperparametersUnderGlobalClipMatchTheReference) {
  const std::vector<std::int64_t> sizes = {500, 70, 1200};
  Tensors t(DType::f32, DType::f32, sizes, 5);
  const std::vector<OptimizerConfig> configs = {adamw(1e-2, 0.1), adamw(4e-3, 0.0, true)};
  OptimizerOptions o;
  o.max_grad_norm = 1.0;
  Optimizer opt({{t.params(0, 2), configs[0]}, {t.params(2, 3), configs[1]}}, o);
  std::vector<ref::RefTensor> r;
  for (std::size_t i = 0; i < sizes.size(); ++i) r.push_back(ref::make_tensor(configs[i < 2 ? 0 : 1], t.w.values(i)));
  for (int step = 1; step <= 4; ++step) {
    t.grads(50 + step);
    const auto g = t.g.all_values();
    const double norm = ref::total_norm(g, 2.0);
    const double coef = ref::clip_coefficient(norm, 1.0);
    ASSERT_LT(coef, 1.0);
    opt.step();
    EXPECT_NEAR(opt.last_grad_norm(), norm, 1e-6 * norm);  // fp32 chunk partials
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<double> gi = g[i];
      for (double& v : gi) v *= coef;
      ref::update(configs[i < 2 ? 0 : 1], r[i], gi, step);
    }
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto w = t.w.values(i);
    for (std::size_t j = 0; j < w.size(); ++j)
      ASSERT_NEAR(w[j], r[i].param[j], 1e-5 * std::fabs(r[i].param[j]) + 1e-6) << "tensor " << i << "[" << j << "]";
  }
  EXPECT_EQ(opt.state(2, "max_exp_avg_sq").size(), 1200u);
  EXPECT_NE(ref::error_message([&] { (void)opt.state(0, "max_exp_avg_sq"); }).find("group (0)"), std::string::npos);
}

// Results do not depend on the thread count, with groups either.
TEST(ParamGroups, BitwiseEqualForAnyThreadCount) {
  Tensors a(DType::bf16, DType::bf16, kSizes, 9), b(DType::bf16, DType::bf16, kSizes, 9);
  OptimizerOptions o1 = with_backend(CpuBackend::highway, 1), o3 = with_backend(CpuBackend::highway, 3);
  o1.max_grad_norm = o3.max_grad_norm = 0.3;
  const std::vector<ParamGroup> ga = {{a.params(0, 3), adamw(1e-3, 0.0)}, {a.params(3, 6), adamw(2e-3, 0.1, true)}};
  const std::vector<ParamGroup> gb = {{b.params(0, 3), adamw(1e-3, 0.0)}, {b.params(3, 6), adamw(2e-3, 0.1, true)}};
  Optimizer x(ga, o1), y(gb, o3);
  for (int s = 0; s < 3; ++s) {
    a.grads(s, 256.0);
    b.grads(s, 256.0);
    x.step_scaled(256.0);
    y.step_scaled(256.0);
  }
  expect_same(a, x, 0, kSizes.size(), b, y, 0, "1 vs 3 threads");
}

TEST(ParamGroups, PerGroupLrAndConfig) {
  Tensors t(DType::f32, DType::f32, kSizes, 2);
  Optimizer opt({{t.params(0, 3), adamw(1e-3, 0.1)}, {t.params(3, 6), adamw(5e-3, 0.0)}});
  EXPECT_EQ(opt.lr(0), 1e-3);
  EXPECT_EQ(opt.lr(1), 5e-3);
  EXPECT_EQ(opt.lr(), 1e-3);  // group 0's
  opt.set_lr(1, 7e-3);
  EXPECT_EQ(opt.lr(1), 7e-3);
  EXPECT_EQ(opt.lr(0), 1e-3);
  opt.set_lr(2e-3);  // every group
  EXPECT_EQ(opt.lr(0), 2e-3);
  EXPECT_EQ(opt.lr(1), 2e-3);
  EXPECT_EQ(std::get<optim::AdamW>(opt.config(0)).weight_decay, 0.1);  // the rest stays per group
  EXPECT_EQ(std::get<optim::AdamW>(opt.config(1)).weight_decay, 0.0);
  opt.set_config(1, adamw(1e-4, 0.2));
  EXPECT_EQ(std::get<optim::AdamW>(opt.config(1)).weight_decay, 0.2);
  // amsgrad changes group 1's program: an Error naming the group, nothing changes.
  const std::string m = ref::error_message([&] { opt.set_config(1, adamw(1e-4, 0.2, true)); });
  EXPECT_NE(m.find("group 1"), std::string::npos) << m;
  EXPECT_NE(ref::error_message([&] { opt.set_lr(-1.0); }).find("lr"), std::string::npos);
  EXPECT_EQ(opt.lr(0), 2e-3);  // set_lr(-1) changed no group
  EXPECT_EQ(opt.lr(1), 1e-4);
  EXPECT_NE(ref::error_message([&] { opt.set_lr(2, 1e-3); }).find("group 2 is out of range"), std::string::npos);
  EXPECT_NE(ref::error_message([&] { (void)opt.config(5); }).find("out of range"), std::string::npos);
  EXPECT_EQ(opt.group_of(4), 1u);
  EXPECT_EQ(opt.group_params(1).size(), 3u);
  EXPECT_EQ(opt.group_params(1)[0].weight.data, t.w[3].data);
}

// add_param_group as torch's: fresh state and a step count of its own; the
// existing groups continue bitwise as if nothing happened.
TEST(ParamGroups, AddParamGroupStartsFreshAndKeepsTheRest) {
  for (const CpuBackend backend : {CpuBackend::highway, CpuBackend::automatic}) {
    Tensors t(DType::bf16, DType::f32, kSizes, 4), a(DType::bf16, DType::f32, {kSizes.begin(), kSizes.begin() + 4}, 4),
        b(DType::bf16, DType::f32, {kSizes.begin() + 4, kSizes.end()}, 0);
    for (std::size_t i = 4; i < kSizes.size(); ++i)
      for (std::int64_t j = 0; j < kSizes[i]; ++j) b.w.set(i - 4, j, t.w.get(i, j));
    const OptimizerOptions o = with_backend(backend);
    optim::Adam first, second;
    first.lr = 1e-2;
    second.lr = 3e-2, second.amsgrad = true, second.weight_decay = 0.05;
    Optimizer opt(first, t.params(0, 4), o), oa(first, a.params(), o), ob(second, b.params(), o);
    const auto copy_grads = [&] {
      for (std::size_t i = 0; i < 4; ++i) std::memcpy(a.g[i].data, t.g[i].data, static_cast<std::size_t>(kSizes[i]) * 4);
      for (std::size_t i = 4; i < 6; ++i)
        std::memcpy(b.g[i - 4].data, t.g[i].data, static_cast<std::size_t>(kSizes[i]) * 4);
    };
    for (int s = 0; s < 2; ++s) {
      t.grads(s);
      copy_grads();
      opt.step();
      oa.step();
    }
    opt.add_param_group({t.params(4, 6), second});
    ASSERT_EQ(opt.num_groups(), 2u);
    EXPECT_EQ(opt.num_params(), 6u);
    EXPECT_EQ(opt.group_step_count(1), 0);
    EXPECT_EQ(opt.step_count(), 2);
    for (int s = 2; s < 5; ++s) {
      t.grads(s);
      copy_grads();
      opt.step();
      oa.step();
      ob.step();
    }
    EXPECT_EQ(opt.group_step_count(0), 5);
    EXPECT_EQ(opt.group_step_count(1), 3);
    expect_same(t, opt, 0, 4, a, oa, 0, "the first group");
    expect_same(t, opt, 4, 6, b, ob, 0, "the added group");
    // An added group must not repeat a tensor; on the Error nothing changes.
    const std::string m = ref::error_message([&] { opt.add_param_group({t.params(1, 2), first}); });
    EXPECT_NE(m.find("groups[2].params[0].weight"), std::string::npos) << m;
    EXPECT_NE(m.find("groups[0].params[1].weight"), std::string::npos) << m;
    EXPECT_EQ(opt.num_groups(), 2u);
    EXPECT_NE(ref::error_message([&] { opt.add_param_group({t.params(0, 0), first}); }).find("empty"), std::string::npos);
    EXPECT_NE(ref::error_message([&] { opt.add_param_group({{}, optim::SGD{}}); }).find("empty"), std::string::npos);
  }
}

TEST(ParamGroups, BadGroupsNameTheGroupTheFieldAndTheValue) {
  Tensors t(DType::f32, DType::f32, kSizes, 1);
  EXPECT_NE(ref::error_message([&] { Optimizer o(std::vector<ParamGroup>{}); }).find("no param groups"),
            std::string::npos);
  std::string m = ref::error_message([&] { Optimizer o({{t.params(0, 2), adamw(1e-3, 0)}, {{}, adamw(1e-3, 0)}}); });
  EXPECT_NE(m.find("groups[1]"), std::string::npos) << m;
  EXPECT_NE(m.find("empty"), std::string::npos) << m;
  m = ref::error_message([&] { Optimizer o({{t.params(0, 2), adamw(1e-3, 0)}, {t.params(2, 3), optim::SGD{}}}); });
  EXPECT_NE(m.find("groups[1].config is sgd"), std::string::npos) << m;
  m = ref::error_message([&] { Optimizer o({{t.params(0, 2), adamw(1e-3, 0)}, {t.params(2, 3), adamw(-1, 0)}}); });
  EXPECT_NE(m.find("groups[1]"), std::string::npos) << m;
  EXPECT_NE(m.find("lr = -1"), std::string::npos) << m;
  // The same tensor in two groups, or twice in one: both places named.
  m = ref::error_message([&] { Optimizer o({{t.params(0, 3), adamw(1e-3, 0)}, {t.params(2, 4), adamw(1e-3, 0)}}); });
  EXPECT_NE(m.find("groups[1].params[0].weight"), std::string::npos) << m;
  EXPECT_NE(m.find("groups[0].params[2].weight"), std::string::npos) << m;
  std::vector<Param> twice = t.params(0, 2);
  twice.push_back(twice[0]);
  m = ref::error_message([&] { Optimizer o(adamw(1e-3, 0), twice); });
  EXPECT_NE(m.find("params[0].weight"), std::string::npos) << m;
  EXPECT_NE(m.find("params[2].weight"), std::string::npos) << m;
  // Two params sharing one gradient buffer, and overlapping weights.
  std::vector<Param> shared = t.params(0, 2);
  shared[1].grad = TensorView{shared[0].grad.data, 37, DType::f32};
  m = ref::error_message([&] { Optimizer o(adamw(1e-3, 0), shared); });
  EXPECT_NE(m.find("params[1].grad"), std::string::npos) << m;
  EXPECT_NE(m.find("params[0].grad"), std::string::npos) << m;
  std::vector<Param> overlap = t.params(0, 1);
  float* w0 = static_cast<float*>(overlap[0].weight.data);
  std::vector<float> g1(10);
  overlap.push_back({TensorView{w0 + 990, 10, DType::f32}, TensorView{g1.data(), 10, DType::f32}});
  m = ref::error_message([&] { Optimizer o(adamw(1e-3, 0), overlap); });
  EXPECT_NE(m.find("overlaps"), std::string::npos) << m;
  // An absurd numel is an Error, not an allocation that takes the machine down.
  std::vector<Param> huge = t.params(0, 1);
  huge[0].weight.numel = huge[0].grad.numel = std::int64_t{1} << 50;
  EXPECT_NE(ref::error_message([&] { Optimizer o(adamw(1e-3, 0), huge); }).find("numel"), std::string::npos);
}

// GradScaler and LossScaleOptimizer over groups: one skip decision, and the Keras
// hyperparameters address group 0 unless a group is given.
TEST(ParamGroups, ScalersWorkOverGroups) {
  Tensors t(DType::f16, DType::f32, kSizes, 8);
  Optimizer opt({{t.params(0, 3), adamw(1e-3, 0.1)}, {t.params(3, 6), adamw(2e-3, 0.0)}});
  GradScaler scaler("cpu");
  const auto before = t.w.snapshot();
  t.grads(1, scaler.get_scale());
  t.g.set(4, 0, INFINITY);
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(t.w.snapshot(), before);
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_LT(scaler.get_scale(), 65536.0);
  t.grads(2, scaler.get_scale());
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(opt.step_count(), 1);
  EXPECT_NE(t.w.snapshot(), before);

  Tensors u(DType::f32, DType::f32, kSizes, 8);
  Optimizer inner({{u.params(0, 3), adamw(1e-3, 0.1)}, {u.params(3, 6), adamw(2e-3, 0.0)}});
  LossScaleOptimizer lso(inner);
  EXPECT_EQ(lso.get_hyper("learning_rate"), 1e-3);
  EXPECT_EQ(lso.get_hyper("learning_rate", 1), 2e-3);
  lso.set_hyper("beta_1", 0.8, 1);
  EXPECT_EQ(std::get<optim::AdamW>(lso.inner_optimizer().config(1)).beta1, 0.8);
  EXPECT_EQ(std::get<optim::AdamW>(lso.inner_optimizer().config(0)).beta1, 0.9);
  EXPECT_NE(ref::error_message([&] { (void)lso.get_hyper("learning_rate", 2); }).find("out of range"),
            std::string::npos);
}


// set_grads: an optimizer pointed at new gradient buffers each step (as PyTorch
// allocates them after zero_grad(set_to_none=True)) steps bitwise as one that
// reads the same values from its original buffers, on every CPU path.
TEST(SetGrads, NewBuffersEachStepMatchTheOriginalBuffers) {
  struct Path {
    const char* name;
    OptimizerOptions options;
  };
  OptimizerOptions unfused;
  unfused.fusion = Fusion::unfused;
  for (const Path& path : {Path{"highway", with_backend(CpuBackend::highway, 2)},
                           Path{"llvm", with_backend(CpuBackend::llvm, 2)}, Path{"unfused", unfused}}) {
    if (path.options.cpu_backend == CpuBackend::llvm && !jit::llvm_built()) continue;
    Tensors a(DType::f32, DType::bf16, kSizes, 4), b(DType::f32, DType::bf16, kSizes, 4);
    OptimizerOptions o = path.options;
    o.max_grad_norm = 0.5;
    Optimizer x({{a.params(0, 3), adamw(1e-3, 0.1)}, {a.params(3, 6), adamw(2e-3, 0.0, true)}}, o);
    Optimizer y({{b.params(0, 3), adamw(1e-3, 0.1)}, {b.params(3, 6), adamw(2e-3, 0.0, true)}}, o);
    for (int s = 0; s < 4; ++s) {
      HostTensors fresh(DType::bf16, kSizes, false);  // new buffers, filled as b's grads
      b.grads(100 + s, 128.0);
      std::vector<TensorView> views;
      for (std::size_t i = 0; i < kSizes.size(); ++i) {
        std::memcpy(fresh[i].data, b.g[i].data, static_cast<std::size_t>(kSizes[i]) * 2);
        views.push_back(fresh[i]);
      }
      // a's own buffers hold other values: a step reading them would differ.
      a.grads(999, 128.0);
      x.set_grads(views);
      EXPECT_EQ(x.params()[2].grad.data, fresh[2].data) << path.name;
      x.step_scaled(128.0);
      y.step_scaled(128.0);
      EXPECT_EQ(x.last_grad_norm(), y.last_grad_norm()) << path.name << " step " << s;
    }
    expect_same(a, x, 0, kSizes.size(), b, y, 0, std::string("set_grads, ") + path.name);
  }
}

TEST(SetGrads, RefusesWhatConstructionRefusesAndChangesNothing) {
  Tensors t(DType::f32, DType::f32, kSizes, 5);
  Optimizer opt(adamw(1e-3, 0.1), t.params());
  HostTensors fresh(DType::f32, kSizes, false);
  std::vector<TensorView> views;
  for (std::size_t i = 0; i < kSizes.size(); ++i) views.push_back(fresh[i]);
  const auto expect_refused = [&](std::vector<TensorView> v, const std::string& needle) {
    try {
      opt.set_grads(v);
      ADD_FAILURE() << "accepted; expected an Error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    for (std::size_t i = 0; i < kSizes.size(); ++i) EXPECT_EQ(opt.params()[i].grad.data, t.g[i].data) << needle;
  };
  expect_refused({views.begin(), views.end() - 1}, "5 gradients for 6 params");
  auto wrong = views;
  wrong[1].numel += 1;
  expect_refused(wrong, "grads[1].numel = 38 but params[1] has 37 elements");
  wrong = views;
  wrong[2].dtype = DType::bf16;
  expect_refused(wrong, "grads[2].dtype = bf16 but the optimizer was built with f32");
  wrong = views;
  wrong[3].data = nullptr;
  expect_refused(wrong, "params[3].grad.data is null");
  wrong = views;
  wrong[4] = {t.w[4].data, t.w[4].numel, DType::f32};  // the weight itself
  expect_refused(wrong, "share memory");
  wrong = views;
  wrong[5] = views[0];
  wrong[5].numel = kSizes[5];
  expect_refused(wrong, "is the same tensor as");
  opt.set_grads(views);  // and a valid call is taken
  EXPECT_EQ(opt.params()[0].grad.data, fresh[0].data);
}

// set_group_step_count: a group's bias corrections continue from the count set, as
// when a framework's checkpoint (torch's state[p]["step"]) is restored.
TEST(SetGroupStepCount, BiasCorrectionsContinueFromTheCountSet) {
  Tensors a(DType::f32, DType::f32, kSizes, 6), b(DType::f32, DType::f32, kSizes, 6);
  OptimizerOptions o = with_backend(CpuBackend::highway);
  Optimizer x({{a.params(0, 3), adamw(1e-3, 0.1)}, {a.params(3, 6), adamw(2e-3, 0.0)}}, o);
  Optimizer y({{b.params(0, 3), adamw(1e-3, 0.1)}, {b.params(3, 6), adamw(2e-3, 0.0)}}, o);
  for (int s = 0; s < 3; ++s) {
    a.grads(s), b.grads(s);
    x.step(), y.step();
  }
  // A fresh optimizer over b's tensors with y's state and step counts restored by hand.
  Optimizer z({{b.params(0, 3), adamw(1e-3, 0.1)}, {b.params(3, 6), adamw(2e-3, 0.0)}}, o);
  for (std::size_t i = 0; i < kSizes.size(); ++i)
    for (std::string_view name : y.state_names()) {
      const auto src = y.state(i, name);
      std::copy(src.begin(), src.end(), z.mutable_state(i, name).begin());
    }
  z.set_group_step_count(0, 3);
  z.set_group_step_count(1, 3);
  EXPECT_EQ(z.group_step_count(0), 3);
  EXPECT_EQ(z.group_step_count(1), 3);
  EXPECT_EQ(z.step_count(), 0);  // the optimizer's own count is not a group's
  for (int s = 3; s < 6; ++s) {
    a.grads(s), b.grads(s);
    x.step(), z.step();
  }
  expect_same(a, x, 0, kSizes.size(), b, z, 0, "restored step counts");
  EXPECT_THROW(z.set_group_step_count(2, 1), Error);
  try {
    z.set_group_step_count(0, -1);
    ADD_FAILURE() << "a negative count was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(z.group_step_count(0), 6);
  }
}

}  // namespace
}  // namespace stepfuse
