// Definitions of launch_recur<kWarps, Split> and launch_recur_segmented<Split>, included by the
// instantiation units.
#pragma once

#include "cuda/check.h"
#include "cuda/device_info.h"
#include "cuda/sm90/prefill/launch.h"
#include "cuda/sm90/prefill/recur_kernel.cuh"

namespace flashkda::cuda::sm90::prefill {

// One K2 launch of `threads` a CTA (early after K1 where PrefillLaunch::early_launch says: a
// candidate, early_launch.cuh).
template <class Kernel>
void launch_k2(Kernel kernel, dim3 grid, int threads, int smem, const Params& p, cudaStream_t stream) {
  FLASHKDA_CUDA_CHECK(allow_dynamic_smem(kernel, smem));
  launch_early(p.early_launch & kEarlyK2, kernel, grid, dim3(threads), size_t(smem), stream, p);
}

template <int kWarps, class Split>
void launch_recur(const Params& p, cudaStream_t stream, bool bulk) {
  const int64_t work = p.num_seqs * p.H;
  if (work == 0) return;
  const dim3 grid(unsigned(work), 8 / kWarps);
  if constexpr (kWarps == 4) {  // two CTAs a head: the bulk record stream applies
    if (bulk)
      return launch_k2(recur_kernel<4, Split, false, true>, grid, 4 * 32,
                       int(sizeof(RecurSmem<4, Split, false, 3, true>)), p, stream);
  }
  launch_k2(recur_kernel<kWarps, Split, false>, grid, kWarps * 32, int(sizeof(RecurSmem<kWarps, Split>)), p, stream);
}

// kCtasPerSm: the segmented K2 at 2 or 3 CTAs an SM (launch.cu seg_ctas_per_sm; RecurSmem).
template <class Split, int kCtasPerSm, bool kBulk>
void launch_recur_segmented_as(const Params& p, cudaStream_t stream) {
  const int64_t ctas = p.max_segs * p.H;
  if (ctas == 0) return;
  constexpr int kStages = kCtasPerSm >= 3 ? kSeg3Stages : 3;
  constexpr int smem = sizeof(RecurSmem<4, Split, true, kStages, kBulk>);
  constexpr auto kernel = [] {  // only the one this instantiation launches is compiled in its unit
    if constexpr (kCtasPerSm >= 3) return recur_seg3_kernel<Split, kBulk>;
    else return recur_kernel<4, Split, true, kBulk>;
  }();
  // Value and transition rows of each segment; with transition skipping, the value rows of every
  // further piece (recur_kernel).
  const unsigned pieces = unsigned(p.run_chunks > 0 ? p.max_pieces : 1);
  const dim3 grid(unsigned(ctas), kSegRows / 64 + 2 * (pieces - 1));
  if constexpr (kCtasPerSm == 2 && kBulk)  // low-rank transitions (launch.cu sets seg_lowrank only here)
    if (p.seg_lowrank != nullptr) return launch_k2(recur_seg_lowrank_kernel<Split>, grid, 4 * 32, smem, p, stream);
  launch_k2(kernel, grid, 4 * 32, smem, p, stream);
}

template <class Split, int kCtasPerSm>
void launch_recur_segmented(const Params& p, cudaStream_t stream, bool bulk) {
  if (bulk) launch_recur_segmented_as<Split, kCtasPerSm, true>(p, stream);
  else launch_recur_segmented_as<Split, kCtasPerSm, false>(p, stream);
}

}  // namespace flashkda::cuda::sm90::prefill
