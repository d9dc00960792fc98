// The public conversions: thin wrappers over the kernels' own (runtime/cpu/convert.cpp).
#include "stepfuse/convert.hpp"

#include <string>

#include "runtime/cpu/kernels.hpp"
#include "runtime/scale_tensors.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {

namespace {
void check(const TensorView& view, std::size_t n, const char* what) {
  detail::validate_views(std::span<const TensorView>(&view, 1), what);
  if (static_cast<std::size_t>(view.numel) != n)
    throw Error(ErrorCode::invalid_argument, std::string(what) + "[0].numel = " + std::to_string(view.numel) +
                                                 " but the float span has " + std::to_string(n) + " elements");
}

// One value through the kernels' conversions, to and from a 16-bit `type`.
std::uint16_t narrow_one(float value, DType type) {
  std::uint16_t out;
  cpu::narrow(&value, type, &out, 1);
  return out;
}
float widen_one(std::uint16_t bits, DType type) {
  float out;
  cpu::widen(type, &bits, &out, 1);
  return out;
}
}  // namespace

std::uint16_t float_to_f16(float value) { return narrow_one(value, DType::f16); }
float f16_to_float(std::uint16_t bits) { return widen_one(bits, DType::f16); }
std::uint16_t float_to_bf16(float value) { return narrow_one(value, DType::bf16); }
float bf16_to_float(std::uint16_t bits) { return widen_one(bits, DType::bf16); }

void to_float(TensorView src, std::span<float> dst) {
  check(src, dst.size(), "to_float: src");
  cpu::widen(src.dtype, src.data, dst.data(), dst.size());
}
void from_float(std::span<const float> src, TensorView dst) {
  check(dst, src.size(), "from_float: dst");
  cpu::narrow(src.data(), dst.dtype, dst.data, src.size());
}

}  // namespace stepfuse
