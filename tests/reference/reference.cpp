// The float64 reference optimizer step, from PyTorch's documented algorithms (see reference.hpp).
//
// Each update below follows the "Algorithm" box of the torch.optim documentation page
// and the single-tensor code path of torch/optim/*.py (foreach=False, fused=False,
// capturable=False, differentiable=False), element by element, in double.
#include "reference/reference.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <type_traits>

namespace stepfuse::ref {
namespace {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

std::vector<double>& state_of(RefTensor& t, const char* name) {
  auto it = t.state.find(name);
  if (it == t.state.end()) throw std::logic_error(std::string("reference: missing state ") + name);
  if (it->second.size() != t.param.size())
    throw std::logic_error(std::string("reference: state ") + name + " has the wrong size");
  return it->second;
}

double sign(double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : x; }  // 0 stays 0, NaN stays NaN

// torch.optim.SGD:
//   g = -g if maximize;  g = g + wd * p
//   if momentum != 0: buf = g on the first step, else buf = momentum * buf + (1 - dampening) * g
//                     g = g + momentum * buf if nesterov, else buf
//   p = p - lr * g
void update_sgd(const optim::SGD& c, RefTensor& t, const std::vector<double>& grad, std::int64_t step) {
  std::vector<double>* buf = c.momentum != 0 ? &state_of(t, "momentum_buffer") : nullptr;
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    const double p = t.param[i];
    double d = c.maximize ? -grad[i] : grad[i];
    if (c.weight_decay != 0) d += c.weight_decay * p;
    if (buf != nullptr) {
      double& b = (*buf)[i];
      b = step == 1 ? d : c.momentum * b + (1 - c.dampening) * d;
      d = c.nesterov ? d + c.momentum * b : b;
    }
    t.param[i] = p - c.lr * d;
  }
}

// torch.optim.Adam (decoupled = false: weight decay is L2, g = g + wd * p) and
// torch.optim.AdamW (decoupled = true: p = p * (1 - lr * wd) before the update):
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   vmax = max(vmax, v) if amsgrad                          (raw, not bias-corrected)
//   p = p - lr / (1 - beta1^t) * m / (sqrt(vmax or v) / sqrt(1 - beta2^t) + eps)
template <class Config>
void update_adam(const Config& c, bool decoupled, RefTensor& t, const std::vector<double>& grad,
                 std::int64_t step) {
  std::vector<double>& m = state_of(t, "exp_avg");
  std::vector<double>& v = state_of(t, "exp_avg_sq");
  std::vector<double>* vmax = c.amsgrad ? &state_of(t, "max_exp_avg_sq") : nullptr;
  const double bias_correction1 = 1 - std::pow(c.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(c.beta2, static_cast<double>(step));
  const double step_size = c.lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    if (decoupled) p *= 1 - c.lr * c.weight_decay;
    else if (c.weight_decay != 0) g += c.weight_decay * p;
    m[i] = c.beta1 * m[i] + (1 - c.beta1) * g;
    v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g;
    double second = v[i];
    if (vmax != nullptr) second = (*vmax)[i] = std::max((*vmax)[i], v[i]);
    const double denom = std::sqrt(second) / bias_correction2_sqrt + c.eps;
    t.param[i] = p - step_size * m[i] / denom;
  }
}

// torch.optim.Adagrad:
//   g = -g if maximize;  g = g + wd * p
//   clr = lr / (1 + (t - 1) * lr_decay)
//   sum = sum + g^2;  p = p - clr * g / (sqrt(sum) + eps)
void update_adagrad(const optim::Adagrad& c, RefTensor& t, const std::vector<double>& grad,
                    std::int64_t step) {
  std::vector<double>& sum = state_of(t, "sum");
  const double clr = c.lr / (1 + static_cast<double>(step - 1) * c.lr_decay);
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    const double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    if (c.weight_decay != 0) g += c.weight_decay * p;
    sum[i] += g * g;
    t.param[i] = p - clr * g / (std::sqrt(sum[i]) + c.eps);
  }
}

