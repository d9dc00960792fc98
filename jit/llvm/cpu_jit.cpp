// ORC LLJIT holding every linked spec: one JITDylib per object, so the same
// symbol names in two specs never meet, with the process's own symbols visible
// (libm's fmaf where the CPU has no FMA instruction).
#include "jit/llvm/cpu_jit.hpp"

#include <llvm/Config/llvm-config.h>
#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/Support/Error.h>
#include <llvm/Support/MemoryBuffer.h>

#include <pthread.h>

#include <mutex>
#include <string>
#include <unordered_map>

#include "jit/base/warning.hpp"
#include "jit/kernel_cache.hpp"
#include "jit/program_analysis.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::jit {
namespace {

[[noreturn]] void link_failed(const std::string& what, llvm::Error err) {
  throw Error(ErrorCode::compile_failed, "LLVM JIT: " + what + ": " + llvm::toString(std::move(err)));
}

class Linker {
 public:
  static Linker& get() {
    static Linker* linker = new Linker();  // never destroyed: linked code lives as long as the process
    return *linker;
  }

  std::vector<void*> link(const std::string& object, const std::vector<std::string>& symbols) {
    std::lock_guard lock(mu_);
    const std::string name = "stepfuse_spec_" + std::to_string(next_++);
    auto jd = jit_->createJITDylib(name);
    if (!jd) link_failed("cannot create a JITDylib", jd.takeError());
    auto process = llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(jit_->getDataLayout().getGlobalPrefix());
    if (!process) link_failed("cannot search the process's symbols", process.takeError());
    jd->addGenerator(std::move(*process));
    if (auto err = jit_->addObjectFile(*jd, llvm::MemoryBuffer::getMemBufferCopy(object, name)))
      link_failed("cannot add the object", std::move(err));
    std::vector<void*> out;
    for (const std::string& s : symbols) {
      auto sym = jit_->lookup(*jd, s);
      if (!sym) link_failed("no symbol " + s + " in the object", sym.takeError());
#if LLVM_VERSION_MAJOR >= 15
      out.push_back(sym->toPtr<void*>());
#else
      out.push_back(reinterpret_cast<void*>(static_cast<std::uintptr_t>(sym->getAddress())));
#endif
    }
    return out;
  }

