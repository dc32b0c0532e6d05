// CUDA runtime queries used by dispatch (is a GPU there, does a pointer live on it) and by the
// launchers (cuda/device_info.h: the SM count, kernels' attributes, each asked once).
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuCtxGetCurrent, PFN_cuCtxGetId

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "backend.h"
#include "cuda/device_info.h"

namespace flashkda::cuda {

bool available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error so later calls start clean
    return false;
  }
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9;
}

detail::PointerInfo pointer_info(const void* ptr) {
  using detail::MemorySpace;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device / unknown pointer: host memory
    return {};
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice: return {MemorySpace::kDevice, attr.device};
    case cudaMemoryTypeManaged: return {MemorySpace::kManaged, attr.device};
    case cudaMemoryTypeHost: return {MemorySpace::kPinnedHost, attr.device};
    default: return {};
  }
}

int current_device() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

int sm_count() {
  constexpr int kCached = 64;  // devices beyond this many are asked every call
  static std::atomic<int> cache[kCached] = {};
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 132;
  }
  if (device < kCached && (sms = cache[device].load(std::memory_order_relaxed)) > 0) return sms;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    return 132;
  }
  if (device < kCached) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

unsigned long long context_id() {
  struct Entry {
    PFN_cuCtxGetCurrent_v4000 current = nullptr;
    PFN_cuCtxGetId_v12000 id = nullptr;
  };
  static const Entry entry = [] {
    Entry e;
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 4000, cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      e.current = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(p);
    if (cudaGetDriverEntryPointByVersion("cuCtxGetId", &p, 12000, cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      e.id = reinterpret_cast<PFN_cuCtxGetId_v12000>(p);
    cudaGetLastError();
    return e;
  }();
  CUcontext ctx = nullptr;
  unsigned long long id = 0;
  if (entry.current == nullptr || entry.id == nullptr || entry.current(&ctx) != CUDA_SUCCESS || ctx == nullptr ||
      entry.id(ctx, &id) != CUDA_SUCCESS)
    return 0;
  return id;
}

namespace {
// (kernel, context id) -> the value asked once: the dynamic shared memory set, or the registers.
struct KernelFacts {
  std::mutex mutex;
  std::map<std::pair<const void*, unsigned long long>, int> values;
};
KernelFacts& smem_set() {
  static KernelFacts facts;
  return facts;
}
KernelFacts& registers_read() {
  static KernelFacts facts;
  return facts;
}
}  // namespace

cudaError_t allow_dynamic_smem(const void* kernel, int bytes) {
  const unsigned long long ctx = context_id();
  if (ctx == 0) return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  // Checked and set under the lock, and only raised: two threads setting one kernel at once must not
  // leave the driver a smaller value than the one recorded.
  KernelFacts& facts = smem_set();
  std::lock_guard<std::mutex> lock(facts.mutex);
  int& set = facts.values[{kernel, ctx}];  // 0 where new
  if (set >= bytes) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) set = bytes;
  return err;
}

cudaError_t kernel_registers(const void* kernel, int& regs) {
  const unsigned long long ctx = context_id();
  KernelFacts& facts = registers_read();
  if (ctx != 0) {
    std::lock_guard<std::mutex> lock(facts.mutex);
    const auto it = facts.values.find({kernel, ctx});
    if (it != facts.values.end()) {
      regs = it->second;
      return cudaSuccess;
    }
  }
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  regs = attr.numRegs;
  if (ctx != 0) {
    std::lock_guard<std::mutex> lock(facts.mutex);
    facts.values[{kernel, ctx}] = regs;
  }
  return cudaSuccess;
}

}  // namespace flashkda::cuda
