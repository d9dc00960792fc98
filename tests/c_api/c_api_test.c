/* The C ABI (include/stepfuse/stepfuse.h) tested from C: compiled as C11, so the header
 * is checked as C and nothing here can reach the C++ API. Results are checked against
 * closed forms computed here in double (the AdamW first step, SGD, the scale rules). */
#include <stepfuse/device_abi.h> /* the emitted kernels' structs, for the tables */
#include <stepfuse/stepfuse.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>
#include <time.h>

static int g_passed, g_failed;

#define CHECK(cond)                                                       \
  do {                                                                    \
    if (cond) {                                                           \
      ++g_passed;                                                         \
    } else {                                                              \
      ++g_failed;                                                         \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                     \
  } while (0)

/* A call that must succeed; on failure prints its status and message. */
#define CHECK_OK(call)                                                                         \
  do {                                                                                         \
    const sf_status st_ = (call);                                                              \
    if (st_ == SF_OK) {                                                                        \
      ++g_passed;                                                                              \
    } else {                                                                                   \
      ++g_failed;                                                                              \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, sf_status_name(st_), \
              sf_last_error());                                                                \
    }                                                                                          \
  } while (0)

/* A call that must fail with `expected` and a message containing `needle`. */
#define CHECK_FAILS(call, expected, needle)                                                               \
  do {                                                                                                    \
    const sf_status st_ = (call);                                                                         \
    if (st_ == (expected) && strstr(sf_last_error(), (needle)) != NULL) {                                 \
      ++g_passed;                                                                                         \
    } else {                                                                                              \
      ++g_failed;                                                                                         \
      fprintf(stderr, "%s:%d: %s returned %s (\"%s\"), expected %s with a message containing \"%s\"\n", \
              __FILE__, __LINE__, #call, sf_status_name(st_), sf_last_error(), sf_status_name(expected), \
              (needle));                                                                                  \
    }                                                                                                     \
  } while (0)

static bool starts_with(const char* s, const char* prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

static bool close_rel(double got, double want, double rel) {
  return fabs(got - want) <= rel * fabs(want);
}

/* xorshift64*: fresh inputs every run (the seed is printed). */
static uint64_t g_rng;
static double uniform(double lo, double hi) {
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  const uint64_t r = g_rng * 0x2545F4914F6CDD1DULL;
  return lo + (hi - lo) * (double)(r >> 11) * (1.0 / 9007199254740992.0);
}
/* A value with magnitude in [lo, hi), random sign, exactly representable in bf16 (and
 * so in f32): the f32 and bf16 runs then see the same numbers. */
static float bf16_value(double lo, double hi) {
  const double m = uniform(lo, hi);
  const float v = (float)(uniform(0, 1) < 0.5 ? -m : m);
  return sf_bf16_to_float(sf_float_to_bf16(v));
}

static sf_tensor_view view_f32(float* data, int64_t n) {
  sf_tensor_view v = {data, n, SF_F32};
  return v;
}

static const char* g_tmpdir = STEPFUSE_TEST_TMPDIR;

/* ---- version, names, defaults ------------------------------------------------ */

static void test_version(void) {
  CHECK(STEPFUSE_VERSION == STEPFUSE_VERSION_MAJOR * 10000 + STEPFUSE_VERSION_MINOR * 100 + STEPFUSE_VERSION_PATCH);
  CHECK(sf_version_number() == STEPFUSE_VERSION);
  char expected[32];
  snprintf(expected, sizeof expected, "%d.%d.%d", STEPFUSE_VERSION_MAJOR, STEPFUSE_VERSION_MINOR,
           STEPFUSE_VERSION_PATCH);
  CHECK(strcmp(sf_version(), expected) == 0);
  /* The CMake project version, passed by tests/CMakeLists.txt. */
  CHECK(strcmp(sf_version(), STEPFUSE_PROJECT_VERSION) == 0);
  CHECK(strlen(sf_cpu_target()) > 0);

  CHECK(strcmp(sf_status_name(SF_OK), "SF_OK") == 0);
  CHECK(strcmp(sf_status_name(SF_IO_ERROR), "SF_IO_ERROR") == 0);
  CHECK(strcmp(sf_status_name(SF_INTERNAL), "SF_INTERNAL") == 0);
  CHECK(strcmp(sf_status_name((sf_status)99), "SF_UNKNOWN_STATUS") == 0);
  CHECK(strcmp(sf_optimizer_kind_name(SF_ADAMW), "AdamW") == 0);
  CHECK(strcmp(sf_optimizer_kind_name(SF_RMSPROP), "RMSprop") == 0);
  CHECK(sf_optimizer_kind_name((sf_optimizer_kind)42) == NULL);
}

static void test_defaults(void) {
  sf_optimizer_config c;
  memset(&c, 0xff, sizeof c); /* init must set every field */
  sf_optimizer_config_init(&c, SF_ADAMW);
  CHECK(c.struct_size == sizeof(sf_optimizer_config));
  CHECK(c.kind == SF_ADAMW);
  CHECK(c.lr == 1e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-8 && c.weight_decay == 0.01);
  CHECK(!c.amsgrad && !c.maximize);
  CHECK(c.momentum == 0 && c.dampening == 0 && c.alpha == 0 && c.lr_decay == 0 && c.initial_accumulator_value == 0);
  CHECK(!c.nesterov && !c.centered);

  sf_optimizer_config_init(&c, SF_ADAM);
  CHECK(c.lr == 1e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-8 && c.weight_decay == 0);
  sf_optimizer_config_init(&c, SF_SGD);
  CHECK(c.kind == SF_SGD && c.lr == 1e-3 && c.momentum == 0 && c.dampening == 0 && c.weight_decay == 0);
  CHECK(!c.nesterov && !c.maximize && c.beta1 == 0 && c.eps == 0);
  sf_optimizer_config_init(&c, SF_ADAGRAD);
  CHECK(c.lr == 1e-2 && c.lr_decay == 0 && c.weight_decay == 0 && c.initial_accumulator_value == 0 &&
        c.eps == 1e-10);
  sf_optimizer_config_init(&c, SF_RMSPROP);
  CHECK(c.lr == 1e-2 && c.alpha == 0.99 && c.eps == 1e-8 && c.weight_decay == 0 && c.momentum == 0 &&
        !c.centered);
  sf_optimizer_config_init(&c, SF_LION);
  CHECK(c.lr == 1e-4 && c.beta1 == 0.9 && c.beta2 == 0.99 && c.weight_decay == 0 && c.eps == 0);
  sf_optimizer_config_init(NULL, SF_SGD); /* a no-op */

  sf_optimizer_options o;
  memset(&o, 0xff, sizeof o);
  sf_optimizer_options_init(&o);
  CHECK(o.struct_size == sizeof(sf_optimizer_options));
  CHECK(o.device.kind == SF_DEVICE_CPU && o.device.index == 0 && o.cuda_stream == NULL);
  CHECK(!o.has_max_grad_norm && o.norm_type == SF_NORM_L2 && o.master_weights);
  CHECK(o.fusion == SF_FUSION_FUSED && o.num_threads == 0 && !o.track_grad_norm);
  CHECK(o.state_format == SF_STATE_F32 && o.state_formats == NULL && o.num_state_formats == 0 &&
        o.min_q8_numel == 4096);
  sf_load_options lo;
  memset(&lo, 0xff, sizeof lo);
  sf_load_options_init(&lo);
  CHECK(lo.struct_size == sizeof(sf_load_options) && !lo.convert_state);
  sf_load_options_init(NULL); /* a no-op */

  sf_grad_scaler_options s;
  sf_grad_scaler_options_init(&s);
  CHECK(s.struct_size == sizeof(sf_grad_scaler_options));
  CHECK(strcmp(s.device, "cuda") == 0 && s.init_scale == 65536.0 && s.growth_factor == 2.0 &&
        s.backoff_factor == 0.5 && s.growth_interval == 2000 && s.enabled);

  sf_step_result r;
  memset(&r, 0xff, sizeof r);
  sf_step_result_init(&r);
  CHECK(r.struct_size == sizeof(sf_step_result) && !r.applied && !r.found_inf && !r.pending);
  sf_grad_scaler_state st;
  memset(&st, 0xff, sizeof st);
  sf_grad_scaler_state_init(&st);
  CHECK(st.struct_size == sizeof(sf_grad_scaler_state) && !st.empty && st.scale == 0 && st.growth_tracker == 0);

  sf_loss_scale_optimizer_options l;
  sf_loss_scale_optimizer_options_init(&l);
  CHECK(l.struct_size == sizeof(sf_loss_scale_optimizer_options));
  CHECK(l.dynamic && l.initial_scale == 32768.0 && l.dynamic_growth_steps == 2000);
}

static void test_conversions(void) {
  CHECK(sf_bf16_to_float(sf_float_to_bf16(1.0f)) == 1.0f);
  CHECK(sf_f16_to_float(sf_float_to_f16(-2.5f)) == -2.5f);
  CHECK(sf_float_to_bf16(1.0f) == 0x3f80);
  CHECK(sf_float_to_f16(1.0f) == 0x3c00);
  CHECK(isinf(sf_f16_to_float(sf_float_to_f16(1e6f)))); /* beyond f16's range */

  const float src[3] = {1.0f, 1.00390625f /* 1 + 2^-8: a tie in bf16, to even */, -3.0f};
  uint16_t bits[3];
  float back[3];
  const sf_tensor_view dst = {bits, 3, SF_BF16};
  CHECK_OK(sf_from_float(src, 3, dst));
  CHECK(bits[0] == 0x3f80 && bits[1] == 0x3f80 && bits[2] == sf_float_to_bf16(-3.0f));
  CHECK_OK(sf_to_float(dst, back, 3));
  CHECK(back[0] == 1.0f && back[1] == 1.0f && back[2] == -3.0f);
  CHECK_FAILS(sf_to_float(dst, back, 2), SF_INVALID_ARGUMENT, "");
}

/* ---- AdamW: the first step against its closed form, f32 and bf16 ---------------- */

enum { kN0 = 1000, kN1 = 37 };

static void test_adamw_first_step(void) {
  /* lr large enough that the update is a tenth of the weight: a relative error of
   * 1e-6 in the weight is then 1e-5 in the update. */
  const double lr = 0.1, wd = 0.1, eps = 1e-8;
  static float w32[2][kN0], g32[2][kN0];
  static uint16_t w16[2][kN0], g16[2][kN0];
  static double want[2][kN0];
  const int64_t n[2] = {kN0, kN1};
  for (int t = 0; t < 2; ++t)
    for (int64_t i = 0; i < n[t]; ++i) {
      w32[t][i] = bf16_value(0.5, 1.5);
      g32[t][i] = bf16_value(0.1, 1.0);
      w16[t][i] = sf_float_to_bf16(w32[t][i]);
      g16[t][i] = sf_float_to_bf16(g32[t][i]);
      /* PyTorch's AdamW at step 1: p *= 1 - lr*wd; m = (1-b1) g, v = (1-b2) g^2;
       * p -= lr/(1-b1) * m / (sqrt(v)/sqrt(1-b2) + eps) = lr * g / (|g| + eps). */
      const double g = g32[t][i];
      want[t][i] = w32[t][i] * (1.0 - lr * wd) - lr * g / (fabs(g) + eps);
    }

  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  cfg.lr = lr;
  cfg.weight_decay = wd;
  const sf_param p32[2] = {{view_f32(w32[0], n[0]), view_f32(g32[0], n[0])},
                           {view_f32(w32[1], n[1]), view_f32(g32[1], n[1])}};
  const sf_param p16[2] = {{{w16[0], n[0], SF_BF16}, {g16[0], n[0], SF_BF16}},
                           {{w16[1], n[1], SF_BF16}, {g16[1], n[1], SF_BF16}}};
  sf_optimizer *a = NULL, *b = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, p32, 2, NULL, &a));
  CHECK_OK(sf_optimizer_create(&cfg, p16, 2, NULL, &b));
  if (a == NULL || b == NULL) {
    sf_optimizer_destroy(a);
    sf_optimizer_destroy(b);
    return;
  }
  CHECK_OK(sf_optimizer_step(a));
  CHECK_OK(sf_optimizer_step(b));

  int bad_f32 = 0, bad_state = 0, bad_master = 0, bad_bf16 = 0;
  for (int t = 0; t < 2; ++t) {
    const float *exp_avg = NULL, *exp_avg_sq = NULL, *master = NULL;
    int64_t ne = 0, nq = 0, nm = 0;
    CHECK_OK(sf_optimizer_state(a, (size_t)t, "exp_avg", &exp_avg, &ne));
    CHECK_OK(sf_optimizer_state(a, (size_t)t, "exp_avg_sq", &exp_avg_sq, &nq));
    CHECK_OK(sf_optimizer_master(b, (size_t)t, &master, &nm));
    CHECK(ne == n[t] && nq == n[t] && nm == n[t]);
    if (ne != n[t] || nq != n[t] || nm != n[t]) continue;
    for (int64_t i = 0; i < n[t]; ++i) {
      const double g = g32[t][i];
      bad_f32 += !close_rel(w32[t][i], want[t][i], 1e-6);
      bad_state += !close_rel(exp_avg[i], 0.1 * g, 1e-6) || !close_rel(exp_avg_sq[i], 0.001 * g * g, 1e-6);
      /* bf16 storage, fp32 masters: the master takes the f32 run's value bit for bit
       * (same inputs, fp32 arithmetic everywhere), the weight is it rounded to bf16. */
      bad_master += memcmp(&master[i], &w32[t][i], sizeof(float)) != 0;
      bad_bf16 += w16[t][i] != sf_float_to_bf16(master[i]);
    }
  }
  CHECK(bad_f32 == 0);
  CHECK(bad_state == 0);
  CHECK(bad_master == 0);
  CHECK(bad_bf16 == 0);
  if (bad_f32 + bad_state + bad_master + bad_bf16 > 0)
    fprintf(stderr, "  mismatches: f32 %d, state %d, master %d, bf16 %d\n", bad_f32, bad_state, bad_master, bad_bf16);

  /* f32 weights have no master. */
  const float* m = (const float*)1;
  int64_t nm = -1;
  CHECK_OK(sf_optimizer_master(a, 0, &m, &nm));
  CHECK(m == NULL && nm == 0);

  /* Introspection. */
  size_t count = 0;
  CHECK_OK(sf_optimizer_num_params(a, &count));
  CHECK(count == 2);
  CHECK_OK(sf_optimizer_state_names(a, &count));
  CHECK(count == 2);
  bool seen_avg = false, seen_sq = false;
  for (size_t i = 0; i < count; ++i) {
    const char* name = NULL;
    CHECK_OK(sf_optimizer_state_name(a, i, &name));
    if (name != NULL) seen_avg |= strcmp(name, "exp_avg") == 0, seen_sq |= strcmp(name, "exp_avg_sq") == 0;
  }
  CHECK(seen_avg && seen_sq);
  int64_t steps = 0;
  CHECK_OK(sf_optimizer_step_count(b, &steps));
  CHECK(steps == 1);
  sf_step_result r;
  sf_step_result_init(&r);
  CHECK_OK(sf_optimizer_last_result(b, &r));
  CHECK(r.applied && !r.found_inf && !r.pending && r.clip_coef == 1.0);
  int threads = 0;
  CHECK_OK(sf_optimizer_num_threads(a, &threads));
  CHECK(threads >= 1);

  sf_optimizer_config got;
  got.struct_size = sizeof got;
  CHECK_OK(sf_optimizer_get_config(a, &got));
  CHECK(got.kind == SF_ADAMW && got.lr == lr && got.weight_decay == wd && got.beta2 == 0.999 && got.momentum == 0);
  got.beta1 = 0.8;
  CHECK_OK(sf_optimizer_set_config(a, &got));
  CHECK_OK(sf_optimizer_set_lr(a, 0.125));
  double lr_now = 0;
  CHECK_OK(sf_optimizer_get_lr(a, &lr_now));
  CHECK(lr_now == 0.125);
  CHECK_OK(sf_optimizer_get_config(a, &got));
  CHECK(got.beta1 == 0.8 && got.lr == 0.125);
  /* Changing the program (amsgrad) needs a new optimizer. */
  got.amsgrad = true;
  CHECK_FAILS(sf_optimizer_set_config(a, &got), SF_INVALID_ARGUMENT, "amsgrad");

  sf_optimizer_options opts;
  opts.struct_size = sizeof opts;
  CHECK_OK(sf_optimizer_get_options(a, &opts));
  CHECK(opts.device.kind == SF_DEVICE_CPU && opts.master_weights && opts.fusion == SF_FUSION_FUSED);

  /* program_text: the required-size protocol. */
  size_t needed = 0;
  CHECK_OK(sf_optimizer_program_text(a, NULL, 0, &needed));
  CHECK(needed > 1);
  char small[8];
  memset(small, 'x', sizeof small);
  CHECK_FAILS(sf_optimizer_program_text(a, small, sizeof small, &needed), SF_INVALID_ARGUMENT, "too small");
  CHECK(small[sizeof small - 1] == '\0' && strlen(small) == sizeof small - 1);
  char* text = malloc(needed);
  if (text != NULL) {
    size_t needed2 = 0;
    CHECK_OK(sf_optimizer_program_text(a, text, needed, &needed2));
    CHECK(needed2 == needed && strlen(text) + 1 == needed);
    CHECK(starts_with(text, "program ") && strstr(text, "stream exp_avg") != NULL);
    free(text);
  }

  sf_optimizer_destroy(a);
  sf_optimizer_destroy(b);
  sf_optimizer_destroy(NULL);
}

/* ---- NAdam, RAdam, Adamax, Adadelta, Rprop, ASGD: defaults, first steps ------------ */

enum { kNew = 257 };

/* An optimizer of `cfg` over one f32 tensor; steps it once with g and checks the weights
 * against want(w0, g) within 1e-6 relative (plus 1e-7). Returns the optimizer (or NULL). */
static sf_optimizer* first_step(const sf_optimizer_config* cfg, float* w, float* g, const float* w0,
                                double (*want)(const sf_optimizer_config*, double, double)) {
  for (int i = 0; i < kNew; ++i) {
    w[i] = w0[i];
    g[i] = bf16_value(0.01, 1.0);
  }
  const sf_param p = {view_f32(w, kNew), view_f32(g, kNew)};
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create(cfg, &p, 1, NULL, &opt));
  if (opt == NULL) return NULL;
  CHECK_OK(sf_optimizer_step(opt));
  int bad = 0;
  for (int i = 0; i < kNew; ++i) {
    const double expect = want(cfg, w0[i], g[i]);
    bad += fabs(w[i] - expect) > 1e-6 * fabs(expect) + 1e-7;
  }
  CHECK(bad == 0);
  if (bad > 0) fprintf(stderr, "  %s: %d weights differ from the first step's closed form\n", sf_optimizer_kind_name(cfg->kind), bad);
  return opt;
}

