// K0 (varlen chunk scan) and K1 (token-parallel prepare) of the sm90 prefill.
//
// K0: grid = 1, block = 1024; runs with cu_seqlens or a state pool (what lives on the GPU and the
//     host cannot check). Validates cu_seqlens (starts at 0, non-decreasing, ends at the token
//     count) and writes chunk_start[n] = sum_{m<n} ceil(len_m / 16) and, with segments,
//     seg_start[n] = sum_{m<n} segments_of(chunks_m), with checkpoints ckpt_start[n] = sum_{m<n}
//     floor(len_m / checkpoint_every). On invalid input it raises error_flag and writes zero
//     chunks, so K1/K2 do no work and K2 fills the outputs with NaN. With Params::fused_sms it gives
//     a valid call where fused_rule holds to the fused kernel (error_flag kCallFused, zero chunks:
//     the chunk-16 kernels do nothing). A checkpoint total other than
//     num_checkpoints raises it too (K2 then fills the outputs with NaN). With a pool it raises it
//     when a live slot (in [0, P)) is named twice across state_indices and checkpoint_slots (the
//     CPU backend's rule, detail::check_pool_slots): K2 then fills the outputs and dense
//     checkpoints with NaN and no kernel writes the pool. With Params::fused_order (where the fused
//     kernel may run the call) it also writes the sequences' order, longest first, in which the
//     fused kernel's CTAs take them (order_longest_first).
// K1: grid = chunk_slots * H (fewer where K0 may give the call to the fused kernel), block = 128.
//     One CTA builds, for one 16-token chunk of one head: q_decayed, k_decayed, k_restored,
//     Mqk, inv_b = (I + L)^-1 diag(b) and exp(G_C), in the record layout of config.h.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>  // cuda::maximum

#include "cuda/common/early_launch.cuh"
#include "cuda/sm90/prefill/chunk_map.cuh"
#include "cuda/sm90/prefill/config.h"
#include "cuda/sm90/prefill/prepare_chunk.cuh"

namespace flashkda::cuda::sm90::prefill {

// ---- K0 ----------------------------------------------------------------------------------------
constexpr int kScanThreads = 1024;

// Raises error_flag when a live slot is named twice: one bit per pool slot (Params::slot_bits),
// set by atomicOr; a thread that finds its bit already set saw the second use. Every thread of the
// CTA must call it.
__device__ inline void check_distinct_slots(const Params& p) {
  const int64_t words = (p.pool_size + 31) / 32;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) p.slot_bits[i] = 0u;
  __syncthreads();
  int twice = 0;
  auto mark = [&](int64_t slot) {
    if (slot < 0 || slot >= p.pool_size) return;  // padding (or a checkpoint not written)
    const uint32_t bit = 1u << (slot & 31);
    if (atomicOr(&p.slot_bits[slot >> 5], bit) & bit) twice = 1;
  };
  for (int64_t n = threadIdx.x; n < p.num_seqs; n += blockDim.x) mark(p.state_indices[n]);
  if (p.checkpoint_slots != nullptr)
    for (int64_t c = threadIdx.x; c < p.num_checkpoints; c += blockDim.x) mark(p.checkpoint_slots[c]);
  if (__syncthreads_or(twice) && threadIdx.x == 0) *p.error_flag = 1;
}

