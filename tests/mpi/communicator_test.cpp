// stepfuse::mpi_communicator (include/stepfuse/mpi.hpp), run under mpiexec on 1, 2 and 3
// ranks (tests/mpi/CMakeLists.txt). Every rank runs every test; the expected results are
// computed on each rank from every rank's inputs, which are exact in their type and
// depend on the rank.
#include <gtest/gtest.h>

#include "mpi_world.hpp"
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "runtime/distributed/mpi_communicator.hpp"
#include "stepfuse/convert.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/mpi.hpp"

namespace {

using stepfuse::CommType;
using stepfuse::Communicator;
using stepfuse::ErrorCode;
using stepfuse::ReduceOp;

constexpr CommType kTypes[] = {CommType::u8,   CommType::i32, CommType::i64, CommType::f16,
                               CommType::bf16, CommType::f32, CommType::f64};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::max, ReduceOp::min};
// Empty, one element, a round count, and a prime.
constexpr std::size_t kCounts[] = {0, 1, 1000, 1009};

using stepfuse::mpi_test::world_rank;
using stepfuse::mpi_test::world_size;

// One communicator over MPI_COMM_WORLD for the tests that need no other; made by the
// first test that uses it (on every rank: the tests run in the same order), freed
// after MPI_Finalize, which the destructor must survive (it frees nothing then).
Communicator& world() {
  static const std::shared_ptr<Communicator> comm = stepfuse::mpi_communicator(MPI_COMM_WORLD);
  return *comm;
}

std::string label(const char* what, CommType t, std::size_t count) {
  return std::string(what) + " " + std::string(stepfuse::comm_type_name(t)) + " x " + std::to_string(count);
}
std::string label(const char* what, CommType t, ReduceOp op, std::size_t count) {
  return label(what, t, count) + " " + std::string(stepfuse::reduce_op_name(op));
}

// Element i of rank r's input, exact in type t. Sums over up to 3 ranks stay exact in
// every type, in any order: u8 below 256; f16 multiples of 0.25 below 64 (f16 holds
// them up to 512); bf16 multiples of 0.5 below 64 (up to 128).
double value(CommType t, int r, std::size_t i) {
  const auto k = static_cast<double>(i);
  switch (t) {
    case CommType::u8: return static_cast<double>((i + 2 * static_cast<std::size_t>(r)) % 64);
    case CommType::i32: return static_cast<double>((i * 7919) % 2001) * 1000.0 - 1e6 + r * 13;
    case CommType::i64: return (static_cast<double>(i % 1001) - 500.0) * 8589934592.0 + r * 3;  // 2^33
    case CommType::f16: return (static_cast<double>(i % 64) - 32.0) * 0.5 + r * 0.25;
    case CommType::bf16: return (static_cast<double>(i % 32) - 16.0) + r * 0.5;
    case CommType::f32: return (std::fmod(k, 1000.0) - 500.0) * 0.125 + r * 1024.0;
    case CommType::f64: return (std::fmod(k, 1000.0) - 500.0) * std::ldexp(1.0, -20) + r * 1e6;
  }
  return 0;
}

void store(CommType t, void* base, std::size_t i, double v) {
  auto* p = static_cast<unsigned char*>(base) + i * stepfuse::comm_type_size(t);
  auto put = [p](auto x) { std::memcpy(p, &x, sizeof x); };
  switch (t) {
    case CommType::u8: put(static_cast<std::uint8_t>(v)); break;
    case CommType::i32: put(static_cast<std::int32_t>(v)); break;
    case CommType::i64: put(static_cast<std::int64_t>(v)); break;
    case CommType::f16: put(stepfuse::float_to_f16(static_cast<float>(v))); break;
    case CommType::bf16: put(stepfuse::float_to_bf16(static_cast<float>(v))); break;
    case CommType::f32: put(static_cast<float>(v)); break;
    case CommType::f64: put(v); break;
  }
}

