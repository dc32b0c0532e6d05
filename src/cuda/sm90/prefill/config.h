// Constants and the workspace layout shared by the prefill kernels (K0 scan, K1 prepare,
// K2 recurrence) and their host launcher. Defined once here; every other file includes this.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkda/config.h"
#include "flashkda/types.h"

namespace flashkda::cuda::sm90::prefill {

constexpr int kChunk = flashkda::kChunk;         // tokens per chunk (docs/SPEC.md §4)
constexpr int kHeadDim = flashkda::kCudaHeadDim;  // K = V = 128
constexpr int kMmaK = 16;       // k extent of one m16n8k16 MMA
constexpr int kKSteps = kHeadDim / kMmaK;  // MMA k-steps over one head dimension

// One chunk of one head in the workspace, written by K1 and read by K2: 23040 bytes in the
// precise and balanced modes, 13824 in the fast mode (RecordLayout below).
//
// The three 16x128 operands of K2's warpgroup MMAs (wgmma, docs/notes/wgmma.md) are stored in the
// canonical no-swizzle shared-memory layouts those instructions read, so K2 copies the record
// into shared memory unchanged and points a descriptor at it. A "core matrix" is 8 rows x 16
// bytes (8 bf16 along the contiguous dimension), 128 contiguous bytes.
//  - WO tile: B operands of W^T = S^T k_decayed^T and O^T = S^T [q_decayed | q_decayed_lo]^T (rows n = 16 * which + t,
//    K = 128 channels c, K-major; W reads rows 0..15, O rows 16..). Element (which, t, c) at
//        kWoLbo * (c / 8) + 128 * (2 * which + t / 8) + 16 * (t % 8) + 2 * (c % 8)
//    i.e. LBO (next 8 channels) = 256 bytes per operand (768 B with q_decayed split, 512 B without), SBO (next 8
//    rows) = 128 B; which = 0 k_decayed, 1 q_decayed, 2 (q_decayed split only) the bf16 remainder of
//    q_decayed. k-step s (channels 16s..16s+15) starts at 2 * kWoLbo * s.
//  - Kr tiles (k_restored and, where the policy splits the factors, its remainder): B operand of the state update
//    S^T += U^T Kr (N = 128 channels, K = 16 tokens), MN-major (channels contiguous). Element
//    (t, c) at
//        2048 * (t / 8) + 128 * (c / 8) + 16 * (t % 8) + 2 * (c % 8)
//    i.e. LBO (next 8 tokens) = 2048 B, SBO (next 8 channels) = 128 B.
//  - gamma: exp(G_C) per channel, fp32.
//  - Mqk and inv_b = (I+L)^-1 diag(b), and (factors split) their remainders: 16x16 B operands of
//    per-warp m16n8k16 MMAs in fragment order (16-byte unit `lane` holds lane's four bf16x2
//    registers).
// In both big layouts a 16-byte granule is 8 consecutive channels of one token, and K1's lane l
// (channels 4l..4l+3) writes half of one with an 8-byte store.
//
// The precise mode also reads the bf16 remainders x - bf16(x) of k_restored, q_decayed, inv_b and
// Mqk. With one key repeated and little decay, bf16 rounding of k_restored or inv_b writes noise
// into state directions that neither the delta rule nor the gate ever removes (measured 2.7e-2
// rel-RMS at 16384 tokens), and the output is a sum of two nearly cancelling terms, S q_decayed^T
// and Mqk U, so bf16 rounding of q_decayed and Mqk is amplified (an fp64 simulation: 3.5e-3 with
// both rounded, 1.7e-3 with both split, against a 1.65e-3 floor from rounding the output to bf16).
// The balanced mode reads the same record and rounds only the state S in K2 (the simulation puts
// the repeated key at 2.3e-3 / 2.5e-4 that way, 2.9e-3 with q_decayed rounded too); the fast mode
// reads no remainder. A record holds only the remainders its mode reads, and every value it holds
// is the bf16 rounding that the precise record stores as the hi part.
constexpr int kTileBytes = kChunk * kHeadDim * 2;      // 4096: one bf16 16x128 operand
constexpr int kSmallTileBytes = kChunk * kChunk * 2;   // 512: Mqk, inv_b
constexpr int kGammaBytes = kHeadDim * 4;              // 512: exp(G_C) per channel, fp32
constexpr int kKrLbo = 2048, kKrSbo = 128;

// The precision policy of one prefill mode (docs/DESIGN.md "Precision as an option"): which
// operands of the recurrence's tensor-core products are split into bf16 hi + lo (the rest are
// rounded to bf16). K1 writes the remainders of the record operands a policy splits, K2 reads
// them and splits its register operands.
//   state      S^T, the A operand of W^T = S^T kd^T and O^T = S^T qd^T (K2 registers)
//   q_decayed  q_decayed in O^T (record: a third WO operand)
//   factors    u and U (K2 registers), inv_b, Mqk and k_restored (record remainders): the
//              operands the state's accuracy needs (a repeated key writes the rounding noise of
//              k_restored or inv_b into state directions nothing removes)
//   f16        S, k_decayed and q_decayed rounded to fp16 instead of bf16 (the W and O products on
//              f16 x f16 wgmma; unsplit, so with state = q_decayed = false), S under the row-scale
//              range guard of recur_kernel.cuh (RowScale): the precise mode where q and k are
//              L2-normalised (launch.cu runs_f16)
template <bool kState, bool kQDecayed, bool kFactors, bool kF16 = false>
struct SplitPolicy {
  static constexpr bool state = kState, q_decayed = kQDecayed, factors = kFactors, f16 = kF16;
  static_assert(!kF16 || (!kState && !kQDecayed), "fp16 operands are not split");
};
using PreciseSplit = SplitPolicy<true, true, true>;     // Precision::kPrecise without L2-normalised q, k
using BalancedSplit = SplitPolicy<false, true, true>;   // Precision::kBalanced: the PreciseSplit record
using FastSplit = SplitPolicy<false, false, false>;     // Precision::kFast
using F16Split = SplitPolicy<false, false, true, true>;  // Precision::kPrecise with L2-normalised q, k
// Every policy the launcher dispatches to (launch.cu with_split): X(policy) for each, so the
// instantiation units list them once.
#define FLASHKDA_PREFILL_SPLITS(X) X(FastSplit) X(BalancedSplit) X(PreciseSplit) X(F16Split)

template <class Split>
struct RecordLayout {
  static constexpr int kWoOperands = Split::q_decayed ? 3 : 2;  // k_decayed | q_decayed [| q_decayed_lo]
  static constexpr int kWoLbo = 2 * 128 * kWoOperands;          // 768 / 512
  static constexpr int kWoSbo = 128;
  static constexpr int kWoStepBytes = 2 * kWoLbo;
  static constexpr int kWoTileBytes = kWoOperands * kTileBytes;
  static constexpr int kKrTiles = Split::factors ? 2 : 1;  // k_restored [| k_restored_lo]

