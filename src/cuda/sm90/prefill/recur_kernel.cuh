// K2 of the sm90 prefill: the chunk recurrence (SPEC.md §4) over the records K1 wrote.
//
// grid = (N * H, 8 / kWarps), block = kWarps * 32. One CTA runs the whole recurrence of one
// sequence and head for a slice of kWarps * 16 value columns; each warp owns 16 value columns
// of the state, S^T [16 v x 128 k], in fp32 registers for the whole sequence (value columns
// evolve independently, so splitting V needs no communication). Per chunk, with M = v rows:
//   W^T  = S^T kd^T               (16 x 16, K = 128)      u^T = v^T - W^T
//   U^T  = u^T inv_b^T            (K = 16)                 inv_b = (I + L)^-1 diag(b)
//   O^T  = S^T qd^T + U^T Mqk^T
//   S^T  = S^T diag(e^Gamma) + U^T Kr                       (N = 128, K = 16)
// The C fragments of one product are the A fragments of the next, so U and S never leave
// registers; the chunk records and v stream through a cp.async ring of kStages stages.
// kPrecise splits S, U, inv_b, k_restored, q_decayed and Mqk into bf16 hi + lo halves (2-3x the
// MMAs on those products); the fast mode rounds them to bf16 (see config.h for what that costs in accuracy).
#pragma once

#include <cute/arch/copy_sm80.hpp>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/sm90/prefill/chunk_map.cuh"

namespace flashkda::sm90::prefill {

using namespace flashkda::cuda;

constexpr int kStages = 3;

template <int kWarps, bool kPrecise>
struct RecurSmem {
  static constexpr int kVCols = kWarps * 16;
  static constexpr int kRecordBytes = kPrecise ? kChunkRecordBytes : kFastRecordBytes;
  struct Stage {
    alignas(16) uint8_t record[kRecordBytes];
    alignas(16) __nv_bfloat16 v[kChunk][kVCols];
  };
  Stage stage[kStages];
  alignas(16) __nv_bfloat16 out[kWarps][kChunk][16];
};

__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

template <int kWarps, bool kPrecise>
__device__ __forceinline__ void load_stage(typename RecurSmem<kWarps, kPrecise>::Stage& st, const Params& p, int64_t slot,
                                           int h, int64_t row0, int rows, int v_base) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kRecordChunks = RecurSmem<kWarps, kPrecise>::kRecordBytes / 16;
  constexpr int kVChunksPerRow = RecurSmem<kWarps, kPrecise>::kVCols / 8;
  const uint8_t* rec = p.records + (slot * p.H + h) * kChunkRecordBytes;
  for (int i = threadIdx.x; i < kRecordChunks; i += kThreads) cp_async_16(st.record + 16 * i, rec + 16 * i);
  for (int i = threadIdx.x; i < kChunk * kVChunksPerRow; i += kThreads) {
    const int t = i / kVChunksPerRow, part = i % kVChunksPerRow;
    const bool valid = t < rows;
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.v) +
                               ((row0 + (valid ? t : 0)) * p.H + h) * kHeadDim + v_base + part * 8;
    cp_async_16_zfill(&st.v[t][part * 8], src, valid);
  }
}

// Fills out and final_state with NaN (invalid cu_seqlens): loud, never silent garbage.
__device__ inline void poison_outputs(const Params& p) {
  const int64_t threads = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  const int64_t tid = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_out = p.total_tokens * p.H * kHeadDim;
  for (int64_t i = tid; i < n_out; i += threads)
    static_cast<__nv_bfloat16*>(p.out)[i] = __float2bfloat16(__int_as_float(0x7fc00000));
  if (p.final_state == nullptr) return;
  const int64_t n_state = p.num_seqs * p.H * kHeadDim * kHeadDim;
  for (int64_t i = tid; i < n_state; i += threads) {
    if (p.final_state_type == ElemType::kF32) static_cast<float*>(p.final_state)[i] = __int_as_float(0x7fc00000);
    else static_cast<__nv_bfloat16*>(p.final_state)[i] = __float2bfloat16(__int_as_float(0x7fc00000));
  }
}

// Converts the 16 n-tiles of S^T (or any 16 x 128 accumulator) into 8 A fragments; with
// kPrecise also the bf16 remainders.
template <bool kPrecise>
__device__ __forceinline__ void state_fragments(const float (&S)[16][4], uint32_t (&hi)[8][4], uint32_t (&lo)[8][4]) {
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    if constexpr (kPrecise) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float(&c)[4] = S[2 * s + (r >> 1)];
        split_bf16x2(c[(r & 1) * 2], c[(r & 1) * 2 + 1], hi[s][r], lo[s][r]);
      }
    } else {
      acc_to_a(S[2 * s], S[2 * s + 1], hi[s]);
    }
  }
}

