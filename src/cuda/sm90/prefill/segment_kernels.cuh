// The two kernels that finish a segmented prefill (config.h "Segments") after the segmented K2:
//
// chain    grid (N * H, kHeadDim / kChainRows), block kChainThreads. Per sequence and head, in
//          segment order: X_{s+1}^T = X_s^T A_s^T + B_s^T (rows of X^T are independent, so each
//          CTA owns kChainRows of them, each of its 8 warps two n8 tiles of columns), the product on the tensor
//          cores with split tf32 operands (hi * hi + hi * lo + lo * hi, about fp32 accuracy)
//          accumulated in fp32 onto B_s^T; A_{s+1}^T and B_{s+1}^T come into the other of two
//          shared-memory buffers while step s computes;
//          X_1 comes from segment 0, the last product is the final state. With checkpoints it
//          writes those at segment starts X_s and at the end;
//          with checkpoints inside segments (p.seg_ckpt_b; otherwise the segment length divides
//          checkpoint_every and there are none) also X_s^T A_c^T + B_c^T for each checkpoint c
//          inside segment s > 0, from the partial transitions K2 stored (segment 0's: K2).
// combine  grid (max_segs * tiles * H), block kCombineThreads. For the tokens of segments s > 0:
//          out_t = o_zero_t + X_s^T w_t, the K = 128 product on the tensor cores with split-bf16
//          operands (hi * hi + hi * lo + lo * hi, about fp32 accuracy), rounded once to bf16.
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/early_launch.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/sm90/prefill/chunk_map.cuh"

namespace flashkda::cuda::sm90::prefill {

constexpr int kChainRows = 16;     // rows of X^T a CTA: one m16 tile
constexpr int kChainTiles = 2;      // n8 tiles a warp: columns 8 (warp + kChainWarps j), j < kChainTiles
constexpr int kChainWarps = kHeadDim / 8 / kChainTiles;  // 8
constexpr int kChainThreads = 32 * kChainWarps;
constexpr int kChainElems = 4 * kChainTiles;  // a thread's elements of the CTA's [16][128]: a C fragment a tile
constexpr int kChainAStride = kHeadDim + 8;  // floats per row of A^T in shared memory: conflict-free B fragments
constexpr int kChainXStride = kHeadDim + 4;  // floats per row of X^T (and of B^T): conflict-free A fragments
constexpr int kChainYStride = kLowRankRows + 4;
constexpr int kChainPreload = kChainThreads / kPlanWords;  // segments whose plans the chain loads up front, a word a thread
constexpr int kCombineChunks = 8;  // chunks per combine CTA, one warp each
constexpr int kCombineThreads = 32 * kCombineChunks;
constexpr int kCombineRowStride = kHeadDim + 8;  // bf16 per row of X^T in shared memory: 272 bytes, conflict-free
constexpr int kCombineStages = 3;   // a warp's ring of w's k-steps (cp.async): two in flight while one multiplies
constexpr int kCombineWStride = 24;  // floats per token row of a k-step's w (16 used): conflict-free float2 reads

// One step's operands: A^T (low rank: T^T, rows 0-63) and the CTA's rows of B^T.
struct ChainStep {
  float a[kHeadDim][kChainAStride];
  float b[kChainRows][kChainXStride];
};
struct ChainSmem {
  ChainStep step[2];  // the current step's and the next one's, in flight
  float x[kChainRows][kChainXStride];
  // The same X_s^T split once for the products (tf32 hi and lo bits) in the A fragments' order: k-step
  // ks, lane 4 g + t holds a0..a3 = (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4) of the step's 16 x 8.
  uint4 x_hi[kHeadDim / 8][32];
  uint4 x_lo[kHeadDim / 8][32];
};
constexpr int kChainYPartStride = kChunk + 4;  // floats per row of a partial of Y's G columns
struct ChainLowRankSmem : ChainSmem {
  float y[kChainRows][kChainYStride];  // Y_s^T = X_s^T G^T, this CTA's rows (low-rank transitions)
  // G's chunk rows [16][K] of a step, in the buffer of its step's operands (copied with them)
  float g[2][kChunk][kChainXStride];
  // Y's G columns, X_s^T G^T's [16][16], as four partial sums over quarters of K (lowrank_y_partial)
  float y_part[4][kChainRows][kChainYPartStride];
  LowRankInfo info[kChainPreload];  // the first segments' plans, loaded with the transition-skipping plans
};

// d += x a over one k-step of 8 (rows k and k + 4 of a, the thread's B fragment at column n; x: its A
// fragment, split), with a's elements split here: lo * hi and hi * lo first, then hi * hi.
__device__ __forceinline__ void chain_kstep(float (&d)[4], const uint32_t (&x_hi)[4], const uint32_t (&x_lo)[4],
                                            const float (*a)[kChainAStride], int k, int n) {
  uint32_t b_hi0, b_lo0, b_hi1, b_lo1;
  split_tf32(a[k][n], b_hi0, b_lo0);
  split_tf32(a[k + 4][n], b_hi1, b_lo1);
  mma_tf32(d, x_lo, b_hi0, b_hi1);
  mma_tf32(d, x_hi, b_lo0, b_lo1);
  mma_tf32(d, x_hi, b_hi0, b_hi1);
}

// First column of tile j of a warp (its n8 tiles lie kChainWarps tiles apart), and the tile's C fragment
// among a thread's kChainElems elements.
__device__ __forceinline__ int chain_tile_col(int warp, int j) { return 8 * (warp + kChainWarps * j); }
__device__ __forceinline__ float (&chain_tile(float (&acc)[kChainElems], int j))[4] {
  return *reinterpret_cast<float(*)[4]>(&acc[4 * j]);
}

// acc += x a for one warp's tiles of the CTA's rows: x [16][kK] (rows of X^T or Y^T), a [kK][128]
// (rows of A^T or T^T), on the tensor cores with split tf32 operands, the small products first.
// acc: the C fragments of the warp's n-tiles (chain_tile).
template <int kK, int kXStride>
__device__ __forceinline__ void chain_product(float (&acc)[kChainElems], const float (*x)[kXStride],
                                              const float (*a)[kChainAStride], int warp, int g, int t) {
#pragma unroll 4
  for (int ks = 0; ks < kK / 8; ++ks) {
    const int k = 8 * ks + t;
    const float xa[4] = {x[g][k], x[g + 8][k], x[g][k + 4], x[g + 8][k + 4]};
    uint32_t a_hi[4], a_lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) split_tf32(xa[r], a_hi[r], a_lo[r]);
#pragma unroll
    for (int j = 0; j < kChainTiles; ++j) chain_kstep(chain_tile(acc, j), a_hi, a_lo, a, k, chain_tile_col(warp, j) + g);
  }
}

