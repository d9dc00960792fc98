// Two-phase update programs (per-tensor reductions: the phase marker, reduce_sumsq,
// tensor_norm): validation of malformed programs (C++ and C), the program text, a
// user's LARS-like trust ratio (C++ builder and C ABI) on every CPU backend, bitwise
// alike among the fused ones and against a float64 LARS, the per-tensor norms'
// canonical order for any thread count, and checkpoints.
#include <gmock/gmock-matchers.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "jit/llvm/emit_llvm.hpp"
#include "jit/program_analysis.hpp"
#include "reference/lars_program.hpp"
#include "reference/test_data.hpp"
#include "reference/test_util.hpp"
#include "stepfuse/emit.hpp"
#include "stepfuse/stepfuse.h"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ref::HostTensors;
using ref::Random;

// ---- The programs ------------------------------------------------------------------------

// LARS, a user's two-phase program (tests/reference/lars_program.hpp).
using ref::kLars;
using ref::lars;
using ref::LarsHyper;
constexpr LarsHyper kLarsHyper{};

// Phase 2 stores each tensor's norm of the unscaled gradients (phase 1's slot 0) into a
// state stream, and the weights unchanged: the per-tensor norms as the optimizer sees them.
constexpr Program make_norm_probe() {
  ProgramBuilder b("norm_probe");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream norm = b.stream("norm", StreamRole::state);
  const Value raw = b.load(grad);  // one op per statement: a fixed order (the text is checked)
  const Value gscale = b.scalar("gscale");
  b.reduce_sumsq(0, b.mul(raw, gscale));
  b.phase();
  b.store(norm, b.tensor_norm(0));
  b.store(param, b.load(param));
  return b.build();
}
constexpr Program kNormProbe = make_norm_probe();
UpdateProgram norm_probe() { return UpdateProgram(kNormProbe, {UpdateProgram::gscale()}); }

// ---- Validation ------------------------------------------------------------------------------

std::string build_error(const std::function<void(ProgramBuilder&, Stream g, Stream p, Stream m)>& body) {
  return ref::thrown_text(
      [&] {
        ProgramBuilder b("broken");
        const Stream g = b.stream("grad", StreamRole::grad);
        const Stream p = b.stream("param", StreamRole::param);
        const Stream m = b.stream("m", StreamRole::state);
        body(b, g, p, m);
        (void)b.build();
      },
      ErrorCode::invalid_argument);
}

