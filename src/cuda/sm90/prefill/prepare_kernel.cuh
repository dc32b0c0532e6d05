// K0 (varlen chunk scan) and K1 (token-parallel prepare) of the sm90 prefill.
//
// K0: grid = 1, block = 1024. Validates cu_seqlens (starts at 0, non-decreasing, ends at the
//     token count) and writes chunk_start[n] = sum_{m<n} ceil(len_m / 16). On invalid input it
//     raises error_flag and writes zeros, so K1/K2 do no work and K2 fills the outputs with NaN.
// K1: grid = chunk_slots * H, block = 128 (thread c owns channel c of all 16 rows).
//     One CTA builds, for one 16-token chunk of one head: q_decayed, k_decayed, k_restored,
//     Mqk, inv_b = (I + L)^-1 diag(b) and exp(G_C), in fragment order (config.h).
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/common/kda_math.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/sm90/prefill/chunk_map.cuh"
#include "cuda/sm90/prefill/config.h"

namespace flashkda::sm90::prefill {

using namespace flashkda::cuda;

// ---- K0 ----------------------------------------------------------------------------------------
constexpr int kScanThreads = 1024;

__global__ void __launch_bounds__(kScanThreads) chunk_scan_kernel(const __grid_constant__ Params p) {
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int carry;

  const int64_t N = p.num_seqs;
  int bad = 0;
  for (int64_t i = threadIdx.x; i <= N; i += kScanThreads) {
    const int64_t c = cu_at(p, i);
    if (i == 0 && c != 0) bad = 1;
    if (i == N && c != p.total_tokens) bad = 1;
    if (i < N && cu_at(p, i + 1) < c) bad = 1;
  }
  const int any_bad = Reduce(tmp.reduce).Sum(bad);
  if (threadIdx.x == 0) {
    carry = 0;
    *p.error_flag = any_bad > 0 ? 1 : 0;
  }
  __syncthreads();
  const bool invalid = *p.error_flag != 0;
  for (int64_t base = 0; base <= N; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    int chunks = 0;
    if (!invalid && i < N) chunks = int((cu_at(p, i + 1) - cu_at(p, i) + kChunk - 1) / kChunk);
    int prefix, total;
    Scan(tmp.scan).ExclusiveSum(chunks, prefix, total);
    if (i <= N) p.chunk_start[i] = carry + prefix;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
}

// ---- K1 ----------------------------------------------------------------------------------------
constexpr int kPrepThreads = kHeadDim;  // 128
constexpr int kRowPad = kHeadDim + 8;   // fp32 rows padded to 136: conflict-free float2 fragment loads

// The gemm operands (phase 2) and the staged record (phase 3) are never live together: sharing
// their bytes keeps a CTA at ~28 KB so five fit on an SM instead of four (K1 is latency-bound:
// ncu measured 25% occupancy and 11.8 cycles between issues at four CTAs per SM).
struct PrepareSmem {
  union {
    struct {
      float op_a[kChunk][kRowPad];  // k_hat*e^{G-mid} (fast path) or k_hat (pairwise path)
      float op_q[kChunk][kRowPad];  // scale*q_hat*e^{G-mid}           or scale*q_hat
      float op_b[kChunk][kRowPad];  // k_hat*e^{mid-G}                 or G
    };
    alignas(16) uint8_t record[kChunkRecordBytes];  // staging of the whole chunk record
  };
  float L[kChunk][kChunk + 1];
  float beta[kChunk];
  float row_sumsq[kPrepThreads / 32][2 * kChunk];
};

// Byte offset of element (row t, channel c) of a 16x128 tile used as the B operand of
// (M=v, N=t, K=c) products: q_decayed, k_decayed.
__device__ __forceinline__ int frag_index_tk(int t, int c) {
  const int s = c >> 4, cc = c & 15;
  const int lane = (t & 7) * 4 + ((cc & 7) >> 1);
  const int reg = (t >> 3) * 2 + (cc >> 3);
  return (((s * 32 + lane) * 4 + reg) * 2 + (cc & 1)) * 2;
}

// ... of k_restored, the B operand of (M=v, N=c, K=t) products.
__device__ __forceinline__ int frag_index_kt(int t, int c) {
  const int pair = c >> 4;
  const int lane = (c & 7) * 4 + ((t & 7) >> 1);
  const int reg = ((c & 15) >> 3) * 2 + (t >> 3);
  return (((pair * 32 + lane) * 4 + reg) * 2 + (t & 1)) * 2;
}

// ... of a 16x16 matrix X[i][j] used as the B operand of (M=v, N=i, K=j) products: Mqk, inv_b.
__device__ __forceinline__ int frag_index_small(int i, int j) {
  const int lane = (i & 7) * 4 + ((j & 7) >> 1);
  const int reg = (i >> 3) * 2 + (j >> 3);
  return ((lane * 4 + reg) * 2 + (j & 1)) * 2;
}

__device__ __forceinline__ void store_bf16(uint8_t* base, int byte_offset, float x) {
  *reinterpret_cast<__nv_bfloat16*>(base + byte_offset) = __float2bfloat16_rn(x);
}

// One transpose-reduce step over n values (lane bit n/2), then the next with n/2 values.
template <int kN>
__device__ __forceinline__ void butterfly_reduce(float (&x)[2 * kChunk], int lane) {
  constexpr int kHalf = kN / 2;
  const bool upper = (lane & kHalf) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? x[i] : x[i + kHalf];
    const float keep = upper ? x[i + kHalf] : x[i];
    x[i] = keep + __shfl_xor_sync(0xffffffffu, send, kHalf);
  }
  if constexpr (kHalf > 1) butterfly_reduce<kHalf>(x, lane);
}

// Sums a[t] and b[t] over the 128 threads for each of the 16 rows; results in every thread.
// Transpose-reduce: each butterfly step halves the values a lane carries (31 shuffles for the
// 32 sums instead of 160), leaving lane l with the warp's sum of value l (a[0..15], b[0..15]).
__device__ __forceinline__ void rows_sum2(float (&a)[kChunk], float (&b)[kChunk], float (*scratch)[2 * kChunk]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float x[2 * kChunk];
#pragma unroll
  for (int t = 0; t < kChunk; ++t) x[t] = a[t], x[kChunk + t] = b[t];
  butterfly_reduce<2 * kChunk>(x, lane);
  scratch[warp][lane] = x[0];
  __syncthreads();
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    a[t] = scratch[0][t] + scratch[1][t] + scratch[2][t] + scratch[3][t];
    b[t] = scratch[0][kChunk + t] + scratch[1][kChunk + t] + scratch[2][kChunk + t] + scratch[3][kChunk + t];
  }
}

