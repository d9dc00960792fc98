// Conversions between fp32 and the f16/bf16 storage formats, bit for bit as the
// kernels do them: round to nearest even, inf and NaN preserved, subnormals kept.
// For code that fills f16/bf16 gradient buffers or reads f16/bf16 weights.
#pragma once

#include <cstdint>
#include <span>

#include "stepfuse/types.hpp"

namespace stepfuse {

std::uint16_t float_to_f16(float value);
float f16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float value);
float bf16_to_float(std::uint16_t bits);

// dst[i] = src[i] widened (exact). Error(invalid_argument) if the sizes differ or
// src is not a valid view.
void to_float(TensorView src, std::span<float> dst);
// dst[i] = src[i] rounded to dst's dtype. Error(invalid_argument) if the sizes
// differ or dst is not a valid view.
void from_float(std::span<const float> src, TensorView dst);

}  // namespace stepfuse
