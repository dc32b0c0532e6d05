// The chunk-32 recurrence's steps for one warpgroup and one chunk (consume.h, consume.cu; the
// consumers of fused.cu), SPEC §4's names. S^T [64 v][128 k] of this warpgroup in fp32 registers
// (warp w: rows 16 w + g and 16 w + g + 8 of its 64, as today's K2), scaled by the fp16 policy's
// row scales (prefill::RowScale: S_st = m S):
//   W^T = S^T k_decayed^T, O^T = S^T q_decayed^T      m64n32k16 fp16, 8 k-steps each
//   u^T = m v^T - W^T,  U^T = u^T inv_b^T             m64n32k16 bf16, u and inv_b split (K = 32)
//   S^T = S^T diag(e^Gamma) + U^T k_restored          m64n128k16 bf16, U and k_restored split
//   O^T += U^T Mqk^T                                  m64n32k16 bf16, U and Mqk split
// The update is issued before the output's Mqk product (a warpgroup's wgmmas run in order).
#pragma once

#include "cuda/sm90/prefill/recur_kernel.cuh"
#include "cuda/sm90/prefill_v2/consume.h"
#include "cuda/sm90/prefill_v2/produce.cuh"

namespace flashkda::cuda::sm90::prefill_v2 {

namespace gmma = cute::SM90::GMMA;
using WgmmaF16N32 = gmma::MMA_64x32x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>;
using WgmmaN32 = gmma::MMA_64x32x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
using WgmmaUpdate = gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;
using prefill::fence_regs;
using prefill::wgmma;

// K-major 64-byte-swizzle descriptor of a 32 x 32 tile (layout.h sw64_offset: SBO = 8 rows of 64 B).
__device__ __forceinline__ uint64_t sw64_desc(const void* p) {
  const uint32_t a = smem_addr(p);
  return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(512 >> 4) << 32) | (uint64_t(2) << 62);
}
// k_restored as the update's MN-major B (N = 128 channels, K = tokens) in the same SW128 tile:
// LBO = 4096 B between the 64-channel blocks, SBO = 1024 B between 8-token groups.
__device__ __forceinline__ uint64_t sw128_mn_desc(const void* p) {
  const uint32_t a = smem_addr(p);
  return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t(4096 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// Byte offset / 16 of k-step s (channels 16 s ..) in a 32-row SW128 K-major tile.
__device__ __forceinline__ constexpr int kstep128(int s) { return ((s / 4) * kChunk * 128 + (s % 4) * 32) >> 4; }

// An accumulator of N = 32 (flat: n-tile n, element e at [4 n + e]) as the two k-steps' A fragments
// over its 32 columns, split into bf16 hi + lo.
__device__ __forceinline__ void split_fragments(const float (&x)[16], uint32_t (&hi)[2][4], uint32_t (&lo)[2][4]) {
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 8 * s + 4 * (r >> 1) + 2 * (r & 1);
      split_bf16x2_trunc(x[i], x[i + 1], hi[s][r], lo[s][r]);
    }
}

// v^T of chunk c for this thread's accumulator slots (token 8 n + 2 t4 + (e & 1) at [4 n + e], value
// row v_row + 8 (e >> 1)); zeros past the end.
__device__ __forceinline__ void load_v_slots(const ConsumeArgs& p, int64_t c, int h, int v_row, int t4, float (&x)[16]) {
  const __nv_bfloat16* const v = static_cast<const __nv_bfloat16*>(p.v);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t t = c * kChunk + 8 * (i >> 2) + 2 * t4 + (i & 1);
    x[i] = t < p.T ? __bfloat162float(v[(t * p.H + h) * kHeadDim + v_row + 8 * ((i >> 1) & 1)]) : 0.f;
  }
}