  static constexpr int kOffWo = 0;
  static constexpr int kOffKRestored = kOffWo + kWoTileBytes;
  static constexpr int kOffKRestoredLo = kOffKRestored + kTileBytes;  // factors split only
  static constexpr int kOffGamma = kOffKRestored + kKrTiles * kTileBytes;
  static constexpr int kOffMqk = kOffGamma + kGammaBytes;
  static constexpr int kOffInvB = kOffMqk + kSmallTileBytes;
  static constexpr int kOffMqkLo = kOffInvB + kSmallTileBytes;   // factors split only
  static constexpr int kOffInvBLo = kOffMqkLo + kSmallTileBytes;  // factors split only
  static constexpr int kBytes = Split::factors ? kOffInvBLo + kSmallTileBytes : kOffInvB + kSmallTileBytes;

  // Byte offset of the granule half (8 bytes: channels 4l'..4l'+3 with l' = c / 4) holding
  // channel c of token t of WO operand `which`.
  __host__ __device__ static constexpr int wo_offset(int which, int t, int c) {
    return kWoLbo * (c / 8) + kWoSbo * (2 * which + t / 8) + 16 * (t % 8) + 2 * (c % 8);
  }
};
using PreciseRecord = RecordLayout<PreciseSplit>;
using BalancedRecord = RecordLayout<BalancedSplit>;
using FastRecord = RecordLayout<FastSplit>;
static_assert(PreciseRecord::kBytes == 23040 && PreciseRecord::kBytes % 128 == 0);
static_assert(BalancedRecord::kBytes == PreciseRecord::kBytes);
static_assert(FastRecord::kBytes == 13824 && FastRecord::kBytes % 128 == 0);
constexpr int kMaxRecordBytes = PreciseRecord::kBytes;

// The same for a Kr tile (both modes).
__host__ __device__ constexpr int kr_offset(int t, int c) {
  return kKrLbo * (t / 8) + kKrSbo * (c / 8) + 16 * (t % 8) + 2 * (c % 8);
}

// Above this per-channel spread of the in-chunk log-decay (G_first - G_last) the factorised
// exp(G_i - mid) * exp(mid - G_j) could leave the fp32/bf16 range (e^80 ~ 5.5e34 < 3.4e38), so K1
// computes that chunk's L and Mqk pairwise with exp(G_i - G_j) <= 1 instead.
constexpr float kMaxFactorisedSpread = float(2.0 * flashkda::kMaxFactorisedShift);

// Workspace: [header: chunk_start[N+1] int32, error flag, seg_start[N+1], ckpt_start[N+1],
// fused_order[N] int32] [chunk records,
// slot-major, head-minor] and, when sequences are split into segments, [segment states]
// [segment outputs] (workspace_layout in launch.cu).
constexpr size_t kAlign = 256;
inline size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
// chunk_start, error_flag, seg_start, ckpt_start and fused_order (Params).
inline size_t header_bytes(int64_t num_seqs) { return align_up(size_t(4 * num_seqs + 4) * sizeof(int32_t)); }
// Upper bound on chunks over all sequences: sum ceil(len/16) <= ceil(total/16) + N.
inline int64_t max_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return (total_tokens + kChunk - 1) / kChunk + num_seqs;
}

