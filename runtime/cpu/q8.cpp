// The q8 state codec (runtime/cpu/q8.hpp): bitsandbytes' two dynamic maps, the scalar
// references, and the Highway kernels, bitwise equal to them on every target.
//
// Encoding counts the thresholds below x. The Highway encoder does it with one gather
// per vector instead of a binary search (8 dependent lookups): x's bits, mapped to a
// signed integer key that orders like the floats, are cut into buckets by their top
// bits (sign, exponent and the first few mantissa bits), narrow enough that no bucket
// holds two thresholds. One table entry per bucket holds the number of thresholds
// below the bucket and the low key bits of the threshold inside it, if any: the code
// is that count plus one exact integer compare of the keys.
//
// On AVX-512 the encoder does without the gather, which is slow on some CPUs
// and reads a 12 KB table: a value's segment of the map (one per decade of codes) comes
// from two 32-entry tables held in registers, indexed by its binade, and the count inside
// the segment from a line through the segment's evenly spaced codes; the few values too
// near a threshold for the line to be trusted take the bucket table (Q8Arith says why no
// other value can be off). The decoder there looks the 256 code values up in 16
// registers instead of gathering them; with VBMI (the AVX3_DL target) it decodes 64
// codes at a time by byte-wide table lookups (ByteDecoder). Measured on an AMD EPYC
// (Zen 4) core with bench/bench_low_precision: quantizing 0.42 ns per element with the
// signed map and 0.36 with the unsigned one, dequantizing 0.085 ns (the 16-register
// decoder: 0.23 ns; this encoder's previous form, without the masked operations,
// vreduceps and the folded offset: 0.60 and 0.52 ns).
// Every one of the 2^32 floats encodes as the scalar reference does, through q8_encode
// and through q8_quantize's fast path (checked once, exhaustively, on AVX3 and AVX3_DL;
// the tests check the values nearest every threshold on every target).
//
// A block whose values are all finite (found by an integer max of their magnitude bits,
// which also gives the absmax) takes the fast path: no
// sanitizing, no NaN lanes, no clamping of the buckets. Other blocks take the general one.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/cpu/q8.cpp"
// Compile the AVX3_DL target too (AVX-512 with VBMI's byte permutes: Ice Lake and later,
// AMD Zen 4 and later), which Highway leaves out unless asked: the decoder uses it.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1
#endif
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "runtime/cpu/q8.hpp"

