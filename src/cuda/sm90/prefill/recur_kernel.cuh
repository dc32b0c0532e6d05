// K2 of the sm90 prefill: the chunk recurrence (docs/SPEC.md §4) over the records K1 wrote.
//
// grid = (N * H, 8 / kWarps), block = kWarps * 32 (kWarps = 4 or 8: one or two warpgroups). One
// CTA runs the whole recurrence of one sequence and head for a slice of kWarps * 16 value
// columns; each warpgroup owns 64 value columns of the state, S^T [64 v x 128 k], in fp32
// registers for the whole sequence (warp w of the group rows 16w..16w+15; value columns evolve
// independently, so splitting V needs no communication). Per chunk, with M = v rows:
//   W^T = S^T k_decayed^T, O^T = S^T q_decayed^T (K = 128)        wgmma, B from the record in shared memory
//   u^T = v^T - W^T,  U^T = u^T inv_b^T (K = 16)      per-warp mma.sync, inv_b = (I + L)^-1 diag(b)
//   O^T += U^T Mqk^T                                   per-warp mma.sync
//   S^T  = S^T diag(e^Gamma) + U^T Kr (N = 128, K = 16) wgmma into the state registers
// wgmma's register layouts per warp equal mma.sync's (docs/notes/wgmma.md), so the accumulator
// of one product is the A operand of the next and U and S never leave registers; the chunk
// records (already in wgmma's shared-memory layouts, config.h) and v stream through a cp.async
// ring of kStages stages. The mode's precision policy (config.h SplitPolicy) says which operands
// are split into bf16 hi + lo halves (2-3x the MMAs on those products): PreciseSplit splits S,
// u, U, inv_b, k_restored, q_decayed and Mqk, the balanced mode all but S, the fast mode none;
// F16Split (the precise mode with L2-normalised q and k) rounds S, k_decayed and q_decayed to fp16,
// S under a row-scale range guard (RowScale below), and splits the rest (see config.h for what
// each costs in accuracy).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include <type_traits>
#include <utility>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/early_launch.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/sm90/prefill/chunk_map.cuh"

namespace flashkda::cuda::sm90::prefill {

// Each stage holds one chunk record of the mode's layout (config.h RecordLayout) and v. The
// segmented kernel (kSeg) also stages fp32 outputs (o_zero, w) of segments s > 0. kStagesT stages:
// three (80 KB at the precise record), or two (55 KB a CTA) for the segmented K2 at three CTAs an
// SM (recur_seg3_kernel).
// kBulk (the rule for one-warpgroup CTAs; internal::PrefillLaunch::record_copy): per stage, `full`
// completes when the stage's record has landed.
template <int kStages>
struct RecordBarriers {
  uint64_t full[kStages];
};
struct NoBarriers {};

template <int kWarps, class Split, bool kSeg = false, int kStagesT = 3, bool kBulk = false>
struct RecurSmem : std::conditional_t<kBulk, RecordBarriers<kStagesT>, NoBarriers> {
  static_assert(kWarps == 4 || kWarps == 8, "K2 runs whole warpgroups");
  static_assert(!kSeg || kWarps == 4, "the segmented K2 runs one warpgroup per CTA");
  static constexpr int kVCols = kWarps * 16;
  static constexpr int kStages = kStagesT;
  struct alignas(128) Stage {
    alignas(128) uint8_t record[RecordLayout<Split>::kBytes];
    alignas(16) __nv_bfloat16 v[kChunk][kVCols];
  };
  Stage stage[kStages];
  alignas(16) __nv_bfloat16 out[kWarps][kChunk][16];
  alignas(16) float out32[kSeg ? kWarps : 1][kChunk][16];
};

__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

// This CTA's value columns of the chunk's v (rows past the sequence end zero) into a stage, by
// cp.async.
template <class Smem>
__device__ __forceinline__ void load_v(typename Smem::Stage& st, const Params& p, int h, int64_t row0, int rows,
                                       int v_base) {
  constexpr int kThreads = Smem::kVCols * 2;
  constexpr int kVChunksPerRow = Smem::kVCols / 8;
  for (int i = threadIdx.x; i < kChunk * kVChunksPerRow; i += kThreads) {
    const int t = i / kVChunksPerRow, part = i % kVChunksPerRow;
    const bool valid = t < rows;
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.v) +
                               ((row0 + (valid ? t : 0)) * p.H + h) * kHeadDim + v_base + part * 8;
    cp_async_16_zfill(&st.v[t][part * 8], src, valid);
  }
}

// Copies chunk `slot`'s record and (unless !with_v: the transition rows' values are zero) v into
// a stage, by cp.async from every thread.
template <class Smem, class Split>
__device__ __forceinline__ void load_stage(typename Smem::Stage& st, const Params& p, int64_t slot, int h,
                                           int64_t row0, int rows, int v_base, bool with_v = true) {
  constexpr int kThreads = Smem::kVCols * 2;
  constexpr int kRecordBytes = RecordLayout<Split>::kBytes;
  constexpr int kRecordChunks = kRecordBytes / 16;
  const uint8_t* rec = p.records + (slot * p.H + h) * kRecordBytes;
  for (int i = threadIdx.x; i < kRecordChunks; i += kThreads) cp_async_16(st.record + 16 * i, rec + 16 * i);
  if (with_v) load_v<Smem>(st, p, h, row0, rows, v_base);
}

// ---- The bulk record stream (kBulk, RecordBarriers) ----
// Thread 0 copies each chunk's record with one bulk copy completing on the stage's full barrier;
// the CTA barrier at the top of each step (every thread has read the stage being refilled) orders
// the refill after the reads.
template <int kStages, class Smem>
__device__ __forceinline__ void init_record_barriers(Smem& sm) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) mbarrier_init(&sm.full[s], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
}

