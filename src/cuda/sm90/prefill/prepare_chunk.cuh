// K1's work on one chunk (prepare_chunk): q_decayed, k_decayed, k_restored, Mqk,
// inv_b = (I + L)^-1 diag(b) and exp(G_C) of one 16-token chunk of one head, in the record layout
// of config.h, by 128 threads. Run by K1 (prepare_kernel.cuh: one chunk a CTA, the record into the
// workspace); a function of its own so that a kernel fusing K1 into the recurrence can run it on a
// shared-memory stage (docs/DESIGN.md "K1 inside the recurrence").
#pragma once

#include "cuda/common/kda_math.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/sm90/prefill/chunk_map.cuh"
#include "cuda/sm90/prefill/config.h"

namespace flashkda::cuda::sm90::prefill {

// Thread layout: warp w owns rows 2w, 2w+1, 2w+8 and 2w+9 of the chunk (index r = 0..3), lane l
// owns channels 4l..4l+3 (index e = 0..3): every global load is 8 or 16 bytes, the row sums of the
// L2 norm are warp reductions, and each thread writes its share of the record (config.h layouts)
// straight from registers.
// The in-chunk prefix sum of the log-decay runs down the columns of one shared tile.
constexpr int kPrepThreads = 128;
constexpr int kPrepWarps = kPrepThreads / 32;

__device__ __forceinline__ int row_of(int warp, int r) { return 2 * warp + (r & 1) + 8 * (r >> 1); }

// Unit (16 bytes) of the m16n8k16 fragment-order operands K1 keeps in shared memory for L and
// Mqk, holding rows t, t+8 (t < 8) of channels 4l..4l+3: {row t ch 0-1, row t ch 2-3, row t+8 ch 0-1, row t+8 ch 2-3}.
// k-step s = l / 4 holds its 32 units (one per lane of the reading warp, lane 4t + l % 4) at
// 32 s, swizzled: bit 2 of the index flipped in odd k-steps. A writing warp stores one row t of
// every k-step at once, and without the swizzle its 32 units fell into half of the banks (twice
// the shared wavefronts, ncu run 61); the readers still read 32 contiguous units a k-step.
__device__ __forceinline__ int tk_swizzle(int s) { return (s & 1) << 2; }
__device__ __forceinline__ int unit_tk(int t, int l) { return (l >> 2) * 32 + ((t * 4 + (l & 3)) ^ tk_swizzle(l >> 2)); }
// Byte offset of element (i, j) of a 16x16 matrix X used as the B operand of (M=v, N=i, K=j)
// products (Mqk, inv_b).
__device__ __forceinline__ void store_bf16_at(uint8_t* base, int byte_offset, float x) {
  *reinterpret_cast<__nv_bfloat16*>(base + byte_offset) = __float2bfloat16_rn(x);
}

__device__ __forceinline__ int frag_index_small(int i, int j) {
  const int lane = (i & 7) * 4 + ((j & 7) >> 1);
  const int reg = (i >> 3) * 2 + (j >> 3);
  return ((lane * 4 + reg) * 2 + (j & 1)) * 2;
}

struct PrepareSmem {
  float G[kChunk][kHeadDim];  // log-decay, then its in-chunk prefix sum (column scan)
  union {
    // Fast path: split-bf16 gemm operands in tk units: [operand][hi/lo][512 words].
    // 0: k_hat e^{G-mid}, 1: scale q_hat e^{G-mid}, 2: k_hat e^{mid-G}.
    uint4 ops[3][2][kTileBytes / 16];
    // Pairwise path: fp32 k_hat, q_hat (and G above).
    float raw[2][kChunk][kHeadDim];
  };
  float L[kChunk][kChunk + 1];
  float beta[kChunk];
  // Transition skipping (Params::chunk_bound): each warp's share of the token bound, each warp's
  // max over its channels of G_C, and the norms of each row of k_decayed and k_restored.
  float bound[kPrepWarps];
  float gamma_max[kPrepWarps];
  float norm_kd[kChunk], norm_kr[kChunk];
  alignas(16) uint8_t small[4][kSmallTileBytes];  // Mqk, Mqk_lo (pairwise path), inv_b, inv_b_lo staging
};

// e^x and 1/x on the MUFU unit (flush-to-zero: the factors they feed are products of decays,
// where anything below 1e-38 is zero to every consumer).
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// K1's elementary functions for gate.h: ex2.approx, rcp.approx and a softplus that cannot overflow,
// softplus(x) = max(x, 0) + log(1 + e^{-|x|}) (absolute error ~1e-7).
struct PrepareMath {
  __device__ __forceinline__ static float exp(float x) { return exp_ftz(x); }
  __device__ __forceinline__ static float quot(float a, float b) { return a * fast_rcp(b); }
  __device__ __forceinline__ static float softplus(float x) { return fmaxf(x, 0.f) + __logf(1.f + exp_ftz(-fabsf(x))); }
};

// x = hi + lo in bf16 for a pair of floats; returns the packed hi and lo words.
__device__ __forceinline__ uint2 split_pair(float a, float b) {
  uint2 r;
  split_bf16x2(a, b, r.x, r.y);
  return r;
}

__device__ __forceinline__ void load4(const void* base, int64_t idx, bool is_f32, float (&x)[4]) {
  if (is_f32) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + idx);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + idx);
    x[0] = bf16_lo(v.x), x[1] = bf16_hi(v.x), x[2] = bf16_lo(v.y), x[3] = bf16_hi(v.y);
  }
}

