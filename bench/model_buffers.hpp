// Caller-side weight and gradient buffers for a tensor list, filled with reproducible values.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "presets.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::bench {

// Storage conversions, round to nearest even (what the library promises, docs/architecture.md §5).
inline std::uint16_t f32_to_bf16(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }
inline std::uint16_t f32_to_f16(float f) { return std::bit_cast<std::uint16_t>(static_cast<_Float16>(f)); }
inline float f16_to_f32(std::uint16_t h) { return static_cast<float>(std::bit_cast<_Float16>(h)); }

// x as stored in `t` and read back as fp32.
inline float round_to(DType t, float x) {
  return t == DType::f32 ? x : t == DType::bf16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
}
inline float load_as_f32(const void* data, DType t, std::int64_t i) {
  if (t == DType::f32) return static_cast<const float*>(data)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(data)[i];
  return t == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// One weight and one gradient buffer per tensor, each allocated separately (as a framework
// does) and 64-byte aligned. Construction allocates but touches nothing; the fills touch
// every page, from `threads` threads. Values are a pure function of the element's global
// index, so a check can recompute any input without keeping a copy:
//   weight = 0.1 * u_w(i), u uniform in [-1, 1);
//   grad = loss_scale * 1e-3 * (random sign) * (magnitude uniform in [0.5, 1)),
// both rounded to their storage dtype.
class ModelBuffers {
 public:
  ModelBuffers(const std::vector<TensorShape>& shapes, DType weights, DType grads);

  void fill_weights(int threads);
  void fill_grads(double loss_scale, int threads);
  // Copies `src`'s gradients (same shapes and grad dtype) into this one's.
  void copy_grads_from(const ModelBuffers& src, int threads);

  // Views of the buffers, in tensor order, for an Optimizer.
  std::vector<Param> params() const;

  // What fill_weights / fill_grads(loss_scale) wrote at global element index i, as fp32.
  float initial_weight(std::int64_t i) const;
  float initial_grad(double loss_scale, std::int64_t i) const;

  std::size_t num_tensors() const { return names_.size(); }
  const std::string& name(std::size_t t) const { return names_[t]; }
  std::int64_t total_numel() const { return offsets_.back(); }
  std::int64_t offset(std::size_t t) const { return offsets_[t]; }  // global index of tensor t's element 0
  std::int64_t numel(std::size_t t) const { return offsets_[t + 1] - offsets_[t]; }
  TensorView weight(std::size_t t) const { return {w_[t].get(), numel(t), weight_dtype_}; }
  TensorView grad(std::size_t t) const { return {g_[t].get(), numel(t), grad_dtype_}; }
  DType weight_dtype() const { return weight_dtype_; }
  DType grad_dtype() const { return grad_dtype_; }
  std::size_t weight_bytes() const { return static_cast<std::size_t>(total_numel()) * dtype_size(weight_dtype_); }
  std::size_t grad_bytes() const { return static_cast<std::size_t>(total_numel()) * dtype_size(grad_dtype_); }

  // Calls fn(tensor, begin, end) for each tensor's part of the global range [lo, hi),
  // begin/end local to the tensor.
  template <class Fn>
  void for_each_piece(std::int64_t lo, std::int64_t hi, Fn&& fn) const;

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::vector<std::string> names_;
  std::vector<std::int64_t> offsets_;  // num_tensors + 1 prefix sums
  DType weight_dtype_, grad_dtype_;
  std::vector<std::unique_ptr<void, Free>> w_, g_;
};

template <class Fn>
void ModelBuffers::for_each_piece(std::int64_t lo, std::int64_t hi, Fn&& fn) const {
  if (lo >= hi) return;
  // First tensor whose end is past lo.
  std::size_t t = 0, n = num_tensors();
  std::size_t a = 0, b = n;
  while (a < b) {
    const std::size_t mid = (a + b) / 2;
    if (offsets_[mid + 1] <= lo) a = mid + 1; else b = mid;
  }
  for (t = a; t < n && offsets_[t] < hi; ++t) {
    const std::int64_t b0 = std::max(lo, offsets_[t]) - offsets_[t];
    const std::int64_t e0 = std::min(hi, offsets_[t + 1]) - offsets_[t];
    if (b0 < e0) fn(t, b0, e0);
  }
}

}  // namespace stepfuse::bench
