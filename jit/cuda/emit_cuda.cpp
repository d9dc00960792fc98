// The CUDA emitter: the update program becomes one straight-line element
// function per dtype combination; fixed kernel text around it does the loads,
// stores, the reduce pass and the scalar stage (see device_abi.h).
#include "jit/cuda/emit_cuda.hpp"

#include <bit>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string_view>

#include "jit/cuda/embedded_headers.hpp"

namespace stepfuse::jit {

namespace {

// Bumped whenever the generated code changes meaning (part of every cache key).
constexpr int kEmitterVersion = 3;  // 2: sf_reduce takes the loss scale as a double; 3: vector reduce, tiled finalize

std::string_view dtype_tag(DType t) { return dtype_name(t); }  // f32, f16, bf16

// Replaces every "{KEY}" in `text`.
std::string fill(std::string text, std::initializer_list<std::pair<std::string_view, std::string>> subs) {
  for (const auto& [key, value] : subs) {
    std::string k(1, '{');  // (not "{" + key: g++ 12 warns falsely, -Wrestrict)
    k.append(key).push_back('}');
    for (std::size_t at = text.find(k); at != std::string::npos; at = text.find(k, at + value.size()))
      text.replace(at, k.size(), value);
  }
  return text;
}

std::string float_literal(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "sf_float(0x%08Xu) /* %.9g */", std::bit_cast<std::uint32_t>(x), static_cast<double>(x));
  return buf;
}

std::string v(int id) { return std::string(1, 'v').append(std::to_string(id)); }

// Which streams the program loads and stores.
struct StreamUse {
  bool loads[kMaxStreams] = {};
  bool stores[kMaxStreams] = {};
};
StreamUse stream_use(const Program& p) {
  StreamUse u;
  for (int i = 0; i < p.num_instrs; ++i) {
    if (p.code[i].op == Op::load) u.loads[p.code[i].attr] = true;
    if (p.code[i].op == Op::store) u.stores[p.code[i].attr] = true;
  }
  return u;
}

// The program as one straight-line function on fp32 values in registers.
std::string element_function(const Program& p, const std::string& name) {
  std::ostringstream o;
  o << "/* " << p.name << ": the update program, one element. */\n"
    << "SF_HD SF_INLINE void " << name
    << "(const float* SF_RESTRICT sc, float g, float* SF_RESTRICT p, float* SF_RESTRICT st) {\n";
  for (int i = 0; i < p.num_instrs; ++i) {
    const Instr& in = p.code[i];
    const std::string a = v(in.a), b = v(in.b), c = v(in.c);
    std::string expr;
    switch (in.op) {
      case Op::load: {
        const StreamRole role = p.streams[in.attr].role;
        expr = role == StreamRole::grad ? "g" : role == StreamRole::param ? "*p" : "st[" + std::to_string(in.attr) + "]";
        break;
      }
      case Op::store:
        o << "  " << (p.streams[in.attr].role == StreamRole::param ? std::string("*p") : "st[" + std::to_string(in.attr) + "]")
          << " = " << a << ";  /* " << p.streams[in.attr].name << " */\n";
        continue;
      case Op::constant: expr = float_literal(in.imm); break;
      case Op::scalar: expr = "sc[" + std::to_string(in.attr) + "] /* " + std::string(p.scalars[in.attr]) + " */"; break;
      case Op::add: expr = a + " + " + b; break;
      case Op::sub: expr = a + " - " + b; break;
      case Op::mul: expr = a + " * " + b; break;
      case Op::div: expr = a + " / " + b; break;
      case Op::fma: expr = "SF_FMAF(" + a + ", " + b + ", " + c + ")"; break;
      case Op::neg: expr = "sf_neg(" + a + ")"; break;
      case Op::abs: expr = "sf_abs(" + a + ")"; break;
      case Op::sqrt: expr = "SF_SQRTF(" + a + ")"; break;
      case Op::max: expr = "sf_max(" + a + ", " + b + ")"; break;
      case Op::min: expr = "sf_min(" + a + ", " + b + ")"; break;
      case Op::sign: expr = "sf_sign(" + a + ")"; break;
      case Op::select: expr = "sf_select(" + a + ", " + b + ", " + c + ")"; break;
      case Op::cmp_lt: expr = "sf_lt(" + a + ", " + b + ")"; break;
      case Op::cmp_le: expr = "sf_le(" + a + ", " + b + ")"; break;
      case Op::cmp_eq: expr = "sf_eq(" + a + ", " + b + ")"; break;
      case Op::convert:
        expr = static_cast<DType>(in.attr) == DType::f16    ? "sf_round_f16(" + a + ")"
               : static_cast<DType>(in.attr) == DType::bf16 ? "sf_round_bf16(" + a + ")"
                                                            : a;
        break;
    }
    o << "  const float " << v(i) << " = " << expr << ";\n";
  }
  o << "}\n";
  return o.str();
}

// Kernel-side helpers: 4-element vector loads and stores (CUDA only).
constexpr std::string_view kVectorHelpers = R"(
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

#define SF_FULL_MASK 0xFFFFFFFFu
)";