// One warp: C (16x16) = X * Y^T over 128 channels from split-bf16 operands in tk units
// (hi*hi + hi*lo + lo*hi, about fp32 accuracy). acc[nt][e]: row g + 8(e>>1), column 8nt + 2t4 + (e&1).
__device__ __forceinline__ void gemm_tk_split(const uint4 (&X)[2][kTileBytes / 16], const uint4 (&Y)[2][kTileBytes / 16],
                                              float (&acc)[2][4]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int s = 0; s < kKSteps; ++s) {
    const int u = s * 32 + (lane ^ tk_swizzle(s));  // unit_tk(lane / 4, 4 s + lane % 4)
    const uint4 xh = X[0][u], xl = X[1][u];
    const uint4 yh = Y[0][u], yl = Y[1][u];
    // X's units hold an A fragment's registers in order (store_tk_split<true>): no moves before the mma
    const uint32_t ah[4] = {xh.x, xh.y, xh.z, xh.w}, al[4] = {xl.x, xl.y, xl.z, xl.w};
    mma_bf16_n16(acc[0], acc[1], ah, yh);
    mma_bf16_n16(acc[0], acc[1], ah, yl);
    mma_bf16_n16(acc[0], acc[1], al, yh);
  }
}

// kAOrder: the operand is gemm_tk_split's X (ops 0 and 1), whose unit u holds an mma A fragment's
// four registers (rows t and t + 8, channel pairs 01 and 23) in the order the mma takes them.
template <bool kAOrder = false>
__device__ __forceinline__ void store_tk_split(uint4* dst_hi, uint4* dst_lo, const float (&x)[4][4], int warp, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint2 a = split_pair(x[r][0], x[r][1]), b = split_pair(x[r][2], x[r][3]);
    const uint2 c = split_pair(x[r + 2][0], x[r + 2][1]), d = split_pair(x[r + 2][2], x[r + 2][3]);
    const int u = unit_tk(2 * warp + r, lane);
    if constexpr (kAOrder) {
      dst_hi[u] = make_uint4(a.x, c.x, b.x, d.x);
      dst_lo[u] = make_uint4(a.y, c.y, b.y, d.y);
    } else {
      dst_hi[u] = make_uint4(a.x, b.x, c.x, d.x);
      dst_lo[u] = make_uint4(a.y, b.y, c.y, d.y);
    }
  }
}

