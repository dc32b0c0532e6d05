// The chunk-32 recurrence over the producer's records (consume.h) as a kernel of its own: grid =
// (2, H), one warpgroup per CTA owning 64 value rows of the state (consume.cuh's steps). Each
// chunk's record arrives by one bulk copy into a ring of two stages; v by 2-byte loads of the
// thread's own elements one chunk ahead. The range guard as today's K2: rows rescaled at the
// start, after the first chunk and every 16 chunks, and the fp32 fallback for a chunk whose W^T is
// not finite (consume_chunk).
#include "cuda/device_info.h"
#include "cuda/sm90/prefill_v2/consume.cuh"

namespace flashkda::cuda::sm90::prefill_v2 {
namespace {

constexpr int kStages = 2;
constexpr int kRecordSpan = (ChunkOperands::kBytes + 1023) & ~1023;
constexpr int kSmemBytes = kStages * kRecordSpan + 64 + 1024;  // + barriers, + the 1024-byte alignment

__global__ void __launch_bounds__(kThreads, 1) consume_kernel(const __grid_constant__ ConsumeArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* const ring = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* const full = reinterpret_cast<uint64_t*>(ring + kStages * kRecordSpan);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.y, v_row = 64 * blockIdx.x + 16 * warp + g;  // this thread's rows v_row, v_row + 8
  const int64_t num_chunks = (p.T + kChunk - 1) / kChunk;
  const uint8_t* const records = static_cast<const uint8_t*>(p.records);
  auto issue = [&](int64_t c) {
    uint64_t* bar = &full[c % kStages];
    mbarrier_arrive_expect_tx(bar, ChunkOperands::kBytes);
    bulk_copy(ring + (c % kStages) * kRecordSpan, records + (c * p.H + h) * int64_t(ChunkOperands::kBytes),
              ChunkOperands::kBytes, bar);
  };
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (tid == 0 && num_chunks > 0) issue(0);

  float S[64];
  prefill::load_state_rows(S, p.initial_state, p.initial_state ? ElemType::kF32 : ElemType::kNone,
                           int64_t(h) * kHeadDim * kHeadDim, v_row, t4);
  prefill::RowScale rs;
  float v_next[16];
  if (num_chunks > 0) load_v_slots(p, 0, h, v_row, t4, v_next);

  for (int64_t c = 0; c < num_chunks; ++c) {
    float v_cur[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v_cur[i] = v_next[i];
    if (c + 1 < num_chunks) load_v_slots(p, c + 1, h, v_row, t4, v_next);
    __syncthreads();  // every thread is done with the stage chunk c + 1 refills (chunk c - 1's)
    if (tid == 0 && c + 1 < num_chunks) issue(c + 1);
    if (c <= 1 || c % prefill::kRenormChunks == 0) rs.renormalise(S);
    mbarrier_wait(&full[c % kStages], uint32_t(c / kStages) & 1);
    __nv_bfloat16 o[16];
    const uint8_t* const rec = ring + (c % kStages) * kRecordSpan;
    consume_chunk(p, h, c, v_row, t4, rec, rec + ChunkOperands::kOffInvB, [&](int i) { return v_cur[i]; }, S, rs, o);
    store_out_slots(p, h, c, v_row, t4, o);
  }
  if (p.final_state != nullptr)
    prefill::store_state_rows(S, p.final_state, ElemType::kF32, int64_t(h) * kHeadDim * kHeadDim, v_row, t4, rs.inv);
}

}  // namespace

cudaError_t consume_chunks(const ConsumeArgs& args, cudaStream_t stream) {
  if (args.T <= 0 || args.H <= 0) return cudaSuccess;
  if (args.records == nullptr || args.v == nullptr || args.out == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = allow_dynamic_smem(consume_kernel, kSmemBytes);
  if (err != cudaSuccess) return err;
  consume_kernel<<<dim3(2, static_cast<unsigned>(args.H)), kThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace flashkda::cuda::sm90::prefill_v2
