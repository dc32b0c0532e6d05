// Host-side facts about the current device that the CUDA launchers' rules use, and the per-kernel
// attributes a launch needs, each asked of the runtime once (per device or per context) instead of
// every call: an eager call at few heads spent ~10 us of host time on these queries (run 124).
#pragma once

#include <cuda_runtime.h>

namespace flashkda::cuda {

// Streaming multiprocessors of the current device (132, an H100/H200, if the query fails); queried
// once per device.
int sm_count();

// The current context's process-unique id (cuCtxGetId, CUDA 12): kernels' attributes and streams
// belong to a context, and a reset device's new context may sit at the old one's address. 0 where the
// driver has no such entry point or no context is current: then nothing is cached.
unsigned long long context_id();

// Makes `bytes` of dynamic shared memory available to `kernel` (cudaFuncAttributeMaxDynamicSharedMemorySize)
// on the current context: the attribute is set once per kernel and context (a context the driver
// recreates, after cudaDeviceReset, starts without it and is set again), and only raised.
cudaError_t allow_dynamic_smem(const void* kernel, int bytes);
template <class... Args>
cudaError_t allow_dynamic_smem(void (*kernel)(Args...), int bytes) {
  return allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

// The registers a thread of `kernel` gets (cudaFuncGetAttributes' numRegs), queried once per kernel
// and context.
cudaError_t kernel_registers(const void* kernel, int& regs);
template <class... Args>
cudaError_t kernel_registers(void (*kernel)(Args...), int& regs) {
  return kernel_registers(reinterpret_cast<const void*>(kernel), regs);
}

}  // namespace flashkda::cuda
