// Definitions of launch_recur<kWarps, Split> and launch_recur_segmented<Split>, included by the
// instantiation units.
#pragma once

#include "cuda/check.h"
#include "cuda/sm90/prefill/launch.h"
#include "cuda/sm90/prefill/recur_kernel.cuh"

namespace flashkda::cuda::sm90::prefill {

template <int kWarps, class Split>
void launch_recur(const Params& p, cudaStream_t stream) {
  const int64_t work = p.num_seqs * p.H;
  if (work == 0) return;
  constexpr int smem = sizeof(RecurSmem<kWarps, Split>);
  auto kernel = recur_kernel<kWarps, Split, false>;
  FLASHKDA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(unsigned(work), 8 / kWarps);
  kernel<<<grid, kWarps * 32, smem, stream>>>(p);
  FLASHKDA_CHECK_LAUNCH();
}

// kCtasPerSm: the segmented K2 at 2 or 3 CTAs an SM (launch.cu seg_ctas_per_sm; RecurSmem).
template <class Split, int kCtasPerSm>
void launch_recur_segmented(const Params& p, cudaStream_t stream) {
  const int64_t ctas = p.max_segs * p.H;
  if (ctas == 0) return;
  constexpr int smem = sizeof(RecurSmem<4, Split, true, kCtasPerSm >= 3 ? kSeg3Stages : 3>);
  constexpr auto kernel = [] {  // only the one this instantiation launches is compiled in its unit
    if constexpr (kCtasPerSm >= 3) return recur_seg3_kernel<Split>;
    else return recur_kernel<4, Split, true>;
  }();
  FLASHKDA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Value and transition rows of each segment; with transition skipping, the value rows of every
  // further piece (recur_kernel).
  const unsigned pieces = unsigned(p.run_chunks > 0 ? p.max_pieces : 1);
  const dim3 grid(unsigned(ctas), kSegRows / 64 + 2 * (pieces - 1));
  kernel<<<grid, 4 * 32, smem, stream>>>(p);
  FLASHKDA_CHECK_LAUNCH();
}

}  // namespace flashkda::cuda::sm90::prefill
