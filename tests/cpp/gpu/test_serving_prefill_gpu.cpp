// Serving prefill on the GPU (docs/SPEC.md §9): prefill against a state pool (slots, padding,
// has_initial_state), checkpoints dense and into pool slots, serial and in segments, and a
// checkpoint count that does not match the lengths. Bit for bit against the GPU's own plain prefill
// where the kernels compute the same thing (gather -> prefill -> scatter; a serial prefill cut at
// a checkpoint), against the fp64 reference elsewhere. Skips with a reason when no Hopper GPU is
// visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "device_problem.h"
#include "kda_test_utils.h"
#include "serving_test_utils.h"
#include "cuda/sm90/prefill_v2/fused.h"
#include "launch_config.h"

namespace flashkda::test {
namespace {

using namespace serving;

class ServingPrefillGpu : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU visible: GPU serving prefill tests skipped";
  }
};

// A pool problem on the GPU: varlen inputs, P slots of random states (untouched slots keep their
// bytes), sequence `padding` with slot -1 and sequence `past_pool` with slot P (padding too, as in
// decode), has_initial_state alternating. `decaying`: head 0's gates near -1 per token on every
// channel (A_log = -1), so that transition skipping has pieces to skip whatever the random draw.
struct PoolCase {
  static KdaInputs pool_inputs(const std::vector<int64_t>& seqlens, bool decaying) {
    KdaInputs in(pool_options(seqlens));
    if (decaying) in.A_log[0] = -1.0f;
    return in;
  }

  KdaInputs in;
  DeviceProblem dev;
  HostTensor pool, pool_before;
  std::vector<int32_t> slots;
  std::vector<char> has_init;
  int64_t P;
  void *d_pool, *d_slots, *d_has;

  PoolCase(const std::vector<int64_t>& seqlens, DType pool_dtype, int64_t P_, int padding, int past_pool,
           internal::PrefillLaunch launch = {}, bool decaying = false)
      : in(pool_inputs(seqlens, decaying)), dev(in, launch), P(P_) {
    pool = random_pool(pool_dtype, P, in.seed + 1);
    pool_before = pool;
    std::vector<int32_t> perm(P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(in.seed + 2));
    for (int64_t n = 0; n < in.N; ++n) slots.push_back(n == padding ? -1 : n == past_pool ? int32_t(P) : perm[n]);
    for (int64_t n = 0; n < in.N; ++n) has_init.push_back(n % 3 != 1);
    d_pool = dev.upload(pool.bytes.data(), pool.bytes.size());
    d_slots = dev.upload(slots.data(), slots.size() * 4);
    d_has = dev.upload(has_init.data(), has_init.size());
  }

  bool live(int64_t n) const { return slots[n] >= 0 && slots[n] < P; }
  bool slot_named(int64_t s) const { return std::find(slots.begin(), slots.end(), int32_t(s)) != slots.end(); }

  PrefillParams params() const {
    PrefillParams p = dev.params();
    p.state_pool = d_pool, p.state_pool_dtype = pool.dtype, p.pool_size = P;
    p.state_indices = static_cast<const int32_t*>(d_slots);
    p.has_initial_state = static_cast<const bool*>(d_has);
    return p;
  }

  // Runs p (workspace sized for it) and copies out and the pool back.
  void run(const PrefillParams& p, internal::PrefillLaunch launch) {
    DeviceBuffer ws(internal::workspace_size(p, launch));
    internal::forward(p, launch, ws.ptr, ws.bytes);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dev.download();
    cudaMemcpy(pool.bytes.data(), d_pool, pool.bytes.size(), cudaMemcpyDeviceToHost);
  }

  // The pool call through `launch` on poisoned outputs: {out, pool} after it, with the guards intact,
  // padding sequences' output rows zero and slots no sequence names unchanged.
  std::pair<HostTensor, HostTensor> checked_pool_call(internal::PrefillLaunch launch) {
    dev.poison();
    run(params(), launch);
    EXPECT_TRUE(in.out.guard_intact() && pool.guard_intact());
    expect_padding_rows_zero(in.out);
    expect_unnamed_slots_untouched(pool);
    return {in.out, pool};
  }

  // The same problem on the host for the fp64 reference: the pool is `ref_pool` (a host copy of
  // pool_before), read and written through `host_slots` (slots, or a copy with past-pool slots
  // made padding, which the reference refuses).
  PrefillParams host_params(HostTensor& ref_pool, const std::vector<int32_t>& host_slots) {
    PrefillParams host = in.params();
    host.state_pool = ref_pool.data(), host.state_pool_dtype = pool.dtype, host.pool_size = P;
    host.state_indices = host_slots.data();
    host.has_initial_state = reinterpret_cast<const bool*>(has_init.data());
    return host;
  }

