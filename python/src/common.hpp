// Shared pieces of the Python binding (stepfuse._stepfuse).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <stepfuse/stepfuse.hpp>

namespace nb = nanobind;

namespace sfpy {

// ---- tensors (tensors.cpp) -------------------------------------------------

// A tensor taken over DLPack (or the buffer protocol): zero-copy, in place. `owner` is
// what the caller passed; `array` holds the exported tensor and so keeps its memory alive.
struct Tensor {
  nb::object owner;
  nb::ndarray<> array;
  stepfuse::TensorView view;
  stepfuse::Device device;
  std::vector<std::size_t> shape;
};

// Takes `obj` as a tensor. `what` names it in errors ("params[2].grad"): TypeError for
// something that is not a tensor or has a dtype other than float32/float16/bfloat16,
// ValueError for a non-contiguous tensor or one on a device other than the CPU or a
// CUDA GPU. A torch tensor that requires grad is detached first (same memory).
Tensor import_tensor(nb::handle obj, const std::string& what);

std::string device_name(const stepfuse::Device& d);  // "cpu", "cuda:0"
// "cpu", "cuda" or "cuda:N" (ValueError otherwise). "cuda" alone gives index -1: any GPU.
stepfuse::Device parse_device(const std::string& s, bool* any_index);

// ---- configs (configs.cpp) -------------------------------------------------

// The built-in config in `obj` (an SGD, Adam, ... object), or nullopt.
std::optional<stepfuse::OptimizerConfig> try_config(nb::handle obj);
// The config as a Python object (a copy).
nb::object config_to_python(const stepfuse::OptimizerConfig& config);
// "SGD, Adam, AdamW, ...": the config classes' names, for messages.
const char* config_class_names();

// ---- the optimizer (optimizer.cpp) -----------------------------------------

// The Python Optimizer: the C++ one and references to every tensor it was given, so
// that they outlive it (the C++ optimizer holds raw pointers into them).
struct PyOptimizer {
  std::unique_ptr<stepfuse::Optimizer> opt;
  std::vector<Tensor> weights, grads;  // params() order
  stepfuse::Device device;

  stepfuse::Optimizer& get() { return *opt; }
};

// ---- binders ---------------------------------------------------------------

void bind_configs(nb::module_& m);
void bind_program(nb::module_& m);
void bind_optimizer(nb::module_& m);
void bind_scaler(nb::module_& m);

}  // namespace sfpy
