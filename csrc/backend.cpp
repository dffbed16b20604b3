// Backend registry: which backends this build holds and how to open one.
#include <cstdio>
#include <sstream>

#include "backend.h"

namespace kvcached {

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
                  "kvcached (compiled: " + compiled_list() + ")");
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

std::string hex(std::uintptr_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << value;
  return out.str();
}

void report_error(const std::string& message) noexcept {
  std::fprintf(stderr, "kvcached: %s\n", message.c_str());
}

}  // namespace kvcached
