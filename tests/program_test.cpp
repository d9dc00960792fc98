// Update programs: the builder, validation messages, the printer, the built-ins'
// shapes, and the interpreter's lowering (in-place streams, superinstructions).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "jit/builtin/registry.hpp"
#include "jit/builtins.hpp"
#include "jit/program_analysis.hpp"
#include "jit/layout.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using ::testing::HasSubstr;

std::string validation_error(const Program& p) {
  try {
    validate(p);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    return e.what();
  }
  return "";
}

// A well-formed SGD-like program whose instructions the tests then break.
Program sgd_like() {
  ProgramBuilder b("toy");
  const Stream g = b.stream("grad", StreamRole::grad);
  const Stream p = b.stream("param", StreamRole::param);
  const Value lr = b.scalar("lr");
  const Value w = b.load(p);
  const Value grad = b.load(g);
  b.store(p, b.sub(w, b.mul(lr, grad)));
  return b.build();
}

TEST(Program, BuilderMakesAValidProgramAndPrintsIt) {
  const Program p = sgd_like();
  EXPECT_EQ(validation_error(p), "");
  EXPECT_EQ(to_string(p),
            "program toy\n"
            "  stream grad : grad\n"
            "  stream param : param\n"
            "  scalar lr\n"
            "  %0 = scalar lr\n"
            "  %1 = load param\n"
            "  %2 = load grad\n"
            "  %3 = mul %0, %2\n"
            "  %4 = sub %1, %3\n"
            "  store param, %4\n");
}

TEST(Program, ValidationNamesTheProblemAndTheInstruction) {
  {
    Program p = sgd_like();
    p.code[3].b = 4;  // operand defined later
    EXPECT_THAT(validation_error(p), HasSubstr("instruction 3: %3 = mul %0, %4"));
    EXPECT_THAT(validation_error(p), HasSubstr("not yet defined"));
  }
  {
    Program p = sgd_like();
    p.code[5].attr = 0;  // store to the gradient
    EXPECT_THAT(validation_error(p), HasSubstr("grad stream is read-only"));
  }
  {
    Program p = sgd_like();
    p.code[3].a = 5;
    p.code[6] = {Op::store, 1, 4};
    p.num_instrs = 7;
    p.code[3] = {Op::mul, 0, 0, 2};
    EXPECT_THAT(validation_error(p), HasSubstr("stored twice"));
  }
  {
    Program p = sgd_like();
    p.code[6] = {Op::load, 1};
    p.num_instrs = 7;
    EXPECT_THAT(validation_error(p), HasSubstr("load follows a store"));
  }
  {
    Program p = sgd_like();
    p.num_instrs = 5;  // drop the store
    EXPECT_THAT(validation_error(p), HasSubstr("never stores the param stream"));
  }
  {
    Program p = sgd_like();
    p.code[0].attr = 9;
    EXPECT_THAT(validation_error(p), HasSubstr("scalar index is out of range"));
  }
  {
    Program p = sgd_like();
    p.streams[0].role = StreamRole::state;
    EXPECT_THAT(validation_error(p), HasSubstr("exactly one stream with role grad"));
  }
  {
    Program p = sgd_like();
    p.code[4].a = 5;
    p.code[4] = {Op::sub, 0, 1, 5};
    EXPECT_THAT(validation_error(p), HasSubstr("not yet defined"));
  }
}

TEST(Program, BuilderRejectsTooManyInstructions) {
  ProgramBuilder b("long");
  const Stream g = b.stream("grad", StreamRole::grad);
  const Stream p = b.stream("param", StreamRole::param);
  Value v = b.load(g);
  for (int i = 0; i < kMaxInstrs; ++i) v = b.add(v, v);
  b.store(p, v);
  try {
    (void)b.build();
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("too many instructions"));
  }
}