// The maps and the encoder's bucket tables: compiled once, shared by every target.
#ifndef STEPFUSE_CPU_Q8_SHARED_
#define STEPFUSE_CPU_Q8_SHARED_
namespace stepfuse::cpu {
namespace {

// bitsandbytes 0.50.2's create_dynamic_map(signed=True) and (signed=False), copied bit
// for bit rather than recomputed: the map is built with torch.linspace in fp32, whose
// CPU kernel computes start + step * i with an FMA on its AVX2 and AVX-512 paths but
// without one on its scalar path, so even torch's own result depends on the CPU (42
// signed and 31 unsigned values differ by an ulp or two under ATEN_CPU_CAPABILITY=default).
// These are the AVX2 / AVX-512 values, what bitsandbytes computes on x86 CPUs.
alignas(64) constexpr float kSignedCode[256] = {
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f, -0x1.df999ap-1f, -0x1.d86666p-1f, -0x1.d13334p-1f,
    -0x1.cap-1f, -0x1.c2ccccp-1f, -0x1.bb999ap-1f, -0x1.b46666p-1f, -0x1.ad3334p-1f, -0x1.a6p-1f, -0x1.9eccccp-1f,
    -0x1.97999ap-1f, -0x1.906666p-1f, -0x1.893334p-1f, -0x1.82p-1f, -0x1.7accccp-1f, -0x1.73999ap-1f, -0x1.6c6668p-1f,
    -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f, -0x1.4f999ap-1f, -0x1.486668p-1f, -0x1.413334p-1f, -0x1.3ap-1f,
    -0x1.32ccccp-1f, -0x1.2b999ap-1f, -0x1.246668p-1f, -0x1.1d3334p-1f, -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.079998p-1f,
    -0x1.006666p-1f, -0x1.f26664p-2f, -0x1.e4p-2f, -0x1.d59998p-2f, -0x1.c73334p-2f, -0x1.b8ccccp-2f, -0x1.aa6666p-2f,
    -0x1.9cp-2f, -0x1.8d9998p-2f, -0x1.7f3334p-2f, -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f, -0x1.459998p-2f,
    -0x1.373334p-2f, -0x1.28ccccp-2f, -0x1.1a6668p-2f, -0x1.0cp-2f, -0x1.fb3332p-3f, -0x1.de6666p-3f, -0x1.c1999ap-3f,
    -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f, -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f,
    -0x1.b66668p-4f, -0x1.93d70ap-4f, -0x1.8851eep-4f, -0x1.7ccccep-4f, -0x1.7147aep-4f, -0x1.65c29p-4f,
    -0x1.5a3d7p-4f, -0x1.4eb854p-4f, -0x1.433334p-4f, -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f,
    -0x1.151ebap-4f, -0x1.09999ap-4f, -0x1.fc28f6p-5f, -0x1.e51ebap-5f, -0x1.ce147ap-5f, -0x1.b70a3ep-5f, -0x1.ap-5f,
    -0x1.88f5c2p-5f, -0x1.71eb86p-5f, -0x1.5ae146p-5f, -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c29p-5f,
    -0x1.fd70a4p-6f, -0x1.cf5c2ap-6f, -0x1.a147aep-6f, -0x1.733334p-6f, -0x1.451ebap-6f, -0x1.170a3ep-6f,
    -0x1.d1eb86p-7f, -0x1.75c29p-7f, -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f,
    -0x1.e978d4p-8f, -0x1.c49ba6p-8f, -0x1.9fbe76p-8f, -0x1.7ae148p-8f, -0x1.56041ap-8f, -0x1.3126e8p-8f,
    -0x1.0c49bap-8f, -0x1.ced914p-9f, -0x1.851eb8p-9f, -0x1.3b645ap-9f, -0x1.e353f8p-10f, -0x1.4fdf3ap-10f,
    -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f, -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f,
    -0x1.19ce0ap-12f, -0x1.47ae16p-13f, -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f,
    -0x1.040bfep-17f, -0x1.b43528p-19f, -0x1.27476ep-21f, 0.0f, 0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f,
    0x1.64840cp-16f, 0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f, 0x1.19ce0ap-12f,
    0x1.8fc506p-12f, 0x1.02de02p-11f, 0x1.3dd982p-11f, 0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f,
    0x1.4fdf3ap-10f, 0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f, 0x1.0c49bap-8f, 0x1.3126e8p-8f,
    0x1.56041ap-8f, 0x1.7ae148p-8f, 0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, 0x1.072b02p-7f, 0x1.19999ap-7f,
    0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f, 0x1.d1eb86p-7f, 0x1.170a3ep-6f, 0x1.451ebap-6f, 0x1.733334p-6f,
    0x1.a147aep-6f, 0x1.cf5c2ap-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f, 0x1.2ccccep-5f, 0x1.43d70ap-5f, 0x1.5ae146p-5f,
    0x1.71eb86p-5f, 0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a3ep-5f, 0x1.ce147ap-5f, 0x1.e51ebap-5f, 0x1.fc28f6p-5f,
    0x1.09999ap-4f, 0x1.151ebap-4f, 0x1.20a3d6p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f, 0x1.4eb854p-4f,
    0x1.5a3d7p-4f, 0x1.65c29p-4f, 0x1.7147aep-4f, 0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f, 0x1.b66668p-4f,
    0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f, 0x1.6b3334p-3f, 0x1.88p-3f, 0x1.a4ccccp-3f,
    0x1.c1999ap-3f, 0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f, 0x1.1a6668p-2f, 0x1.28ccccp-2f, 0x1.373334p-2f,
    0x1.459998p-2f, 0x1.54p-2f, 0x1.626666p-2f, 0x1.70ccccp-2f, 0x1.7f3334p-2f, 0x1.8d9998p-2f, 0x1.9cp-2f,
    0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f, 0x1.d59998p-2f, 0x1.e4p-2f, 0x1.f26664p-2f, 0x1.006666p-1f,
    0x1.079998p-1f, 0x1.0eccccp-1f, 0x1.16p-1f, 0x1.1d3334p-1f, 0x1.246668p-1f, 0x1.2b999ap-1f, 0x1.32ccccp-1f,
    0x1.3ap-1f, 0x1.413334p-1f, 0x1.486668p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f, 0x1.5ep-1f, 0x1.653334p-1f,
    0x1.6c6668p-1f, 0x1.73999ap-1f, 0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f, 0x1.97999ap-1f,
    0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f, 0x1.b46666p-1f, 0x1.bb999ap-1f, 0x1.c2ccccp-1f, 0x1.cap-1f,
    0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f, 0x1.eep-1f, 0x1.f53334p-1f, 0x1.fc6666p-1f,
    0x1p+0f,
};
alignas(64) constexpr float kUnsignedCode[256] = {
    0.0f, 0x1.5cf754p-22f, 0x1.a0133p-21f, 0x1.1d367p-19f, 0x1.2599ecp-18f, 0x1.bc98a2p-18f, 0x1.29cbaap-17f,
    0x1.0624dcp-16f, 0x1.c2e34p-16f, 0x1.3fd0dp-15f, 0x1.9e3p-15f, 0x1.fc8f34p-15f, 0x1.2d7732p-14f, 0x1.5ca6c8p-14f,
    0x1.8bd662p-14f, 0x1.0cb296p-13f, 0x1.82a994p-13f, 0x1.f8a092p-13f, 0x1.374bc8p-12f, 0x1.724744p-12f,
    0x1.ad42c6p-12f, 0x1.e83e44p-12f, 0x1.119ce2p-11f, 0x1.2f1aap-11f, 0x1.4c986p-11f, 0x1.6a162p-11f,
    0x1.8793dep-11f, 0x1.a511ap-11f, 0x1.c28f5ep-11f, 0x1.e00d1cp-11f, 0x1.fd8adcp-11f, 0x1.2b020cp-10f,
    0x1.74bc6ap-10f, 0x1.be76c8p-10f, 0x1.041894p-9f, 0x1.28f5c2p-9f, 0x1.4dd2fp-9f, 0x1.72b02p-9f, 0x1.978d4ep-9f,
    0x1.bc6a8p-9f, 0x1.e147aep-9f, 0x1.03126ep-8f, 0x1.158104p-8f, 0x1.27ef9ep-8f, 0x1.3a5e34p-8f, 0x1.4cccccp-8f,
    0x1.5f3b64p-8f, 0x1.71a9fap-8f, 0x1.841894p-8f, 0x1.96872ap-8f, 0x1.a8f5c2p-8f, 0x1.bb645cp-8f, 0x1.cdd2fp-8f,
    0x1.e0418ap-8f, 0x1.f2b01ep-8f, 0x1.028f5cp-7f, 0x1.0bc6a8p-7f, 0x1.14fdf2p-7f, 0x1.1e354p-7f, 0x1.276c8ap-7f,
    0x1.30a3d6p-7f, 0x1.39db24p-7f, 0x1.43126ep-7f, 0x1.5eb854p-7f, 0x1.8ccccep-7f, 0x1.bae146p-7f, 0x1.e8f5c4p-7f,
    0x1.0b851ep-6f, 0x1.228f5ep-6f, 0x1.39999ap-6f, 0x1.50a3d6p-6f, 0x1.67ae16p-6f, 0x1.7eb852p-6f, 0x1.95c28ep-6f,
    0x1.accccep-6f, 0x1.c3d70ep-6f, 0x1.dae146p-6f, 0x1.f1eb86p-6f, 0x1.047aep-5f, 0x1.1p-5f, 0x1.1b851ep-5f,
    0x1.270a3ep-5f, 0x1.328f5ep-5f, 0x1.3e147ap-5f, 0x1.49999ap-5f, 0x1.551eb8p-5f, 0x1.60a3d6p-5f, 0x1.6c28f6p-5f,
    0x1.77ae14p-5f, 0x1.833334p-5f, 0x1.8eb85p-5f, 0x1.9a3d7p-5f, 0x1.a5c28ep-5f, 0x1.b147aep-5f, 0x1.bccccep-5f,
    0x1.c851eep-5f, 0x1.d3d70ep-5f, 0x1.df5c2ap-5f, 0x1.eae146p-5f, 0x1.f66666p-5f, 0x1.00f5c4p-4f, 0x1.06b854p-4f,
    0x1.0c7ae2p-4f, 0x1.123d7p-4f, 0x1.18p-4f, 0x1.1dc29p-4f, 0x1.23852p-4f, 0x1.2947aep-4f, 0x1.2f0a3ep-4f,
    0x1.34cccep-4f, 0x1.3a8f5ep-4f, 0x1.4051ecp-4f, 0x1.46147cp-4f, 0x1.4bd70ap-4f, 0x1.51999ap-4f, 0x1.575c2ap-4f,
    0x1.5d1eb8p-4f, 0x1.62e148p-4f, 0x1.68a3d6p-4f, 0x1.6e6666p-4f, 0x1.7428f6p-4f, 0x1.79eb86p-4f, 0x1.7fae16p-4f,
    0x1.8570a4p-4f, 0x1.8b3334p-4f, 0x1.90f5c4p-4f, 0x1.96b852p-4f, 0x1.a8p-4f, 0x1.c4ccccp-4f, 0x1.e1999ap-4f,
    0x1.fe6666p-4f, 0x1.0d9998p-3f, 0x1.1cp-3f, 0x1.2a6668p-3f, 0x1.38ccccp-3f, 0x1.473334p-3f, 0x1.559998p-3f,
    0x1.64p-3f, 0x1.726668p-3f, 0x1.80ccccp-3f, 0x1.8f3334p-3f, 0x1.9d9998p-3f, 0x1.acp-3f, 0x1.ba6668p-3f,
    0x1.c8ccccp-3f, 0x1.d73334p-3f, 0x1.e59998p-3f, 0x1.f4p-3f, 0x1.013332p-2f, 0x1.086666p-2f, 0x1.0f999ap-2f,
    0x1.16ccccp-2f, 0x1.1ep-2f, 0x1.253334p-2f, 0x1.2c6666p-2f, 0x1.339998p-2f, 0x1.3accccp-2f, 0x1.42p-2f,
    0x1.493334p-2f, 0x1.506666p-2f, 0x1.579998p-2f, 0x1.5eccccp-2f, 0x1.66p-2f, 0x1.6d3334p-2f, 0x1.746666p-2f,
    0x1.7b9998p-2f, 0x1.82ccccp-2f, 0x1.8ap-2f, 0x1.913334p-2f, 0x1.986666p-2f, 0x1.9f9998p-2f, 0x1.a6ccccp-2f,
    0x1.aep-2f, 0x1.b53334p-2f, 0x1.bc6666p-2f, 0x1.c39998p-2f, 0x1.caccccp-2f, 0x1.d2p-2f, 0x1.d93334p-2f,
    0x1.e06666p-2f, 0x1.e79998p-2f, 0x1.eeccccp-2f, 0x1.f6p-2f, 0x1.fd3332p-2f, 0x1.023334p-1f, 0x1.05ccccp-1f,
    0x1.096666p-1f, 0x1.0dp-1f, 0x1.109998p-1f, 0x1.143334p-1f, 0x1.17ccccp-1f, 0x1.1b6668p-1f, 0x1.1fp-1f,
    0x1.22999ap-1f, 0x1.263334p-1f, 0x1.29ccccp-1f, 0x1.2d6668p-1f, 0x1.31p-1f, 0x1.34999ap-1f, 0x1.383334p-1f,
    0x1.3bccccp-1f, 0x1.3f6668p-1f, 0x1.43p-1f, 0x1.46999ap-1f, 0x1.4a3334p-1f, 0x1.4dccccp-1f, 0x1.516668p-1f,
    0x1.55p-1f, 0x1.58999ap-1f, 0x1.5c3334p-1f, 0x1.5fccccp-1f, 0x1.636668p-1f, 0x1.67p-1f, 0x1.6a999ap-1f,
    0x1.6e3334p-1f, 0x1.71ccccp-1f, 0x1.756668p-1f, 0x1.79p-1f, 0x1.7c999ap-1f, 0x1.803334p-1f, 0x1.83ccccp-1f,
    0x1.876668p-1f, 0x1.8bp-1f, 0x1.8e9998p-1f, 0x1.923334p-1f, 0x1.95ccccp-1f, 0x1.996668p-1f, 0x1.9dp-1f,
    0x1.a09998p-1f, 0x1.a43334p-1f, 0x1.a7ccccp-1f, 0x1.ab6668p-1f, 0x1.afp-1f, 0x1.b29998p-1f, 0x1.b63334p-1f,
    0x1.b9ccccp-1f, 0x1.bd6668p-1f, 0x1.c1p-1f, 0x1.c49998p-1f, 0x1.c83334p-1f, 0x1.cbccccp-1f, 0x1.cf6668p-1f,
    0x1.d3p-1f, 0x1.d69998p-1f, 0x1.da3334p-1f, 0x1.ddccccp-1f, 0x1.e16668p-1f, 0x1.e5p-1f, 0x1.e89998p-1f,
    0x1.ec3334p-1f, 0x1.efccccp-1f, 0x1.f36668p-1f, 0x1.f7p-1f, 0x1.fa9998p-1f, 0x1.fe3334p-1f, 0x1p+0f,
};

std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// A signed integer that orders like the float (-0 just below +0; NaNs beyond the infinities).
std::int32_t order_key(float x) {
  const std::uint32_t u = float_bits(x);
  return static_cast<std::int32_t>(u >> 31 ? u ^ 0x7FFFFFFFu : u);
}

// One map's thresholds and bucket table. Bucket b holds the keys k with k >> shift == b,
// for b in lo..hi, the buckets of -2 and 2: the fast path's normalized values (|x| < 2)
// need no clamping, and other values clamp to those end buckets, which hold no
// threshold. The widest threshold-free run of buckets, mid_lo..mid_hi (around 0, or all
// the negatives for the unsigned map), shares one entry. Entry of bucket b:
//   (low `shift` key bits of b's threshold, all ones if it has none) << (32 - shift) | n
// where n is the number of thresholds below bucket b. For a key in bucket b, its low bits
// shifted the same way compare (unsigned) above the entry exactly when the key is above
// b's threshold, and the code is the entry's low byte plus that comparison.
//
// The arithmetic encoder's tables (AVX-512, where 16- and 32-entry tables are a
// register or two). The positive thresholds fall into segments: below the first one,
// one segment per decade of the map (its codes evenly spaced, so the thresholds inside
// it nearly so), and above the last. A value's segment is found exactly from its binade
// (binade_segment: the segments below the binade; binade_bound: the one boundary inside
// it, if any; no binade holds two); inside a segment the count is y = a * scale + offset
// (one fused multiply-add; the offset includes the thresholds below the segment),
// truncated and clamped to the segment's largest count: y never falls below the
// smallest. That line misses the fp32 thresholds by at most a few ulps, so a value
// whose y lies within `band` of an integer is encoded by the bucket table instead; no
// other value can be off (y is monotone in a). build_arith measures the miss and
// checks every assumption here.
struct Q8Arith {
  std::int32_t binade_base = 0;         // biased exponent of binade 1 of binade_* minus 1
  alignas(64) std::int32_t binade_segment[32] = {};
  alignas(64) std::int32_t binade_bound[32] = {};  // bits of the boundary inside, 0x7FFFFFFF if none
  alignas(64) float scale[16] = {}, offset[16] = {};
  alignas(64) std::int32_t limit[16] = {};  // the largest count in the segment
  float band = 0.0f;
};

struct Q8Tables {
  float code[256];
  float thresholds[255];
  int shift = 0;
  std::int32_t lo = 0, hi = 0, mid_lo = 0, mid_hi = 0;
  std::vector<std::int32_t> entries;
  const std::int32_t* entry_base = nullptr;  // entry of bucket b: entry_base[b - clamp(b, mid_lo, mid_hi)]
  Q8Arith arith;
};

float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Q8Arith for thresholds t whose positive part is `first`..254 and whose map has 7
// decades of 2^i (signed) or 2^(i+1) (unsigned) codes, decade i spanning
// [0.1, 1] * 10^(i-6), as create_dynamic_map builds them.
Q8Arith build_arith(const float* t, bool is_signed) {
  Q8Arith q;
  const int first = is_signed ? 127 : 0;
  const int positive = 255 - first;  // thresholds above 0
  const float* T = t + first;  // T[0] lies between 0 and the first positive code
  // A negative value is encoded through the positive thresholds: the signed map's
  // negative ones must be exactly those negated (all but the last, below 1.0).
  if (is_signed)
    for (int k = 0; k < 127; ++k)
      if (float_bits(t[k]) != (float_bits(t[253 - k]) ^ 0x80000000u)) std::abort();
  std::vector<float> bounds;   // segment boundaries: a value above j of them is in segment j
  int below = 1;               // positive thresholds below the decade's first code
  double band = 0;
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? 1 << i : 2 << i, s = i + 1;
    bounds.push_back(T[below - 1]);
    q.limit[s] = below + n - 1;
    const double decade = std::pow(10.0, i - 6);
    q.scale[s] = n == 1 ? 0.0f : static_cast<float>(n / (0.9 * decade));
    q.offset[s] = static_cast<float>(below + (n == 1 ? 0.5 : -0.1 * n / 0.9));
    const auto y = [&](float a) { return static_cast<double>(std::fma(a, q.scale[s], q.offset[s])); };
    // The segment's first value (just above its lower boundary) counts `below`: no clamp below.
    if (!(y(from_bits(float_bits(T[below - 1]) + 1)) >= below)) std::abort();
    for (int j = 1; j < n; ++j) {  // the j-th threshold inside: y should cross below + j between it and the next float up
      const float u = T[below - 1 + j], up = from_bits(float_bits(u) + 1);
      for (float a : {u, up}) band = std::max(band, std::fabs(y(a) - (below + j)));
    }
    below += n;
  }
  if (below != positive) std::abort();
  bounds.push_back(T[positive - 1]);
  q.offset[0] = 0.5f;
  q.offset[8] = static_cast<float>(positive) + 0.5f;
  q.limit[8] = positive;
  q.band = static_cast<float>(2 * band + 1e-6);
  if (!(q.band < 0.25f)) std::abort();
  q.binade_base = static_cast<std::int32_t>(float_bits(T[0]) >> 23) - 1;
  // The encoder clamps |x| to 2.0 (biased exponent 128) and indexes 32 binades without
  // clamping above.
  if (!(q.binade_base > 0 && 128 - q.binade_base <= 31)) std::abort();
  for (int k = 0; k < 32; ++k) {
    const std::uint32_t lo = static_cast<std::uint32_t>(q.binade_base + k) << 23, hi = lo + (1u << 23);
    q.binade_bound[k] = 0x7FFFFFFF;
    for (float b : bounds) {
      const std::uint32_t u = float_bits(b);
      if (u < lo) {
        ++q.binade_segment[k];
      } else if (u < hi || k == 31) {
        // Binade 0 stands for everything below T[0]'s binade, 31 for everything from
        // its own up: neither may hold a boundary, nor any binade two.
        if (k == 0 || k == 31 || q.binade_bound[k] != 0x7FFFFFFF) std::abort();
        q.binade_bound[k] = static_cast<std::int32_t>(u);
      }
    }
  }
  return q;
}

Q8Tables build_tables(const float* code) {
  Q8Tables q;
  std::memcpy(q.code, code, sizeof q.code);
  for (int k = 0; k < 255; ++k) {
    q.thresholds[k] = static_cast<float>((static_cast<double>(code[k]) + static_cast<double>(code[k + 1])) / 2);
    // A fixed map: these cannot fail (the tests check the map).
    if (!(std::fabs(q.thresholds[k]) < 1.0f) || (k > 0 && !(q.thresholds[k] > q.thresholds[k - 1]))) std::abort();
  }
  // The coarsest buckets that hold at most one threshold each (entries keep 8 bits for the count).
  for (q.shift = 23; q.shift > 0; --q.shift) {
    bool fits = true;
    for (int k = 1; k < 255 && fits; ++k)
      fits = order_key(q.thresholds[k]) >> q.shift != order_key(q.thresholds[k - 1]) >> q.shift;
    if (fits) break;
  }
  q.lo = order_key(-2.0f) >> q.shift;
  q.hi = order_key(2.0f) >> q.shift;
  // Occupied buckets, with sentinels outside lo..hi; the widest run between two of them is shared.
  std::vector<std::int32_t> occupied{q.lo - 1};
  for (int k = 0; k < 255; ++k) occupied.push_back(order_key(q.thresholds[k]) >> q.shift);
  occupied.push_back(q.hi + 1);
  std::size_t gap = 0;
  for (std::size_t j = 1; j + 1 < occupied.size(); ++j)
    if (occupied[j + 1] - occupied[j] > occupied[gap + 1] - occupied[gap]) gap = j;
  q.mid_lo = occupied[gap] + 1;
  q.mid_hi = std::max(occupied[gap + 1] - 1, q.mid_lo);  // if no bucket is free, a run of one bucket
  const std::uint32_t low_mask = (1u << q.shift) - 1;
  int below = 0;  // thresholds in the buckets below b
  for (std::int32_t b = q.lo; b <= q.hi; ++b) {
    const bool has = below < 255 && occupied[below + 1] == b;
    const std::uint32_t low = has ? static_cast<std::uint32_t>(order_key(q.thresholds[below])) & low_mask : low_mask;
    if (b <= q.mid_lo || b > q.mid_hi)
      q.entries.push_back(static_cast<std::int32_t>(low << (32 - q.shift) | static_cast<std::uint32_t>(below)));
    below += has;
  }
  if (below != 255) std::abort();
  q.entry_base = q.entries.data() + (q.mid_lo - q.lo);
  q.arith = build_arith(q.thresholds, code[0] < 0.0f);
  return q;
}

const Q8Tables& tables(Q8Map map) {
  static const Q8Tables signed_tables = build_tables(kSignedCode);
  static const Q8Tables unsigned_tables = build_tables(kUnsignedCode);
  return map == Q8Map::signed_dynamic ? signed_tables : unsigned_tables;
}

// The number of the 255 ascending thresholds t[k] below x, by a binary search: after the
// step of size s the count is known to a multiple of s. Comparisons with NaN are false,
// so NaN counts 0. Written with masks rather than conditionals, which the compiler
// turns into branches that mispredict on random data.
inline std::uint8_t encode_below(const float* t, float x) {
  unsigned count = 0;
  for (unsigned step = 128; step > 0; step >>= 1) count += step & (0u - static_cast<unsigned>(x > t[count + step - 1]));
  return static_cast<std::uint8_t>(count);
}

// NaN -> 0, +-inf -> +-FLT_MAX, everything else unchanged (the sign of 0 included).
float sanitize(float x) {
  if (std::isnan(x)) return 0.0f;
  return x > FLT_MAX ? FLT_MAX : x < -FLT_MAX ? -FLT_MAX : x;
}

}  // namespace
}  // namespace stepfuse::cpu
#endif  // STEPFUSE_CPU_Q8_SHARED_

