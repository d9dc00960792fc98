// GradScaler: one test per documented behaviour of PyTorch's torch.amp.GradScaler (the API
// stepfuse::GradScaler implements), of docs/architecture.md §4 and of include/stepfuse/grad_scaler.hpp
// (the header's comments fix what PyTorch's documentation leaves open: PyTorch's fp32 scale
// arithmetic, the int32 growth tracker, update(new_scale) keeping the tracker, ...).
// Each test quotes the sentence it pins.
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reference/dtypes.hpp"
#include "reference/harness.hpp"
#include "reference/test_data.hpp"
#include "reference/test_util.hpp"
#include "jit/base/warning.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref {
namespace {

using ::testing::HasSubstr;

// The model of these tests (reference/test_util.hpp): gradients N(0, 0.25), not clamped.
using Net = TestNet;

// Everything a step may write: weights, every state tensor, masters, the step count.
struct Snapshot {
  std::vector<std::string> labels;
  std::vector<std::vector<unsigned char>> blocks;
};
Snapshot capture(const Net& n) {
  Snapshot s;
  const auto w = n.w.snapshot();
  for (std::size_t i = 0; i < w.size(); ++i) {
    s.labels.push_back("weight[" + std::to_string(i) + "]");
    s.blocks.push_back(w[i]);
  }
  for (std::string_view name : n.opt.state_names())
    for (std::size_t i = 0; i < n.opt.num_params(); ++i) {
      s.labels.push_back(std::string(name) + "[" + std::to_string(i) + "]");
      s.blocks.push_back(bytes_of(n.opt.state(i, name)));
    }
  for (std::size_t i = 0; i < n.opt.num_params(); ++i) {
    s.labels.push_back("master[" + std::to_string(i) + "]");
    s.blocks.push_back(bytes_of(n.opt.master(i)));
  }
  const std::int64_t steps = n.opt.step_count();
  s.labels.push_back("step_count");
  s.blocks.emplace_back(reinterpret_cast<const unsigned char*>(&steps),
                        reinterpret_cast<const unsigned char*>(&steps) + sizeof steps);
  return s;
}
void expect_same(const Snapshot& a, const Snapshot& b) {
  ASSERT_EQ(a.blocks.size(), b.blocks.size());
  for (std::size_t k = 0; k < a.blocks.size(); ++k)
    EXPECT_TRUE(a.blocks[k] == b.blocks[k]) << a.labels[k] << " changed";
}

optim::Adam adam() {
  optim::Adam c;
  c.lr = 1e-2;
  c.weight_decay = 0.01;
  c.amsgrad = true;  // three state tensors
  return c;
}
optim::SGD sgd(double lr) {
  optim::SGD c;
  c.lr = lr;
  return c;
}

const std::vector<std::int64_t> kSizes = {37, 1000, 4099};

// One clean iteration: grads g * S (g alone when S * g would not be exact), step, update.
// Returns whether the step applied.
bool clean_iteration(GradScaler& s, Net& n, std::uint64_t seed) {
  const double S = s.get_scale();
  int e = 0;
  const bool exact = std::frexp(S, &e) == 0.5 && S <= 4096.0;
  n.set_grads(seed, exact ? S : 1.0);
  const bool applied = s.step(n.opt);
  s.update();
  return applied;
}
// One iteration whose gradients hold an inf.
bool inf_iteration(GradScaler& s, Net& n, std::uint64_t seed) {
  n.set_grads(seed, 1.0);
  n.g.set(0, 0, kInf);
  const bool applied = s.step(n.opt);
  s.update();
  return applied;
}

// ---------------------------------------------------------------------------
// Device (first in the file: the "cuda" warning is once per process, and the "cpu"
// test must run before any "cuda" scaler when the whole suite runs in one process)

int g_warnings = 0;
std::string g_last_warning;
void counting_handler(std::string_view message) {
  ++g_warnings;
  g_last_warning = std::string(message);
}

// "device (str, optional, default="cuda") – Device type to use. Possible values are:
//  ‘cuda’ and ‘cpu’." — "cpu" is accepted and is never a reason to warn.
TEST(GradScalerDoc, DeviceCpuAcceptedWithoutWarning) {
  g_warnings = 0;
  const WarningHandler previous = set_warning_handler(&counting_handler);
  {
    GradScaler a("cpu");
    GradScaler b("cpu", 8.0);
    EXPECT_EQ(a.device(), "cpu");
    EXPECT_TRUE(a.where_scale_lives() == Device::cpu());
  }
  set_warning_handler(previous);
  EXPECT_EQ(g_warnings, 0) << g_last_warning;
}

// Header: ""cuda" where no GPU is usable keeps the scale on the CPU and warns once per
// process (see set_warning_handler), so the default works everywhere." error.hpp: "Each goes to the
// handler, once per process per cause." This build has no CUDA backend, so "cuda"
// always falls back: exactly one warning for three scalers.
TEST(GradScalerDoc, DeviceCudaAcceptedWarnsOnce) {
  g_warnings = 0;
  g_last_warning.clear();
  detail::reset_warnings_for_testing();  // another test may have used "cuda" in this process
  const WarningHandler previous = set_warning_handler(&counting_handler);
  {
    GradScaler a("cuda");
    GradScaler b("cuda", 1024.0);
    GradScaler c;  // the default device is "cuda"
    EXPECT_EQ(a.device(), "cuda");
    // The default works everywhere: it steps a CPU optimizer.
    Net n(sgd(1.0), DType::f32, DType::f32, {16});
    const auto g = n.set_grads(3, b.get_scale());
    const double w0 = n.w.get(0, 0);
    EXPECT_TRUE(b.step(n.opt));
    b.update();
    EXPECT_EQ(n.w.get(0, 0), f32(w0 - g[0][0]));
  }
  set_warning_handler(previous);
  EXPECT_EQ(g_warnings, 1) << g_last_warning;
  EXPECT_THAT(lower(g_last_warning), HasSubstr("cuda"));
  EXPECT_THAT(lower(g_last_warning), HasSubstr("cpu"));
}

// Header: "Any other string is an Error." (a torch.device type: "cuda" or "cpu").
TEST(GradScalerDoc, DeviceOtherStringsRejected) {
  for (const char* d : {"tpu", "", "CUDA:0", "cuda:0", "CPU", "gpu"}) {
    SCOPED_TRACE(d);
    error_message([&] { GradScaler s(d); }, ErrorCode::invalid_argument);
  }
}

// ---------------------------------------------------------------------------
// Constructor

// "class torch.amp.GradScaler(device: str = 'cuda', init_scale: float = 65536.0,
//  growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
//  enabled: bool = True)"
// What an enabled scaler's constructor stored, as the getters return it.
void expect_constructed(const GradScaler& s, double scale, double growth_factor, double backoff_factor,
                        std::int64_t growth_interval, const std::string& device) {
  EXPECT_EQ(s.get_scale(), scale);
  EXPECT_EQ(s.get_growth_factor(), growth_factor);
  EXPECT_EQ(s.get_backoff_factor(), backoff_factor);
  EXPECT_EQ(s.get_growth_interval(), growth_interval);
  EXPECT_TRUE(s.is_enabled());
  EXPECT_EQ(s.device(), device);
}

TEST(GradScalerDoc, ConstructorDefaults) {
  GradScaler s;
  expect_constructed(s, 65536.0, 2.0, 0.5, 2000, "cuda");
  EXPECT_EQ(s.growth_tracker(), 0);
}

// "init_scale (float, optional, default=2.**16) – Initial scale factor." and the other
// parameters are stored as given.
TEST(GradScalerDoc, ConstructorStoresArguments) {
  GradScaler s("cpu", 1024.0, 3.0, 0.25, 7, true);
  expect_constructed(s, 1024.0, 3.0, 0.25, 7, "cpu");
  // The scale is an fp32 value.
  GradScaler t("cpu", 0.1);
  EXPECT_EQ(t.get_scale(), f32(0.1));
}

// Header: "Throws Error(invalid_argument) for init_scale not finite and > 0, growth_factor
// not finite and > 1, backoff_factor not in (0, 1), growth_interval < 1."
TEST(GradScalerDoc, ConstructorRejectsInvalidValues) {
  for (double v : {0.0, -1.0, kInf, -kInf, kNaN}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { GradScaler s("cpu", v); }, ErrorCode::invalid_argument), HasSubstr("init_scale"));
  }
  for (double v : {1.0, 0.5, 0.0, -2.0, kInf, kNaN}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { GradScaler s("cpu", 65536.0, v); }, ErrorCode::invalid_argument),
                HasSubstr("growth_factor"));
  }
  for (double v : {0.0, -0.5, 1.0, 1.5, kInf, kNaN}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { GradScaler s("cpu", 65536.0, 2.0, v); }, ErrorCode::invalid_argument),
                HasSubstr("backoff_factor"));
  }
  for (std::int64_t v : {std::int64_t{0}, std::int64_t{-1}, std::numeric_limits<std::int64_t>::min()}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { GradScaler s("cpu", 65536.0, 2.0, 0.5, v); }, ErrorCode::invalid_argument),
                HasSubstr("growth_interval"));
  }
}

