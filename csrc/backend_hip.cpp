// HIP backend: the HIP runtime's VMM API (hipMem*) loaded at run time from
// libamdhip64.so through one symbol table, like the CUDA backend. No HIP
// header is needed to build it: the types, constants and signatures used are
// declared in driver_api/hip_runtime.h (checked against the real
// hip/hip_runtime_api.h by tests/backends/test_driver_abi.py wherever one is
// installed). Entry points are resolved by their exact ABI symbol.
//
// The allocation properties are passed in the layout the loaded runtime
// reads: HIP 5.3 reordered hipMemAllocationProp (see hip_runtime.h), so the
// runtime's version picks the struct, not the header a build happened to see.
//
// HIP keeps a current device per thread; each call switches to the backend's
// device and back, so the runtime state PyTorch-ROCm sees is unchanged.
#include "backend.h"
#include "driver_api/hip_runtime.h"

namespace kvcached {
namespace {

using namespace hip_runtime;

struct HipApi {
#define KVCACHED_FIELD(name, symbol, ...) fn::name* name = nullptr;
  KVCACHED_HIP_RUNTIME_FUNCTIONS(KVCACHED_FIELD)
#undef KVCACHED_FIELD
  void* lib = nullptr;
  SymbolReport report;
};

HipApi load_api() {
  HipApi api;
  // Tried in order; the unversioned name comes from a -dev package or ROCm.
  api.lib = open_first_library({"libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"},
                               api.report);
#define KVCACHED_RESOLVE(name, symbol, ...) \
  api.name = reinterpret_cast<fn::name*>(resolve_symbol(api.lib, symbol, api.report));
  KVCACHED_HIP_RUNTIME_FUNCTIONS(KVCACHED_RESOLVE)
#undef KVCACHED_RESOLVE
  return api;
}

const HipApi& api() {
  static const HipApi instance = load_api();
  return instance;
}

std::string describe(hipError_t rc) {
  const char* name = api().hipGetErrorName ? api().hipGetErrorName(rc) : nullptr;
  const char* text = api().hipGetErrorString ? api().hipGetErrorString(rc) : nullptr;
  std::string out = name ? name : ("hipError_t " + std::to_string(static_cast<int>(rc)));
  if (text) out += std::string(" (") + text + ")";
  return out;
}

void check(hipError_t rc, const char* call, const std::string& what) {
  if (rc == hipSuccess) return;
  ErrorKind kind = rc == hipErrorOutOfMemory ? ErrorKind::kOutOfMemory
                   : rc == hipErrorInvalidValue ? ErrorKind::kInvalidArgument
                                                : ErrorKind::kDriver;
  throw Error(kind, std::string("hip backend: ") + call + " " + what +
                        " failed: " + describe(rc));
}

void* as_ptr(std::uintptr_t addr) { return reinterpret_cast<void*>(addr); }

class HipBackend final : public Backend {
 public:
  explicit HipBackend(int device) : device_(device) {
    const HipApi& a = api();
    if (!a.report.load_error.empty()) {
      throw Error(ErrorKind::kUnavailable,
                  "hip backend: cannot load libamdhip64.so (" +
                      a.report.load_error + "); is ROCm installed on this machine?");
    }
    if (!a.report.complete()) {
      throw Error(ErrorKind::kUnavailable, "hip backend: " + a.report.library +
                                               " lacks entry points: " + a.report.missing());
    }
    hipError_t rc = a.hipInit(0);
    int count = 0;
    if (rc == hipSuccess) rc = a.hipGetDeviceCount(&count);
    if (rc != hipSuccess || count == 0) {
      throw Error(ErrorKind::kUnavailable,
                  "hip backend: no AMD GPU found (" +
                      (rc != hipSuccess ? describe(rc) : std::string("0 devices")) +
                      "); the HIP runtime loaded from " + a.report.library +
                      " but has no device to use");
    }
    if (device < 0 || device >= count) {
      throw Error(ErrorKind::kInvalidArgument,
                  "hip backend: device index " + std::to_string(device) +
                      " out of range; this machine has " + std::to_string(count) +
                      " HIP device(s)");
    }
    int version = 0;
    check(a.hipRuntimeGetVersion(&version), "hipRuntimeGetVersion", "");
    const hipMemLocation location{hipMemLocationTypeDevice, device_};
    if (version < kPropReorderedVersion) {
      prop_hip52_ = hipMemAllocationProp_hip52{};
      prop_hip52_.type = hipMemAllocationTypePinned;
      prop_hip52_.requestedHandleType = hipMemHandleTypeNone;
      prop_hip52_.location = location;
      // The runtime reads the older layout through the same parameter.
      prop_ptr_ = reinterpret_cast<const hipMemAllocationProp*>(&prop_hip52_);
    } else {
      prop_ = hipMemAllocationProp{};
      prop_.type = hipMemAllocationTypePinned;
      prop_.requestedHandleType = hipMemHandleTypeNone;
      prop_.location = location;
      prop_ptr_ = &prop_;
    }
    access_ = hipMemAccessDesc{};
    access_.location = location;
    access_.flags = hipMemAccessFlagsProtReadWrite;
    DeviceGuard guard(device_);
    check(a.hipMemGetAllocationGranularity(&granularity_, prop_ptr_,
                                           hipMemAllocationGranularityMinimum),
          "hipMemGetAllocationGranularity",
          "(device " + std::to_string(device_) + " may not support VMM)");
  }