// chain_product over X^T split once into its A fragments (ChainSmem::x_hi, x_lo; set_x), read once a
// k-step for all of the warp's tiles, with two accumulators a tile (even and odd k-steps, added at the
// end) so that a warp's MMAs form 2 kChainTiles dependent chains of 24.
__device__ __forceinline__ void chain_product_split(float (&acc)[kChainElems], const uint4 (*x_hi)[32],
                                                    const uint4 (*x_lo)[32], const float (*a)[kChainAStride],
                                                    int warp, int g, int t) {
  float odd[kChainElems] = {};
  const int lane = 4 * g + t;
#pragma unroll 4
  for (int ks = 0; ks < kHeadDim / 8; ++ks) {
    const uint4 h = x_hi[ks][lane], l = x_lo[ks][lane];
    const uint32_t a_hi[4] = {h.x, h.y, h.z, h.w};
    const uint32_t a_lo[4] = {l.x, l.y, l.z, l.w};
    float (&d)[kChainElems] = ks % 2 == 0 ? acc : odd;
#pragma unroll
    for (int j = 0; j < kChainTiles; ++j) chain_kstep(chain_tile(d, j), a_hi, a_lo, a, 8 * ks + t, chain_tile_col(warp, j) + g);
  }
#pragma unroll
  for (int i = 0; i < kChainElems; ++i) acc[i] += odd[i];
}

// Low-rank transitions: warp w's partial of X^T G^T ([16][16], G's chunk rows g [16][K]): its n8 tile
// w % 2 over the quarter w / 2 of K (four k-steps), on the tensor cores with X^T's split A fragments
// and G's elements split here (chain_kstep's products), into part[w / 2] (C fragment order: rows g and
// g + 8, columns 2 t, 2 t + 1 of the tile). g's rows are kChainXStride floats apart: a B fragment's
// lanes read rows 8 j + g at word 8 ks + t, conflict-free.
__device__ __forceinline__ void lowrank_y_partial(const uint4 (*x_hi)[32], const uint4 (*x_lo)[32],
                                                  const float (*gr)[kChainXStride],
                                                  float (*part)[kChainRows][kChainYPartStride], int warp, int g, int t) {
  const int tile = warp % 2, quarter = warp / 2, lane = 4 * g + t, n = 8 * tile + g;
  constexpr int kSteps = kHeadDim / 8 / 4;
  float d[4] = {};
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int ks = kSteps * quarter + i, k = 8 * ks + t;
    const uint4 h = x_hi[ks][lane], l = x_lo[ks][lane];
    const uint32_t a_hi[4] = {h.x, h.y, h.z, h.w};
    const uint32_t a_lo[4] = {l.x, l.y, l.z, l.w};
    uint32_t b_hi0, b_lo0, b_hi1, b_lo1;
    split_tf32(gr[n][k], b_hi0, b_lo0);
    split_tf32(gr[n][k + 4], b_hi1, b_lo1);
    mma_tf32(d, a_lo, b_hi0, b_hi1);
    mma_tf32(d, a_hi, b_lo0, b_lo1);
    mma_tf32(d, a_hi, b_hi0, b_hi1);
  }
  float (*q)[kChainYPartStride] = part[quarter];
  *reinterpret_cast<float2*>(&q[g][8 * tile + 2 * t]) = make_float2(d[0], d[1]);
  *reinterpret_cast<float2*>(&q[g + 8][8 * tile + 2 * t]) = make_float2(d[2], d[3]);
}

constexpr int kCombineLowRankStride = kLowRankRows + 8;  // bf16 per row of Y^T: 144 bytes, conflict-free

struct CombineSmem {
  __nv_bfloat16 x_hi[kHeadDim][kCombineRowStride];  // X_s^T [v][k], split
  __nv_bfloat16 x_lo[kHeadDim][kCombineRowStride];
  float w[kCombineChunks][kCombineStages][kChunk][kCombineWStride];  // each warp's ring: [stage][token][k]
};
struct CombineLowRankSmem : CombineSmem {
  __nv_bfloat16 y_hi[kHeadDim][kCombineLowRankStride];  // Y_s^T [v][i], split (low-rank transitions)
  __nv_bfloat16 y_lo[kHeadDim][kCombineLowRankStride];
};