// ---------------------------------------------------------------------------
// scale()

// "scaler.scale(loss) multiplies a given loss by scaler’s current scale factor."
// "scale(outputs) ... Multiplies (‘scales’) a tensor or list of tensors by the scale factor."
TEST(GradScalerDoc, ScaleMultipliesLossByScale) {
  GradScaler s("cpu");
  EXPECT_EQ(s.scale(1.5), 1.5 * 65536.0);
  EXPECT_EQ(s.scale(-3.0), -3.0 * 65536.0);
  EXPECT_EQ(s.scale(0.1), 0.1 * 65536.0);  // loss * S in double (header: "loss * S")
  EXPECT_EQ(s.scale(0.0), 0.0);
  GradScaler t("cpu", 3.0);
  EXPECT_EQ(t.scale(0.7), 0.7 * 3.0);
  // "current" scale: follows update().
  Net n(sgd(0.1), DType::f32, DType::f32, {8});
  inf_iteration(s, n, 1);
  EXPECT_EQ(s.get_scale(), 32768.0);
  EXPECT_EQ(s.scale(1.5), 1.5 * 32768.0);
}

// "Multiplies (‘scales’) a tensor ... by the scale factor." Header: "Multiplies a tensor
// ... in place by S, rounding to its storage dtype."
TEST(GradScalerDoc, ScaleInPlaceEachDtype) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    GradScaler s("cpu", 1024.0);
    HostTensors t(dt, {67}, false);
    Random rng(7);
    std::vector<double> before;
    for (std::int64_t j = 0; j < 67; ++j) {
      t.set(0, j, rng.normal() * (j == 5 ? 100.0 : 1.0));
      before.push_back(t.get(0, j));
    }
    t.set(0, 66, 70.0);  // 70 * 1024 = 71680 overflows f16 (max 65504) to inf
    before[66] = t.get(0, 66);
    s.scale_(t[0]);
    for (std::int64_t j = 0; j < 67; ++j) {
      const double expected = round_to_dtype(before[static_cast<std::size_t>(j)] * 1024.0, dt);
      EXPECT_EQ(t.get(0, j), expected) << "element " << j;
    }
    if (dt == DType::f16) {
      EXPECT_TRUE(std::isinf(t.get(0, 66)));
    }
  }
  // A scale that is not a power of two: the product rounds to the storage dtype.
  GradScaler s3("cpu", 3.0);
  HostTensors h(DType::bf16, {4}, false);
  const double vals[] = {1.0 / 3.0, 0.1, -7.25, 1e-3};
  for (int j = 0; j < 4; ++j) h.set(0, j, vals[j]);
  std::vector<double> hb = h.values(0);
  s3.scale_(h[0]);
  for (int j = 0; j < 4; ++j) {
    const double p = static_cast<double>(static_cast<float>(hb[static_cast<std::size_t>(j)]) * 3.0f);
    EXPECT_EQ(h.get(0, j), round_to_dtype(p, DType::bf16)) << "element " << j;
  }
}

// "scale(outputs: list[TensorBase]) → list[TensorBase]" — every tensor of the list, each in its dtype.
TEST(GradScalerDoc, ScaleInPlaceList) {
  GradScaler s("cpu", 256.0);
  HostTensors a(DType::f32, {5, 0, 9}, false);
  HostTensors b(DType::f16, {11}, false);
  HostTensors c(DType::bf16, {3}, false);
  Random rng(2);
  for (const HostTensors* t : {&a, &b, &c})
    for (std::size_t i = 0; i < t->size(); ++i)
      for (std::int64_t j = 0; j < (*t)[i].numel; ++j) t->set(i, j, rng.normal());
  const auto va = a.all_values(), vb = b.all_values(), vc = c.all_values();
  std::vector<TensorView> list = {a[0], a[1], b[0], a[2], c[0]};
  s.scale_(std::span<const TensorView>(list));
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::int64_t j = 0; j < a[i].numel; ++j) EXPECT_EQ(a.get(i, j), va[i][static_cast<std::size_t>(j)] * 256.0);
  for (std::int64_t j = 0; j < b[0].numel; ++j) EXPECT_EQ(b.get(0, j), vb[0][static_cast<std::size_t>(j)] * 256.0);
  for (std::int64_t j = 0; j < c[0].numel; ++j) EXPECT_EQ(c.get(0, j), vc[0][static_cast<std::size_t>(j)] * 256.0);
  // An empty list is fine.
  s.scale_(std::span<const TensorView>());
}

// ---------------------------------------------------------------------------
// step(): skip on inf/NaN

struct DtypeCombo {
  DType weight, grad;
};
const DtypeCombo kCombos[] = {{DType::f32, DType::f32},
                              {DType::f32, DType::f16},
                              {DType::f32, DType::bf16},
                              {DType::f16, DType::bf16},  // f16 weights with fp32 masters
                              {DType::bf16, DType::f16}};

