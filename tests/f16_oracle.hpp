// The tests' f16 oracle, independent of the library: the compiler's _Float16 where it has
// one (g++ 12), else the F16C conversion instructions (clang 14 has no _Float16 on
// x86-64). Both convert correctly rounded, to nearest even, subnormals kept.
#pragma once

#include <cstdint>
#include <cstring>

#if !defined(__FLT16_MAX__)
#if !defined(__x86_64__)
#error "the f16 test oracle needs _Float16 or x86-64's F16C instructions"
#endif
#include <immintrin.h>
#endif

namespace stepfuse::test {

#if defined(__FLT16_MAX__)
inline std::uint16_t oracle_float_to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float oracle_f16_to_float(std::uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}
#else
__attribute__((target("f16c"))) inline std::uint16_t oracle_float_to_f16(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
__attribute__((target("f16c"))) inline float oracle_f16_to_float(std::uint16_t b) { return _cvtsh_ss(b); }
#endif

}  // namespace stepfuse::test
