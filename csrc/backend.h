// One small interface over a device's virtual-memory management API.
//
// A backend reserves address ranges, creates physical handles, maps a handle
// into a reserved range, grants access, unmaps and releases. Every failure is
// a kvcached::Error; nothing here aborts or exits the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvcached {

enum class ErrorKind {
  kDriver,           // the driver refused a call
  kOutOfMemory,      // no physical memory for a new handle
  kUnavailable,      // backend not compiled in, library or device missing
  kInvalidArgument,  // bad offset, size, page index, double map/unmap
  kForked,           // used in a process forked from the one that opened it
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// An opaque physical-memory handle (CUmemGenericAllocationHandle,
// hipMemGenericAllocationHandle_t, or a memfd slot for the host backend).
using Handle = std::uint64_t;

struct MemInfo {
  std::size_t free_bytes;
  std::size_t total_bytes;
};

// DLPack device type codes handed to torch.from_dlpack.
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLROCM = 10;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const noexcept = 0;
  virtual int device() const noexcept = 0;
  virtual int dlpack_device_type() const noexcept = 0;
  // Smallest size and alignment a handle and a mapping may have.
  virtual std::size_t granularity() const noexcept = 0;

  virtual std::uintptr_t reserve(std::size_t size, std::size_t alignment) = 0;
  // Never throws: called from destructors. Failures are reported on stderr.
  virtual void free_range(std::uintptr_t addr, std::size_t size) noexcept = 0;

  virtual Handle create(std::size_t size) = 0;
  virtual void release(Handle handle, std::size_t size) = 0;
  virtual void map(std::uintptr_t addr, std::size_t size, Handle handle) = 0;
  virtual void set_access(std::uintptr_t addr, std::size_t size) = 0;
  virtual void unmap(std::uintptr_t addr, std::size_t size) = 0;

  virtual MemInfo mem_info() = 0;
  // Wait until work queued on the device can no longer touch any mapping.
  virtual void synchronize() = 0;
};

// Backends built into this extension, in preference order.
std::vector<std::string> compiled_backends();

// Open `backend` ("host", "cuda", "hip") for one device index.
std::unique_ptr<Backend> make_backend(const std::string& backend, int device);

// For diagnostics: the driver library a GPU backend loads and, for each
// entry point in its symbol table, whether it resolved.
struct SymbolReport {
  std::string library;
  std::string load_error;  // empty when the library loaded
  std::vector<std::pair<std::string, bool>> symbols;

  // The library loaded and every symbol resolved.
  bool complete() const;
  // The symbols not found, comma-separated.
  std::string missing() const;
};

// A GPU backend's entry points are loaded at run time, never linked: the first of
// `libraries` that dlopen loads (its name in report.library; when none loads, the
// first name and every loader error in report.load_error), then each symbol by its
// exact ABI name through resolve_symbol (nullptr, and recorded as missing, when the
// library lacks it or did not load).
void* open_first_library(std::initializer_list<const char*> libraries, SymbolReport& report);
void* resolve_symbol(void* library, const char* symbol, SymbolReport& report);
SymbolReport probe_backend(const std::string& backend);

std::unique_ptr<Backend> make_host_backend(int device);
#ifdef KVCACHED_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int device);
SymbolReport probe_cuda();
#endif
#ifdef KVCACHED_WITH_HIP
std::unique_ptr<Backend> make_hip_backend(int device);
SymbolReport probe_hip();
#endif

// How many times this process (or its ancestors since it loaded the
// extension) forked into a child: 0 in the process that loaded it. The first
// call registers the pthread_atfork handler that counts, so call it before
// any fork that must be seen (a mapper does, when it is opened).
std::uint64_t fork_generation();

// Helpers shared by the backends.
std::string hex(std::uintptr_t value);
void report_error(const std::string& message) noexcept;

}  // namespace kvcached
