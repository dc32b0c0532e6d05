// The chunk-32 producer as a kernel of its own (produce.h): one CTA of 128 threads per (chunk,
// head), its operands built in shared memory (produce.cuh) and copied out with one bulk copy.
#include "cuda/device_info.h"
#include "cuda/sm90/prefill_v2/produce.cuh"

namespace flashkda::cuda::sm90::prefill_v2 {
namespace {

constexpr int kRecordSpan = (ChunkOperands::kBytes + 1023) & ~1023;  // the scratch starts on the next 1024 B
// + up to 1023 bytes to align it: the dynamic shared array is guaranteed only 16-byte alignment.
constexpr int kSmemBytes = kRecordSpan + ProduceScratch::kBytes + 1024;

template <GateForm kGate, bool kF32Gate>
__global__ void __launch_bounds__(kThreads) produce_kernel(const __grid_constant__ ProduceArgs p) {
  extern __shared__ uint8_t smem_raw[];
  // Aligned by offsetting the shared array itself, so that every access stays a shared-memory one.
  uint8_t* const rec = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* const scratch = rec + kRecordSpan;
  const int tid = threadIdx.x, h = blockIdx.y;
  const int64_t chunk = blockIdx.x;
  produce_chunk<kGate, kF32Gate, CtaSync>(p, h, chunk, tid, rec, scratch);
  __syncthreads();
  if (tid == 0 && p.write_records) {
    bulk_store(static_cast<uint8_t*>(p.out) + (chunk * p.H + h) * ChunkOperands::kBytes, rec, ChunkOperands::kBytes);
    bulk_commit();
    bulk_wait_read<0>();
  }
}

// produce.h l_mqk_product_probe: one CTA of one warpgroup; the operand tiles at the scratch's offsets.
__global__ void __launch_bounds__(kThreads) l_mqk_probe_kernel(const uint32_t* a, const uint32_t* b, float* d) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* const scratch = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x;
  for (int i = tid; i < 2 * kChunk * kHeadDim; i += kThreads)
    *reinterpret_cast<uint32_t*>(scratch + ProduceScratch::kOffA + sw128_offset_f32(2 * kChunk, i / kHeadDim, i % kHeadDim)) = a[i];
  for (int i = tid; i < kChunk * kHeadDim; i += kThreads)
    *reinterpret_cast<uint32_t*>(scratch + ProduceScratch::kOffB + sw128_offset_f32(kChunk, i / kHeadDim, i % kHeadDim)) = b[i];
  fence_proxy_async_shared();
  __syncthreads();
  float acc[16];
  l_mqk_product(scratch, acc);
  // warp w holds rows 16 w + g (+ 8), columns 8 n + 2 t4 (+ 1): store_l_mqk_rows' map
  const int w = tid >> 5, g = (tid & 31) >> 2, t4 = tid & 3;
  for (int n = 0; n < 4; ++n)
    for (int half = 0; half < 2; ++half)
      for (int e = 0; e < 2; ++e) d[(16 * w + g + 8 * half) * kChunk + 8 * n + 2 * t4 + e] = acc[4 * n + 2 * half + e];
}

}  // namespace

cudaError_t l_mqk_product_probe(const uint32_t* a, const uint32_t* b, float* d, cudaStream_t stream) {
  constexpr int smem = ProduceScratch::kOffL + 1024;
  cudaError_t err = allow_dynamic_smem(l_mqk_probe_kernel, smem);
  if (err != cudaSuccess) return err;
  l_mqk_probe_kernel<<<1, kThreads, smem, stream>>>(a, b, d);
  return cudaGetLastError();
}

cudaError_t produce_chunks(const ProduceArgs& args, cudaStream_t stream) {
  if (args.T <= 0 || args.H <= 0) return cudaSuccess;
  if (args.q == nullptr || args.k == nullptr || args.g == nullptr || args.beta == nullptr || args.out == nullptr ||
      (args.gate != GateForm::kPrecomputed && args.A_log == nullptr))
    return cudaErrorInvalidValue;
  const bool f32 = args.g_type == ElemType::kF32;
  auto kernel = args.gate == GateForm::kLowerBound ? (f32 ? produce_kernel<GateForm::kLowerBound, true>
                                                          : produce_kernel<GateForm::kLowerBound, false>)
                : args.gate == GateForm::kSoftplus ? (f32 ? produce_kernel<GateForm::kSoftplus, true>
                                                          : produce_kernel<GateForm::kSoftplus, false>)
                                                   : (f32 ? produce_kernel<GateForm::kPrecomputed, true>
                                                          : produce_kernel<GateForm::kPrecomputed, false>);
  cudaError_t err = allow_dynamic_smem(kernel, kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((args.T + kChunk - 1) / kChunk), static_cast<unsigned>(args.H));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace flashkda::cuda::sm90::prefill_v2
