// The chunk-16 form of docs/SPEC.md §4 on the host, templated on the compute type: float is the CPU
// backend (cpu::forward), double an fp64 chunk-form implementation that tests hold against the
// token recurrence. Both instantiations live in prefill.cpp.
#pragma once

#include <cstdint>

#include "flashkda/config.h"
#include "flashkda/params.h"

namespace flashkda::cpu {

// kChunk and kMaxFactorisedShift (the largest |G - mid| built from shifted factors): config.h.

// The chunked forward with state and arithmetic in T. out / final_state / checkpoints: when
// non-null, written in T ([B, T, H, V], [N, H, V, K] and [num_checkpoints, H, V, K]) instead of
// p.out / p.final_state / p.checkpoints in their dtypes (a state pool is read and written as
// PrefillParams says, whatever these are). cpu_isa: internal::PrefillLaunch::cpu_isa (0: the
// widest instruction set the processor has). Does not validate p (callers do).
template <typename T>
void chunk_forward(const PrefillParams& p, T* out = nullptr, T* final_state = nullptr, T* checkpoints = nullptr,
                   int cpu_isa = 0);

// X <- (I + L)^{-1} X for a strictly lower triangular n x n block of a row-major [C, C] matrix L
// and R right-hand sides (X[i * R + r]), by forward substitution: x_i -= sum_{j<i} L[i,j] x_j.
// Accurate where the Neumann series (I - L)(I + L^2)(I + L^4)(I + L^8) cancels catastrophically
// (near-collinear keys, b ~ 1).
template <typename T, int R = 1>
inline void solve_unit_lower(const T* L, T* x, int n) {
  for (int i = 1; i < n; ++i) {
    for (int j = 0; j < i; ++j) {
      const T l = L[i * kChunk + j];
#pragma omp simd
      for (int r = 0; r < R; ++r) x[i * R + r] -= l * x[j * R + r];
    }
  }
}

}  // namespace flashkda::cpu
