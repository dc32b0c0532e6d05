// Device-side KDA preprocessing (docs/SPEC.md §2): sigmoid, softplus, the three gate forms.
#pragma once

#include <cuda_bf16.h>

#include "flashkda/types.h"

namespace flashkda::cuda {

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

// softplus(x) = log(1 + e^x), exact to fp32 rounding for large x (no overflow).
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

// Log-decay a <= 0 of one channel for each gate form (docs/SPEC.md §2; types.h GateForm).
__device__ __forceinline__ float log_decay(GateForm form, float g, float a_exp, float bias, float lower_bound) {
  if (form == GateForm::kLowerBound) return lower_bound * sigmoidf_(a_exp * (g + bias));
  if (form == GateForm::kSoftplus) return -a_exp * softplusf_(g + bias);
  return g;
}

__device__ __forceinline__ float load_bf16(const void* p, long long i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

// Loads element i of a bf16 (is_f32 == false) or fp32 array as float.
__device__ __forceinline__ float load_elem(const void* p, long long i, bool is_f32) {
  return is_f32 ? static_cast<const float*>(p)[i] : load_bf16(p, i);
}

}  // namespace flashkda::cuda