// ---- Segments: parallelism inside a sequence (docs/DESIGN.md "Segments") -----------------------
// A sequence of C chunks is cut into segments of seg_chunks chunks (the last may be shorter;
// every sequence, even an empty one, has at least one). Over segment s the state map is affine,
// S_out = A_s S_in + B_s, and the recurrence run on the augmented state [B | A] (V + K = 256 rows
// of S^T, the transition rows starting at the identity with zero values) gives both, and with
// them, for each token t, the output from a zero start (o_zero_t) and w_t = scale A_t^T q_t, so
// that o_t = o_zero_t + X_s^T w_t once the true start state X_s is known. Three kernels:
//   K2 (segmented)  every segment at once; segment 0 from the initial state (outputs final);
//                   segments s > 0 write o_zero and w (fp32), B_s and A_s^T
//   chain           X_1 = end of segment 0, X_{s+1} = X_s^T A_s^T + B_s^T (fp32), the final state
//   combine         o_t = o_zero_t + X_s^T w_t for the tokens of segments s > 0, rounded once to bf16
constexpr int kSegRows = 2 * kHeadDim;               // rows of the augmented S^T: V value rows, K transition rows
constexpr int kSegStateFloats = kHeadDim * kHeadDim;  // one 128 x 128 fp32 matrix per (segment, head)
constexpr int kSegOutFloats = kChunk * kSegRows;      // per (chunk, head): [16 tokens][o_zero 128 | w 128]
constexpr int kSegMinChunks = 16;                     // shortest segment the launcher picks (256 tokens)
// Transition skipping (docs/DESIGN.md "Segments", runs): each segment is cut again into pieces of
// run_chunks chunks. A piece boundary is skippable when the bounds of the chunks before it fall to
// 2^-30 within a warm-up of at most run_warmup chunks (the incoming state's share of the state there
// below fp32 rounding by 2^6); the start of a segment s > 0 may skip too, also where the segment
// is one piece (then it has no exact run and no transition at all). A run walks from the segment
// start or a skippable boundary to the next of either: the segment's first run is exact (from the
// initial state in segment 0, from zero with o_zero, w and the transition rows elsewhere), every
// other one starts from zero at its warm-up and writes final outputs. So only the exact run needs
// X_s, and where it ends inside the segment nothing after it does: the chain takes X_{s+1} = the
// last run's end state.
constexpr float kSkipLogBound = -20.79441541679836f;  // ln(2^-30)
constexpr int kWarmupBlock = 16;       // bounds one thread loads at once while it scans a warm-up
constexpr int kMaxPieces = 256;        // pieces per segment (the launcher lengthens run_chunks to fit)
constexpr int kPlanWords = kMaxPieces / 32;  // a segment's skippable pieces, one bit each
constexpr int kTaintBytes = kSegRows;  // per run: one byte per row of the augmented S^T, 1 = not finite
// Low-rank transitions (internal::PrefillLaunch::lowrank_transitions; docs/DESIGN.md "Long memory: the
// transition is low rank"). A segment's first chunk maps a start state by A_1 = diag(e^Gamma) -
// k_restored^T inv_b k_decayed, so A = T G + E: J the channels whose e^{Gamma_j} times the bound on the
// rest of the exact run (its chunk bounds) stays above 2^-30, F = [e_j e^{Gamma_j} (j in J) |
// k_restored^T] and G = [e_j^T (j in J) ; -inv_b k_decayed] (r = |J| + 16 rows), T = (the run's later
// chunks) F, ||E|| below 2^-30 of the state. The segmented K2's first transition block (rows 0-63 of
// A^T) runs the first chunk as before, then holds F's columns (its rows past r zero) and T at the end;
// the second block walks the first chunk only. Both write G's chunk rows (their U of the first chunk:
// -inv_b k_decayed e_r). The chain forms Y^T = X_s^T G^T ([V][64]) and X_{s+1}^T = Y^T T^T + B_s^T;
// the combine reads the first chunk's outputs against X_s (K-wide w) and the later ones against Y
// (w from the first block's 64 rows).
constexpr int kLowRankRows = kHeadDim / 2;               // T's rows: one row block
constexpr int kLowRankMaxJ = kLowRankRows - kChunk;      // kept channels at most
struct LowRankInfo {
  int32_t rank;                 // r = |J| + 16, or 0: the segment keeps the K transition rows
  uint8_t j[kLowRankMaxJ];      // the kept channels in increasing order
  uint8_t pad[64 - 4 - kLowRankMaxJ];
};
static_assert(sizeof(LowRankInfo) == 64, "one 64-byte record a segment and head");
constexpr int kLowRankGFloats = kChunk * kHeadDim;       // G's chunk rows: [16][K] a segment and head
constexpr int kLowRankYFloats = kHeadDim * kLowRankRows;  // Y_s^T: [V][64] a segment and head

