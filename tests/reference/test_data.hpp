// Test data: a portable seeded random source and caller-owned host tensors of any dtype.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "reference/dtypes.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::ref {

// SplitMix64 with Box-Muller normals: the same numbers on every platform and
// standard library (std::normal_distribution is not specified bit for bit).
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1).
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(kTwoPi * uniform());
  }
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t state_;
};

// A list of host tensors of one dtype, either each in its own allocation or all
// packed back to back in one flat buffer (so most of them start unaligned).
// Tensors of zero elements get a null data pointer, which the API allows.
class HostTensors {
 public:
  HostTensors(DType dtype, const std::vector<std::int64_t>& sizes, bool flat) : dtype_(dtype) {
    const std::size_t esize = dtype_size(dtype);
    if (flat) {
      std::int64_t total = 0;
      for (std::int64_t n : sizes) total += n;
      pool_.assign((static_cast<std::size_t>(total) * esize + 15) / 8 + 1, 0);
      char* base = reinterpret_cast<char*>(pool_.data());
      std::int64_t offset = 0;
      for (std::int64_t n : sizes) {
        views_.push_back({n > 0 ? base + offset * esize : nullptr, n, dtype});
        offset += n;
      }
    } else {
      own_.resize(sizes.size());
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        own_[i].assign((static_cast<std::size_t>(sizes[i]) * esize + 7) / 8, 0);
        views_.push_back({sizes[i] > 0 ? own_[i].data() : nullptr, sizes[i], dtype});
      }
    }
  }
  HostTensors(const HostTensors&) = delete;
  HostTensors& operator=(const HostTensors&) = delete;

  std::size_t size() const { return views_.size(); }
  const TensorView& operator[](std::size_t i) const { return views_[i]; }
  DType dtype() const { return dtype_; }

  // Element j of tensor i, exactly, as double.
  double get(std::size_t i, std::int64_t j) const { return load(views_[i], j); }
  // Stores x into element j of tensor i, correctly rounded to the dtype.
  void set(std::size_t i, std::int64_t j, double x) const { store(views_[i], j, x); }
  std::vector<double> values(std::size_t i) const {
    std::vector<double> v(static_cast<std::size_t>(views_[i].numel));
    for (std::int64_t j = 0; j < views_[i].numel; ++j) v[static_cast<std::size_t>(j)] = get(i, j);
    return v;
  }
  std::vector<std::vector<double>> all_values() const {
    std::vector<std::vector<double>> v;
    for (std::size_t i = 0; i < size(); ++i) v.push_back(values(i));
    return v;
  }
  // The raw bytes of every tensor, for bitwise before/after comparisons.
  std::vector<std::vector<unsigned char>> snapshot() const {
    std::vector<std::vector<unsigned char>> s;
    for (const TensorView& v : views_) {
      const auto* p = static_cast<const unsigned char*>(v.data);
      s.emplace_back(p, p + static_cast<std::size_t>(v.numel) * dtype_size(dtype_));
    }
    return s;
  }
  // Overwrites every tensor with the bytes of an earlier snapshot.
  void restore(const std::vector<std::vector<unsigned char>>& s) const {
    for (std::size_t i = 0; i < views_.size(); ++i)
      if (!s[i].empty()) std::memcpy(views_[i].data, s[i].data(), s[i].size());
  }

 private:
  DType dtype_;
  std::vector<std::uint64_t> pool_;
  std::vector<std::vector<std::uint64_t>> own_;
  std::vector<TensorView> views_;
};

}  // namespace stepfuse::ref
