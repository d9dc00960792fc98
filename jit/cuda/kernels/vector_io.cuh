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