TEST(TwoPhaseValidation, MalformedProgramsAreRejectedNamingTheOpAndTheProblem) {
  // tensor_norm in phase 1
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                const Value n = b.tensor_norm(0);
                b.reduce_sumsq(0, b.load(g));
                b.phase();
                b.store(p, b.add(b.load(p), n));
              }),
              AllOf(HasSubstr("at op 'tensor_norm' (instruction 0: %0 = tensor_norm r0)"),
                    HasSubstr("tensor_norm before the phase marker")));
  // the param stored in phase 1
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream m) {
                const Value x = b.load(g);
                b.reduce_sumsq(0, x);
                b.store(p, x);
                b.phase();
                b.store(m, b.tensor_norm(0));
              }),
              AllOf(HasSubstr("at op 'store' (instruction 2: store param, %0)"),
                    HasSubstr("the param stream is stored in phase 1"), HasSubstr("the phase marker is instruction 3")));
  // a slot out of range
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                b.reduce_sumsq(4, b.load(g));
                b.phase();
                b.store(p, b.load(p));
              }),
              AllOf(HasSubstr("at op 'reduce_sumsq' (instruction 1: reduce_sumsq r4, %0)"),
                    HasSubstr("the reduction slot is out of range (slot 4; use 0 to 3)")));
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                b.reduce_sumsq(0, b.load(g));
                b.phase();
                b.store(p, b.tensor_norm(-1));
              }),
              HasSubstr("the reduction slot is out of range (slot 255; use 0 to 3)"));
  // a slot read but never reduced, and one reduced twice
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                b.reduce_sumsq(0, b.load(g));
                b.phase();
                b.store(p, b.tensor_norm(2));
              }),
              AllOf(HasSubstr("tensor_norm reads a slot that phase 1 never reduces"), HasSubstr("(slot 2)")));
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                const Value x = b.load(g);
                b.reduce_sumsq(1, x);
                b.reduce_sumsq(1, x);
                b.phase();
                b.store(p, b.tensor_norm(1));
              }),
              AllOf(HasSubstr("a reduction slot is reduced twice"), HasSubstr("slot 1 is reduced by instruction 1")));
  // a phase-1 value in phase 2
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                const Value x = b.load(g);
                b.reduce_sumsq(0, x);
                b.phase();
                b.store(p, b.mul(x, b.tensor_norm(0)));
              }),
              AllOf(HasSubstr("an operand refers to a phase-1 value"),
                    HasSubstr("operand 1 is %0 of phase 1; the phase marker is instruction 2")));
  // reduce_sumsq in phase 2, a second marker, a marker without reductions, reductions without a marker
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                b.reduce_sumsq(0, b.load(g));
                b.phase();
                b.reduce_sumsq(1, b.load(g));
                b.store(p, b.load(p));
              }),
              HasSubstr("reduce_sumsq after the phase marker"));
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                b.reduce_sumsq(0, b.load(g));
                b.phase();
                b.phase();
                b.store(p, b.load(p));
              }),
              HasSubstr("at op 'phase' (instruction 3: phase): a program has at most one phase marker"));
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream, Stream p, Stream) {
                b.phase();
                b.store(p, b.load(p));
              }),
              HasSubstr("a phase marker without a reduce_sumsq before it"));
  EXPECT_THAT(build_error([](ProgramBuilder& b, Stream g, Stream p, Stream) {
                b.reduce_sumsq(0, b.load(g));
                b.store(p, b.load(p));
              }),
              HasSubstr("reduce_sumsq without a phase marker after it"));
  // a reduce_sumsq or the marker as an operand
  EXPECT_THAT(ref::thrown_text(
                  [] {
                    Program p = kNormProbe;
                    p.code[p.num_instrs - 1].a = 4;  // store param, <the phase marker>
                    validate(p);
                  },
                  ErrorCode::invalid_argument),
              HasSubstr("an operand refers to the phase marker or a reduce_sumsq, which have no value"));
}

TEST(TwoPhaseValidation, AStoredStateReadsAsStoredInPhase2) {
  // A load after a store is an error within a phase, not across the marker.
  ProgramBuilder b("state_across");
  const Stream g = b.stream("grad", StreamRole::grad);
  const Stream p = b.stream("param", StreamRole::param);
  const Stream m = b.stream("m", StreamRole::state);
  const Value x = b.mul(b.load(g), b.scalar("gscale"));
  b.store(m, x);
  b.reduce_sumsq(0, x);
  b.phase();
  b.store(p, b.sub(b.load(p), b.mul(b.load(m), b.tensor_norm(0))));
  EXPECT_NO_THROW(UpdateProgram(b.build(), {UpdateProgram::gscale()}));
  const jit::PhaseStreamUse use = jit::phase_stream_use(b.build());
  EXPECT_TRUE(use.part[0].stores[2] && use.part[1].loads[2] && !use.part[0].loads[2] && !use.part[1].stores[2]);
  EXPECT_TRUE(use.part[1].stores[1] && !use.part[0].stores[1]);
}

// ---- The text ----------------------------------------------------------------------------------

