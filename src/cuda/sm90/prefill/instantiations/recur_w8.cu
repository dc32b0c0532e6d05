// K2 recurrence with 8 warp(s) per CTA (128 value columns each), both precision modes.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
template void launch_recur<8, false>(const Params&, cudaStream_t);
template void launch_recur<8, true>(const Params&, cudaStream_t);
}  // namespace flashkda::cuda::sm90::prefill
