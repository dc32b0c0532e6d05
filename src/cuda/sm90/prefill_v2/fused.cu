// The fused chunk-32 prefill (fused.h): grid = H, 384 threads. Warpgroup 0 produces chunk c's
// record into stage c % 2 of a shared-memory ring (its own named barrier 1 inside produce_chunk,
// then every producer thread arrives on full[c % 2]); warpgroups 1 and 2 wait for it, run the
// chunk for value rows 0-63 and 64-127, and every consumer thread arrives on empty[c % 2], which
// the producer waits for before it writes chunk c + 2 there. By default all three run at the
// launch's 168 registers (FusedArgs::producer_regs: setmaxnreg 184 / 160).
// Each stage also holds the chunk's v rows, which one thread of the producer's warp 1 copies in by
// TMA (two tensor copies of the chunk's 32 rows, 64 channels each, into a swizzled tile: staged_v;
// the maps of q, k, g and v are built per call) as the stage is rebuilt, completing on the same
// full barrier. FusedArgs::stage_inputs: the same thread copies chunk c + 2's q, k, g rows into
// chunk c's buffer of two (bf16 gates; fp32 gates: chunk c + 1's into one buffer) by TMA
// (issue_chunk_rows) once chunk c's factors have read it for the last time; the producer reads q
// and k from there where it uses them instead of holding them in registers.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "backend.h"

#include "cuda/device_info.h"
#include "cuda/sm90/prefill_v2/consume.cuh"
#include "cuda/sm90/prefill_v2/fused.h"

