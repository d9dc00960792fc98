// Test support: the float bit patterns the conversion and rounding tests compare,
// and the Highway targets their results must agree across.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "hwy/targets.h"

namespace stepfuse::test {

inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Every Highway target compiled in and supported by this CPU.
inline std::vector<std::int64_t> targets() {
  std::vector<std::int64_t> out;
  for (std::int64_t t : hwy::SupportedAndGeneratedTargets()) out.push_back(t);
  return out;
}

// Dispatches to `target` while in scope.
class PerTarget {
 public:
  explicit PerTarget(std::int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~PerTarget() { hwy::SetSupportedTargetsForTest(0); }
  PerTarget(const PerTarget&) = delete;
  PerTarget& operator=(const PerTarget&) = delete;
};

}  // namespace stepfuse::test
