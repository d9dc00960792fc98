// The q8 state codec (runtime/cpu/q8.hpp): the maps bit for bit against bitsandbytes'
// and against the formula it computes them with; the encoder against its definition
// (the count of thresholds below x) and against nearest-code rounding; the block
// functions' edge cases (all-zero and short blocks, NaN and inf, subnormal scales, no
// writes past the end); and the Highway kernels bitwise equal to the scalar
// references on every Highway target, AVX3_DL included (runtime/cpu/q8.cpp compiles it
// for its VBMI decoder: this test must list it too, so it asks Highway for it alike).
#define HWY_WANT_AVX3_DL 1
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "hwy_targets.hpp"
#include "runtime/cpu/q8.hpp"

namespace stepfuse {
namespace {

using cpu::kQ8Block;
using cpu::Q8Map;
using test::bits;
using test::from_bits;
using test::PerTarget;
using test::targets;

// Generated from bitsandbytes 0.50.2's create_dynamic_map(signed=True) and
// create_dynamic_map(signed=False) (torch on an AVX-512 CPU), printed with float.hex().
constexpr float kBnbSigned[256] = {
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
constexpr float kBnbUnsigned[256] = {
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

const Q8Map kMaps[] = {Q8Map::signed_dynamic, Q8Map::unsigned_dynamic};
std::string name(Q8Map map) { return map == Q8Map::signed_dynamic ? "signed" : "unsigned"; }
const float* bnb(Q8Map map) { return map == Q8Map::signed_dynamic ? kBnbSigned : kBnbUnsigned; }
std::size_t blocks(std::size_t n) { return (n + kQ8Block - 1) / kQ8Block; }

// The definition: the number of thresholds below x.
unsigned count_below(float x, Q8Map map) {
  const float* t = cpu::q8_thresholds(map);
  unsigned k = 0;
  for (int j = 0; j < 255; ++j) k += x > t[j];
  return k;
}

// create_dynamic_map as bitsandbytes computes it: per exponent level i, the fp32 means
// of neighbours of torch.linspace(0.1, 1, n, dtype=float32), times fp32(10^(i-6)) in
// fp32 (the tensor-times-Python-scalar product), then 0 and 1 added and all sorted.
// torch's CPU linspace on its AVX2 / AVX-512 paths: step = (end - start) / (n - 1), and
// element j = fma(step, j, start) in the first half, fma(-step, n - 1 - j, end) in the
// second (its scalar path rounds the product first, which changes some values).
std::vector<float> dynamic_map(bool is_signed) {
  const double scales[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const float start = 0.1f, end = 1.0f, step = (end - start) / static_cast<float>(n - 1);
    std::vector<float> b(n);
    for (int j = 0; j < n; ++j)
      b[j] = j < n / 2 ? std::fma(step, static_cast<float>(j), start)
                       : std::fma(-step, static_cast<float>(n - 1 - j), end);
    const float scale = static_cast<float>(scales[i]);
    for (int j = 0; j + 1 < n; ++j) data.push_back((b[j] + b[j + 1]) / 2.0f * scale);
    if (is_signed)
      for (int j = 0; j + 1 < n; ++j) data.push_back((b[j] + b[j + 1]) / 2.0f * -scale);
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  return data;
}

TEST(Q8Map, BitwiseEqualToBitsandbytes) {
  for (Q8Map map : kMaps) {
    const float* code = cpu::q8_code(map);
    for (int k = 0; k < 256; ++k) ASSERT_EQ(bits(code[k]), bits(bnb(map)[k])) << name(map) << " code " << k;
  }
}

TEST(Q8Map, IsBitsandbytesFormula) {
  for (Q8Map map : kMaps) {
    const std::vector<float> want = dynamic_map(map == Q8Map::signed_dynamic);
    ASSERT_EQ(want.size(), 256u);
    for (int k = 0; k < 256; ++k) ASSERT_EQ(bits(cpu::q8_code(map)[k]), bits(want[k])) << name(map) << " code " << k;
  }
}

TEST(Q8Map, AscendingDistinctWithZeroAndOne) {
  for (Q8Map map : kMaps) {
    const float* code = cpu::q8_code(map);
    for (int k = 1; k < 256; ++k) ASSERT_LT(code[k - 1], code[k]) << name(map) << " code " << k;
    EXPECT_EQ(bits(code[255]), bits(1.0f)) << name(map);
  }
  const float* s = cpu::q8_code(Q8Map::signed_dynamic);
  EXPECT_EQ(bits(s[127]), bits(0.0f));
  EXPECT_LT(s[0], -0.99f);
  EXPECT_GT(s[0], -1.0f);  // bitsandbytes' signed map has 1.0 but not -1.0
  const float* u = cpu::q8_code(Q8Map::unsigned_dynamic);
  EXPECT_EQ(bits(u[0]), bits(0.0f));
  for (int k = 0; k < 256; ++k) EXPECT_FALSE(std::signbit(u[k])) << "unsigned code " << k;
}

TEST(Q8Map, ThresholdsAreTheNearestFloatsToTheMidpoints) {
  for (Q8Map map : kMaps) {
    const float* code = cpu::q8_code(map);
    const float* t = cpu::q8_thresholds(map);
    for (int k = 0; k < 255; ++k) {
      const double mid = (static_cast<double>(code[k]) + static_cast<double>(code[k + 1])) / 2;
      ASSERT_EQ(bits(t[k]), bits(static_cast<float>(mid))) << name(map) << " threshold " << k;
      // No float lies nearer the midpoint.
      ASSERT_LE(std::fabs(t[k] - mid), std::fabs(std::nextafter(t[k], INFINITY) - mid));
      ASSERT_LE(std::fabs(t[k] - mid), std::fabs(std::nextafter(t[k], -INFINITY) - mid));
      ASSERT_LT(code[k], t[k]);
      ASSERT_LT(t[k], code[k + 1]);
    }
  }
}

// Encodes xs with the scalar reference and with q8_encode on every target, and checks
// both against the definition.
void expect_encodes_as_defined(const std::vector<float>& xs, Q8Map map) {
  std::vector<std::uint8_t> want(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) {
    want[i] = cpu::q8_encode_scalar(xs[i], map);
    ASSERT_EQ(want[i], count_below(xs[i], map)) << name(map) << " x = " << std::hexfloat << xs[i];
  }
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    std::vector<std::uint8_t> got(xs.size() + 1, 0xA5);
    cpu::q8_encode(xs.data(), got.data(), xs.size(), map);
    for (std::size_t i = 0; i < xs.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << hwy::TargetName(target) << " " << name(map) << " x = " << std::hexfloat << xs[i];
    ASSERT_EQ(got[xs.size()], 0xA5) << "wrote past the end";
  }
}

// The values of xs in [-1, 1] through q8_quantize's path for finite blocks on every
// target: blocks of 1.0 and 255 of the values, so that 1 / absmax is 1 and the
// normalized values are the values; each must take the code `want` gives it.
void expect_block_codes_as_encoded(const std::vector<float>& xs, const std::vector<std::uint8_t>& want, Q8Map map) {
  std::vector<float> blocked;
  std::vector<std::uint8_t> blocked_want;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    if (blocked.size() % kQ8Block == 0) {
      blocked.push_back(1.0f);
      blocked_want.push_back(255);
    }
    if (std::fabs(xs[i]) > 1.0f) continue;
    blocked.push_back(xs[i]);
    blocked_want.push_back(want[i]);
  }
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    std::vector<std::uint8_t> codes(blocked.size());
    std::vector<float> absmax(blocks(blocked.size()));
    cpu::q8_quantize(blocked.data(), codes.data(), absmax.data(), blocked.size(), map);
    for (std::size_t i = 0; i < blocked.size(); ++i)
      ASSERT_EQ(codes[i], blocked_want[i]) << hwy::TargetName(target) << " " << name(map) << " x = " << std::hexfloat
                                           << blocked[i];
  }
}

TEST(Q8Encode, EveryCodeRoundTrips) {
  for (Q8Map map : kMaps) {
    const float* code = cpu::q8_code(map);
    std::vector<float> xs(code, code + 256);
    for (int k = 0; k < 256; ++k) ASSERT_EQ(cpu::q8_encode_scalar(code[k], map), k) << name(map);
    expect_encodes_as_defined(xs, map);
  }
}

TEST(Q8Encode, ThresholdsTakeTheLowerCode) {
  for (Q8Map map : kMaps) {
    const float* t = cpu::q8_thresholds(map);
    std::vector<float> xs;
    for (int k = 0; k < 255; ++k) {
      ASSERT_EQ(cpu::q8_encode_scalar(t[k], map), k) << name(map);
      ASSERT_EQ(cpu::q8_encode_scalar(std::nextafter(t[k], INFINITY), map), k + 1) << name(map);
      ASSERT_EQ(cpu::q8_encode_scalar(std::nextafter(t[k], -INFINITY), map), k) << name(map);
      float below = t[k], above = t[k];
      for (int step = 0; step < 3; ++step) {
        xs.push_back(below);
        xs.push_back(above);
        below = std::nextafter(below, -INFINITY);
        above = std::nextafter(above, INFINITY);
      }
    }
    expect_encodes_as_defined(xs, map);
    // The same, negated, and through the blocks' path: the values nearest the thresholds
    // are where the encoders' shortcuts (the AVX-512 one's line through each decade)
    // could go wrong.
    for (std::size_t i = 0, n = xs.size(); i < n; ++i) xs.push_back(-xs[i]);
    std::vector<std::uint8_t> want(xs.size());
    for (std::size_t i = 0; i < xs.size(); ++i) want[i] = static_cast<std::uint8_t>(count_below(xs[i], map));
    expect_encodes_as_defined(xs, map);
    expect_block_codes_as_encoded(xs, want, map);
  }
}

TEST(Q8Encode, SpecialValues) {
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, from_bits(0x7F800001), from_bits(0xFFFFFFFF),
                            FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, FLT_TRUE_MIN, -FLT_TRUE_MIN, 1.0f, -1.0f,
                            std::nextafter(1.0f, 2.0f), std::nextafter(-1.0f, -2.0f), 2.0f, -2.0f, 1e-7f, -1e-7f};
  for (Q8Map map : kMaps) {
    const bool is_signed = map == Q8Map::signed_dynamic;
    EXPECT_EQ(cpu::q8_encode_scalar(NAN, map), 0);
    EXPECT_EQ(cpu::q8_encode_scalar(INFINITY, map), 255);
    EXPECT_EQ(cpu::q8_encode_scalar(-INFINITY, map), 0);
    EXPECT_EQ(cpu::q8_encode_scalar(0.0f, map), is_signed ? 127 : 0);
    EXPECT_EQ(cpu::q8_encode_scalar(-0.0f, map), is_signed ? 127 : 0);
    expect_encodes_as_defined(std::vector<float>(std::begin(specials), std::end(specials)), map);
  }
}

// Every float in [-1.01, 1.01] whose bit pattern is a multiple of a stride (both signs),
// on every target: about two million values per map.
TEST(Q8Encode, SteppedThroughTheBitPatterns) {
  const std::uint32_t top = bits(1.01f), stride = 997;
  std::vector<float> xs;
  for (std::uint32_t u = 0; u <= top; u += stride) {
    xs.push_back(from_bits(u));
    xs.push_back(from_bits(u | 0x80000000u));
  }
  for (Q8Map map : kMaps) {
    std::vector<std::uint8_t> want(xs.size());
    for (std::size_t i = 0; i < xs.size(); ++i) want[i] = cpu::q8_encode_scalar(xs[i], map);
    // The definition, by a binary search of its own (count_below on each would be slow).
    const float* t = cpu::q8_thresholds(map);
    for (std::size_t i = 0; i < xs.size(); ++i)
      ASSERT_EQ(want[i], std::lower_bound(t, t + 255, xs[i]) - t) << name(map) << " x = " << std::hexfloat << xs[i];
    for (std::int64_t target : targets()) {
      PerTarget scope(target);
      std::vector<std::uint8_t> got(xs.size());
      cpu::q8_encode(xs.data(), got.data(), xs.size(), map);
      for (std::size_t i = 0; i < xs.size(); ++i)
        ASSERT_EQ(got[i], want[i]) << hwy::TargetName(target) << " " << name(map) << " x = " << std::hexfloat << xs[i];
    }
    expect_block_codes_as_encoded(xs, want, map);
  }
}

// Against an independent reference that does not use the thresholds: the code nearest
// x, found by comparing |x - code[j]| in double (exact for the codes around x). The
// encoder may differ only where x is the threshold itself and lies above the exact
// midpoint (the float nearest an inexact midpoint rounded up), or where x is an exact
// midpoint (a tie, which takes the lower code).
TEST(Q8Encode, AgreesWithNearestCodeExceptAtMidpoints) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> uniform(-1.05f, 1.05f);
  std::uniform_int_distribution<std::uint32_t> small_bits(0, bits(1.05f));
  for (Q8Map map : kMaps) {
    const float* code = cpu::q8_code(map);
    const float* t = cpu::q8_thresholds(map);
    std::vector<float> xs;
    for (int i = 0; i < 200000; ++i) xs.push_back(uniform(rng));
    for (int i = 0; i < 200000; ++i) xs.push_back(from_bits(small_bits(rng) | (i % 2 ? 0x80000000u : 0u)));
    for (int k = 0; k < 255; ++k) {
      float x = std::nextafter(std::nextafter(t[k], -INFINITY), -INFINITY);
      for (int i = 0; i < 5; ++i, x = std::nextafter(x, INFINITY)) xs.push_back(x);  // t[k] and 2 floats each side
    }
    for (int k = 0; k < 256; ++k) xs.push_back(code[k]);
    int threshold_cases = 0;
    for (float x : xs) {
      int nearest = 0;
      bool tie = false;
      for (int j = 1; j < 256; ++j) {
        const double dj = std::fabs(static_cast<double>(x) - code[j]);
        const double dn = std::fabs(static_cast<double>(x) - code[nearest]);
        if (dj < dn) nearest = j, tie = false;
        else if (dj == dn) tie = true;
      }
      // nearest is the lower of two tied codes, as the encoder's choice.
      const int got = cpu::q8_encode_scalar(x, map);
      if (got == nearest) continue;
      ASSERT_FALSE(tie) << name(map) << " x = " << std::hexfloat << x;
      ASSERT_EQ(got + 1, nearest) << name(map) << " x = " << std::hexfloat << x;
      ASSERT_EQ(bits(x), bits(t[got])) << name(map) << " x = " << std::hexfloat << x << " is not a threshold";
      ASSERT_GT(static_cast<double>(x), (static_cast<double>(code[got]) + code[got + 1]) / 2);
      ++threshold_cases;
    }
    // Some thresholds do round up (the test above sees them).
    EXPECT_GT(threshold_cases, 0) << name(map);
  }
}

// ---- blocks ----

// Quantizes with the scalar reference and with q8_quantize on every target, checking
// that they agree bitwise, write nothing past n codes and ceil(n / kQ8Block) absmaxes,
// and that both dequantizers agree too. Returns the scalar codes and absmaxes.
struct Quantized {
  std::vector<std::uint8_t> codes;
  std::vector<float> absmax;
};
Quantized quantize_everywhere(const std::vector<float>& x, Q8Map map) {
  const std::size_t n = x.size(), nb = blocks(n);
  Quantized want{std::vector<std::uint8_t>(n + 64, 0xA5), std::vector<float>(nb + 4, -7.0f)};
  cpu::q8_quantize_scalar(x.data(), want.codes.data(), want.absmax.data(), n, map);
  for (std::size_t i = n; i < n + 64; ++i) EXPECT_EQ(want.codes[i], 0xA5) << "scalar wrote past the codes";
  for (std::size_t b = nb; b < nb + 4; ++b) EXPECT_EQ(want.absmax[b], -7.0f) << "scalar wrote past the absmaxes";
  std::vector<float> want_out(n + 16, -3.0f);
  cpu::q8_dequantize_scalar(want.codes.data(), want.absmax.data(), want_out.data(), n, map);
  for (std::size_t i = n; i < n + 16; ++i) EXPECT_EQ(want_out[i], -3.0f) << "scalar wrote past the output";
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    const std::string where = std::string(hwy::TargetName(target)) + " " + name(map) + " n=" + std::to_string(n);
    Quantized got{std::vector<std::uint8_t>(n + 64, 0xA5), std::vector<float>(nb + 4, -7.0f)};
    cpu::q8_quantize(x.data(), got.codes.data(), got.absmax.data(), n, map);
    for (std::size_t b = 0; b < nb + 4; ++b)
      EXPECT_EQ(bits(got.absmax[b]), bits(want.absmax[b])) << where << " absmax " << b;
    for (std::size_t i = 0; i < n + 64; ++i) {
      EXPECT_EQ(got.codes[i], want.codes[i]) << where << " code " << i << " of x = " << std::hexfloat << x[i];
      if (got.codes[i] != want.codes[i]) break;
    }
    std::vector<float> out(n + 16, -3.0f);
    cpu::q8_dequantize(want.codes.data(), want.absmax.data(), out.data(), n, map);
    for (std::size_t i = 0; i < n + 16; ++i) {
      EXPECT_EQ(bits(out[i]), bits(want_out[i])) << where << " dequantized " << i;
      if (bits(out[i]) != bits(want_out[i])) break;
    }
  }
  want.codes.resize(n);
  want.absmax.resize(nb);
  return want;
}

