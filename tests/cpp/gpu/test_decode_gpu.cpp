// GPU decode (sm_90a) against the fp64 token recurrence and the CPU decode: tokens 1..16, varlen,
// padding (including the GPU's out-of-range rules), speculative slots, both state dtypes, gate
// forms, both tile variants, sentinel pool slots bit-exact, decode after a GPU prefill,
// bit-identical repeats, CUDA-graph capture and replay, argument errors.
// Skips with a reason when no Hopper GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "device_problem.h"
#include "fuzz_params.h"
#include "launch_config.h"
#include "test_decode_fixture.h"

namespace flashkda::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

constexpr double kTolBf16 = 5e-3;  // bf16 out or bf16 state: one rounding (~1.1e-3 rel RMS)
constexpr double kTolF32 = 2e-5;   // fp32 state (fast-math exp/rsqrt: ~1e-6)

double tol_state(const DecodeOptions& o) { return o.state_dtype == DType::kBF16 ? kTolBf16 : kTolF32; }

// Device copies (data + guard bytes) of a decode problem; download() brings out and the pool back.
struct DeviceDecode {
  DecodeProblem& prob;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  void *q, *k, *v, *g, *beta, *out, *pool, *cu = nullptr;
  int32_t *indices, *accepted = nullptr;
  float *A_log, *dt_bias = nullptr;

  explicit DeviceDecode(DecodeProblem& p) : prob(p) {
    KdaInputs& in = prob.in;
    q = upload(in.q.bytes);
    k = upload(in.k.bytes);
    v = upload(in.v.bytes);
    g = upload(in.g.bytes);
    beta = upload(in.beta.bytes);
    out = upload(in.out.bytes);
    pool = upload(prob.pool.bytes);
    indices = static_cast<int32_t*>(upload(prob.indices.data(), prob.indices.size() * 4));
    if (!prob.accepted.empty()) accepted = static_cast<int32_t*>(upload(prob.accepted.data(), prob.accepted.size() * 4));
    if (!in.cu_seqlens.bytes.empty()) cu = upload(in.cu_seqlens.bytes);
    A_log = static_cast<float*>(upload(in.A_log.data(), in.A_log.size() * 4));
    if (!in.dt_bias.empty()) dt_bias = static_cast<float*>(upload(in.dt_bias.data(), in.dt_bias.size() * 4));
  }

