// K2 over segments (one warpgroup per CTA, value and transition rows), every precision mode and the fp16 candidate.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
template void launch_recur_segmented<FastSplit>(const Params&, cudaStream_t);
template void launch_recur_segmented<BalancedSplit>(const Params&, cudaStream_t);
template void launch_recur_segmented<PreciseSplit>(const Params&, cudaStream_t);
template void launch_recur_segmented<F16Split>(const Params&, cudaStream_t);
}  // namespace flashkda::cuda::sm90::prefill
