// Compile-time check of csrc/driver_api/*.h against a real driver header.
// tests/backends/test_driver_abi.py compiles this with -fsyntax-only and one of
//   -DKVCACHED_CHECK_CUDA   (needs cuda.h on the include path)
//   -DKVCACHED_CHECK_HIP    (needs hip/hip_runtime_api.h)
// Every static_assert names what differs. A clean compile means: each enum
// the project declares has the real enum's underlying type and each
// enumerator its real value; each struct has the real size, alignment and
// field offsets; each entry point has the real function type (the project's
// types mapped to the real ones) and is resolved by the ABI symbol the real
// header maps its name to.
#include <cstddef>
#include <type_traits>

#if defined(KVCACHED_CHECK_CUDA)
#include <cuda.h>
#include "driver_api/cuda_driver.h"
namespace ours = kvcached::cuda_driver;
#elif defined(KVCACHED_CHECK_HIP)
#ifndef __HIP_PLATFORM_AMD__
#define __HIP_PLATFORM_AMD__ 1
#endif
#include <hip/hip_runtime_api.h>
#include "driver_api/hip_runtime.h"
namespace ours = kvcached::hip_runtime;
#else
#error "define KVCACHED_CHECK_CUDA or KVCACHED_CHECK_HIP"
#endif

#define KVCACHED_STR2(x) #x
#define KVCACHED_STR(x) KVCACHED_STR2(x)

namespace {

constexpr bool same_text(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || same_text(a + 1, b + 1));
}

// real<T>::type: the real header's type for a type of ours.
template <class T> struct real { using type = T; };
template <class T> struct real<T*> { using type = typename real<T>::type*; };
template <class T> struct real<const T> { using type = const typename real<T>::type; };
template <class R, class... A> struct real<R(A...)> {
  using type = typename real<R>::type(typename real<A>::type...);
};
#define KVCACHED_MAP(type_name) \
  template <> struct real<ours::type_name> { using type = ::type_name; };

template <class Ours, class Real>
constexpr bool same_enum_type() {
  return std::is_same<std::underlying_type_t<Ours>, std::underlying_type_t<Real>>::value;
}

