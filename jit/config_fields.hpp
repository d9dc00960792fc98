// Field-by-field access to an optimizer config, by PyTorch name (checkpoints, the
// C ABI, LossScaleOptimizer's hyperparameters), from each optimizer's traits.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>
#include <variant>

#include "jit/builtin/registry.hpp"
#include "stepfuse/optim.hpp"

namespace stepfuse::jit {

// The built-in optimizer kinds are the alternatives of OptimizerConfig, in order:
// sf_optimizer_kind and the checkpoints' kinds are these indices.
inline constexpr std::size_t kNumOptimizers = std::variant_size_v<OptimizerConfig>;

// The kind-th config with PyTorch's defaults; kind < kNumOptimizers.
inline OptimizerConfig default_config(std::size_t kind) {
  return [&]<std::size_t... K>(std::index_sequence<K...>) {
    static constexpr OptimizerConfig (*kMake[])() = {[] { return OptimizerConfig(std::in_place_index<K>); }...};
    return kMake[kind]();
  }(std::make_index_sequence<kNumOptimizers>{});
}

// Calls f(name, member) for every member of the config, in declaration order:
// booleans as bool&, the rest as double& (const if the config is).
template <class Config, class F>
constexpr void for_each_field(Config& c, F&& f) {
  OptimizerTraits<std::remove_const_t<Config>>::fields(c, f);
}

// A numeric (double) field of the config by name, or null.
inline double* find_number(OptimizerConfig& config, std::string_view name) {
  double* found = nullptr;
  std::visit(
      [&](auto& c) {
        for_each_field(c, [&](std::string_view n, auto& v) {
          if constexpr (std::is_same_v<std::remove_reference_t<decltype(v)>, double>)
            if (n == name) found = &v;
        });
      },
      config);
  return found;
}

}  // namespace stepfuse::jit
