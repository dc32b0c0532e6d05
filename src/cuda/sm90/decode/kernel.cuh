// sm90 decode kernel (docs/SPEC.md §5): the token recurrence of docs/SPEC.md §3 for 1..16 new tokens per
// sequence on a state pool [P, H, V, K] (fp32 or bf16) updated in place, preprocessing fused.
//
// grid = (N * H * kCtasPerHead), block = 4 warps. CTA x handles state rows
// [kRowsPerCta * (x % kCtasPerHead), +kRowsPerCta) of head (x / kCtasPerHead) % H of sequence
// x / (kCtasPerHead * H). The V rows of a state evolve independently (each needs only its own row
// and the K-vectors k̂, q̂, exp(a)), so splitting V across CTAs keeps 4·H CTAs busy even at N = 1
// (SmallTile: 32 rows per CTA) while large batches use 64 rows per CTA (LargeTile).
// Inside a CTA, 8 lanes share one row, 16 columns each (both reductions over K per token are
// 3 shuffles); a thread holds kRowsPerThread rows, rows r, r+4, ... of its warp's block.
//
// Data flow of one CTA: issue the 16-byte loads of its state rows into registers, then stage all
// tokens' q, k, g, v (its rows), beta with cp.async into shared memory, so both latencies overlap;
// the warps prepare q̂·scale, k̂, exp(a) of the tokens (4 channels per lane, warp shuffles for the
// L2 norms: at one token every warp for itself, from two on warp w token w of each group of four,
// shared through the CTA's scratch), run the recurrence on their rows in fp32 and write the
// outputs. The state is written once at the end, or after each token whose speculative slot is
// valid. Memory-bound: the state slice is read and written once; all else is ~1 KB/token.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/fast_div.h"
#include "cuda/common/math.cuh"
#include "cuda/common/preprocess.cuh"
#include "cuda/sm90/decode/config.h"
#include "flashkda/types.h"

namespace flashkda::cuda::sm90::decode {

// Kernel arguments: DecodeParams with dtypes resolved and the scale computed on the host.
struct DecodeArgs {
  const void* q;         // [tokens, H, K] bf16
  const void* k;         // [tokens, H, K] bf16
  const void* v;         // [tokens, H, V] bf16
  const void* g;         // [tokens, H, K] bf16 or fp32 (g_is_f32)
  const void* beta;      // [tokens, H]    bf16 or fp32 (beta_is_f32)
  void* out;             // [tokens, H, V] bf16
  void* state_pool;      // [P, H, V, K]   StateT
  const int32_t* state_indices;        // [N, indices_stride]
  const int32_t* num_accepted_tokens;  // [N] or null (null: not speculative)
  const void* cu_seqlens;              // [N + 1] int32/int64 or null
  int64_t indices_stride;
  int64_t pool_size;
  int64_t tokens_per_seq;  // T without cu_seqlens; with them the total, which bounds their values
  int32_t stage_tokens;    // capacity of the dynamic shared StagedToken buffer (1..16)
  int32_t H;
  bool cu_seqlens_i64;
  bool g_is_f32;
  bool beta_is_f32;
  float scale;
  Preprocess pre;
  int64_t num_seqs;  // N (read by the slot check only: shares_a_slot)
};

// How one thread holds its 16 columns of a state row: kChunks 16-byte vectors of kVec elements;
// register m = j * kVec + e is column (col + 8 j) * kVec + e. Eight lanes with consecutive col
// read 128 contiguous bytes per vector load.
template <typename StateT>
struct RowAccess {
  static constexpr int kVec = 16 / int(sizeof(StateT));
  static constexpr int kChunks = kKPerLane / kVec;

  __device__ __forceinline__ static int column(int col, int j) { return (col + kLanesPerRow * j) * kVec; }

  // Streaming (.cs) accesses: every state byte is touched once per launch.
  __device__ __forceinline__ static void load(const StateT* row, int col, float (&r)[kKPerLane]) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) unpack(__ldcs(reinterpret_cast<const uint4*>(row + column(col, j))), j, r);
  }

  // The same columns from a shared-memory copy of the row (plain 16-byte loads).
  __device__ __forceinline__ static void load_shared(const StateT* row, int col, float (&r)[kKPerLane]) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) unpack(*reinterpret_cast<const uint4*>(row + column(col, j)), j, r);
  }

  __device__ __forceinline__ static void unpack(const uint4 x, int j, float (&r)[kKPerLane]) {
    if constexpr (sizeof(StateT) == 4) {
      r[j * kVec + 0] = __uint_as_float(x.x);
      r[j * kVec + 1] = __uint_as_float(x.y);
      r[j * kVec + 2] = __uint_as_float(x.z);
      r[j * kVec + 3] = __uint_as_float(x.w);
    } else {
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        r[j * kVec + 2 * i] = bf16_lo(w[i]);
        r[j * kVec + 2 * i + 1] = bf16_hi(w[i]);
      }
    }
  }

  // Into a shared-memory copy of the row (the bulk-copy kernel's store buffer): plain 16-byte stores.
  __device__ __forceinline__ static void store_shared(StateT* row, int col, const float (&r)[kKPerLane]) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) *reinterpret_cast<uint4*>(row + column(col, j)) = pack(r, j);
  }

  __device__ __forceinline__ static uint4 pack(const float (&r)[kKPerLane], int j) {
    if constexpr (sizeof(StateT) == 4) {
      return uint4{__float_as_uint(r[j * kVec + 0]), __float_as_uint(r[j * kVec + 1]), __float_as_uint(r[j * kVec + 2]),
                   __float_as_uint(r[j * kVec + 3])};
    } else {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = pack_bf16x2(r[j * kVec + 2 * i], r[j * kVec + 2 * i + 1]);
      return uint4{w[0], w[1], w[2], w[3]};
    }
  }

  __device__ __forceinline__ static void store(StateT* row, int col, const float (&r)[kKPerLane]) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if constexpr (sizeof(StateT) == 4) {
        const float4 x{r[j * kVec + 0], r[j * kVec + 1], r[j * kVec + 2], r[j * kVec + 3]};
        __stcs(reinterpret_cast<float4*>(row + column(col, j)), x);
      } else {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = pack_bf16x2(r[j * kVec + 2 * i], r[j * kVec + 2 * i + 1]);
        __stcs(reinterpret_cast<uint4*>(row + column(col, j)), uint4{w[0], w[1], w[2], w[3]});
      }
    }
  }
};

// The thread's place in the CTA tile and the (sequence, head) it works on.
struct Coord {
  int64_t n;
  int h;
  int lane;
  int warp;
  int col;       // column group within the row (0..7)
  int row0;      // first state row of this thread; its rows are row0 + i * kRowsPerPass
  int cta_row0;  // first state row of the CTA
};

// The per-token scalars too small for cp.async: beta (2 or 4 bytes) and the speculative store
// slot of token t (-1: none). Loaded into registers by thread t of the CTA.
struct TokenWords {
  uint32_t beta;
  int32_t store_slot;
};

// One token's raw inputs for this CTA, staged in shared memory with cp.async (no registers held
// while in flight; all tokens of the sequence are requested at once, next to the state loads).
struct alignas(16) StagedToken {
  uint4 q[kHeadDimK * 2 / 16];        // bf16
  uint4 k[kHeadDimK * 2 / 16];        // bf16
  uint4 g[kHeadDimK * 4 / 16];        // fp32, or bf16 in the first half
  uint4 v[kMaxRowsPerCta * 2 / 16];   // bf16, the CTA's rows only
  TokenWords words;                   // beta: fp32 bits, or bf16 bits in the low half
};

