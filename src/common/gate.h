// The log-decay a <= 0 of the three gate forms (docs/SPEC.md §2), written once for every backend:
//   lower bound: a = lower_bound / (1 + e^{-a_scale x})   (lower_bound * sigmoid(a_scale x))
//   softplus:    a = -a_scale * softplus(x)
//   precomputed: a = x
// with x = g + dt_bias[c] (the raw gate; dt_bias 0 where absent) and a_scale = e^{A_log[h]}; for
// precomputed gates x is the log-decay g itself (no dt_bias is added to it).
// Each backend passes its elementary functions as a policy M, so that every one keeps its own
// arithmetic (and its bits):
//   M::exp(y)        e^y
//   M::quot(a, b)    a / b
//   M::softplus(y)   log(1 + e^y)
// (host_math.h StdMath: the fp64 reference, CPU decode and the CPU engine's other forms; the CPU
// engine's vectorised exp, cpu/prefill.cpp; K1's and decode's device functions, kda_math.cuh.)
#pragma once

#include "flashkda/types.h"

#if defined(__CUDACC__)
#define FLASHKDA_GATE_FN __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define FLASHKDA_GATE_FN inline __attribute__((always_inline))
#else
#define FLASHKDA_GATE_FN inline
#endif

namespace flashkda::gate {

template <class M, typename T>
FLASHKDA_GATE_FN T lower_bound(T lower_bound, T a_scale, T x) {
  return M::quot(lower_bound, T(1) + M::exp(-(a_scale * x)));
}

template <class M, typename T>
FLASHKDA_GATE_FN T softplus(T a_scale, T x) {
  return -a_scale * M::softplus(x);
}

template <class M, typename T>
FLASHKDA_GATE_FN T log_decay(GateForm form, T lower_bound_, T a_scale, T x) {
  if (form == GateForm::kLowerBound) return lower_bound<M>(lower_bound_, a_scale, x);
  if (form == GateForm::kSoftplus) return softplus<M>(a_scale, x);
  return x;
}

}  // namespace flashkda::gate
