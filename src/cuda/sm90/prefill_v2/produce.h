// The chunk-32 producer on its own (issue 11's first measurement: its instructions and time per
// chunk before a fused kernel is built around it): one CTA of one warpgroup per (chunk, head) of a
// single sequence, each chunk's operands (layout.h ChunkOperands) copied to global memory. Not part
// of the public API; the GPU test test_produce32_gpu checks it against fp64 and times it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sm90/prefill/config.h"
#include "flashkda/types.h"

namespace flashkda::cuda::sm90::prefill_v2 {

using prefill::ElemType;

struct ProduceArgs {
  const void* q = nullptr;     // [T, H, 128] bf16
  const void* k = nullptr;     // [T, H, 128] bf16
  const void* g = nullptr;     // [T, H, 128] bf16 or fp32 (g_type)
  const void* beta = nullptr;  // [T, H] bf16 or fp32 (beta_type)
  const float* A_log = nullptr;    // [H] (not read for precomputed gates)
  const float* dt_bias = nullptr;  // [H, 128] or null
  ElemType g_type = ElemType::kBF16, beta_type = ElemType::kBF16;
  GateForm gate = GateForm::kLowerBound;
  float lower_bound = -5.f;
  float scale = 1.f;
  bool l2norm_qk = true;
  bool beta_is_logit = true;
  int64_t T = 0;
  int H = 0;
  void* out = nullptr;  // [ceil(T / 32), H] ChunkOperands records
  // false: build every record in shared memory but copy none out (the producer's time without the
  // record traffic, which a fused kernel does not have); out is then not written.
  bool write_records = true;
  // Timing only (test_prefill32_gpu's A/B): the staged producer's gate and row scales as two phases
  // apart, the form before gate_and_row_scales (produce.cuh); the same bits either way.
  bool gate_then_norms = false;
};

// Launches the producer on `stream`; returns the launch's error.
cudaError_t produce_chunks(const ProduceArgs& args, cudaStream_t stream);

// Test support: the producer's L / Mqk product (produce.cuh l_mqk_product, one warpgroup) on operand
// words stored as given, with no rounding: a [64][128] and b [32][128] fp32 words (row-major, in
// device memory), d = a b^T [64][32] fp32 (row-major). Tf32OperandsIgnoreTheLow13Bits runs it on
// words with and without their low 13 bits, which the producer's tf32 operands leave set.
cudaError_t l_mqk_product_probe(const uint32_t* a, const uint32_t* b, float* d, cudaStream_t stream);

}  // namespace flashkda::cuda::sm90::prefill_v2