// Requests tokens [t0, t0 + count) of the sequence starting at token bos: q, k, g and the CTA's
// rows of v, with cp.async (no registers held in flight) and without committing the group.
// kGChunks: g's 16-byte vectors a token (32 fp32, 16 bf16), so that the division by a token's
// vectors is by a constant (a multiply and a shift, where a run-time divisor cost ~20 instructions).
template <class TileT, int kGChunks>
__device__ __forceinline__ void stage_token_vectors_as(const DecodeArgs& a, const Coord& c, int64_t bos, int t0,
                                                       int count, StagedToken* staged) {
  constexpr int kQChunks = kHeadDimK * 2 / 16;
  constexpr int kVChunks = TileT::kRowsPerCta * 2 / 16;
  constexpr int kPerToken = 2 * kQChunks + kGChunks + kVChunks;
  for (int i = threadIdx.x; i < count * kPerToken; i += kThreads) {
    const int t = i / kPerToken;
    int r = i % kPerToken;
    const int64_t row = (bos + t0 + t) * a.H + c.h;  // token-head row of q, k, g, v
    StagedToken& st = staged[t];
    if (r < kQChunks) {
      cp_async_16(&st.q[r],
                  reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) + row * kHeadDimK) + r);
    } else if ((r -= kQChunks) < kQChunks) {
      cp_async_16(&st.k[r],
                  reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.k) + row * kHeadDimK) + r);
    } else if ((r -= kQChunks) < kGChunks) {
      const char* g_row = static_cast<const char*>(a.g) + row * kGChunks * 16;
      cp_async_16(&st.g[r], reinterpret_cast<const uint4*>(g_row) + r);
    } else {
      r -= kGChunks;
      cp_async_16(&st.v[r],
                  reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.v) + row * kHeadDimV + c.cta_row0) + r);
    }
  }
}
template <class TileT>
__device__ __forceinline__ void stage_token_vectors(const DecodeArgs& a, const Coord& c, int64_t bos, int t0,
                                                    int count, StagedToken* staged) {
  if (a.g_is_f32) stage_token_vectors_as<TileT, kHeadDimK * 4 / 16>(a, c, bos, t0, count, staged);
  else stage_token_vectors_as<TileT, kHeadDimK * 2 / 16>(a, c, bos, t0, count, staged);
}

__device__ __forceinline__ TokenWords load_token_words(const DecodeArgs& a, const Coord& c, int64_t bos, int t) {
  const int64_t beta_offset = (bos + t) * a.H + c.h;
  TokenWords w;
  w.beta = a.beta_is_f32 ? __ldg(static_cast<const uint32_t*>(a.beta) + beta_offset)
                         : uint32_t(__ldg(static_cast<const uint16_t*>(a.beta) + beta_offset));
  w.store_slot = -1;
  if (a.num_accepted_tokens != nullptr && t < a.indices_stride) {
    w.store_slot = __ldg(a.state_indices + c.n * a.indices_stride + t);
  }
  return w;
}

// Stages tokens [t0, t0 + count) completely: the vectors (one committed cp.async group) and the
// scalars. Every thread of the CTA calls it; the caller waits for the group and synchronises the
// CTA before reading.
template <class TileT>
__device__ __forceinline__ void stage_tokens(const DecodeArgs& a, const Coord& c, int64_t bos, int t0, int count,
                                             StagedToken* staged) {
  stage_token_vectors<TileT>(a, c, bos, t0, count, staged);
  cp_async_commit();
  if (threadIdx.x < count) staged[threadIdx.x].words = load_token_words(a, c, bos, t0 + int(threadIdx.x));
}

// Shared scratch of one token: the prepared scale·q̂, k̂, exp(a), all K channels. The CTA has
// kWarps of them: at one token each warp prepares the token into its own; from two tokens on
// warp w prepares token w of each group of kWarps into scratch w for the whole CTA (run_tokens).
struct WarpScratch {
  float4 q[kHeadDimK / 4];
  float4 k[kHeadDimK / 4];
  float4 decay[kHeadDimK / 4];
};

// The per-row scalars of one token.
template <int kRows>
struct TokenScalars {
  float v[kRows];
  float b;
};

// One token's preparation (docs/SPEC.md §2) in one warp: lane l's channels 4l..4l+3.
struct PreparedLane {
  float q[kPrepPerLane], k[kPrepPerLane], decay[kPrepPerLane];
};

__device__ __forceinline__ PreparedLane prepare_lane(const DecodeArgs& a, const Coord& c, const HeadGate& gate,
                                                     const float4& bias, const StagedToken& raw) {
  PreparedLane p;
  const uint2 q2 = reinterpret_cast<const uint2*>(raw.q)[c.lane];
  const uint2 k2 = reinterpret_cast<const uint2*>(raw.k)[c.lane];
  p.q[0] = bf16_lo(q2.x), p.q[1] = bf16_hi(q2.x), p.q[2] = bf16_lo(q2.y), p.q[3] = bf16_hi(q2.y);
  p.k[0] = bf16_lo(k2.x), p.k[1] = bf16_hi(k2.x), p.k[2] = bf16_lo(k2.y), p.k[3] = bf16_hi(k2.y);
  float g[kPrepPerLane];
  if (a.g_is_f32) {
    const uint4 g4 = raw.g[c.lane];
    g[0] = __uint_as_float(g4.x);
    g[1] = __uint_as_float(g4.y);
    g[2] = __uint_as_float(g4.z);
    g[3] = __uint_as_float(g4.w);
  } else {
    const uint2 g2 = reinterpret_cast<const uint2*>(raw.g)[c.lane];
    g[0] = bf16_lo(g2.x);
    g[1] = bf16_hi(g2.x);
    g[2] = bf16_lo(g2.y);
    g[3] = bf16_hi(g2.y);
  }
  if (a.pre.l2norm_qk) {
    warp_l2_normalize(p.q);
    warp_l2_normalize(p.k);
  }
  const float bias_arr[kPrepPerLane] = {bias.x, bias.y, bias.z, bias.w};
#pragma unroll
  for (int i = 0; i < kPrepPerLane; ++i) {
    p.q[i] *= a.scale;
    p.decay[i] = __expf(gate.log_decay(g[i], bias_arr[i]));
  }
  return p;
}

__device__ __forceinline__ void publish(const Coord& c, const PreparedLane& p, WarpScratch& scratch) {
  scratch.q[c.lane] = make_float4(p.q[0], p.q[1], p.q[2], p.q[3]);
  scratch.k[c.lane] = make_float4(p.k[0], p.k[1], p.k[2], p.k[3]);
  scratch.decay[c.lane] = make_float4(p.decay[0], p.decay[1], p.decay[2], p.decay[3]);
}

// The thread's rows of v and the token's beta.
template <class TileT>
__device__ __forceinline__ TokenScalars<TileT::kRowsPerThread> token_scalars(const DecodeArgs& a, const Coord& c,
                                                                             const StagedToken& raw) {
  TokenScalars<TileT::kRowsPerThread> s;
  const uint16_t* v_rows = reinterpret_cast<const uint16_t*>(raw.v) + (c.row0 - c.cta_row0);
#pragma unroll
  for (int i = 0; i < TileT::kRowsPerThread; ++i) s.v[i] = bf16_bits_to_float(v_rows[i * kRowsPerPass]);
  s.b = beta_activation(a.pre, a.beta_is_f32 ? __uint_as_float(raw.words.beta) : bf16_bits_to_float(raw.words.beta));
  return s;
}

