// flashkda basic types: element dtypes, a host bf16 value type, gate forms and the shared
// preprocessing options (gate activation, L2 norm, beta sigmoid, scale) of docs/SPEC.md §2.
#pragma once

#include <cstdint>
#include <cstring>

namespace flashkda {

enum class DType : int { kF32 = 0, kBF16 = 1, kI32 = 2, kI64 = 3 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
  }
  return "unknown";
}

inline int dtype_size(DType t) { return (t == DType::kBF16) ? 2 : (t == DType::kI64 ? 8 : 4); }

// Host-side bfloat16 storage with round-to-nearest-even conversion (NaN stays NaN).
struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  operator float() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  static float to_float(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bf16) == 2, "bf16 must be 2 bytes");

// How the raw gate g becomes the per-channel log-decay a <= 0 (docs/SPEC.md §2).
enum class GateForm : int {
  kLowerBound = 0,   // a = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))
  kSoftplus = 1,     // a = -exp(A_log[h]) * softplus(g + dt_bias[h])   (Kimi Linear)
  kPrecomputed = 2,  // a = g   (any value <= 0)
};

inline const char* gate_form_name(GateForm f) {
  switch (f) {
    case GateForm::kLowerBound: return "lower_bound";
    case GateForm::kSoftplus: return "softplus";
    case GateForm::kPrecomputed: return "precomputed";
  }
  return "unknown";
}

// Precision of the GPU prefill recurrence (docs/DESIGN.md, "Precision as an option"): how the
// operands of its tensor-core products are rounded. kPrecise: errors at the floor set by rounding
// the output to bf16 (~1.7e-3 output, 1e-5 .. 4e-4 state, adversarial inputs included); with
// L2-normalised q and k it rounds the state and the decayed q, k to fp16 under a range guard and
// splits the other operands into bf16 hi + lo pairs, otherwise it splits the state too.
// kBalanced rounds the state to bf16 (no faster than kPrecise since fp16 state operands, and up to
// 1.4x its error where little decays; kept for callers that name it). kFast splits nothing: about
// 2x the output error and a state error of ~3e-3 on random inputs (more on adversarial ones), for
// the shortest prefill (docs/BENCHMARKS.md). The CPU backend and decode compute in fp32 whatever
// the mode.
enum class Precision : int { kPrecise = 0, kFast = 1, kBalanced = 2 };

inline const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kPrecise: return "precise";
    case Precision::kFast: return "fast";
    case Precision::kBalanced: return "balanced";
  }
  return "unknown";
}

// Fused preprocessing shared by prefill and decode.
struct Preprocess {
  GateForm gate = GateForm::kLowerBound;
  float lower_bound = -5.0f;        // kLowerBound only; must lie in [-5, 0)
  const float* A_log = nullptr;     // [H]     fp32; kLowerBound and kSoftplus
  const float* dt_bias = nullptr;   // [H, K]  fp32; optional for kLowerBound and kSoftplus (0 if null)
  bool l2norm_qk = true;            // q <- q / sqrt(sum q^2 + 1e-6), same for k
  bool beta_is_logit = true;        // b = sigmoid(beta) when true, else b = beta
  bool has_scale = false;           // scale = K^-0.5 unless has_scale
  float scale = 0.0f;
};

}  // namespace flashkda