template <bool kPrecise>
__device__ __forceinline__ void acc_fragments(const float (&c0)[4], const float (&c1)[4], uint32_t (&hi)[4],
                                              uint32_t (&lo)[4]) {
  if constexpr (kPrecise) {
    split_bf16x2(c0[0], c0[1], hi[0], lo[0]);
    split_bf16x2(c0[2], c0[3], hi[1], lo[1]);
    split_bf16x2(c1[0], c1[1], hi[2], lo[2]);
    split_bf16x2(c1[2], c1[3], hi[3], lo[3]);
  } else {
    acc_to_a(c0, c1, hi);
  }
}

template <int kWarps, bool kPrecise>
__global__ void __launch_bounds__(kWarps * 32) recur_kernel(const __grid_constant__ Params p) {
  using Smem = RecurSmem<kWarps, kPrecise>;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  if (p.cu_seqlens != nullptr && *p.error_flag != 0) {
    poison_outputs(p);
    return;
  }

  const int64_t n = blockIdx.x / p.H;
  const int h = int(blockIdx.x % p.H);
  const int v_base = blockIdx.y * Smem::kVCols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int v_row = v_base + warp * 16 + g;  // this thread's state rows: v_row and v_row + 8
  const SeqChunks sc = seq_chunks(p, n);
  const int64_t state_base = (n * p.H + h) * int64_t(kHeadDim) * kHeadDim;

  // S^T tile: S[nt][e] = state(v = v_row + 8 * (e >> 1), position 8 * nt + 2 * t4 + (e & 1)); with the
  // channel positions of config.h, n-tiles 2s and 2s + 1 hold channels 16s + 4 * t4 .. + 3.
  float S[16][4];
#pragma unroll
  for (int s = 0; s < 8; ++s) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f);
      const int64_t idx = state_base + int64_t(v_row + 8 * half) * kHeadDim + 16 * s + 4 * t4;
      if (p.initial_state_type == ElemType::kF32) {
        s4 = *reinterpret_cast<const float4*>(static_cast<const float*>(p.initial_state) + idx);
      } else if (p.initial_state_type == ElemType::kBF16) {
        const uint2 b = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.initial_state) + idx);
        s4 = make_float4(bf16_lo(b.x), bf16_hi(b.x), bf16_lo(b.y), bf16_hi(b.y));
      }
      S[2 * s][2 * half] = s4.x, S[2 * s][2 * half + 1] = s4.y;
      S[2 * s + 1][2 * half] = s4.z, S[2 * s + 1][2 * half + 1] = s4.w;
    }
  }

  const int64_t num_chunks = sc.chunk_end - sc.chunk_begin;
  auto chunk_rows = [&](int64_t j) { const int64_t left = sc.eos - (sc.bos + j * kChunk); return int(left < kChunk ? left : kChunk); };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_chunks)
      load_stage<kWarps, kPrecise>(sm.stage[s], p, sc.chunk_begin + s, h, sc.bos + s * kChunk, chunk_rows(s), v_base);
    cute::cp_async_fence();
  }

  for (int64_t j = 0; j < num_chunks; ++j) {
    cute::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int64_t jn = j + kStages - 1;
      if (jn < num_chunks)
        load_stage<kWarps, kPrecise>(sm.stage[jn % kStages], p, sc.chunk_begin + jn, h, sc.bos + jn * kChunk,
                           chunk_rows(jn), v_base);
      cute::cp_async_fence();
    }
    const typename Smem::Stage& st = sm.stage[j % kStages];
    const uint8_t* rec = st.record;

    // W^T = S^T kd^T and O^T = S^T qd^T (K = 128); even and odd k-steps accumulate into two
    // sets so each dependent MMA chain is half as long.
    uint32_t sa[8][4], sa_lo[8][4];
    state_fragments<kPrecise>(S, sa, sa_lo);
    float W2[2][2][4] = {}, O2[2][2][4] = {};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const uint4 bk = lds128(rec + kOffKDecayed + (s * 32 + lane) * 16);
      const uint4 bq = lds128(rec + kOffQDecayed + (s * 32 + lane) * 16);
      float(&W)[2][4] = W2[s & 1];
      float(&O)[2][4] = O2[s & 1];
      mma_bf16_n16(W[0], W[1], sa[s], bk);
      mma_bf16_n16(O[0], O[1], sa[s], bq);
      if constexpr (kPrecise) {
        const uint4 bq_lo = lds128(rec + kOffQDecayedLo + (s * 32 + lane) * 16);
        mma_bf16_n16(W[0], W[1], sa_lo[s], bk);
        mma_bf16_n16(O[0], O[1], sa_lo[s], bq);
        mma_bf16_n16(O[0], O[1], sa[s], bq_lo);
      }
    }
    float W[2][4], O[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) W[nt][e] = W2[0][nt][e] + W2[1][nt][e], O[nt][e] = O2[0][nt][e] + O2[1][nt][e];

    // u^T = v^T - W^T, then U^T = u^T inv_b^T.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = nt * 8 + 2 * t4 + (e & 1);
        const int col = warp * 16 + g + 8 * (e >> 1);
        W[nt][e] = __bfloat162float(st.v[t][col]) - W[nt][e];
      }
    uint32_t ua[4], ua_lo[4];
    acc_fragments<kPrecise>(W[0], W[1], ua, ua_lo);
    float U[2][4] = {};
    {
      const uint4 bi = lds128(rec + kOffInvB + lane * 16);
      mma_bf16_n16(U[0], U[1], ua, bi);
      if constexpr (kPrecise) {
        const uint4 bi_lo = lds128(rec + kOffInvBLo + lane * 16);
        mma_bf16_n16(U[0], U[1], ua_lo, bi);
        mma_bf16_n16(U[0], U[1], ua, bi_lo);
      }
    }
    uint32_t uc[4], uc_lo[4];
    acc_fragments<kPrecise>(U[0], U[1], uc, uc_lo);

    // O^T += U^T Mqk^T.
    {
      const uint4 bm = lds128(rec + kOffMqk + lane * 16);
      mma_bf16_n16(O[0], O[1], uc, bm);
      if constexpr (kPrecise) {
        const uint4 bm_lo = lds128(rec + kOffMqkLo + lane * 16);
        mma_bf16_n16(O[0], O[1], uc_lo, bm);
        mma_bf16_n16(O[0], O[1], uc, bm_lo);
      }
    }

    // S^T = S^T diag(e^Gamma) + U^T Kr.
    const float* gamma = reinterpret_cast<const float*>(rec + kOffGamma);
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const float2 eg = *reinterpret_cast<const float2*>(gamma + 8 * nt + 2 * t4);
      S[nt][0] *= eg.x, S[nt][1] *= eg.y, S[nt][2] *= eg.x, S[nt][3] *= eg.y;
    }