// The reduce kernel's shape, beyond device_abi.h (not part of the ABI: only the
// kernel reads these). Shared memory per block: 2 KiB of staging slots + 6 KiB of
// finalize tile.
constexpr std::string_view kReduceShape = R"(
#define SF_REDUCE_VLOADS 4 /* 16-byte gradient loads in flight per lane */

/* The finalize's partials go through shared memory SF_FIN_SLOTS x SF_FIN_WINDOW at
 * a time: SF_FIN_SLOTS chains of additions side by side (thread s < SF_FIN_SLOTS runs
 * chain s), each over SF_FIN_WINDOW partials per round. */
#define SF_FIN_SLOTS 8
#define SF_FIN_WINDOW 64
#define SF_FIN_TILE (SF_FIN_SLOTS * SF_FIN_WINDOW)
#define SF_FIN_LOADS (SF_FIN_TILE / (32 * SF_REDUCE_WARPS)) /* per thread per round */
)";

// The reduce of one chunk by one warp, for grad dtype {G}, in the canonical
// order: lane l sums elements l, l+32, ... in sequence, then the fixed tree.
constexpr std::string_view kReduceChunkL2 = R"(
SF_DEV SF_INLINE float sf_lane_tree(float acc) {
  for (int w = 16; w >= 1; w >>= 1) acc = acc + __shfl_down_sync(SF_FULL_MASK, acc, w);
  return __shfl_sync(SF_FULL_MASK, acc, 0);
}
)";

// {G}: the grad dtype; {E}: its storage type (float or sf_u16); {V}: elements per
// 16 bytes. The vector path needs the chunk's first gradient 16-byte aligned
// (chunks begin at multiples of SF_CHUNK_ELEMS, so: the tensor's grad pointer),
// which a tensor view need not be: it is checked here, per chunk (warp-uniform),
// and the scalar loop takes the rest (a tail, or the whole of an unaligned chunk).
constexpr std::string_view kReduceChunkL2G = R"(
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
#pragma unroll
      for (int k = 0; k < SF_REDUCE_VLOADS; ++k) q[k] = *(const uint4*)(g + base + 32 * {V} * k + {V} * lane);
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
)";