  void* upload(const std::vector<unsigned char>& bytes) { return upload(bytes.data(), bytes.size()); }
  void* upload(const void* src, size_t bytes) {
    keep.push_back(std::make_unique<DeviceBuffer>(bytes));
    void* p = keep.back()->ptr;
    EXPECT_NE(p, nullptr) << "cudaMalloc of " << bytes << " bytes failed";
    if (p) EXPECT_EQ(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return p;
  }

  DecodeParams params() {
    DecodeParams p = prob.params();
    p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.out = out;
    p.state_pool = pool;
    p.state_indices = indices;
    p.num_accepted_tokens = prob.opt.speculative ? accepted : nullptr;
    if (p.cu_seqlens) p.cu_seqlens = cu;
    p.pre.A_log = A_log;
    p.pre.dt_bias = dt_bias;
    return p;
  }

  // Restores the device pool and out to the problem's initial pool and poisoned out.
  void reset() {
    ASSERT_EQ(cudaMemcpy(pool, prob.pool_before.bytes.data(), prob.pool_before.bytes.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    std::vector<unsigned char> poison(prob.in.out.bytes.size(), kPoison);
    ASSERT_EQ(cudaMemcpy(out, poison.data(), poison.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }

  void download() {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(prob.in.out.bytes.data(), out, prob.in.out.bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(prob.pool.bytes.data(), pool, prob.pool.bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

// Every test runs on each kernel variant: the one-CTA-per-item kernels ("tile"), the persistent
// kernel with shared-memory prefetch and its bulk-copy variant (kernel.cuh), forced through the
// internal launch configuration (src/launch_config.h); flashkda::decode picks by state dtype and N·H.
internal::DecodeLaunch g_launch;
void run_decode(const DecodeParams& p, Stream stream = nullptr) { internal::decode(p, g_launch, stream); }

class DecodeGpu : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU visible: GPU decode tests skipped";
    g_launch.persistent = GetParam()[0] - '0';
  }
  void TearDown() override { g_launch = {}; }
};

std::string kernel_name(const ::testing::TestParamInfo<const char*>& info) {
  static const char* const names[] = {"Tile", "Persistent", "Bulk4", "Bulk3"};
  return names[info.param[0] - '0'];
}
INSTANTIATE_TEST_SUITE_P(Kernels, DecodeGpu, ::testing::Values("0", "1", "2", "3"), kernel_name);

void run_and_check(DecodeProblem& prob, const std::string& tag = "") {
  DeviceDecode dev(prob);
  run_decode(dev.params());
  dev.download();
  prob.check(kTolBf16, tol_state(prob.opt), tag);
}

void run_and_check(const DecodeOptions& o) {
  DecodeProblem prob(o);
  run_and_check(prob);
}

TEST_P(DecodeGpu, TokensOneToSixteenBothStateDtypes) {
  for (int64_t T : {1, 2, 4, 16}) {
    for (DType s : {DType::kF32, DType::kBF16}) {
      DecodeOptions o;
      o.N = 5, o.T = T, o.H = 3;
      o.state_dtype = s;
      run_and_check(o);
    }
  }
}

// N·H >= 2048 selects the 64-rows-per-CTA tile (config.h kLargeTileMinHeads).
TEST_P(DecodeGpu, LargeBatchUsesLargeTile) {
  for (DType s : {DType::kF32, DType::kBF16}) {
    DecodeOptions o;
    o.N = 520, o.T = 1, o.H = 4;
    o.state_dtype = s;
    o.padding = {3, 100, 519};
    run_and_check(o);
  }
  DecodeOptions o;
  o.N = 300, o.T = 3, o.H = 8;
  o.speculative = true;
  o.indices_stride = 3;
  run_and_check(o);
}

// The launcher's own choice (internal::DecodeLaunch::persistent = -1) in each of its N·H ranges for
// bf16 pools (the tile kernels, the three-buffer bulk-copy kernel from 384, the persistent kernel
// from 2048) and for fp32 pools: against the reference, and bit for bit the forced kernel of that
// range.
TEST(DecodeGpuRule, EachRangeMatchesReferenceAndItsForcedKernel) {
  if (!cuda_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU visible: GPU decode tests skipped";
  struct Case { int64_t N, H; DType state; int forced; };
  for (const Case c : {Case{6, 16, DType::kBF16, 0}, Case{16, 32, DType::kBF16, 3}, Case{16, 96, DType::kBF16, 3},
                       Case{65, 32, DType::kBF16, 1}, Case{16, 32, DType::kF32, 0}}) {
    DecodeOptions o;
    o.N = c.N, o.T = 2, o.H = c.H;
    o.state_dtype = c.state;
    o.padding = {1};
    DecodeProblem prob(o);
    DeviceDecode dev(prob);
    g_launch = {};
    run_decode(dev.params());
    dev.download();
    prob.check(kTolBf16, tol_state(prob.opt), "rule N*H=" + std::to_string(c.N * c.H));
    const std::vector<unsigned char> out_rule = prob.in.out.bytes, pool_rule = prob.pool.bytes;
    dev.reset();
    g_launch.persistent = c.forced;
    run_decode(dev.params());
    dev.download();
    g_launch = {};
    EXPECT_EQ(prob.in.out.bytes, out_rule) << "N*H=" << c.N * c.H;
    EXPECT_EQ(prob.pool.bytes, pool_rule) << "N*H=" << c.N * c.H;
  }
}

// Many items per persistent CTA (N·H·2 items against a grid of a few CTAs per SM) with empty,
// padded and varlen sequences mixed in, so every branch of its prefetch loop runs between
// ordinary items; both state dtypes.
TEST_P(DecodeGpu, ManyItemsPerCtaWithEmptyAndPaddedSequences) {
  for (DType s : {DType::kF32, DType::kBF16}) {
    DecodeOptions o;
    o.H = 4;
    for (int64_t n = 0; n < 600; ++n) o.seqlens.push_back(n % 7 == 3 ? 0 : 1 + (n * 5) % 4);
    o.padding = {0, 1, 57, 300, 301, 599};
    o.state_dtype = s;
    run_and_check(o);
  }
}

// Device cu_seqlens cannot be checked without a sync, so a sequence longer than 16 tokens reaches
// the kernels, which run the same recurrence over it in groups of 16 staged tokens (the
// validator's documented behaviour); it must match the fp64 reference like any other.
TEST_P(DecodeGpu, SequencesLongerThan16OnDeviceCuSeqlensRunInGroups) {
  for (DType s : {DType::kF32, DType::kBF16}) {
    DecodeOptions o;
    o.seqlens = {3, 20, 1, 37, 16, 0, 33};
    o.H = 2;
    o.padding = {3};
    o.state_dtype = s;
    run_and_check(o);
  }
}

// Device cu_seqlens cannot be checked on the host: offsets outside [0, T] make an empty sequence
// (nothing read or written) instead of reads and writes past q, v and out.
TEST_P(DecodeGpu, OutOfRangeDeviceCuSeqlensTouchNothing) {
  for (DType cu_dtype : {DType::kI32, DType::kI64}) {
    DecodeOptions o;
    o.seqlens = {3, 5, 2};  // cu_seqlens [0, 3, 8, 10]
    o.cu_dtype = cu_dtype;
    o.H = 2;
    DecodeProblem prob(o);
    DeviceDecode dev(prob);
    HostTensor cu = prob.in.cu_seqlens;
    cu.set(2, cu_dtype == DType::kI32 ? 2147483647.0 : 1e15);  // sequence 1 ends, sequence 2 starts past T
    DeviceBuffer bad(cu.bytes.size());
    ASSERT_EQ(cudaMemcpy(bad.ptr, cu.bytes.data(), cu.bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    DecodeParams p = dev.params();
    p.cu_seqlens = bad.ptr;
    run_decode(p);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "bad offsets faulted";
    dev.download();
    const size_t slot_bytes = size_t(prob.slice) * dtype_size(o.state_dtype);
    const auto slot_bytes_of = [&](const HostTensor& pool, int64_t n) {
      const auto* b = pool.bytes.data() + size_t(prob.start_slot(n)) * slot_bytes;
      return std::vector<unsigned char>(b, b + slot_bytes);
    };
    EXPECT_NE(slot_bytes_of(prob.pool, 0), slot_bytes_of(prob.pool_before, 0)) << "sequence 0 did not run";
    for (int64_t n : {1, 2}) EXPECT_EQ(slot_bytes_of(prob.pool, n), slot_bytes_of(prob.pool_before, n)) << n;
    const size_t row_bytes = size_t(o.H) * o.V * dtype_size(o.dtype);
    const std::vector<unsigned char> rest(prob.in.out.bytes.begin() + 3 * row_bytes,
                                          prob.in.out.bytes.begin() + 10 * row_bytes);
    EXPECT_EQ(rest, std::vector<unsigned char>(rest.size(), kPoison)) << "out rows of sequences 1, 2 written";
  }
}

TEST_P(DecodeGpu, VarlenInt32AndInt64) {
  for (DType cu : {DType::kI32, DType::kI64}) {
    DecodeOptions o;
    o.seqlens = {1, 16, 3, 7, 1};
    o.cu_dtype = cu;
    o.H = 2;
    run_and_check(o);
  }
}

TEST_P(DecodeGpu, GateFormsFlagsAndFloat32GateBeta) {
  for (GateForm gate : {GateForm::kLowerBound, GateForm::kSoftplus, GateForm::kPrecomputed}) {
    for (DType gb : {DType::kBF16, DType::kF32}) {
      DecodeOptions o;
      o.N = 3, o.T = 4, o.H = 2;
      o.gate = gate;
      o.g_dtype = o.beta_dtype = gb;
      if (gate == GateForm::kPrecomputed) o.g_min = -1000.0, o.g_max = 0.0;
      run_and_check(o);
    }
  }
  DecodeOptions o;
  o.N = 3, o.T = 3, o.H = 2;
  o.l2norm = false;
  o.beta_is_logit = false;
  o.with_dt_bias = false;
  o.has_scale = true;
  o.scale = 0.3f;
  o.lower_bound = -1.5f;
  run_and_check(o);
}

TEST_P(DecodeGpu, PaddingEntriesTouchNothingAndOutputZero) {
  DecodeOptions o;
  o.N = 6, o.T = 2, o.H = 2;
  o.padding = {0, 3, 5};
  for (DType s : {DType::kF32, DType::kBF16}) {
    o.state_dtype = s;
    run_and_check(o);
  }
}

// What the GPU does with indices the CPU backend would reject (they cannot be checked without a
// sync): a start slot >= pool_size or an accepted count outside [1, stride] is padding, a store
// slot >= pool_size is skipped.
TEST_P(DecodeGpu, OutOfRangeIndicesAreSkipped) {
  DecodeOptions o;
  o.N = 5, o.T = 3, o.H = 2;
  o.speculative = true;
  o.indices_stride = 3;
  o.accepted = {1, 2, 3, 1, 2};
  DecodeProblem prob(o);
  prob.indices[0 * 3 + 0] = int32_t(prob.P + 7);  // start slot of sequence 0 out of range
  prob.accepted[1] = 0;                           // sequence 1: accepted count out of range
  prob.accepted[2] = 4;                           // sequence 2: likewise
  prob.indices[3 * 3 + 2] = int32_t(prob.P);      // sequence 3: last store slot out of range
  run_and_check(prob);
}

TEST_P(DecodeGpu, SpeculativeSlotsPerToken) {
  for (DType s : {DType::kF32, DType::kBF16}) {
    DecodeOptions o;
    o.N = 4, o.T = 3, o.H = 2;
    o.speculative = true;
    o.indices_stride = 4;
    o.accepted = {1, 2, 3, 4};
    o.skipped_stores = {{0, 1}, {2, 2}};
    o.state_dtype = s;
    run_and_check(o);
  }
  DecodeOptions v;
  v.seqlens = {4, 1, 3, 2};
  v.speculative = true;
  v.indices_stride = 5;
  v.padding = {2};
  v.skipped_stores = {{0, 3}};
  run_and_check(v);
}

// The GPU and the CPU backends agree far below the bf16 tolerance (both fp32 math).
TEST_P(DecodeGpu, MatchesCpuDecode) {
  DecodeOptions o;
  o.N = 7, o.T = 5, o.H = 3;
  o.extra_slots = 0;  // every slot is named and written: no NaN sentinel in the comparison
  DecodeProblem prob(o);
  DecodeProblem cpu_prob(o);
  cpu_prob.in = prob.in;
  cpu_prob.pool = prob.pool;
  cpu_prob.indices = prob.indices;
  run_decode(cpu_prob.params());
  DeviceDecode dev(prob);
  run_decode(dev.params());
  dev.download();
  const double err_state = rel_rms(prob.pool.values(), cpu_prob.pool.values());
  const double err_out = rel_rms(prob.in.out.values(), cpu_prob.in.out.values());
  report("gpu_vs_cpu_state_rel_rms", err_state);
  report("gpu_vs_cpu_out_rel_rms", err_out);
  EXPECT_LE(err_state, 1e-5);
  EXPECT_LE(err_out, 4e-3);  // a few bf16 outputs may round the other way
}

TEST_P(DecodeGpu, RepeatRunsAreBitIdentical) {
  DecodeOptions o;
  o.N = 9, o.T = 4, o.H = 3;
  o.speculative = true;
  o.indices_stride = 4;
  DecodeProblem prob(o);
  DeviceDecode dev(prob);
  run_decode(dev.params());
  dev.download();
  const std::vector<unsigned char> out1 = prob.in.out.bytes, pool1 = prob.pool.bytes;
  dev.reset();
  run_decode(dev.params());
  dev.download();
  EXPECT_EQ(prob.in.out.bytes, out1);
  EXPECT_EQ(prob.pool.bytes, pool1);
}

// The slot check (internal::DecodeLaunch::check_slots: 0 the rule, on from two sequences; 1 always;
// -1 never): out and pool after one call without it and one with check_slots = `on`, on the same
// problem.
struct CheckedAndUnchecked {
  std::vector<unsigned char> out_off, pool_off, out_on, pool_on;
};
CheckedAndUnchecked run_with_and_without_slot_check(DecodeProblem& prob, int on) {
  CheckedAndUnchecked r;
  DeviceDecode dev(prob);
  for (const int check : {-1, on}) {
    dev.reset();
    g_launch.check_slots = check;
    run_decode(dev.params());
    dev.download();
    (check >= 0 ? r.out_on : r.out_off) = prob.in.out.bytes;
    (check >= 0 ? r.pool_on : r.pool_off) = prob.pool.bytes;
  }
  g_launch.check_slots = 0;
  return r;
}

// One call with the caller's opt-out (DecodeParams::check_slots = false) and the launch's defaults;
// out and pool land in prob.
void run_without_the_caller_check(DecodeProblem& prob) {
  DeviceDecode dev(prob);
  dev.reset();
  DecodeParams p = dev.params();
  p.check_slots = false;
  run_decode(p);
  dev.download();
}

// With no slot shared, the check changes nothing, bit for bit: plain and speculative calls, padding
// (negative indices repeat), out-of-range slots and accepted counts, empty sequences, an empty
// sequence naming a live sequence's slot (it touches nothing), and a speculative sequence that names
// one slot for two of its tokens (its own, not shared).
TEST_P(DecodeGpu, SlotCheckChangesNoValidCall) {
  std::vector<DecodeOptions> cases(6);
  cases[0].N = 5, cases[0].T = 3, cases[0].H = 3;
  cases[1].N = 7, cases[1].H = 2, cases[1].state_dtype = DType::kBF16, cases[1].padding = {0, 3, 5};
  cases[2].N = 4, cases[2].T = 3, cases[2].H = 2, cases[2].speculative = true, cases[2].indices_stride = 4;
  cases[2].accepted = {1, 2, 3, 4}, cases[2].skipped_stores = {{0, 1}, {2, 2}};
  cases[3].N = 5, cases[3].T = 3, cases[3].H = 2, cases[3].speculative = true, cases[3].indices_stride = 3;
  cases[3].accepted = {1, 2, 3, 1, 2};
  cases[4].H = 2, cases[4].seqlens = {2, 0, 3, 0, 1}, cases[4].padding = {4};
  cases[5].N = 3, cases[5].T = 3, cases[5].H = 2, cases[5].speculative = true, cases[5].indices_stride = 3;
  cases[5].accepted = {1, 2, 1};
  for (size_t i = 0; i < cases.size(); ++i) {
    DecodeProblem prob(cases[i]);
    if (i == 3) {  // OutOfRangeIndicesAreSkipped's indices
      prob.indices[0 * 3 + 0] = int32_t(prob.P + 7);
      prob.accepted[1] = 0, prob.accepted[2] = 4;
      prob.indices[3 * 3 + 2] = int32_t(prob.P);
    }
    if (i == 4) prob.indices[1] = prob.indices[0];  // sequence 1 is empty
    if (i == 5) prob.indices[0 * 3 + 1] = prob.indices[0 * 3 + 0];  // one sequence names a slot for two tokens
    for (const int on : {1, 0}) {
      const CheckedAndUnchecked r = run_with_and_without_slot_check(prob, on);
      EXPECT_EQ(r.out_on, r.out_off) << "case " << i << ", check_slots " << on;
      EXPECT_EQ(r.pool_on, r.pool_off) << "case " << i << ", check_slots " << on;
      EXPECT_EQ(count_nonfinite(prob.in.out.values()), 0) << "case " << i << ", check_slots " << on;
      if (on == 0) {  // the caller's opt-out (DecodeParams::check_slots = false): the unchecked call's bits
        run_without_the_caller_check(prob);
        EXPECT_EQ(prob.in.out.bytes, r.out_off) << "case " << i << ", DecodeParams::check_slots = false";
        EXPECT_EQ(prob.pool.bytes, r.pool_off) << "case " << i << ", DecodeParams::check_slots = false";
      }
    }
  }
}

// Two sequences that read or write one live slot (a race without the check): with it, both write
// NaN outputs and store nothing (every slot either names unchanged), and every other sequence's
// outputs and slots are what the unchecked call gives them. Plain (two start slots) and
// speculative (one sequence's store slot is another's start slot), both state dtypes; the check
// forced and by the default rule. And once with a pool of 14 000 slots, past the persistent and
// bulk-copy kernels' slot table (13 536 slots at most), where they scan per item instead.
TEST_P(DecodeGpu, SlotCheckPoisonsSequencesThatShareASlot) {
  for (const int64_t extra_slots : {int64_t(5), int64_t(14000)})
  for (const int on : {1, 0})
  for (const bool speculative : {false, true})
    for (const DType state : {DType::kF32, DType::kBF16}) {
      const bool large = extra_slots > 5;
      if (large && (on != 0 || state != DType::kBF16)) continue;  // the rule on bf16 pools: 450 MB each
      SCOPED_TRACE(std::string("check_slots ") + std::to_string(on) + (speculative ? ", speculative" : "") +
                   (state == DType::kBF16 ? ", bf16 pool" : ", fp32 pool") + (large ? ", 14 000 slots" : ""));
      DecodeOptions o;
      o.N = 6, o.T = 3, o.H = large ? 1 : 2, o.state_dtype = state, o.extra_slots = extra_slots;
      if (speculative) o.speculative = true, o.indices_stride = 3, o.accepted = {1, 2, 3, 1, 2, 3};
      DecodeProblem prob(o);
      const int64_t stride = o.indices_stride;
      // The two sequences that share a slot: speculative, a (accepted 1: its start slot is entry 0)
      // stores into b's start slot after its last token.
      const int64_t a = speculative ? 0 : 1, b = 4;
      std::vector<int32_t> touched;  // every slot a or b names
      if (speculative) {
        prob.indices[a * stride + 2] = prob.start_slot(b);
      } else {
        touched.push_back(prob.indices[b * stride]);  // b's own slot, now unnamed
        prob.indices[b * stride] = prob.indices[a * stride];
      }
      for (const int64_t n : {a, b})
        for (int64_t t = 0; t < stride; ++t)
          if (prob.indices[n * stride + t] >= 0) touched.push_back(prob.indices[n * stride + t]);
      const CheckedAndUnchecked r = run_with_and_without_slot_check(prob, on);
      const size_t row = size_t(o.H) * o.V * 2, slot = size_t(prob.slice) * dtype_size(state);
      for (int64_t n = 0; n < prob.N; ++n) {
        const size_t lo = size_t(prob.bos[n]) * row, hi = size_t(prob.bos[n] + prob.len[n]) * row;
        const std::vector<unsigned char> on(r.out_on.begin() + lo, r.out_on.begin() + hi);
        const std::vector<unsigned char> off(r.out_off.begin() + lo, r.out_off.begin() + hi);
        if (n == a || n == b) {
          for (size_t i = 0; i + 1 < on.size(); i += 2)
            ASSERT_EQ(on[i] | (on[i + 1] << 8), 0x7fc0) << "sequence " << n << " output not NaN";
        } else {
          EXPECT_EQ(on, off) << "sequence " << n;
        }
      }
      for (int64_t s = 0; s < prob.P; ++s) {
        const bool shared = std::find(touched.begin(), touched.end(), int32_t(s)) != touched.end();
        const auto& expected = shared ? prob.pool_before.bytes : r.pool_off;
        EXPECT_TRUE(std::equal(r.pool_on.begin() + s * slot, r.pool_on.begin() + (s + 1) * slot,
                               expected.begin() + s * slot))
            << "slot " << s << (shared ? " (named by the sharing sequences) written" : " differs");
      }
      if (on == 0) {  // the caller's opt-out (DecodeParams::check_slots = false) reaches the kernels: no NaN
        run_without_the_caller_check(prob);
        EXPECT_EQ(count_nonfinite(prob.in.out.values()), 0) << "DecodeParams::check_slots = false";
      }
    }
}

// run_decode() is capturable: no host sync, no allocation. The replayed graph writes exactly what the
// eager call wrote.
TEST_P(DecodeGpu, CudaGraphCaptureAndReplayMatchesEagerRun) {
  DecodeOptions o;
  o.seqlens = {3, 1, 16, 2};
  o.state_dtype = DType::kBF16;
  o.padding = {1};
  DecodeProblem prob(o);
  DeviceDecode dev(prob);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  run_decode(dev.params(), stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  dev.download();
  prob.check(kTolBf16, kTolBf16, "eager");
  const std::vector<unsigned char> out_eager = prob.in.out.bytes, pool_eager = prob.pool.bytes;

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  run_decode(dev.params(), stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    dev.reset();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    dev.download();
    EXPECT_EQ(prob.in.out.bytes, out_eager) << "replay " << replay;
    EXPECT_EQ(prob.pool.bytes, pool_eager) << "replay " << replay;
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

// GPU prefill over the first T0 tokens into a pool slot, then GPU decode of the rest: the same
// outputs and final state as the fp64 recurrence over the whole sequence.
TEST_P(DecodeGpu, DecodeAfterPrefillMatchesWholeSequence) {
  const int64_t T0 = 77, T1 = 4, H = 2, K = 128, V = 128, slice = H * V * K, P = 3, slot = 1;
  KdaOptions ko;
  ko.B = 1, ko.T = T0 + T1, ko.H = H;
  ko.initial_state = StateKind::kF32;
  KdaInputs whole(ko);
  const Reference ref = run_reference(whole);

  DeviceBuffer q(whole.q.bytes.size()), k(whole.k.bytes.size()), v(whole.v.bytes.size()), g(whole.g.bytes.size()),
      beta(whole.beta.bytes.size()), out(whole.out.bytes.size()), init(whole.initial_state.bytes.size()),
      A_log(H * 4), dt_bias(H * K * 4), pool(P * slice * 4), index(4);
  for (auto [dst, src, n] : {std::tuple{q.ptr, whole.q.data(), whole.q.bytes.size()},
                            std::tuple{k.ptr, whole.k.data(), whole.k.bytes.size()},
                            std::tuple{v.ptr, whole.v.data(), whole.v.bytes.size()},
                            std::tuple{g.ptr, whole.g.data(), whole.g.bytes.size()},
                            std::tuple{beta.ptr, whole.beta.data(), whole.beta.bytes.size()},
                            std::tuple{init.ptr, whole.initial_state.data(), whole.initial_state.bytes.size()},
                            std::tuple{A_log.ptr, static_cast<void*>(whole.A_log.data()), size_t(H * 4)},
                            std::tuple{dt_bias.ptr, static_cast<void*>(whole.dt_bias.data()), size_t(H * K * 4)}}) {
    CUDA_OK(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
  }
  const int32_t slot32 = int32_t(slot);
  CUDA_OK(cudaMemcpy(index.ptr, &slot32, 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(pool.ptr, 0xFF, P * slice * 4));

  PrefillParams pp = whole.params();
  pp.q = q.ptr, pp.k = k.ptr, pp.v = v.ptr, pp.g = g.ptr, pp.beta = beta.ptr, pp.out = out.ptr;
  pp.initial_state = init.ptr;
  pp.final_state = static_cast<char*>(pool.ptr) + slot * slice * 4;
  pp.final_state_dtype = DType::kF32;
  pp.pre.A_log = static_cast<float*>(A_log.ptr);
  pp.pre.dt_bias = static_cast<float*>(dt_bias.ptr);
  pp.T = T0;
  const size_t ws_bytes = workspace_size(pp);
  DeviceBuffer ws(ws_bytes);
  forward(pp, ws.ptr, ws_bytes);

  DecodeParams dp;
  dp.q = static_cast<char*>(q.ptr) + T0 * H * K * 2;
  dp.k = static_cast<char*>(k.ptr) + T0 * H * K * 2;
  dp.v = static_cast<char*>(v.ptr) + T0 * H * V * 2;
  dp.g = static_cast<char*>(g.ptr) + T0 * H * K * 2;
  dp.beta = static_cast<char*>(beta.ptr) + T0 * H * 2;
  dp.out = static_cast<char*>(out.ptr) + T0 * H * V * 2;
  dp.state_pool = pool.ptr;
  dp.state_dtype = DType::kF32;
  dp.pool_size = P;
  dp.state_indices = static_cast<int32_t*>(index.ptr);
  dp.num_seqs = 1;
  dp.T = T1;
  dp.H = H;
  dp.pre = pp.pre;
  run_decode(dp);
  CUDA_OK(cudaDeviceSynchronize());

  HostTensor got_out(DType::kBF16, (T0 + T1) * H * V);
  HostTensor got_pool(DType::kF32, P * slice);
  CUDA_OK(cudaMemcpy(got_out.data(), out.ptr, got_out.data_bytes(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(got_pool.data(), pool.ptr, got_pool.data_bytes(), cudaMemcpyDeviceToHost));
  const std::vector<double> all_out = got_out.values();
  const std::vector<double> tail_out(all_out.end() - T1 * H * V, all_out.end());
  const std::vector<double> want_out(ref.out.end() - T1 * H * V, ref.out.end());
  std::vector<double> state(slice);
  for (int64_t i = 0; i < slice; ++i) state[i] = got_pool.get(slot * slice + i);
  EXPECT_LE(rel_rms(tail_out, want_out), 6e-3);
  EXPECT_LE(rel_rms(state, ref.final_state), 6e-3);
  for (int64_t other : {int64_t(0), int64_t(2)}) {
    for (int64_t i = 0; i < slice; ++i) {
      uint32_t bits;
      std::memcpy(&bits, static_cast<const char*>(got_pool.data()) + (other * slice + i) * 4, 4);
      ASSERT_EQ(bits, 0xFFFFFFFFu) << "unnamed slot " << other << " written at " << i;
    }
  }
}

TEST_P(DecodeGpu, BadArgumentsThrowBeforeAnyWork) {
  DecodeOptions o;
  o.N = 2, o.T = 1;
  DecodeProblem prob(o);
  DeviceDecode dev(prob);
  const DecodeParams good = dev.params();
  const auto expect_error = [&](const DecodeParams& p, ErrorCode code, const std::string& needle) {
    try {
      run_decode(p);
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  DecodeParams p = good;
  p.dtype = DType::kF32;
  expect_error(p, ErrorCode::kUnsupported, "bfloat16 on the GPU");  // valid, not served on the GPU
  p = good, p.K = 64;
  expect_error(p, ErrorCode::kUnsupported, "K = V = 128");
  p = good, p.q = static_cast<const char*>(good.q) + 2;
  expect_error(p, ErrorCode::kInvalidArgument, "q must be 16-byte aligned");
  p = good, p.state_pool = static_cast<char*>(good.state_pool) + 4;
  expect_error(p, ErrorCode::kInvalidArgument, "state_pool must be 16-byte aligned");
  p = good, p.T = 17;
  expect_error(p, ErrorCode::kInvalidArgument, "T (tokens per sequence)");
  // A pool in pageable host memory next to device inputs: named, nothing touched.
  std::vector<unsigned char> host_pool(prob.pool.bytes);
  p = good, p.state_pool = host_pool.data();
  expect_error(p, ErrorCode::kInvalidArgument, "decode: state_pool is pageable host memory but q is on the GPU");
  std::vector<int32_t> host_indices(prob.indices);
  p = good, p.state_indices = host_indices.data();
  expect_error(p, ErrorCode::kInvalidArgument, "decode: state_indices is pageable host memory");
  EXPECT_EQ(host_pool, prob.pool.bytes);
  dev.download();
  EXPECT_EQ(prob.pool.bytes, prob.pool_before.bytes);
  EXPECT_EQ(prob.in.out.bytes, std::vector<unsigned char>(prob.in.out.bytes.size(), kPoison));
}

// Corrupted DecodeParams on the GPU (tests/cpp/fuzz_params.h, plus misaligned and pageable host
// pointers and bad index, accepted-count and cu_seqlens values in device memory, which the
// kernels must absorb: padding, skipped stores, empty sequences). Every call runs or throws
// before writing, and nothing ever faults (a kernel fault would be sticky).
TEST_P(DecodeGpu, CorruptedParamsRunOrThrowAndNeverFault) {
  Fuzz f;
  int refused = 0;
  constexpr int kGpuCases = 150;
  std::vector<uint8_t> pageable(1 << 20);
  for (int c = 0; c < kGpuCases; ++c) {
    const DecodeOptions o = f.decode_problem();  // K = V = 128, bf16: the GPU's
    DecodeProblem prob(o);
    DeviceDecode dev(prob);
    DecodeParams p = dev.params();
    const DecodeParams p0 = p;
    std::vector<std::unique_ptr<DeviceBuffer>> keep;
    const auto to_device = [&](const void* src, size_t bytes) {
      keep.push_back(std::make_unique<DeviceBuffer>(bytes));
      EXPECT_EQ(cudaMemcpy(keep.back()->ptr, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
      return keep.back()->ptr;
    };
    std::vector<int32_t> indices = prob.indices, accepted = prob.accepted;
    HostTensor cu = prob.in.cu_seqlens;
    std::string what = prob.in.describe() + (o.speculative ? " speculative |" : " |");
    for (int64_t m = 1 + f.below(2); m > 0; --m) {
      switch (f.below(10)) {
        case 0:  // invalid here (never a valid dtype of another size)
          switch (f.below(3)) {
            case 0: p.dtype = f.pick({DType::kF32, DType::kI32, static_cast<DType>(77)}); break;
            case 1: p.g_dtype = f.bad_float_dtype(); break;
            default: p.state_dtype = f.bad_float_dtype();
          }
          what += " a dtype";
          break;
        case 1: f.null_pointer(p, what); break;
        case 2: {
          int64_t* sizes[] = {&p.num_seqs, &p.H, &p.pool_size, &p.indices_stride};
          const int64_t orig[] = {p0.num_seqs, p0.H, p0.pool_size, p0.indices_stride}, i = f.below(4);
          *sizes[i] = f.shrunk_or_bad(orig[i]), what += " a size=" + std::to_string(*sizes[i]);
          break;
        }
        case 3:
          if (f.below(2)) (f.below(2) ? p.K : p.V) = f.pick<int64_t>({64, 0, 256}), what += " K/V";
          else p.T = f.below(2) ? f.shrunk_or_bad(p0.T) : f.pick<int64_t>({0, 17, -1}), what += " T";
          break;
        case 4: {  // misaligned by 2 or 4 bytes inside the same buffer
          const void** ptrs[] = {&p.q, &p.k, &p.v, &p.g};
          const void*& x = *ptrs[f.below(4)];
          if (f.below(2) && x != nullptr) x = static_cast<const uint8_t*>(x) + 2, what += " misaligned";
          else if (p.state_pool != nullptr) p.state_pool = static_cast<uint8_t*>(p.state_pool) + 4, what += " misaligned";
          break;
        }
        case 5:  // pageable host memory where device memory belongs
          switch (f.below(4)) {
            case 0: p.k = pageable.data(); break;
            case 1: p.state_pool = pageable.data(); break;
            case 2: p.state_indices = reinterpret_cast<const int32_t*>(pageable.data()); break;
            default: p.out = pageable.data();
          }
          what += " a host tensor";
          break;
        case 6: {  // bad slot values in device memory: padding or a skipped store
          const int64_t i = f.below(int64_t(indices.size()));
          indices[i] = f.pick<int32_t>({-1, -7, int32_t(prob.P), int32_t(prob.P) + 100,
                                        std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()});
          p.state_indices = static_cast<const int32_t*>(to_device(indices.data(), indices.size() * 4));
          what += " indices[" + std::to_string(i) + "]=" + std::to_string(indices[i]);
          break;
        }
        case 7:
          if (p.num_accepted_tokens == nullptr) break;
          accepted[f.below(int64_t(accepted.size()))] = f.pick<int32_t>({0, -1, 5, std::numeric_limits<int32_t>::max()});
          p.num_accepted_tokens = static_cast<const int32_t*>(to_device(accepted.data(), accepted.size() * 4));
          what += " accepted";
          break;
        case 8:
          if (p.cu_seqlens == nullptr) break;
          if (f.below(3) == 0) {
            p.cu_seqlens_dtype = f.bad_index_dtype(), what += " cu_dtype";
          } else {  // bad offsets in device memory: empty sequences, never reads past the tensors
            f.corrupt_cu(cu, prob.N + 1, what);
            p.cu_seqlens = to_device(cu.bytes.data(), cu.bytes.size());
          }
          break;
        default: f.corrupt_gate(p.pre, what);
      }
    }
    SCOPED_TRACE(what);
    if (run([&] { run_decode(p); }, what) == Outcome::kRefused) {
      ++refused;
      dev.download();
      EXPECT_EQ(prob.pool.bytes, prob.pool_before.bytes) << "pool written before the error";
      EXPECT_EQ(prob.in.out.bytes, std::vector<unsigned char>(prob.in.out.bytes.size(), kPoison)) << "out written";
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the call faulted";
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    if (HasFailure()) break;
  }
  EXPECT_GT(refused, kGpuCases / 3);
  EXPECT_LT(refused, kGpuCases);
}

}  // namespace
}  // namespace flashkda::test
