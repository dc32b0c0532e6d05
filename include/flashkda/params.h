// flashkda problem descriptions: one prefill (chunked forward) problem and one decode step.
// All tensors are dense and contiguous (row-major in the order of their shape); N is the number
// of sequences: B without cu_seqlens, cu_seqlens length - 1 with it (then B must be 1).
#pragma once

#include <cstdint>

#include "flashkda/types.h"

namespace flashkda {

struct PrefillParams {
  const void* q = nullptr;     // [B, T, H, K]  dtype
  const void* k = nullptr;     // [B, T, H, K]  dtype
  const void* v = nullptr;     // [B, T, H, V]  dtype
  const void* g = nullptr;     // [B, T, H, K]  g_dtype: raw gate, or log-decay for kPrecomputed
  const void* beta = nullptr;  // [B, T, H]     beta_dtype: logit or activated beta
  void* out = nullptr;         // [B, T, H, V]  dtype
  DType dtype = DType::kBF16;       // q, k, v, out: kBF16 (CPU and GPU) or kF32 (CPU)
  DType g_dtype = DType::kBF16;     // kBF16 or kF32
  DType beta_dtype = DType::kBF16;  // kBF16 or kF32

  const void* initial_state = nullptr;  // [N, H, V, K]  state_dtype, or null (zeros)
  DType initial_state_dtype = DType::kF32;
  void* final_state = nullptr;          // [N, H, V, K]  or null (not written)
  DType final_state_dtype = DType::kF32;
  // final_state may be initial_state itself (the same pointer and dtype): each state is then updated in
  // place, with the bits of two buffers. Any other overlap between them, or with another argument, is
  // not supported.

  const void* cu_seqlens = nullptr;     // [num_seqs + 1], or null
  DType cu_seqlens_dtype = DType::kI32; // kI32 or kI64
  int64_t num_seqs = 0;                 // N when cu_seqlens is given

  int64_t B = 0, T = 0, H = 0, K = 128, V = 128;
  Preprocess pre;
  Precision precision = Precision::kPrecise;  // GPU recurrence only (types.h)

  // Serving prefill (docs/SPEC.md §9), in place of initial_state / final_state: the states live in
  // a decode pool. Sequence n starts from slot state_indices[n] (from zeros when
  // has_initial_state[n] is false) and its final state is written back into that slot; no other
  // slot is written. A negative slot marks padding: nothing is read or written for the sequence
  // and its output rows are zero. On the GPU the indices stay on the device: a slot outside [0, P)
  // is padding there too (as in decode), and a live slot named twice (across state_indices and
  // checkpoint_slots) fills out and the dense checkpoints with NaN and leaves the pool unchanged;
  // the CPU backend throws instead, naming both positions.
  void* state_pool = nullptr;               // [P, H, V, K] state_pool_dtype (kF32 or kBF16), or null
  DType state_pool_dtype = DType::kF32;
  int64_t pool_size = 0;                    // P
  const int32_t* state_indices = nullptr;   // [N], required with state_pool
  const bool* has_initial_state = nullptr;  // [N], or null: every live slot is read

  // Checkpoints (docs/SPEC.md §9): the state of every sequence after each checkpoint_every tokens,
  // at positions E, 2E, ... up to its length (a sequence of length L has floor(L / E) of them; when
  // E divides L the last one equals its final state). They are numbered sequence by sequence,
  // position by position: checkpoint_count(params) in all (flashkda.h), which the caller passes as
  // num_checkpoints. Written either densely into checkpoints (padding sequences: zeros) or into
  // the pool slots checkpoint_slots names (negative: not written), in the pool's dtype. On the GPU
  // with device cu_seqlens a num_checkpoints other than the lengths give fills out and the dense
  // checkpoints with NaN (the pool is left as it was).
  int64_t checkpoint_every = 0;               // 0: none; else a positive multiple of 64
  void* checkpoints = nullptr;                // [num_checkpoints, H, V, K] checkpoint_dtype, or null
  DType checkpoint_dtype = DType::kF32;       // kF32 or kBF16
  const int32_t* checkpoint_slots = nullptr;  // [num_checkpoints] slots of state_pool, or null
  int64_t num_checkpoints = 0;
};

// One decode step for N sequences of 1..16 new tokens each, states in a pool updated in place.
struct DecodeParams {
  const void* q = nullptr;     // [N, T, H, K], or [1, total, H, K] with cu_seqlens
  const void* k = nullptr;     // same as q
  const void* v = nullptr;     // [N, T, H, V], or [1, total, H, V]
  const void* g = nullptr;     // like q, g_dtype
  const void* beta = nullptr;  // [N, T, H], or [1, total, H]
  void* out = nullptr;         // like v
  DType dtype = DType::kBF16;
  DType g_dtype = DType::kBF16;
  DType beta_dtype = DType::kBF16;

  void* state_pool = nullptr;        // [P, H, V, K] fp32 or bf16, updated in place
  DType state_dtype = DType::kF32;
  int64_t pool_size = 0;             // P

  // state_indices[n * indices_stride + t]: slot receiving the state after token t (speculative),
  // or with indices_stride == 1 / no num_accepted_tokens the one slot of sequence n (read and
  // written). A negative start slot marks a padding entry: nothing is read or written for it
  // (its outputs are set to zero); a negative slot for token t skips that store only. Two sequences
  // may not name one live slot: the CPU backend throws naming both; on the GPU (indices on the
  // device) every sequence that shares a live slot gets NaN outputs and stores nothing, so those
  // slots keep their contents, and every other sequence runs as usual (docs/SPEC.md §5).
  const int32_t* state_indices = nullptr;  // [N] or [N, indices_stride]
  int64_t indices_stride = 1;
  const int32_t* num_accepted_tokens = nullptr;  // [N] or null: start slot = indices[n, acc-1]

  const void* cu_seqlens = nullptr;     // [N + 1] or null (then every sequence has T tokens)
  DType cu_seqlens_dtype = DType::kI32;
  int64_t num_seqs = 0;                 // N

  int64_t T = 0;  // tokens per sequence without cu_seqlens (1..16); total tokens with it
  int64_t H = 0, K = 128, V = 128;
  Preprocess pre;

  // GPU: false leaves out the device-side check for two sequences naming one live slot (see
  // state_indices; 0-12% of a decode step, docs/BENCHMARKS.md) for a caller that guarantees
  // distinct live slots; a shared slot's contents are then undefined. The CPU backend checks the
  // indices on the host either way.
  bool check_slots = true;
};

}  // namespace flashkda
