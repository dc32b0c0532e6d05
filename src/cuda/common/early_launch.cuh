// Programmatic dependent launch (sm90, "early launch"): a kernel launched with
// launch_early may start while the kernel before it in the stream is still running, so that its
// launch and CTA placement overlap the predecessor's last wave. Every kernel that can be launched
// so calls wait_for_prerequisites() before its first global memory access (read or write): it
// returns once every prerequisite grid has completed and its writes are visible, so the results
// are those of ordinary stream order. allow_dependents() lets the next kernel launch as soon as
// every CTA of this one has started.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/check.h"

namespace flashkda::cuda {

__device__ __forceinline__ void wait_for_prerequisites() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// kernel<<<grid, block, smem, stream>>>(args...), launched early (programmatic stream
// serialisation) when `early`; returns the launch's error.
template <class... Expected, class... Actual>
cudaError_t try_launch_early(bool early, void (*kernel)(Expected...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Actual&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = smem, config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute, config.numAttrs = early ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Actual>(args)...);
}
// The same, raising the launch's error.
template <class... Expected, class... Actual>
void launch_early(bool early, void (*kernel)(Expected...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                  Actual&&... args) {
  FLASHKDA_CUDA_CHECK(try_launch_early(early, kernel, grid, block, smem, stream, std::forward<Actual>(args)...));
}

}  // namespace flashkda::cuda
