/* The inf-norm of one chunk by one warp, for grad dtype {G} ({E}, {V} as in
 * reduce_chunk_l2.cuh): a max (NaNs ignored, |x| >= +0) and an or, which no order
 * changes: aligned chunks are read with 16-byte loads, each lane its own. */
SF_DEV sf_partial sf_reduce_chunk_{G}(const void* SF_RESTRICT grad, long long begin, int len, int lane,
                                      uint4* SF_RESTRICT stage) {
  const {E}* SF_RESTRICT g = (const {E}*)grad + begin;
  float m = 0.0f;
  int bad = 0;
  int i = lane;
  if (((unsigned long long)g & 15u) == 0) {
    int base = 0;
    for (; base + SF_REDUCE_VLOADS * 32 * {V} <= len; base += SF_REDUCE_VLOADS * 32 * {V}) {
      uint4 q[SF_REDUCE_VLOADS];
      sf_load_step((const uint4*)g, base / {V}, lane, q);
#pragma unroll
      for (int k = 0; k < SF_REDUCE_VLOADS; ++k) {
#pragma unroll
        for (int j = 0; j < {V}; ++j) {
          const float x = sf_load_{G}(&q[k], j);
          bad |= !sf_isfinite(x);
          m = sf_max(m, sf_abs(x));
        }
      }
    }
    i = base + lane;
  }
  for (; i < len; i += 32) {
    const float x = sf_load_{G}(g, i);
    bad |= !sf_isfinite(x);
    m = sf_max(m, sf_abs(x));
  }
  (void)stage;
  bad = __any_sync(SF_FULL_MASK, bad);
  for (int w = 16; w >= 1; w >>= 1) m = sf_max(m, __shfl_xor_sync(SF_FULL_MASK, m, w));
  sf_partial r;
  r.sumsq = 0.0; r.maxabs = m; r.nonfinite = bad;
  return r;
}
