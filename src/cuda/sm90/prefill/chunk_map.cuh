// Where each chunk lives: sequence token ranges and chunk ranges, with or without cu_seqlens.
// Chunk "slots" number the chunks of all sequences consecutively (workspace record order).
#pragma once

#include <cuda_bf16.h>

#include "cuda/common/math.cuh"
#include "cuda/sm90/prefill/config.h"

namespace flashkda::cuda::sm90::prefill {

__device__ __forceinline__ int64_t cu_at(const Params& p, int64_t i) {
  return cuda::offset_at(p.cu_seqlens, p.cu_seqlens_64, i);
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

// Segment s of sequence n (config.h "Segments"): its index, the sequence's segment count and the
// global index of the sequence's first segment.
struct SegmentRef {
  int64_t n, s, count, first;
};

// Locates global segment `gseg`; false past the last one (the grid is sized by an upper bound).
__device__ __forceinline__ bool locate_segment(const Params& p, int64_t gseg, SegmentRef& r) {
  if (p.cu_seqlens == nullptr) {
    const int64_t per_seq = segments_of((p.seq_len + kChunk - 1) / kChunk, p.seg_chunks);
    if (gseg >= per_seq * p.num_seqs) return false;
    r.n = gseg / per_seq, r.s = gseg % per_seq, r.count = per_seq, r.first = r.n * per_seq;
    return true;
  }
  if (gseg >= p.seg_start[p.num_seqs]) return false;
  int64_t lo = 0, hi = p.num_seqs;  // last n with seg_start[n] <= gseg (every sequence has a segment)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.seg_start[mid] <= gseg) lo = mid; else hi = mid;
  }
  r.n = lo, r.first = p.seg_start[lo], r.count = p.seg_start[lo + 1] - r.first, r.s = gseg - r.first;
  return true;
}

// The token and chunk ranges of segment s of a sequence (chunks s * L .. (s + 1) * L - 1).
__device__ __forceinline__ SeqChunks segment_chunks(const Params& p, const SeqChunks& seq, int64_t s) {
  const int64_t chunks = seq.chunk_end - seq.chunk_begin;
  const int64_t j0 = min(s * p.seg_chunks, chunks), j1 = min(j0 + p.seg_chunks, chunks);
  const int64_t bos = seq.bos + j0 * kChunk;
  return {bos, min(seq.eos, seq.bos + j1 * kChunk), seq.chunk_begin + j0, seq.chunk_begin + j1};
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

// Whether K0 refused the call (Params::error_flag: invalid cu_seqlens, a checkpoint count other
// than the lengths give, a live slot named twice); K0 runs with cu_seqlens or a pool.
__device__ __forceinline__ bool call_refused(const Params& p) {
  return (p.cu_seqlens != nullptr || p.state_indices != nullptr) && *p.error_flag == kCallRefused;
}
// Whether K0 gave the call to the fused kernel (Params::fused_sms): the chunk-16 kernels do nothing.
__device__ __forceinline__ bool call_fused(const Params& p) {
  return p.fused_sms > 0 && *p.error_flag == kCallFused;
}
// Whether the fused kernel's pieces ran the call (Params::pieces_flag, internal::PrefillLaunch::
// fused_pieces): the chunk-16 kernels do nothing.
__device__ __forceinline__ bool pieces_ran(const Params& p) { return p.pieces_flag != nullptr && *p.pieces_flag == 0; }
// The pieces' final states to the call's (PiecesFinal): units i = first, first + stride, ... of them.
__device__ __forceinline__ void copy_pieces_final(const PiecesFinal& f, int64_t first, int64_t stride) {
  const auto* const from = static_cast<const float4*>(f.from);
  auto* const to = static_cast<float4*>(f.to);
  for (int64_t i = first; i < f.units; i += stride) {
    if (f.slots == nullptr) {
      to[i] = from[i];
    } else {
      const int64_t slot = f.slots[i / f.per];
      if (slot >= 0 && slot < f.pool_size) to[slot * f.per + i % f.per] = from[i];
    }
  }
}

// ---- Serving prefill (config.h Params, docs/SPEC.md §9) ------------------------------------------
// The state slot of sequence n: n for dense states, its pool slot with state_indices, -1 for
// padding (a pool slot outside [0, P), as in decode).
__device__ __forceinline__ int64_t state_slot(const Params& p, int64_t n) {
  if (p.state_indices == nullptr) return n;
  const int64_t slot = p.state_indices[n];
  return slot >= 0 && slot < p.pool_size ? slot : -1;
}

// Offset of head h's [V][K] state in slot `slot` of initial_state / final_state / the pool.
__device__ __forceinline__ int64_t state_offset(const Params& p, int64_t slot, int h) {
  return (slot * p.H + h) * int64_t(kHeadDim) * kHeadDim;
}

// Whether sequence n (slot >= 0) starts from a stored state rather than zeros.
__device__ __forceinline__ bool reads_initial_state(const Params& p, int64_t n) {
  return p.initial_state != nullptr && (p.has_initial_state == nullptr || p.has_initial_state[n]);
}

// Index of the first checkpoint of sequence n (the checkpoints are numbered sequence by sequence).
__device__ __forceinline__ int64_t first_checkpoint(const Params& p, int64_t n) {
  return p.cu_seqlens == nullptr ? n * (p.seq_len / p.checkpoint_every) : p.ckpt_start[n];
}

// Where checkpoint c of head h goes: base, element type and offset of its [V][K] state; false
// when it is not written (a pool slot outside [0, P), or c past num_checkpoints).
__device__ __forceinline__ bool checkpoint_target(const Params& p, int64_t c, int h, void*& base, ElemType& type,
                                                  int64_t& offset) {
  if (c < 0 || c >= p.num_checkpoints) return false;
  if (p.checkpoints != nullptr) {
    base = p.checkpoints, type = p.checkpoint_type, offset = state_offset(p, c, h);
    return true;
  }
  const int64_t slot = p.checkpoint_slots[c];
  if (slot < 0 || slot >= p.pool_size) return false;
  base = p.final_state, type = p.final_state_type, offset = state_offset(p, slot, h);
  return true;
}

__device__ __forceinline__ void store_state_elem(void* base, ElemType type, int64_t idx, float x) {
  if (type == ElemType::kF32) static_cast<float*>(base)[idx] = x;
  else static_cast<__nv_bfloat16*>(base)[idx] = __float2bfloat16_rn(x);
}

}  // namespace flashkda::cuda::sm90::prefill