// "If infs/NaNs are found, scaler.step(optimizer) skips the underlying optimizer.step()
//  (so the params themselves remain uncorrupted)". Header: "On inf/NaN nothing is written
//  (weights, state, masters, step count) and it returns false."
TEST(GradScalerDoc, StepSkipsOnNonFiniteAnywhere) {
  struct Where {
    const char* name;
    std::size_t tensor;
    std::int64_t element;
  };
  const Where wheres[] = {{"first element", 0, 0}, {"middle tensor", 1, 517}, {"last element", 2, 4098}};
  const double kinds[] = {kInf, -kInf, kNaN};
  for (const DtypeCombo& dc : kCombos)
    for (const Where& where : wheres)
      for (double bad : kinds) {
        SCOPED_TRACE(std::string("weights ") + std::string(dtype_name(dc.weight)) + ", grads " +
                     std::string(dtype_name(dc.grad)) + ", " + where.name + ", value " + std::to_string(bad));
        GradScaler s("cpu", 1024.0, 2.0, 0.5, 2000);
        Net n(adam(), dc.weight, dc.grad, kSizes, 5);
        // One applied iteration first, so the state is not all zeros.
        ASSERT_TRUE(clean_iteration(s, n, 11));
        ASSERT_EQ(n.opt.step_count(), 1);
        n.set_grads(12, s.get_scale());
        n.g.set(where.tensor, where.element, bad);
        const Snapshot before = capture(n);
        EXPECT_FALSE(s.step(n.opt));
        EXPECT_FALSE(s.last_step_result().applied);
        EXPECT_TRUE(s.last_step_result().found_inf);
        expect_same(before, capture(n));
        EXPECT_EQ(n.opt.step_count(), 1);
        s.update();
        EXPECT_EQ(s.get_scale(), 512.0);
      }
}

// "If no infs/NaNs are found, scaler.step(optimizer) runs the underlying optimizer.step()
//  as usual." — "invokes optimizer.step() using the unscaled gradients": the result is
// that of a plain step on the unscaled gradients.
TEST(GradScalerDoc, StepAppliesAndMatchesPlainStepOnUnscaledGrads) {
  for (const DtypeCombo& dc : kCombos) {
    SCOPED_TRACE(std::string("weights ") + std::string(dtype_name(dc.weight)) + ", grads " +
                 std::string(dtype_name(dc.grad)));
    GradScaler s("cpu", 1024.0, 2.0, 0.5, 2);  // grows every 2 iterations: the scale changes
    Net scaled(adam(), dc.weight, dc.grad, kSizes, 9);
    Net plain(adam(), dc.weight, dc.grad, kSizes, 9);
    for (int it = 0; it < 5; ++it) {
      SCOPED_TRACE(it);
      const double S = s.get_scale();
      scaled.set_grads(100 + it, S);
      plain.set_grads(100 + it, 1.0);
      EXPECT_TRUE(s.step(scaled.opt));
      EXPECT_TRUE(s.last_step_result().applied);
      EXPECT_FALSE(s.last_step_result().found_inf);
      plain.opt.step();
      s.update();
      expect_nets_close(scaled, plain);
    }
    EXPECT_EQ(scaled.opt.step_count(), 5);
    EXPECT_EQ(s.get_scale(), 4096.0);  // grew after iterations 2 and 4
  }
}

// A non-power-of-two scale: still the plain step on g / S (within fp32 rounding; no
// weight decay, whose cancellation g + wd * p ~ 0 would amplify the rounding of g / S).
TEST(GradScalerDoc, StepWithNonPowerOfTwoScaleMatchesPlainStep) {
  GradScaler s("cpu", 3000.0);
  optim::Adam cfg;
  cfg.lr = 1e-2;
  Net scaled(cfg, DType::f32, DType::f32, kSizes, 4);
  Net plain(cfg, DType::f32, DType::f32, kSizes, 4);
  Random rng(8);
  std::vector<std::vector<double>> gs, gp;
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    gs.emplace_back();
    gp.emplace_back();
    for (std::int64_t j = 0; j < kSizes[i]; ++j) {
      const double g = f32(rng.normal());
      gs.back().push_back(f32(g * 3000.0));
      gp.back().push_back(f32(gs.back().back() / 3000.0));
    }
  }
  scaled.put_grads(gs);
  plain.put_grads(gp);
  EXPECT_TRUE(s.step(scaled.opt));
  plain.opt.step();
  expect_nets_close(scaled, plain, 1e-8);  // 1e-6 of the step size lr
}

// Header: "the gradients are unscaled in fp32 inside the kernels and never written."
TEST(GradScalerDoc, StepDoesNotWriteGradients) {
  GradScaler s("cpu", 1024.0);
  Net n(adam(), DType::f16, DType::f16, kSizes, 3);
  n.set_grads(4, 1024.0);
  const auto g_before = n.g.snapshot();
  EXPECT_TRUE(s.step(n.opt));
  EXPECT_TRUE(g_before == n.g.snapshot());
  s.update();
  n.g.set(1, 3, kNaN);
  const auto g_inf = n.g.snapshot();
  EXPECT_FALSE(s.step(n.opt));
  EXPECT_TRUE(g_inf == n.g.snapshot());
}

// "step() ... Returns the return value of optimizer.step()" — here: whether it applied,
// the same value as last_step_result().applied.
TEST(GradScalerDoc, StepReturnValueAndLastStepResult) {
  GradScaler s("cpu", 64.0);
  Net n(sgd(0.5), DType::f32, DType::f32, {4, 4});
  n.set_grads(1, 64.0);
  const bool r1 = s.step(n.opt);
  EXPECT_TRUE(r1);
  EXPECT_EQ(r1, s.last_step_result().applied);
  s.update();
  n.g.set(1, 2, -kInf);
  const bool r2 = s.step(n.opt);
  EXPECT_FALSE(r2);
  EXPECT_EQ(r2, s.last_step_result().applied);
  EXPECT_TRUE(s.last_step_result().found_inf);
}

// "Warning: Calling unscale_() twice ... between each step() triggers a RuntimeError." and
// header: "A second step() for the same optimizer before update() is Error(invalid_state)."
TEST(GradScalerDoc, StepTwiceBeforeUpdateThrowsInvalidState) {
  GradScaler s("cpu", 1024.0);
  Net n(adam(), DType::f32, DType::f32, kSizes);
  n.set_grads(1, 1024.0);
  EXPECT_TRUE(s.step(n.opt));
  const Snapshot after_first = capture(n);
  error_message([&] { s.step(n.opt); }, ErrorCode::invalid_state);
  expect_same(after_first, capture(n));  // thrown before anything is written
  s.update();
  n.set_grads(2, s.get_scale());
  EXPECT_TRUE(s.step(n.opt));  // a new iteration after update()
  EXPECT_EQ(n.opt.step_count(), 2);
}

// ---------------------------------------------------------------------------
// unscale_()

// "unscale_(optimizer) ... Divides (“unscales”) the optimizer’s gradient tensors by the
//  scale factor." — in place; exact for a power-of-two scale, in every grad dtype.
TEST(GradScalerDoc, UnscaleDividesGradsInPlace) {
  for (DType gd : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(gd));
    GradScaler s("cpu", 1024.0);
    Net n(sgd(0.1), DType::f32, gd, kSizes, 2);
    const auto g = n.set_grads(3, 1024.0);
    s.unscale_(n.opt);
    int bad = 0;
    for (std::size_t i = 0; i < g.size(); ++i)
      for (std::int64_t j = 0; j < kSizes[i]; ++j)
        if (n.g.get(i, j) != g[i][static_cast<std::size_t>(j)] && ++bad <= 5)
          ADD_FAILURE() << "grad[" << i << "][" << j << "] = " << n.g.get(i, j) << ", expected " << g[i][static_cast<std::size_t>(j)];
  }
}

