// Prefill v2's producer (issue 11): one 32-token chunk of one head, by one warpgroup, into the
// operands the recurrence reads (layout.h ChunkOperands), with SPEC §4's names:
//
//   load       q, k, the raw gate and beta of the chunk's rows (rows past the end: zeros)
//   gate       the log-decay a of each (token, channel), in log2 units (a · log2 e)
//   normalise  the L2 norms of q and k rows (and q's scale)
//   scan       G_t = a_0 + ... + a_t down each channel; Gamma = G_31
//   factors    k_decayed = k e^G, q_decayed = q e^G, k_restored = k e^{Gamma - G}, and the operands
//              of L and Mqk, k e^{G - mid}, q e^{G - mid} and k e^{mid - G} (mid = Gamma / 2:
//              every factor within e^{±80} while the spread |Gamma| stays under 160)
//   l_mqk      [k e^{G-mid}; q e^{G-mid}] (k e^{mid-G})^T as one 64 x 32 wgmma over the 128
//              channels, tf32 operands (rounded to nearest even): L = b_i (row i < 32, i > j), Mqk (i >= j)
//   invert     inv_b = (I + L)^-1 diag(b) exactly, from the two 16 x 16 fp32 forward
//              substitutions and X21 = -X22 L21 X11
//
// Thread tile: warp w, lane l holds tokens 8w + 4(l / 16) + r (r = 0..3) and channels
// 8(l % 16) + e (e = 0..7): 16-byte loads and stores of 8 channels, a row's L2 norm over the 16
// lanes of a half-warp, the scan in registers, across the two halves and across the warps. A
// chunk whose spread does not fit (|Gamma_c| > 160 for some channel: softplus or precomputed gates)
// is flagged in ChunkOperands::kOffFlags; the pairwise path it needs is not built yet.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include "common/gate.h"
#include "cuda/common/async_copy.cuh"
#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/kda_math.cuh"
#include "cuda/common/math.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/sm90/prefill/config.h"
#include "cuda/sm90/prefill_v2/layout.h"
#include "cuda/sm90/prefill_v2/produce.h"

namespace flashkda::cuda::sm90::prefill_v2 {

using prefill::ElemType;

constexpr float kLog2e = 1.4426950408889634f;
// The largest factorised spread |Gamma| in log2 units (e^{±80} = 2^{±115.4}: inside fp32).
constexpr float kMaxSpreadLog2 = float(prefill::kMaxFactorisedSpread * 1.4426950408889634);

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// gate.h's elementary functions on the MUFU unit (the gates' argument in natural units; the
// callers scale lower_bound or a_scale by log2 e so that a comes out in log2 units).
struct ProduceMath {
  __device__ __forceinline__ static float exp(float x) { return ex2(x * kLog2e); }
  __device__ __forceinline__ static float quot(float a, float b) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
    return a * r;
  }
  __device__ __forceinline__ static float softplus(float x) { return fmaxf(x, 0.f) + __logf(1.f + exp(-fabsf(x))); }
};

// The producer's barriers: the whole CTA when it runs alone (produce.cu), its own warpgroup's
// named barrier inside a CTA shared with the recurrence (fused.cu).
struct CtaSync {
  __device__ __forceinline__ static void sync() { __syncthreads(); }
};
// Named barrier kId of kCount threads that also returns, to each of them, whether x was true in any.
template <int kId, int kCount>
__device__ __forceinline__ bool named_barrier_or(bool x) {
  int r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.s32 %0, 1, 0, q;\n}"
      : "=r"(r)
      : "r"(int(x)), "n"(kId), "n"(kCount)
      : "memory");
  return r != 0;
}
template <int kId>
struct WarpgroupSync {  // the 128 threads of one warpgroup, named barrier kId (0 is __syncthreads')
  __device__ __forceinline__ static void sync() { asm volatile("bar.sync %0, 128;" ::"n"(kId) : "memory"); }
};

// Timing only: produce_chunk calls mark(i) after its step i (fused.cu's phase clocks); by default
// nothing.
struct NoMarks {
  __device__ __forceinline__ void operator()(int) const {}
};
// produce_chunk's after_factors and l_mqk_product's in_flight by default: nothing.
struct NoAfter {
  __device__ __forceinline__ void operator()() const {}
};

// kTileRows tokens of 8 channels a thread (warp w, lane l: tokens 8w + 4(l / 16) + r, channels
// 8(l % 16) + e).
constexpr int kTileRows = 4;
struct ThreadTile {
  float x[kTileRows][8];  // [token r][channel e]
};

__device__ __forceinline__ int tile_token(int warp, int lane, int r) {
  return 2 * kTileRows * warp + kTileRows * (lane >> 4) + r;
}
__device__ __forceinline__ int tile_channel(int lane) { return 8 * (lane & 15); }

template <bool kF32>
__device__ __forceinline__ void load8(const void* base, int64_t idx, float (&x)[8]) {
  if constexpr (kF32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(base) + idx));
    const float4 b = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(base) + idx) + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(base) + idx));
    x[0] = bf16_lo(v.x), x[1] = bf16_hi(v.x), x[2] = bf16_lo(v.y), x[3] = bf16_hi(v.y);
    x[4] = bf16_lo(v.z), x[5] = bf16_hi(v.z), x[6] = bf16_lo(v.w), x[7] = bf16_hi(v.w);
  }
}

// Eight consecutive floats of shared memory (16-byte aligned) into x.
__device__ __forceinline__ void read8(const float* p, float (&x)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// The raw beta of token tid of chunk `chunk` as the bits loaded (threads 0-31; 0 past the end), a
// chunk ahead of its use: a bf16's 16 bits are widened to fp32 where the value is used
// (beta_from_bits), so that no instruction waits for the load before then. Loaded as a float, the
// widening shift came right after the load and held warp 0, the producer's chain, for a global
// load's whole latency at the top of every chunk (the phase clocks' "empty wait", ~1 200 cycles).
__device__ __forceinline__ uint32_t load_beta_bits(const ProduceArgs& p, int h, int64_t chunk, int tid) {
  const int64_t row0 = chunk * kChunk, i = (row0 + tid) * p.H + h;
  if (tid >= kChunk || row0 + tid >= p.T) return 0u;
  return p.beta_type == ElemType::kF32 ? static_cast<const uint32_t*>(p.beta)[i]
                                       : uint32_t(static_cast<const uint16_t*>(p.beta)[i]);
}
__device__ __forceinline__ float beta_from_bits(const ProduceArgs& p, uint32_t bits) {
  return __uint_as_float(p.beta_type == ElemType::kF32 ? bits : bits << 16);
}

// q, k and the raw gate (fp32 when kF32Gate, else bf16) of this thread's rows; rows past the
// chunk's end re-read the last valid row (all loads issue at once) and are zeroed by gate_chunk.
// beta (logistic where a logit) into sm_beta by the first 32 threads.
// beta_ahead: the raw beta's bits already loaded (load_beta_bits, a chunk ahead), else loaded here.
template <bool kF32Gate>
__device__ __forceinline__ void load_chunk(const ProduceArgs& p, int h, int64_t row0, int rows, int tid,
                                           ThreadTile& q, ThreadTile& k, ThreadTile& a, float* sm_beta,
                                           bool beta_ahead, uint32_t beta_bits) {
  const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int t = tile_token(warp, lane, r);
    const int64_t idx = ((row0 + (t < rows ? t : rows - 1)) * p.H + h) * kHeadDim + tile_channel(lane);
    load8<false>(p.q, idx, q.x[r]);
    load8<false>(p.k, idx, k.x[r]);
    load8<kF32Gate>(p.g, idx, a.x[r]);
  }
  if (tid < kChunk) {
    float b = 0.f;
    if (tid < rows) {
      b = beta_ahead ? beta_from_bits(p, beta_bits) : load_elem(p.beta, (row0 + tid) * p.H + h, p.beta_type == ElemType::kF32);
      if (p.beta_is_logit) b = sigmoidf_(b);
    }
    sm_beta[tid] = b;
  }
}

