// stepfuse-bench --backend cuda: the fused step on GPU 0 over device buffers, verified
// against the CPU backend, timed with CUDA events beside a device-to-device copy measured
// in the same run.
#pragma once

#include <chrono>
#include <string>

#include "presets.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse::bench {

// What the command line decided (stepfuse_bench.cpp parses and checks it).
struct CudaBenchArgs {
  Preset preset;
  bool from_file = false;  // preset.name is then the shapes file's path
  OptimizerConfig config;
  DType weights = DType::f32, grads = DType::f32;
  std::string weights_name, grads_name, norm_name;  // as given: "bf16", "2", ...
  OptimizerOptions options;  // clipping, norm, masters, CPU threads; device and stream are set here
  double clip = 0;           // 0: off
  double loss_scale = 1024;
  int steps = 10, warmup = 2;
  int threads = 0;           // for the CPU reference and the host fills (0: every core)
  bool breakdown = true;     // also time the update pass alone
  std::string json_path;
  bool json_only = false;
  std::chrono::steady_clock::time_point start;  // when the command started
};

// Throws UsageError "--backend cuda: the CUDA backend cannot run here: <why> (...); use
// --backend cpu" unless stepfuse::cuda_available(). Cheap; touches no device.
void require_cuda_backend();

// Runs the benchmark and prints its report (the table, or the JSON with json_only; the
// JSON also to json_path when given). Allocates the model's weights, gradients, state and
// masters on GPU 0, plus 2 GiB for the copy probe, and the model's buffers on the host
// for the CPU reference. Throws UsageError for a configuration the library rejects,
// VerifyError when the GPU's step disagrees with the CPU's or a step is skipped; returns
// the exit code.
int run_cuda_bench(const CudaBenchArgs& args);

}  // namespace stepfuse::bench
