// Host side of the sm90 prefill: workspace layout, kernel parameters, K0/K1/K2 launches and
// the choice of the recurrence variant (value-column split, precision mode).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "backend.h"
#include "cuda/check.h"
#include "cuda/device_info.h"
#include "launch_config.h"
#include "cuda/sm90/prefill/launch.h"
#include "cuda/sm90/prefill/prepare_kernel.cuh"
#include "cuda/sm90/prefill/segment_kernels.cuh"
#include "cuda/sm90/prefill_v2/fused.h"

namespace flashkda::cuda::sm90::prefill {

// K0: what the host cannot check (cu_seqlens in order, no live slot named twice) and the chunk scans,
// one CTA; its verdict in *p.error_flag.
void launch_k0(const Params& p, cudaStream_t stream) {
  chunk_scan_kernel<<<1, kScanThreads, 0, stream>>>(p);
  FLASHKDA_CHECK_LAUNCH();
}

template <class Split>
void launch_prepare(const Params& p, cudaStream_t stream) {
  // The call's first kernel launches in stream order (what precedes it is the caller's); K1 after
  // K0 early only where PrefillLaunch::early_launch says (a candidate, early_launch.cuh).
  const bool k0 = (p.cu_seqlens != nullptr || p.state_indices != nullptr) && !p.k0_ran;
  if (k0) launch_k0(p, stream);
  int64_t blocks = p.chunk_slots * p.H;  // > 0 wherever the pieces ran (they serve B T > 0 only)
  if (blocks == 0) return;
  // Where K0 may give the call to the fused kernel, K1's CTAs may all find nothing to do: four waves
  // of them take every chunk in turn (prepare_kernel kStrided).
  // So too after the fused kernel's pieces (Params::pieces_flag), which run the call unless a warm-up
  // fails; there one wave (six CTAs an SM, all resident at once), after unchained pieces taking the
  // chunks from a counter (Params::prep_next): an empty K1 of four waves took 4.7 us at T=8192 H=12
  // (run 121), of one 1.8 (run 123, an H200). Where the pieces stop, K1 in one wave with a fixed
  // stride ran 10-13% longer than the one-a-CTA K1 (run 125); the counter gives the items in the
  // one-a-CTA kernel's order, each CTA taking the next as soon as it is free.
  const bool strided = p.fused_sms > 0 || p.pieces_flag != nullptr;
  const int waves = p.pieces_flag != nullptr ? 1 : 4;
  if (strided) blocks = std::min<int64_t>(blocks, waves * kPrepCtasPerSm * sm_count());  // fused_sms is the SM count
  constexpr int smem = sizeof(PrepareSmem);
  auto kernel = strided ? prepare_kernel<Split, true> : prepare_kernel<Split, false>;
  FLASHKDA_CUDA_CHECK(allow_dynamic_smem(kernel, smem));
  launch_early(k0 && (p.early_launch & kEarlyK1), kernel, dim3(unsigned(blocks)), dim3(kPrepThreads), size_t(smem),
               stream, p);
}

void launch_segment_chain(const Params& p, cudaStream_t stream) {
  const int64_t work = p.num_seqs * p.H;
  if (work == 0) return;
  const bool lowrank = p.seg_lowrank != nullptr;  // low-rank transitions: their own kernel (a candidate)
  const int smem = lowrank ? int(sizeof(ChainLowRankSmem)) : int(sizeof(ChainSmem));
  const auto kernel = lowrank ? segment_chain_kernel<true> : segment_chain_kernel<false>;
  FLASHKDA_CUDA_CHECK(allow_dynamic_smem(kernel, smem));
  launch_early(p.early_launch & kEarlyChain, kernel, dim3(unsigned(work), kHeadDim / kChainRows),
               dim3(kChainThreads), size_t(smem), stream, p);
}

void launch_segment_combine(const Params& p, cudaStream_t stream) {
  const int64_t tiles = (p.seg_chunks + kCombineChunks - 1) / kCombineChunks;
  const int64_t ctas = p.max_segs * tiles;
  if (ctas == 0 || p.H == 0) return;
  // After the few-head pieces that ran the call (random gates) the grid's CTAs only read the flag and
  // leave, the costliest of the empty kernels after them (run 147, an H100: 2.7 us at T=8192 H=12, 21.3
  // at T=131072 H=12); a wave taking the items from a counter measured slower with long memory (run 170).
  const int64_t grid = ctas * p.H;
  const bool lowrank = p.seg_lowrank != nullptr;  // low-rank transitions: their own kernel (a candidate)
  const int smem = lowrank ? int(sizeof(CombineLowRankSmem)) : int(sizeof(CombineSmem));
  const auto kernel = lowrank ? segment_combine_kernel<true> : segment_combine_kernel<false>;
  FLASHKDA_CUDA_CHECK(allow_dynamic_smem(kernel, smem));
  launch_early(p.early_launch & kEarlyCombine, kernel, dim3(unsigned(grid)), dim3(kCombineThreads),
               size_t(smem), stream, p, tiles);
}

namespace {

ElemType elem_type(const void* ptr, DType t) {
  if (ptr == nullptr) return ElemType::kNone;
  return t == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
}

using flashkda::cuda::sm_count;

// Warps per recurrence CTA: two warpgroups (all 128 value columns) or one (a half, two CTAs per
// head). Every value-column split re-reads the whole chunk record (23 KB per chunk), so splits
// trade SM count for L2/DRAM traffic; split in two only when N*H leaves most SMs idle.
int choose_warps(int64_t work, const internal::PrefillLaunch& launch) {
  int splits = (2 * work <= int64_t(sm_count())) ? 2 : 1;
  if (launch.v_splits == 1 || launch.v_splits == 2) splits = launch.v_splits;
  return 8 / splits;
}

// Segments (config.h): cut sequences so that the segmented K2 fills the GPU's warpgroup slots
// (two or three one-warpgroup CTAs per SM, seg_ctas_per_sm) when one CTA pair per (sequence, head)
// would leave them idle. A sequence of C chunks in S segments costs H * (2 + 4 * (S - 1)) warpgroups
// (value rows of every segment, transition rows of all but the first); whether to cut is decided for
// two CTAs an SM, and the rule picks the total segment count that fills the slots, from the token
// count (the per-sequence lengths of cu_seqlens live on the GPU), and segments of at least
// kSegMinChunks chunks (each segment boundary costs a chain step).
// Measured on the H200 (docs/BENCHMARKS.md): a segmented chunk takes ~2.0 us against the serial
// kernel's ~1.2 us (two warpgroups per SM), and the combine adds ~1.25 KB of traffic per token
// and head; the rule cuts where the slots hold 2 segments per sequence on average or more, in every
// mode. (Before transition skipping, two segments per sequence lost ~2% in the fast mode, whose
// chunks are cheaper, and the fast mode asked for 3; with skipping its serial walk is the slower one:
// T=32768 H=32 2.62 against 1.42 ms segmented, BENCHMARKS-history.md "Few heads per GPU".)
//
// With checkpoints, the checkpoints inside a segment come from its partial transitions (the rule,
// ckpt_in_segments), so any segment length serves. internal::PrefillLaunch::checkpoints_in_segments
// = -1 keeps the former rule instead: the segment length divides checkpoint_every (in chunks), so
// that every checkpoint is a segment start or a sequence end, which the chain kernel has; the
// length is rounded down to the largest such divisor (forced lengths too), and the rule's length to
// one of at least kSegMinChunks chunks or no segments.
bool ckpt_in_segments(const internal::PrefillLaunch& launch) { return launch.checkpoints_in_segments >= 0; }

// CTAs of the segmented K2 an SM holds, one warpgroup each (internal::PrefillLaunch::seg_ctas_per_sm):
// 2 (up to 242 registers, three stages) or 3 (168 registers, two stages). The rule takes 3 from
// H = 16 up: measured (BENCHMARKS-history.md, three CTAs an SM) 3.6-4.3% faster with long memory and 4-5%
// on random gates at H = 16 and 32, but 2.6-6% slower with long memory at H = 12, where its eight
// segments (against six) add more transition work than they shorten the walk.
int seg_ctas_per_sm(const internal::PrefillLaunch& launch, int64_t H) {
  if (launch.seg_ctas_per_sm == 2 || launch.seg_ctas_per_sm == 3) return launch.seg_ctas_per_sm;
  return H >= 16 ? 3 : 2;
}

// Whether a call takes low-rank transitions (internal::PrefillLaunch::lowrank_transitions, a
// candidate): only their own segmented K2 (recur_seg_lowrank_kernel: two CTAs an SM, the bulk record
// stream) runs them, and only with transition skipping, whose chunk bounds their plan reads. The
// segment rule, the workspace and the launch all ask this.
bool takes_lowrank(const internal::PrefillLaunch& launch, int64_t H) {
  return launch.lowrank_transitions > 0 && seg_ctas_per_sm(launch, H) == 2 && launch.skip_transitions >= 0 &&
         launch.record_copy >= 0;
}

int64_t choose_segment_chunks(int64_t N, int64_t H, int64_t total_tokens,
                              int64_t checkpoint_every, const internal::PrefillLaunch& launch) {
  const int64_t longest = std::max<int64_t>(1, max_chunk_slots(total_tokens, 1));  // chunks of any sequence
  auto fit_checkpoints = [&](int64_t seg_chunks, int64_t shortest) -> int64_t {
    if (seg_chunks == 0 || checkpoint_every == 0 || seg_chunks >= longest || ckpt_in_segments(launch))
      return seg_chunks;
    const int64_t period = checkpoint_every / kChunk;
    for (int64_t d = std::min(seg_chunks, period); d >= shortest; --d)
      if (period % d == 0) return d;
    return 0;
  };
  if (launch.segment_chunks < 0) return 0;
  if (launch.segment_chunks > 0)  // forced; longer than any sequence is one segment each
    return fit_checkpoints(std::min(launch.segment_chunks, longest), 1);
  if (N <= 0 || H <= 0) return 0;
  // Whether to cut at all is decided for two warpgroups an SM (as before the three-CTA kernel);
  // how many segments, for the warpgroups an SM the call runs.
  const int64_t sms = sm_count();
  // Low-rank transitions (a candidate, at two CTAs an SM with transition skipping): a segment s > 0's
  // second transition block walks one chunk, so it costs about three warpgroups: H * (2 + 3 (S - 1)).
  auto filling = [&](int64_t warpgroups_per_sm, bool lowrank) {  // segments over all sequences
    return lowrank ? (warpgroups_per_sm * sms / H + N) / 3 : (warpgroups_per_sm * sms / H + 2 * N) / 4;
  };
  if (filling(2, false) < 2 * N) return 0;
  const int64_t segments = filling(seg_ctas_per_sm(launch, H), takes_lowrank(launch, H));
  const int64_t chunks = (total_tokens + kChunk - 1) / kChunk;
  const int64_t seg_chunks = std::max<int64_t>(kSegMinChunks, (chunks + segments - 1) / segments);
  return chunks >= 2 * seg_chunks ? fit_checkpoints(seg_chunks, kSegMinChunks) : 0;
}

// Transition skipping (config.h "Transition skipping"): pieces of run_chunks chunks, warm-ups of up
// to a piece. Where every boundary skips, each piece is one run of two warpgroups (value rows), so
// the GPU's warpgroup slots (seg_ctas_per_sm * #SMs) hold slots / 2H pieces per head at once. Where
// the segments have room for two of those pieces each or more, the rule cuts every segment into
// that many equal pieces of 32 chunks or more: one wave of equal runs (H = 16 and 32, two pieces a
// segment at two or three CTAs an SM). Elsewhere (H = 12: six segments, eleven pieces a head) equal
// pieces would need more slots than there are, or segments longer than the exact path's (measured:
// 5-6% slower with long memory at H = 12), and the rule takes pieces of chunks * 2H / slots chunks,
// rounded up to a multiple of 32 within [32, 64], or the whole segment where that is shorter (then
// only the segment starts may skip). Measured (BENCHMARKS-history.md, layouts sweep, two CTAs an SM): equal
// pieces 3-7% faster than those at H = 16 and 32 on random gates, within 2% with long memory. With
// the chunk bound of each chunk's own transition (skip_bound) a warm-up takes a chunk or two on
// random gates, so shorter pieces pay (run 62, H = 12, against pieces of up to 128 and no skipping in
// one-piece segments): T=2048 0.118 -> 0.092 ms random (0.118 -> 0.122 long memory), T=32768 0.738 ->
// 0.665 (1.029 -> 1.020), T=131072 2.487 -> 2.551 (3.950 -> 3.935), T=8192 unchanged. Forced lengths
// (internal::PrefillLaunch::skip_run_chunks) and the rule's are lengthened to kMaxPieces pieces per
// segment at most and rounded up to a multiple of kCombineChunks; 0: no transition skipping.
int64_t choose_run_chunks(int64_t total_tokens, int64_t H, int64_t seg_chunks, bool skip,
                          const internal::PrefillLaunch& launch) {
  if (!skip || seg_chunks <= 0) return 0;
  const int64_t chunks = (total_tokens + kChunk - 1) / kChunk;
  int64_t run = launch.skip_run_chunks;
  if (run <= 0) {
    const int64_t segments = std::max<int64_t>(1, (chunks + seg_chunks - 1) / seg_chunks);  // 0 tokens: 1
    const int64_t slots = seg_ctas_per_sm(launch, H) * int64_t(sm_count());  // warpgroup slots of the GPU
    const int64_t per_segment = H > 0 ? (slots / (2 * H)) / segments : 0;
    if (per_segment >= 2 && seg_chunks >= 32 * per_segment) {
      run = (seg_chunks + per_segment - 1) / per_segment;
    } else {
      const int64_t fill = (2 * chunks * H + slots - 1) / slots;
      run = std::min(std::clamp<int64_t>((fill + 31) / 32 * 32, 32, 64), seg_chunks);  // one piece: starts skip
    }
  }
  run = std::max(run, (seg_chunks + kMaxPieces - 1) / kMaxPieces);
  return (run + kCombineChunks - 1) / kCombineChunks * kCombineChunks;  // the combine's tiles end with the exact run
}

// Whether K1's chunk bounds also take each chunk's own transition bound (internal::PrefillLaunch::
// skip_bound; prepare_chunk.cuh chunk_log_bound). It costs K1 ~3% of its instructions and pays where
// warm-ups are a large part of a piece: the rule takes it for pieces of up to 64 chunks (the H = 12
// branch above, and forced lengths alike), not for the equal pieces of hundreds of chunks at H = 16 and
// 32, where it measured 0.5-1.8% slower in both gate regimes (runs 62-63, BENCHMARKS-history.md).
bool bounds_transitions(int64_t run_chunks, const internal::PrefillLaunch& launch) {
  if (launch.skip_bound != 0) return launch.skip_bound > 0;
  return run_chunks <= 64;
}

struct Layout {
  size_t header, records, seg_states, seg_out, seg_ckpt;
  size_t chunk_bound, seg_exact, seg_plan, seg_taint;  // transition skipping
  size_t seg_lowrank, seg_g, seg_y;                    // low-rank transitions
  size_t slot_bits, total;
};

// The workspace of one call: header, K1 records and, with segments, the per-segment matrices
// (X_s, B_s^T, A_s^T), the fp32 outputs of the chunks of segments s > 0, with checkpoints inside
// segments the partial transitions (B_c^T, A_c^T) of each checkpoint, and with transition skipping
// (pieces of run_chunks) the chunk bounds and each segment's runs; last, with a state pool of
// pool_size slots, one bit per slot for K0's check that no live slot is named twice.
Layout workspace_layout(int64_t N, int64_t H, int64_t total_tokens, int64_t seg_chunks, int64_t ckpt_partials = 0,
                        int64_t run_chunks = 0, int64_t pool_size = 0, bool lowrank = false) {
  const int64_t slots = max_chunk_slots(total_tokens, N);
  Layout l{};
  l.header = header_bytes(N);
  l.records = align_up(size_t(slots) * size_t(H) * kMaxRecordBytes);  // either mode's records fit
  if (seg_chunks > 0) {
    const size_t matrices = size_t(max_segments(slots, N, seg_chunks)) * size_t(H) * kSegStateFloats * 4;
    l.seg_states = 3 * align_up(matrices);
    l.seg_out = align_up(size_t(slots) * size_t(H) * kSegOutFloats * 4);
    l.seg_ckpt = 2 * align_up(size_t(ckpt_partials) * size_t(H) * kSegStateFloats * 4);
    if (run_chunks > 0) {  // chunk bounds, then per segment its exact run, its plan and its runs' taint records
      const size_t segs = size_t(max_segments(slots, N, seg_chunks)) * size_t(H);
      l.chunk_bound = align_up(size_t(slots) * size_t(H) * 4);
      l.seg_exact = align_up(segs * 4);
      l.seg_plan = align_up(segs * kPlanWords * 4);
      l.seg_taint = align_up(segs * size_t(pieces_of(seg_chunks, run_chunks)) * kTaintBytes);
      if (lowrank) {  // per segment its plan, G's chunk rows and Y_s^T
        l.seg_lowrank = align_up(segs * sizeof(LowRankInfo));
        l.seg_g = align_up(segs * kLowRankGFloats * 4);
        l.seg_y = align_up(segs * kLowRankYFloats * 4);
      }
    }
  }
  l.slot_bits = align_up(size_t((pool_size + 31) / 32) * 4);
  l.total = l.header + l.records + l.seg_states + l.seg_out + l.seg_ckpt + l.chunk_bound + l.seg_exact + l.seg_plan +
            l.seg_taint + l.seg_lowrank + l.seg_g + l.seg_y + l.slot_bits;
  return l;
}

// Hands out consecutive regions of a workspace, each as long as its Layout field says, so that the
// order of the regions is written once (the order of the take calls).
struct Carver {
  uint8_t* at;
  template <class T = uint8_t>
  T* take(size_t bytes) {
    T* region = reinterpret_cast<T*>(at);
    at += bytes;
    return region;
  }
};

template <class Split>
void launch_segmented(const Params& kp, int ctas_per_sm, bool bulk, cudaStream_t stream) {
  launch_prepare<Split>(kp, stream);
  if (ctas_per_sm == 3) launch_recur_segmented<Split, 3>(kp, stream, bulk);
  else launch_recur_segmented<Split, 2>(kp, stream, bulk);
  launch_segment_chain(kp, stream);
  launch_segment_combine(kp, stream);
}

// K1 writes the mode's record layout and K2 reads it (config.h RecordLayout); bulk: K2's
// one-warpgroup CTAs take their records by bulk copies (internal::PrefillLaunch::record_copy).
template <class Split>
void launch_mode(int warps, int seg_ctas, bool bulk, const Params& kp, cudaStream_t stream) {
  if (kp.seg_chunks > 0) return launch_segmented<Split>(kp, seg_ctas, bulk, stream);
  launch_prepare<Split>(kp, stream);
  if (warps == 8) launch_recur<8, Split>(kp, stream, false);
  else launch_recur<4, Split>(kp, stream, bulk);
}

// Calls f(Split{}) with the precision policy of the call (config.h SplitPolicy). The precise mode
// runs the fp16 policy (F16Split: S, k_decayed and q_decayed in fp16 with the row-scale range
// guard of recur_kernel.cuh, the factors split) where its record operands are bounded, i.e. with
// L2-normalised q and k and |scale| <= kF16MaxScale (|k_decayed| <= 1, |q_decayed| <= |scale|: far
// inside fp16's range), and the bf16 split of S (PreciseSplit) otherwise. internal::PrefillLaunch::
// f16_operands forces either (1: F16Split for every mode, -1: never).
constexpr float kF16MaxScale = 1024.f;

bool runs_f16(const Params& kp, Precision precision, int f16_operands) {
  if (f16_operands != 0) return f16_operands > 0;
  return precision == Precision::kPrecise && kp.l2norm_qk && std::fabs(kp.scale) <= kF16MaxScale;
}

template <class F>
void with_split(const Params& kp, Precision precision, int f16_operands, F&& f) {
  if (runs_f16(kp, precision, f16_operands)) return f(F16Split{});
  switch (precision) {
    case Precision::kFast: return f(FastSplit{});
    case Precision::kBalanced: return f(BalancedSplit{});
    default: return f(PreciseSplit{});
  }
}

}  // namespace
}  // namespace flashkda::cuda::sm90::prefill