// ---- Inputs staged in shared memory ahead of their chunk (the fused kernel's producer) ----
// A later chunk's q, k and raw gate rows, copied by the TMA unit (a tensor copy each, issued by one
// thread, completing on an mbarrier) while chunk c is computed, so that no global-memory latency
// sits in the producer's chain and no thread holds an address for it. A buffer holds [32][128]
// bf16 q, then k, then the gate ([32][128] bf16 or fp32), rows in token order; rows past the
// chunk's end are zeros or another sequence's (below). (Run 80: one bulk copy a row, issued by a
// warp's lanes, cost the producer ~3 400 cycles a chunk in issue.)
// kStagedBufs: two buffers with bf16 gates (24 KB each; chunk c + 2's rows copied into chunk c's
// buffer once its factors have read it), one with fp32 gates (32 KB; chunk c + 1's, as before).
// With one buffer the copy had ~2 000 cycles from its issue (after the factors) to the next chunk's
// top, too few: run 152's ncu samples put ~2 200 of the producer's ~28 000 on the wait for it
// (~7% of its time, the "load" phase's ~600 cycles a chunk).
constexpr int kStagedQ = 0, kStagedK = kTileBytes, kStagedG = 2 * kTileBytes;
constexpr int kStagedBytes = 2 * kTileBytes + kChunk * kHeadDim * 4;  // 32 KB a buffer (fp32 gates)
template <bool kF32Gate>
constexpr int kStagedBufs = kF32Gate ? 1 : 2;
template <bool kF32Gate>
constexpr int kStagedBufBytes = kF32Gate ? kStagedBytes : 2 * kTileBytes + kChunk * kHeadDim * 2;
// The region holding either gate form's buffers.
constexpr int kStagedRegionBytes = kStagedBufs<false> * kStagedBufBytes<false> > kStagedBufs<true> * kStagedBufBytes<true>
                                       ? kStagedBufs<false> * kStagedBufBytes<false>
                                       : kStagedBufs<true> * kStagedBufBytes<true>;
// Byte offset in a staged buffer of the 16-byte granule of token t's 8 bf16 channels from c0 in
// part kStagedQ, kStagedK or (bf16 gates) kStagedG: what a producer thread reads of its rows, and
// all that it writes there (zero_staged_tail).
__device__ __forceinline__ constexpr int staged_offset(int part, int t, int c0) {
  return part + (t * kHeadDim + c0) * 2;
}

// The tensor maps of the inputs a fused kernel copies by TMA: [T, H, 128] as a 3-D tensor of
// boxes {128, 1, 32}, i.e. the 32 rows of one head and chunk (fused.cu builds them); v's boxes are
// {64, 1, 32} with the 128-byte swizzle, two a chunk (fused.cu staged_v).
struct ChunkRowMaps {
  CUtensorMap q, k, g, v;
};

// Issues (one thread) the copies of chunk `chunk`'s q, k and gate rows into buf, completing on
// bar (one arrival, this thread's, with the bytes to expect). The sequence starts at row token0
// of the maps; rows past the end of the maps arrive as zeros, rows past the sequence's end inside
// them as the next sequence's: gate_chunk and the row scales zero both by selection, and
// zero_staged_tail sets such q and k rows to zero in the buffer before the norms read them.
// Generic reads of buf must be ordered before this call (a barrier), which fences them against
// the copies' async-proxy writes.
template <bool kF32Gate>
__device__ __forceinline__ void issue_chunk_rows(const ChunkRowMaps& maps, int h, int64_t chunk, uint8_t* buf,
                                                 uint64_t* bar, int64_t token0 = 0) {
  fence_proxy_async_shared();
  mbarrier_arrive_expect_tx(bar, 2 * kTileBytes + kChunk * kHeadDim * (kF32Gate ? 4 : 2));
  const int row0 = int(token0 + chunk * kChunk);
  tensor_copy_3d(buf + kStagedQ, &maps.q, 0, h, row0, bar);
  tensor_copy_3d(buf + kStagedK, &maps.k, 0, h, row0, bar);
  tensor_copy_3d(buf + kStagedG, &maps.g, 0, h, row0, bar);
}

__device__ __forceinline__ void unpack_bf16x8(uint4 v, float (&x)[8]) {
  x[0] = bf16_lo(v.x), x[1] = bf16_hi(v.x), x[2] = bf16_lo(v.y), x[3] = bf16_hi(v.y);
  x[4] = bf16_lo(v.z), x[5] = bf16_hi(v.z), x[6] = bf16_lo(v.w), x[7] = bf16_hi(v.w);
}

// From a staged buffer (its copies complete): the raw gate of this thread's rows into a, and beta
// (from its bits, beta_bits). q and k stay in the buffer: qk_row_scales_staged and build_factors_staged read
// them where they are used, so the producer holds one tile of registers instead of three.
template <bool kF32Gate>
__device__ __forceinline__ void load_gate_staged(const ProduceArgs& p, int rows, int tid, const uint8_t* buf,
                                                 uint32_t beta_bits, ThreadTile& a, float* sm_beta) {
  const int warp = tid >> 5, lane = tid & 31, c0 = tile_channel(lane);
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    const int t = tile_token(warp, lane, r);
    if constexpr (kF32Gate) {
      read8(reinterpret_cast<const float*>(buf + kStagedG + (t * kHeadDim + c0) * 4), a.x[r]);
    } else {
      unpack_bf16x8(*reinterpret_cast<const uint4*>(buf + staged_offset(kStagedG, t, c0)), a.x[r]);
    }
  }
  if (tid < kChunk) {
    const float beta_raw = beta_from_bits(p, beta_bits);
    sm_beta[tid] = tid >= rows ? 0.f : p.beta_is_logit ? sigmoidf_(beta_raw) : beta_raw;
  }
}

