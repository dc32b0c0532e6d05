// K2 with K1 fused in (recur_fused_kernel: two consumer warpgroups and a producer), for the
// policies whose consumers fit its 168 registers: FastSplit and F16Split (launch.cu fuses).
#include "cuda/sm90/prefill/recur_launch.cuh"

namespace flashkda::cuda::sm90::prefill {
template void launch_recur_fused<FastSplit>(const Params&, cudaStream_t);
template void launch_recur_fused<F16Split>(const Params&, cudaStream_t);
}  // namespace flashkda::cuda::sm90::prefill