TEST(TwoPhaseText, ListsThePhasesAndRoundTripsThroughBothBuilders) {
  EXPECT_EQ(to_string(kNormProbe),
            "program norm_probe\n"
            "  stream grad : grad\n"
            "  stream param : param\n"
            "  stream norm : state\n"
            "  scalar gscale\n"
            "  %0 = load grad\n"
            "  %1 = scalar gscale\n"
            "  %2 = mul %0, %1\n"
            "  reduce_sumsq r0, %2\n"
            "  phase\n"
            "  %5 = tensor_norm r0\n"
            "  store norm, %5\n"
            "  %7 = load param\n"
            "  store param, %7\n");
  // The lowered program shows the phases too.
  const std::string lowered = jit::to_string(jit::lower(kNormProbe, DType::f32, DType::f32, false));
  EXPECT_THAT(lowered, HasSubstr("r0 = reduce"));
  EXPECT_THAT(lowered, HasSubstr("phase\n"));
  EXPECT_THAT(lowered, HasSubstr("norm0"));
  // The same program through the C ABI has the same text.
  sf_program_builder* b = nullptr;
  ASSERT_EQ(sf_program_builder_create("norm_probe", &b), SF_OK);
  int grad = 0, param = 0, norm = 0;
  sf_value raw, gs, g, n, w;
  ASSERT_EQ(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad), SF_OK);
  ASSERT_EQ(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param), SF_OK);
  ASSERT_EQ(sf_program_builder_stream(b, "norm", SF_ROLE_STATE, 0.0f, &norm), SF_OK);
  ASSERT_EQ(sf_program_builder_load(b, grad, &raw), SF_OK);
  ASSERT_EQ(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &gs), SF_OK);
  ASSERT_EQ(sf_program_builder_op(b, SF_OP_MUL, raw, gs, 0, &g), SF_OK);
  ASSERT_EQ(sf_program_builder_reduce_sumsq(b, 0, g), SF_OK);
  ASSERT_EQ(sf_program_builder_phase(b), SF_OK);
  ASSERT_EQ(sf_program_builder_tensor_norm(b, 0, &n), SF_OK);
  ASSERT_EQ(sf_program_builder_store(b, norm, n), SF_OK);
  ASSERT_EQ(sf_program_builder_load(b, param, &w), SF_OK);
  ASSERT_EQ(sf_program_builder_store(b, param, w), SF_OK);
  sf_program* prog = nullptr;
  ASSERT_EQ(sf_program_builder_build(b, &prog), SF_OK) << sf_last_error();
  sf_program_builder_destroy(b);
  std::size_t needed = 0;
  ASSERT_EQ(sf_program_text(prog, nullptr, 0, &needed), SF_OK);
  std::string text(needed, '\0');
  ASSERT_EQ(sf_program_text(prog, text.data(), text.size(), &needed), SF_OK);
  text.resize(text.find('\0') == std::string::npos ? text.size() : text.find('\0'));
  EXPECT_EQ(text, norm_probe().text());
  sf_program_destroy(prog);
}

// ---- The C ABI ---------------------------------------------------------------------------------

// LARS through the C builder, op for op as make_lars() builds it.
sf_program* c_lars(const LarsHyper& h) {
  sf_program_builder* b = nullptr;
  if (sf_program_builder_create("lars", &b) != SF_OK) return nullptr;
  int grad = 0, param = 0, momentum = 0;
  sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad);
  sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param);
  sf_program_builder_stream(b, "momentum_buffer", SF_ROLE_STATE, 0.0f, &momentum);
  sf_value raw, gs, g1, p1, w, raw2, g, wn, gn, wd, eta, t0, t1, t2, raw_trust, zero, e0, e1, either, one, trust, t3, d,
      mu, vm, vo, lr, step, t4, v, out;
  sf_program_builder_load(b, grad, &raw);
  sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &gs);
  sf_program_builder_op(b, SF_OP_MUL, raw, gs, 0, &g1);
  sf_program_builder_load(b, param, &p1);
  sf_program_builder_reduce_sumsq(b, 0, p1);
  sf_program_builder_reduce_sumsq(b, 1, g1);
  sf_program_builder_phase(b);
  sf_program_builder_load(b, param, &w);
  sf_program_builder_load(b, grad, &raw2);
  sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &gs);
  sf_program_builder_op(b, SF_OP_MUL, raw2, gs, 0, &g);
  sf_program_builder_tensor_norm(b, 0, &wn);
  sf_program_builder_tensor_norm(b, 1, &gn);
  sf_program_builder_scalar(b, "weight_decay", SF_SCALAR_FIXED, h.weight_decay, 0.0, &wd);
  sf_program_builder_scalar(b, "eta", SF_SCALAR_FIXED, h.eta, 0.0, &eta);
  sf_program_builder_op(b, SF_OP_MUL, eta, wn, 0, &t0);
  sf_program_builder_op(b, SF_OP_MUL, wd, wn, 0, &t1);
  sf_program_builder_op(b, SF_OP_ADD, gn, t1, 0, &t2);
  sf_program_builder_op(b, SF_OP_DIV, t0, t2, 0, &raw_trust);
  sf_program_builder_constant(b, 0.0f, &zero);
  sf_program_builder_op(b, SF_OP_EQ, wn, zero, 0, &e0);
  sf_program_builder_op(b, SF_OP_EQ, gn, zero, 0, &e1);
  sf_program_builder_op(b, SF_OP_MAX, e0, e1, 0, &either);
  sf_program_builder_constant(b, 1.0f, &one);
  sf_program_builder_op(b, SF_OP_SELECT, either, one, raw_trust, &trust);
  sf_program_builder_op(b, SF_OP_MUL, wd, w, 0, &t3);
  sf_program_builder_op(b, SF_OP_ADD, g, t3, 0, &d);
  sf_program_builder_scalar(b, "momentum", SF_SCALAR_FIXED, h.momentum, 0.0, &mu);
  sf_program_builder_load(b, momentum, &vo);
  sf_program_builder_op(b, SF_OP_MUL, mu, vo, 0, &vm);
  sf_program_builder_scalar(b, "lr", SF_SCALAR_FIXED, h.lr, 0.0, &lr);
  sf_program_builder_op(b, SF_OP_MUL, lr, trust, 0, &step);
  sf_program_builder_op(b, SF_OP_MUL, step, d, 0, &t4);
  sf_program_builder_op(b, SF_OP_ADD, vm, t4, 0, &v);
  sf_program_builder_store(b, momentum, v);
  sf_program_builder_op(b, SF_OP_SUB, w, v, 0, &out);
  sf_program_builder_store(b, param, out);
  sf_program* prog = nullptr;
  const sf_status st = sf_program_builder_build(b, &prog);
  EXPECT_EQ(st, SF_OK) << sf_last_error();
  sf_program_builder_destroy(b);
  return prog;
}

