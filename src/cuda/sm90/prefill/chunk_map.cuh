// Where each chunk lives: sequence token ranges and chunk ranges, with or without cu_seqlens.
// Chunk "slots" number the chunks of all sequences consecutively (workspace record order).
#pragma once

#include "cuda/sm90/prefill/config.h"

namespace flashkda::sm90::prefill {

__device__ __forceinline__ int64_t cu_at(const Params& p, int64_t i) {
  return p.cu_seqlens_64 ? static_cast<const int64_t*>(p.cu_seqlens)[i]
                         : int64_t(static_cast<const int32_t*>(p.cu_seqlens)[i]);
}

// Token range and chunk range of sequence n.
struct SeqChunks {
  int64_t bos, eos;
  int64_t chunk_begin, chunk_end;
};

__device__ __forceinline__ SeqChunks seq_chunks(const Params& p, int64_t n) {
  if (p.cu_seqlens == nullptr) {
    const int64_t per_seq = (p.seq_len + kChunk - 1) / kChunk;
    return {n * p.seq_len, (n + 1) * p.seq_len, n * per_seq, (n + 1) * per_seq};
  }
  if (p.chunk_start[n] == p.chunk_start[n + 1]) {  // empty, or everything disabled by the flag
    return {0, 0, p.chunk_start[n], p.chunk_start[n]};
  }
  return {cu_at(p, n), cu_at(p, n + 1), p.chunk_start[n], p.chunk_start[n + 1]};
}

// Locates chunk `slot`: its sequence's first token and the number of valid rows. False if the
// slot is past the last chunk (the grid is sized by an upper bound).
__device__ __forceinline__ bool locate_chunk(const Params& p, int64_t slot, int64_t& row0, int& rows) {
  int64_t n;
  if (p.cu_seqlens == nullptr) {
    const int64_t per_seq = (p.seq_len + kChunk - 1) / kChunk;
    if (per_seq == 0 || slot >= per_seq * p.num_seqs) return false;
    n = slot / per_seq;
  } else {
    if (slot >= p.chunk_start[p.num_seqs]) return false;
    int64_t lo = 0, hi = p.num_seqs;  // last n with chunk_start[n] <= slot
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.chunk_start[mid] <= slot) lo = mid; else hi = mid;
    }
    n = lo;
  }
  const SeqChunks sc = seq_chunks(p, n);
  row0 = sc.bos + (slot - sc.chunk_begin) * kChunk;
  rows = int(sc.eos - row0 < kChunk ? sc.eos - row0 : kChunk);
  return true;
}

}  // namespace flashkda::sm90::prefill