namespace flashkda::cuda::sm90::prefill_v2 {
namespace {

constexpr int kFusedThreads = 3 * kThreads;
constexpr int kStages = 2;
constexpr int kRecordSpan = (ChunkOperands::kBytes + 1023) & ~1023;
constexpr int kScratchSpan = (ProduceScratch::kBytes + 1023) & ~1023;
constexpr int kVBytes = kChunk * kHeadDim * 2;           // the chunk's v rows, [32][128] bf16
// The stage's v (and the output the consumers stage in its place) as the v tensor map's two copies
// leave it: a 32 x 128 SW128 tile (layout.h sw128_offset: channels 0-63, then 64-127, token t's
// 16-byte granule j at j ^ (t % 8)). So a warp's loads of one accumulator slot (8 channels of
// tokens 2 t4 + const) and its 16-byte reads of the output's rows fall in distinct banks, where
// unswizzled rows (256 bytes apart: every token in the same banks) cost 4 wavefronts each.
__device__ __forceinline__ __nv_bfloat16& staged_v(const uint8_t* vs, int t, int c) {
  return *reinterpret_cast<__nv_bfloat16*>(const_cast<uint8_t*>(vs) + sw128_offset(kChunk, t, c));
}
// The most sequences in a fused call: the grid's y dimension.
constexpr int64_t kMaxFusedSeqs = 65535;
// Shared memory: the ring's stages (a stage: the record, then v, then with kConsumerInv the fp32 L
// and beta that the consumers invert), the producer's scratch, with kConsumerInv each consumer
// warpgroup's inv_b (split SW64 tiles) and forward-substitution scratch, the barriers (and the
// phase clocks' sums), the staged inputs.
template <bool kStaged, bool kConsumerInv>
struct SmemLayout {
  static constexpr int kOffLBeta = kRecordSpan + kVBytes;  // in a stage
  static constexpr int kStageSpan = (kOffLBeta + (kConsumerInv ? kLBetaBytes : 0) + 1023) & ~1023;
  static constexpr int kOffScratch = kStages * kStageSpan;
  static constexpr int kInvSpan = 8192;  // inv hi, lo (2 KB each), invert_warpgroup's scratch: one, shared
  static constexpr int kOffInv = kOffScratch + kScratchSpan;
  static constexpr int kOffBarriers = kOffInv + (kConsumerInv ? kInvSpan : 0);
  static constexpr int kOffClocks = kOffBarriers + 64;  // FusedArgs::phase_clocks' sums (kPhaseClocks long longs)
  static constexpr int kOffSeqArgs = kOffClocks + kPhaseClocks * 8;  // FusedArgs::num_seqs: the CTA's sequence
  static constexpr int kOffStaged = kOffBarriers + 1024;  // the producer's staged inputs (kStagedBufs buffers)
  // + full[2], empty[2], staged_full[2], the pieces' verdict's (64 bytes: 8 barriers); + the 1024-byte alignment
  static constexpr int kBytes = (kStaged ? kOffStaged + kStagedRegionBytes : kOffClocks + kPhaseClocks * 8) + 1024;
  static_assert(2 * kSmallBytes + ProduceScratch::kInvScratchBytes <= kInvSpan);
  static_assert(kBytes <= 227 * 1024);
};

// FusedArgs::chunk_trace: clock64() as chunk c of head h reaches `point` (timing only).
__device__ __forceinline__ void trace_point(const FusedArgs& a, int h, int64_t c, int point) {
  if (a.chunk_trace != nullptr && h < kTraceHeads && c < kTraceChunks)
    a.chunk_trace[(int64_t(h) * kTraceChunks + c) * kTracePoints + point] = clock64();
}

// The pieces' timing rows (piece_stamps, start_stamps): this CTA's, row y H + x of the grid.
__device__ __forceinline__ int64_t stamps_cta() { return int64_t(blockIdx.y) * gridDim.x + blockIdx.x; }
// FusedArgs::piece_stamps (timing only): this CTA's row of values, and where it reaches `point`, in
// %globaltimer nanoseconds.
__device__ __forceinline__ long long* piece_stamps_row(const FusedArgs& a) {
  return a.piece_stamps + stamps_cta() * kPieceStamps;
}
__device__ __forceinline__ void piece_stamp(const FusedArgs& a, int point) {
  if (a.piece_stamps == nullptr) return;
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  piece_stamps_row(a)[point] = t;
}

// FusedArgs::start_stamps (timing only, the pieces' kernel with kStart): as piece_stamp, its own row;
// value >= 0: that value in place of the time.
template <bool kStart>
__device__ __forceinline__ void start_stamp(const FusedArgs& a, int point, long long value = -1) {
  if constexpr (kStart) {
    if (a.start_stamps == nullptr) return;
    long long t = value;
    if (value < 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    a.start_stamps[stamps_cta() * kStartStamps + point] = t;
  }
}
// FusedArgs::start_stamps' points 9 + 8 c + j (kStart): the steps of chunks c = 0 and 1 in
// produce_chunk, as its mark(i) calls come (thread 0): j = 0 the load (i = 1), 1 the gate and row scales
// (9), 2 the norms where apart (2), 3 the scan, 4 the factors, 5 the L / Mqk product, 6 their stores;
// then 7 the producer's arrival on the chunk's full stage (produce_item's mark 8). The stamped kernel's
// consumers invert (kConsumerInv), so produce_chunk ends at its mark 6.
struct ChunkStepStamps {
  const FusedArgs* a;
  int64_t chunk;
  int tid;
  __device__ __forceinline__ void operator()(int i) const {
    const int j = i == 1 ? 0 : i == 9 ? 1 : i >= 2 && i <= 6 ? i : i == 8 ? 7 : -1;
    if (tid == 0 && chunk < 2 && j >= 0) start_stamp<true>(*a, 9 + 8 * int(chunk) + j);
  }
};
// Whether bar's phase of `parity` has completed, without waiting (the start stamps' point 8).
__device__ __forceinline__ bool mbarrier_done(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// FusedArgs::phase_clocks: mark(i) adds the cycles since the previous mark to sums[i].
struct PhaseMarks {
  long long* sums;  // shared memory; null: off
  long long* last;
  __device__ __forceinline__ void operator()(int i) const {
    if (sums != nullptr) {
      const long long t = clock64();
      sums[i] += t - *last;
      *last = t;
    }
  }
};

// Announces `bytes` more to complete on the barrier's current phase, without an arrival.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Named barrier 2: both consumer warpgroups (256 threads; the producer's is 1). An immediate id (a
// register id makes ptxas reserve all 16 barriers).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 2, 256;" ::: "memory"); }
// The same barrier, returning to every consumer thread whether x was true in any.
__device__ __forceinline__ bool consumers_sync_or(bool x) { return named_barrier_or<2, 2 * kThreads>(x); }

// The kernel's parameters: the caller's arguments and the TMA maps of its inputs' rows.
struct FusedParams {
  ChunkRowMaps maps;
  FusedArgs a;
};

// kSeqs (FusedArgs::num_seqs, cu_seqlens): sequence n's first token and length, from the device
// cu_seqlens (checked by K0 before: FusedArgs::error_flag) or the uniform length.
__device__ __forceinline__ void sequence_span(const FusedArgs& a, int64_t n, int64_t& bos, int64_t& len) {
  if (a.cu_seqlens == nullptr) {
    len = a.produce.T / a.num_seqs, bos = n * len;
    return;
  }
  const auto cu = [&](int64_t i) -> int64_t {
    return a.cu_seqlens_64 ? static_cast<const int64_t*>(a.cu_seqlens)[i] : static_cast<const int32_t*>(a.cu_seqlens)[i];
  };
  bos = cu(n), len = cu(n + 1) - bos;
}

// K0 refused the call (invalid cu_seqlens, a live slot named twice, a checkpoint count the lengths
// do not give): out, final_state and dense checkpoints filled with NaN, a disjoint share by each
// CTA, the pool left as it was (as the chunk-16 kernels do: loud, never silent garbage).
__device__ __noinline__ void poison_fused_outputs(const FusedArgs& a) {
  const int64_t threads = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  const int64_t first = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  const float nan = __int_as_float(0x7fc00000);
  const int64_t n_out = a.consume.T * a.consume.H * kHeadDim;
  for (int64_t i = first; i < n_out; i += threads) static_cast<__nv_bfloat16*>(a.consume.out)[i] = __float2bfloat16(nan);
  if (a.checkpoints != nullptr) {
    const int64_t n_ckpt = a.num_checkpoints * a.consume.H * kHeadDim * kHeadDim;
    for (int64_t i = first; i < n_ckpt; i += threads)
      prefill::store_state_elem(a.checkpoints, a.checkpoints_bf16 ? ElemType::kBF16 : ElemType::kF32, i, nan);
  }
  if (a.consume.final_state == nullptr) return;
  const int64_t n_state = a.num_seqs * a.consume.H * kHeadDim * kHeadDim;
  for (int64_t i = first; i < n_state; i += threads) a.consume.final_state[i] = nan;
}

// A padding sequence's output rows (len of them from out, [len, H, 128] bf16): zeros in head h's
// 128 columns, 16 bytes a store, by `threads` threads (this one the thread-th). Out of line: inline,
// its loop made the kernel spill 28 bytes. Never called after setmaxnreg.dec: a call there makes
// ptxas drop the kernel's register split (C7507).
__device__ __noinline__ void zero_head_rows(void* out, int64_t len, int H, int h, int thread, int threads) {
  const int64_t row = int64_t(H) * kHeadDim;
  uint4* const o = static_cast<uint4*>(out);
  for (int64_t i = thread; i < len * (kHeadDim / 8); i += threads)
    o[((i / (kHeadDim / 8)) * row + int64_t(h) * kHeadDim) / 8 + i % (kHeadDim / 8)] = make_uint4(0, 0, 0, 0);
}

// A padding sequence's dense checkpoints (FusedArgs::checkpoints; len / checkpoint_every of them
// from first_ckpt): head h's [V, K] state of each zero, as its output rows. Out of line and called
// where zero_head_rows is, for the same reasons.
__device__ __noinline__ void zero_head_checkpoints(const FusedArgs& a, int64_t first_ckpt, int64_t len, int h,
                                                   int thread, int threads) {
  if (a.checkpoints == nullptr || a.checkpoint_every <= 0) return;
  constexpr int64_t kState = int64_t(kHeadDim) * kHeadDim;
  const ElemType type = a.checkpoints_bf16 ? ElemType::kBF16 : ElemType::kF32;
  for (int64_t c = first_ckpt; c < first_ckpt + len / a.checkpoint_every && c < a.num_checkpoints; ++c)
    for (int64_t i = thread; i < kState; i += threads)
      prefill::store_state_elem(a.checkpoints, type, (c * a.consume.H + h) * kState + i, 0.f);
}

// Checkpoint ck of head h (FusedArgs::checkpoints or checkpoint_slots): this thread's rows of the
// state S (the consumers' S_st, its rows' 1 / m in inv), stored as the final state is.
__device__ __forceinline__ void store_checkpoint(const FusedArgs& a, int64_t ck, int h, const float (&S)[64], int v_row,
                                                 int t4, const float (&inv)[2]) {
  if (ck >= a.num_checkpoints) return;
  const int64_t state = int64_t(kHeadDim) * kHeadDim, head = h * state;
  if (a.checkpoints != nullptr) {
    prefill::store_state_rows(S, a.checkpoints, a.checkpoints_bf16 ? ElemType::kBF16 : ElemType::kF32,
                              ck * a.consume.H * state + head, v_row, t4, inv);
  } else {
    const int64_t slot = a.checkpoint_slots[ck];
    if (slot >= 0 && slot < a.pool_size)
      prefill::store_state_rows(S, a.state_pool, a.pool_bf16 ? ElemType::kBF16 : ElemType::kF32,
                                slot * a.consume.H * state + head, v_row, t4, inv);
  }
}

// FusedArgs::producer_regs: the producer's registers after setmaxnreg, and the consumers'.
// setmaxnreg.inc only takes registers that the CTA already holds (the launch's count for all 384
// threads) and the consumers gave back: asking for more waits forever (run 84: 192 / 160 hung).
constexpr int kProducerRegs = 184, kConsumerRegs = 160;
constexpr int kLaunchRegs = 168;  // __launch_bounds__(384, 1): 65 536 / 384, rounded down to 8
static_assert(kThreads * kProducerRegs + 2 * kThreads * kConsumerRegs <= 3 * kThreads * kLaunchRegs,
              "the producer would wait for registers no one frees");

// The arguments of a CTA's current sequence (FusedArgs::num_seqs), in shared memory at
// SmemLayout::kOffSeqArgs (written by thread 0, read where they are used).
struct SeqArgs {
  ProduceArgs produce;  // T < 0: a padding sequence of -(T + 1) tokens
  ConsumeArgs consume;
  int64_t bos;          // its first token in the TMA maps' rows
  int64_t first_ckpt;   // its first checkpoint (FusedArgs::checkpoint_every)
  int head;             // FusedArgs::pieces: the CTA's head (pieces_chain: its ticket's)
  // FusedArgs::pieces_chain: the piece's index among the call's (y H + h of CTA row y = n pieces + p),
  // whether it publishes its end state (a sequence's pieces but its last), and the consumers' verdict
  // after the warm-up (set by their thread 0, read by all after a barrier): wait for the piece before.
  int64_t item;
  int64_t chunk0;  // FusedArgs::pieces: the sequence's chunk at the piece's first (its warm-up's)
  int publish;
  volatile int chain;
  // FusedArgs::pieces: the piece's warm-up chunks (0: the first piece), and its stop: abort (set by
  // the consumers' thread 0 once the gates' pre-check or a warm-up bound failed or
  // FusedArgs::pieces_flag is set, read by the consumers after a barrier), its snapshot
  // stage_stop[s] (written by the consumers' thread 0 before it releases stage s, read by the
  // producer after its wait for that release: every producer warp reads the same value, which the
  // consumers rewrite only after the producer's next arrival on full[s]) and stopped_at (the chunk
  // at which the producer stopped, written before its last arrival on the full barrier; INT64_MAX:
  // none; written and read by 64-bit shared atomics, stopped_at_store / stopped_at_load, as the
  // consumers may read it while the producer writes it).
  int warmup;
  volatile int abort;
  volatile int stage_stop[2];
  volatile int64_t stopped_at;
  // FusedArgs::pieces without pieces_chain: the next piece's warm-up, next_warmup chunks from chunk
  // next_warmup_at of this piece (-1: no next piece, or its warm-up starts before this piece), which
  // the consumers' gates pre-check checks beside the piece's own (precheck_warmups), and that
  // check's verdict for the producer (written by consumer thread 0 before its arrival on the verdict
  // barrier, read by the producer after its wait there: verdict_barrier).
  int64_t next_warmup_at;
  int next_warmup;
  volatile int prechecked_stop;
};

// SeqArgs::stopped_at, by atomics: the draining consumers compare it with chunks the producer has
// already filled, so either value gives the same decision, but plain accesses race (run 112's
// racecheck: 14 hazards).
__device__ __forceinline__ void stopped_at_store(SeqArgs* stop, int64_t c) {
  atomicExch(reinterpret_cast<unsigned long long*>(const_cast<int64_t*>(&stop->stopped_at)),
             static_cast<unsigned long long>(c));
}
__device__ __forceinline__ int64_t stopped_at_load(SeqArgs* stop) {
  return static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long*>(const_cast<int64_t*>(&stop->stopped_at)), 0ull));
}

// FusedArgs::pieces_chain: a piece's ready flag, set with release semantics once its end state is
// in global memory, and read with acquire semantics by the piece after it.
__device__ __forceinline__ void ready_release(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
}
__device__ __forceinline__ int ready_acquire(const int* flag) {
  int r;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(r) : "l"(flag) : "memory");
  return r;
}

// The rows' arguments (q, k, g, beta, v, out) moved `tokens` tokens on.
__device__ __forceinline__ void advance_rows(const FusedArgs& a, ProduceArgs& sp, ConsumeArgs& sc, int64_t tokens) {
  const int64_t H = a.consume.H, row = H * kHeadDim;
  const size_t g_elem = a.produce.g_type == ElemType::kF32 ? 4 : 2;
  const size_t b_elem = a.produce.beta_type == ElemType::kF32 ? 4 : 2;
  sp.q = static_cast<const __nv_bfloat16*>(sp.q) + tokens * row;
  sp.k = static_cast<const __nv_bfloat16*>(sp.k) + tokens * row;
  sp.g = static_cast<const uint8_t*>(sp.g) + tokens * row * g_elem;
  sp.beta = static_cast<const uint8_t*>(sp.beta) + tokens * H * b_elem;
  sc.v = static_cast<const __nv_bfloat16*>(sc.v) + tokens * row;
  sc.out = static_cast<__nv_bfloat16*>(sc.out) + tokens * row;
}

// The state `at` elements into `base`, fp32 or bf16 (the kernels' state pointers are float*).
__device__ __forceinline__ float* state_at(void* base, bool bf16, int64_t at) {
  return bf16 ? reinterpret_cast<float*>(static_cast<__nv_bfloat16*>(base) + at) : static_cast<float*>(base) + at;
}

// Sequence n's arguments: the call's shifted to the sequence's first token (bos; the TMA maps keep
// the call's rows, their coordinates add bos) and state, or with a pool to its slot (outside
// [0, P): padding, marked by a negative length, -(len + 1)).
__device__ __forceinline__ void write_sequence_args(const FusedArgs& a, int64_t n, SeqArgs& seq) {
  const int64_t H = a.consume.H;
  int64_t bos = 0, len = 0;
  sequence_span(a, n, bos, len);
  ProduceArgs sp = a.produce;
  ConsumeArgs sc = a.consume;
  advance_rows(a, sp, sc, bos);
  sp.T = sc.T = len;
  if (a.state_pool != nullptr) {  // the sequence's slot; outside [0, P): padding (T < 0 below)
    const int64_t slot = a.state_indices[n];
    const bool live = slot >= 0 && slot < a.pool_size;
    const bool read = live && (a.has_initial_state == nullptr || a.has_initial_state[n]);
    float* const ptr = state_at(a.state_pool, a.pool_bf16, slot * H * kHeadDim * kHeadDim);
    sc.initial_state = read ? ptr : nullptr;
    sc.final_state = live ? ptr : nullptr;
    sc.states_bf16 = a.pool_bf16;
    if (!live) sp.T = -len - 1;  // padding: -(len + 1), so that an empty padding sequence is seen too
  } else {
    const int64_t state = n * H * kHeadDim * kHeadDim;
    if (a.consume.initial_state != nullptr) sc.initial_state = a.consume.initial_state + state;
    if (a.consume.final_state != nullptr) sc.final_state = a.consume.final_state + state;
  }
  seq.produce = sp, seq.consume = sc, seq.bos = bos;
  seq.first_ckpt = a.checkpoint_every <= 0   ? 0
                   : a.ckpt_start != nullptr ? int64_t(a.ckpt_start[n])
                                             : n * (a.produce.T / a.num_seqs / a.checkpoint_every);
}

// FusedArgs::pieces: CTA row y = n pieces + p takes piece p of sequence n (write_sequence_args's
// arguments, shifted again): its chunks [p L, min((p + 1) L, chunks)) of L = ceil(chunks / pieces),
// from warmup = min(FusedArgs::warmup, p L) chunks earlier, from zero (the first piece from the
// sequence's initial state); the last piece's final state into FusedArgs::pieces_final. A piece past
// the sequence's chunks, and a padding sequence's pieces after its first, are padding of no rows.
__device__ __forceinline__ void write_piece_args(const FusedArgs& a, int64_t y, SeqArgs& seq) {
  const int64_t n = y / a.pieces, piece = y % a.pieces;
  write_sequence_args(a, n, seq);
  // a CTA that starts after another piece stopped the call leaves at once (read once, here: uniform)
  seq.abort = *static_cast<volatile int*>(a.pieces_flag) != 0;
  seq.stage_stop[0] = seq.stage_stop[1] = 0;
  seq.stopped_at = INT64_MAX;
  seq.warmup = 0;
  seq.next_warmup_at = -1, seq.next_warmup = 0, seq.prechecked_stop = 0;
  seq.publish = 0, seq.chain = 0, seq.chunk0 = 0;
  if (seq.produce.T < 0) {  // a padding sequence (a pool slot outside [0, P)): its first piece zeroes its rows,
    if (piece > 0) seq.produce.T = seq.consume.T = -1;  // the others are padding of no rows (the CTA leaves)
    return;
  }
  // layout.h piece_span: a piece past the sequence's chunks is padding of no rows (the CTA leaves at
  // once); an empty sequence's first piece an item of no chunks, whose final state is its initial one
  const int64_t len = seq.produce.T;
  const PieceSpan span = piece_span(len, a.pieces, a.warmup, piece);
  ProduceArgs& sp = seq.produce;
  ConsumeArgs& sc = seq.consume;
  advance_rows(a, sp, sc, span.shift);
  sp.T = sc.T = span.T;
  if (piece > 0) sc.initial_state = nullptr;
  // The last piece's final state into pieces_final [n] in the state's dtype (a bf16 pool's: bf16).
  float* const final_at = state_at(a.pieces_final, sc.states_bf16, n * a.consume.H * kHeadDim * kHeadDim);
  sc.final_state = span.last && sc.final_state != nullptr ? final_at : nullptr;
  seq.bos += span.shift;
  seq.warmup = int(span.warmup);
  seq.chunk0 = span.begin - span.warmup;
  seq.publish = a.pieces_chain && !span.last;  // FusedArgs::pieces_chain: the next piece may need it
  if (!a.pieces_chain && piece + 1 < a.pieces) {
    const PieceSpan next = piece_span(len, a.pieces, a.warmup, piece + 1);
    if (next.T >= 0 && next.warmup > 0 && next.begin - next.warmup >= seq.chunk0)
      seq.next_warmup_at = next.begin - next.warmup - seq.chunk0, seq.next_warmup = int(next.warmup);
  }
}

// FusedArgs::pieces without pieces_chain: the barrier on which consumer thread 0 hands the gates
// pre-check's verdict (SeqArgs::prechecked_stop) to the producer, once, before the producer's first
// chunk. An mbarrier, as the ring's hand-offs: with a named barrier of all 384 threads there
// (bar.red, which the two roles reach from their own code) synccheck failed both pieces tests in
// run 136 where the tests alone, memcheck and racecheck passed (its report was not kept; an aligned
// barrier reached from different instructions is the likely cause, as a former persistent grid's
// item barrier's in run 103: an aligned barrier reached by a diverged warp counts it more than once).
constexpr int kMaxStagedBufs = 2;
__device__ __forceinline__ uint64_t* verdict_barrier(uint64_t* full) { return full + 2 * kStages + kMaxStagedBufs; }
// The ring's barriers (thread 0; a CTA barrier before any use): full[2] (the producer's 128
// arrivals), empty[2] (the consumers' 256), then the staged inputs' buffers' (its issuing thread and
// the bytes) and the pieces' pre-check verdict's (consumer thread 0: verdict_barrier).
__device__ __forceinline__ void init_ring_barriers(uint64_t* full) {
  uint64_t* const empty = full + kStages;
  for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s], kThreads), mbarrier_init(&empty[s], 2 * kThreads);
  for (int b = 0; b < kMaxStagedBufs; ++b) mbarrier_init(empty + kStages + b, 1);
  mbarrier_init(verdict_barrier(full), 1);
  fence_mbarrier_init();
}

