/* stepfuse-run-emitted-cpu: a program that runs a fused optimizer step emitted for the
 * CPU by stepfuse-emit-cpu-kernel, without stepfuse: it does not link the library, only
 * the object file the emitter wrote (emitted_cpu_step.o), and includes the two headers
 * written with it (stepfuse_cpu_abi.h: the ABI's struct, constants, scalar rules and
 * function declarations; emitted_cpu_step.h: the tensor list, each tensor's functions,
 * the rules). Everything around the emitted functions is this program's, as the ABI
 * description says: the chunk loop, the fp64 combine of the partials, the rescan of a
 * non-finite partial, the clip coefficient and the scalar stage.
 *
 * It runs AdamW over tensors of several sizes and storages (f32; bf16 with fp32 masters;
 * f32 weights with bf16 gradients): loss-scaled and clipped steps, a new lr between
 * steps (new rules, no recompiling), a step with an inf gradient (must write nothing),
 * a loss scale so large that the fp32 squares overflow (the rescan), and a plain step;
 * and checks the weights, masters and state against a float64 reference. Exit status 1
 * on any mismatch. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepfuse_cpu_abi.h"
#include "emitted_cpu_step.h"

#if EMITTED_NORM_INF
#error "this example runs the L2 norm's reduce functions"
#endif

enum { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum { kGrad = 0, kParam = 1, kState = 2 };

/* ---- Storage: f32 and bf16 (round to nearest even; the example uses no f16) -------- */

static float bf16_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static size_t dtype_size(int dtype) { return dtype == kF32 ? 4 : 2; }
static double load(const void* data, int dtype, long long i) {
  if (dtype == kF32) return ((const float*)data)[i];
  return bf16_to_float(((const uint16_t*)data)[i]);
}
/* Stores v rounded to the dtype; returns the value stored. */
static double store(void* data, int dtype, long long i, double v) {
  if (dtype == kF32) return ((float*)data)[i] = (float)v;
  ((uint16_t*)data)[i] = float_to_bf16((float)v);
  return bf16_to_float(((uint16_t*)data)[i]);
}

static double uniform(unsigned long long* s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return (double)(*s >> 11) * (1.0 / 9007199254740992.0);
}

static void* xcalloc(size_t n, size_t size) {
  void* p = calloc(n + 1, size); /* + 1: no zero-size allocations */
  if (p == NULL) {
    fprintf(stderr, "stepfuse-run-emitted-cpu: out of memory\n");
    exit(1);
  }
  return p;
}

static int scalar_index(const char* name) {
  for (int s = 0; s < EMITTED_NUM_SCALARS; ++s)
    if (strcmp(emitted_scalar_names[s], name) == 0) return s;
  fprintf(stderr, "stepfuse-run-emitted-cpu: the program has no scalar %s\n", name);
  exit(1);
}
static int stream_index(const char* name) {
  for (int s = 0; s < EMITTED_NUM_STREAMS; ++s)
    if (strcmp(emitted_stream_names[s], name) == 0) return s;
  fprintf(stderr, "stepfuse-run-emitted-cpu: the program has no stream %s\n", name);
  exit(1);
}

/* ---- The reduce: chunks, the rescan, the fp64 combine (the ABI's "reduce") ---------- */

static long long num_chunks(long long n) { return (n + SF_CPU_CHUNK_ELEMS - 1) / SF_CPU_CHUNK_ELEMS; }

/* One chunk's partial sum of squares; *found_inf when an element is inf or NaN. */
static double chunk_partial(int t, const void* grad, long long chunk, int* found_inf, int* rescans) {
  const long long begin = chunk * SF_CPU_CHUNK_ELEMS;
  const long long len = emitted_numel[t] - begin < SF_CPU_CHUNK_ELEMS ? emitted_numel[t] - begin : SF_CPU_CHUNK_ELEMS;
  const void* at = (const char*)grad + (size_t)begin * dtype_size(emitted_grad_dtype[t]);
  const float partial = emitted_reduce[t](at, (uint64_t)len);
  if (isfinite(partial)) return partial;
  /* Not finite: an inf/NaN gradient, or squares overflowing fp32. Rescan the chunk. */
  ++*rescans;
  double sum = 0;
  for (long long i = 0; i < len; ++i) {
    const double g = load(at, emitted_grad_dtype[t], i);
    if (!isfinite(g)) {
      *found_inf = 1;
      return INFINITY;
    }
    sum += g * g; /* the overflow case: fp64 (the canonical value differs in the last bits) */
  }
  return sum;
}

/* The norm of the stored (scaled) gradients: chunks may run in any order or on any
 * threads (here: backwards, to show it), the combine runs in the fixed order. */
