// Host-side preprocessing of docs/SPEC.md §2, templated on the compute type (double for the fp64
// reference, float for the CPU backend): activations, gate -> log-decay, L2 norm, and typed
// element loads/stores from untyped tensors (bf16 or fp32 inputs and states).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/gate.h"
#include "flashkda/types.h"

// Forced inlining for helpers that hot loops call: each ISA entry point of the CPU engine (AVX2,
// baseline) then gets its own vectorised copy instead of sharing one baseline function.
#if defined(__GNUC__)
#define FLASHKDA_HOST_INLINE inline __attribute__((always_inline))
#else
#define FLASHKDA_HOST_INLINE inline
#endif

namespace flashkda::host {

// Element i of an int32 or int64 offsets array in host memory (cu_seqlens).
inline int64_t offset_at(const void* offsets, DType dtype, int64_t i) {
  if (dtype == DType::kI64) return static_cast<const int64_t*>(offsets)[i];
  return static_cast<const int32_t*>(offsets)[i];
}

// The output scale: the caller's, else K^-1/2 (docs/SPEC.md §3), in the compute type T.
template <typename T>
inline T output_scale(const Preprocess& pre, int64_t K) {
  return pre.has_scale ? T(pre.scale) : T(1.0 / std::sqrt(double(K)));
}

// Logistic function without overflow for large |x|.
template <typename T>
inline T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

// log(1 + e^x); for x > 20 the correction log1p(e^-x) < 2.1e-9 is below fp32 resolution of x.
template <typename T>
inline T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}

// The host's elementary functions for gate.h: std::exp, true division, softplus above.
template <typename T>
struct StdMath {
  static T exp(T x) { return std::exp(x); }
  static T quot(T a, T b) { return a / b; }
  static T softplus(T x) { return host::softplus(x); }
};

// The log-decay of one head (gate.h; the reference, the CPU backend, CPU decode): the per-channel
// constants of the head are taken once, so hot loops skip the Preprocess branches. e^{-x}
// overflowing to +inf for x << 0 gives the lower-bound form a = -0, its limit.
template <typename T>
struct HeadGate {
  GateForm form = GateForm::kPrecomputed;
  T lower_bound = T(0);
  T a_scale = T(0);
  const float* bias = nullptr;  // [K] slice of dt_bias, or null (always for precomputed gates: a = g)

  HeadGate(const Preprocess& pre, int64_t h, int64_t K) : form(pre.gate), lower_bound(T(pre.lower_bound)) {
    if (form == GateForm::kPrecomputed) return;
    a_scale = std::exp(T(pre.A_log[h]));
    if (pre.dt_bias != nullptr) bias = pre.dt_bias + h * K;
  }

  T operator()(int64_t c, T g) const {
    if (form == GateForm::kPrecomputed) return g;
    return gate::log_decay<StdMath<T>>(form, lower_bound, a_scale, g + (bias != nullptr ? T(bias[c]) : T(0)));
  }

  // a[c] <- the log-decay of g[c] for c < K (a may be g), the lower-bound form with M's exp and
  // quotient (the CPU engine's vectorisable ones) as one loop that vectorises, the others as above.
  template <class M>
  FLASHKDA_HOST_INLINE void row(const T* g, T* a, int64_t K) const {
    if (form != GateForm::kLowerBound) {
      for (int64_t c = 0; c < K; ++c) a[c] = (*this)(c, g[c]);
      return;
    }
    if (bias == nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) a[c] = gate::lower_bound<M>(lower_bound, a_scale, g[c]);
      return;
    }
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) a[c] = gate::lower_bound<M>(lower_bound, a_scale, g[c] + T(bias[c]));
  }
};

// b = sigmoid(beta) when beta is a logit, else beta itself.
template <typename T>
inline T beta_activation(const Preprocess& pre, T beta) {
  return pre.beta_is_logit ? sigmoid(beta) : beta;
}

