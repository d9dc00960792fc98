// Custom update programs (stepfuse/update_program.hpp): a user-written Lion variant and
// a user-written SGD with momentum, run by Optimizer with the built-ins' pipeline.
//  - both against float64 implementations written here (loss scaling, clipping);
//  - the SGD against the built-in SGD bitwise on the CPU (same math, same op order), in
//    every fusion mode and with f32 and bf16 storage;
//  - GradScaler: inf/NaN skips write nothing, the scale backs off and grows;
//  - every validation error is Error(invalid_argument) naming the op and its index;
//  - set_scalar / set_lr change the next step (no recompilation: scalars are arguments);
//  - checkpoints round-trip and refuse another program; LossScaleOptimizer delegates;
//  - on a GPU (skipped here without one), bitwise the CPU's results.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "examples/lion_soft_sign.hpp"
#include "jit/kernel_cache.hpp"
#include "reference/test_data.hpp"
#include "jit/base/cuda_api.hpp"
#include "runtime/cuda/cuda_backend.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ref::HostTensors;
using ref::Random;

// ---- The programs ------------------------------------------------------------------------

// Lion with a soft sign (examples/lion_soft_sign.hpp: where |c| <= tau the update is
// c / tau instead of sign(c)), with a larger learning rate than the example's.
using examples::kLionSoftSign;
using LionHyper = examples::LionSoftSignHyper;
constexpr LionHyper kLionHyper{.lr = 0.05};
UpdateProgram lion_soft_sign() { return examples::lion_soft_sign(kLionHyper); }

// SGD with momentum and dampening, written from scratch in the op order of the
// built-in (jit/builtin/sgd.hpp), so the two are bitwise alike.
Program make_my_sgd() {
  ProgramBuilder b("my_sgd");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = b.add(g, b.mul(b.scalar("weight_decay"), p));
  const Stream buf_stream = b.stream("momentum_buffer", StreamRole::state);
  const Value buf = b.add(b.mul(b.scalar("buf_momentum"), b.load(buf_stream)), b.mul(b.scalar("buf_grad_coef"), g));
  b.store(buf_stream, buf);
  b.store(param, b.sub(p, b.mul(b.scalar("lr"), buf)));
  return b.build();
}

const optim::SGD kSgd{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01};

UpdateProgram my_sgd(const optim::SGD& c = kSgd) {
  return UpdateProgram(make_my_sgd(), {UpdateProgram::gscale(), UpdateProgram::fixed("weight_decay", c.weight_decay),
                                       UpdateProgram::first_step("buf_momentum", 0.0, c.momentum),
                                       UpdateProgram::first_step("buf_grad_coef", 1.0, 1.0 - c.dampening),
                                       UpdateProgram::fixed("lr", c.lr)});
}

// ---- Float64 references, written from the algorithms (not from the programs) ------------

struct RefState {
  std::vector<std::vector<double>> p, m;  // weights, the one state tensor
};

// The gradient multiplier a step applies: 1/S times clip_grad_norm_'s coefficient.
struct RefScale {
  bool finite = true;
  double norm = 0, clip = 1, gscale = 1;
};
RefScale ref_scale(const std::vector<std::vector<double>>& stored, double S, std::optional<double> max_norm) {
  RefScale r;
  double sq = 0;
  for (const auto& t : stored)
    for (double x : t) {
      r.finite &= std::isfinite(x);
      sq += (x / S) * (x / S);
    }
  r.norm = std::sqrt(sq);
  if (max_norm) r.clip = std::min(1.0, *max_norm / (r.norm + 1e-6));
  r.gscale = r.clip / S;
  return r;
}

// Lion with a soft sign. Elements whose |c| lies within fp32 rounding of tau may take
// either branch in fp32: they are marked ambiguous (the comparisons skip them).
void ref_lion_step(RefState& s, const std::vector<std::vector<double>>& stored, double gscale, const LionHyper& h,
                   std::vector<std::vector<bool>>* ambiguous) {
  for (std::size_t t = 0; t < s.p.size(); ++t)
    for (std::size_t i = 0; i < s.p[t].size(); ++i) {
      const double g = stored[t][i] * gscale, m = s.m[t][i];
      const double c = h.beta1 * m + (1 - h.beta1) * g;
      if (std::fabs(std::fabs(c) - h.tau) < 1e-5 * h.tau) (*ambiguous)[t][i] = true;
      const double u = std::fabs(c) > h.tau ? (c > 0 ? 1.0 : -1.0) : c / h.tau;
      s.p[t][i] = s.p[t][i] * (1 - h.lr * h.weight_decay) - h.lr * u;
      s.m[t][i] = h.beta2 * m + (1 - h.beta2) * g;
    }
}

// torch.optim.SGD: g += wd*p; buf = g on the first step, else momentum*buf + (1-dampening)*g; p -= lr*buf.
void ref_sgd_step(RefState& s, const std::vector<std::vector<double>>& stored, double gscale, const optim::SGD& c,
                  std::int64_t step) {
  for (std::size_t t = 0; t < s.p.size(); ++t)
    for (std::size_t i = 0; i < s.p[t].size(); ++i) {
      const double g = stored[t][i] * gscale + c.weight_decay * s.p[t][i];
      s.m[t][i] = step == 1 ? g : c.momentum * s.m[t][i] + (1 - c.dampening) * g;
      s.p[t][i] -= c.lr * s.m[t][i];
    }
}

// ---- A model: caller-owned weights and gradients ---------------------------------------

const std::vector<std::int64_t> kSizes = {1000, 37, 0, 20000};