namespace flashkda::cuda {

using namespace sm90::prefill;  // this file's kernels and their Params

namespace {

Params kernel_params(const PrefillParams& p, uint8_t* ws);
bool fused_by_rule(const PrefillParams& p, const internal::PrefillLaunch& launch);
int64_t fused_min_tokens(const internal::PrefillLaunch& launch);

}  // namespace

int64_t prefill_segment_chunks(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  return choose_segment_chunks(detail::num_sequences(p), p.H, p.B * p.T, p.checkpoint_every, launch);
}

// Whether segments may skip their transition (internal::PrefillLaunch::skip_transitions: the rule
// and 1, not -1).
bool skips_transitions(const internal::PrefillLaunch& launch) { return launch.skip_transitions >= 0; }

// Chunks per piece of transition skipping (0: none).
int64_t prefill_run_chunks(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  return choose_run_chunks(p.B * p.T, p.H, prefill_segment_chunks(p, launch), skips_transitions(launch), launch);
}

// Slots of the state pool, whose bitmap the workspace holds (0 without a pool).
int64_t pool_slots(const PrefillParams& p) { return p.state_pool != nullptr ? p.pool_size : 0; }

// Checkpoints whose partial transitions the workspace holds (checkpoints inside segments).
int64_t checkpoint_partials(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  return ckpt_in_segments(launch) && p.checkpoint_every > 0 ? p.num_checkpoints : 0;
}

// PrefillLaunch's 23 fields, counted by a structured binding: a field added there stops the build here
// until it is placed, named in forces_chunk16 if it forces a variant of the chunk-16 kernels, or not
// (the fused kernel's, the CPU's, pieces_graph_if and the timing-only piece_stamps,
// pieces_start and start_stamps); then the binding gains a name.
[[maybe_unused]] void launch_fields_are_placed(internal::PrefillLaunch& l) {
  [[maybe_unused]] auto& [f1, f2, f3, f4, f5, f6, f7, f8, f9, f10,  //
                          f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23] = l;
}
// Whether the launch forces a variant of the chunk-16 kernels (their segments and transition
// skipping, V splits, operands, record stream, early launch, low-rank transitions 1): the few-head
// pieces' rule then leaves the call to them, so that what the variant names is what runs (low-rank
// transitions 2 keep the pieces' rule: the chunk-16 kernels after a stop take them).
bool forces_chunk16(const internal::PrefillLaunch& l) {
  return l.v_splits != 0 || l.segment_chunks != 0 || l.f16_operands != 0 || l.checkpoints_in_segments != 0 ||
         l.skip_transitions != 0 || l.skip_run_chunks != 0 || l.skip_warmup_chunks != 0 || l.seg_ctas_per_sm != 0 ||
         l.record_copy != 0 || (l.early_launch & kEarlyAll) != 0 || l.skip_bound != 0 || l.lowrank_transitions == 1;
}
// The fused kernel in pieces: internal::PrefillLaunch::fused_pieces where it is set (a count, chained
// with fused_chain 1; -1: never), else by rule (fused_v2 0) for B equal sequences without cu_seqlens,
// or one sequence with them (its length is the call's T if they are valid; K0, launched ahead of the
// pieces, refuses them otherwise): where the fused kernel takes the call by its rule, chained pieces
// (config.h fused_chain_pieces; internal fused_chain -1 turns them off); where it leaves the call to
// the chunk-16 kernels (few heads), unchained pieces (config.h fused_few_head_pieces), those kernels
// running the call after them where a warm-up does not bound its transition; not where the launch
// forces a variant of the chunk-16 kernels (forces_chunk16). Whether the fused kernel serves the
// call in pieces is fused_pieces_area's test, for the forced count and the rule's alike.
struct PiecesChoice {
  int64_t pieces = 0;  // 0: none
  bool chained = false;
};
PiecesChoice fused_pieces_choice(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  if (launch.fused_pieces != 0) return {launch.fused_pieces > 0 ? launch.fused_pieces : 0, launch.fused_chain > 0};
  if (launch.fused_v2 != 0 || (p.cu_seqlens != nullptr && detail::num_sequences(p) != 1)) return {};
  const int64_t chunks = (p.T + kFusedChunk - 1) / kFusedChunk;
  const bool by_rule = p.cu_seqlens == nullptr ? fused_by_rule(p, launch)
                                               : fused_rule(p.H, chunks, p.T, sm_count(), fused_min_tokens(launch));
  if (by_rule) {
    if (launch.fused_chain < 0) return {};
    const int64_t pieces = fused_chain_pieces(p.H, p.B, chunks, sm_count());
    return {pieces > 1 ? pieces : 0, true};
  }
  if (!kFewHeadPiecesByRule || forces_chunk16(launch)) return {};
  const int64_t pieces = fused_few_head_pieces(p.H, p.B, chunks, sm_count());
  return {pieces > 1 ? pieces : 0, false};
}

// The pieces' area of the workspace, after the chunk-16 kernels': the flags' block (the flag; when
// chained, the counter and the ready flags after it, else the chunk-16 K1's counter, Params::prep_next),
// the last pieces' final states, and when chained every piece's end state. pieces 0: the call does not
// run in pieces (total 0).
struct PiecesArea {
  int64_t pieces = 0;
  bool chained = false;
  size_t finals = 0, states = 0, total = 0;  // offsets from the area's start, its bytes
};
PiecesArea fused_pieces_area(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  PiecesArea a;
  const PiecesChoice choice = fused_pieces_choice(p, launch);
  if (choice.pieces <= 0 || launch.fused_v2 < 0 || !sm90::prefill_v2::fused_pieces_serve(p) ||
      detail::num_sequences(p) * choice.pieces > 65535)  // the grid's y
    return a;
  a.pieces = choice.pieces;
  a.chained = choice.chained;
  const size_t states = size_t(detail::num_sequences(p)) * size_t(p.H) * kHeadDim * kHeadDim * 4;
  a.finals = align_up(sizeof(int) * size_t(sm90::prefill_v2::fused_pieces_flag_ints(p, a.pieces, a.chained)));
  a.states = a.finals + align_up(states);
  a.total = a.states + (a.chained ? align_up(states * size_t(a.pieces)) : 0);
  return a;
}

// The kernels' workspace (workspace_layout) without the pieces' area, which follows it.
size_t kernels_workspace_size(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  return workspace_layout(detail::num_sequences(p), p.H, p.B * p.T, prefill_segment_chunks(p, launch),
                          checkpoint_partials(p, launch), prefill_run_chunks(p, launch), pool_slots(p),
                          takes_lowrank(launch, p.H))
      .total;
}

size_t prefill_workspace_size(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  return kernels_workspace_size(p, launch) + fused_pieces_area(p, launch).total;
}

namespace {

// The kernels' view of a problem (everything but the segment fields), workspace header included.
Params kernel_params(const PrefillParams& p, uint8_t* ws) {
  const int64_t N = detail::num_sequences(p);
  Params kp{};
  kp.q = p.q, kp.k = p.k, kp.v = p.v, kp.g = p.g, kp.beta = p.beta, kp.out = p.out;
  kp.g_type = p.g_dtype == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
  kp.beta_type = p.beta_dtype == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
  kp.A_log = p.pre.A_log, kp.dt_bias = p.pre.dt_bias;
  kp.initial_state = p.initial_state;
  kp.initial_state_type = elem_type(p.initial_state, p.initial_state_dtype);
  kp.final_state = p.final_state;
  kp.final_state_type = elem_type(p.final_state, p.final_state_dtype);
  if (p.state_pool != nullptr) {  // the serving prefill: every state read and written in the pool
    kp.initial_state = kp.final_state = p.state_pool;
    kp.initial_state_type = kp.final_state_type = elem_type(p.state_pool, p.state_pool_dtype);
    kp.state_indices = p.state_indices;
    kp.has_initial_state = p.has_initial_state;
    kp.pool_size = p.pool_size;
  }
  kp.checkpoint_every = p.checkpoint_every;
  kp.checkpoints = p.checkpoints;
  kp.checkpoint_type = elem_type(p.checkpoints, p.checkpoint_dtype);
  kp.checkpoint_slots = p.checkpoint_slots;
  kp.num_checkpoints = p.num_checkpoints;
  kp.cu_seqlens = p.cu_seqlens;
  kp.cu_seqlens_64 = p.cu_seqlens_dtype == DType::kI64;
  kp.num_seqs = N;
  kp.seq_len = p.T;
  kp.total_tokens = p.B * p.T;
  kp.H = int(p.H);
  kp.gate = p.pre.gate;
  kp.lower_bound = p.pre.lower_bound;
  kp.l2norm_qk = p.pre.l2norm_qk;
  kp.beta_is_logit = p.pre.beta_is_logit;
  kp.scale = detail::effective_scale(p.pre, p.K);
  kp.chunk_start = reinterpret_cast<int32_t*>(ws);
  kp.error_flag = kp.chunk_start + (N + 1);
  kp.seg_start = kp.error_flag + 1;
  kp.ckpt_start = kp.seg_start + (N + 1);
  kp.chunk_slots = max_chunk_slots(kp.total_tokens, N);
  return kp;
}

// Params::fused_order's room in the workspace header (after ckpt_start), where K0 writes the order
// of the sequences for the fused kernel.
int32_t* order_slot(const Params& kp) { return kp.ckpt_start + (kp.num_seqs + 1); }

// K0 alone ahead of a fused launch (device cu_seqlens or a pool: what the host cannot check): its
// verdict, each sequence's first checkpoint and, with `order`, the sequences' order in the
// workspace header, and a pool's slot bits right after the header (nothing else is carved).
Params launch_k0_ahead(const PrefillParams& p, void* workspace, bool order, cudaStream_t stream) {
  auto* ws = static_cast<uint8_t*>(workspace);
  Params kp = kernel_params(p, ws);
  if (order) kp.fused_order = order_slot(kp);
  const Layout l = workspace_layout(detail::num_sequences(p), p.H, kp.total_tokens, 0, 0, 0, pool_slots(p));
  if (l.slot_bits > 0) kp.slot_bits = reinterpret_cast<uint32_t*>(ws + l.header);
  launch_k0(kp, stream);
  return kp;
}

// The rule's floor on the longest sequence: internal::PrefillLaunch::fused_min_tokens (a candidate), or
// kFusedMinTokens.
int64_t fused_min_tokens(const internal::PrefillLaunch& launch) {
  return launch.fused_min_tokens > 0 ? launch.fused_min_tokens : kFusedMinTokens;
}
// Prefill v2's fused kernel (launch_config.h fused_v2) runs one CTA a sequence and head, each
// walking its sequence's chunks at ~5.4 us a 32-token chunk however many run; the chunk-16 kernels
// take less at few CTAs and more at many. Measured (bench_prefill.py --fused-sweep and
// --fused-batch-sweep, fused / chunk-16): one sequence (run 92, T = 2048-32768) 1.38-1.63 at
// H = 48-64, 1.00-1.06 at 80, 0.94-0.95 at 96, 0.85-0.90 at 112-128; batches of 4-16 equal lengths
// of 512-4096 tokens (run 97, H = 12-96) 1.42-1.60 at N H = 48-64, 0.83-0.96 from N H = 96. So
// config.h fused_rule: the fused kernel from 2/3 of the SMs busy over the longest sequence. Calls
// without cu_seqlens (equal lengths) are decided here; with device cu_seqlens K0 decides
// (fused_by_lengths), since the host cannot read the lengths.
bool fused_by_rule(const PrefillParams& p, const internal::PrefillLaunch& launch) {
  return p.cu_seqlens == nullptr &&
         fused_rule(p.H, p.B * ((p.T + kFusedChunk - 1) / kFusedChunk), p.T, sm_count(), fused_min_tokens(launch));
}
// The fused kernel launched after the chunk-16 kernels, on K0's verdict: a CTA an item (N H of them).
// (A persistent grid of at most #SMs CTAs taking the items from a counter, so that a declined call
// costs one wave of CTAs, measured 2-7% slower where K0 chose it, runs 102-105, and was dropped:
// docs/DESIGN.md "Prefill v2: where the fused kernel's cycles go".)
cudaError_t fused_on_verdict(const PrefillParams& p, const Params& kp, cudaStream_t stream, bool check_only) {
  return sm90::prefill_v2::fused_prefill(p, kp.error_flag, kp.ckpt_start, stream, true, check_only, kp.fused_order);
}
// Whether K0 may give a call with device cu_seqlens to the fused kernel: the rule can hold for some
// lengths (at best N equal ones) and the kernel can be launched here (its tensor maps, its register
// split: asked without launching, since after K0's verdict there is no way back), and only where the
// sequences average at least the rule's floor (64 tokens): where K0 leaves the call to the chunk-16
// kernels, a CTA-an-item launch still runs its N H CTAs, one an SM, which exit at once: ~2.3 us a
// wave of #SMs CTAs (run 99, "2048 + 30 x 64" at H = 12-32: +6 to +17 us), against a call of ~1.65 ns a
// token and head, i.e. ~9 / mean length of the call's time; at 64 tokens and more that is <= 14% (run
// 107: "2048 + 30 x 64", mean 128, at H = 12-32, which K0 leaves to the chunk-16 kernels, 3-6% slower
// than without the launch; at H = 64-96, which it gives the fused kernel, 13% faster; runs 109-110:
// 256 x 64, which K0 gives the fused kernel at every H measured, 0.84-0.86x forced).
bool fused_by_lengths(const PrefillParams& p, const Params& kp) {
  const int64_t N = detail::num_sequences(p);
  return p.cu_seqlens != nullptr && p.B * p.T >= kp.fused_min_tokens * N && 3 * N * p.H >= 2 * int64_t(sm_count()) &&
         fused_on_verdict(p, kp, nullptr, true) == cudaSuccess;
}

// One segment per sequence, as long as the longest possible sequence.
int64_t whole_sequence_chunks(const PrefillParams& p) { return std::max<int64_t>(1, max_chunk_slots(p.B * p.T, 1)); }

// The chunk-16 kernels' parameters (K0's with them) for a call, the workspace carved by
// workspace_layout; pieces_flag: the fused kernel's pieces' flag where they run first (Params::
// pieces_flag), else null. Checks the segmented grids' sizes before anything is launched.
Params chunk16_params(const PrefillParams& p, const internal::PrefillLaunch& launch, void* workspace,
                      const int* pieces_flag) {
  const int64_t N = detail::num_sequences(p);
  auto* ws = static_cast<uint8_t*>(workspace);
  Params kp = kernel_params(p, ws);
  kp.fused_min_tokens = fused_min_tokens(launch);
  kp.pieces_flag = pieces_flag;
  kp.early_launch = launch.early_launch > 0 ? launch.early_launch & kEarlyAll : 0;
  kp.seg_chunks = prefill_segment_chunks(p, launch);
  const int64_t run_chunks = prefill_run_chunks(p, launch);
  const Layout l = workspace_layout(N, p.H, kp.total_tokens, kp.seg_chunks, checkpoint_partials(p, launch),
                                    run_chunks, pool_slots(p), takes_lowrank(launch, p.H));
  Carver regions{ws + l.header};  // the header: kernel_params
  kp.records = regions.take(l.records);
  float* states = regions.take<float>(l.seg_states);
  float* seg_out = regions.take<float>(l.seg_out);
  float* ckpt_partials = regions.take<float>(l.seg_ckpt);
  float* chunk_bound = regions.take<float>(l.chunk_bound);
  int32_t* seg_exact = regions.take<int32_t>(l.seg_exact);
  uint32_t* seg_plan = regions.take<uint32_t>(l.seg_plan);
  uint8_t* seg_taint = regions.take(l.seg_taint);
  LowRankInfo* seg_lowrank = regions.take<LowRankInfo>(l.seg_lowrank);
  float* seg_g = regions.take<float>(l.seg_g);
  float* seg_y = regions.take<float>(l.seg_y);
  uint32_t* slot_bits = regions.take<uint32_t>(l.slot_bits);
  if (l.slot_bits > 0) kp.slot_bits = slot_bits;
  if (kp.seg_chunks > 0) {
    kp.max_segs = max_segments(kp.chunk_slots, N, kp.seg_chunks);
    const size_t matrices = l.seg_states / 3 / sizeof(float);
    kp.seg_x = states, kp.seg_b = states + matrices, kp.seg_a = states + 2 * matrices;
    kp.seg_out = seg_out;
    if (l.seg_ckpt > 0) {
      kp.seg_ckpt_b = ckpt_partials;
      kp.seg_ckpt_a = ckpt_partials + l.seg_ckpt / 2 / sizeof(float);
    }
    if (run_chunks > 0) {
      kp.run_chunks = run_chunks;
      // A warm-up is at most one segment long (and fits plan_runs' 16-bit counts).
      kp.run_warmup = std::min<int64_t>(launch.skip_warmup_chunks > 0 ? launch.skip_warmup_chunks : run_chunks,
                                        std::min<int64_t>(kp.seg_chunks, UINT16_MAX));
      kp.max_pieces = pieces_of(kp.seg_chunks, run_chunks);
      kp.chunk_bound = chunk_bound, kp.seg_exact = seg_exact, kp.seg_plan = seg_plan, kp.seg_taint = seg_taint;
      kp.bound_transitions = bounds_transitions(run_chunks, launch);
      if (l.seg_lowrank > 0) kp.seg_lowrank = seg_lowrank, kp.seg_g = seg_g, kp.seg_y = seg_y;  // takes_lowrank
    }
    // Grid sizes of the segmented K2 and the combine, checked before anything is launched.
    const int64_t combine_ctas = kp.max_segs * ((kp.seg_chunks + kCombineChunks - 1) / kCombineChunks);
    FLASHKDA_CHECK(kp.max_segs <= int64_t(INT32_MAX) / p.H && combine_ctas <= int64_t(INT32_MAX) / p.H,
                   ErrorCode::kUnsupported, "segments of ", kp.seg_chunks, " chunks: ", combine_ctas * p.H,
                   " CTAs exceed the GPU grid limit");
  }
  return kp;
}

// Calls captured in a CUDA graph with pieces (PrefillLaunch::pieces_graph_if, a candidate): the
// kernels after the pieces, which do nothing unless a piece stopped the call, go into the body of a
// conditional node that the pieces' flag opens, so a replay whose pieces ran the call launches none
// of them (four launches and their gaps at few heads). One thread sets the condition from the flag
// once the pieces are done. A graph with a conditional node cannot be cloned, embedded as a child
// graph or have that node's parameters updated (cudaGraphExecUpdate): hence off by default.
__global__ void open_if_stopped_kernel(cudaGraphConditionalHandle handle, const int* flag) {
  cudaGraphSetConditional(handle, *flag != 0 ? 1u : 0u);
}

// The stream that captures the conditional node's body: one per thread and context (a reset device's
// new context gets its own), made by a call that is not being captured, so that nothing is created
// inside the caller's capture; a capture before any eager call of its thread launches as an eager
// call does. Never destroyed (one a thread and context).
cudaStream_t body_stream(bool may_create) {
  thread_local std::unordered_map<unsigned long long, cudaStream_t> streams;
  const unsigned long long ctx = context_id();
  if (ctx == 0) return nullptr;
  if (const auto it = streams.find(ctx); it != streams.end()) return it->second;
  cudaStream_t s = nullptr;
  if (!may_create || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return streams.emplace(ctx, s).first->second;
}

// Where `stream` is being captured: body(s) captured into a conditional node that runs it where
// *flag is not zero when the graph reaches it; true. Else (an eager call, no body stream yet, a
// capture no longer active) false, and the caller launches body(stream) itself. An error after the
// condition's kernel was captured throws: the capture would not instantiate.
template <class Body>
bool launch_if_stopped(cudaStream_t stream, const int* flag, const Body& body) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (status != cudaStreamCaptureStatusActive) {
    (void)body_stream(true);  // for this thread's later captures
    return false;
  }
  const cudaStream_t side = body_stream(false);
  cudaGraph_t graph = nullptr;
  cudaGraphConditionalHandle handle{};
  if (side == nullptr || cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph) != cudaSuccess ||
      status != cudaStreamCaptureStatusActive ||
      cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  open_if_stopped_kernel<<<1, 1, 0, stream>>>(handle, flag);
  FLASHKDA_CHECK_LAUNCH();
  const cudaGraphNode_t* deps = nullptr;
  size_t num_deps = 0;
  FLASHKDA_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, nullptr, &num_deps));
  FLASHKDA_CHECK(status == cudaStreamCaptureStatusActive, ErrorCode::kCuda,
                 "the stream's capture ended inside the prefill call (another thread's unsafe call?)");
  cudaGraphNodeParams node_params{};
  node_params.type = cudaGraphNodeTypeConditional;
  node_params.conditional.handle = handle;
  node_params.conditional.type = cudaGraphCondTypeIf;
  node_params.conditional.size = 1;
  cudaGraphNode_t node = nullptr;
  FLASHKDA_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, nullptr, num_deps, &node_params));
  FLASHKDA_CUDA_CHECK(cudaStreamBeginCaptureToGraph(side, node_params.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                                    cudaStreamCaptureModeRelaxed));
  struct EndBody {  // the body's capture ends whatever body() does
    cudaStream_t s;
    bool ended = false;
    ~EndBody() {
      if (!ended) {
        cudaGraph_t g = nullptr;
        (void)cudaStreamEndCapture(s, &g);
        (void)cudaGetLastError();
      }
    }
  } end_body{side};
  body(side);
  end_body.ended = true;
  cudaGraph_t captured = nullptr;
  FLASHKDA_CUDA_CHECK(cudaStreamEndCapture(side, &captured));
  FLASHKDA_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
  return true;
}

}  // namespace

