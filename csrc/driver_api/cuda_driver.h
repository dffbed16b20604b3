// The part of the CUDA driver API (libcuda.so.1) the cuda backend calls:
// types, enum values, struct layouts and entry-point signatures, declared
// here so the backend builds where no CUDA toolkit is installed (most GPU
// hosts have a driver and pip-installed torch, no cuda.h). The driver is
// loaded at run time with dlopen; nothing links against it.
//
// Everything is taken from the documented, stable driver ABI (the CUDA
// Driver API reference, "Data types" and "Virtual Memory Management"); the
// declarations live in kvcached::cuda_driver so they never clash with the
// real cuda.h, and tests/backends/test_driver_abi.py checks each one against the
// real header wherever it is installed (enum values and underlying types,
// struct sizes and field offsets, function types and ABI symbol names).
//
// KVCACHED_CUDA_DRIVER_FUNCTIONS(X) lists every entry point as
//   X(api name, ABI symbol, function type)
// The ABI symbol is the exported name the driver's header maps the API name
// to on the versions the VMM API exists in (CUDA >= 11.2): cuMemGetInfo is
// exported as cuMemGetInfo_v2, and cuCtxSynchronize stays unversioned (CUDA
// 13's cuCtxSynchronize_v2 takes a context argument: never guess a suffix).
#pragma once

#include <cstddef>

namespace kvcached {
namespace cuda_driver {

// Driver API return codes (CUresult); only the ones the backend names.
enum CUresult : unsigned int {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
};

using CUdevice = int;
using CUdeviceptr = unsigned long long;  // CUdeviceptr_v2 on 64-bit hosts
using CUmemGenericAllocationHandle = unsigned long long;
struct CUctx_st;  // opaque
using CUcontext = CUctx_st*;

enum CUdevice_attribute : unsigned int {
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
};

enum CUmemAllocationType : unsigned int {
  CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
};

enum CUmemAllocationHandleType : unsigned int {
  CU_MEM_HANDLE_TYPE_NONE = 0x0,
};

enum CUmemLocationType : unsigned int {
  CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
};

enum CUmemAccess_flags : unsigned int {
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
};

enum CUmemAllocationGranularity_flags : unsigned int {
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
};

// CUmemLocation_v1
struct CUmemLocation {
  CUmemLocationType type;
  int id;
};

// CUmemAllocationProp_v1
struct CUmemAllocationProp {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

// CUmemAccessDesc_v1
struct CUmemAccessDesc {
  CUmemLocation location;
  CUmemAccess_flags flags;
};

#define KVCACHED_CUDA_DRIVER_FUNCTIONS(X)                                              \
  X(cuInit, "cuInit", CUresult(unsigned int))                                          \
  X(cuGetErrorName, "cuGetErrorName", CUresult(CUresult, const char**))                \
  X(cuGetErrorString, "cuGetErrorString", CUresult(CUresult, const char**))            \
  X(cuDeviceGetCount, "cuDeviceGetCount", CUresult(int*))                              \
  X(cuDeviceGet, "cuDeviceGet", CUresult(CUdevice*, int))                              \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute",                                      \
    CUresult(int*, CUdevice_attribute, CUdevice))                                      \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", CUresult(CUcontext*, CUdevice)) \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", CUresult(CUdevice))     \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", CUresult(CUcontext*))                          \
  X(cuCtxPushCurrent, "cuCtxPushCurrent_v2", CUresult(CUcontext))                      \
  X(cuCtxPopCurrent, "cuCtxPopCurrent_v2", CUresult(CUcontext*))                       \
  X(cuCtxSynchronize, "cuCtxSynchronize", CUresult())                                  \
  X(cuMemGetInfo, "cuMemGetInfo_v2", CUresult(std::size_t*, std::size_t*))             \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",                    \
    CUresult(std::size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags)) \
  X(cuMemAddressReserve, "cuMemAddressReserve",                                        \
    CUresult(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr, unsigned long long)) \
  X(cuMemAddressFree, "cuMemAddressFree", CUresult(CUdeviceptr, std::size_t))          \
  X(cuMemCreate, "cuMemCreate",                                                        \
    CUresult(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,   \
             unsigned long long))                                                      \
  X(cuMemRelease, "cuMemRelease", CUresult(CUmemGenericAllocationHandle))              \
  X(cuMemMap, "cuMemMap",                                                              \
    CUresult(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,      \
             unsigned long long))                                                      \
  X(cuMemUnmap, "cuMemUnmap", CUresult(CUdeviceptr, std::size_t))                      \
  X(cuMemSetAccess, "cuMemSetAccess",                                                  \
    CUresult(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t))

// fn::cuInit etc.: the function type of each entry point.
namespace fn {
#define KVCACHED_CUDA_FUNCTION_TYPE(name, symbol, ...) using name = __VA_ARGS__;
KVCACHED_CUDA_DRIVER_FUNCTIONS(KVCACHED_CUDA_FUNCTION_TYPE)
#undef KVCACHED_CUDA_FUNCTION_TYPE
}  // namespace fn

}  // namespace cuda_driver
}  // namespace kvcached