TEST(Program, BuiltinsAreWellFormedAndNameTheirState) {
  struct Expect {
    jit::Builtin b;
    std::vector<std::string> state;
  };
  const Expect cases[] = {
      {jit::builtin_named("sgd"), {}},
      {jit::builtin_named("sgd_momentum"), {"momentum_buffer"}},
      {jit::builtin_named("adam"), {"exp_avg", "exp_avg_sq"}},
      {jit::builtin_named("adam_amsgrad"), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {jit::builtin_named("adagrad"), {"sum"}},
      {jit::builtin_named("rmsprop_centered_momentum"), {"square_avg", "grad_avg", "momentum_buffer"}},
      {jit::builtin_named("lion"), {"exp_avg"}},
  };
  for (const auto& c : cases) {
    const Program& p = jit::builtin_program(c.b);
    EXPECT_EQ(validation_error(p), "") << p.name;
    std::vector<std::string> state;
    for (int s = 0; s < p.num_streams; ++s)
      if (p.streams[s].role == StreamRole::state) state.emplace_back(p.streams[s].name);
    EXPECT_EQ(state, c.state) << p.name;
    EXPECT_EQ(p.scalars[0], "gscale") << p.name;
    // Built-ins avoid fma: it is not bitwise reproducible on targets without one.
    for (int i = 0; i < p.num_instrs; ++i) EXPECT_NE(p.code[i].op, Op::fma) << p.name;
  }
}

TEST(Program, ConfigSelectsTheVariant) {
  EXPECT_EQ(jit::select_builtin(optim::SGD{}), jit::builtin_named("sgd"));
  EXPECT_EQ(jit::select_builtin(optim::SGD{.momentum = 0.9}), jit::builtin_named("sgd_momentum"));
  EXPECT_EQ(jit::select_builtin(optim::SGD{.momentum = 0.9, .nesterov = true}), jit::builtin_named("sgd_nesterov"));
  EXPECT_EQ(jit::select_builtin(optim::AdamW{.amsgrad = true}), jit::builtin_named("adam_amsgrad"));
  EXPECT_EQ(jit::select_builtin(optim::RMSprop{.momentum = 0.5}), jit::builtin_named("rmsprop_momentum"));
  EXPECT_EQ(jit::select_builtin(optim::RMSprop{.centered = true}), jit::builtin_named("rmsprop_centered"));
}

TEST(Program, AdamScalarsFollowPyTorch) {
  const Program& p = jit::builtin_program(jit::builtin_named("adam"));
  float s[kMaxScalars] = {};
  jit::fill_scalars(optim::AdamW{.lr = 0.01, .weight_decay = 0.1, .maximize = true}, p, 3, 0.25, s);
  EXPECT_EQ(s[p.find_scalar("gscale")], -0.25f);
  EXPECT_EQ(s[p.find_scalar("decay")], static_cast<float>(1.0 - 0.01 * 0.1));
  EXPECT_EQ(s[p.find_scalar("l2")], 0.0f);
  EXPECT_EQ(s[p.find_scalar("step_size")], static_cast<float>(0.01 / (1.0 - std::pow(0.9, 3))));
  EXPECT_EQ(s[p.find_scalar("bias_correction2_sqrt")], static_cast<float>(std::sqrt(1.0 - std::pow(0.999, 3))));
  jit::fill_scalars(optim::Adam{.weight_decay = 0.1}, p, 1, 1.0, s);
  EXPECT_EQ(s[p.find_scalar("decay")], 1.0f);
  EXPECT_EQ(s[p.find_scalar("l2")], 0.1f);
}

TEST(Lowering, ReadsAndWritesStreamsInPlaceWithSuperinstructions) {
  const jit::LoweredProgram l = jit::lower(jit::builtin_program(jit::builtin_named("adam")), DType::f32, DType::f32, false);
  const std::string text = jit::to_string(l);
  // f32 streams are read in place and results written straight into them: no copies.
  EXPECT_THAT(text, Not(HasSubstr("copy"))) << text;
  EXPECT_THAT(text, HasSubstr("state2[] = axpby")) << text;  // m = b1*m + (1-b1)*g, written into exp_avg
  EXPECT_THAT(text, HasSubstr("param[] = msub")) << text;    // p = decayed - step_size*(m/denom)
  EXPECT_LE(l.num_slots, 4) << text;
  EXPECT_LT(l.code.size(), 16u) << text;
}

TEST(Lowering, WidensAndNarrowsLowPrecisionStreams) {
  const jit::LoweredProgram with_masters =
      jit::lower(jit::builtin_program(jit::builtin_named("sgd")), DType::bf16, DType::f16, true);
  const std::string t = jit::to_string(with_masters);
  EXPECT_THAT(t, HasSubstr("widen")) << t;   // the f16 gradient
  EXPECT_THAT(t, HasSubstr("narrow")) << t;  // bf16 weights from the master
  const jit::LoweredProgram no_masters = jit::lower(jit::builtin_program(jit::builtin_named("sgd")), DType::bf16, DType::f32, false);
  EXPECT_THAT(jit::to_string(no_masters), HasSubstr("t0 = widen weight"));
}

TEST(Layout, ChunksCoverEveryElementOnceAndThreadsSplitThem) {
  const std::vector<std::int64_t> sizes = {0, 1, 16384, 16385, 100000, 7};
  std::vector<jit::TensorShape> shapes;
  for (std::int64_t n : sizes) shapes.push_back({n, {}});
  const jit::Layout l = jit::plan_layout(shapes);
  std::vector<std::int64_t> covered(sizes.size(), 0);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    for (std::size_t c = l.tensor_chunks[t]; c < l.tensor_chunks[t + 1]; ++c) {
      EXPECT_EQ(l.chunks[c].tensor, t);
      EXPECT_EQ(l.chunks[c].begin, covered[t]);
      EXPECT_GT(l.chunks[c].len, 0);
      EXPECT_LE(l.chunks[c].len, jit::kChunkElems);
      covered[t] += l.chunks[c].len;
    }
  }
  EXPECT_EQ(covered, sizes);
  EXPECT_EQ(l.tensor_chunks.back(), l.chunks.size());
  for (int threads : {1, 2, 3, 8}) {
    const std::vector<std::size_t> split = jit::split_chunks(l.chunks, threads);
    ASSERT_EQ(split.size(), static_cast<std::size_t>(threads) + 1);
    EXPECT_EQ(split.front(), 0u);
    EXPECT_EQ(split.back(), l.chunks.size());
    for (int t = 0; t < threads; ++t) EXPECT_LE(split[t], split[t + 1]);
  }
  const jit::Layout big = jit::plan_layout({{1 << 20, {}}});
  EXPECT_EQ(jit::split_chunks(big.chunks, 2)[1], big.chunks.size() / 2);  // an even split
}

