// cp.async helpers (sm80+): global -> shared copies that hold no registers while in flight.
#pragma once

#include <cstdint>

namespace flashkda::cuda {

// 16-byte copy, cached in L2 only (.cg); both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

// 4-byte copy (cached at all levels, .ca: the only mode for sizes below 16); 4-byte aligned.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

// 16-byte copy that writes zeros instead when !valid (src-size 0): for rows past a sequence end.
__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 16 : 0)
               : "memory");
}

// Asks L2 for the 128-byte line holding gmem_src (no register, no wait): ahead of a later load.
__device__ __forceinline__ void prefetch_l2(const void* gmem_src) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem_src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits for all of this thread's cp.async groups; a barrier is still needed before other threads read.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Waits until at most kPending of this thread's most recent committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace flashkda::cuda
