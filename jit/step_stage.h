/* The step stage, written once: what happens between the reduce pass and the
 * update pass (docs/architecture.md §1), and the loss-scale updates between steps.
 * The CPU engine, GradScaler, LossScaleOptimizer and the generated CUDA kernels
 * all call these functions; the emitted kernel ABI names them. Embedded verbatim
 * into every generated CUDA source after jit/step_scalars.h, so host and device
 * compute bitwise the same values from the same data. Only IEEE-exact double and
 * float operations. C and C++ and CUDA; no includes. The per-step scalars that
 * follow from the stage's step and gscale are jit/step_scalars.h's rules.
 *
 * Changing anything here changes the generated CUDA text: bump the CUDA emitter's
 * version (jit/cuda/emit_cuda.cpp, kEmitterVersion). */
#ifndef STEPFUSE_JIT_STEP_STAGE_H_
#define STEPFUSE_JIT_STEP_STAGE_H_

#ifndef SF_HD
#define SF_HD
#endif

/* What the step stage decided for one step. */
typedef struct sf_stage {
  int applied;      /* 0: skipped (inf/NaN found by a step that checks): nothing is written */
  double grad_norm; /* norm of the unscaled gradients; +inf when skipped; NaN when not computed */
  double clip_coef; /* the clip coefficient (1 without clipping) */
  double gscale;    /* the gradient multiplier of the update: clip_coef / loss_scale */
  long long step;   /* steps applied after this one (the update applies step number `step`) */
} sf_stage;

SF_HD static inline double sf_positive_inf(void) {
  union {
    unsigned long long u;
    double d;
  } x;
  x.u = 0x7FF0000000000000ull;
  return x.d;
}

/* torch.nn.utils.clip_grad_norm_'s coefficient, min(1, max_norm / (norm + 1e-6));
 * 1 when max_grad_norm <= 0 (no clipping) or when the quotient is NaN. */
SF_HD static inline double sf_clip_coef(double max_grad_norm, double grad_norm) {
  if (!(max_grad_norm > 0.0)) return 1.0;
  const double c = max_grad_norm / (grad_norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

/* Whether a loss scale cannot unscale: not > 0, or its fp32 reciprocal overflows (2^-128
 * and below: a GradScaler's scale backed off that far, or to 0). NaN cannot; inf can. */
SF_HD static inline int sf_unscalable(double loss_scale) {
  if (!(loss_scale > 0.0)) return 1;
  const float inv = (float)(1.0 / loss_scale);
  return !(inv - inv == 0.0f);
}

/* The scalar stage of one step.
 *   found_inf     some gradient is inf or NaN (the reduce pass's flag; 0 without one)
 *   check_finite  the step skips on found_inf: a loss-scaled step, or one that clips
 *                 (a plain step without clipping does not check, as in PyTorch)
 *   norm          norm of the gradients as stored (still multiplied by loss_scale);
 *                 NaN when the reduce pass did not run
 *   loss_scale    S > 0, finite (1 for a plain step); a step with check_finite on a scale
 *                 whose fp32 reciprocal overflows is skipped
 *   max_grad_norm the clip threshold, or 0 for no clipping
 *   steps_done    steps applied before this one */
SF_HD static inline sf_stage sf_step_stage(int found_inf, int check_finite, double norm, double loss_scale,
                                           double max_grad_norm, long long steps_done) {
  sf_stage s;
  /* (an unscalable scale would unscale every gradient to inf or NaN: skipped as non-finite) */
  if ((found_inf || sf_unscalable(loss_scale)) && check_finite) {
    s.applied = 0;
    s.grad_norm = sf_positive_inf();
    s.clip_coef = 1.0;
    s.gscale = 0.0;
    s.step = steps_done;
    return s;
  }
  s.applied = 1;
  s.grad_norm = norm / loss_scale;
  s.clip_coef = sf_clip_coef(max_grad_norm, s.grad_norm);
  s.gscale = s.clip_coef / loss_scale; /* unscale and clip in one multiplier */
  s.step = steps_done + 1;
  return s;
}

/* A dynamic loss scale and its count of good steps in a row. */
typedef struct sf_loss_scale {
  float scale;
  long long growth_tracker;
} sf_loss_scale;

/* torch.amp.GradScaler.update() (torch._amp_update_scale_): an fp32 scale; after a
 * step that found inf/NaN, scale * backoff_factor; after growth_interval good steps
 * in a row, scale * growth_factor, kept only if finite; products in double, rounded
 * to fp32 once. */
SF_HD static inline sf_loss_scale sf_amp_update_scale(sf_loss_scale s, int found_inf, double growth_factor,
                                                      double backoff_factor, long long growth_interval) {
  if (found_inf) {
    s.scale = (float)((double)s.scale * backoff_factor);
    s.growth_tracker = 0;
  } else if (s.growth_tracker + 1 >= growth_interval) {
    const float grown = (float)((double)s.scale * growth_factor);
    if (grown - grown == 0.0f) s.scale = grown; /* finite */
    s.growth_tracker = 0;
  } else {
    s.growth_tracker += 1;
  }
  return s;
}

/* Keras's LossScaleOptimizer (dynamic): after a non-finite step the scale halves,
 * not below 1; after growth_steps finite steps in a row it doubles, kept only if
 * finite. */
SF_HD static inline sf_loss_scale sf_keras_update_scale(sf_loss_scale s, int found_inf, long long growth_steps) {
  if (found_inf) {
    const float half = s.scale / 2.0f;
    s.scale = half > 1.0f ? half : 1.0f;
    s.growth_tracker = 0;
  } else if (s.growth_tracker + 1 >= growth_steps) {
    const float grown = s.scale * 2.0f;
    if (grown - grown == 0.0f) s.scale = grown;
    s.growth_tracker = 0;
  } else {
    s.growth_tracker += 1;
  }
  return s;
}

#endif /* STEPFUSE_JIT_STEP_STAGE_H_ */
