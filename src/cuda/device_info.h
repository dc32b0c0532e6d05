// Host-side facts about the current device that the CUDA launchers' rules use.
#pragma once

#include <cuda_runtime.h>

namespace flashkda::cuda {

// Streaming multiprocessors of the current device (132, an H100/H200, if the query fails).
inline int sm_count() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

}  // namespace flashkda::cuda