// Chunk jc of the walk (workspace slot `slot`) into `record`, its stage.
template <class Split, int kStages, class Smem>
__device__ __forceinline__ void issue_record(Smem& sm, uint8_t* record, const Params& p, int64_t slot, int h,
                                             int64_t jc) {
  constexpr uint32_t kBytes = RecordLayout<Split>::kBytes;
  static_assert(kBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  const uint8_t* rec = p.records + (slot * p.H + h) * int64_t(kBytes);
  uint64_t* full = &sm.full[jc % kStages];
  mbarrier_arrive_expect_tx(full, kBytes);
  bulk_copy(record, rec, kBytes, full);
}

// Fills out, final_state and dense checkpoints with NaN (invalid cu_seqlens, or a checkpoint count
// that does not match them): loud, never silent garbage. A state pool is left as it was: its
// other slots hold other sequences' states.
__device__ inline void poison_outputs(const Params& p) {
  const int64_t threads = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  const int64_t tid = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  if (p.transitions_only) {  // internal::segment_transition: its outputs are the two matrices
    const int64_t n_mat = p.num_seqs * p.H * int64_t(kSegStateFloats);
    for (int64_t i = tid; i < n_mat; i += threads) p.seg_a[i] = p.seg_b[i] = __int_as_float(0x7fc00000);
    return;
  }
  const float nan = __int_as_float(0x7fc00000);
  const int64_t n_out = p.total_tokens * p.H * kHeadDim;
  for (int64_t i = tid; i < n_out; i += threads) static_cast<__nv_bfloat16*>(p.out)[i] = __float2bfloat16(nan);
  if (p.checkpoints != nullptr) {
    const int64_t n_ckpt = p.num_checkpoints * p.H * kHeadDim * kHeadDim;
    for (int64_t i = tid; i < n_ckpt; i += threads) store_state_elem(p.checkpoints, p.checkpoint_type, i, nan);
  }
  if (p.final_state == nullptr || p.state_indices != nullptr) return;
  const int64_t n_state = p.num_seqs * p.H * kHeadDim * kHeadDim;
  for (int64_t i = tid; i < n_state; i += threads) store_state_elem(p.final_state, p.final_state_type, i, nan);
}

// A padding sequence (a pool slot outside [0, P)): zero outputs for this CTA's value columns of
// the tokens [sc.bos, sc.eos) and, with_checkpoints, of every dense checkpoint of the sequence
// (seq_tokens long).
template <int kVCols>
__device__ void zero_padding_outputs(const Params& p, int64_t n, int h, const SeqChunks& sc, int64_t seq_tokens,
                                     int v_base, bool with_checkpoints) {
  constexpr int kUnits = kVCols / 8;  // 16-byte units per token row
  for (int64_t i = threadIdx.x; i < (sc.eos - sc.bos) * kUnits; i += blockDim.x) {
    const int64_t row = sc.bos + i / kUnits;
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + (row * p.H + h) * kHeadDim + v_base +
                              8 * (i % kUnits)) = make_uint4(0, 0, 0, 0);
  }
  if (!with_checkpoints || p.checkpoint_every == 0 || p.checkpoints == nullptr) return;
  const int64_t first = first_checkpoint(p, n), count = seq_tokens / p.checkpoint_every;
  for (int64_t c = first; c < first + count; ++c) {
    void* base;
    ElemType type;
    int64_t offset;
    if (!checkpoint_target(p, c, h, base, type, offset)) continue;
    for (int i = threadIdx.x; i < kVCols * kHeadDim; i += blockDim.x)
      store_state_elem(base, type, offset + int64_t(v_base) * kHeadDim + i, 0.f);
  }
}

// Converts the 16 n-tiles of S^T (flat: S[4j + e] is n-tile j, element e) into the 8 A fragments
// of the K = 128 products; with kSplit also the bf16 remainders; kF16: rounded to fp16 instead.
template <bool kSplit, bool kF16 = false>
__device__ __forceinline__ void state_fragments(const float (&S)[64], uint32_t (&hi)[8][4], uint32_t (&lo)[8][4]) {
#pragma unroll
  for (int s = 0; s < 8; ++s) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float* c = &S[4 * (2 * s + (r >> 1)) + (r & 1) * 2];
      if constexpr (kSplit) split_bf16x2_trunc(c[0], c[1], hi[s][r], lo[s][r]);
      else hi[s][r] = pack_x2<kF16>(c[0], c[1]);
    }
  }
}

template <bool kSplit>
__device__ __forceinline__ void acc_fragments(const float (&c0)[4], const float (&c1)[4], uint32_t (&hi)[4],
                                              uint32_t (&lo)[4]) {
  if constexpr (kSplit) {
    split_bf16x2_trunc(c0[0], c0[1], hi[0], lo[0]);
    split_bf16x2_trunc(c0[2], c0[3], hi[1], lo[1]);
    split_bf16x2_trunc(c1[0], c1[1], hi[2], lo[2]);
    split_bf16x2_trunc(c1[2], c1[3], hi[3], lo[3]);
  } else {
    acc_to_a(c0, c1, hi);
  }
}

// acc += A B for a 16x16 record operand B (inv_b or Mqk, in fragment order: lane's 16-byte unit at
// b + 16 lane) on per-warp mma.sync; kSplit: A and B split into bf16 hi + lo, adding lo * B and
// A * B_lo (B_lo at b_lo).
template <bool kSplit>
__device__ __forceinline__ void record_mma_n16(float (&acc)[2][4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                               const uint8_t* b, const uint8_t* b_lo, int lane) {
  const uint4 r_b = lds128(b + lane * 16);
  mma_bf16_n16(acc[0], acc[1], a_hi, r_b);
  if constexpr (kSplit) {
    const uint4 r_b_lo = lds128(b_lo + lane * 16);
    mma_bf16_n16(acc[0], acc[1], a_lo, r_b);
    mma_bf16_n16(acc[0], acc[1], a_hi, r_b_lo);
  }
}

// ---- wgmma (docs/notes/wgmma.md): A from registers, B from shared memory, fp32 accumulate ----
namespace gmma = cute::SM90::GMMA;
using WgmmaN16 = cute::SM90::GMMA::MMA_64x16x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
using WgmmaN16F16 = cute::SM90::GMMA::MMA_64x16x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>;
using WgmmaN32 = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
using WgmmaUpdate = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;

// No-swizzle descriptor: start address, LBO and SBO in 16-byte units (layout type 0).
__device__ __forceinline__ uint64_t smem_desc(const void* p, int lbo, int sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}

template <class Op, int N, size_t... I>
__device__ __forceinline__ void wgmma_impl(const uint32_t (&a)[4], uint64_t desc, float (&d)[N], gmma::ScaleOut sc,
                                           std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], desc, d[I]..., sc);
}
template <class Op, int N>
__device__ __forceinline__ void wgmma(const uint32_t (&a)[4], uint64_t desc, float (&d)[N], bool accumulate) {
  wgmma_impl<Op, N>(a, desc, d, accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero, std::make_index_sequence<N>{});
}
// Pins every register of an accumulator (float) or A fragment (uint32_t) in program order.
template <class T, int N>
__device__ __forceinline__ void fence_regs(T (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}

// Orders this thread's completed cp.async writes to shared memory before the async proxy
// (wgmma) reads them; followed by a CTA barrier.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// This thread's rows of S^T (flat: S[4j + e] = row v_row + 8 * (e >> 1), channel 8j + 2 * t4 + (e & 1))
// from a [rows][128] matrix of `type` at `base` (row v_row of it at base + v_row * 128), or zeros
// for kNone.
__device__ __forceinline__ void load_state_rows(float (&S)[64], const void* base, ElemType type, int64_t offset,
                                                int v_row, int t4) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float2 s2 = make_float2(0.f, 0.f);
      const int64_t idx = offset + int64_t(v_row + 8 * half) * kHeadDim + 8 * j + 2 * t4;
      if (type == ElemType::kF32) {
        s2 = *reinterpret_cast<const float2*>(static_cast<const float*>(base) + idx);
      } else if (type == ElemType::kBF16) {
        const uint32_t b = *reinterpret_cast<const uint32_t*>(static_cast<const __nv_bfloat16*>(base) + idx);
        s2 = make_float2(bf16_lo(b), bf16_hi(b));
      }
      S[4 * j + 2 * half] = s2.x, S[4 * j + 2 * half + 1] = s2.y;
    }
  }
}

