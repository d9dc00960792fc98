/* One update block's span of one tensor, for a kernel combination that stores some state
 * stream as q8: the span starts on a q8 block boundary (SF_UPDATE_ELEMS is a multiple of
 * SF_Q8_BLOCK), warp w runs its q8 blocks w, w + 8, ..., lane l elements 8l .. 8l + 7 of
 * the block. Loads (q8 streams decoded with their block's absmax), the element function,
 * then each stored q8 stream requantized over the warp (sf_q8_store8), and the other
 * stores; the 8-element accesses (two 4-element ones) when grads and weights are aligned
 * for them (the codes always are). q8s: the maps in shared memory. The emitter fills the
 * holes in braces below (emit_cuda.cpp, update_span). */
SF_DEV SF_INLINE void sf_update_span_{K}(const sf_tensor* SF_RESTRICT t, long long begin, int len,
                                         const sf_streams* SF_RESTRICT ss, const float* SF_RESTRICT sc,
                                         unsigned long long sr_seed, unsigned long long sr_step,
                                         const float* SF_RESTRICT q8s{NORMS_PARAM}) {
  (void)ss;
  const long long so = begin;  /* q8 state is packed: each tensor's from its element 0 */
  const int lane = (int)(threadIdx.x & 31u);
  for (int q = (int)(threadIdx.x >> 5) * SF_Q8_BLOCK; q < len; q += SF_UPDATE_THREADS / 32 * SF_Q8_BLOCK) {
    const int i = q + lane * 8;
    const long long block = (begin + q) / SF_Q8_BLOCK;
    const int rest = len - i;
    const int n = rest < 0 ? 0 : rest < 8 ? rest : 8;
    float g[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float p[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float st[SF_MAX_STREAMS][8] = {};  /* lanes past the tail stay 0 (computed, never stored) */
{ABSMAX}
    if ({VECTOR} && n == 8) {
{LOAD8}
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {  /* (j < n inside a full unroll: the arrays stay in registers) */
        if (j >= n) break;
{LOAD1}
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float s[SF_MAX_STREAMS];
{GATHER}
      {BODY}(sc, g[j], &p[j], s{NORMS_ARG});
{SCATTER}
    }
{ENCODE}
    if ({VECTOR} && n == 8) {
{STORE8}
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j >= n) break;
{STORE1}
      }
    }
  }
}