// One item of a CTA's work, the producer's side: head h of the sequence pa describes (its first
// token bos in the TMA maps' rows), num_chunks chunks of 32 tokens.
// kPieces (FusedArgs::pieces): after each empty-stage wait the producer reads the consumers' stop
// as they released that stage (SeqArgs::stage_stop in `stop`); once set it writes the chunk as
// stopped_at, arrives on the stage's full barrier without filling it and leaves, after the staged
// rows in flight have landed. Unchained, before its first chunk, it also waits for the consumers'
// gates pre-check's verdict (verdict_barrier), which stops it so at chunk 0.
template <GateForm kGate, bool kF32Gate, bool kStaged, bool kClock, bool kConsumerInv, bool kPieces = false,
          bool kStart = false>
__device__ __forceinline__ void produce_item(const FusedParams& params, uint8_t* ring, const ProduceArgs& pa, int h,
                                             int64_t bos, int64_t num_chunks, long long* clock_sums,
                                             long long& last_clock, SeqArgs* stop = nullptr) {
  using L = SmemLayout<kStaged, kConsumerInv>;
  using ProducerSync = WarpgroupSync<1>;
  constexpr bool kTrace = kClock && kStaged && kConsumerInv;  // FusedArgs::chunk_trace (the rule's flags' clocks)
  const FusedArgs& a = params.a;
  uint8_t* const scratch = ring + L::kOffScratch;
  uint64_t* const full = reinterpret_cast<uint64_t*>(ring + L::kOffBarriers);
  uint64_t* const empty = full + kStages;
  uint64_t* const staged_full = empty + kStages;  // [kStagedBufs]
  constexpr int kBufs = kStagedBufs<kF32Gate>;
  static_assert(kBufs <= kMaxStagedBufs && kBufs * kStagedBufBytes<kF32Gate> <= kStagedRegionBytes);
  const int tid = threadIdx.x;
  const PhaseMarks mark{kClock && tid == 0 ? clock_sums : nullptr, &last_clock};
  // Chunk c: buffer c % kBufs, completing on staged_full[c % kBufs] for the (c / kBufs)-th time.
  const auto staged_buf = [&](int64_t c) { return ring + L::kOffStaged + int(c % kBufs) * kStagedBufBytes<kF32Gate>; };
  const auto staged_bar = [&](int64_t c) { return staged_full + int(c % kBufs); };
  const auto staged_wait = [&](int64_t c) { mbarrier_wait(staged_bar(c), uint32_t(c / kBufs) & 1); };
  const auto issue_rows = [&](int64_t c) {  // chunk c of the item (thread 32)
    issue_chunk_rows<kF32Gate>(params.maps, h, c, staged_buf(c), staged_bar(c), bos);
  };
  // Chunk c + kBufs's rows are copied once chunk c's factors have read its buffer for the last time
  // (produce_chunk's after_factors); in time_consumers_only, only chunks 0 and 1.
  const int64_t staged_chunks = a.time_consumers_only && num_chunks > kStages ? kStages : num_chunks;
  float* const sm_gate = reinterpret_cast<float*>(scratch + ProduceScratch::kOffGate);
  if (tid == 0) start_stamp<kStart>(a, 0);
  load_gate_consts<kGate>(pa, h, tid, sm_gate);
  ProducerSync::sync();
  if (tid == 0) start_stamp<kStart>(a, 1);
  // beta's bits a chunk ahead in a register of threads 0-31 (warp 0, whose chain is the producer's).
  uint32_t beta_next = load_beta_bits(pa, h, 0, tid);
  // The first kBufs chunks' staged rows (thread 32). (Issued before the gate constants' loads, run 173 measured
  // the few-head pieces 1.5% slower at T=2048 H=12 and level from T = 8192: DESIGN.md.)
  if (kStaged && tid == 32) {
    for (int64_t c = 0; c < kBufs && c < staged_chunks; ++c) issue_rows(c);
    start_stamp<kStart>(a, 2);
  }
  // kPieces unchained: the consumers' gates pre-check's verdict, waited for here, while chunk 0's rows
  // and beta are in flight (the check's loads take as long), so that a call it stops costs no chunk:
  // a stopped grid's first chunk took ~20 us of cold code and fill (run 135, H100: a pieces kernel
  // stopped by the in-kernel check 20-21 us, against 2.9 for the grid the old kernel stopped; 9.2-9.7
  // with this wait, run 136).
  bool prechecked = false;
  if (kPieces && !a.pieces_chain) {
    mbarrier_wait(verdict_barrier(full), 0);
    prechecked = stop->prechecked_stop != 0;
    if (tid == 0) {
      start_stamp<kStart>(a, 3);
      if constexpr (kStaged && kStart) start_stamp<kStart>(a, 8, mbarrier_done(staged_bar(0), 0) ? 1 : 0);
    }
  }
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int stage = int(c % kStages);
    const uint32_t beta_bits = beta_next;
    if (c + 1 < staged_chunks) beta_next = load_beta_bits(pa, h, c + 1, tid);
    if (kTrace && tid == 0) trace_point(a, h, c, 0);
    if (c >= kStages) mbarrier_wait(&empty[stage], uint32_t(c / kStages - 1) & 1);
    mark(0);
    if (kTrace && tid == 0) trace_point(a, h, c, 1);
    if constexpr (kPieces) {
      // The stop as the consumers released this stage (uniform: as the release the wait acquired left
      // it); at the first chunk, their gates' pre-check's (uniform: one value, written once by
      // consumer thread 0 before its arrival on verdict_barrier).
      const bool stopped = c >= kStages ? stop->stage_stop[stage] != 0 : c == 0 && prechecked;
      if (stopped) {
        if (tid == 0) stopped_at_store(stop, c);
        // the rows in flight: chunks c .. c + kBufs - 1 (issued with chunk c - kBufs .. c - 1, or
        // before the loop)
        if constexpr (kStaged)
          for (int64_t i = c; i < c + kBufs && i < staged_chunks; ++i) staged_wait(i);
        mbarrier_arrive(&full[stage]);
        break;
      }
    }
    if (a.time_consumers_only && c >= kStages) {
      mbarrier_arrive(&full[stage]);
      continue;
    }
    if (tid == 32) {  // the chunk's v rows into the stage by two tensor copies, completing on full[stage]
      // (warp 1: warp 0 runs the inverse, the producer's longest chain). The consumers' last
      // accesses of this stage's v were generic-proxy loads and stores (loads only with their early
      // release), ordered before here by the empty barrier; the copies write through the async proxy.
      fence_proxy_async_shared();
      mbarrier_expect_tx(&full[stage], kVBytes);
      uint8_t* const vs = ring + stage * L::kStageSpan + kRecordSpan;  // channels 0-63, 64-127 (staged_v)
      tensor_copy_3d(vs, &params.maps.v, 0, h, int(bos + c * kChunk), &full[stage]);
      tensor_copy_3d(vs + kVBytes / 2, &params.maps.v, 64, h, int(bos + c * kChunk), &full[stage]);
    }
    uint8_t* const staged = kStaged ? staged_buf(c) : nullptr;
    if constexpr (kStaged) staged_wait(c);
    if (kStart && c == 0 && tid == 0) start_stamp<kStart>(a, 4);
    if constexpr (kStart) {  // start_variant 2 (timing only): chunk 0's steps run twice, the second pass stamped
      if (c == 0 && a.start_variant == 2) {
        produce_chunk<kGate, kF32Gate, ProducerSync, !kConsumerInv, kStaged>(
            pa, h, c, tid, ring + stage * L::kStageSpan, scratch, staged, beta_bits, sm_gate, true,
            reinterpret_cast<float*>(ring + stage * L::kStageSpan + L::kOffLBeta));
        ProducerSync::sync();
      }
    }
    const auto refill = [&] {
      if (kStaged && tid == 32 && c + kBufs < staged_chunks) issue_rows(c + kBufs);
    };
    float* const l_beta = reinterpret_cast<float*>(ring + stage * L::kStageSpan + L::kOffLBeta);
    const auto marks = [&] {  // the start stamps' kernel stamps chunk 0's and 1's steps, the others clock them
      if constexpr (kStart) return ChunkStepStamps{&a, c, tid};
      else return mark;
    }();
    produce_chunk<kGate, kF32Gate, ProducerSync, !kConsumerInv, kStaged>(pa, h, c, tid, ring + stage * L::kStageSpan,
                                                                        scratch, staged, beta_bits, sm_gate, true, l_beta,
                                                                        marks, refill);
    if (kStart && c == 0 && tid == 0) start_stamp<kStart>(a, 5);
    mbarrier_arrive(&full[stage]);
    marks(8);  // the phase clocks' mark, or the start stamps' chunk 0 and 1 hand-overs
    if (kTrace && (tid & 31) == 0) trace_point(a, h, c, 2 + (tid >> 5));  // each producer warp's arrival
  }
  if (kClock && tid == 0) {
    for (int i = 0; i < 10; ++i) a.phase_clocks[int64_t(h) * kPhaseClocks + i] = clock_sums[i];
    a.phase_clocks[int64_t(h) * kPhaseClocks + 14] = clock_sums[14];
    a.phase_clocks[int64_t(h) * kPhaseClocks + 15] = num_chunks;
  }
}