// One warp: C (16x16, fp32) = A (16x128) * B^T where B is 16x128, both fp32 rows in shared
// memory, as split-bf16 MMAs (hi*hi + hi*lo + lo*hi): ~fp32 accuracy on the tensor cores.
__device__ __forceinline__ void gemm_16x16x128_split(const float (*A)[kRowPad], const float (*B)[kRowPad],
                                                     float (&acc)[2][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int s = 0; s < kHeadDim / kMmaK; ++s) {
    const int c = s * kMmaK + 2 * t4;
    uint32_t ah[4], al[4];
    const float2 a0 = *reinterpret_cast<const float2*>(&A[g][c]);
    const float2 a1 = *reinterpret_cast<const float2*>(&A[g + 8][c]);
    const float2 a2 = *reinterpret_cast<const float2*>(&A[g][c + 8]);
    const float2 a3 = *reinterpret_cast<const float2*>(&A[g + 8][c + 8]);
    split_bf16x2(a0.x, a0.y, ah[0], al[0]);
    split_bf16x2(a1.x, a1.y, ah[1], al[1]);
    split_bf16x2(a2.x, a2.y, ah[2], al[2]);
    split_bf16x2(a3.x, a3.y, ah[3], al[3]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 b0 = *reinterpret_cast<const float2*>(&B[nt * 8 + g][c]);
      const float2 b1 = *reinterpret_cast<const float2*>(&B[nt * 8 + g][c + 8]);
      uint32_t bh0, bl0, bh1, bl1;
      split_bf16x2(b0.x, b0.y, bh0, bl0);
      split_bf16x2(b1.x, b1.y, bh1, bl1);
      mma_bf16(acc[nt], ah, bh0, bh1);
      mma_bf16(acc[nt], ah, bl0, bl1);
      mma_bf16(acc[nt], al, bh0, bh1);
    }
  }
}

