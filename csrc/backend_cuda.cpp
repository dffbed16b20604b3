// CUDA backend: the driver API loaded at run time from libcuda.so.1 through
// one symbol table. Nothing links against libcuda and no CUDA header is
// needed to build it: the types, constants and signatures used are declared
// in driver_api/cuda_driver.h (checked against the real cuda.h by
// tests/backends/test_driver_abi.py wherever one is installed). A build imports
// on machines without a GPU and fails only when the backend is opened.
//
// Every entry point is resolved by its exact ABI symbol (cuMemGetInfo ->
// cuMemGetInfo_v2, cuCtxSynchronize stays unversioned), so a symbol's
// signature always matches the declaration it is called through.
//
// Calls run in the device's primary context, the one the CUDA runtime and
// PyTorch use, so tensors and kernels see the same mappings.
#include <mutex>

#include "backend.h"
#include "driver_api/cuda_driver.h"

namespace kvcached {
namespace {

using namespace cuda_driver;

constexpr const char* kLibrary = "libcuda.so.1";

struct CudaApi {
#define KVCACHED_FIELD(name, symbol, ...) fn::name* name = nullptr;
  KVCACHED_CUDA_DRIVER_FUNCTIONS(KVCACHED_FIELD)
#undef KVCACHED_FIELD
  void* lib = nullptr;
  SymbolReport report;
};

CudaApi load_api() {
  CudaApi api;
  api.lib = open_first_library({kLibrary}, api.report);
#define KVCACHED_RESOLVE(name, symbol, ...) \
  api.name = reinterpret_cast<fn::name*>(resolve_symbol(api.lib, symbol, api.report));
  KVCACHED_CUDA_DRIVER_FUNCTIONS(KVCACHED_RESOLVE)
#undef KVCACHED_RESOLVE
  return api;
}

const CudaApi& api() {
  static const CudaApi instance = load_api();
  return instance;
}

std::string describe(CUresult rc) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api().cuGetErrorName) api().cuGetErrorName(rc, &name);
  if (api().cuGetErrorString) api().cuGetErrorString(rc, &text);
  std::string out = name ? name : ("CUresult " + std::to_string(static_cast<int>(rc)));
  if (text) out += std::string(" (") + text + ")";
  return out;
}