// The inf-norm of a chunk: a max (NaNs ignored, |x| >= +0) and an or, which no
// order changes: aligned chunks are read with 16-byte loads, each lane its own.
constexpr std::string_view kReduceChunkInfG = R"(
SF_DEV sf_partial sf_reduce_chunk_{G}(const void* SF_RESTRICT grad, long long begin, int len, int lane,
                                      uint4* SF_RESTRICT stage) {
  const {E}* SF_RESTRICT g = (const {E}*)grad + begin;
  float m = 0.0f;
  int bad = 0;
  int i = lane;
  if (((unsigned long long)g & 15u) == 0) {
    int base = 0;
    for (; base + SF_REDUCE_VLOADS * 32 * {V} <= len; base += SF_REDUCE_VLOADS * 32 * {V}) {
      uint4 q[SF_REDUCE_VLOADS];
#pragma unroll
      for (int k = 0; k < SF_REDUCE_VLOADS; ++k) q[k] = *(const uint4*)(g + base + 32 * {V} * k + {V} * lane);
#pragma unroll
      for (int k = 0; k < SF_REDUCE_VLOADS; ++k) {
#pragma unroll
        for (int j = 0; j < {V}; ++j) {
          const float x = sf_load_{G}(&q[k], j);
          bad |= !sf_isfinite(x);
          m = sf_max(m, sf_abs(x));
        }
      }
    }
    i = base + lane;
  }
  for (; i < len; i += 32) {
    const float x = sf_load_{G}(g, i);
    bad |= !sf_isfinite(x);
    m = sf_max(m, sf_abs(x));
  }
  (void)stage;
  bad = __any_sync(SF_FULL_MASK, bad);
  for (int w = 16; w >= 1; w >>= 1) m = sf_max(m, __shfl_xor_sync(SF_FULL_MASK, m, w));
  sf_partial r;
  r.sumsq = 0.0; r.maxabs = m; r.nonfinite = bad;
  return r;
}
)";

// The reduce kernel and its finalize (the scalar stage), run by the last block.
constexpr std::string_view kReduceKernel = R"(

/* The first chunk at or after chunk x that begins a tensor (num_chunks if none). */
SF_DEV SF_INLINE long long sf_tensor_start_from(const sf_tensor* SF_RESTRICT tensors, const sf_span* SF_RESTRICT chunks,
                                                int num_chunks, long long x) {
  if (x >= num_chunks) return num_chunks;
  const sf_span c = chunks[x];
  if (c.begin == 0) return x;
  return tensors[c.tensor].first_chunk + tensors[c.tensor].num_chunks;
}

/* Loads this thread's entries of round `round` of the finalize tile: the norm value
 * of each partial, and the index of its tensor where it is the tensor's last chunk
 * (else -1). ORs the nonfinite flags into *bad (in any order: an or). */
SF_DEV SF_INLINE void sf_fin_load(const sf_span* SF_RESTRICT chunks, int num_chunks, const sf_partial* partials,
                                  const long long* range, int round, double* value, int* last_of, int* bad) {
#pragma unroll
  for (int j = 0; j < SF_FIN_LOADS; ++j) {
    const int e = j * (32 * SF_REDUCE_WARPS) + (int)threadIdx.x;  /* tile entry: slot e / W, position e % W */
    const int s = e / SF_FIN_WINDOW;
    const long long c = range[s] + (long long)round * SF_FIN_WINDOW + e % SF_FIN_WINDOW;
    value[j] = 0.0;
    last_of[j] = -1;
    if (c < range[s + 1]) {
      /* volatile: written by other blocks of this launch (not through this SM's L1) */
      const volatile sf_partial* p = (const volatile sf_partial*)&partials[c];
      *bad |= p->nonfinite;
      value[j] = {PARTIAL_VALUE};
      if (c + 1 == num_chunks || chunks[c + 1].begin == 0) last_of[j] = chunks[c].tensor;
    }
  }
}

/* Combines the partials in the CPU's order and runs the scalar stage. One block.
 * Invariant (the numerics): each tensor's chunk partials are combined by ONE thread,
 * sequentially in chunk order in fp64, from 0.0; then thread 0 combines the tensors'
 * sums sequentially in tensor order. Only where the values wait changes: the chunk
 * range is cut at tensor starts into SF_FIN_SLOTS ranges of about equal length, one
 * per chain; every round, all threads load the next SF_FIN_WINDOW partials of every
 * range (coalesced) into shared memory, while the chains add the previous round's. */
