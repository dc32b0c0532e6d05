// Prefill v2 (issue 11): shared-memory layouts of one 32-token chunk's operands, as the chunk-32
// producer writes them (produce.cuh). Host and device code: the GPU test decodes them on the host.
//
// Operand tiles of rows x 128 channels (rows = tokens) are wgmma's K-major 128-byte-swizzle layout
// (CUTLASS SW128): two blocks of 64 channels, each `rows` rows of 128 bytes; the 16-byte granule of
// 8 channels g (0..7 inside the block) of row r sits at granule position g ^ (r % 8). The same bytes
// read as an MN-major SW128 operand (channels contiguous) serve the state update's k_restored.
// 32 x 32 matrices (Mqk, inv_b: rows i, columns j = the reduction index of their products) are
// K-major 64-byte-swizzle tiles: row i of 64 bytes, granule g (0..3) at position g ^ ((i / 2) % 4).
// Every tile starts on a 1024-byte boundary (the swizzle atoms' alignment).
#pragma once

#include <cstdint>

namespace flashkda::cuda::sm90::prefill_v2 {

constexpr int kChunk = 32;     // tokens per chunk
constexpr int kHeadDim = 128;  // K = V
constexpr int kThreads = 128;  // the producer: one warpgroup

// The tokens of chunk c of a sequence of T (kChunk, fewer in its last).
__host__ __device__ constexpr int chunk_rows(int64_t T, int64_t c) {
  return T - c * kChunk < kChunk ? int(T - c * kChunk) : kChunk;
}

// Byte offset of byte b of a row (b < 256 in a tile of 128 bf16 or fp16 channels, < 512 of 128
// fp32 ones) in a rows x 128 SW128 tile: blocks of 128 bytes a row, each block `rows` rows; the
// row's 16-byte granule g (0..7 inside the block) of row r at granule position g ^ (r % 8).
// r, b >= 0, in bit operations (signed division and remainder would cost instructions).
__host__ __device__ constexpr int sw128_byte_offset(int rows, int r, int b) {
  return (b >> 7) * rows * 128 + r * 128 + ((((b >> 4) & 7) ^ (r & 7)) << 4) + (b & 15);
}
// Element (r, c) of a bf16 or fp16 tile (two blocks of 64 channels) and of an fp32 / tf32 one
// (four blocks of 32): the same atom in bytes, so the same descriptors (SBO 1024) read both.
__host__ __device__ constexpr int sw128_offset(int rows, int r, int c) { return sw128_byte_offset(rows, r, 2 * c); }
__host__ __device__ constexpr int sw128_offset_f32(int rows, int r, int c) { return sw128_byte_offset(rows, r, 4 * c); }
// A consumer thread's accumulator slot i (token 8 (i >> 2) + 2 t4 + (i & 1), channel
// v_row + 8 ((i >> 1) & 1); v_row = 16 w + g inside its 64-channel block, g < 8) in a 32 x 128
// SW128 tile, less its slot 0's sw128_offset(32, 2 t4, v_row): a constant, since tokens 8 apart
// share the swizzle and the slot's token and channel bits enter the granule position as their xor.
__host__ __device__ constexpr int sw128_slot_offset(int i) {
  return 1024 * (i >> 2) + 128 * (i & 1) + 16 * (((i >> 1) ^ i) & 1);
}
// Byte offset of element (i, j) in a 32 x 32 SW64 tile.
__host__ __device__ constexpr int sw64_offset(int i, int j) {
  return i * 64 + (((j / 8) ^ ((i / 2) % 4)) * 16) + (j % 8) * 2;
}

constexpr int kTileBytes = kChunk * kHeadDim * 2;    // 8192: one 32 x 128 16-bit operand
constexpr int kSmallBytes = kChunk * kChunk * 2;     // 2048: one 32 x 32 16-bit matrix

// One chunk's operands for the recurrence (the precise policy for L2-normalised q, k: k_decayed
// and q_decayed in fp16, k_restored, Mqk and inv_b split into bf16 hi + lo), then e^Gamma and a
// flags word. The standalone producer kernel copies it to global memory unchanged.
struct ChunkOperands {
  static constexpr int kOffKDecayed = 0;
  static constexpr int kOffQDecayed = kOffKDecayed + kTileBytes;
  static constexpr int kOffKRestored = kOffQDecayed + kTileBytes;
  static constexpr int kOffKRestoredLo = kOffKRestored + kTileBytes;
  static constexpr int kOffMqk = kOffKRestoredLo + kTileBytes;
  static constexpr int kOffMqkLo = kOffMqk + kSmallBytes;
  static constexpr int kOffInvB = kOffMqkLo + kSmallBytes;
  static constexpr int kOffInvBLo = kOffInvB + kSmallBytes;
  static constexpr int kOffGamma = kOffInvBLo + kSmallBytes;    // e^{Gamma_c}, fp32
  static constexpr int kOffFlags = kOffGamma + kHeadDim * 4;     // int32: 1 = a channel's spread too wide
  static constexpr int kBytes = kOffFlags + 16;
};
static_assert(ChunkOperands::kBytes % 16 == 0 && ChunkOperands::kOffMqk % 1024 == 0);

// Scratch of the L / Mqk product: its tf32 operands (sw128_offset_f32 tiles) [k e^{G-mid};
// q e^{G-mid}] (64 rows, A) and k e^{mid-G} (32 rows, B).
struct ProduceScratch {
  static constexpr int kOffA = 0;                              // 64 x 128 fp32: 4 kTileBytes
  static constexpr int kOffB = kOffA + 4 * kTileBytes;         // 32 x 128 fp32: 2 kTileBytes
  static constexpr int kOffL = kOffB + 2 * kTileBytes;         // fp32 L [32][kLStride]
  static constexpr int kLStride = 36;
  static constexpr int kOffX22 = kOffL + kChunk * kLStride * 4;  // fp32 X11, X22, T, each [16][20]
  static constexpr int kX22Stride = 20;
  static constexpr int kInvScratchBytes = 3 * 16 * kX22Stride * 4;  // invert_warpgroup's
  static constexpr int kOffTotals = kOffX22 + kInvScratchBytes;     // fp32 [4 warps][128] log-decay sums
  static constexpr int kOffBeta = kOffTotals + 4 * kHeadDim * 4;    // fp32 [32]
  static constexpr int kOffWide = kOffBeta + kChunk * 4;            // int32
  static constexpr int kOffGate = kOffWide + 16;                    // fp32 [128] + 2: produce.cuh load_gate_consts (fused.cu)
  static constexpr int kBytes = kOffGate + (kHeadDim + 4) * 4;
};

// FusedArgs::pieces: piece `piece` of `pieces` of a sequence of len tokens, each after the first
// starting up to `warmup` chunks early: its own chunks [begin, end), the chunks it starts early
// (warmup, never before the sequence's start), its first token (shift) and tokens (T: -1 where the
// piece has no chunks, the CTA leaving at once, but 0 for an empty sequence's first piece, which
// carries its state), and whether it ends the sequence (last: it writes the final state).
struct PieceSpan {
  int64_t begin, end, warmup, shift, T;
  bool last;
};
__host__ __device__ constexpr PieceSpan piece_span(int64_t len, int64_t pieces, int64_t warmup, int64_t piece) {
  const int64_t chunks = (len + kChunk - 1) / kChunk, per = (chunks + pieces - 1) / pieces, begin = piece * per;
  const int64_t end = begin + per < chunks ? begin + per : chunks;
  const int64_t early = begin < warmup ? begin : warmup;
  const int64_t shift = begin < chunks ? (begin - early) * kChunk : 0;  // an empty piece at the sequence's start
  const bool empty_first = chunks == 0 && piece == 0;
  const int64_t T = begin < chunks ? (end * kChunk < len ? end * kChunk : len) - shift : empty_first ? 0 : -1;
  return {begin, end, early, shift, T, (begin < chunks && end == chunks) || empty_first};
}

}  // namespace flashkda::cuda::sm90::prefill_v2