struct Net {
  Net(DType w, DType g, const std::vector<std::int64_t>& sizes = kSizes) : weights(w, sizes, false), grads(g, sizes, false) {
    Random rng(7);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::int64_t i = 0; i < sizes[t]; ++i) weights.set(t, i, rng.uniform() * 2 - 1);
  }
  std::vector<Param> params() const {
    std::vector<Param> ps;
    for (std::size_t t = 0; t < weights.size(); ++t) ps.push_back({weights[t], grads[t]});
    return ps;
  }
  // g ~ N(0, 0.25) rounded to the grad dtype, stored times S (a power of two: exact).
  // Returns the stored values.
  std::vector<std::vector<double>> set_grads(std::uint64_t seed, double S) const {
    Random rng(seed);
    std::vector<std::vector<double>> out(grads.size());
    for (std::size_t t = 0; t < grads.size(); ++t)
      for (std::int64_t i = 0; i < grads[t].numel; ++i) {
        grads.set(t, i, 0.5 * rng.normal());
        grads.set(t, i, grads.get(t, i) * S);
        out[t].push_back(grads.get(t, i));
      }
    return out;
  }
  std::vector<std::vector<double>> weight_values() const {
    std::vector<std::vector<double>> out(weights.size());
    for (std::size_t t = 0; t < weights.size(); ++t)
      for (std::int64_t i = 0; i < weights[t].numel; ++i) out[t].push_back(weights.get(t, i));
    return out;
  }
  HostTensors weights, grads;
};

RefState ref_start(const Net& n) {
  RefState s{n.weight_values(), {}};
  for (const auto& t : s.p) s.m.emplace_back(t.size(), 0.0);
  return s;
}

void expect_near_ref(const Optimizer& opt, const Net& n, const RefState& s, const std::string& state_name, double atol,
                     const std::vector<std::vector<bool>>* ambiguous, const std::string& what) {
  int bad = 0;
  for (std::size_t t = 0; t < s.p.size(); ++t) {
    const std::span<const float> m = opt.state(t, state_name);
    for (std::size_t i = 0; i < s.p[t].size(); ++i) {
      if (ambiguous != nullptr && (*ambiguous)[t][i]) continue;
      const double w = n.weights.get(t, i);
      if (!(std::fabs(w - s.p[t][i]) <= atol + 1e-6 * std::fabs(s.p[t][i])) && ++bad <= 5)
        ADD_FAILURE() << what << ": weight[" << t << "][" << i << "] = " << w << ", expected " << s.p[t][i];
      if (!(std::fabs(m[i] - s.m[t][i]) <= 1e-6 + 1e-5 * std::fabs(s.m[t][i])) && ++bad <= 5)
        ADD_FAILURE() << what << ": " << state_name << "[" << t << "][" << i << "] = " << m[i] << ", expected " << s.m[t][i];
    }
  }
}

// Everything an optimizer wrote, as bytes: weights, state, masters.
std::vector<unsigned char> written(const Optimizer& opt, const Net& n) {
  std::vector<unsigned char> out;
  const auto add = [&](const void* p, std::size_t bytes) {
    const auto* b = static_cast<const unsigned char*>(p);
    out.insert(out.end(), b, b + bytes);
  };
  for (std::size_t t = 0; t < n.weights.size(); ++t) {
    add(n.weights[t].data, static_cast<std::size_t>(n.weights[t].numel) * dtype_size(n.weights.dtype()));
    for (std::string_view name : opt.state_names()) add(opt.state(t, name).data(), opt.state(t, name).size_bytes());
    add(opt.master(t).data(), opt.master(t).size_bytes());
  }
  return out;
}

// The index of the first instruction with `op` (and, for load/scalar, `attr`).
int find_instr(const Program& p, Op op, int attr = -1) {
  for (int i = 0; i < p.num_instrs; ++i)
    if (p.code[i].op == op && (attr < 0 || p.code[i].attr == attr)) return i;
  ADD_FAILURE() << "no such instruction";
  return 0;
}
std::string at_op(const Program& p, int i) {
  return "at op '" + std::string(op_name(p.code[i].op)) + "' (instruction " + std::to_string(i) + ": ";
}

std::string error_of(const std::function<void()>& f, ErrorCode code = ErrorCode::invalid_argument) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(error_code_name(e.code()), error_code_name(code)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no Error";
  return "";
}

// ---- The Lion variant against its float64 reference --------------------------------------

TEST(CustomProgram, LionVariantMatchesFloat64ReferenceWithScalingAndClipping) {
  for (const Fusion fusion : {Fusion::fused, Fusion::interpreted, Fusion::unfused}) {
    SCOPED_TRACE("fusion " + std::to_string(static_cast<int>(fusion)));
    const LionHyper h = kLionHyper;
    Net n(DType::f32, DType::f32);
    OptimizerOptions o;
    o.max_grad_norm = 20.0;  // the gradients' norm is ~75: clipping is active
    o.fusion = fusion;
    Optimizer opt(examples::lion_soft_sign(h), n.params(), o);
    EXPECT_TRUE(opt.is_custom());
    RefState s = ref_start(n);
    std::vector<std::vector<bool>> ambiguous;
    for (const auto& t : s.p) ambiguous.emplace_back(t.size(), false);
    const double S = 1024;
    for (int step = 1; step <= 3; ++step) {
      const auto stored = n.set_grads(100 + step, S);
      const RefScale rs = ref_scale(stored, S, o.max_grad_norm);
      const StepResult r = opt.step_scaled(S);
      ASSERT_TRUE(r.applied);
      EXPECT_NEAR(r.grad_norm, rs.norm, 1e-6 * rs.norm);
      EXPECT_NEAR(r.clip_coef, rs.clip, 1e-6);
      EXPECT_LT(r.clip_coef, 1.0);
      ref_lion_step(s, stored, rs.gscale, h, &ambiguous);
      expect_near_ref(opt, n, s, "exp_avg", 1e-6, &ambiguous, "step " + std::to_string(step));
    }
    EXPECT_EQ(opt.step_count(), 3);
  }
}

