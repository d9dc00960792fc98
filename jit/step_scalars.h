/* The per-step scalars of the built-in optimizers, as rules evaluated on the
 * host (CPU backend) and on the device (embedded verbatim into the generated
 * CUDA C++), so both compute bitwise the same values from the same data.
 *
 * A rule is data: the host turns a config into one rule per program scalar
 * when the config changes; evaluating the rules for (step, gscale) is the
 * scalar stage. Only IEEE double operations that round the same everywhere are
 * used: + - * / and sqrt, powers by repeated squaring, and the real powers,
 * logarithms and exponentials below, written with those operations and bit
 * manipulation of doubles (no libm), so the result does not depend on the libm
 * or the device. Compile without floating-point contraction (-ffp-contract=off;
 * NVRTC --fmad=false), as stepfuse does: the exact products below rely on it.
 * C and C++ and CUDA; no includes.
 *
 * Changing anything here changes the generated CUDA text: bump the CUDA emitter's
 * version (jit/cuda/emit_cuda.cpp, kEmitterVersion). */
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

/* t is the 1-based index of the step being applied; b^t is a power by repeated
 * squaring (sf_powi), x^y for real y is sf_pow. The values of these kinds are
 * stepfuse::ScalarRule::Kind's and the C ABI's SF_SCALAR_* (append only). */
enum sf_rule_kind {
  SF_RULE_FIXED = 0,               /* a                                   */
  SF_RULE_GSCALE = 1,              /* a * gscale (a = -1 with maximize)   */
  SF_RULE_FIRST_STEP = 2,          /* t == 1 ? a : b                      */
  SF_RULE_DIV_ONE_MINUS_POW = 3,   /* a / (1 - b^t)   (Adam's lr / bias_correction1) */
  SF_RULE_SQRT_ONE_MINUS_POW = 4,  /* sqrt(1 - b^t)   (Adam's sqrt(bias_correction2)) */
  SF_RULE_DIV_LINEAR = 5,          /* a / (1 + (t - 1) * b)   (Adagrad's lr decay)     */
  SF_RULE_ONE_MINUS_POW = 6,       /* 1 - b^t   (RAdam's bias_correction1, NAdam's bias_correction2) */
  /* NAdam, with lr = a, beta1 = b, momentum_decay = c: mu_t = b (1 - 0.5 * 0.96^(t c)),
   * P_t = exp(d) * mu_1 * ... * mu_t rounded to fp32 (PyTorch keeps mu_product in fp32;
   * d = 0 unless b or c changed between steps: sf_nadam_product_offset): */
  SF_RULE_NADAM_GRAD_COEF = 7,     /* -a (1 - mu_t) / (1 - P_t)                  */
  SF_RULE_NADAM_MOMENTUM_COEF = 8, /* -a mu_{t+1} / (1 - P_t mu_{t+1})           */
  /* RAdam, beta2 = b: rho_inf = 2 / (1 - b) - 1, rho_t = rho_inf - 2 t b^t / (1 - b^t): */
  SF_RULE_RADAM_RECT = 9,          /* rho_t > 5 ? sqrt((rho_t - 4)(rho_t - 2) rho_inf
                                                       / ((rho_inf - 4)(rho_inf - 2) rho_t)) : 0 */
  /* ASGD, with lr = a, lambd = b, alpha = c, t0 = a (asgd_mu): */
  SF_RULE_ASGD_ETA = 10,           /* eta_t = a / (1 + b a (t - 1))^c                  */
  SF_RULE_ASGD_DECAY = 11,         /* 1 - b * eta_t, eta_t rounded to fp32 first       */
  SF_RULE_ASGD_MU = 12             /* t == 1 ? 1 : 1 / max(1, t - 1 - a)              */
};
/* One more than the last kind (not a kind). */
#define SF_RULE_KIND_COUNT 13