TEST(Layout, OffsetsMastersAndCombinationsInFirstUseOrder) {
  const jit::DtypeCombo f32{}, bf16m{DType::bf16, DType::bf16, true}, f16{DType::f16, DType::f32, false};
  const std::vector<jit::TensorShape> shapes = {{10, bf16m}, {16, f32}, {17, bf16m}, {0, f16}, {5, f32}};
  const jit::Layout padded = jit::plan_layout(shapes);
  EXPECT_EQ(padded.offsets, (std::vector<std::int64_t>{0, 16, 32, 64, 64}));
  EXPECT_EQ(padded.state_elems, 80);
  EXPECT_EQ(padded.master_offsets, (std::vector<std::int64_t>{0, -1, 16, -1, -1}));
  EXPECT_EQ(padded.master_elems, 48);
  EXPECT_EQ(padded.combos, (std::vector<jit::DtypeCombo>{bf16m, f32, f16}));
  EXPECT_EQ(padded.tensor_combo, (std::vector<int>{0, 1, 0, 2, 1}));
  EXPECT_EQ(padded.reduce_grads, (std::vector<DType>{DType::bf16, DType::f32}));
  EXPECT_EQ(padded.tensor_reduce, (std::vector<int>{0, 1, 0, 1, 1}));
  const jit::Layout flat = jit::plan_layout(shapes, /*flat=*/true);
  EXPECT_EQ(flat.offsets, (std::vector<std::int64_t>{0, 10, 26, 43, 43}));
  EXPECT_EQ(flat.state_elems, 48);
  EXPECT_EQ(flat.master_offsets, (std::vector<std::int64_t>{0, -1, 10, -1, -1}));
  EXPECT_EQ(flat.master_elems, 27);
  // A dense, distinct table index for every combination.
  std::vector<int> seen;
  for (DType w : {DType::f32, DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::f16, DType::bf16})
      for (bool m : {false, true}) {
        const int i = jit::DtypeCombo{w, g, m}.index();
        EXPECT_GE(i, 0);
        EXPECT_LT(i, jit::kNumComboIndices);
        EXPECT_EQ(std::count(seen.begin(), seen.end(), i), 0);
        seen.push_back(i);
      }
}

TEST(ThreadPool, RunsEveryIndexOnceAndWaits) {
  for (int threads : {1, 2, 3}) {
    detail::ThreadPool pool(threads);
    for (int round = 0; round < 200; ++round) {
      std::vector<int> hits(threads, 0);
      pool.run([&](int t) { hits[t] += 1; });
      EXPECT_EQ(hits, std::vector<int>(threads, 1));
    }
  }
}

}  // namespace
}  // namespace stepfuse