// torch.optim.RMSprop:
//   g = -g if maximize;  g = g + wd * p
//   square_avg = alpha * square_avg + (1 - alpha) * g^2
//   centered:  grad_avg = alpha * grad_avg + (1 - alpha) * g;  avg = sqrt(square_avg - grad_avg^2)
//   else:      avg = sqrt(square_avg)
//   avg = avg + eps
//   momentum > 0: buf = momentum * buf + g / avg;  p = p - lr * buf
//   else:         p = p - lr * g / avg
void update_rmsprop(const optim::RMSprop& c, RefTensor& t, const std::vector<double>& grad) {
  std::vector<double>& square_avg = state_of(t, "square_avg");
  std::vector<double>* grad_avg = c.centered ? &state_of(t, "grad_avg") : nullptr;
  std::vector<double>* buf = c.momentum > 0 ? &state_of(t, "momentum_buffer") : nullptr;
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    const double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    if (c.weight_decay != 0) g += c.weight_decay * p;
    square_avg[i] = c.alpha * square_avg[i] + (1 - c.alpha) * g * g;
    double avg;
    if (grad_avg != nullptr) {
      double& ga = (*grad_avg)[i];
      ga = c.alpha * ga + (1 - c.alpha) * g;
      avg = std::sqrt(square_avg[i] - ga * ga);
    } else {
      avg = std::sqrt(square_avg[i]);
    }
    avg += c.eps;
    if (buf != nullptr) {
      double& b = (*buf)[i];
      b = c.momentum * b + g / avg;
      t.param[i] = p - c.lr * b;
    } else {
      t.param[i] = p - c.lr * g / avg;
    }
  }
}

// Lion (Chen et al. 2023, Program 1), weight decay decoupled as in the paper:
//   g = -g if maximize
//   p = p * (1 - lr * wd)
//   c = beta1 * m + (1 - beta1) * g;  p = p - lr * sign(c)
//   m = beta2 * m + (1 - beta2) * g
void update_lion(const optim::Lion& c, RefTensor& t, const std::vector<double>& grad) {
  std::vector<double>& m = state_of(t, "exp_avg");
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    double p = t.param[i];
    const double g = c.maximize ? -grad[i] : grad[i];
    p *= 1 - c.lr * c.weight_decay;
    const double interp = c.beta1 * m[i] + (1 - c.beta1) * g;
    t.param[i] = p - c.lr * sign(interp);
    m[i] = c.beta2 * m[i] + (1 - c.beta2) * g;
  }
}

// torch.optim.NAdam (decoupled_weight_decay: p = p * (1 - lr * wd), else g = g + wd * p):
//   mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay));  mu_product *= mu_t (each step's own)
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   denom = sqrt(v / (1 - beta2^t)) + eps
//   p = p - lr * (1 - mu_t) / (1 - mu_product) * g / denom
//         - lr * mu_{t+1} / (1 - mu_product * mu_{t+1}) * m / denom
double nadam_mu(const optim::NAdam& c, std::int64_t t) {
  return c.beta1 * (1 - 0.5 * std::pow(0.96, static_cast<double>(t) * c.momentum_decay));
}
void update_nadam(const optim::NAdam& c, RefTensor& t, const std::vector<double>& grad, std::int64_t step) {
  std::vector<double>& m = state_of(t, "exp_avg");
  std::vector<double>& v = state_of(t, "exp_avg_sq");
  double mu_product = 1;
  if (t.mu_product) mu_product = *t.mu_product;
  else for (std::int64_t i = 1; i < step; ++i) mu_product *= nadam_mu(c, i);
  mu_product *= nadam_mu(c, step);
  t.mu_product = mu_product;
  const double mu = nadam_mu(c, step), mu_next = nadam_mu(c, step + 1);
  const double bias_correction2 = 1 - std::pow(c.beta2, static_cast<double>(step));
  const double grad_coef = c.lr * (1 - mu) / (1 - mu_product);
  const double momentum_coef = c.lr * mu_next / (1 - mu_product * mu_next);
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    if (c.decoupled_weight_decay) p *= 1 - c.lr * c.weight_decay;
    else g += c.weight_decay * p;
    m[i] = c.beta1 * m[i] + (1 - c.beta1) * g;
    v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g;
    const double denom = std::sqrt(v[i] / bias_correction2) + c.eps;
    t.param[i] = p - grad_coef * g / denom - momentum_coef * m[i] / denom;
  }
}

