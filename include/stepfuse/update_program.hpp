// Custom update programs: an optimizer written by the user in the update IR
// (program.hpp), with the definitions of its per-step scalars, ready to run.
//
// An UpdateProgram owns everything it refers to (the names a Program holds as
// string_views are copied into it), is validated when constructed, and is
// immutable; copies share the same storage. An Optimizer built from one runs it
// with the same fusion as the built-ins: unscale, inf/NaN check, clipping and
// the update in one reduce pass and one update pass, on every backend
// (docs/update-programs.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "stepfuse/optim.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse {

// How a per-step scalar gets its value for applying step `t` (1-based), `gscale`
// being the step's gradient multiplier (clip coefficient / loss scale). The value
// is computed in double from + - * /, sqrt and bit manipulation only (powers,
// logarithms and exponentials included: jit/step_scalars.h), then rounded once to
// fp32; host and GPU compute it bitwise alike. The values of Kind are those of the
// device ABI's sf_rule_kind (stepfuse/device_abi.h) and the C ABI's SF_SCALAR_*;
// b^t is a power by repeated squaring, x^y for real y accurate to about a double ulp.
struct ScalarRule {
  enum class Kind : std::uint8_t {
    fixed = 0,               // a
    gscale = 1,              // a * gscale   (a = 1: the gradient multiplier; -1 to maximize)
    first_step = 2,          // t == 1 ? a : b
    div_one_minus_pow = 3,   // a / (1 - b^t)      (Adam's step size lr / bias_correction1)
    sqrt_one_minus_pow = 4,  // sqrt(1 - b^t)      (Adam's sqrt(bias_correction2))
    div_linear = 5,          // a / (1 + (t - 1) * b)   (Adagrad's lr decay)
    one_minus_pow = 6,       // 1 - b^t            (RAdam's bias_correction1, NAdam's bias_correction2)
    // NAdam with lr = a, beta1 = b, momentum_decay = c: mu_t = b * (1 - 0.5 * 0.96^(t * c)),
    // P_t = mu_1 * ... * mu_t (in closed form, rounded to fp32 as PyTorch's mu_product; a
    // built-in NAdam's group also carries the product of steps taken with other values):
    nadam_grad_coef = 7,      // -a * (1 - mu_t) / (1 - P_t)
    nadam_momentum_coef = 8,  // -a * mu_(t+1) / (1 - P_t * mu_(t+1))
    // RAdam with beta2 = b: rho_inf = 2 / (1 - b) - 1, rho_t = rho_inf - 2 t b^t / (1 - b^t):
    radam_rect = 9,  // rho_t > 5 ? sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t)) : 0
    // ASGD with lr = a, lambd = b, alpha = c:
    asgd_eta = 10,    // eta_t = a / (1 + b * a * (t - 1))^c   (lr on the first step)
    asgd_decay = 11,  // 1 - b * eta_t, with eta_t rounded to fp32 first (PyTorch keeps eta in fp32)
    asgd_mu = 12,     // t == 1 ? 1 : 1 / max(1, t - 1 - a)    (a = t0)
  };
  Kind kind = Kind::fixed;
  double a = 0.0, b = 0.0, c = 0.0;

  // The rule's value in double (before the rounding to fp32).
  double eval(std::int64_t step, double gscale) const;
  bool operator==(const ScalarRule&) const = default;
};

// "fixed", "gscale", "first_step", "div_one_minus_pow", "sqrt_one_minus_pow", "div_linear",
// "one_minus_pow", "nadam_grad_coef", "nadam_momentum_coef", "radam_rect", "asgd_eta",
// "asgd_decay", "asgd_mu".
std::string_view scalar_rule_name(ScalarRule::Kind kind);

// One scalar of a program and its rule.
struct ScalarDef {
  std::string name;
  ScalarRule rule;
  bool operator==(const ScalarDef&) const = default;
};