// The head's gate constants, read by gate_chunk from global memory or, in a kernel that walks many
// chunks of one head, once into shared memory (sm_gate; followed by a barrier before use): for the
// lower-bound gate its one fma's operands (LowerBoundConsts: [128] dt_bias · c, then c, lb2), for
// softplus [128] dt_bias (0 where absent), then e^{A_log[h]}.
struct LowerBoundConsts {
  float c, lb2;  // -e^{A_log[h]} log2 e and lower_bound log2 e
};
__device__ __forceinline__ LowerBoundConsts lower_bound_consts(const ProduceArgs& p, int h) {
  return {-(__expf(p.A_log[h]) * kLog2e), p.lower_bound * kLog2e};
}
template <GateForm kGate>
__device__ __forceinline__ void load_gate_consts(const ProduceArgs& p, int h, int tid, float* sm_gate) {
  const float bias = kGate != GateForm::kPrecomputed && p.dt_bias != nullptr ? p.dt_bias[int64_t(h) * kHeadDim + tid] : 0.f;
  if constexpr (kGate == GateForm::kLowerBound) {
    const LowerBoundConsts k = lower_bound_consts(p, h);
    sm_gate[tid] = bias * k.c;
    if (tid == 0) sm_gate[kHeadDim] = k.c, sm_gate[kHeadDim + 1] = k.lb2;
  } else if constexpr (kGate != GateForm::kPrecomputed) {
    sm_gate[tid] = bias;
    if (tid == 0) sm_gate[kHeadDim] = __expf(p.A_log[h]);
  }
}

// kFull: the caller knows the chunk is full (rows == kChunk), so no tail branch ends the gate's block
// (gate_and_row_scales).
template <GateForm kGate, bool kFull = false>
__device__ __forceinline__ void gate_chunk(const ProduceArgs& p, int h, int rows, int tid, ThreadTile& a,
                                           const float* sm_gate) {
  const int warp = tid >> 5, lane = tid & 31;
  if constexpr (kGate == GateForm::kLowerBound) {
    // gate.h's lower_bound, lb2 / (1 + e^{-a_scale (g + bias)}), with its exponent in log2 units
    // as one fma a channel, g (-a_scale log2 e) + bias (-a_scale log2 e), where gate.h's form takes
    // an add and two multiplies (a fused kernel's chain: 64 instructions a thread and chunk fewer);
    // bias (-a_scale log2 e), -a_scale log2 e and lb2 from load_gate_consts where the kernel walks
    // many chunks of the head (recomputed every chunk, they cost the producer ~11 instructions a warp).
    float bc[8], c, lb2;
    if (sm_gate != nullptr) {
      read8(sm_gate + tile_channel(lane), bc);
      const float2 cl = *reinterpret_cast<const float2*>(sm_gate + kHeadDim);
      c = cl.x, lb2 = cl.y;
    } else {
      float bias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (p.dt_bias != nullptr) load8<true>(p.dt_bias, int64_t(h) * kHeadDim + tile_channel(lane), bias);
      const LowerBoundConsts kc = lower_bound_consts(p, h);
      c = kc.c, lb2 = kc.lb2;
#pragma unroll
      for (int e = 0; e < 8; ++e) bc[e] = bias[e] * c;
    }
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) a.x[r][e] = ProduceMath::quot(lb2, 1.f + ex2(fmaf(a.x[r][e], c, bc[e])));
  } else {
    float bias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float a_scale = 0.f;
    if constexpr (kGate != GateForm::kPrecomputed) {
      if (sm_gate != nullptr) {
        read8(sm_gate + tile_channel(lane), bias);
        a_scale = sm_gate[kHeadDim];
      } else {
        if (p.dt_bias != nullptr) load8<true>(p.dt_bias, int64_t(h) * kHeadDim + tile_channel(lane), bias);
        a_scale = __expf(p.A_log[h]);
      }
    }
    const float a_scale2 = a_scale * kLog2e;
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float x = a.x[r][e] + bias[e];
        if constexpr (kGate == GateForm::kSoftplus) a.x[r][e] = gate::softplus<ProduceMath>(a_scale2, x);
        else a.x[r][e] = x * kLog2e;
      }
  }
  if (!kFull && rows < kChunk) {  // uniform: the last chunk of a sequence whose length is not a multiple of 32
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
      if (tile_token(warp, lane, r) >= rows) {
#pragma unroll
        for (int e = 0; e < 8; ++e) a.x[r][e] = 0.f;
      }
  }
}

// The row scales of q and k: sq[r] = scale / |q_r| and sq[r + 4] = 1 / |k_r| for this thread's
// four tokens (l2norm_qk; else scale and 1), 0 past the end (>= rows). s: the eight row sums of
// squares of this thread's part of the rows; the sums over the 16 lanes of the half-warp by
// reduce-scatter: each lane ends with one row's sum, takes its rsqrt, and the eight scales come
// back by shuffles.
// kFullL2: the caller knows l2norm_qk is set and the chunk is full (gate_and_row_scales): no branch.
template <bool kFullL2 = false>
__device__ __forceinline__ void qk_row_scales(const ProduceArgs& p, int tid, int rows, const float (&s)[8], float (&sq)[8]) {
  const int lane = tid & 31;
  if (kFullL2 || p.l2norm_qk) {
    const bool b3 = lane & 8, b2 = lane & 4, b1 = lane & 2;
    float s4[4], s2[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) s4[i] = (b3 ? s[i + 4] : s[i]) + __shfl_xor_sync(0xffffffffu, b3 ? s[i] : s[i + 4], 8);
#pragma unroll
    for (int i = 0; i < 2; ++i) s2[i] = (b2 ? s4[i + 2] : s4[i]) + __shfl_xor_sync(0xffffffffu, b2 ? s4[i] : s4[i + 2], 4);
    float s1 = (b1 ? s2[1] : s2[0]) + __shfl_xor_sync(0xffffffffu, b1 ? s2[0] : s2[1], 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    // This lane holds row sum slot 4 b3 + 2 b2 + b1 (0-3: q rows, 4-7: k rows).
    const float inv = rsqrtf(s1 + 1e-6f) * (b3 ? 1.f : p.scale);
#pragma unroll
    for (int slot = 0; slot < 8; ++slot)
      sq[slot] = __shfl_sync(0xffffffffu, inv, ((slot >> 2) << 3) + (((slot >> 1) & 1) << 2) + ((slot & 1) << 1), 16);
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) sq[r] = p.scale, sq[r + 4] = 1.f;
  }
  if (!kFullL2 && rows < kChunk) {  // uniform, as in gate_chunk
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (tile_token(tid >> 5, lane, r) >= rows) sq[r] = sq[r + 4] = 0.f;
  }
}

