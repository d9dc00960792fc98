/* The data the CPU kernels share with their callers: the C struct an update
 * function reads, and the constants of the numerics. Read by the LLVM emitter
 * (field offsets), used by the CPU runtime (cpu::UpdateArgs is this struct) and
 * embedded verbatim into the C header the emit API returns for a CPU target, so
 * the three cannot disagree on a layout. C and C++; no includes (the including
 * side brings <stddef.h>/<stdint.h> or <cstddef>/<cstdint>). */
#ifndef STEPFUSE_JIT_LLVM_CPU_ABI_H_
#define STEPFUSE_JIT_LLVM_CPU_ABI_H_

/* Elements per reduce chunk: part of the numerics (the canonical order). */
#define SF_CPU_CHUNK_ELEMS 16384
/* A chunk's element i goes into accumulator lane i mod SF_CPU_REDUCE_LANES. */
#define SF_CPU_REDUCE_LANES 32
#define SF_CPU_MAX_STREAMS 8
#define SF_CPU_MAX_SCALARS 16
/* Per-tensor reduction slots of a two-phase program (stepfuse::kMaxNormSlots). */
#define SF_CPU_MAX_NORM_SLOTS 4

/* One tensor's base pointers (element 0) and the step's scalars. */
typedef struct sf_cpu_update_args {
  const void* grad;                 /* grad dtype */
  void* weight;                     /* weight dtype: read unless master is set, written */
  float* master;                    /* fp32 master copy, or NULL when the combo has none; compensated
                                       combos: the bf16 compensations (uint16_t bit patterns) */
  float* state[SF_CPU_MAX_STREAMS]; /* by program stream index: state streams' buffers, else NULL */
  const float* scalars;             /* the program's per-step scalars */
  const float* norms;               /* two-phase programs, phase 2: this tensor's norm of each reduction slot
                                       (SF_CPU_MAX_NORM_SLOTS floats); else unused */
  /* Combos with stochastic rounding (bf16 weights without masters; jit/stochastic_round.h): */
  uint64_t sr_seed;                 /* the optimizer's seed (Philox key) */
  uint64_t sr_step;                 /* the step of the tensor's group being applied (1-based), set before each
                                       update pass */
  uint64_t sr_base;                 /* the model index of the tensor's element 0 */
  const uint16_t* sr_bits;          /* per call over elements [begin, begin + n): element i's random bits are
                                       sr_bits[i - begin] (sf_sr_bits of model element sr_base + i); with bf16
                                       state (the `_bs` functions of a one-phase program, unless the spec rounds
                                       that state to nearest: CpuSpec::nearest_state), the j-th bf16 state
                                       stream the update stores (j = 1, 2, ... in stream order) finds its bits at
                                       sr_bits[j * sr_stride + i - begin] (at step sf_sr_state_step(sr_step, k),
                                       k its stream index) */
  uint64_t sr_stride;               /* elements between those streams' bits */
} sf_cpu_update_args;

#endif /* STEPFUSE_JIT_LLVM_CPU_ABI_H_ */