TEST(CustomProgram, LionVariantWithBf16WeightsKeepsMastersAndRoundsTheWeights) {
  const LionHyper h = kLionHyper;
  Net n(DType::bf16, DType::bf16);
  Optimizer opt(examples::lion_soft_sign(h), n.params());  // fp32 masters by default
  RefState s = ref_start(n);
  std::vector<std::vector<bool>> ambiguous;
  for (const auto& t : s.p) ambiguous.emplace_back(t.size(), false);
  for (int step = 1; step <= 2; ++step) {
    const auto stored = n.set_grads(200 + step, 256);
    opt.step_scaled(256);
    ref_lion_step(s, stored, 1.0 / 256, h, &ambiguous);
  }
  // The master follows the reference in fp32; the weight is the master rounded to bf16.
  for (std::size_t t = 0; t < s.p.size(); ++t) {
    const std::span<const float> master = opt.master(t);
    ASSERT_EQ(master.size(), s.p[t].size());
    for (std::size_t i = 0; i < master.size(); ++i) {
      if (ambiguous[t][i]) continue;
      ASSERT_NEAR(master[i], s.p[t][i], 1e-6 + 1e-6 * std::fabs(s.p[t][i])) << t << "," << i;
      ASSERT_EQ(static_cast<float>(n.weights.get(t, i)), bf16_to_float(float_to_bf16(master[i]))) << t << "," << i;
    }
  }
}

// ---- SGD from scratch: the reference, and the built-in bit for bit ------------------------

TEST(CustomProgram, SgdMomentumMatchesFloat64Reference) {
  Net n(DType::f32, DType::f32);
  OptimizerOptions o;
  o.max_grad_norm = 30.0;
  Optimizer opt(my_sgd(), n.params(), o);
  RefState s = ref_start(n);
  for (int step = 1; step <= 3; ++step) {
    const auto stored = n.set_grads(300 + step, 64);
    const RefScale rs = ref_scale(stored, 64, o.max_grad_norm);
    ASSERT_TRUE(opt.step_scaled(64).applied);
    ref_sgd_step(s, stored, rs.gscale, kSgd, step);
    expect_near_ref(opt, n, s, "momentum_buffer", 2e-6, nullptr, "step " + std::to_string(step));
  }
}

TEST(CustomProgram, SgdMomentumIsBitwiseTheBuiltinInEveryModeAndStorage) {
  struct Storage {
    DType w, g;
    bool masters;
  };
  for (const Storage st : {Storage{DType::f32, DType::f32, true}, Storage{DType::bf16, DType::bf16, true},
                           Storage{DType::f16, DType::f32, false}}) {
    for (const Fusion fusion : {Fusion::fused, Fusion::interpreted, Fusion::unfused}) {
      SCOPED_TRACE(std::string(dtype_name(st.w)) + "/" + std::string(dtype_name(st.g)) + " fusion " +
                   std::to_string(static_cast<int>(fusion)));
      Net a(st.w, st.g), b(st.w, st.g);
      OptimizerOptions o;
      o.max_grad_norm = 25.0;
      o.master_weights = st.masters;
      o.fusion = fusion;
      Optimizer custom(my_sgd(), a.params(), o);
      Optimizer builtin(kSgd, b.params(), o);
      for (int step = 1; step <= 3; ++step) {
        a.set_grads(400 + step, 128);
        b.set_grads(400 + step, 128);
        const StepResult rc = custom.step_scaled(128), rb = builtin.step_scaled(128);
        EXPECT_EQ(rc.grad_norm, rb.grad_norm);
        EXPECT_EQ(rc.clip_coef, rb.clip_coef);
        ASSERT_EQ(written(custom, a), written(builtin, b)) << "step " << step;
      }
      // A plain step (no loss scale): the custom program's update alone.
      a.set_grads(499, 1);
      b.set_grads(499, 1);
      custom.step();
      builtin.step();
      EXPECT_EQ(written(custom, a), written(builtin, b)) << "plain step";
    }
  }
}

TEST(CustomProgram, GradScalerSkipsNonFiniteStepsAndScales) {
  Net a(DType::f32, DType::f16), b(DType::f32, DType::f16);
  OptimizerOptions o;
  o.max_grad_norm = 10.0;
  Optimizer custom(my_sgd(), a.params(), o);
  Optimizer builtin(kSgd, b.params(), o);
  GradScaler sa("cpu", 1024.0, 2.0, 0.5, /*growth_interval=*/2), sb("cpu", 1024.0, 2.0, 0.5, 2);
  for (int it = 0; it < 7; ++it) {
    const double S = sa.get_scale();
    ASSERT_EQ(S, sb.get_scale());
    a.set_grads(500 + it, S);
    b.set_grads(500 + it, S);
    const bool poison = it == 2 || it == 5;
    if (poison) {  // one inf (it 2), one NaN (it 5)
      a.grads.set(3, 123, it == 2 ? INFINITY : NAN);
      b.grads.set(3, 123, it == 2 ? INFINITY : NAN);
    }
    const auto before = written(custom, a);
    const std::int64_t steps = custom.step_count();
    const bool applied = sa.step(custom);
    EXPECT_EQ(applied, !poison) << "iteration " << it;
    EXPECT_EQ(sb.step(builtin), !poison);
    if (poison) {
      EXPECT_EQ(written(custom, a), before) << "a skipped step wrote something";
      EXPECT_EQ(custom.step_count(), steps);
      EXPECT_TRUE(sa.last_step_result().found_inf);
    }
    sa.update();
    sb.update();
    EXPECT_EQ(written(custom, a), written(builtin, b)) << "iteration " << it;
  }
  // 1024 -> 2048 (2 good) -> 1024 (inf) -> 2048 (2 good: it 3, 4) -> 1024 (NaN) -> (it 6: 1 good)
  EXPECT_EQ(sa.get_scale(), 1024.0);
  EXPECT_EQ(custom.step_count(), 5);
}