TEST(TwoPhaseCApi, MalformedProgramsAndBadSlotsAreRejected) {
  sf_program_builder* b = nullptr;
  ASSERT_EQ(sf_program_builder_create("broken", &b), SF_OK);
  int grad = 0, param = 0;
  sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad);
  sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param);
  sf_value x, n;
  EXPECT_EQ(sf_program_builder_reduce_sumsq(b, 4, 0), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), HasSubstr("sf_program_builder_reduce_sumsq: slot = 4 is not a reduction slot (use 0 to 3)"));
  EXPECT_EQ(sf_program_builder_tensor_norm(b, -1, &n), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), HasSubstr("slot = -1 is not a reduction slot"));
  EXPECT_EQ(sf_program_builder_tensor_norm(b, 0, nullptr), SF_INVALID_ARGUMENT);
  EXPECT_EQ(sf_program_builder_phase(nullptr), SF_INVALID_ARGUMENT);
  // tensor_norm in phase 1, the param stored in phase 1
  ASSERT_EQ(sf_program_builder_tensor_norm(b, 0, &n), SF_OK);
  ASSERT_EQ(sf_program_builder_load(b, grad, &x), SF_OK);
  ASSERT_EQ(sf_program_builder_reduce_sumsq(b, 0, x), SF_OK);
  ASSERT_EQ(sf_program_builder_store(b, param, x), SF_OK);
  ASSERT_EQ(sf_program_builder_phase(b), SF_OK);
  sf_program* prog = nullptr;
  EXPECT_EQ(sf_program_builder_build(b, &prog), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), HasSubstr("at op 'tensor_norm' (instruction 0: %0 = tensor_norm r0)"));
  EXPECT_EQ(prog, nullptr);
  sf_program_builder_destroy(b);

  ASSERT_EQ(sf_program_builder_create("broken2", &b), SF_OK);
  sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad);
  sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param);
  ASSERT_EQ(sf_program_builder_load(b, grad, &x), SF_OK);
  ASSERT_EQ(sf_program_builder_reduce_sumsq(b, 0, x), SF_OK);
  ASSERT_EQ(sf_program_builder_store(b, param, x), SF_OK);
  ASSERT_EQ(sf_program_builder_phase(b), SF_OK);
  EXPECT_EQ(sf_program_builder_build(b, &prog), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), HasSubstr("the param stream is stored in phase 1"));
  sf_program_builder_destroy(b);
}

