// Eight-lane AVX2 building blocks of the CPU engine (cpu/prefill.cpp): the state products'
// register tile, and for the chunk preprocessing the exponentials and the fixed-order lane sums.
// The preprocessing's lanes are computed each on its own, so the AVX2 and AVX-512 builds, which
// both call these, give the same bits.
#pragma once

#include <cstdint>

#include "cpu/isa.h"

#ifdef FLASHKDA_X86_DISPATCH
#include <immintrin.h>

namespace flashkda::cpu::avx2 {

// e^r by range reduction, the core of both exponentials, for N vectors at once: n = round(xn / ln2)
// (xn: x clamped where the float-to-int conversion is defined), r = x - n ln2 in two parts
// (|r| <= ln2 / 2), then the Cephes expf polynomial of degree 6; y = e^r and ni = n. The caller
// applies 2^n. Each step runs for all N vectors before the next: one vector's exponential is a chain
// of ~60 cycles of dependent latency, of which the out-of-order window held about two, so a loop of
// one vector a step ran latency-bound; with four chains side by side in program order, 8.2 cycles a
// vector against 15.7 (Zen 3, 2026-12-05). Every lane takes the same operations whatever N is.
template <int N>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void exp_reduced(const __m256 (&xn)[N], const __m256 (&x)[N],
                                                                            __m256 (&y)[N], __m256i (&ni)[N]) {
  __m256 r[N];
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    // t > 0 for xn > -177, so truncation rounds down (an offset of 128 would round the other way
    // below xn = -89, and r would leave the polynomial's range there)
    const __m256 t = _mm256_fmadd_ps(xn[j], _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(256.5f));
    ni[j] = _mm256_sub_epi32(_mm256_cvttps_epi32(t), _mm256_set1_epi32(256));
  }
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const __m256 n = _mm256_cvtepi32_ps(ni[j]);
    r[j] = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x[j]));
    y[j] = _mm256_set1_ps(1.9875691500e-4f);
  }
  constexpr float kPoly[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                              5.0000001201e-1f};
#pragma GCC unroll 5
  for (int k = 0; k < 5; ++k)
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) y[j] = _mm256_fmadd_ps(y[j], r[j], _mm256_set1_ps(kPoly[k]));
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j)
    y[j] = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y[j], r[j]), r[j], r[j]), _mm256_set1_ps(1.0f));
}

// 2^n as a float, for n in [-126, 127].
FLASHKDA_TARGET_AVX2 inline __m256 pow2(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// x <- e^x for N vectors, as the engine's scalar exp: NaN gives NaN, beyond the float range +inf,
// below e^-104 zero; within 2 ulps where the result is normal, within one unit of the smallest
// subnormal below (2^n applied in two halves, each a normal float, so the result rounds twice
// there). x is clamped to [-104, 89] by max and min with x as the second operand, which x86 returns
// when x is NaN, so the NaN reaches r and the result; e^89 overflows to +inf in the last product, as
// does every x above ln(FLT_MAX) ~ 88.72.
template <int N>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void exp(__m256 (&x)[N]) {
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) x[j] = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x[j]));
  __m256 y[N];
  __m256i ni[N];
  exp_reduced<N>(x, x, y, ni);
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const __m256i n1 = _mm256_srai_epi32(ni[j], 1), n2 = _mm256_sub_epi32(ni[j], n1);
    x[j] = _mm256_mul_ps(_mm256_mul_ps(y[j], pow2(n1)), pow2(n2));
  }
}

// x <- e^x for N vectors with |x| <= 80 or NaN (the shifted factors' exponents): no overflow or
// subnormal handling, 2^n in one factor. x is clamped only where n is formed, so a NaN reaches r
// and the result.
template <int N>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void exp_shift(__m256 (&x)[N]) {
  __m256 xn[N], y[N];
  __m256i ni[N];
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) xn[j] = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-88.0f), x[j]));
  exp_reduced<N>(xn, x, y, ni);
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) x[j] = _mm256_mul_ps(y[j], pow2(ni[j]));
}

