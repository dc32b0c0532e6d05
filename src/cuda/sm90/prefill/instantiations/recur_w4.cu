// K2 recurrence with 4 warp(s) per CTA (64 value columns each), every precision policy
// (config.h FLASHKDA_PREFILL_SPLITS).
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
#define FLASHKDA_INSTANTIATE(Split) template void launch_recur<4, Split>(const Params&, cudaStream_t, bool);
FLASHKDA_PREFILL_SPLITS(FLASHKDA_INSTANTIATE)
#undef FLASHKDA_INSTANTIATE
}  // namespace flashkda::cuda::sm90::prefill
