/* Phase 1 of a two-phase program over one reduce chunk, by one warp, for dtype
 * combination {K}, which stores some state stream as q8: the chunk's q8 blocks in order
 * (a chunk starts on a block boundary), lane l running elements l, l + 32, ..., l + 224
 * of each in increasing order, so that each lane meets the chunk's elements in
 * phase1_chunk.cuh's canonical order and adds the same squares to acc[] in the same
 * order. Loads (q8 streams decoded with their block's absmax), the element function
 * sf_body1, the other stores, the slots' squares; then each q8 stream phase 1 stores is
 * requantized over the warp (sf_q8_store_strided). q8s: the maps in shared memory. The
 * emitter fills the holes in braces below (emit_cuda.cpp, phase1_chunk). */
SF_DEV SF_INLINE void sf_phase1_chunk_{K}(const sf_tensor* SF_RESTRICT t, long long begin, int len, int lane,
                                          const sf_streams* SF_RESTRICT ss, const float* SF_RESTRICT sc,
                                          float* SF_RESTRICT acc, unsigned long long sr_seed,
                                          unsigned long long sr_step, const float* SF_RESTRICT q8s) {
  (void)ss, (void)sr_seed, (void)sr_step;
  const long long so = begin;  /* q8 state is packed: each tensor's from its element 0 */
  for (int q = 0; q < len; q += SF_Q8_BLOCK) {
    const long long block = (begin + q) / SF_Q8_BLOCK;
    const int rest = len - q - lane;  /* the lane's elements in the tensor: ceil(rest / 32), at most 8 */
    const int n = rest <= 0 ? 0 : rest >= 8 * 32 ? 8 : (rest + 31) / 32;
    float st[SF_MAX_STREAMS][8] = {};  /* elements past the tail stay 0 (never stored) */
{ABSMAX}
#pragma unroll
    for (int j = 0; j < 8; ++j) {  /* (j < n inside a full unroll: the arrays stay in registers) */
      if (j >= n) break;
      const int i = q + lane + 32 * j;
      float g = 0.0f, p = 0.0f;
      float s[SF_MAX_STREAMS] = {};
      float red[SF_MAX_NORM_SLOTS] = {};
{LOAD1}
      sf_body1(sc, g, &p, s, red);
{STORE1}
{ACCUMULATE}
    }
{ENCODE}
  }
}