// Header: "multiplies by the fp32 reciprocal, as PyTorch does" (docs/architecture.md §5:
// the reciprocal computed in double and rounded to fp32), then rounds to
// the grad dtype.
TEST(GradScalerDoc, UnscaleMultipliesByFp32Reciprocal) {
  for (DType gd : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(gd));
    GradScaler s("cpu", 3.0);
    Net n(sgd(0.1), DType::f32, gd, {333});
    Random rng(6);
    std::vector<double> before;
    for (std::int64_t j = 0; j < 333; ++j) {
      n.g.set(0, j, rng.normal() * 3.0);
      before.push_back(n.g.get(0, j));
    }
    s.unscale_(n.opt);
    const float inv = static_cast<float>(1.0 / 3.0);
    int bad = 0;
    for (std::int64_t j = 0; j < 333; ++j) {
      const float p = static_cast<float>(before[static_cast<std::size_t>(j)]) * inv;
      const double expected = round_to_dtype(p, gd);
      if (n.g.get(0, j) != expected && ++bad <= 5)
        ADD_FAILURE() << "grad[" << j << "] = " << n.g.get(0, j) << ", expected " << expected;
    }
  }
}

// "As part of the unscale_(), gradients are checked for infs/NaNs." and "step() ...
//  (unless unscale_() was explicitly called ...)": after an unscale_ that found inf,
// step() skips; update() then backs off.
TEST(GradScalerDoc, StepAfterUnscaleThatFoundInfSkips) {
  for (double bad : {kInf, -kInf, kNaN}) {
    SCOPED_TRACE(bad);
    GradScaler s("cpu", 1024.0);
    Net n(adam(), DType::f16, DType::bf16, kSizes);
    ASSERT_TRUE(clean_iteration(s, n, 1));
    n.set_grads(2, s.get_scale());
    n.g.set(2, 100, bad);
    s.unscale_(n.opt);
    // The check is recorded by unscale_: a gradient made finite afterwards does not undo it.
    n.g.set(2, 100, 0.0);
    const Snapshot before = capture(n);
    EXPECT_FALSE(s.step(n.opt));
    EXPECT_FALSE(s.last_step_result().applied);
    expect_same(before, capture(n));
    s.update();
    EXPECT_EQ(s.get_scale(), 512.0);
    EXPECT_EQ(s.growth_tracker(), 0);
  }
}

// "Internally invokes unscale_(optimizer) (unless unscale_() was explicitly called for
//  optimizer earlier in the iteration)." — step() after unscale_ does not unscale again,
// and sees the gradients as modified between unscale_ and step() (the clipping example).
TEST(GradScalerDoc, StepAfterUnscaleDoesNotUnscaleAgain) {
  GradScaler s("cpu", 1024.0);
  Net n(sgd(1.0), DType::f32, DType::f32, {5, 300});
  Net ref(sgd(1.0), DType::f32, DType::f32, {5, 300});
  const auto g = n.set_grads(4, 1024.0);
  s.unscale_(n.opt);
  n.g.set(0, 0, 0.75);  // "modify or inspect gradients between the backward pass(es) and step()"
  EXPECT_TRUE(s.step(n.opt));
  s.update();
  for (std::size_t i = 0; i < g.size(); ++i)
    for (std::int64_t j = 0; j < n.w[i].numel; ++j) {
      const double gij = (i == 0 && j == 0) ? 0.75 : g[i][static_cast<std::size_t>(j)];
      ASSERT_EQ(n.w.get(i, j), f32(ref.w.get(i, j) - gij)) << "weight[" << i << "][" << j << "]";
    }
  EXPECT_EQ(s.get_scale(), 1024.0);  // an unskipped iteration, no growth yet
  EXPECT_EQ(s.growth_tracker(), 1);
}

// "unscale_() should only be called once per optimizer per step() call ... Calling
//  unscale_() twice for a given optimizer between each step() triggers a RuntimeError."
// Header: "A second call for the same optimizer before update() ... is Error(invalid_state)."
TEST(GradScalerDoc, UnscaleTwiceBeforeUpdateThrowsInvalidState) {
  GradScaler s("cpu", 1024.0);
  Net n(sgd(0.1), DType::f32, DType::f32, {64});
  const auto g = n.set_grads(1, 1024.0);
  s.unscale_(n.opt);
  const auto after_first = n.g.snapshot();
  const std::string msg = error_message([&] { s.unscale_(n.opt); }, ErrorCode::invalid_state);
  EXPECT_THAT(msg, HasSubstr("unscale_"));
  EXPECT_TRUE(after_first == n.g.snapshot());  // not divided a second time
  EXPECT_EQ(n.g.get(0, 0), g[0][0]);
  // The step still works, and after update() unscale_ is allowed again.
  EXPECT_TRUE(s.step(n.opt));
  s.update();
  n.set_grads(2, s.get_scale());
  s.unscale_(n.opt);
  EXPECT_TRUE(s.step(n.opt));
  s.update();
}

// Header: "... or a call after step(), is Error(invalid_state)."
TEST(GradScalerDoc, UnscaleAfterStepThrowsInvalidState) {
  GradScaler s("cpu", 1024.0);
  Net n(sgd(0.1), DType::f32, DType::f32, {64});
  n.set_grads(1, 1024.0);
  EXPECT_TRUE(s.step(n.opt));
  const auto g = n.g.snapshot();
  error_message([&] { s.unscale_(n.opt); }, ErrorCode::invalid_state);
  EXPECT_TRUE(g == n.g.snapshot());
}

// Header: "Error(invalid_state) if no optimizer was stepped or unscaled since the last
// update()" — unscale_ alone counts: update() after it is allowed and uses its finding.
TEST(GradScalerDoc, UpdateAfterUnscaleOnly) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  Net n(sgd(0.1), DType::f32, DType::f32, {64});
  n.set_grads(1, 1024.0);
  s.unscale_(n.opt);
  s.update();
  EXPECT_EQ(s.get_scale(), 1024.0);
  EXPECT_EQ(s.growth_tracker(), 1);
  n.set_grads(1, 1.0);
  n.g.set(0, 5, kNaN);
  s.unscale_(n.opt);
  s.update();
  EXPECT_EQ(s.get_scale(), 512.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  EXPECT_EQ(n.opt.step_count(), 0);
}

// ---------------------------------------------------------------------------
// update()

// "If infs/NaNs are found, ... update() multiplies the scale by backoff_factor."
// "backoff_factor ... Factor by which the scale is multiplied during update() if inf/NaN
//  gradients occur in an iteration."
TEST(GradScalerDoc, UpdateBacksOffAfterSkip) {
  GradScaler s("cpu", 65536.0, 2.0, 0.25, 2000);
  Net n(sgd(0.1), DType::f32, DType::f32, {10});
  EXPECT_FALSE(inf_iteration(s, n, 1));
  EXPECT_EQ(s.get_scale(), 16384.0);
  EXPECT_FALSE(inf_iteration(s, n, 2));
  EXPECT_EQ(s.get_scale(), 4096.0);
  EXPECT_EQ(s.growth_tracker(), 0);
}