HWY_BEFORE_NAMESPACE();
namespace stepfuse::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// AVX-512 keeps whole tables in registers: 16 entries in one, 32 in two, 256 in 16.
#undef STEPFUSE_Q8_REGISTER_TABLES
#if HWY_TARGET <= HWY_AVX3
#define STEPFUSE_Q8_REGISTER_TABLES 1
using V16i = hn::Vec512<std::int32_t>;
using V16f = hn::Vec512<float>;
HWY_INLINE V16i Lookup32(V16i lo, V16i hi, V16i index) {
  return V16i{_mm512_permutex2var_epi32(lo.raw, index.raw, hi.raw)};
}
HWY_INLINE V16f Lookup16(V16f table, V16i index) { return V16f{_mm512_permutexvar_ps(index.raw, table.raw)}; }
HWY_INLINE V16i Lookup16(V16i table, V16i index) { return V16i{_mm512_permutexvar_epi32(index.raw, table.raw)}; }
#else
#define STEPFUSE_Q8_REGISTER_TABLES 0
#endif

// One map's encoder constants, broadcast once per call (D: the float lanes' tag;
// kSigned: the map is signed_dynamic).
template <class D, bool kSigned>
struct Encoder {
  using DI = hn::RebindToSigned<D>;
  using V = hn::Vec<DI>;
  Encoder(DI di, const Q8Tables& q)
      : entries(q.entry_base), shift(q.shift), lo(hn::Set(di, q.lo)), hi(hn::Set(di, q.hi)),
        mid_lo(hn::Set(di, q.mid_lo)), mid_hi(hn::Set(di, q.mid_hi)) {
#if STEPFUSE_Q8_REGISTER_TABLES
    const Q8Arith& a = q.arith;
    binade_base = hn::Set(di, a.binade_base);
    segment_lo = hn::Load(di, a.binade_segment), segment_hi = hn::Load(di, a.binade_segment + 16);
    bound_lo = hn::Load(di, a.binade_bound), bound_hi = hn::Load(di, a.binade_bound + 16);
    scale = hn::Load(D(), a.scale), offset = hn::Load(D(), a.offset), band = hn::Set(D(), a.band);
    limit = hn::Load(di, a.limit);
#endif
  }
  const std::int32_t* entries;
  int shift;
  V lo, hi, mid_lo, mid_hi;
#if STEPFUSE_Q8_REGISTER_TABLES
  V binade_base, segment_lo, segment_hi, bound_lo, bound_hi, limit;
  hn::Vec<D> scale, offset, band;
#endif
};

