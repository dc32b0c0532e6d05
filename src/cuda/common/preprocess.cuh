// Device side of the fused preprocessing of docs/SPEC.md §2 in fp32, per head and per warp: the gate
// constants of a head (the log-decay of common/gate.h with kda_math.cuh's DecodeMath), beta activation,
// warp-wide L2 norm.
#pragma once

#include "cuda/common/kda_math.cuh"
#include "cuda/common/math.cuh"
#include "flashkda/types.h"

namespace flashkda::cuda {

// The gate constants of one head (common/gate.h).
struct HeadGate {
  GateForm form;
  float lower_bound;
  float a_scale;  // exp(A_log[h]); unused for kPrecomputed

  __device__ __forceinline__ static HeadGate make(const Preprocess& pre, int64_t h) {
    return from_a_log(pre, pre.gate != GateForm::kPrecomputed ? __ldg(pre.A_log + h) : 0.0f);
  }

  // From A_log[h] already loaded (by a caller that fetches it ahead of use).
  __device__ __forceinline__ static HeadGate from_a_log(const Preprocess& pre, float a_log) {
    HeadGate gate{pre.gate, pre.lower_bound, 0.0f};
    if (pre.gate != GateForm::kPrecomputed) gate.a_scale = __expf(a_log);
    return gate;
  }

  // Log-decay a of one channel from the raw gate g and its dt_bias (0 when absent; a = g for
  // precomputed gates).
  __device__ __forceinline__ float log_decay(float g, float bias) const {
    if (form == GateForm::kLowerBound) return gate::lower_bound<DecodeMath>(lower_bound, a_scale, g + bias);
    if (form == GateForm::kSoftplus) return gate::softplus<DecodeMath>(a_scale, g + bias);
    return g;
  }
};

// b = sigmoid(beta) when beta is a logit, else beta.
__device__ __forceinline__ float beta_activation(const Preprocess& pre, float beta) {
  return pre.beta_is_logit ? sigmoidf_(beta) : beta;
}

// x <- x / sqrt(sum x^2 + 1e-6) for a vector of 32 * kPerLane elements held kPerLane per lane
// across one full warp (all 32 lanes must call it).
template <int kPerLane>
__device__ __forceinline__ void warp_l2_normalize(float (&x)[kPerLane]) {
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) sum += x[i] * x[i];
  const float inv = rsqrtf(group_sum<32>(sum) + 1e-6f);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] *= inv;
}

}  // namespace flashkda::cuda
