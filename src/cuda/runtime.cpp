// CUDA runtime queries used by dispatch: is a GPU there, and does a pointer live on it.
#include <cuda_runtime.h>

#include "backend.h"

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

}  // namespace flashkda::cuda
