// The names of the collectives' types and ops (include/stepfuse/distributed.hpp).
#include "stepfuse/distributed.hpp"

namespace stepfuse {

std::string_view comm_type_name(CommType t) {
  switch (t) {
    case CommType::u8: return "u8";
    case CommType::i32: return "i32";
    case CommType::i64: return "i64";
    case CommType::f16: return "f16";
    case CommType::bf16: return "bf16";
    case CommType::f32: return "f32";
    case CommType::f64: return "f64";
  }
  return "?";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

}  // namespace stepfuse
