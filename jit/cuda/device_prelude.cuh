/* The element math of the generated CUDA kernels: storage conversions and the
 * update IR's ops, written once with the same IEEE fp32 operations as the CPU
 * backend (runtime/cpu/convert-inl.h, vector_ops-inl.h), so a generated update
 * is bitwise the CPU's. Embedded verbatim at the top of every generated source.
 * It also compiles as plain C++ (no CUDA), which is how the tests check the
 * generated element math on the host. Compiled with --fmad=false (NVRTC) or
 * -ffp-contract=off (host): no multiply-add is fused unless the program says fma. */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SF_HD __host__ __device__
#define SF_DEV __device__
#define SF_INLINE __forceinline__
#define SF_RESTRICT __restrict__
SF_HD SF_INLINE unsigned sf_bits(float f) { return __float_as_uint(f); }
SF_HD SF_INLINE float sf_float(unsigned u) { return __uint_as_float(u); }
#define SF_SQRTF(x) sqrtf(x)
#define SF_FMAF(a, b, c) fmaf(a, b, c)
#else
#define SF_HD
#define SF_DEV
#define SF_INLINE inline
#define SF_RESTRICT __restrict
SF_INLINE unsigned sf_bits(float f) { unsigned u; __builtin_memcpy(&u, &f, 4); return u; }
SF_INLINE float sf_float(unsigned u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
#define SF_SQRTF(x) __builtin_sqrtf(x)
#define SF_FMAF(a, b, c) __builtin_fmaf(a, b, c)
#endif

typedef unsigned short sf_u16;

SF_HD SF_INLINE int sf_isnan(float x) { return (sf_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
SF_HD SF_INLINE int sf_isfinite(float x) { return (sf_bits(x) & 0x7F800000u) != 0x7F800000u; }

/* bf16 -> f32: exact. */
SF_HD SF_INLINE float sf_widen_bf16(sf_u16 h) { return sf_float((unsigned)h << 16); }

/* f16 -> f32: exact for normals, subnormals, infinities and NaNs (rebias by 2^112). */
SF_HD SF_INLINE float sf_widen_f16(sf_u16 h) {
  const unsigned sign = ((unsigned)h & 0x8000u) << 16;
  const unsigned em = (unsigned)h & 0x7FFFu;
  const unsigned shifted = em << 13;
  const float v = em > 0x7BFFu ? sf_float(shifted | 0x7F800000u) : sf_float(shifted) * 0x1.0p112f;
  return sf_float(sf_bits(v) | sign);
}

/* f32 -> bf16, round to nearest even; NaN stays a quiet NaN. */
SF_HD SF_INLINE sf_u16 sf_narrow_bf16(float v) {
  const unsigned u = sf_bits(v);
  if (sf_isnan(v)) return (sf_u16)((u >> 16) | 0x40u);
  return (sf_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* f32 -> f16, round to nearest even by one IEEE addition that aligns the f16
 * mantissa's last bit with the f32's; overflow -> inf, NaN -> 0x7E00. */
SF_HD SF_INLINE sf_u16 sf_narrow_f16(float v) {
  const unsigned w = sf_bits(v);
  float base = (sf_float(w & 0x7FFFFFFFu) * 0x1.0p112f) * 0x1.0p-110f;
  /* Unsigned: for |v| >= 2^114 (inf, NaN) the sum passes 2^31, which in int is UB. */
  const unsigned exp_w = w & 0x7F800000u;
  const unsigned bias = (exp_w > 0x38800000u ? exp_w : 0x38800000u) + 0x07800000u;
  base = sf_float(bias) + base;
  const unsigned bits = sf_bits(base);
  const unsigned nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  const unsigned magnitude = sf_isnan(v) ? 0x7E00u : nonsign;
  return (sf_u16)(magnitude | ((w >> 16) & 0x8000u));
}

/* Exact powers of two and exponents, by bits (the same on every compiler; the
 * CPU's std::ilogb/std::ldexp give the same values for these arguments). */
SF_HD SF_INLINE int sf_ilogb_normal(float x) { return (int)((sf_bits(x) >> 23) & 0xFFu) - 127; } /* x normal */
SF_HD SF_INLINE float sf_exp2f(int k) { /* 2^k, k in [-149, 127] */
  return k >= -126 ? sf_float((unsigned)(k + 127) << 23) : sf_float(1u << (k + 149));
}
SF_HD SF_INLINE double sf_exp2(int k) { /* 2^k, k in [-1022, 1023] */
  const unsigned long long bits = (unsigned long long)(k + 1023) << 52;
  double d;
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
  d = __longlong_as_double((long long)bits);
#else
  __builtin_memcpy(&d, &bits, 8);
#endif
  return d;
}

SF_HD SF_INLINE float sf_round_f16(float v) { return sf_widen_f16(sf_narrow_f16(v)); }
SF_HD SF_INLINE float sf_round_bf16(float v) { return sf_widen_bf16(sf_narrow_bf16(v)); }

/* The IR's ops that are not a single operator (max/min/sign with the CPU's NaN
 * and signed-zero behaviour, select, compares). */
SF_HD SF_INLINE float sf_max(float a, float b) { return a < b ? b : a; }
SF_HD SF_INLINE float sf_min(float a, float b) { return b < a ? b : a; }
SF_HD SF_INLINE float sf_abs(float a) { return sf_float(sf_bits(a) & 0x7FFFFFFFu); }
SF_HD SF_INLINE float sf_neg(float a) { return sf_float(sf_bits(a) ^ 0x80000000u); }
SF_HD SF_INLINE float sf_sign(float a) {
  if (sf_isnan(a)) return a;
  if (a == 0.0f) return 0.0f;
  return sf_float(0x3F800000u | (sf_bits(a) & 0x80000000u));
}
SF_HD SF_INLINE float sf_select(float c, float a, float b) { return c != 0.0f ? a : b; }
SF_HD SF_INLINE float sf_lt(float a, float b) { return a < b ? 1.0f : 0.0f; }
SF_HD SF_INLINE float sf_le(float a, float b) { return a <= b ? 1.0f : 0.0f; }
SF_HD SF_INLINE float sf_eq(float a, float b) { return a == b ? 1.0f : 0.0f; }

/* Loads and stores of one element of a stream stored as f32, f16 or bf16. */
SF_HD SF_INLINE float sf_load_f32(const void* p, long long i) { return ((const float*)p)[i]; }
SF_HD SF_INLINE float sf_load_f16(const void* p, long long i) { return sf_widen_f16(((const sf_u16*)p)[i]); }
SF_HD SF_INLINE float sf_load_bf16(const void* p, long long i) { return sf_widen_bf16(((const sf_u16*)p)[i]); }
SF_HD SF_INLINE void sf_store_f32(void* p, long long i, float v) { ((float*)p)[i] = v; }
SF_HD SF_INLINE void sf_store_f16(void* p, long long i, float v) { ((sf_u16*)p)[i] = sf_narrow_f16(v); }
SF_HD SF_INLINE void sf_store_bf16(void* p, long long i, float v) { ((sf_u16*)p)[i] = sf_narrow_bf16(v); }