void forward(const PrefillParams& p, const internal::PrefillLaunch& launch, void* workspace, size_t,
             Stream stream_handle) {
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  // The fused kernel in pieces (fused_pieces_choice: forced, or by rule), then the kernels the rule
  // picks for the call, which run it only where a piece's warm-up did not bound its transition.
  const int* pieces_flag = nullptr;
  uint32_t* prep_next = nullptr;  // unchained pieces: K1's counter after their flag (Params::prep_next)
  Params ahead{};  // with cu_seqlens or a pool: the chunk-16 kernels' parameters K0 ran with ahead of the pieces
  const int* pieces_error_flag = nullptr;  // K0's verdict where it ran ahead of the pieces
  const int32_t* pieces_ckpt_start = nullptr;
  bool fused_if_stopped = false;  // where a piece stops the call, the fused kernel runs it
  PiecesFinal pieces_final;        // the pieces' final states, for K1 after them to copy
  if (const PiecesArea area = fused_pieces_area(p, launch); area.pieces > 0) {
    uint8_t* const at = static_cast<uint8_t*>(workspace) + kernels_workspace_size(p, launch);
    int* const flag = reinterpret_cast<int*>(at);
    float* const finals = reinterpret_cast<float*>(at + area.finals);
    float* const chain_states = area.chained ? reinterpret_cast<float*>(at + area.states) : nullptr;
    const int warmup = launch.fused_warmup > 0 ? launch.fused_warmup : 1;
    // K0 first (the cu_seqlens' and the slots' check, each sequence's first checkpoint), whose refusal
    // the kernels after the pieces carry out. With the chunk-16 kernels' parameters (its scan then
    // numbers their segments too), so that where those kernels run after the pieces they do not launch
    // it again (Params::k0_ran): one launch fewer on every call with cu_seqlens or a pool, as engines
    // make them.
    const bool k0_first = p.state_pool != nullptr || p.cu_seqlens != nullptr;
    if (k0_first) {
      ahead = chunk16_params(p, launch, workspace, flag);
      ahead.pieces_zero = flag;  // K0 zeroes the pieces' flags: their memset's launch saved
      ahead.pieces_zero_ints = sm90::prefill_v2::fused_pieces_flag_ints(p, area.pieces, area.chained);
      launch_k0(ahead, stream);
      pieces_error_flag = ahead.error_flag;
      if (p.cu_seqlens != nullptr) pieces_ckpt_start = ahead.ckpt_start;
    }
    // A pieces kernel that cannot start here (its register split, the driver's tensor-map encoder:
    // errors before it ran) leaves the call to the kernels below, as the fused kernel's rule does
    // (and they launch K0 again: without the pieces the fused kernel may take the call).
    if (sm90::prefill_v2::fused_pieces_prefill(p, area.pieces, warmup, flag, finals, pieces_error_flag,
                                               pieces_ckpt_start, stream, chain_states, k0_first,
                                               launch.piece_stamps, launch.pieces_start,
                                               launch.start_stamps) == cudaSuccess) {
      pieces_flag = flag;
      if (!area.chained) {  // zeroed with the flag
        prep_next = reinterpret_cast<uint32_t*>(flag + 1);
      }
      ahead.k0_ran = k0_first;  // the kernels after the pieces take these parameters
      // Where a piece stopped the call, the kernels the rule (or fused_v2 = 1) picks run it: the fused
      // kernel (where it cannot start, the chunk-16 kernels below), else the chunk-16 kernels.
      fused_if_stopped = launch.fused_v2 > 0 || fused_by_rule(p, launch);
      // The pieces' final states (a pool's slots): copied by K1, the first of the chunk-16 kernels,
      // where those follow the pieces in every replay (run 163: the finishing kernel and its gap
      // ~4.5 us of the pool's ~10 at T=32768 H=12); else (the fused kernel after them, or the
      // chunk-16 kernels in a conditional node) by a kernel of its own.
      if (!fused_if_stopped && launch.pieces_graph_if <= 0)
        pieces_final = sm90::prefill_v2::pieces_final_copy(p, finals);
      else
        FLASHKDA_CUDA_CHECK(sm90::prefill_v2::fused_pieces_finish(p, flag, finals, stream));
    } else {
      (void)cudaGetLastError();
    }
  }
  // The call's kernels on stream s: after pieces, those that run it where a piece stopped it (each
  // returns at once while the pieces' flag is zero).
  const auto run = [&](cudaStream_t s) {
    if (fused_if_stopped) {
      if (sm90::prefill_v2::fused_after_pieces(p, pieces_flag, pieces_error_flag, pieces_ckpt_start, s) == cudaSuccess)
        return;
      (void)cudaGetLastError();  // an attribute query's error, which the next launch check would read
    }
    const bool fused_serves = pieces_flag == nullptr && launch.fused_v2 >= 0 && sm90::prefill_v2::fused_serves(p);
    if (fused_serves && (launch.fused_v2 > 0 || fused_by_rule(p, launch))) {
      const int* error_flag = nullptr;
      const int32_t *ckpt_start = nullptr, *order = nullptr;
      if (p.cu_seqlens != nullptr || p.state_pool != nullptr) {  // K0 first: what the host cannot check
        // No segments: K0 checks, scans and, with checkpoints, numbers each sequence's first (ckpt_start)
        // and checks their count against the lengths; with cu_seqlens it orders the sequences, longest first.
        const Params kp = launch_k0_ahead(p, workspace, p.cu_seqlens != nullptr && launch.fused_order >= 0, s);
        error_flag = kp.error_flag;
        if (p.cu_seqlens != nullptr) ckpt_start = kp.ckpt_start, order = kp.fused_order;
      }
      const cudaError_t err =
          sm90::prefill_v2::fused_prefill(p, error_flag, ckpt_start, s, false, false, order);
      if (err == cudaSuccess) return;
      // Under the rule, a fused kernel that cannot start here (its register split or the driver's
      // tensor-map encoder missing: errors before anything ran) leaves the call to the chunk-16 kernels.
      if (launch.fused_v2 > 0) FLASHKDA_CUDA_CHECK(err);
    }
    const int64_t N = detail::num_sequences(p);
    Params kp = ahead.k0_ran ? ahead : chunk16_params(p, launch, workspace, pieces_flag);
    kp.prep_next = prep_next;
    kp.pieces_final = pieces_final;
    // With device cu_seqlens K0 picks the kernels: the chunk-16 ones below, or (kCallFused) the fused
    // kernel launched after them, while they do nothing.
    const bool fused_after = fused_serves && launch.fused_v2 == 0 && fused_by_lengths(p, kp);
    if (fused_after) {
      kp.fused_sms = sm_count();
      if (launch.fused_order >= 0) kp.fused_order = order_slot(kp);  // K0 orders the sequences, longest first
    }

    const int warps = choose_warps(N * p.H, launch);
    const int seg_ctas = seg_ctas_per_sm(launch, p.H);
    with_split(kp, p.precision, launch.f16_operands,
               [&](auto split) { launch_mode<decltype(split)>(warps, seg_ctas, launch.record_copy >= 0, kp, s); });
    if (fused_after) FLASHKDA_CUDA_CHECK(fused_on_verdict(p, kp, s, false));
  };
  if (pieces_flag != nullptr && launch.pieces_graph_if > 0 && launch_if_stopped(stream, pieces_flag, run)) return;
  run(stream);
}