// q <- scale q / |q|, k <- k / |k| per row (l2norm_qk), else q <- scale q; rows past the end
// (>= rows) <- 0.
__device__ __forceinline__ void normalise_qk(const ProduceArgs& p, int tid, int rows, ThreadTile& q, ThreadTile& k) {
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, sq[8];
  if (p.l2norm_qk) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) s[r] = fmaf(q.x[r][e], q.x[r][e], s[r]), s[r + 4] = fmaf(k.x[r][e], k.x[r][e], s[r + 4]);
  }
  qk_row_scales(p, tid, rows, s, sq);
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int e = 0; e < 8; ++e) q.x[r][e] *= sq[r], k.x[r][e] *= sq[r + 4];
}

// fn(r, t, q, k) for each of this thread's four tokens t (r = 0..3) with its q and k (channels
// tile_channel(lane) .. + 7) read from a staged buffer, row r + kAhead's granules read before
// fn(r) runs. fn's own shared stores would otherwise come before the next row's loads, which then
// queue behind them (no compiler moves a shared load above a shared store it cannot prove apart):
// run 152's ncu samples (H100) put ~1 500 of the producer's ~28 000 stall samples on the factors'
// unpacking of rows read one by one after the previous row's six STS.128. Each row ahead holds
// eight more registers (four more rows, as the row scales read them, would spill in the factors).
template <int kAhead, class Fn>
__device__ __forceinline__ void for_staged_rows(const uint8_t* buf, int tid, Fn&& fn) {
  const int warp = tid >> 5, lane = tid & 31, c0 = tile_channel(lane);
  uint4 rq[kTileRows], rk[kTileRows];
  const auto read = [&](int r) {
    const int t = tile_token(warp, lane, r);
    rq[r] = *reinterpret_cast<const uint4*>(buf + staged_offset(kStagedQ, t, c0));
    rk[r] = *reinterpret_cast<const uint4*>(buf + staged_offset(kStagedK, t, c0));
  };
#pragma unroll
  for (int r = 0; r < kAhead; ++r) read(r);
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    if (r + kAhead < kTileRows) read(r + kAhead);
    float q[8], k[8];
    unpack_bf16x8(rq[r], q);
    unpack_bf16x8(rk[r], k);
    fn(r, tile_token(warp, lane, r), q, k);
  }
}

// The staged form (inputs in shared memory, read where they are used): this thread's row scales
// from the buffer's q and k rows, the same sums in the same order as normalise_qk's.
template <bool kFullL2 = false>
__device__ __forceinline__ void qk_row_scales_staged(const ProduceArgs& p, int tid, int rows, const uint8_t* buf,
                                                     float (&sq)[8]) {
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (kFullL2 || p.l2norm_qk)
    for_staged_rows<kTileRows>(buf, tid, [&](int r, int, const float (&q)[8], const float (&k)[8]) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s[r] = fmaf(q[e], q[e], s[r]), s[r + 4] = fmaf(k[e], k[e], s[r + 4]);
    });
  qk_row_scales<kFullL2>(p, tid, rows, s, sq);
}

// The staged form's gate and row scales of a full chunk with l2norm_qk (every chunk of the fused
// kernel's calls but a sequence's last partial one): the same instructions as gate_chunk followed by
// qk_row_scales_staged, but in one branch-free block, so that ptxas can interleave the row scales'
// loads, sums, shuffle reductions and rsqrt (a latency-bound chain: ~900 cycles a chunk as its own
// phase, runs 148-151) with the gate's 64 exponentials and reciprocals a thread (MUFU-bound, ~900).
// In the general form the tail branches and the l2norm_qk test between the two keep them apart. The
// same values in the same order: the same bits.
template <GateForm kGate>
__device__ __forceinline__ void gate_and_row_scales(const ProduceArgs& p, int h, int tid, ThreadTile& a,
                                                    const float* sm_gate, const uint8_t* buf, float (&sq)[8]) {
  qk_row_scales_staged<true>(p, tid, kChunk, buf, sq);
  gate_chunk<kGate, true>(p, h, kChunk, tid, a, sm_gate);
}

// The end of the log-decay scan: gamma <- G_31 of this thread's channels (`last`, the last group's
// prefix), and whether some channel of the chunk spreads beyond the factorised form (a NaN gate takes
// the flag too). Every warp holds every channel's G_31, the same sums of the same totals in the same
// order (lanes l and l + 16 the same eight channels), so one warp's vote is the chunk's: all 128
// threads agree without the warpgroup barrier-or that cost a barrier a chunk (run 152: ~500 of the
// producer's ~28 000 stall samples on it, and the barrier split the scan's tail from the factors in
// the schedule). After the scan the warps next meet at the factors' barrier, which also keeps a fast
// warp's next chunk from overwriting the totals that a slow one still reads.
__device__ __forceinline__ bool scan_gamma(const float (&last)[8], float (&gamma)[8]) {
  bool wide = false;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    gamma[e] = last[e];
    wide |= !(gamma[e] >= -kMaxSpreadLog2);
  }
  return __any_sync(0xffffffffu, wide);
}

// The inclusive prefix sums G down each channel, in two parts: a <- the sums over this thread's
// half-warp's rows up to each of its tokens, and offset <- what G adds to them (the rows of the
// half-warps and warps before: G = a + offset), which build_factors folds into its one subtraction
// of mid (FactorScales) instead of 32 additions a thread here; gamma <- G_31 of this thread's
// channels. Returns whether some channel of the chunk spreads beyond the factorised form (all
// threads agree). sm_totals: [4 warps][128] scratch, read after the scan's one barrier; the caller's
// next barrier must come before the next scan's writes there (produce_chunk: the factors').
template <class Sync>
__device__ __forceinline__ bool scan_log_decay(int tid, ThreadTile& a, float (&offset)[8], float (&gamma)[8],
                                               float* sm_totals) {
  const int warp = tid >> 5, lane = tid & 31, c0 = tile_channel(lane);
#pragma unroll
  for (int r = 1; r < 4; ++r)
#pragma unroll
    for (int e = 0; e < 8; ++e) a.x[r][e] += a.x[r - 1][e];
  const bool upper = lane & 16;
  float below[8];  // the lower half-warp's total (upper lanes), else 0
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float x = __shfl_xor_sync(0xffffffffu, a.x[3][e], 16);
    below[e] = upper ? x : 0.f;
  }
  if (upper) {  // the warp's totals
    float4* dst = reinterpret_cast<float4*>(sm_totals + warp * kHeadDim + c0);
    dst[0] = make_float4(a.x[3][0] + below[0], a.x[3][1] + below[1], a.x[3][2] + below[2], a.x[3][3] + below[3]);
    dst[1] = make_float4(a.x[3][4] + below[4], a.x[3][5] + below[5], a.x[3][6] + below[6], a.x[3][7] + below[7]);
  }
  Sync::sync();
  // Prefix sums of the four warps' totals; this warp adds those before it (warp-uniform choice).
  float prefix[4][8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4* src = reinterpret_cast<const float4*>(sm_totals + w * kHeadDim + c0);
    const float4 x0 = src[0], x1 = src[1];
    const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) prefix[w][e] = w == 0 ? x[e] : prefix[w - 1][e] + x[e];
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float before = warp == 0 ? 0.f : warp == 1 ? prefix[0][e] : warp == 2 ? prefix[1][e] : prefix[2][e];
    offset[e] = below[e] + before;
  }
  return scan_gamma(prefix[3], gamma);
}

