/* Stochastic rounding of bf16 weights (and of their bf16 state), written once: the random bits of an
 * element and the rounding that uses them. Counter-based, so every backend (the
 * Highway kernels, the LLVM-compiled code, the generated CUDA kernels, the
 * unfused baseline) computes bitwise the same weights for the same step, on any
 * thread count, ISA or device, and a run is reproducible from its seed.
 *
 * The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as
 * easy as 1, 2, 3", SC 2011; the generator of cuRAND, PyTorch and JAX), keyed
 * by the optimizer's seed. One call gives 128 bits: 16 for each of 8 consecutive
 * elements. Model element e (its index in the concatenation of every param in
 * order; for a sharded optimizer, the whole model's) at step t of its param
 * group (the t the scalar rules see, 1-based) takes the 16 bits
 *     half (e & 1) of word ((e >> 1) & 3) of
 *     philox4x32_10(counter = {lo(e >> 3), hi(e >> 3), lo(t), hi(t)}, key = {lo(seed), hi(seed)})
 * (half 0 the low 16 bits), which on a little-endian machine is the words stored
 * in order and read as 16-bit values. Rounding x (fp32) to bf16 adds those 16
 * bits to x's bits and keeps the upper half: x rounds away from zero with
 * probability (the dropped fraction of an ulp), which makes the rounding
 * unbiased. NaN stays a quiet NaN and inf stays inf; a finite x whose rounding
 * carries past the largest bf16 becomes inf, as the next value up.
 *
 * Embedded verbatim into the generated CUDA source. C and C++ and CUDA; no
 * includes. Changing anything here changes results: bump the CUDA and LLVM
 * emitters' versions. */
#ifndef STEPFUSE_JIT_STOCHASTIC_ROUND_H_
#define STEPFUSE_JIT_STOCHASTIC_ROUND_H_

#ifndef SF_HD
#define SF_HD
#endif

/* Philox4x32's constants: the round multipliers and the key schedule's Weyl increments. */
#define SF_PHILOX_M0 0xD2511F53u
#define SF_PHILOX_M1 0xCD9E8D57u
#define SF_PHILOX_W0 0x9E3779B9u
#define SF_PHILOX_W1 0xBB67AE85u

/* Philox4x32-10 of counter c under key k, into out. */
SF_HD static inline void sf_philox4x32_10(const unsigned c_in[4], const unsigned k_in[2], unsigned out[4]) {
  unsigned c0 = c_in[0], c1 = c_in[1], c2 = c_in[2], c3 = c_in[3];
  unsigned k0 = k_in[0], k1 = k_in[1];
  for (int r = 0; r < 10; ++r) {
    const unsigned long long p0 = (unsigned long long)SF_PHILOX_M0 * c0;
    const unsigned long long p1 = (unsigned long long)SF_PHILOX_M1 * c2;
    const unsigned hi0 = (unsigned)(p0 >> 32), lo0 = (unsigned)p0;
    const unsigned hi1 = (unsigned)(p1 >> 32), lo1 = (unsigned)p1;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += SF_PHILOX_W0;
    k1 += SF_PHILOX_W1;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* The 16 random bits (0 .. 65535) of model element `index` at step `step` under `seed`. */
SF_HD static inline unsigned sf_sr_bits(unsigned long long seed, unsigned long long step, unsigned long long index) {
  const unsigned long long block = index >> 3;
  const unsigned c[4] = {(unsigned)block, (unsigned)(block >> 32), (unsigned)step, (unsigned)(step >> 32)};
  const unsigned k[2] = {(unsigned)seed, (unsigned)(seed >> 32)};
  unsigned out[4];
  sf_philox4x32_10(c, k, out);
  const unsigned word = out[(index >> 1) & 3];
  return (index & 1) ? word >> 16 : word & 0xFFFFu;
}

/* Stored state streams rounded stochastically (bf16 state of a tensor whose bf16
 * weights round stochastically) take their bits from the same generator with the
 * counter's step word marked by the stream: program stream k uses step
 * sf_sr_state_step(step, k), whose top byte is k + 1 (the weights' is 0), so every
 * stream has bits of its own. Steps stay below 2^56. */
SF_HD static inline unsigned long long sf_sr_state_step(unsigned long long step, int stream) {
  return step | ((unsigned long long)(stream + 1) << 56);
}

/* The random bits of model elements index .. index + 3 into r: one Philox call, or
 * two when they straddle two 8-element blocks (the GPU's 4-element stores). */
SF_HD static inline void sf_sr_bits4(unsigned long long seed, unsigned long long step, unsigned long long index,
                                     unsigned r[4]) {
  const unsigned k[2] = {(unsigned)seed, (unsigned)(seed >> 32)};
  unsigned out[4];
  unsigned long long block = ~0ull;
  for (int j = 0; j < 4; ++j) {
    const unsigned long long e = index + (unsigned long long)j;
    if ((e >> 3) != block) {
      block = e >> 3;
      const unsigned c[4] = {(unsigned)block, (unsigned)(block >> 32), (unsigned)step, (unsigned)(step >> 32)};
      sf_philox4x32_10(c, k, out);
    }
    const unsigned word = out[(e >> 1) & 3];
    r[j] = (e & 1) ? word >> 16 : word & 0xFFFFu;
  }
}

/* The bf16 bits of fp32 x rounded stochastically with 16 random bits r. */
SF_HD static inline unsigned short sf_bf16_round_stochastic(float x, unsigned r) {
  union {
    float f;
    unsigned u;
  } v;
  v.f = x;
  if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((v.u >> 16) | 0x40u); /* NaN: quiet */
  /* inf + r stays inf: the carry never leaves the dropped half */
  return (unsigned short)((v.u + r) >> 16);
}

#endif /* STEPFUSE_JIT_STOCHASTIC_ROUND_H_ */
