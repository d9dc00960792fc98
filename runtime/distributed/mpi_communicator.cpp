// The MPI Communicator (include/stepfuse/mpi.hpp).
#include "mpi_communicator.hpp"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "stepfuse/convert.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/mpi.hpp"

namespace stepfuse {
namespace {

std::atomic<std::size_t> g_max_count{static_cast<std::size_t>(INT_MAX)};

std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS || length <= 0) return "MPI error code " + std::to_string(rc);
  return std::string(text, static_cast<std::size_t>(length));
}

// Error(device_error) unless rc is MPI_SUCCESS: "mpi: <call> (<what>) failed: <MPI's text>".
void check(int rc, const char* call, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  std::string message = std::string("mpi: ") + call;
  if (!what.empty()) message += " (" + what + ")";
  throw Error(ErrorCode::device_error, message + " failed: " + mpi_error_string(rc));
}

// f16/bf16 storage <-> float, and the user-defined operations over it (MPI_User_function).
template <bool Bf16>
float widen(std::uint16_t bits) {
  if constexpr (Bf16) return bf16_to_float(bits);
  else return f16_to_float(bits);
}
template <bool Bf16>
std::uint16_t narrow(float value) {
  if constexpr (Bf16) return float_to_bf16(value);
  else return float_to_f16(value);
}

// inout[i] = in[i] op inout[i]. A sum of two f16 (bf16) values computed in fp32 and
// rounded once to f16 (bf16) is their correctly rounded sum: fp32 has more than twice
// their precision plus two bits, so the double rounding cannot differ from one rounding.
// max/min pick one of the operands (exact), NaN when either is NaN.
template <bool Bf16, ReduceOp Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const unsigned char*>(in);
  auto* b = static_cast<unsigned char*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) {
    std::uint16_t x, y;
    std::memcpy(&x, a + 2 * i, 2);
    std::memcpy(&y, b + 2 * i, 2);
    const float fx = widen<Bf16>(x), fy = widen<Bf16>(y);
    std::uint16_t r;
    if constexpr (Op == ReduceOp::sum) {
      r = narrow<Bf16>(fx + fy);
    } else if (std::isnan(fy)) {
      r = y;
    } else if (std::isnan(fx)) {
      r = x;
    } else if constexpr (Op == ReduceOp::max) {
      r = fx > fy ? x : y;
    } else {
      r = fx < fy ? x : y;
    }
    std::memcpy(b + 2 * i, &r, 2);
  }
}

constexpr MPI_User_function* kHalfOps[2][3] = {
    {&half_op<false, ReduceOp::sum>, &half_op<false, ReduceOp::max>, &half_op<false, ReduceOp::min>},
    {&half_op<true, ReduceOp::sum>, &half_op<true, ReduceOp::max>, &half_op<true, ReduceOp::min>}};

bool known_type(CommType t) { return static_cast<unsigned>(t) <= static_cast<unsigned>(CommType::f64); }
bool known_op(ReduceOp op) { return static_cast<unsigned>(op) <= static_cast<unsigned>(ReduceOp::min); }

// [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

