// The gates' log-decay on AVX2 vectors (docs/SPEC.md §2), for the CPU prefill engine
// (cpu/prefill.cpp) and CPU decode (cpu/decode.cpp): the lower-bound and softplus forms of one row.
#pragma once

#include <cstdint>

#include "common/gate.h"
#include "common/host_math.h"
#include "cpu/isa.h"
#include "cpu/vec_avx2.h"

#ifdef FLASHKDA_X86_DISPATCH
#include <immintrin.h>

namespace flashkda::cpu::avx2 {

// The log-decay of N vectors of raw gates a (plus bias), in place: the lower-bound form,
// a <- lower_bound / (1 + e^{-a_scale x}), or the softplus form, a <- -a_scale softplus(x) (x = a + bias).
template <int N, GateForm kForm>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void gate_vectors(const host::HeadGate<float>& gate,
                                                                             float* a, const float* bias) {
  __m256 x[N];
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    x[j] = _mm256_loadu_ps(a + 8 * j);
    if (bias != nullptr) x[j] = _mm256_add_ps(x[j], _mm256_loadu_ps(bias + 8 * j));
  }
  if constexpr (kForm == GateForm::kLowerBound) {
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) x[j] = _mm256_mul_ps(_mm256_set1_ps(-gate.a_scale), x[j]);
    exp<N>(x);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j)
      _mm256_storeu_ps(a + 8 * j, _mm256_div_ps(_mm256_set1_ps(gate.lower_bound), _mm256_add_ps(_mm256_set1_ps(1.0f), x[j])));
  } else {
    softplus<N>(x);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) _mm256_storeu_ps(a + 8 * j, _mm256_mul_ps(_mm256_set1_ps(-gate.a_scale), x[j]));
  }
}

template <GateForm kForm, class M>
FLASHKDA_TARGET_AVX2 inline void gate_row_form(const host::HeadGate<float>& gate, float* a, int64_t K) {
  const float* bias = gate.bias;
  int64_t c = 0;
  for (; c + 32 <= K; c += 32) gate_vectors<4, kForm>(gate, a + c, bias != nullptr ? bias + c : nullptr);
  for (; c + 8 <= K; c += 8) gate_vectors<1, kForm>(gate, a + c, bias != nullptr ? bias + c : nullptr);
  for (; c < K; ++c) {
    if constexpr (kForm == GateForm::kLowerBound)
      a[c] = gate::lower_bound<M>(gate.lower_bound, gate.a_scale, a[c] + (bias ? bias[c] : 0.0f));
    else
      a[c] = gate(c, a[c]);
  }
}

// The log-decay of one row of raw gates a[0 .. K), in place, on AVX2 vectors four at a time, for the
// lower-bound and softplus forms; returns false (a untouched) for precomputed gates. The channels
// past the last whole vector take M's exp for the lower-bound form, the host's softplus for the other.
// The compiler's vectorisation of HeadGate::row kept the lower-bound form's exp masks and constants in
// stack slots (~7% of the prefill engine's time; one vector a step, 0.95x the whole call; four, 10.9
// against 13.7 TSC cycles a vector with its data in L1, 2026-12-05: the exponential's multiplies and
// FMAs bound it now); the softplus form ran std::log1p and std::exp per element, 66% of the engine's
// time (T=4096 H=4, one thread: 76.2 ms against 26.8 with the lower-bound gate).
template <class M>
FLASHKDA_TARGET_AVX2 inline bool gate_row(const host::HeadGate<float>& gate, float* a, int64_t K) {
  if (gate.form == GateForm::kLowerBound) return gate_row_form<GateForm::kLowerBound, M>(gate, a, K), true;
  if (gate.form == GateForm::kSoftplus) return gate_row_form<GateForm::kSoftplus, M>(gate, a, K), true;
  return false;
}

}  // namespace flashkda::cpu::avx2

#endif  // FLASHKDA_X86_DISPATCH