// x <- x / sqrt(sum x^2 + 1e-6), in place over n elements. The sum runs in 16 partial sums (then
// added in order), so it vectorises without reassociation flags: a plain running sum is a chain of
// n dependent adds, about a thousand cycles per 128-channel row.
template <typename T>
inline void l2_normalize(T* x, int64_t n) {
  constexpr int kLanes = 16;
  T part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int w = 0; w < kLanes; ++w) part[w] += x[i + w] * x[i + w];
  }
  for (int w = 0; i < n; ++i, ++w) part[w] += x[i] * x[i];
  T sum = T(0);
  for (int w = 0; w < kLanes; ++w) sum += part[w];
  const T inv = T(1) / std::sqrt(sum + T(1e-6));
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

// Element i of a bf16 or fp32 tensor, converted to T.
template <typename T>
inline T load(const void* ptr, DType dtype, int64_t i) {
  if (dtype == DType::kBF16) return T(bf16::to_float(static_cast<const uint16_t*>(ptr)[i]));
  return T(static_cast<const float*>(ptr)[i]);
}

// dst[0..n) <- elements [offset, offset + n) of a bf16 or fp32 tensor.
template <typename T>
inline void load_row(const void* ptr, DType dtype, int64_t offset, int64_t n, T* dst) {
  if (dtype == DType::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(ptr) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = T(bf16::to_float(src[i]));
  } else {
    const float* src = static_cast<const float*>(ptr) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
  }
}

// Elements [offset, offset + n) of a bf16 or fp32 tensor <- src[0..n) (round to nearest even).
template <typename T>
inline void store_row(void* ptr, DType dtype, int64_t offset, int64_t n, const T* src) {
  if (dtype == DType::kBF16) {
    uint16_t* dst = static_cast<uint16_t*>(ptr) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16::from_float(float(src[i]));
  } else {
    float* dst = static_cast<float*>(ptr) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
  }
}

// l2_normalize as a callable (load_token_inputs' default normaliser).
struct L2Normalize {
  template <typename T>
  void operator()(T* x, int64_t n) const {
    l2_normalize(x, n);
  }
};

// The inputs of token t, head h of a prefill or decode problem (PrefillParams or DecodeParams: the
// same field names), preprocessed as docs/SPEC.md §2 defines but for the gate: q and k
// (L2-normalised when asked, by `norm(x, K)`: l2_normalize, or a build's own of the same arithmetic),
// v, the raw gate g, and the returned b. Buffers hold K or V values.
template <typename T, typename Params, typename Norm = L2Normalize>
inline T load_token_inputs(const Params& p, int64_t t, int64_t h, T* q, T* k, T* v, T* g, Norm norm = {}) {
  const int64_t row = t * p.H + h;
  load_row(p.q, p.dtype, row * p.K, p.K, q);
  load_row(p.k, p.dtype, row * p.K, p.K, k);
  load_row(p.v, p.dtype, row * p.V, p.V, v);
  load_row(p.g, p.g_dtype, row * p.K, p.K, g);
  if (p.pre.l2norm_qk) {
    norm(q, p.K);
    norm(k, p.K);
  }
  return beta_activation(p.pre, load<T>(p.beta, p.beta_dtype, row));
}

// load_token_inputs with the gate applied: decay holds the per-channel decay factor e^a (not its log).
template <typename T, typename Params>
inline T load_token(const Params& p, const HeadGate<T>& gate, int64_t t, int64_t h, T* q, T* k, T* v, T* decay) {
  const T b = load_token_inputs(p, t, h, q, k, v, decay);
  for (int64_t c = 0; c < p.K; ++c) decay[c] = std::exp(gate(c, decay[c]));
  return b;
}

// One recurrent state [V, K] (v-first) of sequence n, head h, from a [N, H, V, K] tensor;
// zeros when state is null.
template <typename T>
inline void load_state(const void* state, DType dtype, int64_t n, int64_t h, int64_t H, int64_t V, int64_t K,
                       T* dst) {
  if (state == nullptr) {
    for (int64_t i = 0; i < V * K; ++i) dst[i] = T(0);
    return;
  }
  load_row(state, dtype, (n * H + h) * V * K, V * K, dst);
}

// Writes one [V, K] state into a [N, H, V, K] tensor of dtype kF32 or kBF16.
template <typename T>
inline void store_state(void* state, DType dtype, int64_t n, int64_t h, int64_t H, int64_t V, int64_t K,
                        const T* src) {
  store_row(state, dtype, (n * H + h) * V * K, V * K, src);
}

}  // namespace flashkda::host