// W^T (tile = k_decayed) or O^T (tile = q_decayed) of one chunk for this thread's rows in fp32 on
// the CUDA cores from the fp32 state: the range guard's fallback when S_st left fp16's range
// (prefill::RowScale). D receives the m64n32 accumulator layout (token 8 n + 2 t4 + (e & 1), row
// + 8 (e >> 1) at [4 n + e]). Every lane of the warp calls it.
__device__ __forceinline__ void f16_product_fp32(const float (&S)[64], const uint8_t* tile, float (&D)[16], int t4) {
#pragma unroll 1
  for (int t = 0; t < kChunk; ++t) {  // not unrolled (rare path, registers); the slots by select
    float d0 = 0.f, d1 = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 8 * j + 2 * t4;
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(tile + sw128_offset(kChunk, t, c)));
      d0 = fmaf(S[4 * j], x.x, fmaf(S[4 * j + 1], x.y, d0));
      d1 = fmaf(S[4 * j + 2], x.x, fmaf(S[4 * j + 3], x.y, d1));
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) d0 += __shfl_xor_sync(0xffffffffu, d0, x), d1 += __shfl_xor_sync(0xffffffffu, d1, x);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const bool mine = t == 8 * (i >> 2) + 2 * t4 + (i & 1);
      D[i] = mine ? ((i & 2) ? d1 : d0) : D[i];
    }
  }
}

// Chunk c of head h from its record `rec` (shared memory, written and made visible to the async
// proxy before): the output of this thread's slots into out (the same slots as v_at's), and S^T
// advanced. Returns when every wgmma reading rec has completed. Every thread of the warpgroup
// calls it.
// v_at(i): v^T of this thread's accumulator slot i (token 8 (i >> 2) + 2 t4 + (i & 1), row
// v_row + 8 ((i >> 1) & 1)), read once W^T is in (so that v holds no registers across the wgmmas).
// inv: inv_b's split SW64 tiles (hi, then lo kSmallBytes after it): the record's
// (rec + ChunkOperands::kOffInvB), or the warpgroup's own where it inverts (fused.cu).
template <class VAt>
__device__ __forceinline__ void consume_chunk(const ConsumeArgs& p, int h, int64_t c, int v_row, int t4,
                                              const uint8_t* rec, const uint8_t* inv, VAt&& v_at, float (&S)[64],
                                              prefill::RowScale& rs, __nv_bfloat16 (&out)[16]) {
  // W^T and O^T over K = 128 (fp16 S_st, k_decayed, q_decayed).
  uint32_t s_hi[8][4], s_unused[8][4];
  prefill::state_fragments<false, true>(S, s_hi, s_unused);
  const uint64_t d_kd = sw128_desc(rec + ChunkOperands::kOffKDecayed);
  const uint64_t d_qd = sw128_desc(rec + ChunkOperands::kOffQDecayed);
  float W[16], O[16];
#pragma unroll
  for (int s = 0; s < 8; ++s) fence_regs(s_hi[s]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int s = 0; s < 8; ++s) wgmma<WgmmaF16N32>(s_hi[s], d_kd + kstep128(s), W, s > 0);
  cute::warpgroup_commit_batch();
#pragma unroll
  for (int s = 0; s < 8; ++s) wgmma<WgmmaF16N32>(s_hi[s], d_qd + kstep128(s), O, s > 0);
  cute::warpgroup_commit_batch();
  // Both batches: the U product below would queue behind O^T anyway (a warpgroup's wgmmas run in
  // order), and holding O^T's operands in flight through the fallback's registers would make
  // ptxas serialise every wgmma of the fused kernel (C7512).
  cute::warpgroup_wait<0>();
  fence_regs(W), fence_regs(O);
  // Range guard: a non-finite W^T means S_st left fp16's range (or an input is not finite); this
  // warp rescales its rows and redoes W^T and O^T in fp32.
  {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) sum += W[i];
    if (__any_sync(0xffffffffu, !(fabsf(sum) <= 3.0e38f))) {
      rs.renormalise(S);
      f16_product_fp32(S, rec + ChunkOperands::kOffKDecayed, W, t4);
      f16_product_fp32(S, rec + ChunkOperands::kOffQDecayed, O, t4);
      fence_regs(W), fence_regs(O);
    }
  }

  // u^T = m v^T - W^T, then U^T = u^T inv_b^T (both split: hi.hi + lo.hi + hi.lo).