// With row factors f: rows v_row and v_row + 8 multiplied by f[0] and f[1] (the fp16 policy's row
// scales, RowScale below).
__device__ __forceinline__ void store_state_rows(const float (&S)[64], void* base, ElemType type, int64_t offset,
                                                 int v_row, int t4, const float (&f)[2]) {
#pragma unroll
  for (int jt = 0; jt < 16; ++jt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t idx = offset + int64_t(v_row + 8 * half) * kHeadDim + 8 * jt + 2 * t4;
      const float x0 = S[4 * jt + 2 * half] * f[half], x1 = S[4 * jt + 2 * half + 1] * f[half];
      if (type == ElemType::kF32) {
        *reinterpret_cast<float2*>(static_cast<float*>(base) + idx) = make_float2(x0, x1);
      } else {
        *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(base) + idx) = pack_bf16x2(x0, x1);
      }
    }
}

__device__ __forceinline__ void store_state_rows(const float (&S)[64], void* base, ElemType type, int64_t offset,
                                                 int v_row, int t4) {
  store_state_rows(S, base, type, offset, v_row, t4, {1.f, 1.f});
}

// ---- The fp16 policy's range guard (config.h SplitPolicy::f16) ----------------------------------
// fp16 holds +-65504 and is normal down to 2^-14, where bf16 holds the fp32 range. So the fp16
// policy keeps each row r of S^T scaled by a power of two m_r (registers hold S_st = m_r S, the
// update adds m_r U), which leaves every product exact up to the fp16 rounding:
//   W_st = S_st kd,  u_st = m_r v - W_st,  U_st = u_st inv_b,  O_st = S_st qd + U_st Mqk,
//   out = O_st / m_r,  S_st <- S_st e^Gamma + U_st Kr,  stored states S_st / m_r.
// RowScale::renormalise (at the start, after the first chunk and every kRenormChunks chunks; one
// max over the row per thread quad) leaves m_r alone while the row's largest |entry| lies in
// [2^-8, 2^12) and otherwise moves it to [2^3, 2^4): so ordinary states run at m = 1 (the
// products of the unscaled fp16 state, and the same bits whichever call a sequence is cut into),
// small ones keep fp16's 11 bits (an entry below 2^-14 errs by at most 2^-25, i.e. 2^-17 of a
// row maximum >= 2^-8) and large ones stay 2^12 below fp16's range. A state that still grows past
// 65504 between two renormalisations (a jump in |v| of 2^12, a huge initial state) turns W^T
// non-finite: the warp that sees it renormalises and recomputes its W^T and O^T of the chunk in
// fp32 on the CUDA cores from the fp32 state (f16_product_fp32), so no finite input falls outside
// the guard; only non-finite inputs (non-finite results on every path) take that path each chunk.
constexpr int kRenormChunks = 16;
constexpr int kRowScaleMaxExp = 60;  // |log2 m_r| <= 60: row maxima from ~2^-57 to ~2^63 rescaled

struct RowScale {
  float m[2] = {1.f, 1.f}, inv[2] = {1.f, 1.f};
  int e[2] = {0, 0};  // m = 2^e

  // Quad-collective (every lane of the warp must call it): rescales this thread's rows of S_st.
  __device__ __forceinline__ void renormalise(float (&S)[64]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(fabsf(S[4 * j + 2 * half]), fabsf(S[4 * j + 2 * half + 1])));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // In range, zero, or not finite (nothing a scale can do): m_r stays.
      if (!(mx > 0.f && mx <= 3.0e38f) || (mx >= 0x1p-8f && mx < 0x1p12f)) continue;
      const int ex = ((__float_as_int(mx) >> 23) & 0xff) - 127;  // mx in [2^ex, 2^(ex+1)) (normal mx)
      const int target = max(-kRowScaleMaxExp, min(kRowScaleMaxExp, e[half] + 3 - ex));
      const int k = target - e[half];
      if (k == 0) continue;
      const float f = __int_as_float((127 + k) << 23);  // |k| <= 2 * kRowScaleMaxExp < 127
#pragma unroll
      for (int j = 0; j < 16; ++j) S[4 * j + 2 * half] *= f, S[4 * j + 2 * half + 1] *= f;
      e[half] = target;
      m[half] = __int_as_float((127 + target) << 23);
      inv[half] = __int_as_float((127 - target) << 23);
    }
  }
};

// W^T (which = 0: k_decayed) or O^T (which = 1: q_decayed) of one chunk for this thread's rows
// (v_row, v_row + 8) in fp32 on the CUDA cores: the fp16 policy's fallback when S_st left fp16's
// range. The operand comes from the record (fp16, WO operand `which`); D receives the wgmma
// accumulator layout (token 8 nt + 2 t4 + (e & 1), row g + 8 (e >> 1) at [4 nt + e]). Every lane of
// the warp calls it.
template <class Rec>
__device__ __forceinline__ void f16_product_fp32(const float (&S)[64], const uint8_t* wo, int which, float (&D)[8],
                                                 int t4) {
#pragma unroll 1
  for (int t = 0; t < kChunk; ++t) {  // not unrolled (rare path, registers); the slots by select
    float d0 = 0.f, d1 = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 8 * j + 2 * t4;
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(wo + Rec::wo_offset(which, t, c)));
      d0 = fmaf(S[4 * j], x.x, fmaf(S[4 * j + 1], x.y, d0));
      d1 = fmaf(S[4 * j + 2], x.x, fmaf(S[4 * j + 3], x.y, d1));
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) d0 += __shfl_xor_sync(0xffffffffu, d0, x), d1 += __shfl_xor_sync(0xffffffffu, d1, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // slot i holds token 8 (i / 4) + 2 t4 + (i & 1), row g + 8 ((i >> 1) & 1)
      const bool mine = t == 8 * (i >> 2) + 2 * t4 + (i & 1);
      D[i] = mine ? ((i & 2) ? d1 : d0) : D[i];
    }
  }
}

// Rows r, r + 8 of the identity (the transition rows of a segment start at A = I).
__device__ __forceinline__ void identity_rows(float (&S)[64], int r, int t4) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[4 * j + e] = (r + 8 * (e >> 1) == 8 * j + 2 * t4 + (e & 1)) ? 1.f : 0.f;
}

// Transition skipping (config.h "Transition skipping"): the runs of segment `seg` (chunks
// `sc` of the sequence `whole`), for every CTA of the segment the same, from the same bounds and
// the same arithmetic. Returns the segment's piece count and leaves in warm[i] the warm-up of the
// run starting at piece i (chunks before it whose bounds' product first falls to 2^-30, at most
// Params::run_warmup and within the sequence), 0 where piece i starts no run of its own.
// CTA-collective: a thread per piece, kWarmupBlock bound loads in flight at once.
__device__ inline int plan_runs(const Params& p, const SeqChunks& whole, const SeqChunks& sc, bool first_segment,
                                int h, uint16_t (&warm)[kMaxPieces]) {
  const int64_t len = sc.chunk_end - sc.chunk_begin;
  const int pieces = int(pieces_of(len, p.run_chunks));
  for (int i = threadIdx.x; i < pieces; i += blockDim.x) {
    const int64_t b = sc.chunk_begin + i * p.run_chunks;  // the piece's first chunk
    const bool may_skip = i > 0 || !first_segment;
    const int avail = may_skip ? int(min(p.run_warmup, b - whole.chunk_begin)) : 0;
    float cum = 0.f;
    int found = 0;
    for (int base = 0; base < avail && found == 0; base += kWarmupBlock) {
      float bound[kWarmupBlock];
#pragma unroll
      for (int w = 0; w < kWarmupBlock; ++w)
        bound[w] = base + w < avail ? p.chunk_bound[(b - 1 - base - w) * p.H + h] : INFINITY;
#pragma unroll
      for (int w = 0; w < kWarmupBlock; ++w) {
        cum += bound[w] == bound[w] ? bound[w] : INFINITY;  // a NaN bound (K1 drops most NaN inputs) bounds nothing
        if (found == 0 && cum <= kSkipLogBound) found = base + w + 1;
      }
    }
    warm[i] = uint16_t(found);
  }
  __syncthreads();
  return pieces;
}

