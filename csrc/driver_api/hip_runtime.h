// The part of the HIP runtime API (libamdhip64.so) the hip backend calls:
// types, enum values, struct layouts and entry-point signatures, declared
// here so the backend builds where no ROCm/HIP headers are installed. The
// runtime is loaded at run time with dlopen; nothing links against it.
//
// Taken from the documented HIP runtime API (HIP Runtime API Reference,
// "Virtual Memory Management"); the declarations live in
// kvcached::hip_runtime so they never clash with the real
// hip/hip_runtime_api.h, and tests/backends/test_driver_abi.py checks each one
// against the real header wherever it is installed.
//
// One ABI difference between releases matters here: hipMemAllocationProp
// was reordered in HIP 5.3 to match CUDA's CUmemAllocationProp. HIP <= 5.2
// (e.g. Debian's libamdhip64 5.2) expects hipMemAllocationProp_hip52; every
// later release (ROCm 5.3 through 7.x) expects hipMemAllocationProp. The
// backend asks the loaded runtime its version (hipRuntimeGetVersion) and
// passes the layout that runtime reads.
//
// KVCACHED_HIP_RUNTIME_FUNCTIONS(X) lists every entry point as
//   X(api name, ABI symbol, function type)
#pragma once

#include <cstddef>

namespace kvcached {
namespace hip_runtime {

// HIP_VERSION of the first release with the CUDA-like hipMemAllocationProp.
constexpr int kPropReorderedVersion = 50300000;  // 5.3.0

enum hipError_t : unsigned int {
  hipSuccess = 0,
  hipErrorInvalidValue = 1,
  hipErrorOutOfMemory = 2,
};

struct ihipMemGenericAllocationHandle;  // opaque
using hipMemGenericAllocationHandle_t = ihipMemGenericAllocationHandle*;

enum hipMemAllocationType : unsigned int {
  hipMemAllocationTypePinned = 0x1,
};

enum hipMemAllocationHandleType : unsigned int {
  hipMemHandleTypeNone = 0x0,
};

enum hipMemLocationType : unsigned int {
  hipMemLocationTypeDevice = 1,
};

enum hipMemAccessFlags : unsigned int {
  hipMemAccessFlagsProtReadWrite = 3,
};

enum hipMemAllocationGranularity_flags : unsigned int {
  hipMemAllocationGranularityMinimum = 0x0,
};

struct hipMemLocation {
  hipMemLocationType type;
  int id;
};

// HIP >= 5.3 (the layout of CUDA's CUmemAllocationProp, without its
// reserved bytes; ROCm 6.2+ names the second field through a union with
// requestedHandleTypes, same offset).
struct hipMemAllocationProp {
  hipMemAllocationType type;
  hipMemAllocationHandleType requestedHandleType;
  hipMemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
  } allocFlags;
};

// HIP <= 5.2.
struct hipMemAllocationProp_hip52 {
  unsigned char compressionType;
  hipMemLocation location;
  hipMemAllocationHandleType requestedHandleType;
  hipMemAllocationType type;
  unsigned short usage;
  void* win32HandleMetaData;
};

struct hipMemAccessDesc {
  hipMemLocation location;
  hipMemAccessFlags flags;
};

#define KVCACHED_HIP_RUNTIME_FUNCTIONS(X)                                              \
  X(hipInit, "hipInit", hipError_t(unsigned int))                                      \
  X(hipRuntimeGetVersion, "hipRuntimeGetVersion", hipError_t(int*))                    \
  X(hipGetErrorName, "hipGetErrorName", const char*(hipError_t))                       \
  X(hipGetErrorString, "hipGetErrorString", const char*(hipError_t))                   \
  X(hipGetDeviceCount, "hipGetDeviceCount", hipError_t(int*))                          \
  X(hipGetDevice, "hipGetDevice", hipError_t(int*))                                    \
  X(hipSetDevice, "hipSetDevice", hipError_t(int))                                     \
  X(hipDeviceSynchronize, "hipDeviceSynchronize", hipError_t())                        \
  X(hipMemGetInfo, "hipMemGetInfo", hipError_t(std::size_t*, std::size_t*))            \
  X(hipMemGetAllocationGranularity, "hipMemGetAllocationGranularity",                  \
    hipError_t(std::size_t*, const hipMemAllocationProp*,                              \
               hipMemAllocationGranularity_flags))                                     \
  X(hipMemAddressReserve, "hipMemAddressReserve",                                      \
    hipError_t(void**, std::size_t, std::size_t, void*, unsigned long long))           \
  X(hipMemAddressFree, "hipMemAddressFree", hipError_t(void*, std::size_t))            \
  X(hipMemCreate, "hipMemCreate",                                                      \
    hipError_t(hipMemGenericAllocationHandle_t*, std::size_t,                          \
               const hipMemAllocationProp*, unsigned long long))                       \
  X(hipMemRelease, "hipMemRelease", hipError_t(hipMemGenericAllocationHandle_t))       \
  X(hipMemMap, "hipMemMap",                                                            \
    hipError_t(void*, std::size_t, std::size_t, hipMemGenericAllocationHandle_t,       \
               unsigned long long))                                                    \
  X(hipMemUnmap, "hipMemUnmap", hipError_t(void*, std::size_t))                        \
  X(hipMemSetAccess, "hipMemSetAccess",                                                \
    hipError_t(void*, std::size_t, const hipMemAccessDesc*, std::size_t))

// fn::hipInit etc.: the function type of each entry point.
namespace fn {
#define KVCACHED_HIP_FUNCTION_TYPE(name, symbol, ...) using name = __VA_ARGS__;
KVCACHED_HIP_RUNTIME_FUNCTIONS(KVCACHED_HIP_FUNCTION_TYPE)
#undef KVCACHED_HIP_FUNCTION_TYPE
}  // namespace fn

}  // namespace hip_runtime
}  // namespace kvcached