static double sign_of(double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0; }
static double nadam_mu(const sf_optimizer_config* c, double t) { return c->beta1 * (1 - 0.5 * pow(0.96, t * c->momentum_decay)); }
/* Step 1: m = (1-b1) g, v = (1-b2) g^2, denom = |g| + eps; mu_product = mu_1. */
static double want_nadam(const sf_optimizer_config* c, double p, double g) {
  const double mu1 = nadam_mu(c, 1), mu2 = nadam_mu(c, 2), denom = fabs(g) + c->eps;
  return p - c->lr * g / denom - c->lr * mu2 / (1 - mu1 * mu2) * (1 - c->beta1) * g / denom;
}
/* Step 1: rho_1 <= 5, so p -= lr * m / (1 - b1) = lr * g. */
static double want_radam(const sf_optimizer_config* c, double p, double g) { return p - c->lr * g; }
static double want_adamax(const sf_optimizer_config* c, double p, double g) {
  return p - c->lr * g / (fabs(g) + c->eps);
}
static double want_adadelta(const sf_optimizer_config* c, double p, double g) {
  return p - c->lr * sqrt(c->eps) / sqrt((1 - c->rho) * g * g + c->eps) * g;
}
/* Step 1: prev = 0, so the step size stays lr (within the clamps). */
static double want_rprop(const sf_optimizer_config* c, double p, double g) { return p - sign_of(g) * c->lr; }
/* Step 1: eta = lr, p = p (1 - lambd lr) - lr g. */
static double want_asgd(const sf_optimizer_config* c, double p, double g) {
  return p * (1 - c->lambd * c->lr) - c->lr * g;
}

static void test_new_optimizers(void) {
  CHECK(strcmp(sf_optimizer_kind_name(SF_NADAM), "NAdam") == 0);
  CHECK(strcmp(sf_optimizer_kind_name(SF_RADAM), "RAdam") == 0);
  CHECK(strcmp(sf_optimizer_kind_name(SF_ADAMAX), "Adamax") == 0);
  CHECK(strcmp(sf_optimizer_kind_name(SF_ADADELTA), "Adadelta") == 0);
  CHECK(strcmp(sf_optimizer_kind_name(SF_RPROP), "Rprop") == 0);
  CHECK(strcmp(sf_optimizer_kind_name(SF_ASGD), "ASGD") == 0);

  /* PyTorch's defaults. */
  sf_optimizer_config c;
  memset(&c, 0xff, sizeof c);
  sf_optimizer_config_init(&c, SF_NADAM);
  CHECK(c.lr == 2e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-8 && c.weight_decay == 0 &&
        c.momentum_decay == 4e-3 && !c.decoupled_weight_decay && !c.maximize && c.rho == 0 && c.t0 == 0);
  sf_optimizer_config_init(&c, SF_RADAM);
  CHECK(c.lr == 1e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-8 && c.momentum_decay == 0);
  sf_optimizer_config_init(&c, SF_ADAMAX);
  CHECK(c.lr == 2e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-8 && c.weight_decay == 0);
  sf_optimizer_config_init(&c, SF_ADADELTA);
  CHECK(c.lr == 1.0 && c.rho == 0.9 && c.eps == 1e-6 && c.weight_decay == 0 && c.beta1 == 0);
  sf_optimizer_config_init(&c, SF_RPROP);
  CHECK(c.lr == 1e-2 && c.eta_minus == 0.5 && c.eta_plus == 1.2 && c.step_size_min == 1e-6 &&
        c.step_size_max == 50 && c.eps == 0);
  sf_optimizer_config_init(&c, SF_ASGD);
  CHECK(c.lr == 1e-2 && c.lambd == 1e-4 && c.alpha == 0.75 && c.t0 == 1e6 && c.weight_decay == 0);

  static float w[kNew], g[kNew], w0[kNew];
  for (int i = 0; i < kNew; ++i) w0[i] = bf16_value(0.5, 1.5);
  sf_optimizer* opt;

  sf_optimizer_config_init(&c, SF_NADAM);
  c.lr = 0.01, c.momentum_decay = 0.05;
  opt = first_step(&c, w, g, w0, want_nadam);
  /* mu_product: each step's own mu_t, with the beta1 of its time (torch's fp32 product). */
  double product = 0;
  CHECK_OK(sf_optimizer_nadam_mu_product(opt, 0, &product));
  float torch_product = (float)(0.9 * (1 - 0.5 * pow(0.96, 0.05)));
  CHECK(fabs(product - torch_product) <= 2 * 0x1p-24 * torch_product);
  c.beta1 = 0.8;
  CHECK_OK(sf_optimizer_set_config(opt, &c));
  CHECK_OK(sf_optimizer_step(opt));
  torch_product *= (float)(0.8 * (1 - 0.5 * pow(0.96, 2 * 0.05)));
  CHECK_OK(sf_optimizer_nadam_mu_product(opt, 0, &product));
  CHECK(fabs(product - torch_product) <= 2 * 0x1p-24 * torch_product);
  CHECK_OK(sf_optimizer_set_nadam_mu_product(opt, 0, 0.5));
  CHECK_OK(sf_optimizer_nadam_mu_product(opt, 0, &product));
  CHECK(product == 0.5);
  /* Restoring a PyTorch state: the step count, then the product. */
  int64_t steps = -1;
  CHECK_OK(sf_optimizer_group_step_count(opt, 0, &steps));
  CHECK(steps == 2);
  CHECK_OK(sf_optimizer_set_group_step_count(opt, 0, 40));
  CHECK_OK(sf_optimizer_group_step_count(opt, 0, &steps));
  CHECK(steps == 40);
  CHECK_OK(sf_optimizer_set_nadam_mu_product(opt, 0, 0.0625));
  CHECK_OK(sf_optimizer_nadam_mu_product(opt, 0, &product));
  CHECK(product == 0.0625);
  CHECK_FAILS(sf_optimizer_set_group_step_count(opt, 0, -1), SF_INVALID_ARGUMENT, "count = -1");
  CHECK_FAILS(sf_optimizer_group_step_count(opt, 2, &steps), SF_INVALID_ARGUMENT, "group 2");
  CHECK_FAILS(sf_optimizer_set_nadam_mu_product(opt, 0, 2.0), SF_INVALID_ARGUMENT, "mu_product = 2");
  CHECK_FAILS(sf_optimizer_nadam_mu_product(opt, 3, &product), SF_INVALID_ARGUMENT, "group 3");
  CHECK_FAILS(sf_optimizer_nadam_mu_product(opt, 0, NULL), SF_INVALID_ARGUMENT, "mu_product");
  sf_optimizer_destroy(opt);
  sf_optimizer_config_init(&c, SF_RADAM);
  c.lr = 0.01;
  opt = first_step(&c, w, g, w0, want_radam);
  double none = 0;
  CHECK_FAILS(sf_optimizer_nadam_mu_product(opt, 0, &none), SF_INVALID_STATE, "runs RAdam, not NAdam");
  sf_optimizer_destroy(opt);
  sf_optimizer_config_init(&c, SF_ADAMAX);
  c.lr = 0.01;
  sf_optimizer_destroy(first_step(&c, w, g, w0, want_adamax));
  sf_optimizer_config_init(&c, SF_ADADELTA);
  c.rho = 0.8, c.eps = 1e-3;
  sf_optimizer_destroy(first_step(&c, w, g, w0, want_adadelta));
  sf_optimizer_config_init(&c, SF_ASGD);
  c.lr = 0.05, c.lambd = 0.1;
  opt = first_step(&c, w, g, w0, want_asgd);
  if (opt != NULL) {
    const float* ax = NULL;
    int64_t n = 0;
    CHECK_OK(sf_optimizer_state(opt, 0, "ax", &ax, &n));
    CHECK(n == kNew && ax != NULL && memcmp(ax, w, sizeof w) == 0); /* mu = 1: ax is p */
    sf_optimizer_config got;
    got.struct_size = sizeof got;
    CHECK_OK(sf_optimizer_get_config(opt, &got));
    CHECK(got.kind == SF_ASGD && got.lambd == 0.1 && got.t0 == 1e6 && got.alpha == 0.75);
    got.t0 = 0;
    CHECK_OK(sf_optimizer_set_config(opt, &got));
    sf_optimizer_destroy(opt);
  }

  /* Rprop: the step size starts at lr; the second step grows it where the gradient kept
   * its sign and shrinks it where it flipped (clamped), skipping those elements. */
  sf_optimizer_config_init(&c, SF_RPROP);
  c.lr = 0.02, c.eta_minus = 0.25, c.eta_plus = 1.5, c.step_size_min = 0.01, c.step_size_max = 0.025;
  opt = first_step(&c, w, g, w0, want_rprop);
  if (opt != NULL) {
    static float g1[kNew], w1[kNew];
    memcpy(g1, g, sizeof g);
    memcpy(w1, w, sizeof w);
    for (int i = 0; i < kNew; ++i) g[i] = bf16_value(0.01, 1.0);
    CHECK_OK(sf_optimizer_step(opt));
    const float *step_size = NULL, *prev = NULL;
    int64_t n1 = 0, n2 = 0;
    CHECK_OK(sf_optimizer_state(opt, 0, "step_size", &step_size, &n1));
    CHECK_OK(sf_optimizer_state(opt, 0, "prev", &prev, &n2));
    int bad = 0, kept = 0, flipped = 0;
    if (n1 == kNew && n2 == kNew)
      for (int i = 0; i < kNew; ++i) {
        const bool same = (double)g[i] * g1[i] > 0;
        kept += same, flipped += !same;
        const float s = same ? 0.025f : 0.01f; /* 0.02 * 1.5 and 0.02 * 0.25, clamped */
        const double p = same ? w1[i] - sign_of(g[i]) * s : w1[i];
        bad += step_size[i] != s || prev[i] != (same ? g[i] : 0.0f) || fabs(w[i] - p) > 1e-7;
      }
    CHECK(n1 == kNew && n2 == kNew && bad == 0 && kept > 0 && flipped > 0);
    sf_optimizer_destroy(opt);
  }

  /* Fields of other kinds must stay 0; PyTorch's checks name the field and value. */
  sf_optimizer_config_init(&c, SF_NADAM);
  c.rho = 0.5;
  const sf_param p = {view_f32(w, kNew), view_f32(g, kNew)};
  opt = NULL;
  CHECK_FAILS(sf_optimizer_create(&c, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "config->rho = 0.5, but NAdam has no rho");
  sf_optimizer_config_init(&c, SF_RPROP);
  c.eta_minus = 1.5;
  CHECK_FAILS(sf_optimizer_create(&c, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "Rprop: invalid eta_minus = 1.5");
  sf_optimizer_config_init(&c, SF_ADADELTA);
  c.rho = 1.5;
  CHECK_FAILS(sf_optimizer_create(&c, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "Adadelta: invalid rho = 1.5");
  sf_optimizer_config_init(&c, SF_ASGD);
  c.lambd = -1;
  CHECK_FAILS(sf_optimizer_create(&c, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "ASGD: invalid lambd = -1");
  CHECK(opt == NULL);

  /* The three-parameter rules in a custom program: p -= eta_t * g, ASGD's eta. */
  sf_program_builder* b = NULL;
  CHECK_OK(sf_program_builder_create("asgd_eta_sgd", &b));
  if (b == NULL) return;
  int gs = -1, ps = -1;
  sf_value v[8];
  CHECK_OK(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &gs));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &ps));
  CHECK_OK(sf_program_builder_load(b, gs, &v[0]));
  CHECK_OK(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &v[1]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[0], v[1], 0, &v[2]));
  CHECK_OK(sf_program_builder_load(b, ps, &v[3]));
  CHECK_OK(sf_program_builder_scalar3(b, "eta", SF_SCALAR_ASGD_ETA, 0.1, 0.5, 0.75, &v[4]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[4], v[2], 0, &v[5]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_SUB, v[3], v[5], 0, &v[6]));
  CHECK_OK(sf_program_builder_store(b, ps, v[6]));
  CHECK_FAILS(sf_program_builder_scalar3(b, "eta", SF_SCALAR_ASGD_ETA, 0.1, 0.5, 0.5, &v[7]), SF_INVALID_ARGUMENT,
              "declared with another rule");
  CHECK_FAILS(sf_program_builder_scalar3(b, "x", (sf_scalar_rule_kind)13, 0, 0, 0, &v[7]), SF_INVALID_ARGUMENT,
              "rule = 13");
  sf_program* prog = NULL;
  CHECK_OK(sf_program_builder_build(b, &prog));
  sf_program_builder_destroy(b);
  if (prog == NULL) return;
  char text[2048];
  CHECK_OK(sf_program_text(prog, text, sizeof text, NULL));
  CHECK(strstr(text, "  eta = 0.1 / (1 + 0.5 * 0.1 * (step - 1))^0.75\n") != NULL);
  for (int i = 0; i < kNew; ++i) w[i] = w0[i], g[i] = bf16_value(0.01, 1.0);
  opt = NULL;
  CHECK_OK(sf_optimizer_create_custom(prog, &p, 1, NULL, &opt));
  sf_program_destroy(prog);
  if (opt == NULL) return;
  CHECK_OK(sf_optimizer_step(opt));
  CHECK_OK(sf_optimizer_step(opt));
  const float eta2 = (float)(0.1 / pow(1 + 0.5 * 0.1, 0.75)); /* step 2: one step done */
  int bad = 0;
  for (int i = 0; i < kNew; ++i) {
    const float p1 = w0[i] - 0.1f * g[i];
    bad += w[i] != p1 - eta2 * g[i];
  }
  CHECK(bad == 0);
  sf_optimizer_destroy(opt);
}

/* ---- GradScaler ---------------------------------------------------------------- */

enum { kS = 64 };

static void set_scaled(float* g, const float* g_true, double scale) {
  for (int i = 0; i < kS; ++i) g[i] = (float)(g_true[i] * scale);
}

static void test_grad_scaler(void) {
  static float w[kS], g[kS], g_true[kS], before[kS];
  for (int i = 0; i < kS; ++i) w[i] = (float)uniform(-1, 1), g_true[i] = (float)uniform(-1, 1);
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_SGD);
  cfg.lr = 0.5;
  const sf_param p = {view_f32(w, kS), view_f32(g, kS)};
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, NULL, &opt));
  sf_grad_scaler_options so;
  sf_grad_scaler_options_init(&so);
  so.device = "cpu";
  so.init_scale = 1024.0;
  so.growth_interval = 2;
  sf_grad_scaler* sc = NULL;
  CHECK_OK(sf_grad_scaler_create(&so, &sc));
  if (opt == NULL || sc == NULL) goto done;

  const char* dev = NULL;
  CHECK_OK(sf_grad_scaler_device(sc, &dev));
  CHECK(dev != NULL && strcmp(dev, "cpu") == 0);
  sf_device where = {SF_DEVICE_CUDA, 7};
  CHECK_OK(sf_grad_scaler_where_scale_lives(sc, &where));
  CHECK(where.kind == SF_DEVICE_CPU);

  /* update() before any step: nothing recorded. */
  CHECK_FAILS(sf_grad_scaler_update(sc, NULL), SF_INVALID_STATE, "no inf checks were recorded");

  double s = 0, x = 0;
  CHECK_OK(sf_grad_scaler_scale(sc, 2.0, &x));
  CHECK(x == 2048.0);

  /* Iteration 1: finite gradients scaled by 1024 (a power of two: unscaling is exact). */
  set_scaled(g, g_true, 1024.0);
  memcpy(before, w, sizeof w);
  bool applied = false;
  CHECK_OK(sf_grad_scaler_step(sc, opt, &applied));
  CHECK(applied);
  int bad = 0;
  for (int i = 0; i < kS; ++i) bad += !close_rel(w[i], before[i] - 0.5 * g_true[i], 1e-6) && fabs(w[i]) > 1e-3;
  CHECK(bad == 0);
  sf_step_result r;
  sf_step_result_init(&r);
  CHECK_OK(sf_grad_scaler_last_step_result(sc, &r));
  double sumsq = 0;
  for (int i = 0; i < kS; ++i) sumsq += (double)g_true[i] * g_true[i];
  CHECK(r.applied && !r.found_inf && close_rel(r.grad_norm, sqrt(sumsq), 1e-6));
  const double* norms = NULL;
  size_t nnorms = 0;
  CHECK_OK(sf_optimizer_last_tensor_grad_norms(opt, &norms, &nnorms));
  CHECK(nnorms == 1 && norms != NULL && close_rel(norms[0], sqrt(sumsq), 1e-6));
  /* A second step before update() is not allowed. */
  CHECK_FAILS(sf_grad_scaler_step(sc, opt, &applied), SF_INVALID_STATE, "already been called");
  CHECK_OK(sf_grad_scaler_update(sc, NULL));
  int64_t tracker = -1, steps = -1;
  CHECK_OK(sf_grad_scaler_get_scale(sc, &s));
  CHECK_OK(sf_grad_scaler_get_growth_tracker(sc, &tracker));
  CHECK(s == 1024.0 && tracker == 1);

  /* Iteration 2: an inf gradient. The step is skipped (nothing written, step count
   * unchanged) and update() halves the scale. */
  set_scaled(g, g_true, 1024.0);
  g[17] = INFINITY;
  memcpy(before, w, sizeof w);
  applied = true;
  CHECK_OK(sf_grad_scaler_step(sc, opt, &applied));
  CHECK(!applied);
  CHECK(memcmp(before, w, sizeof w) == 0);
  CHECK_OK(sf_optimizer_step_count(opt, &steps));
  CHECK(steps == 1);
  CHECK_OK(sf_grad_scaler_last_step_result(sc, &r));
  CHECK(!r.applied && r.found_inf);
  double norm = 0;
  CHECK_OK(sf_optimizer_last_grad_norm(opt, &norm));
  CHECK(isinf(norm));
  CHECK_OK(sf_grad_scaler_update(sc, NULL));
  CHECK_OK(sf_grad_scaler_get_scale(sc, &s));
  CHECK_OK(sf_grad_scaler_get_growth_tracker(sc, &tracker));
  CHECK(s == 512.0 && tracker == 0);

  /* Iterations 3 and 4: finite; growth after growth_interval = 2 good steps. */
  for (int it = 0; it < 2; ++it) {
    set_scaled(g, g_true, 512.0);
    CHECK_OK(sf_grad_scaler_step(sc, opt, &applied));
    CHECK(applied);
    CHECK_OK(sf_grad_scaler_update(sc, NULL));
    CHECK_OK(sf_grad_scaler_get_scale(sc, &s));
    CHECK(s == (it == 0 ? 512.0 : 1024.0));
  }
  CHECK_OK(sf_optimizer_step_count(opt, &steps));
  CHECK(steps == 3);

  /* unscale_ then step; a second unscale_ is an error. */
  set_scaled(g, g_true, 1024.0);
  CHECK_OK(sf_grad_scaler_unscale_(sc, opt));
  int unscaled_ok = 0;
  for (int i = 0; i < kS; ++i) unscaled_ok += g[i] == g_true[i];
  CHECK(unscaled_ok == kS);
  CHECK_FAILS(sf_grad_scaler_unscale_(sc, opt), SF_INVALID_STATE, "unscale_");
  CHECK_OK(sf_grad_scaler_step(sc, opt, NULL));
  const double new_scale = 300.0;
  CHECK_OK(sf_grad_scaler_update(sc, &new_scale));
  CHECK_OK(sf_grad_scaler_get_scale(sc, &s));
  CHECK(s == 300.0);
  const double zero = 0.0;
  CHECK_FAILS(sf_grad_scaler_update(sc, &zero), SF_INVALID_ARGUMENT, "new_scale");

  /* scale_: in place by S, one view or several. */
  float t[3] = {1.0f, -2.0f, 0.5f}, u[2] = {4.0f, 8.0f};
  CHECK_OK(sf_grad_scaler_scale_(sc, view_f32(t, 3)));
  CHECK(t[0] == 300.0f && t[1] == -600.0f && t[2] == 150.0f);
  const sf_tensor_view vs[2] = {view_f32(t, 1), view_f32(u, 2)};
  CHECK_OK(sf_grad_scaler_scale_views_(sc, vs, 2));
  CHECK(t[0] == 90000.0f && u[0] == 1200.0f && u[1] == 2400.0f);

  /* Factors: getters, setters, validation (nothing changes on an error). */
  double f = 0;
  int64_t interval = 0;
  bool enabled = false;
  CHECK_OK(sf_grad_scaler_set_growth_factor(sc, 4.0));
  CHECK_OK(sf_grad_scaler_get_growth_factor(sc, &f));
  CHECK(f == 4.0);
  CHECK_FAILS(sf_grad_scaler_set_growth_factor(sc, 0.5), SF_INVALID_ARGUMENT, "growth_factor");
  CHECK_OK(sf_grad_scaler_get_growth_factor(sc, &f));
  CHECK(f == 4.0);
  CHECK_OK(sf_grad_scaler_set_backoff_factor(sc, 0.25));
  CHECK_OK(sf_grad_scaler_get_backoff_factor(sc, &f));
  CHECK(f == 0.25);
  CHECK_FAILS(sf_grad_scaler_set_backoff_factor(sc, 1.0), SF_INVALID_ARGUMENT, "backoff_factor");
  CHECK_OK(sf_grad_scaler_set_growth_interval(sc, 7));
  CHECK_OK(sf_grad_scaler_get_growth_interval(sc, &interval));
  CHECK(interval == 7);
  CHECK_FAILS(sf_grad_scaler_set_growth_interval(sc, 0), SF_INVALID_ARGUMENT, "growth_interval");
  CHECK_OK(sf_grad_scaler_is_enabled(sc, &enabled));
  CHECK(enabled);

  /* state_dict / load_state_dict. */
  sf_grad_scaler_state st;
  sf_grad_scaler_state_init(&st);
  CHECK_OK(sf_grad_scaler_state_dict(sc, &st));
  CHECK(!st.empty && st.scale == 300.0 && st.growth_factor == 4.0 && st.backoff_factor == 0.25 &&
        st.growth_interval == 7 && st.growth_tracker == 0);
  sf_grad_scaler_options so2;
  sf_grad_scaler_options_init(&so2);
  so2.device = "cpu";
  sf_grad_scaler* sc2 = NULL;
  CHECK_OK(sf_grad_scaler_create(&so2, &sc2));
  st.growth_tracker = 3;
  CHECK_OK(sf_grad_scaler_load_state_dict(sc2, &st));
  CHECK_OK(sf_grad_scaler_get_scale(sc2, &s));
  CHECK_OK(sf_grad_scaler_get_growth_tracker(sc2, &tracker));
  CHECK_OK(sf_grad_scaler_get_growth_interval(sc2, &interval));
  CHECK(s == 300.0 && tracker == 3 && interval == 7);
  sf_grad_scaler_state empty;
  sf_grad_scaler_state_init(&empty);
  empty.empty = true;
  CHECK_FAILS(sf_grad_scaler_load_state_dict(sc2, &empty), SF_INVALID_ARGUMENT, "");
  sf_grad_scaler_state wrong = st;
  wrong.struct_size = 4;
  CHECK_FAILS(sf_grad_scaler_load_state_dict(sc2, &wrong), SF_INVALID_ARGUMENT, "struct_size = 4");
  sf_grad_scaler_destroy(sc2);

  /* Disabled: scale 1, empty state, step is a plain step. */
  so2.enabled = false;
  sc2 = NULL;
  CHECK_OK(sf_grad_scaler_create(&so2, &sc2));
  CHECK_OK(sf_grad_scaler_get_scale(sc2, &s));
  CHECK(s == 1.0);
  CHECK_OK(sf_grad_scaler_state_dict(sc2, &st));
  CHECK(st.empty && st.scale == 0);
  CHECK_OK(sf_grad_scaler_is_enabled(sc2, &enabled));
  CHECK(!enabled);
  sf_grad_scaler_destroy(sc2);

  /* Bad construction arguments. */
  so2.enabled = true;
  so2.device = "tpu";
  CHECK_FAILS(sf_grad_scaler_create(&so2, &sc2), SF_INVALID_ARGUMENT, "device");
  so2.device = "cpu";
  so2.init_scale = -1;
  CHECK_FAILS(sf_grad_scaler_create(&so2, &sc2), SF_INVALID_ARGUMENT, "init_scale");
  so2.init_scale = 1;
  so2.device = NULL;
  CHECK_FAILS(sf_grad_scaler_create(&so2, &sc2), SF_INVALID_ARGUMENT, "options->device is NULL");

