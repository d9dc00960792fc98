// Internal: the front-ends' access to an Optimizer's step engine.
#pragma once

#include "runtime/step_engine.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse {

struct detail_access {
  static detail::StepEngine& engine(const Optimizer& o) { return *o.engine_; }
};

}  // namespace stepfuse