// q8_encode_scalar of each lane, for lanes in [-2, 2] (no NaN); the code in each u32
// lane's low byte. With `kClamp`, any non-NaN value.
template <bool kClamp, class D, bool kSigned>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> EncodeFinite(const Encoder<D, kSigned>& e, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  const auto u = hn::BitCast(di, x);
  const auto key = hn::Xor(u, hn::And(hn::ShiftRight<31>(u), hn::Set(di, 0x7FFFFFFF)));
  auto b = hn::ShiftRightSame(key, e.shift);
  if constexpr (kClamp) b = hn::Min(hn::Max(b, e.lo), e.hi);
  const auto index = hn::Sub(b, hn::Min(hn::Max(b, e.mid_lo), e.mid_hi));
  const auto entry = hn::BitCast(du, hn::GatherIndex(di, e.entries, index));
  // A true mask is all ones: subtracting it adds the threshold inside the bucket when x is above it.
  const auto above = hn::Gt(hn::BitCast(du, hn::ShiftLeftSame(key, 32 - e.shift)), entry);
  return hn::Sub(entry, hn::VecFromMask(du, above));
}

#if STEPFUSE_Q8_REGISTER_TABLES
// EncodeFinite by arithmetic (Q8Arith), no memory access: the count of positive
// thresholds below a = |x| is its segment's base plus floor(a * scale + offset), clamped
// to the segment. A negative x counts the positive thresholds at or below |x|, those
// below the next float up, mirrored (the signed map's negative thresholds are its
// positive ones negated, all but the last); the unsigned map has none below 0. A vector
// with a lane too near a threshold to trust the line takes EncodeFinite. The code is
// the whole u32 lane (StoreCodes64 packs with saturation). Written with
// AVX-512's masked operations and its vreduceps (y - round(y) in one instruction).
template <bool kClamp, class D, bool kSigned>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> EncodeFast(const Encoder<D, kSigned>& e, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  const __m512i u = _mm512_castps_si512(x.raw);
  const __mmask16 negative = _mm512_movepi32_mask(u);
  __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  if constexpr (kSigned) a = _mm512_mask_add_epi32(a, negative, a, _mm512_set1_epi32(1));
  if constexpr (kClamp) a = _mm512_min_epi32(a, _mm512_set1_epi32(0x40000000));  // 2.0: above every threshold, still finite
  // The binade, less binade_base and at least 0 (a saturating 16-bit subtraction: the
  // exponent fits the low half); at most 31, as |x| <= 2 (build_arith checks).
  const V16i binade{_mm512_subs_epu16(_mm512_srli_epi32(a, 23), e.binade_base.raw)};
  V16i segment = Lookup32(e.segment_lo, e.segment_hi, binade);
  const __mmask16 past_bound = _mm512_cmpgt_epi32_mask(a, Lookup32(e.bound_lo, e.bound_hi, binade).raw);
  segment.raw = _mm512_mask_add_epi32(segment.raw, past_bound, segment.raw, _mm512_set1_epi32(1));
  const __m512 y = _mm512_fmadd_ps(_mm512_castsi512_ps(a), Lookup16(e.scale, segment).raw, Lookup16(e.offset, segment).raw);
  const __m512 from_nearest = _mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT);  // y - round(y)
  const __mmask16 near = _mm512_cmp_ps_mask(_mm512_abs_ps(from_nearest), e.band.raw, _CMP_LT_OQ);
  if (HWY_UNLIKELY(near != 0)) return hn::And(EncodeFinite<kClamp>(e, x), hn::Set(du, 0xFF));
  const __m512i count = _mm512_min_epi32(_mm512_cvttps_epi32(y), Lookup16(e.limit, segment).raw);
  if constexpr (!kSigned) return hn::BitCast(du, V16i{_mm512_mask_mov_epi32(count, negative, _mm512_setzero_si512())});
  const __m512i mid = _mm512_set1_epi32(127);
  const __m512i code = _mm512_mask_sub_epi32(_mm512_add_epi32(mid, count), negative, mid, _mm512_min_epi32(count, mid));
  (void)di;
  return hn::BitCast(du, V16i{code});
}
#endif