SF_DEV void sf_finalize(const sf_tensor* SF_RESTRICT tensors, int num_tensors, const sf_span* SF_RESTRICT chunks,
                        int num_chunks, const sf_partial* partials, double* tensor_sums, sf_step_state* st,
                        const sf_hyper* hyper, double scale, int check_finite, sf_scaler_state* scaler) {
  __shared__ double tile[SF_FIN_TILE];
  __shared__ int tile_last_of[SF_FIN_TILE];
  __shared__ long long range[SF_FIN_SLOTS + 1];  /* chain s: chunks [range[s], range[s + 1]) */
  __shared__ int any_bad;
  if (threadIdx.x == 0) any_bad = 0;
  if (threadIdx.x <= SF_FIN_SLOTS)
    range[threadIdx.x] = sf_tensor_start_from(tensors, chunks, num_chunks,
                                              (long long)num_chunks * threadIdx.x / SF_FIN_SLOTS);
  for (int t = threadIdx.x; t < num_tensors; t += blockDim.x)
    if (tensors[t].num_chunks == 0) tensor_sums[t] = 0.0;  /* empty: no chain visits it */
  __syncthreads();
  long long longest = 0;
  for (int s = 0; s < SF_FIN_SLOTS; ++s) longest = range[s + 1] - range[s] > longest ? range[s + 1] - range[s] : longest;
  const int rounds = (int)((longest + SF_FIN_WINDOW - 1) / SF_FIN_WINDOW);
  int bad = 0;
  double value[SF_FIN_LOADS];
  int last_of[SF_FIN_LOADS];
  sf_fin_load(chunks, num_chunks, partials, range, 0, value, last_of, &bad);
  double acc = 0.0;  /* chain threadIdx.x's sum of its current tensor so far */
  for (int round = 0; round < rounds; ++round) {
    __syncthreads();  /* the chains are done with the previous round's tile */
#pragma unroll
    for (int j = 0; j < SF_FIN_LOADS; ++j) {
      tile[j * (32 * SF_REDUCE_WARPS) + threadIdx.x] = value[j];
      tile_last_of[j * (32 * SF_REDUCE_WARPS) + threadIdx.x] = last_of[j];
    }
    __syncthreads();
    if (round + 1 < rounds) sf_fin_load(chunks, num_chunks, partials, range, round + 1, value, last_of, &bad);
    if (threadIdx.x < SF_FIN_SLOTS) {
      const long long left = range[threadIdx.x + 1] - range[threadIdx.x] - (long long)round * SF_FIN_WINDOW;
      const int n = left < SF_FIN_WINDOW ? (int)left : SF_FIN_WINDOW;
      const double* v = &tile[threadIdx.x * SF_FIN_WINDOW];
      const int* last = &tile_last_of[threadIdx.x * SF_FIN_WINDOW];
      for (int i = 0; i < n; ++i) {
        {NORM_COMBINE}
        if (last[i] >= 0) {  /* a chain's range ends with a tensor's last chunk */
          tensor_sums[last[i]] = acc;
          acc = 0.0;
        }
      }
    }
  }
  if (bad) atomicOr(&any_bad, 1);
  __syncthreads();
  /* The total, in tensor order, by thread 0; the tensors' sums staged the same way. */
  double total = 0.0;
  for (int base = 0; base < num_tensors; base += SF_FIN_TILE) {
    if (base > 0) __syncthreads();
    for (int k = threadIdx.x; k < SF_FIN_TILE && base + k < num_tensors; k += blockDim.x)
      tile[k] = ((const volatile double*)tensor_sums)[base + k];
    __syncthreads();
    if (threadIdx.x == 0) {
      const int n = num_tensors - base < SF_FIN_TILE ? num_tensors - base : SF_FIN_TILE;
      for (int k = 0; k < n; ++k) {
        const double x = tile[k];
        {TOTAL_COMBINE}
      }
    }
  }
  if (threadIdx.x != 0) return;
  const double norm = {NORM_OF_TOTAL};
  const int found_inf = any_bad;
  st->found_inf = found_inf;
  st->loss_scale = scale;
  st->blocks_done = 0u;
  if (scaler) {
    if (found_inf) scaler->found_inf = 1;
    scaler->recorded = 1;
  }
  if (found_inf && check_finite) {  /* skipped: nothing is written, the step count stays */
    st->applied = 0;
    st->grad_norm = sf_float(0x7F800000u);
    st->clip_coef = 1.0;
    st->gscale = 0.0;
    return;
  }
  const double grad_norm = norm / scale;
  double clip = 1.0;
  if (hyper->max_grad_norm > 0.0) {  /* torch.nn.utils.clip_grad_norm_ */
    const double c = hyper->max_grad_norm / (grad_norm + 1e-6);
    clip = c < 1.0 ? c : 1.0;
  }
  const double gscale = clip / scale;
  const long long step = st->step + 1;
#pragma unroll 1
  for (int k = 0; k < {NUM_SCALARS}; ++k) st->scalars[k] = (float)sf_eval_rule(&hyper->rules[k], step, gscale);
  st->grad_norm = grad_norm;
  st->clip_coef = clip;
  st->gscale = gscale;
  st->step = step;
  st->applied = 1;
}