// "If growth_interval unskipped iterations occur consecutively, update() multiplies the
//  scale by growth_factor." — and not before.
TEST(GradScalerDoc, UpdateGrowsAfterGrowthIntervalConsecutiveUnskipped) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  Net n(sgd(0.01), DType::f32, DType::f32, {10});
  EXPECT_TRUE(clean_iteration(s, n, 1));
  EXPECT_EQ(s.get_scale(), 1024.0);
  EXPECT_EQ(s.growth_tracker(), 1);
  EXPECT_TRUE(clean_iteration(s, n, 2));
  EXPECT_EQ(s.get_scale(), 1024.0);
  EXPECT_EQ(s.growth_tracker(), 2);
  EXPECT_TRUE(clean_iteration(s, n, 3));
  EXPECT_EQ(s.get_scale(), 2048.0);
  EXPECT_EQ(s.growth_tracker(), 0);  // reset on growth
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(clean_iteration(s, n, 4 + k));
  EXPECT_EQ(s.get_scale(), 2048.0);
  EXPECT_TRUE(clean_iteration(s, n, 6));
  EXPECT_EQ(s.get_scale(), 4096.0);
  // growth_factor other than 2.
  GradScaler t("cpu", 10.0, 3.0, 0.5, 1);
  EXPECT_TRUE(clean_iteration(t, n, 7));
  EXPECT_EQ(t.get_scale(), 30.0);
  EXPECT_TRUE(clean_iteration(t, n, 8));
  EXPECT_EQ(t.get_scale(), 90.0);
}

// "growth_interval ... Number of consecutive iterations without inf/NaN gradients that
//  must occur" — a skipped iteration resets the count (the growth tracker).
TEST(GradScalerDoc, SkipResetsGrowthTracker) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  Net n(sgd(0.01), DType::f32, DType::f32, {10});
  EXPECT_TRUE(clean_iteration(s, n, 1));
  EXPECT_TRUE(clean_iteration(s, n, 2));
  EXPECT_EQ(s.growth_tracker(), 2);
  EXPECT_FALSE(inf_iteration(s, n, 3));
  EXPECT_EQ(s.get_scale(), 512.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  EXPECT_TRUE(clean_iteration(s, n, 4));
  EXPECT_TRUE(clean_iteration(s, n, 5));
  EXPECT_EQ(s.get_scale(), 512.0);  // only 2 in a row since the skip
  EXPECT_EQ(s.growth_tracker(), 2);
  EXPECT_TRUE(clean_iteration(s, n, 6));
  EXPECT_EQ(s.get_scale(), 1024.0);
  EXPECT_EQ(s.growth_tracker(), 0);
}

// A scale that backed off to 0 (about 150 skipped steps in a row from 1.0, in fp32) skips
// every later step, as PyTorch's scaler does (every gradient unscales to inf or NaN),
// writing nothing and raising nothing; its state dict, scale 0, loads.
TEST(GradScalerDoc, ScaleBackedOffToZeroSkipsEveryStep) {
  GradScaler s("cpu", 1.0, 2.0, 0.5, 2);
  Net n(sgd(0.1), DType::f32, DType::f32, {10});
  int backoffs = 0;
  while (s.get_scale() != 0.0 && backoffs < 200) {
    EXPECT_FALSE(inf_iteration(s, n, static_cast<std::uint64_t>(backoffs)));
    ++backoffs;
  }
  ASSERT_EQ(s.get_scale(), 0.0);
  EXPECT_EQ(backoffs, 150);  // 2^-149, the smallest fp32, halves to 0 (the steps from 2^-128 on skipped unread)
  n.set_grads(7, 1.0);
  const Snapshot before = capture(n);
  for (int k = 0; k < 3; ++k) {  // clean gradients, and more than growth_interval of them
    EXPECT_FALSE(s.step(n.opt));
    EXPECT_TRUE(s.last_step_result().found_inf);
    EXPECT_FALSE(s.last_step_result().applied);
    EXPECT_EQ(s.last_step_result().grad_norm, kInf);
    s.update();
    EXPECT_EQ(s.get_scale(), 0.0);
  }
  expect_same(before, capture(n));
  GradScaler t("cpu");
  t.load_state_dict(s.state_dict());
  EXPECT_EQ(t.get_scale(), 0.0);
  EXPECT_FALSE(t.step(n.opt));
  t.update(1024.0);  // a scale set by hand starts over
  EXPECT_EQ(t.get_scale(), 1024.0);
  // Not yet 0 but below 2^-128: the fp32 reciprocal overflows, the step skips the same way.
  t.update(0x1p-130);
  n.set_grads(8, 1.0);
  const Snapshot tiny = capture(n);
  EXPECT_FALSE(t.step(n.opt));
  EXPECT_TRUE(t.last_step_result().found_inf);
  expect_same(tiny, capture(n));
}

// Header: "multiplies the scale by growth_factor (kept only if the result is finite)" —
// the fp32 scale never becomes inf; the tracker is reset all the same (PyTorch).
TEST(GradScalerDoc, GrowthToInfIsNotKept) {
  GradScaler s("cpu", 0x1p127, 2.0, 0.5, 1);
  Net n(sgd(0.0), DType::f32, DType::f32, {4});
  n.set_grads(1, 1.0);  // unscaled by 2^127: tiny but finite
  EXPECT_TRUE(s.step(n.opt));
  s.update();
  EXPECT_EQ(s.get_scale(), 0x1p127);
  EXPECT_EQ(s.growth_tracker(), 0);
  GradScaler m("cpu", FLT_MAX, 1.5, 0.5, 2);
  for (int k = 0; k < 4; ++k) {
    n.set_grads(2 + k, 1.0);
    EXPECT_TRUE(s.step(n.opt));
    s.update();
    n.set_grads(2 + k, 1.0);
    EXPECT_TRUE(m.step(n.opt));
    m.update();
    EXPECT_EQ(m.get_scale(), static_cast<double>(FLT_MAX));
  }
  EXPECT_EQ(m.growth_tracker(), 0);
  // 2^126 * 2 = 2^127 is finite in fp32: kept.
  GradScaler k("cpu", 0x1p126, 2.0, 0.5, 1);
  n.set_grads(9, 1.0);
  EXPECT_TRUE(k.step(n.opt));
  k.update();
  EXPECT_EQ(k.get_scale(), 0x1p127);
}

// Header: "The scale is an fp32 value and its updates round as PyTorch's do":
// backoff: scale = float(scale * backoff_factor); growth: float(scale * growth_factor).
TEST(GradScalerDoc, ScaleArithmeticIsFp32AsPyTorch) {
  const double growth = 1.7, backoff = 0.3;
  GradScaler s("cpu", 3.0, growth, backoff, 1);
  Net n(sgd(0.0), DType::f32, DType::f32, {4});
  double expected = f32(3.0);
  const bool pattern[] = {false, false, true, false, true, true, false, true, true, true};
  for (bool finite : pattern) {
    if (finite) {
      clean_iteration(s, n, 1);
      expected = f32(expected * growth);
    } else {
      inf_iteration(s, n, 1);
      expected = f32(expected * backoff);
    }
    EXPECT_EQ(s.get_scale(), expected);
  }
  // Small scales are fp32 values too.
  GradScaler t("cpu", 1e-30, 2.0, 0.001, 100);
  double e = f32(1e-30);
  for (int k = 0; k < 2; ++k) {
    inf_iteration(t, n, 1);
    e = f32(e * 0.001);
    EXPECT_EQ(t.get_scale(), e);
  }
}

