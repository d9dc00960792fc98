// The built-in optimizers by their lower-case names, with PyTorch's defaults: stepfuse-bench's --optimizer.
#pragma once

#include <optional>
#include <string_view>

#include "stepfuse/optimizer.hpp"

namespace stepfuse::bench {

// The optimizer named `name` ("sgd", "adam", "adamw", "adagrad", "rmsprop", "lion",
// "nadam", "radam", "adamax", "adadelta", "rprop", "asgd", "lamb") with
// its defaults, or nothing for another name (the caller words the error).
inline std::optional<OptimizerConfig> default_config_named(std::string_view name) {
  if (name == "sgd") return optim::SGD{};
  if (name == "adam") return optim::Adam{};
  if (name == "adamw") return optim::AdamW{};
  if (name == "adagrad") return optim::Adagrad{};
  if (name == "rmsprop") return optim::RMSprop{};
  if (name == "lion") return optim::Lion{};
  if (name == "nadam") return optim::NAdam{};
  if (name == "radam") return optim::RAdam{};
  if (name == "adamax") return optim::Adamax{};
  if (name == "adadelta") return optim::Adadelta{};
  if (name == "rprop") return optim::Rprop{};
  if (name == "asgd") return optim::ASGD{};
  if (name == "lamb") return optim::LAMB{};
  return std::nullopt;
}

}  // namespace stepfuse::bench
