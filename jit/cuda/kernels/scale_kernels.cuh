/* data *= S (reciprocal = 0) or data *= fp32(1 / double(S)) (reciprocal = 1), in
 * place, rounded to the storage format {D}; S is *scale (device); any inf/NaN input
 * sets *found_inf when it is given (GradScaler.unscale_). Grid-stride. And fp32
 * copies of {D} data (master weights). */
extern "C" __global__ void sf_scale_{D}(void* data, long long n, const float* scale, int reciprocal, int* found_inf) {
  const float s = reciprocal ? (float)(1.0 / (double)*scale) : *scale;
  int bad = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float x = sf_load_{D}(data, i);
    bad |= !sf_isfinite(x);
    sf_store_{D}(data, i, x * s);
  }
  if (found_inf && bad) *found_inf = 1;  /* every writer writes 1: no race that matters */
}
extern "C" __global__ void sf_widen_{D}(const void* src, float* dst, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = sf_load_{D}(src, i);
}
