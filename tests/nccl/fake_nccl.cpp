// A stand-in for libnccl.so.2 with NCCL's C ABI, for nccl_communicator_test on machines
// without a GPU: one-rank collectives on host memory, every call recorded, errors on
// request. Built twice: complete (libnccl.so.2, SONAME libnccl.so.2) and, with
// FAKE_NCCL_INCOMPLETE, without ncclReduceScatter (the loader must refuse it).
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "fake_nccl.hpp"

struct ncclComm {
  int rank, size, device;
  int fail;  // the result every collective returns, when not 0
};
using ncclComm_t = ncclComm*;
using cudaStream_t = void*;

namespace {
FakeNcclCall g_last{};
std::size_t type_size(int type) {
  switch (type) {
    case 0: case 1: return 1;
    case 2: case 3: return 4;
    case 4: case 5: return 8;
    case 6: case 9: return 2;
    case 7: return 4;
    case 8: return 8;
    default: return 0;
  }
}
int record(const char* name, const void* send, void* recv, std::size_t count, int type, int op, ncclComm_t comm,
           cudaStream_t stream) {
  g_last = {name, send, recv, count, type, op, stream, g_last.calls + 1};
  if (comm->fail != 0) return comm->fail;
  if (type_size(type) == 0) return 4;  // ncclInvalidArgument
  if (comm->size == 1 && send != recv) std::memmove(recv, send, count * type_size(type));
  return 0;
}
}  // namespace

extern "C" {

ncclComm_t fakeNcclCommCreate(int rank, int size, int device, int fail) { return new ncclComm{rank, size, device, fail}; }
void fakeNcclCommFree(ncclComm_t comm) { delete comm; }
const FakeNcclCall* fakeNcclLastCall() { return &g_last; }

int ncclGetVersion(int* version) {
  const char* v = std::getenv("FAKE_NCCL_VERSION");
  *version = v != nullptr ? std::atoi(v) : 22899;
  return 0;
}
const char* ncclGetErrorString(int result) {
  switch (result) {
    case 0: return "no error";
    case 3: return "fake internal error";
    case 4: return "fake invalid argument";
    default: return "fake error";
  }
}
const char* ncclGetLastError(ncclComm_t) { return "the fake's last error"; }
int ncclCommCount(ncclComm_t comm, int* count) { *count = comm->size; return 0; }
int ncclCommUserRank(ncclComm_t comm, int* rank) { *rank = comm->rank; return 0; }
int ncclCommCuDevice(ncclComm_t comm, int* device) { *device = comm->device; return 0; }
int ncclAllGather(const void* send, void* recv, std::size_t count, int type, ncclComm_t comm, cudaStream_t stream) {
  return record("ncclAllGather", send, recv, count, type, -1, comm, stream);
}
int ncclAllReduce(const void* send, void* recv, std::size_t count, int type, int op, ncclComm_t comm,
                  cudaStream_t stream) {
  return record("ncclAllReduce", send, recv, count, type, op, comm, stream);
}
#ifndef FAKE_NCCL_INCOMPLETE
int ncclReduceScatter(const void* send, void* recv, std::size_t count, int type, int op, ncclComm_t comm,
                      cudaStream_t stream) {
  return record("ncclReduceScatter", send, recv, count, type, op, comm, stream);
}
#endif

}  // extern "C"