// torch.optim.RAdam (weight decay as NAdam's):
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
//   m_hat = m / (1 - beta1^t)
//   rho_t > 5: p = p - lr * m_hat * sqrt(1 - beta2^t) / (sqrt(v) + eps) * rect,
//              rect = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
//   else:      p = p - lr * m_hat
void update_radam(const optim::RAdam& c, RefTensor& t, const std::vector<double>& grad, std::int64_t step) {
  std::vector<double>& m = state_of(t, "exp_avg");
  std::vector<double>& v = state_of(t, "exp_avg_sq");
  const double ts = static_cast<double>(step);
  const double bias_correction1 = 1 - std::pow(c.beta1, ts);
  const double bias_correction2 = 1 - std::pow(c.beta2, ts);
  const double rho_inf = 2 / (1 - c.beta2) - 1;
  const double rho_t = rho_inf - 2 * ts * std::pow(c.beta2, ts) / bias_correction2;
  const bool rectified = rho_t > 5;
  const double rect =
      rectified ? std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) : 0;
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    if (c.decoupled_weight_decay) p *= 1 - c.lr * c.weight_decay;
    else g += c.weight_decay * p;
    m[i] = c.beta1 * m[i] + (1 - c.beta1) * g;
    v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g;
    const double m_hat = m[i] / bias_correction1;
    if (rectified)
      t.param[i] = p - c.lr * m_hat * std::sqrt(bias_correction2) / (std::sqrt(v[i]) + c.eps) * rect;
    else
      t.param[i] = p - c.lr * m_hat;
  }
}

// torch.optim.Adamax:
//   g = -g if maximize;  g = g + wd * p
//   m = beta1 * m + (1 - beta1) * g;  u = max(beta2 * u, |g| + eps)
//   p = p - lr / (1 - beta1^t) * m / u
void update_adamax(const optim::Adamax& c, RefTensor& t, const std::vector<double>& grad, std::int64_t step) {
  std::vector<double>& m = state_of(t, "exp_avg");
  std::vector<double>& u = state_of(t, "exp_inf");
  const double clr = c.lr / (1 - std::pow(c.beta1, static_cast<double>(step)));
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    const double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    g += c.weight_decay * p;
    m[i] = c.beta1 * m[i] + (1 - c.beta1) * g;
    u[i] = std::max(c.beta2 * u[i], std::fabs(g) + c.eps);
    t.param[i] = p - clr * m[i] / u[i];
  }
}

// torch.optim.Adadelta:
//   g = -g if maximize;  g = g + wd * p
//   square_avg = rho * square_avg + (1 - rho) * g^2
//   delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
//   acc_delta = rho * acc_delta + (1 - rho) * delta^2
//   p = p - lr * delta
void update_adadelta(const optim::Adadelta& c, RefTensor& t, const std::vector<double>& grad) {
  std::vector<double>& sq = state_of(t, "square_avg");
  std::vector<double>& acc = state_of(t, "acc_delta");
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    const double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    g += c.weight_decay * p;
    sq[i] = c.rho * sq[i] + (1 - c.rho) * g * g;
    const double delta = std::sqrt(acc[i] + c.eps) / std::sqrt(sq[i] + c.eps) * g;
    acc[i] = c.rho * acc[i] + (1 - c.rho) * delta * delta;
    t.param[i] = p - c.lr * delta;
  }
}

// torch.optim.Rprop (step_size starts at lr):
//   g = -g if maximize
//   g * prev > 0: step_size = min(step_size * eta_plus, step_size_max)
//   g * prev < 0: step_size = max(step_size * eta_minus, step_size_min), g = 0
//   (clamped to [step_size_min, step_size_max] in every case)
//   p = p - sign(g) * step_size;  prev = g   (torch.sign: NaN -> 0, so a NaN g moves nothing)
void update_rprop(const optim::Rprop& c, RefTensor& t, const std::vector<double>& grad) {
  std::vector<double>& prev = state_of(t, "prev");
  std::vector<double>& step_size = state_of(t, "step_size");
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    double g = c.maximize ? -grad[i] : grad[i];
    const double direction = g * prev[i];
    const double factor = direction > 0 ? c.eta_plus : direction < 0 ? c.eta_minus : 1.0;
    step_size[i] = std::min(std::max(step_size[i] * factor, c.step_size_min), c.step_size_max);
    if (direction < 0) g = 0;
    t.param[i] -= (g > 0 ? 1.0 : g < 0 ? -1.0 : 0.0) * step_size[i];
    prev[i] = g;
  }
}

