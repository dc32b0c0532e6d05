// K2 over segments (one warpgroup per CTA, value and transition rows), every precision policy
// (config.h FLASHKDA_PREFILL_SPLITS).
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
#define FLASHKDA_INSTANTIATE(Split) template void launch_recur_segmented<Split, 2>(const Params&, cudaStream_t, bool);
FLASHKDA_PREFILL_SPLITS(FLASHKDA_INSTANTIATE)
#undef FLASHKDA_INSTANTIATE
}  // namespace flashkda::cuda::sm90::prefill
