// fuzz_c_abi: the C ABI (stepfuse.h) with structs filled from the input.
//
// The input fills sf_optimizer_options, up to two param groups (each an
// sf_optimizer_config and up to three params) and then drives a sequence of calls:
// set_config, set_group_config, set_lr, step, step_scaled, state and program_text
// queries, checkpoint save and load (with and without a grad scaler), the scaler's
// load_state_dict, and finally destroy. Doubles, integers and enums are raw bytes
// (enums out of range included: a C caller may pass any int); bools are 0 or 1 (any
// other byte is a trap representation in C, the caller's undefined behaviour); pointers
// are the harness's own: every tensor's data points into a buffer of 16 elements of 4
// bytes that the harness owns, its numel clamped to that (negative numels are kept), or
// is NULL. Threads are clamped to 0..4 (the fuzzer is not after huge thread pools).
//
// Oracle: every call returns a status of the documented set (SF_OK to SF_IO_ERROR and
// SF_OUT_OF_MEMORY; never SF_INTERNAL nor an undocumented value); after a failure
// sf_last_error() is a NUL-terminated string shorter than 64 KiB; an optimizer's
// state and master queries return sizes within the tensors given.
//
// STEPFUSE_FUZZ_WRITE_SEEDS=<dir>: writes the seed corpus into <dir> and exits.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "stepfuse/stepfuse.h"