std::vector<float> dequantize(const Quantized& q, Q8Map map) {
  std::vector<float> out(q.codes.size());
  cpu::q8_dequantize_scalar(q.codes.data(), q.absmax.data(), out.data(), out.size(), map);
  return out;
}

TEST(Q8Blocks, AllZeroBlocksStoreZero) {
  for (Q8Map map : kMaps) {
    std::vector<float> x(700, 0.0f);
    for (std::size_t i = 0; i < x.size(); i += 3) x[i] = -0.0f;
    const Quantized q = quantize_everywhere(x, map);
    for (float m : q.absmax) EXPECT_EQ(bits(m), bits(0.0f));
    for (std::uint8_t c : q.codes) ASSERT_EQ(cpu::q8_code(map)[c], 0.0f) << name(map);
    for (float y : dequantize(q, map)) ASSERT_EQ(y, 0.0f);
  }
}

TEST(Q8Blocks, EveryLengthAgreesAcrossTargets) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const std::size_t lengths[] = {0, 1, 3, 7, 8, 15, 16, 17, 31, 33, 100, 255, 256, 257, 300, 511, 512, 513, 1000, 4099};
  for (Q8Map map : kMaps) {
    for (std::size_t n : lengths) {
      std::vector<float> x(n);
      for (float& v : x) v = normal(rng) * 1e-3f;
      if (map == Q8Map::unsigned_dynamic)
        for (float& v : x) v = v * v;
      const Quantized q = quantize_everywhere(x, map);
      ASSERT_EQ(q.absmax.size(), blocks(n));
      // The short last block's absmax is its own elements' (the padding counts nothing).
      for (std::size_t b = 0; b < q.absmax.size(); ++b) {
        float m = 0.0f;
        for (std::size_t i = b * kQ8Block; i < std::min(n, (b + 1) * kQ8Block); ++i) m = std::max(m, std::fabs(x[i]));
        EXPECT_EQ(bits(q.absmax[b]), bits(m)) << name(map) << " n=" << n << " block " << b;
      }
    }
  }
}

