/* One update block's span of one tensor, for kernel combination {K}: loads, the
 * element function {BODY} of its program (variant), stores. {VECTOR}: 1 when every stream is
 * aligned for 4-element accesses; {LOAD4} ... {STORE1}: the combination's accesses;
 * {NORMS_PARAM}, {NORMS_ARG}: a two-phase program's phase 2 gets the tensor's norms.
 * sr_seed, sr_step: stochastic rounding's key and the applied step (combos with it);
 * {STATE_BASE}: the state index of element `begin` (packed state: its own). */
SF_DEV SF_INLINE void sf_update_span_{K}(const sf_tensor* SF_RESTRICT t, long long begin, int len,
                                         const sf_streams* SF_RESTRICT ss, const float* SF_RESTRICT sc,
                                         unsigned long long sr_seed, unsigned long long sr_step{NORMS_PARAM}) {
  const long long so = {STATE_BASE};  /* the state's index of element begin */
  for (int i = threadIdx.x * 4; i < len; i += SF_UPDATE_THREADS * 4) {
    float g[4] = {0.0f, 0.0f, 0.0f, 0.0f}, p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float st[SF_MAX_STREAMS][4] = {};  /* lanes past a short tail stay 0 (computed, never stored) */
    const int n = len - i < 4 ? len - i : 4;
    if ({VECTOR} && n == 4) {
{LOAD4}
    } else {
      for (int j = 0; j < n; ++j) {
{LOAD1}
      }
    }
    for (int j = 0; j < 4; ++j) {
      float s[SF_MAX_STREAMS];
{GATHER}
      {BODY}(sc, g[j], &p[j], s{NORMS_ARG});
{SCATTER}
    }
    if ({VECTOR} && n == 4) {
{STORE4}
    } else {
      for (int j = 0; j < n; ++j) {
{STORE1}
      }
    }
  }
}