// Prepares one token in the warp for the warp alone, through the warp's own scratch (read back per
// column in recur_token).
template <class TileT>
__device__ __forceinline__ TokenScalars<TileT::kRowsPerThread> prepare_token(
    const DecodeArgs& a, const Coord& c, const HeadGate& gate, const float4& bias, const StagedToken& raw,
    WarpScratch& scratch) {
  const PreparedLane p = prepare_lane(a, c, gate, bias, raw);
  __syncwarp();  // every lane has finished reading the previous token's scratch
  publish(c, p, scratch);
  __syncwarp();  // the scratch is complete
  return token_scalars<TileT>(a, c, raw);
}

// docs/SPEC.md §3 for one token on the thread's rows: decay, delta-rule correction, output read.
// Loops run column-outer so each prepared value is read from shared memory once and used for all
// rows of the thread. o[i]: output of row i, valid in all 8 lanes of the row.
template <typename StateT, int kRows>
__device__ __forceinline__ void recur_token(const Coord& c, const TokenScalars<kRows>& s,
                                            const WarpScratch& scratch, float (&state)[kRows][kKPerLane],
                                            float (&o)[kRows]) {
  using Row = RowAccess<StateT>;
  float pred[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) pred[i] = 0.0f;
#pragma unroll
  for (int j = 0; j < Row::kChunks; ++j) {
#pragma unroll
    for (int e = 0; e < Row::kVec; e += 4) {
      const int v4 = (Row::column(c.col, j) + e) / 4;
      const float4 d4 = scratch.decay[v4], k4 = scratch.k[v4];
      const float d[4] = {d4.x, d4.y, d4.z, d4.w}, k[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          float& st = state[i][j * Row::kVec + e + x];
          st *= d[x];
          pred[i] = fmaf(st, k[x], pred[i]);
        }
      }
    }
  }
  float delta[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    delta[i] = s.b * (s.v[i] - group_sum<kLanesPerRow>(pred[i]));
    o[i] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < Row::kChunks; ++j) {
#pragma unroll
    for (int e = 0; e < Row::kVec; e += 4) {
      const int v4 = (Row::column(c.col, j) + e) / 4;
      const float4 k4 = scratch.k[v4], q4 = scratch.q[v4];
      const float k[4] = {k4.x, k4.y, k4.z, k4.w}, q[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          float& st = state[i][j * Row::kVec + e + x];
          st = fmaf(delta[i], k[x], st);
          o[i] = fmaf(st, q[x], o[i]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) o[i] = group_sum<kLanesPerRow>(o[i]);
}

__device__ __forceinline__ int64_t cu_at(const DecodeArgs& a, int64_t i) {
  return offset_at(a.cu_seqlens, a.cu_seqlens_i64, i);
}

// A slot word as a start slot: -1 (padding) past the pool; negative words stay negative (padding).
__device__ __forceinline__ int32_t slot_in_pool(const DecodeArgs& a, int32_t slot) {
  return slot < a.pool_size ? slot : -1;
}

// Start slot of sequence n, or -1 for padding (negative index, out-of-range slot or accepted count).
__device__ __forceinline__ int32_t start_slot(const DecodeArgs& a, int64_t n) {
  int64_t t = 0;
  if (a.num_accepted_tokens != nullptr) {
    const int64_t accepted = __ldg(a.num_accepted_tokens + n);
    if (accepted < 1 || accepted > a.indices_stride) return -1;
    t = accepted - 1;
  }
  return slot_in_pool(a, __ldg(a.state_indices + n * a.indices_stride + t));
}

template <typename StateT>
__device__ __forceinline__ StateT* state_row(const DecodeArgs& a, int32_t slot, int h, int row) {
  return static_cast<StateT*>(a.state_pool) + ((int64_t(slot) * a.H + h) * kHeadDimV + row) * kHeadDimK;
}

// The thread's first state element in slot `slot` (row c.row0, column RowAccess::column(c.col, 0)):
// its row i lies i kRowsPerPass K elements on and its vector j RowAccess::column(0, j), offsets the
// loads and stores take as immediates (a pointer a row, formed in 64-bit arithmetic from the int
// row, cost ~13 instructions a row and vector).
template <typename StateT>
__device__ __forceinline__ StateT* thread_state(const DecodeArgs& a, const Coord& c, int32_t slot) {
  return state_row<StateT>(a, slot, c.h, c.row0) + RowAccess<StateT>::column(c.col, 0);
}

template <typename StateT, int kRows>
__device__ __forceinline__ void load_state(const DecodeArgs& a, const Coord& c, int32_t slot,
                                           float (&state)[kRows][kKPerLane]) {
  const StateT* const p = thread_state<StateT>(a, c, slot);
#pragma unroll
  for (int i = 0; i < kRows; ++i) RowAccess<StateT>::load(p + i * kRowsPerPass * kHeadDimK, 0, state[i]);
}

template <typename StateT, int kRows>
__device__ __forceinline__ void store_state(const DecodeArgs& a, const Coord& c, int32_t slot,
                                            const float (&state)[kRows][kKPerLane]) {
  StateT* const p = thread_state<StateT>(a, c, slot);
#pragma unroll
  for (int i = 0; i < kRows; ++i) RowAccess<StateT>::store(p + i * kRowsPerPass * kHeadDimK, 0, state[i]);
}

// The thread's coordinates for work item x: rows [kRowsPerCta * (x % kCtasPerHead), +kRowsPerCta)
// of head (x / kCtasPerHead) % H of sequence x / (kCtasPerHead * H).
template <class TileT>
__device__ __forceinline__ Coord thread_coord(int cta_row0, int h, int64_t n) {
  Coord c;
  c.cta_row0 = cta_row0;
  c.h = h;
  c.n = n;
  c.lane = int(threadIdx.x) % 32;
  c.warp = int(threadIdx.x) / 32;
  c.col = c.lane % kLanesPerRow;
  c.row0 = c.cta_row0 + c.warp * TileT::kRowsPerWarp + c.lane / kLanesPerRow;
  return c;
}
template <class TileT>
__device__ __forceinline__ Coord coord_of(const DecodeArgs& a, int64_t x) {
  const int64_t nh = x / TileT::kCtasPerHead;
  return thread_coord<TileT>(int(x % TileT::kCtasPerHead) * TileT::kRowsPerCta, int(nh % a.H), nh / a.H);
}
// The same for x < 2^31 with H's divider (the persistent kernels, which form three a CTA and item:
// launch.cu keeps their items below 2^31).
template <class TileT>
__device__ __forceinline__ Coord coord_of(const DecodeArgs& a, int32_t x, const FastDiv32& by_h) {
  const int32_t nh = x / TileT::kCtasPerHead, n = by_h.div(nh);
  return thread_coord<TileT>((x % TileT::kCtasPerHead) * TileT::kRowsPerCta, nh - n * a.H, n);
}

// A sequence's tokens and start slot. len <= 0: empty (nothing read or written); slot < 0:
// padding (no slot touched, outputs zero). Device cu_seqlens cannot be checked on the host: a
// range outside [0, total tokens] (tokens_per_seq holds the total with cu_seqlens) is empty too,
// so bad offsets never read or write past q, v, out.
struct Span {
  int64_t bos;
  int len;
  int32_t slot;
};

// The length rule of span_of for offsets [bos, eos), shared with the slot check's batched loads.
__device__ __forceinline__ int len_of(const DecodeArgs& a, int64_t bos, int64_t eos) {
  const bool in_range = a.cu_seqlens == nullptr || (bos >= 0 && eos <= a.tokens_per_seq);
  return in_range && eos > bos ? int(eos - bos) : 0;
}

__device__ __forceinline__ Span span_of(const DecodeArgs& a, int64_t n) {
  Span sp;
  sp.bos = a.cu_seqlens != nullptr ? cu_at(a, n) : n * a.tokens_per_seq;
  const int64_t eos = a.cu_seqlens != nullptr ? cu_at(a, n + 1) : sp.bos + a.tokens_per_seq;
  sp.len = len_of(a, sp.bos, eos);
  sp.slot = sp.len > 0 ? start_slot(a, n) : -1;
  return sp;
}

// span_of in two steps for the persistent kernels, which ask for an item's span three items ahead:
// load_span issues its loads (the offsets, and without num_accepted_tokens the start slot, which
// state_indices always holds for a sequence of the call) and resolve_span applies span_of's rules
// an item later, once they have landed. Resolved where it was loaded, the slot's range check held
// every warp for a load's latency at each item (the offsets, widened as offset_at reads them,
// still wait where they are loaded, on calls with cu_seqlens: splitting them too made the
// bulk-copy kernel spill). The same span as span_of.
struct SpanLoads {
  int64_t bos, eos;
  int32_t n;     // -1: past the last item
  int32_t slot;  // state_indices' word for the first token (num_accepted_tokens: resolved later)
};
__device__ __forceinline__ SpanLoads load_span(const DecodeArgs& a, int64_t n) {
  SpanLoads l;
  l.bos = a.cu_seqlens != nullptr ? cu_at(a, n) : n * a.tokens_per_seq;
  l.eos = a.cu_seqlens != nullptr ? cu_at(a, n + 1) : l.bos + a.tokens_per_seq;
  l.n = int32_t(n);  // item numbers, and so sequences, stay below 2^31 (launch.cu)
  l.slot = a.num_accepted_tokens == nullptr ? __ldg(a.state_indices + n * a.indices_stride) : -1;
  return l;
}
__device__ __forceinline__ Span resolve_span(const DecodeArgs& a, const SpanLoads& l) {
  if (l.n < 0) return Span{0, 0, -1};
  Span sp;
  sp.bos = l.bos;
  sp.len = len_of(a, l.bos, l.eos);
  if (sp.len <= 0) sp.slot = -1;
  else if (a.num_accepted_tokens != nullptr) sp.slot = start_slot(a, l.n);  // its loads depend on each other
  else sp.slot = slot_in_pool(a, l.slot);
  return sp;
}

__device__ __forceinline__ float4 load_bias(const DecodeArgs& a, const Coord& c) {
  if (a.pre.gate == GateForm::kPrecomputed || a.pre.dt_bias == nullptr) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  return __ldg(reinterpret_cast<const float4*>(a.pre.dt_bias + int64_t(c.h) * kHeadDimK) + c.lane);
}

// The CTA's rows of every output of the sequence set to `bits` (bf16): zero for padding, NaN
// where the sequence shares a slot (shares_a_slot).
template <class TileT>
__device__ __forceinline__ void fill_outputs(const DecodeArgs& a, const Coord& c, const Span& sp, uint16_t bits = 0) {
  for (int64_t tok = sp.bos; tok < sp.bos + sp.len; ++tok) {
    if (threadIdx.x < TileT::kRowsPerCta)
      static_cast<uint16_t*>(a.out)[(tok * a.H + c.h) * kHeadDimV + c.cta_row0 + threadIdx.x] = bits;
  }
}
constexpr uint16_t kBf16NaN = 0x7fc0;

// The slot check (the rule in calls of two or more sequences: internal::DecodeLaunch::check_slots;
// docs/DESIGN.md "Serving prefill"): sequence n is poisoned when a slot it reads or writes is also
// read or written by another sequence m of the call, the race that the CPU backend refuses by name.
// The uses of a live sequence (len > 0, start slot in [0, P)) are its start slot and, speculative,
// the store slots of tokens t < min(len, indices_stride) that lie in [0, P); other sequences use
// nothing. The relation is symmetric, so every sequence of a shared slot sees it.

__device__ __forceinline__ int32_t index_at(const DecodeArgs& a, int64_t n, int64_t t) {
  return __ldg(a.state_indices + n * a.indices_stride + t);
}
__device__ __forceinline__ bool in_pool(const DecodeArgs& a, int32_t s) { return s >= 0 && s < a.pool_size; }
// The tokens of a speculative sequence of `len` tokens that store: min(len, indices_stride).
__device__ __forceinline__ int store_count(const DecodeArgs& a, int len) {
  return int(len < a.indices_stride ? int64_t(len) : a.indices_stride);
}

// What a scan loads first of sequence m: its cu_seqlens offsets and accepted count (without them
// 0, tokens_per_seq and 1; past N an empty range). The loads are independent, so a batch issues
// every sequence's before it uses any.
struct SeqRaw {
  int64_t bos, eos;
  int32_t accepted;
};
__device__ __forceinline__ SeqRaw load_raw(const DecodeArgs& a, int64_t m) {
  SeqRaw r{0, 0, 1};
  if (m < a.num_seqs) {
    r.bos = a.cu_seqlens != nullptr ? cu_at(a, m) : 0;
    r.eos = a.cu_seqlens != nullptr ? cu_at(a, m + 1) : a.tokens_per_seq;
    if (a.num_accepted_tokens != nullptr) r.accepted = __ldg(a.num_accepted_tokens + m);
  }
  return r;
}

// The rest of what the scan needs before m's slots (span_of's and start_slot's rules): how many
// of its tokens store (min(len, indices_stride), speculative only) and the entry of its
// state_indices row that names its start slot (accepted - 1, or 0); start = -1: m uses nothing
// (empty, past N or an accepted count out of [1, indices_stride]).
struct SeqHead {
  int stores;
  int start;
};
__device__ __forceinline__ SeqHead head_of(const DecodeArgs& a, const SeqRaw& r) {
  const bool speculative = a.num_accepted_tokens != nullptr;
  const int len = len_of(a, r.bos, r.eos);
  SeqHead h{0, -1};
  if (len > 0 && (!speculative || (r.accepted >= 1 && r.accepted <= a.indices_stride))) {
    h.start = speculative ? r.accepted - 1 : 0;
    h.stores = speculative ? store_count(a, len) : 0;
  }
  return h;
}

// Sequences a thread loads at once in a scan (registers: about 3 a sequence, plus one a store
// slot in flight).
constexpr int kScanBatch = 4;

// visit(m, s) for every use s of every live sequence m of this thread's share, m = threadIdx.x,
// + kThreads, ...: kScanBatch sequences at a time, each round of loads issued for the whole batch
// before any result is used: the heads, then the start slots with the first kTokens store slots,
// then kTokens store slots a round, so a batch of T <= kTokens tokens costs at most two dependent
// round trips (one without cu_seqlens and num_accepted_tokens). A start slot that is also the store
// slot of one of the sequence's tokens (start < stores) is visited as that. Returns true after the
// first batch in which a visit returned true.
template <int kTokens, class Visit>
__device__ __forceinline__ bool visit_uses(const DecodeArgs& a, Visit&& visit) {
  for (int64_t m0 = threadIdx.x; m0 < a.num_seqs; m0 += kScanBatch * kThreads) {
    SeqRaw raw[kScanBatch];
#pragma unroll
    for (int b = 0; b < kScanBatch; ++b) raw[b] = load_raw(a, m0 + b * kThreads);
    SeqHead h[kScanBatch];
    int stores = 0;
#pragma unroll
    for (int b = 0; b < kScanBatch; ++b) {
      h[b] = head_of(a, raw[b]);
      stores = max(stores, h[b].stores);
    }
    int32_t slot[kScanBatch];
#pragma unroll
    for (int b = 0; b < kScanBatch; ++b) slot[b] = h[b].start >= 0 ? index_at(a, m0 + b * kThreads, h[b].start) : -1;
    bool met = false;
    for (int t0 = 0; t0 < stores; t0 += kTokens) {
      int32_t s[kTokens][kScanBatch];
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
#pragma unroll
        for (int b = 0; b < kScanBatch; ++b)
          s[j][b] = t0 + j < h[b].stores ? index_at(a, m0 + b * kThreads, t0 + j) : -1;
      }
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
#pragma unroll
        for (int b = 0; b < kScanBatch; ++b)
          if (in_pool(a, slot[b]) && in_pool(a, s[j][b])) met |= visit(m0 + b * kThreads, s[j][b]);
      }
    }
#pragma unroll
    for (int b = 0; b < kScanBatch; ++b) {
      if (in_pool(a, slot[b]) && h[b].start >= h[b].stores) met |= visit(m0 + b * kThreads, slot[b]);
    }
    if (met) return true;
  }
  return false;
}

