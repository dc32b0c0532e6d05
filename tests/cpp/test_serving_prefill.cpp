// Serving prefill on the CPU backend (docs/SPEC.md §9): prefill against a state pool (slots,
// padding, has_initial_state), checkpoints (dense and into pool slots), chunked prefill through
// the pool, prefill then decode through one pool, and the validation of the new fields.
// Bit-exact where the definition says so (gather -> plain prefill -> scatter; checkpoints equal to
// a prefill cut at their position); against the fp64 reference elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kda_test_utils.h"
#include "serving_test_utils.h"

namespace flashkda::test {
namespace {

using namespace serving;

// One pool problem: inputs of the given lengths, slots drawn from a shuffled pool, one padding
// entry where slots[n] < 0, has_initial_state alternating.
struct PoolCase {
  KdaInputs in;
  HostTensor pool, pool_before;
  std::vector<int32_t> slots;
  std::vector<char> has_init;  // bool storage (std::vector<bool> has no data())
  int64_t P;

  PoolCase(const std::vector<int64_t>& seqlens, DType pool_dtype, int64_t P_, int padding)
      : in(pool_options(seqlens)), P(P_) {
    pool = random_pool(pool_dtype, P, in.seed + 1);
    pool_before = pool;
    std::vector<int32_t> perm(P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(in.seed + 2));
    for (int64_t n = 0; n < in.N; ++n) slots.push_back(n == padding ? -1 : perm[n]);
    for (int64_t n = 0; n < in.N; ++n) has_init.push_back(n % 3 != 1);
  }

  PrefillParams params() {
    PrefillParams p = in.params();
    p.state_pool = pool.data();
    p.state_pool_dtype = pool.dtype;
    p.pool_size = P;
    p.state_indices = slots.data();
    p.has_initial_state = reinterpret_cast<const bool*>(has_init.data());
    return p;
  }