  // Padding sequences' output rows are zero.
  void expect_padding_rows_zero(const HostTensor& out_pool) const {
    for (int64_t n = 0; n < in.N; ++n) {
      if (live(n)) continue;
      const Range r = range_of(in, n);
      for (int64_t i = r.bos * kH * kV; i < r.eos * kH * kV; ++i) ASSERT_EQ(out_pool.get(i), 0.0) << "padding output row " << n;
    }
  }

  // Live sequences' outputs and final states bit for bit those of the plain prefill (in.out, fin).
  void expect_live_match_plain(const HostTensor& out_pool, const HostTensor& pool_after, const HostTensor& fin) const {
    for (int64_t n = 0; n < in.N; ++n) {
      if (!live(n)) continue;
      const Range r = range_of(in, n);
      const int64_t first = r.bos * kH * kV, count = r.len() * kH * kV;
      EXPECT_TRUE(same_bytes(out_pool, first, in.out, first, count)) << "output of sequence " << n;
      EXPECT_TRUE(same_bytes(pool_after, slots[n] * kState, fin, n * kState, kState))
          << "final state of sequence " << n << " in slot " << slots[n];
    }
  }

  // Slots no sequence names keep their bytes.
  void expect_unnamed_slots_untouched(const HostTensor& pool_after) const {
    for (int64_t s = 0; s < P; ++s)
      if (!slot_named(s)) EXPECT_TRUE(same_bytes(pool_after, s * kState, pool_before, s * kState, kState)) << "slot " << s;
  }

  // The call's rel-RMS errors against the fp64 reference on pool_before: {output, final states in
  // their slots}; slots past the pool become padding there, which the reference refuses otherwise.
  std::pair<double, double> reference_errors(const HostTensor& out_pool, const HostTensor& pool_after) {
    std::vector<double> ref_out(in.out.count), ref_state(size_t(in.N * kState));
    std::vector<int32_t> host_slots = slots;
    for (int32_t& s : host_slots) s = s < P ? s : -1;
    HostTensor ref_pool = pool_before;
    reference_forward(host_params(ref_pool, host_slots), ref_out.data(), ref_state.data());
    return {rel_rms(out_pool.values(), ref_out), rel_rms(states_in_slots(pool_after, slots, P), ref_state)};
  }

  void reset_pool() {
    pool = pool_before;
    cudaMemcpy(d_pool, pool.bytes.data(), pool.bytes.size(), cudaMemcpyHostToDevice);
  }

  // The plain prefill of the same inputs from the gathered states (zeros where a sequence reads
  // none), on the GPU: out into in.out, final states [N][H][V][K] in the pool's dtype.
  HostTensor plain_prefill(internal::PrefillLaunch launch) {
    HostTensor init(pool.dtype, in.N * kState), fin(pool.dtype, in.N * kState);
    for (int64_t n = 0; n < in.N; ++n)
      for (int64_t i = 0; i < kState; ++i)
        init.set(n * kState + i, live(n) && has_init[n] ? pool_before.get(slots[n] * kState + i) : 0.0);
    DeviceBuffer d_init(init.bytes.size()), d_fin(fin.bytes.size());
    cudaMemcpy(d_init.ptr, init.bytes.data(), init.bytes.size(), cudaMemcpyHostToDevice);
    PrefillParams p = dev.params();
    p.initial_state = d_init.ptr, p.initial_state_dtype = pool.dtype;
    p.final_state = d_fin.ptr, p.final_state_dtype = pool.dtype;
    dev.poison();
    DeviceBuffer ws(internal::workspace_size(p, launch));
    internal::forward(p, launch, ws.ptr, ws.bytes);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dev.download();
    cudaMemcpy(fin.bytes.data(), d_fin.ptr, fin.bytes.size(), cudaMemcpyDeviceToHost);
    return fin;
  }
};

// The serving prefill's tests hold the chunk-16 kernels' pools and checkpoints to each other and to the
// plain call bit for bit: their calls run without the fused kernel's few-head pieces unless a test
// forces the fused kernel or its pieces (DeviceProblem::chunk16_rule; test_prefill32_gpu tests the
// pieces through pools).
[[maybe_unused]] const bool kChunk16Rule = (DeviceProblem::chunk16_rule = true);
const internal::PrefillLaunch kSerial{0, -1};

// Pool prefill == gather -> plain prefill -> scatter on the GPU, bit for bit, serial and in
// segments; padding rows (slot -1, and a slot past the pool) are zero; slots not named keep their
// bytes; and against the fp64 reference.
TEST_P(ServingPrefillGpu, PoolMatchesGatherPrefillScatter) {
  for (const internal::PrefillLaunch launch : {kSerial, internal::PrefillLaunch{0, 3}, internal::PrefillLaunch{}}) {
    PoolCase c({37, 130, 0, 64, 200, 16, 300}, GetParam(), 11, /*padding=*/3, /*past_pool=*/5, launch);
    SCOPED_TRACE(c.in.describe() + " segment_chunks=" + std::to_string(launch.segment_chunks));
    const auto [out_pool, pool_after] = c.checked_pool_call(launch);
    c.expect_live_match_plain(out_pool, pool_after, c.plain_prefill(launch));
    const auto [e_out, e_state] = c.reference_errors(out_pool, pool_after);
    report("gpu pool out rel-RMS", e_out);
    report("gpu pool state rel-RMS", e_state);
    EXPECT_LT(e_out, 6e-3);
    EXPECT_LT(e_state, GetParam() == DType::kBF16 ? 6e-3 : 1e-4);
  }
}

