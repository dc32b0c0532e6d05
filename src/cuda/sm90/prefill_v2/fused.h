// Prefill v2 (issue 11), third step: the chunk-32 producer and recurrence in one kernel, the
// record never leaving shared memory. One CTA of three warpgroups per head of one sequence: a
// producer (produce.cuh) fills a ring of two record stages, two consumers (consume.cuh, 64 value
// rows of the state each) run the recurrence over them, handing stages back and forth on
// mbarriers. The same scope as consume.h (one sequence, the precise policy with its range guard, no
// wide chunks). Not part of the public API; the GPU test
// test_prefill32_gpu checks it against the fp64 token recurrence and times it.
#pragma once

#include <cuda_runtime.h>

#include "cuda/sm90/prefill_v2/consume.h"
#include "flashkda/params.h"
#include "cuda/sm90/prefill_v2/produce.h"

namespace flashkda::cuda::sm90::prefill_v2 {

struct FusedArgs {
  ProduceArgs produce;  // out (records) unused
  ConsumeArgs consume;  // records unused
  // The producer's q, k, g rows of chunk c + 1 copied by TMA into one shared buffer once chunk c's
  // factors are built (beta a chunk ahead in registers), and q, k read from there where they are
  // used; false: loaded from global memory into registers when the chunk starts.
  bool stage_inputs = false;
  // Timing only: the producer builds chunks 0 and 1 and then hands the same two stages back
  // without rebuilding them, so the call takes the consumers' time alone; outputs are meaningless.
  bool time_consumers_only = false;
  // Timing only: where the kernel's cycles go. Non-null: [H][kPhaseClocks] sums of clock64()
  // differences over the chunks, written at the end (lower-bound bf16 gates only; other calls with
  // it are refused). Producer (its thread 0, in the inverse's warp): 0 the wait for an empty stage,
  // 1 load (staged inputs: the wait for them), 9 gate, 2 normalise, 3 scan, 4 factors, 5 L/Mqk
  // product, 6 their stores, 7 inverse, 8 the rest of the loop; consumers (warpgroup 1's thread 0):
  // 10 the wait for a full stage, 13 the inverse (consumer_inverse), 11 the chunk's recurrence,
  // 12 the output stores and release; 15 the chunks.
  long long* phase_clocks = nullptr;
  // A candidate (lower-bound bf16 gates only): setmaxnreg gives the producer 184 registers and the
  // consumers 160 (false: all at the launch's 168).
  bool producer_regs = false;
  // A candidate (lower-bound bf16 gates): the producer leaves inv_b to the
  // consumers (it writes L and beta into the stage and arrives); both consumer warpgroups build
  // one inv_b from the chunk's (I + L) before the recurrence (produce.cuh invert_warpgroup, 256
  // threads), which both then read.
  bool consumer_inverse = false;
  // Several sequences (last in the struct, so that initialisations in field order keep their
  // meaning): a grid of H x num_seqs CTAs, CTA (h, n) walking sequence n's chunks, with the device
  // cu_seqlens [num_seqs + 1] (int32, or int64 with cu_seqlens_64), or null for num_seqs sequences
  // of produce.T / num_seqs tokens each; produce.T and consume.T are the total tokens, the states
  // [num_seqs, H, V, K]. Invalid cu_seqlens (cu[0] != 0, cu[num_seqs] != T, a decrease) fill out
  // and final_state with NaN. Only with the rule's flags above (stage_inputs, producer_regs,
  // consumer_inverse) and lower-bound bf16 gates; other calls with it are refused.
  int64_t num_seqs = 1;
  const void* cu_seqlens = nullptr;
  bool cu_seqlens_64 = false;
  // K0's verdict (launch.cu runs it first for calls with cu_seqlens or a pool): non-zero when the
  // cu_seqlens are invalid or a live slot is named twice; out (and final_state) are then NaN and
  // the pool is left as it was. Null: nothing to check (one sequence, or a batch of equal lengths).
  const int* error_flag = nullptr;
  // A state pool (SPEC §9; checkpoints below): sequence n starts from slot state_indices[n]
  // (zeros where has_initial_state[n] is false) and its final state goes back there, fp32 or bf16
  // (pool_bf16); a slot outside [0, pool_size) is padding: zero output rows, nothing read or written.
  // consume.initial_state and final_state are then null.
  void* state_pool = nullptr;
  bool pool_bf16 = false;
  int64_t pool_size = 0;
  const int32_t* state_indices = nullptr;
  const bool* has_initial_state = nullptr;
  // Launched after the chunk-16 kernels of the same call, which K0 let choose (prefill
  // Params::fused_sms): the kernel runs the call only where error_flag says kCallFused, and does
  // nothing otherwise (the chunk-16 kernels ran it, or refused it and wrote the NaN).
  bool on_verdict = false;
  // Checks what a launch would (the arguments, the tensor maps, the register split) and returns its
  // error without launching: launch.cu asks before K0 may give the call to the kernel.
  bool check_only = false;
  // Checkpoints (SPEC §9): the state after every checkpoint_every tokens of each sequence (a
  // multiple of 64; 0 = none; a sequence's last partial piece has none), numbered sequence by
  // sequence: sequence n's first is ckpt_start[n] (K0's, in the workspace header, with cu_seqlens),
  // else n (T / num_seqs / checkpoint_every). Each goes into the dense checkpoints ([C, H, V, K],
  // bf16 with checkpoints_bf16, else fp32) or, with a pool, into slot checkpoint_slots[c] in the
  // pool's dtype (outside [0, pool_size): not written); c >= num_checkpoints: not written. A
  // padding sequence's dense checkpoints are zero, a refused call's NaN, as the chunk-16 kernels
  // write them.
  int64_t checkpoint_every = 0;
  void* checkpoints = nullptr;
  bool checkpoints_bf16 = false;
  const int32_t* checkpoint_slots = nullptr;
  int64_t num_checkpoints = 0;
  const int32_t* ckpt_start = nullptr;
  // Pieces (internal::PrefillLaunch::fused_pieces, or the rule's chained pieces): each sequence (of B equal
  // ones or by device cu_seqlens, with or without a pool) cut into `pieces` runs of equal chunks,
  // CTA (h, n pieces + p) taking piece p, so that N H pieces CTAs fill the GPU at few heads. A
  // piece after the first starts `warmup` chunks early from a zero state and writes no output for
  // those chunks; while it runs them its consumers bound each chunk's transition
  // (chunk_log2_bound), and where the product of the bounds is not below 2^-30 (the incoming state
  // is not provably erased), or a piece's state ends non-finite, the piece sets *pieces_flag to 1
  // (zeroed by the caller before the launch; unchained, the consumers' pre-check of the gates
  // (precheck_warmups) sets it to 2 as the pieces start) and every CTA of the call stops at its next chunk: the
  // kernels the launcher's rule picks, launched after, then run the whole call (they do nothing
  // while the flag is zero: run_if_flag, prefill Params::pieces_flag). Outputs go to consume.out; the last piece's final state to
  // pieces_final ([num_seqs, H, V, K] in the state's dtype: the workspace, which fused_pieces_finish
  // copies to the final state or the pool's slot only where the flag stayed zero, or the call's final
  // state itself where pieces_final_in_place). With a pool, K0's
  // refusal (error_flag) sets the flag: the kernels after the pieces refuse the call.
  int64_t pieces = 0;
  int warmup = 1;
  int* pieces_flag = nullptr;
  float* pieces_final = nullptr;
  // With pieces, chained (internal::PrefillLaunch::fused_chain, a candidate): a piece whose warm-up
  // does not bound its transition does not stop the call; its consumers wait for the piece before it
  // to publish its end state and go on from that (exact: the serial walk, a piece at a time). Every
  // piece but a sequence's last publishes its end state (fp32) into pieces_states [N pieces][H][V][K]
  // and then sets pieces_ready [N pieces][H] (both workspace, the flags zeroed by the caller with
  // pieces_flag). The CTAs take their pieces in turn from the counter pieces_next (zeroed likewise),
  // sequence by sequence and piece by piece, so the piece a CTA waits for belongs to a CTA that took
  // its ticket earlier and is running or done (no deadlock, whatever order the grid's CTAs start
  // in). A non-finite end state, or K0's refusal, still stops the call (pieces_flag), and a waiting
  // piece then stops too.
  bool pieces_chain = false;
  int* pieces_next = nullptr;
  int* pieces_ready = nullptr;
  float* pieces_states = nullptr;
  // The pieces' fallback where the rule gives the call to this kernel: launched after the pieces, it
  // runs the call only where *run_if_flag is non-zero (a piece stopped it). Null: always.
  const int* run_if_flag = nullptr;
  // With cu_seqlens: K0's order of the sequences, longest first ([num_seqs], prefill
  // Params::fused_order): grid row y takes sequence order[y],
  // so that the longest sequences' CTAs start first instead of wherever they stand in the batch.
  // Null: in the batch's order.
  const int32_t* order = nullptr;
  // Timing only, with phase_clocks and staged inputs and inverting consumers (the rule's flags; other
  // variants leave it untouched): a timeline of the first kTraceHeads heads' first kTraceChunks
  // chunks, [kTraceHeads][kTraceChunks][kTracePoints] clock64() values of the head's SM (null: none).
  // Points: 0 the producer at its chunk's top (before the empty-stage wait), 1 after that wait (its
  // thread 0), 2-5 each producer warp's arrival on the full barrier (lane 0); 6 consumer warpgroup 0
  // before its full-stage wait, 7 and 8 each warpgroup after it (thread 0), 9-16 each consumer warp's
  // release of the stage (lane 0). Where a point is not reached (a warm-up chunk's release) its entry
  // is left as it was.
  long long* chunk_trace = nullptr;
  // Timing only, with pieces: each CTA's (row y of the grid, head x: y H + x) kPieceStamps values,
  // %globaltimer nanoseconds where the CTA reaches each point, then three values (null: none). Points:
  // 0 the kernel's top (thread 0); the consumers' thread 0 1 when their state and inverse tiles are
  // set (after the gates' pre-check), 2 after their first full-stage wait, 3 as the piece's own chunks
  // begin (after the warm-up), 4 after its last chunk, 5 after the final state's stores; 6 the
  // producer's thread 0 after its last chunk; then 7 the chunks the CTA walks and 8 its warm-up
  // chunks, 9 its SM (%smid). A point not reached (a stopped piece) keeps its value.
  long long* piece_stamps = nullptr;
  // Timing only, with unchained pieces: 1 = the pieces' kernel with start stamps (start_stamps, null:
  // none), a kernel of its own, so that the rule's SASS stays as it is; 0 = the rule's.
  int start_variant = 0;  // 2: the same kernel, chunk 0's producer steps run twice (the second stamped);
                          // 3, 4: the consumers wait for each full stage with a ~1 ms suspend hint
                          // (mbarrier_wait_hinted), or by polls 256 ns apart (mbarrier_wait_backoff)
  // With start_variant 1 to 4 (in 2 the step after chunk 0's rows landed, "load", holds the whole first
  // pass): each CTA's kStartStamps values (row y H + x, as piece_stamps), %globaltimer
  // nanoseconds where its first chunk's way reaches each point: the producer's thread 0 at 0 its
  // start (produce_item), 1 after the gate constants and the producer's barrier, 3 after the gates'
  // pre-check's verdict, 4 with chunk 0's staged rows landed, 5 with chunk 0's factors done (before its
  // arrival on the full stage); 2 thread 32 after it issued the staged rows' copies; the consumers'
  // thread 0 at 6 after the pre-check (the verdict handed over), 7 after chunk 0's full-stage wait;
  // then 8: 1 where chunk 0's staged rows had landed as the verdict's wait ended, else 0 (the time at 4
  // is the later of the two); 9 + 8 c + j: chunk c = 0, 1's steps in produce_chunk and their hand-over
  // (fused.cu ChunkStepStamps).
  long long* start_stamps = nullptr;
};
constexpr int kPieceStamps = 10;
constexpr int kStartStamps = 25;
constexpr int kPhaseClocks = 16;
constexpr int kTraceHeads = 4, kTraceChunks = 512, kTracePoints = 17;

// Launches the fused kernel on `stream`; returns the launch's error.
cudaError_t fused_chunks(const FusedArgs& args, cudaStream_t stream);

// The fused kernel as a prefill (internal::PrefillLaunch::fused_v2): whether it serves a validated
// call (up to 65 535 sequences, by B or by device cu_seqlens, fewer than 2^31 tokens (the TMA
// coordinates); K = V = 128, bf16 q, k, v and g, the lower-bound gate with L2-normalised q and k,
// the precise mode; fp32 initial and final states or none, or a state pool (fp32 or bf16); with or
// without checkpoints), and the call through it with the rule's flags (staged inputs, inverting
// consumers, setmaxnreg).
bool fused_serves(const PrefillParams& p);
// error_flag: K0's (FusedArgs::error_flag), required with cu_seqlens or a pool; ckpt_start: K0's,
// required with cu_seqlens and checkpoints; on_verdict, check_only and order as FusedArgs says.
cudaError_t fused_prefill(const PrefillParams& p, const int* error_flag, const int32_t* ckpt_start, cudaStream_t stream,
                          bool on_verdict = false, bool check_only = false, const int32_t* order = nullptr);
// The kernels' arguments for a call (records unset, the candidate flags off).
FusedArgs fused_args(const PrefillParams& p);

// FusedArgs::pieces (internal::PrefillLaunch::fused_pieces, a candidate): whether it serves a call
// fused_serves does (checkpoints too: a piece writes those after its warm-up; ckpt_start: K0's, with
// cu_seqlens); the call in `pieces` pieces a sequence, each after the first
// starting `warmup` chunks early (flag zeroed here unless flags_zeroed, final_states: [N, H, V, K] in the state's
// dtype, fp32 room; error_flag: K0's, required with cu_seqlens or a pool, whose refusal the pieces
// leave to the kernels after them); then fused_pieces_finish, which copies final_states to
// p.final_state or the pool's slots where no piece set the flag.
bool fused_pieces_serve(const PrefillParams& p);
// Whether the last pieces write the call's final state themselves, final_states unused and
// fused_pieces_finish a no-op: no pool, a final state, and no initial state whose bytes it overlaps.
// Where the pieces stop, the kernels after them write the whole final state again, and they, like the
// first pieces, read only the initial state: so only a pool's slot (read and written in place) or a
// final state over the initial one needs the copy after the pieces (run 123: ~2 us and a launch gap).
bool pieces_final_in_place(const PrefillParams& p);
// Chained (FusedArgs::pieces_chain) where chain_states ([N pieces][H][V][K] fp32) is non-null: flag
// then heads a block of 2 + N pieces H ints that the call zeroes (unless flags_zeroed), the stop flag,
// the counter (pieces_next) and the ready flags (pieces_ready).
// flags_zeroed: K0, launched ahead, zeroed the flags' block (prefill Params::pieces_zero), so no memset.
cudaError_t fused_pieces_prefill(const PrefillParams& p, int64_t pieces, int warmup, int* flag, float* final_states,
                                 const int* error_flag, const int32_t* ckpt_start, cudaStream_t stream,
                                 float* chain_states = nullptr, bool flags_zeroed = false, long long* stamps = nullptr,
                                 int start_variant = 0, long long* start_stamps = nullptr);
// The ints of that block: 2 + N pieces H.
int64_t fused_chain_flags(const PrefillParams& p, int64_t pieces);
// The ints fused_pieces_prefill zeroes at `flag`: chained, fused_chain_flags; else the flag and the
// chunk-16 K1's counter after it (prefill Params::prep_next).
int64_t fused_pieces_flag_ints(const PrefillParams& p, int64_t pieces, bool chained);
cudaError_t fused_pieces_finish(const PrefillParams& p, const int* flag, const float* final_states, cudaStream_t stream);
// What fused_pieces_finish copies (from null: nothing, pieces_final_in_place or no final state), for K1
// after the pieces to copy in its place (prefill Params::pieces_final: the kernel's launch saved).
prefill::PiecesFinal pieces_final_copy(const PrefillParams& p, const float* final_states);
// The call through the fused kernel with the rule's flags, run only where *flag is non-zero (the
// pieces' fallback where the rule gives the call to the fused kernel).
cudaError_t fused_after_pieces(const PrefillParams& p, const int* flag, const int* error_flag, const int32_t* ckpt_start,
                               cudaStream_t stream);

}  // namespace flashkda::cuda::sm90::prefill_v2
