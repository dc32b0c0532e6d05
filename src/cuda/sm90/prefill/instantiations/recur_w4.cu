// K2 recurrence with 4 warp(s) per CTA (64 value columns each), every precision mode and the fp16 candidate.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
template void launch_recur<4, FastSplit>(const Params&, cudaStream_t);
template void launch_recur<4, BalancedSplit>(const Params&, cudaStream_t);
template void launch_recur<4, PreciseSplit>(const Params&, cudaStream_t);
template void launch_recur<4, F16Split>(const Params&, cudaStream_t);
}  // namespace flashkda::cuda::sm90::prefill