// A warp's copy of k-step ks of w (kSteps of them; the fp32 w columns of o, from column kHeadDim,
// stride kSegRows: 16 tokens x 16 floats, 64 copies of 16 bytes, two a lane) into its ring, as one
// cp.async group, empty past the last k-step, so that wait_group<kCombineStages - 1> in
// combine_product always means "k-step ks has landed". The caller issues k-steps 0 .. kCombineStages - 2.
template <int kSteps>
__device__ __forceinline__ void copy_w(float (*ring)[kChunk][kCombineWStride], const float* o, int lane, int ks) {
  if (ks < kSteps) {
#pragma unroll
    for (int i = 0; i < kChunk * 4 / 32; ++i) {
      const int c = lane + 32 * i, t = c / 4, q = c % 4;
      cp_async_16(&ring[ks % kCombineStages][t][4 * q],
                  reinterpret_cast<const float4*>(o + t * kSegRows + kHeadDim + kMmaK * ks) + q);
    }
  }
  cp_async_commit();
}

// acc += w^T x over kSteps k-steps of 16 for one warp's 16 tokens (x: split bf16 [v][k] rows of
// kStride), with split-bf16 operands (hi * hi + hi * lo + lo * hi). w's k-steps come through the
// warp's ring (copy_w), two ahead of the one multiplied; __syncwarp makes each lane's copies the warp's.
template <int kSteps, int kStride>
__device__ __forceinline__ void combine_product(float (&acc)[16][4], const float* o,
                                                float (*ring)[kChunk][kCombineWStride],
                                                const __nv_bfloat16 (*x_hi)[kStride],
                                                const __nv_bfloat16 (*x_lo)[kStride], int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    copy_w<kSteps>(ring, o, lane, ks + kCombineStages - 1);  // into the stage k-step ks - 1 read (__syncwarp below)
    cp_async_wait_group<kCombineStages - 1>();
    __syncwarp();  // every lane's copies of k-step ks
    // A = w [16 t][16 k] of k-step ks: a0 (g, 2t4..), a1 (g+8, 2t4..), a2 (g, 2t4+8..), a3 (g+8, 2t4+8..).
    const float (*w)[kCombineWStride] = ring[ks % kCombineStages];
    uint32_t a_hi[4], a_lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 wr = *reinterpret_cast<const float2*>(&w[g + 8 * (r & 1)][2 * t4 + 8 * (r >> 1)]);
      split_bf16x2(wr.x, wr.y, a_hi[r], a_lo[r]);
    }
    __syncwarp();  // every lane has read k-step ks before the next iteration refills its stage
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int v = 8 * nt + g, k = kMmaK * ks + 2 * t4;
      const uint32_t bh0 = *reinterpret_cast<const uint32_t*>(&x_hi[v][k]);
      const uint32_t bh1 = *reinterpret_cast<const uint32_t*>(&x_hi[v][k + 8]);
      const uint32_t bl0 = *reinterpret_cast<const uint32_t*>(&x_lo[v][k]);
      const uint32_t bl1 = *reinterpret_cast<const uint32_t*>(&x_lo[v][k + 8]);
      mma_bf16(acc[nt], a_hi, bh0, bh1);
      mma_bf16(acc[nt], a_hi, bl0, bl1);
      mma_bf16(acc[nt], a_lo, bh0, bh1);
    }
  }
}

// Loads a [rows][cols] fp32 matrix into split bf16 shared rows of `stride` (every load first).
template <int kCols, int kStride>
__device__ __forceinline__ void load_split(const float* src, __nv_bfloat16 (*hi)[kStride], __nv_bfloat16 (*lo)[kStride]) {
  constexpr int kQuads = kHeadDim * kCols / 4 / kCombineThreads;
  const float4* x = reinterpret_cast<const float4*>(src);
  float4 xv[kQuads];
#pragma unroll
  for (int i = 0; i < kQuads; ++i) xv[i] = x[threadIdx.x + i * kCombineThreads];
#pragma unroll
  for (int i = 0; i < kQuads; ++i) {
    const int q = threadIdx.x + i * kCombineThreads, row = (4 * q) / kCols, col = (4 * q) % kCols;
    uint32_t hi0, lo0, hi1, lo1;
    split_bf16x2(xv[i].x, xv[i].y, hi0, lo0);
    split_bf16x2(xv[i].z, xv[i].w, hi1, lo1);
    *reinterpret_cast<uint2*>(&hi[row][col]) = make_uint2(hi0, hi1);
    *reinterpret_cast<uint2*>(&lo[row][col]) = make_uint2(lo0, lo1);
  }
}

// Fills value column v of the outputs of tokens [r0, r1) of head h with NaN (a non-finite state that
// a skipping run did not see).
__device__ __forceinline__ void poison_column(const Params& p, int64_t r0, int64_t r1, int h, int v) {
  const __nv_bfloat16 nan = __float2bfloat16(__int_as_float(0x7fc00000));
  for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x)
    static_cast<__nv_bfloat16*>(p.out)[(r * p.H + h) * kHeadDim + v] = nan;
}

__device__ __forceinline__ int64_t segment_matrix(const Params& p, int64_t gseg, int h) {
  return (gseg * p.H + h) * int64_t(kSegStateFloats);
}

// First segment and segment count of sequence n.
__device__ __forceinline__ void sequence_segments(const Params& p, int64_t n, int64_t& first, int64_t& count) {
  if (p.cu_seqlens == nullptr) {
    count = segments_of((p.seq_len + kChunk - 1) / kChunk, p.seg_chunks);
    first = n * count;
  } else {
    first = p.seg_start[n];
    count = p.seg_start[n + 1] - first;
  }
}