// The piece after `i` that starts a run, or `pieces`.
__device__ __forceinline__ int next_run(const uint16_t (&warm)[kMaxPieces], int i, int pieces) {
  int j = i + 1;
  while (j < pieces && warm[j] == 0) ++j;
  return j;
}

// Low-rank transitions (config.h LowRankInfo): the plan of the exact run of `chunks` chunks from chunk
// slot `first` at head h, the same in every CTA that computes it (the same loads and arithmetic). The
// rest of the run is bounded by the sum of its chunks' positive log-bounds (an upper bound on every
// partial product's norm, a NaN counting as infinite); channel c is kept unless log e^{Gamma_c} plus
// that bound is at most kSkipLogBound (a NaN e^Gamma keeps it). Returns r = |J| + 16, or 0 where more
// than kLowRankMaxJ channels stay or the run is a single chunk. CTA-collective, 128 threads.
template <class Rec>
__device__ inline int plan_lowrank(const Params& p, int64_t first, int64_t chunks, int h, LowRankInfo& info) {
  __shared__ float s_part[4];
  __shared__ int s_count[4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (chunks < 2) return 0;
  float tail = 0.f;
  for (int64_t c = 1 + threadIdx.x; c < chunks; c += blockDim.x) {
    const float b = p.chunk_bound[(first + c) * p.H + h];
    tail += b == b ? fmaxf(b, 0.f) : INFINITY;
  }
#pragma unroll
  for (int x = 16; x >= 1; x >>= 1) tail += __shfl_xor_sync(0xffffffffu, tail, x);
  if (lane == 0) s_part[warp] = tail;
  __syncthreads();
  tail = (s_part[0] + s_part[1]) + (s_part[2] + s_part[3]);
  const float gamma = reinterpret_cast<const float*>(p.records + (first * p.H + h) * int64_t(Rec::kBytes) +
                                                     Rec::kOffGamma)[threadIdx.x];
  const bool keep = !(__logf(gamma) + tail <= kSkipLogBound);
  const uint32_t votes = __ballot_sync(0xffffffffu, keep);
  if (lane == 0) s_count[warp] = __popc(votes);
  __syncthreads();
  const int count = s_count[0] + s_count[1] + s_count[2] + s_count[3];
  if (count > kLowRankMaxJ) return 0;
  int before = __popc(votes & ((1u << lane) - 1u));
  for (int w = 0; w < warp; ++w) before += s_count[w];
  if (keep) info.j[before] = uint8_t(threadIdx.x);
  if (threadIdx.x == 0) info.rank = count + kChunk;
  __syncthreads();
  return count + kChunk;
}

// kSeg = false: grid (N * H, 8 / kWarps), one CTA walks a whole sequence for kWarps * 16 value rows.
// kSeg = true (config.h "Segments"): grid (max_segs * H, 4 + 2 * (max_pieces - 1)), one warpgroup per
// CTA; blockIdx.y 0-1 are the value rows, 2-3 the transition rows (A^T) of a segment, and with
// transition skipping 4 + 2 (i - 1) + half the value rows of piece i >= 1 (config.h "Transition
// skipping"). Segment 0 runs from the initial state and writes its outputs; segments s > 0 run from
// zero (transition rows: the identity, with zero values) and write fp32 o_zero and w for the
// combine kernel, and B_s^T and A_s^T. A skipping run starts from zero at its warm-up and writes
// final outputs; a run that ends inside its segment writes, instead of a state, which of its rows
// are not finite (Params::seg_taint).
// The kernels below are this body under their launch bounds and stage counts.
template <int kWarps, class Split, bool kSeg, int kStagesT, bool kBulk, bool kLowRankT = false>
__device__ __forceinline__ void recur_body(const Params& p) {
  using Smem = RecurSmem<kWarps, Split, kSeg, kStagesT, kBulk>;
  constexpr int kStages = Smem::kStages;
  using Rec = RecordLayout<Split>;
  constexpr bool kSplitS = Split::state, kSplitQd = Split::q_decayed, kSplitF = Split::factors;
  using WgmmaWO16 = std::conditional_t<Split::f16, WgmmaN16F16, WgmmaN16>;  // W, and O unless q_decayed is split
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  if (call_fused(p)) return;
  if (call_refused(p)) {
    poison_outputs(p);
    return;
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  int64_t n;
  int h, row_base;         // row_base: first of this CTA's rows of S^T (of the augmented 256 with kSeg)
  SeqChunks sc;            // the chunks this CTA walks
  SegmentRef seg{0, 0, 1, 0};
  int64_t warm = 0;        // transition skipping: chunks walked before the run's own, outputs unwritten
  int run_start = 0;       // transition skipping: the run's first piece (its taint record)
  bool run_to_end = true;  // whether the walk ends at the segment's end (else: a taint record, no state)
  if constexpr (kSeg) {
    h = int(blockIdx.x % p.H);
    if (!locate_segment(p, blockIdx.x / p.H, seg)) return;
    const int piece = blockIdx.y < 4 ? 0 : 1 + (int(blockIdx.y) - 4) / 2;
    const bool transition = blockIdx.y == 2 || blockIdx.y == 3;
    if (seg.s == 0 && !p.transitions_only && transition) return;  // a known start state: no transition
    n = seg.n;
    row_base = blockIdx.y < 4 ? int(blockIdx.y) * Smem::kVCols : Smem::kVCols * (blockIdx.y % 2);
    const SeqChunks whole = seq_chunks(p, n);
    sc = segment_chunks(p, whole, seg.s);
    if (p.seg_exact != nullptr && !p.transitions_only && state_slot(p, n) < 0) {
      if (piece > 0) return;  // padding: piece 0 writes the zero outputs (below)
    } else if (p.seg_exact != nullptr && !p.transitions_only) {
      if (piece >= pieces_of(sc.chunk_end - sc.chunk_begin, p.run_chunks)) return;  // a shorter segment
      __shared__ uint16_t s_warm[kMaxPieces];
      const int pieces = plan_runs(p, whole, sc, seg.s == 0, h, s_warm);
      const int exact_end = s_warm[0] > 0 ? 0 : next_run(s_warm, 0, pieces);  // pieces of the exact run
      const int64_t len = sc.chunk_end - sc.chunk_begin, F = p.run_chunks;
      const int64_t seg_id = (seg.first + seg.s) * p.H + h;
      if (blockIdx.y == 0 && threadIdx.x < kPlanWords) {
        uint32_t bits = 0;
        for (int b = 0; b < 32; ++b) bits |= uint32_t(32 * threadIdx.x + b < pieces && s_warm[32 * threadIdx.x + b] > 0) << b;
        p.seg_plan[seg_id * kPlanWords + threadIdx.x] = bits;
        if (threadIdx.x == 0) p.seg_exact[seg_id] = int32_t(min(int64_t(exact_end) * F, len));
      }
      int first, last;  // pieces [first, last) of this CTA's run
      if (transition) {
        if (exact_end == 0) return;  // the segment's start skips: no transition
        first = 0, last = exact_end;
      } else {
        if (piece > 0 && s_warm[piece] == 0) return;  // inside another run
        first = piece, last = next_run(s_warm, piece, pieces);
        warm = s_warm[piece];
      }
      run_start = first, run_to_end = last == pieces;
      const int64_t j0 = first * F - warm, j1 = min(last * F, len);
      sc.bos += j0 * kChunk, sc.eos = min(sc.eos, sc.bos + (j1 - j0) * kChunk);
      sc.chunk_end = sc.chunk_begin + j1, sc.chunk_begin += j0;
    }
  } else {
    n = blockIdx.x / p.H;
    h = int(blockIdx.x % p.H);
    row_base = int(blockIdx.y) * Smem::kVCols;
    sc = seq_chunks(p, n);
  }
  const bool transition_rows = kSeg && row_base >= kHeadDim;  // rows of A^T: zero values, no v
  const bool first_segment = seg.s == 0 && !(kSeg && p.transitions_only);
  const int v_base = transition_rows ? 0 : row_base;  // value columns this CTA reads and writes
  const int v_row = row_base + warp * 16 + g;  // this thread's rows: v_row and v_row + 8
  const int64_t head_offset = int64_t(h) * kSegStateFloats;
  const int64_t slot = state_slot(p, n);
  if (slot < 0) {  // padding: zero outputs, nothing read or written
    if (!transition_rows) {
      const SeqChunks whole = seq_chunks(p, n);
      zero_padding_outputs<Smem::kVCols>(p, n, h, sc, whole.eos - whole.bos, v_base, seg.s == 0);
    }
    return;
  }
  const int64_t state_base = state_offset(p, slot, h);
  // Checkpoints at chunk ends: next_ckpt is the chunk (of this CTA's walk) after which the next one
  // falls, -1 for none (one compare per chunk). A CTA that walks the whole sequence writes them all.
  // With segments, those on segment boundaries come from the chain kernel; with checkpoints inside
  // segments (p.seg_ckpt_b) segment 0 writes its inner ones and segments s > 0 store their partial
  // transitions B_c^T, A_c^T at theirs, which the chain maps to the checkpoint. A skipping run writes
  // those after its warm-up (true states); the chain turns the rows a non-finite state reaches to NaN.
  const int64_t ckpt_period = p.checkpoint_every / kChunk;
  const int64_t seg_chunk0 = sc.chunk_begin - seq_chunks(p, n).chunk_begin;  // this walk's first chunk in the sequence
  const bool inner_ckpts = kSeg && p.seg_ckpt_b != nullptr && !p.transitions_only && seg.count > 1;
  int64_t next_ckpt = p.checkpoint_every > 0 && ((seg.count == 1 && first_segment) || inner_ckpts)
                          ? ckpt_period - 1 - seg_chunk0 % ckpt_period
                          : -1;

  // S^T tile, flat: S[4j + e] = state(v = v_row + 8 * (e >> 1), channel 8j + 2 * t4 + (e & 1)).
  float r_S[64];
  if (first_segment && warm == 0)
    load_state_rows(r_S, p.initial_state, reads_initial_state(p, n) ? p.initial_state_type : ElemType::kNone,
                    state_base, v_row, t4);
  else if (transition_rows) identity_rows(r_S, v_row - kHeadDim, t4);
  else load_state_rows(r_S, nullptr, ElemType::kNone, 0, v_row, t4);
  RowScale rs;  // the fp16 policy's row scales (S holds S_st = m S); unused by the bf16 policies
  if constexpr (Split::f16) rs.renormalise(r_S);

  int64_t num_chunks = sc.chunk_end - sc.chunk_begin;
  // Low-rank transitions (config.h LowRankInfo): both transition blocks of a segment s > 0 plan the
  // same; the first then runs F's columns after the first chunk, the second walks that chunk only.
  // Only their own kernel (recur_seg_lowrank_kernel: two CTAs an SM, the bulk record stream) takes
  // them, so that the rule's kernels keep their code (at three CTAs an SM it spilled, at two it took
  // up to 19 more registers); the launcher asks for them only where it runs that one (launch.cu).
  constexpr bool kLowRank = kLowRankT;
  static_assert(!kLowRank || (kSeg && kStages >= 3), "low-rank transitions: the two-CTA segmented K2 only");
  int lr_rank = 0;
  const int64_t gseg = kSeg ? (seg.first + seg.s) * p.H + h : 0;
  const LowRankInfo* s_lr = nullptr;
  if constexpr (kLowRank) {
    __shared__ LowRankInfo lr;
    s_lr = &lr;
    if (transition_rows && p.seg_lowrank != nullptr && !p.transitions_only && warm == 0) {
      lr_rank = plan_lowrank<Rec>(p, sc.chunk_begin, num_chunks, h, lr);
      if (row_base == kHeadDim && threadIdx.x < 16)
        reinterpret_cast<int32_t*>(p.seg_lowrank + gseg)[threadIdx.x] =
            lr_rank > 0 ? reinterpret_cast<const int32_t*>(&lr)[threadIdx.x] : 0;  // rank 0: the K rows
      if (lr_rank > 0 && row_base > kHeadDim) num_chunks = 1;
    }
  }
  const bool lr_first = lr_rank > 0 && row_base == kHeadDim;  // the block that carries T
  auto chunk_rows = [&](int64_t j) { const int64_t left = sc.eos - (sc.bos + j * kChunk); return int(left < kChunk ? left : kChunk); };
  // kEarlyHead (three stages: the two-CTA kernels, 190 registers and more): the state's A fragments
  // formed before the chunk's barrier and the bulk refill issued under the W and O products (the
  // serial head from the last update to the first wgmma ~163 -> ~70 instructions), the v, record and
  // output addresses carried from chunk to chunk, v read and the output staged by ldmatrix /
  // stmatrix. At three CTAs an SM (168 registers, two stages) the values these keep live cost
  // spills and serialised wgmmas (ptxas), so that kernel keeps the former code.
  constexpr bool kEarlyHead = kStages >= 3;
  // v: one 16-byte unit per thread and chunk (token lv_t, part lv_part), its source advanced by a
  // chunk per fetch (chunks are fetched in order); rows past the sequence end zero-filled from the
  // chunk's first row, as load_v does. (kVCols = 16 kWarps columns: 2 kVCols threads.)
  constexpr int kVUnits = Smem::kVCols / 8;
  static_assert(kChunk * kVUnits == kWarps * 32, "one v unit per thread");
  const int lv_t = threadIdx.x / kVUnits, lv_part = threadIdx.x % kVUnits;
  const int64_t v_token_step = int64_t(p.H) * kHeadDim;  // elements from one token to the next
  const __nv_bfloat16* v_src =
      static_cast<const __nv_bfloat16*>(p.v) + ((sc.bos + lv_t) * p.H + h) * kHeadDim + v_base + lv_part * 8;
  const int64_t v_back = lv_t * v_token_step;  // to the chunk's first row
  int64_t v_token = sc.bos + lv_t;
  const uint32_t v_dst0 = smem_addr(&sm.stage[0].v[lv_t][lv_part * 8]);
  constexpr uint32_t kStageBytes = sizeof(typename Smem::Stage);
  if constexpr (kBulk) init_record_barriers<kStages>(sm);
  const uint8_t* rec_src = p.records + ((sc.chunk_begin) * p.H + h) * int64_t(RecordLayout<Split>::kBytes);
  const int64_t rec_step = int64_t(p.H) * RecordLayout<Split>::kBytes;
  auto fetch = [&](int64_t jc, int st_idx) {
    if constexpr (kBulk && !kEarlyHead) {
      typename Smem::Stage& st = sm.stage[st_idx];
      if (threadIdx.x == 0) issue_record<Split, kStages>(sm, st.record, p, sc.chunk_begin + jc, h, jc);
      if (!transition_rows) load_v<Smem>(st, p, h, sc.bos + jc * kChunk, chunk_rows(jc), v_base);
    } else if constexpr (kBulk) {
      typename Smem::Stage& st = sm.stage[st_idx];
      if (threadIdx.x == 0) {
        uint64_t* full = &sm.full[st_idx];
        mbarrier_arrive_expect_tx(full, RecordLayout<Split>::kBytes);
        bulk_copy(st.record, rec_src, RecordLayout<Split>::kBytes, full);
      }
      rec_src += rec_step;
      if (!transition_rows) {
        const bool valid = v_token < sc.eos;
        const uint32_t dst = v_dst0 + st_idx * kStageBytes;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(valid ? v_src : v_src - v_back),
                     "r"(valid ? 16 : 0) : "memory");
        v_src += kChunk * v_token_step, v_token += kChunk;
      }
    } else {
      load_stage<Smem, Split>(sm.stage[st_idx], p, sc.chunk_begin + jc, h, sc.bos + jc * kChunk,
                              chunk_rows(jc), v_base, !transition_rows);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_chunks) fetch(s, s);
    cp_async_commit();
  }
  int stage = 0;         // chunk j's stage
  uint32_t phase = 0;    // parity of its full barrier's phase
  // Output destinations of chunk j, advanced a chunk per iteration.
  float* seg_dst = kSeg ? p.seg_out + (sc.chunk_begin * p.H + h) * int64_t(kSegOutFloats) + row_base + warp * 16 : nullptr;
  const int64_t seg_step = int64_t(p.H) * kSegOutFloats;
  const int o_t = lane >> 1, o_part = lane & 1;
  __nv_bfloat16* out_dst = static_cast<__nv_bfloat16*>(p.out) + ((sc.bos + o_t) * p.H + h) * kHeadDim + v_base +
                           warp * 16 + o_part * 8;
  const int64_t out_step = int64_t(kChunk) * p.H * kHeadDim;
  int64_t out_token = sc.bos + o_t;

  for (int64_t j = 0; j < num_chunks; ++j) {
    uint32_t r_S_hi[kKSteps][4], r_S_lo[kKSteps][4];
    if constexpr (kEarlyHead) state_fragments<kSplitS, Split::f16>(r_S, r_S_hi, r_S_lo);  // no shared memory
    cp_async_wait_group<kStages - 2>();
    if constexpr (!kBulk) fence_proxy_async_smem();
    __syncthreads();
    if constexpr (!kBulk || !kEarlyHead) {
      const int64_t jn = j + kStages - 1;  // into the stage of chunk j - 1, which every thread has read
      if (jn < num_chunks) fetch(jn, int(jn % kStages));
      cp_async_commit();
    }
    // chunk j's stage and its full barrier's phase (kEarlyHead: counters, else from j as before)
    const int st_j = kEarlyHead ? stage : int(j % kStages);
    if constexpr (kBulk) mbarrier_wait(&sm.full[st_j], kEarlyHead ? phase : uint32_t(j / kStages) & 1);
    const typename Smem::Stage& s_stage = sm.stage[st_j];
    const uint8_t* s_rec = s_stage.record;

    // W^T = S^T k_decayed^T and O^T = S^T [q_decayed | q_decayed_lo]^T over K = 128 (8 k-steps), as two wgmma groups:
    // W is on the recurrence's critical path and is waited for first; O completes while this
    // warp forms u and U. A split S adds S_lo^T k_decayed^T to W and S_lo^T q_decayed^T to O (a
    // second O accumulator: different wgmma shapes never share one); a split q_decayed widens
    // the O product to [q_decayed | q_decayed_lo] (n = 32).
    if constexpr (!kEarlyHead) state_fragments<kSplitS, Split::f16>(r_S, r_S_hi, r_S_lo);
    const uint64_t desc_w = smem_desc(s_rec + Rec::kOffWo, Rec::kWoLbo, Rec::kWoSbo);  // rows 0..15: k_decayed
    const uint64_t desc_o = desc_w + ((2 * Rec::kWoSbo) >> 4);  // rows 16..: q_decayed (and q_decayed_lo)
    constexpr uint64_t kStep = Rec::kWoStepBytes >> 4;
    using WgmmaO = std::conditional_t<kSplitQd, WgmmaN32, WgmmaWO16>;
    float r_W_acc[8], r_O_acc[kSplitQd ? 16 : 8], r_O_lo_acc[kSplitS ? 8 : 1];
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      fence_regs(r_S_hi[s]);
      if constexpr (kSplitS) fence_regs(r_S_lo[s]);
    }
    cute::warpgroup_arrive();
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      wgmma<WgmmaWO16>(r_S_hi[s], desc_w + s * kStep, r_W_acc, s > 0);
      if constexpr (kSplitS) wgmma<WgmmaN16>(r_S_lo[s], desc_w + s * kStep, r_W_acc, true);
    }
    cute::warpgroup_commit_batch();
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      wgmma<WgmmaO>(r_S_hi[s], desc_o + s * kStep, r_O_acc, s > 0);
      if constexpr (kSplitS) wgmma<WgmmaN16>(r_S_lo[s], desc_o + s * kStep, r_O_lo_acc, s > 0);
    }
    cute::warpgroup_commit_batch();
    if constexpr (kBulk && kEarlyHead) {  // the refill of chunk j - 1's stage, under the W and O products
      const int64_t jn = j + kStages - 1;
      if (jn < num_chunks) fetch(jn, stage == 0 ? kStages - 1 : stage - 1);
      cp_async_commit();
    }
    cute::warpgroup_wait<1>();
    fence_regs(r_W_acc);
    bool o_fp32 = false;  // the range guard's fallback: O^T too, once the whole warpgroup waits for it
    if constexpr (Split::f16) {
      // Range guard (RowScale): a non-finite W^T means S_st left fp16's range (or an input is not
      // finite); this warp redoes W^T in fp32 at a new scale now and O^T after the warpgroup's wait
      // for it below (wgmma.wait_group is warpgroup-aligned: no warp may wait alone).
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += r_W_acc[i];
      if (__any_sync(0xffffffffu, !(fabsf(sum) <= 3.0e38f))) {
        rs.renormalise(r_S);
        f16_product_fp32<Rec>(r_S, s_rec + Rec::kOffWo, 0, r_W_acc, t4);
        fence_regs(r_W_acc);
        o_fp32 = true;
      }
    }
    float r_u[2][4], r_O[2][4];  // r_u: W^T, then u^T = v^T - W^T in place
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) r_u[nt][e] = r_W_acc[4 * nt + e];

    // u^T = v^T - W^T (v = 0 on transition rows), then U^T = u^T inv_b^T. v^T in the accumulator
    // layout by one ldmatrix.trans: matrix 2 nt + eh holds tokens 8 nt.., columns 8 eh.. of this
    // warp's 16, so lane (g, t4) gets tokens 8 nt + 2 t4 + {0, 1} of column g + 8 eh.
    uint32_t r_v[4] = {0u, 0u, 0u, 0u};
    if (kEarlyHead && !transition_rows) {
      const int m = lane >> 3, r = lane & 7;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r_v[0]), "=r"(r_v[1]), "=r"(r_v[2]), "=r"(r_v[3])
                   : "r"(smem_addr(&s_stage.v[8 * (m >> 1) + r][warp * 16 + 8 * (m & 1)]))
                   : "memory");
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float vt;
        if constexpr (kEarlyHead) {
          const uint32_t vv = r_v[2 * nt + (e >> 1)];
          vt = __uint_as_float((e & 1) ? (vv & 0xffff0000u) : (vv << 16));
        } else {
          const int t = nt * 8 + 2 * t4 + (e & 1);
          const int col = warp * 16 + g + 8 * (e >> 1);
          vt = transition_rows ? 0.f : __bfloat162float(s_stage.v[t][col]);
        }
        if constexpr (Split::f16) r_u[nt][e] = fmaf(vt, rs.m[e >> 1], -r_u[nt][e]);  // u_st = m v - W_st
        else r_u[nt][e] = vt - r_u[nt][e];
      }
    uint32_t r_u_hi[4], r_u_lo[4];
    acc_fragments<kSplitF>(r_u[0], r_u[1], r_u_hi, r_u_lo);
    float r_U[2][4] = {};
    record_mma_n16<kSplitF>(r_U, r_u_hi, r_u_lo, s_rec + Rec::kOffInvB, s_rec + Rec::kOffInvBLo, lane);
    uint32_t r_U_hi[4], r_U_lo[4];
    acc_fragments<kSplitF>(r_U[0], r_U[1], r_U_hi, r_U_lo);

    cute::warpgroup_wait<0>();
    fence_regs(r_O_acc);
    if constexpr (kSplitS) fence_regs(r_O_lo_acc);
    if constexpr (Split::f16)
      if (o_fp32) {
        f16_product_fp32<Rec>(r_S, s_rec + Rec::kOffWo, 1, r_O_acc, t4);
        fence_regs(r_O_acc);
      }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        r_O[nt][e] = r_O_acc[4 * nt + e];
        if constexpr (kSplitQd && kSplitS) r_O[nt][e] += r_O_acc[8 + 4 * nt + e] + r_O_lo_acc[4 * nt + e];
        else if constexpr (kSplitQd) r_O[nt][e] += r_O_acc[8 + 4 * nt + e];
        else if constexpr (kSplitS) r_O[nt][e] += r_O_lo_acc[4 * nt + e];
      }

    // O^T += U^T Mqk^T.
    record_mma_n16<kSplitF>(r_O, r_U_hi, r_U_lo, s_rec + Rec::kOffMqk, s_rec + Rec::kOffMqkLo, lane);

    if (kLowRank && lr_rank > 0 && j == 0) {
      // Low-rank transitions: G's chunk rows are this chunk's U of the basis rows (U^T[r][i] =
      // -(inv_b k_decayed)[i][r]); the first block's rows then become F's columns: row i < |J| the
      // basis row of kept channel j_i (decayed below to e_j e^{Gamma_j}), row |J| + i the update of
      // token i alone (U^T = e_i: k_restored_i), the rest zero.
      float* g_dst = p.seg_g + gseg * int64_t(kLowRankGFloats);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          g_dst[(nt * 8 + 2 * t4 + (e & 1)) * kHeadDim + v_row + 8 * (e >> 1) - kHeadDim] = r_U[nt][e] * rs.inv[e >> 1];
      if (lr_first) {
        const int kept = lr_rank - kChunk;
#pragma unroll
        for (int jt = 0; jt < 16; ++jt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = v_row + 8 * (e >> 1) - kHeadDim;
            r_S[4 * jt + e] = i < kept && s_lr->j[i] == 8 * jt + 2 * t4 + (e & 1) ? rs.m[e >> 1] : 0.f;
          }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            r_U[nt][e] = v_row + 8 * (e >> 1) - kHeadDim - kept == nt * 8 + 2 * t4 + (e & 1) ? rs.m[e >> 1] : 0.f;
        acc_fragments<kSplitF>(r_U[0], r_U[1], r_U_hi, r_U_lo);
      }
    }

    // S^T = S^T diag(e^Gamma) + U^T Kr: the decay in registers, then the update on the tensor
    // cores while this warp writes its output.
    const float* s_gamma = reinterpret_cast<const float*>(s_rec + Rec::kOffGamma);