typedef struct sf_scalar_rule {
  int kind;
  int pad_;
  double a, b, c;
  /* Carried over from earlier steps, 0 for a fresh rule: NAdam's log offset of P_t. */
  double d;
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

/* ---- Real powers, logarithms and exponentials ------------------------------------
 * Double-double arithmetic (an unevaluated sum hi + lo) from + - * / alone: the
 * logarithm is carried to about 100 bits, so x^y = exp(y log x) is within about
 * one double ulp of the true value for any |y log x| (std::pow's accuracy), and
 * the same bits on every machine that rounds doubles to nearest even. */

/* A double's bits and back. */
SF_HD static inline unsigned long long sf_double_bits(double x) {
  union {
    double d;
    unsigned long long u;
  } v;
  v.d = x;
  return v.u;
}
SF_HD static inline double sf_bits_double(unsigned long long u) {
  union {
    double d;
    unsigned long long u;
  } v;
  v.u = u;
  return v.d;
}

/* s + *err == a + b exactly (Knuth's two-sum). */
SF_HD static inline double sf_two_sum(double a, double b, double* err) {
  const double s = a + b, bb = s - a;
  *err = (a - (s - bb)) + (b - bb);
  return s;
}
/* p + *err == a * b exactly (Dekker's product with Veltkamp's split; |a|, |b| < 2^995). */
SF_HD static inline double sf_two_prod(double a, double b, double* err) {
  const double split = 134217729.0; /* 2^27 + 1 */
  const double ca = split * a, ah = ca - (ca - a), al = a - ah;
  const double cb = split * b, bh = cb - (cb - b), bl = b - bh;
  const double p = a * b;
  *err = ((ah * bh - p) + ah * bl + al * bh) + al * bl;
  return p;
}

/* ln 2 = SF_LN2_HI + SF_LN2_LO, SF_LN2_HI with 32 significant bits (k * SF_LN2_HI is
 * exact for |k| < 2^21). */
#define SF_LN2_HI 6.93147180369123816490e-01
#define SF_LN2_LO 1.90821492927058770002e-10

/* log(x) = hi + *lo for finite x > 0. */
SF_HD static inline double sf_log_dd(double x, double* lo) {
  unsigned long long u = sf_double_bits(x);
  int e = 0;
  if ((u >> 52) == 0) { /* subnormal: scale into the normal range first */
    x *= 18014398509481984.0; /* 2^54 */
    u = sf_double_bits(x);
    e = -54;
  }
  e += (int)(u >> 52) - 1023;
  double m = sf_bits_double((u & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull); /* [1, 2) */
  if (m > 1.4142135623730951) {
    m *= 0.5;
    e += 1;
  }
  /* log(m) = 2 atanh(s), s = f / (2 + f), f = m - 1 (exact), |s| <= 0.1716. */
  const double f = m - 1.0;
  double d_lo;
  const double d = sf_two_sum(2.0, f, &d_lo);
  const double s = f / d;
  double p_lo;
  const double p = sf_two_prod(s, d, &p_lo);
  const double s_lo = (((f - p) - p_lo) - s * d_lo) / d; /* f / (d + d_lo) - s */
  /* 2 atanh(s) = 2s + 2s^3/3 + 2s^5 (1/5 + s^2/7 + ...): 2s^3/3 (below 1% of 2s) in
   * double-double, the rest (below 0.02%) in double; s_lo adds 2 s_lo (1 + s^2). */
  const double z = s * s;
  double poly = 1.0 / 29.0;
  poly = poly * z + 1.0 / 27.0;
  poly = poly * z + 1.0 / 25.0;
  poly = poly * z + 1.0 / 23.0;
  poly = poly * z + 1.0 / 21.0;
  poly = poly * z + 1.0 / 19.0;
  poly = poly * z + 1.0 / 17.0;
  poly = poly * z + 1.0 / 15.0;
  poly = poly * z + 1.0 / 13.0;
  poly = poly * z + 1.0 / 11.0;
  poly = poly * z + 1.0 / 9.0;
  poly = poly * z + 1.0 / 7.0;
  poly = poly * z + 1.0 / 5.0;
  const double rest = 2.0 * s * z * z * poly;
  double z_lo, c_lo, q_err;
  const double zh = sf_two_prod(s, s, &z_lo);
  const double cube = sf_two_prod(zh, 2.0 * s, &c_lo); /* 2 s^3 = cube + c_lo */
  c_lo += z_lo * (2.0 * s);
  const double third = cube / 3.0;
  const double q3 = sf_two_prod(third, 3.0, &q_err);
  const double third_lo = (((cube - q3) - q_err) + c_lo) / 3.0; /* (cube + c_lo) / 3 - third */
  const double de = (double)e;
  double e1, e2;
  const double h1 = sf_two_sum(de * SF_LN2_HI, 2.0 * s, &e1);
  const double h = sf_two_sum(h1, third, &e2);
  const double l = (e1 + e2) + (de * SF_LN2_LO + (third_lo + (2.0 * s_lo * (1.0 + z) + rest)));
  const double hi = h + l;
  *lo = l - (hi - h);
  return hi;
}

/* An integer-valued double nearest to x (ties away from zero), |x| < 2^62. */
SF_HD static inline double sf_round_int(double x) {
  return (double)(long long)(x >= 0.0 ? x + 0.5 : x - 0.5);
}

/* exp(hi + lo), |lo| <= ulp(hi): +inf above 710, 0 below -746. */
SF_HD static inline double sf_exp_dd(double hi, double lo) {
  if (hi != hi) return hi;
  if (hi > 710.0) return sf_bits_double(0x7FF0000000000000ull);
  if (hi < -746.0) return 0.0;
  /* exp(x) = 2^k exp(r), r = x - k ln2 (|r| <= 0.35): hi - k * SF_LN2_HI is exact. */
  const double k = sf_round_int(hi * 1.4426950408889634);
  double r_lo;
  const double r = sf_two_sum(hi - k * SF_LN2_HI, lo - k * SF_LN2_LO, &r_lo);
  /* exp(r) = 1 + r + r^2 (1/2 + r/6 + ... + r^13/15!) + r_lo (1 + r) */
  double poly = 1.0 / 1307674368000.0;
  poly = poly * r + 1.0 / 87178291200.0;
  poly = poly * r + 1.0 / 6227020800.0;
  poly = poly * r + 1.0 / 479001600.0;
  poly = poly * r + 1.0 / 39916800.0;
  poly = poly * r + 1.0 / 3628800.0;
  poly = poly * r + 1.0 / 362880.0;
  poly = poly * r + 1.0 / 40320.0;
  poly = poly * r + 1.0 / 5040.0;
  poly = poly * r + 1.0 / 720.0;
  poly = poly * r + 1.0 / 120.0;
  poly = poly * r + 1.0 / 24.0;
  poly = poly * r + 1.0 / 6.0;
  poly = poly * r + 0.5;
  double one_err;
  const double one_r = sf_two_sum(1.0, r, &one_err);
  double y = one_r + (one_err + (r * r * poly + r_lo * (1.0 + r)));
  /* y * 2^k, in two steps where 2^k is not a normal double. */
  long long ki = (long long)k;
  if (ki > 1023) {
    y *= sf_bits_double(0x7FE0000000000000ull); /* 2^1023 */
    ki -= 1023;
  } else if (ki < -1021) {
    y *= sf_bits_double(0x0020000000000000ull); /* 2^-1021 */
    ki += 1021;
  }
  return y * sf_bits_double((unsigned long long)(ki + 1023) << 52);
}

/* exp(x). */
SF_HD static inline double sf_exp(double x) { return sf_exp_dd(x, 0.0); }

/* log(x) for finite x > 0. */
SF_HD static inline double sf_log(double x) {
  double lo;
  const double hi = sf_log_dd(x, &lo);
  return hi + lo;
}

/* exp(x) - 1, accurate relative to the result also near x = 0. */
SF_HD static inline double sf_expm1(double x) {
  if (!(x > -0.3 && x < 0.3)) return sf_exp(x) - 1.0;
  /* x + x^2 (1/2 + x/6 + ... + x^14/16!) */
  double poly = 1.0 / 20922789888000.0;
  poly = poly * x + 1.0 / 1307674368000.0;
  poly = poly * x + 1.0 / 87178291200.0;
  poly = poly * x + 1.0 / 6227020800.0;
  poly = poly * x + 1.0 / 479001600.0;
  poly = poly * x + 1.0 / 39916800.0;
  poly = poly * x + 1.0 / 3628800.0;
  poly = poly * x + 1.0 / 362880.0;
  poly = poly * x + 1.0 / 40320.0;
  poly = poly * x + 1.0 / 5040.0;
  poly = poly * x + 1.0 / 720.0;
  poly = poly * x + 1.0 / 120.0;
  poly = poly * x + 1.0 / 24.0;
  poly = poly * x + 1.0 / 6.0;
  poly = poly * x + 0.5;
  return x + x * x * poly;
}

/* x^y for real y: 1 when y == 0 or x == 1; for x > 0 (finite) exp(y log x) in
 * double-double; 0 or +inf for x == 0 or x == +inf as the sign of y says; NaN for
 * x < 0 or a NaN operand. */
SF_HD static inline double sf_pow(double x, double y) {
  if (y == 0.0 || x == 1.0) return 1.0;
  if (x != x || y != y) return x + y;
  if (x < 0.0) return (x - x) / (x - x); /* NaN */
  const double inf = sf_bits_double(0x7FF0000000000000ull);
  if (x == 0.0) return y > 0.0 ? 0.0 : inf;
  if (x == inf) return y > 0.0 ? inf : 0.0;
  if (y == inf || y == -inf) return (x > 1.0) == (y > 0.0) ? inf : 0.0;
  double l_lo;
  const double l = sf_log_dd(x, &l_lo);
  const double p = y * l;
  if (p > 710.0) return inf;
  if (p < -746.0) return 0.0;
  /* |y| < 746 / |log x| < 2^63 here (|log x| >= 2^-53 for x != 1): sf_two_prod applies. */
  double p_err;
  const double ph = sf_two_prod(y, l, &p_err);
  p_err += y * l_lo;
  const double h = ph + p_err;
  return sf_exp_dd(h, p_err - (h - ph));
}

/* ---- The optimizers' rules ----------------------------------------------------- */

/* log(prod_{i=1..t} (1 - 0.5 q^i)) with q = 0.96^md (NAdam's momentum cache without
 * beta1), in closed form: log(1 - 0.5 q^i) = -sum_k (0.5 q^i)^k / k, so the sum over i
 * is -sum_k (0.5^k / k) q^k (1 - q^(kt)) / (1 - q^k). With 1 - q^k = (1 - q) S_k,
 * S_k = 1 + q + ... + q^(k-1), nothing cancels when q is near 1. The terms fall by at
 * least half each, so the sum stops when a term no longer changes it. */
SF_HD static inline double sf_nadam_log_cache(double md, long long t) {
  const double lq = md * sf_log(0.96), tq = (double)t * lq;
  const double q = sf_exp(lq), qt = sf_exp(tq);
  const double one_minus_q = -sf_expm1(lq), one_minus_qt = -sf_expm1(tq);
  /* (1 - q^(kt)) / (1 - q^k) = ratio * sq_t / sq: the same sums over q^t and q. */
  const double ratio = one_minus_q == 0.0 ? (double)t : one_minus_qt / one_minus_q;
  double sq = 1.0, sq_t = 1.0, qk = q, half_k = 0.5, sum = 0.0;
  for (int k = 1; k <= 64; ++k) {
    const double term = half_k / (double)k * qk * (ratio * (sq_t / sq));
    const double next = sum + term;
    if (next == sum) break;
    sum = next;
    sq = sq * q + 1.0;
    sq_t = sq_t * qt + 1.0;
    qk *= q;
    half_k *= 0.5;
  }
  return -sum;
}

/* NAdam's mu_t = beta1 * (1 - 0.5 * 0.96^(t * md)), as PyTorch computes it in Python. */
SF_HD static inline double sf_nadam_mu(double beta1, double md, long long t) {
  return beta1 * (1.0 - 0.5 * sf_pow(0.96, (double)t * md));
}

/* NAdam's mu_product after step t, rounded to fp32 as PyTorch keeps it: with offset 0,
 * the product of mu_1..mu_t for this beta1 and md; an offset carries the product of
 * earlier steps taken with other values (sf_nadam_product_offset; -inf: a product that
 * reached 0). */
SF_HD static inline double sf_nadam_mu_product(double beta1, double md, long long t, double offset) {
  if (!(beta1 > 0.0)) return 0.0;
  return (double)(float)sf_exp((double)t * sf_log(beta1) + sf_nadam_log_cache(md, t) + offset);
}

/* The offset with which sf_nadam_mu_product(beta1, md, t, offset) continues from
 * mu_product after step t: each later step s multiplies in that step's mu_s, as PyTorch
 * does when beta1 or momentum_decay change between steps. */
SF_HD static inline double sf_nadam_product_offset(double mu_product, double beta1, double md, long long t) {
  if (!(beta1 > 0.0)) return 0.0; /* (mu_t is 0: no product is read) */
  if (!(mu_product > 0.0)) return -sf_bits_double(0x7FF0000000000000ull); /* stays 0 */
  return sf_log(mu_product) - ((double)t * sf_log(beta1) + sf_nadam_log_cache(md, t));
}

/* RAdam's rectification term for step t (0 while rho_t <= 5: no adaptive step). */
SF_HD static inline double sf_radam_rect(double beta2, long long t) {
  const double pw = sf_powi(beta2, t), bias_correction2 = 1.0 - pw;
  const double rho_inf = 2.0 / (1.0 - beta2) - 1.0;
  const double rho_t = rho_inf - 2.0 * (double)t * pw / bias_correction2;
  if (!(rho_t > 5.0)) return 0.0;
  return SF_DSQRT((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t));
}

/* ASGD's eta for step t: lr / (1 + lambd * lr * (t - 1))^alpha (lr on the first step). */
SF_HD static inline double sf_asgd_eta(double lr, double lambd, double alpha, long long t) {
  return lr / sf_pow(1.0 + lambd * lr * (double)(t - 1), alpha);
}

/* The rule's value in double; the caller rounds it to fp32 once. */
SF_HD static inline double sf_eval_rule(const sf_scalar_rule* r, long long step, double gscale) {
  switch (r->kind) {
    case SF_RULE_GSCALE: return r->a * gscale;
    case SF_RULE_FIRST_STEP: return step == 1 ? r->a : r->b;
    case SF_RULE_DIV_ONE_MINUS_POW: return r->a / (1.0 - sf_powi(r->b, step));
    case SF_RULE_SQRT_ONE_MINUS_POW: return SF_DSQRT(1.0 - sf_powi(r->b, step));
    case SF_RULE_DIV_LINEAR: return r->a / (1.0 + (double)(step - 1) * r->b);
    case SF_RULE_ONE_MINUS_POW: return 1.0 - sf_powi(r->b, step);
    case SF_RULE_NADAM_GRAD_COEF: {
      const double mu = sf_nadam_mu(r->b, r->c, step);
      return -r->a * (1.0 - mu) / (1.0 - sf_nadam_mu_product(r->b, r->c, step, r->d));
    }
    case SF_RULE_NADAM_MOMENTUM_COEF: {
      const double mu_next = sf_nadam_mu(r->b, r->c, step + 1);
      return -r->a * mu_next / (1.0 - sf_nadam_mu_product(r->b, r->c, step, r->d) * mu_next);
    }
    case SF_RULE_RADAM_RECT: return sf_radam_rect(r->b, step);
    case SF_RULE_ASGD_ETA: return sf_asgd_eta(r->a, r->b, r->c, step);
    case SF_RULE_ASGD_DECAY: return 1.0 - r->b * (double)(float)sf_asgd_eta(r->a, r->b, r->c, step);
    case SF_RULE_ASGD_MU: {
      if (step == 1) return 1.0;
      const double d = (double)(step - 1) - r->a;
      return 1.0 / (d > 1.0 ? d : 1.0);
    }
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