// q8_encode_scalar of each lane, for lanes in [-2, 2] (no NaN); with `kClamp`, any non-NaN value.
template <bool kClamp, class D, bool kSigned>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> EncodeNumber(const Encoder<D, kSigned>& e, hn::Vec<D> x) {
#if STEPFUSE_Q8_REGISTER_TABLES
  return EncodeFast<kClamp>(e, x);
#else
  return EncodeFinite<kClamp>(e, x);
#endif
}

// q8_encode_scalar of each lane, any value.
template <class D, bool kSigned>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> Encode(const Encoder<D, kSigned>& e, hn::Vec<D> x) {
  const hn::RebindToUnsigned<D> du;
  // Positive NaNs order above +inf, so their bucket is hi; NaN is above no threshold.
  return hn::IfThenZeroElse(hn::RebindMask(du, hn::IsNaN(x)), EncodeNumber<true>(e, x));
}

template <class D>
HWY_INLINE void StoreCodes(D /*d*/, hn::Vec<hn::RebindToUnsigned<D>> codes, std::uint8_t* to) {
#if STEPFUSE_Q8_REGISTER_TABLES
  // (vpmovdb: Highway 1.0.3's TruncateTo on AVX3_DL puts the bytes out of order)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(to), _mm512_cvtepi32_epi8(codes.raw));
#else
  const hn::Rebind<std::uint8_t, D> d8;
  hn::StoreU(hn::TruncateTo(d8, codes), d8, to);
#endif
}

