// The LLVM CPU backend (jit/llvm, runtime/cpu/llvm_backend) against the Highway backend:
//  - every built-in optimizer x dtype combination x {plain, scaled, clipped, inf-norm clipped,
//    track_grad_norm} step, over odd sizes around the vector width and the 16384-element
//    chunk, is bit for bit the Highway step after several steps: weights, masters, state,
//    the step's result and the per-tensor norms;
//  - a custom program using every op of the IR (select on NaN, sign, min/max with NaN, fma,
//    f16/bf16 rounding of huge, tiny and NaN values) matches the interpreter bit for bit;
//  - special gradients: inf/NaN skip the step alike, squares that overflow fp32 take the
//    same rescaled path, subnormals;
//  - CpuBackend::automatic starts on Highway and turns to LLVM once the background compile
//    is done, without a step ever waiting, bitwise equal throughout; thread counts do not
//    change results; STEPFUSE_CPU_BACKEND is honoured and checked;
//  - llvm_contract stays within fp32 rounding of Highway; the object code is deterministic,
//    cached on disk, and keys tell specs apart.
// Without LLVM in the build, the tests that need it skip, and CpuBackend::llvm is an Error.
#include <elf.h>
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "jit/builtins.hpp"
#include "jit/kernel_cache.hpp"
#include "jit/llvm/cpu_jit.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "reference/builtin_configs.hpp"
#include "reference/elf_reader.hpp"
#include "reference/test_util.hpp"
#include "runtime/cpu/kernels.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

bool have_llvm() { return llvm_version()[0] != '\0'; }
#define REQUIRE_LLVM() \
  if (!have_llvm()) GTEST_SKIP() << "this build has no LLVM backend"

// ---- Tensor lists ----------------------------------------------------------------------

struct TensorType {
  DType weight, grad;
};

// Sizes around the AVX2/AVX-512 vector widths, the reduce's 32 lanes and the 16384-element chunk.
const std::vector<std::int64_t> kSizes = {1, 7, 8, 9, 31, 33, 0, 16383, 16385, 40000, 3, 16};

// One tensor list: weights and grads in their own byte buffers, built from a seed.
struct List {
  List(const std::vector<TensorType>& cycle, const std::vector<std::int64_t>& sizes, std::uint32_t seed,
       float grad_scale = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const TensorType t = cycle[i % cycle.size()];
      types.push_back(t);
      std::vector<float> w(static_cast<std::size_t>(sizes[i])), g(w.size());
      for (float& x : w) x = normal(rng);
      for (float& x : g) x = normal(rng) * 0.05f * grad_scale;
      weights.push_back(store(w, t.weight));
      grads.push_back(store(g, t.grad));
    }
  }
  static std::vector<std::uint8_t> store(const std::vector<float>& v, DType t) {
    std::vector<std::uint8_t> out(v.size() * dtype_size(t) + 1);  // +1: never empty
    if (!v.empty()) from_float(v, TensorView{out.data(), static_cast<std::int64_t>(v.size()), t});
    return out;
  }
  std::vector<Param> params() {
    std::vector<Param> out;
    for (std::size_t i = 0; i < types.size(); ++i) {
      const std::int64_t n = static_cast<std::int64_t>((weights[i].size() - 1) / dtype_size(types[i].weight));
      out.push_back({{weights[i].data(), n, types[i].weight}, {grads[i].data(), n, types[i].grad}});
    }
    return out;
  }
  void set_grad(std::size_t t, std::size_t i, float v) {
    ASSERT_LT(i, (grads[t].size() - 1) / dtype_size(types[t].grad));
    const std::vector<float> one{v};
    from_float(one, TensorView{grads[t].data() + i * dtype_size(types[t].grad), 1, types[t].grad});
  }
  std::vector<TensorType> types;
  std::vector<std::vector<std::uint8_t>> weights, grads;
};

using ::testing::HasSubstr;
using NamedConfig = ref::NamedBuiltin;
const std::vector<NamedConfig>& configs() { return ref::one_config_per_program(); }

struct DtypeSet {
  const char* name;
  std::vector<TensorType> cycle;
  bool masters;
};
std::vector<DtypeSet> dtype_sets() {
  return {{"f32", {{DType::f32, DType::f32}}, true},
          {"bf16_masters", {{DType::bf16, DType::bf16}}, true},
          {"f16_masters", {{DType::f16, DType::f16}}, true},
          {"f16_no_masters", {{DType::f16, DType::f16}}, false},
          {"bf16_no_masters_f16g", {{DType::bf16, DType::f16}}, false},
          {"mixed",
           {{DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::f16, DType::f16}, {DType::f32, DType::bf16},
            {DType::f16, DType::f32}},
           true}};
}

enum class StepKind { plain, tracked, scaled, clipped, scaled_clipped_inf };
const char* kind_name(StepKind k) {
  switch (k) {
    case StepKind::plain: return "plain";
    case StepKind::tracked: return "tracked";
    case StepKind::scaled: return "scaled";
    case StepKind::clipped: return "clipped";
    case StepKind::scaled_clipped_inf: return "scaled_clipped_inf";
  }
  return "?";
}
constexpr double kLossScale = 1000.0;  // not a power of two: 1/S is rounded

OptimizerOptions options_for(StepKind k, bool masters, CpuBackend backend, int threads = 0) {
  OptimizerOptions o;
  o.master_weights = masters;
  o.cpu_backend = backend;
  o.num_threads = threads;
  if (k == StepKind::tracked) o.track_grad_norm = true;
  if (k == StepKind::clipped) o.max_grad_norm = 1.0;
  if (k == StepKind::scaled_clipped_inf) o.max_grad_norm = 0.02, o.norm_type = INFINITY;
  return o;
}
bool is_scaled(StepKind k) { return k == StepKind::scaled || k == StepKind::scaled_clipped_inf; }
StepResult take_step(Optimizer& o, StepKind k) {
  if (is_scaled(k)) return o.step_scaled(kLossScale);
  o.step();
  return o.last_result();
}