// FusedArgs::pieces: a piece's warm-up must bound its transition by 2^-30 (the incoming state's
// share of the piece's start state below fp32's rounding of it, as the chunk-16 kernels' transition
// skipping requires).
constexpr float kPieceLog2Bound = -30.f;
// The flag's value where the gates' pre-check stopped the pieces (a piece's own bound: 1).
constexpr int kPiecesPrechecked = 2;

// FusedArgs::pieces without pieces_chain, the gates' pre-check: a piece stops the call where its
// warm-up chunks' bounds multiply to more than 2^kPieceLog2Bound, and each chunk's bound
// (chunk_log2_bound) is at least max_c e^{Gamma_c}, its channels' decay over the chunk. So where a
// warm-up's sum over its chunks of log2 max_c e^{Gamma_c} is above the bound, the piece will stop;
// the consumers find it from the gates alone when the piece starts, while the producer's first
// rows are in flight, and stop the call at once instead of after the warm-up's recurrence (run 112: ~34 us
// at few heads with long-memory channels when every piece ran its warm-up and drained). Half a unit
// of margin against the two computations' rounding: the check stops only calls whose pieces' own
// bounds would stop them, so the results are the rule's kernels' either way (an early exit, not a
// decision). A NaN gate stops the call, as in the pieces. Consumer warpgroup 0 checks the piece's own
// warm-up, warpgroup 1 the next piece's (the last chunks of this one), so that the first piece,
// which has none, learns of its successor's at once, and a call whose every head has long-memory
// channels stops in each CTA before its first chunk. Thread c of a warpgroup: channel c;
// lower-bound bf16 gates (what the pieces serve). All 256 consumer threads (named barrier 2), before
// any other use of `scratch` (8 floats); returns the verdict in every thread (consume_item hands it
// to the producer, which waits for it before its first chunk: verdict_barrier).
__device__ __forceinline__ bool precheck_warmups(const SeqArgs& seq, int h, int ctid, float* scratch) {
  const int cwg = ctid >> 7, c = ctid & (kHeadDim - 1), warp = (ctid >> 5) & 3, lane = ctid & 31;
  const ProduceArgs& pa = seq.produce;
  const int next = seq.next_warmup_at >= 0 ? seq.next_warmup : 0;
  const int count = cwg == 0 ? seq.warmup : next, iters = seq.warmup > next ? seq.warmup : next;
  const int64_t first = cwg == 0 ? 0 : seq.next_warmup_at;
  const LowerBoundConsts k = lower_bound_consts(pa, h);
  const float bc = pa.dt_bias != nullptr ? pa.dt_bias[int64_t(h) * kHeadDim + c] * k.c : 0.f;
  const __nv_bfloat16* const g = static_cast<const __nv_bfloat16*>(pa.g);
  float total = 0.f;  // the sum over the warm-up's chunks of log2 max_c e^{Gamma_c}
  bool nan = false;
  for (int i = 0; i < iters; ++i) {  // uniform over both warpgroups (their barriers)
    if (i < count) {
      // The chunk's 32 gates of this channel loaded at once (rows past the piece's end read its last
      // row and are not summed), then summed in token order: one round trip to memory a chunk.
      const int64_t t0 = (first + i) * kChunk, last = pa.T - 1 - t0;  // t0 < T: a warm-up chunk has rows
      const __nv_bfloat16* const gj = g + (t0 * pa.H + h) * kHeadDim + c;
      float x[kChunk];
#pragma unroll
      for (int t = 0; t < kChunk; ++t) x[t] = __bfloat162float(gj[(t < last ? int64_t(t) : last) * pa.H * kHeadDim]);
      float gamma = 0.f;  // this channel's log-decay over the chunk, log2 units (as the producer's scan)
#pragma unroll
      for (int t = 0; t < kChunk; ++t)
        if (t0 + t < pa.T) gamma += ProduceMath::quot(k.lb2, 1.f + ex2(fmaf(x[t], k.c, bc)));
      nan |= gamma != gamma;
      float m = gamma;
      for (int d = 16; d >= 1; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
      if (lane == 0) scratch[4 * cwg + warp] = m;
    }
    consumers_sync();
    if (i < count) {
      const float* const w = scratch + 4 * cwg;
      total += fmaxf(fmaxf(w[0], w[1]), fmaxf(w[2], w[3]));
    }
    consumers_sync();
  }
  return consumers_sync_or(count > 0 && (nan || total > kPieceLog2Bound + 0.5f));
}

// FusedArgs::pieces: an upper bound on log2 ||A|| of the chunk's state transition
// A = diag(e^Gamma) - sum_ij inv_b[i][j] k_decayed_j k_restored_i^T (W^T = S^T k_decayed^T,
// U_i = sum_j inv_b[i][j] u_j, S^T += U^T k_restored: consume.cuh), by the triangle inequality over
// its rank-one terms, max_c e^{Gamma_c} + sum_ij |inv_b[i][j]| |k_restored_i| |k_decayed_j|, the sum
// doubled against the rounding of the stage's fp16 / split operands and of these fp32 sums (the
// chunk-16 kernels' chunk bound, prepare_chunk.cuh chunk_log_bound). All 256 consumer threads,
// after the chunk's recurrence (the inverse's scratch is free until the next chunk's inverse); the
// result in consumer thread 0. rec: the stage's operands; inv: the consumers' inv_b (hi, lo).
__device__ __forceinline__ float chunk_log2_bound(int ctid, const uint8_t* rec, const uint8_t* inv, float* scratch) {
  const int t = ctid >> 3, lane = ctid & 31;
  float sd = 0.f, sr = 0.f;  // row t's |k_decayed|^2, |k_restored|^2 over this thread's 16 channels
  for (int e = 0; e < 16; ++e) {
    const int off = sw128_offset(kChunk, t, 16 * (ctid & 7) + e);
    const float d = __half2float(*reinterpret_cast<const __half*>(rec + ChunkOperands::kOffKDecayed + off));
    const float r = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(rec + ChunkOperands::kOffKRestored + off)) +
                    __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(rec + ChunkOperands::kOffKRestoredLo + off));
    sd = fmaf(d, d, sd), sr = fmaf(r, r, sr);
  }
  for (int x = 1; x < 8; x <<= 1)
    sd += __shfl_xor_sync(0xffffffffu, sd, x), sr += __shfl_xor_sync(0xffffffffu, sr, x);
  if ((ctid & 7) == 0) scratch[t] = sqrtf(sd), scratch[kChunk + t] = sqrtf(sr);
  if (ctid < kHeadDim) {  // max_c e^{Gamma_c}, a warp's 32 channels
    float g = reinterpret_cast<const float*>(rec + ChunkOperands::kOffGamma)[ctid];
    for (int x = 16; x >= 1; x >>= 1) g = fmaxf(g, __shfl_xor_sync(0xffffffffu, g, x));
    if (lane == 0) scratch[2 * kChunk + (ctid >> 5)] = g;
  }
  consumers_sync();
  float bound = 0.f;
  if (ctid < 32) {  // lane j: |k_decayed_j| sum_i |inv_b[i][j]| |k_restored_i|
    float sum = 0.f;
    for (int i = 0; i < kChunk; ++i) {
      const int off = sw64_offset(i, lane);
      const float x = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(inv + off)) +
                      __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(inv + kSmallBytes + off));
      sum = fmaf(fabsf(x), scratch[kChunk + i], sum);
    }
    sum *= scratch[lane];
    for (int x = 16; x >= 1; x >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, x);
    const float g = fmaxf(fmaxf(scratch[2 * kChunk], scratch[2 * kChunk + 1]),
                          fmaxf(scratch[2 * kChunk + 2], scratch[2 * kChunk + 3]));
    bound = __log2f(g + 2.f * sum) + 0.01f;  // NaN stays NaN: the piece is not skipped
  }
  consumers_sync();  // the scratch read before anyone writes it again
  return bound;
}