/* The reduce pass: one warp per chunk; the last block to finish runs sf_finalize.
 * The loss scale is *scale_ptr when given (a GradScaler's, on the device), else scale_value
 * (a double, as the CPU divides by: Optimizer::step_scaled takes any finite S > 0). */
extern "C" __global__ void __launch_bounds__(32 * SF_REDUCE_WARPS)
sf_reduce(const sf_tensor* SF_RESTRICT tensors, int num_tensors, const sf_span* SF_RESTRICT chunks, int num_chunks,
          sf_partial* partials, double* tensor_sums, sf_step_state* st, const sf_hyper hyper, const float* scale_ptr,
          double scale_value, int check_finite, sf_scaler_state* scaler) {
  __shared__ uint4 stage[SF_REDUCE_WARPS][32];  /* each warp's staging slots (sf_reduce_chunk_*) */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x * SF_REDUCE_WARPS + warp;
  if (c < num_chunks) {
    const sf_span ch = chunks[c];
    const sf_tensor* t = &tensors[ch.tensor];
    sf_partial r;
    switch (t->combo) {
{REDUCE_CASES}
      default: r.sumsq = 0.0; r.maxabs = 0.0f; r.nonfinite = 1; break;
    }
    if (lane == 0) partials[c] = r;
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) is_last = atomicAdd(&st->blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const double scale = scale_ptr ? (double)*(const volatile float*)scale_ptr : scale_value;
  sf_finalize(tensors, num_tensors, chunks, num_chunks, partials, tensor_sums, st, &hyper, scale, check_finite, scaler);
}
)";

// One update block's span of one tensor, for combination {K}.
constexpr std::string_view kUpdateSpan = R"(
SF_DEV SF_INLINE void sf_update_span_{K}(const sf_tensor* SF_RESTRICT t, long long begin, int len,
                                         const sf_streams* SF_RESTRICT ss, const float* SF_RESTRICT sc) {
  const long long so = t->state_offset + begin;
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
      sf_body_{K}(sc, g[j], &p[j], s);
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
)";

constexpr std::string_view kUpdateKernel = R"(
/* The update pass. With plain = 0 it follows a reduce: it returns at once when
 * that step was skipped and reads the scalars the reduce's finalize wrote. With
 * plain = 1 (no loss scale, no clipping, no norm) it is the whole step: every
 * block evaluates the scalar rules itself and the last block counts the step. */
extern "C" __global__ void __launch_bounds__(SF_UPDATE_THREADS)
sf_update(const sf_tensor* SF_RESTRICT tensors, const sf_span* SF_RESTRICT blocks, long long flat_numel,
          sf_streams streams, sf_step_state* st, const sf_hyper hyper, int plain) {
  __shared__ float sc[SF_MAX_SCALARS];
  if (!plain && !*(const volatile int*)&st->applied) return;
  if (threadIdx.x < {NUM_SCALARS})
    sc[threadIdx.x] = plain ? (float)sf_eval_rule(&hyper.rules[threadIdx.x], st->step + 1, 1.0) : st->scalars[threadIdx.x];
  __syncthreads();
{DISPATCH}
  if (plain) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(&st->update_blocks_done, 1u) == gridDim.x - 1) {
        st->update_blocks_done = 0u;
        st->step += 1;
        st->applied = 1;
        st->found_inf = 0;
        st->loss_scale = 1.0;
        st->grad_norm = (double)sf_float(0x7FC00000u);
        st->clip_coef = 1.0;
        st->gscale = 1.0;
      }
    }
  }
}
)";

