// Model-shaped tensor lists for the benchmarks: named presets, flat:N, and the user's own lists (shapes files).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stepfuse::bench {

// One parameter tensor of a model: its name, element count and, where known, its dims
// (their product is numel). Param groups split by rank, as transformer recipes do: 1-D
// tensors (biases, norms) go without weight decay (bench/param_groups.hpp).
struct TensorShape {
  TensorShape() = default;
  // (A constructor, not an aggregate: {name, numel} without dims draws -Wmissing-field-initializers.)
  TensorShape(std::string name_, std::int64_t numel_, std::vector<std::int64_t> dims_ = {})
      : name(std::move(name_)), numel(numel_), dims(std::move(dims_)) {}

  std::string name;
  std::int64_t numel = 0;
  std::vector<std::int64_t> dims;  // empty: given as an element count alone, which is a 1-D tensor

  // Dims given: 2 or more make a matrix (or a convolution's weight); a count alone is 1-D.
  bool is_matrix() const { return dims.size() >= 2; }
};

struct Preset {
  std::string name;         // as given on the command line, e.g. "gpt2-124m" or "flat:1000000";
                            // for a shapes file, the file's path
  std::string description;  // one line for --help and the report
  std::vector<TensorShape> tensors;

  std::int64_t total_numel() const;
};

// The preset `spec` names: "gpt2-124m", "resnet50", "llama7b-layer", "many-small", or
// "flat:N" (one tensor of N elements, N > 0; N may use a k/M/G suffix, powers of 1000).
// A named preset's tensor and parameter counts are checked against the ones its
// description states (std::logic_error if they ever differ).
// Throws std::invalid_argument with a message naming `spec` for anything else.
Preset make_preset(std::string_view spec);

// The names make_preset accepts, with their descriptions (for --help).
std::vector<std::pair<std::string, std::string>> preset_catalog();

// A tensor list read from a shapes file, one tensor per line:
//   [NAME] COUNT      or      [NAME] D0xD1[x...]
// COUNT is an element count >= 0 with an optional k/M/G suffix (powers of 1000, as in
// flat:N): a 1-D tensor. D0xD1... are the dims of a tensor of rank 2 or more (each a
// count as COUNT is; their product is the element count), e.g. 50257x768. NAME is any
// word without whitespace, and a tensor without one is named "t<index>" (index from 0,
// in file order). Blank lines and everything from a '#' to the end of a line are
// ignored. Names must be unique and the list must hold at least one element. This is
// the format format_shapes() writes. Reads the whole file; throws std::invalid_argument
// "PATH:LINE: what is wrong" (or "PATH: ..." for the file as a whole).
Preset load_shapes_file(const std::string& path);

// `tensors` as a shapes file, in order: "NAME COUNT" per line (what --print-shapes
// prints, and bench/peers reads), or with `dims`, "NAME D0xD1..." for the tensors of
// rank 2 or more (what --print-shapes --groups prints). load_shapes_file reads either
// back to the same list (the first without the dims).
std::string format_shapes(const std::vector<TensorShape>& tensors, bool dims = false);

}  // namespace stepfuse::bench