// FusedArgs::pieces_chain, all 256 consumer threads at the top of the piece's first chunk after its
// warm-up (SeqArgs::chain set): thread 0 waits until the piece before has published its end state
// (or the call stopped: SeqArgs::abort, read by all after the barrier), then every thread loads its
// rows of that state (by L2: the flag's acquire and the barrier order them after its writes) in
// place of the warm-up's, its row scales anew.
__device__ __forceinline__ void chain_in(const FusedArgs& a, SeqArgs* stop, int ctid, int v_row, int t4, float (&S)[64],
                                         prefill::RowScale& rs) {
  if (ctid == 0) {
    const int* const ready = a.pieces_ready + (stop->item - a.consume.H);
    int r;
    while ((r = ready_acquire(ready)) == 0 && *static_cast<volatile int*>(a.pieces_flag) == 0) __nanosleep(256);
    if (r == 0) stop->abort = 1;
  }
  __syncwarp();  // warp 0 converged before the aligned barrier (thread 0 alone spun: verdict_barrier's note)
  consumers_sync();
  if (stop->abort) return;
  const float* const from = a.pieces_states + (stop->item - a.consume.H) * kHeadDim * kHeadDim;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 s2 = __ldcg(reinterpret_cast<const float2*>(from + (v_row + 8 * half) * kHeadDim + 8 * j + 2 * t4));
      S[4 * j + 2 * half] = s2.x, S[4 * j + 2 * half + 1] = s2.y;
    }
  rs = prefill::RowScale{};
  rs.renormalise(S);
}

// The chunk's output through the stage's v, once each thread has written its 16 slots' bf16 where
// it read its v (no other thread reads those bytes; the other consumer warpgroup's columns are
// disjoint): the warp's 32 tokens x 16 columns from col to global memory as 16-byte rows, before
// the stage is released. Pass u: tokens of parity u, lanes 2m and 2m + 1 one token's 32 bytes; a
// quarter-warp's 8 reads (tokens 8 k + u, + 2, + 4, + 6, both halves) fall on 8 distinct granule
// positions. rows: the chunk's tokens (fewer at a sequence's end).
__device__ __forceinline__ void store_chunk_output(const ConsumeArgs& p, int h, int64_t c, int rows, const uint8_t* vs,
                                                   int col, int lane) {
  __syncwarp();
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int t = 8 * (lane >> 3) + 2 * ((lane >> 1) & 3) + u, part = lane & 1;
    if (t < rows)
      *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + ((c * kChunk + t) * p.H + h) * kHeadDim + col +
                                8 * part) = *reinterpret_cast<const uint4*>(&staged_v(vs, t, col + 8 * part));
  }
}

// FusedArgs::pieces, consumer thread 0 after a piece's last warm-up chunk, log2_bound the sum of its
// chunks' bounds: where it is not below 2^kPieceLog2Bound (or NaN: not erased either), chained, the
// piece takes its predecessor's end state (stop->chain, which the others read after the next chunk's
// first barrier); unchained, it stops the call (flag 1; the first stop's value stays, the pre-check's
// 2) and itself (stop->abort, likewise).
__device__ __forceinline__ void warmup_verdict(const FusedArgs& a, SeqArgs* stop, float log2_bound) {
  if (log2_bound <= kPieceLog2Bound) return;
  if (a.pieces_chain) {
    stop->chain = 1;
  } else {
    atomicCAS(a.pieces_flag, 0, 1);
    stop->abort = 1;
  }
}

// FusedArgs::pieces without pieces_chain, all 256 consumer threads as the piece starts: the gates'
// pre-check (precheck_warmups), whose stop is the call's (flag 2, by compare-and-swap: a piece's own
// later stop, 1, does not overwrite it) and this piece's at once (stop->abort, which every consumer
// reads after the first chunk's barrier); consumer thread 0 hands the verdict to the producer, which
// waits for it before its first chunk and stops there (verdict_barrier).
__device__ __forceinline__ void precheck_and_hand_over(const FusedArgs& a, SeqArgs* stop, int h, int ctid,
                                                       float* scratch, uint64_t* full) {
  const bool stopped = precheck_warmups(*stop, h, ctid, scratch);
  if (ctid == 0) {
    if (stopped) {
      atomicCAS(a.pieces_flag, 0, kPiecesPrechecked);
      stop->abort = 1;
    }
    stop->prechecked_stop = stopped;
    mbarrier_arrive(verdict_barrier(full));
  }
}

