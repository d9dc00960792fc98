// Tensors from Python: DLPack (torch, NumPy, JAX, CuPy, anything with __dlpack__) or the
// buffer protocol, taken zero-copy through nanobind's ndarray.
#include <string>

#include "common.hpp"

namespace sfpy {

namespace {

// DLPack's device types (dlpack.h: DLDeviceType).
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

std::string dtype_str(const nb::dlpack::dtype& dt) {
  // DLPack's type codes (dlpack.h: DLDataTypeCode), named as NumPy and torch spell them.
  static const char* const kSmallFloats[] = {"float8_e3m4",   "float8_e4m3",     "float8_e4m3b11fnuz",
                                             "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                             "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn",
                                             "float6_e3m2fn", "float4_e2m1fn"};
  std::string s;
  switch (dt.code) {
    case 0: s = "int" + std::to_string(dt.bits); break;
    case 1: s = "uint" + std::to_string(dt.bits); break;
    case 2: s = "float" + std::to_string(dt.bits); break;
    case 4: s = "bfloat" + std::to_string(dt.bits); break;
    case 5: s = "complex" + std::to_string(dt.bits); break;
    case 6: s = "bool"; break;
    case 18: s = "bcomplex" + std::to_string(dt.bits); break;
    default:
      if (dt.code >= 7 && dt.code <= 17) s = kSmallFloats[dt.code - 7];
      else return "DLPack type code " + std::to_string(dt.code) + " with " + std::to_string(dt.bits) + " bits";
  }
  if (dt.lanes != 1) s += "x" + std::to_string(dt.lanes);
  return s;
}

std::string device_type_str(int type) {
  switch (type) {
    case 4: return "OpenCL";
    case 7: return "Vulkan";
    case 8: return "Metal";
    case 9: return "VPI";
    case 10: return "ROCm";
    case 11: return "ROCm host";
    case 12: return "ext_dev";
    case 13: return "CUDA managed memory";
    case 14: return "oneAPI";
    case 15: return "WebGPU";
    case 16: return "Hexagon";
    default: return "DLPack device type " + std::to_string(type);
  }
}

std::string py_type_name(nb::handle obj) { return nb::inst_name(obj).c_str(); }

}  // namespace

std::string device_name(const stepfuse::Device& d) {
  return d.kind == stepfuse::Device::Kind::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

stepfuse::Device parse_device(const std::string& s, bool* any_index) {
  *any_index = false;
  if (s == "cpu") return stepfuse::Device::cpu();
  if (s == "cuda") {
    *any_index = true;
    return stepfuse::Device::cuda(0);
  }
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 9) {
    int index = 0;
    bool digits = true;
    for (std::size_t i = 5; i < s.size(); ++i) {
      if (s[i] < '0' || s[i] > '9') digits = false;
      else index = index * 10 + (s[i] - '0');
    }
    if (digits) return stepfuse::Device::cuda(index);
  }
  throw nb::value_error(("device '" + s + "' is not one of 'cpu', 'cuda', 'cuda:N'").c_str());
}

Tensor import_tensor(nb::handle obj, const std::string& what) {
  if (obj.is_none())
    throw nb::type_error((what + " is None: every parameter needs a weight and a gradient tensor (for a torch "
                                 "parameter without .grad yet, allocate it first, e.g. p.grad = torch.zeros_like(p))")
                             .c_str());
  nb::object src = nb::borrow(obj);
  // torch refuses to export a tensor that requires grad (an nn.Parameter); its detached
  // alias has the same storage, and that storage is what the optimizer updates.
  if (nb::hasattr(obj, "requires_grad") && nb::hasattr(obj, "detach")) {
    nb::object rg = obj.attr("requires_grad");
    if (nb::isinstance<nb::bool_>(rg) && nb::cast<bool>(rg)) src = obj.attr("detach")();
  }
  Tensor t;
  t.owner = nb::borrow(obj);
  if (!nb::try_cast(src, t.array, /*convert=*/false)) {
    throw nb::type_error((what + ": expected a writable tensor or array (an object with __dlpack__, such as a "
                                 "torch tensor, or a NumPy array), not " + py_type_name(obj))
                             .c_str());
  }
  const nb::ndarray<>& a = t.array;
  const nb::dlpack::dtype dt = a.dtype();
  if (dt.lanes == 1 && dt.code == 2 && dt.bits == 32) t.view.dtype = stepfuse::DType::f32;
  else if (dt.lanes == 1 && dt.code == 2 && dt.bits == 16) t.view.dtype = stepfuse::DType::f16;
  else if (dt.lanes == 1 && dt.code == 4 && dt.bits == 16) t.view.dtype = stepfuse::DType::bf16;
  else
    throw nb::type_error((what + " has dtype " + dtype_str(dt) + "; stepfuse takes float32, float16 and bfloat16 tensors")
                             .c_str());

  switch (a.device_type()) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: the CPU reads it directly
      t.device = stepfuse::Device::cpu();
      break;
    case kDLCUDA: t.device = stepfuse::Device::cuda(a.device_id()); break;
    default:
      throw nb::value_error((what + " is in " + device_type_str(a.device_type()) +
                             "; stepfuse takes tensors on the CPU and on CUDA GPUs")
                                .c_str());
  }
  (void)kDLCUDAManaged;

  // Row-major and dense: each stride the product of the sizes after it; a dimension of
  // size 1 may have any stride (torch gives them several), and an empty tensor has no
  // elements to misplace.
  t.shape.resize(a.ndim());
  std::int64_t numel = 1;
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    t.shape[i] = a.shape(i);
    numel *= static_cast<std::int64_t>(a.shape(i));
  }
  if (numel > 0) {
    std::int64_t expected = 1;
    for (std::size_t k = a.ndim(); k-- > 0;) {
      if (a.shape(k) != 1 && a.stride(k) != expected) {
        std::string shape, strides;
        for (std::size_t i = 0; i < a.ndim(); ++i) {
          shape += (i ? ", " : "") + std::to_string(a.shape(i));
          strides += (i ? ", " : "") + std::to_string(a.stride(i));
        }
        throw nb::value_error((what + " is not contiguous (shape (" + shape + "), strides (" + strides +
                               ") in elements): pass a row-major dense tensor (call .contiguous() on it, or "
                               "numpy.ascontiguousarray)")
                                  .c_str());
      }
      expected *= static_cast<std::int64_t>(a.shape(k));
    }
  }
  t.view.data = a.data();
  t.view.numel = numel;
  return t;
}

}  // namespace sfpy
