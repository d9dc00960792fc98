/* The update pass (sf_update). {NUM_SCALARS}: the program's scalars; {DISPATCH}:
 * the call of the block's span function (by combination, or one flat range);
 * {EXTRA_PARAMS}: a two-phase program's (phase 2) table of the tensors' norms. When some
 * combination stores q8 state, its maps are copied to shared memory (q8s) before the barrier. */
/* With plain = 0 it follows a reduce: it returns at once when
 * that step was skipped and reads the scalars the reduce's finalize wrote. With
 * plain = 1 (no loss scale, no clipping, no norm) it is the whole step: every
 * block evaluates the scalar rules itself and the last block counts the step. */
extern "C" __global__ void __launch_bounds__(SF_UPDATE_THREADS)
sf_update(const sf_tensor* SF_RESTRICT tensors, const sf_span* SF_RESTRICT blocks, long long flat_numel,
          sf_streams streams, sf_step_state* st, const sf_hyper hyper, int plain{EXTRA_PARAMS}) {
  __shared__ float sc[SF_MAX_SCALARS];
  if (!plain && !*(const volatile int*)&st->applied) return;
  /* A plain step's stage: no reduce (norm NaN), S = 1, no clipping. */
  const sf_stage stage = sf_step_stage(0, 0, (double)sf_float(0x7FC00000u), 1.0, 0.0, st->step);
  /* The block's param group (a block spans one tensor; the flat layout has one group). */
  const int g = hyper.num_groups > 1 ? tensors[blocks[blockIdx.x].tensor].group : 0;
  if (threadIdx.x < {NUM_SCALARS})
    sc[threadIdx.x] = plain ? (float)sf_eval_rule(&hyper.groups[g].rules[threadIdx.x],
                                                  stage.step - hyper.groups[g].step_base, stage.gscale)
                            : hyper.scalars[(long long)g * SF_MAX_SCALARS + threadIdx.x];
{Q8_MAPS}
  __syncthreads();
  /* Stochastic rounding's step: the group's step this update applies (the reduce's finalize counted the
     optimizer's already, a plain step counts it at the end), the t its scalars see. */
  const unsigned long long sr_step = (unsigned long long)((plain ? stage.step : st->step) - hyper.groups[g].step_base);
{DISPATCH}
  if (plain) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(&st->update_blocks_done, 1u) == gridDim.x - 1) {
        st->update_blocks_done = 0u;
        st->step = stage.step;
        st->applied = stage.applied;
        st->found_inf = 0;
        st->loss_scale = 1.0;
        st->grad_norm = stage.grad_norm;
        st->clip_coef = stage.clip_coef;
        st->gscale = stage.gscale;
      }
    }
  }
}
