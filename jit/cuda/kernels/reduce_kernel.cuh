/* The reduce pass (sf_reduce) and its finalize, which combines the partials in the
 * canonical order and runs the step stage (jit/step_stage.h). Filled in by the
 * emitter: {PARTIAL_VALUE}, {NORM_COMBINE}, {TOTAL_COMBINE}, {NORM_OF_TOTAL} (the norm
 * type), {NUM_SCALARS}, {REDUCE_CASES} (one case per grad dtype). */
/* The first chunk at or after chunk x that begins a tensor (num_chunks if none). */
SF_DEV SF_INLINE long long sf_tensor_start_from(const sf_tensor* SF_RESTRICT tensors, const sf_span* SF_RESTRICT chunks,
                                                int num_chunks, long long x) {
  if (x >= num_chunks) return num_chunks;
  const sf_span c = chunks[x];
  if (c.begin == 0) return x;
  return tensors[c.tensor].first_chunk + tensors[c.tensor].num_chunks;
}

/* Loads this thread's entries of round `round` of the finalize tile: the norm value
 * of each partial, and the index of its tensor where it is the tensor's last chunk
 * (else -1). ORs the nonfinite flags into *bad (in any order: an or). */
SF_DEV SF_INLINE void sf_fin_load(const sf_span* SF_RESTRICT chunks, int num_chunks, const sf_partial* partials,
                                  const long long* range, int round, double* value, int* last_of, int* bad) {
#pragma unroll
  for (int j = 0; j < SF_FIN_LOADS; ++j) {
    const int e = j * (32 * SF_REDUCE_WARPS) + (int)threadIdx.x;  /* tile entry: slot e / W, position e % W */
    const int s = e / SF_FIN_WINDOW;
    const long long c = range[s] + (long long)round * SF_FIN_WINDOW + e % SF_FIN_WINDOW;
    value[j] = 0.0;
    last_of[j] = -1;
    if (c < range[s + 1]) {
      /* volatile: written by other blocks of this launch (not through this SM's L1) */
      const volatile sf_partial* p = (const volatile sf_partial*)&partials[c];
      *bad |= p->nonfinite;
      value[j] = {PARTIAL_VALUE};
      if (c + 1 == num_chunks || chunks[c + 1].begin == 0) last_of[j] = chunks[c].tensor;
    }
  }
}

/* The scalar stage, by one thread, from the step's norm (of the gradients as stored)
 * and found_inf: the results in *st, found_inf recorded in the scaler, and when the
 * step is applied every group's scalars and the new step count. */
SF_DEV void sf_finish(double norm, int found_inf, sf_step_state* st, const sf_hyper* hyper, double scale,
                      int check_finite, sf_scaler_state* scaler) {
  st->found_inf = found_inf;
  st->loss_scale = scale;
  if (scaler) {
    if (found_inf) scaler->found_inf = 1;
    scaler->recorded = 1;
  }
  const sf_stage stage = sf_step_stage(found_inf, check_finite, norm, scale, hyper->max_grad_norm, st->step);
  st->grad_norm = stage.grad_norm;
  st->clip_coef = stage.clip_coef;
  st->gscale = stage.gscale;
  st->applied = stage.applied;
  if (!stage.applied) return;  /* skipped: nothing is written, the step count stays */
  for (int g = 0; g < hyper->num_groups; ++g)  /* every group's scalars, at its own step */
    sf_eval_scalars(hyper->groups[g].rules, {NUM_SCALARS}, stage.step - hyper->groups[g].step_base, stage.gscale,
                    hyper->scalars + (long long)g * SF_MAX_SCALARS);
  st->step = stage.step;
}

/* Combines the partials in the CPU's order and runs the scalar stage. One block.
 * Invariant (the numerics): each tensor's chunk partials are combined by ONE thread,
 * sequentially in chunk order in fp64, from 0.0; then thread 0 combines the tensors'
 * sums sequentially in tensor order. Only where the values wait changes: the chunk
 * range is cut at tensor starts into SF_FIN_SLOTS ranges of about equal length, one
 * per chain; every round, all threads load the next SF_FIN_WINDOW partials of every
 * range (coalesced) into shared memory, while the chains add the previous round's. */