constexpr std::string_view kScalerKernels = R"(
/* GradScaler.update() on the device: torch._amp_update_scale_ (an fp32 scale,
 * products in double rounded once, growth kept only if finite). The host has
 * checked that the iteration stepped or unscaled something. */
extern "C" __global__ void sf_update_scale(sf_scaler_state* s) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (s->found_inf) {
    s->scale = (float)((double)s->scale * s->backoff_factor);
    s->growth_tracker = 0;
  } else if (s->growth_tracker + 1 >= s->growth_interval) {
    const float grown = (float)((double)s->scale * s->growth_factor);
    if (sf_isfinite(grown)) s->scale = grown;
    s->growth_tracker = 0;
  } else {
    s->growth_tracker += 1;
  }
  s->found_inf = 0;
  s->recorded = 0;
}
)";

// data *= S (reciprocal = 0) or data *= fp32(1 / double(S)) (reciprocal = 1), in place,
// rounded to the storage format; S is *scale (device); any inf/NaN input sets
// *found_inf when it is given (GradScaler.unscale_). Grid-stride.
constexpr std::string_view kScaleKernel = R"(
extern "C" __global__ void sf_scale_{D}(void* data, long long n, const float* scale, int reciprocal, int* found_inf) {
  const float s = reciprocal ? (float)(1.0 / (double)*scale) : *scale;
  int bad = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float x = sf_load_{D}(data, i);
    bad |= !sf_isfinite(x);
    sf_store_{D}(data, i, x * s);
  }
  if (found_inf && bad) *found_inf = 1;  /* every writer writes 1: no race that matters */
}
extern "C" __global__ void sf_widen_{D}(const void* src, float* dst, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = sf_load_{D}(src, i);
}
)";

constexpr std::string_view kFillKernel = R"(
extern "C" __global__ void sf_fill(float* dst, long long n, float value) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = value;
}
)";

// Indents each line; no newline after the last (the template supplies it).
std::string indent(const std::string& lines, int n) {
  std::string pad(static_cast<std::size_t>(n), ' '), out;
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);) out += (out.empty() ? "" : "\n") + pad + line;
  return out;
}

std::string update_span(const Program& prog, const CudaSpec& spec, int k) {
  const CudaCombo& c = spec.combos[static_cast<std::size_t>(k)];
  const StreamUse use = stream_use(prog);
  const std::string G(dtype_tag(c.grad)), W(dtype_tag(c.weight));
  const int gs = prog.grad_stream(), ps = prog.param_stream();
  std::string load4, load1, gather, scatter, store4, store1;
  if (use.loads[gs]) {
    load4 += "sf_load4_" + G + "(t->grad, begin + i, g);\n";
    load1 += "g[j] = sf_load_" + G + "(t->grad, begin + i + j);\n";
  }
  if (use.loads[ps]) {
    load4 += c.master ? "sf_load4_f32(t->master, begin + i, p);\n" : "sf_load4_" + W + "(t->weight, begin + i, p);\n";
    load1 += c.master ? "p[j] = sf_load_f32(t->master, begin + i + j);\n"
                      : "p[j] = sf_load_" + W + "(t->weight, begin + i + j);\n";
  }
  if (c.master) {
    store4 += "sf_store4_f32(t->master, begin + i, p);\n";
    store1 += "sf_store_f32(t->master, begin + i + j, p[j]);\n";
  }
  store4 += "sf_store4_" + W + "(t->weight, begin + i, p);\n";
  store1 += "sf_store_" + W + "(t->weight, begin + i + j, p[j]);\n";
  for (int s = 0; s < prog.num_streams; ++s) {
    if (prog.streams[s].role != StreamRole::state) continue;
    const std::string S = std::to_string(s);
    if (use.loads[s]) {
      load4 += "sf_load4_f32(ss->s[" + S + "], so + i, st[" + S + "]);\n";
      load1 += "st[" + S + "][j] = sf_load_f32(ss->s[" + S + "], so + i + j);\n";
      gather += "s[" + S + "] = st[" + S + "][j];\n";
    }
    if (use.stores[s]) {
      scatter += "st[" + S + "][j] = s[" + S + "];\n";
      store4 += "sf_store4_f32(ss->s[" + S + "], so + i, st[" + S + "]);\n";
      store1 += "sf_store_f32(ss->s[" + S + "], so + i + j, st[" + S + "][j]);\n";
    }
  }
  return fill(std::string(kUpdateSpan), {{"K", std::to_string(k)},
                                         {"VECTOR", spec.aligned16 ? "1" : "0"},
                                         {"LOAD4", indent(load4, 6)},
                                         {"LOAD1", indent(load1, 8)},
                                         {"GATHER", indent(gather, 6)},
                                         {"SCATTER", indent(scatter, 6)},
                                         {"STORE4", indent(store4, 6)},
                                         {"STORE1", indent(store1, 8)}});
}

}  // namespace