// Bitwise comparison of everything an optimizer owns or writes.
void expect_same(const Optimizer& a, const Optimizer& b, const List& la, const List& lb, const std::string& what) {
  EXPECT_EQ(a.step_count(), b.step_count()) << what;
  const StepResult& ra = a.last_result();
  const StepResult& rb = b.last_result();
  EXPECT_EQ(ra.applied, rb.applied) << what;
  EXPECT_EQ(ra.found_inf, rb.found_inf) << what;
  EXPECT_EQ(std::memcmp(&ra.grad_norm, &rb.grad_norm, sizeof(double)), 0) << what << ": grad_norm " << ra.grad_norm
                                                                           << " vs " << rb.grad_norm;
  EXPECT_EQ(std::memcmp(&ra.clip_coef, &rb.clip_coef, sizeof(double)), 0) << what;
  const auto& na = a.last_tensor_grad_norms();
  const auto& nb = b.last_tensor_grad_norms();
  ASSERT_EQ(na.size(), nb.size());
  for (std::size_t t = 0; t < na.size(); ++t)
    EXPECT_EQ(std::memcmp(&na[t], &nb[t], sizeof(double)), 0) << what << ": tensor " << t << " norm";
  for (std::size_t t = 0; t < la.weights.size(); ++t) {
    EXPECT_EQ(la.weights[t], lb.weights[t]) << what << ": weights of tensor " << t;
    const auto ma = a.master(t), mb = b.master(t);
    ASSERT_EQ(ma.size(), mb.size());
    if (!ma.empty()) {
      EXPECT_EQ(std::memcmp(ma.data(), mb.data(), ma.size_bytes()), 0) << what << ": master " << t;
    }
    for (std::string_view s : a.state_names()) {
      const auto sa = a.state(t, s), sb = b.state(t, s);
      ASSERT_EQ(sa.size(), sb.size());
      if (!sa.empty()) {
        EXPECT_EQ(std::memcmp(sa.data(), sb.data(), sa.size_bytes()), 0) << what << ": state " << s << " of tensor " << t;
      }
    }
  }
}

class CacheDir : public ::testing::Environment {
 public:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("stepfuse_llvm_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    std::filesystem::permissions(dir_, std::filesystem::perms::owner_all, std::filesystem::perm_options::replace);
    setenv("STEPFUSE_CACHE_DIR", dir_.c_str(), 1);
    unsetenv("STEPFUSE_CPU_BACKEND");
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  static inline std::filesystem::path dir_;
};
const auto* const kCacheDir = ::testing::AddGlobalTestEnvironment(new CacheDir);

// ---- Built-ins: LLVM vs Highway, bit for bit ------------------------------------------

struct Case {
  NamedConfig config;
  DtypeSet dtypes;
  StepKind kind;
};
std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const NamedConfig& c : configs())
    for (const DtypeSet& d : dtype_sets())
      for (StepKind k : {StepKind::plain, StepKind::tracked, StepKind::scaled, StepKind::clipped,
                         StepKind::scaled_clipped_inf})
        out.push_back({c, d, k});
  return out;
}

// gtest's (and CTest's) name for a case's parameter.
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.config.name << "_" << c.dtypes.name << "_" << kind_name(c.kind);
}

class BuiltinBitwise : public ::testing::TestWithParam<Case> {};

TEST_P(BuiltinBitwise, LlvmEqualsHighway) {
  REQUIRE_LLVM();
  const Case& c = GetParam();
  const float gs = is_scaled(c.kind) ? static_cast<float>(kLossScale) : 1.0f;
  List lh(c.dtypes.cycle, kSizes, 11, gs), ll(c.dtypes.cycle, kSizes, 11, gs);
  Optimizer high(c.config.config, lh.params(), options_for(c.kind, c.dtypes.masters, CpuBackend::highway));
  Optimizer llvm(c.config.config, ll.params(), options_for(c.kind, c.dtypes.masters, CpuBackend::llvm));
  ASSERT_EQ(high.backend(), "highway");
  ASSERT_EQ(llvm.backend(), "llvm");
  for (int step = 1; step <= 3; ++step) {
    take_step(high, c.kind);
    take_step(llvm, c.kind);
    expect_same(high, llvm, lh, ll, "step " + std::to_string(step));
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(AllBuiltins, BuiltinBitwise, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.config.name) + "_" + info.param.dtypes.name + "_" +
                                  kind_name(info.param.kind);
                         });

// ---- Special gradients -----------------------------------------------------------------