#if STEPFUSE_Q8_REGISTER_TABLES
// Four vectors of 16 codes (each in a u32 lane's low byte), c[k] for elements 16k..16k+15,
// stored as 64 bytes: two saturating packs (codes are below 256) interleave them by
// 128-bit lane, and one dword permute puts them in order.
HWY_INLINE void StoreCodes64(const __m512i c[4], std::uint8_t* to) {
  const __m512i packed = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
  // dword 4L + k of `packed` holds elements 16k + 4L .. +3
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_si512(to, _mm512_permutexvar_epi32(order, packed));
}
#endif

template <class D>
HWY_INLINE hn::Vec<D> Sanitize(D d, hn::Vec<D> x) {
  const auto finite = hn::IfThenZeroElse(hn::IsNaN(x), x);
  return hn::Min(hn::Max(finite, hn::Set(d, -FLT_MAX)), hn::Set(d, FLT_MAX));
}

template <bool kSigned>
void EncodeArrayWith(const float* x, std::uint8_t* codes, std::size_t n) {
  using D = hn::ScalableTag<float>;
  const D d;
  const std::size_t N = hn::Lanes(d);
  const Encoder<D, kSigned> e(hn::RebindToSigned<D>(), tables(kSigned ? Q8Map::signed_dynamic : Q8Map::unsigned_dynamic));
  std::size_t i = 0;
  for (; i + N <= n; i += N) StoreCodes(d, Encode(e, hn::LoadU(d, x + i)), codes + i);
  if (i == n) return;
  alignas(64) float in[hn::MaxLanes(d)] = {};
  alignas(64) std::uint8_t out[hn::MaxLanes(d)];
  std::memcpy(in, x + i, (n - i) * sizeof(float));
  StoreCodes(d, Encode(e, hn::Load(d, in)), out);
  std::memcpy(codes + i, out, n - i);
}

// One block of len <= kQ8Block elements, any values: sanitized, then encoded with NaN
// handling.
template <class D, bool kSigned>
float QuantizeBlockSlow(D d, const Encoder<D, kSigned>& e, const float* x, std::uint8_t* c, std::size_t len) {
  const std::size_t N = hn::Lanes(d);
  const std::size_t full = len - len % N;
  alignas(64) float tail[hn::MaxLanes(d)] = {};  // zero padding changes no max
  std::memcpy(tail, x + full, (len - full) * sizeof(float));
  auto vmax = hn::Abs(Sanitize(d, hn::Load(d, tail)));
  for (std::size_t i = 0; i < full; i += N) vmax = hn::Max(vmax, hn::Abs(Sanitize(d, hn::LoadU(d, x + i))));
  const float absmax = hn::GetLane(hn::MaxOfLanes(d, vmax));
  const auto inv = hn::Set(d, q8_inverse_scale(absmax));
  for (std::size_t i = 0; i < full; i += N)
    StoreCodes(d, Encode(e, hn::Mul(Sanitize(d, hn::LoadU(d, x + i)), inv)), c + i);
  if (full < len) {
    alignas(64) std::uint8_t out[hn::MaxLanes(d)];
    StoreCodes(d, Encode(e, hn::Mul(Sanitize(d, hn::Load(d, tail)), inv)), out);
    std::memcpy(c + full, out, len - full);
  }
  return absmax;
}