double load(CommType t, const void* base, std::size_t i) {
  const auto* p = static_cast<const unsigned char*>(base) + i * stepfuse::comm_type_size(t);
  auto get = [p](auto x) {
    std::memcpy(&x, p, sizeof x);
    return x;
  };
  switch (t) {
    case CommType::u8: return get(std::uint8_t{});
    case CommType::i32: return get(std::int32_t{});
    case CommType::i64: return static_cast<double>(get(std::int64_t{}));
    case CommType::f16: return stepfuse::f16_to_float(get(std::uint16_t{}));
    case CommType::bf16: return stepfuse::bf16_to_float(get(std::uint16_t{}));
    case CommType::f32: return get(float{});
    case CommType::f64: return get(double{});
  }
  return 0;
}

using Buffer = std::vector<unsigned char>;
Buffer buffer(CommType t, std::size_t count) { return Buffer(count * stepfuse::comm_type_size(t)); }

// op over the ranks of value(t, r, i).
double reduced(CommType t, ReduceOp op, int size, std::size_t i) {
  double acc = value(t, 0, i);
  for (int r = 1; r < size; ++r) {
    const double v = value(t, r, i);
    acc = op == ReduceOp::sum ? acc + v : op == ReduceOp::max ? std::max(acc, v) : std::min(acc, v);
  }
  return acc;
}

// Counts the elements of `got` (count elements of type t) that differ from expected(i);
// reports the first.
template <class Expected>
void expect_elements(const std::string& what, CommType t, const void* got, std::size_t count, Expected expected) {
  std::size_t wrong = 0, first = 0;
  double first_got = 0, first_want = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const double g = load(t, got, i), w = expected(i);
    if (g != w && !(std::isnan(g) && std::isnan(w))) {
      if (wrong++ == 0) first = i, first_got = g, first_want = w;
    }
  }
  EXPECT_EQ(wrong, 0u) << what << ": " << wrong << " of " << count << " elements wrong; first [" << first
                       << "] = " << first_got << ", expected " << first_want;
}

void check_all_reduce(Communicator& comm, CommType t, ReduceOp op, std::size_t count) {
  Buffer data = buffer(t, count);
  for (std::size_t i = 0; i < count; ++i) store(t, data.data(), i, value(t, comm.rank(), i));
  comm.all_reduce(data.data(), count, t, op);
  expect_elements(label("all_reduce", t, op, count), t, data.data(), count,
                  [&](std::size_t i) { return reduced(t, op, comm.size(), i); });
}

// recv = send on other memory; `in_place`: recv's block rank * count is the send buffer.
void check_reduce_scatter(Communicator& comm, CommType t, ReduceOp op, std::size_t count, bool in_place) {
  const auto n = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
  Buffer send = buffer(t, n * count), recv = buffer(t, count);
  for (std::size_t j = 0; j < n * count; ++j) store(t, send.data(), j, value(t, comm.rank(), j));
  void* out = in_place ? send.data() + me * count * stepfuse::comm_type_size(t) : recv.data();
  comm.reduce_scatter(send.data(), out, count, t, op);
  expect_elements(label(in_place ? "reduce_scatter (into send)" : "reduce_scatter", t, op, count), t, out, count,
                  [&](std::size_t i) { return reduced(t, op, comm.size(), me * count + i); });
}

void check_all_gather(Communicator& comm, CommType t, std::size_t count, bool in_place) {
  const auto n = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
  const std::size_t es = stepfuse::comm_type_size(t);
  Buffer send = buffer(t, count), recv = buffer(t, n * count);
  for (std::size_t i = 0; i < count; ++i) store(t, send.data(), i, value(t, comm.rank(), i));
  const void* from = send.data();
  if (in_place) {
    std::memcpy(recv.data() + me * count * es, send.data(), count * es);
    from = recv.data() + me * count * es;
  }
  comm.all_gather(from, recv.data(), count, t);
  expect_elements(label(in_place ? "all_gather (in place)" : "all_gather", t, count), t, recv.data(), n * count,
                  [&](std::size_t j) { return value(t, static_cast<int>(j / count), j % count); });
}

