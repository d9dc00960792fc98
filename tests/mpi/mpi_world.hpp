// MPI_COMM_WORLD's rank and size, for the MPI tests.
#pragma once

#include <mpi.h>

namespace stepfuse::mpi_test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace stepfuse::mpi_test
