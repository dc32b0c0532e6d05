// Prefill v2 (issue 11), second step: the chunk-32 recurrence over the producer's records
// (produce.h), as a kernel of its own, so that the two halves of the fused kernel can be checked
// and timed before they share a CTA. One sequence, every head; K = V = 128; the precise (fp16)
// policy with its row-scale range guard and fp32 fallback, no wide chunks
// (the producer flags them; their pairwise path is not built). Not part of the public API; the GPU
// test test_produce32_gpu checks producer + recurrence against the fp64 token recurrence and times
// them beside today's prefill.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashkda::cuda::sm90::prefill_v2 {

struct ConsumeArgs {
  const void* records = nullptr;      // [ceil(T / 32), H] ChunkOperands (produce_chunks)
  const void* v = nullptr;            // [T, H, 128] bf16
  const float* initial_state = nullptr;  // [H, V, K] fp32, or null (zeros)
  void* out = nullptr;                // [T, H, 128] bf16
  float* final_state = nullptr;       // [H, V, K] fp32, or null (not written)
  int64_t T = 0;
  int H = 0;
  // The fused kernel over a state pool (FusedArgs::state_pool): initial_state and final_state point
  // at bf16 states (their pointers' type notwithstanding); the recurrence kernel ignores it.
  bool states_bf16 = false;
};

// Launches the recurrence on `stream` (grid: two CTAs of one warpgroup per head, 64 value rows of
// the state each); returns the launch's error.
cudaError_t consume_chunks(const ConsumeArgs& args, cudaStream_t stream);

}  // namespace flashkda::cuda::sm90::prefill_v2