done:
  sf_grad_scaler_destroy(sc);
  sf_optimizer_destroy(opt);
}

/* ---- LossScaleOptimizer ------------------------------------------------------- */

struct var_sq {
  float var, grad;
  int calls;
  int fail; /* the callback's way to fail: return non-zero */
};

/* loss = var^2: writes d(loss * S)/d var = 2 var S. */
static int backward_var_sq(double loss_scale, void* user) {
  struct var_sq* v = user;
  ++v->calls;
  if (v->fail) return 7;
  v->grad = (float)(2.0 * v->var * loss_scale);
  return 0;
}

static void test_loss_scale_optimizer(void) {
  /* The Keras document's example: SGD(0.25) on var^2 takes var from 1.0 to 0.5. */
  struct var_sq v = {1.0f, 0.0f, 0, 0};
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_SGD);
  cfg.lr = 0.25;
  const sf_param p = {view_f32(&v.var, 1), view_f32(&v.grad, 1)};
  sf_optimizer* opt = NULL;
  sf_loss_scale_optimizer* lso = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, NULL, &opt));
  CHECK_OK(sf_loss_scale_optimizer_create(opt, NULL, &lso));
  if (opt == NULL || lso == NULL) goto done;

  sf_optimizer* inner = NULL;
  CHECK_OK(sf_loss_scale_optimizer_inner(lso, &inner));
  CHECK(inner == opt);
  double s = 0, x = 0;
  int64_t counter = -1, growth = 0;
  bool dynamic = false, applied = false;
  CHECK_OK(sf_loss_scale_optimizer_loss_scale(lso, &s));
  CHECK_OK(sf_loss_scale_optimizer_dynamic(lso, &dynamic));
  CHECK_OK(sf_loss_scale_optimizer_dynamic_growth_steps(lso, &growth));
  CHECK(s == 32768.0 && dynamic && growth == 2000);
  CHECK_OK(sf_loss_scale_optimizer_get_scaled_loss(lso, 2.0, &x));
  CHECK(x == 65536.0);

  CHECK_OK(sf_loss_scale_optimizer_minimize(lso, backward_var_sq, &v, &applied));
  CHECK(applied && v.calls == 1 && v.var == 0.5f);
  CHECK(v.grad == 65536.0f); /* 2 * 1.0 * S: the scaled gradient, left as written */
  CHECK_OK(sf_loss_scale_optimizer_dynamic_counter(lso, &counter));
  CHECK(counter == 1);

  /* A failing callback: nothing stepped, scale and counter unchanged. */
  v.fail = 1;
  CHECK_FAILS(sf_loss_scale_optimizer_minimize(lso, backward_var_sq, &v, &applied), SF_INVALID_STATE,
              "returned 7");
  CHECK(v.calls == 2 && v.var == 0.5f);
  int64_t steps = 0;
  CHECK_OK(sf_optimizer_step_count(opt, &steps));
  CHECK_OK(sf_loss_scale_optimizer_dynamic_counter(lso, &counter));
  CHECK(steps == 1 && counter == 1);
  v.fail = 0;
  CHECK_FAILS(sf_loss_scale_optimizer_minimize(lso, NULL, &v, &applied), SF_INVALID_ARGUMENT, "backward is NULL");

  /* Hyperparameters under Keras's names, delegated to the inner optimizer. */
  double h = 0;
  CHECK_OK(sf_loss_scale_optimizer_get_hyper(lso, "learning_rate", &h));
  CHECK(h == 0.25);
  CHECK_OK(sf_loss_scale_optimizer_set_hyper(lso, "lr", 0.5));
  CHECK_OK(sf_optimizer_get_lr(opt, &h));
  CHECK(h == 0.5);
  CHECK_OK(sf_loss_scale_optimizer_get_hyper(lso, "momentum", &h));
  CHECK(h == 0.0);
  CHECK_FAILS(sf_loss_scale_optimizer_get_hyper(lso, "epsilon", &h), SF_INVALID_ARGUMENT, "epsilon");
  CHECK_FAILS(sf_loss_scale_optimizer_set_hyper(lso, "learning_rate", -1.0), SF_INVALID_ARGUMENT, "lr");
  CHECK_OK(sf_loss_scale_optimizer_set_hyper(lso, "learning_rate", 0.25));

  /* By hand: get_unscaled_gradients + apply_gradients; a non-finite one halves S. */
  v.grad = (float)(2.0 * v.var * 32768.0);
  const sf_tensor_view gv = view_f32(&v.grad, 1);
  CHECK_OK(sf_loss_scale_optimizer_get_unscaled_gradients(lso, &gv, 1));
  CHECK(v.grad == 1.0f);
  CHECK_OK(sf_loss_scale_optimizer_apply_gradients(lso, &applied));
  CHECK(applied && v.var == 0.25f);
  v.grad = NAN;
  CHECK_OK(sf_loss_scale_optimizer_apply_gradients(lso, &applied));
  CHECK(!applied && v.var == 0.25f);
  CHECK_OK(sf_loss_scale_optimizer_loss_scale(lso, &s));
  CHECK_OK(sf_loss_scale_optimizer_dynamic_counter(lso, &counter));
  CHECK(s == 16384.0 && counter == 0);
  sf_step_result r;
  sf_step_result_init(&r);
  CHECK_OK(sf_loss_scale_optimizer_last_result(lso, &r));
  CHECK(!r.applied && r.found_inf);

  /* save / load: the loss-scale state comes back. */
  char path[4096];
  snprintf(path, sizeof path, "%s/c_api_test_lso.ckpt", g_tmpdir);
  CHECK_OK(sf_loss_scale_optimizer_save(lso, path));
  CHECK_OK(sf_loss_scale_optimizer_minimize(lso, backward_var_sq, &v, &applied));
  CHECK_OK(sf_loss_scale_optimizer_dynamic_counter(lso, &counter));
  CHECK(counter == 1);
  CHECK_OK(sf_loss_scale_optimizer_load(lso, path));
  CHECK_OK(sf_loss_scale_optimizer_loss_scale(lso, &s));
  CHECK_OK(sf_loss_scale_optimizer_dynamic_counter(lso, &counter));
  CHECK_OK(sf_optimizer_step_count(opt, &steps));
  CHECK(s == 16384.0 && counter == 0 && steps == 2);
  remove(path);

  /* Bad construction arguments. */
  sf_loss_scale_optimizer_options lo;
  sf_loss_scale_optimizer_options_init(&lo);
  lo.dynamic_growth_steps = 0;
  sf_loss_scale_optimizer* bad = NULL;
  CHECK_FAILS(sf_loss_scale_optimizer_create(opt, &lo, &bad), SF_INVALID_ARGUMENT, "dynamic_growth_steps");
  CHECK_FAILS(sf_loss_scale_optimizer_create(NULL, NULL, &bad), SF_INVALID_ARGUMENT, "inner is NULL");
  CHECK(bad == NULL);

done:
  sf_loss_scale_optimizer_destroy(lso); /* before the optimizer it wraps */
  sf_optimizer_destroy(opt);
}

/* ---- Checkpoint with a scaler ---------------------------------------------------- */

static void test_checkpoint(void) {
  static float w[kS], g[kS], g_true[kS];
  for (int i = 0; i < kS; ++i) w[i] = (float)uniform(-1, 1), g_true[i] = (float)uniform(-1, 1);
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  const sf_param p = {view_f32(w, kS), view_f32(g, kS)};
  sf_optimizer* opt = NULL;
  sf_grad_scaler* sc = NULL;
  sf_grad_scaler_options so;
  sf_grad_scaler_options_init(&so);
  so.device = "cpu";
  so.init_scale = 256.0;
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, NULL, &opt));
  CHECK_OK(sf_grad_scaler_create(&so, &sc));
  if (opt == NULL || sc == NULL) goto done;

  char path[4096], plain[4096], missing[4096];
  snprintf(path, sizeof path, "%s/c_api_test_scaler.ckpt", g_tmpdir);
  snprintf(plain, sizeof plain, "%s/c_api_test_plain.ckpt", g_tmpdir);
  snprintf(missing, sizeof missing, "%s/c_api_test_does_not_exist.ckpt", g_tmpdir);
  remove(missing);

  set_scaled(g, g_true, 256.0);
  CHECK_OK(sf_grad_scaler_step(sc, opt, NULL));
  CHECK_OK(sf_grad_scaler_update(sc, NULL));
  CHECK_OK(sf_optimizer_save(opt, path, sc));
  CHECK_OK(sf_optimizer_save(opt, plain, NULL));
  static float saved_avg[kS], saved_sq[kS];
  const float *avg = NULL, *sq = NULL;
  int64_t n = 0;
  CHECK_OK(sf_optimizer_state(opt, 0, "exp_avg", &avg, &n));
  CHECK_OK(sf_optimizer_state(opt, 0, "exp_avg_sq", &sq, &n));
  if (avg == NULL || sq == NULL || n != kS) goto done;
  memcpy(saved_avg, avg, sizeof saved_avg);
  memcpy(saved_sq, sq, sizeof saved_sq);

  /* Move on: another step, a new scale. */
  set_scaled(g, g_true, 256.0);
  CHECK_OK(sf_grad_scaler_step(sc, opt, NULL));
  const double new_scale = 8.0;
  CHECK_OK(sf_grad_scaler_update(sc, &new_scale));
  CHECK_OK(sf_optimizer_set_lr(opt, 0.5));

  /* Back to the checkpoint: state, step count, hyperparameters and the scale. */
  CHECK_OK(sf_optimizer_load(opt, path, sc));
  CHECK_OK(sf_optimizer_state(opt, 0, "exp_avg", &avg, &n));
  CHECK_OK(sf_optimizer_state(opt, 0, "exp_avg_sq", &sq, &n));
  CHECK(memcmp(avg, saved_avg, sizeof saved_avg) == 0 && memcmp(sq, saved_sq, sizeof saved_sq) == 0);
  int64_t steps = 0, tracker = -1;
  double s = 0, lr = 0;
  CHECK_OK(sf_optimizer_step_count(opt, &steps));
  CHECK_OK(sf_grad_scaler_get_scale(sc, &s));
  CHECK_OK(sf_grad_scaler_get_growth_tracker(sc, &tracker));
  CHECK_OK(sf_optimizer_get_lr(opt, &lr));
  CHECK(steps == 1 && s == 256.0 && tracker == 1 && lr == 1e-3);

  /* A file without a scaler's state, loaded with a scaler: a mismatch, nothing changes. */
  CHECK_FAILS(sf_optimizer_load(opt, plain, sc), SF_INVALID_ARGUMENT, "no GradScaler state");
  CHECK_OK(sf_optimizer_load(opt, plain, NULL));
  /* A missing file: an I/O error naming it. */
  CHECK_FAILS(sf_optimizer_load(opt, missing, sc), SF_IO_ERROR, "c_api_test_does_not_exist.ckpt");
  CHECK_FAILS(sf_optimizer_load(opt, NULL, NULL), SF_INVALID_ARGUMENT, "path is NULL");
  remove(path);
  remove(plain);

done:
  sf_grad_scaler_destroy(sc);
  sf_optimizer_destroy(opt);
}

/* ---- Error paths ------------------------------------------------------------------- */

