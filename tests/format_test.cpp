// Numbers in messages (jit/base/format.hpp): the shortest text that reads back as the
// value, and messages that carry it where std::to_string or "%.17g" used to print
// "0.000000" or "0.10000000000000001".
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "jit/base/format.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using detail::format_float;
using detail::format_number;
using ::testing::HasSubstr;

TEST(FormatNumber, PrintsWhatAPersonWouldWrite) {
  EXPECT_EQ(format_number(1e-8), "1e-08");
  EXPECT_EQ(format_number(0.1), "0.1");
  EXPECT_EQ(format_number(2000.0), "2000");
  EXPECT_EQ(format_number(65536.0), "65536");
  EXPECT_EQ(format_number(0.5), "0.5");
  EXPECT_EQ(format_number(0.001), "0.001");  // fixed and scientific tie: fixed
  EXPECT_EQ(format_number(-3e-4), "-3e-04");  // shorter than -0.0003
  EXPECT_EQ(format_number(1e20), "1e+20");
  EXPECT_EQ(format_number(0.0), "0");
  EXPECT_EQ(format_number(-0.0), "-0");
  EXPECT_EQ(format_number(INFINITY), "inf");
  EXPECT_EQ(format_number(-INFINITY), "-inf");
  EXPECT_EQ(format_number(std::nan("")), "nan");
  EXPECT_EQ(format_number(-std::nan("")), "nan");
  EXPECT_EQ(format_number(std::numeric_limits<double>::denorm_min()), "5e-324");
  EXPECT_EQ(format_number(-std::numeric_limits<double>::min()), "-2.2250738585072014e-308");
  EXPECT_EQ(format_float(0.1f), "0.1");
  EXPECT_EQ(format_number(0.1f), "0.10000000149011612");  // the float's exact value, as a double
  EXPECT_EQ(format_float(-std::numeric_limits<float>::max()), "-3.4028235e+38");
  EXPECT_EQ(format_float(std::nanf("")), "nan");
}

TEST(FormatNumber, ReadsBackAsTheSameValue) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100000; ++i) {
    const std::uint64_t bits = rng();
    double v;
    std::memcpy(&v, &bits, sizeof v);
    if (!std::isfinite(v)) continue;
    const std::string text = format_number(v);
    double back = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), back);
    ASSERT_EQ(error, std::errc{}) << text;
    ASSERT_EQ(end, text.data() + text.size()) << text;
    ASSERT_EQ(std::memcmp(&back, &v, sizeof v), 0) << text;
    float f;
    const auto fbits = static_cast<std::uint32_t>(bits);
    std::memcpy(&f, &fbits, sizeof f);
    if (!std::isfinite(f)) continue;
    const std::string ftext = format_float(f);
    float fback = 0;
    ASSERT_EQ(std::from_chars(ftext.data(), ftext.data() + ftext.size(), fback).ec, std::errc{}) << ftext;
    ASSERT_EQ(std::memcmp(&fback, &f, sizeof f), 0) << ftext;
  }
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a stepfuse::Error";
  return {};
}

TEST(FormatNumber, MessagesShowTheValuesAsGiven) {
  float w[4] = {}, g[4] = {};
  std::vector<Param> params = {{{w, 4, DType::f32}, {g, 4, DType::f32}}};
  Optimizer adam(optim::Adam{}, params);
  // Below fp32's range: std::to_string printed "0.000000".
  EXPECT_THAT(message_of([&] { LossScaleOptimizer(adam, true, 1e-50, 2); }), HasSubstr("initial_scale = 1e-50 "));

  // A custom program's lr.
  ProgramBuilder b("plain_sgd");
  const Stream grad = b.stream("grad", StreamRole::grad), param = b.stream("param", StreamRole::param);
  const Value lr = b.scalar("lr");
  const Value gscale = b.scalar("gscale");
  b.store(param, b.sub(b.load(param), b.mul(lr, b.mul(b.load(grad), gscale))));
  const UpdateProgram program(b.build(), {UpdateProgram::fixed("lr", 0.1), UpdateProgram::gscale()});
  EXPECT_THAT(program.text(), HasSubstr("  lr = 0.1\n"));  // "%.17g" printed 0.10000000000000001
  Optimizer custom(program, params);
  EXPECT_THAT(message_of([&] { custom.set_lr(-1e-8); }), HasSubstr("lr = -1e-08 "));

  // The emit API's norm_type.
  EmitRequest request{.program = program, .tensors = {EmitTensor{}}, .target = EmitTarget::ptx(75)};
  request.norm_type = 1.5;
  request.compile = false;
  EXPECT_THAT(message_of([&] { emit(request); }), HasSubstr("norm_type = 1.5 (use 2.0 or INFINITY)"));

  // A rule parameter that is not finite.
  EXPECT_THAT(message_of([&] { static_cast<void>(program.with_value("lr", -INFINITY)); }), HasSubstr("= -inf "));
}

}  // namespace
}  // namespace stepfuse