// ---- Validation ----------------------------------------------------------------------------

std::string build_error(const std::function<void(ProgramBuilder&, Stream grad, Stream param, Stream state)>& body) {
  return error_of([&] {
    ProgramBuilder b("broken");
    const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param),
                 m = b.stream("m", StreamRole::state);
    body(b, g, p, m);
    (void)b.build();
  });
}

TEST(CustomProgram, EveryValidationErrorNamesTheOpAndItsIndex) {
  // A load after a store to the same stream.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream m) {
                const Value x = b.load(g);         // %0
                b.store(m, x);                     // 1
                const Value w = b.load(p);         // %2
                const Value old = b.load(m);       // %3
                b.store(p, b.add(w, old));
              }),
              AllOf(HasSubstr("at op 'load' (instruction 3: %3 = load m)"), HasSubstr("a load follows a store"),
                    HasSubstr("stream 2 'm'")));
  // A store to the gradient.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                const Value x = b.load(g);
                b.store(g, x);
                b.store(p, x);
              }),
              AllOf(HasSubstr("at op 'store' (instruction 1: store grad, %0)"), HasSubstr("grad stream is read-only")));
  // A stream stored twice.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                const Value x = b.load(g);
                b.store(p, x);
                b.store(p, x);
              }),
              AllOf(HasSubstr("at op 'store' (instruction 2"), HasSubstr("stored twice"), HasSubstr("stream 1 'param'")));
  // An operand that is a store.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream m) {
                b.store(m, b.load(g));
                b.store(p, b.neg(Value{1}));
              }),
              AllOf(HasSubstr("at op 'neg' (instruction 2"), HasSubstr("refers to a store"),
                    HasSubstr("operand 1 is instruction 1: store m, %0")));
  // No store of the param stream.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream, Stream m) { b.store(m, b.load(g)); }),
              AllOf(HasSubstr("never stores the param stream"), HasSubstr("'store param, %v'"), HasSubstr("stream 1 'param'")));
  // Two grad streams.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                const Stream g2 = b.stream("grad2", StreamRole::grad);
                b.store(p, b.add(b.load(g), b.load(g2)));
              }),
              AllOf(HasSubstr("exactly one stream with role grad"), HasSubstr("stream 0 'grad', stream 3 'grad2'")));
  // Too many instructions: the first that does not fit is named.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                Value v = b.load(g);
                for (int i = 0; i < kMaxInstrs; ++i) v = b.add(v, v);
                b.store(p, v);
              }),
              AllOf(HasSubstr("op 'add' (instruction " + std::to_string(kMaxInstrs) + ") does not fit"),
                    HasSubstr("too many instructions")));
  // Too many streams, and too many scalars.
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                for (int i = 0; i < kMaxStreams; ++i) b.stream("extra", StreamRole::state);
                b.store(p, b.load(g));
              }),
              AllOf(HasSubstr("stream 'extra' does not fit"), HasSubstr("too many streams")));
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                Value v = b.load(g);
                static const char* names[] = {"s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8",
                                              "s9", "s10", "s11", "s12", "s13", "s14", "s15", "s16"};
                for (const char* n : names) v = b.mul(v, b.scalar(n));
                b.store(p, v);
              }),
              AllOf(HasSubstr("scalar 's16' (declared by instruction 33, op 'scalar') does not fit"),
                    HasSubstr("too many scalars")));

  // Structures the builder cannot make: operand and stream indexes out of range.
  Program p = kLionSoftSign;
  const int mul = find_instr(p, Op::mul);
  p.code[mul].b = 40;
  EXPECT_THAT(error_of([&] { UpdateProgram(p, {}); }),
              AllOf(HasSubstr(at_op(p, mul)), HasSubstr(", %40)"), HasSubstr("not yet defined"), HasSubstr("operand 2 is %40")));
  p = kLionSoftSign;
  const int load = find_instr(p, Op::load, p.find_stream("exp_avg"));
  p.code[load].attr = 7;
  EXPECT_THAT(error_of([&] { UpdateProgram(p, {}); }),
              AllOf(HasSubstr(at_op(p, load)), HasSubstr("stream index is out of range"),
                    HasSubstr("(stream 7; the program declares 3 streams)")));
  p = kLionSoftSign;
  const int scalar = find_instr(p, Op::scalar);
  p.code[scalar].attr = 12;  // a scalar slot not declared
  EXPECT_THAT(error_of([&] { UpdateProgram(p, {}); }),
              AllOf(HasSubstr(at_op(p, scalar)), HasSubstr("scalar index is out of range")));
}