static void test_errors(void) {
  float w[4] = {1, 2, 3, 4}, g[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  const sf_param p = {view_f32(w, 4), view_f32(g, 4)};
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  sf_optimizer* opt = NULL;

  /* NULL handles and out pointers name the function and the argument. */
  CHECK_FAILS(sf_optimizer_step(NULL), SF_INVALID_ARGUMENT, "sf_optimizer_step: opt is NULL");
  CHECK(starts_with(sf_last_error(), "stepfuse: "));
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, NULL, NULL), SF_INVALID_ARGUMENT, "sf_optimizer_create: out is NULL");
  CHECK_FAILS(sf_optimizer_create(NULL, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "config is NULL");
  CHECK_FAILS(sf_optimizer_create(&cfg, NULL, 1, NULL, &opt), SF_INVALID_ARGUMENT, "params is NULL");
  CHECK_FAILS(sf_optimizer_create(&cfg, NULL, 0, NULL, &opt), SF_INVALID_ARGUMENT, "parameter list is empty");
  CHECK_FAILS(sf_grad_scaler_step(NULL, NULL, NULL), SF_INVALID_ARGUMENT, "sf_grad_scaler_step: scaler is NULL");
  CHECK_FAILS(sf_loss_scale_optimizer_loss_scale(NULL, NULL), SF_INVALID_ARGUMENT, "lso is NULL");
  CHECK(opt == NULL);

  /* Bad hyperparameters: named, with the value; the out pointer is left alone. */
  cfg.lr = -1.0;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "invalid lr = -1");
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  cfg.beta1 = 1.5;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "beta1 = 1.5");
  /* A field another kind has: as an unknown keyword in PyTorch. */
  sf_optimizer_config_init(&cfg, SF_SGD);
  cfg.beta1 = 0.9;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "SGD has no beta1");
  sf_optimizer_config_init(&cfg, SF_ADAM);
  cfg.nesterov = true;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "Adam has no nesterov");
  sf_optimizer_config_init(&cfg, (sf_optimizer_kind)42);
  CHECK(cfg.struct_size == sizeof cfg && cfg.kind == 42);
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "kind = 42");
  CHECK(opt == NULL);

  /* struct_size: an unknown size is rejected, saying what was expected. */
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  cfg.struct_size = sizeof cfg + 8; /* a newer header's struct */
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT, "config->struct_size");
  CHECK(strstr(sf_last_error(), "sf_optimizer_config_init") != NULL);
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  o.struct_size = 0; /* never initialized */
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt), SF_INVALID_ARGUMENT, "options->struct_size = 0");

  /* Bad params and options. */
  sf_param bp = p;
  bp.grad.numel = 3;
  CHECK_FAILS(sf_optimizer_create(&cfg, &bp, 1, NULL, &opt), SF_INVALID_ARGUMENT, "numel");
  bp = p;
  bp.weight.dtype = (sf_dtype)7;
  CHECK_FAILS(sf_optimizer_create(&cfg, &bp, 1, NULL, &opt), SF_INVALID_ARGUMENT, "params[0].weight.dtype = 7");
  bp = p;
  bp.weight.data = NULL;
  CHECK_FAILS(sf_optimizer_create(&cfg, &bp, 1, NULL, &opt), SF_INVALID_ARGUMENT, "data is null");
  sf_optimizer_options_init(&o);
  o.has_max_grad_norm = true;
  o.max_grad_norm = -1.0;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt), SF_INVALID_ARGUMENT, "max_grad_norm");
  sf_optimizer_options_init(&o);
  o.fusion = (sf_fusion)9;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt), SF_INVALID_ARGUMENT, "fusion = 9");
  sf_optimizer_options_init(&o);
  o.cuda_stream = &o; /* any non-NULL stream, with the CPU */
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt), SF_INVALID_ARGUMENT, "cuda_stream");
  CHECK(opt == NULL);

  /* A CUDA device: unsupported here without a GPU, with the C++ message. On a GPU
   * machine the same request with a CPU-only fusion mode is unsupported instead. */
  sf_optimizer_options_init(&o);
  o.device.kind = SF_DEVICE_CUDA;
  char reason[512];
  if (!sf_cuda_available(reason, sizeof reason)) {
    CHECK(strlen(reason) > 0);
    CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt), SF_UNSUPPORTED, reason);
    CHECK(starts_with(sf_last_error(),
                      "stepfuse: OptimizerOptions::device = cuda:0: the CUDA backend cannot run here: "));
  } else {
    CHECK(reason[0] == '\0');
    o.fusion = SF_FUSION_UNFUSED;
    CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt), SF_UNSUPPORTED, "run on the CPU only");
    CHECK(starts_with(sf_last_error(), "stepfuse: OptimizerOptions::fusion: "));
  }
  CHECK(opt == NULL);
  char tiny[4] = "xyz";
  (void)sf_nvrtc_available(tiny, sizeof tiny); /* whatever the answer, the reason fits */
  CHECK(strlen(tiny) < sizeof tiny);

  /* On a live optimizer. */
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, NULL, &opt));
  if (opt == NULL) return;
  double lr = 0;
  CHECK_FAILS(sf_optimizer_get_lr(opt, NULL), SF_INVALID_ARGUMENT, "sf_optimizer_get_lr: lr is NULL");
  CHECK_FAILS(sf_optimizer_set_lr(opt, NAN), SF_INVALID_ARGUMENT, "lr");
  CHECK_OK(sf_optimizer_get_lr(opt, &lr));
  CHECK(lr == 1e-3); /* unchanged */
  const float* data = NULL;
  int64_t n = 0;
  CHECK_FAILS(sf_optimizer_state(opt, 0, "momentum_buffer", &data, &n), SF_INVALID_ARGUMENT, "'momentum_buffer'");
  CHECK(strstr(sf_last_error(), "exp_avg") != NULL); /* lists the names it has */
  CHECK_FAILS(sf_optimizer_state(opt, 5, "exp_avg", &data, &n), SF_INVALID_ARGUMENT, "param index 5");
  CHECK_FAILS(sf_optimizer_state(opt, 0, NULL, &data, &n), SF_INVALID_ARGUMENT, "name is NULL");
  const char* name = NULL;
  CHECK_FAILS(sf_optimizer_state_name(opt, 2, &name), SF_INVALID_ARGUMENT, "index 2");
  CHECK_FAILS(sf_optimizer_step_scaled(opt, 0.0, NULL), SF_INVALID_ARGUMENT, "loss_scale = 0");
  CHECK_FAILS(sf_optimizer_step_scaled(opt, 0x1p-130, NULL), SF_INVALID_ARGUMENT, "above 2^-128");
  sf_step_result r = {0};
  CHECK_FAILS(sf_optimizer_step_scaled(opt, 1.0, &r), SF_INVALID_ARGUMENT, "result->struct_size = 0");
  r.struct_size = sizeof r;
  CHECK_OK(sf_optimizer_step_scaled(opt, 2.0, &r));
  CHECK(r.applied && !r.found_inf && close_rel(r.grad_norm, 0.5, 1e-12)); /* |g/2| over 4 elements */
  /* State written through mutable_state is what the next step reads:
   * exp_avg = b1 * exp_avg + (1 - b1) * g. */
  float* avg = NULL;
  CHECK_OK(sf_optimizer_mutable_state(opt, 0, "exp_avg", &avg, &n));
  CHECK(avg != NULL && n == 4);
  if (avg != NULL) {
    avg[0] = 42.0f;
    CHECK_OK(sf_optimizer_state(opt, 0, "exp_avg", &data, &n));
    CHECK(data == avg && data[0] == 42.0f);
    CHECK_OK(sf_optimizer_step(opt)); /* g = 0.5, unscaled */
    CHECK_OK(sf_optimizer_state(opt, 0, "exp_avg", &data, &n));
    CHECK(close_rel(data[0], 0.9 * 42.0 + 0.1 * 0.5, 1e-6));
  }
  sf_optimizer_config bigger;
  sf_optimizer_config_init(&bigger, SF_ADAMW);
  bigger.struct_size = 16;
  CHECK_FAILS(sf_optimizer_get_config(opt, &bigger), SF_INVALID_ARGUMENT, "out->struct_size = 16");
  sf_optimizer_config_init(&bigger, SF_SGD);
  CHECK_FAILS(sf_optimizer_set_config(opt, &bigger), SF_INVALID_ARGUMENT, "");

  /* The message stays until the next failure: a successful call keeps it. */
  CHECK_FAILS(sf_optimizer_set_lr(opt, -2.0), SF_INVALID_ARGUMENT, "lr = -2");
  char kept[1024];
  snprintf(kept, sizeof kept, "%s", sf_last_error());
  CHECK_OK(sf_optimizer_get_lr(opt, &lr));
  CHECK(strcmp(sf_last_error(), kept) == 0);

  /* update() before step(): invalid state. */
  sf_grad_scaler_options so;
  sf_grad_scaler_options_init(&so);
  so.device = "cpu";
  sf_grad_scaler* sc = NULL;
  CHECK_OK(sf_grad_scaler_create(&so, &sc));
  CHECK_FAILS(sf_grad_scaler_update(sc, NULL), SF_INVALID_STATE, "GradScaler::update: no inf checks");
  CHECK_FAILS(sf_grad_scaler_get_scale(sc, NULL), SF_INVALID_ARGUMENT, "sf_grad_scaler_get_scale: scale is NULL");
  sf_grad_scaler_destroy(sc);
  sf_optimizer_destroy(opt);
}

/* ---- Per-thread messages ---------------------------------------------------------- */

static int thread_body(void* arg) {
  (void)arg;
  /* A new thread has no message yet, whatever other threads did. */
  CHECK(strcmp(sf_last_error(), "") == 0);
  CHECK_FAILS(sf_grad_scaler_step(NULL, NULL, NULL), SF_INVALID_ARGUMENT, "sf_grad_scaler_step: scaler is NULL");
  return 0;
}

static void test_thread_local_error(void) {
  CHECK_FAILS(sf_optimizer_step(NULL), SF_INVALID_ARGUMENT, "sf_optimizer_step: opt is NULL");
  thrd_t t;
  CHECK(thrd_create(&t, thread_body, NULL) == thrd_success);
  int rc = -1;
  CHECK(thrd_join(t, &rc) == thrd_success && rc == 0);
  /* The other thread's failure did not touch this thread's message. */
  CHECK(strstr(sf_last_error(), "sf_optimizer_step: opt is NULL") != NULL);
}

/* ---- Warnings ------------------------------------------------------------------- */

struct warnings {
  int count;
  char last[1024];
};

static void on_warning(const char* message, void* user) {
  struct warnings* w = user;
  ++w->count;
  snprintf(w->last, sizeof w->last, "%s", message);
}

static void test_warning_handler(void) {
  /* Must run before any other GradScaler("cuda"): the warning is sent once per process. */
  struct warnings w = {0, ""};
  sf_set_warning_handler(on_warning, &w);
  sf_grad_scaler* sc = NULL;
  CHECK_OK(sf_grad_scaler_create(NULL, &sc)); /* the defaults: device "cuda" */
  sf_device where = {SF_DEVICE_CUDA, 0};
  CHECK_OK(sf_grad_scaler_where_scale_lives(sc, &where));
  CHECK(where.kind == SF_DEVICE_CPU); /* on a GPU too: it moves when a GPU optimizer steps */
  if (!sf_cuda_available(NULL, 0)) {
    CHECK(w.count == 1);
    CHECK(strstr(w.last, "GradScaler(device=\"cuda\")") != NULL);
  } else {
    CHECK(w.count == 0);
  }
  sf_grad_scaler_destroy(sc);
  sf_set_warning_handler(NULL, NULL);
}

/* ---- Custom update programs: a Lion variant built op by op ------------------------ */

/* Lion with a soft sign: where |c| <= tau the update is c / tau instead of sign(c).
 *   c = beta1*m + (1-beta1)*g;  p = p*decay - lr*u;  m = beta2*m + (1-beta2)*g,  g = grad*gscale */
enum { kLionBeta1, kLionBeta2, kLionDecay, kLionTau };
static const double kLion[] = {0.9, 0.99, 1.0 - 0.05 * 0.1, 0.02};
static const double kLionLr = 0.05;

static sf_program* build_lion_soft_sign(void) {
  sf_program_builder* b = NULL;
  CHECK_OK(sf_program_builder_create("lion_soft_sign", &b));
  int grad = -1, param = -1, exp_avg = -1;
  CHECK_OK(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param));
  CHECK_OK(sf_program_builder_stream(b, "exp_avg", SF_ROLE_STATE, 0.0f, &exp_avg));
  sf_value v[32];
  CHECK_OK(sf_program_builder_load(b, grad, &v[0]));
  CHECK_OK(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &v[1]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[0], v[1], 0, &v[2])); /* g */
  CHECK_OK(sf_program_builder_load(b, exp_avg, &v[3]));                /* m */
  CHECK_OK(sf_program_builder_scalar(b, "beta1", SF_SCALAR_FIXED, kLion[kLionBeta1], 0.0, &v[4]));
  CHECK_OK(sf_program_builder_scalar(b, "one_minus_beta1", SF_SCALAR_FIXED, 1.0 - kLion[kLionBeta1], 0.0, &v[5]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[4], v[3], 0, &v[6]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[5], v[2], 0, &v[7]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_ADD, v[6], v[7], 0, &v[8])); /* c */
  CHECK_OK(sf_program_builder_scalar(b, "tau", SF_SCALAR_FIXED, kLion[kLionTau], 0.0, &v[9]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_ABS, v[8], 0, 0, &v[10]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_LT, v[9], v[10], 0, &v[11]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_SIGN, v[8], 0, 0, &v[12]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_DIV, v[8], v[9], 0, &v[13]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_SELECT, v[11], v[12], v[13], &v[14])); /* u */
  CHECK_OK(sf_program_builder_load(b, param, &v[15]));
  CHECK_OK(sf_program_builder_scalar(b, "decay", SF_SCALAR_FIXED, kLion[kLionDecay], 0.0, &v[16]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[15], v[16], 0, &v[17]));
  CHECK_OK(sf_program_builder_scalar(b, "lr", SF_SCALAR_FIXED, kLionLr, 0.0, &v[18]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[18], v[14], 0, &v[19]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_SUB, v[17], v[19], 0, &v[20]));
  CHECK_OK(sf_program_builder_store(b, param, v[20]));
  CHECK_OK(sf_program_builder_scalar(b, "beta2", SF_SCALAR_FIXED, kLion[kLionBeta2], 0.0, &v[21]));
  CHECK_OK(sf_program_builder_scalar(b, "one_minus_beta2", SF_SCALAR_FIXED, 1.0 - kLion[kLionBeta2], 0.0, &v[22]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[21], v[3], 0, &v[23]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, v[22], v[2], 0, &v[24]));
  CHECK_OK(sf_program_builder_op(b, SF_OP_ADD, v[23], v[24], 0, &v[25]));
  CHECK_OK(sf_program_builder_store(b, exp_avg, v[25]));
  CHECK(v[25] == 26); /* ids are instruction indexes (the store of param is 21) */
  sf_program* prog = NULL;
  CHECK_OK(sf_program_builder_build(b, &prog));
  sf_program_builder_destroy(b);
  return prog;
}

/* One element of a step from m = 0, in double; *ambiguous when |c| is within fp32
 * rounding of tau (either branch may be taken). */
static void lion_first_step(double p, double g, double lr, double* p_out, double* m_out, bool* ambiguous) {
  const double c = (1.0 - kLion[kLionBeta1]) * g;
  const double tau = kLion[kLionTau];
  *ambiguous = fabs(fabs(c) - tau) < 1e-5 * tau;
  const double u = fabs(c) > tau ? (c > 0 ? 1.0 : -1.0) : c / tau;
  *p_out = p * kLion[kLionDecay] - lr * u;
  *m_out = (1.0 - kLion[kLionBeta2]) * g;
}

static void test_custom_program(void) {
  sf_program* prog = build_lion_soft_sign();
  CHECK(prog != NULL);
  if (prog == NULL) return;
  size_t needed = 0;
  CHECK_OK(sf_program_text(prog, NULL, 0, &needed));
  char text[4096];
  CHECK(needed > 0 && needed < sizeof text);
  CHECK_OK(sf_program_text(prog, text, sizeof text, NULL));
  CHECK(starts_with(text, "program lion_soft_sign\n"));
  CHECK(strstr(text, "  %14 = select %11, %12, %13\n") != NULL);
  CHECK(strstr(text, "scalars\n  gscale = gscale * 1\n") != NULL);

  static float w[2][kN0], g[2][kN0], w0[2][kN0], g_true[2][kN0];
  const int64_t n[2] = {kN0, kN1};
  for (int t = 0; t < 2; ++t)
    for (int64_t i = 0; i < n[t]; ++i) {
      w[t][i] = w0[t][i] = bf16_value(0.5, 1.5);
      g_true[t][i] = bf16_value(0.01, 0.5); /* (1-beta1)*g spans tau = 0.02 */
    }
  sf_param params[2] = {{view_f32(w[0], n[0]), view_f32(g[0], n[0])}, {view_f32(w[1], n[1]), view_f32(g[1], n[1])}};
  sf_optimizer_options opts;
  sf_optimizer_options_init(&opts);
  opts.has_max_grad_norm = true;
  opts.max_grad_norm = 1e6; /* clipping on, not binding: the reduce pass runs */
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create_custom(prog, params, 2, &opts, &opt));
  sf_program_destroy(prog); /* the optimizer keeps its own copy */
  if (opt == NULL) return;

  /* The loss-scaled first step against the closed form. */
  const double S = 1024.0;
  for (int t = 0; t < 2; ++t)
    for (int64_t i = 0; i < n[t]; ++i) g[t][i] = (float)(g_true[t][i] * S);
  sf_step_result r;
  sf_step_result_init(&r);
  CHECK_OK(sf_optimizer_step_scaled(opt, S, &r));
  CHECK(r.applied && !r.found_inf && r.clip_coef == 1.0);
  int bad = 0, skipped = 0;
  for (int t = 0; t < 2; ++t) {
    const float* m = NULL;
    int64_t numel = 0;
    CHECK_OK(sf_optimizer_state(opt, (size_t)t, "exp_avg", &m, &numel));
    CHECK(numel == n[t]);
    for (int64_t i = 0; i < n[t]; ++i) {
      double p_want, m_want;
      bool ambiguous;
      lion_first_step(w0[t][i], g_true[t][i], kLionLr, &p_want, &m_want, &ambiguous);
      if (ambiguous) {
        ++skipped;
        continue;
      }
      if (fabs(w[t][i] - p_want) > 1e-6 * fabs(p_want) + 1e-7 || !close_rel(m[i], m_want, 1e-5)) ++bad;
    }
  }
  CHECK(bad == 0);
  CHECK(skipped < 10);

  /* Scalars: lr through get/set_lr (a fixed "lr" scalar), others by name; no config. */
  double lr = 0;
  CHECK_OK(sf_optimizer_get_lr(opt, &lr));
  CHECK(lr == kLionLr);
  CHECK_OK(sf_optimizer_set_lr(opt, 0.01));
  CHECK_OK(sf_optimizer_get_scalar(opt, "lr", &lr));
  CHECK(lr == 0.01);
  double tau = 0;
  CHECK_OK(sf_optimizer_get_scalar(opt, "tau", &tau));
  CHECK(tau == kLion[kLionTau]);
  CHECK_OK(sf_optimizer_set_scalar(opt, "tau", 0.03));
  CHECK_FAILS(sf_optimizer_set_scalar(opt, "gscale", 2.0), SF_INVALID_ARGUMENT, "has rule gscale");
  CHECK_FAILS(sf_optimizer_set_scalar(opt, "eps", 2.0), SF_INVALID_ARGUMENT, "no scalar 'eps'");
  CHECK_FAILS(sf_optimizer_get_scalar(opt, NULL, &tau), SF_INVALID_ARGUMENT, "sf_optimizer_get_scalar: name is NULL");
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_LION);
  CHECK_FAILS(sf_optimizer_get_config(opt, &cfg), SF_INVALID_STATE, "has no OptimizerConfig");
  CHECK_FAILS(sf_optimizer_set_config(opt, &cfg), SF_INVALID_STATE, "has no OptimizerConfig");
  char ptext[4096];
  CHECK_OK(sf_optimizer_program_text(opt, ptext, sizeof ptext, NULL));
  CHECK(starts_with(ptext, "program lion_soft_sign\n"));

  /* A GradScaler over it: an inf is skipped, writing nothing. */
  sf_grad_scaler_options so;
  sf_grad_scaler_options_init(&so);
  so.device = "cpu";
  so.init_scale = 256.0;
  sf_grad_scaler* scaler = NULL;
  CHECK_OK(sf_grad_scaler_create(&so, &scaler));
  for (int t = 0; t < 2; ++t)
    for (int64_t i = 0; i < n[t]; ++i) g[t][i] = (float)(g_true[t][i] * 256.0);
  g[1][3] = INFINITY;
  memcpy(w0, w, sizeof w);
  bool applied = true;
  CHECK_OK(sf_grad_scaler_step(scaler, opt, &applied));
  CHECK(!applied);
  CHECK(memcmp(w0, w, sizeof w) == 0);
  CHECK_OK(sf_grad_scaler_update(scaler, NULL));
  double scale = 0;
  CHECK_OK(sf_grad_scaler_get_scale(scaler, &scale));
  CHECK(scale == 128.0);
  int64_t steps = 0;
  CHECK_OK(sf_optimizer_step_count(opt, &steps));
  CHECK(steps == 1);
  sf_grad_scaler_destroy(scaler);
  sf_optimizer_destroy(opt);
}