// Whether a sequence m != n of this thread's share uses one of the slots own[0..kOwn).
template <int kTokens, int kOwn>
__device__ __forceinline__ bool meets_uses(const DecodeArgs& a, int64_t n, const int32_t (&own)[kOwn]) {
  return visit_uses<kTokens>(a, [&](int64_t m, int32_t s) {
    bool hit = false;
#pragma unroll
    for (int j = 0; j < kOwn; ++j) hit |= s == own[j];
    return hit && m != n;
  });
}

// Slots of sequence n compared per pass of the scan (registers held through it).
constexpr int kOwnUses = 4;

// Whether a slot that sequence n (span sp, live) uses is used by another sequence: this thread's
// share of the scan, the CTA's answer the OR of its threads'. n's uses sit in registers, kOwnUses
// per pass over the other sequences (one pass up to 4 speculative tokens); unused places hold n's
// start slot, so every place is compared. Exactly one use when n is not speculative or its start
// slot is its only store slot (no 4-wide compare then). kTokens: visit_uses.
template <int kTokens = 4>
__device__ __forceinline__ bool shares_a_slot(const DecodeArgs& a, int64_t n, const Span& sp) {
  const SeqHead h = head_of(a, load_raw(a, n));
  const int uses = h.stores + (h.start >= h.stores ? 1 : 0);  // the start slot counts unless a token stores there
  if (uses == 1) {
    const int32_t own[1] = {sp.slot};
    return meets_uses<kTokens>(a, n, own);
  }
  for (int u0 = 0; u0 < uses; u0 += kOwnUses) {
    int32_t own[kOwnUses];
#pragma unroll
    for (int j = 0; j < kOwnUses; ++j) {
      const int32_t s = u0 + j < h.stores ? index_at(a, n, u0 + j) : -1;
      own[j] = in_pool(a, s) ? s : sp.slot;
    }
    if (meets_uses<kTokens>(a, n, own)) return true;
  }
  return false;
}

