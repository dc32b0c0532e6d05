// Constants and the workspace layout shared by the prefill kernels (K0 scan, K1 prepare,
// K2 recurrence) and their host launcher. Defined once here; every other file includes this.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkda/config.h"

namespace flashkda::sm90::prefill {

constexpr int kChunk = flashkda::kChunk;         // tokens per chunk (SPEC.md §4)
constexpr int kHeadDim = flashkda::kCudaHeadDim;  // K = V = 128
constexpr int kMmaK = 16;       // k extent of one m16n8k16 MMA

// One chunk of one head in the workspace, written by K1 and read by K2. Every 16x128 / 16x16
// operand is stored in *fragment order*: 16-byte unit (step * 32 + lane) holds the four bf16x2
// registers of lane `lane` of the m16n8k16 B operand for k-step (or n-tile pair) `step`, so K2
// reads each fragment with one conflict-free 16-byte shared-memory load (no ldmatrix, no swizzle).
// Channels enter the tiles in *position* order (channel_position below).
constexpr int kTileBytes = kChunk * kHeadDim * 2;      // 4096: q_decayed, k_decayed, k_restored
constexpr int kSmallTileBytes = kChunk * kChunk * 2;   // 512: Mqk, inv_b = (I+L)^-1 diag(b)
constexpr int kGammaBytes = kHeadDim * 4;              // 512: exp(G_C) per channel position, fp32
// The precise mode also reads the bf16 remainders x - bf16(x) of k_restored, q_decayed, inv_b and
// Mqk, stored last so the fast mode reads a prefix. With one key repeated and little decay, bf16
// rounding of k_restored or inv_b writes noise into state directions that neither the delta rule
// nor the gate ever removes (measured 2.7e-2 rel-RMS at 16384 tokens), and the output is a sum
// of two nearly cancelling terms, S q_decayed^T and Mqk U, so bf16 rounding of q_decayed and Mqk
// is amplified (an fp64 simulation: 3.5e-3 with both rounded, 1.7e-3 with both split, against a
// 1.65e-3 floor from rounding the output to bf16).
constexpr int kChunkRecordBytes = 5 * kTileBytes + 4 * kSmallTileBytes + kGammaBytes;  // 23040
constexpr int kFastRecordBytes = 3 * kTileBytes + 2 * kSmallTileBytes + kGammaBytes;  // 13824

// Offsets inside one chunk record: the fast mode's operands first, then the remainders.
constexpr int kOffQDecayed = 0;
constexpr int kOffKDecayed = kTileBytes;
constexpr int kOffKRestored = 2 * kTileBytes;
constexpr int kOffGamma = 3 * kTileBytes;
constexpr int kOffMqk = kOffGamma + kGammaBytes;
constexpr int kOffInvB = kOffMqk + kSmallTileBytes;
constexpr int kOffKRestoredLo = kOffInvB + kSmallTileBytes;  // == kFastRecordBytes
constexpr int kOffQDecayedLo = kOffKRestoredLo + kTileBytes;
constexpr int kOffInvBLo = kOffQDecayedLo + kTileBytes;
constexpr int kOffMqkLo = kOffInvBLo + kSmallTileBytes;
static_assert(kOffKRestoredLo == kFastRecordBytes && kOffMqkLo + kSmallTileBytes == kChunkRecordBytes);

// Channel order inside the tiles. The sums over channels (K of q_decayed/k_decayed products, N of
// the state update) do not care which MMA index a channel takes, so within each 16-channel step
// channel 4*t4 + 2*h + e sits at MMA index 8*h + 2*t4 + e. Then one 16-byte unit of a
// q_decayed/k_decayed tile is 4 consecutive channels of rows t and t+8 (K1 loads 4 channels with
// one 8-byte load and stores the unit with one 16-byte store), and the fp32 state a K2 lane owns
// is 4 consecutive channels per step (one 16-byte load or store). The state stays [V, K] in
// memory; only the registers and the records use positions.
__host__ __device__ constexpr int channel_position(int c) {
  return (c & ~15) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1) | (c & 1);
}

// Above this per-channel spread of the in-chunk log-decay (G_first - G_last) the factorised
// exp(G_i - mid) * exp(mid - G_j) could leave the fp32/bf16 range (e^80 ~ 5.5e34 < 3.4e38), so K1
// computes that chunk's L and Mqk pairwise with exp(G_i - G_j) <= 1 instead.
constexpr float kMaxFactorisedSpread = float(2.0 * flashkda::kMaxFactorisedShift);

// Workspace: [header: chunk_start[N+1] int32, error flag] [chunk records, slot-major, head-minor].
constexpr size_t kAlign = 256;
inline size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
inline size_t header_bytes(int64_t num_seqs) { return align_up(size_t(num_seqs + 2) * sizeof(int32_t)); }
// Upper bound on chunks over all sequences: sum ceil(len/16) <= ceil(total/16) + N.
inline int64_t max_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return (total_tokens + kChunk - 1) / kChunk + num_seqs;
}

enum class ElemType : int { kNone = 0, kF32 = 1, kBF16 = 2 };
enum class Gate : int { kLowerBound = 0, kSoftplus = 1, kPrecomputed = 2 };

// Everything the kernels need, by value (a __grid_constant__-friendly POD).
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
  Gate gate;
  float lower_bound;
  bool l2norm_qk;
  bool beta_is_logit;
  float scale;
  int32_t* chunk_start;       // workspace header: [N+1]
  int32_t* error_flag;        // workspace header: 1 when cu_seqlens is invalid
  uint8_t* records;           // workspace chunk records [slots][H][kChunkRecordBytes]
  int64_t chunk_slots;        // launched K1 slots
};

}  // namespace flashkda::sm90::prefill
