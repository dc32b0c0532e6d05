// Internal launch configurations: how the CUDA backend splits a problem, for tests and benchmarks
// that compare variants of the same computation. Not part of the public API (nothing in
// include/flashkda/ refers to it) and never read from the environment: a variant is chosen only by
// passing one of these to the internal entry points below. Defaults = the launcher's own rules,
// i.e. exactly what flashkda::forward / flashkda::decode do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "flashkda/flashkda.h"

namespace flashkda::internal {

struct PrefillLaunch {
  int v_splits = 0;            // value-column splits of the one-CTA-per-sequence recurrence: 0 = rule, 1 or 2
  int64_t segment_chunks = 0;  // 0 = rule; -1 = never cut sequences into segments; > 0 = segments of this
                               // many 16-token chunks (docs/DESIGN.md "Segments")
  int f16_operands = 0;        // GPU: 0 = rule (the precise mode runs S, k_decayed and q_decayed in fp16 where q
                               // and k are L2-normalised, docs/DESIGN.md "Precision as an option"); 1 = that
                               // fp16 policy for every mode; -1 = never (the bf16 split of S)
  int checkpoints_in_segments = 0;  // GPU, with checkpoints and segments: 0 (rule) and 1 = segments of any
                                    // length, the checkpoints inside a segment from its partial transitions
                                    // (the chain kernel); -1 = segment lengths that divide checkpoint_every
                                    // (the former rule; docs/DESIGN.md "Segments")
  int skip_transitions = 0;  // GPU, with segments: 0 (rule) and 1 = segments cut into pieces, and a
                             // piece whose preceding chunks provably attenuate any incoming state below 2^-30
                             // starts from zero that many chunks early instead of continuing the exact run
                             // (docs/DESIGN.md "Segments", runs);
                             // -1 = never
  int64_t skip_run_chunks = 0;     // with transition skipping: chunks per piece; 0 = rule
  int64_t skip_warmup_chunks = 0;  // with transition skipping: the longest warm-up, chunks; 0 = rule (a piece)
  int seg_ctas_per_sm = 0;  // GPU, with segments: the segmented K2 at 2 CTAs an SM (up to 242 registers, three
                            // stages) or 3 (168 registers, two stages), the segment and piece rules planning for
                            // that many warpgroups an SM; 0 = rule (3 from H = 16 up, else 2)
  int record_copy = 0;  // GPU, the one-warpgroup recurrence CTAs (the segmented K2 and two CTAs a head):
                        // 0 (rule) and 1 = one thread copies each chunk record with one bulk copy into an
                        // mbarrier stage; -1 = every thread copies it by cp.async (the former rule;
                        // docs/DESIGN.md "Segments")
  int early_launch = 0;  // GPU, a candidate: bits of the kernels that launch early, while their
                         // predecessor runs (programmatic dependent launch; each waits for it before it
                         // touches memory): 1 K1 (after K0), 2 K2, 4 the chain, 8 the combine (these
                         // turn the rule's few-head pieces off); 0 = rule (none: stream order;
                         // docs/DESIGN.md "Early launch")
  int cpu_isa = 0;  // CPU: the instruction set of the engine, capped at what the processor has: 0 = rule
                   // (the widest), 1 = the baseline ISA, 2 = AVX2 + FMA, 3 = AVX-512 (F, VL, BW, DQ)
  int skip_bound = 0;  // with transition skipping, the bound on each chunk's transition that K1 writes:
                       // 1 = the smaller of the token bound, the product of each token's max_c e^a_c, and
                       // the chunk's own (max_c e^Gamma_c + 2 sum_ij |inv_b_ij| |k_restored_i| |k_decayed_j|);
                       // -1 = the token bound only; 0 = rule (1 for pieces of up to 64 chunks, else -1;
                       // docs/DESIGN.md "Segments")
  int fused_v2 = 0;  // GPU: prefill v2's fused chunk-32 kernel (one CTA of three warpgroups a head, no record in
                     // global memory; staged inputs, the consumers inverting, setmaxnreg 184 / 160) for the
                     // calls it serves (prefill_v2::fused_serves: up to 65 535 sequences, by B or device
                     // cu_seqlens, K = V = 128, bf16 q/k/v/g, the lower-bound gate with L2-normalised q and k,
                     // the precise mode, fp32 states or none or a pool (fp32 or bf16), with or without checkpoints),
                     // today's kernels for the rest: 1 = wherever it serves, -1 = never, 0 = rule (where
                     // its CTAs, one a sequence and head, keep 2/3 of the SMs busy over the longest sequence
                     // of at least 64 tokens: cuda/sm90/prefill/config.h fused_rule; decided on the host
                     // without cu_seqlens, by K0 on the GPU with them; docs/DESIGN.md "Prefill v2")
  int64_t fused_min_tokens = 0;  // GPU, a candidate: the fused kernel's rule with this floor on the longest
                                 // sequence instead of 64 tokens (and, where K0 chooses, a mean of this many
                                 // tokens); 0 = rule
  int64_t fused_pieces = 0;  // GPU (calls the fused kernel serves): each sequence cut into this many pieces, CTAs
                             // of the fused kernel at once, a piece after the first starting fused_warmup 32-token
                             // chunks early from zero where the warm-up provably erases the incoming state (below
                             // 2^-30; else the kernels the rule picks run the call: prefill_v2 FusedArgs::pieces);
                             // 0 = rule (chained pieces where the fused kernel's rule takes one sequence and leaves
                             // SMs idle, config.h fused_chain_pieces; unchained ones at few heads, config.h
                             // fused_few_head_pieces); -1 = none
  int fused_warmup = 0;      // with fused_pieces: the warm-up in 32-token chunks; 0 = 1
  int fused_order = 0;       // GPU, device cu_seqlens through the fused kernel: 0 = rule (K0 orders the
                             // sequences longest first, the CTAs take them in that order); -1 = the batch's order
  int fused_chain = 0;       // GPU, chained pieces (prefill_v2 FusedArgs::pieces_chain: a piece whose warm-up
                             // does not bound its transition waits for the piece before it and goes on from
                             // its end state): 0 = rule (config.h fused_chain_pieces, where fused_pieces is 0;
                             // forced fused_pieces stop the call instead); 1 = chain forced fused_pieces;
                             // -1 = the rule's pieces off
  int pieces_graph_if = 0;  // GPU, a candidate, calls with pieces captured in a CUDA graph: 1 = the kernels after
                            // the pieces, which run the call only where a piece stopped it, in the body of a
                            // conditional node that the pieces' flag opens (a replay whose pieces ran the call
                            // launches none of them; such a graph cannot be cloned, embedded as a child graph
                            // or have the node updated); 0 = rule (launched as in an eager call)
  int lowrank_transitions = 0;  // GPU, a candidate, with segments and transition skipping: 1 = a segment's exact
                                // run carries its transition as T G (docs/DESIGN.md "Long memory: the transition
                                // is low rank"): the channels whose decay over its first chunk stays above 2^-30
                                // and that chunk's 16 columns, one row block of 64 instead of two, where they fit
                                // (48 channels or fewer), the few-head pieces off; 2 = the same where the
                                // chunk-16 kernels run, the pieces' rule kept (after a stop); 0 = rule (the K
                                // transition rows)
  long long* piece_stamps = nullptr;  // GPU, timing only, calls the few-head pieces run: each pieces CTA's
                                      // kPieceStamps points (prefill_v2 FusedArgs::piece_stamps), device
                                      // memory of at least N pieces H kPieceStamps values; null: none
  int pieces_start = 0;  // GPU, timing only, the unchained few-head pieces: 0 = their rule's kernel; 1 = a
                         // kernel of its own with start stamps (start_stamps; prefill_v2
                         // FusedArgs::start_variant); 2 = the same, chunk 0's producer steps run
                         // twice, the second pass stamped; 3 and 4 = the same, the consumers waiting
                         // for each stage with a long suspend hint or by spaced polls (diagnostics)
  long long* start_stamps = nullptr;  // with pieces_start: each pieces CTA's kStartStamps points
                                      // (prefill_v2 FusedArgs::start_stamps); null: none
};

struct DecodeLaunch {
  int persistent = -1;  // -1 = rule (bf16 pools: the bulk-copy kernel with three buffers at N·H = 384-1536,
                        // the persistent kernel from 2048, else the one-CTA-per-item kernels; fp32 pools:
                        // the latter); 0 = the one-CTA-per-item kernels; 1 = the persistent kernel; 2, 3 = its
                        // bulk-copy variant with four or three buffers (state blocks in and out by TMA bulk
                        // copies)
  int check_slots = 0;  // GPU: 0 = rule (the slot check in every call of two or more sequences that
                        // DecodeParams::check_slots does not turn off: every CTA finds whether another
                        // sequence reads or writes a live slot that its sequence also uses, and on one writes
                        // NaN outputs and stores nothing, both sequences of the shared slot); 1 = the check
                        // always; -1 = never (docs/DESIGN.md "Serving prefill")
  int cpu_isa = 0;  // CPU: as PrefillLaunch::cpu_isa
};

size_t workspace_size(const PrefillParams& params, const PrefillLaunch& launch);
void forward(const PrefillParams& params, const PrefillLaunch& launch, void* workspace, size_t workspace_bytes,
             Stream stream = nullptr);
// forward with the workspace from alloc(bytes), called once, after the arguments are validated and only
// where the call needs workspace: it must return at least `bytes` of device memory that stays valid for
// the call's kernels (the caller's stream order). One validation where workspace_size and then forward
// make two (the Python extension's call).
void forward_allocating(const PrefillParams& params, const PrefillLaunch& launch,
                        const std::function<void*(size_t)>& alloc, Stream stream = nullptr);
void decode(const DecodeParams& params, const DecodeLaunch& launch, Stream stream = nullptr);

// The segment length the launcher picks for this problem on the current device (0: no split).
int64_t chosen_segment_chunks(const PrefillParams& params, const PrefillLaunch& launch = {});
// The piece length of transition skipping the launcher picks (0: no skipping).
int64_t chosen_run_chunks(const PrefillParams& params, const PrefillLaunch& launch = {});
// The instruction set the CPU engine runs for PrefillLaunch::cpu_isa = requested on this processor
// (1 baseline, 2 AVX2 + FMA, 3 AVX-512): requested capped at the widest it has (0: the widest).
int cpu_engine_isa(int requested = 0);

// The segment transition (docs/DESIGN.md "Segments"): over a sequence the state map is affine,
// S_out = A S_in + B. For every sequence n and head h of params (taken as one segment each) this
// writes transition[n][h] = A^T ([K][K] fp32, row r = A e_r, the image of the r-th basis state)
// and zero_start[n][h] = B^T ([V][K] fp32, v-first like every state: the final state from zero),
// so that a start state X (v-first, X^T) ends as X^T A^T + B^T. params.initial_state,
// final_state and out are not used. Memory where q lives; on the GPU the workspace is
// segment_transition_workspace_size(params) bytes (0 on the CPU). This is the step segmented
// prefill chains, and the one context parallelism across devices exchanges.
size_t segment_transition_workspace_size(const PrefillParams& params);
void segment_transition(const PrefillParams& params, float* transition, float* zero_start, void* workspace,
                        size_t workspace_bytes, Stream stream = nullptr);

// Transition skipping's bound on each chunk (docs/DESIGN.md "Segments"): bounds[c][h] (fp32, device
// memory, [sum_n ceil(len_n / 16)][H], the chunks numbered sequence after sequence) >= log ||A||_2 of
// chunk c's state transition S_out = A S_in + B at head h, as K1 writes it for the segmented K2
// (launch.skip_bound picks the bound; here 0 means 1). The GPU only (the CPU backend does not skip); the workspace
// is chunk_log_bounds_workspace_size(params) bytes. For tests of the bound against the transition.
size_t chunk_log_bounds_workspace_size(const PrefillParams& params);
void chunk_log_bounds(const PrefillParams& params, const PrefillLaunch& launch, float* bounds, void* workspace,
                      size_t workspace_bytes, Stream stream = nullptr);

// The serving prefill's slot rule on host indices (what forward checks on the CPU backend): every
// slot < pool_size, no live slot named twice across state_indices and checkpoint_slots; throws
// flashkda::Error naming the position(s). For callers that hand forward a gathered copy of the
// named slots (the Python API with a pool in another layout), whose indices no longer show it.
void check_pool_slots(const int32_t* state_indices, int64_t num_seqs, const int32_t* checkpoint_slots,
                      int64_t num_checkpoints, int64_t pool_size);

// The decode slot rule on host memory (what decode checks on the CPU backend): params' state_indices
// [num_seqs, indices_stride], num_accepted_tokens, cu_seqlens with T, and pool_size are read (the
// rest is not); every slot < pool_size, num_accepted_tokens in [1, indices_stride], no live slot used
// by two sequences. Throws flashkda::Error naming the position(s). For the same callers as above.
void check_decode_slots(const DecodeParams& params);

}  // namespace flashkda::internal