// ---- Running them ----------------------------------------------------------------------------

struct RunSetup {
  DType weight = DType::f32, grad = DType::f32;
  bool masters = true;
  std::vector<std::int64_t> sizes = {0, 1, 7, 33, 1000, 16384, 40000};
  std::optional<double> max_grad_norm;
  int threads = 0;
  Fusion fusion = Fusion::fused;
  std::optional<CpuBackend> backend;
};

OptimizerOptions options_of(const RunSetup& s) {
  OptimizerOptions o;
  o.master_weights = s.masters;
  o.max_grad_norm = s.max_grad_norm;
  o.num_threads = s.threads;
  o.fusion = s.fusion;
  o.cpu_backend = s.backend;
  return o;
}

// Weights, gradients and an optimizer running `program`.
struct ProgramRun {
  ProgramRun(const UpdateProgram& program, const RunSetup& s, std::uint64_t seed = 7)
      : weights(s.weight, s.sizes, false), grads(s.grad, s.sizes, false), rng(seed),
        opt((fill(), program), params(), options_of(s)) {}
  int fill() {
    for (std::size_t i = 0; i < weights.size(); ++i)
      for (std::int64_t j = 0; j < weights[i].numel; ++j) weights.set(i, j, rng.normal());
    return 0;
  }
  std::vector<Param> params() const {
    std::vector<Param> p;
    for (std::size_t i = 0; i < weights.size(); ++i) p.push_back({weights[i], grads[i]});
    return p;
  }
  // Gradients N(0, factor^2) times S, and step_scaled(S).
  StepResult step(double factor, double scale) {
    for (std::size_t i = 0; i < grads.size(); ++i)
      for (std::int64_t j = 0; j < grads[i].numel; ++j) grads.set(i, j, rng.normal() * factor * scale);
    return opt.step_scaled(scale);
  }
  // Every byte the optimizer owns or writes.
  std::vector<std::uint32_t> bits() const {
    std::vector<std::uint32_t> out;
    for (const auto& w : weights.snapshot())
      for (unsigned char c : w) out.push_back(c);
    for (std::size_t i = 0; i < weights.size(); ++i) {
      for (float m : opt.master(i)) out.push_back(std::bit_cast<std::uint32_t>(m));
      for (std::string_view name : opt.state_names())
        for (float x : opt.state(i, name)) out.push_back(std::bit_cast<std::uint32_t>(x));
    }
    return out;
  }
  HostTensors weights, grads;
  Random rng;
  Optimizer opt;
};

// float64 LARS of one tensor, from the values the step started from.
void lars_reference(const LarsHyper& h, std::vector<double>& w, std::vector<double>& v, const std::vector<double>& g) {
  double ws = 0, gs = 0;
  for (std::size_t j = 0; j < w.size(); ++j) ws += w[j] * w[j], gs += g[j] * g[j];
  const double wn = std::sqrt(ws), gn = std::sqrt(gs);
  const double trust = wn == 0 || gn == 0 ? 1.0 : h.eta * wn / (gn + h.weight_decay * wn);
  for (std::size_t j = 0; j < w.size(); ++j) {
    v[j] = h.momentum * v[j] + h.lr * trust * (g[j] + h.weight_decay * w[j]);
    w[j] -= v[j];
  }
}

