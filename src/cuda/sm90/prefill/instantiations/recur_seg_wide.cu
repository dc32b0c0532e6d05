// K2 over segments with both V halves of a piece in one CTA of two warpgroups (recur_seg_wide_kernel,
// internal::PrefillLaunch::seg_ctas_per_sm = 1: a candidate), every precision policy.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
#define FLASHKDA_INSTANTIATE(Split) template void launch_recur_segmented<Split, 1>(const Params&, cudaStream_t);
FLASHKDA_PREFILL_SPLITS(FLASHKDA_INSTANTIATE)
#undef FLASHKDA_INSTANTIATE
}  // namespace flashkda::cuda::sm90::prefill
