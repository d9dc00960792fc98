/* Requantizes one q8 block held by a warp as a two-phase program's phase 1 runs it: lane l
 * holds elements l, l + 32, ..., l + 224 of the block (i: the lane's first element; n: how
 * many of them are in the tensor, 0 <= n <= 8). The absmax and the codes are
 * sf_q8_store8's (vector_io.cuh): it requantizes into the lane's 8 bytes, which then go to
 * their strided places. Every lane of the warp must call it. */
SF_DEV SF_INLINE void sf_q8_store_strided(void* codes, float* absmax, long long block, long long i, const float* v,
                                          int n, const float* m) {
  uint2 lane_codes = make_uint2(0u, 0u);
  sf_q8_store8(&lane_codes, absmax, block, 0, v, n, m);
  const unsigned char* c = (const unsigned char*)&lane_codes;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < n) ((unsigned char*)codes)[i + 32 * j] = c[j];
}
