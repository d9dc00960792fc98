/* The sum of squares of one chunk by one warp, for grad dtype {G}, in the canonical
 * order: lane l sums elements l, l+32, ... in sequence, then the fixed tree.
 * {G}: the grad dtype; {E}: its storage type (float or sf_u16); {V}: elements per 16
 * bytes. The vector path needs the chunk's first gradient 16-byte aligned (chunks
 * begin at multiples of SF_CHUNK_ELEMS, so: the tensor's grad pointer), which a
 * tensor view need not be: it is checked here, per chunk (warp-uniform), and the
 * scalar loop takes the rest (a tail, or the whole of an unaligned chunk). */
SF_DEV sf_partial sf_reduce_chunk_{G}(const void* SF_RESTRICT grad, long long begin, int len, int lane,
                                      uint4* SF_RESTRICT stage) {
  const {E}* SF_RESTRICT g = (const {E}*)grad + begin;
  float acc = 0.0f;
  int i = lane;
  if (((unsigned long long)g & 15u) == 0) {
    /* SF_REDUCE_VLOADS 16-byte loads in flight per lane; lane l's load k holds the
     * elements 32*{V}*k + {V}*l ... + {V}-1 of the step. Each 16 bytes go through the
     * warp's 32 staging slots in shared memory, from which lane l reads back elements
     * l, l+32, ..., l+32*({V}-1) of that segment: lane l still adds exactly elements
     * l, l+32, l+64, ... of the chunk, in increasing order, with the same ops. */
    int base = 0;
    for (; base + SF_REDUCE_VLOADS * 32 * {V} <= len; base += SF_REDUCE_VLOADS * 32 * {V}) {
      uint4 q[SF_REDUCE_VLOADS];
      sf_load_step((const uint4*)g, base / {V}, lane, q);
#pragma unroll
      for (int k = 0; k < SF_REDUCE_VLOADS; ++k) {
        __syncwarp(SF_FULL_MASK);  /* every lane has read the previous segment */
        stage[lane] = q[k];
        __syncwarp(SF_FULL_MASK);
#pragma unroll
        for (int r = 0; r < {V}; ++r) { const float x = sf_load_{G}(stage, 32 * r + lane); acc = acc + x * x; }
      }
    }
    i = base + lane;  /* a multiple of 32 plus the lane: the scalar loop continues the order */
  }
  for (; i + 7 * 32 < len; i += 8 * 32) {  /* eight loads in flight, summed in order */
    float x[8];
    for (int k = 0; k < 8; ++k) x[k] = sf_load_{G}(g, i + 32 * k);
    for (int k = 0; k < 8; ++k) acc = acc + x[k] * x[k];
  }
  for (; i < len; i += 32) { const float x = sf_load_{G}(g, i); acc = acc + x * x; }
  acc = sf_lane_tree(acc);
  sf_partial r;
  r.sumsq = (double)acc; r.maxabs = 0.0f; r.nonfinite = 0;
  if (!sf_isfinite(acc)) {  /* rare: an inf/NaN element, or squares overflowing fp32 */
    int bad = 0;
    float m = 0.0f;
    for (i = lane; i < len; i += 32) {
      const float x = sf_load_{G}(g, i);
      bad |= !sf_isfinite(x);
      m = sf_max(m, sf_abs(x));
    }
    bad = __any_sync(SF_FULL_MASK, bad);
    for (int w = 16; w >= 1; w >>= 1) m = sf_max(m, __shfl_xor_sync(SF_FULL_MASK, m, w));
    if (bad) {
      r.nonfinite = 1;
    } else {  /* the same order on values scaled by 2^-e, e just above max |g| (as the CPU) */
      const int e = sf_ilogb_normal(m) + 1;  /* m is normal: squares of it overflowed */
      const float s = sf_exp2f(-e);
      acc = 0.0f;
      for (i = lane; i < len; i += 32) { const float x = sf_load_{G}(g, i) * s; acc = acc + x * x; }
      acc = sf_lane_tree(acc);
      r.sumsq = (double)acc * sf_exp2(2 * e);
    }
  }
  return r;
}
