// Consumer smoke test of stepfuse::mpi: every rank adds rank + 1 over the communicator.
// Run under mpiexec; rank 0 prints "consumer OK" when every rank got the sum.
#include <stepfuse/mpi.hpp>
#include <stepfuse/stepfuse.hpp>

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int bad = 0;
  try {
    auto comm = stepfuse::mpi_communicator(MPI_COMM_WORLD);
    const int n = comm->size();
    std::vector<float> x(5, static_cast<float>(comm->rank() + 1));
    comm->all_reduce(x.data(), x.size(), stepfuse::CommType::f32, stepfuse::ReduceOp::sum);
    for (float v : x)
      if (v != static_cast<float>(n * (n + 1) / 2)) bad = 1;
    if (bad) std::fprintf(stderr, "rank %d: sum %g, expected %d\n", comm->rank(), static_cast<double>(x[0]), n * (n + 1) / 2);
    if (comm->rank() == 0)
      std::printf("stepfuse %s: %s communicator of %d ranks\n", stepfuse::version(), std::string(comm->name()).c_str(), n);
  } catch (const stepfuse::Error& e) {
    std::fprintf(stderr, "stepfuse::Error: %s\n", e.what());
    bad = 1;
  }
  int any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0 && !any) std::printf("consumer OK\n");
  MPI_Finalize();
  return any;
}