  const char* name() const noexcept override { return "hip"; }
  int device() const noexcept override { return device_; }
  int dlpack_device_type() const noexcept override { return kDLROCM; }
  std::size_t granularity() const noexcept override { return granularity_; }

  std::uintptr_t reserve(std::size_t size, std::size_t alignment) override {
    DeviceGuard guard(device_);
    void* ptr = nullptr;
    check(api().hipMemAddressReserve(&ptr, size, alignment, nullptr, 0),
          "hipMemAddressReserve", std::to_string(size) + " bytes");
    return reinterpret_cast<std::uintptr_t>(ptr);
  }

  void free_range(std::uintptr_t addr, std::size_t size) noexcept override {
    try {
      DeviceGuard guard(device_);
      hipError_t rc = api().hipMemAddressFree(as_ptr(addr), size);
      if (rc != hipSuccess)
        report_error("hip backend: hipMemAddressFree(" + hex(addr) +
                     ") failed: " + describe(rc));
    } catch (const std::exception& e) {
      report_error(e.what());
    }
  }

  Handle create(std::size_t size) override {
    DeviceGuard guard(device_);
    hipMemGenericAllocationHandle_t h = nullptr;
    check(api().hipMemCreate(&h, size, prop_ptr_, 0), "hipMemCreate",
          std::to_string(size) + " bytes on device " + std::to_string(device_));
    return static_cast<Handle>(reinterpret_cast<std::uintptr_t>(h));
  }

  void release(Handle handle, std::size_t) override {
    DeviceGuard guard(device_);
    check(api().hipMemRelease(to_handle(handle)), "hipMemRelease", "");
  }

  void map(std::uintptr_t addr, std::size_t size, Handle handle) override {
    DeviceGuard guard(device_);
    check(api().hipMemMap(as_ptr(addr), size, 0, to_handle(handle), 0), "hipMemMap",
          "at " + hex(addr));
  }

  void set_access(std::uintptr_t addr, std::size_t size) override {
    DeviceGuard guard(device_);
    check(api().hipMemSetAccess(as_ptr(addr), size, &access_, 1), "hipMemSetAccess",
          "at " + hex(addr));
  }

  void unmap(std::uintptr_t addr, std::size_t size) override {
    DeviceGuard guard(device_);
    check(api().hipMemUnmap(as_ptr(addr), size), "hipMemUnmap", "at " + hex(addr));
  }

  MemInfo mem_info() override {
    DeviceGuard guard(device_);
    size_t free_b = 0, total_b = 0;
    check(api().hipMemGetInfo(&free_b, &total_b), "hipMemGetInfo", "");
    return MemInfo{free_b, total_b};
  }

  void synchronize() override {
    DeviceGuard guard(device_);
    check(api().hipDeviceSynchronize(), "hipDeviceSynchronize", "");
  }

 private:
  static hipMemGenericAllocationHandle_t to_handle(Handle h) {
    return reinterpret_cast<hipMemGenericAllocationHandle_t>(
        static_cast<std::uintptr_t>(h));
  }

  class DeviceGuard {
   public:
    explicit DeviceGuard(int device) {
      check(api().hipGetDevice(&previous_), "hipGetDevice", "");
      if (previous_ != device) check(api().hipSetDevice(device), "hipSetDevice", "");
    }
    ~DeviceGuard() {
      // A destructor cannot report failure; restoring the device is best effort.
      int now = -1;
      (void)api().hipGetDevice(&now);
      if (now != previous_) (void)api().hipSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

   private:
    int previous_ = 0;
  };

  int device_;
  hipMemAllocationProp prop_{};             // HIP >= 5.3 runtimes
  hipMemAllocationProp_hip52 prop_hip52_{};  // HIP <= 5.2 runtimes
  const hipMemAllocationProp* prop_ptr_ = &prop_;
  hipMemAccessDesc access_{};
  std::size_t granularity_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_hip_backend(int device) {
  return std::make_unique<HipBackend>(device);
}

SymbolReport probe_hip() { return api().report; }

}  // namespace kvcached