TEST(LlvmBackend, NonFiniteGradientsSkipAlike) {
  REQUIRE_LLVM();
  for (const DtypeSet& d : dtype_sets()) {
    for (float bad : {INFINITY, -INFINITY, NAN}) {
      for (double norm_type : {2.0, double(INFINITY)}) {
        List lh(d.cycle, kSizes, 5), ll(d.cycle, kSizes, 5);
        // At a chunk's last element, in the zero-padded tail of the reduce, and in the middle.
        for (List* l : {&lh, &ll}) l->set_grad(8, 16383, bad), l->set_grad(9, 39999, bad);
        OptimizerOptions oh = options_for(StepKind::scaled, d.masters, CpuBackend::highway);
        oh.norm_type = norm_type, oh.max_grad_norm = 1.0;
        OptimizerOptions ol = oh;
        ol.cpu_backend = CpuBackend::llvm;
        Optimizer high(optim::AdamW{}, lh.params(), oh), llvm(optim::AdamW{}, ll.params(), ol);
        high.step_scaled(kLossScale);
        const StepResult rl = llvm.step_scaled(kLossScale);
        EXPECT_FALSE(rl.applied);
        EXPECT_TRUE(rl.found_inf);
        expect_same(high, llvm, lh, ll, std::string(d.name) + " bad=" + std::to_string(bad));
        // A plain step without clipping does not check (PyTorch), but tracks the norm alike.
        OptimizerOptions th = options_for(StepKind::tracked, d.masters, CpuBackend::highway), tl = th;
        th.norm_type = tl.norm_type = norm_type;
        tl.cpu_backend = CpuBackend::llvm;
        List mh(d.cycle, kSizes, 6), ml(d.cycle, kSizes, 6);
        for (List* l : {&mh, &ml}) l->set_grad(0, 0, bad), l->set_grad(4, 30, bad);
        Optimizer th_opt(optim::SGD{}, mh.params(), th), tl_opt(optim::SGD{}, ml.params(), tl);
        th_opt.step();
        tl_opt.step();
        expect_same(th_opt, tl_opt, mh, ml, std::string(d.name) + " tracked bad=" + std::to_string(bad));
      }
    }
  }
}

// The inf-norm's max ignores NaNs on every CPU backend, as the CUDA kernels' sf_max: a NaN
// between a larger and a smaller value of its reduce lane (element i goes to lane i mod 32)
// leaves the larger. A max instruction that returns its second operand on a NaN (x86
// MAXPS) would restart the lane after the NaN, and report 0.25 here.
TEST(LlvmBackend, InfNormIgnoresNaNsOnEveryCpuBackend) {
  REQUIRE_LLVM();
  for (const CpuBackend backend : {CpuBackend::highway, CpuBackend::llvm}) {
    for (const Fusion fusion : {Fusion::fused, Fusion::unfused, Fusion::interpreted}) {
      std::vector<float> w(100, 1.0f), g(100, 0.25f);
      g[0] = 0.5f, g[32] = NAN, g[64] = 0.125f;  // all in lane 0
      OptimizerOptions o;
      o.cpu_backend = backend;
      o.fusion = fusion;
      o.norm_type = INFINITY;
      o.track_grad_norm = true;  // a plain step reduces without checking
      Optimizer opt(optim::SGD{}, {Param{{w.data(), 100, DType::f32}, {g.data(), 100, DType::f32}}}, o);
      opt.step();
      EXPECT_EQ(opt.last_tensor_grad_norms().at(0), 0.5)
          << (backend == CpuBackend::llvm ? "llvm" : "highway") << " fusion " << static_cast<int>(fusion);
    }
  }
}

TEST(LlvmBackend, OverflowingSquaresTakeTheSameRescaledPath) {
  REQUIRE_LLVM();
  // |g| ~ 1e20 at S = 2^70: the fp32 squares overflow, the norm is finite (docs/architecture.md §5).
  for (DType g : {DType::f32, DType::bf16}) {
    List lh({{DType::f32, g}}, {40000, 33}, 9, 1e21f), ll({{DType::f32, g}}, {40000, 33}, 9, 1e21f);
    OptimizerOptions oh = options_for(StepKind::clipped, true, CpuBackend::highway), ol = oh;
    ol.cpu_backend = CpuBackend::llvm;
    Optimizer high(optim::Adam{}, lh.params(), oh), llvm(optim::Adam{}, ll.params(), ol);
    high.step_scaled(std::ldexp(1.0, 70));
    const StepResult rl = llvm.step_scaled(std::ldexp(1.0, 70));
    EXPECT_TRUE(rl.applied);
    EXPECT_TRUE(std::isfinite(rl.grad_norm));
    expect_same(high, llvm, lh, ll, std::string("overflowing squares, grads ") + std::string(dtype_name(g)));
  }
}

TEST(LlvmBackend, SubnormalAndTinyValuesAlike) {
  REQUIRE_LLVM();
  for (const DtypeSet& d : dtype_sets()) {
    List lh(d.cycle, kSizes, 21, 1e-36f), ll(d.cycle, kSizes, 21, 1e-36f);  // fp32 subnormal squares
    OptimizerOptions oh = options_for(StepKind::clipped, d.masters, CpuBackend::highway), ol = oh;
    ol.cpu_backend = CpuBackend::llvm;
    Optimizer high(optim::RMSprop{}, lh.params(), oh), llvm(optim::RMSprop{}, ll.params(), ol);
    for (int s = 0; s < 2; ++s) high.step(), llvm.step();
    expect_same(high, llvm, lh, ll, d.name);
  }
}

// ---- Custom programs: every op ---------------------------------------------------------

// A program that uses every op, with values that reach NaN, infinities, signed zeros and
// the f16/bf16 rounding edge cases (huge values overflow f16; tiny ones are f16 subnormals).
Program make_every_op() {
  ProgramBuilder b("every_op");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream s1 = b.stream("s1", StreamRole::state, 0.5f);
  const Stream s2 = b.stream("s2", StreamRole::state, -1.0f);
  const Value g = b.mul(b.load(grad), b.scalar("gscale"));
  const Value p = b.load(param);
  const Value a = b.load(s1);
  const Value q = b.div(g, b.sub(a, b.constant(0.5f)));  // inf/NaN where a == 0.5 (step 1)
  const Value big = b.mul(p, b.scalar("huge"));           // overflows f16 and sometimes fp32
  const Value r16 = b.convert(big, DType::f16);
  const Value rb = b.convert(b.mul(g, b.scalar("tiny")), DType::bf16);
  const Value t16 = b.convert(b.mul(g, b.scalar("tiny")), DType::f16);
  const Value mx = b.max(q, b.neg(p));
  const Value mn = b.min(b.sqrt(b.abs(p)), q);  // min with NaN operands
  const Value sel = b.select(b.le(p, b.constant(0.0f)), b.sign(q), b.sign(b.sub(p, p)));
  const Value pick = b.select(q, mx, mn);  // q NaN selects like C: true
  const Value e = b.select(b.eq(a, b.constant(0.5f)), b.constant(1.0f), b.constant(2.0f));
  const Value f = b.fma(g, b.scalar("lr"), b.mul(pick, b.constant(1e-3f)));
  const Value upd = b.add(b.add(f, b.mul(sel, b.constant(1e-4f))), b.mul(b.add(rb, t16), e));
  b.store(param, b.sub(p, b.mul(b.scalar("lr"), b.select(b.lt(b.abs(upd), b.constant(1e30f)), upd, b.constant(0.0f)))));
  b.store(s1, b.add(b.mul(a, b.constant(0.9f)), b.mul(g, g)));
  b.store(s2, b.add(r16, b.mul(b.load(s2), b.constant(0.5f))));
  return b.build();
}