class UpdateProgram {
 public:
  // Copies `program` (and every name in it) and the definitions, then validates:
  // the program itself (validate(): the message names the instruction, its op and
  // the problem); every scalar the program declares has exactly one definition
  // and every definition names a declared scalar; at least one scalar has the
  // gscale rule (else loss scaling and clipping would not reach the update);
  // names are identifiers ([A-Za-z_][A-Za-z0-9_]*, at most 64 characters: they
  // appear in generated code and checkpoints); rule parameters and state init
  // values are finite. Throws Error(invalid_argument) naming what is wrong.
  // Allocates.
  UpdateProgram(const Program& program, std::vector<ScalarDef> scalars);

  // The built-in program a config runs, with the scalar rules of that config
  // (a snapshot: later changes to the config are not seen). Validates the config
  // as Optimizer does. For emitting a built-in's kernels (emit.hpp).
  static UpdateProgram from_config(const OptimizerConfig& config);

  // ---- definitions, for the constructor's list ----
  // A fixed value (a hyperparameter: "lr", "beta1", ...); Optimizer::set_scalar changes it.
  static ScalarDef fixed(std::string name, double value);
  // The gradient multiplier of the step, times `multiplier` (-1 to maximize). Every
  // program multiplies its gradient by one of these.
  static ScalarDef gscale(std::string name = "gscale", double multiplier = 1.0);
  // `first` on the first step, `later` afterwards (SGD's momentum buffer starts as the gradient).
  static ScalarDef first_step(std::string name, double first, double later);
  // lr / (1 - beta1^t): Adam's step size, the first moment's bias correction folded in.
  static ScalarDef bias_correction1_step_size(std::string name, double lr, double beta1);
  // sqrt(1 - beta2^t): Adam's sqrt(bias_correction2).
  static ScalarDef bias_correction2_sqrt(std::string name, double beta2);
  // lr / (1 + (t - 1) * decay): Adagrad's decayed learning rate.
  static ScalarDef lr_decay(std::string name, double lr, double decay);
  // 1 - beta^t: a bias correction itself (RAdam's bias_correction1).
  static ScalarDef bias_correction(std::string name, double beta);
  // NAdam's two step coefficients (ScalarRule::Kind::nadam_grad_coef, nadam_momentum_coef).
  static ScalarDef nadam_grad_coef(std::string name, double lr, double beta1, double momentum_decay);
  static ScalarDef nadam_momentum_coef(std::string name, double lr, double beta1, double momentum_decay);
  // RAdam's rectification term, 0 while rho_t <= 5 (ScalarRule::Kind::radam_rect).
  static ScalarDef radam_rect(std::string name, double beta2);
  // ASGD's eta_t, the parameter decay 1 - lambd * eta_t and the averaging weight mu_t
  // (ScalarRule::Kind::asgd_eta, asgd_decay, asgd_mu).
  static ScalarDef asgd_eta(std::string name, double lr, double lambd, double alpha);
  static ScalarDef asgd_decay(std::string name, double lr, double lambd, double alpha);
  static ScalarDef asgd_mu(std::string name, double t0);

  const Program& program() const;  // string_views into this object's storage (shared by copies)
  std::string_view name() const { return program().name; }
  // One definition per program scalar, in the program's scalar order.
  const std::vector<ScalarDef>& scalars() const { return scalars_; }
  // The definition of scalar `name`; Error(invalid_argument) listing the scalars when absent.
  const ScalarDef& scalar(std::string_view name) const;

  // A copy with scalar `name`'s rule replaced, validated as the constructor does.
  UpdateProgram with_rule(std::string_view name, ScalarRule rule) const;
  // A copy with the rules of the named scalars replaced (the others kept), validated.
  UpdateProgram with_rules(const std::vector<ScalarDef>& defs) const;
  // A copy with a fixed scalar's value replaced (Error if `name` is not fixed).
  UpdateProgram with_value(std::string_view name, double value) const;

  // The program listing (to_string(program())) followed by the scalar rules:
  //   scalars
  //     gscale = gscale * 1
  //     lr = 0.0001
  std::string text() const;

 private:
  struct Storage;
  UpdateProgram(std::shared_ptr<const Storage> storage, std::vector<ScalarDef> scalars);
  std::shared_ptr<const Storage> storage_;
  std::vector<ScalarDef> scalars_;
};

}  // namespace stepfuse