// |dequantized - x| is at most half the gap between the codes around x / absmax, times
// absmax (plus the roundings of x * (1 / absmax) and code * absmax, and the encoder's
// threshold rounded up by half an ulp).
void expect_within_half_a_gap(const std::vector<float>& x, const Quantized& q, Q8Map map) {
  const float* code = cpu::q8_code(map);
  const std::vector<float> y = dequantize(q, map);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double m = q.absmax[i / kQ8Block];
    ASSERT_TRUE(std::isfinite(y[i]));
    const double v = std::isnan(x[i]) ? 0.0 : std::clamp(static_cast<double>(x[i]), -double{FLT_MAX}, double{FLT_MAX});
    if (m == 0) {
      ASSERT_EQ(y[i], 0.0f);
      continue;
    }
    const double r = v / m;
    const float* upper = std::lower_bound(code, code + 256, r, [](float c, double y) { return c < y; });
    double half_gap;
    if (upper == code) half_gap = code[0] - r;
    else if (upper == code + 256) half_gap = r - code[255];
    else half_gap = (static_cast<double>(upper[0]) - upper[-1]) / 2;
    const double tolerance = m * (std::fabs(half_gap) * (1 + 0x1.0p-20) + std::ldexp(std::fabs(r), -21)) +
                             std::ldexp(std::fabs(v), -22) + FLT_TRUE_MIN;
    ASSERT_LE(std::fabs(static_cast<double>(y[i]) - v), tolerance)
        << name(map) << " x = " << std::hexfloat << x[i] << " absmax " << m << " dequantized " << y[i];
  }
}

