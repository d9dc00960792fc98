// Internals of the NCCL communicator (stepfuse/nccl.hpp) that tests reach: the
// function table of a loaded libnccl, and the communicator over a given table.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "stepfuse/nccl.hpp"

namespace stepfuse::detail {

// NCCL's ABI (nccl.h): results, data types and reduction ops are C enums (int).
using NcclResult = int;
inline constexpr NcclResult kNcclSuccess = 0;
inline constexpr NcclResult kNcclInvalidArgument = 4;
enum NcclDataType : int {
  kNcclUint8 = 1,
  kNcclInt32 = 2,
  kNcclInt64 = 4,
  kNcclFloat16 = 6,
  kNcclFloat32 = 7,
  kNcclFloat64 = 8,
  kNcclBfloat16 = 9
};
enum NcclRedOp : int { kNcclSum = 0, kNcclMax = 2, kNcclMin = 3 };

// The entry points the communicator calls; every member is non-null in a loaded table
// but ncclGetLastError (NCCL 2.13 and newer).
struct NcclApi {
  NcclResult (*ncclGetVersion)(int* version);
  const char* (*ncclGetErrorString)(NcclResult result);
  const char* (*ncclGetLastError)(ncclComm_t comm);
  NcclResult (*ncclCommCount)(ncclComm_t comm, int* count);
  NcclResult (*ncclCommUserRank)(ncclComm_t comm, int* rank);
  NcclResult (*ncclCommCuDevice)(ncclComm_t comm, int* device);
  NcclResult (*ncclAllGather)(const void* send, void* recv, std::size_t count, int type, ncclComm_t comm, CUstream stream);
  NcclResult (*ncclAllReduce)(const void* send, void* recv, std::size_t count, int type, int op, ncclComm_t comm,
                              CUstream stream);
  NcclResult (*ncclReduceScatter)(const void* send, void* recv, std::size_t count, int type, int op, ncclComm_t comm,
                                  CUstream stream);
};

// A libnccl opened from one of `candidates` (the first that loads, resolves every
// entry point and is NCCL 2.10 or newer), or the reason none did. `handle` is the
// dlopen handle (tests look up more of NCCL in it); `version` is NCCL_VERSION_CODE
// (2.28.9: 22809).
struct NcclLibrary {
  NcclApi api{};
  void* handle = nullptr;
  int version = 0;
  std::string path;
  std::string error;  // empty when loaded
};
// Opens the first of `candidates` that works; an already loaded libnccl.so.2 first
// when `prefer_loaded`. Each call opens anew (for tests; the communicator uses
// nccl_library_loaded()).
NcclLibrary open_nccl(const std::vector<std::string>& candidates, bool prefer_loaded);
// The process's libnccl, opened once as stepfuse/nccl.hpp says; Error(device_error)
// when none loads.
const NcclLibrary& nccl_library_loaded();

// nccl_communicator over the given table (which must outlive it).
std::shared_ptr<Communicator> nccl_communicator_with(const NcclLibrary& library, ncclComm_t comm, CUstream stream);

}  // namespace stepfuse::detail