// Segments of a sequence of `chunks` chunks cut every seg_chunks chunks (at least one).
__host__ __device__ inline int64_t segments_of(int64_t chunks, int64_t seg_chunks) {
  return chunks <= seg_chunks ? 1 : (chunks + seg_chunks - 1) / seg_chunks;
}
// Pieces of a segment of `chunks` chunks cut every run_chunks chunks (at least one, as for an empty
// sequence; transition skipping).
__host__ __device__ inline int64_t pieces_of(int64_t chunks, int64_t run_chunks) {
  return chunks <= run_chunks ? 1 : (chunks + run_chunks - 1) / run_chunks;
}
// Upper bound on the segments of all sequences: sum max(1, ceil(C_n / L)) <= slots / L + N.
inline int64_t max_segments(int64_t chunk_slots, int64_t num_seqs, int64_t seg_chunks) {
  return (chunk_slots + seg_chunks - 1) / seg_chunks + num_seqs;
}

// K0's verdict in *Params::error_flag (K0 runs with cu_seqlens or a pool), read by every later
// kernel of the call: kCallValid, the chunk-16 kernels run it; kCallRefused, invalid cu_seqlens, a
// checkpoint count other than the lengths give or a live slot named twice (NaN outputs, the pool
// left as it was); kCallFused, K0 gave the call to prefill v2's fused kernel (Params::fused_sms):
// the chunk-16 kernels do nothing and the fused kernel, launched after them, runs it.
constexpr int32_t kCallValid = 0, kCallRefused = 1, kCallFused = 2;