/* constant and convert: p = bf16(p - 0.5 * g), on f32 weights. */
static void test_constant_and_convert(void) {
  sf_program_builder* b = NULL;
  CHECK_OK(sf_program_builder_create("rounded_step", &b));
  int grad, param;
  CHECK_OK(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param));
  sf_value raw, gs, g, half, step, p, diff, rounded;
  CHECK_OK(sf_program_builder_load(b, grad, &raw));
  CHECK_OK(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &gs));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, raw, gs, 0, &g));
  CHECK_OK(sf_program_builder_constant(b, 0.5f, &half));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, half, g, 0, &step));
  CHECK_OK(sf_program_builder_load(b, param, &p));
  CHECK_OK(sf_program_builder_op(b, SF_OP_SUB, p, step, 0, &diff));
  CHECK_OK(sf_program_builder_convert(b, diff, SF_BF16, &rounded));
  CHECK_OK(sf_program_builder_store(b, param, rounded));
  sf_program* prog = NULL;
  CHECK_OK(sf_program_builder_build(b, &prog));
  sf_program_builder_destroy(b);
  static float w[kN1], gr[kN1];
  float want[kN1];
  for (int i = 0; i < kN1; ++i) {
    w[i] = (float)uniform(-1, 1), gr[i] = (float)uniform(-1, 1);
    want[i] = sf_bf16_to_float(sf_float_to_bf16(w[i] - 0.5f * gr[i]));
  }
  sf_param param_view = {view_f32(w, kN1), view_f32(gr, kN1)};
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create_custom(prog, &param_view, 1, NULL, &opt));
  sf_program_destroy(prog);
  CHECK_OK(sf_optimizer_step(opt));
  CHECK(memcmp(w, want, sizeof want) == 0);
  double lr = 0;
  CHECK_FAILS(sf_optimizer_get_lr(opt, &lr), SF_INVALID_STATE, "declares no scalar 'lr'");
  sf_optimizer_destroy(opt);
}

/* A builder whose program is malformed in one way: build fails naming the op and index. */
static void expect_build_error(sf_program_builder* b, const char* needle1, const char* needle2) {
  sf_program* prog = NULL;
  CHECK_FAILS(sf_program_builder_build(b, &prog), SF_INVALID_ARGUMENT, needle1);
  CHECK(strstr(sf_last_error(), needle2) != NULL);
  CHECK(prog == NULL);
  sf_program_builder_destroy(b);
}

static sf_program_builder* start(int* grad, int* param, int* state, sf_value* g) {
  sf_program_builder* b = NULL;
  CHECK_OK(sf_program_builder_create("broken", &b));
  CHECK_OK(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, grad));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, param));
  CHECK_OK(sf_program_builder_stream(b, "m", SF_ROLE_STATE, 0.0f, state));
  sf_value gs, raw;
  CHECK_OK(sf_program_builder_load(b, *grad, &raw));                            /* %0 */
  CHECK_OK(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1, 0, &gs));  /* %1 */
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, raw, gs, 0, g));                   /* %2 */
  return b;
}

static void test_program_errors(void) {
  int grad, param, state;
  sf_value g, v;
  int w;
  sf_program_builder* b;

  b = start(&grad, &param, &state, &g); /* a store to the gradient */
  CHECK_OK(sf_program_builder_store(b, grad, g));
  CHECK_OK(sf_program_builder_store(b, param, g));
  expect_build_error(b, "at op 'store' (instruction 3: store grad, %2)", "the grad stream is read-only");

  b = start(&grad, &param, &state, &g); /* a load after a store */
  CHECK_OK(sf_program_builder_store(b, state, g));
  CHECK_OK(sf_program_builder_load(b, state, &v));
  CHECK_OK(sf_program_builder_store(b, param, v));
  expect_build_error(b, "at op 'load' (instruction 4: %4 = load m)", "a load follows a store");

  b = start(&grad, &param, &state, &g); /* an operand out of range */
  CHECK_OK(sf_program_builder_op(b, SF_OP_ADD, g, 99, 0, &v));
  CHECK_OK(sf_program_builder_store(b, param, v));
  expect_build_error(b, "at op 'add' (instruction 3)", "operand 2 is %99");

  b = start(&grad, &param, &state, &g); /* a stream index out of range */
  CHECK_OK(sf_program_builder_load(b, 5, &v));
  CHECK_OK(sf_program_builder_store(b, param, v));
  expect_build_error(b, "at op 'load' (instruction 3)", "stream index 5 is out of range");

  b = start(&grad, &param, &state, &g); /* the param stream never stored */
  CHECK_OK(sf_program_builder_store(b, state, g));
  expect_build_error(b, "never stores the param stream", "store param");

  b = start(&grad, &param, &state, &g); /* two grad streams */
  CHECK_OK(sf_program_builder_stream(b, "grad2", SF_ROLE_GRAD, 0.0f, &w));
  CHECK_OK(sf_program_builder_store(b, param, g));
  expect_build_error(b, "exactly one stream with role grad", "stream 0 'grad', stream 3 'grad2'");

  b = start(&grad, &param, &state, &g); /* too many instructions */
  v = g;
  for (int i = 0; i < 140; ++i) CHECK_OK(sf_program_builder_op(b, SF_OP_NEG, v, 0, 0, &v));
  CHECK_OK(sf_program_builder_store(b, param, v));
  expect_build_error(b, "op 'neg' (instruction 128) does not fit", "too many instructions");

  /* no scalar with the gscale rule */
  CHECK_OK(sf_program_builder_create("no_gscale", &b));
  CHECK_OK(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param));
  CHECK_OK(sf_program_builder_load(b, grad, &v));
  CHECK_OK(sf_program_builder_store(b, param, v));
  expect_build_error(b, "no scalar has the gscale rule", "UpdateProgram::gscale");

  /* Checked at the call: enums, a scalar redeclared with another rule, NULLs. */
  b = start(&grad, &param, &state, &g);
  CHECK_FAILS(sf_program_builder_op(b, (sf_op)2, g, g, 0, &v), SF_INVALID_ARGUMENT, "op = 2 is not an sf_op");
  CHECK_FAILS(sf_program_builder_stream(b, "x", (sf_stream_role)7, 0.0f, &w), SF_INVALID_ARGUMENT, "role = 7");
  CHECK_FAILS(sf_program_builder_scalar(b, "gscale", SF_SCALAR_FIXED, 1, 0, &v), SF_INVALID_ARGUMENT,
              "scalar 'gscale' was declared with another rule");
  CHECK_FAILS(sf_program_builder_convert(b, g, (sf_dtype)9, &v), SF_INVALID_ARGUMENT, "to = 9");
  CHECK_FAILS(sf_program_builder_load(NULL, 0, &v), SF_INVALID_ARGUMENT, "sf_program_builder_load: builder is NULL");
  sf_program_builder_destroy(b);
  CHECK_FAILS(sf_optimizer_create_custom(NULL, NULL, 0, NULL, NULL), SF_INVALID_ARGUMENT, "program is NULL");
}

/* ---- Emit: the kernels for a compiler, their ABI and tables ----------------------- */

static void test_emit(void) {
  sf_program* prog = build_lion_soft_sign();
  sf_emit_tensor tensors[2] = {{SF_BF16, SF_BF16, true}, {SF_F32, SF_F32, false}};
  sf_emit_request req;
  sf_emit_request_init(&req);
  CHECK(req.struct_size == sizeof req && req.sm == 90 && req.compile && req.target == SF_EMIT_CUBIN);
  req.program = prog;
  req.tensors = tensors;
  req.num_tensors = 2;
  req.compile = false; /* source and ABI: no NVRTC needed */
  sf_emitted_kernel* k = NULL;
  CHECK_OK(sf_emit(&req, &k));
  const char* data = NULL;
  size_t size = 0;
  CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_SOURCE, &data, &size));
  CHECK(size > 1000 && strstr(data, "sf_reduce(") != NULL && strstr(data, "sf_update(") != NULL);
  CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_ABI_JSON, &data, &size));
  CHECK(strstr(data, "\"format\": \"stepfuse.kernel_abi\"") != NULL);
  CHECK(strstr(data, "\"name\": \"lion_soft_sign\"") != NULL);
  CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_ABI_HEADER, &data, &size));
  CHECK(strstr(data, "typedef struct sf_tensor") != NULL);
  CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_BINARY, &data, &size));
  CHECK(size == 0);
  CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_ARCH, &data, &size));
  CHECK(strcmp(data, "sm_90") == 0);
  sf_emitted_kernel_destroy(k);

  if (sf_nvrtc_available(NULL, 0)) { /* PTX for compute_80, from a built-in's config */
    sf_optimizer_config cfg;
    sf_optimizer_config_init(&cfg, SF_ADAMW);
    req.program = NULL;
    req.config = &cfg;
    req.target = SF_EMIT_PTX;
    req.sm = 80;
    req.compile = true;
    k = NULL;
    CHECK_OK(sf_emit(&req, &k));
    CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_BINARY, &data, &size));
    CHECK(size > 0 && strstr(data, ".entry sf_update") != NULL && strstr(data, ".target sm_80") != NULL);
    sf_emitted_kernel_destroy(k);
    req.config = NULL;
    req.program = prog;
  }
  req.target = SF_EMIT_CPU; /* this machine's CPU: LLVM IR, the ABI and the header of the functions */
  req.compile = false;
  k = NULL;
  if (sf_emit(&req, &k) == SF_OK) {
    CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_SOURCE, &data, &size));
    CHECK(strstr(data, "define void @sf_cpu_update_bf16_bf16_m(") != NULL);
    CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_KERNEL_NAMES, &data, &size));
    CHECK(strcmp(data, "sf_cpu_update_bf16_bf16_m\nsf_cpu_update_f32_f32\nsf_cpu_reduce_l2_bf16\n"
                       "sf_cpu_reduce_l2_f32\n") == 0);
    CHECK_OK(sf_emitted_kernel_part(k, SF_EMITTED_ABI_HEADER, &data, &size));
    CHECK(strstr(data, "typedef struct sf_cpu_update_args") != NULL);
    sf_emitted_kernel_destroy(k);
    req.cpu_name = "no-such-cpu";
    CHECK_FAILS(sf_emit(&req, &k), SF_INVALID_ARGUMENT, "'no-such-cpu' is not a CPU LLVM knows");
    req.cpu_name = NULL;
  } else { /* built without LLVM */
    CHECK_FAILS(sf_emit(&req, &k), SF_UNSUPPORTED, "needs the LLVM backend (not built)");
  }
  req.target = SF_EMIT_CUBIN;
  req.flat = true; /* two storages cannot be one flat range */
  CHECK_FAILS(sf_emit(&req, &k), SF_INVALID_ARGUMENT, "flat = true needs every tensor");
  req.flat = false;

  const int64_t numels[2] = {40000, 5};
  sf_kernel_tables* tables = NULL;
  CHECK_OK(sf_emit_tables(&req, numels, 2, &tables));
  sf_kernel_tables_info info;
  sf_kernel_tables_info_init(&info);
  CHECK_OK(sf_kernel_tables_get(tables, &info));
  CHECK(info.num_tensors == 2 && info.num_chunks == 4 && info.num_blocks == 11);
  CHECK(info.state_elems == 40000 + 16 && info.master_elems == 40000);
  CHECK(info.master_offsets[0] == 0 && info.master_offsets[1] == -1);
  CHECK(info.reduce_grid == 1 && info.reduce_block == 128 && info.update_grid == 11 && info.update_block == 256);
  CHECK(info.tensor_sums_bytes == 2 * sizeof(double) && info.partials_bytes == 4 * sizeof(sf_partial));
  CHECK(info.step_state_bytes == sizeof(sf_step_state));
  const sf_tensor* tt = (const sf_tensor*)info.tensors;
  const sf_span* chunks = (const sf_span*)info.chunks;
  CHECK(tt[0].grad == NULL && tt[1].state_offset == 40000 && tt[1].numel == 5 && tt[1].first_chunk == 3);
  CHECK(tt[0].combo == 0 && tt[1].combo == 1 && tt[0].num_chunks == 3);
  CHECK(chunks[2].begin == 2 * SF_CHUNK_ELEMS && chunks[2].len == 40000 - 2 * SF_CHUNK_ELEMS && chunks[3].tensor == 1);
  sf_kernel_tables_destroy(tables);
  CHECK_FAILS(sf_emit_tables(&req, numels, 1, &tables), SF_INVALID_ARGUMENT, "numels has 1 entries");
  sf_program_destroy(prog);
}

/* The CPU backends: the option, the backend query, LLVM vs Highway bit for bit, and an
 * options struct from an older header (SF_OPTIMIZER_OPTIONS_SIZE_V1). */
static void test_cpu_backends(void) {
  enum { kN = 40003 };
  static float w[3][kN], g[kN];
  for (int i = 0; i < kN; ++i) {
    w[0][i] = w[1][i] = w[2][i] = bf16_value(0.5, 1.5);
    g[i] = bf16_value(0.1, 1.0);
  }
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_LION);
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  CHECK(o.cpu_backend == SF_CPU_BACKEND_DEFAULT && !o.llvm_contract);
  o.has_max_grad_norm = true;
  o.max_grad_norm = 1.0;
  const bool have_llvm = sf_llvm_version()[0] != '\0';
  sf_optimizer* opt[3] = {NULL, NULL, NULL};
  const sf_cpu_backend backends[2] = {SF_CPU_BACKEND_HIGHWAY, SF_CPU_BACKEND_LLVM};
  for (int k = 0; k < 2; ++k) {
    const sf_param p = {view_f32(w[k], kN), view_f32(g, kN)};
    o.cpu_backend = backends[k];
    if (k == 1 && !have_llvm) {
      CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt[k]), SF_UNSUPPORTED, "llvm-14-dev");
      continue;
    }
    CHECK_OK(sf_optimizer_create(&cfg, &p, 1, &o, &opt[k]));
    const char* name = NULL;
    CHECK_OK(sf_optimizer_backend(opt[k], &name));
    CHECK(name != NULL && strcmp(name, k == 0 ? "highway" : "llvm") == 0);
    sf_optimizer_options got;
    got.struct_size = sizeof got;
    CHECK_OK(sf_optimizer_get_options(opt[k], &got));
    CHECK(got.cpu_backend == backends[k]);
    sf_step_result r;
    sf_step_result_init(&r);
    CHECK_OK(sf_optimizer_step_scaled(opt[k], 512.0, &r));
  }
  if (have_llvm) CHECK(memcmp(w[0], w[1], sizeof w[0]) == 0);
  /* An older header's struct: no cpu_backend field, read with its defaults. */
  o.struct_size = (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V1;
  o.cpu_backend = (sf_cpu_backend)77; /* beyond V1's size: never read */
  const sf_param p2 = {view_f32(w[2], kN), view_f32(g, kN)};
  CHECK_OK(sf_optimizer_create(&cfg, &p2, 1, &o, &opt[2]));
  sf_optimizer_options old;
  memset(&old, 0xAB, sizeof old);
  old.struct_size = (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V1;
  CHECK_OK(sf_optimizer_get_options(opt[2], &old));
  CHECK(old.struct_size == SF_OPTIMIZER_OPTIONS_SIZE_V1 && old.has_max_grad_norm && old.max_grad_norm == 1.0);
  CHECK(*(const unsigned char*)&old.llvm_contract == 0xAB); /* beyond V1's size: untouched */
  /* The struct of the header before stochastic rounding, as its sizeof (padding included)
   * gives it: its fields are written, nothing after them. */
  const uint32_t v2_sizeof =
      (uint32_t)((SF_OPTIMIZER_OPTIONS_SIZE_V2 + _Alignof(sf_optimizer_options) - 1) / _Alignof(sf_optimizer_options) *
                 _Alignof(sf_optimizer_options));
  for (int k = 0; k < 2; ++k) {
    memset(&old, 0xAB, sizeof old);
    old.struct_size = k == 0 ? (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V2 : v2_sizeof;
    CHECK_OK(sf_optimizer_get_options(opt[2], &old));
    CHECK(old.struct_size == (k == 0 ? (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V2 : v2_sizeof) && !old.llvm_contract);
    CHECK(*(const unsigned char*)&old.stochastic_rounding == 0xAB); /* beyond V2's fields: untouched */
  }
  /* ... and read: bytes past its fields (padding in the older struct) are not the new fields. */
  o.struct_size = v2_sizeof;
  o.cpu_backend = SF_CPU_BACKEND_DEFAULT;
  o.stochastic_rounding = (bool)1; /* in the older struct's padding: never read */
  sf_optimizer* padded = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, &p2, 1, &o, &padded));
  sf_optimizer_options back;
  sf_optimizer_options_init(&back);
  CHECK_OK(sf_optimizer_get_options(padded, &back));
  CHECK(!back.stochastic_rounding);
  sf_optimizer_destroy(padded);
  o.stochastic_rounding = false;
  o.struct_size = sizeof o;
  o.cpu_backend = (sf_cpu_backend)9;
  sf_optimizer* none = NULL;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p2, 1, &o, &none), SF_INVALID_ARGUMENT, "is not an sf_cpu_backend");
  CHECK(none == NULL);
  for (int k = 0; k < 3; ++k) sf_optimizer_destroy(opt[k]);
}

/* Param groups from C: two groups equal two optimizers (no clipping: groups do not
 * interact), per-group config and lr, add_param_group, and errors naming the group. */
