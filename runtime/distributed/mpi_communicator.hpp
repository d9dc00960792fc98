// Internals of the MPI communicator (stepfuse/mpi.hpp) that tests reach.
#pragma once

#include <cstddef>

namespace stepfuse::detail {

// The most elements one MPI call moves (INT_MAX: MPI's counts are int); larger
// counts are split into pieces of at most this. Tests lower it to run the split
// paths on small buffers; every rank must set the same value. Returns the previous
// one; 0 is Error(invalid_argument).
std::size_t set_mpi_max_count(std::size_t count);

}  // namespace stepfuse::detail
