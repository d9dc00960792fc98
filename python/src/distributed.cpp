// stepfuse.Communicator (a stepfuse::Communicator implemented in Python), CommType,
// ReduceOp and TensorSlice: what a sharded step across processes needs from Python.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/trampoline.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common.hpp"

namespace sfpy {

namespace {

using stepfuse::CommType;
using stepfuse::Communicator;
using stepfuse::ReduceOp;
using stepfuse::TensorSlice;

// The NumPy dtype of a CommType's buffers. NumPy has no bfloat16: bf16 buffers are
// uint16 (the same bits), which stepfuse.torch views as torch.bfloat16.
nb::dlpack::dtype numpy_dtype(CommType t) {
  switch (t) {
    case CommType::u8: return nb::dtype<std::uint8_t>();
    case CommType::i32: return nb::dtype<std::int32_t>();
    case CommType::i64: return nb::dtype<std::int64_t>();
    case CommType::f16: return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case CommType::bf16: return nb::dtype<std::uint16_t>();
    case CommType::f32: return nb::dtype<float>();
    case CommType::f64: return nb::dtype<double>();
  }
  return nb::dtype<std::uint8_t>();
}

// The CommType of an array passed from Python (the inverse of numpy_dtype, and
// bfloat16 from a DLPack exporter that has it, such as torch).
CommType comm_type_of(const nb::dlpack::dtype& dt, const char* what) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(dt.code);
  if (dt.lanes == 1) {
    if (code == Code::UInt && dt.bits == 8) return CommType::u8;
    if (code == Code::Int && dt.bits == 32) return CommType::i32;
    if (code == Code::Int && dt.bits == 64) return CommType::i64;
    if (code == Code::Float && dt.bits == 16) return CommType::f16;
    if ((code == Code::Bfloat || code == Code::UInt) && dt.bits == 16) return CommType::bf16;
    if (code == Code::Float && dt.bits == 32) return CommType::f32;
    if (code == Code::Float && dt.bits == 64) return CommType::f64;
  }
  throw nb::type_error((std::string(what) +
                        ": a collective's buffers are uint8, int32, int64, float16, bfloat16 (or uint16 for its bits), "
                        "float32 or float64")
                           .c_str());
}

// A zero-copy, one-dimensional NumPy array of `count` elements at `data`, owned by
// nobody: valid only while the collective that passes it runs. The GIL must be held.
nb::object host_array(const void* data, std::size_t count, CommType type, bool writable) {
  const std::size_t shape[1] = {count};
  if (writable) {
    nb::ndarray<nb::numpy> a(const_cast<void*>(data), 1, shape, nb::handle(), nullptr, numpy_dtype(type));
    return nb::cast(a, nb::rv_policy::reference);
  }
  nb::ndarray<nb::numpy, nb::ro> a(data, 1, shape, nb::handle(), nullptr, numpy_dtype(type));
  return nb::cast(a, nb::rv_policy::reference);
}

// The C++ side of a Python subclass of stepfuse.Communicator: each virtual call takes
// the GIL (the step calls its collectives with the GIL released, from the thread that
// called step()), wraps the engine's host buffers as NumPy arrays and calls the
// subclass's method. A Python exception comes out as nb::python_error, through the
// engine's frames, and reaches the caller of step() as the exception it was.
class PyCommunicator final : public Communicator {
 public:
  NB_TRAMPOLINE(Communicator);

  // A communicator's rank and size never change: asked once, then kept.
  int rank() const override {
    if (rank_ < 0) {
      nb::gil_scoped_acquire gil;
      rank_ = nb::cast<int>(call_py("rank", nb::detail::str_hash("rank")));
    }
    return rank_;
  }
  int size() const override {
    if (size_ < 0) {
      nb::gil_scoped_acquire gil;
      size_ = nb::cast<int>(call_py("size", nb::detail::str_hash("size")));
    }
    return size_;
  }
  std::string_view name() const override {
    nb::gil_scoped_acquire gil;
    name_ = nb::cast<std::string>(call_py("name", nb::detail::str_hash("name")));  // viewed until the next call
    return name_;
  }

  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override {
    const std::size_t n = static_cast<std::size_t>(size());
    nb::gil_scoped_acquire gil;
    call_py("all_gather", nb::detail::str_hash("all_gather"), host_array(send, count, type, false),
            host_array(recv, n * count, type, true));
  }
  void all_reduce(void* data, std::size_t count, CommType type, ReduceOp op) override {
    nb::gil_scoped_acquire gil;
    call_py("all_reduce", nb::detail::str_hash("all_reduce"), host_array(data, count, type, true), op);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, CommType type, ReduceOp op) override {
    const std::size_t n = static_cast<std::size_t>(size());
    nb::gil_scoped_acquire gil;
    call_py("reduce_scatter", nb::detail::str_hash("reduce_scatter"), host_array(send, n * count, type, false),
            host_array(recv, count, type, true), op);
  }

