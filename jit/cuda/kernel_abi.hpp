// The description of the generated kernels' ABI (JSON) that the emit API hands a
// compiler: what the kernels of a spec take, in which order, with which grid,
// and what memory and tables the caller provides. Lives beside the emitter
// because it must say exactly what emit_cuda.cpp generates.
#pragma once

#include <string>
#include <vector>

#include "jit/abi_json.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/cuda/nvrtc_compile.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse::jit {

// `program` is the update program spec.program was taken from (its program() and
// scalar rules are described). `tensor_combos[i]` is tensor i's index into
// spec.combos. `nvrtc_version` is empty when nothing was compiled. The JSON has
// format "stepfuse.kernel_abi", version kKernelAbiVersion (jit/abi_json.hpp).
std::string describe_cuda_abi(const CudaSpec& spec, const UpdateProgram& program, const std::vector<int>& tensor_combos,
                              const CudaTarget& target, const std::string& nvrtc_version);

// The C declarations the description refers to: the text of stepfuse/device_abi.h.
std::string cuda_abi_header();

}  // namespace stepfuse::jit
