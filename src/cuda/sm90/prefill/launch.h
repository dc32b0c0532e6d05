// Host-side launchers of the sm90 prefill kernels; one recurrence variant per translation unit
// in instantiations/ so they compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/sm90/prefill/config.h"

namespace flashkda::cuda::sm90::prefill {

// Split: the mode's precision policy (config.h SplitPolicy).
template <class Split>
void launch_prepare(const Params& p, cudaStream_t stream);  // K0 (varlen only) + K1 (the mode's record)

// bulk: the record stream by bulk copies (one-warpgroup CTAs only; internal::PrefillLaunch::record_copy).
template <int kWarps, class Split>
void launch_recur(const Params& p, cudaStream_t stream, bool bulk);  // K2, grid (N*H, 8 / kWarps)

template <class Split, int kCtasPerSm>  // 2 or 3 CTAs an SM (launch.cu seg_ctas_per_sm)
void launch_recur_segmented(const Params& p, cudaStream_t stream,
                            bool bulk);  // K2 over segments, grid (max_segs*H, 4 + ...)
void launch_segment_chain(const Params& p, cudaStream_t stream);     // segment start states, final state
void launch_segment_combine(const Params& p, cudaStream_t stream);   // outputs of segments s > 0

}  // namespace flashkda::cuda::sm90::prefill