std::string canonical_text(const CudaSpec& spec) {
  std::ostringstream o;
  o << "stepfuse cuda emitter " << kEmitterVersion << "\n"
    << "norm " << (spec.norm == CudaNorm::l2 ? "l2" : "inf") << "\n"
    << "flat " << spec.flat << "\naligned16 " << spec.aligned16 << "\n"
    << "combos";
  for (const CudaCombo& c : spec.combos)
    o << " " << dtype_name(c.weight) << "/" << dtype_name(c.grad) << (c.master ? "/master" : "");
  o << "\nscalars " << static_cast<int>(spec.program.num_scalars) << "\nstreams";
  for (int s = 0; s < spec.program.num_streams; ++s)
    o << " " << spec.program.streams[s].name << ":" << static_cast<int>(spec.program.streams[s].role);
  o << "\nprogram\n" << to_string(spec.program);
  return o.str();
}

const std::string& cuda_embedded_headers() {
  static const std::string text = std::string(kEmbeddedDevicePrelude) + "\n" + std::string(kEmbeddedStepScalars) + "\n" +
                                  std::string(kEmbeddedDeviceAbi) + "\n";
  return text;
}

std::string emit_element_functions(const CudaSpec& spec) {
  std::string out = cuda_embedded_headers();
  for (std::size_t k = 0; k < spec.combos.size(); ++k)
    out += element_function(spec.program, "sf_body_" + std::to_string(k));
  return out;
}