UpdateProgram every_op_program() {
  static const Program program = make_every_op();
  return UpdateProgram(program, {UpdateProgram::gscale("gscale"), UpdateProgram::fixed("huge", 3e4),
                                 UpdateProgram::fixed("tiny", 1e-4), UpdateProgram::fixed("lr", 0.01)});
}

TEST(LlvmBackend, CustomProgramWithEveryOpEqualsTheInterpreter) {
  REQUIRE_LLVM();
  for (const DtypeSet& d : dtype_sets()) {
    for (StepKind k : {StepKind::plain, StepKind::scaled, StepKind::clipped}) {
      const float gs = is_scaled(k) ? static_cast<float>(kLossScale) : 1.0f;
      List lh(d.cycle, kSizes, 31, gs), ll(d.cycle, kSizes, 31, gs);
      Optimizer interp(every_op_program(), lh.params(), options_for(k, d.masters, CpuBackend::highway));
      Optimizer llvm(every_op_program(), ll.params(), options_for(k, d.masters, CpuBackend::llvm));
      ASSERT_EQ(interp.backend(), "interpreter");
      ASSERT_EQ(llvm.backend(), "llvm");
      for (int s = 1; s <= 3; ++s) {
        take_step(interp, k);
        take_step(llvm, k);
        expect_same(interp, llvm, lh, ll, std::string(d.name) + " " + kind_name(k) + " step " + std::to_string(s));
        if (HasFailure()) return;
      }
    }
  }
}

// ---- Threads, modes, the environment ---------------------------------------------------

TEST(LlvmBackend, ThreadCountsDoNotChangeResults) {
  REQUIRE_LLVM();
  const DtypeSet d = dtype_sets().back();  // mixed
  List l1(d.cycle, kSizes, 41, kLossScale), l2(d.cycle, kSizes, 41, kLossScale);
  Optimizer one(optim::AdamW{}, l1.params(), options_for(StepKind::scaled, true, CpuBackend::llvm, 1));
  Optimizer two(optim::AdamW{}, l2.params(), options_for(StepKind::scaled, true, CpuBackend::llvm, 3));
  EXPECT_EQ(one.num_threads(), 1);
  EXPECT_EQ(two.num_threads(), 3);
  for (int s = 0; s < 3; ++s) one.step_scaled(kLossScale), two.step_scaled(kLossScale);
  expect_same(one, two, l1, l2, "1 thread vs 3");
}