// One vector's e^x by the two forms above.
FLASHKDA_TARGET_AVX2 inline __m256 exp(__m256 x) {
  __m256 v[1] = {x};
  exp<1>(v);
  return v[0];
}
FLASHKDA_TARGET_AVX2 inline __m256 exp_shift(__m256 x) {
  __m256 v[1] = {x};
  exp_shift<1>(v);
  return v[0];
}

// x <- log(1 + x) for N vectors with x in [0, 1] (or NaN): u = 1 + x rounded, log(u) = k ln2 +
// log(1 + f) with f = u - 1 (k = 0) or u / 2 - 1 (k = 1, u > sqrt 2), both exact, by the Cephes logf
// polynomial in f (|f| <= 0.415), plus (x - (u - 1)) / u, the rounding of 1 + x carried to first
// order; within 2 ulps of log1p over [0, 1], x itself where 1 + x rounds to 1.
template <int N>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void log1p_unit(__m256 (&x)[N]) {
  const __m256 one = _mm256_set1_ps(1.0f);
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const __m256 u = _mm256_add_ps(one, x[j]);
    const __m256 big = _mm256_cmp_ps(u, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);  // k = 1
    const __m256 f = _mm256_sub_ps(_mm256_blendv_ps(u, _mm256_mul_ps(u, _mm256_set1_ps(0.5f)), big), one);
    const __m256 z = _mm256_mul_ps(f, f);
    __m256 p = _mm256_set1_ps(7.0376836292e-2f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.1514610310e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.1676998740e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.2420140846e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.4249322787e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.6668057665e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.0000714765e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-2.4999993993e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(3.3333331174e-1f));
    // log(1 + f) = f + (f z p - z / 2), the small terms first; k ln2 in two parts, as Cephes adds them
    const __m256 k = _mm256_and_ps(big, one);
    __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, f), z, _mm256_mul_ps(k, _mm256_set1_ps(-2.12194440e-4f)));
    y = _mm256_add_ps(f, _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y));
    y = _mm256_fmadd_ps(k, _mm256_set1_ps(0.693359375f), y);
    const __m256 corr = _mm256_div_ps(_mm256_sub_ps(x[j], _mm256_sub_ps(u, one)), u);
    x[j] = _mm256_add_ps(y, corr);
  }
}

// x <- softplus(x) = log(1 + e^x) for N vectors, as max(0, x) + log1p(e^{-|x|}) (no overflow for
// any x; +inf for +inf, 0 for -inf; a NaN reaches the result through max(0, x), which x86 returns as
// its second operand).
template <int N>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void softplus(__m256 (&x)[N]) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 t[N];
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) t[j] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(abs_mask, x[j]));
  exp<N>(t);
  log1p_unit<N>(t);
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) x[j] = _mm256_add_ps(_mm256_max_ps(_mm256_setzero_ps(), x[j]), t[j]);
}

// The lane sums of eight vectors as one vector (lane r: the sum of a[r]'s eight lanes), always by
// the same tree: pairwise within 128-bit halves, then the two halves.
FLASHKDA_TARGET_AVX2 inline __m256 lane_sums(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The state products' register tile (cpu/prefill.cpp): kRows rows x 16 columns of fp32
// accumulators, 2 ymm a row: [lo, hi][r] (+)= sum_d a[r * lda + d * lda_d] * b[d * ldb + 0..15].
// With 6 rows, 12 accumulators, 2 loads and 6 broadcasts per step: the sgemm microkernel shape
// for AVX2 (12 independent FMA chains cover the FMA latency; the loads stay under two a cycle).
template <int kRows>
FLASHKDA_TARGET_AVX2 inline void tile(__m256 (&lo)[kRows], __m256 (&hi)[kRows], const float* a, int64_t lda,
                                      int64_t lda_d, const float* b, int64_t ldb, int64_t depth) {
#pragma GCC unroll 4
  for (int64_t d = 0; d < depth; ++d, a += lda_d, b += ldb) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda);
      lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
    }
  }
}