#pragma unroll
  for (int i = 0; i < 16; ++i) W[i] = fmaf(v_at(i), rs.m[(i >> 1) & 1], -W[i]);
  uint32_t u_hi[2][4], u_lo[2][4];
  split_fragments(W, u_hi, u_lo);
  const uint64_t d_inv = sw64_desc(inv), d_inv_lo = sw64_desc(inv + kSmallBytes);
  float U[16];
#pragma unroll
  for (int s = 0; s < 2; ++s) fence_regs(u_hi[s]), fence_regs(u_lo[s]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    wgmma<WgmmaN32>(u_hi[s], d_inv + 2 * s, U, s > 0);
    wgmma<WgmmaN32>(u_lo[s], d_inv + 2 * s, U, true);
    wgmma<WgmmaN32>(u_hi[s], d_inv_lo + 2 * s, U, true);
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence_regs(U);
  uint32_t U_hi[2][4], U_lo[2][4];
  split_fragments(U, U_hi, U_lo);

  // S^T = S^T diag(e^Gamma) + U^T k_restored, then O^T += U^T Mqk^T.
  const float* const gamma = reinterpret_cast<const float*>(rec + ChunkOperands::kOffGamma);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 e = *reinterpret_cast<const float2*>(gamma + 8 * j + 2 * t4);
    S[4 * j] *= e.x, S[4 * j + 1] *= e.y, S[4 * j + 2] *= e.x, S[4 * j + 3] *= e.y;
  }
  const uint64_t d_kr = sw128_mn_desc(rec + ChunkOperands::kOffKRestored);
  const uint64_t d_kr_lo = sw128_mn_desc(rec + ChunkOperands::kOffKRestoredLo);
  const uint64_t d_mqk = sw64_desc(rec + ChunkOperands::kOffMqk), d_mqk_lo = sw64_desc(rec + ChunkOperands::kOffMqkLo);
  fence_regs(S), fence_regs(O);
#pragma unroll
  for (int s = 0; s < 2; ++s) fence_regs(U_hi[s]), fence_regs(U_lo[s]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int s = 0; s < 2; ++s) {  // k-step s: tokens 16 s .. 16 s + 15, 2048 bytes into the tile
    wgmma<WgmmaUpdate>(U_hi[s], d_kr + 128 * s, S, true);
    wgmma<WgmmaUpdate>(U_lo[s], d_kr + 128 * s, S, true);
    wgmma<WgmmaUpdate>(U_hi[s], d_kr_lo + 128 * s, S, true);
  }
  cute::warpgroup_commit_batch();
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    wgmma<WgmmaN32>(U_hi[s], d_mqk + 2 * s, O, true);
    wgmma<WgmmaN32>(U_lo[s], d_mqk + 2 * s, O, true);
    wgmma<WgmmaN32>(U_hi[s], d_mqk_lo + 2 * s, O, true);
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence_regs(S), fence_regs(O);

  // The output O_st / m of this thread's slots, rounded to bf16 (the caller stores them).
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = __float2bfloat16_rn(O[i] * rs.inv[(i >> 1) & 1]);
}

// The output slots of consume_chunk straight to global memory (2-byte stores; rows of the sequence only).
__device__ __forceinline__ void store_out_slots(const ConsumeArgs& p, int h, int64_t c, int v_row, int t4,
                                                const __nv_bfloat16 (&o)[16]) {
  __nv_bfloat16* const out = static_cast<__nv_bfloat16*>(p.out);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t t = c * kChunk + 8 * (i >> 2) + 2 * t4 + (i & 1);
    if (t < p.T) out[(t * p.H + h) * kHeadDim + v_row + 8 * ((i >> 1) & 1)] = o[i];
  }
}

}  // namespace flashkda::cuda::sm90::prefill_v2