// The consumers' side of the same item (p: its sequence's arguments; first_ckpt: its first
// checkpoint, FusedArgs::checkpoint_every). kPieces (FusedArgs::pieces): the item's first
// stop->warmup chunks write no output and are bounded (chunk_log2_bound); once their bounds'
// product is not below 2^-30, or FusedArgs::pieces_flag is set, the consumers set stop->abort and
// drain: they release each stage the producer fills until the one it marks (stop->stopped_at), and
// leave without a final state.
template <bool kStaged, bool kClock, bool kConsumerInv, bool kPieces = false, bool kStart = false>
__device__ __forceinline__ void consume_item(const FusedParams& params, uint8_t* ring, const ConsumeArgs& p, int h,
                                             int64_t num_chunks, int64_t first_ckpt,
                                             long long* clock_sums, long long& last_clock, SeqArgs* stop = nullptr) {
  using L = SmemLayout<kStaged, kConsumerInv>;
  constexpr bool kTrace = kClock && kStaged && kConsumerInv;  // FusedArgs::chunk_trace (the rule's flags' clocks)
  const FusedArgs& a = params.a;
  uint64_t* const full = reinterpret_cast<uint64_t*>(ring + L::kOffBarriers);
  uint64_t* const empty = full + kStages;
  const int tid = threadIdx.x, wg = tid / kThreads, cwg = wg - 1;  // cwg: 0 or 1
  const PhaseMarks mark{kClock && tid == kThreads ? clock_sums : nullptr, &last_clock};
  const int ctid = tid - kThreads, warp = (ctid >> 5) & 3, lane = ctid & 31, g = lane >> 2, t4 = lane & 3;
  const int v_row = 64 * cwg + 16 * warp + g;
  uint8_t* const own_inv = ring + L::kOffInv;
  if constexpr (kPieces) {
    static_assert(kConsumerInv, "the pieces' consumers stop at their first chunk's barrier");
    if (!a.pieces_chain)
      precheck_and_hand_over(a, stop, h, ctid, reinterpret_cast<float*>(own_inv + 2 * kSmallBytes), full);
    if (ctid == 0) start_stamp<kStart>(a, 6);
  }
  float S[64];
  prefill::load_state_rows(S, p.initial_state,
                           p.initial_state == nullptr ? ElemType::kNone : p.states_bf16 ? ElemType::kBF16 : ElemType::kF32,
                           int64_t(h) * kHeadDim * kHeadDim, v_row, t4);
  prefill::RowScale rs;
  // kConsumerInv: the consumers' inv_b, which both warpgroups build together from each chunk's L
  // and both read (invert_warpgroup over 256 threads, named barrier 2). X12 = 0 once.
  if constexpr (kConsumerInv) {
    if (ctid < 64) invert_zero_upper(ctid, own_inv, own_inv + kSmallBytes);
    fence_proxy_async_shared();
  }
  if (kPieces && ctid == 0) piece_stamp(a, 1);
  // Checkpoints: after chunk next_ckpt (every period chunks; -1: none), checkpoint ck, where that
  // chunk is full (a sequence's last partial piece has none).
  const int64_t ckpt_period = a.checkpoint_every / kChunk;
  int64_t next_ckpt = a.checkpoint_every > 0 ? ckpt_period - 1 : -1, ck = first_ckpt;
  const int warmup = kPieces ? stop->warmup : 0;
  if (kPieces && a.checkpoint_every > 0) {
    // a piece's first checkpoint: the sequence's j-th, the first whose chunk is past the warm-up
    const int64_t j = (stop->chunk0 + warmup) / ckpt_period;
    next_ckpt = (j + 1) * ckpt_period - 1 - stop->chunk0, ck = first_ckpt + j;
  }
  // kPieces: the stop as the producer will read it once this stage is free (stage_stop)
  const auto release = [&](int s) {
    if (kPieces && ctid == 0) stop->stage_stop[s] = stop->abort;
    mbarrier_arrive(&empty[s]);
  };
  float log2_bound = 0.f;  // consumer thread 0: the warm-up's bounds so far
  bool draining = false;
  // kPieces: another piece's stop (the call's flag), as consumer thread 0 read it a chunk earlier (the
  // read before the loop serves chunk 0): a compare right after the load, read at the top of the
  // chunk, held the warp for the load's latency before its wait for the stage. A stop seen a chunk
  // late costs that chunk's work, never the result (the kernels after the pieces redo the call).
  int flag_next = kPieces && ctid == 0 ? *static_cast<volatile int*>(a.pieces_flag) : 0;
  // Two phases (kPieces; one otherwise), each a loop of its own after the unrolling, warm_phase a
  // constant in each: the piece's warm-up chunks, each bounded instead of written, with the chunk
  // after them, which takes a chained piece's state (chain_in); then the rest of the piece, whose loop
  // holds neither (runs 164 and 166: the pieces' kernel with one piece, whose loop held both, took
  // 1041 us at T=8192 H=96 against the unsplit kernel's 989, with 3.7% more instructions executed
  // and more of its warps' stalls waiting for an instruction fetch).
  int64_t c = 0;
  bool more = true;  // false: the consumers stopped draining (the producer stopped before chunk c)
#pragma unroll
  for (int phase = kPieces ? 0 : 1; phase < 2; ++phase) {
    const bool warm_phase = phase == 0;
    if (kPieces && !warm_phase && ctid == 0) piece_stamp(a, 3);
    for (; more && c < num_chunks && (!warm_phase || c <= warmup); ++c) {
      const int stage = int(c % kStages);
      const int flag = flag_next;
      if (kPieces && ctid == 0) flag_next = *static_cast<volatile int*>(a.pieces_flag);
      const bool failed = flag != 0;
      if (!draining && (c <= 1 || c % prefill::kRenormChunks == 0)) rs.renormalise(S);
      const bool tracer = kTrace && (ctid & (kThreads - 1)) == 0;  // each consumer warpgroup's thread 0
      if (tracer && cwg == 0) trace_point(a, h, c, 6);
      if (kStart && a.start_variant == 3) mbarrier_wait_hinted(&full[stage], uint32_t(c / kStages) & 1, 1000000u);
      else if (kStart && a.start_variant == 4) mbarrier_wait_backoff(&full[stage], uint32_t(c / kStages) & 1);
      else mbarrier_wait(&full[stage], uint32_t(c / kStages) & 1);
      if (tracer) trace_point(a, h, c, 7 + cwg);
      if (kPieces && warm_phase && c == 0 && ctid == 0) piece_stamp(a, 2), start_stamp<kStart>(a, 7);
      if constexpr (kPieces) {
        if (draining) {  // release what the producer fills until the chunk at which it stopped
          if (stopped_at_load(stop) <= c) {
            more = false;
            break;
          }
          release(stage);
          continue;
        }
        if (failed) stop->abort = 1;
      }
      mark(10);
      if constexpr (kConsumerInv) {
        // Every consumer warp is past chunk c - 1's U product (its reads of own_inv) before the
        // tiles are rewritten: a wgmma completing in one warp is not documented to mean the whole
        // warpgroup's operand reads are done.
        consumers_sync();
        if constexpr (kPieces) {  // read by all after the barrier; thread 0 writes it only before one
          // FusedArgs::pieces_chain: the warm-up did not bound the transition; the piece before's end
          // state, once published, replaces the warm-up's (or the call stopped meanwhile: drain)
          if (warm_phase && c == warmup && warmup > 0 && stop->chain) chain_in(a, stop, ctid, v_row, t4, S, rs);
          if (stop->abort) {
            draining = true;
            if (stopped_at_load(stop) <= c) {
              more = false;
              break;
            }
            release(stage);
            continue;
          }
        }
        const float* const l_beta = reinterpret_cast<const float*>(ring + stage * L::kStageSpan + L::kOffLBeta);
        invert_warpgroup<256>(ctid, l_beta, l_beta + kLBetaOffBeta, reinterpret_cast<float*>(own_inv + 2 * kSmallBytes),
                              own_inv, own_inv + kSmallBytes, false, [] { consumers_sync(); });
        fence_proxy_async_shared();  // the tiles are the U product's wgmma operand
        consumers_sync();
        mark(13);
      }
      // v^T of this thread's slots from the stage (rows past the end: zero, never the stage's bytes).
      const uint8_t* const vs = ring + stage * L::kStageSpan + kRecordSpan;  // a 32 x 128 SW128 tile (staged_v)
      const int rows = chunk_rows(p.T, c);
      __nv_bfloat16* const slot0 = &staged_v(vs, 2 * t4, v_row);  // slot i at + sw128_slot_offset(i)
      const auto slot = [&](int i) -> __nv_bfloat16& {
        return *reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<uint8_t*>(slot0) + sw128_slot_offset(i));
      };
      auto v_at = [&](int i) {
        const int t = 8 * (i >> 2) + 2 * t4 + (i & 1);
        return t < rows ? __bfloat162float(slot(i)) : 0.f;
      };
      __nv_bfloat16 o[16];
      consume_chunk(p, h, c, v_row, t4, ring + stage * L::kStageSpan,
                    kConsumerInv ? own_inv : ring + stage * L::kStageSpan + ChunkOperands::kOffInvB, v_at, S, rs, o);
      mark(11);
      if constexpr (kPieces) {
        if (warm_phase && c < warmup) {  // a warm-up chunk: its bound, no output; at the last, the verdict
          const float b = chunk_log2_bound(ctid, ring + stage * L::kStageSpan, own_inv,
                                           reinterpret_cast<float*>(own_inv + 2 * kSmallBytes));
          if (ctid == 0) {
            log2_bound += b;
            if (c + 1 == warmup) warmup_verdict(a, stop, log2_bound);
          }
          fence_proxy_async_shared();
          release(stage);
          continue;
        }
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) slot(i) = o[i];
      store_chunk_output(p, h, c, rows, vs, 64 * cwg + 16 * warp, lane);
      // This thread's generic writes of the stage's v (the output slots) before the producer's TMA
      // overwrites them: fenced by each writing thread, then released by its arrival.
      fence_proxy_async_shared();
      release(stage);
      if (kTrace && lane == 0) trace_point(a, h, c, 9 + (ctid >> 5));  // each consumer warp's release
      if (c == next_ckpt) {  // S is complete (consume_chunk waited for the update)
        if ((c + 1) * kChunk <= p.T) store_checkpoint(a, ck, h, S, v_row, t4, rs.inv);
        next_ckpt += ckpt_period, ++ck;
      }
      mark(12);
    }
  }
  if (kClock && tid == kThreads)
    for (int i = 10; i < 14; ++i) a.phase_clocks[int64_t(h) * kPhaseClocks + i] = clock_sums[i];
  if (kPieces && ctid == 0) piece_stamp(a, 4);
  if (draining) return;  // FusedArgs::pieces: stopped; the rule's kernels run the call after the pieces
  if constexpr (kPieces) {
    // A non-finite state would reach every later token in the serial recurrence, but the next
    // piece starts from zero: the rule's kernels run the call (the chunk-16 kernels' transition
    // skipping carries it; the fused kernel runs each sequence whole).
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 64; ++i) bad |= !isfinite(S[i]);
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicCAS(a.pieces_flag, 0, 1);
    if (stop->publish) {  // FusedArgs::pieces_chain: the end state for the next piece, then its flag
      prefill::store_state_rows(S, a.pieces_states, ElemType::kF32, stop->item * kHeadDim * kHeadDim, v_row, t4, rs.inv);
      __threadfence();
      consumers_sync();
      if (ctid == 0) ready_release(a.pieces_ready + stop->item);
    }
  }
  if (p.final_state != nullptr)
    prefill::store_state_rows(S, p.final_state, p.states_bf16 ? ElemType::kBF16 : ElemType::kF32,
                              int64_t(h) * kHeadDim * kHeadDim, v_row, t4, rs.inv);
  if (kPieces && ctid == 0 && a.piece_stamps != nullptr) {
    piece_stamp(a, 5);
    long long* const at = piece_stamps_row(a);
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    at[7] = num_chunks, at[8] = warmup, at[9] = sm;
  }
}

