// What the stand-in libnccl (fake_nccl.cpp) records of the last collective, and the
// functions it exports besides NCCL's, for nccl_communicator_test.
#pragma once

#include <cstddef>

struct FakeNcclCall {
  const char* name;  // "ncclAllGather", ...
  const void* send;
  void* recv;
  std::size_t count;
  int type, op;  // NCCL's enums (op -1 for ncclAllGather)
  void* stream;
  int calls;  // collectives called so far
};

// extern "C" in the library:
//   ncclComm_t fakeNcclCommCreate(int rank, int size, int device, int fail);  (fail: the
//       result every collective of the comm returns, when not 0)
//   void fakeNcclCommFree(ncclComm_t comm);
//   const FakeNcclCall* fakeNcclLastCall();