// Params::fused_order: the sequences longest first, by a counting sort on their length in 32-token
// chunks (kOrderBuckets classes, the longest class from kOrderBuckets - 1 chunks up; ties in any order,
// which changes no bits: each sequence and head is one CTA's work wherever it stands). The fused
// kernel's CTAs take sequence order[y] in grid row y, so a batch's longest sequences start first
// instead of wherever they stand (docs/DESIGN.md "Longest first"). Invalid cu_seqlens give some
// order too (lengths clamped), never read: the call is refused. Every thread of the CTA calls it.
constexpr int kOrderBuckets = 512;
__device__ __forceinline__ int order_bucket(const Params& p, int64_t n) {
  const int64_t d = cu_at(p, n + 1) - cu_at(p, n);  // clamped before any arithmetic (invalid cu_seqlens)
  const int64_t len = d < 0 ? 0 : d > p.total_tokens ? p.total_tokens : d;
  const int64_t chunks = (len + kFusedChunk - 1) / kFusedChunk;
  return kOrderBuckets - 1 - int(chunks < kOrderBuckets - 1 ? chunks : kOrderBuckets - 1);  // 0: the longest
}
// The lanes of a warp whose sequences share a class take one atomic between them (equal lengths, the
// common batch, would otherwise queue every thread on one word): the leader adds the group's size
// and each lane its rank in the group. Every lane of the warp calls it (bucket -1: none).
__device__ __forceinline__ int warp_grouped_add(int* next, int bucket) {
  const unsigned group = __match_any_sync(0xffffffffu, bucket);
  const int lane = threadIdx.x & 31, leader = __ffs(group) - 1;
  int base = 0;
  if (bucket >= 0 && lane == leader) base = atomicAdd(&next[bucket], __popc(group));
  base = __shfl_sync(0xffffffffu, base, leader);
  return base + __popc(group & ((1u << lane) - 1));
}
template <class ScanStorage>
__device__ void order_longest_first(const Params& p, ScanStorage& scan_storage) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ int next[kOrderBuckets];  // counts, then each class's next place
  for (int b = threadIdx.x; b < kOrderBuckets; b += blockDim.x) next[b] = 0;
  __syncthreads();
  for (int64_t base = 0; base < p.num_seqs; base += blockDim.x) {  // whole warps in every pass
    const int64_t n = base + threadIdx.x;
    warp_grouped_add(next, n < p.num_seqs ? order_bucket(p, n) : -1);
  }
  __syncthreads();
  static_assert(kOrderBuckets <= kScanThreads, "one class a thread");
  const int count = threadIdx.x < kOrderBuckets ? next[threadIdx.x] : 0;
  int first = 0;
  Scan(scan_storage).ExclusiveSum(count, first);  // class b's first place: the longer classes' sizes
  if (threadIdx.x < kOrderBuckets) next[threadIdx.x] = first;
  __syncthreads();
  for (int64_t base = 0; base < p.num_seqs; base += blockDim.x) {
    const int64_t n = base + threadIdx.x;
    const int bucket = n < p.num_seqs ? order_bucket(p, n) : -1;
    const int at = warp_grouped_add(next, bucket);
    if (bucket >= 0) p.fused_order[at] = int32_t(n);
  }
}

