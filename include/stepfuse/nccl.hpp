// The NCCL implementation of stepfuse::Communicator (stepfuse/distributed.hpp): the
// collectives of a sharded step between GPUs, on device memory, enqueued on a CUDA
// stream. Link the CMake target stepfuse::nccl.
//
// NCCL is loaded lazily, as the CUDA driver is: nothing links libnccl, and building
// needs neither nccl.h nor cuda.h (the two handle types below are declared exactly as
// those headers declare them, so code that includes them too compiles unchanged).
//
//   ncclComm_t comm;                      // from ncclCommInitRank, as usual
//   ncclCommInitRank(&comm, nranks, id, rank);
//   stepfuse::OptimizerOptions options;    // a CUDA optimizer's sharded step:
//   options.device = stepfuse::Device::cuda(dev);
//   options.cuda_stream = stream;          // the same stream as the communicator's
//   options.communicator = stepfuse::nccl_communicator(comm, stream);
#pragma once

#include <memory>
#include <string>

#include "stepfuse/distributed.hpp"

typedef struct ncclComm* ncclComm_t;   // as nccl.h
typedef struct CUstream_st* CUstream;  // as cuda.h (cudaStream_t is the same type)

namespace stepfuse {

// A Communicator over the ranks of the NCCL communicator `comm` (rank() and size() are
// its ncclCommUserRank and ncclCommCount; device() is Device::cuda(ncclCommCuDevice)).
// Not collective: it wraps comm, which stays the caller's (it must outlive the
// Communicator; the Communicator never destroys it).
//
// Every collective is enqueued on `stream` (nullptr: the legacy default stream) and
// returns without waiting for it: ncclAllGather, ncclAllReduce (in place),
// ncclReduceScatter. Buffers are device memory of device(). As with any NCCL call,
// every rank must enqueue the same collectives in the same order, and the caller's
// thread must not hold other NCCL work of the same comm in a group it has not ended.
// Types u8, i32, i64, f16, bf16, f32, f64 are NCCL's ncclUint8, ncclInt32, ncclInt64,
// ncclFloat16, ncclBfloat16, ncclFloat32, ncclFloat64 (bf16 needs NCCL 2.10 or newer);
// ops ncclSum, ncclMax, ncclMin. A count of 0 enqueues nothing.
//
// Which libnccl: a libnccl.so.2 the process has already loaded (the one PyTorch or
// the application uses: comm must come from the same library), else, in order,
// $STEPFUSE_NCCL_PATH (a file, or a directory holding libnccl.so.2),
// $CUDA_HOME/lib64, $CUDA_PATH/lib64, /usr/local/cuda/lib64, then the loader's
// search. Loaded once per process, on first use; never unloaded.
//
// Errors: NCCL that cannot be loaded (or is older than 2.10) is Error(device_error)
// listing what was tried and what to install; a null comm is Error(invalid_argument);
// a failing NCCL call is Error(device_error) naming the call, ncclGetErrorString and
// ncclGetLastError. An asynchronous NCCL error (a peer that died) surfaces as NCCL
// reports it: in the next call, or when the stream is synchronized.
std::shared_ptr<Communicator> nccl_communicator(ncclComm_t comm, CUstream stream);

// The libnccl in use: its path and version (e.g. "libnccl.so.2 2.28.9"), loading it if
// need be; Error(device_error) as above when it cannot be loaded.
std::string nccl_library();

}  // namespace stepfuse