// Element (r, 8c'..8c'+7) of a rows x 128 SW128 tile: one 16-byte store.
__device__ __forceinline__ void store_granule(uint8_t* tile, int rows, int r, int c, uint4 v) {
  *reinterpret_cast<uint4*>(tile + sw128_offset(rows, r, c)) = v;
}
template <bool kF16>
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  return make_uint4(pack_x2<kF16>(x[0], x[1]), pack_x2<kF16>(x[2], x[3]), pack_x2<kF16>(x[4], x[5]),
                    pack_x2<kF16>(x[6], x[7]));
}
// x = hi + lo (bf16, hi truncated: mma.cuh split_bf16x2_trunc) into two tiles.
__device__ __forceinline__ void store_split(uint8_t* hi_tile, uint8_t* lo_tile, int rows, int r, int c,
                                            const float (&x)[8]) {
  uint32_t hi[4], lo[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) split_bf16x2_trunc(x[2 * i], x[2 * i + 1], hi[i], lo[i]);
  store_granule(hi_tile, rows, r, c, make_uint4(hi[0], hi[1], hi[2], hi[3]));
  store_granule(lo_tile, rows, r, c, make_uint4(lo[0], lo[1], lo[2], lo[3]));
}

// x rounded to tf32 into a rows x 128 fp32 SW128 tile (sw128_offset_f32): two 16-byte granules.
// Rounded to nearest (ties away) by adding half a tf32 ulp to the word (one IADD), the low 13 bits
// left for the tensor core, which reads only the top 19 bits of a tf32 operand (CUTLASS's
// round_half_ulp_truncate makes the same assumption; `Produce32Gpu.Tf32OperandsIgnoreTheLow13Bits`
// checks it on the GPU, bit for bit, through this product). The LOP3 that cleared them cost a
// producer warp 96 instructions a chunk. cvt.rn.tf32.f32 (F2FP.TF32.F32.PACK_B) runs on the
// conversion pipe at the exponentials' rate, and its 96 a thread and chunk (three operands of 32
// elements) queued there with the exponentials and the fp16/bf16 packs (run 110's candidate moved
// the factors' reads and stores and left their cycles as they were). The add turns the canonical
// NaN 0x7fffffff into 0x80000fff, read as -0 (and a word from 0x7ffff000 up, the same; a negative
// NaN from 0xfffff000 up wraps to +0): every operand here is a product whose NaN k_decayed, q_decayed
// or k_restored carry too (the same product times e^mid, finite in a chunk that is not flagged wide),
// so a NaN input still reaches the output. inf stays inf (0x7f801000 reads as 0x7f800000).
// Column order: a thread's eight channels c..c+7 are one k-group of 8 of the product, two granules.
// In a 32-channel block's row the lanes of a quarter-warp (one token) would write granules 0, 2, 4, 6
// of two blocks at once (lanes l and l + 4: the same granule positions, 128·rows bytes apart), a
// 2-way bank conflict on each of a row's six STS.128. The lanes of odd blocks write their two
// granules in swapped places instead (channels c..c+3 in the columns of c+4..c+7 and back), so that a
// quarter-warp covers all eight positions. Only the producer's L / Mqk product reads these tiles, and
// A (op_k, op_q) and B (op_d) are permuted alike, so the product sums the same channel pairs; only
// their order inside a k-group of 8 moves.
__device__ __forceinline__ uint32_t tf32_rna_word(float x) { return __float_as_uint(x) + 0x1000u; }
__device__ __forceinline__ void store_tf32(uint8_t* tile, int rows, int r, int c, const float (&x)[8]) {
  const int swap = (c >> 5) & 1;  // an odd 32-channel block
#pragma unroll
  for (int h = 0; h < 2; ++h)
    *reinterpret_cast<uint4*>(tile + sw128_offset_f32(rows, r, c + 4 * (h ^ swap))) =
        make_uint4(tf32_rna_word(x[4 * h]), tf32_rna_word(x[4 * h + 1]), tf32_rna_word(x[4 * h + 2]),
                   tf32_rna_word(x[4 * h + 3]));
}

// The decayed and restored keys, q_decayed and the tf32 operands of L and Mqk, into their tiles
// (rec: the chunk's ChunkOperands; scratch: ProduceScratch). G (scan_log_decay's a: the log-decay
// prefix less its offset), offset and gamma in log2 units. factor_row: token t's eight channels
// from c0 (q, k normalised); build_factors: this thread's four tokens.
struct FactorScales {
  float shift[8], e_mid[8];  // mid - offset (mid = Gamma / 2; scan_log_decay's offset) and e^{mid}
  __device__ __forceinline__ FactorScales(const float (&offset)[8], const float (&gamma)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float mid = 0.5f * gamma[e];
      shift[e] = mid - offset[e], e_mid[e] = ex2(mid);
    }
  }
};

__device__ __forceinline__ void factor_row(int t, int c0, const float (&q)[8], const float (&k)[8], const float (&G)[8],
                                           const FactorScales& f, uint8_t* rec, uint8_t* scratch) {
  uint8_t* const a = scratch + ProduceScratch::kOffA;
  uint8_t* const b = scratch + ProduceScratch::kOffB;
  float op_k[8], op_q[8], op_d[8], kd[8], qd[8], kr[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float up = ex2(G[e] - f.shift[e]), down = ex2(f.shift[e] - G[e]);  // e^{±(G - mid)}
    op_k[e] = k[e] * up, op_q[e] = q[e] * up, op_d[e] = k[e] * down;
    kd[e] = op_k[e] * f.e_mid[e], qd[e] = op_q[e] * f.e_mid[e], kr[e] = op_d[e] * f.e_mid[e];
  }
  store_granule(rec + ChunkOperands::kOffKDecayed, kChunk, t, c0, pack8<true>(kd));
  store_granule(rec + ChunkOperands::kOffQDecayed, kChunk, t, c0, pack8<true>(qd));
  store_split(rec + ChunkOperands::kOffKRestored, rec + ChunkOperands::kOffKRestoredLo, kChunk, t, c0, kr);
  store_tf32(a, 2 * kChunk, t, c0, op_k);
  store_tf32(a, 2 * kChunk, kChunk + t, c0, op_q);
  store_tf32(b, kChunk, t, c0, op_d);
}