template <bool kSigned>
void QuantizeWith(const float* in, std::uint8_t* codes, float* absmax, std::size_t n) {
  using D = hn::ScalableTag<float>;
  const D d;
  const hn::RebindToSigned<D> di;
  const std::size_t N = hn::Lanes(d);
  const Encoder<D, kSigned> e(di, tables(kSigned ? Q8Map::signed_dynamic : Q8Map::unsigned_dynamic));
  const auto magnitude = hn::Set(di, 0x7FFFFFFF);
  for (std::size_t start = 0, block = 0; start < n; start += kQ8Block, ++block) {
    const float* x = in + start;
    std::uint8_t* c = codes + start;
    const std::size_t len = n - start < kQ8Block ? n - start : kQ8Block;
    const std::size_t full = len - len % N;
    // The largest |x| as the largest magnitude bit pattern: exact, and above the
    // largest finite float's exactly when the block holds an inf or a NaN.
    auto vmax = hn::Zero(di);
    for (std::size_t i = 0; i < full; i += N)
      vmax = hn::Max(vmax, hn::And(hn::BitCast(di, hn::LoadU(d, x + i)), magnitude));
    for (std::size_t i = full; i < len; ++i)
      vmax = hn::Max(vmax, hn::Set(di, static_cast<std::int32_t>(float_bits(x[i]) & 0x7FFFFFFFu)));
    const std::int32_t max_bits = hn::GetLane(hn::MaxOfLanes(di, vmax));
    float m;
    std::memcpy(&m, &max_bits, sizeof m);
    const float inv = q8_inverse_scale(m);
    if (max_bits > 0x7F7FFFFF || !(inv <= FLT_MAX)) {
      // inf or NaN to sanitize: rare.
      absmax[block] = QuantizeBlockSlow(d, e, x, c, len);
      continue;
    }
    absmax[block] = m;
    // The normalized values are finite and below 2 in magnitude (|x| <= absmax, and
    // absmax * inv is 1 within a few roundings, even where inv is subnormal).
    const auto vinv = hn::Set(d, inv);
    std::size_t i = 0;
#if STEPFUSE_Q8_REGISTER_TABLES
    for (; i + 4 * N <= full; i += 4 * N) {
      __m512i code[4];
      for (int k = 0; k < 4; ++k) code[k] = EncodeNumber<false>(e, hn::Mul(hn::LoadU(d, x + i + k * N), vinv)).raw;
      StoreCodes64(code, c + i);
    }
#endif
    for (; i < full; i += N) StoreCodes(d, EncodeNumber<false>(e, hn::Mul(hn::LoadU(d, x + i), vinv)), c + i);
    if (full == len) continue;
    alignas(64) float tail[hn::MaxLanes(d)] = {};
    alignas(64) std::uint8_t out[hn::MaxLanes(d)];
    std::memcpy(tail, x + full, (len - full) * sizeof(float));
    StoreCodes(d, EncodeNumber<false>(e, hn::Mul(hn::Load(d, tail), vinv)), out);
    std::memcpy(c + full, out, len - full);
  }
}

void EncodeArray(const float* x, std::uint8_t* codes, std::size_t n, int map) {
  if (static_cast<Q8Map>(map) == Q8Map::signed_dynamic) return EncodeArrayWith<true>(x, codes, n);
  EncodeArrayWith<false>(x, codes, n);
}

void Quantize(const float* in, std::uint8_t* codes, float* absmax, std::size_t n, int map) {
  if (static_cast<Q8Map>(map) == Q8Map::signed_dynamic) return QuantizeWith<true>(in, codes, absmax, n);
  QuantizeWith<false>(in, codes, absmax, n);
}

// The code values of each lane's code (0..255).
template <class D>
struct Decoder {
#if STEPFUSE_Q8_REGISTER_TABLES
  explicit Decoder(const float* code) {
    for (int j = 0; j < 16; ++j) table[j] = hn::Load(D(), code + 16 * j);
  }
  HWY_INLINE hn::Vec<D> operator()(hn::Vec<hn::RebindToSigned<D>> index) const {
    const hn::RebindToSigned<D> di;
    hn::Vec<D> pair[8];  // pair[j]: from codes 32j..32j+31, by the index's low 5 bits
    for (int j = 0; j < 8; ++j) pair[j] = V16f{_mm512_permutex2var_ps(table[2 * j].raw, index.raw, table[2 * j + 1].raw)};
    const auto bit5 = hn::RebindMask(D(), hn::TestBit(index, hn::Set(di, 32)));
    const auto bit6 = hn::RebindMask(D(), hn::TestBit(index, hn::Set(di, 64)));
    const auto bit7 = hn::RebindMask(D(), hn::TestBit(index, hn::Set(di, 128)));
    for (int j = 0; j < 4; ++j) pair[j] = hn::IfThenElse(bit5, pair[2 * j + 1], pair[2 * j]);
    for (int j = 0; j < 2; ++j) pair[j] = hn::IfThenElse(bit6, pair[2 * j + 1], pair[2 * j]);
    return hn::IfThenElse(bit7, pair[1], pair[0]);
  }
  hn::Vec<D> table[16];
#else
  explicit Decoder(const float* code) : code(code) {}
  HWY_INLINE hn::Vec<D> operator()(hn::Vec<hn::RebindToSigned<D>> index) const { return hn::GatherIndex(D(), code, index); }
  const float* code;
#endif
};

