// What the sharded-step tests share (tests/sharded_step_test.cpp with in-process
// ranks, tests/mpi/sharded_step_mpi_test.cpp across processes): a small model whose
// tensors cross the 16384-element chunk, gradients that any partition of it sees
// alike, partitions into whole tensors or slices, and the optimizers and setups
// every test runs.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "reference/test_data.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::sharded_test {

using ref::HostTensors;

inline const std::vector<std::int64_t> kSizes = {40000, 100, 16384, 50000, 7, 33000};

// A gradient element, from (step, tensor, element) alone, so any partition of the
// model sees the same values: uniform in (-1, 1), times S, times 2^-16, 1 or 2^16 by
// tensor — magnitudes far enough apart that the fp64 sum of the tensors' sums of
// squares rounds, so a combine in another order than one process's gives other
// bits (small sums of fp32 partials are exact in fp64 in any order). inf_step and
// inf_tensor put a +inf in.
struct GradSource {
  double S = 1024.0;
  int inf_step = -1;
  std::size_t inf_tensor = 0;
  double value(int step, std::size_t tensor, std::int64_t j) const {
    if (step == inf_step && tensor == inf_tensor && j == 3) return INFINITY;
    std::uint64_t x = (static_cast<std::uint64_t>(step) << 48) ^ (static_cast<std::uint64_t>(tensor) << 40) ^
                      static_cast<std::uint64_t>(j);
    x += 0x9E3779B97F4A7C15ull;  // splitmix64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (static_cast<double>(x >> 11) * 0x1p-53 * 2.0 - 1.0) * S * std::ldexp(1.0, 16 * (static_cast<int>(tensor % 3) - 1));
  }
};

// The whole model's weights and gradients.
struct Model {
  Model(DType wd, DType gd, const std::vector<std::int64_t>& sizes = kSizes) : w(wd, sizes, false), g(gd, sizes, false) {
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::int64_t j = 0; j < sizes[t]; ++j) w.set(t, j, std::sin(0.37 * static_cast<double>(j) + static_cast<double>(t)));
  }
  HostTensors w, g;
};

// A part of the model's tensor `tensor` on one rank.
struct Piece {
  std::size_t tensor;
  std::int64_t offset, numel;
};
using Partition = std::vector<std::vector<Piece>>;  // per rank

inline TensorView slice_of(const TensorView& v, std::int64_t offset, std::int64_t numel) {
  return {static_cast<char*>(v.data) + offset * static_cast<std::int64_t>(dtype_size(v.dtype)), numel, v.dtype};
}

inline void fill_grads(const Model& m, const GradSource& src, int step, const std::vector<Piece>& pieces) {
  for (const Piece& p : pieces)
    for (std::int64_t j = p.offset; j < p.offset + p.numel; ++j) m.g.set(p.tensor, j, src.value(step, p.tensor, j));
}

inline std::vector<Piece> whole_model() {
  std::vector<Piece> all;
  for (std::size_t t = 0; t < kSizes.size(); ++t) all.push_back({t, 0, kSizes[t]});
  return all;
}

// Whole tensors: contiguous runs of the model's tensors, one run per rank.
inline Partition whole_tensors(int ranks) {
  Partition p(static_cast<std::size_t>(ranks));
  for (std::size_t t = 0; t < kSizes.size(); ++t)
    p[t * static_cast<std::size_t>(ranks) / kSizes.size()].push_back({t, 0, kSizes[t]});
  return p;
}

// Slices: tensors 0 and 3 cut at chunk boundaries and spread over the ranks, the
// others whole, each rank's list in an order unlike the model's.
inline Partition sliced(int ranks) {
  Partition p(static_cast<std::size_t>(ranks));
  const auto r = [&](int k) -> std::vector<Piece>& { return p[static_cast<std::size_t>(k % ranks)]; };
  r(0).push_back({0, 0, 16384});
  r(1).push_back({0, 16384, 40000 - 16384});
  r(2).push_back({3, 0, 16384});
  r(0).push_back({3, 16384, 16384});
  r(1).push_back({3, 32768, 50000 - 32768});
  r(2).push_back({1, 0, 100});
  r(1).push_back({2, 0, 16384});
  r(0).push_back({5, 0, 33000});
  r(1).push_back({4, 0, 7});
  return p;
}

