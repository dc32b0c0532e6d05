// K2 over segments at three CTAs an SM (launch.cu seg_ctas_per_sm: from H = 16 up), every precision
// policy (config.h FLASHKDA_PREFILL_SPLITS).
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
#define FLASHKDA_INSTANTIATE(Split) template void launch_recur_segmented<Split, 3>(const Params&, cudaStream_t, bool);
FLASHKDA_PREFILL_SPLITS(FLASHKDA_INSTANTIATE)
#undef FLASHKDA_INSTANTIATE
}  // namespace flashkda::cuda::sm90::prefill
