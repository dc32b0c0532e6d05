// CPU decode (docs/SPEC.md §5) against the fp64 token recurrence: single and several tokens, varlen,
// padding, speculative slots, both state dtypes, all gate forms and flags, sentinel pool slots
// that must stay bit-exact, decode after prefill, and argument errors. The DecodeCpu tests run once
// per instruction set of the engine (internal::DecodeLaunch::cpu_isa), skipping, with the reason,
// those the processor lacks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "backend.h"
#include "isa_test.h"
#include "test_decode_fixture.h"

namespace flashkda::test {
namespace {

// fp32 math on bf16 inputs: the error is the bf16 rounding of what is stored.
constexpr double kTolBf16 = 5e-3;  // bf16 out or bf16 state (one rounding: ~1.1e-3 rel RMS)
constexpr double kTolF32 = 2e-5;   // fp32 out or fp32 state

double tol_out(const DecodeOptions& o) { return o.dtype == DType::kBF16 ? kTolBf16 : kTolF32; }
double tol_state(const DecodeOptions& o) { return o.state_dtype == DType::kBF16 ? kTolBf16 : kTolF32; }

// CPU decode of p with the running test's instruction set.
void run_cpu(const DecodeParams& p) {
  internal::DecodeLaunch launch{};
  launch.cpu_isa = g_isa;
  internal::decode(p, launch);
}

class DecodeCpu : public IsaTest {};

void run_and_check(const DecodeOptions& o) {
  DecodeProblem prob(o);
  run_cpu(prob.params());
  prob.check(tol_out(o), tol_state(o));
}

TEST_P(DecodeCpu, SingleTokenBothStateDtypes) {
  for (DType s : {DType::kF32, DType::kBF16}) {
    DecodeOptions o;
    o.N = 5, o.T = 1, o.H = 3;
    o.state_dtype = s;
    run_and_check(o);
  }
}

TEST_P(DecodeCpu, SeveralTokensUpToSixteen) {
  for (int64_t T : {2, 5, 16}) {
    for (DType s : {DType::kF32, DType::kBF16}) {
      DecodeOptions o;
      o.N = 3, o.T = T, o.H = 2;
      o.state_dtype = s;
      run_and_check(o);
    }
  }
}

TEST_P(DecodeCpu, VarlenInt32AndInt64) {
  for (DType cu : {DType::kI32, DType::kI64}) {
    DecodeOptions o;
    o.seqlens = {1, 16, 3, 7, 1};
    o.cu_dtype = cu;
    o.H = 2;
    run_and_check(o);
  }
}

TEST_P(DecodeCpu, GateFormsAndFlags) {
  for (GateForm gate : {GateForm::kLowerBound, GateForm::kSoftplus, GateForm::kPrecomputed}) {
    DecodeOptions o;
    o.N = 3, o.T = 4, o.H = 2;
    o.gate = gate;
    if (gate == GateForm::kPrecomputed) o.g_min = -1000.0, o.g_max = 0.0;
    run_and_check(o);
    for (const int64_t K : {1, 20, 40}) {  // the gates' vector loops (32 and 8 channels) and their tails
      o.K = K, o.V = 24;
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

TEST_P(DecodeCpu, Float32InputsGateAndBeta) {
  DecodeOptions o;
  o.N = 3, o.T = 4, o.H = 2;
  o.dtype = o.g_dtype = o.beta_dtype = DType::kF32;
  for (DType s : {DType::kF32, DType::kBF16}) {
    o.state_dtype = s;
    run_and_check(o);
  }
}

TEST_P(DecodeCpu, PaddingEntriesTouchNothingAndOutputZero) {
  DecodeOptions o;
  o.N = 6, o.T = 2, o.H = 2;
  o.padding = {0, 3, 5};
  for (DType s : {DType::kF32, DType::kBF16}) {
    o.state_dtype = s;
    run_and_check(o);
  }
  DecodeOptions v;
  v.seqlens = {2, 1, 4};
  v.padding = {1};
  run_and_check(v);
}

TEST_P(DecodeCpu, SpeculativeSlotsPerToken) {
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
}

TEST_P(DecodeCpu, SpeculativeVarlenWithPadding) {
  DecodeOptions o;
  o.seqlens = {4, 1, 3, 2};
  o.speculative = true;
  o.indices_stride = 5;
  o.padding = {2};
  o.skipped_stores = {{0, 3}};
  run_and_check(o);
}

TEST_P(DecodeCpu, SpeculativeStrideOneEqualsPlainDecode) {
  DecodeOptions o;
  o.N = 4, o.T = 1, o.H = 2;
  o.speculative = true;
  o.indices_stride = 1;
  run_and_check(o);
}

// Four decode calls of one token leave the same fp32 state as one call of four tokens (fp32 pool:
// the state never leaves fp32 in between), and the same outputs.
TEST_P(DecodeCpu, TokenByTokenEqualsMultiTokenBitExact) {
  DecodeOptions o;
  o.N = 3, o.T = 4, o.H = 2;
  DecodeProblem multi(o);
  DecodeProblem single(o);
  single.in = multi.in;  // same inputs, same seeds
  single.pool = multi.pool;
  single.indices = multi.indices;
  run_cpu(multi.params());

  DecodeParams p = single.params();
  std::vector<unsigned char> out_bytes(multi.in.out.data_bytes());
  const int64_t H = o.H, K = o.K, V = o.V, T = o.T;
  for (int64_t t = 0; t < T; ++t) {
    // Inputs of token t of every sequence, packed [N, 1, H, *].
    KdaOptions ko = DecodeProblem::kda_options(o);
    ko.T = 1;
    ko.seed = 1;
    KdaInputs step(ko);
    for (int64_t n = 0; n < o.N; ++n) {
      const int64_t src = (n * T + t) * H, dst = n * H;
      std::memcpy(static_cast<char*>(step.q.data()) + dst * K * 2, static_cast<char*>(single.in.q.data()) + src * K * 2, H * K * 2);
      std::memcpy(static_cast<char*>(step.k.data()) + dst * K * 2, static_cast<char*>(single.in.k.data()) + src * K * 2, H * K * 2);
      std::memcpy(static_cast<char*>(step.v.data()) + dst * V * 2, static_cast<char*>(single.in.v.data()) + src * V * 2, H * V * 2);
      std::memcpy(static_cast<char*>(step.g.data()) + dst * K * 2, static_cast<char*>(single.in.g.data()) + src * K * 2, H * K * 2);
      std::memcpy(static_cast<char*>(step.beta.data()) + dst * 2, static_cast<char*>(single.in.beta.data()) + src * 2, H * 2);
    }
    DecodeParams ps = p;
    ps.q = step.q.data(), ps.k = step.k.data(), ps.v = step.v.data(), ps.g = step.g.data(), ps.beta = step.beta.data();
    ps.out = step.out.data();
    ps.T = 1;
    run_cpu(ps);
    for (int64_t n = 0; n < o.N; ++n) {
      std::memcpy(out_bytes.data() + (n * T + t) * H * V * 2, static_cast<char*>(step.out.data()) + n * H * V * 2,
                  H * V * 2);
    }
  }
  EXPECT_EQ(std::memcmp(out_bytes.data(), multi.in.out.data(), out_bytes.size()), 0) << "outputs differ";
  EXPECT_EQ(std::memcmp(single.pool.data(), multi.pool.data(), multi.pool.data_bytes()), 0) << "pool differs";
}

// Prefill over the first T0 tokens into a pool slot, then decode the rest: same outputs and final
// state as the fp64 recurrence over the whole sequence.
TEST_P(DecodeCpu, DecodeAfterPrefillMatchesWholeSequence) {
  for (DType s : {DType::kF32, DType::kBF16}) {
    const int64_t T0 = 37, T1 = 5, H = 2, K = 128, V = 128;
    KdaOptions ko;
    ko.B = 1, ko.T = T0 + T1, ko.H = H;
    ko.initial_state = StateKind::kF32;
    KdaInputs whole(ko);
    const Reference ref = run_reference(whole);

    // Prefill of tokens [0, T0) into slot 2 of a 4-slot pool.
    const int64_t P = 4, slot = 2, slice = H * V * K;
    HostTensor pool(s, P * slice);
    HostTensor final_state(s, slice);
    PrefillParams pp = whole.params();
    pp.T = T0;
    pp.final_state = final_state.data();
    pp.final_state_dtype = s;
    forward(pp, nullptr, 0);
    std::memcpy(static_cast<char*>(pool.data()) + slot * slice * dtype_size(s), final_state.data(),
                final_state.data_bytes());
    const HostTensor pool_before = pool;

    // Decode of tokens [T0, T0 + T1).
    HostTensor out(DType::kBF16, T1 * H * V);
    const int32_t index = int32_t(slot);
    DecodeParams dp;
    const auto offset = [&](const HostTensor& t, int64_t row_elems) {
      return static_cast<const char*>(t.data()) + T0 * H * row_elems * dtype_size(t.dtype);
    };
    dp.q = offset(whole.q, K), dp.k = offset(whole.k, K), dp.v = offset(whole.v, V), dp.g = offset(whole.g, K);
    dp.beta = offset(whole.beta, 1);
    dp.out = out.data();
    dp.state_pool = pool.data();
    dp.state_dtype = s;
    dp.pool_size = P;
    dp.state_indices = &index;
    dp.num_seqs = 1;
    dp.T = T1;
    dp.H = H;
    dp.pre = pp.pre;
    run_cpu(dp);

    std::vector<double> got_out = out.values(), want_out(ref.out.end() - T1 * H * V, ref.out.end());
    std::vector<double> got_state(slice);
    for (int64_t i = 0; i < slice; ++i) got_state[i] = pool.get(slot * slice + i);
    const double tol = s == DType::kBF16 ? 1e-2 : kTolBf16;  // prefill chunk form + bf16 state adds a rounding
    EXPECT_LE(rel_rms(got_out, want_out), tol) << dtype_name(s);
    EXPECT_LE(rel_rms(got_state, ref.final_state), tol) << dtype_name(s);
    for (int64_t other = 0; other < P; ++other) {
      if (other == slot) continue;
      const size_t bytes = slice * dtype_size(s);
      EXPECT_EQ(std::memcmp(static_cast<char*>(pool.data()) + other * bytes,
                            static_cast<const char*>(pool_before.data()) + other * bytes, bytes),
                0);
    }
  }
}

// --- argument errors -----------------------------------------------------------------------------

// Expects decode(p) to throw kInvalidArgument with `needle` in the message, leaving out and pool untouched.
void expect_arg_error(DecodeProblem& prob, const DecodeParams& p, const std::string& needle) {
  const std::vector<unsigned char> out_before = prob.in.out.bytes;
  try {
    decode(p);
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
  EXPECT_EQ(prob.in.out.bytes, out_before) << "out written despite the error";
  EXPECT_EQ(prob.pool.bytes, prob.pool_before.bytes) << "pool written despite the error";
}

TEST(DecodeCpuErrors, NullPointersDtypesShapes) {
  DecodeOptions o;
  o.N = 2, o.T = 2;
  DecodeProblem prob(o);
  const DecodeParams good = prob.params();
  DecodeParams p;
  p = good, p.q = nullptr, expect_arg_error(prob, p, "q must not be null");
  p = good, p.beta = nullptr, expect_arg_error(prob, p, "beta");
  p = good, p.out = nullptr, expect_arg_error(prob, p, "out");
  p = good, p.state_pool = nullptr, expect_arg_error(prob, p, "state_pool");
  p = good, p.state_indices = nullptr, expect_arg_error(prob, p, "state_indices");
  p = good, p.dtype = DType::kI32, expect_arg_error(prob, p, "float32 or bfloat16");
  p = good, p.g_dtype = DType::kI64, expect_arg_error(prob, p, "g must be");
  p = good, p.beta_dtype = DType::kI32, expect_arg_error(prob, p, "beta must be");
  p = good, p.state_dtype = DType::kI32, expect_arg_error(prob, p, "state_pool must be");
  p = good, p.T = 0, expect_arg_error(prob, p, "T (tokens per sequence)");
  p = good, p.T = 17, expect_arg_error(prob, p, "T (tokens per sequence)");
  p = good, p.H = 0, expect_arg_error(prob, p, "H must be");
  p = good, p.pool_size = 0, expect_arg_error(prob, p, "pool_size");
  p = good, p.indices_stride = 0, expect_arg_error(prob, p, "indices_stride");
  p = good, p.pool_size = int64_t(1) << 50, expect_arg_error(prob, p, "state_pool [P, H, V, K]: shape");
  p = good, p.indices_stride = int64_t(1) << 62, expect_arg_error(prob, p, "state_indices [N, indices_stride]");
  p = good, p.H = int64_t(1) << 60, expect_arg_error(prob, p, "q [N, T, H, K]: shape");
  p = good, p.pre.lower_bound = -6.0f, expect_arg_error(prob, p, "lower_bound");
  p = good, p.pre.lower_bound = 0.0f, expect_arg_error(prob, p, "lower_bound");
  p = good, p.pre.A_log = nullptr, expect_arg_error(prob, p, "A_log");
  p = good, p.pre.gate = GateForm::kSoftplus, p.pre.A_log = nullptr, expect_arg_error(prob, p, "A_log");
  p = good, p.pre.gate = GateForm::kPrecomputed, p.pre.A_log = nullptr;
  EXPECT_NO_THROW(detail::validate_decode(p, Backend::kCpu));
}

TEST(DecodeCpuErrors, IndicesAcceptedAndCuSeqlens) {
  DecodeOptions o;
  o.N = 3, o.T = 2;
  DecodeProblem prob(o);
  const DecodeParams good = prob.params();
  DecodeParams p = good;

  std::vector<int32_t> bad_indices = prob.indices;
  bad_indices[1] = int32_t(prob.P);
  p.state_indices = bad_indices.data();
  expect_arg_error(prob, p, "state_indices[1, 0]");

  std::vector<int32_t> spec_indices(3 * 2, 0);
  for (int i = 0; i < 6; ++i) spec_indices[i] = i;
  std::vector<int32_t> acc = {1, 3, 2};
  p = good, p.state_indices = spec_indices.data(), p.indices_stride = 2, p.num_accepted_tokens = acc.data();
  expect_arg_error(prob, p, "num_accepted_tokens[1]=3");
  acc = {1, 0, 2};
  expect_arg_error(prob, p, "num_accepted_tokens[1]=0");
  acc = {1, 1, 1};
  p.indices_stride = 1;
  expect_arg_error(prob, p, "indices_stride must be >= T");

  DecodeOptions v;
  v.seqlens = {2, 3};
  DecodeProblem vprob(v);
  const DecodeParams vgood = vprob.params();
  std::vector<int32_t> cu = {0, 2, 2};
  p = vgood, p.cu_seqlens = cu.data(), p.cu_seqlens_dtype = DType::kI32, p.T = 2;
  expect_arg_error(vprob, p, "cu_seqlens[2]=2 - cu_seqlens[1]=2");
  cu = {0, 2, 19};
  p.T = 19;
  expect_arg_error(vprob, p, "1..16 tokens");
  cu = {0, 2, 5};
  p.T = 6;
  expect_arg_error(vprob, p, "must equal T");
  cu = {1, 2, 5};
  p.T = 5;
  expect_arg_error(vprob, p, "cu_seqlens[0] must be 0");
  p = vgood, p.cu_seqlens_dtype = DType::kF32;
  expect_arg_error(vprob, p, "cu_seqlens must be int32 or int64");

  std::vector<int32_t> vspec(2 * 2, 0);
  for (int i = 0; i < 4; ++i) vspec[i] = i;
  std::vector<int32_t> vacc = {1, 1};
  p = vgood, p.state_indices = vspec.data(), p.indices_stride = 2, p.num_accepted_tokens = vacc.data();
  expect_arg_error(vprob, p, "longest sequence (3)");
}

// Two sequences naming one live slot: refused naming both positions, whatever check_slots says
// (it leaves out only the GPU's device-side check; the CPU reads the indices on the host).
TEST(DecodeCpuErrors, SharedLiveSlotIsRefusedNamingBoth) {
  DecodeOptions o;
  o.N = 3;
  DecodeProblem prob(o);
  for (const bool check : {true, false}) {
    DecodeParams p = prob.params();
    p.check_slots = check;
    std::vector<int32_t> shared = prob.indices;
    shared[2] = shared[0];
    p.state_indices = shared.data();
    expect_arg_error(prob, p, "state_indices[0, 0] and state_indices[2, 0] both name slot " + std::to_string(shared[0]));
    shared[1] = -1, shared[2] = -1;  // padding entries may repeat
    p = prob.params(), p.check_slots = check, p.state_indices = shared.data();
    EXPECT_NO_THROW(decode(p));
    prob.in.out.bytes.assign(prob.in.out.bytes.size(), 0);
    prob.pool.bytes = prob.pool_before.bytes;
  }
}

TEST(DecodeCpuErrors, EmptyBatchIsANoOp) {
  DecodeOptions o;
  o.N = 2, o.T = 1;
  DecodeProblem prob(o);
  DecodeParams p = prob.params();
  p.num_seqs = 0;
  EXPECT_NO_THROW(decode(p));
  EXPECT_EQ(prob.pool.bytes, prob.pool_before.bytes);
}

// Where two byte images of a bf16 or fp32 tensor differ: how many elements, and the first one's index
// with both values (a failure on one compiler or processor and not another is diagnosed from this).
std::string first_difference(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, DType dtype) {
  const size_t width = dtype == DType::kF32 ? 4 : 2, n = std::min(a.size(), b.size()) / width;
  size_t count = 0, first = n;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&a[i * width], &b[i * width], width) != 0) count += 1, first = std::min(first, i);
  std::ostringstream os;
  os << count << " of " << n << " elements differ";
  if (count > 0) {
    const auto value = [&](const std::vector<unsigned char>& x) {
      uint32_t u = 0;
      std::memcpy(&u, &x[first * width], width);
      const uint32_t fp32_bits = width == 4 ? u : u << 16;
      float f = 0.f;
      std::memcpy(&f, &fp32_bits, 4);
      std::ostringstream v;
      v << f << " (0x" << std::hex << u << ")";
      return v.str();
    };
    os << "; the first, element " << first << ": " << value(a) << " against " << value(b);
  }
  return os.str();
}

// The AVX2 and AVX-512 builds run the same arithmetic in the same order (16 partial sums written in
// intrinsics, step_row_avx2 / _avx512): the same outputs and pool bits, plain and speculative, fp32 and
// bf16 pools, and K = 15, 20, 40, 100 (tails past the last 16 channels, where GCC 12's two builds of
// the former loops differed).
TEST(DecodeCpuIsas, Avx512GivesTheBitsOfAvx2) {
  if (internal::cpu_engine_isa(3) != 3) GTEST_SKIP() << "this processor has no AVX512";
  DecodeOptions plain;
  plain.N = 5, plain.T = 2, plain.H = 3;
  DecodeOptions spec;
  spec.N = 4, spec.T = 3, spec.H = 2, spec.speculative = true, spec.indices_stride = 4;
  spec.accepted = {1, 2, 3, 4};
  std::vector<DecodeOptions> cases = {plain, spec};
  for (const int64_t K : {15, 20, 40, 100}) {  // channels past the last 16 (the rows' and norms' tails)
    DecodeOptions tails = plain;
    tails.K = K, tails.V = 24;
    cases.push_back(tails);
  }
  for (DecodeOptions o : cases)
    for (DType s : {DType::kF32, DType::kBF16}) {
      o.state_dtype = s;
      DecodeProblem prob(o);
      std::vector<unsigned char> bits[2][2];
      for (int i = 0; i < 2; ++i) {
        prob.pool.bytes = prob.pool_before.bytes;
        prob.in.poison_outputs();
        g_isa = 2 + i;
        run_cpu(prob.params());
        bits[i][0] = prob.in.out.bytes, bits[i][1] = prob.pool.bytes;
      }
      const std::string where = std::string(o.speculative ? "speculative" : "plain") + ", K = " + std::to_string(o.K) +
                                (s == DType::kF32 ? ", fp32 pool: " : ", bf16 pool: ");
      EXPECT_TRUE(bits[0][0] == bits[1][0])
          << where << "out " << first_difference(bits[0][0], bits[1][0], prob.in.out.dtype);
      EXPECT_TRUE(bits[0][1] == bits[1][1]) << where << "pool " << first_difference(bits[0][1], bits[1][1], s);
    }
}

INSTANTIATE_TEST_SUITE_P(Isa, DecodeCpu, kIsas, isa_param_name);

}  // namespace
}  // namespace flashkda::test