TEST(LlvmBackend, AutomaticTurnsToLlvmWithoutWaitingAndStaysBitwiseEqual) {
  REQUIRE_LLVM();
  // A spec no other test compiles (Lion over f16 grads with bf16 weights, no masters, inf norm):
  // nothing is cached, so the compile runs on the background thread.
  const std::vector<TensorType> cycle = {{DType::bf16, DType::f16}, {DType::f32, DType::f16}};
  const std::vector<std::int64_t> sizes = {70001, 5, 16384};
  List lh(cycle, sizes, 51, kLossScale), la(cycle, sizes, 51, kLossScale);
  OptimizerOptions oh = options_for(StepKind::scaled_clipped_inf, false, CpuBackend::highway), oa = oh;
  oa.cpu_backend = CpuBackend::automatic;
  optim::Lion lion;
  lion.lr = 1e-3;
  Optimizer high(lion, lh.params(), oh), autom(lion, la.params(), oa);
  const std::string first(autom.backend());
  EXPECT_TRUE(first == "highway" || first == "llvm") << first;
  bool saw_llvm = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int steps = 0;
  while (std::chrono::steady_clock::now() < deadline && (!saw_llvm || steps < 4)) {
    const std::string before(autom.backend());
    high.step_scaled(kLossScale);
    autom.step_scaled(kLossScale);
    ++steps;
    saw_llvm |= before == "llvm";
    expect_same(high, autom, lh, la, "step " + std::to_string(steps) + " on " + before);
    if (HasFailure()) return;
    if (!saw_llvm) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(saw_llvm) << "the background compile did not finish within 120 s (" << steps << " steps)";
  EXPECT_EQ(autom.backend(), "llvm");
  // A second optimizer with the same spec links the compiled kernels at construction.
  List lb(cycle, sizes, 52, kLossScale);
  Optimizer again(lion, lb.params(), oa);
  EXPECT_EQ(again.backend(), "llvm");
}

TEST(LlvmBackend, EnvironmentChoosesTheBackendAndIsChecked) {
  List l({{DType::f32, DType::f32}}, {100}, 1);
  setenv("STEPFUSE_CPU_BACKEND", "highway", 1);
  EXPECT_EQ(Optimizer(optim::SGD{}, l.params()).backend(), "highway");
  setenv("STEPFUSE_CPU_BACKEND", "bogus", 1);
  EXPECT_THAT(ref::error_message([&] { Optimizer o(optim::SGD{}, l.params()); }, ErrorCode::invalid_argument),
              HasSubstr("auto, highway or llvm"))
      << "STEPFUSE_CPU_BACKEND=bogus";
  // The option wins over the environment.
  OptimizerOptions o;
  o.cpu_backend = CpuBackend::highway;
  EXPECT_EQ(Optimizer(optim::SGD{}, l.params(), o).backend(), "highway");
  setenv("STEPFUSE_CPU_BACKEND", "llvm", 1);
  if (have_llvm()) {
    EXPECT_EQ(Optimizer(optim::SGD{}, l.params()).backend(), "llvm");
  } else {
    EXPECT_THAT(ref::error_message([&] { Optimizer x(optim::SGD{}, l.params()); }, ErrorCode::unsupported),
                HasSubstr("llvm-14-dev"))
        << "CpuBackend::llvm without LLVM";
  }
  unsetenv("STEPFUSE_CPU_BACKEND");
  // Other fusion modes never use LLVM.
  OptimizerOptions un;
  un.fusion = Fusion::unfused;
  un.cpu_backend = have_llvm() ? CpuBackend::llvm : CpuBackend::highway;
  EXPECT_EQ(Optimizer(optim::SGD{}, l.params(), un).backend(), "unfused");
  un.fusion = Fusion::interpreted;
  EXPECT_EQ(Optimizer(optim::SGD{}, l.params(), un).backend(), "interpreter");
}

TEST(LlvmBackend, WithoutLlvmAutomaticIsHighway) {
  if (have_llvm()) GTEST_SKIP() << "this build has LLVM";
  List l({{DType::f32, DType::f32}}, {100}, 1);
  OptimizerOptions o;
  o.cpu_backend = CpuBackend::automatic;
  EXPECT_EQ(Optimizer(optim::SGD{}, l.params(), o).backend(), "highway");
}

// ---- FMA contraction ------------------------------------------------------------------

TEST(LlvmBackend, ContractStaysCloseToHighway) {
  REQUIRE_LLVM();
  const std::vector<std::int64_t> sizes = {40000, 37};
  for (const NamedConfig& c : configs()) {
    List lh({{DType::f32, DType::f32}}, sizes, 61), lc = lh;
    const List start = lh;
    OptimizerOptions oh = options_for(StepKind::clipped, true, CpuBackend::highway), oc = oh;
    oc.cpu_backend = CpuBackend::llvm;
    oc.llvm_contract = true;
    Optimizer high(c.config, lh.params(), oh), con(c.config, lc.params(), oc);
    for (int s = 0; s < 2; ++s) high.step(), con.step();
    // The reduce is never contracted: the norm is bitwise the same.
    EXPECT_EQ(high.last_grad_norm(), con.last_grad_norm()) << c.name;
    // Each fused multiply-add rounds once instead of twice: the steps differ by a few ulps
    // of their terms, amplified only where a program cancels (centered RMSprop's
    // v - avg^2). Almost every weight stays within 1e-6 relative; none moves by more than
    // a small fraction of the largest step.
    std::size_t far = 0, total = 0;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto* w0 = reinterpret_cast<const float*>(start.weights[t].data());
      const auto* wh = reinterpret_cast<const float*>(lh.weights[t].data());
      const auto* wc = reinterpret_cast<const float*>(lc.weights[t].data());
      float largest_step = 0, largest_diff = 0;
      for (std::int64_t i = 0; i < sizes[t]; ++i) {
        largest_step = std::max(largest_step, std::fabs(wh[i] - w0[i]));
        largest_diff = std::max(largest_diff, std::fabs(wh[i] - wc[i]));
        far += std::fabs(wh[i] - wc[i]) > 1e-6f * std::max(1.0f, std::fabs(wh[i]));
        ++total;
      }
      EXPECT_LE(largest_diff, 0.05f * largest_step) << c.name << " tensor " << t;
    }
    EXPECT_LE(far, total / 1000) << c.name << ": " << far << " of " << total << " weights differ by more than 1e-6";
  }
}

// ---- Vector widths: the kernels alone, against Highway's ------------------------------

// One side's args of a direct kernel call: its copies of the weights (and masters), the
// shared gradients, scalars and norms (the state streams are the caller's to point).
void point_args(cpu::UpdateArgs& a, const std::vector<std::uint8_t>& grad, std::vector<std::uint8_t>& weight,
                std::vector<float>& master, bool masters, const float* scalars, const float* norms) {
  a.grad = grad.data();
  a.weight = weight.data();
  a.master = masters ? master.data() : nullptr;
  a.scalars = scalars;
  a.norms = norms;
}

