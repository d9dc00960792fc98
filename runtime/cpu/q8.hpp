// The q8 state codec: optimizer state stored as 8-bit codes into a 256-value map
// with one fp32 absmax per block of kQ8Block elements, as bitsandbytes' blockwise
// dynamic quantization (quantize_blockwise / dequantize_blockwise with its
// create_dynamic_map). Every function here is exactly specified in fp32: the
// Highway versions are bitwise equal to the scalar references on every target.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stepfuse::cpu {

inline constexpr std::size_t kQ8Block = 256;  // elements per block, one fp32 absmax each
// The blocks (absmaxes) of n elements.
constexpr std::size_t q8_blocks(std::size_t n) { return (n + kQ8Block - 1) / kQ8Block; }

// signed_dynamic: bitsandbytes' create_dynamic_map(signed=True), for signed state
// (Adam's first moment); unsigned_dynamic: create_dynamic_map(signed=False), for
// non-negative state (the second moment). Both with max_exponent_bits 7, total_bits 8.
enum class Q8Map : std::uint8_t { signed_dynamic = 0, unsigned_dynamic = 1 };

// The map's 256 code values, ascending and distinct, bit for bit bitsandbytes'.
// signed_dynamic holds 0 at code 127 and 1.0 at code 255 (and no -1.0);
// unsigned_dynamic holds 0 at code 0 and 1.0 at code 255.
const float* q8_code(Q8Map map);
// The 255 decision thresholds: t[k] = float((double(code[k]) + double(code[k+1])) / 2),
// the fp32 nearest the exact midpoint.
const float* q8_thresholds(Q8Map map);

// The code of a normalized value x: the number of thresholds t[k] with x > t[k], so a
// value equal to a threshold takes the lower code, values beyond the map's ends take
// its end codes, and NaN takes code 0. Scalar reference.
std::uint8_t q8_encode_scalar(float x, Q8Map map);
// codes[i] = q8_encode_scalar(x[i]) for n values as they are (no block scaling).
void q8_encode(const float* x, std::uint8_t* codes, std::size_t n, Q8Map map);

// Blocks: element i belongs to block i / kQ8Block (the first block starts at codes[0]);
// the last block may be short.
//
// Dequantize n elements: out[i] = code[codes[i]] * absmax[i / kQ8Block] (one fp32 multiply).
void q8_dequantize(const std::uint8_t* codes, const float* absmax, float* out, std::size_t n, Q8Map map);
// Quantize n elements block by block. A block's values are first sanitized (NaN -> 0,
// +-inf -> +-FLT_MAX: inf and NaN are never stored); absmax[b] = max |x| over the block's
// sanitized values; inv = absmax > 0 ? 1.0f / absmax : 0.0f (one fp32 division); and
// codes[i] = q8_encode_scalar(x * inv) (one fp32 multiply). Writes exactly n codes and
// ceil(n / kQ8Block) absmaxes.
//
// A block whose absmax is at most 2^-128 (so 1 / absmax would overflow) scales by
// FLT_MAX instead: its zeros stay zero and its values dequantize within absmax of
// themselves rather than within half a code gap (bitsandbytes' Python reference
// divides by max(absmax, 1e-38) to the same end).
void q8_quantize(const float* in, std::uint8_t* codes, float* absmax, std::size_t n, Q8Map map);

// Scalar reference versions of the block functions (plain loops over
// q8_encode_scalar), for the tests and the interpreter.
void q8_dequantize_scalar(const std::uint8_t* codes, const float* absmax, float* out, std::size_t n, Q8Map map);
void q8_quantize_scalar(const float* in, std::uint8_t* codes, float* absmax, std::size_t n, Q8Map map);

// The maps as the CUDA kernels read them (sf_hyper.q8_maps, jit/cuda/device_abi.h):
// 4 * 256 floats, the signed map's code values, its 255 thresholds and +inf, then the
// unsigned map's.
void q8_device_maps(float* out);

// The reciprocal q8_quantize scales a block by: 1 / absmax in fp32, at most FLT_MAX,
// 0 for an all-zero block.
inline float q8_inverse_scale(float absmax) {
  if (!(absmax > 0.0f)) return 0.0f;
  const float inv = 1.0f / absmax;
  return inv < 3.40282347e+38f ? inv : 3.40282347e+38f;  // (FLT_MAX)
}

}  // namespace stepfuse::cpu
