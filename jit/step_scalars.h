/* The per-step scalars of the built-in optimizers, as rules evaluated on the
 * host (CPU backend) and on the device (embedded verbatim into the generated
 * CUDA C++), so both compute bitwise the same values from the same data.
 *
 * A rule is data: the host turns a config into one rule per program scalar
 * when the config changes; evaluating the rules for (step, gscale) is the
 * scalar stage. Only IEEE-exact double operations (+ - * / and sqrt, powers by
 * repeated squaring) are used, so the result does not depend on the libm or
 * the device. C and C++ and CUDA; no includes. */
#ifndef STEPFUSE_JIT_STEP_SCALARS_H_
#define STEPFUSE_JIT_STEP_SCALARS_H_

#ifndef SF_HD
#define SF_HD
#endif
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SF_DSQRT(x) sqrt(x)
#else
#define SF_DSQRT(x) __builtin_sqrt(x)
#endif

enum sf_rule_kind {
  SF_RULE_FIXED = 0,                /* a                                   */
  SF_RULE_GSCALE = 1,               /* a * gscale (a = -1 with maximize)   */
  SF_RULE_FIRST_STEP = 2,           /* step == 1 ? a : b                   */
  SF_RULE_DIV_ONE_MINUS_POW = 3,    /* a / (1 - b^step)   (Adam's lr / bias_correction1) */
  SF_RULE_SQRT_ONE_MINUS_POW = 4,   /* sqrt(1 - b^step)   (Adam's sqrt(bias_correction2)) */
  SF_RULE_DIV_LINEAR = 5            /* a / (1 + (step - 1) * b)   (Adagrad's lr decay)     */
};

typedef struct sf_scalar_rule {
  int kind;
  int pad_;
  double a, b;
} sf_scalar_rule;

/* x^n for n >= 0 by repeated squaring: the same rounding everywhere. */
SF_HD static inline double sf_powi(double x, long long n) {
  double result = 1.0;
  while (n > 0) {
    if (n & 1) result *= x;
    x *= x;
    n >>= 1;
  }
  return result;
}

/* The rule's value in double; the caller rounds it to fp32 once. */
SF_HD static inline double sf_eval_rule(const sf_scalar_rule* r, long long step, double gscale) {
  switch (r->kind) {
    case SF_RULE_GSCALE: return r->a * gscale;
    case SF_RULE_FIRST_STEP: return step == 1 ? r->a : r->b;
    case SF_RULE_DIV_ONE_MINUS_POW: return r->a / (1.0 - sf_powi(r->b, step));
    case SF_RULE_SQRT_ONE_MINUS_POW: return SF_DSQRT(1.0 - sf_powi(r->b, step));
    case SF_RULE_DIV_LINEAR: return r->a / (1.0 + (double)(step - 1) * r->b);
    default: return r->a;
  }
}

/* The update pass's per-step scalars: rule k evaluated for applying step `step`
 * (1-based) with the gradient multiplier `gscale`, each rounded to fp32 once. */
SF_HD static inline void sf_eval_scalars(const sf_scalar_rule* rules, int n, long long step, double gscale,
                                         float* out) {
  for (int k = 0; k < n; ++k) out[k] = (float)sf_eval_rule(&rules[k], step, gscale);
}

#endif /* STEPFUSE_JIT_STEP_SCALARS_H_ */