// Every built-in's kernels compiled for the generic x86-64 CPU (SSE2: 4 lanes) and for this
// one (8 or 16), called directly on data full of special values, against the Highway
// kernels: the same bits whatever the vector width.
TEST(LlvmBackend, EveryVectorWidthMatchesHighwayKernels) {
  REQUIRE_LLVM();
  const jit::CpuTarget host = jit::CpuTarget::host();
  if (host.triple.rfind("x86_64", 0) != 0) GTEST_SKIP() << "x86-64 only (the generic CPU's code must run here)";
  std::vector<jit::CpuTarget> targets = {jit::CpuTarget::named(host.triple, "x86-64"), host};
  std::vector<jit::DtypeCombo> combos;
  for (DType w : {DType::f32, DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::f16, DType::bf16})
      for (bool m : {false, true})
        if (!(m && w == DType::f32)) combos.push_back({w, g, m});
  std::mt19937 rng(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -3e-39f, 65504.0f, 65520.0f, 1e30f, 6e-8f};
  const auto fill = [&](std::vector<float>& v, float scale) {
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = i % 13 == 5 ? specials[(i / 13) % std::size(specials)] : normal(rng) * scale;
  };
  constexpr std::size_t kN = 1000 + 37;  // a tail after the vectors for every width
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    const auto builtin = static_cast<jit::Builtin>(b);
    jit::CpuSpec spec;
    spec.program = jit::builtin_program(builtin);
    spec.combos = combos;
    spec.reduce_grads = {DType::f32, DType::f16, DType::bf16};
    for (const jit::CpuTarget& target : targets) {
      const auto k = jit::cpu_kernels_for(spec, target);
      for (std::size_t ci = 0; ci < combos.size(); ++ci) {
        const jit::DtypeCombo c = combos[ci];
        const cpu::UpdateFn hwy = cpu::fused_update_kernel(builtin, c);
        ASSERT_NE(hwy, nullptr);
        std::vector<float> g(kN), w(kN), s[kMaxStreams];
        fill(g, 0.1f), fill(w, 1.0f);
        std::vector<std::uint8_t> gb = List::store(g, c.grad), wb = List::store(w, c.weight);
        float scalars[kMaxScalars];
        for (float& x : scalars) x = 0.5f + 0.4f * std::fabs(normal(rng));
        // A two-phase program's update (phase 2) reads the tensor's norms.
        float norms[kMaxNormSlots];
        for (float& x : norms) x = 0.5f + 2.0f * std::fabs(normal(rng));
        cpu::UpdateArgs a[2];
        std::vector<std::uint8_t> wcopy[2] = {wb, wb};
        std::vector<float> master[2] = {w, w}, state[2][kMaxStreams];
        for (int side = 0; side < 2; ++side) {
          point_args(a[side], gb, wcopy[side], master[side], c.master, scalars, norms);
          for (int st = 0; st < spec.program.num_streams; ++st) {
            state[side][st].assign(kN, 0.0f);
            if (side == 0) fill(state[0][st], 0.01f);
            else state[1][st] = state[0][st];
            a[side].state[st] = state[side][st].data();
          }
        }
        // A two-phase program's phase 1 first, on both sides: its chunk sums bitwise alike.
        if (const cpu::Phase1Fn hwy1 = cpu::fused_phase1_kernel(builtin, c)) {
          ASSERT_EQ(k->phase1.size(), combos.size());
          float sums[2][kMaxNormSlots];
          hwy1(a[0], 0, kN, sums[0]);
          reinterpret_cast<cpu::Phase1Fn>(k->phase1[ci])(a[1], 0, kN, sums[1]);
          EXPECT_EQ(std::memcmp(sums[0], sums[1], sizeof sums[0]), 0) << spec.program.name << ": phase-1 sums";
        }
        // Two calls: a whole range, then one starting off a vector boundary.
        hwy(a[0], 0, kN - 9), hwy(a[0], kN - 9, 9);
        reinterpret_cast<cpu::UpdateFn>(k->update[ci])(a[1], 0, kN - 9);
        reinterpret_cast<cpu::UpdateFn>(k->update[ci])(a[1], kN - 9, 9);
        const std::string what = std::string(spec.program.name) + " " + std::string(dtype_name(c.weight)) + "/" +
                                 std::string(dtype_name(c.grad)) + (c.master ? "/m" : "") + " for " + target.cpu;
        EXPECT_EQ(wcopy[0], wcopy[1]) << what << ": weights";
        EXPECT_EQ(std::memcmp(master[0].data(), master[1].data(), kN * 4), 0) << what << ": master";
        for (int st = 0; st < spec.program.num_streams; ++st)
          EXPECT_EQ(std::memcmp(state[0][st].data(), state[1][st].data(), kN * 4), 0) << what << ": stream " << st;
      }
      for (std::size_t gi = 0; gi < spec.reduce_grads.size(); ++gi) {
        const DType gt = spec.reduce_grads[gi];
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{31}, std::size_t{33}, std::size_t{16384},
                              std::size_t{777}}) {
          std::vector<float> g(n);
          for (float& x : g) x = normal(rng) * 3.0f;
          const std::vector<std::uint8_t> gb = List::store(g, gt);
          const cpu::ReducePartial h = cpu::reduce_kernel(gt, cpu::NormKind::l2)(gb.data(), n);
          const float l = reinterpret_cast<float (*)(const void*, std::uint64_t)>(k->reduce[gi])(gb.data(), n);
          EXPECT_EQ(h.sumsq, static_cast<double>(l)) << dtype_name(gt) << " n=" << n << " for " << target.cpu;
        }
      }
    }
    if (HasFailure()) return;
  }
}

// ---- Object code and cache -------------------------------------------------------------

jit::CpuSpec adamw_spec(bool contract = false) {
  jit::CpuSpec spec;
  spec.program = jit::builtin_program(jit::select_builtin(optim::AdamW{}));
  spec.combos = {{DType::bf16, DType::bf16, true}, {DType::f32, DType::f32, false}};
  spec.reduce_grads = {DType::bf16, DType::f32};
  spec.contract = contract;
  return spec;
}

