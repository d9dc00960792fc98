// stepfuse-bench --ranks N: the sharded step (OptimizerOptions::communicator) across N MPI
// processes, against the local step over the same shard, and the collective it makes.
#pragma once

#include "stepfuse_bench.hpp"

namespace stepfuse::bench::tool {

// Whether this stepfuse-bench was built with MPI (stepfuse::mpi), which --ranks needs.
bool ranks_supported();

// --ranks N. Outside an MPI launch (no OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK in the
// environment), checks the arguments and replaces this process with
// `mpiexec -n N [--oversubscribe] <this program> <argv[1..]>`, so mpiexec's exit code is the
// command's. Under one (on every rank): the benchmark (ranks.cpp's header comment); rank 0
// prints the report. argv is main's, for the relaunch. Returns the exit code; throws
// UsageError for bad arguments and, in a build without MPI, for --ranks itself.
int run_ranks(const Args& a, int argc, char** argv);

}  // namespace stepfuse::bench::tool