static double reduce_all(void* const* grads, int* found_inf, int* rescans) {
  double total = 0;
  for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
    const long long chunks = num_chunks(emitted_numel[t]);
    double* partials = xcalloc((size_t)chunks, sizeof(double));
    for (long long c = chunks - 1; c >= 0; --c) partials[c] = chunk_partial(t, grads[t], c, found_inf, rescans);
    double acc = 0; /* chunks of a tensor in order, then tensors in order */
    for (long long c = 0; c < chunks; ++c) acc += partials[c];
    total += acc;
    free(partials);
  }
  return sqrt(total);
}

/* ---- The float64 reference: torch.optim.AdamW ---------------------------------------- */

typedef struct Reference {
  double *p, *m, *v;
} Reference;

static void reference_step(Reference* r, long long n, const double* g, double lr, long long step) {
  const double b1 = EMITTED_BETA1, b2 = EMITTED_BETA2;
  const double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);
  for (long long i = 0; i < n; ++i) {
    r->p[i] *= 1 - lr * EMITTED_WEIGHT_DECAY;
    r->m[i] = b1 * r->m[i] + (1 - b1) * g[i];
    r->v[i] = b2 * r->v[i] + (1 - b2) * g[i] * g[i];
    r->p[i] -= lr / bc1 * r->m[i] / (sqrt(r->v[i]) / sqrt(bc2) + EMITTED_EPS);
  }
}

static int close_to(double x, double ref, double rel, double abs_tol) { return fabs(x - ref) <= rel * fabs(ref) + abs_tol; }