static void test_param_groups(void) {
  enum { kA = 300, kB = 45 };
  static float wg[2][kA], gg[2][kA], w1[kA], g1[kA], w2[kB], g2[kB], wx[kB], gx[kB];
  for (int i = 0; i < kA; ++i) {
    wg[0][i] = w1[i] = bf16_value(0.5, 1.5);
    gg[0][i] = g1[i] = bf16_value(0.1, 1.0);
  }
  for (int i = 0; i < kB; ++i) {
    wg[1][i] = w2[i] = bf16_value(0.5, 1.5);
    gg[1][i] = g2[i] = bf16_value(0.1, 1.0);
    wx[i] = 1.0f;
    gx[i] = 0.5f;
  }
  sf_optimizer_config decay, no_decay;
  sf_optimizer_config_init(&decay, SF_ADAMW);
  decay.lr = 0.1;
  decay.weight_decay = 0.1;
  sf_optimizer_config_init(&no_decay, SF_ADAMW);
  no_decay.lr = 0.2;
  no_decay.weight_decay = 0.0;
  no_decay.amsgrad = 1;
  const sf_param pa = {view_f32(wg[0], kA), view_f32(gg[0], kA)}, pb = {view_f32(wg[1], kB), view_f32(gg[1], kB)};
  const sf_param p1 = {view_f32(w1, kA), view_f32(g1, kA)}, p2 = {view_f32(w2, kB), view_f32(g2, kB)};
  const sf_param_group groups[2] = {{&pa, 1, &decay}, {&pb, 1, &no_decay}};
  sf_optimizer *grouped = NULL, *one = NULL, *two = NULL;
  CHECK_OK(sf_optimizer_create_groups(groups, 2, NULL, &grouped));
  CHECK_OK(sf_optimizer_create(&decay, &p1, 1, NULL, &one));
  CHECK_OK(sf_optimizer_create(&no_decay, &p2, 1, NULL, &two));
  if (grouped == NULL || one == NULL || two == NULL) {
    sf_optimizer_destroy(grouped), sf_optimizer_destroy(one), sf_optimizer_destroy(two);
    return;
  }
  size_t count = 0, group = 9;
  CHECK_OK(sf_optimizer_num_groups(grouped, &count));
  CHECK(count == 2);
  CHECK_OK(sf_optimizer_group_of(grouped, 1, &group));
  CHECK(group == 1);
  for (int step = 0; step < 3; ++step) {
    CHECK_OK(sf_optimizer_step(grouped));
    CHECK_OK(sf_optimizer_step(one));
    CHECK_OK(sf_optimizer_step(two));
  }
  CHECK(memcmp(wg[0], w1, sizeof w1) == 0);
  CHECK(memcmp(wg[1], w2, sizeof w2) == 0);
  const float *s_grouped = NULL, *s_two = NULL;
  int64_t n = 0;
  CHECK_OK(sf_optimizer_state(grouped, 1, "max_exp_avg_sq", &s_grouped, &n));
  CHECK_OK(sf_optimizer_state(two, 0, "max_exp_avg_sq", &s_two, &n));
  CHECK(n == kB && s_grouped != NULL && s_two != NULL && memcmp(s_grouped, s_two, sizeof(float) * kB) == 0);
  CHECK_FAILS(sf_optimizer_state(grouped, 0, "max_exp_avg_sq", &s_grouped, &n), SF_INVALID_ARGUMENT, "group (0)");

  double lr = 0;
  CHECK_OK(sf_optimizer_set_group_lr(grouped, 1, 0.05));
  CHECK_OK(sf_optimizer_get_group_lr(grouped, 1, &lr));
  CHECK(lr == 0.05);
  CHECK_OK(sf_optimizer_get_lr(grouped, &lr));
  CHECK(lr == 0.1);
  sf_optimizer_config got;
  sf_optimizer_config_init(&got, SF_SGD);
  CHECK_OK(sf_optimizer_get_group_config(grouped, 1, &got));
  CHECK(got.kind == SF_ADAMW && got.weight_decay == 0.0 && got.amsgrad);
  got.weight_decay = 0.01;
  CHECK_OK(sf_optimizer_set_group_config(grouped, 1, &got));
  CHECK_FAILS(sf_optimizer_get_group_lr(grouped, 2, &lr), SF_INVALID_ARGUMENT, "group 2 is out of range");
  got.amsgrad = 0;
  CHECK_FAILS(sf_optimizer_set_group_config(grouped, 1, &got), SF_INVALID_ARGUMENT, "group 1");

  /* add_param_group: a new tensor is fine, one already in a group is not. */
  const sf_param px = {view_f32(wx, kB), view_f32(gx, kB)};
  const sf_param_group again = {&pa, 1, &decay}, extra = {&px, 1, &decay};
  CHECK_FAILS(sf_optimizer_add_param_group(grouped, &again), SF_INVALID_ARGUMENT, "groups[0].params[0].weight");
  CHECK_OK(sf_optimizer_add_param_group(grouped, &extra));
  CHECK_OK(sf_optimizer_num_groups(grouped, &count));
  CHECK(count == 3);
  CHECK_OK(sf_optimizer_step(grouped));
  CHECK(wx[0] < 1.0f);

  /* Creation errors name the group. */
  sf_optimizer* bad = NULL;
  const sf_param_group twice[2] = {{&pa, 1, &decay}, {&pa, 1, &no_decay}};
  CHECK_FAILS(sf_optimizer_create_groups(twice, 2, NULL, &bad), SF_INVALID_ARGUMENT, "groups[1].params[0].weight");
  const sf_param_group empty[2] = {{&pa, 1, &decay}, {NULL, 0, &no_decay}};
  CHECK_FAILS(sf_optimizer_create_groups(empty, 2, NULL, &bad), SF_INVALID_ARGUMENT, "groups[1]");
  const sf_param_group no_config[1] = {{&pa, 1, NULL}};
  CHECK_FAILS(sf_optimizer_create_groups(no_config, 1, NULL, &bad), SF_INVALID_ARGUMENT, "groups[0].config is NULL");
  CHECK(bad == NULL);
  sf_optimizer_destroy(grouped);
  sf_optimizer_destroy(one);
  sf_optimizer_destroy(two);
}

/* How param `param`'s stream `name` is stored; -1 when the call fails (counted as a failure). */
static int format_of(const sf_optimizer* opt, size_t param, const char* name) {
  sf_state_format f = (sf_state_format)-1;
  CHECK_OK(sf_optimizer_state_format(opt, param, name, &f));
  return (int)f;
}

/* Per-group state formats (sf_optimizer_config.has_state_format): a group's own format
 * beside the options' blanket one and the per-stream overrides; the getters report it,
 * the setters refuse to change it; an older header's config struct neither reads nor
 * writes the new fields; a group's q8 state steps bit for bit as a q8 optimizer's. */
static void test_group_state_formats(void) {
  enum { kA = 700, kB = 300 };
  static float wa[kA], ga[kA], wb[kB], gb[kB], wq[kA], gq[kA], wx[kB], gx[kB];
  for (int i = 0; i < kA; ++i) wa[i] = wq[i] = (float)uniform(-1, 1), ga[i] = gq[i] = (float)uniform(-1, 1);
  for (int i = 0; i < kB; ++i) wb[i] = wx[i] = (float)uniform(-1, 1), gb[i] = gx[i] = (float)uniform(-1, 1);
  sf_optimizer_config matrices, embeddings;
  sf_optimizer_config_init(&matrices, SF_ADAMW);
  CHECK(matrices.state_format == SF_STATE_F32 && !matrices.has_state_format);
  matrices.has_state_format = true;
  matrices.state_format = SF_STATE_Q8;
  sf_optimizer_config_init(&embeddings, SF_ADAMW);
  embeddings.weight_decay = 0.0;
  const sf_param pa = {view_f32(wa, kA), view_f32(ga, kA)}, pb = {view_f32(wb, kB), view_f32(gb, kB)};
  const sf_param_group groups[2] = {{&pa, 1, &matrices}, {&pb, 1, &embeddings}};
  /* The blanket format is bf16 (group 1 takes it), exp_avg_sq is f32 in every group. */
  sf_stream_format overrides[1] = {{"exp_avg_sq", SF_STATE_F32}};
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  o.state_format = SF_STATE_BF16;
  o.state_formats = overrides;
  o.num_state_formats = 1;
  o.min_q8_numel = 0;
  sf_optimizer *grouped = NULL, *q8 = NULL;
  CHECK_OK(sf_optimizer_create_groups(groups, 2, &o, &grouped));
  sf_optimizer_options qo = o; /* every group q8, exp_avg_sq f32 */
  qo.state_format = SF_STATE_Q8;
  const sf_param pq = {view_f32(wq, kA), view_f32(gq, kA)};
  sf_optimizer_config plain;
  sf_optimizer_config_init(&plain, SF_ADAMW);
  CHECK_OK(sf_optimizer_create(&plain, &pq, 1, &qo, &q8));
  if (grouped == NULL || q8 == NULL) {
    sf_optimizer_destroy(grouped), sf_optimizer_destroy(q8);
    return;
  }
  CHECK(format_of(grouped, 0, "exp_avg") == SF_STATE_Q8 && format_of(grouped, 0, "exp_avg_sq") == SF_STATE_F32);
  CHECK(format_of(grouped, 1, "exp_avg") == SF_STATE_BF16 && format_of(grouped, 1, "exp_avg_sq") == SF_STATE_F32);
  for (int step = 0; step < 3; ++step) {
    CHECK_OK(sf_optimizer_step(grouped));
    CHECK_OK(sf_optimizer_step(q8));
  }
  CHECK(memcmp(wa, wq, sizeof wa) == 0);
  const void *stored = NULL, *stored_q8 = NULL;
  size_t nbytes = 0, nbytes_q8 = 0;
  CHECK_OK(sf_optimizer_state_storage(grouped, 0, "exp_avg", &stored, &nbytes));
  CHECK_OK(sf_optimizer_state_storage(q8, 0, "exp_avg", &stored_q8, &nbytes_q8));
  CHECK(nbytes == kA && nbytes_q8 == kA && stored != NULL && stored_q8 != NULL && memcmp(stored, stored_q8, kA) == 0);

  /* The getters: the group's own format, or the one it takes from the options. */
  sf_optimizer_config got;
  sf_optimizer_config_init(&got, SF_SGD);
  CHECK_OK(sf_optimizer_get_group_config(grouped, 0, &got));
  CHECK(got.kind == SF_ADAMW && got.has_state_format && got.state_format == SF_STATE_Q8);
  CHECK_OK(sf_optimizer_get_config(grouped, &got));
  CHECK(got.has_state_format && got.state_format == SF_STATE_Q8);
  CHECK_OK(sf_optimizer_get_group_config(grouped, 1, &got));
  CHECK(!got.has_state_format && got.state_format == SF_STATE_BF16 && got.weight_decay == 0.0);

  /* The setters: what a getter gave back, or no format, is fine; another format is not. */
  got.lr = 0.002;
  CHECK_OK(sf_optimizer_set_group_config(grouped, 1, &got));
  got.has_state_format = true; /* bf16: the format group 1 takes */
  CHECK_OK(sf_optimizer_set_group_config(grouped, 1, &got));
  got.state_format = SF_STATE_Q8;
  CHECK_FAILS(sf_optimizer_set_group_config(grouped, 1, &got), SF_INVALID_ARGUMENT, "group 1 takes bf16 as its state format");
  CHECK_OK(sf_optimizer_set_group_config(grouped, 0, &got));
  CHECK_OK(sf_optimizer_set_config(grouped, &got)); /* group 0's format: what get_config gives */
  got.state_format = SF_STATE_BF16;
  got.lr = 0.004;
  CHECK_FAILS(sf_optimizer_set_config(grouped, &got), SF_INVALID_ARGUMENT, "group 0 takes q8 as its state format");
  double lr = 0;
  CHECK_OK(sf_optimizer_get_group_lr(grouped, 0, &lr));
  CHECK(lr == 0.002); /* the refused set_config changed nothing */
  got.has_state_format = false;
  got.lr = 0.003;
  CHECK_OK(sf_optimizer_set_config(grouped, &got));
  CHECK_OK(sf_optimizer_get_group_lr(grouped, 1, &lr));
  CHECK(lr == 0.003);

  /* add_param_group with its own format (f32, under the options' bf16). */
  const sf_param px = {view_f32(wx, kB), view_f32(gx, kB)};
  sf_optimizer_config exact;
  sf_optimizer_config_init(&exact, SF_ADAMW);
  exact.has_state_format = true;
  exact.state_format = SF_STATE_F32;
  const sf_param_group extra = {&px, 1, &exact};
  CHECK_OK(sf_optimizer_add_param_group(grouped, &extra));
  CHECK(format_of(grouped, 2, "exp_avg") == SF_STATE_F32);
  CHECK_OK(sf_optimizer_step(grouped));

  /* Bad values name the group's config. */
  sf_optimizer* bad = NULL;
  embeddings.has_state_format = true;
  embeddings.state_format = (sf_state_format)7;
  CHECK_FAILS(sf_optimizer_create_groups(groups, 2, &o, &bad), SF_INVALID_ARGUMENT, "groups[1].config->state_format = 7");
  embeddings.state_format = SF_STATE_F32;
  memset(&embeddings.has_state_format, 2, 1);
  CHECK_FAILS(sf_optimizer_create_groups(groups, 2, &o, &bad), SF_INVALID_ARGUMENT,
              "groups[1].config->has_state_format = 2");
  CHECK(bad == NULL);

  /* One group: sf_optimizer_create takes the config's format too. */
  sf_optimizer* one = NULL;
  sf_optimizer_config half;
  sf_optimizer_config_init(&half, SF_ADAM);
  half.has_state_format = true;
  half.state_format = SF_STATE_BF16;
  CHECK_OK(sf_optimizer_create(&half, &pb, 1, NULL, &one));
  CHECK(format_of(one, 0, "exp_avg_sq") == SF_STATE_BF16);
  sf_optimizer_destroy(one);

  /* An older header's struct (SF_OPTIMIZER_CONFIG_SIZE_V1, or its sizeof): the bytes past
   * its fields are not read, and not written. */
  const size_t align = _Alignof(sf_optimizer_config);
  const uint32_t v1_sizes[2] = {(uint32_t)SF_OPTIMIZER_CONFIG_SIZE_V1,
                                (uint32_t)((SF_OPTIMIZER_CONFIG_SIZE_V1 + align - 1) / align * align)};
  CHECK(v1_sizes[1] < sizeof(sf_optimizer_config));
  for (int k = 0; k < 2; ++k) {
    sf_optimizer_config old;
    sf_optimizer_config_init(&old, SF_ADAM);
    old.struct_size = v1_sizes[k];
    memset(&old.state_format, 0x5A, sizeof old.state_format); /* garbage past the older struct's fields */
    memset(&old.has_state_format, 0x7F, 1);
    one = NULL;
    CHECK_OK(sf_optimizer_create(&old, &pb, 1, NULL, &one));
    if (one == NULL) continue;
    CHECK(format_of(one, 0, "exp_avg") == SF_STATE_F32);
    old.lr = 0.5;
    CHECK_OK(sf_optimizer_get_config(one, &old));
    unsigned char flag = 0, format[sizeof old.state_format], garbage[sizeof old.state_format];
    memcpy(&flag, &old.has_state_format, 1);
    memcpy(format, &old.state_format, sizeof format);
    memset(garbage, 0x5A, sizeof garbage);
    CHECK(old.struct_size == v1_sizes[k] && old.lr == 1e-3 && flag == 0x7F);
    CHECK(memcmp(format, garbage, sizeof format) == 0); /* past the older struct's fields: not written */
    CHECK_OK(sf_optimizer_set_config(one, &old));
    sf_optimizer_destroy(one);
  }
  sf_optimizer_config wrong;
  sf_optimizer_config_init(&wrong, SF_ADAM);
  wrong.struct_size = (uint32_t)SF_OPTIMIZER_CONFIG_SIZE_V1 - 8;
  CHECK_FAILS(sf_optimizer_create(&wrong, &pb, 1, NULL, &bad), SF_INVALID_ARGUMENT, "config->struct_size");

  /* Emitting: a program keeps no storage of its own. */
  sf_emit_tensor tensor = {SF_F32, SF_F32, false};
  sf_emit_request req;
  sf_emit_request_init(&req);
  req.config = &matrices;
  req.tensors = &tensor;
  req.num_tensors = 1;
  req.compile = false;
  sf_emitted_kernel* k = NULL;
  CHECK_FAILS(sf_emit(&req, &k), SF_INVALID_ARGUMENT, "config->has_state_format");
  sf_optimizer_destroy(grouped);
  sf_optimizer_destroy(q8);
}

/* stochastic_state_rounding: on by default, read and reported; an older header's options
 * struct (SF_OPTIMIZER_OPTIONS_SIZE_V5) keeps the default and gets its fields only. */
static void test_stochastic_state_rounding(void) {
  enum { kN = 600 };
  static uint16_t w[kN], g[kN];
  for (int i = 0; i < kN; ++i) w[i] = sf_float_to_bf16((float)uniform(-1, 1)), g[i] = sf_float_to_bf16((float)uniform(-1, 1));
  const sf_param p = {{w, kN, SF_BF16}, {g, kN, SF_BF16}};
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  CHECK(o.stochastic_state_rounding);
  o.master_weights = false;
  o.stochastic_rounding = true;
  o.state_format = SF_STATE_BF16;
  o.stochastic_state_rounding = false;
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, &o, &opt));
  sf_optimizer_options got;
  sf_optimizer_options_init(&got);
  CHECK_OK(sf_optimizer_get_options(opt, &got));
  CHECK(!got.stochastic_state_rounding && got.stochastic_rounding);
  CHECK_OK(sf_optimizer_step(opt));
  sf_optimizer_destroy(opt);
  sf_optimizer_options old;
  memset(&old, 0, sizeof old);
  old.struct_size = (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V5;
  memset(&old.stochastic_state_rounding, 0x7F, 1); /* past the older struct's fields: never written */
  opt = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, &o, &opt));
  if (opt == NULL) return;
  CHECK_OK(sf_optimizer_get_options(opt, &old));
  unsigned char flag = 0;
  memcpy(&flag, &old.stochastic_state_rounding, 1);
  CHECK(old.struct_size == SF_OPTIMIZER_OPTIONS_SIZE_V5 && old.stochastic_rounding && flag == 0x7F);
  sf_optimizer_destroy(opt);
  o.struct_size = (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V5; /* read without it: the default, true */
  opt = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, &o, &opt));
  CHECK_OK(sf_optimizer_get_options(opt, &got));
  CHECK(got.stochastic_state_rounding);
  sf_optimizer_destroy(opt);
  o.struct_size = sizeof o;
  memset(&o.stochastic_state_rounding, 3, 1);
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &opt), SF_INVALID_ARGUMENT, "options->stochastic_state_rounding = 3");
}

/* A two-phase program from C: phase 1 reduces the unscaled gradient into slot 0,
 * phase 2 stores the tensor's norm into a state stream (and the weights unchanged);
 * a bad slot is refused at the call; LAMB (SF_LAMB) steps. */
static void test_two_phase_program(void) {
  sf_program_builder* b = NULL;
  CHECK_OK(sf_program_builder_create("norm_probe", &b));
  if (b == NULL) return;
  int grad = 0, param = 0, norm = 0;
  sf_value raw, gs, g, n, w;
  CHECK_OK(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &grad));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param));
  CHECK_OK(sf_program_builder_stream(b, "norm", SF_ROLE_STATE, 0.0f, &norm));
  CHECK_OK(sf_program_builder_load(b, grad, &raw));
  CHECK_OK(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &gs));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, raw, gs, 0, &g));
  CHECK_FAILS(sf_program_builder_reduce_sumsq(b, SF_PROGRAM_MAX_NORM_SLOTS, g), SF_INVALID_ARGUMENT,
              "slot = 4 is not a reduction slot (use 0 to 3)");
  CHECK_OK(sf_program_builder_reduce_sumsq(b, 0, g));
  CHECK_OK(sf_program_builder_phase(b));
  CHECK_OK(sf_program_builder_tensor_norm(b, 0, &n));
  CHECK_OK(sf_program_builder_store(b, norm, n));
  CHECK_OK(sf_program_builder_load(b, param, &w));
  CHECK_OK(sf_program_builder_store(b, param, w));
  sf_program* prog = NULL;
  CHECK_OK(sf_program_builder_build(b, &prog));
  sf_program_builder_destroy(b);
  if (prog == NULL) return;

  enum { kN = 40000 }; /* three chunks */
  static float wt[kN], gr[kN];
  double sum = 0;
  for (int i = 0; i < kN; ++i) {
    wt[i] = (float)uniform(-1.0, 1.0);
    gr[i] = (float)uniform(-1.0, 1.0);
    sum += (double)gr[i] * gr[i];
  }
  sf_param p = {view_f32(wt, kN), view_f32(gr, kN)};
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create_custom(prog, &p, 1, NULL, &opt));
  sf_program_destroy(prog);
  if (opt == NULL) return;
  sf_step_result r;
  sf_step_result_init(&r);
  CHECK_OK(sf_optimizer_step(opt));
  const float* norms = NULL;
  int64_t numel = 0;
  CHECK_OK(sf_optimizer_state(opt, 0, "norm", &norms, &numel));
  CHECK(numel == kN && norms != NULL && close_rel(norms[0], sqrt(sum), 1e-5) && norms[kN - 1] == norms[0]);
  sf_optimizer_destroy(opt);

  sf_optimizer_config c;
  sf_optimizer_config_init(&c, SF_LAMB);
  CHECK(c.lr == 1e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-6 && c.weight_decay == 0.01);
  CHECK(strcmp(sf_optimizer_kind_name(SF_LAMB), "LAMB") == 0);
  CHECK_OK(sf_optimizer_create(&c, &p, 1, NULL, &opt));
  if (opt == NULL) return;
  const float before = wt[0];
  CHECK_OK(sf_optimizer_step(opt));
  CHECK_OK(sf_optimizer_last_result(opt, &r));
  CHECK(r.applied && wt[0] != before);
  sf_optimizer_destroy(opt);
}

