// The fused chunk-32 prefill (fused.h): grid = H, 384 threads. Warpgroup 0 produces chunk c's
// record into stage c % 2 of a shared-memory ring (its own named barrier 1 inside produce_chunk,
// then every producer thread arrives on full[c % 2]); warpgroups 1 and 2 wait for it, run the
// chunk for value rows 0-63 and 64-127, and every consumer thread arrives on empty[c % 2], which
// the producer waits for before it writes chunk c + 2 there. All three run at the launch's 168
// registers: with v read from the stage the consumers fit without spills, and the producer spills
// least (setmaxnreg 152 / 176 cost the producer ~50 spill instructions a chunk).
// FusedArgs::stage_inputs: the producer copies chunk c + 1's q, k, g into shared memory by cp.async
// (issue_chunk_inputs) while it computes chunk c. Each stage also holds the chunk's v rows, which
// the producer's warp 1 bulk-copies in (a row a lane) as the stage is rebuilt, completing on the
// same full barrier.
#include "cuda/sm90/prefill_v2/consume.cuh"
#include "cuda/sm90/prefill_v2/fused.h"

namespace flashkda::cuda::sm90::prefill_v2 {
namespace {

constexpr int kFusedThreads = 3 * kThreads;
constexpr int kStages = 2;
constexpr int kRecordSpan = (ChunkOperands::kBytes + 1023) & ~1023;
constexpr int kScratchSpan = (ProduceScratch::kBytes + 1023) & ~1023;
constexpr int kVBytes = kChunk * kHeadDim * 2;           // the chunk's v rows, [32][128] bf16
constexpr int kStageSpan = kRecordSpan + kVBytes;         // a ring stage: the record, then v
constexpr int kOffBarriers = kStages * kStageSpan + kScratchSpan;
constexpr int kOffStaged = kOffBarriers + 1024;  // two buffers of the producer's staged inputs
// + full[2], empty[2] (and the staged inputs); + the 1024-byte alignment
constexpr int kSmemBytes(bool staged) { return (staged ? kOffStaged + 2 * kStagedBytes : kOffBarriers + 64) + 1024; }

// Announces `bytes` more to complete on the barrier's current phase, without an arrival.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

template <GateForm kGate, bool kF32Gate, bool kStaged>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_kernel(const __grid_constant__ FusedArgs a) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* const ring = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* const scratch = ring + kStages * kStageSpan;
  uint64_t* const full = reinterpret_cast<uint64_t*>(ring + kOffBarriers);
  uint64_t* const empty = full + kStages;
  const int tid = threadIdx.x, wg = tid / kThreads, h = blockIdx.x;
  const int64_t num_chunks = (a.consume.T + kChunk - 1) / kChunk;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s], kThreads), mbarrier_init(&empty[s], 2 * kThreads);
    fence_mbarrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    uint8_t* const staged = ring + kOffStaged;
    float beta_next = 0.f;
    if constexpr (kStaged) {
      if (num_chunks > 0) beta_next = issue_chunk_inputs<kF32Gate>(a.produce, h, 0, tid, staged);
      cp_async_commit();
    }
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int stage = int(c % kStages);
      const float beta_raw = beta_next;
      if constexpr (kStaged) {  // chunk c + 1's inputs on their way while chunk c is computed
        if (c + 1 < num_chunks)
          beta_next = issue_chunk_inputs<kF32Gate>(a.produce, h, c + 1, tid, staged + ((c + 1) & 1) * kStagedBytes);
        cp_async_commit();
        cp_async_wait_group<1>();  // chunk c's (each thread reads only its own granules)
      }
      if (c >= kStages) mbarrier_wait(&empty[stage], uint32_t(c / kStages - 1) & 1);
      if (a.time_consumers_only && c >= kStages) {
        mbarrier_arrive(&full[stage]);
        continue;
      }
      if (tid >= 32 && tid < 64) {  // the chunk's v rows into the stage by bulk copies, completing on
        // full[stage]: a row a lane of warp 1 (warp 0 runs the inverse, the producer's longest chain)
        const int64_t row0 = c * kChunk;
        const int rows = a.consume.T - row0 < kChunk ? int(a.consume.T - row0) : kChunk, t = tid - 32;
        // The consumers' last reads of this stage's v were generic-proxy loads, ordered before
        // here by the empty barrier; the copies write through the async proxy.
        fence_proxy_async_shared();
        if (t == 0) mbarrier_expect_tx(&full[stage], uint32_t(rows) * kHeadDim * 2);
        __syncwarp();
        if (t < rows)
          bulk_copy(ring + stage * kStageSpan + kRecordSpan + t * kHeadDim * 2,
                    static_cast<const __nv_bfloat16*>(a.consume.v) + ((row0 + t) * a.consume.H + h) * kHeadDim,
                    kHeadDim * 2, &full[stage]);
      }
      produce_chunk<kGate, kF32Gate, WarpgroupSync<1>>(a.produce, h, c, tid, ring + stage * kStageSpan, scratch,
                                                       kStaged ? staged + (c & 1) * kStagedBytes : nullptr, beta_raw);
      mbarrier_arrive(&full[stage]);
    }
  } else {
    const ConsumeArgs& p = a.consume;
    const int ctid = tid - kThreads, warp = (ctid >> 5) & 3, lane = ctid & 31, g = lane >> 2, t4 = lane & 3;
    const int v_row = 64 * (wg - 1) + 16 * warp + g;
    float S[64];
    prefill::load_state_rows(S, p.initial_state, p.initial_state ? ElemType::kF32 : ElemType::kNone,
                             int64_t(h) * kHeadDim * kHeadDim, v_row, t4);
    prefill::RowScale rs;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int stage = int(c % kStages);
      if (c <= 1 || c % prefill::kRenormChunks == 0) rs.renormalise(S);
      mbarrier_wait(&full[stage], uint32_t(c / kStages) & 1);
      // v^T of this thread's slots from the stage (rows past the end: zero, never the stage's bytes).
      const __nv_bfloat16* const vs = reinterpret_cast<const __nv_bfloat16*>(ring + stage * kStageSpan + kRecordSpan);
      const int rows = p.T - c * kChunk < kChunk ? int(p.T - c * kChunk) : kChunk;
      auto v_at = [&](int i) {
        const int t = 8 * (i >> 2) + 2 * t4 + (i & 1);
        return t < rows ? __bfloat162float(vs[t * kHeadDim + v_row + 8 * ((i >> 1) & 1)]) : 0.f;
      };
      __nv_bfloat16 o[16];
      consume_chunk(p, h, c, v_row, t4, ring + stage * kStageSpan, v_at, S, rs, o);
      // The output through the stage's v: each slot's bf16 where this thread read its v (no other
      // thread reads those bytes; the other consumer warpgroup's columns are disjoint), then the
      // warp's 32 tokens x 16 columns to global memory as 16-byte rows, before the stage is released.
      __nv_bfloat16* const vw = const_cast<__nv_bfloat16*>(vs);
#pragma unroll
      for (int i = 0; i < 16; ++i) vw[(8 * (i >> 2) + 2 * t4 + (i & 1)) * kHeadDim + v_row + 8 * ((i >> 1) & 1)] = o[i];
      __syncwarp();
      const int col = 64 * (wg - 1) + 16 * warp;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int unit = lane + 32 * u, t = unit >> 1, part = unit & 1;
        if (t < rows)
          *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + ((c * kChunk + t) * p.H + h) * kHeadDim + col +
                                    8 * part) = *reinterpret_cast<const uint4*>(vw + t * kHeadDim + col + 8 * part);
      }
      mbarrier_arrive(&empty[stage]);
    }
    if (p.final_state != nullptr)
      prefill::store_state_rows(S, p.final_state, ElemType::kF32, int64_t(h) * kHeadDim * kHeadDim, v_row, t4, rs.inv);
  }
}