// dst[i * ldd + j] = src[j * lds + i] for i, j < 8: one 8 x 8 block of a transpose (unpack, shuffle
// and 128-bit permute of eight rows).
FLASHKDA_TARGET_AVX2 inline void transpose8x8(float* dst, int64_t ldd, const float* src, int64_t lds) {
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + j * lds);
#pragma GCC unroll 4
  for (int j = 0; j < 8; j += 2) t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]), t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
#pragma GCC unroll 2
  for (int j = 0; j < 8; j += 4) {
    r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44), r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
    r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44), r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// The state pass's two products on one panel of 16 value columns (cpu/prefill.cpp; also timed alone
// by benchmarks/cpu_small_gemm.cpp), R and U rows of 16 floats.

// R[m0 .. m0 + kRows) = a[m0 .., :] b over `depth` (a: row stride lda; b: rows of ldb).
template <int kRows>
FLASHKDA_TARGET_AVX2 inline void rows_times_panel(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                  int64_t depth, int m0, float* R) {
  __m256 lo[kRows], hi[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  tile<kRows>(lo, hi, a + m0 * lda, lda, 1, b, ldb, depth);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(R + (m0 + r) * 16, lo[r]), _mm256_storeu_ps(R + (m0 + r) * 16 + 8, hi[r]);
}

// R = [k_decayed; q_decayed] S^T[:, panel]: rows [0, n) and [C, C + n) of R [2C, 16] from kq [2C, Kp]
// and the panel St (rows of Vp), tiles of 6 rows while 6 are left, then 4, then 1 (6, 6, 4 at n = 16);
// the other rows of R are not written.
template <int C>
FLASHKDA_TARGET_AVX2 inline void panel_reads(const float* kq, int64_t Kp, const float* St, int64_t Vp, int n, float* R) {
  for (const int base : {0, C}) {
    int m = 0;
    for (; m + 6 <= n; m += 6) rows_times_panel<6>(kq, Kp, St, Vp, Kp, base + m, R);
    for (; m + 4 <= n; m += 4) rows_times_panel<4>(kq, Kp, St, Vp, Kp, base + m, R);
    for (; m < n; ++m) rows_times_panel<1>(kq, Kp, St, Vp, Kp, base + m, R);
  }
}

// S^T[c0 .. c0 + kRows, panel] <- decay[c] S^T[c, panel] + sum_{i < n} kr[i, c] U[i, :]
template <int kRows>
FLASHKDA_TARGET_AVX2 inline void update_rows(const float* kr, const float* decay, int64_t Kp, const float* U, int n,
                                             float* St, int64_t Vp, int64_t c0) {
  __m256 lo[kRows], hi[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m256 g = _mm256_broadcast_ss(&decay[c0 + r]);
    lo[r] = _mm256_mul_ps(g, _mm256_loadu_ps(St + (c0 + r) * Vp));
    hi[r] = _mm256_mul_ps(g, _mm256_loadu_ps(St + (c0 + r) * Vp + 8));
  }
  tile<kRows>(lo, hi, kr + c0, 1, Kp, U, 16, n);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
    _mm256_storeu_ps(St + (c0 + r) * Vp, lo[r]), _mm256_storeu_ps(St + (c0 + r) * Vp + 8, hi[r]);
}

// The update of a panel: S^T[:, panel] <- e^Γ ⊙ S^T[:, panel] + k_restored^T U (kr [C, Kp], decay [Kp],
// U [C, 16], n tokens), tiles of 6 channels while at least 10 are left, then of 4 (Kp a multiple of 16).
FLASHKDA_TARGET_AVX2 inline void panel_update(const float* kr, const float* decay, int64_t Kp, const float* U, int n,
                                              float* St, int64_t Vp) {
  int64_t c0 = 0;
  for (; Kp - c0 >= 10; c0 += 6) update_rows<6>(kr, decay, Kp, U, n, St, Vp, c0);
  for (; c0 + 4 <= Kp; c0 += 4) update_rows<4>(kr, decay, Kp, U, n, St, Vp, c0);
  for (; c0 < Kp; ++c0) update_rows<1>(kr, decay, Kp, U, n, St, Vp, c0);
}

}  // namespace flashkda::cpu::avx2

#endif  // FLASHKDA_X86_DISPATCH