int main(void) {
  printf("stepfuse-run-emitted-cpu: program '%s' for CPU %s, %d tensors:", emitted_program_name, emitted_cpu,
         EMITTED_NUM_TENSORS);
  for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
    if (emitted_weight_dtype[t] == kF16 || emitted_grad_dtype[t] == kF16) {
      fprintf(stderr, "\nstepfuse-run-emitted-cpu: f16 storage is not handled by this example\n");
      return 1;
    }
    printf(" %lld", emitted_numel[t]);
  }
  printf("\n");
  const int exp_avg = stream_index("exp_avg"), exp_avg_sq = stream_index("exp_avg_sq");
  const int step_size = scalar_index("step_size"), decay = scalar_index("decay");

  /* The caller's buffers and the state the ABI lists; the args of every tensor. */
  unsigned long long seed = 2024;
  void* weight[EMITTED_NUM_TENSORS];
  void* grad[EMITTED_NUM_TENSORS];
  float* master[EMITTED_NUM_TENSORS];
  float* state[EMITTED_NUM_TENSORS][EMITTED_NUM_STREAMS];
  double* g_ref[EMITTED_NUM_TENSORS];
  Reference ref[EMITTED_NUM_TENSORS];
  float scalars[SF_CPU_MAX_SCALARS];
  sf_cpu_update_args args[EMITTED_NUM_TENSORS];
  for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
    const long long n = emitted_numel[t];
    weight[t] = xcalloc((size_t)n, dtype_size(emitted_weight_dtype[t]));
    grad[t] = xcalloc((size_t)n, dtype_size(emitted_grad_dtype[t]));
    master[t] = emitted_master[t] ? xcalloc((size_t)n, sizeof(float)) : NULL;
    g_ref[t] = xcalloc((size_t)n, sizeof(double));
    ref[t].p = xcalloc((size_t)n, sizeof(double));
    ref[t].m = xcalloc((size_t)n, sizeof(double));
    ref[t].v = xcalloc((size_t)n, sizeof(double));
    for (long long i = 0; i < n; ++i) {
      ref[t].p[i] = store(weight[t], emitted_weight_dtype[t], i, uniform(&seed) * 2 - 1);
      if (master[t] != NULL) master[t][i] = (float)ref[t].p[i]; /* the weights widened */
    }
    memset(&args[t], 0, sizeof args[t]);
    args[t].grad = grad[t];
    args[t].weight = weight[t];
    args[t].master = master[t];
    args[t].scalars = scalars;
    for (int s = 0; s < EMITTED_NUM_STREAMS; ++s) {
      state[t][s] = NULL;
      if (emitted_stream_role[s] != kState) continue;
      state[t][s] = xcalloc((size_t)n, sizeof(float));
      for (long long i = 0; i < n; ++i) state[t][s][i] = emitted_stream_init[s];
      args[t].state[s] = state[t][s];
    }
  }
  sf_scalar_rule rules[EMITTED_NUM_SCALARS];
  memcpy(rules, emitted_rules, sizeof rules);
  const double max_grad_norm = 1.0;
  double lr = EMITTED_LR;
  long long steps_applied = 0;
  int failures = 0;

  for (int it = 1; it <= 6; ++it) {
    /* Step 3: a new lr -- new rules for the next scalar stage, nothing recompiled.
     * Step 4: an inf gradient. Step 5: S = 2^70, the squares overflow fp32. Step 6: a
     * plain step (no loss scale, no clipping: no reduce). */
    if (it == 3) {
      lr = 5e-4;
      rules[step_size].a = lr;
      rules[decay].a = 1 - lr * EMITTED_WEIGHT_DECAY;
    }
    const int plain = it == 6, poison = it == 4;
    const double S = it == 5 ? ldexp(1.0, 70) : plain ? 1.0 : 1024.0;
    const double amplitude = it % 2 ? 0.02 : 0.004; /* odd steps clip (norm above max_grad_norm) */
    double ref_sumsq = 0;
    for (int t = 0; t < EMITTED_NUM_TENSORS; ++t)
      for (long long i = 0; i < emitted_numel[t]; ++i) {
        const double stored = store(grad[t], emitted_grad_dtype[t], i, (uniform(&seed) - 0.5) * amplitude * S);
        g_ref[t][i] = stored / S; /* the unscaled gradient the reference sees */
        ref_sumsq += g_ref[t][i] * g_ref[t][i];
      }
    if (poison) store(grad[1], emitted_grad_dtype[1], 7, INFINITY);

    /* Reduce and scalar stage: the norm, the clip coefficient, gscale, the scalars. */
    int found_inf = 0, rescans = 0;
    double norm = NAN, clip = 1.0;
    if (!plain) {
      norm = reduce_all(grad, &found_inf, &rescans) / S;
      if (!found_inf) clip = fmin(1.0, max_grad_norm / (norm + 1e-6));
    }
    const double ref_norm = sqrt(ref_sumsq);
    int bad = 0;
    if (!found_inf) {
      const double gscale = clip / S;
      for (int k = 0; k < EMITTED_NUM_SCALARS; ++k) scalars[k] = (float)sf_eval_rule(&rules[k], steps_applied + 1, gscale);
      /* Update: every tensor chunk by chunk (any split, any order, any thread). */
      for (int t = 0; t < EMITTED_NUM_TENSORS; ++t)
        for (long long c = 0; c < num_chunks(emitted_numel[t]); ++c) {
          const long long begin = c * SF_CPU_CHUNK_ELEMS, rest = emitted_numel[t] - begin;
          emitted_update[t](&args[t], (uint64_t)begin, (uint64_t)(rest < SF_CPU_CHUNK_ELEMS ? rest : SF_CPU_CHUNK_ELEMS));
        }
      ++steps_applied;
      const double ref_clip = plain ? 1.0 : fmin(1.0, max_grad_norm / (ref_norm + 1e-6));
      for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
        for (long long i = 0; i < emitted_numel[t]; ++i) g_ref[t][i] *= ref_clip;
        reference_step(&ref[t], emitted_numel[t], g_ref[t], lr, steps_applied);
      }
      bad += !plain && !close_to(norm, ref_norm, 1e-5, 0);
    }
    bad += found_inf != poison || (it == 5) != (rescans > 0 && !found_inf); /* step 5 overflows fp32 */

    /* Every element against the reference (unchanged after the skipped step). */
    long long checked = 0;
    for (int t = 0; t < EMITTED_NUM_TENSORS; ++t)
      for (long long i = 0; i < emitted_numel[t]; ++i, ++checked) {
        const double w = load(weight[t], emitted_weight_dtype[t], i);
        if (master[t] != NULL) {
          bad += !close_to(master[t][i], ref[t].p[i], 2e-6, 1e-8);
          bad += w != (double)bf16_to_float(float_to_bf16(master[t][i])); /* the master, rounded */
        } else {
          bad += !close_to(w, ref[t].p[i], 2e-6, 1e-8);
        }
        bad += !close_to(state[t][exp_avg][i], ref[t].m[i], 1e-5, 1e-9);
        bad += !close_to(state[t][exp_avg_sq][i], ref[t].v[i], 1e-5, 1e-15);
      }
    printf("step %d: loss scale 2^%d, %s, found_inf %d, %d chunks rescanned, grad norm %.7g (float64: %.7g), clip %.4f, "
           "steps applied %lld, %lld elements checked, %d mismatches\n",
           it, (int)log2(S), plain ? "plain" : "reduce", found_inf, rescans, norm, plain ? NAN : ref_norm, clip,
           steps_applied, checked, bad);
    failures += bad != 0;
  }

  for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
    free(weight[t]), free(grad[t]), free(master[t]), free(g_ref[t]);
    free(ref[t].p), free(ref[t].m), free(ref[t].v);
    for (int s = 0; s < EMITTED_NUM_STREAMS; ++s) free(state[t][s]);
  }
  printf("%s\n", failures ? "FAILED" : "the emitted CPU step agrees with the float64 reference");
  return failures ? 1 : 0;
}