__global__ void __launch_bounds__(kPrepThreads) prepare_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  PrepareSmem& sm = *reinterpret_cast<PrepareSmem*>(smem_raw);

  const int h = int(blockIdx.x % p.H);
  const int64_t slot = blockIdx.x / p.H;
  int64_t row0;
  int rows;
  if (!locate_chunk(p, slot, row0, rows)) return;

  const int c = threadIdx.x, lane = c & 31, warp = c >> 5;
  const int H = p.H;

  // Load channel c of the 16 rows. Every load is issued before any is used (rows past the
  // sequence end re-read the last valid row and are zeroed below: k = q = 0, a = 0), so the 48
  // loads share one memory latency instead of paying one per row (measured: 1.72 ms for this
  // kernel at T=8192, H=96 with the loads under a per-row branch).
  float q[kChunk], k[kChunk], G[kChunk];
  const float a_exp = (p.gate == Gate::kPrecomputed) ? 0.f : __expf(p.A_log[h]);
  const float bias = p.dt_bias != nullptr ? p.dt_bias[h * kHeadDim + c] : 0.f;
  const bool g_f32 = p.g_type == ElemType::kF32;
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    const int64_t idx = ((row0 + (t < rows ? t : rows - 1)) * H + h) * kHeadDim + c;
    q[t] = load_bf16(p.q, idx);
    k[t] = load_bf16(p.k, idx);
    G[t] = load_elem(p.g, idx, g_f32);
  }
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    if (t < rows) {
      G[t] = log_decay(int(p.gate), G[t], a_exp, bias, p.lower_bound);
    } else {
      q[t] = k[t] = G[t] = 0.f;
    }
  }
  if (c < kChunk) {
    float b = 0.f;
    if (c < rows) {
      b = load_elem(p.beta, (row0 + c) * H + h, p.beta_type == ElemType::kF32);
      if (p.beta_is_logit) b = sigmoidf_(b);
    }
    sm.beta[c] = b;
  }

  if (p.l2norm_qk) {
    float sq[kChunk], sk[kChunk];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) sq[t] = q[t] * q[t], sk[t] = k[t] * k[t];
    rows_sum2(sq, sk, sm.row_sumsq);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) q[t] *= rsqrtf(sq[t] + 1e-6f), k[t] *= rsqrtf(sk[t] + 1e-6f);
  }
#pragma unroll
  for (int t = 0; t < kChunk; ++t) q[t] *= p.scale;

  // In-chunk inclusive prefix sum of the log-decay: G[t] = a_0 + ... + a_t (G[15] = Gamma).
#pragma unroll
  for (int t = 1; t < kChunk; ++t) G[t] += G[t - 1];
  const float gamma = G[kChunk - 1];
  const float mid = 0.5f * (G[0] + gamma);
  const bool pairwise = __syncthreads_or(G[0] - gamma > kMaxFactorisedSpread);

  // Phase 2: L = kd ki^T and Mqk = qd ki^T from operands shifted per channel by mid, so no factor
  // exceeds e^{spread/2}; the pairwise path keeps k_hat, q_hat and G instead.
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    if (!pairwise) {
      const float up = __expf(G[t] - mid), down = __expf(mid - G[t]);
      sm.op_a[t][c] = k[t] * up;
      sm.op_q[t][c] = q[t] * up;
      sm.op_b[t][c] = k[t] * down;
    } else {
      sm.op_a[t][c] = k[t];
      sm.op_q[t][c] = q[t];
      sm.op_b[t][c] = G[t];
    }
  }
  __syncthreads();

  const int g = lane >> 2, t4 = lane & 3;
  float mqk[2][4] = {};    // fast path: warp 1's Mqk accumulators
  float mqk_pair[2] = {};  // pairwise path: Mqk entries e = c + 256 and c + 384
  if (!pairwise) {
    if (warp < 2) {
      float acc[2][4];
      gemm_16x16x128_split(warp == 0 ? sm.op_a : sm.op_q, sm.op_b, acc);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = g + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
          if (warp == 0) sm.L[i][j] = i > j ? sm.beta[i] * acc[nt][e] : 0.f;
          mqk[nt][e] = acc[nt][e];
        }
    }
  } else {
    // Pairwise: sum_c x_i,c k_j,c exp(G_i,c - G_j,c), exponent <= 0 for i >= j.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e = c + r * kPrepThreads, i = (e / kChunk) % kChunk, j = e % kChunk;
      float acc = 0.f;
      if (i >= j) {
        const float (*X)[kRowPad] = r < 2 ? sm.op_a : sm.op_q;
        for (int cc = 0; cc < kHeadDim; ++cc)
          acc += X[i][cc] * sm.op_a[j][cc] * __expf(sm.op_b[i][cc] - sm.op_b[j][cc]);
      }
      if (r < 2) sm.L[i][j] = i > j ? sm.beta[i] * acc : 0.f;
      else mqk_pair[r - 2] = acc;
    }
  }
  // Read this channel's operands back (q, k and G are not kept in registers across the gemm, so
  // K1 stays at <= 80 registers), then let the record staging reuse their bytes.
  float xq[kChunk], xa[kChunk], xb[kChunk];
