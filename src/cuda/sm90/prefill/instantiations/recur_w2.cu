// K2 recurrence with 2 warp(s) per CTA (32 value columns each), both precision modes.
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::sm90::prefill {
template void launch_recur<2, false>(const Params&, cudaStream_t);
template void launch_recur<2, true>(const Params&, cudaStream_t);
}  // namespace flashkda::sm90::prefill
