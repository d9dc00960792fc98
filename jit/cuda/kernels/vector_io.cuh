/* 4-element vector loads and stores of each storage format (CUDA only): the update
 * kernel's 16-byte (f32) and 8-byte (f16, bf16) accesses. */
SF_DEV SF_INLINE void sf_load4_f32(const void* p, long long i, float* v) {
  const float4 q = *(const float4*)((const float*)p + i);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
SF_DEV SF_INLINE void sf_load4_f16(const void* p, long long i, float* v) {
  const uint2 q = *(const uint2*)((const sf_u16*)p + i);
  v[0] = sf_widen_f16((sf_u16)(q.x & 0xFFFFu)); v[1] = sf_widen_f16((sf_u16)(q.x >> 16));
  v[2] = sf_widen_f16((sf_u16)(q.y & 0xFFFFu)); v[3] = sf_widen_f16((sf_u16)(q.y >> 16));
}
SF_DEV SF_INLINE void sf_load4_bf16(const void* p, long long i, float* v) {
  const uint2 q = *(const uint2*)((const sf_u16*)p + i);
  v[0] = sf_widen_bf16((sf_u16)(q.x & 0xFFFFu)); v[1] = sf_widen_bf16((sf_u16)(q.x >> 16));
  v[2] = sf_widen_bf16((sf_u16)(q.y & 0xFFFFu)); v[3] = sf_widen_bf16((sf_u16)(q.y >> 16));
}
SF_DEV SF_INLINE void sf_store4_f32(void* p, long long i, const float* v) {
  *(float4*)((float*)p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
SF_DEV SF_INLINE void sf_store4_f16(void* p, long long i, const float* v) {
  *(uint2*)((sf_u16*)p + i) = make_uint2((unsigned)sf_narrow_f16(v[0]) | ((unsigned)sf_narrow_f16(v[1]) << 16),
                                         (unsigned)sf_narrow_f16(v[2]) | ((unsigned)sf_narrow_f16(v[3]) << 16));
}
SF_DEV SF_INLINE void sf_store4_bf16(void* p, long long i, const float* v) {
  *(uint2*)((sf_u16*)p + i) = make_uint2((unsigned)sf_narrow_bf16(v[0]) | ((unsigned)sf_narrow_bf16(v[1]) << 16),
                                         (unsigned)sf_narrow_bf16(v[2]) | ((unsigned)sf_narrow_bf16(v[3]) << 16));
}

/* bf16 weights rounded stochastically (jit/stochastic_round.h): element i is model element `index`. */
SF_DEV SF_INLINE void sf_store_bf16_sr(void* p, long long i, float v, unsigned long long index, unsigned long long seed,
                                       unsigned long long step) {
  ((sf_u16*)p)[i] = sf_bf16_round_stochastic(v, sf_sr_bits(seed, step, index));
}
SF_DEV SF_INLINE void sf_store4_bf16_sr(void* p, long long i, const float* v, unsigned long long index,
                                        unsigned long long seed, unsigned long long step) {
  unsigned r[4];
  sf_sr_bits4(seed, step, index, r);  /* one Philox call, two when the 4 straddle 8-element blocks */
  sf_u16 h[4];
  for (int j = 0; j < 4; ++j) h[j] = sf_bf16_round_stochastic(v[j], r[j]);
  *(uint2*)((sf_u16*)p + i) = make_uint2((unsigned)h[0] | ((unsigned)h[1] << 16), (unsigned)h[2] | ((unsigned)h[3] << 16));
}

/* Compensated bf16 weights (docs/low-precision.md; runtime/cpu/convert-inl.h LoadCompensated
 * and StoreCompensated): the parameter is the bf16 weight w plus its bf16 compensation c,
 * one fp32 addition; it is stored as the nearest bf16 weight and the nearest bf16 to the
 * rest (exact in fp32), 0 where the rest is not finite. */
SF_DEV SF_INLINE float sf_load_bf16_comp(const void* w, const void* c, long long i) {
  return sf_load_bf16(w, i) + sf_load_bf16(c, i);
}
SF_DEV SF_INLINE void sf_load4_bf16_comp(const void* w, const void* c, long long i, float* v) {
  float lo[4];
  sf_load4_bf16(w, i, v);
  sf_load4_bf16(c, i, lo);
  for (int j = 0; j < 4; ++j) v[j] = v[j] + lo[j];
}
SF_DEV SF_INLINE sf_u16 sf_bf16_rest(float v, sf_u16 hi) {
  const float rest = v - sf_widen_bf16(hi);
  return sf_narrow_bf16(sf_isfinite(rest) ? rest : 0.0f);
}
SF_DEV SF_INLINE void sf_store_bf16_comp(void* w, void* c, long long i, float v) {
  const sf_u16 hi = sf_narrow_bf16(v);
  ((sf_u16*)w)[i] = hi;
  ((sf_u16*)c)[i] = sf_bf16_rest(v, hi);
}
SF_DEV SF_INLINE void sf_store4_bf16_comp(void* w, void* c, long long i, const float* v) {
  sf_u16 hi[4], lo[4];
  for (int j = 0; j < 4; ++j) hi[j] = sf_narrow_bf16(v[j]), lo[j] = sf_bf16_rest(v[j], hi[j]);
  *(uint2*)((sf_u16*)w + i) = make_uint2((unsigned)hi[0] | ((unsigned)hi[1] << 16), (unsigned)hi[2] | ((unsigned)hi[3] << 16));
  *(uint2*)((sf_u16*)c + i) = make_uint2((unsigned)lo[0] | ((unsigned)lo[1] << 16), (unsigned)lo[2] | ((unsigned)lo[3] << 16));
}

#define SF_FULL_MASK 0xFFFFFFFFu

/* q8 state (runtime/cpu/q8.hpp, bit for bit): a map m (sf_hyper.q8_maps + 512 * map, in
 * shared memory) holds its 256 code values at m[0..255] and its 255 thresholds then +inf
 * at m[256..511]. A value is its code's value times its block's absmax (one multiply). */
SF_DEV SF_INLINE float sf_q8_load(const void* codes, long long i, float absmax, const float* m) {
  return m[((const unsigned char*)codes)[i]] * absmax;
}
SF_DEV SF_INLINE void sf_q8_load8(const void* codes, long long i, float absmax, const float* m, float* v) {
  const uint2 c = *(const uint2*)((const unsigned char*)codes + i);
  for (int j = 0; j < 4; ++j) {
    v[j] = m[(c.x >> (8 * j)) & 0xFFu] * absmax;
    v[4 + j] = m[(c.y >> (8 * j)) & 0xFFu] * absmax;
  }
}
/* The code of a normalized value: how many thresholds lie below it (a branchless binary
 * search over the 256 entries; NaN compares false everywhere and takes code 0). */
SF_DEV SF_INLINE unsigned sf_q8_code(float x, const float* thresholds) {
  unsigned k = 0;
  for (unsigned step = 128; step > 0; step >>= 1)
    if (thresholds[k + step - 1] < x) k += step;
  return k;
}
/* inf and NaN are never stored: NaN -> 0, +-inf -> +-FLT_MAX. */
SF_DEV SF_INLINE float sf_q8_sanitize(float x) {
  if (sf_isnan(x)) return 0.0f;
  return sf_isfinite(x) ? x : sf_float((sf_bits(x) & 0x80000000u) | 0x7F7FFFFFu);
}
/* Requantizes one block of SF_Q8_BLOCK elements held by a warp, lane l elements 8l ..
 * 8l + 7 (the first n of them in the tensor, 0 <= n <= 8; i: the lane's first element):
 * the block's absmax is the max |value| over the warp (sanitized values; max is exact in
 * any order), the scale 1 / absmax (at most FLT_MAX, 0 for an all-zero block), each code
 * the count of thresholds below value * scale. Every lane of the warp must call it. */
SF_DEV SF_INLINE void sf_q8_store8(void* codes, float* absmax, long long block, long long i, const float* v, int n,
                                   const float* m) {
  float x[8];
  float a = 0.0f;
  for (int j = 0; j < 8; ++j) {
    x[j] = sf_q8_sanitize(v[j]);
    if (j < n) a = sf_max(a, sf_abs(x[j]));
  }
  for (int o = 16; o > 0; o >>= 1) a = sf_max(a, __shfl_xor_sync(SF_FULL_MASK, a, o));
  __syncwarp(SF_FULL_MASK);  /* every lane has read the old absmax (a shuffle orders no memory) */
  if ((threadIdx.x & 31u) == 0) absmax[block] = a;
  float inv = 0.0f;
  if (a > 0.0f) {
    inv = 1.0f / a;
    if (!(inv < sf_float(0x7F7FFFFFu))) inv = sf_float(0x7F7FFFFFu);
  }
  unsigned c[8];
  for (int j = 0; j < 8; ++j) c[j] = sf_q8_code(x[j] * inv, m + 256);
  unsigned char* out = (unsigned char*)codes + i;
  if (n == 8) {
    *(uint2*)out = make_uint2(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24), c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24));
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < n) out[j] = (unsigned char)c[j];
  }
}
