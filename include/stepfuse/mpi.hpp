// The MPI implementation of stepfuse::Communicator (stepfuse/distributed.hpp): the
// collectives of a sharded step over the processes of an MPI communicator, on host
// memory. Link the CMake target stepfuse::mpi (built when CMake found MPI:
// STEPFUSE_WITH_MPI), which brings MPI::MPI_C.
//
//   MPI_Init(&argc, &argv);
//   {
//     stepfuse::OptimizerOptions options;
//     options.communicator = stepfuse::mpi_communicator(MPI_COMM_WORLD);
//     ...
//   }
//   MPI_Finalize();
#pragma once

// Only MPI's C API: without these, Open MPI's and MPICH's <mpi.h> declare the MPI-2 C++
// bindings (removed in MPI-3) in C++, whose symbols are in a library MPI::MPI_C does not
// link. (stepfuse::mpi also defines them for its users.)
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <memory>

#include "stepfuse/distributed.hpp"

namespace stepfuse {

// A Communicator over the processes of `comm` (rank() and size() are theirs in comm).
//
// Collective: every process of comm calls it, in the same order as its other
// collectives on comm, since it duplicates comm (MPI_Comm_dup): the library's
// collectives run on that duplicate and never match, delay or disturb the caller's
// own calls on comm, whatever their order. The duplicate reports errors to the
// library (MPI_ERRORS_RETURN); comm's error handler is left as it is. It is freed
// (MPI_Comm_free) when the last reference to the communicator goes, unless MPI has
// been finalized by then (MPI_Finalize released it): let every process drop it.
//
// MPI must be initialized and not finalized: Error(invalid_state) otherwise, and for
// MPI_COMM_NULL (a process outside the group, as MPI_Comm_split's MPI_UNDEFINED
// gives); an intercommunicator is Error(invalid_argument). Its collectives may be
// called from any thread, one at a time (MPI_THREAD_SERIALIZED; from the thread that
// initialized MPI only, MPI_THREAD_FUNNELED is enough).
//
// The collectives (see Communicator):
//  - all_gather: MPI_Allgather; send may be recv + rank() * count (in place: MPI_IN_PLACE),
//    else it must not overlap recv (then it is staged through a copy).
//  - all_reduce: MPI_Allreduce with MPI_IN_PLACE.
//  - reduce_scatter: MPI_Reduce_scatter_block; recv may overlap send (the result is
//    staged through a temporary).
//  - count 0 calls nothing (every rank passes the same count).
//  - Counts above INT_MAX (MPI's int counts) are split into pieces of at most INT_MAX
//    elements: consecutive MPI_Allreduce calls; one MPI_Bcast (all_gather) or MPI_Reduce
//    (reduce_scatter) per rank and piece.
//  - Types: u8, i32, i64, f32, f64 are MPI_UINT8_T, MPI_INT32_T, MPI_INT64_T, MPI_FLOAT,
//    MPI_DOUBLE with MPI_SUM/MAX/MIN (u8 sums wrap modulo 256; NaN in max/min is as the MPI
//    library does it). f16 and bf16 have no MPI type: they travel as a 2-byte type with
//    user-defined operations (made once per communicator, on first use): a sum widens both
//    operands to fp32, adds and rounds once to the nearest (ties to even), which is the
//    correctly rounded f16/bf16 sum of the two; max and min are exact and return NaN when
//    either operand is NaN. As with f32, a sum over more than two ranks depends on the
//    order in which the MPI library combines them.
//  - A failing MPI call is Error(device_error) naming the call and MPI_Error_string. A
//    null buffer with count > 0, or an unknown type or op, is Error(invalid_argument),
//    thrown before any MPI call (on the ranks where it is wrong: the others then wait).
std::shared_ptr<Communicator> mpi_communicator(MPI_Comm comm);

}  // namespace stepfuse