#pragma unroll
    for (int pr = 0; pr < 8; ++pr) {
      const uint4 br = lds128(rec + kOffKRestored + (pr * 32 + lane) * 16);
      mma_bf16_n16(S[2 * pr], S[2 * pr + 1], uc, br);
      if constexpr (kPrecise) {
        const uint4 br_lo = lds128(rec + kOffKRestoredLo + (pr * 32 + lane) * 16);
        mma_bf16_n16(S[2 * pr], S[2 * pr + 1], uc_lo, br);
        mma_bf16_n16(S[2 * pr], S[2 * pr + 1], uc, br_lo);
      }
    }

    // Output: stage O^T as [t][16 v] in this warp's tile, then one 16-byte store per lane.
    const int rows = chunk_rows(j);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sm.out[warp][nt * 8 + 2 * t4 + (e & 1)][g + 8 * (e >> 1)] = __float2bfloat16_rn(O[nt][e]);
    __syncwarp();
    {
      const int t = lane >> 1, part = lane & 1;
      if (t < rows) {
        const int64_t row = sc.bos + j * kChunk + t;
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + (row * p.H + h) * kHeadDim + v_base +
                             warp * 16 + part * 8;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sm.out[warp][t][part * 8]);
      }
    }
  }
  cute::cp_async_wait<0>();

  if (p.final_state != nullptr) {
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t idx = state_base + int64_t(v_row + 8 * half) * kHeadDim + 16 * s + 4 * t4;
        const float4 s4 = make_float4(S[2 * s][2 * half], S[2 * s][2 * half + 1], S[2 * s + 1][2 * half],
                                      S[2 * s + 1][2 * half + 1]);
        if (p.final_state_type == ElemType::kF32) {
          *reinterpret_cast<float4*>(static_cast<float*>(p.final_state) + idx) = s4;
        } else {
          *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.final_state) + idx) =
              make_uint2(pack_bf16x2(s4.x, s4.y), pack_bf16x2(s4.z, s4.w));
        }
      }
  }
}

}  // namespace flashkda::sm90::prefill
