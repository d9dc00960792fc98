/* A two-phase program's phase 1 (sf_phase1) and the combine of its sums
 * (sf_phase_combine), launched between the reduce pass and sf_update (which then
 * runs phase 2 with the tensors' norms). {NUM_SCALARS}: the program's scalars;
 * {PHASE1_CASES}: one case per combination; with q8 state, the emitter adds the copy of
 * the maps to shared memory (q8s) for the combinations' chunk functions.
 *   sf_phase1         grid = ceil(num_chunks / SF_REDUCE_WARPS) (at least 1), block
 *                     32 * SF_REDUCE_WARPS: one warp per reduce chunk; writes the chunk's
 *                     canonical fp32 sum of squares of every slot to sums[c * SF_MAX_NORM_SLOTS + r]
 *                     (0 for slots the program does not reduce).
 *   sf_phase_combine  <<<1, SF_COMBINE_THREADS>>>: per tensor (one thread each) and slot, the
 *                     chunk sums in chunk order in fp64 from 0, then
 *                     norms[t * SF_MAX_NORM_SLOTS + r] = (float)sqrt(sum): the CPU's order.
 * Both return at once when the step was skipped (plain = 0 and !applied); with plain = 1
 * phase 1 evaluates the scalar rules itself, as sf_update does. */
#define SF_COMBINE_THREADS 256

extern "C" __global__ void __launch_bounds__(32 * SF_REDUCE_WARPS)
sf_phase1(const sf_tensor* SF_RESTRICT tensors, const sf_span* SF_RESTRICT chunks, int num_chunks, sf_streams streams,
          float* SF_RESTRICT sums, sf_step_state* st, const sf_hyper hyper, int plain) {
  __shared__ float sc_warp[SF_REDUCE_WARPS][SF_MAX_SCALARS];  /* each warp's chunk's group's scalars */
  if (!plain && !*(const volatile int*)&st->applied) return;{Q8_MAPS}
  /* A plain step's stage: no reduce (norm NaN), S = 1, no clipping (as sf_update). */
  const sf_stage stage = sf_step_stage(0, 0, (double)sf_float(0x7FC00000u), 1.0, 0.0, st->step);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x * SF_REDUCE_WARPS + warp;
  if (c >= num_chunks) return;  /* the whole warp */
  const sf_span ch = chunks[c];
  const sf_tensor* t = &tensors[ch.tensor];
  const int g = t->group;
  if (lane < {NUM_SCALARS})
    sc_warp[warp][lane] = plain ? (float)sf_eval_rule(&hyper.groups[g].rules[lane],
                                                      stage.step - hyper.groups[g].step_base, stage.gscale)
                                : hyper.scalars[(long long)g * SF_MAX_SCALARS + lane];
  __syncwarp(SF_FULL_MASK);
  const float* SF_RESTRICT sc = sc_warp[warp];
  /* Stochastic rounding's step (bf16 state of bf16 weights rounded stochastically), as sf_update's. */
  const unsigned long long sr_step = (unsigned long long)((plain ? stage.step : st->step) - hyper.groups[g].step_base);
  float acc[SF_MAX_NORM_SLOTS] = {};
  switch (t->combo) {
{PHASE1_CASES}
    default: break;
  }
  for (int r = 0; r < SF_MAX_NORM_SLOTS; ++r) {
    const float x = sf_lane_tree(acc[r]);
    if (lane == 0) sums[(long long)c * SF_MAX_NORM_SLOTS + r] = x;
  }
}

extern "C" __global__ void __launch_bounds__(SF_COMBINE_THREADS)
sf_phase_combine(const sf_tensor* SF_RESTRICT tensors, int num_tensors, const float* SF_RESTRICT sums,
                 float* SF_RESTRICT norms, const sf_step_state* st, int plain) {
  if (!plain && !*(const volatile int*)&st->applied) return;
  for (int t = threadIdx.x; t < num_tensors; t += blockDim.x) {
    const long long first = tensors[t].first_chunk;
    const int n = tensors[t].num_chunks;
    for (int r = 0; r < SF_MAX_NORM_SLOTS; ++r) {
      double acc = 0.0;
      for (int c = 0; c < n; ++c) acc = acc + (double)sums[(first + c) * SF_MAX_NORM_SLOTS + r];
      norms[(long long)t * SF_MAX_NORM_SLOTS + r] = (float)sqrt(acc);
    }
  }
}
