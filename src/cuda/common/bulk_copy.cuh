// Bulk copies (sm90 cp.async.bulk, the TMA unit's non-tensor form) into shared memory, completing
// on an mbarrier. One thread issues a whole contiguous block; the waiting threads spend no issue
// slots on the copy.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing links the driver)

#include <cstdint>

namespace flashkda::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes initialised mbarriers visible to the async proxy (the bulk copies completing on them);
// followed by a CTA barrier before any use.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// This thread's arrival, announcing `bytes` of copies that will complete on the barrier's phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// mbarrier_wait with a suspend-time hint (ns): ptxas follows the wait's first test with NANOSLEEP.SYNCS,
// a sleep that the barrier's phase completing ends (sm_90a SASS), where the plain form tests again and
// again (on an SM whose other warps have work to issue, the test loop takes their issue slots).
__device__ __forceinline__ void mbarrier_wait_hinted(uint64_t* bar, uint32_t parity, uint32_t suspend_ns) {
  asm volatile(
      "{\n .reg .pred done;\n wait_phase_hinted:\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1, %2;\n"
      " @!done bra wait_phase_hinted;\n}" ::"r"(smem_addr(bar)),
      "r"(parity), "r"(suspend_ns)
      : "memory");
}
// Every kernel's mbarrier_wait: 0, the plain try_wait loop (every kernel today); > 0, hinted with this
// many ns, a candidate for an A/B build (DESIGN.md "Where a few-head call's fixed cost goes": the fused
// kernel's producer ~3x slower while its consumers wait for their first stage, run 177; the chunk-16
// K2's records, decode's bulk kernel and the fused kernel's two roles all wait through here).
constexpr uint32_t kMbarrierWaitSuspendNs = 0;
// Waits until the barrier's phase of this parity has completed (acquire at CTA scope: every
// kernel here synchronises only its own CTA's threads and copies through its barriers; at cluster
// scope the compiler follows each completed wait with CCTL.IVALL, an invalidation of the SM's L1).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  if constexpr (kMbarrierWaitSuspendNs > 0) {
    mbarrier_wait_hinted(bar, parity, kMbarrierWaitSuspendNs);
  } else {
    asm volatile(
        "{\n .reg .pred done;\n wait_phase:\n"
        " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait_phase;\n}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
  }
}
// Waits by test_wait polls 256 ns of nanosleep apart (timing only, FusedArgs::start_variant 4).
__device__ __forceinline__ void mbarrier_wait_backoff(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  for (;;) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    if (done) return;
    __nanosleep(256);
  }
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into this CTA's
// shared memory, completing on bar.
__device__ __forceinline__ void bulk_copy(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// The box at coordinates (c0, c1, c2) of a 3-D tensor map (in kernel parameter space: a
// __grid_constant__ argument's member) into this CTA's shared memory (128-byte aligned),
// completing on bar with the box's whole size (elements outside the tensor arrive as zeros).
__device__ __forceinline__ void tensor_copy_3d(void* smem_dst, const CUtensorMap* map, int c0, int c1, int c2,
                                               uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

// A plain arrival (no bytes announced): completes the phase of a one-arrival barrier whose item
// copies nothing.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// The other direction: `bytes` (a multiple of 16, both addresses 16-byte aligned) from this CTA's
// shared memory to global memory, in this thread's current bulk async-group. The shared memory
// written by ordinary stores must be made visible to the async proxy first (fence_proxy_async_shared
// by each writing thread, then a CTA barrier).
__device__ __forceinline__ void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_addr(smem_src)),
               "r"(bytes)
               : "memory");
}
// Closes this thread's bulk async-group (possibly empty).
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's most recent bulk groups still read shared memory
// (their sources may be overwritten after it; the global writes complete on their own).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// Orders this thread's ordinary shared-memory writes before later async-proxy reads of them.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace flashkda::cuda