TEST(CustomProgram, ScalarRulesAndNamesAreValidated) {
  const auto defs = lion_soft_sign().scalars();
  auto without = [&](std::string_view name) {
    std::vector<ScalarDef> d;
    for (const ScalarDef& s : defs)
      if (s.name != name) d.push_back(s);
    return d;
  };
  const int tau = find_instr(kLionSoftSign, Op::scalar, kLionSoftSign.find_scalar("tau"));
  EXPECT_THAT(error_of([&] { UpdateProgram(kLionSoftSign, without("tau")); }),
              HasSubstr("scalar 'tau' (op 'scalar', instruction " + std::to_string(tau) + ") has no rule"));
  std::vector<ScalarDef> extra = defs;
  extra.push_back(UpdateProgram::fixed("eps", 1e-8));
  EXPECT_THAT(error_of([&] { UpdateProgram(kLionSoftSign, extra); }),
              AllOf(HasSubstr("'eps'"), HasSubstr("does not declare")));
  std::vector<ScalarDef> twice = defs;
  twice.push_back(UpdateProgram::fixed("tau", 1));
  EXPECT_THAT(error_of([&] { UpdateProgram(kLionSoftSign, twice); }), HasSubstr("scalar 'tau' has two rules"));
  std::vector<ScalarDef> no_gscale = without("gscale");
  no_gscale.push_back(UpdateProgram::fixed("gscale", 1));
  EXPECT_THAT(error_of([&] { UpdateProgram(kLionSoftSign, no_gscale); }), HasSubstr("no scalar has the gscale rule"));
  std::vector<ScalarDef> bad_rule = without("tau");
  bad_rule.push_back(UpdateProgram::bias_correction1_step_size("tau", 1e-3, 1.0));
  EXPECT_THAT(error_of([&] { UpdateProgram(kLionSoftSign, bad_rule); }),
              AllOf(HasSubstr("scalar 'tau' (rule div_one_minus_pow)"), HasSubstr("must be in [0, 1)")));
  std::vector<ScalarDef> nan_value = without("lr");
  nan_value.push_back(UpdateProgram::fixed("lr", NAN));
  EXPECT_THAT(error_of([&] { UpdateProgram(kLionSoftSign, nan_value); }), HasSubstr("scalar 'lr' (rule fixed): a = nan"));

  ProgramBuilder b("bad name");
  const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
  b.store(p, b.mul(b.load(g), b.scalar("gscale")));
  EXPECT_THAT(error_of([&] { UpdateProgram(b.build(), {UpdateProgram::gscale()}); }),
              HasSubstr("name 'bad name' is not an identifier"));
  ProgramBuilder c("ok");
  const Stream cg = c.stream("grad", StreamRole::grad), cp = c.stream("param", StreamRole::param);
  c.stream("state */", StreamRole::state, 1.0f);
  c.store(cp, c.mul(c.load(cg), c.scalar("gscale")));
  EXPECT_THAT(error_of([&] { UpdateProgram(c.build(), {UpdateProgram::gscale()}); }),
              HasSubstr("stream 2 name 'state */' is not an identifier"));
}

TEST(CustomProgram, OwnsItsNamesAndPrintsItsRules) {
  std::string name = "temporary_name", stream = "param_stream", scalar = "my_lr";
  UpdateProgram up = [&] {
    ProgramBuilder b(name);
    const Stream g = b.stream("grad", StreamRole::grad), p = b.stream(stream, StreamRole::param);
    const Value lr = b.scalar(scalar);  // one statement each: scalars declared in this order
    const Value gs = b.scalar("gscale");
    const Value step = b.mul(lr, b.mul(b.load(g), gs));
    b.store(p, b.sub(b.load(p), step));
    return UpdateProgram(b.build(), {UpdateProgram::fixed(scalar, 0.5), UpdateProgram::gscale()});
  }();
  name.assign(name.size(), 'x'), stream.assign(stream.size(), 'x'), scalar.assign(scalar.size(), 'x');
  const UpdateProgram copy = up;
  EXPECT_EQ(copy.name(), "temporary_name");
  EXPECT_EQ(copy.program().streams[1].name, "param_stream");
  EXPECT_EQ(copy.scalars()[0].name, "my_lr");
  EXPECT_THAT(copy.text(), AllOf(HasSubstr("program temporary_name\n"), HasSubstr("scalar my_lr\n"),
                                 HasSubstr("scalars\n  my_lr = 0.5\n  gscale = gscale * 1\n")));
  const UpdateProgram adam = UpdateProgram::from_config(optim::AdamW{.lr = 1e-3, .beta1 = 0.8});
  EXPECT_EQ(adam.scalar("step_size").rule, (ScalarRule{ScalarRule::Kind::div_one_minus_pow, 1e-3, 0.8}));
  EXPECT_EQ(adam.scalar("bias_correction2_sqrt").rule.kind, ScalarRule::Kind::sqrt_one_minus_pow);
  EXPECT_DOUBLE_EQ(adam.scalar("step_size").rule.eval(2, 1.0), 1e-3 / (1 - 0.8 * 0.8));
}

// ---- Scalars, lr, config ---------------------------------------------------------------

TEST(CustomProgram, SetScalarChangesTheNextStepOnly) {
  LionHyper h = kLionHyper;
  Net n(DType::f32, DType::f32);
  Optimizer opt(examples::lion_soft_sign(h), n.params());
  RefState s = ref_start(n);
  std::vector<std::vector<bool>> ambiguous;
  for (const auto& t : s.p) ambiguous.emplace_back(t.size(), false);
  for (int step = 1; step <= 4; ++step) {
    if (step == 3) {
      // lr alone (decay = 1 - lr*wd is its own fixed scalar, kept), then tau and beta1.
      opt.set_lr(0.01);
      opt.set_scalar("tau", 0.5);
      opt.set_scalar("beta1", 0.5);
      opt.set_scalar("one_minus_beta1", 0.5);
      EXPECT_EQ(opt.lr(), 0.01);
      EXPECT_EQ(opt.scalar("tau"), 0.5);
      h.lr = 0.01, h.tau = 0.5, h.beta1 = 0.5;
      h.weight_decay = 0.1 * 0.05 / 0.01;  // the same decay factor 1 - 0.005
    }
    const auto stored = n.set_grads(600 + step, 1);
    opt.step();
    ref_lion_step(s, stored, 1.0, h, &ambiguous);
    expect_near_ref(opt, n, s, "exp_avg", 1e-6, &ambiguous, "step " + std::to_string(step));
  }
  // Nothing changes on an Error.
  const UpdateProgram before = opt.update_program();
  EXPECT_THAT(error_of([&] { opt.set_scalar("gscale", 2.0); }), HasSubstr("has rule gscale"));
  EXPECT_THAT(error_of([&] { opt.set_scalar("nope", 2.0); }), HasSubstr("no scalar 'nope'"));
  EXPECT_THAT(error_of([&] { opt.set_scalar("lr", INFINITY); }), HasSubstr("scalar 'lr' (rule fixed)"));
  EXPECT_THAT(error_of([&] { opt.set_lr(-1.0); }), HasSubstr("lr = -1"));
  EXPECT_THAT(error_of([&] { opt.set_scalar_rule("gscale", ScalarRule{ScalarRule::Kind::fixed, 1.0, 0.0}); }),
              HasSubstr("gscale"));
  EXPECT_EQ(opt.update_program().scalars(), before.scalars());
  opt.set_scalar_rule("tau", ScalarRule{ScalarRule::Kind::first_step, 0.1, 0.2});
  EXPECT_EQ(opt.update_program().scalar("tau").rule.kind, ScalarRule::Kind::first_step);
  EXPECT_THAT(error_of([&] { (void)opt.scalar("tau"); }), HasSubstr("not a fixed value"));
}