/* Stochastic rounding from C: the options, reproducible from the seed, refused with masters. */
static void test_stochastic_rounding(void) {
  enum { kN = 1003 };
  static uint16_t w[3][kN], g[kN];
  for (int i = 0; i < kN; ++i) {
    w[0][i] = w[1][i] = w[2][i] = sf_float_to_bf16(1.0f);
    g[i] = sf_float_to_bf16(-1.0f);
  }
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_SGD);
  cfg.lr = 1.0 / 4096; /* 1/32 of a bf16 ulp at 1.0: round-to-nearest never moves the weights */
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  CHECK(!o.stochastic_rounding && o.seed == 0);
  sf_optimizer* opt[3] = {NULL, NULL, NULL};
  for (int k = 0; k < 3; ++k) {
    const sf_param p = {{w[k], kN, SF_BF16}, {g, kN, SF_BF16}};
    o.master_weights = false;
    o.stochastic_rounding = k < 2;
    o.seed = 0x100000001ull;
    CHECK_OK(sf_optimizer_create(&cfg, &p, 1, &o, &opt[k]));
    for (int s = 0; s < 8; ++s) CHECK_OK(sf_optimizer_step(opt[k]));
  }
  sf_optimizer_options got;
  sf_optimizer_options_init(&got);
  CHECK_OK(sf_optimizer_get_options(opt[0], &got));
  CHECK(got.stochastic_rounding && got.seed == 0x100000001ull);
  CHECK(memcmp(w[0], w[1], sizeof w[0]) == 0); /* the same seed: the same bits */
  int moved = 0;
  for (int i = 0; i < kN; ++i) {
    CHECK(w[2][i] == sf_float_to_bf16(1.0f));
    moved += w[0][i] != sf_float_to_bf16(1.0f);
  }
  CHECK(moved > kN / 8 && moved < kN / 2); /* 8 steps of 1/32 ulp: 1 - (31/32)^8 = 22% on average */
  for (int k = 0; k < 3; ++k) sf_optimizer_destroy(opt[k]);
  /* With masters: refused, naming the option. */
  const sf_param p = {{w[0], kN, SF_BF16}, {g, kN, SF_BF16}};
  o.master_weights = true;
  o.stochastic_rounding = true;
  sf_optimizer* none = NULL;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &none), SF_INVALID_ARGUMENT, "stochastic_rounding");
  CHECK(none == NULL);
}

/* Compensated bf16 weights: updates below half an ulp stay in the compensation. */
static void test_compensated_weights(void) {
  enum { kN = 1003 };
  static uint16_t w[kN], g[kN];
  for (int i = 0; i < kN; ++i) w[i] = sf_float_to_bf16(1.0f), g[i] = sf_float_to_bf16(-1.0f);
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_SGD);
  cfg.lr = 1.0 / 4096; /* 1/32 of a bf16 ulp at 1.0 */
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  CHECK(!o.compensated_weights);
  o.master_weights = false;
  o.compensated_weights = true;
  const sf_param p = {{w, kN, SF_BF16}, {g, kN, SF_BF16}};
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, &p, 1, &o, &opt));
  for (int s = 0; s < 8; ++s) CHECK_OK(sf_optimizer_step(opt));
  const uint16_t* comp = NULL;
  int64_t numel = -1;
  CHECK_OK(sf_optimizer_compensation(opt, 0, &comp, &numel));
  CHECK(comp != NULL && numel == kN);
  for (int i = 0; i < kN; ++i) {
    CHECK(w[i] == sf_float_to_bf16(1.0f));             /* 8/32 of an ulp: the weight stays */
    CHECK(comp[i] == sf_float_to_bf16(1.0f / 512)); /* ... and the compensation holds it exactly */
  }
  const float* master = (const float*)1;
  CHECK_OK(sf_optimizer_master(opt, 0, &master, &numel));
  CHECK(master == NULL && numel == 0);
  sf_optimizer_options got;
  sf_optimizer_options_init(&got);
  CHECK_OK(sf_optimizer_get_options(opt, &got));
  CHECK(got.compensated_weights && !got.master_weights);
  /* The struct of the header before compensated weights: its fields are written, nothing after. */
  sf_optimizer_options old;
  memset(&old, 0xAB, sizeof old);
  old.struct_size = (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V3;
  CHECK_OK(sf_optimizer_get_options(opt, &old));
  CHECK(old.struct_size == SF_OPTIMIZER_OPTIONS_SIZE_V3 && !old.stochastic_rounding);
  CHECK(*(const unsigned char*)&old.compensated_weights == 0xAB);
  CHECK_FAILS(sf_optimizer_compensation(opt, 1, &comp, &numel), SF_INVALID_ARGUMENT, "param");
  sf_optimizer_destroy(opt);
  /* With masters: refused, naming the option. */
  o.master_weights = true;
  sf_optimizer* none = NULL;
  CHECK_FAILS(sf_optimizer_create(&cfg, &p, 1, &o, &none), SF_INVALID_ARGUMENT, "compensated_weights");
  CHECK(none == NULL);
}

/* Optimizer state stored as q8 or bf16: the formats per stream, the stored bytes and
 * absmaxes, decoded values and writing them, the f32-only accessors refusing, the size
 * threshold, the refusals, an older header's struct, and checkpoints converting formats. */
static void test_state_formats(void) {
  enum { kQ = 1000, kT = 3, kBlocks = (kQ + SF_STATE_Q8_BLOCK - 1) / SF_STATE_Q8_BLOCK };
  static float w[kQ], wt[kT], g[kQ], gt[kT], w2[kQ], wt2[kT];
  for (int i = 0; i < kQ; ++i) w[i] = w2[i] = (float)uniform(-1, 1), g[i] = (float)uniform(-1, 1);
  for (int i = 0; i < kT; ++i) wt[i] = wt2[i] = (float)uniform(-1, 1), gt[i] = (float)uniform(-1, 1);
  g[17] = 0.0f; /* a zero: exactly zero in every format */
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  const sf_param p[2] = {{view_f32(w, kQ), view_f32(g, kQ)}, {view_f32(wt, kT), view_f32(gt, kT)}};
  /* q8 everywhere (min_q8_numel 0: the 3-element tensor too), but exp_avg_sq in bf16. */
  char sq_name[16] = "exp_avg_sq"; /* the caller's string: copied by create */
  sf_stream_format overrides[1] = {{sq_name, SF_STATE_BF16}};
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  o.state_format = SF_STATE_Q8;
  o.min_q8_numel = 0;
  o.state_formats = overrides;
  o.num_state_formats = 1;
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, p, 2, &o, &opt));
  if (opt == NULL) return;
  strcpy(sq_name, "changed");
  overrides[0].format = SF_STATE_F32;
  sf_state_format f = (sf_state_format)-1;
  CHECK_OK(sf_optimizer_state_format(opt, 0, "exp_avg", &f));
  CHECK(f == SF_STATE_Q8);
  CHECK_OK(sf_optimizer_state_format(opt, 0, "exp_avg_sq", &f));
  CHECK(f == SF_STATE_BF16);
  CHECK_OK(sf_optimizer_state_format(opt, 1, "exp_avg", &f));
  CHECK(f == SF_STATE_Q8);
  sf_optimizer_options got;
  sf_optimizer_options_init(&got);
  CHECK_OK(sf_optimizer_get_options(opt, &got));
  CHECK(got.state_format == SF_STATE_Q8 && got.min_q8_numel == 0 && got.num_state_formats == 1);
  CHECK(got.state_formats != NULL && got.state_formats != overrides);
  if (got.state_formats != NULL)
    CHECK(strcmp(got.state_formats[0].stream, "exp_avg_sq") == 0 && got.state_formats[0].format == SF_STATE_BF16);

  CHECK_OK(sf_optimizer_step(opt));

  /* As stored: n code bytes and ceil(n / 256) absmaxes for q8; 2n bytes and none for bf16. */
  const void* bytes = NULL;
  size_t nbytes = 0, count = 99;
  const float* absmax = NULL;
  CHECK_OK(sf_optimizer_state_storage(opt, 0, "exp_avg", &bytes, &nbytes));
  CHECK(bytes != NULL && nbytes == kQ);
  CHECK_OK(sf_optimizer_state_absmax(opt, 0, "exp_avg", &absmax, &count));
  CHECK(absmax != NULL && count == kBlocks);
  CHECK_OK(sf_optimizer_state_storage(opt, 1, "exp_avg", &bytes, &nbytes));
  CHECK(nbytes == kT);
  CHECK_OK(sf_optimizer_state_absmax(opt, 1, "exp_avg", &absmax, &count));
  CHECK(absmax != NULL && count == 1);
  const float* none_absmax = (const float*)1;
  CHECK_OK(sf_optimizer_state_storage(opt, 0, "exp_avg_sq", &bytes, &nbytes));
  CHECK(nbytes == 2 * kQ);
  CHECK_OK(sf_optimizer_state_absmax(opt, 0, "exp_avg_sq", &none_absmax, &count));
  CHECK(none_absmax == NULL && count == 0);

  /* Decoded: exp_avg = (1 - beta1) g after one step, within q8's error of its block's
   * absmax (the block's largest |value|); exp_avg_sq = (1 - beta2) g^2 rounded to bf16. */
  static float m[kQ], v[kQ], again[kQ];
  CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg", m, kQ));
  CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg_sq", v, kQ));
  CHECK_OK(sf_optimizer_state_absmax(opt, 0, "exp_avg", &absmax, &count));
  int bad_m = 0, bad_v = 0, bad_absmax = 0;
  for (int b = 0; b < kBlocks; ++b) {
    double want = 0;
    for (int i = b * SF_STATE_Q8_BLOCK; i < kQ && i < (b + 1) * SF_STATE_Q8_BLOCK; ++i)
      if (fabs(0.1 * g[i]) > want) want = fabs(0.1 * g[i]);
    bad_absmax += !close_rel(absmax[b], want, 1e-5);
  }
  for (int i = 0; i < kQ; ++i) {
    bad_m += fabs(m[i] - 0.1 * g[i]) > 0.02 * absmax[i / SF_STATE_Q8_BLOCK];
    const double sq = 0.001 * g[i] * g[i];
    bad_v += fabs(v[i] - sq) > sq / 128 + 1e-30;
  }
  CHECK(bad_absmax == 0 && bad_m == 0 && bad_v == 0);
  CHECK(m[17] == 0.0f && v[17] == 0.0f);

  /* The f32-only accessors refuse a stream not stored as f32, with the C++ message. */
  const float* data = NULL;
  float* mdata = NULL;
  int64_t numel = 0;
  CHECK_FAILS(sf_optimizer_state(opt, 0, "exp_avg", &data, &numel), SF_INVALID_STATE,
              "state 'exp_avg' of param 0 is stored as q8, not f32");
  CHECK(strstr(sf_last_error(), "state_values()") != NULL);
  CHECK_FAILS(sf_optimizer_mutable_state(opt, 0, "exp_avg_sq", &mdata, &numel), SF_INVALID_STATE,
              "is stored as bf16, not f32");
  CHECK(data == NULL && mdata == NULL);

  /* The stored bytes are writable: save the step's codes and absmaxes, write other
   * values, then restore them. */
  static unsigned char codes[kQ];
  float saved_absmax[kBlocks];
  CHECK_OK(sf_optimizer_state_storage(opt, 0, "exp_avg", &bytes, &nbytes));
  memcpy(codes, bytes, sizeof codes);
  memcpy(saved_absmax, absmax, sizeof saved_absmax);

  /* Writing values: stored as a step stores them. q8 holds 0 and each block's largest
   * positive |value| (code 1.0 times the absmax) exactly, anything else within its code
   * gap; bf16 rounds to nearest even. */
  static float exact[kQ];
  for (int i = 0; i < kQ; ++i) exact[i] = i % 2 == 0 ? (float)(i / SF_STATE_Q8_BLOCK + 1) * 0.375f : 0.0f;
  CHECK_OK(sf_optimizer_set_state_values(opt, 0, "exp_avg", exact, kQ));
  CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg", again, kQ));
  CHECK(memcmp(again, exact, sizeof exact) == 0);
  CHECK_OK(sf_optimizer_state_absmax(opt, 0, "exp_avg", &absmax, &count));
  CHECK(count == kBlocks && absmax[0] == 0.375f && absmax[kBlocks - 1] == kBlocks * 0.375f);
  static float requant[kQ]; /* m encoded as a step stores it (and as a converting load does) */
  CHECK_OK(sf_optimizer_set_state_values(opt, 0, "exp_avg", m, kQ));
  CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg", requant, kQ));
  CHECK_OK(sf_optimizer_state_absmax(opt, 0, "exp_avg", &absmax, &count));
  int far = 0;
  for (int i = 0; i < kQ; ++i) far += fabs(requant[i] - m[i]) > 0.02 * absmax[i / SF_STATE_Q8_BLOCK];
  CHECK(far == 0);
  static float third[kQ];
  for (int i = 0; i < kQ; ++i) third[i] = (float)(i + 1) / 3.0f;
  CHECK_OK(sf_optimizer_set_state_values(opt, 0, "exp_avg_sq", third, kQ));
  CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg_sq", again, kQ));
  int bad_bf16 = 0;
  for (int i = 0; i < kQ; ++i) bad_bf16 += again[i] != sf_bf16_to_float(sf_float_to_bf16(third[i]));
  CHECK(bad_bf16 == 0);
  CHECK_OK(sf_optimizer_set_state_values(opt, 0, "exp_avg_sq", v, kQ)); /* back (v is bf16-exact) */
  CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg_sq", again, kQ));
  CHECK(memcmp(again, v, sizeof v) == 0);
  void* mbytes = NULL;
  float* mabsmax = NULL;
  CHECK_OK(sf_optimizer_mutable_state_storage(opt, 0, "exp_avg", &mbytes, &nbytes));
  CHECK_OK(sf_optimizer_mutable_state_absmax(opt, 0, "exp_avg", &mabsmax, &count));
  CHECK(mbytes != NULL && nbytes == kQ && mabsmax != NULL && count == kBlocks);
  if (mbytes != NULL && mabsmax != NULL) {
    memcpy(mbytes, codes, sizeof codes);
    memcpy(mabsmax, saved_absmax, sizeof saved_absmax);
  }
  CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg", again, kQ));
  CHECK(memcmp(again, m, sizeof m) == 0); /* the step's state again */

  /* Bad arguments: the count, NULLs, names. */
  CHECK_FAILS(sf_optimizer_state_values(opt, 0, "exp_avg", m, kQ - 1), SF_INVALID_ARGUMENT,
              "numel = 999, but state 'exp_avg' of param 0 has 1000 elements");
  CHECK_FAILS(sf_optimizer_set_state_values(opt, 0, "exp_avg", m, kQ + 1), SF_INVALID_ARGUMENT, "1001 values");
  CHECK_FAILS(sf_optimizer_set_state_values(opt, 0, "exp_avg", m, -1), SF_INVALID_ARGUMENT, "numel = -1 is negative");
  CHECK_FAILS(sf_optimizer_state_values(opt, 0, "exp_avg", NULL, kQ), SF_INVALID_ARGUMENT,
              "sf_optimizer_state_values: values is NULL");
  CHECK_FAILS(sf_optimizer_state_format(opt, 0, "momentum_buffer", &f), SF_INVALID_ARGUMENT, "momentum_buffer");
  CHECK_FAILS(sf_optimizer_state_format(opt, 2, "exp_avg", &f), SF_INVALID_ARGUMENT, "param");
  CHECK_FAILS(sf_optimizer_state_format(opt, 0, "exp_avg", NULL), SF_INVALID_ARGUMENT,
              "sf_optimizer_state_format: format is NULL");
  CHECK_FAILS(sf_optimizer_state_storage(opt, 0, NULL, &bytes, &nbytes), SF_INVALID_ARGUMENT,
              "sf_optimizer_state_storage: name is NULL");
  CHECK_FAILS(sf_optimizer_state_absmax(NULL, 0, "exp_avg", &absmax, &count), SF_INVALID_ARGUMENT,
              "sf_optimizer_state_absmax: opt is NULL");

  /* Checkpoints: an f32 optimizer refuses q8/bf16 state unless asked to convert it; then
   * it holds the decoded values exactly. */
  char path[4096];
  snprintf(path, sizeof path, "%s/c_api_test_state_formats.ckpt", g_tmpdir);
  CHECK_OK(sf_optimizer_save(opt, path, NULL));
  const sf_param p2[2] = {{view_f32(w2, kQ), view_f32(g, kQ)}, {view_f32(wt2, kT), view_f32(gt, kT)}};
  sf_optimizer* f32 = NULL;
  CHECK_OK(sf_optimizer_create(&cfg, p2, 2, NULL, &f32));
  if (f32 != NULL) {
    CHECK_OK(sf_optimizer_state_format(f32, 0, "exp_avg", &f));
    CHECK(f == SF_STATE_F32);
    CHECK_FAILS(sf_optimizer_load(f32, path, NULL), SF_INVALID_ARGUMENT, "convert_state");
    CHECK(strstr(sf_last_error(), "exp_avg") != NULL);
    CHECK_FAILS(sf_optimizer_load_ex(f32, path, NULL, NULL), SF_INVALID_ARGUMENT, "convert_state");
    sf_load_options lo;
    sf_load_options_init(&lo);
    CHECK_FAILS(sf_optimizer_load_ex(f32, path, NULL, &lo), SF_INVALID_ARGUMENT, "convert_state");
    int64_t steps = -1;
    CHECK_OK(sf_optimizer_step_count(f32, &steps));
    CHECK(steps == 0); /* nothing loaded */
    lo.struct_size = 3;
    CHECK_FAILS(sf_optimizer_load_ex(f32, path, NULL, &lo), SF_INVALID_ARGUMENT, "sf_load_options_init");
    sf_load_options_init(&lo);
    lo.convert_state = true;
    CHECK_OK(sf_optimizer_load_ex(f32, path, NULL, &lo));
    CHECK_OK(sf_optimizer_step_count(f32, &steps));
    CHECK(steps == 1);
    CHECK_OK(sf_optimizer_state(f32, 0, "exp_avg", &data, &numel));
    CHECK(data != NULL && numel == kQ && memcmp(data, m, sizeof m) == 0);
    CHECK_OK(sf_optimizer_state(f32, 0, "exp_avg_sq", &data, &numel));
    CHECK(data != NULL && numel == kQ && memcmp(data, v, sizeof v) == 0);
    /* The other way: f32 state into the q8 optimizer, converted: encoded as a step
     * stores it (as sf_optimizer_set_state_values did). */
    CHECK_OK(sf_optimizer_save(f32, path, NULL));
    CHECK_FAILS(sf_optimizer_load(opt, path, NULL), SF_INVALID_ARGUMENT, "convert_state");
    CHECK_OK(sf_optimizer_load_ex(opt, path, NULL, &lo));
    CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg", again, kQ));
    CHECK(memcmp(again, requant, sizeof requant) == 0);
    CHECK_OK(sf_optimizer_state_values(opt, 0, "exp_avg_sq", again, kQ));
    CHECK(memcmp(again, v, sizeof v) == 0);
  }
  remove(path);
  sf_optimizer_destroy(f32);
  sf_optimizer_destroy(opt);

  /* Below min_q8_numel (default 4096) a tensor keeps f32, and sf_optimizer_state reads it. */
  sf_optimizer_options_init(&o);
  o.state_format = SF_STATE_Q8;
  CHECK_OK(sf_optimizer_create(&cfg, p2, 2, &o, &opt));
  if (opt != NULL) {
    CHECK_OK(sf_optimizer_state_format(opt, 0, "exp_avg", &f));
    CHECK(f == SF_STATE_F32);
    CHECK_OK(sf_optimizer_state(opt, 0, "exp_avg", &data, &numel));
    CHECK(numel == kQ);
    CHECK_OK(sf_optimizer_state_absmax(opt, 0, "exp_avg", &absmax, &count));
    CHECK(absmax == NULL && count == 0);
    CHECK_OK(sf_optimizer_state_storage(opt, 0, "exp_avg", &bytes, &nbytes));
    CHECK(nbytes == 4 * kQ && bytes == (const void*)data);
    sf_optimizer_options_init(&got);
    CHECK_OK(sf_optimizer_get_options(opt, &got));
    CHECK(got.state_formats == NULL && got.num_state_formats == 0 && got.min_q8_numel == 4096);
    sf_optimizer_destroy(opt);
    opt = NULL;
  }

  /* The struct of the header before state formats (its fields end at
   * SF_OPTIMIZER_OPTIONS_SIZE_V4, or its sizeof): what lies beyond is never read, so
   * the state stays f32; get_options writes its fields only. */
  const size_t align = _Alignof(sf_optimizer_options);
  const uint32_t v4_sizeof = (uint32_t)((SF_OPTIMIZER_OPTIONS_SIZE_V4 + align - 1) / align * align);
  for (int k = 0; k < 2; ++k) {
    sf_optimizer_options_init(&o);
    o.struct_size = k == 0 ? (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V4 : v4_sizeof;
    o.state_format = SF_STATE_Q8; /* beyond its fields: never read */
    o.state_formats = NULL;
    o.num_state_formats = 5;
    o.min_q8_numel = -7;
    sf_optimizer* old_opt = NULL;
    CHECK_OK(sf_optimizer_create(&cfg, p2, 2, &o, &old_opt));
    if (old_opt == NULL) continue;
    CHECK_OK(sf_optimizer_state_format(old_opt, 0, "exp_avg", &f));
    CHECK(f == SF_STATE_F32);
    CHECK_OK(sf_optimizer_state(old_opt, 0, "exp_avg", &data, &numel));
    sf_optimizer_options old;
    memset(&old, 0xAB, sizeof old);
    old.struct_size = k == 0 ? (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V4 : v4_sizeof;
    CHECK_OK(sf_optimizer_get_options(old_opt, &old));
    CHECK(old.struct_size == (k == 0 ? (uint32_t)SF_OPTIMIZER_OPTIONS_SIZE_V4 : v4_sizeof) && old.master_weights);
    CHECK(*(const unsigned char*)&old.min_q8_numel == 0xAB); /* beyond its fields: untouched */
    sf_optimizer_destroy(old_opt);
  }

  /* Refusals: ASGD keeps "ax" in full precision; unknown names, formats, NULLs. */
  sf_optimizer_config asgd;
  sf_optimizer_config_init(&asgd, SF_ASGD);
  sf_optimizer* none = NULL;
  sf_optimizer_options_init(&o);
  o.state_format = SF_STATE_Q8;
  o.min_q8_numel = 0;
  CHECK_FAILS(sf_optimizer_create(&asgd, p2, 2, &o, &none), SF_INVALID_ARGUMENT, "'ax' full precision");
  CHECK(strstr(sf_last_error(), "must stay f32") != NULL);
  sf_stream_format ax = {"ax", SF_STATE_Q8};
  sf_optimizer_options_init(&o);
  o.state_formats = &ax;
  o.num_state_formats = 1;
  CHECK_FAILS(sf_optimizer_create(&asgd, p2, 2, &o, &none), SF_INVALID_ARGUMENT, "keeps 'ax' in full precision");
  ax.format = SF_STATE_F32; /* f32 may be named */
  CHECK_OK(sf_optimizer_create(&asgd, p2, 2, &o, &none));
  sf_optimizer_destroy(none);
  none = NULL;
  sf_stream_format twice[2] = {{"exp_avg", SF_STATE_Q8}, {"nope", SF_STATE_BF16}};
  sf_optimizer_options_init(&o);
  o.state_formats = twice;
  o.num_state_formats = 2;
  CHECK_FAILS(sf_optimizer_create(&cfg, p2, 2, &o, &none), SF_INVALID_ARGUMENT, "no state stream 'nope'");
  twice[1].stream = "exp_avg";
  CHECK_FAILS(sf_optimizer_create(&cfg, p2, 2, &o, &none), SF_INVALID_ARGUMENT, "a second time");
  twice[1].stream = NULL;
  CHECK_FAILS(sf_optimizer_create(&cfg, p2, 2, &o, &none), SF_INVALID_ARGUMENT, "options->state_formats[1].stream is NULL");
  twice[1].stream = "exp_avg_sq";
  twice[1].format = (sf_state_format)5;
  CHECK_FAILS(sf_optimizer_create(&cfg, p2, 2, &o, &none), SF_INVALID_ARGUMENT,
              "options->state_formats[1].format = 5 is not an sf_state_format");
  o.state_formats = NULL;
  CHECK_FAILS(sf_optimizer_create(&cfg, p2, 2, &o, &none), SF_INVALID_ARGUMENT,
              "options->state_formats is NULL with num_state_formats = 2");
  sf_optimizer_options_init(&o);
  o.state_format = (sf_state_format)3;
  CHECK_FAILS(sf_optimizer_create(&cfg, p2, 2, &o, &none), SF_INVALID_ARGUMENT,
              "options->state_format = 3 is not an sf_state_format");
  sf_optimizer_options_init(&o);
  o.min_q8_numel = -1;
  CHECK_FAILS(sf_optimizer_create(&cfg, p2, 2, &o, &none), SF_INVALID_ARGUMENT, "min_q8_numel = -1");
  CHECK(none == NULL);
}

/* A custom program's state streams say what their values allow: a non-negative stream
 * takes q8 (its unsigned code), a full-precision one stays f32 under a blanket format. */
static void test_program_state_values(void) {
  sf_program_builder* b = NULL;
  CHECK_OK(sf_program_builder_create("adagrad_avg", &b));
  if (b == NULL) return;
  int grad, param, sum, avg, bad;
  CHECK_OK(sf_program_builder_stream_ex(b, "grad", SF_ROLE_GRAD, 0.0f, SF_STATE_VALUES_ANY, &grad));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param));
  CHECK_OK(sf_program_builder_stream_ex(b, "sum", SF_ROLE_STATE, 0.0f, SF_STATE_VALUES_NONNEGATIVE, &sum));
  CHECK_OK(sf_program_builder_stream_ex(b, "avg", SF_ROLE_STATE, 0.0f, SF_STATE_VALUES_FULL_PRECISION, &avg));
  CHECK_FAILS(sf_program_builder_stream_ex(b, "x", SF_ROLE_STATE, 0.0f, (sf_state_values)3, &bad),
              SF_INVALID_ARGUMENT, "sf_program_builder_stream_ex: values = 3 is not an sf_state_values");
  sf_value raw, gs, g, s0, sq, s1, p, a0, a1, lr, upd, p1;
  CHECK_OK(sf_program_builder_load(b, grad, &raw));
  CHECK_OK(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &gs));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, raw, gs, 0, &g));
  CHECK_OK(sf_program_builder_load(b, sum, &s0));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, g, g, 0, &sq));
  CHECK_OK(sf_program_builder_op(b, SF_OP_ADD, s0, sq, 0, &s1));
  CHECK_OK(sf_program_builder_store(b, sum, s1));
  CHECK_OK(sf_program_builder_load(b, param, &p));
  CHECK_OK(sf_program_builder_load(b, avg, &a0));
  CHECK_OK(sf_program_builder_op(b, SF_OP_ADD, a0, p, 0, &a1));
  CHECK_OK(sf_program_builder_store(b, avg, a1));
  CHECK_OK(sf_program_builder_scalar(b, "lr", SF_SCALAR_FIXED, 0.01, 0.0, &lr));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, lr, g, 0, &upd));
  CHECK_OK(sf_program_builder_op(b, SF_OP_SUB, p, upd, 0, &p1));
  CHECK_OK(sf_program_builder_store(b, param, p1));
  sf_program* prog = NULL;
  CHECK_OK(sf_program_builder_build(b, &prog));
  sf_program_builder_destroy(b);
  if (prog == NULL) return;
  char text[4096];
  CHECK_OK(sf_program_text(prog, text, sizeof text, NULL));
  CHECK(strstr(text, "stream sum : state (nonnegative)\n") != NULL);
  CHECK(strstr(text, "stream avg : state (full precision)\n") != NULL);

  enum { kN = 600 };
  static float w[kN], g0[kN], w0[kN];
  for (int i = 0; i < kN; ++i) w[i] = w0[i] = (float)uniform(-1, 1), g0[i] = (float)uniform(-1, 1);
  const sf_param prm = {view_f32(w, kN), view_f32(g0, kN)};
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  o.state_format = SF_STATE_Q8;
  o.min_q8_numel = 0;
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create_custom(prog, &prm, 1, &o, &opt));
  sf_program_destroy(prog);
  if (opt == NULL) return;
  sf_state_format f;
  CHECK_OK(sf_optimizer_state_format(opt, 0, "sum", &f));
  CHECK(f == SF_STATE_Q8);
  CHECK_OK(sf_optimizer_state_format(opt, 0, "avg", &f));
  CHECK(f == SF_STATE_F32);
  CHECK_OK(sf_optimizer_step(opt));
  static float s[kN];
  CHECK_OK(sf_optimizer_state_values(opt, 0, "sum", s, kN));
  const float* a = NULL;
  int64_t numel = 0;
  CHECK_OK(sf_optimizer_state(opt, 0, "avg", &a, &numel)); /* f32: readable as such */
  int neg = 0, far = 0, avg_bad = 0;
  for (int i = 0; i < kN; ++i) {
    neg += s[i] < 0.0f;
    far += fabs(s[i] - (double)g0[i] * g0[i]) > 0.02; /* absmax <= 1 */
    avg_bad += a == NULL || a[i] != w0[i];
  }
  CHECK(neg == 0 && far == 0 && avg_bad == 0 && numel == kN);
  sf_optimizer_destroy(opt);

  /* A grad stream with other values than any: caught at build, as the C++ builder does. */
  CHECK_OK(sf_program_builder_create("bad_values", &b));
  if (b == NULL) return;
  CHECK_OK(sf_program_builder_stream_ex(b, "grad", SF_ROLE_GRAD, 0.0f, SF_STATE_VALUES_NONNEGATIVE, &grad));
  CHECK_OK(sf_program_builder_stream(b, "param", SF_ROLE_PARAM, 0.0f, &param));
  CHECK_OK(sf_program_builder_load(b, grad, &raw));
  CHECK_OK(sf_program_builder_scalar(b, "gscale", SF_SCALAR_GSCALE, 1.0, 0.0, &gs));
  CHECK_OK(sf_program_builder_op(b, SF_OP_MUL, raw, gs, 0, &g));
  CHECK_OK(sf_program_builder_store(b, param, g));
  prog = NULL;
  CHECK_FAILS(sf_program_builder_build(b, &prog), SF_INVALID_ARGUMENT, "StateValues");
  CHECK(prog == NULL);
  sf_program_builder_destroy(b);
}

