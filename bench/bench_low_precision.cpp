// Google Benchmark suite of the low-precision codecs alone, on one thread: the q8 state
// codec (runtime/cpu/q8.hpp) and stochastic rounding's random bits (runtime/cpu/kernels.hpp).
//
// The fused step with q8 state decodes each 256-element block of a stream to fp32,
// updates it, and encodes it back (the block's absmax, then one code per element); with
// stochastically rounded bf16 weights it draws 16 random bits per weight (Philox4x32-10,
// one call per 8 weights). On a CPU with a few cores these, not memory, set the step's
// speed, so they are timed here by themselves:
//
//   q8/dequantize/<signed|unsigned>   codes and absmaxes -> fp32
//   q8/quantize/<signed|unsigned>     fp32 -> absmaxes and codes (every block finite: the fast path)
//   sr/rounding_bits                  the random bits of 64 Ki consecutive weights
//
// over 64 Ki elements (at most 320 KiB in all, as a thread's share of the step keeps in
// L2), so the figures are compute, not memory. The q8 values are an Adam moment's kind:
// normally distributed (signed) or their squares (unsigned), scaled per block over six
// decades. Before timing, each case checks its result bitwise against the scalar
// reference. items_per_second = elements per second; ns per element = 1e9 / it.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "jit/stochastic_round.h"
#include "runtime/cpu/kernels.hpp"
#include "runtime/cpu/q8.hpp"

namespace cpu = stepfuse::cpu;

namespace {

constexpr std::size_t kElems = 64 * 1024;

std::vector<float> moment_values(cpu::Q8Map map) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decades(-6.0f, 0.0f);
  std::vector<float> x(kElems);
  float scale = 1.0f;
  for (std::size_t i = 0; i < kElems; ++i) {
    if (i % cpu::kQ8Block == 0) scale = std::pow(10.0f, decades(rng));
    const float v = normal(rng);
    x[i] = (map == cpu::Q8Map::signed_dynamic ? v : v * v) * scale;
  }
  return x;
}

const char* map_name(cpu::Q8Map map) { return map == cpu::Q8Map::signed_dynamic ? "signed" : "unsigned"; }

void quantize(benchmark::State& state, cpu::Q8Map map) {
  const std::vector<float> x = moment_values(map);
  std::vector<std::uint8_t> codes(kElems), ref_codes(kElems);
  std::vector<float> absmax(cpu::q8_blocks(kElems)), ref_absmax(absmax.size());
  cpu::q8_quantize(x.data(), codes.data(), absmax.data(), kElems, map);
  cpu::q8_quantize_scalar(x.data(), ref_codes.data(), ref_absmax.data(), kElems, map);
  if (codes != ref_codes || std::memcmp(absmax.data(), ref_absmax.data(), absmax.size() * sizeof(float)) != 0) {
    state.SkipWithError("q8_quantize differs from the scalar reference");
    return;
  }
  for (auto _ : state) {
    cpu::q8_quantize(x.data(), codes.data(), absmax.data(), kElems, map);
    benchmark::DoNotOptimize(codes.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kElems));
}

void dequantize(benchmark::State& state, cpu::Q8Map map) {
  const std::vector<float> x = moment_values(map);
  std::vector<std::uint8_t> codes(kElems);
  std::vector<float> absmax(cpu::q8_blocks(kElems)), out(kElems), ref(kElems);
  cpu::q8_quantize(x.data(), codes.data(), absmax.data(), kElems, map);
  cpu::q8_dequantize(codes.data(), absmax.data(), out.data(), kElems, map);
  cpu::q8_dequantize_scalar(codes.data(), absmax.data(), ref.data(), kElems, map);
  if (std::memcmp(out.data(), ref.data(), kElems * sizeof(float)) != 0) {
    state.SkipWithError("q8_dequantize differs from the scalar reference");
    return;
  }
  for (auto _ : state) {
    cpu::q8_dequantize(codes.data(), absmax.data(), out.data(), kElems, map);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kElems));
}

void rounding_bits(benchmark::State& state) {
  const std::uint64_t seed = 0x9E3779B97F4A7C15ull, step = 12, first = 1000;
  std::vector<std::uint16_t> bits(kElems);
  cpu::rounding_bits(seed, step, first, kElems, bits.data());
  for (std::size_t i = 0; i < kElems; ++i)
    if (bits[i] != sf_sr_bits(seed, step, first + i)) {
      state.SkipWithError("rounding_bits differs from the scalar reference");
      return;
    }
  for (auto _ : state) {
    cpu::rounding_bits(seed, step, first, kElems, bits.data());
    benchmark::DoNotOptimize(bits.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kElems));
}

const bool registered = [] {
  benchmark::RegisterBenchmark("sr/rounding_bits", rounding_bits);
  for (const cpu::Q8Map map : {cpu::Q8Map::signed_dynamic, cpu::Q8Map::unsigned_dynamic}) {
    benchmark::RegisterBenchmark((std::string("q8/dequantize/") + map_name(map)).c_str(), dequantize, map);
    benchmark::RegisterBenchmark((std::string("q8/quantize/") + map_name(map)).c_str(), quantize, map);
  }
  return true;
}();

}  // namespace