TEST(CustomProgram, ConfigIsAnErrorAndLrNeedsAFixedLrScalar) {
  Net n(DType::f32, DType::f32);
  Optimizer opt(lion_soft_sign(), n.params());
  EXPECT_THAT(error_of([&] { (void)opt.config(); }, ErrorCode::invalid_state),
              HasSubstr("a custom-program optimizer has no OptimizerConfig"));
  EXPECT_THAT(error_of([&] { opt.set_config(optim::Lion{}); }, ErrorCode::invalid_state), HasSubstr("set_config()"));
  EXPECT_EQ(opt.lr(), 0.05);
  EXPECT_EQ(opt.program_text(), to_string(kLionSoftSign));
  EXPECT_EQ(opt.state_names(), std::vector<std::string_view>{"exp_avg"});

  ProgramBuilder b("no_lr");
  const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
  b.store(p, b.sub(b.load(p), b.mul(b.scalar("step_size"), b.mul(b.load(g), b.scalar("gscale")))));
  Optimizer other(UpdateProgram(b.build(), {UpdateProgram::gscale(), UpdateProgram::bias_correction1_step_size("step_size", 0.1, 0.9)}),
                  n.params());
  EXPECT_THAT(error_of([&] { (void)other.lr(); }, ErrorCode::invalid_state), HasSubstr("declares no scalar 'lr'"));
  EXPECT_THAT(error_of([&] { other.set_lr(0.1); }, ErrorCode::invalid_state), HasSubstr("declares no scalar 'lr'"));

  // Built-ins: set_scalar is for custom programs; scalar() reads the config's rules.
  Optimizer builtin(kSgd, n.params());
  EXPECT_FALSE(builtin.is_custom());
  EXPECT_EQ(builtin.scalar("lr"), 0.05);
  EXPECT_THAT(error_of([&] { builtin.set_scalar("lr", 0.1); }, ErrorCode::invalid_state), HasSubstr("use set_config()"));
}

TEST(CustomProgram, StateStartsAtItsInitValue) {
  ProgramBuilder b("accumulate");
  const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
  const Stream acc = b.stream("acc", StreamRole::state, 0.25f);
  const Value sum = b.add(b.load(acc), b.mul(b.load(g), b.scalar("gscale")));
  b.store(acc, sum);
  b.store(p, b.sub(b.load(p), b.mul(b.constant(0.5f), sum)));
  Net n(DType::f32, DType::f32, {5});
  Optimizer opt(UpdateProgram(b.build(), {UpdateProgram::gscale()}), n.params());
  for (float x : opt.state(0, "acc")) EXPECT_EQ(x, 0.25f);
  const auto w0 = n.weight_values();
  n.set_grads(1, 1);
  opt.step();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(opt.state(0, "acc")[i], 0.25f + static_cast<float>(n.grads.get(0, i)));
    EXPECT_EQ(static_cast<float>(n.weights.get(0, i)),
              static_cast<float>(w0[0][i]) - 0.5f * (0.25f + static_cast<float>(n.grads.get(0, i))));
  }
}

// A stream loaded twice keeps its old contents for every load until the last one is
// read: the interpreter and the unfused step (jit/program_analysis.cpp) wrote a computed
// value straight into its stream when the *first* load of that stream was done, so a
// second load read after that saw the new value (found by fuzz_program; LLVM was right).
TEST(CustomProgram, AStreamLoadedTwiceKeepsItsOldValueForEveryLoad) {
  ProgramBuilder b("two_loads");
  const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
  const Stream m = b.stream("old_param", StreamRole::state);
  const Value first = b.load(p);
  const Value again = b.load(p);
  const Value half = b.mul(first, b.add(b.constant(0.5f), b.mul(b.load(g), b.scalar("gscale"))));
  b.store(m, again);  // read after `half` is computed: must still be the old weights
  b.store(p, half);
  const Program program = b.build();
  std::vector<std::pair<Fusion, CpuBackend>> modes = {{Fusion::interpreted, CpuBackend::automatic},
                                                      {Fusion::unfused, CpuBackend::automatic}};
  if (llvm_version()[0] != '\0') modes.push_back({Fusion::fused, CpuBackend::llvm});
  for (const auto& [fusion, backend] : modes) {
    SCOPED_TRACE("fusion " + std::to_string(static_cast<int>(fusion)) + ", backend " +
                 std::to_string(static_cast<int>(backend)));
    Net n(DType::f32, DType::f32, {37});
    n.set_grads(1, 1);
    OptimizerOptions o;
    o.fusion = fusion;
    o.cpu_backend = backend;
    Optimizer opt(UpdateProgram(program, {UpdateProgram::gscale()}), n.params(), o);
    const auto w0 = n.weight_values();
    opt.step();
    for (int i = 0; i < 37; ++i) {
      const float old = static_cast<float>(w0[0][i]);
      EXPECT_EQ(opt.state(0, "old_param")[i], old) << i;
      EXPECT_EQ(static_cast<float>(n.weights.get(0, i)), old * (0.5f + static_cast<float>(n.grads.get(0, i)))) << i;
    }
  }
}

