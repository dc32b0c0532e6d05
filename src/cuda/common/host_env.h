// Host-side helpers of the CUDA launchers: environment switches (experiment knobs read at each
// call) and the current device's SM count.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>

namespace flashkda::cuda {

// The value of an environment switch, or null when it is unset or empty.
inline const char* env_value(const char* name) {
  const char* s = std::getenv(name);
  return (s != nullptr && *s != '\0') ? s : nullptr;
}

inline int env_int(const char* name, int fallback) {
  const char* s = env_value(name);
  return s != nullptr ? std::atoi(s) : fallback;
}

// Streaming multiprocessors of the current device (132, an H100/H200, if the query fails).
inline int sm_count() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

}  // namespace flashkda::cuda