// "Passing new_scale sets the new scale value manually." Header: "With new_scale
// (finite, > 0): sets the scale (the growth tracker is kept)."
TEST(GradScalerDoc, UpdateNewScaleSetsItAndKeepsTracker) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  Net n(sgd(0.01), DType::f32, DType::f32, {10});
  for (int it = 1; it <= 2; ++it) EXPECT_TRUE(clean_iteration(s, n, it));
  ASSERT_EQ(s.growth_tracker(), 2);
  n.set_grads(3, s.get_scale());
  EXPECT_TRUE(s.step(n.opt));
  s.update(256.0);
  EXPECT_EQ(s.get_scale(), 256.0);
  EXPECT_EQ(s.growth_tracker(), 2);  // neither counted nor reset
  // The next unskipped iteration is the third in a row: it grows from the new scale.
  EXPECT_TRUE(clean_iteration(s, n, 4));
  EXPECT_EQ(s.get_scale(), 512.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  // new_scale after a skipped step: the skip does not back off the new scale either.
  EXPECT_TRUE(clean_iteration(s, n, 5));
  n.set_grads(6, 1.0);
  n.g.set(0, 0, kInf);
  EXPECT_FALSE(s.step(n.opt));
  s.update(100.0);
  EXPECT_EQ(s.get_scale(), 100.0);
  EXPECT_EQ(s.growth_tracker(), 1);
  // "new_scale is not used directly, it's used to fill GradScaler's internal scale
  //  tensor" — an fp32 value.
  n.set_grads(7, 1.0);
  EXPECT_TRUE(s.step(n.opt));
  s.update(0.1);
  EXPECT_EQ(s.get_scale(), f32(0.1));
}

// Header: "With new_scale (finite, > 0)" — other values are rejected, the scale unchanged.
TEST(GradScalerDoc, UpdateNewScaleInvalidThrows) {
  for (double v : {0.0, -1.0, kInf, kNaN}) {
    SCOPED_TRACE(v);
    GradScaler s("cpu", 1024.0);
    Net n(sgd(0.01), DType::f32, DType::f32, {10});
    n.set_grads(1, 1024.0);
    EXPECT_TRUE(s.step(n.opt));
    error_message([&] { s.update(v); }, ErrorCode::invalid_argument);
    EXPECT_EQ(s.get_scale(), 1024.0);
  }
}

// Header: "Error(invalid_state) if no optimizer was stepped or unscaled since the last update()."
// (PyTorch: "No inf checks were recorded prior to update.")
TEST(GradScalerDoc, UpdateWithNothingSteppedThrowsInvalidState) {
  GradScaler s("cpu", 1024.0);
  error_message([&] { s.update(); }, ErrorCode::invalid_state);
  EXPECT_EQ(s.get_scale(), 1024.0);
  Net n(sgd(0.01), DType::f32, DType::f32, {10});
  EXPECT_TRUE(clean_iteration(s, n, 1));
  EXPECT_EQ(s.growth_tracker(), 1);
  error_message([&] { s.update(); }, ErrorCode::invalid_state);  // a second update() in a row
  EXPECT_EQ(s.get_scale(), 1024.0);
  EXPECT_EQ(s.growth_tracker(), 1);
}

// "update() should only be called at the end of the iteration, after scaler.step(optimizer)
//  has been invoked for all optimizers used this iteration." "If any optimizer steps were
//  skipped the scale is multiplied by backoff_factor" — once per iteration.
TEST(GradScalerDoc, SeveralOptimizersOneScaler) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 2);
  Net a(adam(), DType::f32, DType::f32, kSizes, 1);
  Net b(adam(), DType::bf16, DType::f16, {100, 7}, 2);
  Net b_ref(adam(), DType::bf16, DType::f16, {100, 7}, 2);
  // Iteration 1: a finds inf, b does not: b is applied, a is not, the scale backs off once.
  a.set_grads(10, 1024.0);
  a.g.set(1, 999, kInf);
  const auto gb = b.set_grads(11, 1024.0);
  b_ref.set_grads(11, 1.0);
  const Snapshot a_before = capture(a);
  EXPECT_FALSE(s.step(a.opt));
  EXPECT_TRUE(s.step(b.opt));
  b_ref.opt.step();
  expect_same(a_before, capture(a));
  expect_nets_close(b, b_ref);
  s.update();
  EXPECT_EQ(s.get_scale(), 512.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  // Iterations 2 and 3: both clean: one tracker count per iteration, not per optimizer.
  for (int it = 0; it < 2; ++it) {
    a.set_grads(20 + it, s.get_scale());
    b.set_grads(30 + it, s.get_scale());
    EXPECT_TRUE(s.step(a.opt));
    EXPECT_TRUE(s.step(b.opt));
    s.update();
    EXPECT_EQ(s.growth_tracker(), it == 0 ? 1 : 0);
  }
  EXPECT_EQ(s.get_scale(), 1024.0);
  // Iteration 4: b finds NaN (a clean): the scale backs off once, not twice.
  a.set_grads(40, s.get_scale());
  b.set_grads(41, 1.0);
  b.g.set(0, 50, kNaN);
  EXPECT_TRUE(s.step(a.opt));
  EXPECT_FALSE(s.step(b.opt));
  s.update();
  EXPECT_EQ(s.get_scale(), 512.0);
  EXPECT_EQ(a.opt.step_count(), 3);
  EXPECT_EQ(b.opt.step_count(), 3);
  (void)gb;
}

// "the optimal scale factor is the largest factor that can be used without incurring inf
//  or NaN gradient values. scaler approximates the optimal scale factor over time by
//  checking the gradients for infs and NaNs during every scaler.step(optimizer)".
// Gradients of 100 stored in f16 (max 65504): 100 * S overflows for S >= 1024, so the
// optimum is 512. From 65536 the scaler backs off 7 times to 512, then oscillates: 10
// good iterations at 512, growth to 1024, one skip back to 512.
TEST(GradScalerDoc, ApproximatesOptimalScaleOverTime) {
  GradScaler s("cpu", 65536.0, 2.0, 0.5, 10);
  Net n(sgd(1e-6), DType::f32, DType::f16, {64});
  auto iteration = [&] {
    for (std::int64_t j = 0; j < 64; ++j) n.g.set(0, j, 100.0 * s.get_scale());  // backward of scale(loss)
    const bool applied = s.step(n.opt);
    s.update();
    return applied;
  };
  for (int k = 0; k < 7; ++k) EXPECT_FALSE(iteration()) << k;
  EXPECT_EQ(s.get_scale(), 512.0);
  int skipped = 0;
  for (int k = 0; k < 110; ++k) {
    if (!iteration()) ++skipped;
    EXPECT_TRUE(s.get_scale() == 512.0 || s.get_scale() == 1024.0) << s.get_scale();
  }
  EXPECT_EQ(skipped, 10);
  EXPECT_EQ(n.opt.step_count(), 100);
}

// ---------------------------------------------------------------------------
// enabled = false