// The documented NaN and signed-zero behaviour of max, min, sign, select, neg, abs
// (docs/update-programs.md), on the CPU target this machine dispatches to.
TEST(CustomProgram, OpsFollowTheDocumentedNanAndSignedZeroRules) {
  ProgramBuilder b("op_semantics");
  const Stream grad = b.stream("grad", StreamRole::grad), param = b.stream("param", StreamRole::param);
  Stream out[6];
  const char* names[6] = {"max", "min", "sign", "select", "neg", "abs"};
  for (int k = 0; k < 6; ++k) out[k] = b.stream(names[k], StreamRole::state);
  const Value gs = b.scalar("gscale");
  const Value a = b.mul(b.load(grad), gs);  // gscale = 1 on a plain step: a is the gradient, bit for bit
  const Value x = b.load(param);
  const Value one = b.constant(1.0f), two = b.constant(2.0f);
  b.store(out[0], b.max(a, x));
  b.store(out[1], b.min(a, x));
  b.store(out[2], b.sign(a));
  b.store(out[3], b.select(a, one, two));
  b.store(out[4], b.neg(a));
  b.store(out[5], b.abs(a));
  b.store(param, x);
  const UpdateProgram program(b.build(), {UpdateProgram::gscale()});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    float a, b, max, min, sign, select, neg, abs;
  };
  const Case cases[] = {
      {nan, 1.0f, nan, nan, nan, 1.0f, -nan, nan},     // a NaN a is kept, selects b
      {1.0f, nan, 1.0f, 1.0f, 1.0f, 1.0f, -1.0f, 1.0f},  // a NaN b is not
      {-0.0f, 0.0f, -0.0f, -0.0f, 0.0f, 2.0f, 0.0f, 0.0f},  // ties give a; sign(-0) = +0; -0 selects c
      {0.0f, -0.0f, 0.0f, 0.0f, 0.0f, 2.0f, -0.0f, 0.0f},
      {-2.0f, 3.0f, 3.0f, -2.0f, -1.0f, 1.0f, 2.0f, 2.0f},
      {-INFINITY, -1.0f, -1.0f, -INFINITY, -1.0f, 1.0f, INFINITY, INFINITY},
  };
  const auto n = static_cast<std::int64_t>(std::size(cases));
  for (const Fusion fusion : {Fusion::fused, Fusion::unfused}) {
    std::vector<float> w(n), g(n);
    for (std::int64_t i = 0; i < n; ++i) w[i] = cases[i].b, g[i] = cases[i].a;
    OptimizerOptions o;
    o.fusion = fusion;
    Optimizer opt(program, {{{w.data(), n, DType::f32}, {g.data(), n, DType::f32}}}, o);
    opt.step();
    for (std::int64_t i = 0; i < n; ++i) {
      const Case& c = cases[i];
      const float want[6] = {c.max, c.min, c.sign, c.select, c.neg, c.abs};
      for (int k = 0; k < 6; ++k) {
        const float got = opt.state(0, names[k])[i];
        // NaNs compare by being NaN with the expected sign; everything else bit for bit.
        const bool same = std::isnan(want[k]) ? std::isnan(got) && std::signbit(got) == std::signbit(want[k])
                                              : std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want[k]);
        EXPECT_TRUE(same) << names[k] << "(" << c.a << ", " << c.b << ") = " << got << ", expected " << want[k]
                          << " (fusion " << static_cast<int>(fusion) << ", " << cpu_target() << ")";
      }
    }
  }
}

// ---- Checkpoints, LossScaleOptimizer -----------------------------------------------------

TEST(CustomProgram, CheckpointRoundTripsAndRefusesAnotherProgram) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("stepfuse_custom_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + ".ckpt"))
                               .string();
  Net a(DType::bf16, DType::f32), b(DType::bf16, DType::f32);
  OptimizerOptions o;
  o.max_grad_norm = 15.0;
  Optimizer first(lion_soft_sign(), a.params(), o);
  GradScaler scaler("cpu", 512.0, 2.0, 0.5, 1);
  for (int it = 0; it < 2; ++it) {
    a.set_grads(700 + it, scaler.get_scale());
    scaler.step(first);
    scaler.update();
  }
  first.set_scalar("tau", 0.3);
  first.save(path, scaler);
  std::vector<std::vector<double>> saved_weights = a.weight_values();  // the caller saves these with the model
  // The uninterrupted run...
  for (int it = 2; it < 4; ++it) {
    a.set_grads(700 + it, scaler.get_scale());
    scaler.step(first);
    scaler.update();
  }
  // ...and one resumed from the checkpoint, with the same weights, from a fresh optimizer.
  Optimizer second(lion_soft_sign(), b.params(), o);
  GradScaler restored("cpu");
  for (std::size_t t = 0; t < kSizes.size(); ++t)  // the model's weights, restored with it
    for (std::int64_t i = 0; i < kSizes[t]; ++i) b.weights.set(t, i, saved_weights[t][static_cast<std::size_t>(i)]);
  second.load(path, restored);
  EXPECT_EQ(second.scalar("tau"), 0.3);
  EXPECT_EQ(second.step_count(), 2);
  for (int it = 2; it < 4; ++it) {
    b.set_grads(700 + it, restored.get_scale());
    restored.step(second);
    restored.update();
  }
  EXPECT_EQ(written(second, b), written(first, a));

  // Another program (or a built-in) does not load it, and changes nothing.
  Net c(DType::bf16, DType::f32);
  Optimizer sgd(my_sgd(), c.params(), o);
  EXPECT_THAT(error_of([&] { sgd.load(path); }), AllOf(HasSubstr("update program 'lion_soft_sign'"), HasSubstr("my_sgd")));
  Optimizer lion(optim::Lion{}, c.params(), o);
  EXPECT_THAT(error_of([&] { lion.load(path); }),
              AllOf(HasSubstr("custom update program 'lion_soft_sign'"), HasSubstr("this one is Lion")));
  const int lt = find_instr(kLionSoftSign, Op::cmp_lt);
  UpdateProgram changed = [&] {
    Program p = kLionSoftSign;
    p.code[lt].op = Op::cmp_le;  // tau < |c| -> tau <= |c|
    return UpdateProgram(p, lion_soft_sign().scalars());
  }();
  Optimizer variant(changed, c.params(), o);
  const std::vector<unsigned char> untouched = written(variant, c);
  EXPECT_THAT(error_of([&] { variant.load(path); }),
              AllOf(HasSubstr("different custom update program"), HasSubstr("saved '  %" + std::to_string(lt) + " = lt "),
                    HasSubstr("here '  %" + std::to_string(lt) + " = le ")));
  EXPECT_EQ(written(variant, c), untouched);
  std::filesystem::remove(path);
}