// The rule for prefill v2's fused chunk-32 kernel (docs/DESIGN.md "The rule"): one CTA a sequence
// and head walks that sequence's 32-token chunks in order at a rate that does not depend on how
// many run, while the chunk-16 kernels slow down as more heads share the GPU. So the fused kernel
// takes a call it serves when its CTAs keep 2/3 of the SMs busy over the longest sequence,
// 3 H sum_n ceil(len_n / 32) >= 2 SMs ceil(max_n len_n / 32), and the longest sequence has at
// least 64 tokens (runs 109-110: the fused kernel forced 0.79x the chunk-16 kernels on 1 x 64 at
// H = 96 and 0.84-0.86x on 256 x 64 at H = 12-96; run 107: 0.80-0.82x on 1 x 128 at H = 96 and
// 128 x 128 at H = 12-96; run 103 from 256 tokens 0.78-0.88x; shorter not yet measured). For B
// sequences of T tokens: 3 B H >= 2 SMs, T >= 64. The host applies it without cu_seqlens, K0
// (Params::fused_sms) with them.
// min_tokens: the floor (internal::PrefillLaunch::fused_min_tokens, a candidate, replaces it).
constexpr int64_t kFusedChunk = 32, kFusedMinTokens = 64;
__host__ __device__ inline bool fused_rule(int64_t H, int64_t total_chunks32, int64_t longest_tokens, int64_t sms,
                                           int64_t min_tokens = kFusedMinTokens) {
  return longest_tokens >= min_tokens &&
         3 * H * total_chunks32 >= 2 * sms * ((longest_tokens + kFusedChunk - 1) / kFusedChunk);
}

// The fused kernel in chained pieces (prefill_v2 FusedArgs::pieces_chain; docs/DESIGN.md "Chained
// pieces"): where the fused kernel takes a call of N sequences of `chunks` 32-token chunks each and
// its N H CTAs (one an SM) leave SMs idle, each sequence cut into P pieces run as P N H CTAs in
// ceil(P N H / SMs) waves, each piece after the first with a warm-up chunk and every CTA with a fixed
// cost of about kChainPieceFixed chunks (its pipeline's fill, its state's load and store; run 113,
// an H100: T = 2048 at H = 96 in four pieces gained 8%, where the waves alone predict 20%). The rule
// takes the P in [2, kMaxChainPieces] that minimises waves x (ceil(chunks / P) + 1 + fixed), pieces
// of at least kMinChainPieceChunks chunks (shorter ones lost with long-memory channels in run 113:
// T = 2048 H = 96 +10%, the waits between pieces), where that is at most kChainGain of one piece's
// chunks + fixed; else 1 (no pieces). One sequence at H = 96 on 132 SMs: 4 pieces from T = 8192
// (run 113, an H100: 1.249 -> 1.012 ms on random gates, 1.277 -> 1.262 with long memory).
constexpr int64_t kChainPieceFixed = 3, kMaxChainPieces = 16, kMinChainPieceChunks = 64;
constexpr double kChainGain = 0.85;
__host__ __device__ inline int64_t fused_chain_pieces(int64_t H, int64_t N, int64_t chunks, int64_t sms) {
  if (H < 1 || N < 1 || sms < 1 || N * H >= sms) return 1;
  const double whole = double(chunks + kChainPieceFixed);
  int64_t best = 1;
  double best_cost = whole;
  for (int64_t P = 2; P <= kMaxChainPieces && (chunks + P - 1) / P >= kMinChainPieceChunks; ++P) {
    const double cost = double((P * N * H + sms - 1) / sms) * double((chunks + P - 1) / P + 1 + kChainPieceFixed);
    if (cost < best_cost) best = P, best_cost = cost;
  }
  return best_cost <= kChainGain * whole ? best : 1;
}

// The fused kernel in unchained pieces at few heads (prefill_v2 FusedArgs::pieces; docs/DESIGN.md
// "Few heads: the fused kernel in pieces"): where the fused kernel serves a call of N sequences of
// `chunks` 32-token chunks each but its rule leaves it to the chunk-16 kernels (N H CTAs would fill
// too few SMs), each sequence is cut into P = #SMs / (N H) pieces, one wave of CTAs, each after the
// first starting a chunk early from zero; where some warm-up does not bound its transition below
// 2^-30 (long-memory channels: the gates' pre-check in the pieces' consumers sees most of them as the
// pieces start) the chunk-16 kernels launched after the pieces run the call. Pieces of at least kMinFewPieceChunks
// chunks (each pays its warm-up); else 1 (no pieces). Run 111 (an H100, random gates, P = 11 at
// H = 12, 8 at H = 16 and 32): one long sequence 27-40% faster than the chunk-16 segments.
constexpr int64_t kMinFewPieceChunks = 4;
constexpr bool kFewHeadPiecesByRule = true;  // false: only forced (internal fused_pieces > 0)
__host__ __device__ inline int64_t fused_few_head_pieces(int64_t H, int64_t N, int64_t chunks, int64_t sms) {
  if (H < 1 || N < 1 || sms < 1 || N * H >= sms) return 1;
  const int64_t by_sms = sms / (N * H), by_length = chunks / kMinFewPieceChunks;
  const int64_t P = by_sms < by_length ? by_sms : by_length;
  return P >= 2 ? P : 1;
}