// torch.optim.ASGD (eta = lr and mu = 1 before the first step):
//   g = -g if maximize;  g = g + wd * p
//   eta = lr / (1 + lambd * lr * (t - 1))^alpha;  mu = 1 / max(1, t - 1 - t0)  (t > 1)
//   p = p * (1 - lambd * eta) - eta * g
//   ax = p if mu == 1, else ax + (p - ax) * mu
void update_asgd(const optim::ASGD& c, RefTensor& t, const std::vector<double>& grad, std::int64_t step) {
  std::vector<double>& ax = state_of(t, "ax");
  const double done = static_cast<double>(step - 1);  // steps taken before this one
  const double eta = c.lr / std::pow(1 + c.lambd * c.lr * done, c.alpha);
  const double mu = step == 1 ? 1.0 : 1 / std::max(1.0, done - c.t0);
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    const double p = t.param[i];
    double g = c.maximize ? -grad[i] : grad[i];
    g += c.weight_decay * p;
    const double updated = p * (1 - c.lambd * eta) - eta * g;
    t.param[i] = updated;
    ax[i] = mu == 1 ? updated : ax[i] + (updated - ax[i]) * mu;
  }
}

// LAMB as NVIDIA Apex's FusedLAMB (adam_w_mode, bias_correction, grad_averaging; no
// NVLAMB), its global clipping being the pipeline's clip_grad_norm_:
//   g = -g if maximize;  m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd * p
//   ratio = ||p|| / ||u|| over the tensor when wd != 0 and both norms are != 0, else 1
//   p = p - lr * ratio * u
// (the norms in double here; the library keeps them in fp32).
void update_lamb(const optim::LAMB& c, RefTensor& t, const std::vector<double>& grad, std::int64_t step) {
  std::vector<double>& m = state_of(t, "exp_avg");
  std::vector<double>& v = state_of(t, "exp_avg_sq");
  const double bc1 = 1 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(c.beta2, static_cast<double>(step));
  std::vector<double> u(t.param.size());
  double param_sq = 0, update_sq = 0;
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    const double g = c.maximize ? -grad[i] : grad[i];
    m[i] = c.beta1 * m[i] + (1 - c.beta1) * g;
    v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g;
    u[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + c.eps) + c.weight_decay * t.param[i];
    param_sq += t.param[i] * t.param[i];
    update_sq += u[i] * u[i];
  }
  const double param_norm = std::sqrt(param_sq), update_norm = std::sqrt(update_sq);
  const double ratio = c.weight_decay != 0 && param_norm != 0 && update_norm != 0 ? param_norm / update_norm : 1.0;
  for (std::size_t i = 0; i < t.param.size(); ++i) t.param[i] -= c.lr * ratio * u[i];
}

}  // namespace