TEST(LlvmBackend, ObjectCodeIsDeterministicAndKeysTellSpecsApart) {
  REQUIRE_LLVM();
  const jit::CpuTarget host = jit::CpuTarget::host();
  EXPECT_FALSE(host.cpu.empty());
  EXPECT_TRUE(host.vector_width == 4 || host.vector_width == 8 || host.vector_width == 16) << host.describe();
  const std::string a = jit::cpu_compile_object(adamw_spec(), host);
  const std::string b = jit::cpu_compile_object(adamw_spec(), host);
  ASSERT_GT(a.size(), 64u);
  EXPECT_EQ(a.substr(0, 4), "\x7f" "ELF");
  EXPECT_EQ(a, b) << "the same spec compiled twice gave different object code";
  EXPECT_NE(jit::cpu_cache_key(adamw_spec(), host), jit::cpu_cache_key(adamw_spec(true), host));
  jit::CpuSpec inf = adamw_spec();
  inf.inf_norm = true;
  EXPECT_NE(jit::cpu_cache_key(adamw_spec(), host), jit::cpu_cache_key(inf, host));
  jit::CpuSpec lion = adamw_spec();
  lion.program = jit::builtin_program(jit::select_builtin(optim::Lion{}));
  EXPECT_NE(jit::cpu_canonical_text(adamw_spec()), jit::cpu_canonical_text(lion));
  // A different CPU of the same architecture is another key and other code.
  const jit::CpuTarget generic = jit::CpuTarget::named(host.triple, "x86-64");
  EXPECT_EQ(generic.vector_width, 4);
  EXPECT_NE(jit::cpu_cache_key(adamw_spec(), host), jit::cpu_cache_key(adamw_spec(), generic));
  const std::string ir = jit::cpu_module_ir(adamw_spec(), host, false);
  EXPECT_NE(ir.find("define void @sf_cpu_update_bf16_bf16_m"), std::string::npos);
  EXPECT_NE(ir.find("define float @sf_cpu_reduce_l2_bf16"), std::string::npos);
  EXPECT_EQ(ir.find(" contract "), std::string::npos) << "contract flags without llvm_contract";
  EXPECT_NE(jit::cpu_module_ir(adamw_spec(true), host, false).find("fmul contract"), std::string::npos);
  EXPECT_THROW(jit::CpuTarget::named(host.triple, "no-such-cpu"), Error);
}

// The `_bs` functions (state streams stored as bf16, CpuSpec::bf16_state), called
// directly, against Highway's bf16-state kernels: every built-in, the dtype setups
// Highway has them for, this CPU's vector width and the generic one's.
TEST(LlvmBackend, Bf16StateFunctionsMatchHighwayKernels) {
  REQUIRE_LLVM();
  const jit::CpuTarget host = jit::CpuTarget::host();
  if (host.triple.rfind("x86_64", 0) != 0) GTEST_SKIP() << "x86-64 only (the generic CPU's code must run here)";
  const std::vector<jit::DtypeCombo> combos = {{DType::f32, DType::f32, false},
                                               {DType::f32, DType::bf16, false},
                                               {DType::bf16, DType::f32, true},
                                               {DType::bf16, DType::bf16, true},
                                               {DType::bf16, DType::bf16, false}};
  std::mt19937 rng(78);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, 3.3895e38f, 1e30f};
  constexpr std::size_t kN = 1000 + 37, kFinite = 512;  // special values only from element kFinite on
  const auto fill = [&](std::vector<float>& v, float scale) {
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = i >= kFinite && i % 11 == 4 ? specials[(i / 11) % std::size(specials)] : normal(rng) * scale;
  };
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    const auto builtin = static_cast<jit::Builtin>(b);
    jit::CpuSpec spec;
    spec.program = jit::builtin_program(builtin);
    spec.combos = combos;
    spec.bf16_state = combos;
    spec.reduce_grads = {DType::f32};
    const Program& p = spec.program;
    const auto bf16_stream = [&](int st) {
      return p.streams[st].role == StreamRole::state && p.streams[st].values != StateValues::full_precision;
    };
    for (const jit::CpuTarget& target : {jit::CpuTarget::named(host.triple, "x86-64"), host}) {
      const auto k = jit::cpu_kernels_for(spec, target);
      ASSERT_EQ(k->update_bf16_state.size(), combos.size());
      for (std::size_t ci = 0; ci < combos.size(); ++ci) {
        const jit::DtypeCombo c = combos[ci];
        const cpu::UpdateFn hwy = cpu::fused_update_kernel(builtin, c, cpu::StateKernel::bf16);
        ASSERT_NE(hwy, nullptr);
        std::vector<float> g(kN), w(kN), init(kN);
        fill(g, 0.1f), fill(w, 1.0f);
        const std::vector<std::uint8_t> gb = List::store(g, c.grad), wb = List::store(w, c.weight);
        float scalars[kMaxScalars], norms[kMaxNormSlots];
        for (float& x : scalars) x = 0.5f + 0.4f * std::fabs(normal(rng));
        for (float& x : norms) x = 0.5f + 2.0f * std::fabs(normal(rng));
        cpu::UpdateArgs a[2];
        std::vector<std::uint8_t> wcopy[2] = {wb, wb}, state[2][kMaxStreams];
        std::vector<float> master[2] = {w, w};
        for (int st = 0; st < p.num_streams; ++st) {
          if (p.streams[st].role != StreamRole::state) continue;
          fill(init, 0.01f);
          if (p.streams[st].values != StateValues::any)
            for (float& x : init) x = std::fabs(x);  // non-negative streams start non-negative
          state[0][st] = state[1][st] = List::store(init, bf16_stream(st) ? DType::bf16 : DType::f32);
        }
        for (int side = 0; side < 2; ++side) {
          point_args(a[side], gb, wcopy[side], master[side], c.master, scalars, norms);
          for (int st = 0; st < p.num_streams; ++st)
            a[side].state[st] = state[side][st].empty() ? nullptr : reinterpret_cast<float*>(state[side][st].data());
        }
        const std::string what = std::string(p.name) + " " + std::string(dtype_name(c.weight)) + "/" +
                                 std::string(dtype_name(c.grad)) + (c.master ? "/m" : "") + " for " + target.cpu;
        if (const cpu::Phase1Fn hwy1 = cpu::fused_phase1_kernel(builtin, c, cpu::StateKernel::bf16)) {
          ASSERT_EQ(k->phase1_bf16_state.size(), combos.size());
          // Phase 1 over a finite range (its sums compared bit for bit), then over the rest
          // (special values: a NaN sum's sign is the order's, and any NaN is the answer).
          for (const auto& [from, n] : {std::pair<std::size_t, std::size_t>{0, kFinite}, {kFinite, kN - kFinite}}) {
            float sums[2][kMaxNormSlots];
            hwy1(a[0], from, n, sums[0]);
            reinterpret_cast<cpu::Phase1Fn>(k->phase1_bf16_state[ci])(a[1], from, n, sums[1]);
            for (int r = 0; r < kMaxNormSlots; ++r)
              EXPECT_TRUE((from > 0 && std::isnan(sums[0][r]) && std::isnan(sums[1][r])) ||
                          std::memcmp(&sums[0][r], &sums[1][r], 4) == 0)
                  << what << ": phase-1 sum " << r << " from " << from << ": " << sums[0][r] << " vs " << sums[1][r];
            if (from == 0) {
              EXPECT_TRUE(std::isfinite(sums[1][0]) && sums[1][0] > 0.0f) << what << ": " << sums[1][0];
            }
          }
        }
        hwy(a[0], 0, kN - 9), hwy(a[0], kN - 9, 9);
        reinterpret_cast<cpu::UpdateFn>(k->update_bf16_state[ci])(a[1], 0, kN - 9);
        reinterpret_cast<cpu::UpdateFn>(k->update_bf16_state[ci])(a[1], kN - 9, 9);
        EXPECT_EQ(wcopy[0], wcopy[1]) << what << ": weights";
        EXPECT_EQ(std::memcmp(master[0].data(), master[1].data(), kN * 4), 0) << what << ": master";
        for (int st = 0; st < p.num_streams; ++st) EXPECT_EQ(state[0][st], state[1][st]) << what << ": stream " << st;
        EXPECT_NE(wcopy[1], wb) << what << ": the update wrote nothing";
      }
    }
  }
  // The module names them, and the spec's key tells them apart.
  jit::CpuSpec spec = adamw_spec(), with = adamw_spec();
  with.bf16_state = {with.combos[1]};
  EXPECT_NE(jit::cpu_cache_key(spec, host), jit::cpu_cache_key(with, host));
  EXPECT_NE(jit::cpu_module_ir(with, host, false).find("define void @sf_cpu_update_f32_f32_bs"), std::string::npos);
  with.bf16_state = {{DType::f16, DType::f16, true}};  // not among the spec's combos
  EXPECT_THROW(jit::cpu_module_ir(with, host, false), Error);
}

