/* The utility module's kernels that are the same for every dtype: the GradScaler's
 * update on the device, and a constant fill. */
/* GradScaler.update() on the device, sf_amp_update_scale (jit/step_stage.h). The
 * host has checked that the iteration stepped or unscaled something. */
extern "C" __global__ void sf_update_scale(sf_scaler_state* s) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  sf_loss_scale ls;
  ls.scale = s->scale;
  ls.growth_tracker = s->growth_tracker;
  ls = sf_amp_update_scale(ls, s->found_inf, s->growth_factor, s->backoff_factor, s->growth_interval);
  s->scale = ls.scale;
  s->growth_tracker = (int)ls.growth_tracker;
  s->found_inf = 0;
  s->recorded = 0;
}

extern "C" __global__ void sf_fill(float* dst, long long n, float value) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = value;
}
