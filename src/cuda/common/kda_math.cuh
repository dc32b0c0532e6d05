// Device-side KDA preprocessing (docs/SPEC.md §2): sigmoid, softplus, decode's math for the gate forms
// (common/gate.h).
#pragma once

#include <cuda_bf16.h>

#include "common/gate.h"
#include "flashkda/types.h"

namespace flashkda::cuda {

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

// softplus(x) = log(1 + e^x), exact to fp32 rounding for large x (no overflow).
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

// Decode's elementary functions for gate.h (the log-decay of the three gate forms): __expf, the
// reciprocal of the sigmoid above (lower_bound * sigmoid), softplusf_.
struct DecodeMath {
  __device__ __forceinline__ static float exp(float x) { return __expf(x); }
  __device__ __forceinline__ static float quot(float a, float b) { return a * (1.0f / b); }
  __device__ __forceinline__ static float softplus(float x) { return softplusf_(x); }
};

__device__ __forceinline__ float load_bf16(const void* p, long long i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

// Loads element i of a bf16 (is_f32 == false) or fp32 array as float.
__device__ __forceinline__ float load_elem(const void* p, long long i, bool is_f32) {
  return is_f32 ? static_cast<const float*>(p)[i] : load_bf16(p, i);
}

}  // namespace flashkda::cuda