#define CHECK_ENUM_TYPE(e)                                                 \
  static_assert(same_enum_type<ours::e, ::e>(),                            \
                #e ": underlying type differs from the real header's");    \
  static_assert(sizeof(ours::e) == sizeof(::e), #e ": size differs");
#define CHECK_VALUE(v) \
  static_assert(static_cast<long long>(ours::v) == static_cast<long long>(::v), #v ": value differs");
#define CHECK_LAYOUT(ours_t, real_t)                                                   \
  static_assert(sizeof(ours::ours_t) == sizeof(real_t), #ours_t ": size differs from " #real_t); \
  static_assert(alignof(ours::ours_t) == alignof(real_t), #ours_t ": alignment differs from " #real_t);
#define CHECK_FIELD(ours_t, real_t, field)                                               \
  static_assert(offsetof(ours::ours_t, field) == offsetof(real_t, field),               \
                #ours_t "." #field ": offset differs from " #real_t);                    \
  static_assert(sizeof(ours::ours_t::field) == sizeof(real_t::field),                   \
                #ours_t "." #field ": size differs from " #real_t);
// decltype(&::name) expands the real header's name macro (cuMemGetInfo ->
// cuMemGetInfo_v2), so the type checked is the one the symbol has.
#define CHECK_FUNCTION(name, symbol, ...)                                          \
  static_assert(std::is_same<typename real<__VA_ARGS__>::type*, decltype(&::name)>::value, \
                #name ": function type differs from the real header's");          \
  static_assert(same_text(symbol, KVCACHED_STR(name)),                             \
                #name ": the real header exports it under another symbol");

#if defined(KVCACHED_CHECK_CUDA)

KVCACHED_MAP(CUresult)
KVCACHED_MAP(CUctx_st)
KVCACHED_MAP(CUdevice_attribute)
KVCACHED_MAP(CUmemAllocationType)
KVCACHED_MAP(CUmemAllocationHandleType)
KVCACHED_MAP(CUmemLocationType)
KVCACHED_MAP(CUmemAccess_flags)
KVCACHED_MAP(CUmemAllocationGranularity_flags)
KVCACHED_MAP(CUmemLocation)
KVCACHED_MAP(CUmemAllocationProp)
KVCACHED_MAP(CUmemAccessDesc)

static_assert(std::is_same<ours::CUdevice, ::CUdevice>::value, "CUdevice differs");
static_assert(std::is_same<ours::CUdeviceptr, ::CUdeviceptr>::value, "CUdeviceptr differs");
static_assert(std::is_same<ours::CUmemGenericAllocationHandle, ::CUmemGenericAllocationHandle>::value,
              "CUmemGenericAllocationHandle differs");
static_assert(std::is_same<real<ours::CUcontext>::type, ::CUcontext>::value, "CUcontext differs");

CHECK_ENUM_TYPE(CUresult)
CHECK_ENUM_TYPE(CUdevice_attribute)
CHECK_ENUM_TYPE(CUmemAllocationType)
CHECK_ENUM_TYPE(CUmemAllocationHandleType)
CHECK_ENUM_TYPE(CUmemLocationType)
CHECK_ENUM_TYPE(CUmemAccess_flags)
CHECK_ENUM_TYPE(CUmemAllocationGranularity_flags)

CHECK_VALUE(CUDA_SUCCESS)
CHECK_VALUE(CUDA_ERROR_INVALID_VALUE)
CHECK_VALUE(CUDA_ERROR_OUT_OF_MEMORY)
CHECK_VALUE(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
CHECK_VALUE(CU_MEM_ALLOCATION_TYPE_PINNED)
CHECK_VALUE(CU_MEM_HANDLE_TYPE_NONE)
CHECK_VALUE(CU_MEM_LOCATION_TYPE_DEVICE)
CHECK_VALUE(CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
CHECK_VALUE(CU_MEM_ALLOC_GRANULARITY_MINIMUM)

CHECK_LAYOUT(CUmemLocation, ::CUmemLocation)
CHECK_FIELD(CUmemLocation, ::CUmemLocation, type)
CHECK_FIELD(CUmemLocation, ::CUmemLocation, id)
CHECK_LAYOUT(CUmemAllocationProp, ::CUmemAllocationProp)
CHECK_FIELD(CUmemAllocationProp, ::CUmemAllocationProp, type)
CHECK_FIELD(CUmemAllocationProp, ::CUmemAllocationProp, requestedHandleTypes)
CHECK_FIELD(CUmemAllocationProp, ::CUmemAllocationProp, location)
CHECK_FIELD(CUmemAllocationProp, ::CUmemAllocationProp, win32HandleMetaData)
CHECK_FIELD(CUmemAllocationProp, ::CUmemAllocationProp, allocFlags)
static_assert(offsetof(ours::CUmemAllocationProp, allocFlags.usage) ==
                  offsetof(::CUmemAllocationProp, allocFlags.usage),
              "CUmemAllocationProp.allocFlags.usage: offset differs");
CHECK_LAYOUT(CUmemAccessDesc, ::CUmemAccessDesc)
CHECK_FIELD(CUmemAccessDesc, ::CUmemAccessDesc, location)
CHECK_FIELD(CUmemAccessDesc, ::CUmemAccessDesc, flags)

KVCACHED_CUDA_DRIVER_FUNCTIONS(CHECK_FUNCTION)

#else  // KVCACHED_CHECK_HIP

KVCACHED_MAP(hipError_t)
KVCACHED_MAP(ihipMemGenericAllocationHandle)
KVCACHED_MAP(hipMemAllocationType)
KVCACHED_MAP(hipMemAllocationHandleType)
KVCACHED_MAP(hipMemLocationType)
KVCACHED_MAP(hipMemAccessFlags)
KVCACHED_MAP(hipMemAllocationGranularity_flags)
KVCACHED_MAP(hipMemLocation)
KVCACHED_MAP(hipMemAllocationProp)
KVCACHED_MAP(hipMemAccessDesc)

static_assert(std::is_same<real<ours::hipMemGenericAllocationHandle_t>::type,
                           ::hipMemGenericAllocationHandle_t>::value,
              "hipMemGenericAllocationHandle_t differs");

CHECK_ENUM_TYPE(hipError_t)
CHECK_ENUM_TYPE(hipMemAllocationType)
CHECK_ENUM_TYPE(hipMemAllocationHandleType)
CHECK_ENUM_TYPE(hipMemLocationType)
CHECK_ENUM_TYPE(hipMemAccessFlags)
CHECK_ENUM_TYPE(hipMemAllocationGranularity_flags)

CHECK_VALUE(hipSuccess)
CHECK_VALUE(hipErrorInvalidValue)
CHECK_VALUE(hipErrorOutOfMemory)
CHECK_VALUE(hipMemAllocationTypePinned)
CHECK_VALUE(hipMemHandleTypeNone)
CHECK_VALUE(hipMemLocationTypeDevice)
CHECK_VALUE(hipMemAccessFlagsProtReadWrite)
CHECK_VALUE(hipMemAllocationGranularityMinimum)

CHECK_LAYOUT(hipMemLocation, ::hipMemLocation)
CHECK_FIELD(hipMemLocation, ::hipMemLocation, type)
CHECK_FIELD(hipMemLocation, ::hipMemLocation, id)
CHECK_LAYOUT(hipMemAccessDesc, ::hipMemAccessDesc)
CHECK_FIELD(hipMemAccessDesc, ::hipMemAccessDesc, location)
CHECK_FIELD(hipMemAccessDesc, ::hipMemAccessDesc, flags)

// The real header holds one of the two layouts the project declares; the
// backend picks by the runtime's version with the same threshold.
#if HIP_VERSION >= 50300000
static_assert(ours::kPropReorderedVersion <= HIP_VERSION, "kPropReorderedVersion is above this header's HIP_VERSION");
CHECK_LAYOUT(hipMemAllocationProp, ::hipMemAllocationProp)
CHECK_FIELD(hipMemAllocationProp, ::hipMemAllocationProp, type)
CHECK_FIELD(hipMemAllocationProp, ::hipMemAllocationProp, requestedHandleType)
CHECK_FIELD(hipMemAllocationProp, ::hipMemAllocationProp, location)
CHECK_FIELD(hipMemAllocationProp, ::hipMemAllocationProp, win32HandleMetaData)
CHECK_FIELD(hipMemAllocationProp, ::hipMemAllocationProp, allocFlags)
#else
static_assert(ours::kPropReorderedVersion > HIP_VERSION, "kPropReorderedVersion is not above this header's HIP_VERSION");
CHECK_LAYOUT(hipMemAllocationProp_hip52, ::hipMemAllocationProp)
CHECK_FIELD(hipMemAllocationProp_hip52, ::hipMemAllocationProp, compressionType)
CHECK_FIELD(hipMemAllocationProp_hip52, ::hipMemAllocationProp, location)
CHECK_FIELD(hipMemAllocationProp_hip52, ::hipMemAllocationProp, requestedHandleType)
CHECK_FIELD(hipMemAllocationProp_hip52, ::hipMemAllocationProp, type)
CHECK_FIELD(hipMemAllocationProp_hip52, ::hipMemAllocationProp, usage)
CHECK_FIELD(hipMemAllocationProp_hip52, ::hipMemAllocationProp, win32HandleMetaData)
#endif

KVCACHED_HIP_RUNTIME_FUNCTIONS(CHECK_FUNCTION)

#endif

}  // namespace
