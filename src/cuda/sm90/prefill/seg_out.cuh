// The segmented K2's o_zero | w in seg_out (config.h kSegOutBytes): fp16 values under a power-of-two
// exponent per token and group of 16 columns. K2 packs a group from four lanes' four values each
// (lanes 4 i .. 4 i + 3 of a warp); the combine unpacks pairs.
#pragma once

#include <cuda_fp16.h>

#include "cuda/common/math.cuh"
#include "cuda/sm90/prefill/config.h"

namespace flashkda::cuda::sm90::prefill {

constexpr int kSegExpMin = -126, kSegExpMax = 126;  // 2^e and 2^-e both normal fp32 numbers

// 2^e for e in [kSegExpMin, kSegExpMax], exactly. The clamp binds only for groups whose largest
// magnitude is below 2^-112: their values keep an absolute precision of 2^-150 instead of 11 bits.
__device__ __forceinline__ float seg_pow2(int e) { return __int_as_float((127 + e) << 23); }

// The group's exponent from this lane's four values and those of lanes ^ 1 and ^ 2 (every lane of
// the warp calls it): the largest finite magnitude m in [2^14, 2^15) once scaled by 2^-e, so the
// scaled values stay below fp16's 65504; 0 where the group has no finite nonzero value. Non-finite
// values keep their kind through the fp16 conversion (NaN stays NaN, +-inf stays +-inf).
__device__ __forceinline__ int seg_group_exponent(float4 x) {
  auto mag = [](float v) { return isfinite(v) ? fabsf(v) : 0.f; };
  float m = fmaxf(fmaxf(mag(x.x), mag(x.y)), fmaxf(mag(x.z), mag(x.w)));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  if (m == 0.f) return 0;
  const int e = ((__float_as_int(m) >> 23) & 0xff) - 127 - 14;  // a subnormal m clamps below
  return min(max(e, kSegExpMin), kSegExpMax);
}

// Four values scaled by 2^-e and rounded to fp16 (nearest even), packed in order.
__device__ __forceinline__ uint2 seg_pack4(float4 x, int e) {
  const float s = seg_pow2(-e);
  return make_uint2(pack_f16x2(x.x * s, x.y * s), pack_f16x2(x.z * s, x.w * s));
}

// Two packed fp16 values times 2^e.
__device__ __forceinline__ float2 seg_unpack2(uint32_t pair, int e) {
  const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&pair));
  const float s = seg_pow2(e);
  return make_float2(v.x * s, v.y * s);
}

// Exponent i (0-7) of eight consecutive ones loaded as a uint2 (a token's groups of o_zero or of w).
__device__ __forceinline__ int seg_exp(uint2 e8, int i) { return int(int8_t((i < 4 ? e8.x : e8.y) >> (8 * (i % 4)))); }

}  // namespace flashkda::cuda::sm90::prefill