// Runs every token of one item on the state in registers: outputs, speculative stores, the final
// store. Tokens stage in groups of the stage capacity (one group unless the input is invalid:
// more than 16 tokens); kFirstGroupStaged: the caller has staged the first group already.
// kCheckSlots (with !kFirstGroupStaged): the slot check scans while the first group
// and the state are in flight, and on a shared slot the outputs are NaN and nothing is stored.
// shared_rows (the bulk-copy kernel): the final state goes into this shared-memory copy of the
// CTA's rows instead of global memory (speculative stores still go to global memory).
template <typename StateT, class TileT, bool kFirstGroupStaged, bool kCheckSlots = false>
__device__ __forceinline__ void run_tokens(const DecodeArgs& a, const Coord& c, const Span& sp, const HeadGate& gate,
                                           const float4& bias, StagedToken* staged, WarpScratch* scratch,
                                           float (&state)[TileT::kRowsPerThread][kKPerLane],
                                           StateT* shared_rows = nullptr) {
  constexpr int kRows = TileT::kRowsPerThread;
  const bool speculative = a.num_accepted_tokens != nullptr;
  for (int t0 = 0; t0 < sp.len; t0 += a.stage_tokens) {
    const int count = min(a.stage_tokens, sp.len - t0);
    if (!kFirstGroupStaged || t0 > 0) {
      if (t0 > 0) __syncthreads();  // every warp has read the previous group
      stage_tokens<TileT>(a, c, sp.bos, t0, count, staged);
      if (kCheckSlots && t0 == 0) {
        // One store slot a scan round where the thread holds 4 state rows (64 registers) in
        // flight: wider rounds spill (kTokens of visit_uses).
        const bool shared = shares_a_slot<kRows >= 4 ? 1 : 4>(a, c.n, sp);
        cp_async_wait_all();
        if (__syncthreads_or(shared)) {
          fill_outputs<TileT>(a, c, sp, kBf16NaN);
          return;
        }
      } else {
        cp_async_wait_all();
        __syncthreads();
      }
    }
    // One token: each warp prepares it for itself (no CTA barrier). Two or more: warp w prepares
    // token t + w of each group of kWarps for the CTA, so that no warp repeats another's
    // preparation (at four tokens ~3/4 of it, docs/DESIGN.md "Decode on sm90"); a CTA barrier
    // hands the scratch over and another frees it for the next group.
    const bool shared_prep = count > 1;
    for (int t1 = 0; t1 < count; t1 += kWarps) {
      const int in_group = shared_prep ? min(kWarps, count - t1) : 1;
      if (shared_prep) {
        if (t1 > 0) __syncthreads();  // every warp has read the previous group's scratch
        if (c.warp < in_group) publish(c, prepare_lane(a, c, gate, bias, staged[t1 + c.warp]), scratch[c.warp]);
        __syncthreads();  // the group's scratch is complete
      }
      for (int u = 0; u < in_group; ++u) {
        const int t = t1 + u;
        const StagedToken& raw = staged[t];
        const TokenScalars<kRows> scalars = shared_prep ? token_scalars<TileT>(a, c, raw)
                                                        : prepare_token<TileT>(a, c, gate, bias, raw, scratch[c.warp]);
        float o[kRows];
        recur_token<StateT>(c, scalars, shared_prep ? scratch[u] : scratch[c.warp], state, o);

        if (c.col == 0) {
          uint16_t* out_row =
              static_cast<uint16_t*>(a.out) + ((sp.bos + t0 + t) * a.H + c.h) * kHeadDimV + c.row0;
#pragma unroll
          for (int i = 0; i < kRows; ++i) out_row[i * kRowsPerPass] = float_to_bf16_bits(o[i]);
        }
        const int32_t store_slot = raw.words.store_slot;
        if (speculative && store_slot >= 0 && store_slot < a.pool_size) store_state<StateT>(a, c, store_slot, state);
      }
    }
  }
  if (speculative) return;
  if (shared_rows != nullptr) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      RowAccess<StateT>::store_shared(shared_rows + (c.row0 + i * kRowsPerPass - c.cta_row0) * kHeadDimK, c.col,
                                      state[i]);
    }
    fence_proxy_async_shared();  // before thread 0's bulk store reads them (after a CTA barrier)
  } else {
    store_state<StateT>(a, c, sp.slot, state);
  }
}

