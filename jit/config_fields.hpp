// Field-by-field access to an optimizer config, by PyTorch name (checkpoints,
// LossScaleOptimizer's hyperparameters). Booleans are visited as bool&, the rest
// as double&, in declaration order.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>
#include <variant>

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

// The number of members of a flat aggregate (no bases, no arrays): how many
// initializers T{...} accepts. Checks that a field list names every member.
struct AnyMember {
  template <class T>
  constexpr operator T() const { return T{}; }
};
template <class T, class... Inits>
constexpr std::size_t aggregate_members() {
  if constexpr (requires { T{Inits{}..., AnyMember{}}; })
    return aggregate_members<T, Inits..., AnyMember>();
  else
    return sizeof...(Inits);
}

template <class Config, class F>
constexpr void for_each_field(Config& c, F&& f) {
  using T = std::remove_const_t<Config>;
  f("lr", c.lr);
  if constexpr (std::is_same_v<T, optim::SGD>) {
    f("momentum", c.momentum), f("dampening", c.dampening), f("weight_decay", c.weight_decay);
    f("nesterov", c.nesterov);
  } else if constexpr (std::is_same_v<T, optim::Adam> || std::is_same_v<T, optim::AdamW>) {
    f("beta1", c.beta1), f("beta2", c.beta2), f("eps", c.eps), f("weight_decay", c.weight_decay);
    f("amsgrad", c.amsgrad);
  } else if constexpr (std::is_same_v<T, optim::Adagrad>) {
    f("lr_decay", c.lr_decay), f("weight_decay", c.weight_decay);
    f("initial_accumulator_value", c.initial_accumulator_value), f("eps", c.eps);
  } else if constexpr (std::is_same_v<T, optim::RMSprop>) {
    f("alpha", c.alpha), f("eps", c.eps), f("weight_decay", c.weight_decay), f("momentum", c.momentum);
    f("centered", c.centered);
  } else {
    static_assert(std::is_same_v<T, optim::Lion>, "a config type without a field list");
    f("beta1", c.beta1), f("beta2", c.beta2), f("weight_decay", c.weight_decay);
  }
  f("maximize", c.maximize);
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