#if HWY_TARGET == HWY_AVX3_DL
// With VBMI, 64 codes at a time, byte by byte: byte p of every code value is looked up
// in its own 256-byte table (four registers, two vpermi2b of 128 bytes each and a blend
// by the code's top bit), and the four byte planes interleave into four vectors of 16
// floats. The interleave (unpack) works within 128-bit lanes, so the codes are first
// permuted to come out in order: the value of code j lands in vector j / 16, lane j % 16.
struct ByteDecoder {
  explicit ByteDecoder(const float* code) {
    alignas(64) std::uint8_t planes[4][256];
    for (int k = 0; k < 256; ++k)
      for (int p = 0; p < 4; ++p) planes[p][k] = static_cast<std::uint8_t>(float_bits(code[k]) >> (8 * p));
    for (int p = 0; p < 4; ++p)
      for (int j = 0; j < 4; ++j) table[p][j] = _mm512_load_si512(planes[p] + 64 * j);
    order = _mm512_load_si512(kLaneOrder);
  }
  // The code values of codes[0..63]: out[k] holds those of codes 16k..16k+15.
  HWY_INLINE void operator()(const std::uint8_t* codes, __m512 out[4]) const {
    const __m512i index = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes));
    const __mmask64 upper = _mm512_movepi8_mask(index);  // codes 128..255
    __m512i plane[4];
    for (int p = 0; p < 4; ++p)
      plane[p] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(table[p][0], index, table[p][1]),
                                        _mm512_permutex2var_epi8(table[p][2], index, table[p][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(plane[0], plane[1]), hi01 = _mm512_unpackhi_epi8(plane[0], plane[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(plane[2], plane[3]), hi23 = _mm512_unpackhi_epi8(plane[2], plane[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
  }
  // After the unpacks, byte 16L + 4k + i holds element 16k + 4L + i (L the 128-bit lane,
  // k the output vector, i < 4): the byte order that puts them there.
  alignas(64) static constexpr std::uint8_t kLaneOrder[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
      8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  __m512i table[4][4];
  __m512i order;
};

void Dequantize(const std::uint8_t* codes, const float* absmax, float* out, std::size_t n, int map) {
  const ByteDecoder code(tables(static_cast<Q8Map>(map)).code);
  for (std::size_t start = 0, block = 0; start < n; start += kQ8Block, ++block) {
    const std::uint8_t* c = codes + start;
    float* o = out + start;
    const std::size_t len = n - start < kQ8Block ? n - start : kQ8Block;
    const __m512 scale = _mm512_set1_ps(absmax[block]);
    __m512 value[4];
    std::size_t i = 0;
    for (; i + 64 <= len; i += 64) {
      code(c + i, value);
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(o + i + 16 * k, _mm512_mul_ps(value[k], scale));
    }
    if (i == len) continue;
    alignas(64) std::uint8_t tail[64] = {};
    alignas(64) float result[64];
    std::memcpy(tail, c + i, len - i);
    code(tail, value);
    for (int k = 0; k < 4; ++k) _mm512_store_ps(result + 16 * k, _mm512_mul_ps(value[k], scale));
    std::memcpy(o + i, result, (len - i) * sizeof(float));
  }
}
#else
void Dequantize(const std::uint8_t* codes, const float* absmax, float* out, std::size_t n, int map) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<std::uint8_t, decltype(d)> d8;
  const std::size_t N = hn::Lanes(d);
  const Decoder<decltype(d)> code(tables(static_cast<Q8Map>(map)).code);
  for (std::size_t start = 0, block = 0; start < n; start += kQ8Block, ++block) {
    const std::uint8_t* c = codes + start;
    float* o = out + start;
    const std::size_t len = n - start < kQ8Block ? n - start : kQ8Block;
    const std::size_t full = len - len % N;
    const auto scale = hn::Set(d, absmax[block]);
    for (std::size_t i = 0; i < full; i += N) {
      const auto value = code(hn::PromoteTo(di, hn::LoadU(d8, c + i)));
      hn::StoreU(hn::Mul(value, scale), d, o + i);
    }
    if (full == len) continue;
    alignas(64) std::uint8_t tail[hn::MaxLanes(d)] = {};
    alignas(64) float result[hn::MaxLanes(d)];
    std::memcpy(tail, c + full, len - full);
    hn::Store(hn::Mul(code(hn::PromoteTo(di, hn::Load(d8, tail))), scale), d, result);
    std::memcpy(o + full, result, (len - full) * sizeof(float));
  }
}
#endif

}  // namespace stepfuse::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace stepfuse::cpu {
HWY_EXPORT(EncodeArray);
HWY_EXPORT(Quantize);
HWY_EXPORT(Dequantize);

const float* q8_code(Q8Map map) { return tables(map).code; }
const float* q8_thresholds(Q8Map map) { return tables(map).thresholds; }

std::uint8_t q8_encode_scalar(float x, Q8Map map) { return encode_below(tables(map).thresholds, x); }

void q8_encode(const float* x, std::uint8_t* codes, std::size_t n, Q8Map map) {
  HWY_DYNAMIC_DISPATCH(EncodeArray)(x, codes, n, static_cast<int>(map));
}
void q8_quantize(const float* in, std::uint8_t* codes, float* absmax, std::size_t n, Q8Map map) {
  HWY_DYNAMIC_DISPATCH(Quantize)(in, codes, absmax, n, static_cast<int>(map));
}
void q8_dequantize(const std::uint8_t* codes, const float* absmax, float* out, std::size_t n, Q8Map map) {
  HWY_DYNAMIC_DISPATCH(Dequantize)(codes, absmax, out, n, static_cast<int>(map));
}

void q8_quantize_scalar(const float* in, std::uint8_t* codes, float* absmax, std::size_t n, Q8Map map) {
  const float* t = tables(map).thresholds;
  for (std::size_t start = 0, block = 0; start < n; start += kQ8Block, ++block) {
    const std::size_t end = n - start < kQ8Block ? n : start + kQ8Block;
    float m = 0.0f;
    for (std::size_t i = start; i < end; ++i) m = std::fmax(m, std::fabs(sanitize(in[i])));
    absmax[block] = m;
    const float inv = q8_inverse_scale(m);
    for (std::size_t i = start; i < end; ++i) codes[i] = encode_below(t, sanitize(in[i]) * inv);
  }
}

void q8_device_maps(float* out) {
  for (const Q8Map map : {Q8Map::signed_dynamic, Q8Map::unsigned_dynamic}) {
    std::copy_n(q8_code(map), kQ8Block, out);
    std::copy_n(q8_thresholds(map), kQ8Block - 1, out + kQ8Block);
    out[2 * kQ8Block - 1] = std::numeric_limits<float>::infinity();
    out += 2 * kQ8Block;
  }
}

void q8_dequantize_scalar(const std::uint8_t* codes, const float* absmax, float* out, std::size_t n, Q8Map map) {
  const float* code = q8_code(map);
  for (std::size_t i = 0; i < n; ++i) out[i] = code[codes[i]] * absmax[i / kQ8Block];
}
}  // namespace stepfuse::cpu
#endif