// Lowers the most elements per MPI call (every rank alike), for the split paths.
class MaxCount {
 public:
  explicit MaxCount(std::size_t n) : previous_(stepfuse::detail::set_mpi_max_count(n)) {}
  ~MaxCount() { stepfuse::detail::set_mpi_max_count(previous_); }

 private:
  std::size_t previous_;
};

TEST(MpiCommunicator, NameRankSizeDevice) {
  Communicator& comm = world();
  EXPECT_EQ(comm.name(), "mpi");
  EXPECT_EQ(comm.rank(), world_rank());
  EXPECT_EQ(comm.size(), world_size());
  EXPECT_TRUE(comm.device() == stepfuse::Device::cpu());
}

TEST(MpiCommunicator, AllReduceEveryTypeOpAndCount) {
  for (CommType t : kTypes)
    for (ReduceOp op : kOps)
      for (std::size_t count : kCounts) check_all_reduce(world(), t, op, count);
}

TEST(MpiCommunicator, ReduceScatterEveryTypeOpAndCount) {
  for (CommType t : kTypes)
    for (ReduceOp op : kOps)
      for (std::size_t count : kCounts) check_reduce_scatter(world(), t, op, count, /*in_place=*/false);
}

TEST(MpiCommunicator, ReduceScatterIntoItsOwnBlockOfSend) {
  for (CommType t : kTypes)
    for (ReduceOp op : kOps) check_reduce_scatter(world(), t, op, 1009, /*in_place=*/true);
}

TEST(MpiCommunicator, AllGatherEveryTypeAndCount) {
  for (CommType t : kTypes)
    for (std::size_t count : kCounts) {
      check_all_gather(world(), t, count, /*in_place=*/false);
      check_all_gather(world(), t, count, /*in_place=*/true);
    }
}

TEST(MpiCommunicator, CountZeroTakesNullBuffers) {
  Communicator& comm = world();
  comm.all_reduce(nullptr, 0, CommType::f16, ReduceOp::sum);
  comm.all_gather(nullptr, nullptr, 0, CommType::f32);
  comm.reduce_scatter(nullptr, nullptr, 0, CommType::bf16, ReduceOp::max);
}

// f16/bf16 sums round to the nearest, ties to even: rank 0 holds x, rank 1 holds 1 or 1.5,
// the others 0. In f16 the spacing at 2048 is 2: 2048 + 1 is a tie that rounds to 2048,
// 2050 + 1 one that rounds to 2052 (away from zero would give 2050 and 2052; truncation
// 2048 and 2050), 2048 + 1.5 = 2049.5 rounds to 2050. In bf16 the same at 256.
TEST(MpiCommunicator, HalfSumsRoundToNearestEven) {
  Communicator& comm = world();
  for (CommType t : {CommType::f16, CommType::bf16}) {
    const double base = t == CommType::f16 ? 2048 : 256;
    const double x[3] = {base, base + 2, base}, y[3] = {1, 1, 1.5};
    const double want[3] = {base, base + 4, base + 2};
    Buffer data = buffer(t, 3);
    for (std::size_t i = 0; i < 3; ++i) store(t, data.data(), i, comm.rank() == 0 ? x[i] : comm.rank() == 1 ? y[i] : 0);
    comm.all_reduce(data.data(), 3, t, ReduceOp::sum);
    expect_elements(label("tie rounding", t, ReduceOp::sum, 3), t, data.data(), 3,
                    [&](std::size_t i) { return comm.size() == 1 ? x[i] : want[i]; });
  }
}

