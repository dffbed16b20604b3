// Backend registry: which backends this build holds and how to open one.
#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <mutex>

#include "backend.h"

namespace kvcached {

namespace {
std::atomic<std::uint64_t> g_fork_generation{0};
void count_fork_in_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

std::uint64_t fork_generation() {
  static std::once_flag registered;
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, count_fork_in_child); });
  return g_fork_generation.load(std::memory_order_relaxed);
}

std::vector<std::string> compiled_backends() {
  std::vector<std::string> out;
#ifdef KVCACHED_WITH_CUDA
  out.emplace_back("cuda");
#endif
#ifdef KVCACHED_WITH_HIP
  out.emplace_back("hip");
#endif
  out.emplace_back("host");
  return out;
}

namespace {
std::string compiled_list() {
  std::string names;
  for (const auto& b : compiled_backends()) names += (names.empty() ? "" : ", ") + b;
  return names;
}

[[noreturn]] void not_compiled(const std::string& backend) {
  throw Error(ErrorKind::kUnavailable,
              "backend '" + backend + "' is not compiled into this build of " +
                  "kvcached (compiled: " + compiled_list() +
                  "); it was left out with KVCACHED_BACKENDS at build time: "
                  "reinstall kvcached-core without that variable set");
}
}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& backend, int device) {
  if (backend == "host") return make_host_backend(device);
  if (backend == "cuda") {
#ifdef KVCACHED_WITH_CUDA
    return make_cuda_backend(device);
#else
    not_compiled(backend);
#endif
  }
  if (backend == "hip") {
#ifdef KVCACHED_WITH_HIP
    return make_hip_backend(device);
#else
    not_compiled(backend);
#endif
  }
  throw Error(ErrorKind::kInvalidArgument,
              "unknown backend '" + backend + "' (known: cuda, hip, host)");
}

bool SymbolReport::complete() const {
  if (!load_error.empty()) return false;
  for (const auto& s : symbols)
    if (!s.second) return false;
  return true;
}

std::string SymbolReport::missing() const {
  std::string out;
  for (const auto& s : symbols)
    if (!s.second) out += (out.empty() ? "" : ", ") + s.first;
  return out;
}

void* open_first_library(std::initializer_list<const char*> libraries, SymbolReport& report) {
  std::string errors;
  for (const char* name : libraries) {
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
      report.library = name;
      report.load_error.clear();
      return lib;
    }
    const char* err = dlerror();
    errors += (errors.empty() ? "" : "; ") + std::string(err ? err : name);
  }
  report.library = *libraries.begin();
  report.load_error = errors.empty() ? "dlopen failed" : errors;
  return nullptr;
}

void* resolve_symbol(void* library, const char* symbol, SymbolReport& report) {
  void* sym = library ? dlsym(library, symbol) : nullptr;
  report.symbols.emplace_back(symbol, sym != nullptr);
  return sym;
}

SymbolReport probe_backend(const std::string& backend) {
#ifdef KVCACHED_WITH_CUDA
  if (backend == "cuda") return probe_cuda();
#endif
#ifdef KVCACHED_WITH_HIP
  if (backend == "hip") return probe_hip();
#endif
  if (backend == "host") return SymbolReport{"libc", "", {}};
  not_compiled(backend);
}

// snprintf rather than iostreams: a stream's locale machinery can come from
// another libstdc++ than the one this extension was built with (torch and
// other extensions load their own), and crash when touched.
std::string hex(std::uintptr_t value) {
  char buf[2 + 2 * sizeof(value) + 1];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(value));
  return buf;
}

void report_error(const std::string& message) noexcept {
  std::fprintf(stderr, "kvcached: %s\n", message.c_str());
}

}  // namespace kvcached