// The relocation types of an ELF64 object's RELA sections (none when it does not parse).
std::vector<std::uint32_t> relocation_types(const std::string& object) {
  const ref::ElfImage image = ref::read_elf(object);
  EXPECT_EQ(image.problem, "") << object.size() << " bytes";
  return image.relocation_types;
}

// ORC's RuntimeDyld may put an object's code and its constants more than 2 GiB apart (it
// did under ASan, and a 32-bit PC-relative constant load then read the wrong address):
// the objects the JIT links must reach constants through absolute 64-bit addresses.
TEST(LlvmBackend, JitObjectsUseOnlyAbsoluteRelocations) {
  REQUIRE_LLVM();
  const jit::CpuTarget host = jit::CpuTarget::host();
  if (host.triple.rfind("x86_64", 0) != 0) GTEST_SKIP() << "x86-64 relocation types";
  jit::CpuSpec spec = adamw_spec();
  spec.inf_norm = true;  // the inf reduce's constants were the ones that crashed
  for (const jit::CpuSpec& s : {adamw_spec(), spec}) {
    const std::vector<std::uint32_t> jit_types =
        relocation_types(jit::cpu_compile_object(s, host, jit::CpuObjectKind::jit));
    ASSERT_FALSE(jit_types.empty());
    for (std::uint32_t t : jit_types) EXPECT_EQ(t, static_cast<std::uint32_t>(R_X86_64_64)) << "relocation type " << t;
    // The emit API's objects are position-independent, for a normal link.
    const std::vector<std::uint32_t> pic = relocation_types(jit::cpu_compile_object(s, host));
    EXPECT_NE(std::find(pic.begin(), pic.end(), static_cast<std::uint32_t>(R_X86_64_PC32)), pic.end());
  }
}

TEST(LlvmBackend, CompiledObjectsAreCachedOnDisk) {
  REQUIRE_LLVM();
  jit::CpuSpec spec = adamw_spec();
  spec.combos = {{DType::f16, DType::bf16, true}};  // no other test compiles this one
  spec.reduce_grads = {DType::bf16};
  const std::string key = jit::cpu_cache_key(spec, jit::CpuTarget::host());
  jit::KernelCache& cache = jit::KernelCache::shared();
  ASSERT_TRUE(cache.disk_enabled());
  EXPECT_EQ(jit::cpu_kernels_if_cached(spec), nullptr);
  const auto k = jit::cpu_kernels(spec);
  EXPECT_EQ(k->source, jit::CpuKernels::Source::compiled);
  ASSERT_EQ(k->update.size(), 1u);
  ASSERT_EQ(k->reduce.size(), 1u);
  EXPECT_TRUE(std::filesystem::exists(cache.entry_path(key))) << cache.entry_path(key);
  // The same spec again: linked already, nothing compiled.
  EXPECT_EQ(jit::cpu_kernels(spec)->source, jit::CpuKernels::Source::linked);
  EXPECT_EQ(jit::cpu_kernels(spec)->update[0], k->update[0]);
  // From the disk alone: the bytes a fresh process would load are the ones compiled.
  jit::KernelCache fresh(CacheDir::dir_);
  const auto bytes = fresh.find_or_load(key);
  ASSERT_NE(bytes, nullptr);
  EXPECT_EQ(*bytes, jit::cpu_compile_object(spec, jit::CpuTarget::host(), jit::CpuObjectKind::jit));
}

}  // namespace
}  // namespace stepfuse