// The element type of an optional kernel operand: kNone marks an absent one (DType has no such value).
enum class ElemType : int { kNone = 0, kF32 = 1, kBF16 = 2 };

// Everything the kernels need, by value (a __grid_constant__-friendly POD).
// Params::early_launch bits (internal::PrefillLaunch::early_launch, a candidate): the kernels that
// launch early after their predecessor; 0 = every kernel in stream order.
constexpr int kEarlyK1 = 1, kEarlyK2 = 2, kEarlyChain = 4, kEarlyCombine = 8, kEarlyAll = 15;

// The few-head pieces' final states on their way to the call's (a pool's slots, or a final state over
// the initial one): `units` 16-byte units from `from`, sequence n's `per` units to `to` (slot slots[n]
// of a pool of pool_size, padding skipped, where slots is set), copied only where no piece stopped the
// call (prefill_v2 fused_pieces_finish; K1 after the pieces, Params::pieces_final). from null: none.
struct PiecesFinal {
  const void* from = nullptr;
  void* to = nullptr;
  int64_t units = 0, per = 0;
  const int32_t* slots = nullptr;
  int64_t pool_size = 0;
};

struct Params {
  const void* q;      // [total, H, K] bf16
  const void* k;      // [total, H, K] bf16
  const void* v;      // [total, H, V] bf16
  const void* g;      // [total, H, K] g_type
  const void* beta;   // [total, H]    beta_type
  void* out;          // [total, H, V] bf16
  ElemType g_type, beta_type;
  const float* A_log;    // [H] or null
  const float* dt_bias;  // [H, K] or null
  const void* initial_state;  // [N, H, V, K] or null
  ElemType initial_state_type;
  void* final_state;          // [N, H, V, K] or null
  ElemType final_state_type;
  const void* cu_seqlens;     // [N+1] or null
  bool cu_seqlens_64;
  int64_t num_seqs;           // N
  int64_t seq_len;            // T without cu_seqlens
  int64_t total_tokens;       // B*T
  int H;
  GateForm gate;
  float lower_bound;
  bool l2norm_qk;
  bool beta_is_logit;
  float scale;
  int32_t* chunk_start;       // workspace header: [N+1]
  int32_t* error_flag;        // workspace header (K0): its verdict, kCallValid, kCallRefused or kCallFused
  int64_t fused_sms;          // > 0 (cu_seqlens): K0 gives a valid call to the fused kernel where
                              // fused_rule holds with this many SMs (launch.cu forward); 0: never
  int64_t fused_min_tokens;   // with fused_sms: the rule's floor on the longest sequence (config.h fused_rule)
  const int* pieces_flag;     // internal::PrefillLaunch::fused_pieces: zero where the fused kernel's pieces ran the
                              // call (every chunk-16 kernel then returns at once: pieces_ran), else null or 1
  int* pieces_zero;           // K0 ahead of the fused kernel's pieces: their flags' block, which it zeroes first
  int64_t pieces_zero_ints;   // (in place of their memset: one launch fewer on calls with cu_seqlens or a pool)
  PiecesFinal pieces_final;   // the pieces' final states, which K1 after them copies where they ran the call
                              // (its CTAs return at once otherwise): the finishing kernel's launch saved
  uint32_t* prep_next;        // the few-head pieces' area (zeroed with their flag), or null: the strided K1 after
                              // them takes its (slot, head) items from this counter, in the one-a-CTA kernel's
                              // order, instead of every gridDim.x-th in turn (prepare_kernel kStrided)
  int32_t* fused_order;       // workspace header [N] (with cu_seqlens): K0's order of the sequences, longest
                              // first (order_longest_first), in which the fused kernel's CTAs take them
  uint8_t* records;           // workspace chunk records [slots][H][RecordLayout<Split>::kBytes]
  int64_t chunk_slots;        // launched K1 slots
  int early_launch;           // host only: which of the call's kernels launch early (launch.cu kEarly*)
  bool k0_ran;                // host only: K0 ran ahead of the fused kernel's pieces with these parameters
                              // (launch.cu forward), so launch_prepare does not launch it again

