// Host side of the sm90 decode kernel: resolves DecodeParams into kernel arguments, picks the
// state-dtype variant, launches on the caller's stream (no sync, no allocation: graph capturable).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "backend.h"
#include "cuda/check.h"
#include "cuda/device_info.h"
#include "cuda/sm90/decode/config.h"
#include "cuda/sm90/decode/kernel.cuh"

namespace flashkda::cuda {
namespace {

sm90::decode::DecodeArgs make_args(const DecodeParams& p) {
  sm90::decode::DecodeArgs a{};
  a.q = p.q, a.k = p.k, a.v = p.v, a.g = p.g, a.beta = p.beta, a.out = p.out;
  a.state_pool = p.state_pool;
  a.state_indices = p.state_indices;
  a.num_accepted_tokens = p.num_accepted_tokens;
  a.cu_seqlens = p.cu_seqlens;
  a.indices_stride = p.indices_stride;
  a.pool_size = p.pool_size;
  a.tokens_per_seq = p.T;
  a.num_seqs = p.num_seqs;
  // Stage capacity: every token of a valid sequence (1..16; with cu_seqlens no sequence is longer
  // than the total T). Sized on the host so T = 1 decode uses ~1 KB of shared memory, not 17 KB.
  a.stage_tokens = static_cast<int32_t>(std::clamp<int64_t>(p.T, 1, sm90::decode::kMaxTokens));
  a.H = static_cast<int32_t>(p.H);
  a.cu_seqlens_i64 = p.cu_seqlens_dtype == DType::kI64;
  a.g_is_f32 = p.g_dtype == DType::kF32;
  a.beta_is_f32 = p.beta_dtype == DType::kF32;
  a.scale = detail::effective_scale(p.pre, p.K);
  a.pre = p.pre;
  return a;
}

template <typename StateT, class TileT, bool kCheck>
void launch(const sm90::decode::DecodeArgs& args, int64_t num_heads, cudaStream_t stream) {
  using namespace sm90::decode;
  const int64_t ctas = num_heads * TileT::kCtasPerHead;
  FLASHKDA_CHECK(ctas <= std::numeric_limits<int32_t>::max(), ErrorCode::kUnsupported, "decode: num_seqs * H = ",
                 num_heads, " exceeds the GPU grid limit");
  static_assert(kMaxTokens * sizeof(StagedToken) <= 48 * 1024, "dynamic smem above 48 KB needs an opt-in");
  const size_t smem = size_t(args.stage_tokens) * sizeof(StagedToken);
  decode_kernel<StateT, TileT, kCheck><<<static_cast<unsigned>(ctas), kThreads, smem, stream>>>(args);
  FLASHKDA_CHECK_LAUNCH();
}

// CTAs of the persistent kernel resident per SM for a stage capacity (1..16): queried once per
// capacity and cached (not a stream operation, so it is allowed under graph capture).
template <typename StateT, class TileT, bool kCheck>
int persistent_ctas_per_sm(int stage_tokens, size_t smem) {
  static std::atomic<int> cache[sm90::decode::kMaxTokens + 1] = {};
  int n = cache[stage_tokens].load(std::memory_order_relaxed);
  if (n == 0) {
    FLASHKDA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, sm90::decode::decode_persistent_kernel<StateT, TileT, kCheck>, sm90::decode::kThreads, smem));
    n = std::max(n, 1);
    cache[stage_tokens].store(n, std::memory_order_relaxed);
  }
  return n;
}

template <typename StateT, class TileT, bool kCheck>
void launch_persistent(const sm90::decode::DecodeArgs& args, int64_t num_heads, cudaStream_t stream) {
  using namespace sm90::decode;
  const int64_t items = num_heads * TileT::kCtasPerHead;
  // The kernel's item numbers are 32-bit (coord_of with H's FastDiv32), as the tile kernels' CTAs.
  FLASHKDA_CHECK(items <= std::numeric_limits<int32_t>::max(), ErrorCode::kUnsupported, "decode: num_seqs * H = ",
                 num_heads, " exceeds the GPU backend's item limit");
  const size_t smem = PersistentLayout<TileT, StateT>::bytes(args.stage_tokens);
  auto kernel = decode_persistent_kernel<StateT, TileT, kCheck>;
  FLASHKDA_CUDA_CHECK(allow_dynamic_smem(kernel, int(smem)));
  const int64_t grid =
      std::min<int64_t>(items, int64_t(sm_count()) *
                                   persistent_ctas_per_sm<StateT, TileT, kCheck>(args.stage_tokens, smem));
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(args, items);
  FLASHKDA_CHECK_LAUNCH();
}

// The bulk-copy kernel (internal::DecodeLaunch::persistent = 2 with four buffers, 3 with three; a
// candidate): items of 16 KB, i.e. 64 rows of a bf16 state or 32 rows of an fp32 one.
template <typename StateT>
using BulkTile = std::conditional_t<sizeof(StateT) == 2, sm90::decode::PersistentLargeTile, sm90::decode::BulkSmallTile>;

