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
}  // namespace

std::uint16_t float_to_f16(float value) {
  std::uint16_t out;
  cpu::narrow(&value, DType::f16, &out, 1);
  return out;
}
float f16_to_float(std::uint16_t bits) {
  float out;
  cpu::widen(DType::f16, &bits, &out, 1);
  return out;
}
std::uint16_t float_to_bf16(float value) {
  std::uint16_t out;
  cpu::narrow(&value, DType::bf16, &out, 1);
  return out;
}
float bf16_to_float(std::uint16_t bits) {
  float out;
  cpu::widen(DType::bf16, &bits, &out, 1);
  return out;
}

void to_float(TensorView src, std::span<float> dst) {
  check(src, dst.size(), "to_float: src");
  cpu::widen(src.dtype, src.data, dst.data(), dst.size());
}
void from_float(std::span<const float> src, TensorView dst) {
  check(dst, src.size(), "from_float: dst");
  cpu::narrow(src.data(), dst.dtype, dst.data, src.size());
}

}  // namespace stepfuse