__device__ __forceinline__ void build_factors(int tid, const ThreadTile& q, const ThreadTile& k, const ThreadTile& G,
                                              const float (&offset)[8], const float (&gamma)[8], uint8_t* rec,
                                              uint8_t* scratch) {
  const int warp = tid >> 5, lane = tid & 31, c0 = tile_channel(lane);
  const FactorScales f(offset, gamma);
#pragma unroll
  for (int r = 0; r < 4; ++r) factor_row(tile_token(warp, lane, r), c0, q.x[r], k.x[r], G.x[r], f, rec, scratch);
}

// The staged form's last chunk of a sequence whose length is not a multiple of 32: this thread's
// rows past the end (>= rows) of the buffer's q and k set to zero in place, since the buffer may
// hold another sequence's rows there, non-finite ones included (a zero row scale would keep a NaN).
// Each thread zeroes the granules that it alone reads (staged_offset, as for_staged_rows reads
// them), so no barrier; the fence after the factors orders these generic stores before the next
// copy into the buffer. Zeroing the rows here rather than selecting in build_factors_staged keeps
// 64 selects a thread out of every chunk's factors.
__device__ __forceinline__ void zero_staged_tail(int tid, int rows, uint8_t* buf) {
  const int warp = tid >> 5, lane = tid & 31, c0 = tile_channel(lane);
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    const int t = tile_token(warp, lane, r);
    if (t >= rows) {
      *reinterpret_cast<uint4*>(buf + staged_offset(kStagedQ, t, c0)) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(buf + staged_offset(kStagedK, t, c0)) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The factors read a row ahead (run 155, H100: 0.4% faster than two rows, DESIGN.md).
constexpr int kFactorRowsAhead = 1;
// The staged form: q and k read from the buffer row by row and scaled (sq: qk_row_scales_staged)
// as normalise_qk would have scaled them (rows past the end: zero_staged_tail's zeros).
// sq: the q rows' scales, then the k rows'.
__device__ __forceinline__ void build_factors_staged(int tid, const uint8_t* buf, const float (&sq)[2 * kTileRows],
                                                     const ThreadTile& G, const float (&offset)[8],
                                                     const float (&gamma)[8], uint8_t* rec, uint8_t* scratch) {
  const FactorScales f(offset, gamma);
  for_staged_rows<kFactorRowsAhead>(buf, tid, [&](int r, int t, float (&q)[8], float (&k)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] *= sq[r], k[e] *= sq[r + kTileRows];
    factor_row(t, tile_channel(tid & 31), q, k, G.x[r], f, rec, scratch);
  });
}

// The record's e^{Gamma_c} (threads 0-15, eight channels each: their scan's gamma) and its flags word
// (thread 0: the chunk's spread too wide for the factorised form).
__device__ __forceinline__ void store_gamma_flags(int tid, const float (&gamma)[8], bool wide, uint8_t* rec) {
  if (tid < 16) {
    float4* dst = reinterpret_cast<float4*>(rec + ChunkOperands::kOffGamma) + 2 * tid;
    dst[0] = make_float4(ex2(gamma[0]), ex2(gamma[1]), ex2(gamma[2]), ex2(gamma[3]));
    dst[1] = make_float4(ex2(gamma[4]), ex2(gamma[5]), ex2(gamma[6]), ex2(gamma[7]));
  }
  if (tid == 0) *reinterpret_cast<int4*>(rec + ChunkOperands::kOffFlags) = make_int4(wide ? 1 : 0, 0, 0, 0);
}

// K-major SW128 descriptor (layout type 1; SBO = 1024 B between 8-row groups, LBO unused).
__device__ __forceinline__ uint64_t sw128_desc(const void* p) {
  const uint32_t a = smem_addr(p);
  return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

using WgmmaLMqk = cute::SM90::GMMA::MMA_64x32x8_F32TF32TF32_SS_TN<>;

__device__ __forceinline__ void wgmma_l_mqk(uint64_t da, uint64_t db, float (&d)[16], bool accumulate) {
  WgmmaLMqk::fma(da, db, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13], d[14],
                 d[15], accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// d = [k e^{G-mid}; q e^{G-mid}] (k e^{mid-G})^T, rows 0-31 the keys', 32-63 the queries'; warp w
// holds rows 16w + g (+8), columns 8n + 2t (+1) (docs/notes/wgmma.md d). tf32 operands, 16 k-steps
// of 8 channels (32 bytes: four a 128-byte block of 32 channels), one product each (the bf16 split
// before took three a 16-channel step: docs/DESIGN.md "Prefill v2", the tf32 L and Mqk). The
// operand stores must be fenced to the async proxy and behind a barrier. in_flight() runs while the
// products are in flight (produce_chunk's after_factors: the fused kernel's refill of its staged
// inputs, ~36 instructions of warp 1 that the warpgroup's first wgmma otherwise waited for).
template <class InFlight = NoAfter>
__device__ __forceinline__ void l_mqk_product(const uint8_t* scratch, float (&d)[16],
                                              const InFlight& in_flight = InFlight{}) {
#pragma unroll
  for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(d[i]);
  cute::warpgroup_arrive();
  // The k-steps' descriptors: the tiles' own plus the step's byte offset / 16 (no carry out of
  // the address field: shared addresses stay under 2^18).
  const uint64_t da = sw128_desc(scratch + ProduceScratch::kOffA), db = sw128_desc(scratch + ProduceScratch::kOffB);
#pragma unroll
  for (int s = 0; s < kHeadDim / 8; ++s) {
    const int oa = ((s / 4) * 2 * kChunk * 128 + (s % 4) * 32) >> 4, ob = ((s / 4) * kChunk * 128 + (s % 4) * 32) >> 4;
    wgmma_l_mqk(da + oa, db + ob, d, s > 0);
  }
  cute::warpgroup_commit_batch();
  in_flight();
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(d[i]);
}

__device__ __forceinline__ void store_bf16(uint8_t* base, int offset, float x) {
  *reinterpret_cast<__nv_bfloat16*>(base + offset) = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void store_split_scalar(uint8_t* hi_tile, uint8_t* lo_tile, int offset, float x) {
  const float hi = __bfloat162float(__float2bfloat16_rn(x));
  store_bf16(hi_tile, offset, hi);
  store_bf16(lo_tile, offset, x - hi);
}

// Warps 0, 1: L = b_i d (i > j) into sm_L (fp32); warps 2, 3: Mqk = d (i >= j), split, into the
// record. Followed by a barrier before sm_L is read. kOdd = warp & 1 (rows 16-31) as a compile-time
// constant, so that the blocks whose mask is the same in every lane need no compare, and the
// warp-uniform choice outside the unrolled loop (inside it, each step paid a branch and reloaded
// beta: ~40 instructions a warp and chunk).
template <int kOdd>
__device__ __forceinline__ void store_l_mqk_rows(int warp, int g, int t4, const float (&d)[16], const float* sm_beta,
                                                 float* sm_L, uint8_t* rec) {
  if (warp < 2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = 16 * kOdd + g + 8 * half;
      const float b = sm_beta[i];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int j = 8 * n + 2 * t4;
        const float x0 = d[4 * n + 2 * half], x1 = d[4 * n + 2 * half + 1];
        *reinterpret_cast<float2*>(sm_L + i * ProduceScratch::kLStride + j) =
            make_float2(i > j ? b * x0 : 0.f, i > j + 1 ? b * x1 : 0.f);
      }
    }
  } else {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = 16 * kOdd + g + 8 * half, j = 8 * n + 2 * t4;
        const float x0 = d[4 * n + 2 * half], x1 = d[4 * n + 2 * half + 1];
        uint32_t hi, lo;
        split_bf16x2(i >= j ? x0 : 0.f, i >= j + 1 ? x1 : 0.f, hi, lo);
        *reinterpret_cast<uint32_t*>(rec + ChunkOperands::kOffMqk + sw64_offset(i, j)) = hi;
        *reinterpret_cast<uint32_t*>(rec + ChunkOperands::kOffMqkLo + sw64_offset(i, j)) = lo;
      }
  }
}
__device__ __forceinline__ void store_l_mqk(int tid, const float (&d)[16], const float* sm_beta, float* sm_L,
                                            uint8_t* rec) {
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  if (warp & 1) store_l_mqk_rows<1>(warp, g, t4, d, sm_beta, sm_L, rec);
  else store_l_mqk_rows<0>(warp, g, t4, d, sm_beta, sm_L, rec);
}

// sum_m row[m] x[m] over 16 entries, in order; row 16-byte aligned (read four at a time).
__device__ __forceinline__ float dot16(const float* row, const float (&x)[16]) {
  const float4* r4 = reinterpret_cast<const float4*>(row);
  float acc = 0.f;
#pragma unroll
  for (int m4 = 0; m4 < 4; ++m4) {
    const float4 l = r4[m4];
    acc = fmaf(l.x, x[4 * m4], acc), acc = fmaf(l.y, x[4 * m4 + 1], acc);
    acc = fmaf(l.z, x[4 * m4 + 2], acc), acc = fmaf(l.w, x[4 * m4 + 3], acc);
  }
  return acc;
}

// inv_b = X diag(b), X = (I + L)^-1, as a split SW64 pair (inv_hi, inv_lo: the record's, or a
// the consumers' own), by the 128 threads of one warpgroup or the 256 of both consumer warpgroups
// (kThreadsInv). invert_zero_upper: thread u
// (0..63) zeroes one granule of the upper-right block X12 = 0 (rows 0-15, columns 16-31: granules 2
// and 3 of each row, wherever the swizzle puts them; nothing else writes there).
// invert_warpgroup: warp 0's lanes 0-15 take column j = lane of X11 = (I + L11)^-1, lanes 16-31
// column j = lane - 16 of X22 = (I + L22)^-1, both by fp32 forward substitution (exact for unit
// lower-triangular matrices, stable for near-collinear keys), into sm_X; then every thread u (column
// j = u % 16, 256 / kThreadsInv rows from that times u / 16) forms its rows of T = L21 X11 and,
// after a barrier, of X21 = -X22 T, and stores its rows of X11, X22 and X21 times b_j. The substitutions
// are a fifth of the work (run 87: ~555 of ~2 950 cycles a chunk on one warp); the products and
// the stores spread over the warpgroup. Each entry is the same fma chain in the same order as when
// one warp did it all, so the bits are unchanged. sm_L: fp32 L [32][kLStride] (b_i L, strictly
// lower), sm_beta: [32], sm_X: ProduceScratch::kInvScratchBytes (X11, X22, T: [16][kX22Stride]).
// sync(): the warpgroup's barrier; the caller fences and synchronises after it.
__device__ __forceinline__ void invert_zero_upper(int u, uint8_t* inv_hi, uint8_t* inv_lo) {
  const int tile = u >> 5, i = (u >> 1) & 15, gcol = 2 + (u & 1);
  *reinterpret_cast<uint4*>((tile ? inv_lo : inv_hi) + sw64_offset(i, 8 * gcol)) = make_uint4(0, 0, 0, 0);
}

// Column j of (I + L_d)^-1 for a 16 x 16 diagonal block L_d of the fp32 L (row stride kLStride) by
// forward substitution into x (invert_warpgroup's warp 0).
// Rows are read four entries at a time (kLStride keeps them 16-byte aligned).
__device__ __forceinline__ void forward_substitute(const float* L, int j, float (&x)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float acc = (i == j) ? 1.f : 0.f;
#pragma unroll
    for (int m4 = 0; m4 < i; m4 += 4) {
      const float4 l = *reinterpret_cast<const float4*>(L + i * ProduceScratch::kLStride + m4);
      const float lv[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (m4 + u < i) acc = fmaf(-lv[u], x[m4 + u], acc);
    }
    x[i] = acc;
  }
}

// kThreadsInv: 128 (one warpgroup, two rows a thread) or 256 (both consumer warpgroups, one row).
template <int kThreadsInv = 128, class SyncFn, class Mark = NoMarks>
__device__ __forceinline__ void invert_warpgroup(int tid, const float* sm_L, const float* sm_beta, float* sm_X,
                                                 uint8_t* inv_hi, uint8_t* inv_lo, bool zero_upper,
                                                 const SyncFn& sync, const Mark& mark = Mark{}) {
  static_assert(kThreadsInv == 128 || kThreadsInv == 256);
  constexpr int kS = ProduceScratch::kX22Stride;
  constexpr int kRowsPer = 256 / kThreadsInv;
  float* const sm_X11 = sm_X;
  float* const sm_X22 = sm_X + 16 * kS;
  float* const sm_T = sm_X + 32 * kS;
  if (tid < 32) {
    const int half = tid >> 4, j = tid & 15, base = 16 * half;
    float x[16];
    forward_substitute(sm_L + base * ProduceScratch::kLStride + base, j, x);
    float* const out = half ? sm_X22 : sm_X11;
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i * kS + j] = x[i];
    mark(14);
  } else if (zero_upper && tid < 96) {
    invert_zero_upper(tid - 32, inv_hi, inv_lo);
  }
  sync();
  const int j = tid & 15, r0 = kRowsPer * (tid >> 4);
  float col[16];
#pragma unroll
  for (int m = 0; m < 16; ++m) col[m] = sm_X11[m * kS + j];
  const float b_low = sm_beta[j], b_high = sm_beta[16 + j];
#pragma unroll
  for (int r = r0; r < r0 + kRowsPer; ++r) {
    sm_T[r * kS + j] = dot16(sm_L + (16 + r) * ProduceScratch::kLStride, col);
    // X11[r][j] from shared memory, not col[r]: r is a run-time index, and indexing the register
    // array by it put col in local memory (an STL.128 x 4 and an LDL a chunk on the inverse's path)
    store_split_scalar(inv_hi, inv_lo, sw64_offset(r, j), sm_X11[r * kS + j] * b_low);
    store_split_scalar(inv_hi, inv_lo, sw64_offset(16 + r, 16 + j), sm_X22[r * kS + j] * b_high);
  }
  sync();
#pragma unroll
  for (int m = 0; m < 16; ++m) col[m] = sm_T[m * kS + j];
#pragma unroll
  for (int r = r0; r < r0 + kRowsPer; ++r) {
    const float acc = dot16(sm_X22 + r * kS, col);
    store_split_scalar(inv_hi, inv_lo, sw64_offset(16 + r, j), -acc * b_low);
  }
}