template <GateForm kGate, bool kF32Gate, bool kStaged, bool kClock, bool kRegSplit = false, bool kConsumerInv = false,
          bool kSeqs = false, bool kPieces = false, bool kStart = false>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_kernel(const __grid_constant__ FusedParams params) {
  using L = SmemLayout<kStaged, kConsumerInv>;
  const FusedArgs& a = params.a;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* const ring = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* const full = reinterpret_cast<uint64_t*>(ring + L::kOffBarriers);
  const int tid = threadIdx.x, wg = tid / kThreads;
  if (kPieces && threadIdx.x == 0) piece_stamp(a, 0);
  int h = blockIdx.x;  // kPieces: the piece's head (with pieces_chain its ticket's), from seq below
  // kSeqs: CTA (h, n) walks sequence n, its arguments shifted to the sequence's first token and
  // state (the TMA maps keep the call's rows: their coordinates add bos); else the call's own. The
  // shifted arguments live in shared memory (the free bytes between the clocks and the staged
  // buffer), read where they are used, so that the loops hold no more registers than the
  // one-sequence kernel's (held in registers they cost ptxas 136 bytes of spills).
  static_assert(!kSeqs || (kStaged && L::kOffSeqArgs + int(sizeof(SeqArgs)) <= L::kOffStaged),
                "no room for the sequence's arguments");
  SeqArgs& seq = *reinterpret_cast<SeqArgs*>(ring + L::kOffSeqArgs);
  ProduceArgs& seq_produce = seq.produce;
  ConsumeArgs& seq_consume = seq.consume;
  if (!kPieces && a.run_if_flag != nullptr && *a.run_if_flag == 0) return;  // the pieces ran the call (uniform)
  if constexpr (kSeqs) {
    if (a.error_flag != nullptr) {  // uniform: every thread reads the same verdict
      const int verdict = *a.error_flag;
      if (a.on_verdict ? verdict != prefill::kCallFused : verdict == prefill::kCallRefused) {
        if constexpr (kPieces) {  // the kernels after the pieces refuse it (NaN outputs, the pool unchanged)
          if (tid == 0) atomicExch(a.pieces_flag, 1);
        } else if (!a.on_verdict) {
          poison_fused_outputs(a);  // else the chunk-16 kernels ran the call
        }
        return;
      }
    }
    if (tid == 0) {
      if constexpr (kPieces) {
        // FusedArgs::pieces_chain: the CTA's piece by ticket, sequence by sequence, piece by piece
        // and head by head, so that a piece's predecessor is held by a CTA that took its ticket first
        const int64_t H = a.consume.H;
        const int64_t y = a.pieces_chain ? atomicAdd(a.pieces_next, 1) : int64_t(blockIdx.y) * H + blockIdx.x;
        seq.head = int(y % H), seq.item = y;
        write_piece_args(a, y / H, seq);
      } else write_sequence_args(a, a.order != nullptr ? int64_t(a.order[blockIdx.y]) : int64_t(blockIdx.y), seq);
    }
  }
  const ProduceArgs& pa = kSeqs ? seq_produce : a.produce;
  if constexpr (kSeqs) {
    __syncthreads();  // the sequence's arguments
    if (kPieces) h = seq.head;
    if (kPieces && seq.abort) return;  // another piece stopped the call before this CTA started
    if (seq_produce.T < 0) {  // a padding sequence (a pool slot outside [0, P)): zero output rows and
      // dense checkpoints, no state
      zero_head_rows(seq_consume.out, -seq_produce.T - 1, a.consume.H, h, int(threadIdx.x), int(blockDim.x));
      zero_head_checkpoints(a, seq.first_ckpt, -seq_produce.T - 1, h, int(threadIdx.x), int(blockDim.x));
      return;
    }
  }
  const int64_t bos = kSeqs ? seq.bos : 0;
  const int64_t num_chunks = ((kSeqs ? seq_produce.T : a.consume.T) + kChunk - 1) / kChunk;
  if (tid == 0) init_ring_barriers(full);
  long long* const clock_sums = reinterpret_cast<long long*>(ring + L::kOffClocks);
  if (kClock && tid < kPhaseClocks) clock_sums[tid] = 0;
  __syncthreads();
  long long last_clock = kClock ? clock64() : 0;

  if (wg == 0) {
    if constexpr (kRegSplit) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    produce_item<kGate, kF32Gate, kStaged, kClock, kConsumerInv, kPieces, kStart>(params, ring, pa, h, bos, num_chunks,
                                                                                  clock_sums, last_clock, &seq);
    if (kPieces && tid == 0) piece_stamp(a, 6);
  } else {
    if constexpr (kRegSplit) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    consume_item<kStaged, kClock, kConsumerInv, kPieces, kStart>(params, ring, kSeqs ? seq_consume : a.consume, h,
                                                                 num_chunks, kSeqs ? seq.first_ckpt : 0, clock_sums,
                                                                 last_clock, &seq);
  }
}

// cuTensorMapEncodeTiled from the driver, found once through the runtime (nothing links libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// [T, H, 128] (bf16, or fp32 when f32) as boxes of {128 channels, 1 head, 32 tokens}; with
// swizzled_halves (bf16), boxes of {64 channels, 1 head, 32 tokens} with the 128-byte swizzle (the
// stage's v: staged_v).
bool chunk_rows_map(CUtensorMap* map, const void* base, bool f32, int64_t T, int H, bool swizzled_halves = false) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || (reinterpret_cast<uintptr_t>(base) & 15) != 0 || (f32 && swizzled_halves)) return false;
  const cuuint64_t elem = f32 ? 4 : 2;
  const cuuint64_t dims[3] = {cuuint64_t(kHeadDim), cuuint64_t(H), cuuint64_t(T)};
  const cuuint64_t strides[2] = {kHeadDim * elem, cuuint64_t(H) * kHeadDim * elem};
  const cuuint32_t box[3] = {cuuint32_t(swizzled_halves ? kHeadDim / 2 : kHeadDim), 1, cuuint32_t(kChunk)},
                   element_strides[3] = {1, 1, 1};
  return encode(map, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base),
                dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzled_halves ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <GateForm kGate, bool kF32Gate, bool kStaged, bool kClock = false, bool kRegSplit = false,
          bool kConsumerInv = false, bool kSeqs = false, bool kPieces = false, bool kStart = false>
cudaError_t launch(const FusedArgs& args, cudaStream_t stream) {
  FusedParams params{};
  params.a = args;
  const ProduceArgs& pa = args.produce;
  if (!chunk_rows_map(&params.maps.v, args.consume.v, false, pa.T, pa.H, true)) return cudaErrorInvalidValue;
  if (kStaged && (!chunk_rows_map(&params.maps.q, pa.q, false, pa.T, pa.H) ||
                  !chunk_rows_map(&params.maps.k, pa.k, false, pa.T, pa.H) ||
                  !chunk_rows_map(&params.maps.g, pa.g, kF32Gate, pa.T, pa.H)))
    return cudaErrorInvalidValue;
  const auto kernel = fused_kernel<kGate, kF32Gate, kStaged, kClock, kRegSplit, kConsumerInv, kSeqs, kPieces, kStart>;
  constexpr int kSmem = SmemLayout<kStaged, kConsumerInv>::kBytes;
  cudaError_t err = allow_dynamic_smem(kernel, kSmem);
  if (err != cudaSuccess) return err;
  if constexpr (kRegSplit) {  // the split must fit the registers the launch gives the CTA (else: a hang)
    int regs = 0;
    if ((err = kernel_registers(kernel, regs)) != cudaSuccess) return err;
    if (regs < kLaunchRegs) return cudaErrorInvalidConfiguration;
  }
  if (args.check_only) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(args.consume.H),
                  static_cast<unsigned>(kSeqs ? args.num_seqs * (kPieces ? args.pieces : 1) : 1));
  kernel<<<grid, kFusedThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}
template <GateForm kGate, bool kF32Gate>
cudaError_t launch(const FusedArgs& args, cudaStream_t stream) {
  return args.stage_inputs ? launch<kGate, kF32Gate, true>(args, stream) : launch<kGate, kF32Gate, false>(args, stream);
}

// The candidates and the phase clocks (lower-bound bf16 gates only): each of FusedArgs' four flags
// (stage_inputs, phase_clocks, producer_regs, consumer_inverse) as a template argument in turn.
template <bool... kFlags>
cudaError_t launch_lower_bound(const FusedArgs& args, cudaStream_t stream) {
  constexpr int kDone = sizeof...(kFlags);
  if constexpr (kDone == 4) {
    return launch<GateForm::kLowerBound, false, kFlags...>(args, stream);
  } else {
    const bool flag = kDone == 0 ? args.stage_inputs
                    : kDone == 1 ? args.phase_clocks != nullptr
                    : kDone == 2 ? args.producer_regs
                                 : args.consumer_inverse;
    return flag ? launch_lower_bound<kFlags..., true>(args, stream) : launch_lower_bound<kFlags..., false>(args, stream);
  }
}

// The rule's flags (lower-bound bf16 gates, staged inputs, setmaxnreg, inverting consumers); kStart:
// the start stamps' kernel (FusedArgs::start_variant 1 to 4, the pieces only).
template <bool kSeqs, bool kPieces, bool kStart = false>
cudaError_t launch_rule_flags(const FusedArgs& args, cudaStream_t stream) {
  return launch<GateForm::kLowerBound, false, true, false, true, true, kSeqs, kPieces, kStart>(args, stream);
}

// FusedArgs::pieces: the last pieces' final states into the call's, where no piece stopped the call
// (*flag zero; else the rule's kernels after the pieces write them).
__global__ void pieces_finish_kernel(const int* flag, const prefill::PiecesFinal f) {
  if (*flag != 0) return;
  prefill::copy_pieces_final(f, int64_t(blockIdx.x) * blockDim.x + threadIdx.x, int64_t(gridDim.x) * blockDim.x);
}

}  // namespace

