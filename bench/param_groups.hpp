// The two param groups transformer recipes use, for the benchmarks: weight decay on matrices, none on 1-D tensors.
//
// As in the usual PyTorch recipe (decay = [p for p in params if p.dim() >= 2], no_decay = the
// rest; AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0}])): biases and
// norms, the 1-D tensors, get weight_decay = 0, everything else the optimizer's own. The
// benchmarks put the tensor list in group order (matrices first), so that the optimizer's
// params() and the buffers list the tensors in the same order, with one group or two.
#pragma once

#include <algorithm>
#include <cstddef>
#include <variant>
#include <vector>

#include "presets.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse::bench {

// Reorders `tensors` into group order: the matrices (TensorShape::is_matrix), then the 1-D
// tensors, each in their original order. Returns how many matrices there are: the decay
// group is tensors [0, that), the no-decay group the rest.
inline std::size_t to_group_order(std::vector<TensorShape>& tensors) {
  const auto mid = std::stable_partition(tensors.begin(), tensors.end(), [](const TensorShape& t) { return t.is_matrix(); });
  return static_cast<std::size_t>(mid - tensors.begin());
}

// `config` with weight_decay = 0: the no-decay group's config. An optimizer without a
// weight_decay hyperparameter keeps its config (both groups then run the same one).
inline OptimizerConfig without_weight_decay(OptimizerConfig config) {
  std::visit(
      [](auto& c) {
        if constexpr (requires { c.weight_decay; }) c.weight_decay = 0;
      },
      config);
  return config;
}

// The weight decay of `config` (0 for an optimizer without one), for reports.
inline double weight_decay_of(const OptimizerConfig& config) {
  return std::visit(
      [](const auto& c) -> double {
        if constexpr (requires { c.weight_decay; }) return c.weight_decay;
        return 0.0;
      },
      config);
}

// The two groups over `params` (in group order): [0, split) with `config`, [split, end)
// with it without weight decay. Both must be non-empty (the library rejects an empty group).
inline std::vector<ParamGroup> decay_groups(const std::vector<Param>& params, std::size_t split,
                                            const OptimizerConfig& config) {
  const auto mid = params.begin() + static_cast<std::ptrdiff_t>(split);
  return {{std::vector<Param>(params.begin(), mid), config},
          {std::vector<Param>(mid, params.end()), without_weight_decay(config)}};
}

}  // namespace stepfuse::bench