TEST(CustomProgram, LossScaleOptimizerDelegatesFixedScalars) {
  Net n(DType::f32, DType::f32);
  Optimizer opt(lion_soft_sign(), n.params());
  LossScaleOptimizer lso(opt);
  EXPECT_EQ(lso.get_hyper("learning_rate"), 0.05);
  lso.set_hyper("lr", 0.02);
  EXPECT_EQ(opt.lr(), 0.02);
  lso.set_hyper("beta2", 0.9);
  EXPECT_EQ(opt.scalar("beta2"), 0.9);
  EXPECT_THAT(error_of([&] { (void)lso.get_hyper("gscale"); }), HasSubstr("not a hyperparameter"));
  const auto names = lso.hyper_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "learning_rate"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "tau"), names.end());
  n.set_grads(1, lso.loss_scale());
  EXPECT_TRUE(lso.minimize([](double) {}));
  EXPECT_EQ(opt.step_count(), 1);
}

// ---- On a GPU: bitwise the CPU ----------------------------------------------------------

struct DeviceCopy {
  explicit DeviceCopy(const TensorView& host) : bytes(static_cast<std::size_t>(host.numel) * dtype_size(host.dtype)) {
    cuda::check(cuda::driver()->cuMemAlloc(&ptr, std::max<std::size_t>(bytes, 4)), "cuMemAlloc");
    if (bytes) cuda::check(cuda::driver()->cuMemcpyHtoD(ptr, host.data, bytes), "cuMemcpyHtoD");
    view = {reinterpret_cast<void*>(ptr), host.numel, host.dtype};
  }
  ~DeviceCopy() { cuda::driver()->cuMemFree(ptr); }
  void to_host(void* dst) const {
    if (bytes) cuda::check(cuda::driver()->cuMemcpyDtoH(dst, ptr, bytes), "cuMemcpyDtoH");
  }
  void from_host(const void* src) const {
    if (bytes) cuda::check(cuda::driver()->cuMemcpyHtoD(ptr, src, bytes), "cuMemcpyHtoD");
  }
  std::size_t bytes;
  cuda::CUdeviceptr ptr = 0;
  TensorView view;
};

TEST(CustomProgramGpu, SameProgramIsBitwiseTheCpu) {
  if (const CudaStatus s = cuda_available(); !s) GTEST_SKIP() << "no GPU: " << s.reason;
  detail::CudaContext context(0);  // current on this thread for the copies
  for (const bool lion : {true, false}) {
    SCOPED_TRACE(lion ? "lion_soft_sign" : "my_sgd");
    Net host(DType::bf16, DType::bf16), dev_host(DType::bf16, DType::bf16);  // dev_host: the GPU's results, copied back
    std::vector<std::unique_ptr<DeviceCopy>> w, g;
    std::vector<Param> dparams;
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      w.push_back(std::make_unique<DeviceCopy>(host.weights[t]));
      g.push_back(std::make_unique<DeviceCopy>(host.grads[t]));
      dparams.push_back({w.back()->view, g.back()->view});
    }
    OptimizerOptions o;
    o.max_grad_norm = 20.0;
    const UpdateProgram program = lion ? lion_soft_sign() : my_sgd();
    Optimizer cpu(program, host.params(), o);
    OptimizerOptions go = o;
    go.device = Device::cuda(0);
    Optimizer gpu(program, dparams, go);
    for (int step = 1; step <= 3; ++step) {
      if (step == 3) {
        const jit::CacheStats before = jit::KernelCache::shared().stats();
        cpu.set_lr(0.02);
        gpu.set_lr(0.02);
        EXPECT_EQ(jit::KernelCache::shared().stats().compiles, before.compiles);
      }
      host.set_grads(800 + step, 1024);
      for (std::size_t t = 0; t < kSizes.size(); ++t) g[t]->from_host(host.grads[t].data);
      cpu.step_scaled(1024);
      gpu.step_scaled(1024);
      EXPECT_EQ(gpu.last_result().grad_norm, cpu.last_result().grad_norm);
    }
    for (std::size_t t = 0; t < kSizes.size(); ++t) w[t]->to_host(dev_host.weights[t].data);
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      ASSERT_EQ(std::memcmp(dev_host.weights[t].data, host.weights[t].data, w[t]->bytes), 0) << "weights " << t;
      for (std::string_view name : cpu.state_names())
        ASSERT_EQ(std::memcmp(gpu.state(t, name).data(), cpu.state(t, name).data(), cpu.state(t, name).size_bytes()), 0)
            << name << " " << t;
      ASSERT_EQ(std::memcmp(gpu.master(t).data(), cpu.master(t).data(), cpu.master(t).size_bytes()), 0) << "master " << t;
    }
  }
}

}  // namespace
}  // namespace stepfuse
