// The C ABI of the emit API (include/stepfuse/stepfuse.h): sf_emit, the emitted kernel's parts, kernel tables.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "runtime/c_api_support.hpp"
#include "stepfuse/emit.hpp"

using namespace stepfuse::c_api;  // guard, need, the checks and conversions (runtime/c_api_support.hpp)

// The C enum is the C++ one, value for value.
static_assert(SF_EMIT_CUBIN == static_cast<int>(stepfuse::EmitTarget::Kind::cuda_cubin) &&
              SF_EMIT_PTX == static_cast<int>(stepfuse::EmitTarget::Kind::cuda_ptx) &&
              SF_EMIT_CPU == static_cast<int>(stepfuse::EmitTarget::Kind::cpu));
// The cpu_* fields were appended: the older request is exactly the part before them.
static_assert(SF_EMIT_REQUEST_SIZE_V1 ==
                  (offsetof(sf_emit_request, compile) + sizeof(bool) + alignof(void*) - 1) / alignof(void*) * alignof(void*),
              "sf_emit_request before the cpu_* fields ended with `bool compile`, padded to pointer alignment");

struct sf_emitted_kernel {
  stepfuse::EmittedKernel kernel;
  std::string names;  // SF_EMITTED_KERNEL_NAMES: kernel.kernel_names, each followed by '\n'
};
struct sf_kernel_tables {
  stepfuse::KernelTables tables;
};

namespace {

stepfuse::EmitRequest to_request(const char* fn, const sf_emit_request* r) {
  need(fn, r, "request");
  // Requests from a stepfuse.h before the cpu_* fields are read without them.
  const bool has_cpu_fields = r->struct_size == sizeof(sf_emit_request);
  if (!has_cpu_fields && r->struct_size != SF_EMIT_REQUEST_SIZE_V1)
    bad_argument(fn, "request->struct_size = " + std::to_string(r->struct_size) + ", but this library knows only " +
                         std::to_string(sizeof(sf_emit_request)) + " (sizeof(sf_emit_request) in its stepfuse.h) and " +
                         std::to_string(SF_EMIT_REQUEST_SIZE_V1) +
                         " (before the cpu_* fields): initialize it with sf_emit_request_init()");
  if ((r->program == nullptr) == (r->config == nullptr))
    bad_argument(fn, "give exactly one of request->program (a custom program) and request->config (a built-in)");
  if (r->num_tensors > 0) need(fn, r->tensors, "request->tensors");
  std::vector<stepfuse::EmitTensor> tensors;
  for (std::size_t i = 0; i < r->num_tensors; ++i) {
    const std::string at = "request->tensors[" + std::to_string(i) + "]";
    const int w = enum_in_range(fn, r->tensors[i].weight, SF_F32, SF_BF16, at + ".weight", "an sf_dtype");
    const int g = enum_in_range(fn, r->tensors[i].grad, SF_F32, SF_BF16, at + ".grad", "an sf_dtype");
    const bool master = bool_value(fn, r->tensors[i].master, at + ".master");
    tensors.push_back({static_cast<stepfuse::DType>(w), static_cast<stepfuse::DType>(g), master});
  }
  const int norm = enum_in_range(fn, r->norm_type, SF_NORM_L2, SF_NORM_INF, "request->norm_type", "an sf_norm_type");
  const int target = enum_in_range(fn, r->target, SF_EMIT_CUBIN, SF_EMIT_CPU, "request->target", "an sf_emit_target");
  const bool flat = bool_value(fn, r->flat, "request->flat");
  const bool aligned16 = bool_value(fn, r->aligned16, "request->aligned16");
  const bool compile = bool_value(fn, r->compile, "request->compile");
  stepfuse::EmitTarget emit_target{static_cast<stepfuse::EmitTarget::Kind>(target), r->sm};
  if (has_cpu_fields) {
    const auto text = [](const char* s) { return s != nullptr ? std::string(s) : std::string(); };
    emit_target.cpu_name = text(r->cpu_name);
    emit_target.triple = text(r->cpu_triple);
    emit_target.features = text(r->cpu_features);
  }
  return stepfuse::EmitRequest{
      r->program != nullptr ? r->program->program
                            : stepfuse::UpdateProgram::from_config(to_config(fn, r->config)),
      std::move(tensors),
      flat,
      aligned16,
      norm == SF_NORM_L2 ? 2.0 : INFINITY,
      std::move(emit_target),
      compile};
}

}  // namespace

