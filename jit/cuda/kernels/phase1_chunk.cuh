/* Phase 1 of a two-phase program over one reduce chunk, by one warp, for dtype
 * combination {K}: lane l runs the element function sf_body1 on elements l, l+32,
 * ... of the chunk in increasing order (the reduce pass's canonical lanes,
 * docs/architecture.md §5), stores the state phase 1 stores, and adds the square of
 * each reduced value to its slot's accumulator in acc[] (acc + x * x, two roundings).
 * {LOAD1}, {STORE1}: the combination's accesses of element i; {ACCUMULATE}: the slots;
 * {STATE_BASE}: the state index of element `begin` (packed state: its own). */
SF_DEV SF_INLINE void sf_phase1_chunk_{K}(const sf_tensor* SF_RESTRICT t, long long begin, int len, int lane,
                                          const sf_streams* SF_RESTRICT ss, const float* SF_RESTRICT sc,
                                          float* SF_RESTRICT acc, unsigned long long sr_seed,
                                          unsigned long long sr_step) {
  (void)sr_seed, (void)sr_step;
  const long long so = {STATE_BASE};
  for (int i = lane; i < len; i += 32) {
    float g = 0.0f, p = 0.0f;
    float s[SF_MAX_STREAMS] = {};
    float red[SF_MAX_NORM_SLOTS] = {};
{LOAD1}
    sf_body1(sc, g, &p, s, red);
{STORE1}
{ACCUMULATE}
  }
}