  bool slot_named(int64_t s) const { return std::find(slots.begin(), slots.end(), int32_t(s)) != slots.end(); }
};

// The plain prefill of the same problem from gathered states: initial_state[n] = pool[slot] (or
// zeros), final_state in the pool's dtype.
struct Gathered {
  HostTensor initial, final_state;
  explicit Gathered(PoolCase& c) : initial(c.pool.dtype, c.in.N * kState), final_state(c.pool.dtype, c.in.N * kState) {
    for (int64_t n = 0; n < c.in.N; ++n) {
      const bool read = c.slots[n] >= 0 && c.has_init[n];
      for (int64_t i = 0; i < kState; ++i) initial.set(n * kState + i, read ? c.pool_before.get(c.slots[n] * kState + i) : 0.0);
    }
  }
};

class PoolPrefill : public ::testing::TestWithParam<DType> {};

// Pool prefill == gather -> plain prefill -> scatter, bit for bit; padding rows are zero; slots
// not named keep their bytes; and against the fp64 reference on the pool.
TEST_P(PoolPrefill, MatchesGatherPrefillScatter) {
  PoolCase c({37, 130, 0, 64, 200, 16}, GetParam(), 9, /*padding=*/3);
  SCOPED_TRACE(c.in.describe());
  c.in.poison_outputs();
  forward(c.params(), nullptr, 0);
  const HostTensor out_pool = c.in.out;

  Gathered gathered(c);
  c.in.poison_outputs();
  PrefillParams plain = c.in.params();
  plain.initial_state = gathered.initial.data();
  plain.initial_state_dtype = c.pool.dtype;
  plain.final_state = gathered.final_state.data();
  plain.final_state_dtype = c.pool.dtype;
  forward(plain, nullptr, 0);

  for (int64_t n = 0; n < c.in.N; ++n) {
    const Range r = range_of(c.in, n);
    const int64_t first = r.bos * kH * kV, count = r.len() * kH * kV;
    if (c.slots[n] < 0) {
      for (int64_t i = first; i < first + count; ++i) ASSERT_EQ(out_pool.get(i), 0.0) << "padding output row " << n;
      continue;
    }
    EXPECT_TRUE(same_bytes(out_pool, first, c.in.out, first, count)) << "output of sequence " << n;
    EXPECT_TRUE(same_bytes(c.pool, c.slots[n] * kState, gathered.final_state, n * kState, kState))
        << "final state of sequence " << n << " in slot " << c.slots[n];
  }
  for (int64_t s = 0; s < c.P; ++s) {
    if (!c.slot_named(s)) EXPECT_TRUE(same_bytes(c.pool, s * kState, c.pool_before, s * kState, kState)) << "slot " << s;
  }
  EXPECT_TRUE(c.pool.guard_intact() && out_pool.guard_intact());

  // The reference reads the same pool (before the call) and writes fp64 states in sequence order.
  std::vector<double> ref_out(c.in.out.count), ref_state(size_t(c.in.N * kState));
  HostTensor pool_after = c.pool;
  c.pool = c.pool_before;
  reference_forward(c.params(), ref_out.data(), ref_state.data());
  const double e_out = rel_rms(out_pool.values(), ref_out);
  const double e_state = rel_rms(states_in_slots(pool_after, c.slots, c.P), ref_state);
  report("pool out rel-RMS", e_out);
  report("pool state rel-RMS", e_state);
  EXPECT_LT(e_out, 5e-3);
  EXPECT_LT(e_state, GetParam() == DType::kBF16 ? 5e-3 : 1e-5);
}

// Checkpoints: each equals the final state of the same prefill cut at its position (bit for bit,
// as the chunks up to there are the same), dense in fp32 and bf16, into pool slots with skips, and
// against the fp64 reference's checkpoints.
TEST_P(PoolPrefill, CheckpointsEqualTruncatedPrefill) {
  const DType dtype = GetParam();
  PoolCase c({200, 64, 0, 130, 63, 256}, dtype, 8, /*padding=*/5);
  SCOPED_TRACE(c.in.describe());
  PrefillParams p = c.params();
  p.checkpoint_every = 64;
  const int64_t count = checkpoint_count(p);
  ASSERT_EQ(count, 3 + 1 + 0 + 2 + 0 + 4);
  HostTensor dense(dtype, count * kState);
  p.checkpoints = dense.data();
  p.checkpoint_dtype = dtype;
  p.num_checkpoints = count;
  forward(p, nullptr, 0);
  EXPECT_TRUE(dense.guard_intact());

  int64_t ck = 0;
  std::vector<int64_t> owner;  // the sequence of each checkpoint
  for (int64_t n = 0; n < c.in.N; ++n) {
    const Range r = range_of(c.in, n);
    for (int64_t j = 0; j < r.len() / 64; ++j, ++ck) {
      owner.push_back(n);
      if (c.slots[n] < 0) {
        for (int64_t i = 0; i < kState; ++i) ASSERT_EQ(dense.get(ck * kState + i), 0.0) << "padding checkpoint " << ck;
        continue;
      }
      // The same sequence alone, cut after 64 (j + 1) tokens, from the same initial state.
      KdaInputs cut = cut_sequence(c.in, r, 64 * (j + 1));
      HostTensor h0(dtype, kState), ht(dtype, kState);
      for (int64_t i = 0; i < kState; ++i) h0.set(i, c.has_init[n] ? c.pool_before.get(c.slots[n] * kState + i) : 0.0);
      PrefillParams q = cut.params();
      q.initial_state = h0.data(), q.initial_state_dtype = dtype;
      q.final_state = ht.data(), q.final_state_dtype = dtype;
      forward(q, nullptr, 0);
      EXPECT_TRUE(same_bytes(dense, ck * kState, ht, 0, kState)) << "checkpoint " << ck << " (sequence " << n
                                                                  << ", after " << 64 * (j + 1) << " tokens)";
    }
  }
  ASSERT_EQ(ck, count);

  // The same checkpoints into pool slots: the free slots of the pool, every other one skipped.
  std::vector<int32_t> free_slots;
  for (int64_t s = 0; s < c.P; ++s)
    if (!c.slot_named(s)) free_slots.push_back(int32_t(s));
  std::vector<int32_t> ck_slots(size_t(count), -1);
  for (int64_t i = 0, f = 0; i < count && f < int64_t(free_slots.size()); i += 2) ck_slots[i] = free_slots[f++];
  c.pool = c.pool_before;
  PrefillParams ps = c.params();
  ps.checkpoint_every = 64;
  ps.checkpoint_slots = ck_slots.data();
  ps.num_checkpoints = count;
  forward(ps, nullptr, 0);
  for (int64_t i = 0; i < count; ++i) {
    if (ck_slots[i] < 0) continue;
    if (c.slots[owner[i]] < 0) {  // a padding sequence's checkpoint is not written into its slot
      EXPECT_TRUE(same_bytes(c.pool, ck_slots[i] * kState, c.pool_before, ck_slots[i] * kState, kState));
    } else {
      EXPECT_TRUE(same_bytes(c.pool, ck_slots[i] * kState, dense, i * kState, kState)) << "checkpoint slot " << i;
    }
  }
  for (int32_t s : free_slots) {
    if (std::find(ck_slots.begin(), ck_slots.end(), s) == ck_slots.end())
      EXPECT_TRUE(same_bytes(c.pool, s * kState, c.pool_before, s * kState, kState)) << "unnamed slot " << s;
  }

  // fp64 reference checkpoints.
  c.pool = c.pool_before;
  std::vector<double> ref_out(c.in.out.count), ref_ck(size_t(count * kState), std::nan(""));
  PrefillParams pr = c.params();
  pr.checkpoint_every = 64;
  pr.num_checkpoints = count;
  reference_forward(pr, ref_out.data(), nullptr, ref_ck.data());
  EXPECT_EQ(count_nonfinite(ref_ck), 0);
  const double e = rel_rms(dense.values(), ref_ck);
  report("checkpoints rel-RMS", e);
  EXPECT_LT(e, dtype == DType::kBF16 ? 5e-3 : 1e-5);
}

INSTANTIATE_TEST_SUITE_P(PoolDtypes, PoolPrefill, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// A prompt in three pieces through one fp32 pool slot equals one prefill over the whole prompt:
// bit for bit when the cuts fall on chunk boundaries (multiples of 16), to the reference's
// tolerance otherwise; then two decode steps through the same pool against the reference.
TEST(ChunkedPrefill, PiecesThroughThePool) {
  for (const std::vector<int64_t>& pieces : {std::vector<int64_t>{112, 96, 92}, std::vector<int64_t>{100, 77, 123}}) {
    const int64_t T = 300, P = 3, slot = 1;
    KdaOptions o;
    o.T = T, o.H = kH;
    KdaInputs whole(o);
    SCOPED_TRACE(whole.describe());
    HostTensor ht(DType::kF32, kState);
    PrefillParams pw = whole.params();
    pw.final_state = ht.data();
    forward(pw, nullptr, 0);

    HostTensor pool(DType::kF32, P * kState), out(whole.opt.dtype, T * kH * kV);
    std::vector<int32_t> idx = {int32_t(slot)};
    int64_t t0 = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const int64_t len = pieces[i];
      PrefillParams p = whole.params();
      const auto at = [&](const HostTensor& x, int64_t per_token) {
        return static_cast<const void*>(x.bytes.data() + t0 * per_token * dtype_size(x.dtype));
      };
      p.q = at(whole.q, kH * kK), p.k = at(whole.k, kH * kK), p.v = at(whole.v, kH * kV), p.g = at(whole.g, kH * kK);
      p.beta = at(whole.beta, kH);
      p.out = out.bytes.data() + t0 * kH * kV * dtype_size(out.dtype);
      p.T = len;
      p.state_pool = pool.data(), p.pool_size = P, p.state_indices = idx.data();
      const bool first_piece = i == 0;
      const bool read = !first_piece;
      p.has_initial_state = &read;
      forward(p, nullptr, 0);
      t0 += len;
    }
    const bool aligned = pieces[0] % 16 == 0 && (pieces[0] + pieces[1]) % 16 == 0;
    if (aligned) {
      EXPECT_TRUE(same_bytes(out, 0, whole.out, 0, T * kH * kV));
      EXPECT_TRUE(same_bytes(pool, slot * kState, ht, 0, kState));
    }
    const Reference ref = run_reference(whole);
    std::vector<double> got(kState);
    for (int64_t i = 0; i < kState; ++i) got[i] = pool.get(slot * kState + i);
    EXPECT_LT(rel_rms(out.values(), ref.out), 5e-3);
    EXPECT_LT(rel_rms(got, ref.final_state), 1e-5);
  }
}

TEST(ChunkedPrefill, PrefillThenDecodeThroughOnePool) {
  // 2 sequences: 90 prompt tokens each, then decode steps of 1 and 3 tokens; the reference runs
  // the 94 tokens of each sequence in one go.
  const std::vector<int64_t> steps = {90, 1, 3};
  const int64_t T = 94, N = 2, P = 4;
  KdaOptions o;
  o.B = N, o.T = T, o.H = kH;
  KdaInputs all(o);
  SCOPED_TRACE(all.describe());
  const Reference ref = run_reference(all);

  HostTensor pool = random_pool(DType::kF32, P, all.seed + 7);
  std::vector<int32_t> idx = {3, 0};
  std::vector<char> no_init = {0, 0};
  HostTensor out(all.opt.dtype, N * T * kH * kV);
  int64_t t0 = 0;
  for (int64_t len : steps) {
    // The tokens [t0, t0 + len) of both sequences, packed [N, len, ...].
    KdaOptions so = o;
    so.T = len;
    KdaInputs step(so);
    for (int64_t n = 0; n < N; ++n) {
      const auto copy = [&](HostTensor& dst, const HostTensor& src, int64_t per_token) {
        const size_t w = dtype_size(src.dtype);
        std::memcpy(dst.bytes.data() + n * len * per_token * w, src.bytes.data() + (n * T + t0) * per_token * w,
                    len * per_token * w);
      };
      copy(step.q, all.q, kH * kK), copy(step.k, all.k, kH * kK), copy(step.v, all.v, kH * kV);
      copy(step.g, all.g, kH * kK), copy(step.beta, all.beta, kH);
    }
    step.A_log = all.A_log, step.dt_bias = all.dt_bias;
    if (t0 == 0) {
      PrefillParams p = step.params();
      p.state_pool = pool.data(), p.pool_size = P, p.state_indices = idx.data();
      p.has_initial_state = reinterpret_cast<const bool*>(no_init.data());
      forward(p, nullptr, 0);
    } else {
      const PrefillParams pp = step.params();
      DecodeParams d;
      d.q = pp.q, d.k = pp.k, d.v = pp.v, d.g = pp.g, d.beta = pp.beta, d.out = pp.out;
      d.dtype = pp.dtype, d.g_dtype = pp.g_dtype, d.beta_dtype = pp.beta_dtype;
      d.state_pool = pool.data(), d.pool_size = P, d.state_indices = idx.data();
      d.num_seqs = N, d.T = len, d.H = kH, d.K = kK, d.V = kV, d.pre = pp.pre;
      decode(d);
    }
    for (int64_t n = 0; n < N; ++n) {
      const size_t w = dtype_size(out.dtype);
      std::memcpy(out.bytes.data() + (n * T + t0) * kH * kV * w, step.out.bytes.data() + n * len * kH * kV * w,
                  len * kH * kV * w);
    }
    t0 += len;
  }
  std::vector<double> got(size_t(N * kState));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < kState; ++i) got[n * kState + i] = pool.get(idx[n] * kState + i);
  const double e_out = rel_rms(out.values(), ref.out), e_state = rel_rms(got, ref.final_state);
  report("prefill+decode out rel-RMS", e_out);
  report("prefill+decode state rel-RMS", e_state);
  EXPECT_LT(e_out, 5e-3);
  EXPECT_LT(e_state, 1e-5);
}

// Every new field's misuse is named before anything is written.
TEST(ServingPrefillValidation, NamesTheBadField) {
  PoolCase c({64, 130, 20}, DType::kF32, 5, /*padding=*/-1);
  const auto run = [&](const PrefillParams& p) { forward(p, nullptr, 0); };
  {
    PrefillParams p = c.params();
    p.initial_state = c.in.A_log.data();  // any non-null pointer
    expect_invalid([&] { run(p); }, "state_pool replaces initial_state and final_state");
  }
  {
    PrefillParams p = c.params();
    p.state_indices = nullptr;
    expect_invalid([&] { run(p); }, "state_indices must not be null");
  }
  {
    std::vector<int32_t> bad = {0, 5, 1};
    PrefillParams p = c.params();
    p.state_indices = bad.data();
    expect_invalid([&] { run(p); }, "state_indices[1]=5 must be < pool_size=5");
  }
  {
    std::vector<int32_t> dup = {2, -1, 2};
    PrefillParams p = c.params();
    p.state_indices = dup.data();
    expect_invalid([&] { run(p); }, "state_indices[0] and state_indices[2] both name slot 2");
  }
  {
    PrefillParams p = c.in.params();
    std::vector<int32_t> idx = {0, 1, 2};
    p.state_indices = idx.data();
    expect_invalid([&] { run(p); }, "state_indices needs state_pool");
  }
  {
    PrefillParams p = c.params();
    p.state_pool_dtype = DType::kI32;
    expect_invalid([&] { run(p); }, "state_pool_dtype must be bfloat16 or float32");
  }
  HostTensor dense(DType::kF32, 3 * kState);
  {
    PrefillParams p = c.params();
    p.checkpoint_every = 100;
    p.checkpoints = dense.data(), p.num_checkpoints = 3;
    expect_invalid([&] { run(p); }, "checkpoint_every must be a positive multiple of 64");
  }
  {
    PrefillParams p = c.params();
    p.checkpoint_every = 64;
    p.checkpoints = dense.data(), p.num_checkpoints = 2;
    expect_invalid([&] { run(p); }, "num_checkpoints must be 3");
  }
  {
    PrefillParams p = c.params();
    p.checkpoint_every = 64, p.num_checkpoints = 3;
    expect_invalid([&] { run(p); }, "needs exactly one destination");
  }
  {
    PrefillParams p = c.params();
    p.checkpoints = dense.data();
    expect_invalid([&] { run(p); }, "need checkpoint_every > 0");
  }
  {
    int32_t free_slot = 0;
    while (c.slot_named(free_slot)) ++free_slot;
    std::vector<int32_t> ck = {free_slot, -1, c.slots[0]};  // the last one is sequence 0's slot
    PrefillParams p = c.params();
    p.checkpoint_every = 64, p.checkpoint_slots = ck.data(), p.num_checkpoints = 3;
    expect_invalid([&] { run(p); }, "both name slot " + std::to_string(c.slots[0]));
  }
  {
    std::vector<int32_t> ck = {0, 1, 2};
    PrefillParams p = c.in.params();
    p.checkpoint_every = 64, p.checkpoint_slots = ck.data(), p.num_checkpoints = 3;
    expect_invalid([&] { run(p); }, "checkpoint_slots needs state_pool");
  }
  EXPECT_TRUE(same_bytes(c.pool, 0, c.pool_before, 0, c.P * kState));  // nothing was written
}

}  // namespace
}  // namespace flashkda::test