  // Segments (all zero / null when sequences are not split).
  int64_t seg_chunks;         // chunks per segment L; 0 = one CTA walks the whole sequence
  int64_t max_segs;           // launched segment slots (an upper bound with cu_seqlens)
  int32_t* seg_start;         // workspace header [N+1]: first global segment of sequence n (varlen; K0)
  float* seg_x;               // [max_segs][H][V][K] start state X_s of each segment (s >= 1)
  float* seg_b;               // [max_segs][H][V][K] B_s^T: the state after segment s from zero
  float* seg_a;               // [max_segs][H][K][K] A_s^T (row r = A_s e_r): the segment's transition
  float* seg_out;             // [chunk_slots][H][16][256] o_zero | w of the chunks of segments s >= 1
  // Transition skipping (internal::PrefillLaunch::skip_transitions; null otherwise, the runs above
  // kSkipLogBound): K1 writes each chunk's log-bound on the norm of its state transition,
  // sum_t max_c a_{t,c} + log max(1, |1 - b_t |k_t|^2|), or with bound_transitions the smaller of that
  // and the bound of the chunk's transition (prepare_chunk.cuh chunk_log_bound); the segmented K2 writes per segment the
  // chunks its exact run covers (the segment's length: the exact transition; fewer: the chain takes
  // X_{s+1} = the last run's end state, the combine stops there), its skippable pieces, and for each
  // run that ends inside the segment which rows of its end state are not finite (a NaN the recurrence
  // would carry on, which the chain writes into every later output of those rows).
  int64_t run_chunks;         // chunks per piece (0: no runs)
  int64_t run_warmup;         // the longest warm-up, chunks
  int64_t max_pieces;         // pieces of the longest segment
  float* chunk_bound;         // [chunk_slots][H]
  bool bound_transitions;     // K1: chunk_bound also takes the bound of the chunk's own transition, the
                              // smaller of the two (internal::PrefillLaunch::skip_bound; launch.cu)
  int32_t* seg_exact;         // [max_segs][H]
  uint32_t* seg_plan;         // [max_segs][H][kPlanWords]: bit i = piece i starts a skipping run
  uint8_t* seg_taint;         // [max_segs][H][max_pieces][kTaintBytes]: by the run starting at piece i
  float* seg_ckpt_b;          // [num_checkpoints][H][V][K] or null: with checkpoints inside segments, the
  float* seg_ckpt_a;          // partial B_c^T and A_c^T of segment s up to checkpoint c (s > 0), which the
                              // chain maps to the checkpoint X_s^T A_c^T + B_c^T
  // Low-rank transitions (null where off; kLowRankRows above): per segment and head its rank and kept
  // channels (K2's first transition block), G's chunk rows (both blocks) and Y_s^T (the chain).
  LowRankInfo* seg_lowrank;   // [max_segs][H]
  float* seg_g;               // [max_segs][H][16][K]
  float* seg_y;               // [max_segs][H][V][64]
  bool transitions_only;      // every sequence is one segment, run as s > 0: seg_b, seg_a = (B, A^T) of
                              // each whole sequence (internal::segment_transition); out is not written

  // Serving prefill (docs/SPEC.md §9). With state_indices the states live in a pool [P][H][V][K]
  // (initial_state = final_state = the pool): sequence n reads (unless has_initial_state[n] is
  // false) and writes slot state_indices[n]; a slot outside [0, P) marks padding (nothing read or
  // written, zero outputs and dense checkpoints), as in decode.
  const int32_t* state_indices;     // [N] or null (dense [N][H][V][K] states)
  const bool* has_initial_state;    // [N] or null
  int64_t pool_size;                // P
  uint32_t* slot_bits;              // workspace [ceil(P / 32)] with state_indices: K0's duplicate-slot check
  // Checkpoints: the state after every checkpoint_every tokens of each sequence, numbered sequence
  // by sequence (ckpt_start), into a dense [C][H][V][K] tensor or into pool slots.
  int64_t checkpoint_every;         // tokens, a multiple of 64; 0 = none
  void* checkpoints;                // [num_checkpoints][H][V][K] checkpoint_type, or null
  ElemType checkpoint_type;
  const int32_t* checkpoint_slots;  // [num_checkpoints] slots of the pool, or null
  int64_t num_checkpoints;
  int32_t* ckpt_start;              // workspace header [N+1] (varlen): first checkpoint of sequence n (K0)
};

}  // namespace flashkda::cuda::sm90::prefill
