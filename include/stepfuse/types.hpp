// Tensor descriptions shared by every part of the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace stepfuse {

// Storage formats. All arithmetic is fp32; f16 and bf16 are storage only.
enum class DType : std::uint8_t { f32, f16, bf16 };

constexpr std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) {
  return t == DType::f32 ? "f32" : t == DType::f16 ? "f16" : "bf16";
}

// How an optimizer state stream is stored between steps (OptimizerOptions::
// state_format, docs/low-precision.md). The update always computes in fp32: a
// stored stream is decoded when a step loads it and encoded when it stores it.
enum class StateFormat : std::uint8_t {
  f32,   // 4 bytes per element, exact
  bf16,  // 2 bytes per element, rounded to nearest even (stochastically, with bits of its
         // own, for a tensor whose bf16 weights round stochastically: stochastic_rounding,
         // unless stochastic_state_rounding is off)
  q8,    // block-wise 8-bit dynamic quantization, as bitsandbytes': per block of 256
         // elements one fp32 absmax and one byte per element, the nearest of 256
         // codes (a signed code, or an unsigned one for non-negative streams)
};
// Bytes per element as stored (q8 also keeps one fp32 absmax per 256 elements).
constexpr std::size_t state_format_size(StateFormat f) { return f == StateFormat::f32 ? 4 : f == StateFormat::bf16 ? 2 : 1; }
constexpr std::string_view state_format_name(StateFormat f) {
  return f == StateFormat::f32 ? "f32" : f == StateFormat::bf16 ? "bf16" : "q8";
}

// Where an optimizer runs. The CPU is always available.
struct Device {
  enum class Kind : std::uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {Kind::cpu, 0}; }
  static Device cuda(int index = 0) { return {Kind::cuda, index}; }
  bool operator==(const Device&) const = default;
};

// A contiguous, caller-owned tensor. Maps one-to-one onto DLPack's DLTensor
// (data pointer, element count, dtype, device) for a contiguous tensor.
struct TensorView {
  void* data = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::f32;
};

// One parameter: its weights and the gradient of the loss with respect to them.
// Both are caller-owned and must stay valid for the optimizer's lifetime.
struct Param {
  TensorView weight;
  TensorView grad;
};

}  // namespace stepfuse
