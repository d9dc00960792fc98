// Test support: the CPU paths whose results must be bitwise equal for one step
// configuration — every Highway target, 1 to 3 threads, the interpreter, the unfused
// baseline and (where built) the LLVM backend.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "hwy/targets.h"
#include "hwy_targets.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::test {

// Expects run(options) on every path, each options derived from `base`, to equal
// run(base); `what` names the case in failures.
template <class Run>
void expect_same_on_every_cpu_path(const OptimizerOptions& base, Run&& run, const std::string& what) {
  const auto ref = run(base);
  for (std::int64_t target : targets()) {
    PerTarget scope(target);
    EXPECT_EQ(run(base), ref) << what << " on " << hwy::TargetName(target);
  }
  for (int threads : {1, 2, 3}) {
    OptimizerOptions o = base;
    o.num_threads = threads;
    EXPECT_EQ(run(o), ref) << what << " with " << threads << " threads";
  }
  for (Fusion f : {Fusion::interpreted, Fusion::unfused}) {
    OptimizerOptions o = base;
    o.fusion = f;
    EXPECT_EQ(run(o), ref) << what << (f == Fusion::unfused ? " unfused" : " interpreted");
  }
  if (jit::llvm_built()) {
    OptimizerOptions o = base;
    o.cpu_backend = CpuBackend::llvm;
    EXPECT_EQ(run(o), ref) << what << " with the LLVM backend";
  }
}

}  // namespace stepfuse::test
