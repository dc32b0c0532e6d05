// Device helpers shared by the sm90 kernels: offsets loads, warp-group reductions and bf16 bit packing
// (activations and gate forms live in kda_math.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace flashkda::cuda {

// Element i of an int32 or int64 offsets array (cu_seqlens), through the read-only cache: no
// kernel writes the offsets it reads. The host side is host::offset_at (src/common/host_math.h).
__device__ __forceinline__ int64_t offset_at(const void* offsets, bool is_i64, int64_t i) {
  return is_i64 ? int64_t(__ldg(static_cast<const long long*>(offsets) + i))
                : int64_t(__ldg(static_cast<const int32_t*>(offsets) + i));
}

// Sum over groups of kWidth consecutive lanes (kWidth a power of two <= 32); every lane of a group
// receives the group's sum. All 32 lanes must call it.
template <int kWidth>
__device__ __forceinline__ float group_sum(float x) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "kWidth: power of two <= 32");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// bf16 bits <-> fp32 (bf16 is the upper half of an fp32; the conversion to bf16 rounds to nearest even).
__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float bf16_lo(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Two floats rounded to fp16 (nearest even), packed like pack_bf16x2.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// A pair rounded to the 16-bit operand type of a product: fp16 (kF16) or bf16.
template <bool kF16>
__device__ __forceinline__ uint32_t pack_x2(float lo, float hi) {
  if constexpr (kF16) return pack_f16x2(lo, hi);
  else return pack_bf16x2(lo, hi);
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float x) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  return *reinterpret_cast<const uint16_t*>(&h);
}

}  // namespace flashkda::cuda