// "enabled (bool, optional) – If False, disables gradient scaling. step() simply invokes
//  the underlying optimizer.step()" — even with inf gradients it does what a plain
// Optimizer::step() does.
TEST(GradScalerDoc, DisabledStepIsPlainStep) {
  for (bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "with max_grad_norm" : "without clipping");
    OptimizerOptions o;
    if (clip) o.max_grad_norm = 1.0;
    GradScaler s("cpu", 1024.0, 2.0, 0.5, 2000, false);
    Net a(adam(), DType::f32, DType::f32, kSizes, 5, o);
    Net b(adam(), DType::f32, DType::f32, kSizes, 5, o);
    // A clean step: the gradients are not unscaled (a plain step on them as they are).
    a.set_grads(1, 1.0);
    b.set_grads(1, 1.0);
    const bool r = s.step(a.opt);
    b.opt.step();
    EXPECT_EQ(r, b.opt.last_result().applied);
    EXPECT_TRUE(r);
    expect_same(capture(b), capture(a));
    // Another step() in the same iteration is just another plain step.
    a.set_grads(2, 1.0);
    b.set_grads(2, 1.0);
    s.step(a.opt);
    b.opt.step();
    expect_same(capture(b), capture(a));
    // Inf gradients: exactly what the plain step does (without clipping it applies them).
    a.set_grads(3, 1.0);
    b.set_grads(3, 1.0);
    a.g.set(1, 10, kInf);
    b.g.set(1, 10, kInf);
    a.g.set(2, 11, kNaN);
    b.g.set(2, 11, kNaN);
    const bool r3 = s.step(a.opt);
    b.opt.step();
    EXPECT_EQ(r3, b.opt.last_result().applied);
    expect_same(capture(b), capture(a));
    EXPECT_EQ(a.opt.step_count(), clip ? 2 : 3);
  }
}

// "If False, ... other methods become no-ops." "get_scale() ... or 1.0 if scaling is
//  disabled." "scale(outputs) ... If this instance of GradScaler is not enabled, outputs
//  are returned unmodified." "state_dict() ... If this instance is not enabled, returns an
//  empty dict." "If this instance is disabled, load_state_dict() is a no-op."
TEST(GradScalerDoc, DisabledMethodsAreNoOps) {
  GradScaler s("cpu", 1024.0, 3.0, 0.25, 7, false);
  EXPECT_FALSE(s.is_enabled());
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_EQ(s.scale(0.1), 0.1);
  EXPECT_EQ(s.scale(-123.456), -123.456);
  HostTensors t(DType::f16, {9}, false);
  for (int j = 0; j < 9; ++j) t.set(0, j, 0.37 * j - 1);
  const auto tb = t.snapshot();
  s.scale_(t[0]);
  std::vector<TensorView> list = {t[0], t[0]};
  s.scale_(std::span<const TensorView>(list));
  EXPECT_TRUE(tb == t.snapshot());
  // unscale_ does nothing (not even the twice-per-step check); update() needs no step.
  Net n(sgd(0.1), DType::f32, DType::bf16, {50});
  n.set_grads(1, 1024.0);
  n.g.set(0, 3, kInf);
  const auto gb = n.g.snapshot();
  s.unscale_(n.opt);
  s.unscale_(n.opt);
  EXPECT_TRUE(gb == n.g.snapshot());
  s.update();
  s.update();
  s.update(4.0);
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_TRUE(s.state_dict().empty());
  s.load_state_dict({});
  s.load_state_dict({{"scale", 8.0}, {"growth_factor", 4.0}, {"backoff_factor", 0.125}, {"growth_interval", 3.0},
                     {"_growth_tracker", 2.0}});
  s.load_state_dict({{"garbage", -1.0}});
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_TRUE(s.state_dict().empty());
  EXPECT_FALSE(s.is_enabled());
  // The setters store without checking, as PyTorch's: a disabled scaler never uses them.
  s.set_growth_factor(0.5);
  s.set_backoff_factor(2.0);
  s.set_growth_interval(0);
  EXPECT_EQ(s.get_growth_factor(), 0.5);
  EXPECT_EQ(s.get_backoff_factor(), 2.0);
  EXPECT_EQ(s.get_growth_interval(), 0);
  EXPECT_EQ(s.get_scale(), 1.0);
}

// PyTorch checks the constructor's values only when enabled; so does GradScaler (the
// device is checked either way).
TEST(GradScalerDoc, DisabledConstructorTakesAnyFactors) {
  GradScaler s("cpu", -1.0, 0.5, 2.0, 0, false);
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_EQ(s.get_growth_factor(), 0.5);
  EXPECT_EQ(s.get_backoff_factor(), 2.0);
  EXPECT_EQ(s.get_growth_interval(), 0);
  EXPECT_THROW(GradScaler("cpu", 1024.0, 0.5, 0.5, 1, true), Error);
  EXPECT_THROW(GradScaler("tpu", 1024.0, 2.0, 0.5, 1, false), Error);
}

// ---------------------------------------------------------------------------
// state_dict / load_state_dict

// "state_dict() ... It contains five entries: "scale" ..., "growth_factor" ...,
//  "backoff_factor" ..., "growth_interval" ..., "_growth_tracker" - ... the number of
//  recent consecutive unskipped steps."
TEST(GradScalerDoc, StateDictHasExactlyFiveEntries) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  Net n(sgd(0.01), DType::f32, DType::f32, {10});
  const auto fresh = s.state_dict();
  const std::map<std::string, double> expected_fresh = {{"scale", 1024.0},       {"growth_factor", 2.0},
                                                        {"backoff_factor", 0.5}, {"growth_interval", 3.0},
                                                        {"_growth_tracker", 0.0}};
  EXPECT_EQ(fresh, expected_fresh);
  for (int k = 0; k < 3; ++k) clean_iteration(s, n, k);  // grows to 2048
  inf_iteration(s, n, 9);                                // backs off to 1024
  clean_iteration(s, n, 10);
  clean_iteration(s, n, 11);  // tracker 2
  s.set_growth_factor(4.0);
  s.set_backoff_factor(0.125);
  const auto sd = s.state_dict();
  const std::map<std::string, double> expected = {{"scale", 1024.0},         {"growth_factor", 4.0},
                                                  {"backoff_factor", 0.125}, {"growth_interval", 3.0},
                                                  {"_growth_tracker", 2.0}};
  EXPECT_EQ(sd, expected);
  // A non-power-of-two scale is reported as its fp32 value.
  GradScaler t("cpu", 0.1);
  EXPECT_EQ(t.state_dict().at("scale"), f32(0.1));
}

// "load_state_dict(state_dict) ... Load the scaler state. ... Should be an object returned
//  from a call to state_dict()." — a scaler that loads another's state continues exactly
// as the other does.
TEST(GradScalerDoc, LoadStateDictRoundTripContinuesIdentically) {
  GradScaler a("cpu", 1024.0, 2.0, 0.5, 3);
  Net na(sgd(0.01), DType::f32, DType::f32, {10}, 1);
  for (int k = 0; k < 3; ++k) clean_iteration(a, na, k);
  inf_iteration(a, na, 5);
  clean_iteration(a, na, 6);
  clean_iteration(a, na, 7);
  ASSERT_EQ(a.growth_tracker(), 2);
  GradScaler b("cpu", 7.0, 3.0, 0.25, 100);
  Net nb(sgd(0.01), DType::f32, DType::f32, {10}, 1);
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.state_dict(), a.state_dict());
  EXPECT_EQ(b.get_scale(), 1024.0);
  EXPECT_EQ(b.get_growth_factor(), 2.0);
  EXPECT_EQ(b.get_backoff_factor(), 0.5);
  EXPECT_EQ(b.get_growth_interval(), 3);
  EXPECT_EQ(b.growth_tracker(), 2);
  const bool pattern[] = {true, true, false, true, true, true, true};
  int seed = 50;
  for (bool finite : pattern) {
    ++seed;
    if (finite) {
      clean_iteration(a, na, seed);
      clean_iteration(b, nb, seed);
    } else {
      inf_iteration(a, na, seed);
      inf_iteration(b, nb, seed);
    }
    EXPECT_EQ(a.state_dict(), b.state_dict()) << "after iteration with seed " << seed;
  }
  // Grew at the first (2 + 1 = 3), backed off at the third, grew again after three more.
  EXPECT_EQ(b.get_scale(), 2048.0);
  EXPECT_EQ(b.growth_tracker(), 1);
  // Extra entries are ignored.
  auto sd = a.state_dict();
  sd["something_else"] = 42.0;
  GradScaler c("cpu");
  c.load_state_dict(sd);
  EXPECT_EQ(c.state_dict(), a.state_dict());
}