template <GateForm kGate, bool kF32Gate, bool kStaged>
cudaError_t launch(const FusedArgs& args, cudaStream_t stream) {
  auto kernel = fused_kernel<kGate, kF32Gate, kStaged>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes(kStaged));
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(args.consume.H), kFusedThreads, kSmemBytes(kStaged), stream>>>(args);
  return cudaGetLastError();
}
template <GateForm kGate, bool kF32Gate>
cudaError_t launch(const FusedArgs& args, cudaStream_t stream) {
  return args.stage_inputs ? launch<kGate, kF32Gate, true>(args, stream) : launch<kGate, kF32Gate, false>(args, stream);
}

}  // namespace

cudaError_t fused_chunks(const FusedArgs& args, cudaStream_t stream) {
  const ProduceArgs& pa = args.produce;
  const ConsumeArgs& ca = args.consume;
  if (ca.T <= 0 || ca.H <= 0) return cudaSuccess;
  if (pa.T != ca.T || pa.H != ca.H || pa.q == nullptr || pa.k == nullptr || pa.g == nullptr || pa.beta == nullptr ||
      (pa.gate != GateForm::kPrecomputed && pa.A_log == nullptr) || ca.v == nullptr || ca.out == nullptr)
    return cudaErrorInvalidValue;
  const bool f32 = pa.g_type == ElemType::kF32;
  if (pa.gate == GateForm::kLowerBound)
    return f32 ? launch<GateForm::kLowerBound, true>(args, stream) : launch<GateForm::kLowerBound, false>(args, stream);
  if (pa.gate == GateForm::kSoftplus)
    return f32 ? launch<GateForm::kSoftplus, true>(args, stream) : launch<GateForm::kSoftplus, false>(args, stream);
  return f32 ? launch<GateForm::kPrecomputed, true>(args, stream) : launch<GateForm::kPrecomputed, false>(args, stream);
}

}  // namespace flashkda::cuda::sm90::prefill_v2