#pragma unroll
    for (int jt = 0; jt < 16; ++jt) {
      const float2 r_decay = *reinterpret_cast<const float2*>(s_gamma + 8 * jt + 2 * t4);
      r_S[4 * jt] *= r_decay.x, r_S[4 * jt + 1] *= r_decay.y, r_S[4 * jt + 2] *= r_decay.x, r_S[4 * jt + 3] *= r_decay.y;
    }
    {
      const uint64_t desc_kr = smem_desc(s_rec + Rec::kOffKRestored, kKrLbo, kKrSbo);
      fence_regs(r_S), fence_regs(r_U_hi);
      if constexpr (kSplitF) fence_regs(r_U_lo);
      cute::warpgroup_arrive();
      wgmma<WgmmaUpdate>(r_U_hi, desc_kr, r_S, true);
      if constexpr (kSplitF) {
        const uint64_t desc_kr_lo = smem_desc(s_rec + Rec::kOffKRestoredLo, kKrLbo, kKrSbo);
        wgmma<WgmmaUpdate>(r_U_lo, desc_kr, r_S, true);
        wgmma<WgmmaUpdate>(r_U_hi, desc_kr_lo, r_S, true);
      }
      cute::warpgroup_commit_batch();
    }

    if (j < warm) {
      // A skipped segment's warm-up: the state only.
    } else if (kSeg && !first_segment && warm == 0) {
      // Segments s > 0: O^T of all 16 tokens in fp32 (o_zero on value rows, w on transition
      // rows), staged as [t][16 rows] in this warp's tile, then 16-byte stores into seg_out.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sm.out32[kSeg ? warp : 0][nt * 8 + 2 * t4 + (e & 1)][g + 8 * (e >> 1)] = r_O[nt][e] * rs.inv[e >> 1];
      __syncwarp();
      float* dst = kEarlyHead ? seg_dst
                              : p.seg_out + ((sc.chunk_begin + j) * p.H + h) * int64_t(kSegOutFloats) + row_base + warp * 16;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int unit = lane + 32 * i, t = unit >> 2, part = unit & 3;
        *reinterpret_cast<float4*>(dst + t * kSegRows + 4 * part) =
            *reinterpret_cast<const float4*>(&sm.out32[kSeg ? warp : 0][t][4 * part]);
      }
    } else {
      // Output: stage O^T as [t][16 v] in this warp's tile, then one 16-byte store per lane.
      // kEarlyHead: by stmatrix.trans: matrix 2 nt + eh is rows (tokens) 8 nt.., columns 8 eh..;
      // lane (g, t4) gives tokens 8 nt + 2 t4 + {0, 1} of column g + 8 eh (the same roundings).
      if constexpr (kEarlyHead) {
        uint32_t r_o16[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int eh = 0; eh < 2; ++eh)
            r_o16[2 * nt + eh] = pack_bf16x2(r_O[nt][2 * eh] * rs.inv[eh], r_O[nt][2 * eh + 1] * rs.inv[eh]);
        const int m = lane >> 3, r = lane & 7;
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                         smem_addr(&sm.out[warp][8 * (m >> 1) + r][8 * (m & 1)])),
                     "r"(r_o16[0]), "r"(r_o16[1]), "r"(r_o16[2]), "r"(r_o16[3])
                     : "memory");
      } else {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sm.out[warp][nt * 8 + 2 * t4 + (e & 1)][g + 8 * (e >> 1)] = __float2bfloat16_rn(r_O[nt][e] * rs.inv[e >> 1]);
      }
      __syncwarp();
      {
        const bool in_seq = kEarlyHead ? out_token < sc.eos : o_t < chunk_rows(j);
        __nv_bfloat16* const dst = kEarlyHead ? out_dst
                                              : static_cast<__nv_bfloat16*>(p.out) +
                                                    ((sc.bos + j * kChunk + o_t) * p.H + h) * kHeadDim + v_base +
                                                    warp * 16 + o_part * 8;
        if (in_seq) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sm.out[warp][o_t][o_part * 8]);
      }
    }
    // The update must finish before S is read again and before the next iteration's barrier
    // lets a cp.async overwrite this stage.
    cute::warpgroup_wait<0>();
    fence_regs(r_S);
    if (j == next_ckpt) {
      next_ckpt += ckpt_period;
      const int64_t c = first_checkpoint(p, n) + (seg_chunk0 + j + 1) / ckpt_period - 1;
      void* base;
      ElemType type;
      int64_t offset;
      if (j < warm) {
        // A skipping run's warm-up: the checkpoint is the previous run's.
      } else if (seg.count == 1 && first_segment) {  // the whole sequence
        if (chunk_rows(j) == kChunk && checkpoint_target(p, c, h, base, type, offset))
          store_state_rows(r_S, base, type, offset, v_row, t4, rs.inv);
      } else if (!(run_to_end && j + 1 == num_chunks) && c < p.num_checkpoints) {  // inside a segment (its end: the chain)
        if (first_segment || warm > 0) {
          if (checkpoint_target(p, c, h, base, type, offset)) store_state_rows(r_S, base, type, offset, v_row, t4, rs.inv);
        } else if (transition_rows) {
          store_state_rows(r_S, p.seg_ckpt_a, ElemType::kF32, c * p.H * int64_t(kSegStateFloats) + head_offset,
                           v_row - kHeadDim, t4, rs.inv);
        } else {
          store_state_rows(r_S, p.seg_ckpt_b, ElemType::kF32, c * p.H * int64_t(kSegStateFloats) + head_offset,
                           v_row, t4, rs.inv);
        }
      }
    }
    if constexpr (Split::f16)
      if (j % kRenormChunks == 0) rs.renormalise(r_S);
    if constexpr (kEarlyHead) {
      if (++stage == kStages) stage = 0, phase ^= 1u;
      if constexpr (kSeg) seg_dst += seg_step;
      out_dst += out_step, out_token += kChunk;
    }
  }
  cp_async_wait_all();

  if (!run_to_end) {  // a run that ends inside its segment: which of its rows are not finite
    bool bad[2] = {false, false};
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) bad[e >> 1] = bad[e >> 1] || !isfinite(r_S[4 * j + e]);
    uint8_t* taint = p.seg_taint + (((seg.first + seg.s) * p.H + h) * p.max_pieces + run_start) * kTaintBytes;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const bool row_bad = __any_sync(0xfu << (lane & 28), bad[half]);
      if (t4 == 0) taint[v_row + 8 * half] = row_bad;
    }
  } else if (seg.count == 1 && first_segment) {  // the whole sequence: its final state
    if (p.final_state != nullptr) store_state_rows(r_S, p.final_state, p.final_state_type, state_base, v_row, t4, rs.inv);
  } else if (first_segment) {  // X_1, the start state of segment 1
    store_state_rows(r_S, p.seg_x, ElemType::kF32, (seg.first + 1) * p.H * int64_t(kSegStateFloats) + head_offset,
                     v_row, t4, rs.inv);
  } else if (transition_rows) {  // A_s^T (low rank: T^T in rows 0-63; the second block walked one chunk)
    if (lr_rank == 0 || lr_first)
      store_state_rows(r_S, p.seg_a, ElemType::kF32, (seg.first + seg.s) * p.H * int64_t(kSegStateFloats) + head_offset,
                       v_row - kHeadDim, t4, rs.inv);
  } else {  // B_s^T
    store_state_rows(r_S, p.seg_b, ElemType::kF32, (seg.first + seg.s) * p.H * int64_t(kSegStateFloats) + head_offset,
                     v_row, t4, rs.inv);
  }
}