size_t segment_transition_workspace_size(const PrefillParams& p) {
  const int64_t N = detail::num_sequences(p);
  const Layout l = workspace_layout(N, p.H, p.B * p.T, whole_sequence_chunks(p));
  return l.header + l.records + l.seg_out;
}

void segment_transition(const PrefillParams& p, float* transition, float* zero_start, void* workspace, size_t,
                        Stream stream_handle) {
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const int64_t N = detail::num_sequences(p);
  auto* ws = static_cast<uint8_t*>(workspace);
  Params kp = kernel_params(p, ws);
  kp.out = nullptr, kp.initial_state = nullptr, kp.final_state = nullptr;
  kp.initial_state_type = kp.final_state_type = ElemType::kNone;
  kp.state_indices = nullptr, kp.has_initial_state = nullptr;  // no states: the transition only
  kp.checkpoint_every = 0, kp.checkpoints = nullptr, kp.checkpoint_slots = nullptr, kp.num_checkpoints = 0;
  kp.seg_chunks = whole_sequence_chunks(p);
  kp.max_segs = N;
  kp.transitions_only = true;
  const Layout l = workspace_layout(N, p.H, kp.total_tokens, kp.seg_chunks);
  Carver regions{ws + l.header};  // records, then seg_out: no segment matrices (seg_a, seg_b are the caller's)
  kp.records = regions.take(l.records);
  kp.seg_out = regions.take<float>(l.seg_out);
  kp.seg_a = transition, kp.seg_b = zero_start;
  with_split(kp, p.precision, 0, [&](auto split) {
    launch_prepare<decltype(split)>(kp, stream);
    launch_recur_segmented<decltype(split), 2>(kp, stream, true);
  });
}

size_t chunk_log_bounds_workspace_size(const PrefillParams& p) {
  const Layout l = workspace_layout(detail::num_sequences(p), p.H, p.B * p.T, 0);
  return l.header + l.records;
}

// K0 and K1 alone, K1 writing its chunk bounds into `bounds` (the chunk slots are the chunks of the
// sequences in order, as forward numbers them).
void chunk_log_bounds(const PrefillParams& p, const internal::PrefillLaunch& launch, float* bounds, void* workspace,
                      Stream stream_handle) {
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  auto* ws = static_cast<uint8_t*>(workspace);
  Params kp = kernel_params(p, ws);
  kp.out = nullptr, kp.initial_state = nullptr, kp.final_state = nullptr;
  const Layout l = workspace_layout(kp.num_seqs, p.H, kp.total_tokens, 0);
  kp.records = ws + l.header;
  kp.chunk_bound = bounds;
  kp.bound_transitions = launch.skip_bound >= 0;
  with_split(kp, p.precision, launch.f16_operands, [&](auto split) { launch_prepare<decltype(split)>(kp, stream); });
}

}  // namespace flashkda::cuda