TEST(MpiCommunicator, HalfMaxAndMinPropagateNaN) {
  Communicator& comm = world();
  for (CommType t : {CommType::f16, CommType::bf16})
    for (ReduceOp op : {ReduceOp::max, ReduceOp::min}) {
      // Element 0 is NaN on the last rank, element 1 on rank 0; element 2 never.
      const int last = comm.size() - 1;
      const double nan = std::numeric_limits<double>::quiet_NaN();
      Buffer data = buffer(t, 3);
      store(t, data.data(), 0, comm.rank() == last ? nan : comm.rank());
      store(t, data.data(), 1, comm.rank() == 0 ? nan : -comm.rank());
      store(t, data.data(), 2, comm.rank() + 0.5);
      comm.all_reduce(data.data(), 3, t, op);
      EXPECT_TRUE(std::isnan(load(t, data.data(), 0))) << label("NaN", t, op, 3);
      EXPECT_TRUE(std::isnan(load(t, data.data(), 1))) << label("NaN", t, op, 3);
      EXPECT_EQ(load(t, data.data(), 2), op == ReduceOp::max ? last + 0.5 : 0.5) << label("NaN", t, op, 3);
    }
}

// Counts above the most elements per MPI call (INT_MAX, lowered here to 7) go in pieces:
// consecutive MPI_Allreduce calls, one MPI_Bcast / MPI_Reduce per rank and piece.
TEST(MpiCommunicator, CountsAboveTheLimitGoInPieces) {
  const MaxCount limit(7);
  Communicator& comm = world();
  for (CommType t : {CommType::f32, CommType::f16, CommType::i64, CommType::u8}) {
    for (ReduceOp op : kOps) {
      check_all_reduce(comm, t, op, 1009);
      check_reduce_scatter(comm, t, op, 1009, /*in_place=*/false);
      check_reduce_scatter(comm, t, op, 1009, /*in_place=*/true);
    }
    check_all_gather(comm, t, 1009, /*in_place=*/false);
    check_all_gather(comm, t, 1009, /*in_place=*/true);
    check_all_reduce(comm, t, ReduceOp::sum, 7);  // exactly the limit: one call
  }
  EXPECT_THROW(stepfuse::detail::set_mpi_max_count(0), stepfuse::Error);
}

// The communicator works on a duplicate of the caller's: here the ranks start their
// collectives on MPI_COMM_WORLD and on the communicator in different orders (even
// ranks the communicator's first, odd ranks world's first), which on one
// communicator would match the wrong calls with one another.
TEST(MpiCommunicator, CollectivesOnTheCallersCommunicatorDoNotMix) {
  auto comm = stepfuse::mpi_communicator(MPI_COMM_WORLD);
  const int n = comm->size(), r = comm->rank();
  std::vector<float> x(1000, static_cast<float>(r + 1));
  std::int32_t mine[3] = {r, 10 * r, 100 * r}, theirs[3] = {};
  MPI_Request request = MPI_REQUEST_NULL;
  if (r % 2 == 0) {
    comm->all_reduce(x.data(), x.size(), CommType::f32, ReduceOp::sum);
    MPI_Iallreduce(mine, theirs, 3, MPI_INT32_T, MPI_MAX, MPI_COMM_WORLD, &request);
  } else {
    MPI_Iallreduce(mine, theirs, 3, MPI_INT32_T, MPI_MAX, MPI_COMM_WORLD, &request);
    comm->all_reduce(x.data(), x.size(), CommType::f32, ReduceOp::sum);
  }
  MPI_Wait(&request, MPI_STATUS_IGNORE);
  expect_elements("the communicator's all_reduce", CommType::f32, x.data(), x.size(),
                  [&](std::size_t) { return n * (n + 1) / 2.0; });
  EXPECT_EQ(theirs[0], n - 1);
  EXPECT_EQ(theirs[1], 10 * (n - 1));
  EXPECT_EQ(theirs[2], 100 * (n - 1));
}

