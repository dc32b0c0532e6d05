// Host side of the sm90 prefill: workspace layout, kernel parameters, K0/K1/K2 launches and
// the choice of the recurrence variant (value-column split, precision mode).
#include <cstring>

#include "backend.h"
#include "cuda/common/check.h"
#include "cuda/common/host_env.h"
#include "cuda/sm90/prefill/launch.h"
#include "cuda/sm90/prefill/prepare_kernel.cuh"

namespace flashkda::sm90::prefill {

template <bool kPrecise>
void launch_prepare(const Params& p, cudaStream_t stream) {
  if (p.cu_seqlens != nullptr) {
    chunk_scan_kernel<<<1, kScanThreads, 0, stream>>>(p);
    FLASHKDA_CHECK_LAUNCH();
  }
  const int64_t blocks = p.chunk_slots * p.H;
  if (blocks == 0) return;
  constexpr int smem = sizeof(PrepareSmem);
  auto kernel = prepare_kernel<kPrecise>;
  FLASHKDA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<unsigned(blocks), kPrepThreads, smem, stream>>>(p);
  FLASHKDA_CHECK_LAUNCH();
}

namespace {

ElemType elem_type(const void* ptr, DType t) {
  if (ptr == nullptr) return ElemType::kNone;
  return t == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
}

using flashkda::cuda::env_int;

// Warps per recurrence CTA: two warpgroups (all 128 value columns) or one (a half, two CTAs per
// head). Every value-column split re-reads the whole chunk record (23 KB per chunk), so splits
// trade SM count for L2/DRAM traffic; split in two only when N*H leaves most SMs idle.
// FLASHKDA_V_SPLITS (1 or 2) overrides.
int choose_warps(int64_t work) {
  int splits = (2 * work <= int64_t(flashkda::cuda::sm_count())) ? 2 : 1;
  const int forced = env_int("FLASHKDA_V_SPLITS", 0);
  if (forced == 1 || forced == 2) splits = forced;
  return 8 / splits;
}

// K1 writes the mode's record layout and K2 reads it (config.h RecordLayout).
template <bool kPrecise>
void launch_mode(int warps, const Params& kp, cudaStream_t stream) {
  launch_prepare<kPrecise>(kp, stream);
  if (warps == 8) launch_recur<8, kPrecise>(kp, stream);
  else launch_recur<4, kPrecise>(kp, stream);
}

}  // namespace
}  // namespace flashkda::sm90::prefill

namespace flashkda::cuda {

using namespace flashkda::sm90::prefill;

size_t prefill_workspace_size(const PrefillParams& p) {
  const int64_t N = detail::num_sequences(p);
  const int64_t slots = max_chunk_slots(p.B * p.T, N);
  return header_bytes(N) + size_t(slots) * size_t(p.H) * kMaxRecordBytes;  // either mode's records fit
}

void forward(const PrefillParams& p, void* workspace, size_t, Stream stream_handle) {
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const int64_t N = detail::num_sequences(p);
  auto* ws = static_cast<uint8_t*>(workspace);

  Params kp{};
  kp.q = p.q, kp.k = p.k, kp.v = p.v, kp.g = p.g, kp.beta = p.beta, kp.out = p.out;
  kp.g_type = p.g_dtype == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
  kp.beta_type = p.beta_dtype == DType::kF32 ? ElemType::kF32 : ElemType::kBF16;
  kp.A_log = p.pre.A_log, kp.dt_bias = p.pre.dt_bias;
  kp.initial_state = p.initial_state;
  kp.initial_state_type = elem_type(p.initial_state, p.initial_state_dtype);
  kp.final_state = p.final_state;
  kp.final_state_type = elem_type(p.final_state, p.final_state_dtype);
  kp.cu_seqlens = p.cu_seqlens;
  kp.cu_seqlens_64 = p.cu_seqlens_dtype == DType::kI64;
  kp.num_seqs = N;
  kp.seq_len = p.T;
  kp.total_tokens = p.B * p.T;
  kp.H = int(p.H);
  kp.gate = static_cast<Gate>(int(p.pre.gate));
  kp.lower_bound = p.pre.lower_bound;
  kp.l2norm_qk = p.pre.l2norm_qk;
  kp.beta_is_logit = p.pre.beta_is_logit;
  kp.scale = detail::effective_scale(p.pre, p.K);
  kp.chunk_start = reinterpret_cast<int32_t*>(ws);
  kp.error_flag = kp.chunk_start + (N + 1);
  kp.records = ws + header_bytes(N);
  kp.chunk_slots = max_chunk_slots(kp.total_tokens, N);

  const int warps = choose_warps(N * p.H);
  // FLASHKDA_PRECISE=0|1 overrides the caller's choice (for experiments and benchmarks).
  const int forced = env_int("FLASHKDA_PRECISE", -1);
  if (forced >= 0 ? forced != 0 : p.precision == Precision::kPrecise) launch_mode<true>(warps, kp, stream);
  else launch_mode<false>(warps, kp, stream);
}

}  // namespace flashkda::cuda