// The fused chunk-32 kernel over a pool (internal fused_v2 = 1: the rule would leave this small call
// to the chunk-16 kernels): padding rows zero (slot -1 and a slot past the pool), slots not named keep their bytes,
// and against the fp64 reference; with fp32 states bit for bit the fused plain prefill from the
// gathered states (a bf16 pool's plain prefill would need bf16 states, which the fused kernel leaves
// to the chunk-16 kernels).
TEST_P(ServingPrefillGpu, FusedPoolPrefill) {
  internal::PrefillLaunch fused;
  fused.fused_v2 = 1;
  // sequence 1 is empty and reads no initial state (has_initial_state is n % 3 != 1): zeros go to its slot
  PoolCase c({37, 0, 130, 64, 200, 16, 300}, GetParam(), 11, /*padding=*/3, /*past_pool=*/5, fused);
  SCOPED_TRACE(c.in.describe());
  ASSERT_TRUE(cuda::sm90::prefill_v2::fused_serves(c.params()));
  const auto [out_pool, pool_after] = c.checked_pool_call(fused);
  if (GetParam() == DType::kF32) {
    const HostTensor fin = c.plain_prefill(fused);  // overwrites c.in.out with the plain call's outputs
    c.expect_live_match_plain(out_pool, pool_after, fin);
  }
  const auto [e_out, e_state] = c.reference_errors(out_pool, pool_after);
  report("gpu fused pool out rel-RMS", e_out);
  report("gpu fused pool state rel-RMS", e_state);
  EXPECT_LT(e_out, 2e-3);
  EXPECT_LT(e_state, GetParam() == DType::kBF16 ? 6e-3 : 5e-4);
}

