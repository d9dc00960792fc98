// The GoogleTest main of the MPI tests (tests/mpi/CMakeLists.txt: stepfuse_add_mpi_test),
// run as `mpiexec -n N <test>`.
//
// Every rank runs every test, in the same order (a --gtest_shuffle seed is rank 0's), so
// the tests' collectives match across the ranks. Rank 0 prints GoogleTest's usual report;
// the other ranks print only their failures, each line prefixed "[rank r]". At the end
// each rank's count of failed tests is gathered: rank 0 lists the ranks that failed, and
// every rank exits 1 if any rank failed a test (0 otherwise), so mpiexec's status says so
// whichever rank it reports.
//
// A test whose ranks stop making the same collectives (a fatal ASSERT_* on one rank
// before a collective the others make) leaves them waiting until CTest's TIMEOUT: in
// code between collectives, prefer EXPECT_* to ASSERT_*.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// Rank r > 0: its failures only, each line prefixed.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : prefix_("[rank " + std::to_string(rank) + "] ") {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::string text = prefix_;
    if (result.file_name()) {
      text += result.file_name();
      if (result.line_number() >= 0) {
        text += ':';
        text += std::to_string(result.line_number());
      }
      text += ": ";
    }
    text += "Failure\n";
    for (const char* p = result.message(); *p;) {
      const char* end = p;
      while (*end && *end != '\n') ++end;
      text += prefix_;
      text.append(p, end);
      text += '\n';
      p = *end ? end + 1 : end;
    }
    std::fputs(text.c_str(), stdout);
    std::fflush(stdout);
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::printf("%s[  FAILED  ] %s.%s\n", prefix_.c_str(), info.test_suite_name(), info.name());
    std::fflush(stdout);
  }

 private:
  std::string prefix_;
};

}  // namespace

int main(int argc, char** argv) {
  // SERIALIZED: code under test may call MPI from a thread other than main's, one at a time.
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "MPI_Init_thread failed\n");
    return 1;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  ::testing::InitGoogleTest(&argc, argv);
  // The same test order on every rank: a shuffle seed drawn from the clock would differ.
  int seed = GTEST_FLAG_GET(random_seed);
  if (seed == 0 && rank == 0)
    seed = static_cast<int>(std::chrono::steady_clock::now().time_since_epoch().count() % 99999) + 1;
  MPI_Bcast(&seed, 1, MPI_INT, 0, MPI_COMM_WORLD);
  GTEST_FLAG_SET(random_seed, seed);

  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
    GTEST_FLAG_SET(output, "");  // one report file (rank 0's), not N writers of one path
  }
  if (rank == 0 && provided < MPI_THREAD_SERIALIZED)
    std::printf("[mpi] note: MPI provides thread level %d, below MPI_THREAD_SERIALIZED\n", provided);

  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  // Failed tests, or 1 for a failure outside them (an environment's SetUp, say).
  int failed = unit.failed_test_count();
  if (failed == 0 && (rc != 0 || unit.ad_hoc_test_result().Failed())) failed = 1;

  std::vector<int> per_rank(rank == 0 ? size : 0);
  MPI_Gather(&failed, 1, MPI_INT, per_rank.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  MPI_Allreduce(&failed, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    if (total == 0) {
      std::printf("[mpi] all %d ranks passed\n", size);
    } else {
      for (int r = 0; r < size; ++r)
        if (per_rank[r] != 0)
          std::printf("[mpi] rank %d of %d: %d test%s FAILED%s\n", r, size, per_rank[r], per_rank[r] == 1 ? "" : "s",
                      r == 0 ? "" : " (its failures are above, prefixed with its rank)");
    }
    std::fflush(stdout);
  }
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