// One CTA per work item (grid = N * H * kCtasPerHead). kCheckSlots: the slot check
// (internal::DecodeLaunch::check_slots), compiled only into the kernels that run it.
template <typename StateT, class TileT, bool kCheckSlots = false>
__global__ void __launch_bounds__(kThreads, TileT::kMinCtasPerSm) decode_kernel(const DecodeArgs a) {
  constexpr int kRows = TileT::kRowsPerThread;
  __shared__ WarpScratch scratch[kWarps];
  extern __shared__ StagedToken staged[];  // [a.stage_tokens]

  const Coord c = coord_of<TileT>(a, blockIdx.x);
  const Span sp = span_of(a, c.n);
  if (sp.len <= 0) return;  // empty sequence: nothing to read or write
  if (sp.slot < 0) {
    fill_outputs<TileT>(a, c, sp);
    return;
  }

  // The state loads go first: they are the bulk of the traffic and everything below overlaps them.
  float state[kRows][kKPerLane];
  load_state<StateT>(a, c, sp.slot, state);
  const HeadGate gate = HeadGate::make(a.pre, c.h);
  const float4 bias = load_bias(a, c);
  run_tokens<StateT, TileT, false, kCheckSlots>(a, c, sp, gate, bias, staged, scratch, state);
}

// Persistent variant: grid = a few CTAs per SM, each looping over items x = blockIdx.x, +gridDim.x,
// ... through a ring of kPersistentStages shared-memory buffers. While item i computes, items i+1
// and i+2 have their state rows, token vectors, dt_bias row and A_log in flight into the other
// buffers (cp.async: bytes in flight without registers), and item i+3's cu_seqlens and slot are
// being loaded, so the memory pipe never waits on one item's load -> compute -> store sequence.
// Dynamic shared memory, kPersistentStages of each:
//   [state]   kRowsPerCta x K StateT, row-major (a thread reads back what it copied)
//   [consts]  dt_bias row and A_log of the item's head
//   [staged]  stage_tokens StagedToken
struct alignas(16) HeadConsts {
  float4 bias[kHeadDimK / 4];
  float a_log;
};

template <class TileT, typename StateT>
struct PersistentLayout {
  static constexpr int kStateBytes = TileT::kRowsPerCta * kHeadDimK * int(sizeof(StateT));
  static constexpr int kStateElems = TileT::kRowsPerCta * kHeadDimK;
  static_assert(kStateBytes % 16 == 0 && sizeof(HeadConsts) % 16 == 0);
  __host__ __device__ static constexpr size_t bytes(int stage_tokens) {
    return kPersistentStages * (size_t(kStateBytes) + sizeof(HeadConsts) + size_t(stage_tokens) * sizeof(StagedToken));
  }
};

// A live item's inputs besides its state, into one buffer (cp.async, not committed): the first
// group's token vectors, the head's dt_bias row and A_log (the last warp; warp 0 stages beta), and
// for threads below the group's count the scalars of token threadIdx.x (returned).
template <class TileT>
__device__ __forceinline__ TokenWords stage_item_inputs(const DecodeArgs& a, const Coord& c, const Span& sp,
                                                        HeadConsts* consts, StagedToken* staged) {
  TokenWords words{0u, -1};
  const int count = min(a.stage_tokens, sp.len);
  stage_token_vectors<TileT>(a, c, sp.bos, 0, count, staged);
  if (c.warp == kWarps - 1) {
    if (a.pre.gate != GateForm::kPrecomputed && a.pre.dt_bias != nullptr) {
      cp_async_16(&consts->bias[c.lane], reinterpret_cast<const float4*>(a.pre.dt_bias + int64_t(c.h) * kHeadDimK) + c.lane);
    } else {
      consts->bias[c.lane] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (c.lane == 0 && a.pre.gate != GateForm::kPrecomputed) cp_async_4(&consts->a_log, a.pre.A_log + c.h);
  }
  if (threadIdx.x < count) words = load_token_words(a, c, sp.bos, int(threadIdx.x));
  return words;
}

// Issues item (c, sp)'s copies into one buffer as one cp.async group (possibly empty, so that
// wait_group<kPersistentStages - 1> always means "item i's copies have landed"). Returns the scalars of
// token threadIdx.x for threads below the first group's count.
template <typename StateT, class TileT>
__device__ __forceinline__ TokenWords prefetch_item(const DecodeArgs& a, const Coord& c, const Span& sp,
                                                    StateT* state_buf, HeadConsts* consts, StagedToken* staged) {
  TokenWords words{0u, -1};
  if (sp.len > 0 && sp.slot >= 0) {
    using Row = RowAccess<StateT>;
    const StateT* const src = thread_state<StateT>(a, c, sp.slot);  // and the same place in the buffer:
    StateT* const dst = state_buf + (c.row0 - c.cta_row0) * kHeadDimK + Row::column(c.col, 0);
#pragma unroll
    for (int i = 0; i < TileT::kRowsPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < Row::kChunks; ++j) {
        const int off = i * kRowsPerPass * kHeadDimK + Row::column(0, j);
        cp_async_16(dst + off, src + off);
      }
    }
    words = stage_item_inputs<TileT>(a, c, sp, consts, staged);
  }
  cp_async_commit();
  return words;
}

// The persistent kernel's slot check answers each item from a table built once per CTA: bit s of
// `marked` is set when two or more live sequences use slot s (the first sequence to claim s owns
// it, a claim by another marks it). The claims take P int32 owners, which borrow the ring before
// the first prefetch, so the table covers pools up to the ring's size at one stage token and 16384
// slots (2 KB of bits); larger pools (or N >= 2^31) scan per item (shares_a_slot).
template <class TileT, typename StateT>
struct SlotTable {
  static constexpr size_t kRingSlots = PersistentLayout<TileT, StateT>::bytes(1) / sizeof(int32_t);
  static constexpr int kSlots = int(kRingSlots < 16384 ? kRingSlots : 16384) / 32 * 32;
};

__device__ __forceinline__ bool is_marked(const uint32_t* marked, int32_t s) {
  return (marked[s / 32] >> (s % 32)) & 1u;
}

// Builds the table with the whole CTA; returns it, or null where the pool does not fit.
// kAsyncRefill: the ring is refilled through the async proxy (the bulk-copy kernel's TMA copies),
// so the owners' generic writes are fenced against it before the barrier that hands the ring over.
template <class TileT, typename StateT, bool kAsyncRefill = false>
__device__ __forceinline__ const uint32_t* mark_shared_slots(const DecodeArgs& a, void* ring) {
  constexpr int kSlots = SlotTable<TileT, StateT>::kSlots;
  __shared__ uint32_t marked[kSlots / 32];
  if (a.pool_size > kSlots || a.num_seqs > INT32_MAX) return nullptr;
  int32_t* const owner = static_cast<int32_t*>(ring);
  const int slots = int(a.pool_size);
  for (int s = threadIdx.x; s < slots; s += kThreads) owner[s] = -1;
  for (int w = threadIdx.x; w < (slots + 31) / 32; w += kThreads) marked[w] = 0u;
  __syncthreads();
  visit_uses<4>(a, [&](int64_t m, int32_t s) {
    const int32_t first = atomicCAS(owner + s, -1, int32_t(m));
    if (first != -1 && first != int32_t(m)) atomicOr(marked + s / 32, 1u << (s % 32));
    return false;
  });
  if constexpr (kAsyncRefill) fence_proxy_async_shared();
  __syncthreads();  // the table is complete, the ring free for the first prefetch
  return marked;
}

// Whether item sequence n (span sp, live) uses a slot that the table marks: thread 0 looks up the
// start slot, thread t below the first group's count the store slot of token t (its TokenWords w,
// -1 where none), and past the first group (more than 16 tokens: an invalid call) the threads load
// the remaining store slots.
__device__ __forceinline__ bool uses_a_marked_slot(const DecodeArgs& a, int64_t n, const Span& sp,
                                                   const TokenWords& w, const uint32_t* marked) {
  bool hit = threadIdx.x == 0 && is_marked(marked, sp.slot);
  if (int(threadIdx.x) < min(a.stage_tokens, sp.len) && in_pool(a, w.store_slot))
    hit |= is_marked(marked, w.store_slot);
  if (a.num_accepted_tokens != nullptr) {
    const int stores = store_count(a, sp.len);
    for (int t = a.stage_tokens + int(threadIdx.x); t < stores; t += kThreads) {
      const int32_t s = index_at(a, n, t);
      if (in_pool(a, s)) hit |= is_marked(marked, s);
    }
  }
  return hit;
}

