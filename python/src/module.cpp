// stepfuse._stepfuse: the Python binding of the stepfuse C++ library (re-exported by
// the stepfuse package). Tensors come in over DLPack, zero-copy and in place.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <string>
#include <utility>

#include "common.hpp"

namespace sfpy {
void bind_distributed(nb::module_& m);  // distributed.cpp
}

namespace {

// stepfuse::Error by its code: a bad value is ValueError, a valid request this build or
// machine cannot serve TypeError, everything else RuntimeError; the message unchanged.
PyObject* python_type(stepfuse::ErrorCode code) {
  switch (code) {
    case stepfuse::ErrorCode::invalid_argument: return PyExc_ValueError;
    case stepfuse::ErrorCode::unsupported: return PyExc_TypeError;
    case stepfuse::ErrorCode::invalid_state:
    case stepfuse::ErrorCode::compile_failed:
    case stepfuse::ErrorCode::device_error:
    case stepfuse::ErrorCode::io_error: break;
  }
  return PyExc_RuntimeError;
}

}  // namespace

NB_MODULE(_stepfuse, m) {
  m.doc() =
      "stepfuse: the whole mixed-precision optimizer step (unscale, inf/NaN check, clip, update), fused, on "
      "tensors taken zero-copy over DLPack (torch, NumPy, ...).";

  // Views of an optimizer's state (and the torch tensors over them) keep it alive; a
  // training script that exits with an optimizer still referenced from a torch
  // optimizer's state is normal, not a leak worth a message at interpreter exit.
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const stepfuse::Error& e) {
      PyErr_SetString(python_type(e.code()), e.what());
    }
  });

  m.attr("__version__") = stepfuse::version();
  m.def("version", [] { return std::string(stepfuse::version()); }, "The C++ library's version, 'MAJOR.MINOR.PATCH'.");
  m.def("cpu_target", [] { return std::string(stepfuse::cpu_target()); },
        "The Highway target the CPU backend dispatches to on this machine, e.g. 'AVX2'.");
  m.def("llvm_version", [] { return std::string(stepfuse::llvm_version()); },
        "The LLVM version of the CPU JIT backend, or '' when this build has none.");
  m.def("llvm_cpu", [] { return std::string(stepfuse::llvm_cpu()); },
        "The CPU the LLVM backend compiles for ('haswell', 'znver3'), or '' without LLVM.");
  m.def(
      "cuda_available",
      [] {
        stepfuse::CudaStatus s = stepfuse::cuda_available();
        return std::make_pair(s.available, s.reason);
      },
      "(available, reason): whether the CUDA backend can run here (a driver, NVRTC and a device), and what is "
      "missing when not.");
  m.def(
      "nvrtc_available",
      [] {
        stepfuse::CudaStatus s = stepfuse::nvrtc_available();
        return std::make_pair(s.available, s.reason);
      },
      "(available, reason): whether NVRTC alone is usable (kernels compile, without a GPU to run them).");

  sfpy::bind_configs(m);
  sfpy::bind_program(m);
  sfpy::bind_distributed(m);
  sfpy::bind_optimizer(m);
  sfpy::bind_scaler(m);
}
