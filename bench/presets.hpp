// Model-shaped tensor lists for the benchmarks: named presets and flat:N.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace stepfuse::bench {

// One parameter tensor of a model: its name and element count.
struct TensorShape {
  std::string name;
  std::int64_t numel = 0;
};

struct Preset {
  std::string name;         // as given on the command line, e.g. "gpt2-124m" or "flat:1000000"
  std::string description;  // one line for --help and the report
  std::vector<TensorShape> tensors;

  std::int64_t total_numel() const;
};

// The preset `spec` names: "gpt2-124m", "llama7b-layer", "many-small", or "flat:N"
// (one tensor of N elements, N > 0; N may use a k/M/G suffix, powers of 1000).
// Throws std::invalid_argument with a message naming `spec` for anything else.
Preset make_preset(std::string_view spec);

// The names make_preset accepts, with their descriptions (for --help).
std::vector<std::pair<std::string, std::string>> preset_catalog();

}  // namespace stepfuse::bench
