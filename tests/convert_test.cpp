// The public f16/bf16 conversions agree bit for bit with the kernels' and with
// the compiler's _Float16 or F16C (f16, tests/f16_oracle.hpp) / a truncation oracle
// (bf16 widening).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "f16_oracle.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

TEST(Convert, HalfPrecisionRoundTripsEveryPattern) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float ref = test::oracle_f16_to_float(h);
    const float f = f16_to_float(h);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(f)) << b;
      EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(f)))) << b;
      continue;
    }
    EXPECT_EQ(std::bit_cast<std::uint32_t>(f), std::bit_cast<std::uint32_t>(ref)) << b;
    EXPECT_EQ(float_to_f16(f), h) << b;
    EXPECT_EQ(std::bit_cast<std::uint32_t>(bf16_to_float(h)), b << 16) << b;
    if (!std::isnan(bf16_to_float(h))) {
      EXPECT_EQ(float_to_bf16(bf16_to_float(h)), h) << b;
    }
  }
}

TEST(Convert, RoundsToNearestEvenLikeTheCompiler) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float f = std::bit_cast<float>(bits(rng));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_f16(f), test::oracle_float_to_f16(f)) << f;
    // bf16: round to nearest even on the top 16 bits.
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const auto expect = static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    EXPECT_EQ(float_to_bf16(f), expect) << f;
  }
}

TEST(Convert, BulkConversionsMatchTheScalarOnesAndCheckSizes) {
  std::vector<float> src = {0.0f, -1.5f, 65504.0f, 70000.0f, 1e-8f, INFINITY, 3.14159f};
  for (DType t : {DType::f16, DType::bf16}) {
    std::vector<std::uint16_t> out(src.size());
    from_float(src, {out.data(), static_cast<std::int64_t>(out.size()), t});
    std::vector<float> back(src.size());
    to_float({out.data(), static_cast<std::int64_t>(out.size()), t}, back);
    for (std::size_t i = 0; i < src.size(); ++i) {
      EXPECT_EQ(out[i], t == DType::f16 ? float_to_f16(src[i]) : float_to_bf16(src[i]));
      EXPECT_EQ(std::bit_cast<std::uint32_t>(back[i]),
                std::bit_cast<std::uint32_t>(t == DType::f16 ? f16_to_float(out[i]) : bf16_to_float(out[i])));
    }
    std::vector<float> wrong(src.size() + 1);
    EXPECT_THROW(to_float({out.data(), static_cast<std::int64_t>(out.size()), t}, wrong), Error);
    EXPECT_THROW(from_float(wrong, {out.data(), static_cast<std::int64_t>(out.size()), t}), Error);
    EXPECT_THROW(from_float(src, {nullptr, static_cast<std::int64_t>(src.size()), t}), Error);
  }
}

}  // namespace
}  // namespace stepfuse
