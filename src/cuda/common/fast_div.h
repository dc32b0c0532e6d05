// Division of non-negative 32-bit integers by a divisor fixed for a whole kernel, by a multiply-high
// and a shift (the scheme of CUTLASS's FastDivmod): for 1 <= d < 2^31 and 0 <= n < 2^31,
// n / d = umulhi(n, m) >> s with p = 31 + ceil(log2 d), m = ceil(2^p / d), s = p - 32 (d = 1: n).
// A kernel builds it once before its loop, where a run-time `/` costs ~20 instructions a use
// (64-bit operands: a 32-bit fast path after a test, the reciprocal of d recomputed each time).
// Host-callable, so that a CPU test can check it against `/` (tests/cpp/test_fast_div.cpp).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHKDA_HD __host__ __device__
#else
#define FLASHKDA_HD
#endif

namespace flashkda::cuda {

struct FastDiv32 {
  int32_t d = 1;
  uint32_t m = 0;
  uint32_t s = 0;

  FLASHKDA_HD FastDiv32() = default;
  FLASHKDA_HD explicit FastDiv32(int32_t divisor) : d(divisor) {
    if (d <= 1) return;  // d = 1: n itself (m unused); d < 1 is the caller's error
    uint32_t log2 = 0;   // ceil(log2 d)
    while ((uint32_t(1) << log2) < uint32_t(d)) ++log2;
    const uint32_t p = 31 + log2;
    m = uint32_t(((uint64_t(1) << p) + uint64_t(d) - 1) / uint64_t(d));
    s = p - 32;
  }

  FLASHKDA_HD static uint32_t mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
    return __umulhi(a, b);
#else
    return uint32_t((uint64_t(a) * uint64_t(b)) >> 32);
#endif
  }

  // n / d for 0 <= n < 2^31.
  FLASHKDA_HD int32_t div(int32_t n) const { return d == 1 ? n : int32_t(mulhi(uint32_t(n), m) >> s); }
};

}  // namespace flashkda::cuda