// Record tiles in wgmma layout (config.h). Lanes 2m and 2m+1 hold channels 8m..8m+3 and
// 8m+4..8m+7 of rows tA and tA + 1 (pieces a and b, four bf16 each); after one exchange lane 2m
// stores the 16-byte granule of row tA and lane 2m+1 the adjacent one of row tA + 1, so each
// lane pair writes one whole 32-byte sector. dst_even: the granule of row tA.
__device__ __forceinline__ void store_granules(uint8_t* dst_even, uint2 a, uint2 b, int lane) {
  const bool odd = lane & 1;
  const uint2 send = odd ? a : b;
  const uint2 recv = make_uint2(__shfl_xor_sync(0xffffffffu, send.x, 1), __shfl_xor_sync(0xffffffffu, send.y, 1));
  const uint4 v = odd ? make_uint4(recv.x, recv.y, b.x, b.y) : make_uint4(a.x, a.y, recv.x, recv.y);
  *reinterpret_cast<uint4*>(dst_even + (odd ? 16 : 0)) = v;
}

template <bool kF16 = false>
__device__ __forceinline__ uint2 pack4(const float (&x)[4]) {
  return make_uint2(pack_x2<kF16>(x[0], x[1]), pack_x2<kF16>(x[2], x[3]));
}

// x rounded to bf16 (or fp16: kF16) at tile offset off(t, c) of the granule (t = token, c = first
// of its 8 channels). Rows r = 0, 1 of this thread are tokens 2w, 2w+1 and rows 2, 3 are 2w+8, 2w+9.
template <bool kF16 = false, class Offset>
__device__ __forceinline__ void store_rounded(uint8_t* tile, const float (&x)[4][4], int warp, int lane, Offset off) {
#pragma unroll
  for (int rp = 0; rp < 2; ++rp)
    store_granules(tile + off(row_of(warp, 2 * rp), 8 * (lane >> 1)), pack4<kF16>(x[2 * rp]),
                   pack4<kF16>(x[2 * rp + 1]), lane);
}

// The bf16 split of x: hi into hi_tile, lo into lo_tile, both at tile offset off(t, c) of the
// granule (t = token, c = first of its 8 channels).
template <class Offset>
__device__ __forceinline__ void store_split(uint8_t* hi_tile, uint8_t* lo_tile, const float (&x)[4][4], int warp,
                                            int lane, Offset off) {
#pragma unroll
  for (int rp = 0; rp < 2; ++rp) {
    const uint2 a0 = split_pair(x[2 * rp][0], x[2 * rp][1]), a1 = split_pair(x[2 * rp][2], x[2 * rp][3]);
    const uint2 b0 = split_pair(x[2 * rp + 1][0], x[2 * rp + 1][1]), b1 = split_pair(x[2 * rp + 1][2], x[2 * rp + 1][3]);
    const int o = off(row_of(warp, 2 * rp), 8 * (lane >> 1));
    store_granules(hi_tile + o, make_uint2(a0.x, a1.x), make_uint2(b0.x, b1.x), lane);
    store_granules(lo_tile + o, make_uint2(a0.y, a1.y), make_uint2(b0.y, b1.y), lane);
  }
}