TEST(MpiCommunicator, LeavesTheCallersErrorHandlerAlone) {
  auto comm = stepfuse::mpi_communicator(MPI_COMM_WORLD);
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &handler);
  EXPECT_TRUE(handler == MPI_ERRORS_ARE_FATAL);
  MPI_Errhandler_free(&handler);
}

// A communicator over a split of the world, still usable after the caller frees the
// communicator it was made from (it works on its own duplicate).
TEST(MpiCommunicator, SubCommunicatorOutlivesTheCallersHandle) {
  const int wr = world_rank(), wn = world_size();
  MPI_Comm half = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, wr % 2, wr, &half), MPI_SUCCESS);
  int hr = -1, hn = -1;
  MPI_Comm_rank(half, &hr);
  MPI_Comm_size(half, &hn);
  auto comm = stepfuse::mpi_communicator(half);
  MPI_Comm_free(&half);
  EXPECT_EQ(comm->rank(), hr);
  EXPECT_EQ(comm->size(), hn);
  std::int64_t x[2] = {wr, 1};
  comm->all_reduce(x, 2, CommType::i64, ReduceOp::sum);
  std::int64_t want = 0;
  for (int r = wr % 2; r < wn; r += 2) want += r;
  EXPECT_EQ(x[0], want);
  EXPECT_EQ(x[1], hn);
}

TEST(MpiCommunicator, CommSelfIsOneRank) {
  auto comm = stepfuse::mpi_communicator(MPI_COMM_SELF);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  std::uint16_t h[2] = {stepfuse::float_to_f16(1.5f), stepfuse::float_to_f16(-2.0f)};
  comm->all_reduce(h, 2, CommType::f16, ReduceOp::sum);
  EXPECT_EQ(stepfuse::f16_to_float(h[0]), 1.5f);
  EXPECT_EQ(stepfuse::f16_to_float(h[1]), -2.0f);
}

// (MPI not initialized cannot be tested here: MPI is initialized for the whole run.)
TEST(MpiCommunicator, CommNullIsInvalidState) {
  try {
    stepfuse::mpi_communicator(MPI_COMM_NULL);
    ADD_FAILURE() << "no Error for MPI_COMM_NULL";
  } catch (const stepfuse::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_state) << e.what();
    EXPECT_NE(std::string(e.what()).find("MPI_COMM_NULL"), std::string::npos) << e.what();
  }
}

// Refused on every rank alike, before any MPI call.
TEST(MpiCommunicator, BadArgumentsAreInvalidArgument) {
  Communicator& comm = world();
  float x[4] = {};
  auto code_of = [](auto&& call) {
    try {
      call();
    } catch (const stepfuse::Error& e) {
      return e.code();
    }
    ADD_FAILURE() << "no Error";
    return ErrorCode::io_error;
  };
  EXPECT_EQ(code_of([&] { comm.all_reduce(nullptr, 4, CommType::f32, ReduceOp::sum); }), ErrorCode::invalid_argument);
  EXPECT_EQ(code_of([&] { comm.all_gather(x, nullptr, 1, CommType::f32); }), ErrorCode::invalid_argument);
  EXPECT_EQ(code_of([&] { comm.reduce_scatter(nullptr, x, 1, CommType::f32, ReduceOp::sum); }),
            ErrorCode::invalid_argument);
  EXPECT_EQ(code_of([&] { comm.all_reduce(x, 4, static_cast<CommType>(42), ReduceOp::sum); }),
            ErrorCode::invalid_argument);
  EXPECT_EQ(code_of([&] { comm.all_reduce(x, 4, CommType::f32, static_cast<ReduceOp>(42)); }),
            ErrorCode::invalid_argument);
  EXPECT_EQ(code_of([&] { comm.reduce_scatter(x, x, 0, CommType::f32, static_cast<ReduceOp>(42)); }),
            ErrorCode::invalid_argument);
  // The communicator still works afterwards.
  check_all_reduce(comm, CommType::f32, ReduceOp::sum, 4);
}

}  // namespace
