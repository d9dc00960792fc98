// Small helpers shared by the API tests (errors_test.cpp, grad_scaler_test.cpp,
// loss_scale_optimizer_test.cpp): error messages, fp32 comparisons, and a model of
// caller-owned tensors with an Optimizer over them.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reference/dtypes.hpp"
#include "reference/harness.hpp"
#include "reference/test_data.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------
// Error messages

inline std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// Runs `f`, which must throw stepfuse::Error, with `code` when one is given, and returns
// its message as it is ("" when it did not throw one).
inline std::string thrown_text(const std::function<void()>& f, std::optional<ErrorCode> code) {
  try {
    f();
  } catch (const Error& e) {
    if (code) {
      EXPECT_EQ(error_code_name(e.code()), error_code_name(*code)) << "message: " << e.what();
    }
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than stepfuse::Error: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception";
  return {};
}

// thrown_text in lower case (messages are matched case-insensitively: "NaN", "nan", "Inf", "inf").
inline std::string thrown_message(const std::function<void()>& f, std::optional<ErrorCode> code) {
  return lower(thrown_text(f, code));
}

// Runs `f`, which must throw stepfuse::Error with `code`; returns the message in lower case.
inline std::string error_message(const std::function<void()>& f, ErrorCode code = ErrorCode::invalid_argument) {
  return thrown_message(f, code);
}

// Runs `f`, which must throw stepfuse::Error (any code); returns the message in lower case.
inline std::string any_error_message(const std::function<void()>& f) { return thrown_message(f, std::nullopt); }

// ---------------------------------------------------------------------------
// Values

// The fp32 value a double rounds to, as a double.
inline double f32(double x) { return static_cast<double>(static_cast<float>(x)); }

template <class T>
std::vector<unsigned char> bytes_of(std::span<const T> s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  return {p, p + s.size_bytes()};
}

// fp32 values agree within 1e-6 relative (plus a tiny absolute floor for values near 0).
inline void expect_close_f32(std::span<const float> a, std::span<const float> b, const std::string& what,
                             double abs_floor = 1e-12) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int bad = 0;
  for (std::size_t j = 0; j < a.size(); ++j) {
    const double x = a[j], y = b[j];
    const double tol = 1e-6 * std::max(std::fabs(x), std::fabs(y)) + abs_floor;
    if (!(std::fabs(x - y) <= tol) && ++bad <= 5) ADD_FAILURE() << what << "[" << j << "]: " << x << " vs " << y;
  }
}

// ---------------------------------------------------------------------------
// A model

// Caller-owned weights and gradients, and an Optimizer over them.
// Weights are N(0, 1) from `seed`, so two TestNets with the same seed start identical.
struct TestNet {
  TestNet(const OptimizerConfig& config, DType weight_dtype, DType grad_dtype, const std::vector<std::int64_t>& sizes,
          std::uint64_t seed = 1, OptimizerOptions options = {})
      : w(weight_dtype, sizes, false),
        g(grad_dtype, sizes, false),
        opt((init(w, seed), config), make_params(w, g), options) {}

  static int init(const HostTensors& t, std::uint64_t seed) {
    Random rng(seed);
    fill_weights(t, rng);
    return 0;
  }

  // Gradients g ~ N(0, 0.25), clamped to [-limit, limit] (by default not at all), rounded to
  // the grad dtype, stored as g * S. S must keep g * S exact (a power of two, no overflow).
  // Returns the unscaled g.
  std::vector<std::vector<double>> set_grads(std::uint64_t seed, double S, double limit = kInf) const {
    Random rng(seed);
    std::vector<std::vector<double>> out;
    for (std::size_t i = 0; i < g.size(); ++i) {
      out.emplace_back();
      for (std::int64_t j = 0; j < g[i].numel; ++j) {
        g.set(i, j, std::clamp(0.5 * rng.normal(), -limit, limit));
        const double v = g.get(i, j);
        out.back().push_back(v);
        g.set(i, j, v * S);
        EXPECT_EQ(g.get(i, j), v * S) << "test setup: g * S not exact";
      }
    }
    return out;
  }
  // Stores the given (already scaled) values.
  void put_grads(const std::vector<std::vector<double>>& v) const {
    for (std::size_t i = 0; i < g.size(); ++i)
      for (std::int64_t j = 0; j < g[i].numel; ++j) g.set(i, j, v[i][static_cast<std::size_t>(j)]);
  }
  std::vector<TensorView> grad_views() const {
    std::vector<TensorView> v;
    for (std::size_t i = 0; i < g.size(); ++i) v.push_back(g[i]);
    return v;
  }

  HostTensors w;
  HostTensors g;
  Optimizer opt;
};

// Two TestNets' weights, state and masters agree (fp32 within 1e-6 rel; f16/bf16 weights within 1 ulp).
inline void expect_nets_close(const TestNet& a, const TestNet& b, double abs_floor = 1e-12) {
  ASSERT_EQ(a.opt.num_params(), b.opt.num_params());
  EXPECT_EQ(a.opt.step_count(), b.opt.step_count());
  for (std::size_t i = 0; i < a.w.size(); ++i) {
    const std::string t = "tensor " + std::to_string(i);
    if (a.w.dtype() == DType::f32) {
      expect_close_f32({static_cast<const float*>(a.w[i].data), static_cast<std::size_t>(a.w[i].numel)},
                       {static_cast<const float*>(b.w[i].data), static_cast<std::size_t>(b.w[i].numel)}, "weight " + t,
                       abs_floor);
    } else {
      int bad = 0;
      for (std::int64_t j = 0; j < a.w[i].numel; ++j) {
        const auto d = ulp_distance16(load_bits16(a.w[i], j), load_bits16(b.w[i], j), a.w.dtype());
        if (d > 1 && ++bad <= 5) ADD_FAILURE() << "weight " << t << "[" << j << "]: " << a.w.get(i, j) << " vs " << b.w.get(i, j);
      }
    }
    expect_close_f32(a.opt.master(i), b.opt.master(i), "master " + t, abs_floor);
    for (std::string_view name : a.opt.state_names())
      expect_close_f32(a.opt.state(i, name), b.opt.state(i, name), std::string(name) + " " + t, abs_floor);
  }
}

// The L2 norm of all the gradients together (as set_grads returns them).
inline double l2_norm(const std::vector<std::vector<double>>& g) {
  double sq = 0;
  for (const auto& t : g)
    for (double x : t) sq += x * x;
  return std::sqrt(sq);
}

// One SGD step with lr = 1 and the gradients `g` clipped by `coef`: every weight of `n` is
// the weight of `w0` (the same model, not stepped) minus g * coef, within 1e-6 relative.
inline void expect_clipped_sgd_step(const TestNet& n, const TestNet& w0, const std::vector<std::vector<double>>& g,
                                    double coef) {
  int bad = 0;
  for (std::size_t i = 0; i < g.size(); ++i)
    for (std::int64_t j = 0; j < n.w[i].numel; ++j) {
      const double expected = w0.w.get(i, j) - g[i][static_cast<std::size_t>(j)] * coef;
      if (std::fabs(n.w.get(i, j) - expected) > 1e-6 * (std::fabs(expected) + 1) && ++bad <= 5)
        ADD_FAILURE() << "weight[" << i << "][" << j << "] = " << n.w.get(i, j) << ", expected " << expected;
    }
}

}  // namespace stepfuse::ref