TEST(Q8Blocks, RoundTripIsWithinHalfACodeGap) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  // Blocks at scales from just above the subnormal range to near overflow.
  const float scales[] = {1.0f, 1e-3f, 3e-8f, 1e-30f, 2e-37f, 1e30f, 1e37f, 0x1.0p-126f};
  for (Q8Map map : kMaps) {
    std::vector<float> x;
    for (float s : scales) {
      for (std::size_t i = 0; i < kQ8Block; ++i) x.push_back(normal(rng) * s);
      for (std::size_t i = 0; i < kQ8Block; ++i) x.push_back(uniform(rng) * s);
      // Heavy tails: most values far below the block's absmax.
      for (std::size_t i = 0; i < kQ8Block; ++i)
        x.push_back(std::ldexp(uniform(rng), -static_cast<int>(rng() % 40)) * s);
    }
    x.resize(x.size() - 91);  // a short last block
    if (map == Q8Map::unsigned_dynamic)
      for (float& v : x) v = std::fabs(v);
    const Quantized q = quantize_everywhere(x, map);
    expect_within_half_a_gap(x, q, map);
  }
}

TEST(Q8Blocks, NanAndInfAreNeverStored) {
  for (Q8Map map : kMaps) {
    std::vector<float> x(3 * kQ8Block + 40, 0.25f);
    x[1] = NAN;                      // block 0: a NaN among finite values
    x[kQ8Block + 2] = INFINITY;      // block 1: inf -> FLT_MAX, the block's absmax
    x[kQ8Block + 3] = -INFINITY;
    x[kQ8Block + 4] = -NAN;
    for (std::size_t i = 2 * kQ8Block; i < 3 * kQ8Block; ++i) x[i] = NAN;  // block 2: only NaN
    x[3 * kQ8Block + 39] = -INFINITY;  // the short last block
    const Quantized q = quantize_everywhere(x, map);
    EXPECT_EQ(q.absmax[0], 0.25f);
    EXPECT_EQ(q.absmax[1], FLT_MAX);
    EXPECT_EQ(q.absmax[2], 0.0f);
    EXPECT_EQ(q.absmax[3], FLT_MAX);
    const float* code = cpu::q8_code(map);
    EXPECT_EQ(code[q.codes[1]], 0.0f);
    EXPECT_EQ(q.codes[kQ8Block + 2], 255);
    EXPECT_EQ(code[q.codes[kQ8Block + 3]], code[0]);
    EXPECT_EQ(code[q.codes[kQ8Block + 4]], 0.0f);
    const std::vector<float> y = dequantize(q, map);
    for (std::size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(y[i])) << name(map) << " element " << i;
    EXPECT_EQ(y[kQ8Block + 2], FLT_MAX);
    expect_within_half_a_gap(x, q, map);
  }
}