#pragma unroll
  for (int t = 0; t < kChunk; ++t) xq[t] = sm.op_q[t][c], xa[t] = sm.op_a[t][c], xb[t] = sm.op_b[t][c];
  __syncthreads();

  // Phase 3: q_decayed, k_decayed, k_restored (all factors <= 1), Mqk, exp(Gamma) staged as bf16.
  // Fast path: q_decayed = (q e^{G-mid}) e^{mid}, k_restored = (k e^{mid-G}) e^{Gamma-mid}, both
  // factors <= 1; pairwise path: xq, xa, xb are q_hat, k_hat and G themselves.
  const float e_mid = __expf(mid), e_gamma_mid = __expf(gamma - mid);
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    const float e = pairwise ? __expf(xb[t]) : e_mid;
    const float kr = pairwise ? xa[t] * __expf(gamma - xb[t]) : xb[t] * e_gamma_mid;
    store_bf16(sm.record, kOffQDecayed + frag_index_tk(t, c), xq[t] * e);
    store_bf16(sm.record, kOffKDecayed + frag_index_tk(t, c), xa[t] * e);
    const float kr_hi = __bfloat162float(__float2bfloat16_rn(kr));
    store_bf16(sm.record, kOffKRestored + frag_index_kt(t, c), kr_hi);
    store_bf16(sm.record, kOffKRestoredLo + frag_index_kt(t, c), kr - kr_hi);
  }
  reinterpret_cast<float*>(sm.record + kOffGamma)[c] = __expf(gamma);
  if (!pairwise && warp == 1) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = g + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
        store_bf16(sm.record, kOffMqk + frag_index_small(i, j), i >= j ? mqk[nt][e] : 0.f);
      }
  } else if (pairwise) {
#pragma unroll
    for (int r = 2; r < 4; ++r) {
      const int e = c + r * kPrepThreads;
      store_bf16(sm.record, kOffMqk + frag_index_small((e / kChunk) % kChunk, e % kChunk), mqk_pair[r - 2]);
    }
  }

  // inv_b = (I + L)^-1 diag(b) by fp32 forward substitution (lane j owns column j): exact for
  // strictly lower-triangular L and stable for near-collinear keys, where the Neumann series
  // of (I + L)^-1 cancels catastrophically.
  if (warp == 0 && lane < kChunk) {
    const int j = lane;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float acc = (i == j) ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) acc -= sm.L[i][m] * x[m];
      x[i] = acc;
    }
    const float bj = sm.beta[j];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float val = x[i] * bj, hi = __bfloat162float(__float2bfloat16_rn(val));
      store_bf16(sm.record, kOffInvB + frag_index_small(i, j), hi);
      store_bf16(sm.record, kOffInvBLo + frag_index_small(i, j), val - hi);
    }
  }
  __syncthreads();

  // Coalesced 16-byte copy of the staged record to the workspace.
  const uint4* src = reinterpret_cast<const uint4*>(sm.record);
  uint4* dst = reinterpret_cast<uint4*>(p.records + (slot * H + h) * kChunkRecordBytes);
  for (int i = c; i < kChunkRecordBytes / 16; i += kPrepThreads) dst[i] = src[i];
}

}  // namespace flashkda::sm90::prefill
