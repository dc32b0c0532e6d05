// K2 over segments (one warpgroup per CTA, value and transition rows), both precision modes.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
template void launch_recur_segmented<false>(const Params&, cudaStream_t);
template void launch_recur_segmented<true>(const Params&, cudaStream_t);
}  // namespace flashkda::cuda::sm90::prefill
