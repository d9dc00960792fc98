// Consumer smoke test: one AdamW step through an installed stepfuse must move the weights.
// Exits 0 when it did, 1 (with a message) otherwise.
#include <stepfuse/stepfuse.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// The first AdamW step from zero state moves every weight by lr * sign(g) after decay:
// p' = p * (1 - lr * wd) - lr * |g| / (|g| + eps) * sign(g).
bool check(const char* name, const std::vector<float>& w, float before, float g, double lr, double wd) {
  const double expected = before * (1.0 - lr * wd) - lr * (g > 0 ? 1.0 : -1.0);
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (!(std::fabs(w[i] - expected) <= 1e-5 * std::fabs(expected))) {
      std::fprintf(stderr, "%s[%zu] = %.9g after the step, expected %.9g (was %.9g)\n", name, i,
                   static_cast<double>(w[i]), expected, static_cast<double>(before));
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
  using namespace stepfuse;
  constexpr double kScale = 1024.0;
  // Sizes that are not a multiple of any vector width.
  std::vector<float> w1(37, 1.0f), g1(37, static_cast<float>(0.5 * kScale));
  std::vector<float> w2(1001, -2.0f), g2(1001, static_cast<float>(-0.25 * kScale));

  optim::AdamW adamw;
  adamw.lr = 1e-2;
  std::vector<Param> params = {
      {{w1.data(), static_cast<std::int64_t>(w1.size()), DType::f32},
       {g1.data(), static_cast<std::int64_t>(g1.size()), DType::f32}},
      {{w2.data(), static_cast<std::int64_t>(w2.size()), DType::f32},
       {g2.data(), static_cast<std::int64_t>(g2.size()), DType::f32}},
  };
  OptimizerOptions options;
  options.max_grad_norm = 1e6;  // on, but far above the norm: exercises the reduce pass only

  try {
    Optimizer opt(adamw, params, options);
    const StepResult r = opt.step_scaled(kScale);
    std::printf("stepfuse %s (%s): applied=%d found_inf=%d grad_norm=%.6g\n", version(), cpu_target(),
                r.applied, r.found_inf, r.grad_norm);
    if (!r.applied || r.found_inf || opt.step_count() != 1) {
      std::fprintf(stderr, "the step was not applied\n");
      return 1;
    }
    const double norm = std::sqrt(37 * 0.25 + 1001 * 0.0625);
    if (!(std::fabs(r.grad_norm - norm) <= 1e-5 * norm)) {
      std::fprintf(stderr, "grad_norm %.9g, expected %.9g\n", r.grad_norm, norm);
      return 1;
    }
    if (!check("w1", w1, 1.0f, 0.5f, adamw.lr, adamw.weight_decay) ||
        !check("w2", w2, -2.0f, -0.25f, adamw.lr, adamw.weight_decay))
      return 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "stepfuse::Error (%s): %s\n", std::string(error_code_name(e.code())).c_str(), e.what());
    return 1;
  }
  std::printf("consumer OK\n");
  return 0;
}