// The record's inv_b by the producer's warpgroup (X12 zeroed every chunk).
template <class Sync, class Mark>
__device__ __forceinline__ void invert(int tid, const float* sm_L, const float* sm_beta, float* sm_X, uint8_t* rec,
                                       const Mark& mark) {
  invert_warpgroup(tid, sm_L, sm_beta, sm_X, rec + ChunkOperands::kOffInvB, rec + ChunkOperands::kOffInvBLo, true,
                   [] { Sync::sync(); }, mark);
}

// One chunk's record (rec, 1024-byte aligned) from its inputs, by the 128 threads tid of one
// warpgroup, scratch: ProduceScratch (1024-byte aligned). Ends with the record's stores fenced for
// the async proxy (a bulk copy or a consumer's wgmma may read it after the next barrier or
// mbarrier arrival).
// kStaged: the chunk's inputs already in shared memory at `staged` (issue_chunk_rows, copies
// complete; a last chunk's rows past the end zeroed in place: zero_staged_tail), read where
// they are used; after the factors' barrier no thread reads them again, and after_factors() runs
// while the L/Mqk products are in flight (the fused kernel refills the buffer there). Else loaded
// from global memory.
// beta_bits: the chunk's raw beta's bits (load_beta_bits) where staged or beta_ahead, else loaded here.
// sm_gate: the head's gate constants in shared memory (load_gate_consts), or null: read here.
// kInvert false: the record's inv_b is left to its consumers; L (fp32, [32][kLStride]) and beta
// ([32]) go to l_beta instead of the scratch (L, then beta at kLBetaOffBeta floats), and the call
// ends after their stores (fenced for the async proxy, no barrier).
constexpr int kLBetaOffBeta = kChunk * ProduceScratch::kLStride;
constexpr int kLBetaBytes = (kLBetaOffBeta + kChunk) * 4;
template <GateForm kGate, bool kF32Gate, class Sync, bool kInvert = true, bool kStaged = false, class Marks = NoMarks,
          class AfterFactors = NoAfter>