// Checkpoints through the fused chunk-32 kernel (internal fused_v2 = 1; the rule would leave this
// small call to the chunk-16 kernels), over a pool with device cu_seqlens, so K0 numbers each
// sequence's first checkpoint: dense ones, with fp32 states each the final state of the fused
// prefill cut at its position, bit for bit (the chunks up to there are the same); padding
// sequences' dense checkpoints zero; into pool slots (every other one skipped, one past the pool)
// the dense ones; against the fp64 reference. Then without cu_seqlens or a pool, one sequence (the
// one-sequence kernel) and a batch of two (first checkpoint n T / every): each sequence's last
// checkpoint is its final state, bit for bit, and all against the reference.
TEST_P(ServingPrefillGpu, FusedCheckpoints) {
  const DType dtype = GetParam();
  internal::PrefillLaunch fused;
  fused.fused_v2 = 1;
  PoolCase c({200, 64, 0, 130, 63, 256, 1030}, dtype, 12, /*padding=*/3, /*past_pool=*/-1, fused);
  SCOPED_TRACE(c.in.describe());
  PrefillParams p = c.params();
  p.checkpoint_every = 64;
  const int64_t count = 3 + 1 + 0 + 2 + 0 + 4 + 16;
  HostTensor dense(dtype, count * kState);
  void* d_dense = c.dev.upload(dense.bytes.data(), dense.bytes.size());  // poisoned with its guard bytes
  p.checkpoints = d_dense, p.checkpoint_dtype = dtype, p.num_checkpoints = count;
  ASSERT_TRUE(cuda::sm90::prefill_v2::fused_serves(p));
  c.dev.poison();
  c.run(p, fused);
  cudaMemcpy(dense.bytes.data(), d_dense, dense.bytes.size(), cudaMemcpyDeviceToHost);
  EXPECT_TRUE(dense.guard_intact());
  EXPECT_EQ(count_nonfinite(dense.values()), 0);
  const HostTensor out_pool = c.in.out, pool_after = c.pool;

  int64_t ck = 0;
  std::vector<int64_t> owner;
  for (int64_t n = 0; n < c.in.N; ++n) {
    const Range r = range_of(c.in, n);
    for (int64_t j = 0; j < r.len() / 64; ++j, ++ck) {
      owner.push_back(n);
      if (!c.live(n)) {
        for (int64_t i = 0; i < kState; ++i) ASSERT_EQ(dense.get(ck * kState + i), 0.0) << "padding checkpoint " << ck;
        continue;
      }
      // fp32 states only: a bf16 pool's cut prefill would need bf16 states, which the fused kernel
      // leaves to the chunk-16 kernels (other bits).
      if (dtype != DType::kF32 || (j > 3 && j + 1 < r.len() / 64)) continue;
      KdaInputs cut = cut_sequence(c.in, r, 64 * (j + 1));
      DeviceProblem dcut(cut, fused);
      HostTensor h0(dtype, kState), ht(dtype, kState);
      for (int64_t i = 0; i < kState; ++i) h0.set(i, c.has_init[n] ? c.pool_before.get(c.slots[n] * kState + i) : 0.0);
      void* d_h0 = dcut.upload(h0.bytes.data(), h0.bytes.size());
      void* d_ht = dcut.upload(ht.bytes.data(), ht.bytes.size());
      PrefillParams q = dcut.params();
      q.initial_state = d_h0, q.initial_state_dtype = dtype;
      q.final_state = d_ht, q.final_state_dtype = dtype;
      ASSERT_TRUE(cuda::sm90::prefill_v2::fused_serves(q));
      DeviceBuffer ws(internal::workspace_size(q, fused));
      internal::forward(q, fused, ws.ptr, ws.bytes);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cudaMemcpy(ht.bytes.data(), d_ht, ht.bytes.size(), cudaMemcpyDeviceToHost);
      EXPECT_TRUE(same_bytes(dense, ck * kState, ht, 0, kState)) << "checkpoint " << ck << " (sequence " << n
                                                                  << ", after " << 64 * (j + 1) << " tokens)";
    }
  }
  ASSERT_EQ(ck, count);

  std::vector<double> ref_out(c.in.out.count), ref_ck(size_t(count * kState), std::nan(""));
  std::vector<double> ref_state(size_t(c.in.N * kState));
  HostTensor ref_pool = c.pool_before;
  PrefillParams host = c.host_params(ref_pool, c.slots);
  host.checkpoint_every = 64, host.num_checkpoints = count;
  reference_forward(host, ref_out.data(), ref_state.data(), ref_ck.data());
  const double tol = dtype == DType::kBF16 ? 6e-3 : 5e-4;
  const double e = rel_rms(dense.values(), ref_ck);
  report("gpu fused checkpoints rel-RMS", e);
  EXPECT_LT(e, tol);
  EXPECT_LT(rel_rms(out_pool.values(), ref_out), 2e-3);
  EXPECT_LT(rel_rms(states_in_slots(pool_after, c.slots, c.P), ref_state), tol);

  // Into pool slots: the free slots, every other checkpoint skipped (-1), one past the pool.
  std::vector<int32_t> free_slots;
  for (int64_t s = 0; s < c.P; ++s)
    if (!c.slot_named(s)) free_slots.push_back(int32_t(s));
  std::vector<int32_t> ck_slots(size_t(count), -1);
  for (int64_t i = 0, f = 0; i < count && f < int64_t(free_slots.size()); i += 2) ck_slots[i] = free_slots[f++];
  ck_slots[1] = int32_t(c.P);
  c.reset_pool();
  PrefillParams ps = c.params();
  ps.checkpoint_every = 64;
  ps.checkpoint_slots = static_cast<const int32_t*>(c.dev.upload(ck_slots.data(), ck_slots.size() * 4));
  ps.num_checkpoints = count;
  ASSERT_TRUE(cuda::sm90::prefill_v2::fused_serves(ps));
  c.run(ps, fused);
  for (int64_t i = 0; i < count; ++i) {
    const int32_t s = ck_slots[i];
    if (s < 0 || s >= c.P) continue;
    if (!c.live(owner[i])) {
      EXPECT_TRUE(same_bytes(c.pool, s * kState, c.pool_before, s * kState, kState)) << "padding checkpoint slot " << i;
    } else {
      EXPECT_TRUE(same_bytes(c.pool, s * kState, dense, i * kState, kState)) << "checkpoint slot " << i;
    }
  }
  for (int32_t s : free_slots)
    if (std::find(ck_slots.begin(), ck_slots.end(), s) == ck_slots.end())
      EXPECT_TRUE(same_bytes(c.pool, s * kState, c.pool_before, s * kState, kState)) << "unnamed slot " << s;

  // Without cu_seqlens or a pool: B sequences of 320 tokens, fp32 states, checkpoints every 64.
  for (const int64_t B : {int64_t(1), int64_t(2)}) {
    KdaOptions o;
    o.B = B, o.T = 320, o.H = kH;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    DeviceProblem d(in, fused);
    const int64_t per = o.T / 64, n_ck = B * per;
    HostTensor cks(dtype, n_ck * kState);
    void* d_cks = d.upload(cks.bytes.data(), cks.bytes.size());
    PrefillParams pb = d.params();
    pb.checkpoint_every = 64, pb.checkpoints = d_cks, pb.checkpoint_dtype = dtype, pb.num_checkpoints = n_ck;
    ASSERT_TRUE(cuda::sm90::prefill_v2::fused_serves(pb));
    d.poison();
    DeviceBuffer ws(internal::workspace_size(pb, fused));  // checkpoints: more than d's workspace
    internal::forward(pb, fused, ws.ptr, ws.bytes);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    d.download();
    cudaMemcpy(cks.bytes.data(), d_cks, cks.bytes.size(), cudaMemcpyDeviceToHost);
    EXPECT_TRUE(cks.guard_intact());
    EXPECT_EQ(count_nonfinite(cks.values()), 0);
    if (dtype == DType::kF32)
      for (int64_t n = 0; n < B; ++n)
        EXPECT_TRUE(same_bytes(cks, (n * per + per - 1) * kState, in.final_state, n * kState, kState))
            << "the last checkpoint of sequence " << n << " against its final state";
    std::vector<double> r_out(in.out.count), r_state(size_t(B * kState)), r_ck(size_t(n_ck * kState), std::nan(""));
    PrefillParams hb = in.params();
    hb.checkpoint_every = 64, hb.num_checkpoints = n_ck;
    reference_forward(hb, r_out.data(), r_state.data(), r_ck.data());
    const double eb = rel_rms(cks.values(), r_ck);
    report("gpu fused checkpoints B=" + std::to_string(B) + " rel-RMS", eb);
    EXPECT_LT(eb, tol);
  }
}