template <typename StateT, int kRing, bool kCheck>
int bulk_ctas_per_sm(int stage_tokens, size_t smem) {
  static std::atomic<int> cache[sm90::decode::kMaxTokens + 1] = {};
  int n = cache[stage_tokens].load(std::memory_order_relaxed);
  if (n == 0) {
    FLASHKDA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, sm90::decode::decode_bulk_kernel<StateT, BulkTile<StateT>, kRing, kCheck>, sm90::decode::kThreads, smem));
    n = std::max(n, 1);
    cache[stage_tokens].store(n, std::memory_order_relaxed);
  }
  return n;
}

template <typename StateT, int kRing, bool kCheck>
void launch_bulk(const sm90::decode::DecodeArgs& args, int64_t num_heads, cudaStream_t stream) {
  using namespace sm90::decode;
  using TileT = BulkTile<StateT>;
  const int64_t items = num_heads * TileT::kCtasPerHead;
  // The kernel's item numbers are 32-bit (coord_of with H's FastDiv32), as the tile kernels' CTAs.
  FLASHKDA_CHECK(items <= std::numeric_limits<int32_t>::max(), ErrorCode::kUnsupported, "decode: num_seqs * H = ",
                 num_heads, " exceeds the GPU backend's item limit");
  const size_t smem = BulkLayout<TileT, StateT, kRing>::bytes(args.stage_tokens);
  auto kernel = decode_bulk_kernel<StateT, TileT, kRing, kCheck>;
  FLASHKDA_CUDA_CHECK(allow_dynamic_smem(kernel, int(smem)));
  const int64_t grid = std::min<int64_t>(items, int64_t(sm_count()) * bulk_ctas_per_sm<StateT, kRing, kCheck>(args.stage_tokens, smem));
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(args, items);
  FLASHKDA_CHECK_LAUNCH();
}

// bf16 pools with N·H in [kBulkMinHeads, kBulkMaxHeads] take the bulk-copy kernel with three
// buffers, from kPersistentMinHeads the persistent kernel (config.h); an internal launch
// configuration can force any of them (the tile kernels, the persistent kernel or its bulk-copy
// variant).
bool use_bulk(bool bf16_state, int64_t num_heads, const internal::DecodeLaunch& config) {
  return config.persistent < 0 && bf16_state && num_heads >= sm90::decode::kBulkMinHeads &&
         num_heads <= sm90::decode::kBulkMaxHeads;
}

bool use_persistent(bool bf16_state, int64_t num_heads, const internal::DecodeLaunch& config) {
  if (config.persistent >= 0) return config.persistent >= 1;
  return bf16_state && num_heads >= sm90::decode::kPersistentMinHeads;
}

template <typename StateT, bool kCheck>
void launch_tile_as(const sm90::decode::DecodeArgs& args, int64_t num_heads, const internal::DecodeLaunch& config,
                    cudaStream_t stream) {
  using namespace sm90::decode;
  const bool large = num_heads >= kLargeTileMinHeads;
  if (config.persistent == 2) {
    launch_bulk<StateT, 4, kCheck>(args, num_heads, stream);
  } else if (config.persistent == 3 || use_bulk(sizeof(StateT) == 2, num_heads, config)) {
    launch_bulk<StateT, 3, kCheck>(args, num_heads, stream);
  } else if (use_persistent(sizeof(StateT) == 2, num_heads, config)) {
    if (large) launch_persistent<StateT, PersistentLargeTile, kCheck>(args, num_heads, stream);
    else launch_persistent<StateT, SmallTile, kCheck>(args, num_heads, stream);
  } else if (large) {
    launch<StateT, LargeTile, kCheck>(args, num_heads, stream);
  } else {
    launch<StateT, SmallTile, kCheck>(args, num_heads, stream);
  }
}

// The slot check (kernel.cuh: a sequence that shares a live slot with another gets NaN outputs and
// stores nothing) runs wherever two or more sequences could share a slot, unless the caller says
// they do not (DecodeParams::check_slots = false): the rule (internal::DecodeLaunch::check_slots =
// 0); 1 forces it, -1 leaves it out.
bool checks_slots(const DecodeParams& p, const internal::DecodeLaunch& config) {
  return config.check_slots > 0 || (config.check_slots == 0 && p.check_slots && p.num_seqs >= 2);
}

template <typename StateT>
void launch_tile(const sm90::decode::DecodeArgs& args, int64_t num_heads, bool check,
                 const internal::DecodeLaunch& config, cudaStream_t stream) {
  if (check) launch_tile_as<StateT, true>(args, num_heads, config, stream);
  else launch_tile_as<StateT, false>(args, num_heads, config, stream);
}

}  // namespace

void decode(const DecodeParams& p, const internal::DecodeLaunch& config, Stream stream) {
  if (p.num_seqs == 0) return;
  FLASHKDA_CHECK(p.H <= std::numeric_limits<int32_t>::max(), ErrorCode::kUnsupported, "decode: H=", p.H,
                 " is too large for the GPU backend");
  const sm90::decode::DecodeArgs args = make_args(p);
  const int64_t num_heads = p.num_seqs * p.H;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.state_dtype == DType::kF32) {
    launch_tile<float>(args, num_heads, checks_slots(p, config), config, s);
  } else {
    launch_tile<__nv_bfloat16>(args, num_heads, checks_slots(p, config), config, s);
  }
}

}  // namespace flashkda::cuda
