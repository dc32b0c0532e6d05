// K2 recurrence with 4 warp(s) per CTA (64 value columns each), both precision modes.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
template void launch_recur<4, false>(const Params&, cudaStream_t);
template void launch_recur<4, true>(const Params&, cudaStream_t);
}  // namespace flashkda::cuda::sm90::prefill