// One scaled step of `run` against the float64 LARS from the optimizer's previous state.
void check_lars_step(ProgramRun& r, double factor, double scale, double rtol) {
  std::vector<std::vector<double>> w, v;
  for (std::size_t i = 0; i < r.weights.size(); ++i) {
    const auto m = r.opt.master(i);
    w.push_back(m.empty() ? r.weights.values(i) : std::vector<double>(m.begin(), m.end()));
    const auto s = r.opt.state(i, "momentum_buffer");
    v.emplace_back(s.begin(), s.end());
  }
  const StepResult res = r.step(factor, scale);
  ASSERT_TRUE(res.applied);
  double max_step = 0;
  for (std::size_t i = 0; i < r.weights.size(); ++i) {
    std::vector<double> g = r.grads.values(i);
    for (double& x : g) x = x / scale * res.clip_coef;
    std::vector<double> before = w[i];
    lars_reference(kLarsHyper, w[i], v[i], g);
    for (std::size_t j = 0; j < g.size(); ++j) max_step = std::max(max_step, std::fabs(w[i][j] - before[j]));
  }
  int bad = 0;
  for (std::size_t i = 0; i < r.weights.size(); ++i) {
    const auto m = r.opt.master(i);
    const auto s = r.opt.state(i, "momentum_buffer");
    for (std::size_t j = 0; j < w[i].size(); ++j) {
      const double got = m.empty() ? r.weights.get(i, static_cast<std::int64_t>(j)) : m[j];
      if (std::fabs(got - w[i][j]) > rtol * std::fabs(w[i][j]) + 1e-4 * max_step && bad++ < 5)
        ADD_FAILURE() << "weight[" << i << "][" << j << "] = " << got << ", float64 LARS " << w[i][j];
      if (std::fabs(s[j] - v[i][j]) > rtol * std::fabs(v[i][j]) + 1e-4 * max_step && bad++ < 5)
        ADD_FAILURE() << "momentum[" << i << "][" << j << "] = " << s[j] << ", float64 LARS " << v[i][j];
    }
  }
}

TEST(TwoPhaseLars, MatchesFloat64LarsAndIsBitwiseAlikeOnEveryFusedCpuBackend) {
  for (bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "clipped at 5" : "no clipping");
    RunSetup s;
    if (clip) s.max_grad_norm = 5.0;
    ProgramRun checked(lars(), s);
    for (int k = 0; k < 3; ++k) check_lars_step(checked, k == 1 ? 0.1 : 1.0, 1024.0, 2e-5);

    // The interpreter (a custom program's fused path), any thread count, the LLVM kernels.
    std::vector<std::uint32_t> first;
    for (int threads : {1, 2, 5}) {
      RunSetup t = s;
      t.threads = threads;
      t.backend = CpuBackend::highway;
      ProgramRun r(lars(), t, 11);
      for (int k = 0; k < 3; ++k) ASSERT_TRUE(r.step(k == 1 ? 0.1 : 1.0, 1024.0).applied);
      EXPECT_EQ(r.opt.backend(), "interpreter");
      if (first.empty()) first = r.bits();
      else EXPECT_TRUE(r.bits() == first) << threads << " threads differ from 1";
    }
    if (jit::llvm_built()) {
      RunSetup t = s;
      t.threads = 3;
      t.backend = CpuBackend::llvm;
      ProgramRun r(lars(), t, 11);
      for (int k = 0; k < 3; ++k) ASSERT_TRUE(r.step(k == 1 ? 0.1 : 1.0, 1024.0).applied);
      EXPECT_EQ(r.opt.backend(), "llvm");
      EXPECT_TRUE(r.bits() == first) << "LLVM differs from the interpreter";
    }
    // The unfused baseline: the float64 LARS within fp32 rounding.
    RunSetup u = s;
    u.fusion = Fusion::unfused;
    ProgramRun unfused(lars(), u);
    for (int k = 0; k < 3; ++k) check_lars_step(unfused, k == 1 ? 0.1 : 1.0, 1024.0, 2e-5);
  }
}

TEST(TwoPhaseLars, StorageCombinationsWithAndWithoutMasters) {
  for (DType w : {DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::bf16})
      for (bool masters : {true, false}) {
        SCOPED_TRACE(std::string(dtype_name(w)) + "/" + std::string(dtype_name(g)) + (masters ? " masters" : ""));
        RunSetup s;
        s.weight = w, s.grad = g, s.masters = masters, s.sizes = {3, 16385, 0, 100};
        std::vector<std::uint32_t> interpreted;
        {
          RunSetup t = s;
          t.backend = CpuBackend::highway;
          ProgramRun r(lars(), t, 5);
          for (int k = 0; k < 2; ++k) ASSERT_TRUE(r.step(1.0, 256.0).applied);
          interpreted = r.bits();
        }
        if (jit::llvm_built()) {
          RunSetup t = s;
          t.backend = CpuBackend::llvm;
          ProgramRun r(lars(), t, 5);
          for (int k = 0; k < 2; ++k) ASSERT_TRUE(r.step(1.0, 256.0).applied);
          EXPECT_TRUE(r.bits() == interpreted) << "LLVM differs from the interpreter";
        }
      }
}