 private:
  Linker() {
    CpuTarget::host();  // initializes the native target
    auto jit = llvm::orc::LLJITBuilder().create();
    if (!jit) link_failed("cannot create LLJIT", jit.takeError());
    jit_ = std::move(*jit);
  }
  std::mutex mu_;
  std::unique_ptr<llvm::orc::LLJIT> jit_;
  int next_ = 0;
};

std::vector<std::string> symbols_of(const CpuSpec& spec) {
  std::vector<std::string> out;
  for (const DtypeCombo& c : spec.combos) out.push_back(cpu_update_symbol(c));
  for (DType g : spec.reduce_grads) out.push_back(cpu_reduce_symbol(g, spec.inf_norm));
  const bool two_phase = is_two_phase(spec.program);
  if (two_phase)
    for (const DtypeCombo& c : spec.combos) out.push_back(cpu_phase1_symbol(c));
  for (const DtypeCombo& c : spec.bf16_state) out.push_back(cpu_update_symbol(c, /*bf16_state=*/true));
  if (two_phase)
    for (const DtypeCombo& c : spec.bf16_state) out.push_back(cpu_phase1_symbol(c, /*bf16_state=*/true));
  return out;
}

// Linked specs by cache key. A spec is linked once; later calls share it.
std::mutex linked_mu;
std::unordered_map<std::string, std::shared_ptr<const CpuKernels>>& linked() {
  static auto* map = new std::unordered_map<std::string, std::shared_ptr<const CpuKernels>>();
  return *map;
}

// fork(): linked_mu is held across it, so no link (and no ORC call) is in progress in
// another thread when the child's copy is made; the child then links as the parent does.
void hold_links_across_fork() {
  static const bool registered = [] {
    pthread_atfork([] { linked_mu.lock(); }, [] { linked_mu.unlock(); }, [] { linked_mu.unlock(); });
    return true;
  }();
  (void)registered;
}

std::shared_ptr<const CpuKernels> link_object(const CpuSpec& spec, const std::string& key, const std::string& object,
                                              CpuKernels::Source source);

std::shared_ptr<const CpuKernels> kernels(const CpuSpec& spec, const CpuTarget& target, bool compile) {
  hold_links_across_fork();
  const std::string key = cpu_cache_key(spec, target);
  {
    std::lock_guard lock(linked_mu);
    if (auto it = linked().find(key); it != linked().end()) {
      auto out = std::make_shared<CpuKernels>(*it->second);
      out->source = CpuKernels::Source::linked;
      return out;
    }
  }
  KernelCache& cache = KernelCache::shared();
  for (bool evicted = false;; evicted = true) {
    CpuKernels::Source source = CpuKernels::Source::memory_cache;
    std::shared_ptr<const std::string> object = cache.find(key);
    if (!object) {
      source = CpuKernels::Source::disk_cache;
      object = cache.find_or_load(key);
    }
    if (!object) {
      if (!compile) return nullptr;
      bool compiled = false;
      object = cache.get(key, [&] {
        compiled = true;
        return cpu_compile_object(spec, target, CpuObjectKind::jit);
      });
      source = compiled ? CpuKernels::Source::compiled : CpuKernels::Source::memory_cache;
    }
    try {
      return link_object(spec, key, *object, source);
    } catch (const Error& e) {
      // Cached bytes that passed the cache's checks (so written whole, under this very
      // key) but do not link: evicted, or every later process would load them again
      // (and CpuBackend::llvm would fail for good); compiled once more. Bytes compiled
      // just now that do not link are an error.
      if (evicted || source == CpuKernels::Source::compiled || e.code() != ErrorCode::compile_failed) throw;
      cache.evict(key);
      detail::warn_once("llvm_cached_object_evicted:" + key,
                        "a cached LLVM object did not link (" + std::string(e.what()) +
                            "); it was removed from the kernel cache and the kernels are compiled again");
    }
  }
}

std::shared_ptr<const CpuKernels> link_object(const CpuSpec& spec, const std::string& key, const std::string& object,
                                              CpuKernels::Source source) {
  const std::vector<std::string> symbols = symbols_of(spec);
  std::lock_guard lock(linked_mu);  // one link per spec (linking takes a few milliseconds)
  if (auto it = linked().find(key); it != linked().end()) return it->second;
  const std::vector<void*> fns = Linker::get().link(object, symbols);
  auto out = std::make_shared<CpuKernels>();
  // In symbols_of's order: updates, reduces, phase 1s, then the bf16-state updates and phase 1s.
  auto at = fns.begin();
  const auto take = [&](std::vector<void*>& into, std::size_t n) {
    into.assign(at, at + static_cast<std::ptrdiff_t>(n));
    at += static_cast<std::ptrdiff_t>(n);
  };
  const bool two_phase = is_two_phase(spec.program);
  take(out->update, spec.combos.size());
  take(out->reduce, spec.reduce_grads.size());
  take(out->phase1, two_phase ? spec.combos.size() : 0);
  take(out->update_bf16_state, spec.bf16_state.size());
  take(out->phase1_bf16_state, two_phase ? spec.bf16_state.size() : 0);
  out->source = source;
  linked().emplace(key, out);
  return out;
}

}  // namespace

std::shared_ptr<const CpuKernels> cpu_kernels(const CpuSpec& spec) { return kernels(spec, CpuTarget::host(), true); }
std::shared_ptr<const CpuKernels> cpu_kernels_if_cached(const CpuSpec& spec) {
  return kernels(spec, CpuTarget::host(), false);
}
std::shared_ptr<const CpuKernels> cpu_kernels_for(const CpuSpec& spec, const CpuTarget& target) {
  return kernels(spec, target, true);
}

}  // namespace stepfuse::jit