// absmax at most 2^-128: 1 / absmax would be inf, so the block scales by FLT_MAX
// (q8.hpp): zeros stay zero, the others within absmax, the same on every target.
// Just above 2^-128, 1 / absmax is finite and the usual bound holds.
TEST(Q8Blocks, SubnormalAbsmax) {
  for (Q8Map map : kMaps) {
    const auto subnormals = [&](std::uint32_t largest) {
      std::vector<float> x(2 * kQ8Block);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::uint32_t magnitude = i % 7 == 3 ? largest : static_cast<std::uint32_t>(i * 977 % largest);
        x[i] = from_bits(i % 5 == 0 ? 0 : magnitude) * (i % 2 && map == Q8Map::signed_dynamic ? -1.0f : 1.0f);
      }
      return x;
    };
    const std::vector<float> tiny = subnormals(bits(0x1.0p-128f));
    const Quantized q = quantize_everywhere(tiny, map);
    const std::vector<float> y = dequantize(q, map);
    for (std::size_t i = 0; i < tiny.size(); ++i) {
      ASSERT_EQ(q.absmax[i / kQ8Block], 0x1.0p-128f);
      ASSERT_TRUE(std::isfinite(y[i]));
      if (tiny[i] == 0.0f) {
        ASSERT_EQ(y[i], 0.0f) << name(map) << " element " << i;
      }
      ASSERT_LE(std::fabs(static_cast<double>(y[i]) - tiny[i]), q.absmax[i / kQ8Block])
          << name(map) << " element " << i;
    }
    for (std::uint32_t largest : {bits(0x1.0p-128f) + 1, bits(0x1.0p-127f), bits(0x1.fffffcp-127f)}) {
      const std::vector<float> x = subnormals(largest);
      expect_within_half_a_gap(x, quantize_everywhere(x, map), map);
    }
  }
}

