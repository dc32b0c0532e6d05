// Constants of the sm90 decode kernel (docs/SPEC.md §5): head dims and the thread -> state mapping.
#pragma once

#include <cstdint>

#include "flashkda/config.h"

namespace flashkda::cuda::sm90::decode {

constexpr int kHeadDimK = flashkda::kCudaHeadDim;  // K: state row length (contiguous in memory, [V, K] layout)
constexpr int kHeadDimV = flashkda::kCudaHeadDim;  // V: state rows
constexpr int kMaxTokens = flashkda::kMaxDecodeTokens;  // new tokens per sequence in one decode step (docs/SPEC.md §5)

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// A state row (K fp32/bf16 values) is split across kLanesPerRow lanes, so the two reductions
// over K per token are 3-step shuffles; a warp covers kRowsPerPass rows per pass.
constexpr int kLanesPerRow = 8;
constexpr int kKPerLane = kHeadDimK / kLanesPerRow;  // 16 state columns per thread
constexpr int kRowsPerPass = 32 / kLanesPerRow;      // 4

// Preprocessing: each warp prepares the whole K vector of a token, 4 channels per lane.
constexpr int kPrepPerLane = kHeadDimK / 32;

// How many state rows one thread holds. More rows per thread put a larger share of the register
// file into state (more bytes in flight per SM); fewer rows per CTA give more CTAs for small N·H.
template <int kRows, int kMinCtas>
struct Tile {
  static constexpr int kRowsPerThread = kRows;
  static constexpr int kMinCtasPerSm = kMinCtas;  // __launch_bounds__ occupancy target (caps registers)
  static constexpr int kRowsPerWarp = kRowsPerPass * kRowsPerThread;
  static constexpr int kRowsPerCta = kRowsPerWarp * kWarps;
  static constexpr int kCtasPerHead = kHeadDimV / kRowsPerCta;
  static_assert(kHeadDimV % kRowsPerCta == 0, "V must split evenly into CTAs");
};
using SmallTile = Tile<2, 4>;  // 32 rows per CTA, 4 CTAs per (seq, head): N = 1, H = 32 gives 128 CTAs
using LargeTile = Tile<4, 4>;  // 64 rows per CTA, 2 CTAs per (seq, head)
// The persistent kernel keeps the next items' bookkeeping in registers on top of the state rows:
// three CTAs per SM leave it the registers of LargeTile without spilling.
using PersistentLargeTile = Tile<4, 3>;
// The bulk-copy kernel's fp32 items (kernel.cuh decode_bulk_kernel): 32 rows, 16 KB as a bf16 item.
using BulkSmallTile = Tile<2, 3>;
// Items whose copies are in flight or computing at once in one persistent CTA (shared-memory ring).
constexpr int kPersistentStages = 3;
constexpr int kMaxRowsPerCta = LargeTile::kRowsPerCta;

// N·H from which LargeTile is used: SmallTile CTAs then number >= 8192, many waves on 132 SMs.
// A starting point to tune with benchmarks/bench_decode.py on the H200.
constexpr int64_t kLargeTileMinHeads = 2048;

// N·H from which bf16 pools use the persistent kernel (kernel.cuh): one CTA's load -> compute ->
// store leaves the memory pipe idle, and a bf16 row puts half the bytes of an fp32 row in flight
// per register, so at large batches the next item's state is prefetched into shared memory.
constexpr int64_t kPersistentMinHeads = kLargeTileMinHeads;

// N·H range in which bf16 pools take the bulk-copy kernel with three buffers (kernel.cuh
// decode_bulk_kernel): measured on the H200 (run 66, BENCHMARKS-history.md "Decode"), 7-19% faster than the
// one-CTA-per-item kernels at N·H = 384-1536 (H = 32 and 96, T = 1 and 4), slower at N·H <= 96 and
// from 2048 (where the persistent kernel runs), mixed at 128-256.
constexpr int64_t kBulkMinHeads = 384;
constexpr int64_t kBulkMaxHeads = 1536;

static_assert(kPrepPerLane == 4, "the preprocessing reads 4 channels (one 8- or 16-byte vector) per lane");

}  // namespace flashkda::cuda::sm90::decode