__global__ void __launch_bounds__(kScanThreads) chunk_scan_kernel(const __grid_constant__ Params p) {
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  using Reduce64 = cub::BlockReduce<long long, kScanThreads>;
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Reduce64::TempStorage reduce64;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int carry, seg_carry, ckpt_carry;
  allow_dependents();  // K1 may launch now; it waits for this kernel before it reads anything
  // Ahead of the fused kernel's pieces: their flags, zeroed here instead of by a memset of their own.
  for (int64_t i = threadIdx.x; i < p.pieces_zero_ints; i += kScanThreads) p.pieces_zero[i] = 0;

  if (p.cu_seqlens == nullptr) {  // a pool without cu_seqlens: the slot check only
    if (threadIdx.x == 0) *p.error_flag = 0;
    __syncthreads();
    check_distinct_slots(p);
    return;
  }
  const int64_t N = p.num_seqs;
  int bad = 0;
  long long chunks32 = 0, longest = 0;  // for the fused kernel's rule (fused_sms > 0)
  for (int64_t i = threadIdx.x; i <= N; i += kScanThreads) {
    const int64_t c = cu_at(p, i);
    if (i == 0 && c != 0) bad = 1;
    if (i == N && c != p.total_tokens) bad = 1;
    if (i < N && cu_at(p, i + 1) < c) bad = 1;
    if (i < N) {  // clamped to [0, total]: meaningful for valid cu_seqlens, no overflow for others
      const int64_t d = cu_at(p, i + 1) - c;
      const int64_t len = d < 0 ? 0 : d > p.total_tokens ? p.total_tokens : d;
      chunks32 += (len + kFusedChunk - 1) / kFusedChunk;
      longest = len > longest ? len : longest;
    }
  }
  const int any_bad = Reduce(tmp.reduce).Sum(bad);
  bool fused = false;  // thread 0's
  if (p.fused_sms > 0) {  // uniform
    __syncthreads();
    const long long total32 = Reduce64(tmp.reduce64).Sum(chunks32);
    __syncthreads();
    const long long longest_all = Reduce64(tmp.reduce64).Reduce(longest, ::cuda::maximum<>{});
    fused = fused_rule(p.H, total32, longest_all, p.fused_sms, p.fused_min_tokens);
  }
  if (threadIdx.x == 0) {
    carry = 0, seg_carry = 0, ckpt_carry = 0;
    *p.error_flag = any_bad > 0 ? kCallRefused : fused ? kCallFused : kCallValid;
  }
  __syncthreads();
  // Refused or the fused kernel's: no chunks, so K1 does nothing (K2 fills refused outputs with NaN).
  // Checkpoints are numbered unless refused: the fused kernel reads ckpt_start too.
  const bool no_chunks = *p.error_flag != kCallValid;
  const bool refused = *p.error_flag == kCallRefused;
  for (int64_t base = 0; base <= N; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    int chunks = 0;
    if (!no_chunks && i < N) chunks = int((cu_at(p, i + 1) - cu_at(p, i) + kChunk - 1) / kChunk);
    int prefix, total;
    Scan(tmp.scan).ExclusiveSum(chunks, prefix, total);
    if (i <= N) p.chunk_start[i] = carry + prefix;
    int seg_prefix = 0, seg_total = 0;
    if (p.seg_chunks > 0) {  // seg_start[n]: the first global segment of sequence n (config.h)
      __syncthreads();
      Scan(tmp.scan).ExclusiveSum(i < N ? int(segments_of(chunks, p.seg_chunks)) : 0, seg_prefix, seg_total);
      if (i <= N) p.seg_start[i] = seg_carry + seg_prefix;
    }
    int ckpt_prefix = 0, ckpt_total = 0;
    if (p.checkpoint_every > 0) {  // ckpt_start[n]: the first checkpoint of sequence n
      __syncthreads();
      const int ckpts = !refused && i < N ? int((cu_at(p, i + 1) - cu_at(p, i)) / p.checkpoint_every) : 0;
      Scan(tmp.scan).ExclusiveSum(ckpts, ckpt_prefix, ckpt_total);
      if (i <= N) p.ckpt_start[i] = ckpt_carry + ckpt_prefix;
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += total, seg_carry += seg_total, ckpt_carry += ckpt_total;
    __syncthreads();
  }
  // The caller's num_checkpoints must be what the lengths give (the host cannot read them).
  if (threadIdx.x == 0 && p.checkpoint_every > 0 && ckpt_carry != p.num_checkpoints) *p.error_flag = 1;
  // The order, where the fused kernel runs the call (not where K0 left it to the chunk-16 kernels or
  // refused it); the barrier: tmp.scan free, thread 0's verdict seen by all.
  __syncthreads();
  if (p.fused_order != nullptr && (p.fused_sms == 0 || *p.error_flag == kCallFused)) order_longest_first(p, tmp.scan);
  if (p.state_indices != nullptr) check_distinct_slots(p);
}

// K1: grid = chunk_slots * H, block = 128, one chunk of one head a CTA.
// Six CTAs per SM (24 warps): 80 registers, no local memory; 6 x 36 KB of shared memory fits the
// SM's 228 KB. Measured against five CTAs (96 registers) on the H200: K1 1.5-2.5% shorter.
constexpr int kPrepCtasPerSm = 6;

// Chunk slot and head b = slot * H + h; false past the last chunk.
template <class Split>
__device__ __forceinline__ bool prepare_at(const Params& p, uint8_t* smem_raw, int64_t slot, int h) {
  int64_t row0;
  int rows;
  if (!locate_chunk(p, slot, row0, rows)) return false;
  prepare_chunk<Split, CtaSync>(p, *reinterpret_cast<PrepareSmem*>(smem_raw),
                                p.records + (slot * p.H + h) * RecordLayout<Split>::kBytes, h, slot, row0, rows,
                                int(threadIdx.x));
  return true;
}
template <class Split>
__device__ __forceinline__ bool prepare_slot(const Params& p, uint8_t* smem_raw, uint32_t b) {  // b < 2^31
  const uint32_t H = uint32_t(p.H);
  return prepare_at<Split>(p, smem_raw, int64_t(b / H), int(b % H));
}

// After the few-head pieces (Params::prep_next): the CTAs take items b = slot * H + h from a counter,
// in the one-a-CTA kernel's order, each CTA taking the next as soon as it is free, where a fixed
// stride ran 10-13% longer with long memory (run 125). The last thread asks for the CTA's next item
// once it leaves prepare_chunk, which warps 2 and 3 do while warp 0 still inverts (the atomic's
// latency behind that), and hands it over through next[] alternately, so that the one CTA barrier an
// item already has orders both; no register holds it across a chunk (ptxas spilled one that did).
template <class Split>
__device__ __forceinline__ void prepare_from_counter(const Params& p, uint8_t* smem_raw) {
  __shared__ uint32_t next[2];
  const uint32_t total = uint32_t(p.chunk_slots * p.H);  // < 2^31 (launch_prepare)
  const bool asks = threadIdx.x == kPrepThreads - 1;     // warp 3's last lane
  if (asks) next[0] = atomicAdd(p.prep_next, 1u);
  __syncthreads();
  for (int i = 0;; i ^= 1) {
    const uint32_t b = next[i];
    if (b >= total) return;
    if (!prepare_slot<Split>(p, smem_raw, b)) return;  // and every later item (a larger slot)
    if (asks) next[i ^ 1] = atomicAdd(p.prep_next, 1u);
    __syncthreads();  // every thread done with this chunk's shared memory and next[i]; next[i ^ 1] written
  }
}

// kStrided (launch_prepare, where K0 may give the call to the fused kernel: Params::fused_sms, and
// after the few-head pieces): fewer CTAs, each taking every gridDim.x-th chunk and head in turn (or
// from Params::prep_next's counter), so that a K1 that finds no chunks costs a few microseconds, not
// ~1.2 ns a chunk and head (run 98). A kernel of its own: the loop costs the one-a-CTA kernel ~80
// bytes of spills at its 80 registers.
template <class Split, bool kStrided>
__global__ void __launch_bounds__(kPrepThreads, kPrepCtasPerSm) prepare_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  wait_for_prerequisites();  // K0 (launched early after it)
  allow_dependents();
  if (pieces_ran(p)) {  // the call is done but for the pieces' final states, where they are apart
    // (after the pieces K1 is strided: launch_prepare)
    if (kStrided && p.pieces_final.from != nullptr)
      copy_pieces_final(p.pieces_final, int64_t(blockIdx.x) * blockDim.x + threadIdx.x, int64_t(gridDim.x) * blockDim.x);
    return;
  }
  if constexpr (kStrided) {
    if (call_fused(p)) return;
    if (p.prep_next != nullptr) return prepare_from_counter<Split>(p, smem_raw);
    // b = slot * H + h stepped by gridDim.x < chunk_slots * H < 2^31: (slot, h) carried, one division.
    const uint32_t H = uint32_t(p.H), step = gridDim.x, dh = step % H;
    const int64_t dslot = step / H, total = p.chunk_slots * p.H;
    uint32_t h = blockIdx.x % H;
    int64_t slot = blockIdx.x / H;
    for (int64_t b = blockIdx.x; b < total; b += step) {
      if (!prepare_at<Split>(p, smem_raw, slot, int(h))) return;  // and every later slot
      __syncthreads();  // every thread done with this chunk's shared memory (and each warp reconverged)
      h += dh, slot += dslot;
      if (h >= H) h -= H, ++slot;
    }
  } else {
    prepare_slot<Split>(p, smem_raw, blockIdx.x);
  }
}

}  // namespace flashkda::cuda::sm90::prefill