extern "C" {

void sf_emit_request_init_size(sf_emit_request* request, size_t struct_size) {
  sf_emit_request full{};
  full.norm_type = SF_NORM_L2;
  full.target = SF_EMIT_CUBIN;
  full.sm = 90;
  full.compile = true;
  init_struct(request, struct_size, full);
}
void(sf_emit_request_init)(sf_emit_request* request) {
  sf_emit_request_init_size(request, SF_SIZE_THROUGH(sf_emit_request, cpu_features));
}

sf_status sf_emit(const sf_emit_request* request, sf_emitted_kernel** out) {
  constexpr const char* fn = "sf_emit";
  return guard(fn, [&] {
    const stepfuse::EmitRequest r = to_request(fn, request);
    need(fn, out, "out");
    auto k = std::make_unique<sf_emitted_kernel>();
    k->kernel = stepfuse::emit(r);
    for (const std::string& name : k->kernel.kernel_names) k->names += name + "\n";
    *out = k.release();
  });
}

void sf_emitted_kernel_destroy(sf_emitted_kernel* kernel) { delete kernel; }

sf_status sf_emitted_kernel_part(const sf_emitted_kernel* kernel, sf_emitted_part part, const char** data,
                                 size_t* size) {
  constexpr const char* fn = "sf_emitted_kernel_part";
  return guard(fn, [&] {
    need_all(fn, kernel, "kernel", data, "data", size, "size");
    const stepfuse::EmittedKernel& k = kernel->kernel;
    const std::string* s = nullptr;
    switch (enum_value(part)) {
      case SF_EMITTED_SOURCE: s = &k.source; break;
      case SF_EMITTED_BINARY: s = &k.binary; break;
      case SF_EMITTED_ABI_JSON: s = &k.abi; break;
      case SF_EMITTED_ABI_HEADER: s = &k.abi_header; break;
      case SF_EMITTED_ARCH: s = &k.arch; break;
      case SF_EMITTED_KERNEL_NAMES: s = &kernel->names; break;
      default: bad_argument(fn, "part = " + std::to_string(enum_value(part)) + " is not an sf_emitted_part");
    }
    *data = s->c_str();
    *size = s->size();
  });
}

void sf_kernel_tables_info_init_size(sf_kernel_tables_info* info, size_t struct_size) {
  init_struct(info, struct_size, sf_kernel_tables_info{});
}
void(sf_kernel_tables_info_init)(sf_kernel_tables_info* info) {
  sf_kernel_tables_info_init_size(info, SF_SIZE_THROUGH(sf_kernel_tables_info, step_state_bytes));
}

sf_status sf_emit_tables(const sf_emit_request* request, const int64_t* numels, size_t count, sf_kernel_tables** out) {
  constexpr const char* fn = "sf_emit_tables";
  return guard(fn, [&] {
    const stepfuse::EmitRequest r = to_request(fn, request);
    if (count > 0) need(fn, numels, "numels");
    need(fn, out, "out");
    *out = new sf_kernel_tables{stepfuse::plan_kernel_tables(r, std::span<const std::int64_t>(numels, count))};
  });
}

sf_status sf_kernel_tables_get(const sf_kernel_tables* tables, sf_kernel_tables_info* info) {
  constexpr const char* fn = "sf_kernel_tables_get";
  return guard(fn, [&] {
    need_all(fn, tables, "tables", info, "info");
    if (info->struct_size != sizeof(sf_kernel_tables_info))
      bad_argument(fn, "info->struct_size = " + std::to_string(info->struct_size) + ", but this library knows only " +
                           std::to_string(sizeof(sf_kernel_tables_info)) + ": initialize it with sf_kernel_tables_info_init()");
    const stepfuse::KernelTables& t = tables->tables;
    info->tensors = t.tensors.data();
    info->num_tensors = t.tensors.size();
    info->master_offsets = t.master_offsets.data();
    info->chunks = t.chunks.data();
    info->num_chunks = t.chunks.size();
    info->blocks = t.blocks.data();
    info->num_blocks = t.blocks.size();
    info->state_elems = t.state_elems;
    info->master_elems = t.master_elems;
    info->flat_numel = t.flat_numel;
    info->reduce_grid = t.reduce_grid;
    info->reduce_block = t.reduce_block;
    info->update_grid = t.update_grid;
    info->update_block = t.update_block;
    info->partials_bytes = t.partials_bytes;
    info->tensor_sums_bytes = t.tensor_sums_bytes;
    info->step_state_bytes = t.step_state_bytes;
  });
}

void sf_kernel_tables_destroy(sf_kernel_tables* tables) { delete tables; }

}  // extern "C"