namespace {

[[noreturn]] void oracle_failed(const std::string& what) {
  std::fprintf(stderr, "fuzz_c_abi: ORACLE FAILED: %s\n", what.c_str());
  std::abort();
}

void check(sf_status s, const char* call) {
  if (std::getenv("STEPFUSE_FUZZ_DEBUG"))
    std::fprintf(stderr, "%s: %s %s\n", call, sf_status_name(s), s == SF_OK ? "" : sf_last_error());
  if (s == SF_OK) return;
  if (s != SF_INVALID_ARGUMENT && s != SF_INVALID_STATE && s != SF_UNSUPPORTED && s != SF_COMPILE_FAILED &&
      s != SF_DEVICE_ERROR && s != SF_IO_ERROR && s != SF_OUT_OF_MEMORY)
    oracle_failed(std::string(call) + " returned status " + std::to_string(static_cast<int>(s)) + " (" +
                  sf_status_name(s) + "): " + (sf_last_error() ? sf_last_error() : "(null)"));
  const char* message = sf_last_error();
  if (message == nullptr) oracle_failed(std::string(call) + " failed and sf_last_error() is NULL");
  if (::strnlen(message, 65536) >= 65536) oracle_failed(std::string(call) + ": sf_last_error() is not bounded");
}

struct Reader {
  const std::uint8_t* p;
  std::size_t n;
  bool empty() const { return n == 0; }
  std::uint8_t u8() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  void bytes(void* out, std::size_t k) {
    auto* o = static_cast<std::uint8_t*>(out);
    for (std::size_t i = 0; i < k; ++i) o[i] = u8();
  }
  double f64() {
    static constexpr double kTable[] = {1e-3, 0.0, 0.9, 0.999, 1e-8, 1.0, 0.5, 2.0, -1.0, 1e300, 65536.0, 1e-2};
    const std::uint8_t b = u8();
    if (b < 240) return kTable[b % std::size(kTable)];
    double d;
    bytes(&d, 8);
    return d;
  }
};

// Sets a bool member from one input bit (never another byte value).
template <typename T>
void set_bool(T* s, std::size_t offset, Reader& r) {
  const std::uint8_t v = r.u8() & 1;
  std::memcpy(reinterpret_cast<unsigned char*>(s) + offset, &v, 1);
}
void set_enum(void* field, Reader& r) {
  const std::uint8_t b = r.u8();
  std::int32_t v = b < 248 ? b % 16 : 0;
  if (b >= 248) r.bytes(&v, 4);  // any int, negative ones included
  std::memcpy(field, &v, sizeof v);
}

// A config: a kind's defaults with some fields replaced, or every byte from the input.
void fill_config(sf_optimizer_config* c, Reader& r) {
  const std::uint8_t how = r.u8();
  std::int32_t kind;
  set_enum(&kind, r);
  sf_optimizer_config_init(c, static_cast<sf_optimizer_kind>(kind));
  if ((how & 3) == 3) {
    r.bytes(c, sizeof *c);
    if ((how & 4) == 0) c->struct_size = sizeof *c;
    for (std::size_t off : {offsetof(sf_optimizer_config, amsgrad), offsetof(sf_optimizer_config, nesterov),
                            offsetof(sf_optimizer_config, centered), offsetof(sf_optimizer_config, maximize),
                            offsetof(sf_optimizer_config, decoupled_weight_decay)})
      set_bool(c, off, r);
    return;
  }
  for (int i = 0; i < (how >> 2) % 4; ++i) {
    switch (r.u8() % 8) {
      case 0: c->lr = r.f64(); break;
      case 1: c->beta1 = r.f64(); break;
      case 2: c->beta2 = r.f64(); break;
      case 3: c->eps = r.f64(); break;
      case 4: c->weight_decay = r.f64(); break;
      case 5: c->momentum = r.f64(); break;
      case 6: set_bool(c, offsetof(sf_optimizer_config, amsgrad), r); break;
      case 7: set_bool(c, offsetof(sf_optimizer_config, nesterov), r); break;
    }
  }
}

void fill_options(sf_optimizer_options* o, Reader& r) {
  sf_optimizer_options_init(o);
  const std::uint8_t how = r.u8();
  if ((how & 1) == 0) return;
  set_enum(&o->device.kind, r);
  o->device.index = static_cast<int>(r.u8() % 3) - 1;
  set_bool(o, offsetof(sf_optimizer_options, has_max_grad_norm), r);
  o->max_grad_norm = r.f64();
  set_enum(&o->norm_type, r);
  set_bool(o, offsetof(sf_optimizer_options, master_weights), r);
  set_enum(&o->fusion, r);
  o->num_threads = static_cast<int>(r.u8() % 6) - 1;
  set_bool(o, offsetof(sf_optimizer_options, track_grad_norm), r);
  set_enum(&o->cpu_backend, r);
  set_bool(o, offsetof(sf_optimizer_options, llvm_contract), r);
  if ((how & 2) != 0) o->struct_size = static_cast<std::uint32_t>(SF_OPTIMIZER_OPTIONS_SIZE_V1);
  if ((how & 6) == 6) o->struct_size = r.u8();
}

constexpr int kElems = 16;
struct Buffers {
  float w[6][kElems], g[6][kElems];
};

void fill_view(sf_tensor_view* v, float* buffer, Reader& r) {
  const std::uint8_t b = r.u8();
  set_enum(&v->dtype, r);
  v->numel = static_cast<std::int64_t>(b % (kElems + 3)) - 2;  // -2 .. kElems
  v->data = (b & 0x80) != 0 && v->numel <= 0 ? nullptr : buffer;
}

const char* kStateNames[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "", "nope"};

void exercise(sf_optimizer* opt, int num_params, Reader& r, const std::string& path) {
  sf_grad_scaler* scaler = nullptr;
  sf_grad_scaler_options so;
  sf_grad_scaler_options_init(&so);
  so.device = "cpu";
  check(sf_grad_scaler_create(&so, &scaler), "sf_grad_scaler_create");
  for (int calls = 0; calls < 24 && !r.empty(); ++calls) {
    switch (r.u8() % 11) {
      case 0: {
        sf_optimizer_config c;
        fill_config(&c, r);
        check(sf_optimizer_set_config(opt, &c), "sf_optimizer_set_config");
        break;
      }
      case 1: {
        sf_optimizer_config c;
        const size_t group = r.u8() % 3;
        fill_config(&c, r);
        check(sf_optimizer_set_group_config(opt, group, &c), "sf_optimizer_set_group_config");
        break;
      }
      case 2:
        check(sf_optimizer_set_lr(opt, r.f64()), "sf_optimizer_set_lr");
        break;
      case 3:
        check(sf_optimizer_step(opt), "sf_optimizer_step");
        break;
      case 4: {
        sf_step_result result;
        sf_step_result_init(&result);
        check(sf_optimizer_step_scaled(opt, r.f64(), &result), "sf_optimizer_step_scaled");
        break;
      }
      case 5: {
        const size_t param = r.u8() % (num_params + 1);
        const float* data = nullptr;
        int64_t numel = -1;
        const sf_status s = sf_optimizer_state(opt, param, kStateNames[r.u8() % std::size(kStateNames)], &data, &numel);
        check(s, "sf_optimizer_state");
        if (s == SF_OK && (numel < 0 || numel > kElems)) oracle_failed("sf_optimizer_state: a size beyond the tensor");
        const sf_status m = sf_optimizer_master(opt, param, &data, &numel);
        check(m, "sf_optimizer_master");
        if (m == SF_OK && (numel < 0 || numel > kElems)) oracle_failed("sf_optimizer_master: a size beyond the tensor");
        break;
      }
      case 6: {
        char buf[32];
        std::memset(buf, 'x', sizeof buf);
        size_t needed = 0;
        const size_t cap = r.u8() % (sizeof buf + 1);
        const sf_status s = sf_optimizer_program_text(opt, cap == 0 ? nullptr : buf, cap, &needed);
        check(s, "sf_optimizer_program_text");
        if (cap > 0 && (s == SF_OK || s == SF_INVALID_ARGUMENT) && ::strnlen(buf, cap) == cap)
          oracle_failed("sf_optimizer_program_text: the buffer is not NUL-terminated");
        break;
      }
      case 7:
        check(sf_optimizer_save(opt, path.c_str(), (r.u8() & 1) != 0 ? scaler : nullptr), "sf_optimizer_save");
        break;
      case 8:
        check(sf_optimizer_load(opt, path.c_str(), (r.u8() & 1) != 0 ? scaler : nullptr), "sf_optimizer_load");
        break;
      case 9: {
        sf_grad_scaler_state st;
        sf_grad_scaler_state_init(&st);
        if ((r.u8() & 1) != 0) {
          check(sf_grad_scaler_state_dict(scaler, &st), "sf_grad_scaler_state_dict");
        } else {
          r.bytes(&st, sizeof st);
          set_bool(&st, offsetof(sf_grad_scaler_state, empty), r);
        }
        check(sf_grad_scaler_load_state_dict(scaler, &st), "sf_grad_scaler_load_state_dict");
        break;
      }
      case 10: {
        bool applied = false;
        check(sf_grad_scaler_unscale_(scaler, opt), "sf_grad_scaler_unscale_");
        check(sf_grad_scaler_step(scaler, opt, &applied), "sf_grad_scaler_step");
        const double s = r.f64();
        check(sf_grad_scaler_update(scaler, (r.u8() & 1) != 0 ? &s : nullptr), "sf_grad_scaler_update");
        break;
      }
    }
  }
  sf_grad_scaler_destroy(scaler);
}

std::string g_path;

void write_seeds(const char* dir) {
  const auto put = [&](const char* name, const std::vector<int>& bytes) {
    std::string s;
    for (int b : bytes) s += static_cast<char>(b);
    std::ofstream(std::string(dir) + "/" + name, std::ios::binary) << s;
  };
  // Options: defaults; one group: AdamW's defaults; two f32 params of 5 and 7 elements;
  // then step_scaled(65536), state("exp_avg"), save and load with the scaler, step, text.
  put("adamw_one_group", {0, 0, 0, SF_ADAMW, 2, 7, 0, 7, 0, 9, 0, 9, 0, 4, 10, 5, 0, 0, 7, 1, 8, 1, 3, 6, 20});
  // Two SGD groups (momentum 0.5; momentum 0.9 with nesterov), bf16 weights with f32
  // grads; the scaler's unscale/step/update, a state_dict round trip, step_scaled,
  // set_group_config, set_lr.
  put("sgd_two_groups", {0, 1, 4, SF_SGD, 5, 6, 1, 11, 2, 11, 0, 8, SF_SGD, 5, 2, 7, 1, 1, 11, 2, 11, 0,
                         10, 10, 0, 9, 1, 4, 10, 1, 1, 0, SF_SGD, 2, 11});
  // Every option from the input (clipping by the inf-norm, interpreted, one thread,
  // Highway), and every byte of an RMSprop config.
  std::vector<int> raw = {1, SF_DEVICE_CPU, 1, 1, 5, SF_NORM_INF, 1, SF_FUSION_INTERPRETED, 2, 1,
                          SF_CPU_BACKEND_HIGHWAY, 0, 0, 3, SF_RMSPROP};
  sf_optimizer_config c;
  std::memset(&c, 0, sizeof c);
  sf_optimizer_config_init(&c, SF_RMSPROP);
  const auto* bytes = reinterpret_cast<const unsigned char*>(&c);
  raw.insert(raw.end(), bytes, bytes + sizeof c);
  raw.insert(raw.end(), {0, 0, 0, 0, 0, 1, 12, 0, 12, 0, 4, 5, 0, 0, SF_RMSPROP, 3});
  put("raw_config", raw);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string base = std::string(tmp && *tmp ? tmp : "/tmp") + "/stepfuse_fuzz_c_abi." + std::to_string(::getpid());
  g_path = base + ".safetensors";
  ::setenv("STEPFUSE_CACHE_DIR", "off", 1);  // compiled kernels in memory only
  sf_set_warning_handler([](const char*, void*) {}, nullptr);
  if (const char* dir = std::getenv("STEPFUSE_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  std::atexit([] { std::remove(g_path.c_str()); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader r{data, size};
  static Buffers buffers;
  for (int t = 0; t < 6; ++t)
    for (int i = 0; i < kElems; ++i) {
      buffers.w[t][i] = 0.25f * static_cast<float>(i - t);
      buffers.g[t][i] = 0.125f * static_cast<float>(3 * t - i);
    }
  sf_optimizer_options options;
  fill_options(&options, r);
  const int num_groups = r.u8() % 3 + 1;  // 3 means none: a NULL group list
  sf_optimizer_config configs[2];
  sf_param params[6];
  sf_param_group groups[2];
  int num_params = 0;
  for (int g = 0; g < num_groups && g < 2; ++g) {
    fill_config(&configs[g], r);
    const int n = r.u8() % 4;  // 0: an empty group
    groups[g] = {params + num_params, static_cast<size_t>(n), &configs[g]};
    for (int p = 0; p < n; ++p, ++num_params) {
      fill_view(&params[num_params].weight, buffers.w[num_params], r);
      fill_view(&params[num_params].grad, buffers.g[num_params], r);
    }
  }
  sf_optimizer* opt = nullptr;
  sf_status s;
  if (num_groups == 1) {
    s = sf_optimizer_create(&configs[0], params, num_params, &options, &opt);
    check(s, "sf_optimizer_create");
  } else {
    s = sf_optimizer_create_groups(num_groups == 3 ? nullptr : groups, num_groups == 3 ? 0 : 2, &options, &opt);
    check(s, "sf_optimizer_create_groups");
  }
  if (s == SF_OK) {
    if (opt == nullptr) oracle_failed("SF_OK without an optimizer");
    exercise(opt, num_params, r, g_path);
    sf_optimizer_destroy(opt);
  } else if (opt != nullptr) {
    oracle_failed("a failed create wrote *out");
  }
  return 0;
}