template <typename StateT, class TileT, bool kCheckSlots = false>
__global__ void __launch_bounds__(kThreads, TileT::kMinCtasPerSm) decode_persistent_kernel(const DecodeArgs a,
                                                                                           int64_t items) {
  constexpr int kRows = TileT::kRowsPerThread;
  constexpr int kStages = kPersistentStages;
  static_assert(kStages == 3, "the register rotation below holds items i, i+1, i+2 and i+3");
  using Layout = PersistentLayout<TileT, StateT>;
  __shared__ WarpScratch scratch[kWarps];
  extern __shared__ uint4 smem[];
  StateT* const state0 = reinterpret_cast<StateT*>(smem);
  HeadConsts* const consts0 =
      reinterpret_cast<HeadConsts*>(reinterpret_cast<char*>(smem) + kStages * Layout::kStateBytes);
  StagedToken* const staged0 = reinterpret_cast<StagedToken*>(consts0 + kStages);
  const FastDiv32 by_h(a.H);  // item numbers stay below 2^31 (launch.cu)
  const auto prefetch = [&](int64_t y, const Span& sp, int b) {
    return prefetch_item<StateT, TileT>(a, coord_of<TileT>(a, int32_t(y), by_h), sp, state0 + b * Layout::kStateElems, consts0 + b,
                                        staged0 + b * a.stage_tokens);
  };
  const auto loads_at = [&](int64_t y) {  // item y's span three items ahead: resolved an item later
    return y < items ? load_span(a, coord_of<TileT>(a, int32_t(y), by_h).n) : SpanLoads{0, 0, -1, -1};
  };
  const auto span_at = [&](int64_t y) { return resolve_span(a, loads_at(y)); };

  // Item i = x lives in buffer b = i % 3. Registers: spans of items i, i+1, i+2 (the last one's
  // loads issued an iteration ago) and the token scalars of items i and i+1.
  const int64_t step = gridDim.x;
  int64_t x = blockIdx.x;  // the launcher keeps gridDim.x <= items
  Span sp0 = span_at(x), sp1 = span_at(x + step);
  const uint32_t* marked = nullptr;  // the slot check's table (null: scan per item)
  if constexpr (kCheckSlots) marked = mark_shared_slots<TileT, StateT>(a, smem);
  TokenWords w0 = prefetch(x, sp0, 0);
  TokenWords w1{0u, -1};
  if (x + step < items) w1 = prefetch(x + step, sp1, 1);
  else cp_async_commit();
  Span sp2 = span_at(x + 2 * step);

  for (int b = 0; x < items; x += step, b = (b == kStages - 1) ? 0 : b + 1) {
    StagedToken* const staged = staged0 + b * a.stage_tokens;
    __syncthreads();  // every thread is done with item i-1, whose buffer item i+2 takes
    if (threadIdx.x < min(a.stage_tokens, sp0.len)) staged[threadIdx.x].words = w0;
    const int b2 = (b == 0) ? kStages - 1 : b - 1;  // (i + 2) % 3
    TokenWords w2{0u, -1};
    if (x + 2 * step < items) w2 = prefetch(x + 2 * step, sp2, b2);
    else cp_async_commit();
    const SpanLoads loads3 = loads_at(x + 3 * step);
    bool shared = false;  // the slot check: on a shared slot NaN outputs, no store
    Coord c;  // the item's place (64-bit divisions by H): formed once, with the check before the waits
    if constexpr (kCheckSlots) {
      c = coord_of<TileT>(a, int32_t(x), by_h);
      const bool meets = sp0.len > 0 && sp0.slot >= 0 &&
                         (marked != nullptr ? uses_a_marked_slot(a, c.n, sp0, w0, marked) : shares_a_slot(a, c.n, sp0));
      cp_async_wait_group<kStages - 1>();
      shared = __syncthreads_or(meets);
    } else {
      cp_async_wait_group<kStages - 1>();  // this thread's copies of item i have landed
      __syncthreads();  // and everyone's
      c = coord_of<TileT>(a, int32_t(x), by_h);
    }

    if (sp0.len > 0 && sp0.slot < 0) fill_outputs<TileT>(a, c, sp0);
    if (shared) fill_outputs<TileT>(a, c, sp0, kBf16NaN);
    if (sp0.len > 0 && sp0.slot >= 0 && !shared) {
      const StateT* rows = state0 + b * Layout::kStateElems;
      float state[kRows][kKPerLane];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        RowAccess<StateT>::load_shared(rows + (c.row0 + i * kRowsPerPass - c.cta_row0) * kHeadDimK, c.col, state[i]);
      }
      const HeadConsts& hc = consts0[b];
      const HeadGate gate = HeadGate::from_a_log(a.pre, hc.a_log);
      run_tokens<StateT, TileT, true>(a, c, sp0, gate, hc.bias[c.lane], staged, scratch, state);
    }
    sp0 = sp1, sp1 = sp2, sp2 = resolve_span(a, loads3);
    w0 = w1, w1 = w2;
  }
  cp_async_wait_all();  // nothing may be in flight into shared memory when the CTA exits
}

// Bulk-copy variant of the persistent kernel (internal::DecodeLaunch::persistent = 2 with four
// buffers, 3 with three; a candidate, measured slower than the default except at small batches:
// docs/DESIGN.md "Decode on sm90"):
// the same items and token staging, but each item's state rows (one contiguous block of
// kRowsPerCta x K) arrive by one bulk copy (the TMA unit) completing on the buffer's mbarrier, and
// leave by one bulk store from the same buffer, so no thread holds a state byte in flight either
// way. Ring of kRing buffers: item i in buffer i % kRing; at the top of iteration i thread 0
// issues item i-1's store (its rows written and fenced by every thread before the CTA barrier),
// waits until the store of the item that last used buffer (i + 2) % kRing has read it (item i-2
// with four buffers, i-1 itself with three), and issues item i+2's copy into it. So two items'
// loads, and with four buffers up to two items' stores, are in flight while item i computes. Four
// buffers cost a CTA an SM (two fit up to ~10 staged tokens, one from 12; three buffers: three up
// to 5 tokens, two beyond), and three wait for each store's read of shared memory. Speculative
// stores (after each token) still go from registers to global memory, and a speculative item
// writes no rows back (so it fences nothing before its buffer is refilled: its reads are ordered
// by the CTA barriers alone, as in CUTLASS's TMA pipelines). kCheckSlots: the slot check, by the
// persistent kernel's table (mark_shared_slots, in the ring before the first copy).
template <class TileT, typename StateT, int kRing>
struct BulkLayout {
  static constexpr int kStateBytes = PersistentLayout<TileT, StateT>::kStateBytes;
  static constexpr int kStateElems = PersistentLayout<TileT, StateT>::kStateElems;
  __host__ __device__ static constexpr size_t bytes(int stage_tokens) {
    return kRing * (size_t(kStateBytes) + sizeof(HeadConsts) + size_t(stage_tokens) * sizeof(StagedToken));
  }
};