// Header: "An empty map is an Error (it was saved from a disabled scaler)". PyTorch:
// "The source state dict is empty, possibly because it was saved from a disabled instance
//  of GradScaler."
TEST(GradScalerDoc, LoadStateDictEmptyThrowsNamingDisabled) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  const auto before = s.state_dict();
  const std::string msg = any_error_message([&] { s.load_state_dict({}); });
  EXPECT_THAT(msg, HasSubstr("disabled"));
  EXPECT_EQ(s.state_dict(), before);
}

// Header: "... as is a missing entry or an invalid value; nothing changes on an Error."
TEST(GradScalerDoc, LoadStateDictMissingOrInvalidThrowsAndChangesNothing) {
  const std::map<std::string, double> good = {{"scale", 8.0},
                                              {"growth_factor", 4.0},
                                              {"backoff_factor", 0.125},
                                              {"growth_interval", 5.0},
                                              {"_growth_tracker", 3.0}};
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  Net n(sgd(0.01), DType::f32, DType::f32, {10});
  clean_iteration(s, n, 1);
  const auto before = s.state_dict();
  for (const auto& [key, value] : good) {
    SCOPED_TRACE("missing " + key);
    auto sd = good;
    sd.erase(key);
    const std::string msg = any_error_message([&] { s.load_state_dict(sd); });
    EXPECT_THAT(msg, HasSubstr(lower(key)));
    EXPECT_EQ(s.state_dict(), before);
  }
  const std::pair<const char*, double> invalid[] = {
      {"scale", -1e-50},       {"scale", -8.0},          {"scale", kInf},           {"scale", kNaN},
      {"growth_factor", 1.0},  {"growth_factor", kNaN},  {"backoff_factor", 1.0},   {"backoff_factor", 0.0},
      {"growth_interval", 0.0}, {"growth_interval", -4.0},  {"_growth_tracker", kNaN}};
  for (const auto& [key, value] : invalid) {
    SCOPED_TRACE(std::string(key) + " = " + std::to_string(value));
    auto sd = good;
    sd[key] = value;
    any_error_message([&] { s.load_state_dict(sd); });
    EXPECT_EQ(s.state_dict(), before);
  }
  // The scaler still works after the failed loads.
  EXPECT_TRUE(clean_iteration(s, n, 2));
  EXPECT_EQ(s.growth_tracker(), 2);
}

// ---------------------------------------------------------------------------
// Getters and setters

// "get_backoff_factor() → float: Return a Python float containing the scale backoff
//  factor." ... "set_growth_factor(new_factor) Set a new scale growth factor." etc.
TEST(GradScalerDoc, GettersAndSetters) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  s.set_growth_factor(4.0);
  s.set_backoff_factor(0.25);
  s.set_growth_interval(2);
  EXPECT_EQ(s.get_growth_factor(), 4.0);
  EXPECT_EQ(s.get_backoff_factor(), 0.25);
  EXPECT_EQ(s.get_growth_interval(), 2);
  // The new values are the ones update() uses.
  Net n(sgd(0.01), DType::f32, DType::f32, {10});
  clean_iteration(s, n, 1);
  clean_iteration(s, n, 2);
  EXPECT_EQ(s.get_scale(), 4096.0);
  inf_iteration(s, n, 3);
  EXPECT_EQ(s.get_scale(), 1024.0);
}

// Header: "Validated as in the constructor; nothing changes on an Error."
TEST(GradScalerDoc, SettersRejectInvalidValuesAndChangeNothing) {
  GradScaler s("cpu", 1024.0, 2.0, 0.5, 3);
  for (double v : {1.0, 0.99, 0.0, -2.0, kInf, kNaN}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { s.set_growth_factor(v); }, ErrorCode::invalid_argument), HasSubstr("growth_factor"));
    EXPECT_EQ(s.get_growth_factor(), 2.0);
  }
  for (double v : {0.0, -0.5, 1.0, 1.01, kInf, kNaN}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { s.set_backoff_factor(v); }, ErrorCode::invalid_argument),
                HasSubstr("backoff_factor"));
    EXPECT_EQ(s.get_backoff_factor(), 0.5);
  }
  for (std::int64_t v : {std::int64_t{0}, std::int64_t{-3}}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { s.set_growth_interval(v); }, ErrorCode::invalid_argument),
                HasSubstr("growth_interval"));
    EXPECT_EQ(s.get_growth_interval(), 3);
  }
  EXPECT_EQ(s.get_scale(), 1024.0);
}

// ---------------------------------------------------------------------------
// Clipping

// "Simple example, using unscale_() to enable clipping of unscaled gradients" — here the
// clip (OptimizerOptions::max_grad_norm) is fused into scaler.step(): clip_grad_norm_ on
// the unscaled gradients; last_step_result() reports the norm and the clip coefficient.
TEST(GradScalerDoc, ClippingThroughScalerStep) {
  for (DType gd : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(gd));
    OptimizerOptions o;
    o.max_grad_norm = 1.0;
    GradScaler s("cpu", 4096.0);
    Net n(sgd(1.0), DType::f32, gd, kSizes, 3, o);
    Net w0(sgd(1.0), DType::f32, gd, kSizes, 3);
    const auto g = n.set_grads(5, 4096.0);
    const double norm = l2_norm(g);
    ASSERT_GT(norm, 10.0);  // so the clip really scales
    const double coef = 1.0 / (norm + 1e-6);
    EXPECT_TRUE(s.step(n.opt));
    const StepResult& r = s.last_step_result();
    EXPECT_TRUE(r.applied);
    EXPECT_NEAR(r.grad_norm, norm, 1e-5 * norm);
    EXPECT_NEAR(r.clip_coef, coef, 1e-5 * coef);
    expect_clipped_sgd_step(n, w0, g, coef);
    s.update();
    // The same with unscale_() first (the document's example): the same clip.
    Net m(sgd(1.0), DType::f32, gd, kSizes, 3, o);
    GradScaler s2("cpu", 4096.0);
    m.set_grads(5, 4096.0);
    s2.unscale_(m.opt);
    EXPECT_TRUE(s2.step(m.opt));
    EXPECT_NEAR(s2.last_step_result().clip_coef, coef, 1e-5 * coef);
    expect_nets_close(m, n);
    // Below the threshold: no clipping.
    OptimizerOptions big;
    big.max_grad_norm = 1e6;
    Net q(sgd(1.0), DType::f32, gd, kSizes, 3, big);
    GradScaler s3("cpu", 4096.0);
    q.set_grads(5, 4096.0);
    EXPECT_TRUE(s3.step(q.opt));
    EXPECT_EQ(s3.last_step_result().clip_coef, 1.0);
  }
}

}  // namespace
}  // namespace stepfuse::ref