// Checkpoints, serial: each equals the final state of the same GPU prefill cut at its position, bit
// for bit (the chunks up to there are the same); padding sequences' dense checkpoints are zero;
// the same checkpoints into pool slots (every other one skipped) equal the dense ones; and in
// segments (lengths that divide checkpoint_every, and lengths that do not, with the checkpoints
// inside segments from their partial transitions) they match the fp64 reference.
TEST_P(ServingPrefillGpu, CheckpointsEqualTruncatedPrefill) {
  const DType dtype = GetParam();
  PoolCase c({200, 64, 0, 130, 63, 256, 1030}, dtype, 12, /*padding=*/3, /*past_pool=*/-1, kSerial,
             /*decaying=*/true);
  SCOPED_TRACE(c.in.describe());
  PrefillParams p = c.params();
  p.checkpoint_every = 64;
  const int64_t count = 3 + 1 + 0 + 2 + 0 + 4 + 16;
  HostTensor dense(dtype, count * kState);
  void* d_dense = c.dev.upload(dense.bytes.data(), dense.bytes.size());  // poisoned with its guard bytes
  p.checkpoints = d_dense, p.checkpoint_dtype = dtype, p.num_checkpoints = count;
  c.run(p, kSerial);
  cudaMemcpy(dense.bytes.data(), d_dense, dense.bytes.size(), cudaMemcpyDeviceToHost);
  EXPECT_TRUE(dense.guard_intact());
  EXPECT_EQ(count_nonfinite(dense.values()), 0);

  int64_t ck = 0;
  std::vector<int64_t> owner;
  for (int64_t n = 0; n < c.in.N; ++n) {
    const Range r = range_of(c.in, n);
    for (int64_t j = 0; j < r.len() / 64; ++j, ++ck) {
      owner.push_back(n);
      if (!c.live(n)) {
        for (int64_t i = 0; i < kState; ++i) ASSERT_EQ(dense.get(ck * kState + i), 0.0) << "padding checkpoint " << ck;
        continue;
      }
      if (j > 3 && j + 1 < r.len() / 64) continue;  // the long sequence: its first four and last one
      KdaInputs cut = cut_sequence(c.in, r, 64 * (j + 1));
      DeviceProblem dcut(cut, kSerial);
      HostTensor h0(dtype, kState), ht(dtype, kState);
      for (int64_t i = 0; i < kState; ++i) h0.set(i, c.has_init[n] ? c.pool_before.get(c.slots[n] * kState + i) : 0.0);
      void* d_h0 = dcut.upload(h0.bytes.data(), h0.bytes.size());
      void* d_ht = dcut.upload(ht.bytes.data(), ht.bytes.size());
      PrefillParams q = dcut.params();
      q.initial_state = d_h0, q.initial_state_dtype = dtype;
      q.final_state = d_ht, q.final_state_dtype = dtype;
      DeviceBuffer ws(internal::workspace_size(q, kSerial));
      internal::forward(q, kSerial, ws.ptr, ws.bytes);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cudaMemcpy(ht.bytes.data(), d_ht, ht.bytes.size(), cudaMemcpyDeviceToHost);
      EXPECT_TRUE(same_bytes(dense, ck * kState, ht, 0, kState)) << "checkpoint " << ck << " (sequence " << n
                                                                  << ", after " << 64 * (j + 1) << " tokens)";
    }
  }
  ASSERT_EQ(ck, count);

  // Into pool slots: the free slots, every other checkpoint skipped (-1) or past the pool.
  std::vector<int32_t> free_slots;
  for (int64_t s = 0; s < c.P; ++s)
    if (!c.slot_named(s)) free_slots.push_back(int32_t(s));
  std::vector<int32_t> ck_slots(size_t(count), -1);
  for (int64_t i = 0, f = 0; i < count && f < int64_t(free_slots.size()); i += 2) ck_slots[i] = free_slots[f++];
  ck_slots[1] = int32_t(c.P);
  c.reset_pool();
  PrefillParams ps = c.params();
  ps.checkpoint_every = 64;
  ps.checkpoint_slots = static_cast<const int32_t*>(c.dev.upload(ck_slots.data(), ck_slots.size() * 4));
  ps.num_checkpoints = count;
  c.run(ps, kSerial);
  for (int64_t i = 0; i < count; ++i) {
    const int32_t s = ck_slots[i];
    if (s < 0 || s >= c.P) continue;
    if (!c.live(owner[i])) {
      EXPECT_TRUE(same_bytes(c.pool, s * kState, c.pool_before, s * kState, kState)) << "padding checkpoint slot " << i;
    } else {
      EXPECT_TRUE(same_bytes(c.pool, s * kState, dense, i * kState, kState)) << "checkpoint slot " << i;
    }
  }
  for (int32_t s : free_slots)
    if (std::find(ck_slots.begin(), ck_slots.end(), s) == ck_slots.end())
      EXPECT_TRUE(same_bytes(c.pool, s * kState, c.pool_before, s * kState, kState)) << "unnamed slot " << s;

  // fp64 reference checkpoints, and the same call in segments: segments of 4 chunks (64 tokens)
  // and of 2, both dividing checkpoint_every = 64 tokens (4 chunks); the chain kernel writes them.
  std::vector<double> ref_out(c.in.out.count), ref_ck(size_t(count * kState), std::nan(""));
  std::vector<double> ref_state(size_t(c.in.N * kState));
  HostTensor ref_pool = c.pool_before;
  PrefillParams host = c.host_params(ref_pool, c.slots);
  host.checkpoint_every = 64, host.num_checkpoints = count;
  reference_forward(host, ref_out.data(), ref_state.data(), ref_ck.data());
  const double tol = dtype == DType::kBF16 ? 6e-3 : 1e-4;
  const double e = rel_rms(dense.values(), ref_ck);
  report("gpu checkpoints serial rel-RMS", e);
  EXPECT_LT(e, tol);
  // Then segments of 3 and 5 chunks with the checkpoints inside segments from their partial
  // transitions (the rule; internal::PrefillLaunch::checkpoints_in_segments), and of 4 and 2 with
  // the former rule's lengths that divide checkpoint_every (checkpoints_in_segments = -1).
  // Last, transition skipping (segments of 16 and 20 chunks in pieces of 8, warm-ups of up to 8): the
  // checkpoints of skipping runs (after their warm-up) and of exact runs that end inside a segment.
  const internal::PrefillLaunch seg_launches[] = {{0, 4, 0, -1},        {0, 2, 0, -1}, {0, 3}, {0, 5, 0, 1}, {0, 4},
                                                  {0, 16, 0, 0, 1, 8}, {0, 20, 0, 0, 1, 8}};
  std::vector<uint8_t> runs_out;  // the outputs of the first launch with transition skipping
  for (const internal::PrefillLaunch& launch : seg_launches) {
    const int64_t seg = launch.segment_chunks;
    ASSERT_EQ(internal::chosen_segment_chunks(p, launch), seg);
    c.reset_pool();
    HostTensor seg_dense(dtype, count * kState);
    void* d_seg = c.dev.upload(seg_dense.bytes.data(), seg_dense.bytes.size());
    PrefillParams pseg = p;
    pseg.checkpoints = d_seg;
    c.dev.poison();
    c.run(pseg, launch);
    cudaMemcpy(seg_dense.bytes.data(), d_seg, seg_dense.bytes.size(), cudaMemcpyDeviceToHost);
    EXPECT_TRUE(seg_dense.guard_intact());
    EXPECT_EQ(count_nonfinite(seg_dense.values()), 0);
    const double es = rel_rms(seg_dense.values(), ref_ck);
    report("gpu checkpoints segments" + std::to_string(seg) + (launch.checkpoints_in_segments >= 0 ? " inside" : "") +
               (launch.skip_run_chunks > 0 ? " runs" : "") + " rel-RMS",
           es);
    EXPECT_LT(es, tol);
    EXPECT_LT(rel_rms(c.in.out.values(), ref_out), 6e-3);
    EXPECT_LT(rel_rms(states_in_slots(c.pool, c.slots, c.P), ref_state), tol);  // final states in their slots
    if (launch.skip_run_chunks > 0 && runs_out.empty()) runs_out = c.in.out.bytes;
  }
  {  // some piece skipped (head 0 decays fast): the same segments without skipping give other bits
    c.reset_pool();
    c.dev.poison();
    c.run(p, internal::PrefillLaunch{0, 16, 0, 0, -1});
    EXPECT_FALSE(c.in.out.bytes == runs_out) << "no piece took the skipped path";
  }
  // Under the former rule a segment length that does not divide checkpoint_every is rounded down
  // to one that does.
  EXPECT_EQ(internal::chosen_segment_chunks(p, internal::PrefillLaunch{0, 3, 0, -1}), 2);
}

