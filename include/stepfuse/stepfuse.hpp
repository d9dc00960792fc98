// stepfuse: the whole mixed-precision optimizer step, fused. Umbrella header.
#pragma once

#include "stepfuse/convert.hpp"
#include "stepfuse/cuda.hpp"
#include "stepfuse/distributed.hpp"
#include "stepfuse/emit.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/grad_scaler.hpp"
#include "stepfuse/loss_scale_optimizer.hpp"
#include "stepfuse/optim.hpp"
#include "stepfuse/optimizer.hpp"
#include "stepfuse/program.hpp"
#include "stepfuse/sharded_optimizer.hpp"
#include "stepfuse/types.hpp"
#include "stepfuse/update_program.hpp"
#include "stepfuse/version.hpp"
