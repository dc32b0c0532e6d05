// K2 recurrence with 8 warp(s) per CTA (128 value columns each), every precision mode and the fp16 candidate.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
template void launch_recur<8, FastSplit>(const Params&, cudaStream_t);
template void launch_recur<8, BalancedSplit>(const Params&, cudaStream_t);
template void launch_recur<8, PreciseSplit>(const Params&, cudaStream_t);
template void launch_recur<8, F16Split>(const Params&, cudaStream_t);
}  // namespace flashkda::cuda::sm90::prefill