// Every code at every position of a 64-code group (the AVX3_DL decoder's unit) and of a
// block, in blocks whose absmax is 1, -0 (a code times -0) and 3: each must decode to
// its code value times the absmax, bitwise, on every target.
TEST(Q8Blocks, EveryCodeDecodesAtEveryPosition) {
  const float scales[] = {1.0f, -0.0f, 3.0f};
  for (Q8Map map : kMaps) {
    std::vector<std::uint8_t> codes;
    std::vector<float> absmax;
    for (int round = 0; round < 5; ++round)
      for (float scale : scales) {
        for (std::size_t i = 0; i < kQ8Block; ++i) codes.push_back(static_cast<std::uint8_t>(i * (2 * round + 1) + 7 * round));
        absmax.push_back(scale);
      }
    codes.resize(codes.size() - 93);  // a short last block
    const float* code = cpu::q8_code(map);
    for (std::int64_t target : targets()) {
      PerTarget scope(target);
      std::vector<float> out(codes.size() + 16, -3.0f);
      cpu::q8_dequantize(codes.data(), absmax.data(), out.data(), codes.size(), map);
      for (std::size_t i = 0; i < codes.size(); ++i)
        ASSERT_EQ(bits(out[i]), bits(code[codes[i]] * absmax[i / kQ8Block]))
            << hwy::TargetName(target) << " " << name(map) << " element " << i << " code " << int{codes[i]};
      for (std::size_t i = codes.size(); i < out.size(); ++i) ASSERT_EQ(out[i], -3.0f) << "wrote past the end";
    }
  }
}