std::vector<std::string> state_names(const OptimizerConfig& config) {
  std::vector<std::string> names = std::visit(
      Overloaded{
          [](const optim::SGD& c) -> std::vector<std::string> {
            if (c.momentum != 0) return {"momentum_buffer"};
            return {};
          },
          [](const optim::Adam& c) -> std::vector<std::string> {
            if (c.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
            return {"exp_avg", "exp_avg_sq"};
          },
          [](const optim::AdamW& c) -> std::vector<std::string> {
            if (c.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
            return {"exp_avg", "exp_avg_sq"};
          },
          [](const optim::Adagrad&) -> std::vector<std::string> { return {"sum"}; },
          [](const optim::RMSprop& c) {
            std::vector<std::string> n{"square_avg"};
            if (c.momentum > 0) n.push_back("momentum_buffer");
            if (c.centered) n.push_back("grad_avg");
            return n;
          },
          [](const optim::Lion&) -> std::vector<std::string> { return {"exp_avg"}; },
          [](const optim::NAdam&) -> std::vector<std::string> { return {"exp_avg", "exp_avg_sq"}; },
          [](const optim::RAdam&) -> std::vector<std::string> { return {"exp_avg", "exp_avg_sq"}; },
          [](const optim::Adamax&) -> std::vector<std::string> { return {"exp_avg", "exp_inf"}; },
          [](const optim::Adadelta&) -> std::vector<std::string> { return {"square_avg", "acc_delta"}; },
          [](const optim::Rprop&) -> std::vector<std::string> { return {"prev", "step_size"}; },
          [](const optim::ASGD&) -> std::vector<std::string> { return {"ax"}; },
          [](const optim::LAMB&) -> std::vector<std::string> { return {"exp_avg", "exp_avg_sq"}; },
      },
      config);
  std::sort(names.begin(), names.end());
  return names;
}

double initial_state_value(const OptimizerConfig& config, std::string_view name) {
  if (const auto* a = std::get_if<optim::Adagrad>(&config); a != nullptr && name == "sum")
    return a->initial_accumulator_value;
  if (const auto* r = std::get_if<optim::Rprop>(&config); r != nullptr && name == "step_size") return r->lr;
  return 0.0;
}

RefTensor make_tensor(const OptimizerConfig& config, std::vector<double> param) {
  RefTensor t;
  for (const std::string& name : state_names(config))
    t.state[name] = std::vector<double>(param.size(), initial_state_value(config, name));
  t.param = std::move(param);
  return t;
}

double learning_rate(const OptimizerConfig& config) {
  return std::visit([](const auto& c) { return c.lr; }, config);
}

bool any_non_finite(const std::vector<std::vector<double>>& grads) {
  for (const auto& g : grads)
    for (double x : g)
      if (!std::isfinite(x)) return true;
  return false;
}

double total_norm(const std::vector<std::vector<double>>& grads, double norm_type) {
  if (std::isinf(norm_type)) {
    double m = 0;
    for (const auto& g : grads)
      for (double x : g) m = std::max(m, std::fabs(x));
    return m;
  }
  if (norm_type != 2) throw std::invalid_argument("reference: norm_type must be 2 or inf");
  double total = 0;  // sum over tensors of (per-tensor norm)^2, as clip_grad_norm_ stacks them
  for (const auto& g : grads) {
    double s = 0;
    for (double x : g) s += x * x;
    total += s;
  }
  return std::sqrt(total);
}

double clip_coefficient(double norm, double max_norm) {
  return std::min(1.0, max_norm / (norm + kClipEpsilon));
}

void update(const OptimizerConfig& config, RefTensor& tensor, const std::vector<double>& grad,
            std::int64_t step) {
  if (grad.size() != tensor.param.size()) throw std::logic_error("reference: grad/param size mismatch");
  if (step < 1) throw std::logic_error("reference: step is 1-based");
  std::visit(Overloaded{
                 [&](const optim::SGD& c) { update_sgd(c, tensor, grad, step); },
                 [&](const optim::Adam& c) { update_adam(c, /*decoupled=*/false, tensor, grad, step); },
                 [&](const optim::AdamW& c) { update_adam(c, /*decoupled=*/true, tensor, grad, step); },
                 [&](const optim::Adagrad& c) { update_adagrad(c, tensor, grad, step); },
                 [&](const optim::RMSprop& c) { update_rmsprop(c, tensor, grad); },
                 [&](const optim::Lion& c) { update_lion(c, tensor, grad); },
                 [&](const optim::NAdam& c) { update_nadam(c, tensor, grad, step); },
                 [&](const optim::RAdam& c) { update_radam(c, tensor, grad, step); },
                 [&](const optim::Adamax& c) { update_adamax(c, tensor, grad, step); },
                 [&](const optim::Adadelta& c) { update_adadelta(c, tensor, grad); },
                 [&](const optim::Rprop& c) { update_rprop(c, tensor, grad); },
                 [&](const optim::ASGD& c) { update_asgd(c, tensor, grad, step); },
                 [&](const optim::LAMB& c) { update_lamb(c, tensor, grad, step); },
             },
             config);
}

RefStepResult step(const OptimizerConfig& config, std::vector<RefTensor>& tensors,
                   const std::vector<std::vector<double>>& scaled_grads, const RefStepInput& input) {
  if (scaled_grads.size() != tensors.size()) throw std::logic_error("reference: one gradient per tensor");
  RefStepResult result;
  // GradScaler: a non-finite scaled gradient skips the whole step.
  if (any_non_finite(scaled_grads)) {
    result.found_inf = true;
    return result;
  }
  // unscale_: g / S.
  std::vector<std::vector<double>> grads = scaled_grads;
  for (auto& g : grads)
    for (double& x : g) x /= input.loss_scale;
  // clip_grad_norm_ on the unscaled gradients.
  result.grad_norm = total_norm(grads, input.norm_type);
  if (input.max_grad_norm) {
    result.clip_coef = clip_coefficient(result.grad_norm, *input.max_grad_norm);
    for (auto& g : grads)
      for (double& x : g) x *= result.clip_coef;
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) update(config, tensors[i], grads[i], input.step);
  result.effective_grads = std::move(grads);
  return result;
}

}  // namespace stepfuse::ref