std::string describe(const char* what, std::size_t count, CommType type) {
  return std::string(what) + " of " + std::to_string(count) + " " + std::string(comm_type_name(type));
}
std::string describe(const char* what, std::size_t count, CommType type, ReduceOp op) {
  return describe(what, count, type) + ", " + std::string(reduce_op_name(op));
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) {
    int inter = 0;
    check(MPI_Comm_test_inter(comm, &inter), "MPI_Comm_test_inter", "");
    if (inter)
      throw Error(ErrorCode::invalid_argument,
                  "mpi_communicator: an intercommunicator; the collectives need an intracommunicator");
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup", "");
    try {
      check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", "");
      check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank", "");
      check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size", "");
    } catch (...) {
      MPI_Comm_free(&comm_);
      throw;
    }
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  // After MPI_Finalize the handles are gone with MPI: nothing to free (nor callable).
  ~MpiCommunicator() override {
    int finalized = 0;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;
    for (auto& ops : half_ops_)
      for (MPI_Op& op : ops)
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
    if (half_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&half_type_);
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "mpi"; }

  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override {
    if (!known_type(type)) throw_unknown("all_gather", type);
    if (count == 0) return;
    if (!send || !recv) throw_null("all_gather", count, type);
    const std::size_t es = comm_type_size(type), bytes = count * es;
    const MPI_Datatype dt = datatype(type);
    auto* out = static_cast<unsigned char*>(recv);
    unsigned char* own = out + static_cast<std::size_t>(rank_) * bytes;
    const bool in_place = send == own;
    std::vector<unsigned char> staged;
    if (!in_place && overlap(send, bytes, recv, bytes * static_cast<std::size_t>(size_))) {
      staged.assign(static_cast<const unsigned char*>(send), static_cast<const unsigned char*>(send) + bytes);
      send = staged.data();
    }
    const std::size_t max = g_max_count.load();
    if (count <= max) {
      const int n = static_cast<int>(count);
      check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, n, dt, recv, n, dt, comm_), "MPI_Allgather",
            describe("all_gather", count, type));
      return;
    }
    // Each rank's block, piece by piece, broadcast from that rank.
    if (!in_place) std::memcpy(own, send, bytes);
    for (int root = 0; root < size_; ++root) {
      unsigned char* block = out + static_cast<std::size_t>(root) * bytes;
      for (std::size_t at = 0; at < count; at += max) {
        const std::size_t n = std::min(max, count - at);
        check(MPI_Bcast(block + at * es, static_cast<int>(n), dt, root, comm_), "MPI_Bcast",
              describe("all_gather", count, type) + ", in pieces");
      }
    }
  }

  void all_reduce(void* data, std::size_t count, CommType type, ReduceOp op) override {
    if (!known_type(type)) throw_unknown("all_reduce", type);
    if (!known_op(op)) throw_unknown("all_reduce", op);
    if (count == 0) return;
    if (!data) throw_null("all_reduce", count, type);
    const std::size_t es = comm_type_size(type), max = g_max_count.load();
    const MPI_Datatype dt = datatype(type);
    const MPI_Op mop = mpi_op(type, op);
    auto* p = static_cast<unsigned char*>(data);
    for (std::size_t at = 0; at < count; at += max) {
      const std::size_t n = std::min(max, count - at);
      check(MPI_Allreduce(MPI_IN_PLACE, p + at * es, static_cast<int>(n), dt, mop, comm_), "MPI_Allreduce",
            describe("all_reduce", count, type, op));
    }
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, CommType type, ReduceOp op) override {
    if (!known_type(type)) throw_unknown("reduce_scatter", type);
    if (!known_op(op)) throw_unknown("reduce_scatter", op);
    if (count == 0) return;
    if (!send || !recv) throw_null("reduce_scatter", count, type);
    const std::size_t es = comm_type_size(type), bytes = count * es, max = g_max_count.load();
    const MPI_Datatype dt = datatype(type);
    const MPI_Op mop = mpi_op(type, op);
    std::vector<unsigned char> staged;
    void* out = recv;
    if (overlap(recv, bytes, send, bytes * static_cast<std::size_t>(size_))) {
      staged.resize(bytes);
      out = staged.data();
    }
    if (count <= max) {
      check(MPI_Reduce_scatter_block(send, out, static_cast<int>(count), dt, mop, comm_), "MPI_Reduce_scatter_block",
            describe("reduce_scatter", count, type, op));
    } else {
      // Each rank's block, piece by piece, reduced to that rank.
      const auto* in = static_cast<const unsigned char*>(send);
      for (int root = 0; root < size_; ++root) {
        const unsigned char* block = in + static_cast<std::size_t>(root) * bytes;
        for (std::size_t at = 0; at < count; at += max) {
          const std::size_t n = std::min(max, count - at);
          void* dst = root == rank_ ? static_cast<unsigned char*>(out) + at * es : nullptr;
          check(MPI_Reduce(block + at * es, dst, static_cast<int>(n), dt, mop, root, comm_), "MPI_Reduce",
                describe("reduce_scatter", count, type, op) + ", in pieces");
        }
      }
    }
    if (!staged.empty()) std::memcpy(recv, staged.data(), bytes);
  }

 private:
  static bool half(CommType t) { return t == CommType::f16 || t == CommType::bf16; }

  MPI_Datatype datatype(CommType t) {
    switch (t) {
      case CommType::u8: return MPI_UINT8_T;
      case CommType::i32: return MPI_INT32_T;
      case CommType::i64: return MPI_INT64_T;
      case CommType::f32: return MPI_FLOAT;
      case CommType::f64: return MPI_DOUBLE;
      case CommType::f16:
      case CommType::bf16: make_half_ops(); return half_type_;
    }
    throw_unknown("datatype", t);
  }

  MPI_Op mpi_op(CommType t, ReduceOp op) {
    const auto o = static_cast<std::size_t>(op);
    if (half(t)) {
      make_half_ops();
      return half_ops_[t == CommType::bf16 ? 1 : 0][o];
    }
    switch (op) {
      case ReduceOp::sum: return MPI_SUM;
      case ReduceOp::max: return MPI_MAX;
      case ReduceOp::min: return MPI_MIN;
    }
    throw_unknown("op", op);
  }

  // The 2-byte type and the six f16/bf16 operations, made on first use (local calls,
  // not collective). A failure leaves nothing made, and the next use tries again.
  void make_half_ops() {
    std::call_once(half_once_, [this] {
      MPI_Datatype type = MPI_DATATYPE_NULL;
      MPI_Op ops[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
      auto release = [&] {
        for (auto& row : ops)
          for (MPI_Op& op : row)
            if (op != MPI_OP_NULL) MPI_Op_free(&op);
        if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
      };
      try {
        check(MPI_Type_contiguous(2, MPI_BYTE, &type), "MPI_Type_contiguous", "the f16/bf16 type");
        check(MPI_Type_commit(&type), "MPI_Type_commit", "the f16/bf16 type");
        for (int b = 0; b < 2; ++b)
          for (int o = 0; o < 3; ++o)
            check(MPI_Op_create(kHalfOps[b][o], /*commute=*/1, &ops[b][o]), "MPI_Op_create",
                  std::string(b ? "bf16 " : "f16 ") + std::string(reduce_op_name(static_cast<ReduceOp>(o))));
      } catch (...) {
        release();
        throw;
      }
      half_type_ = type;
      std::memcpy(half_ops_, ops, sizeof ops);
    });
  }

  [[noreturn]] static void throw_unknown(const char* fn, CommType t) {
    throw Error(ErrorCode::invalid_argument,
                std::string("mpi: ") + fn + ": unknown CommType " + std::to_string(static_cast<unsigned>(t)));
  }
  [[noreturn]] static void throw_unknown(const char* fn, ReduceOp op) {
    throw Error(ErrorCode::invalid_argument,
                std::string("mpi: ") + fn + ": unknown ReduceOp " + std::to_string(static_cast<unsigned>(op)));
  }
  [[noreturn]] static void throw_null(const char* fn, std::size_t count, CommType t) {
    throw Error(ErrorCode::invalid_argument,
                std::string("mpi: ") + fn + ": a null buffer for " + std::to_string(count) + " " +
                    std::string(comm_type_name(t)) + " elements");
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::once_flag half_once_;
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  MPI_Op half_ops_[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
};

}  // namespace

std::shared_ptr<Communicator> mpi_communicator(MPI_Comm comm) {
  int initialized = 0, finalized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized", "");
  if (!initialized)
    throw Error(ErrorCode::invalid_state, "mpi_communicator: MPI is not initialized (call MPI_Init first)");
  check(MPI_Finalized(&finalized), "MPI_Finalized", "");
  if (finalized) throw Error(ErrorCode::invalid_state, "mpi_communicator: MPI has been finalized");
  if (comm == MPI_COMM_NULL)
    throw Error(ErrorCode::invalid_state,
                "mpi_communicator: the communicator is MPI_COMM_NULL (this process is not in its group)");
  return std::make_shared<MpiCommunicator>(comm);
}

namespace detail {

std::size_t set_mpi_max_count(std::size_t count) {
  if (count == 0) throw Error(ErrorCode::invalid_argument, "set_mpi_max_count: the count must be positive");
  if (count > static_cast<std::size_t>(INT_MAX))
    throw Error(ErrorCode::invalid_argument, "set_mpi_max_count: the count must be at most INT_MAX");
  return g_max_count.exchange(count);
}

}  // namespace detail
}  // namespace stepfuse