// The tests above run on every target this CPU has: AVX3_DL too where it has VBMI.
TEST(Q8Targets, AvxDlIsTestedWhereTheCpuHasIt) {
  if constexpr (!(HWY_TARGETS & HWY_AVX3_DL)) GTEST_SKIP() << "this build leaves AVX3_DL out (the sanitizer builds do)";
  if (!(hwy::SupportedTargets() & HWY_AVX3_DL)) GTEST_SKIP() << "this CPU has no AVX3_DL (AVX-512 VBMI)";
  const std::vector<std::int64_t> listed = targets();
  EXPECT_NE(std::find(listed.begin(), listed.end(), HWY_AVX3_DL), listed.end());
}

TEST(Q8Blocks, LargeRandomBlocksAgreeAcrossTargets) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (Q8Map map : kMaps) {
    // 64 blocks and a short one: normal values at random per-block scales, random bit
    // patterns (NaN, inf, subnormals included) in some blocks.
    std::vector<float> x(64 * kQ8Block + 77);
    for (std::size_t b = 0; b < blocks(x.size()); ++b) {
      const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 200) - 120);
      for (std::size_t i = b * kQ8Block; i < std::min(x.size(), (b + 1) * kQ8Block); ++i)
        x[i] = b % 8 == 7 ? from_bits(static_cast<std::uint32_t>(rng())) : normal(rng) * scale;
    }
    quantize_everywhere(x, map);
  }
}

}  // namespace
}  // namespace stepfuse
