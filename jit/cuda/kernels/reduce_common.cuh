/* The reduce kernel's shape beyond device_abi.h (only the kernel reads these) and
 * the fixed pairwise tree over a warp's 32 lanes. Shared memory per block: 2 KiB of
 * staging slots + 6 KiB of finalize tile. */
#define SF_REDUCE_VLOADS 4 /* 16-byte gradient loads in flight per lane */

/* The finalize's partials go through shared memory SF_FIN_SLOTS x SF_FIN_WINDOW at
 * a time: SF_FIN_SLOTS chains of additions side by side (thread s < SF_FIN_SLOTS runs
 * chain s), each over SF_FIN_WINDOW partials per round. */
#define SF_FIN_SLOTS 8
#define SF_FIN_WINDOW 64
#define SF_FIN_TILE (SF_FIN_SLOTS * SF_FIN_WINDOW)
#define SF_FIN_LOADS (SF_FIN_TILE / (32 * SF_REDUCE_WARPS)) /* per thread per round */

SF_DEV SF_INLINE float sf_lane_tree(float acc) {
  for (int w = 16; w >= 1; w >>= 1) acc = acc + __shfl_down_sync(SF_FULL_MASK, acc, w);
  return __shfl_sync(SF_FULL_MASK, acc, 0);
}

/* One step of a chunk's vector path: lane `lane`'s SF_REDUCE_VLOADS 16-byte loads, load
 * k being the 16-byte word `first + 32 * k + lane` of the chunk (words of an aligned
 * chunk: elements {V} * word ... {V} * word + {V} - 1). */
SF_DEV SF_INLINE void sf_load_step(const uint4* SF_RESTRICT words, int first, int lane, uint4* SF_RESTRICT q) {
#pragma unroll
  for (int k = 0; k < SF_REDUCE_VLOADS; ++k) q[k] = words[first + 32 * k + lane];
}