// Both can launch early after K1 (launch_early, a candidate) and so wait for it before anything else.
template <int kWarps, class Split, bool kSeg, bool kBulk = false>
__global__ void __launch_bounds__(kWarps * 32) recur_kernel(const __grid_constant__ Params p) {
  wait_for_prerequisites();
  allow_dependents();
  if (pieces_ran(p)) return;
  recur_body<kWarps, Split, kSeg, 3, kBulk>(p);
}

// The segmented K2 at two CTAs an SM with low-rank transitions (internal::PrefillLaunch::
// lowrank_transitions, a candidate; config.h LowRankInfo), the bulk record stream.
template <class Split>
__global__ void __launch_bounds__(128) recur_seg_lowrank_kernel(const __grid_constant__ Params p) {
  wait_for_prerequisites();
  allow_dependents();
  if (pieces_ran(p)) return;
  recur_body<4, Split, true, 3, true, true>(p);
}

// The segmented K2 at three CTAs an SM (launch.cu seg_ctas_per_sm: the rule from H = 16 up): 168
// registers a thread, two stages.
constexpr int kSeg3Stages = 2;
template <class Split, bool kBulk = false>
__global__ void __launch_bounds__(128, 3) recur_seg3_kernel(const __grid_constant__ Params p) {
  wait_for_prerequisites();
  allow_dependents();
  if (pieces_ran(p)) return;
  recur_body<4, Split, true, kSeg3Stages, kBulk>(p);
}

}  // namespace flashkda::cuda::sm90::prefill