__device__ __forceinline__ void produce_chunk(const ProduceArgs& p, int h, int64_t chunk, int tid, uint8_t* rec,
                                              uint8_t* scratch, uint8_t* staged = nullptr,
                                              uint32_t beta_bits = 0, const float* sm_gate = nullptr,
                                              bool beta_ahead = false, float* l_beta = nullptr,
                                              const Marks& mark = Marks{}, const AfterFactors& after_factors = AfterFactors{}) {
  float* const sm_beta =
      kInvert ? reinterpret_cast<float*>(scratch + ProduceScratch::kOffBeta) : l_beta + kLBetaOffBeta;
  const int64_t row0 = chunk * kChunk;
  const int rows = chunk_rows(p.T, chunk);

  ThreadTile q, k, a;  // q, k unused where staged
  if constexpr (kStaged) load_gate_staged<kF32Gate>(p, rows, tid, staged, beta_bits, a, sm_beta);
  else load_chunk<kF32Gate>(p, h, row0, rows, tid, q, k, a, sm_beta, beta_ahead, beta_bits);
  mark(1);
  float sq[8];
  // Uniform. Every fused call has l2norm_qk, so this is all its chunks but a sequence's last.
  if (kStaged && rows == kChunk && p.l2norm_qk && !p.gate_then_norms) {
    gate_and_row_scales<kGate>(p, h, tid, a, sm_gate, staged, sq);
    mark(9);  // the two phases in one: the gate's clocks count both, the row scales' none
  } else {
    gate_chunk<kGate>(p, h, rows, tid, a, sm_gate);
    mark(9);
    if constexpr (kStaged) {
      if (rows < kChunk) zero_staged_tail(tid, rows, staged);  // uniform: a sequence's last chunk at most
      qk_row_scales_staged(p, tid, rows, staged, sq);
    }
    else normalise_qk(p, tid, rows, q, k);
  }
  mark(2);
  float offset[8], gamma[8];  // a: G less offset (scan_log_decay)
  const bool wide =
      scan_log_decay<Sync>(tid, a, offset, gamma, reinterpret_cast<float*>(scratch + ProduceScratch::kOffTotals));
  mark(3);
  store_gamma_flags(tid, gamma, wide, rec);
  if constexpr (kStaged) build_factors_staged(tid, staged, sq, a, offset, gamma, rec, scratch);
  else build_factors(tid, q, k, a, offset, gamma, rec, scratch);
  fence_proxy_async_shared();
  Sync::sync();
  mark(4);

  float d[16];
  l_mqk_product(scratch, d, after_factors);
  mark(5);
  float* const sm_L = kInvert ? reinterpret_cast<float*>(scratch + ProduceScratch::kOffL) : l_beta;
  store_l_mqk(tid, d, sm_beta, sm_L, rec);
  if constexpr (!kInvert) {
    fence_proxy_async_shared();  // Mqk's tiles (the consumers' wgmma operands)
    mark(6);
    return;
  }
  Sync::sync();
  mark(6);
  invert<Sync>(tid, sm_L, sm_beta, reinterpret_cast<float*>(scratch + ProduceScratch::kOffX22), rec, mark);
  fence_proxy_async_shared();
  mark(7);
}

}  // namespace flashkda::cuda::sm90::prefill_v2