// kLowRank: the kernel that low-rank transitions take (internal::PrefillLaunch::lowrank_transitions, a
// candidate), so that the rule's keeps its code.
template <bool kLowRank>
__global__ void __launch_bounds__(kChainThreads, 1) segment_chain_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  using Smem = std::conditional_t<kLowRank, ChainLowRankSmem, ChainSmem>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  wait_for_prerequisites();  // K2 (launched early after it)
  allow_dependents();
  if (call_refused(p) || call_fused(p) || pieces_ran(p)) return;  // refused: K2 filled the outputs with NaN
  const int64_t n = blockIdx.x / p.H;
  const int h = int(blockIdx.x % p.H);
  int64_t first, count;
  sequence_segments(p, n, first, count);
  const bool runs = p.seg_exact != nullptr;  // transition skipping (config.h "Transition skipping")
  if (count <= 1 && !runs) return;  // K2 wrote the final state (and the checkpoints)
  const int64_t slot = state_slot(p, n);
  if (slot < 0) return;  // padding: K2 wrote the zero outputs
  // Checkpoint of the state after `tokens` tokens of the sequence, or -1.
  const SeqChunks sc = seq_chunks(p, n);
  const int64_t E = p.checkpoint_every, first_ckpt = E > 0 ? first_checkpoint(p, n) : 0;
  auto checkpoint_at = [&](int64_t tokens) { return E > 0 && tokens % E == 0 ? first_ckpt + tokens / E - 1 : -1; };
  const bool final_checkpoint = checkpoint_at(sc.eos - sc.bos) >= 0;

  const int tid = threadIdx.x;
  const int v0 = blockIdx.y * kChainRows;  // this CTA's rows of X^T
  // This thread's elements e of the CTA's rows: those of its warp's C fragments (mma.cuh), tile e / 4:
  // row g (e % 4 < 2) or g + 8, column chain_tile_col(warp, e / 4) + 2 t + e % 2 (g = lane / 4, t = lane % 4).
  const int warp = tid / 32, frag_g = (tid % 32) / 4, frag_t = tid % 4;
  auto erow = [&](int e) { return frag_g + 8 * ((e % 4) / 2); };
  auto ecol = [&](int e) { return chain_tile_col(warp, e / 4) + 2 * frag_t + e % 2; };
  constexpr int kQuads = kHeadDim * kHeadDim / 4;
  const int64_t state_base = state_offset(p, slot, h);
  const int64_t seg_tokens = p.seg_chunks * kChunk;
  // Chunks of segment s.
  auto seg_len = [&](int64_t s) { return min(sc.chunk_end - sc.chunk_begin - s * p.seg_chunks, p.seg_chunks); };

  // Transition skipping: the first kChainPreload segments' exact-run lengths and plan words, loaded
  // once here (one round trip) instead of at every step; later segments read them where used.
  __shared__ int32_t s_exact[kChainPreload];
  __shared__ uint32_t s_plan[kChainPreload][kPlanWords];
  const int64_t preloaded = runs ? min(count, int64_t(kChainPreload)) : 0;
  if (tid < preloaded * kPlanWords) {
    const int64_t gs = (first + tid / kPlanWords) * p.H + h;
    s_plan[tid / kPlanWords][tid % kPlanWords] = p.seg_plan[gs * kPlanWords + tid % kPlanWords];
    if (tid % kPlanWords == 0) s_exact[tid / kPlanWords] = p.seg_exact[gs];
  }
  if constexpr (kLowRank) {  // and their low-rank plans, 16 bytes a thread
    constexpr int kWords = sizeof(LowRankInfo) / 16;
    if (tid < preloaded * kWords)
      reinterpret_cast<uint4*>(sm.info)[tid] =
          reinterpret_cast<const uint4*>(p.seg_lowrank + (first + tid / kWords) * p.H + h)[tid % kWords];
  }
  auto exact_of = [&](int64_t s) -> int64_t { return s < preloaded ? s_exact[s] : p.seg_exact[(first + s) * p.H + h]; };
  auto plan_word = [&](int64_t s, int w) -> uint32_t {
    return s < preloaded ? s_plan[s][w] : p.seg_plan[((first + s) * p.H + h) * kPlanWords + w];
  };
  // Segment s's transition (A_s^T, or its low-rank T^T) and this CTA's rows of B_s^T into L2, two
  // steps ahead (K2's later stores may have evicted them; the copy into shared memory is issued a
  // step ahead): 64 threads a 128-byte line each of the CTA's eighth of A_s^T, 64 of its rows of B_s^T.
  auto prefetch_step = [&](int64_t s) {
    if (s >= count) return;
    constexpr int kLines = kSegStateFloats * 4 / 128 / (kHeadDim / kChainRows);  // 64
    const int64_t len = seg_len(s);
    const bool needs_a = !runs || exact_of(s) >= len;  // else X_{s+1} = B_s (below)
    const float* a = p.seg_a + segment_matrix(p, first + s, h) + int64_t(blockIdx.y) * kLines * 32;
    const float* b = p.seg_b + segment_matrix(p, first + s, h) + int64_t(v0) * kHeadDim;
    if (tid < kLines) {
      if (needs_a) prefetch_l2(a + tid * 32);
    } else if (tid < 2 * kLines) {
      prefetch_l2(b + (tid - kLines) * 32);
    }
  };
  __syncthreads();  // the preloaded plans
  prefetch_step(2);

  // Transition skipping: the first chunk of segment s (from its start) after which the recurrence's
  // state row v0 + r is not finite, for this CTA's rows (INT64_MAX: none), where a skipping run
  // would not carry it: the end of a run that ends inside the segment with the row not finite, or,
  // where the exact run ends inside the segment (or the segment starts skipping), its end if X_s's
  // row or the transition is not finite. Those rows are NaN in X_{s+1} and in the outputs after it.
  __shared__ int64_t s_taint[kChainRows];
  __shared__ bool s_any_taint;
  auto find_taint = [&](int64_t s) {
    {  // nothing to find where the segment is one exact run (every thread reads the same words)
      const int64_t len = seg_len(s);
      uint32_t runs_inside = exact_of(s) < len;
#pragma unroll
      for (int w = 0; w < kPlanWords; ++w) runs_inside |= plan_word(s, w);
      if (runs_inside == 0) return false;
    }
    if (tid == 0) s_any_taint = false;
    __syncthreads();
    if (tid < kChainRows) {  // row tid
      const int64_t gs = (first + s) * p.H + h;
      const int64_t len = seg_len(s);
      const int pieces = int(pieces_of(len, p.run_chunks));
      const int64_t exact = exact_of(s);
      const uint8_t* taint = p.seg_taint + gs * p.max_pieces * kTaintBytes;
      auto starts_run = [&](int i) { return (plan_word(s, i / 32) >> (i % 32)) & 1u; };
      int64_t t = INT64_MAX;
      if (s > 0 && exact < len) {
        // Every load issued at once (no early exit): X_s's row by 16-byte words, the transition rows'
        // taint bytes by 16.
        bool bad = false;
#pragma unroll 8
        for (int k = 0; k < kHeadDim; k += 4) {
          const float4 x = *reinterpret_cast<const float4*>(&sm.x[tid][k]);
          bad |= !isfinite(x.x) | !isfinite(x.y) | !isfinite(x.z) | !isfinite(x.w);
        }
        if (exact > 0) {
          const uint4* words = reinterpret_cast<const uint4*>(taint + kHeadDim);
          uint32_t any = 0;
#pragma unroll
          for (int i = 0; i < (kSegRows - kHeadDim) / 16; ++i) {
            const uint4 w = words[i];
            any |= w.x | w.y | w.z | w.w;
          }
          bad |= any != 0;
        }
        if (bad) t = exact;
      }
      for (int i = 0; i < pieces;) {  // the runs in order; the last one ends at the segment's end
        int next = i + 1;
        while (next < pieces && !starts_run(next)) ++next;
        if (next == pieces) break;
        if (taint[int64_t(i) * kTaintBytes + v0 + tid] != 0) {
          t = min(t, next * p.run_chunks);
          break;
        }
        i = next;
      }
      s_taint[tid] = t;
      if (t != INT64_MAX) s_any_taint = true;
    }
    __syncthreads();
    if (!s_any_taint) return false;
    const int64_t bos = sc.bos + s * seg_tokens, eos = min(sc.eos, bos + seg_tokens);
    for (int r = 0; r < kChainRows; ++r)
      if (s_taint[r] != INT64_MAX) poison_column(p, min(eos, bos + s_taint[r] * kChunk), eos, h, v0 + r);
    return true;
  };
  auto tainted = [&](int e) { return s_taint[erow(e)] != INT64_MAX; };  // element e's row
  // ... and the checkpoints K2 wrote inside segment s after chunk `from` of it (segment 0, skipping
  // runs) in those rows, where the state before them is not finite: NaN (with_end: also one at the
  // segment's end, which K2 wrote in a one-segment sequence).
  auto taint_checkpoints = [&](int64_t s, int64_t from, bool with_end) {
    if (E == 0) return;
    const int64_t begin = s * seg_tokens, end = min(sc.eos - sc.bos, begin + seg_tokens);
    for (int64_t t = (begin / E + 1) * E; t < end || (with_end && t == end); t += E) {
      const int64_t ck = checkpoint_at(t), pos = (t - begin) / kChunk;
      void* base;
      ElemType type;
      int64_t offset;
      if (pos <= from || !checkpoint_target(p, ck, h, base, type, offset)) continue;
      for (int e = 0; e < kChainElems; ++e)
        if (s_taint[erow(e)] <= pos)
          store_state_elem(base, type, offset + int64_t(v0 + erow(e)) * kHeadDim + ecol(e),
                           __int_as_float(0x7fc00000));
    }
  };

  if (count <= 1) {  // transition skipping in a one-segment sequence: K2 wrote the final state
    if (!find_taint(0)) return;
    taint_checkpoints(0, 0, true);
    if (p.final_state == nullptr) return;
    for (int e = 0; e < kChainElems; ++e)
      if (tainted(e))
        store_state_elem(p.final_state, p.final_state_type, state_base + int64_t(v0 + erow(e)) * kHeadDim + ecol(e),
                         __int_as_float(0x7fc00000));
    return;
  }
  // Writes this thread's elements of a state (x[e]: element e) into checkpoint `ckpt`.
  auto store_checkpoint = [&](int64_t ckpt, const float (&x)[kChainElems]) {
    void* base;
    ElemType type;
    int64_t offset;
    if (!checkpoint_target(p, ckpt, h, base, type, offset)) return;
    for (int e = 0; e < kChainElems; ++e)
      store_state_elem(base, type, offset + int64_t(v0 + erow(e)) * kHeadDim + ecol(e), x[e]);
  };
  // X_s^T's element (r, c) in both forms: fp32, and split in the A fragments' order for the products.
  auto set_x = [&](int r, int c, float v) {
    uint32_t hi, lo;
    split_tf32(v, hi, lo);
    sm.x[r][c] = v;
    const int ks = c / 8, lane = 4 * (r % 8) + c % 4, reg = r / 8 + 2 * ((c % 8) / 4);
    reinterpret_cast<uint32_t*>(&sm.x_hi[ks][lane])[reg] = hi;
    reinterpret_cast<uint32_t*>(&sm.x_lo[ks][lane])[reg] = lo;
  };
  bool lowrank = false;
  // Segment s's low-rank plan (low-rank transitions), and whether step s's transition is low rank (K2
  // writes the plan only where the segment has an exact run).
  auto lowrank_info = [&](int64_t s) -> const LowRankInfo& {
    if constexpr (kLowRank)
      if (s < preloaded) return sm.info[s];
    return p.seg_lowrank[(first + s) * p.H + h];
  };
  auto lowrank_at = [&](int64_t s) {
    return kLowRank && s < count && (runs ? exact_of(s) : seg_len(s)) > 0 && lowrank_info(s).rank > 0;
  };
  // G's chunk rows (low-rank transitions) into buffer `buf`, in the caller's cp.async group.
  auto copy_g = [&](int buf, const float* g) {
    if constexpr (kLowRank)
      for (int i = tid; i < kChunk * kHeadDim / 4; i += kChainThreads)
        cp_async_16(&sm.g[buf][i / (kHeadDim / 4)][4 * (i % (kHeadDim / 4))], reinterpret_cast<const float4*>(g) + i);
  };
  // A step's operands into buffer `buf` as one cp.async group: a's rows (the first 64 where half: a
  // low-rank transition's T^T), this CTA's rows of b, and G's chunk rows where g is given (a low-rank
  // step copied ahead, whose coordinates then find them there).
  auto copy_step = [&](int buf, const float* a, const float* b, bool half, const float* g) {
    for (int i = tid; i < (half ? kQuads / 2 : kQuads); i += kChainThreads)
      cp_async_16(&sm.step[buf].a[i / (kHeadDim / 4)][4 * (i % (kHeadDim / 4))], reinterpret_cast<const float4*>(a) + i);
    const float4* b_rows = reinterpret_cast<const float4*>(b + int64_t(v0) * kHeadDim);
    for (int i = tid; i < kChainRows * kHeadDim / 4; i += kChainThreads)
      cp_async_16(&sm.step[buf].b[i / (kHeadDim / 4)][4 * (i % (kHeadDim / 4))], b_rows + i);
    if (g != nullptr) copy_g(buf, g);
    cp_async_commit();
  };
  // Step s's operands copied ahead into buffer `buf` (a: its transition, copied_ahead(s)).
  auto copy_ahead = [&](int buf, int64_t s, const float* a) {
    const bool half = lowrank_at(s);
    const int64_t gs = (first + s) * p.H + h;
    copy_step(buf, a, p.seg_b + segment_matrix(p, first + s, h), half,
              half ? p.seg_g + gs * kLowRankGFloats : nullptr);
  };
  // The transition of step s's own product (A_s^T, or T_s^T where low rank), or null where it has
  // none or it is not copied ahead: its transition skipped, the chain stopping before it.
  auto copied_ahead = [&](int64_t s) -> const float* {
    if (s >= count) return nullptr;
    if (s + 1 == count && p.final_state == nullptr && !final_checkpoint) return nullptr;
    if (runs && exact_of(s) < seg_len(s)) return nullptr;
    return p.seg_a + segment_matrix(p, first + s, h);
  };
  const float* ahead = copied_ahead(1);  // the step copied ahead (its A^T; null: none) and its buffer
  int ahead_buf = 0;
  if (ahead != nullptr) copy_ahead(ahead_buf, 1, ahead);
  for (int i = tid; i < kChainRows * kHeadDim; i += kChainThreads)
    set_x(i / kHeadDim, i % kHeadDim, p.seg_x[segment_matrix(p, first + 1, h) + int64_t(v0) * kHeadDim + i]);
  if (runs && find_taint(0)) {  // X_1's tainted rows NaN here and for the combine of segment 1
    taint_checkpoints(0, 0, false);
    for (int e = 0; e < kChainElems; ++e)
      if (tainted(e)) {
        set_x(erow(e), ecol(e), __int_as_float(0x7fc00000));
        p.seg_x[segment_matrix(p, first + 1, h) + int64_t(v0 + erow(e)) * kHeadDim + ecol(e)] =
            __int_as_float(0x7fc00000);
      }
  }
  __syncthreads();
  if (checkpoint_at(seg_tokens) >= 0) {
    float x1[kChainElems];
    for (int e = 0; e < kChainElems; ++e) x1[e] = sm.x[erow(e)][ecol(e)];
    store_checkpoint(checkpoint_at(seg_tokens), x1);
  }
  float acc[kChainElems];  // element e: acc[e], the C fragments (erow, ecol)
  // acc = this thread's elements of b, a [V][K] B^T matrix in global memory (this CTA's rows)
  auto load_b = [&](const float* b) {
    b += int64_t(v0) * kHeadDim;
#pragma unroll
    for (int e = 0; e < kChainElems; ++e) acc[e] = b[erow(e) * kHeadDim + ecol(e)];
  };
  // acc = this thread's elements of X_s^T a^T + b^T (a, b: [K][K] A^T and [V][K] B^T matrices), or
  // with a low-rank transition (lowrank) Y_s^T a^T + b^T over a's first 64 rows (T^T). Operands copied
  // ahead are in their buffer; others come now, into the buffer not holding them. next_a: the next
  // step's (next_s) own transition (copied_ahead), whose operands are copied into the buffer this
  // product does not read.
  auto affine = [&](const float* a, const float* b, const float* next_a, int64_t next_s) {
    __syncthreads();  // the previous product's reads of sm.x and of both buffers are done
    int cur;
    if (a == ahead) {
      cur = ahead_buf;
      ahead = nullptr;
    } else {
      cur = ahead != nullptr ? ahead_buf ^ 1 : 0;  // a step copied ahead keeps its buffer
      copy_step(cur, a, b, lowrank, nullptr);
    }
    if (next_a != nullptr) {
      if (ahead != nullptr) cp_async_wait_all();  // a copy ahead that no step took (not reached)
      ahead = next_a, ahead_buf = cur ^ 1;
      copy_ahead(ahead_buf, next_s, next_a);
      cp_async_wait_group<1>();  // every group but the one just issued
    } else {
      cp_async_wait_all();
    }
    __syncthreads();
    const ChainStep& st = sm.step[cur];
#pragma unroll
    for (int e = 0; e < kChainElems; ++e) acc[e] = st.b[erow(e)][ecol(e)];
    if constexpr (kLowRank)
      if (lowrank) {
        chain_product<kLowRankRows>(acc, sm.y, st.a, warp, frag_g, frag_t);
        return;
      }
    chain_product_split(acc, sm.x_hi, sm.x_lo, st.a, warp, frag_g, frag_t);
  };
  // Low-rank transitions: Y_s^T = X_s^T G^T for step s, this CTA's rows (the kept channels' columns of
  // X_s^T, then its products with G's chunk rows on the tensor cores, zero past the rank) into sm.y and
  // the workspace for the combine. G came with the step's operands where they were copied ahead, else
  // it comes now into the buffer that no copy ahead holds.
  auto coordinates = [&](int64_t s) {
    if constexpr (kLowRank) {
      const int64_t gs = (first + s) * p.H + h;
      const LowRankInfo& info = lowrank_info(s);
      const int rank = info.rank, kept = rank - kChunk;
      const bool with_step = ahead != nullptr && ahead == p.seg_a + segment_matrix(p, first + s, h);
      const int buf = with_step ? ahead_buf : ahead != nullptr ? ahead_buf ^ 1 : 0;
      if (!with_step) {  // nothing reads sm.g between a step's coordinates and the next one's
        copy_g(buf, p.seg_g + gs * kLowRankGFloats);
        cp_async_commit();
      }
      cp_async_wait_all();
      __syncthreads();  // G, and X_s's split fragments (set_x at the previous step's end), for every warp
      lowrank_y_partial(sm.x_hi, sm.x_lo, sm.g[buf], sm.y_part, warp, frag_g, frag_t);
      __syncthreads();  // the partials (the previous product's reads of sm.y ended before set_x)
      for (int e = tid; e < kChainRows * kLowRankRows; e += kChainThreads) {
        const int r = e / kLowRankRows, i = e % kLowRankRows, c = i - kept;
        float y = 0.f;
        if (i < kept)
          y = sm.x[r][info.j[i]];
        else if (i < rank)
          y = ((sm.y_part[0][r][c] + sm.y_part[1][r][c]) + sm.y_part[2][r][c]) + sm.y_part[3][r][c];
        sm.y[r][i] = y;
        p.seg_y[gs * kLowRankYFloats + int64_t(v0 + r) * kLowRankRows + i] = y;
      }
    }
  };
  for (int64_t s = 1; s < count; ++s) {
    const bool last = s + 1 == count;
    // With transition skipping, a segment whose exact run ends inside it: X_{s+1} = its last run's
    // end state (B_s), which owes nothing to X_s; the rows a non-finite state reaches are NaN.
    const int64_t len = seg_len(s);
    const int64_t exact = runs ? exact_of(s) : len;  // chunks of the exact run
    prefetch_step(s + 2);
    const bool any_taint = runs && find_taint(s);  // before X_s is replaced
    lowrank = lowrank_at(s);
    if (lowrank) coordinates(s);
    if (p.seg_ckpt_b != nullptr && E > 0) {  // checkpoints inside the exact run: X_s^T A_c^T + B_c^T
      const int64_t begin = s * seg_tokens, end = last ? sc.eos - sc.bos : (s + 1) * seg_tokens;
      for (int64_t t = (begin / E + 1) * E; t < end && (t - begin) / kChunk <= exact; t += E) {
        const int64_t ck = checkpoint_at(t);
        if (ck < 0 || ck >= p.num_checkpoints) continue;
        affine(p.seg_ckpt_a + segment_matrix(p, ck, h), p.seg_ckpt_b + segment_matrix(p, ck, h), nullptr, 0);
        store_checkpoint(ck, acc);
      }
      if (any_taint) taint_checkpoints(s, exact, false);  // the skipping runs' (K2)
    }
    const bool skipped = exact < len;
    if (last && p.final_state == nullptr && !final_checkpoint) break;
    if (skipped) {
      load_b(p.seg_b + segment_matrix(p, first + s, h));
    } else {
      const float* next_a = copied_ahead(s + 1);
      affine(p.seg_a + segment_matrix(p, first + s, h), p.seg_b + segment_matrix(p, first + s, h), next_a, s + 1);
    }
    if (any_taint)
#pragma unroll
      for (int e = 0; e < kChainElems; ++e)
        if (tainted(e)) acc[e] = __int_as_float(0x7fc00000);
    __syncthreads();  // every thread has read sm.x for this step
#pragma unroll
    for (int e = 0; e < kChainElems; ++e) {
      const int64_t idx = int64_t(v0 + erow(e)) * kHeadDim + ecol(e);
      const float x = acc[e];
      set_x(erow(e), ecol(e), x);
      if (!last) p.seg_x[segment_matrix(p, first + s + 1, h) + idx] = x;
      else if (p.final_state != nullptr) store_state_elem(p.final_state, p.final_state_type, state_base + idx, x);
    }
    const int64_t ckpt = checkpoint_at(last ? sc.eos - sc.bos : (s + 1) * seg_tokens);
    if (ckpt >= 0) store_checkpoint(ckpt, acc);
  }
  cp_async_wait_all();  // nothing in flight into shared memory when the CTA exits (every copy ahead is taken)
}