struct DtypeSetup {
  DType weight, grad;
  bool masters;
};
inline const DtypeSetup kSetups[] = {{DType::f32, DType::f32, true},
                         {DType::bf16, DType::bf16, true},
                         {DType::f16, DType::f32, true},
                         {DType::bf16, DType::bf16, false}};

struct Norm {
  std::optional<double> max_grad_norm;
  double norm_type;
};
inline const Norm kNorms[] = {{std::nullopt, 2.0}, {0.5, 2.0}, {0.01, INFINITY}};

inline OptimizerOptions base_options(const Norm& n, Fusion fusion = Fusion::fused) {
  OptimizerOptions o;
  o.max_grad_norm = n.max_grad_norm;
  o.norm_type = n.norm_type;
  o.fusion = fusion;
  o.cpu_backend = CpuBackend::highway;
  o.num_threads = 1;
  return o;
}

inline void expect_same_result(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_EQ(a.applied, b.applied) << what;
  EXPECT_EQ(a.found_inf, b.found_inf) << what;
  EXPECT_EQ(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double)), 0) << what << ": grad_norm " << a.grad_norm << " vs " << b.grad_norm;
  EXPECT_EQ(std::memcmp(&a.clip_coef, &b.clip_coef, sizeof(double)), 0) << what << ": clip_coef " << a.clip_coef << " vs " << b.clip_coef;
}

inline std::vector<float> state_of(const Optimizer& o, std::size_t param, std::int64_t offset, std::int64_t numel) {
  std::vector<float> out;
  for (std::string_view name : o.state_names()) {  // (decoded: any state format)
    const std::vector<float> v = o.state_values(param, name);
    out.insert(out.end(), v.begin() + offset, v.begin() + offset + numel);
  }
  return out;
}

struct Case {
  const char* name;
  OptimizerConfig config;
  bool splittable = true;  // one-phase: its tensors may be split across ranks
};

// GoogleTest prints a case (and CTest names it) by its optimizer's name.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

inline const Case kCases[] = {
    {"SGD", optim::SGD{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}},
    {"Adam", optim::Adam{.lr = 1e-2, .weight_decay = 1e-2, .amsgrad = true}},
    {"AdamW", optim::AdamW{.lr = 1e-2}},
    {"Adagrad", optim::Adagrad{.lr = 0.05, .lr_decay = 1e-3, .initial_accumulator_value = 0.1}},
    {"RMSprop", optim::RMSprop{.lr = 1e-2, .momentum = 0.5, .centered = true}},
    {"Lion", optim::Lion{.lr = 1e-3, .weight_decay = 0.1}},
    {"NAdam", optim::NAdam{.lr = 1e-2, .decoupled_weight_decay = true}},
    {"RAdam", optim::RAdam{.lr = 1e-2, .weight_decay = 1e-2}},
    {"Adamax", optim::Adamax{.lr = 1e-2}},
    {"Adadelta", optim::Adadelta{.lr = 0.5, .weight_decay = 1e-3}},
    {"Rprop", optim::Rprop{.lr = 1e-2}},
    {"ASGD", optim::ASGD{.lr = 1e-2, .t0 = 2}},
    {"LAMB", optim::LAMB{.lr = 1e-2}, false},
};

inline std::vector<Param> rank_params(const Model& m, const std::vector<Piece>& pieces) {
  std::vector<Param> out;
  for (const Piece& p : pieces) out.push_back({slice_of(m.w[p.tensor], p.offset, p.numel), slice_of(m.g[p.tensor], p.offset, p.numel)});
  return out;
}


}  // namespace stepfuse::sharded_test
