// Caller-side weight and gradient buffers for a tensor list, filled with reproducible values.
#include "model_buffers.hpp"

#include <cstdlib>
#include <new>
#include <stdexcept>

#include "parallel.hpp"

namespace stepfuse::bench {
namespace {

constexpr std::uint64_t kWeightSeed = 0x5eed0001, kGradSeed = 0x5eed0002;

// splitmix64 of (seed, i) -> uniform in [-1, 1) with 24 random bits.
inline float uniform(std::uint64_t seed, std::int64_t i) {
  std::uint64_t z = seed * 0xD1B54A32D192ED03ull + static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<std::int32_t>(z >> 40) - (1 << 23)) * (1.0f / (1 << 23));
}

void store(void* data, DType t, std::int64_t i, float x) {
  switch (t) {
    case DType::f32: static_cast<float*>(data)[i] = x; break;
    case DType::bf16: static_cast<std::uint16_t*>(data)[i] = f32_to_bf16(x); break;
    case DType::f16: static_cast<std::uint16_t*>(data)[i] = f32_to_f16(x); break;
  }
}

void* alloc_bytes(std::size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void ModelBuffers::Free::operator()(void* p) const { std::free(p); }

ModelBuffers::ModelBuffers(const std::vector<TensorShape>& shapes, DType weights, DType grads)
    : weight_dtype_(weights), grad_dtype_(grads) {
  names_.reserve(shapes.size());
  offsets_.reserve(shapes.size() + 1);
  offsets_.push_back(0);
  for (const auto& s : shapes) {
    if (s.numel < 0) throw std::invalid_argument("tensor '" + s.name + "' has a negative size");
    names_.push_back(s.name);
    offsets_.push_back(offsets_.back() + s.numel);
    w_.emplace_back(alloc_bytes(static_cast<std::size_t>(s.numel) * dtype_size(weights)));
    g_.emplace_back(alloc_bytes(static_cast<std::size_t>(s.numel) * dtype_size(grads)));
  }
}

float ModelBuffers::initial_weight(std::int64_t i) const {
  return round_to(weight_dtype_, 0.1f * uniform(kWeightSeed, i));
}

float ModelBuffers::initial_grad(double loss_scale, std::int64_t i) const {
  // Magnitudes in [0.5, 1) x 1e-3, random signs: no gradient is near zero, where Adam-type
  // updates (g / (|g| + eps)) turn a rounding difference into a large relative one and a
  // 16-bit format unscaled in place (the unfused baseline) would flush it to zero.
  const float u = uniform(kGradSeed, i);
  const float g = u >= 0 ? 0.5f + 0.5f * u : -0.5f + 0.5f * u;
  return round_to(grad_dtype_, static_cast<float>(loss_scale * 1e-3) * g);
}

void ModelBuffers::fill_weights(int threads) {
  parallel_for(total_numel(), threads, [&](int, std::int64_t lo, std::int64_t hi) {
    for_each_piece(lo, hi, [&](std::size_t t, std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) store(w_[t].get(), weight_dtype_, i, initial_weight(offsets_[t] + i));
    });
  });
}

void ModelBuffers::fill_grads(double loss_scale, int threads) {
  parallel_for(total_numel(), threads, [&](int, std::int64_t lo, std::int64_t hi) {
    for_each_piece(lo, hi, [&](std::size_t t, std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i)
        store(g_[t].get(), grad_dtype_, i, initial_grad(loss_scale, offsets_[t] + i));
    });
  });
}

void ModelBuffers::copy_grads_from(const ModelBuffers& src, int threads) {
  if (src.offsets_ != offsets_ || src.grad_dtype_ != grad_dtype_)
    throw std::invalid_argument("copy_grads_from: the tensor lists differ");
  const std::size_t es = dtype_size(grad_dtype_);
  parallel_for(total_numel(), threads, [&](int, std::int64_t lo, std::int64_t hi) {
    for_each_piece(lo, hi, [&](std::size_t t, std::int64_t b, std::int64_t e) {
      std::memcpy(static_cast<std::byte*>(g_[t].get()) + b * es,
                  static_cast<const std::byte*>(src.g_[t].get()) + b * es, static_cast<std::size_t>(e - b) * es);
    });
  });
}

std::vector<Param> ModelBuffers::params() const {
  std::vector<Param> p;
  p.reserve(num_tensors());
  for (std::size_t t = 0; t < num_tensors(); ++t) p.push_back({weight(t), grad(t)});
  return p;
}

}  // namespace stepfuse::bench