SF_DEV void sf_finalize(const sf_tensor* SF_RESTRICT tensors, int num_tensors, const sf_span* SF_RESTRICT chunks,
                        int num_chunks, const sf_partial* partials, double* tensor_sums, sf_step_state* st,
                        const sf_hyper* hyper, double scale, int check_finite, sf_scaler_state* scaler) {
  __shared__ double tile[SF_FIN_TILE];
  __shared__ int tile_last_of[SF_FIN_TILE];
  __shared__ long long range[SF_FIN_SLOTS + 1];  /* chain s: chunks [range[s], range[s + 1]) */
  __shared__ int any_bad;
  if (threadIdx.x == 0) any_bad = 0;
  if (threadIdx.x <= SF_FIN_SLOTS)
    range[threadIdx.x] = sf_tensor_start_from(tensors, chunks, num_chunks,
                                              (long long)num_chunks * threadIdx.x / SF_FIN_SLOTS);
  for (int t = threadIdx.x; t < num_tensors; t += blockDim.x)
    if (tensors[t].num_chunks == 0) tensor_sums[t] = 0.0;  /* empty: no chain visits it */
  __syncthreads();
  long long longest = 0;
  for (int s = 0; s < SF_FIN_SLOTS; ++s) longest = range[s + 1] - range[s] > longest ? range[s + 1] - range[s] : longest;
  const int rounds = (int)((longest + SF_FIN_WINDOW - 1) / SF_FIN_WINDOW);
  int bad = 0;
  double value[SF_FIN_LOADS];
  int last_of[SF_FIN_LOADS];
  sf_fin_load(chunks, num_chunks, partials, range, 0, value, last_of, &bad);
  double acc = 0.0;  /* chain threadIdx.x's sum of its current tensor so far */
  for (int round = 0; round < rounds; ++round) {
    __syncthreads();  /* the chains are done with the previous round's tile */
#pragma unroll
    for (int j = 0; j < SF_FIN_LOADS; ++j) {
      tile[j * (32 * SF_REDUCE_WARPS) + threadIdx.x] = value[j];
      tile_last_of[j * (32 * SF_REDUCE_WARPS) + threadIdx.x] = last_of[j];
    }
    __syncthreads();
    if (round + 1 < rounds) sf_fin_load(chunks, num_chunks, partials, range, round + 1, value, last_of, &bad);
    if (threadIdx.x < SF_FIN_SLOTS) {
      const long long left = range[threadIdx.x + 1] - range[threadIdx.x] - (long long)round * SF_FIN_WINDOW;
      const int n = left < SF_FIN_WINDOW ? (int)left : SF_FIN_WINDOW;
      const double* v = &tile[threadIdx.x * SF_FIN_WINDOW];
      const int* last = &tile_last_of[threadIdx.x * SF_FIN_WINDOW];
      for (int i = 0; i < n; ++i) {
        {NORM_COMBINE}
        if (last[i] >= 0) {  /* a chain's range ends with a tensor's last chunk */
          tensor_sums[last[i]] = acc;
          acc = 0.0;
        }
      }
    }
  }
  if (bad) atomicOr(&any_bad, 1);
  __syncthreads();
  /* The total, in tensor order, by thread 0; the tensors' sums staged the same way. */
  double total = 0.0;
  for (int base = 0; base < num_tensors; base += SF_FIN_TILE) {
    if (base > 0) __syncthreads();
    for (int k = threadIdx.x; k < SF_FIN_TILE && base + k < num_tensors; k += blockDim.x)
      tile[k] = ((const volatile double*)tensor_sums)[base + k];
    __syncthreads();
    if (threadIdx.x == 0) {
      const int n = num_tensors - base < SF_FIN_TILE ? num_tensors - base : SF_FIN_TILE;
      for (int k = 0; k < n; ++k) {
        const double x = tile[k];
        {TOTAL_COMBINE}
      }
    }
  }
  if (threadIdx.x != 0) return;
  st->blocks_done = 0u;
  sf_finish({NORM_OF_TOTAL}, any_bad, st, hyper, scale, check_finite, scaler);
}

/* The reduce pass's blocks: one warp per chunk writes the chunk's partial. Returns 1
 * in the last block to finish (all partials written and visible), else 0. */
SF_DEV SF_INLINE int sf_reduce_blocks(const sf_tensor* SF_RESTRICT tensors, const sf_span* SF_RESTRICT chunks,
                                      int num_chunks, sf_partial* partials, sf_step_state* st) {
  __shared__ uint4 stage[SF_REDUCE_WARPS][32];  /* each warp's staging slots (sf_reduce_chunk_*) */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x * SF_REDUCE_WARPS + warp;
  if (c < num_chunks) {
    const sf_span ch = chunks[c];
    const sf_tensor* t = &tensors[ch.tensor];
    sf_partial r;
    switch (t->combo) {
{REDUCE_CASES}
      default: r.sumsq = 0.0; r.maxabs = 0.0f; r.nonfinite = 1; break;
    }
    if (lane == 0) partials[c] = r;
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) is_last = atomicAdd(&st->blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return 0;
  __threadfence();
  return 1;
}

/* The reduce pass: one warp per chunk; the last block to finish runs sf_finalize.
 * The loss scale is *scale_ptr when given (a GradScaler's, on the device), else scale_value
 * (a double, as the CPU divides by: Optimizer::step_scaled takes any finite S > 0). */
extern "C" __global__ void __launch_bounds__(32 * SF_REDUCE_WARPS)
sf_reduce(const sf_tensor* SF_RESTRICT tensors, int num_tensors, const sf_span* SF_RESTRICT chunks, int num_chunks,
          sf_partial* partials, double* tensor_sums, sf_step_state* st, const sf_hyper hyper, const float* scale_ptr,
          double scale_value, int check_finite, sf_scaler_state* scaler) {
  if (!sf_reduce_blocks(tensors, chunks, num_chunks, partials, st)) return;
  const double scale = scale_ptr ? (double)*(const volatile float*)scale_ptr : scale_value;
  sf_finalize(tensors, num_tensors, chunks, num_chunks, partials, tensor_sums, st, &hyper, scale, check_finite, scaler);
}