TEST(TwoPhaseLars, TheCApiProgramRunsBitwiseAsTheCppOne) {
  sf_program* prog = c_lars(kLarsHyper);
  ASSERT_NE(prog, nullptr);
  std::size_t needed = 0;
  ASSERT_EQ(sf_program_text(prog, nullptr, 0, &needed), SF_OK);
  std::string text(needed, '\0');
  ASSERT_EQ(sf_program_text(prog, text.data(), text.size(), &needed), SF_OK);
  text.resize(text.find('\0') == std::string::npos ? text.size() : text.find('\0'));
  // The C builder declares the scalars in use order, the C++ one likewise: the same text.
  EXPECT_EQ(text, lars().text());

  RunSetup s;
  s.sizes = {5, 20000, 33};
  ProgramRun cpp(lars(), s, 3);
  HostTensors weights(DType::f32, s.sizes, false), grads(DType::f32, s.sizes, false);
  for (std::size_t i = 0; i < weights.size(); ++i)
    for (std::int64_t j = 0; j < weights[i].numel; ++j) weights.set(i, j, cpp.weights.get(i, j));
  std::vector<sf_param> params;
  for (std::size_t i = 0; i < weights.size(); ++i)
    params.push_back({{weights[i].data, weights[i].numel, SF_F32}, {grads[i].data, grads[i].numel, SF_F32}});
  sf_optimizer_options options;
  sf_optimizer_options_init(&options);
  sf_optimizer* opt = nullptr;
  ASSERT_EQ(sf_optimizer_create_custom(prog, params.data(), params.size(), &options, &opt), SF_OK) << sf_last_error();
  sf_program_destroy(prog);
  for (int k = 0; k < 3; ++k) {
    cpp.step(1.0, 512.0);
    for (std::size_t i = 0; i < grads.size(); ++i)
      for (std::int64_t j = 0; j < grads[i].numel; ++j) grads.set(i, j, cpp.grads.get(i, j));
    sf_step_result r;
    sf_step_result_init(&r);
    ASSERT_EQ(sf_optimizer_step_scaled(opt, 512.0, &r), SF_OK) << sf_last_error();
  }
  EXPECT_EQ(weights.snapshot(), cpp.weights.snapshot());
  sf_optimizer_destroy(opt);
}

// ---- The per-tensor norms' order -------------------------------------------------------------