// The pool path with checkpoints into pool slots, captured in a CUDA graph and replayed: the
// replay gives what the eager call gave, bit for bit (no host synchronisation, no allocation).
TEST_P(ServingPrefillGpu, GraphCaptureOfThePoolPath) {
  PoolCase c({200, 64, 0, 130, 1030}, GetParam(), 12, /*padding=*/2, /*past_pool=*/-1);
  PrefillParams p = c.params();
  p.checkpoint_every = 128;
  p.num_checkpoints = 1 + 0 + 0 + 1 + 8;
  std::vector<int32_t> ck_slots(size_t(p.num_checkpoints), -1);
  for (int64_t i = 0, s = 0; i < p.num_checkpoints && s < c.P; ++s)
    if (!c.slot_named(s)) ck_slots[size_t(i++)] = int32_t(s);
  p.checkpoint_slots = static_cast<const int32_t*>(c.dev.upload(ck_slots.data(), ck_slots.size() * 4));
  DeviceBuffer ws(internal::workspace_size(p, {}));
  c.dev.poison();
  internal::forward(p, {}, ws.ptr, ws.bytes);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  c.dev.download();
  const HostTensor out_eager = c.in.out;
  HostTensor pool_eager(c.pool.dtype, c.P * kState);
  cudaMemcpy(pool_eager.bytes.data(), c.d_pool, pool_eager.bytes.size(), cudaMemcpyDeviceToHost);

  c.reset_pool();
  c.dev.poison();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  internal::forward(p, {}, ws.ptr, ws.bytes, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  c.dev.download();
  cudaMemcpy(c.pool.bytes.data(), c.d_pool, c.pool.bytes.size(), cudaMemcpyDeviceToHost);
  EXPECT_TRUE(same_bytes(c.in.out, 0, out_eager, 0, c.in.out.count)) << "graph replay output";
  EXPECT_TRUE(same_bytes(c.pool, 0, pool_eager, 0, c.P * kState)) << "graph replay pool";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(PoolDtypes, ServingPrefillGpu, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// With device cu_seqlens the host cannot count the checkpoints: a num_checkpoints other than the
// lengths give fills out and the dense checkpoints with NaN (as invalid cu_seqlens do) and leaves
// the pool untouched.
TEST(ServingPrefillGpuErrors, WrongCheckpointCountPoisonsOutputs) {
  if (!cuda_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU visible";
  PoolCase c({200, 64, 130}, DType::kF32, 4, -1, -1);
  PrefillParams p = c.params();
  p.checkpoint_every = 64;
  const int64_t count = 3 + 1 + 2 + 1;  // one too many
  HostTensor dense(DType::kF32, count * kState);
  void* d_dense = c.dev.upload(dense.bytes.data(), dense.bytes.size());
  p.checkpoints = d_dense, p.checkpoint_dtype = DType::kF32, p.num_checkpoints = count;
  c.dev.poison();
  c.run(p, {});
  cudaMemcpy(dense.bytes.data(), d_dense, dense.bytes.size(), cudaMemcpyDeviceToHost);
  const std::vector<double> out = c.in.out.values(), ck = dense.values();
  EXPECT_EQ(count_nonfinite(out), int64_t(out.size()));
  EXPECT_EQ(count_nonfinite(ck), int64_t(ck.size()));
  EXPECT_TRUE(same_bytes(c.pool, 0, c.pool_before, 0, c.P * kState)) << "the pool was written";
  // Without cu_seqlens the host counts them and names the field.
  KdaOptions o;
  o.B = 2, o.T = 130, o.H = kH;
  KdaInputs in(o);
  DeviceProblem dev(in);
  PrefillParams q = dev.params();
  q.checkpoint_every = 64, q.checkpoints = d_dense, q.num_checkpoints = 3;
  try {
    internal::forward(q, {}, nullptr, 0);
    ADD_FAILURE() << "num_checkpoints=3 accepted for B=2, T=130";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_checkpoints must be 4"), std::string::npos) << e.what();
  }
}

// A live slot named twice (two sequences, or a sequence and a checkpoint) is refused on the GPU
// as the CPU backend refuses it, without a host synchronisation: K0 finds it, out and the dense
// checkpoints come back NaN and the pool keeps its bytes; serial, segmented and with checkpoints
// inside segments, with cu_seqlens and without. Padding slots (negative, or >= P) may repeat.
TEST(ServingPrefillGpuErrors, DuplicateLiveSlotsPoisonOutputsAndLeaveThePool) {
  if (!cuda_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU visible";
  PoolCase c({200, 64, 130}, DType::kF32, 6, -1, -1);
  auto set_slots = [&](std::vector<int32_t> slots) {
    c.slots = slots;
    cudaMemcpy(c.d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice);
  };
  auto expect_refused = [&](const PrefillParams& p, internal::PrefillLaunch launch, const char* what) {
    c.reset_pool();
    c.dev.poison();
    ASSERT_EQ(cudaMemset(c.dev.out, 0, c.in.out.data_bytes()), cudaSuccess);  // only the kernels' NaN counts
    c.run(p, launch);
    const std::vector<double> out = c.in.out.values();
    EXPECT_EQ(count_nonfinite(out), int64_t(out.size())) << what << ": outputs not all NaN";
    EXPECT_TRUE(same_bytes(c.pool, 0, c.pool_before, 0, c.P * kState)) << what << ": the pool was written";
  };
  const std::vector<int32_t> distinct = {4, 1, 3};
  const internal::PrefillLaunch launches[] = {{}, kSerial, {0, 2}};
  set_slots({4, 1, 4});
  for (const internal::PrefillLaunch& launch : launches) expect_refused(c.params(), launch, "sequences 0 and 2 in slot 4");
  internal::PrefillLaunch fused;  // the fused chunk-32 kernel (K0's verdict before it)
  fused.fused_v2 = 1;
  ASSERT_TRUE(cuda::sm90::prefill_v2::fused_serves(c.params()));
  expect_refused(c.params(), fused, "fused: sequences 0 and 2 in slot 4");

  // A checkpoint into a sequence's slot.
  set_slots(distinct);
  PrefillParams p = c.params();
  p.checkpoint_every = 64, p.num_checkpoints = 3 + 1 + 2;
  std::vector<int32_t> ck_slots(6, -1);
  ck_slots[0] = 0, ck_slots[4] = 3;  // slot 3 is sequence 2's
  p.checkpoint_slots = static_cast<const int32_t*>(c.dev.upload(ck_slots.data(), ck_slots.size() * 4));
  for (const internal::PrefillLaunch& launch : {internal::PrefillLaunch{}, internal::PrefillLaunch{0, 3, 0, 1}})
    expect_refused(p, launch, "checkpoint 4 in sequence 2's slot");

  // Padding repeated is not a conflict: the call runs (finite outputs; only the live slot 2 is
  // written). -1: padding; 6 = P: past the pool, padding too.
  for (const std::vector<int32_t>& padding : {std::vector<int32_t>{-1, -1, 2}, std::vector<int32_t>{6, 6, 2}}) {
    set_slots(padding);
    c.reset_pool();
    c.dev.poison();
    c.run(c.params(), {});
    EXPECT_EQ(count_nonfinite(c.in.out.values()), 0) << "slots " << padding[0] << ", " << padding[1] << ", 2";
    EXPECT_TRUE(same_bytes(c.pool, 0, c.pool_before, 0, 2 * kState) &&
                same_bytes(c.pool, 3 * kState, c.pool_before, 3 * kState, (c.P - 3) * kState))
        << "padding wrote the pool";
    EXPECT_FALSE(same_bytes(c.pool, 2 * kState, c.pool_before, 2 * kState, kState)) << "slot 2 not written";
  }

  // Without cu_seqlens (B sequences of T tokens) K0 runs for the check alone.
  KdaOptions o;
  o.B = 2, o.T = 130, o.H = kH;
  KdaInputs in(o);
  DeviceProblem dev(in);
  HostTensor pool = random_pool(DType::kF32, 4, 7), pool_after = pool;
  void* d_pool = dev.upload(pool.bytes.data(), pool.bytes.size());
  const std::vector<int32_t> twice = {2, 2};
  PrefillParams q = dev.params();
  q.initial_state = q.final_state = nullptr;
  q.state_pool = d_pool, q.state_pool_dtype = DType::kF32, q.pool_size = 4;
  q.state_indices = static_cast<const int32_t*>(dev.upload(twice.data(), 8));
  DeviceBuffer ws(internal::workspace_size(q, {}));
  dev.poison();
  internal::forward(q, {}, ws.ptr, ws.bytes);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();
  cudaMemcpy(pool_after.bytes.data(), d_pool, pool.bytes.size(), cudaMemcpyDeviceToHost);
  EXPECT_EQ(count_nonfinite(in.out.values()), int64_t(in.out.count)) << "B x T: outputs not all NaN";
  EXPECT_TRUE(same_bytes(pool_after, 0, pool, 0, 4 * kState)) << "B x T: the pool was written";
}

}  // namespace
}  // namespace flashkda::test
