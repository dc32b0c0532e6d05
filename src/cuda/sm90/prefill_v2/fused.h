// Prefill v2 (issue 11), third step: the chunk-32 producer and recurrence in one kernel, the
// record never leaving shared memory. One CTA of three warpgroups per head of one sequence: a
// producer (produce.cuh) fills a ring of two record stages, two consumers (consume.cuh, 64 value
// rows of the state each) run the recurrence over them, handing stages back and forth on
// mbarriers. The same scope as consume.h (one sequence, the precise policy with its range guard, no
// wide chunks). Not part of the public API; the GPU test
// test_prefill32_gpu checks it against the fp64 token recurrence and times it.
#pragma once

#include <cuda_runtime.h>

#include "cuda/sm90/prefill_v2/consume.h"
#include "cuda/sm90/prefill_v2/produce.h"

namespace flashkda::cuda::sm90::prefill_v2 {

struct FusedArgs {
  ProduceArgs produce;  // out (records) unused
  ConsumeArgs consume;  // records unused
  // The producer's q, k, g of chunk c + 1 copied into shared memory (cp.async) while it computes
  // chunk c; false: loaded from global memory when the chunk starts.
  bool stage_inputs = true;
  // Timing only: the producer builds chunks 0 and 1 and then hands the same two stages back
  // without rebuilding them, so the call takes the consumers' time alone; outputs are meaningless.
  bool time_consumers_only = false;
};

// Launches the fused kernel on `stream`; returns the launch's error.
cudaError_t fused_chunks(const FusedArgs& args, cudaStream_t stream);

}  // namespace flashkda::cuda::sm90::prefill_v2