/* The sized init functions: sf_X_init is a macro passing sizeof(sf_X); sf_X_init_size
 * writes the size it is given and no byte more, so a program built against an older
 * stepfuse.h (a smaller struct) gets its own fields, and a newer header's larger struct
 * gets this library's fields, zeros after them, and a struct_size this library refuses. */
#define CHECK_TAIL(buf, from, to, byte)                                       \
  do {                                                                        \
    bool same_ = true;                                                        \
    for (size_t i_ = (from); i_ < (to); ++i_) same_ = same_ && (buf)[i_] == (byte); \
    CHECK(same_);                                                             \
  } while (0)
static void test_init_size(void) {
  enum { kPad = 64 };
  /* (aligned for any of the structs it stands for) */
  static _Alignas(max_align_t) unsigned char buf[sizeof(sf_optimizer_options) + sizeof(sf_optimizer_config) + kPad];
  /* Options from the first header (V1) and the one before the state's rounding (V5). */
  const size_t option_sizes[2] = {SF_OPTIMIZER_OPTIONS_SIZE_V1, SF_OPTIMIZER_OPTIONS_SIZE_V5};
  for (int k = 0; k < 2; ++k) {
    memset(buf, 0xAB, sizeof buf);
    sf_optimizer_options_init_size((sf_optimizer_options*)buf, option_sizes[k]);
    sf_optimizer_options o;
    memcpy(&o, buf, option_sizes[k]);
    CHECK(o.struct_size == option_sizes[k] && o.norm_type == SF_NORM_L2 && !o.has_max_grad_norm);
    CHECK_TAIL(buf, option_sizes[k], sizeof buf, 0xAB);
  }
  /* An older config (V1): its fields with AdamW's defaults, nothing past them; it creates
   * an optimizer as that struct. */
  memset(buf, 0xAB, sizeof buf);
  sf_optimizer_config_init_size((sf_optimizer_config*)buf, SF_ADAMW, SF_OPTIMIZER_CONFIG_SIZE_V1);
  CHECK_TAIL(buf, SF_OPTIMIZER_CONFIG_SIZE_V1, sizeof buf, 0xAB);
  sf_optimizer_config old_cfg;
  memcpy(&old_cfg, buf, SF_OPTIMIZER_CONFIG_SIZE_V1);
  CHECK(old_cfg.struct_size == SF_OPTIMIZER_CONFIG_SIZE_V1 && old_cfg.kind == SF_ADAMW && old_cfg.lr == 1e-3 &&
        old_cfg.weight_decay == 1e-2);
  static float w[8], g[8];
  const sf_param p = {view_f32(w, 8), view_f32(g, 8)};
  sf_optimizer* opt = NULL;
  CHECK_OK(sf_optimizer_create((const sf_optimizer_config*)buf, &p, 1, NULL, &opt));
  sf_optimizer_destroy(opt);
  opt = NULL;
  /* A newer header's larger struct: this library's fields, then zeros; then refused. */
  const size_t bigger = sizeof(sf_optimizer_config) + 16;
  memset(buf, 0xAB, sizeof buf);
  sf_optimizer_config_init_size((sf_optimizer_config*)buf, SF_SGD, bigger);
  CHECK_TAIL(buf, sizeof(sf_optimizer_config), bigger, 0);
  CHECK_TAIL(buf, bigger, sizeof buf, 0xAB);
  CHECK(((const sf_optimizer_config*)buf)->struct_size == bigger && ((const sf_optimizer_config*)buf)->kind == SF_SGD);
  CHECK_FAILS(sf_optimizer_create((const sf_optimizer_config*)buf, &p, 1, NULL, &opt), SF_INVALID_ARGUMENT,
              "config->struct_size");
  CHECK(opt == NULL);
  /* Each of the others: the given size only, struct_size set to it. */
  struct {
    const char* name;
    size_t size;
  } others[7] = {{"sf_step_result", sizeof(sf_step_result)},
                 {"sf_load_options", sizeof(sf_load_options)},
                 {"sf_grad_scaler_options", sizeof(sf_grad_scaler_options)},
                 {"sf_grad_scaler_state", sizeof(sf_grad_scaler_state)},
                 {"sf_loss_scale_optimizer_options", sizeof(sf_loss_scale_optimizer_options)},
                 {"sf_emit_request", sizeof(sf_emit_request)},
                 {"sf_kernel_tables_info", sizeof(sf_kernel_tables_info)}};
  for (int k = 0; k < 7; ++k) {
    for (int shorter = 0; shorter < 2; ++shorter) {
      const size_t n = shorter ? others[k].size - 4 : others[k].size;
      memset(buf, 0xAB, sizeof buf);
      switch (k) {
        case 0: sf_step_result_init_size((sf_step_result*)buf, n); break;
        case 1: sf_load_options_init_size((sf_load_options*)buf, n); break;
        case 2: sf_grad_scaler_options_init_size((sf_grad_scaler_options*)buf, n); break;
        case 3: sf_grad_scaler_state_init_size((sf_grad_scaler_state*)buf, n); break;
        case 4: sf_loss_scale_optimizer_options_init_size((sf_loss_scale_optimizer_options*)buf, n); break;
        case 5: sf_emit_request_init_size((sf_emit_request*)buf, n); break;
        default: sf_kernel_tables_info_init_size((sf_kernel_tables_info*)buf, n); break;
      }
      uint32_t size;
      memcpy(&size, buf, sizeof size);
      if (size != n || buf[n] != 0xAB) fprintf(stderr, "%s_init_size with %zu bytes\n", others[k].name, n);
      CHECK(size == n);
      CHECK_TAIL(buf, n, sizeof buf, 0xAB);
    }
  }
  /* The macros pass the caller's sizeof; the functions of the same names write it too. */
  sf_grad_scaler_options so;
  sf_grad_scaler_options_init(&so);
  CHECK(so.struct_size == sizeof so && so.init_scale == 65536.0 && so.enabled);
  memset(&so, 0, sizeof so);
  (sf_grad_scaler_options_init)(&so);
  CHECK(so.struct_size == sizeof so && so.growth_interval == 2000);
  sf_optimizer_options o;
  memset(&o, 0, sizeof o);
  (sf_optimizer_options_init)(&o);
  CHECK(o.struct_size == sizeof o && o.stochastic_state_rounding);
  /* NULL, or a size that cannot hold struct_size: nothing is written. */
  sf_optimizer_options_init_size(NULL, sizeof o);
  (sf_optimizer_config_init)(NULL, SF_ADAMW);
  memset(buf, 0xAB, sizeof buf);
  sf_optimizer_options_init_size((sf_optimizer_options*)buf, 3);
  CHECK_TAIL(buf, 0, sizeof buf, 0xAB);
}
#undef CHECK_TAIL

int main(void) {
  g_rng = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ULL | 1;
  printf("c_api_test: stepfuse %s (%s), seed %llu\n", sf_version(), sf_cpu_target(), (unsigned long long)g_rng);
  test_warning_handler();
  test_version();
  test_defaults();
  test_conversions();
  test_adamw_first_step();
  test_new_optimizers();
  test_grad_scaler();
  test_loss_scale_optimizer();
  test_checkpoint();
  test_errors();
  test_thread_local_error();
  test_custom_program();
  test_constant_and_convert();
  test_program_errors();
  test_emit();
  test_cpu_backends();
  test_param_groups();
  test_two_phase_program();
  test_stochastic_rounding();
  test_compensated_weights();
  test_state_formats();
  test_group_state_formats();
  test_stochastic_state_rounding();
  test_program_state_values();
  test_init_size();
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