// Item (c, sp)'s copies into one buffer: thread 0 the state block on `full` (one arrival per item,
// with the block's bytes when it is live), every thread its share of the token vectors and the
// head's constants as one cp.async group (possibly empty). Returns prefetch_item's token scalars.
template <typename StateT, class TileT, int kRing>
__device__ __forceinline__ TokenWords prefetch_item_bulk(const DecodeArgs& a, const Coord& c, const Span& sp,
                                                         StateT* state_buf, HeadConsts* consts, StagedToken* staged,
                                                         uint64_t* full) {
  TokenWords words{0u, -1};
  const bool live = sp.len > 0 && sp.slot >= 0;
  if (threadIdx.x == 0) {
    if (live) {
      constexpr uint32_t kBytes = BulkLayout<TileT, StateT, kRing>::kStateBytes;
      mbarrier_arrive_expect_tx(full, kBytes);
      bulk_copy(state_buf, state_row<StateT>(a, sp.slot, c.h, c.cta_row0), kBytes, full);
    } else {
      mbarrier_arrive(full);
    }
  }
  if (live) {
    words = stage_item_inputs<TileT>(a, c, sp, consts, staged);
  }
  cp_async_commit();
  return words;
}

template <typename StateT, class TileT, int kRing, bool kCheckSlots = false>
__global__ void __launch_bounds__(kThreads, TileT::kMinCtasPerSm) decode_bulk_kernel(const DecodeArgs a, int64_t items) {
  static_assert(kRing == 3 || kRing == 4, "items i..i+2 in flight, plus one store with four buffers");
  static_assert(BulkLayout<TileT, StateT, kRing>::bytes(1) >= PersistentLayout<TileT, StateT>::bytes(1),
                "the slot table (SlotTable) borrows a ring of the persistent kernel's size");
  constexpr int kRows = TileT::kRowsPerThread;
  using Layout = BulkLayout<TileT, StateT, kRing>;
  __shared__ WarpScratch scratch[kWarps];
  __shared__ uint64_t full[kRing];
  extern __shared__ uint4 smem[];
  StateT* const state0 = reinterpret_cast<StateT*>(smem);
  HeadConsts* const consts0 = reinterpret_cast<HeadConsts*>(reinterpret_cast<char*>(smem) + kRing * Layout::kStateBytes);
  StagedToken* const staged0 = reinterpret_cast<StagedToken*>(consts0 + kRing);
  if (threadIdx.x == 0) {
    for (int b = 0; b < kRing; ++b) mbarrier_init(&full[b], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  const FastDiv32 by_h(a.H);  // item numbers stay below 2^31 (launch.cu)
  const auto prefetch = [&](int64_t y, const Span& sp, int b) {
    return prefetch_item_bulk<StateT, TileT, kRing>(a, coord_of<TileT>(a, int32_t(y), by_h), sp, state0 + b * Layout::kStateElems,
                                             consts0 + b, staged0 + b * a.stage_tokens, &full[b]);
  };
  const auto loads_at = [&](int64_t y) {  // item y's span three items ahead: resolved an item later
    return y < items ? load_span(a, coord_of<TileT>(a, int32_t(y), by_h).n) : SpanLoads{0, 0, -1, -1};
  };
  const auto span_at = [&](int64_t y) { return resolve_span(a, loads_at(y)); };

  // Registers as in decode_persistent_kernel: spans of items i..i+2, token scalars of i and i+1.
  const int64_t step = gridDim.x;
  int64_t x = blockIdx.x;  // the launcher keeps gridDim.x <= items
  Span sp0 = span_at(x), sp1 = span_at(x + step);
  const uint32_t* marked = nullptr;  // the slot check's table (null: scan per item), as in the persistent kernel
  if constexpr (kCheckSlots) marked = mark_shared_slots<TileT, StateT, true>(a, smem);
  TokenWords w0 = prefetch(x, sp0, 0);
  TokenWords w1{0u, -1};
  if (x + step < items) w1 = prefetch(x + step, sp1, 1);
  else cp_async_commit();
  Span sp2 = span_at(x + 2 * step);
  StateT* store_to = nullptr;  // where item i-1's rows go (thread 0 issues the store; null: none)

  for (int64_t i = 0; x < items; x += step, ++i) {
    const int b = int(i % kRing), b2 = int((i + 2) % kRing);
    StagedToken* const staged = staged0 + b * a.stage_tokens;
    __syncthreads();  // item i-1 is done: its buffer's rows written and fenced, its token buffers free
    if (threadIdx.x == 0) {
      if (store_to != nullptr) bulk_store(store_to, state0 + ((i + kRing - 1) % kRing) * Layout::kStateElems, Layout::kStateBytes);
      bulk_commit();                // one group per item, empty or not, so that
      bulk_wait_read<kRing - 3>();  // the store of buffer b2's last item has read it
    }
    if (threadIdx.x < min(a.stage_tokens, sp0.len)) staged[threadIdx.x].words = w0;
    TokenWords w2{0u, -1};
    if (x + 2 * step < items) w2 = prefetch(x + 2 * step, sp2, b2);
    else cp_async_commit();
    const SpanLoads loads3 = loads_at(x + 3 * step);
    const bool live = sp0.len > 0 && sp0.slot >= 0;
    // The slot check: this thread's share of whether item i's sequence uses a slot that another
    // sequence uses (before the waits, so its loads overlap them).
    bool meets = false;
    Coord c;  // the item's place (64-bit divisions by H): formed once, with the check before the waits
    if constexpr (kCheckSlots) {
      c = coord_of<TileT>(a, int32_t(x), by_h);
      meets = live && (marked != nullptr ? uses_a_marked_slot(a, c.n, sp0, w0, marked) : shares_a_slot(a, c.n, sp0));
    }
    cp_async_wait_group<2>();                           // this thread's token copies of item i have landed
    mbarrier_wait(&full[b], uint32_t(i / kRing) & 1u);  // and item i's state block
    bool shared = false;
    if constexpr (kCheckSlots) shared = __syncthreads_or(meets);  // and everyone's token copies and answers
    else __syncthreads();                                          // and everyone's token copies
    if constexpr (!kCheckSlots) c = coord_of<TileT>(a, int32_t(x), by_h);

    StateT* const rows = state0 + b * Layout::kStateElems;
    store_to = nullptr;
    if (sp0.len > 0 && sp0.slot < 0) fill_outputs<TileT>(a, c, sp0);
    if (shared) fill_outputs<TileT>(a, c, sp0, kBf16NaN);  // and nothing stored: the slots keep their contents
    if (live && !shared) {
      float state[kRows][kKPerLane];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        RowAccess<StateT>::load_shared(rows + (c.row0 + r * kRowsPerPass - c.cta_row0) * kHeadDimK, c.col, state[r]);
      }
      const HeadConsts& hc = consts0[b];
      const HeadGate gate = HeadGate::from_a_log(a.pre, hc.a_log);
      run_tokens<StateT, TileT, true>(a, c, sp0, gate, hc.bias[c.lane], staged, scratch, state, rows);
      if (a.num_accepted_tokens == nullptr) store_to = state_row<StateT>(a, sp0.slot, c.h, c.cta_row0);
    }
    sp0 = sp1, sp1 = sp2, sp2 = resolve_span(a, loads3);
    w0 = w1, w1 = w2;
  }
  __syncthreads();  // the last item's rows are written and fenced
  if (threadIdx.x == 0) {
    if (store_to != nullptr) {
      const int64_t done = (int64_t(items) - 1 - blockIdx.x) / step + 1;  // items this CTA ran
      bulk_store(store_to, state0 + ((done - 1) % kRing) * Layout::kStateElems, Layout::kStateBytes);
    }
    bulk_commit();
    bulk_wait_read<0>();  // no store may still read shared memory when the CTA exits
  }
  cp_async_wait_all();
}

}  // namespace flashkda::cuda::sm90::decode
