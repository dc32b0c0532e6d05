// Tensor-core helpers: the CuTe SM80 m16n8k16 bf16 and m16n8k8 tf32 MMA atoms (run on sm_90a as
// mma.sync), bf16 and tf32 hi/lo splitting. Fragment layouts (PTX ISA, g = lane / 4, t = lane % 4):
//   bf16 A 16x16: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//        B 16x8 : b0 (k 2t..2t+1, n g)  b1 (k 2t+8..2t+9, n g)
//   tf32 A 16x8 : a0 (g, t)  a1 (g+8, t)  a2 (g, t+4)  a3 (g+8, t+4)
//        B 8x8  : b0 (k t, n g)  b1 (k t+4, n g)
//   C 16x8 (both): c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
// so the C fragments of two adjacent n-tiles are exactly the bf16 A fragment of a 16x16 operand.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cute/arch/mma_sm80.hpp>

#include "cuda/common/math.cuh"

namespace flashkda::cuda {

// Split x = hi + lo with both halves bf16: hi*b + lo*b carries ~16 mantissa bits of x.
// (hi's halves read back by shifts and masks: the bf16x2 -> float2 conversion cost two PRMT a pair
// that rebuilt the same register.)
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16x2(x0, x1);
  lo = pack_bf16x2(x0 - bf16_lo(hi), x1 - bf16_hi(hi));
}

// The same split with hi = x truncated to bf16 (x with its low 16 bits cleared): 6 instructions
// per pair instead of 8, and lo = x - hi is exact before its own rounding, so hi + lo still
// carries ~15 mantissa bits (|lo| < 2^-7 |x|, rounded to 8 bits).
__device__ __forceinline__ void split_bf16x2_trunc(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const uint32_t b0 = __float_as_uint(x0), b1 = __float_as_uint(x1);
  hi = __byte_perm(b0, b1, 0x7632);
  lo = pack_bf16x2(x0 - __uint_as_float(b0 & 0xffff0000u), x1 - __uint_as_float(b1 & 0xffff0000u));
}

// Split x = hi + lo for tf32 products: hi is x with its low 13 bits cleared (what the tensor core
// reads of a tf32 operand), lo = x - hi exactly (13 bits, of which the tensor core reads the top
// 11), so hi*b_hi + hi*b_lo + lo*b_hi carries ~21 mantissa bits of each product. A non-finite x
// gives a NaN lo.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// d += A * B for one m16n8k8 tf32 tile (fp32 accumulate).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1],
                                           d[2], d[3]);
}

// d += A * B for one m16n8k16 tile (fp32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0],
                                            d[1], d[2], d[3]);
}

// Both 16x8 n-tiles of a 16x16 B operand held as one 16-byte fragment unit {b0, b1 of n-tile 0,
// b0, b1 of n-tile 1}: d0 += A * n-tile 0, then d1 += A * n-tile 1.
__device__ __forceinline__ void mma_bf16_n16(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4], const uint4& b) {
  mma_bf16(d0, a, b.x, b.y);
  mma_bf16(d1, a, b.z, b.w);
}

// The accumulators of two adjacent 16x8 n-tiles as the bf16 A fragment of one 16x16 operand.
__device__ __forceinline__ void acc_to_a(const float (&c0)[4], const float (&c1)[4], uint32_t (&a)[4]) {
  a[0] = pack_bf16x2(c0[0], c0[1]);
  a[1] = pack_bf16x2(c0[2], c0[3]);
  a[2] = pack_bf16x2(c1[0], c1[1]);
  a[3] = pack_bf16x2(c1[2], c1[3]);
}

}  // namespace flashkda::cuda
