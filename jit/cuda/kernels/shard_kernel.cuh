/* The sharded step on the device (OptimizerOptions::communicator), in the reduce
 * module of a sharded spec. sf_reduce_shard runs the reduce pass, and its last
 * block writes this rank's values for the step's one collective; the host then
 * enqueues the all_gather of every rank's values on the stream; sf_shard_finalize
 * combines them in the model's canonical order and runs the scalar stage.
 *
 * The numerics are the CPU's (runtime/shard.cpp): a whole model tensor sends its
 * own combine of its chunks (the additions one process makes), a slice of a split
 * tensor one value per chunk; then each model tensor's values are combined in
 * order in fp64 from 0.0, and the tensors' sums in tensor order, so every rank's
 * norm is bitwise the one-process norm. Filled in by the emitter: {PARTIAL_VALUE}
 * (a partial p's norm value), {COMBINE} (acc with x: + for L2, max for inf). */
SF_DEV SF_INLINE double sf_shard_combine(double acc, double x) { return {COMBINE}; }

/* The last block of sf_reduce_shard: this rank's values, found_inf and refused = 0. */
SF_DEV void sf_shard_pack(const sf_tensor* SF_RESTRICT tensors, int num_tensors, int num_chunks, const sf_partial* partials,
                          const sf_shard* shard, sf_step_state* st) {
  __shared__ int any_bad;
  if (threadIdx.x == 0) any_bad = 0;
  __syncthreads();
  int bad = 0;
  for (int c = threadIdx.x; c < num_chunks; c += blockDim.x)
    bad |= ((const volatile sf_partial*)&partials[c])->nonfinite;  /* (volatile: written by other blocks) */
  if (bad) atomicOr(&any_bad, 1);
  for (int t = threadIdx.x; t < num_tensors; t += blockDim.x) {
    const long long first = tensors[t].first_chunk;
    const int n = tensors[t].num_chunks;
    double* out = shard->send + shard->send_at[t];
    double acc = 0.0;
    for (int k = 0; k < n; ++k) {
      const volatile sf_partial* p = (const volatile sf_partial*)&partials[first + k];
      const double v = {PARTIAL_VALUE};
      if (shard->send_whole[t])
        acc = sf_shard_combine(acc, v);
      else
        out[k] = v;
    }
    if (shard->send_whole[t]) out[0] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    shard->send[shard->stride - 2] = any_bad ? 1.0 : 0.0;
    shard->send[shard->stride - 1] = 0.0;  /* refused: set only by a rank that refuses its step */
    st->blocks_done = 0u;
  }
}

/* The reduce pass of a sharded step: sf_reduce's blocks; the last one packs. */
extern "C" __global__ void __launch_bounds__(32 * SF_REDUCE_WARPS)
sf_reduce_shard(const sf_tensor* SF_RESTRICT tensors, int num_tensors, const sf_span* SF_RESTRICT chunks, int num_chunks,
                sf_partial* partials, sf_step_state* st, const sf_shard shard) {
  if (!sf_reduce_blocks(tensors, chunks, num_chunks, partials, st)) return;
  sf_shard_pack(tensors, num_tensors, num_chunks, partials, &shard, st);
}

/* After the all_gather: the model's norm and found_inf, every rank alike; one block of
 * SF_SHARD_THREADS. tensor_sums[i]: local tensor i's model tensor's combine (its
 * norm's square for L2). A rank that refused its step: nothing is applied (the host
 * raises the Error when it reads the result), the scaler is not touched. */
extern "C" __global__ void __launch_bounds__(SF_SHARD_THREADS)
sf_shard_finalize(const sf_shard shard, double* tensor_sums, int num_tensors, sf_step_state* st, const sf_hyper hyper,
                  const float* scale_ptr, double scale_value, int check_finite, sf_scaler_state* scaler) {
  __shared__ int refused, any_bad;
  if (threadIdx.x == 0) {
    refused = -1;
    any_bad = 0;
    for (int r = 0; r < shard.ranks; ++r) {
      const double* flags = shard.recv + (long long)r * shard.stride + shard.stride - 2;
      if (flags[0] != 0.0) any_bad = 1;
      if (flags[1] != 0.0 && refused < 0) refused = r;
    }
  }
  for (int t = threadIdx.x; t < shard.num_model_tensors; t += blockDim.x) {
    double acc = 0.0;
    for (long long k = shard.tensor_begin[t]; k < shard.tensor_begin[t + 1]; ++k)
      acc = sf_shard_combine(acc, shard.recv[shard.order[k]]);
    shard.model_sums[t] = acc;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_tensors; i += blockDim.x) tensor_sums[i] = shard.model_sums[shard.local_tensor[i]];
  if (threadIdx.x != 0) return;
  *shard.refused = refused;
  if (refused >= 0) {
    st->applied = 0;
    st->found_inf = 0;
    return;
  }
  double total = 0.0;
  for (int t = 0; t < shard.num_model_tensors; ++t) total = sf_shard_combine(total, shard.model_sums[t]);
  const double scale = scale_ptr ? (double)*(const volatile float*)scale_ptr : scale_value;
  sf_finish({NORM_OF_TOTAL}, any_bad, st, &hyper, scale, check_finite, scaler);
}