namespace {

// The reduce kernel's part of a spec: what it depends on (the grad dtype of
// each combination, the norm, the number of scalars), not the update program.
std::string reduce_part(const CudaSpec& spec) {
  std::string out;
  const bool l2 = spec.norm == CudaNorm::l2;
  out += kReduceShape;
  if (l2) out += kReduceChunkL2;
  bool have_grad[3] = {};
  for (const CudaCombo& c : spec.combos) {
    if (have_grad[static_cast<int>(c.grad)]) continue;
    have_grad[static_cast<int>(c.grad)] = true;
    const bool wide = c.grad == DType::f32;
    out += fill(std::string(l2 ? kReduceChunkL2G : kReduceChunkInfG), {{"G", std::string(dtype_tag(c.grad))},
                                                                         {"E", wide ? "float" : "sf_u16"},
                                                                         {"V", wide ? "4" : "8"}});
  }
  // One case per grad dtype (the combinations sharing it fall through), so each
  // chunk function is inlined once: a 15-combination list compiles ~5x faster.
  std::string reduce_cases;
  for (DType g : {DType::f32, DType::f16, DType::bf16}) {
    if (!have_grad[static_cast<int>(g)]) continue;
    for (std::size_t k = 0; k < spec.combos.size(); ++k)
      if (spec.combos[k].grad == g) reduce_cases += "      case " + std::to_string(k) + ":\n";
    reduce_cases += "        r = sf_reduce_chunk_" + std::string(dtype_tag(g)) + "(t->grad, ch.begin, ch.len, lane, stage[warp]);\n        break;\n";
  }
  if (!reduce_cases.empty()) reduce_cases.pop_back();
  out += fill(std::string(kReduceKernel),
              {{"PARTIAL_VALUE", l2 ? "p->sumsq" : "(double)p->maxabs"},
               {"NORM_COMBINE", l2 ? "acc = acc + v[i];" : "acc = acc < v[i] ? v[i] : acc;"},
               {"TOTAL_COMBINE", l2 ? "total = total + x;" : "total = total < x ? x : total;"},
               {"NORM_OF_TOTAL", l2 ? "sqrt(total)" : "total"},
               {"NUM_SCALARS", std::to_string(spec.program.num_scalars)},
               {"REDUCE_CASES", reduce_cases}});
  return out;
}

// The update kernel's part: one span function per combination, dispatched on
// the tensor's combo (or one flat range).
std::string update_part(const CudaSpec& spec) {
  const Program& prog = spec.program;
  std::string out;
  for (std::size_t k = 0; k < spec.combos.size(); ++k) out += update_span(prog, spec, static_cast<int>(k));
  std::string dispatch;
  if (spec.flat) {
    dispatch =
        "  const long long begin = (long long)blockIdx.x * SF_UPDATE_ELEMS;\n"
        "  const long long rest = flat_numel - begin;\n"
        "  sf_update_span_0(&tensors[0], begin, rest < SF_UPDATE_ELEMS ? (int)rest : SF_UPDATE_ELEMS, &streams, sc);";
  } else {
    dispatch = "  const sf_span b = blocks[blockIdx.x];\n  const sf_tensor* t = &tensors[b.tensor];\n  switch (t->combo) {\n";
    for (std::size_t k = 0; k < spec.combos.size(); ++k)
      dispatch += "    case " + std::to_string(k) + ": sf_update_span_" + std::to_string(k) +
                  "(t, b.begin, b.len, &streams, sc); break;\n";
    dispatch += "    default: break;\n  }";
  }
  out += fill(std::string(kUpdateKernel), {{"NUM_SCALARS", std::to_string(prog.num_scalars)}, {"DISPATCH", dispatch}});
  return out;
}

std::string header(const std::string& what, const std::string& key) {
  return "/* Generated by stepfuse: " + what + ". Spec:\n" + key + "*/\n";
}

}  // namespace

std::string reduce_canonical_text(const CudaSpec& spec) {
  std::ostringstream o;
  o << "stepfuse cuda emitter " << kEmitterVersion << ", reduce kernel\n"
    << "norm " << (spec.norm == CudaNorm::l2 ? "l2" : "inf") << "\ngrads";
  for (const CudaCombo& c : spec.combos) o << " " << dtype_name(c.grad);
  o << "\nscalars " << static_cast<int>(spec.program.num_scalars) << "\n";
  return o.str();
}

std::string emit_cuda_reduce(const CudaSpec& spec) {
  return header("reduce kernel", reduce_canonical_text(spec)) + cuda_embedded_headers() + std::string(kVectorHelpers) +
         reduce_part(spec);
}

std::string emit_cuda_update(const CudaSpec& spec) {
  return header("update kernel", canonical_text(spec)) + emit_element_functions(spec) + std::string(kVectorHelpers) +
         update_part(spec);
}

std::string emit_cuda(const CudaSpec& spec) {
  return header("step kernels", canonical_text(spec)) + emit_element_functions(spec) + std::string(kVectorHelpers) +
         reduce_part(spec) + update_part(spec);
}

std::string emit_cuda_utilities() {
  std::string out = "/* Generated by stepfuse: utility kernels, emitter version " + std::to_string(kEmitterVersion) + ". */\n";
  out += cuda_embedded_headers();
  out += kScalerKernels;
  for (DType d : {DType::f32, DType::f16, DType::bf16}) out += fill(std::string(kScaleKernel), {{"D", std::string(dtype_tag(d))}});
  out += kFillKernel;
  return out;
}

}  // namespace stepfuse::jit