// The canonical sum of squares (docs/architecture.md §5) written out plainly: per chunk
// of 16384, element i into fp32 lane i mod 32, the lanes by the fixed tree; the chunks
// in fp64 in order; sqrt, rounded to fp32.
float canonical_norm(const std::vector<float>& x) {
  double total = 0;
  for (std::size_t c = 0; c < x.size(); c += 16384) {
    float lanes[32] = {};
    for (std::size_t i = c; i < std::min(x.size(), c + 16384); ++i) lanes[(i - c) % 32] += x[i] * x[i];
    for (int w = 16; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
    total += lanes[0];
  }
  return static_cast<float>(std::sqrt(total));
}

TEST(TwoPhaseNorms, AreTheCanonicalOrderForAnyThreadCountAndBackend) {
  RunSetup s;
  s.sizes = {1, 31, 32, 33, 16383, 16384, 16385, 0, 50000, 100003};
  std::vector<std::uint32_t> first;
  const auto check = [&](RunSetup t, const char* what) {
    SCOPED_TRACE(what);
    ProgramRun r(norm_probe(), t, 21);
    ASSERT_TRUE(r.step(1.0, 1024.0).applied);  // S a power of two: g * (1/S) is exact
    const std::vector<double>& grad_norms = r.opt.last_tensor_grad_norms();
    std::vector<std::uint32_t> bits;
    for (std::size_t i = 0; i < r.weights.size(); ++i) {
      const auto norm = r.opt.state(i, "norm");
      std::vector<float> g(static_cast<std::size_t>(r.grads[i].numel));
      for (std::size_t j = 0; j < g.size(); ++j) g[j] = static_cast<float>(r.grads.get(i, static_cast<std::int64_t>(j)) / 1024.0);
      const float want = canonical_norm(g);
      for (float x : norm) EXPECT_EQ(std::bit_cast<std::uint32_t>(x), std::bit_cast<std::uint32_t>(want)) << "tensor " << i;
      // The reduce pass's per-tensor norm (fp64 sqrt, / S) in the same order: the same value.
      if (!norm.empty() && t.fusion != Fusion::unfused) {  // (unfused computes no norm without clipping)
        EXPECT_EQ(norm[0], static_cast<float>(grad_norms[i])) << "tensor " << i;
      }
      bits.push_back(std::bit_cast<std::uint32_t>(want));
    }
    if (first.empty()) first = bits;
    else EXPECT_EQ(bits, first);
  };
  for (int threads : {1, 2, 3, 7}) {
    RunSetup t = s;
    t.threads = threads;
    t.backend = CpuBackend::highway;
    check(t, ("interpreter, " + std::to_string(threads) + " threads").c_str());
  }
  if (jit::llvm_built()) {
    RunSetup t = s;
    t.threads = 4;
    t.backend = CpuBackend::llvm;
    check(t, "LLVM");
  }
  RunSetup u = s;
  u.fusion = Fusion::unfused;
  check(u, "unfused");
}

// ---- The emit API -----------------------------------------------------------------------------

TEST(TwoPhaseEmit, CpuTargetsHavePhase1FunctionsAndCudaTargetsSaySoClearly) {
  EmitRequest r{.program = lars(),
                .tensors = {{DType::bf16, DType::bf16, true}, {DType::f32, DType::f32, false}},
                .target = EmitTarget::cubin(90)};
  r.compile = false;
  EXPECT_THAT(ref::thrown_text([&] { (void)emit(r); }, ErrorCode::unsupported),
              AllOf(HasSubstr("'lars' has two phases"), HasSubstr("emit it for a CPU target")));
  if (!jit::llvm_built()) GTEST_SKIP() << "CPU targets need the LLVM backend";
  r.target = EmitTarget::cpu();
  const EmittedKernel k = emit(r);
  EXPECT_EQ(k.kernel_names, (std::vector<std::string>{"sf_cpu_update_bf16_bf16_m", "sf_cpu_update_f32_f32",
                                                      "sf_cpu_reduce_l2_bf16", "sf_cpu_reduce_l2_f32",
                                                      "sf_cpu_phase1_bf16_bf16_m", "sf_cpu_phase1_f32_f32"}));
  EXPECT_THAT(k.abi, HasSubstr("\"role\": \"phase1\""));
  EXPECT_THAT(k.abi, HasSubstr("\"SF_CPU_MAX_NORM_SLOTS\": 4"));
  EXPECT_THAT(k.abi_header,
              HasSubstr("void sf_cpu_phase1_f32_f32(const sf_cpu_update_args* args, uint64_t begin, uint64_t n, float* sums);"));
  EXPECT_THAT(k.abi_header, HasSubstr("const float* norms;"));
}

// ---- Checkpoints -------------------------------------------------------------------------------

TEST(TwoPhaseCheckpoint, SaveLoadContinuesBitForBit) {
  const std::string path = (std::filesystem::temp_directory_path() / "stepfuse_two_phase_test.ckpt").string();
  RunSetup s;
  s.sizes = {100, 20000};
  ProgramRun a(lars(), s, 9), b(lars(), s, 9);
  for (int k = 0; k < 2; ++k) a.step(1.0, 64.0), b.step(1.0, 64.0);
  a.opt.save(path);
  ProgramRun c(lars(), s, 9);
  for (std::size_t i = 0; i < c.weights.size(); ++i)
    for (std::int64_t j = 0; j < c.weights[i].numel; ++j) c.weights.set(i, j, a.weights.get(i, j));
  c.opt.load(path);
  c.rng = b.rng;
  for (int k = 0; k < 2; ++k) b.step(1.0, 64.0), c.step(1.0, 64.0);
  EXPECT_TRUE(c.bits() == b.bits());
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace stepfuse
