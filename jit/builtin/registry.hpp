// The registry of built-in optimizers: every program file, and the flat list of
// built-in programs, each optimizer's place in it, and the checks derived from them.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

// One line per optimizer: its program file, which specialises OptimizerTraits for
// its config types (the alternatives of OptimizerConfig, include/stepfuse/optim.hpp).
#include "jit/builtin/sgd.hpp"
#include "jit/builtin/adam.hpp"  // Adam and AdamW
#include "jit/builtin/adagrad.hpp"
#include "jit/builtin/rmsprop.hpp"
#include "jit/builtin/lion.hpp"
#include "jit/builtin/nadam.hpp"
#include "jit/builtin/radam.hpp"
#include "jit/builtin/adamax.hpp"
#include "jit/builtin/adadelta.hpp"
#include "jit/builtin/rprop.hpp"
#include "jit/builtin/asgd.hpp"
#include "jit/builtin/lamb.hpp"

#include "jit/builtins.hpp"

namespace stepfuse::jit {

// The K-th optimizer kind, in OptimizerConfig's order (sf_optimizer_kind, checkpoints).
template <std::size_t K>
using ConfigAt = std::variant_alternative_t<K, OptimizerConfig>;

// Calls f(std::type_identity<Config>{}) for every config type, in OptimizerConfig's order.
template <class F>
constexpr void for_each_optimizer(F&& f) {
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    (f(std::type_identity<ConfigAt<K>>{}), ...);
  }(std::make_index_sequence<std::variant_size_v<OptimizerConfig>>{});
}

namespace registry_detail {

inline constexpr std::size_t kMaxBuiltins = 64;  // Builtin is a std::uint8_t; `none` is 0xff

struct ProgramList {
  const Program* programs[kMaxBuiltins] = {};
  std::size_t size = 0;
  // By name (names are unique), not by address: g++ does not fold an address
  // comparison of two globals in a constant expression under AddressSanitizer.
  constexpr int find(const Program* p) const {
    for (std::size_t i = 0; i < size; ++i)
      if (programs[i]->name == p->name) return static_cast<int>(i);
    return -1;
  }
};

// Every optimizer's programs in registry order, each once (AdamW's are Adam's).
constexpr ProgramList collect_programs() {
  ProgramList list;
  for_each_optimizer([&](auto config) {
    for (const Program* p : OptimizerTraits<typename decltype(config)::type>::programs)
      if (list.find(p) < 0) list.programs[list.size++] = p;
  });
  return list;
}
inline constexpr ProgramList kPrograms = collect_programs();

}  // namespace registry_detail

// Every built-in program: Builtin b is kBuiltinPrograms[b]. The order (the
// registry's, then each optimizer's `programs`) indexes the CPU backend's fused
// kernels (runtime/cpu/update_kernels-inl.h).
inline constexpr auto kBuiltinPrograms = [] {
  std::array<const Program*, registry_detail::kPrograms.size> a{};
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = registry_detail::kPrograms.programs[i];
  return a;
}();

// The Builtin of each of Config's programs, in the order of its traits' `programs`.
template <class Config>
inline constexpr auto kBuiltinsOf = [] {
  constexpr auto& programs = OptimizerTraits<Config>::programs;
  std::array<Builtin, std::size(programs)> a{};
  for (std::size_t v = 0; v < a.size(); ++v) a[v] = static_cast<Builtin>(registry_detail::kPrograms.find(programs[v]));
  return a;
}();

// The built-in program named `program_name` (Program::name, e.g. "adam_amsgrad").
consteval Builtin builtin_named(std::string_view program_name) {
  for (std::size_t i = 0; i < kBuiltinPrograms.size(); ++i)
    if (kBuiltinPrograms[i]->name == program_name) return static_cast<Builtin>(i);
  throw "no built-in program of this name";  // a compile error: consteval
}

// ---- checks of every registry entry ----

// The number of members of a flat aggregate (no bases, no arrays): how many
// initializers T{...} accepts.
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

// The traits' field list names every member of the config.
template <class Config>
constexpr std::size_t count_fields() {
  Config c{};
  std::size_t n = 0;
  OptimizerTraits<Config>::fields(c, [&](std::string_view, auto&) { ++n; });
  return n;
}

template <class Config>
constexpr bool check_traits() {
  using T = OptimizerTraits<Config>;
  static_assert(requires { T::name; }, "an OptimizerConfig alternative without OptimizerTraits: "
                                       "include its program file in jit/builtin/registry.hpp");
  static_assert(count_fields<Config>() == aggregate_members<Config>(),
                "OptimizerTraits<Config>::fields does not name every member of the config");
  static_assert(!T::name.empty() && std::size(T::programs) > 0);
  return true;
}
static_assert([]<std::size_t... K>(std::index_sequence<K...>) {
  return (check_traits<ConfigAt<K>>() && ...);
}(std::make_index_sequence<std::variant_size_v<OptimizerConfig>>{}));

static_assert(kBuiltinPrograms.size() < registry_detail::kMaxBuiltins, "more built-in programs than Builtin holds");

}  // namespace stepfuse::jit