// The sums over the warp's 32 lanes of eight values at once, by reduce-scatter: each exchange
// step halves the values a lane carries (4, 2, 1), then two steps finish the last one; 9 shuffles
// instead of 8 x 5. Lane l is left with the sum of v[4 (l >> 4 & 1) + 2 (l >> 3 & 1) + (l >> 2 & 1)]
// (sum8_slot), the same in each lane of a quad.
__device__ __forceinline__ int sum8_slot(int lane) { return ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1); }
__device__ __forceinline__ float warp_sum8_scatter(const float (&v)[8], int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float a[4], c[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = (b4 ? v[i + 4] : v[i]) + __shfl_xor_sync(0xffffffffu, b4 ? v[i] : v[i + 4], 16);
#pragma unroll
  for (int i = 0; i < 2; ++i) c[i] = (b3 ? a[i + 2] : a[i]) + __shfl_xor_sync(0xffffffffu, b3 ? a[i] : a[i + 2], 8);
  float d = (b2 ? c[1] : c[0]) + __shfl_xor_sync(0xffffffffu, b2 ? c[0] : c[1], 4);
  d += __shfl_xor_sync(0xffffffffu, d, 2);
  return d + __shfl_xor_sync(0xffffffffu, d, 1);
}

// The barriers of one chunk's preparation among its 128 threads: the whole CTA in K1. A kernel that
// runs prepare_chunk in a warpgroup of its own passes a named-barrier policy instead, and one that
// prepares chunk after chunk also needs a barrier before a chunk writes the scratch tiles the
// previous one may still read (docs/DESIGN.md "K1 inside the recurrence", measured at 4a576c9).
struct CtaSync {
  __device__ __forceinline__ static void sync() { __syncthreads(); }
  __device__ __forceinline__ static bool sync_or(bool x) { return __syncthreads_or(x); }
};

// Transition skipping's bound on one chunk (Params::chunk_bound), by warp 0 after the inverse: an
// upper bound on log ||A||_2, A = diag(e^Gamma) - k_restored^T inv_b k_decayed the chunk's state
// transition (S_out = A S_in + ..., docs/SPEC.md §4), the smaller of two:
//  - the token bound: each token's transition (I - b k k^T) diag(e^a) has norm at most
//    max_c e^{a_c} max(1, |1 - b |k|^2|), so the chunk's at most their product (the warps' sums in
//    sm.bound). Tight where every channel decays alike; loose where a different channel decays
//    slowest at each token (random gates: ~-0.4 per chunk for a head whose per-token maximum
//    is ~-0.02, against ~-24 for the chunk's true norm);
//  - the chunk bound: ||A|| <= max_c e^{Gamma_c} + sum_ij |inv_b[i][j]| |k_restored_i| |k_decayed_j|
//    (the triangle inequality over the rank-one terms, each of norm |inv_b[i][j]| |k_r_i| |k_d_j|),
//    doubled against the rounding of its fp32 terms. ~1.9 above log ||A|| on random gates (the GPU
//    test ChunkBoundsBoundEveryChunkTransition; docs/DESIGN.md), but it sums 16 terms where nothing
//    decays.
// r_projection: lane j's share of the sum. A NaN in the chunk bound leaves the token bound.
__device__ __forceinline__ void chunk_log_bound(const Params& p, const PrepareSmem& sm, float r_projection, int64_t slot,
                                                int h, int lane) {
  float bound = sm.bound[0] + sm.bound[1] + sm.bound[2] + sm.bound[3];
  if (p.bound_transitions) {
#pragma unroll
    for (int x = 8; x >= 1; x >>= 1) r_projection += __shfl_xor_sync(0xffffffffu, r_projection, x);
    const float gamma_max = fmaxf(fmaxf(sm.gamma_max[0], sm.gamma_max[1]), fmaxf(sm.gamma_max[2], sm.gamma_max[3]));
    const float norm = exp_ftz(gamma_max) + 2.f * r_projection;  // lanes 0-15 hold the sum
    const float chunk = norm == norm ? fmaxf(__logf(norm), -87.f) + 0.01f : norm;  // log(0): a norm below 1e-38
    bound = fminf(bound, chunk);
  }
  if (lane == 0) p.chunk_bound[slot * p.H + h] = bound;
}

// One chunk of one head (rows tokens from row0; slot = its chunk index, for chunk_bound) into the
// record at g_rec (global or shared memory), by 128 threads (tid 0..127) with scratch sm: K1's
// body. Split: the mode's precision policy, i.e. which bf16 remainders its record holds (config.h
// SplitPolicy, RecordLayout).
template <class Split, class Sync>
__device__ __forceinline__ void prepare_chunk(const Params& p, PrepareSmem& sm, uint8_t* g_rec, int h, int64_t slot,
                                              int64_t row0, int rows, int tid) {
  using Rec = RecordLayout<Split>;
  __builtin_assume(tid >= 0 && tid < kPrepThreads);
  const int lane = tid & 31, warp = tid >> 5;
  const int H = p.H;

  // Load rows 2w, 2w+1, 2w+8, 2w+9, channels 4l..4l+3. Rows past the sequence end re-read the
  // last valid row and are zeroed below (k = q = 0, log-decay 0), so all loads issue at once.
  float r_q[4][4], r_k[4][4], r_a[4][4];
  const bool g_f32 = p.g_type == ElemType::kF32;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int t = row_of(warp, r);
    const int64_t idx = ((row0 + (t < rows ? t : rows - 1)) * H + h) * kHeadDim + 4 * lane;
    load4(p.q, idx, false, r_q[r]);
    load4(p.k, idx, false, r_k[r]);
    load4(p.g, idx, g_f32, r_a[r]);
  }
  if (tid < kChunk) {
    float b = 0.f;
    if (tid < rows) {
      b = load_elem(p.beta, (row0 + tid) * H + h, p.beta_type == ElemType::kF32);
      if (p.beta_is_logit) b = sigmoidf_(b);
    }
    sm.beta[tid] = b;
  }
  {
    const float a_exp = (p.gate == GateForm::kPrecomputed) ? 0.f : __expf(p.A_log[h]);
    float r_bias[4] = {0.f, 0.f, 0.f, 0.f};
    if (p.dt_bias != nullptr) load4(p.dt_bias, int64_t(h) * kHeadDim + 4 * lane, true, r_bias);
    // One branch on the gate form per thread, not per element (common/gate.h with PrepareMath).
    auto apply = [&](auto log_decay_of) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const bool valid = row_of(warp, r) < rows;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          r_a[r][e] = valid ? log_decay_of(r_a[r][e], r_bias[e]) : 0.f;
          if (!valid) r_q[r][e] = r_k[r][e] = 0.f;
        }
        *reinterpret_cast<float4*>(&sm.G[row_of(warp, r)][4 * lane]) =
            make_float4(r_a[r][0], r_a[r][1], r_a[r][2], r_a[r][3]);
      }
    };
    const float lb = p.lower_bound;
    if (p.gate == GateForm::kLowerBound) {
      apply([&](float g, float bias) { return gate::lower_bound<PrepareMath>(lb, a_exp, g + bias); });
    } else if (p.gate == GateForm::kSoftplus) {
      apply([&](float g, float bias) { return gate::softplus<PrepareMath>(a_exp, g + bias); });
    } else {
      apply([&](float g, float) { return g; });  // a precomputed log-decay: a = g, a dt_bias not added
    }
  }

  // L2 norms: each row's 128 channels live in one warp.
  float r_q_scale[4], r_k_scale[4], r_kk[4];  // r_kk: |k|^2 after the norm (transition skipping's bound)
  float ss[8];  // |q_r|^2 (0-3), |k_r|^2 (4-7): this lane's parts
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    ss[r] = ss[r + 4] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) ss[r] += r_q[r][e] * r_q[r][e], ss[r + 4] += r_k[r][e] * r_k[r][e];
  }
  if (p.l2norm_qk) {
    // The eight row sums by one reduce-scatter (warp_sum8_scatter: group_sum<32>'s butterfly, the
    // same operands in the same order, so the same sums; 21 shuffles instead of 40), then one
    // rsqrt a lane and the scales broadcast from the lanes that hold them: value v (q rows 0-3, k
    // rows 4-7) in lane 16 (v >> 2) + 8 ((v >> 1) & 1) + 4 (v & 1) (sum8_slot).
    const float s = warp_sum8_scatter(ss, lane);
    const float inv = rsqrtf(s + 1e-6f), scale = sum8_slot(lane) < 4 ? inv * p.scale : inv, kk = s * inv * inv;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      r_q_scale[r] = __shfl_sync(0xffffffffu, scale, 8 * (r >> 1) + 4 * (r & 1));
      r_k_scale[r] = __shfl_sync(0xffffffffu, scale, 16 + 8 * (r >> 1) + 4 * (r & 1));
      r_kk[r] = __shfl_sync(0xffffffffu, kk, 16 + 8 * (r >> 1) + 4 * (r & 1));
    }
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      r_q_scale[r] = p.scale, r_k_scale[r] = 1.f;
      r_kk[r] = p.chunk_bound != nullptr ? group_sum<32>(ss[r + 4]) : 0.f;
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) r_q[r][e] *= r_q_scale[r], r_k[r][e] *= r_k_scale[r];
  }
  Sync::sync();
  if (p.chunk_bound != nullptr) {
    // Transition skipping (config.h Params::chunk_bound): the norm of a token's transition
    // (I - b k k^T) diag(e^a) is at most max_c e^{a_c} max(1, |1 - b |k|^2|); this warp's rows'
    // logs, summed (rows past the end: a = k = 0, i.e. 0).
    float part = 0.f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float mx = fmaxf(fmaxf(r_a[r][0], r_a[r][1]), fmaxf(r_a[r][2], r_a[r][3]));
#pragma unroll
      for (int x = 16; x >= 1; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
      part += mx + __logf(fmaxf(1.f, fabsf(1.f - sm.beta[row_of(warp, r)] * r_kk[r])));
    }
    if (lane == 0) sm.bound[warp] = part;
  }

  // Column scan: thread c forms G[t][c] = a_0 + ... + a_t in place, writes exp(Gamma_c) and
  // flags a spread the factorised form cannot hold.
  bool wide = false;
  {
    const int c = tid;
    float run = 0.f;
#pragma unroll
    for (int t = 0; t < kChunk; ++t) run += sm.G[t][c], sm.G[t][c] = run;
    wide = sm.G[0][c] - run > kMaxFactorisedSpread;
    reinterpret_cast<float*>(g_rec + Rec::kOffGamma)[c] = exp_ftz(run);
    if (p.chunk_bound != nullptr && p.bound_transitions) {  // max_c G_C, this warp's channels
      float mx = run;
#pragma unroll
      for (int x = 16; x >= 1; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
      if (lane == 0) sm.gamma_max[warp] = mx;
    }
  }
  const bool pairwise = Sync::sync_or(wide);

  float r_G[4][4], r_G_first[4], r_Gamma[4];
  {
    const float4 f = *reinterpret_cast<const float4*>(&sm.G[0][4 * lane]);
    const float4 l = *reinterpret_cast<const float4*>(&sm.G[kChunk - 1][4 * lane]);
    r_G_first[0] = f.x, r_G_first[1] = f.y, r_G_first[2] = f.z, r_G_first[3] = f.w;
    r_Gamma[0] = l.x, r_Gamma[1] = l.y, r_Gamma[2] = l.z, r_Gamma[3] = l.w;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float4 v = *reinterpret_cast<const float4*>(&sm.G[row_of(warp, r)][4 * lane]);
      r_G[r][0] = v.x, r_G[r][1] = v.y, r_G[r][2] = v.z, r_G[r][3] = v.w;
    }
  }

  // q_decayed = q e^{G}, k_decayed = k e^{G}, k_restored = k e^{Gamma - G}: every factor <= 1.
  // Fast path: formed from the mid-shifted gemm operands, x e^{G-mid} e^{mid} etc.
  float r_q_decayed[4][4], r_k_decayed[4][4], r_k_restored[4][4];
  if (!pairwise) {
    float r_k_up[4][4], r_k_down[4][4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float mid = 0.5f * (r_G_first[e] + r_Gamma[e]);
      const float e_mid = exp_ftz(mid), e_gamma_mid = exp_ftz(r_Gamma[e] - mid);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float d = (r_G[r][e] - mid) * 1.4426950408889634f;  // exp_ftz's scaling; -d == (mid - G) * log2e
        const float up = ex2_ftz(d), down = ex2_ftz(-d);
        r_k_up[r][e] = r_k[r][e] * up;
        r_q[r][e] *= up;  // op_q
        r_k_down[r][e] = r_k[r][e] * down;
        r_q_decayed[r][e] = r_q[r][e] * e_mid;
        r_k_decayed[r][e] = r_k_up[r][e] * e_mid;
        r_k_restored[r][e] = r_k_down[r][e] * e_gamma_mid;
      }
    }
    store_tk_split<true>(sm.ops[0][0], sm.ops[0][1], r_k_up, warp, lane);
    store_tk_split<true>(sm.ops[1][0], sm.ops[1][1], r_q, warp, lane);
    store_tk_split(sm.ops[2][0], sm.ops[2][1], r_k_down, warp, lane);
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = row_of(warp, r);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float eg = exp_ftz(r_G[r][e]);
        r_q_decayed[r][e] = r_q[r][e] * eg;
        r_k_decayed[r][e] = r_k[r][e] * eg;
        r_k_restored[r][e] = r_k[r][e] * exp_ftz(r_Gamma[e] - r_G[r][e]);
      }
      *reinterpret_cast<float4*>(&sm.raw[0][t][4 * lane]) = make_float4(r_k[r][0], r_k[r][1], r_k[r][2], r_k[r][3]);
      *reinterpret_cast<float4*>(&sm.raw[1][t][4 * lane]) = make_float4(r_q[r][0], r_q[r][1], r_q[r][2], r_q[r][3]);
    }
  }
  if (p.chunk_bound != nullptr && p.bound_transitions) {
    // |k_decayed_t| and |k_restored_t| for the chunk's transition bound (chunk_log_bound below).
    float sq[8];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      sq[r] = sq[r + 4] = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sq[r] = fmaf(r_k_decayed[r][e], r_k_decayed[r][e], sq[r]),
        sq[r + 4] = fmaf(r_k_restored[r][e], r_k_restored[r][e], sq[r + 4]);
    }
    const float norm = sqrtf(warp_sum8_scatter(sq, lane));
    const int which = sum8_slot(lane);
    if ((lane & 3) == 0) (which < 4 ? sm.norm_kd : sm.norm_kr)[row_of(warp, which & 3)] = norm;
  }
  {
    const auto wo = [](int t, int c) { return Rec::wo_offset(0, t, c); };  // operand `which` adds 256 * which
    const auto kr_at = [](int t, int c) { return kr_offset(t, c); };
    uint8_t* const g_wo_tile = g_rec + Rec::kOffWo;
    // k_decayed and unsplit q_decayed: the bf16 roundings (the hi parts a split stores), or fp16.
    store_rounded<Split::f16>(g_wo_tile + Rec::wo_offset(0, 0, 0), r_k_decayed, warp, lane, wo);
    if constexpr (Split::q_decayed)
      store_split(g_wo_tile + Rec::wo_offset(1, 0, 0), g_wo_tile + Rec::wo_offset(2, 0, 0), r_q_decayed, warp, lane,
                  wo);
    else
      store_rounded<Split::f16>(g_wo_tile + Rec::wo_offset(1, 0, 0), r_q_decayed, warp, lane, wo);
    if constexpr (Split::factors)
      store_split(g_rec + Rec::kOffKRestored, g_rec + Rec::kOffKRestoredLo, r_k_restored, warp, lane, kr_at);
    else
      store_rounded(g_rec + Rec::kOffKRestored, r_k_restored, warp, lane, kr_at);
  }
  Sync::sync();

  const int g = lane >> 2, t4 = lane & 3;
  if (!pairwise) {
    // Warp 0: L = b_i (k e^{G-mid}) (k e^{mid-G})^T (i > j); warp 1: Mqk (i >= j), written as
    // this lane's own fragment unit. Warps 2 and 3 are done.
    if (warp >= 2) return;
    float acc[2][4];
    gemm_tk_split(sm.ops[warp], sm.ops[2], acc);
    if (warp == 1) {
      float m[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) m[nt][e] = (g + 8 * (e >> 1) >= 8 * nt + 2 * t4 + (e & 1)) ? acc[nt][e] : 0.f;
      const uint2 pa = split_pair(m[0][0], m[0][1]), pb = split_pair(m[1][0], m[1][1]);
      const uint2 pc = split_pair(m[0][2], m[0][3]), pd = split_pair(m[1][2], m[1][3]);
      reinterpret_cast<uint4*>(g_rec + Rec::kOffMqk)[lane] = make_uint4(pa.x, pb.x, pc.x, pd.x);
      if constexpr (Split::factors)
        reinterpret_cast<uint4*>(g_rec + Rec::kOffMqkLo)[lane] = make_uint4(pa.y, pb.y, pc.y, pd.y);
      return;
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = g + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
        sm.L[i][j] = i > j ? sm.beta[i] * acc[nt][e] : 0.f;
      }
    __syncwarp();
  } else {
    // Pairwise (a chunk spread beyond e^{2 * kMaxFactorisedShift}): sum_c x_i,c k_j,c e^{G_i,c - G_j,c}
    // with the exponent <= 0 for i >= j. Rare and slow; all 128 threads, 4 entries each.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e = tid + r * kPrepThreads, i = (e / kChunk) % kChunk, j = e % kChunk;
      float acc = 0.f;
      if (i >= j) {
        const float(*X)[kHeadDim] = r < 2 ? sm.raw[0] : sm.raw[1];
        for (int cc = 0; cc < kHeadDim; ++cc)
          acc += X[i][cc] * sm.raw[0][j][cc] * exp_ftz(sm.G[i][cc] - sm.G[j][cc]);
      }
      if (r < 2) sm.L[i][j] = i > j ? sm.beta[i] * acc : 0.f;
      else {
        const float hi = __bfloat162float(__float2bfloat16_rn(acc));
        store_bf16_at(sm.small[0], frag_index_small(i, j), hi);
        if constexpr (Split::factors) store_bf16_at(sm.small[1], frag_index_small(i, j), acc - hi);
      }
    }
    Sync::sync();
    if (warp >= 1) {
      if (warp == 1) {
        reinterpret_cast<uint4*>(g_rec + Rec::kOffMqk)[lane] = reinterpret_cast<const uint4*>(sm.small[0])[lane];
        if constexpr (Split::factors)
          reinterpret_cast<uint4*>(g_rec + Rec::kOffMqkLo)[lane] = reinterpret_cast<const uint4*>(sm.small[1])[lane];
      }
      return;
    }
  }

  // Warp 0: inv_b = (I + L)^-1 diag(b) by fp32 forward substitution (lane j owns column j): exact
  // for strictly lower-triangular L and stable for near-collinear keys, where the Neumann series
  // of (I + L)^-1 cancels catastrophically.
  float r_projection = 0.f;  // lane j: |k_decayed_j| sum_i |inv_b[i][j]| |k_restored_i| (chunk_log_bound)
  if (lane < kChunk) {
    const int j = lane;
    float r_x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float acc = (i == j) ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) acc -= sm.L[i][m] * r_x[m];
      r_x[i] = acc;
    }
    const float bj = sm.beta[j];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float val = r_x[i] * bj;
      const __nv_bfloat16 hb = __float2bfloat16_rn(val);
      const float hi = __bfloat162float(hb);
      *reinterpret_cast<__nv_bfloat16*>(sm.small[2] + frag_index_small(i, j)) = hb;
      if constexpr (Split::factors) store_bf16_at(sm.small[3], frag_index_small(i, j), val - hi);
    }
    if (p.chunk_bound != nullptr && p.bound_transitions) {
      float col = 0.f;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) col = fmaf(fabsf(r_x[i]), sm.norm_kr[i], col);
      r_projection = col * fabsf(bj) * sm.norm_kd[j];
    }
  }
  if (p.chunk_bound != nullptr) chunk_log_bound(p, sm, r_projection, slot, h, lane);
  __syncwarp();
  reinterpret_cast<uint4*>(g_rec + Rec::kOffInvB)[lane] = reinterpret_cast<const uint4*>(sm.small[2])[lane];
  if constexpr (Split::factors)
    reinterpret_cast<uint4*>(g_rec + Rec::kOffInvBLo)[lane] = reinterpret_cast<const uint4*>(sm.small[3])[lane];
}

}  // namespace flashkda::cuda::sm90::prefill