void check(CUresult rc, const char* call, const std::string& what) {
  if (rc == CUDA_SUCCESS) return;
  ErrorKind kind = rc == CUDA_ERROR_OUT_OF_MEMORY ? ErrorKind::kOutOfMemory
                   : rc == CUDA_ERROR_INVALID_VALUE ? ErrorKind::kInvalidArgument
                                                    : ErrorKind::kDriver;
  throw Error(kind, std::string("cuda backend: ") + call + " " + what +
                        " failed: " + describe(rc));
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    const CudaApi& a = api();
    if (!a.report.load_error.empty()) {
      throw Error(ErrorKind::kUnavailable,
                  std::string("cuda backend: cannot load ") + kLibrary + " (" +
                      a.report.load_error +
                      "); is an NVIDIA driver installed on this machine?");
    }
    if (!a.report.complete()) {
      throw Error(ErrorKind::kUnavailable,
                  std::string("cuda backend: ") + kLibrary +
                      " lacks entry points: " + a.report.missing() +
                      " (driver older than the CUDA 11.2 VMM API?)");
    }
    CUresult rc = a.cuInit(0);
    if (rc != CUDA_SUCCESS) {
      throw Error(ErrorKind::kUnavailable,
                  "cuda backend: cuInit failed: " + describe(rc) +
                      "; no usable NVIDIA GPU here");
    }
    int count = 0;
    check(a.cuDeviceGetCount(&count), "cuDeviceGetCount", "");
    if (device < 0 || device >= count) {
      throw Error(ErrorKind::kInvalidArgument,
                  "cuda backend: device index " + std::to_string(device) +
                      " out of range; this machine has " + std::to_string(count) +
                      " CUDA device(s)");
    }
    check(a.cuDeviceGet(&dev_, device), "cuDeviceGet", std::to_string(device));
    int vmm = 0;
    check(a.cuDeviceGetAttribute(
              &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev_),
          "cuDeviceGetAttribute", "(VMM support)");
    if (!vmm) {
      throw Error(ErrorKind::kUnavailable,
                  "cuda backend: device " + std::to_string(device) +
                      " does not support virtual memory management");
    }
    check(a.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain",
          std::to_string(device));

    prop_ = CUmemAllocationProp{};
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = dev_;
    access_ = CUmemAccessDesc{};
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ContextGuard guard(*this);
    check(a.cuMemGetAllocationGranularity(&granularity_, &prop_,
                                          CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity", "");
  }

  ~CudaBackend() override {
    if (ctx_ != nullptr) api().cuDevicePrimaryCtxRelease(dev_);
  }

  const char* name() const noexcept override { return "cuda"; }
  int device() const noexcept override { return device_; }
  int dlpack_device_type() const noexcept override { return kDLCUDA; }
  std::size_t granularity() const noexcept override { return granularity_; }

  std::uintptr_t reserve(std::size_t size, std::size_t alignment) override {
    ContextGuard guard(*this);
    CUdeviceptr ptr = 0;
    check(api().cuMemAddressReserve(&ptr, size, alignment, 0, 0),
          "cuMemAddressReserve", std::to_string(size) + " bytes");
    return static_cast<std::uintptr_t>(ptr);
  }

  void free_range(std::uintptr_t addr, std::size_t size) noexcept override {
    try {
      ContextGuard guard(*this);
      CUresult rc = api().cuMemAddressFree(static_cast<CUdeviceptr>(addr), size);
      if (rc != CUDA_SUCCESS)
        report_error("cuda backend: cuMemAddressFree(" + hex(addr) + ") failed: " +
                     describe(rc));
    } catch (const std::exception& e) {
      report_error(e.what());
    }
  }

  Handle create(std::size_t size) override {
    ContextGuard guard(*this);
    CUmemGenericAllocationHandle h = 0;
    check(api().cuMemCreate(&h, size, &prop_, 0), "cuMemCreate",
          std::to_string(size) + " bytes on device " + std::to_string(device_));
    return static_cast<Handle>(h);
  }

  void release(Handle handle, std::size_t) override {
    ContextGuard guard(*this);
    check(api().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)),
          "cuMemRelease", "");
  }

  void map(std::uintptr_t addr, std::size_t size, Handle handle) override {
    ContextGuard guard(*this);
    check(api().cuMemMap(static_cast<CUdeviceptr>(addr), size, 0,
                         static_cast<CUmemGenericAllocationHandle>(handle), 0),
          "cuMemMap", "at " + hex(addr));
  }

  void set_access(std::uintptr_t addr, std::size_t size) override {
    ContextGuard guard(*this);
    check(api().cuMemSetAccess(static_cast<CUdeviceptr>(addr), size, &access_, 1),
          "cuMemSetAccess", "at " + hex(addr));
  }

  void unmap(std::uintptr_t addr, std::size_t size) override {
    ContextGuard guard(*this);
    check(api().cuMemUnmap(static_cast<CUdeviceptr>(addr), size), "cuMemUnmap",
          "at " + hex(addr));
  }

  MemInfo mem_info() override {
    ContextGuard guard(*this);
    size_t free_b = 0, total_b = 0;
    check(api().cuMemGetInfo(&free_b, &total_b), "cuMemGetInfo", "");
    return MemInfo{free_b, total_b};
  }

  void synchronize() override {
    ContextGuard guard(*this);
    check(api().cuCtxSynchronize(), "cuCtxSynchronize", "");
  }

 private:
  // Makes the device's primary context current for the calling thread and
  // restores whatever was current before.
  class ContextGuard {
   public:
    explicit ContextGuard(const CudaBackend& b) {
      CUcontext cur = nullptr;
      api().cuCtxGetCurrent(&cur);
      if (cur != b.ctx_) {
        check(api().cuCtxPushCurrent(b.ctx_), "cuCtxPushCurrent", "");
        pushed_ = true;
      }
    }
    ~ContextGuard() {
      if (pushed_) {
        CUcontext popped = nullptr;
        api().cuCtxPopCurrent(&popped);
      }
    }
    ContextGuard(const ContextGuard&) = delete;
    ContextGuard& operator=(const ContextGuard&) = delete;

   private:
    bool pushed_ = false;
  };

  int device_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::size_t granularity_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

SymbolReport probe_cuda() { return api().report; }

}  // namespace kvcached