// Every global load of a phase is issued before its first use (X_s: 16 float4 per thread; w: by
// cp.async into each warp's ring, its first two k-steps before X_s's loads and then two ahead of the
// product; o_zero: half a chunk at a time).
// kLowRank: as the chain's.
// One item b = tile * H + h (tile: a segment's kCombineChunks-chunk tile); every condition that ends
// it early is the CTA's (uniform), but for a warp without a chunk after the CTA's barrier.
template <bool kLowRank>
__device__ __forceinline__ void combine_item(const Params& p, uint8_t* smem_raw, int64_t tiles, unsigned b) {
  CombineSmem& sm = *reinterpret_cast<CombineSmem*>(smem_raw);
  const int h = int(b % p.H);
  const int64_t tile = b / p.H;
  SegmentRef seg;
  if (!locate_segment(p, tile / tiles, seg) || seg.s == 0) return;  // segment 0 wrote its outputs
  if (state_slot(p, seg.n) < 0) return;  // padding: K2 wrote zero outputs
  const SeqChunks sc = segment_chunks(p, seq_chunks(p, seg.n), seg.s);
  const int64_t j0 = (tile % tiles) * kCombineChunks;
  if (sc.chunk_begin + j0 >= sc.chunk_end) return;
  // Transition skipping: only the chunks of the segment's exact run need X_s (K2 wrote the others;
  // the run length is a multiple of the tile's, kCombineChunks).
  if (p.seg_exact != nullptr && j0 >= p.seg_exact[(seg.first + seg.s) * p.H + h]) return;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t slot = sc.chunk_begin + j0 + warp;  // this warp's chunk, if it has one
  const bool has_chunk = slot < sc.chunk_end;
  const float* o = p.seg_out + (slot * p.H + h) * int64_t(kSegOutFloats);  // [t][o_zero 128 | w 128]
  // w's first k-steps, in flight while X_s comes (every warp's product has two k-steps or more)
  static_assert(kLowRankRows / kMmaK >= kCombineStages - 1, "the prologue's k-steps are every product's");
  if (has_chunk) {
#pragma unroll
    for (int ks = 0; ks < kCombineStages - 1; ++ks) copy_w<kKSteps>(sm.w[warp], o, lane, ks);
  }

  // X_s^T as split bf16, [v][k] (B operand of the token x value product: B[k][v] = X^T[v][k]); with a
  // low-rank transition Y_s^T [v][i] for the chunks after the segment's first, X_s^T for that one.
  const int64_t gs = (seg.first + seg.s) * p.H + h;
  const bool lowrank = kLowRank && p.seg_lowrank[gs].rank > 0;
  if (!lowrank || j0 == 0) load_split<kHeadDim, kCombineRowStride>(p.seg_x + segment_matrix(p, seg.first + seg.s, h), sm.x_hi, sm.x_lo);
  if (lowrank) {
    CombineLowRankSmem& lr = *reinterpret_cast<CombineLowRankSmem*>(smem_raw);
    load_split<kLowRankRows, kCombineLowRankStride>(p.seg_y + gs * kLowRankYFloats, lr.y_hi, lr.y_lo);
  }
  __syncthreads();
  if (!has_chunk) return;
  const int64_t row0 = sc.bos + (j0 + warp) * kChunk;
  const int64_t left = sc.eos - row0;
  const int rows = int(left < kChunk ? left : kChunk);

  float acc[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
  if (lowrank && j0 + warp > 0) {
    const CombineLowRankSmem& lr = *reinterpret_cast<const CombineLowRankSmem*>(smem_raw);
    combine_product<kLowRankRows / kMmaK, kCombineLowRankStride>(acc, o, sm.w[warp], lr.y_hi, lr.y_lo, lane);
  } else {
    combine_product<kKSteps, kCombineRowStride>(acc, o, sm.w[warp], sm.x_hi, sm.x_lo, lane);
  }
  // acc[nt][e]: token g + 8 * (e >> 1), value 8 * nt + 2 * t4 + (e & 1).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = g + 8 * half;
    float2 z[16];
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) z[nt] = *reinterpret_cast<const float2*>(o + t * kSegRows + 8 * nt + 2 * t4);
    if (t >= rows) continue;
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + ((row0 + t) * p.H + h) * kHeadDim;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
      *reinterpret_cast<uint32_t*>(dst + 8 * nt + 2 * t4) =
          pack_bf16x2(z[nt].x + acc[nt][2 * half], z[nt].y + acc[nt][2 * half + 1]);
  }
}

// One CTA an item (blockIdx.x). (A wave of CTAs taking the items from a counter after the few-head
// pieces, whose one-a-CTA grid only reads the flag there, measured slower with long memory in run 170
// and was dropped: DESIGN.md "Few heads: the fused kernel in pieces".)
template <bool kLowRank>
__global__ void __launch_bounds__(kCombineThreads, 2) segment_combine_kernel(const __grid_constant__ Params p,
                                                                             int64_t tiles) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  wait_for_prerequisites();  // the chain (launched early after it)
  if (call_refused(p) || call_fused(p) || pieces_ran(p)) return;
  combine_item<kLowRank>(p, smem_raw, tiles, blockIdx.x);
}

}  // namespace flashkda::cuda::sm90::prefill