 private:
  // NB_OVERRIDE_PURE without its return cast (the virtuals' C++ arguments are not
  // what Python gets): the Python subclass's method `name` (a string literal; `hash`
  // its str_hash), called with `args`. The ticket makes a subclass that lacks the
  // method an error instead of a recursion through the bound base method.
  template <typename... Args>
  nb::object call_py(const char* name, std::uint64_t hash, Args&&... args) const {
    nb::detail::ticket ticket(nb_trampoline, name, hash, /*pure=*/true);
    return nb_trampoline.base().attr(ticket.key)(std::forward<Args>(args)...);
  }

  mutable int rank_ = -1, size_ = -1;
  mutable std::string name_;
};

using InArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using OutArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

void check_same_type(CommType a, CommType b, const char* what) {
  if (a != b)
    throw nb::type_error((std::string(what) + ": send has type " + std::string(stepfuse::comm_type_name(a)) +
                          " but recv has " + std::string(stepfuse::comm_type_name(b)))
                             .c_str());
}

std::string slice_repr(const TensorSlice& s) {
  return "TensorSlice(tensor=" + std::to_string(s.tensor) + ", offset=" + std::to_string(s.offset) + ")";
}

}  // namespace

void bind_distributed(nb::module_& m) {
  nb::enum_<CommType>(m, "CommType",
                      "Element types of a collective's buffers. In Python the buffers are NumPy arrays of uint8, "
                      "int32, int64, float16, uint16 (bf16: the bits of bfloat16, which NumPy lacks), float32 or "
                      "float64.")
      .value("u8", CommType::u8)
      .value("i32", CommType::i32)
      .value("i64", CommType::i64)
      .value("f16", CommType::f16)
      .value("bf16", CommType::bf16)
      .value("f32", CommType::f32)
      .value("f64", CommType::f64);

  nb::enum_<ReduceOp>(m, "ReduceOp", "The reduction of all_reduce and reduce_scatter.")
      .value("sum", ReduceOp::sum)
      .value("max", ReduceOp::max)
      .value("min", ReduceOp::min);

  nb::class_<TensorSlice>(m, "TensorSlice",
                          "Where a param lies in the model when an optimizer holds only a shard of it (the slices= "
                          "option): elements [offset, offset + numel) of the model's tensor number `tensor`. Across "
                          "the ranks, a tensor's slices tile it exactly, each starting at a multiple of SHARD_ALIGN "
                          "elements.")
      .def(
          "__init__",
          [](TensorSlice* s, std::int64_t tensor, std::int64_t offset) { new (s) TensorSlice{tensor, offset}; },
          nb::arg("tensor"), nb::arg("offset") = 0)
      .def_rw("tensor", &TensorSlice::tensor, "The model's tensor (ranks' tensors are ordered by this id).")
      .def_rw("offset", &TensorSlice::offset, "First element of the slice within that tensor.")
      .def("__eq__",
           [](const TensorSlice& a, const TensorSlice& b) { return a.tensor == b.tensor && a.offset == b.offset; })
      .def("__repr__", &slice_repr);
  m.attr("SHARD_ALIGN") = stepfuse::kShardAlign;

  static const char* kClassDoc =
      "A group of processes (ranks) that run the same collectives: the communicator= option of Optimizer makes "
      "its step a sharded step, each rank holding its own shard of the model's params (docs/distributed.md).\n\n"
      "Subclass it in Python (call super().__init__()) and implement:\n\n"
      "  rank() -> int, size() -> int: this process's rank and the number of ranks (asked once, then kept);\n"
      "  name() -> str: a short description for messages, e.g. 'torch.distributed(gloo)';\n"
      "  all_gather(send, recv) -> None: recv[r * len(send):(r + 1) * len(send)] = rank r's send, for every r;\n"
      "  all_reduce(data, op) -> None: data = op over the ranks of data, in place;\n"
      "  reduce_scatter(send, recv, op) -> None: recv = this rank's block, send[rank * len(recv):(rank + 1) * "
      "len(recv)], of op over the ranks of send.\n\n"
      "Every call is collective: each rank makes the same calls in the same order, with the same lengths, dtypes "
      "and ops. send, recv and data are one-dimensional NumPy arrays over the engine's host buffers, zero-copy "
      "(send read-only; write results into recv and data in place), valid only during the call: do not keep "
      "them. Their dtype is uint8, int32, int64, float16, uint16 (bfloat16's bits, as NumPy has no bfloat16), "
      "float32 or float64; op is a ReduceOp. The optimizer calls these from the thread that called step() (or "
      "the constructor), holding the GIL. An exception raised by one comes out of the step or constructor as "
      "itself; the step makes its collectives before it writes anything. The buffers are host memory: a "
      "communicator serves CPU optimizers.\n\n"
      "Called on an instance from Python, the methods below take any C-contiguous CPU arrays or tensors (NumPy, "
      "torch over DLPack) and go through the C++ interface, as the optimizer calls them. "
      "stepfuse.torch.distributed.ProcessGroupCommunicator is one over a torch.distributed process group.";
  nb::class_<Communicator, PyCommunicator>(m, "Communicator", kClassDoc)
      .def(nb::init<>())
      .def("rank", &Communicator::rank, "This process's rank, 0 <= rank() < size().")
      .def("size", &Communicator::size, "The number of ranks.")
      .def(
          "name", [](const Communicator& c) { return std::string(c.name()); },
          "A short description for messages ('torch.distributed(gloo)').")
      .def(
          "all_gather",
          [](Communicator& c, InArray send, OutArray recv) {
            const CommType t = comm_type_of(send.dtype(), "all_gather");
            check_same_type(t, comm_type_of(recv.dtype(), "all_gather"), "all_gather");
            const std::size_t n = static_cast<std::size_t>(c.size());
            if (recv.size() != n * send.size())
              throw nb::value_error(("all_gather: recv has " + std::to_string(recv.size()) +
                                     " elements; size() * " + std::to_string(send.size()) + " = " +
                                     std::to_string(n * send.size()) + " expected")
                                        .c_str());
            nb::gil_scoped_release nogil;
            c.all_gather(send.data(), recv.data(), send.size(), t);
          },
          nb::arg("send"), nb::arg("recv").noconvert(),
          "recv (size() * len(send) elements) = every rank's send, in rank order.")
      .def(
          "all_reduce",
          [](Communicator& c, OutArray data, ReduceOp op) {
            const CommType t = comm_type_of(data.dtype(), "all_reduce");
            nb::gil_scoped_release nogil;
            c.all_reduce(data.data(), data.size(), t, op);
          },
          nb::arg("data").noconvert(), nb::arg("op"), "data = op over the ranks of data, in place, on every rank.")
      .def(
          "reduce_scatter",
          [](Communicator& c, InArray send, OutArray recv, ReduceOp op) {
            const CommType t = comm_type_of(send.dtype(), "reduce_scatter");
            check_same_type(t, comm_type_of(recv.dtype(), "reduce_scatter"), "reduce_scatter");
            const std::size_t n = static_cast<std::size_t>(c.size());
            if (send.size() != n * recv.size())
              throw nb::value_error(("reduce_scatter: send has " + std::to_string(send.size()) +
                                     " elements; size() * " + std::to_string(recv.size()) + " = " +
                                     std::to_string(n * recv.size()) + " expected")
                                        .c_str());
            nb::gil_scoped_release nogil;
            c.reduce_scatter(send.data(), recv.data(), recv.size(), t, op);
          },
          nb::arg("send"), nb::arg("recv").noconvert(), nb::arg("op"),
          "recv (len(send) / size() elements) = this rank's block of op over the ranks of send.")
      .def("__repr__", [](const Communicator& c) {
        return "Communicator(" + std::string(c.name()) + ", rank=" + std::to_string(c.rank()) +
               ", size=" + std::to_string(c.size()) + ")";
      });
}

}  // namespace sfpy