cudaError_t fused_chunks(const FusedArgs& args, cudaStream_t stream) {
  const ProduceArgs& pa = args.produce;
  const ConsumeArgs& ca = args.consume;
  if (ca.T <= 0 || ca.H <= 0) return cudaSuccess;
  if (pa.T != ca.T || pa.H != ca.H || pa.q == nullptr || pa.k == nullptr || pa.g == nullptr || pa.beta == nullptr ||
      (pa.gate != GateForm::kPrecomputed && pa.A_log == nullptr) || ca.v == nullptr || ca.out == nullptr)
    return cudaErrorInvalidValue;
  const bool f32 = pa.g_type == ElemType::kF32;
  if (args.on_verdict && (args.error_flag == nullptr || args.cu_seqlens == nullptr)) return cudaErrorInvalidValue;
  if (args.checkpoint_every < 0 ||
      (args.checkpoint_every > 0 &&
       (args.checkpoint_every % 64 != 0 || args.num_checkpoints < 0 ||
        (args.checkpoints == nullptr) == (args.checkpoint_slots == nullptr) ||
        (args.checkpoint_slots != nullptr && args.state_pool == nullptr) ||
        (args.cu_seqlens != nullptr && args.ckpt_start == nullptr))))
    return cudaErrorInvalidValue;
  if (args.run_if_flag != nullptr && (args.pieces > 0 || args.on_verdict))
    return cudaErrorInvalidValue;  // the pieces' fallback is a plain launch of the rule's kernel
  if (args.start_variant != 0 && args.pieces <= 0) return cudaErrorInvalidValue;  // the pieces' variants only
  // The several-sequence kernels (and the pieces): the rule's flags only, K0's verdict with
  // cu_seqlens or a pool, B equal lengths without cu_seqlens.
  const bool sequences_valid =
      args.num_seqs >= 1 && args.num_seqs <= kMaxFusedSeqs &&
      ((args.cu_seqlens == nullptr && args.state_pool == nullptr) || args.error_flag != nullptr) &&
      (args.state_pool == nullptr || args.state_indices != nullptr) && pa.T % (args.cu_seqlens ? 1 : args.num_seqs) == 0 &&
      pa.gate == GateForm::kLowerBound && !f32 && args.stage_inputs && args.producer_regs && args.consumer_inverse &&
      args.phase_clocks == nullptr && !args.time_consumers_only;
  if (args.pieces > 0) {  // no verdict to wait for
    if (!sequences_valid || args.pieces > kMaxFusedSeqs || args.num_seqs * args.pieces > kMaxFusedSeqs ||
        args.warmup < 1 || args.pieces_flag == nullptr ||
        ((ca.final_state != nullptr || args.state_pool != nullptr) && args.pieces_final == nullptr) ||
        args.on_verdict ||
        (args.pieces_chain &&
         (args.pieces_next == nullptr || args.pieces_ready == nullptr || args.pieces_states == nullptr)))
      return cudaErrorInvalidValue;
    if (args.start_variant != 0) {  // timing only: the start stamps (unchained pieces)
      if (args.pieces_chain || (args.start_variant < 1 || args.start_variant > 4)) return cudaErrorInvalidValue;
      return launch_rule_flags<true, true, true>(args, stream);
    }
    return launch_rule_flags<true, true>(args, stream);
  }
  if (args.num_seqs != 1 || args.cu_seqlens != nullptr || args.state_pool != nullptr) {  // the rule's flags only
    if (!sequences_valid) return cudaErrorInvalidValue;
    return launch_rule_flags<true, false>(args, stream);
  }
  if (args.phase_clocks != nullptr || args.producer_regs || args.consumer_inverse) {
    if (pa.gate != GateForm::kLowerBound || f32) return cudaErrorInvalidValue;
    return launch_lower_bound(args, stream);
  }
  if (pa.gate == GateForm::kLowerBound)
    return f32 ? launch<GateForm::kLowerBound, true>(args, stream) : launch<GateForm::kLowerBound, false>(args, stream);
  if (pa.gate == GateForm::kSoftplus)
    return f32 ? launch<GateForm::kSoftplus, true>(args, stream) : launch<GateForm::kSoftplus, false>(args, stream);
  return f32 ? launch<GateForm::kPrecomputed, true>(args, stream) : launch<GateForm::kPrecomputed, false>(args, stream);
}

bool fused_serves(const PrefillParams& p) {
  const int64_t N = detail::num_sequences(p);
  const bool states = p.state_pool != nullptr
                          ? p.initial_state == nullptr && p.final_state == nullptr
                          : (p.initial_state == nullptr || p.initial_state_dtype == DType::kF32) &&
                                (p.final_state == nullptr || p.final_state_dtype == DType::kF32);
  return N >= 1 && N <= kMaxFusedSeqs && p.B * p.T > 0 && p.B * p.T < (int64_t(1) << 31) && p.K == kHeadDim &&
         p.V == kHeadDim && p.dtype == DType::kBF16 && p.g_dtype == DType::kBF16 &&
         p.pre.gate == GateForm::kLowerBound && p.pre.l2norm_qk && p.precision == Precision::kPrecise && states;
}

FusedArgs fused_args(const PrefillParams& p) {
  FusedArgs f;
  ProduceArgs& pa = f.produce;
  pa.q = p.q, pa.k = p.k, pa.g = p.g, pa.beta = p.beta, pa.A_log = p.pre.A_log, pa.dt_bias = p.pre.dt_bias;
  pa.g_type = p.g_dtype == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
  pa.beta_type = p.beta_dtype == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
  pa.gate = p.pre.gate, pa.lower_bound = p.pre.lower_bound;
  pa.scale = detail::effective_scale(p.pre, p.K);
  pa.l2norm_qk = p.pre.l2norm_qk, pa.beta_is_logit = p.pre.beta_is_logit;
  pa.T = p.B * p.T, pa.H = int(p.H);
  ConsumeArgs& ca = f.consume;
  ca.v = p.v, ca.out = p.out, ca.T = p.B * p.T, ca.H = int(p.H);
  ca.initial_state = static_cast<const float*>(p.initial_state);
  ca.final_state = static_cast<float*>(p.final_state);
  f.num_seqs = detail::num_sequences(p);
  f.cu_seqlens = p.cu_seqlens, f.cu_seqlens_64 = p.cu_seqlens_dtype == DType::kI64;
  if (p.state_pool != nullptr) {
    f.state_pool = p.state_pool, f.pool_bf16 = p.state_pool_dtype == DType::kBF16, f.pool_size = p.pool_size;
    f.state_indices = p.state_indices, f.has_initial_state = p.has_initial_state;
  }
  if (p.checkpoint_every > 0 && p.num_checkpoints > 0) {  // none: no destination is required
    f.checkpoint_every = p.checkpoint_every, f.num_checkpoints = p.num_checkpoints;
    f.checkpoints = p.checkpoints, f.checkpoints_bf16 = p.checkpoint_dtype == DType::kBF16;
    f.checkpoint_slots = p.checkpoint_slots;
  }
  return f;
}

namespace {
// The call's arguments with the rule's flags (staged inputs, inverting consumers, setmaxnreg) and
// K0's verdict.
FusedArgs rule_args(const PrefillParams& p, const int* error_flag) {
  FusedArgs f = fused_args(p);
  f.stage_inputs = f.consumer_inverse = f.producer_regs = true;
  f.error_flag = error_flag;
  return f;
}
}  // namespace

cudaError_t fused_prefill(const PrefillParams& p, const int* error_flag, const int32_t* ckpt_start, cudaStream_t stream,
                          bool on_verdict, bool check_only, const int32_t* order) {
  FusedArgs f = rule_args(p, error_flag);
  f.ckpt_start = ckpt_start;
  f.order = p.cu_seqlens != nullptr ? order : nullptr;
  f.on_verdict = on_verdict, f.check_only = check_only;
  return fused_chunks(f, stream);
}

bool fused_pieces_serve(const PrefillParams& p) { return fused_serves(p); }

bool pieces_final_in_place(const PrefillParams& p) {
  if (p.state_pool != nullptr || p.final_state == nullptr) return false;
  if (p.initial_state == nullptr) return true;
  const uintptr_t bytes = uintptr_t(detail::num_sequences(p)) * uintptr_t(p.H) * kHeadDim * kHeadDim * sizeof(float);
  const auto in = reinterpret_cast<uintptr_t>(p.initial_state), out = reinterpret_cast<uintptr_t>(p.final_state);
  return out + bytes <= in || in + bytes <= out;  // fp32 states [N, H, V, K] (fused_serves), disjoint
}

int64_t fused_chain_flags(const PrefillParams& p, int64_t pieces) {
  return 2 + detail::num_sequences(p) * pieces * p.H;
}

int64_t fused_pieces_flag_ints(const PrefillParams& p, int64_t pieces, bool chained) {
  return chained ? fused_chain_flags(p, pieces) : 2;
}

cudaError_t fused_pieces_prefill(const PrefillParams& p, int64_t pieces, int warmup, int* flag, float* final_states,
                                 const int* error_flag, const int32_t* ckpt_start, cudaStream_t stream,
                                 float* chain_states, bool flags_zeroed, long long* stamps, int start_variant,
                                 long long* start_stamps) {
  if (!fused_pieces_serve(p) || pieces < 1 ||
      ((p.state_pool != nullptr || p.cu_seqlens != nullptr) && error_flag == nullptr))
    return cudaErrorInvalidValue;
  FusedArgs f = rule_args(p, error_flag);
  f.pieces = pieces, f.warmup = warmup, f.pieces_flag = flag;
  f.pieces_final = pieces_final_in_place(p) ? static_cast<float*>(p.final_state) : final_states;
  f.ckpt_start = ckpt_start;
  if (chain_states != nullptr) {  // the stop flag, the counter, the ready flags: one block, zeroed together
    f.pieces_chain = true, f.pieces_next = flag + 1, f.pieces_ready = flag + 2, f.pieces_states = chain_states;
  }
  f.piece_stamps = stamps;
  f.start_variant = start_variant, f.start_stamps = start_stamps;
  const int64_t flag_ints = fused_pieces_flag_ints(p, pieces, f.pieces_chain);
  cudaError_t err = cudaSuccess;
  if (!flags_zeroed) err = cudaMemsetAsync(flag, 0, size_t(flag_ints) * sizeof(int), stream);
  return err != cudaSuccess ? err : fused_chunks(f, stream);
}

cudaError_t fused_after_pieces(const PrefillParams& p, const int* flag, const int* error_flag, const int32_t* ckpt_start,
                               cudaStream_t stream) {
  FusedArgs f = rule_args(p, error_flag);
  f.ckpt_start = ckpt_start;
  f.run_if_flag = flag;
  return fused_chunks(f, stream);
}

prefill::PiecesFinal pieces_final_copy(const PrefillParams& p, const float* final_states) {
  prefill::PiecesFinal f;
  void* const to = p.state_pool != nullptr ? p.state_pool : p.final_state;
  if (to == nullptr || pieces_final_in_place(p)) return f;  // the last pieces wrote it
  const int64_t elem = p.state_pool != nullptr && p.state_pool_dtype == DType::kBF16 ? 2 : 4;
  f.from = final_states, f.to = to;
  f.per = p.H * kHeadDim * kHeadDim * elem / 16;  // 16-byte units of a sequence's state
  f.units = detail::num_sequences(p) * f.per;
  if (p.state_pool != nullptr) f.slots = p.state_indices, f.pool_size = p.pool_size;
  return f;
}

cudaError_t fused_pieces_finish(const PrefillParams& p, const int* flag, const float* final_states, cudaStream_t stream) {
  const prefill::PiecesFinal f = pieces_final_copy(p, final_states);
  if (f.from == nullptr) return cudaSuccess;
  pieces_finish_kernel<<<264, 256, 0, stream>>>(flag, f);
  return cudaGetLastError();
}

}  // namespace flashkda::cuda::sm90::prefill_v2
