/* The data the generated CUDA kernels share with the host: C structs included
 * by the C++ runtime and embedded verbatim into every generated source, so the
 * two sides cannot disagree on a layout. This is also the ABI a compiler that
 * embeds the kernels launches them with. C and C++ and CUDA; no includes.
 *
 * A step on the device:
 *   sf_reduce   grid = ceil(num_chunks / SF_REDUCE_WARPS) blocks of 32 * SF_REDUCE_WARPS
 *               threads; one warp per chunk of at most SF_CHUNK_ELEMS gradients, summed
 *               in the canonical order (element i into lane i mod 32, a fixed pairwise
 *               tree over the lanes). The last block to finish combines the partials
 *               in chunk order (fp64) and runs the scalar stage: found_inf, the norm,
 *               the clip coefficient, gscale, the program's scalars, the step count.
 *   sf_update   grid = num_update_blocks blocks of SF_UPDATE_THREADS; returns at once
 *               when the step found inf/NaN; else applies the update program.
 * A two-phase program (per-tensor reductions) launches two more kernels between them
 * (jit/cuda/kernels/phase1_kernel.cuh): sf_phase1 (phase 1, one warp per reduce chunk,
 * each slot's canonical chunk sum of squares into a float table, SF_MAX_NORM_SLOTS per
 * chunk) and sf_phase_combine (per tensor, the chunk sums in order in fp64, then the
 * norms, SF_MAX_NORM_SLOTS floats per tensor); its sf_update (phase 2) reads the norms.
 * The utility module (the same for every spec):
 *   sf_update_scale   <<<1, 1>>>: the GradScaler's growth/backoff, on the device.
 *   sf_scale_{f32,f16,bf16}   data *= S or fp32(1/S), S read from the device.
 *   sf_widen_{f32,f16,bf16}   fp32 copies (master weights); sf_fill: constant fill.
 * Nothing in a step is read back by the host: it can be captured in a CUDA graph. */
#ifndef STEPFUSE_JIT_CUDA_DEVICE_ABI_H_
#define STEPFUSE_JIT_CUDA_DEVICE_ABI_H_

#define SF_CHUNK_ELEMS 16384 /* the CPU backend's chunk: part of the numerics */
#define SF_REDUCE_WARPS 4
#define SF_UPDATE_THREADS 256
#define SF_UPDATE_ELEMS 4096 /* elements per update block: SF_UPDATE_THREADS threads x 4 x 4 */
#define SF_MAX_SCALARS 16
#define SF_MAX_STREAMS 8
#define SF_MAX_NORM_SLOTS 4 /* per-tensor reduction slots of a two-phase program */
#define SF_Q8_BLOCK 256      /* q8 state: elements per block, one fp32 absmax each (from element 0 of a tensor) */

/* Where one tensor keeps its state when some tensor of the list stores a state
 * stream as bf16 or q8 (OptimizerOptions::state_format): per program stream (the
 * tensor's combination's), the device address of its element 0's value (f32),
 * bit pattern (bf16) or code (q8), and for q8 its blocks' absmaxes. */
typedef struct sf_tensor_state {
  void* data[SF_MAX_STREAMS];
  float* absmax[SF_MAX_STREAMS];
} sf_tensor_state;

/* One parameter tensor. Pointers are device addresses. */
typedef struct sf_tensor {
  const void* grad;
  void* weight;
  float* master;       /* fp32 master copy, or null; compensated combos: the bf16 compensations */
  long long state_offset; /* element offset of this tensor in every state buffer */
  long long numel;
  long long first_chunk;  /* index of its first reduce chunk; chunks are per tensor, in order */
  int num_chunks;
  int combo;           /* index of its dtype combination in the generated kernel */
  int group;           /* its param group: the index of its rules in sf_hyper.groups */
  int pad_;
  long long model_index; /* its element 0's index in the model: stochastic rounding's counter (jit/stochastic_round.h) */
  const sf_tensor_state* state; /* compressed state (some combo stores bf16 or q8): its state's addresses; else null,
                                   and the state is at state_offset in the buffers of sf_streams */
} sf_tensor;

/* A span of one tensor: a reduce chunk or an update block. */
typedef struct sf_span {
  long long begin; /* element offset within the tensor */
  int tensor;
  int len;
} sf_span;

/* The base of every state buffer, by program stream index (null for the
 * grad and param streams); passed to sf_update by value. */
typedef struct sf_streams {
  float* s[SF_MAX_STREAMS];
} sf_streams;

/* A reduce chunk's partial result. */
typedef struct sf_partial {
  double sumsq;   /* sum of squares of the stored (scaled) gradients, canonical order */
  float maxabs;   /* inf-norm mode */
  int nonfinite;
} sf_partial;

/* A param group's per-step scalar rules (one group when there are no groups). */
typedef struct sf_group_rules {
  sf_scalar_rule rules[SF_MAX_SCALARS]; /* the program's per-step scalars */
  long long step_base;  /* steps applied before the group was added: its step t is sf_step_state.step + 1 - step_base */
} sf_group_rules;

/* The hyperparameters of a step, passed to the kernels by value. The rules and the
 * step's scalars live in device memory that the kernels read at every launch, so a
 * captured CUDA graph replayed after the rules changed (a new lr) uses the new
 * values (PyTorch's capturable=True with a tensor lr), and changing them is a copy
 * into `groups`, no recompilation and no re-capture. */
typedef struct sf_hyper {
  const sf_group_rules* groups; /* num_groups rules, device memory */
  float* scalars;               /* num_groups * SF_MAX_SCALARS floats, device memory: the step's scalars
                                   (the reduce pass's finalize writes them, the update pass reads them) */
  double max_grad_norm;         /* > 0: clip to it; 0: no clipping */
  int num_groups;
  int pad_;
  unsigned long long seed;      /* stochastic rounding of bf16 weights: the Philox key */
  const float* q8_maps;         /* q8 state (combos with it): 4 x 256 floats, device memory: the signed map's code
                                   values, its 255 thresholds and +inf, the unsigned map's values, its thresholds and
                                   +inf (runtime/cpu/q8.hpp); else null */
} sf_hyper;

/* Per-optimizer state on the device, owned by the kernels; the host reads it
 * only when asked (Optimizer::last_result() and friends synchronize). */
typedef struct sf_step_state {
  long long step;       /* steps applied so far */
  unsigned int blocks_done;        /* reduce blocks finished in this step; the last resets it */
  unsigned int update_blocks_done; /* the same for a plain step's update blocks */
  /* the last step's results */
  int found_inf;
  int applied;
  double loss_scale;    /* the loss scale the step divided by */
  double grad_norm;     /* unscaled; +inf when not finite; NaN when not computed */
  double clip_coef;
  double gscale;
} sf_step_state;

/* A GradScaler's state on the device (torch._amp_update_scale_ semantics). */
typedef struct sf_scaler_state {
  float scale;
  int growth_tracker;
  int found_inf;        /* any optimizer stepped this iteration found inf/NaN */
  int recorded;         /* an optimizer was stepped this iteration */
  double growth_factor;
  double backoff_factor;
  int growth_interval;
  int pad_;
} sf_scaler_state;

#endif /* STEPFUSE_JIT_CUDA_DEVICE_ABI_H_ */
