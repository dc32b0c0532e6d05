// Corrupted PrefillParams and DecodeParams on the CPU backend: invalid enums, null pointers,
// negative or overflowing sizes, bad cu_seqlens / index / accepted-count values, bad gate, scale
// and precision. Every call either runs or throws flashkda::Error (kInvalidArgument or
// kUnsupported) before writing any output; forward, workspace_size and reference_forward agree on
// which. Only corruptions that keep every buffer a call may read in bounds are drawn: a size can
// shrink or become invalid, never grow to something valid (no check can catch a caller who claims
// more memory than it passed). scripts/sanitize_host.sh runs this under ASan + UBSan.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fuzz_params.h"
#include "test_decode_fixture.h"

namespace flashkda::test {
namespace {

constexpr int kCases = 400;

TEST(FuzzParams, CorruptedPrefillParamsRunOrThrowBeforeWriting) {
  Fuzz f;
  int refused = 0;
  for (int c = 0; c < kCases; ++c) {
    KdaOptions o = f.prefill_problem(20);
    o.K = o.V = 32;
    o.dtype = f.pick({DType::kBF16, DType::kF32});
    KdaInputs in(o);
    PrefillParams p = in.params();
    const PrefillParams p0 = p;
    HostTensor cu = in.cu_seqlens;
    std::string what = in.describe() + " |";
    for (int64_t m = 1 + f.below(2); m > 0; --m) {
      switch (f.below(10)) {
        case 0: p.dtype = f.bad_float_dtype(), what += " dtype"; break;
        case 1: p.g_dtype = f.bad_float_dtype(), what += " g_dtype"; break;
        case 2: p.beta_dtype = f.bad_float_dtype(), what += " beta_dtype"; break;
        case 3:
          if (p.initial_state != nullptr) p.initial_state_dtype = f.bad_float_dtype(), what += " initial_state_dtype";
          else p.final_state_dtype = f.bad_float_dtype(), what += " final_state_dtype";
          break;
        case 4: f.null_pointer(p, what); break;
        case 5: f.corrupt_batch(p, p0, what); break;
        case 6: {
          const bool k = f.below(2);
          int64_t& s = k ? p.K : p.V;
          s = f.below(2) ? f.shrunk_or_bad(k ? p0.K : p0.V, 1) : f.pick<int64_t>({0, -1, 257});
          what += " K/V=" + std::to_string(s);
          break;
        }
        case 7:
          if (p.cu_seqlens == nullptr) break;
          if (f.below(3) == 0) p.cu_seqlens_dtype = f.bad_index_dtype(), what += " cu_dtype";
          else if (f.below(2)) p.num_seqs = f.pick<int64_t>({-1, kI64Min, f.below(in.N + 1)}), what += " num_seqs";
          else f.corrupt_cu(cu, in.N + 1, what), p.cu_seqlens = cu.data();
          break;
        case 8: p.precision = static_cast<Precision>(f.pick({5, -1})), what += " precision"; break;
        default: f.corrupt_gate(p.pre, what);
      }
    }
    SCOPED_TRACE(what);
    const std::vector<unsigned char> out0 = in.out.bytes, fs0 = in.final_state.bytes;
    std::vector<double> ref_out(size_t(std::max<int64_t>(in.out.count, 1)));
    std::vector<double> ref_state(size_t(std::max<int64_t>(in.N * o.H * o.V * o.K, 1)));
    const Outcome fwd = run([&] { forward(p, nullptr, 0); }, what);
    EXPECT_EQ(run([&] { workspace_size(p); }, what), fwd) << "workspace_size and forward disagree";
    // reference_forward writes its own fp64 outputs: params.out and final_state are not its to check.
    PrefillParams p_ref = p;
    p_ref.out = p0.out, p_ref.final_state = nullptr;
    EXPECT_EQ(run([&] { reference_forward(p, ref_out.data(), ref_state.data()); }, what),
              run([&] { workspace_size(p_ref); }, what))
        << "reference_forward and forward disagree";
    if (fwd == Outcome::kRefused) {
      ++refused;
      EXPECT_TRUE(in.out.bytes == out0) << "out written before the error";
      EXPECT_TRUE(in.final_state.bytes == fs0) << "final_state written before the error";
    }
    EXPECT_TRUE(in.out.guard_intact() && in.final_state.guard_intact()) << "write past the end of an output";
    if (HasFailure()) break;
  }
  // Most corruptions are refused, some are valid (a shrunk size, a valid gate form or lower bound).
  EXPECT_GT(refused, kCases / 2);
  EXPECT_LT(refused, kCases);
}

TEST(FuzzParams, CorruptedDecodeParamsRunOrThrowBeforeWriting) {
  Fuzz f;
  int refused = 0;
  for (int c = 0; c < kCases; ++c) {
    DecodeOptions o = f.decode_problem();
    o.K = o.V = 32;
    o.dtype = f.pick({DType::kBF16, DType::kF32});
    DecodeProblem prob(o);
    DecodeParams p = prob.params();
    const DecodeParams p0 = p;
    std::vector<int32_t> indices = prob.indices, accepted = prob.accepted;
    HostTensor cu = prob.in.cu_seqlens;
    std::string what = prob.in.describe() + (o.speculative ? " speculative |" : " |");
    for (int64_t m = 1 + f.below(2); m > 0; --m) {
      switch (f.below(10)) {
        case 0: p.dtype = f.bad_float_dtype(), what += " dtype"; break;
        case 1: p.g_dtype = f.bad_float_dtype(), what += " g_dtype"; break;
        case 2: (f.below(2) ? p.beta_dtype : p.state_dtype) = f.bad_float_dtype(), what += " beta/state dtype"; break;
        case 3: f.null_pointer(p, what); break;
        case 4: {
          int64_t* sizes[] = {&p.num_seqs, &p.H, &p.K, &p.V, &p.pool_size, &p.indices_stride};
          const int64_t orig[] = {p0.num_seqs, p0.H, p0.K, p0.V, p0.pool_size, p0.indices_stride}, i = f.below(6);
          *sizes[i] = f.shrunk_or_bad(orig[i]), what += " a size=" + std::to_string(*sizes[i]);
          break;
        }
        case 5:  // tokens: shrink, or leave the 1..16 range (with cu_seqlens T is the total)
          p.T = f.below(2) ? f.shrunk_or_bad(p0.T) : f.pick<int64_t>({0, 17, -1}), what += " T=" + std::to_string(p.T);
          break;
        case 6: {
          const int64_t i = f.below(int64_t(indices.size()));
          indices[i] = f.pick<int32_t>({-1, int32_t(prob.P), int32_t(prob.P) + 100, std::numeric_limits<int32_t>::min(),
                                        std::numeric_limits<int32_t>::max()});
          p.state_indices = indices.data();
          what += " indices[" + std::to_string(i) + "]=" + std::to_string(indices[i]);
          break;
        }
        case 7:
          if (p.num_accepted_tokens == nullptr) break;
          accepted[f.below(int64_t(accepted.size()))] = f.pick<int32_t>({0, -1, 5, std::numeric_limits<int32_t>::max()});
          p.num_accepted_tokens = accepted.data();
          what += " accepted";
          break;
        case 8:
          if (p.cu_seqlens == nullptr) break;
          if (f.below(3) == 0) p.cu_seqlens_dtype = f.bad_index_dtype(), what += " cu_dtype";
          else f.corrupt_cu(cu, prob.N + 1, what), p.cu_seqlens = cu.data();
          break;
        default: f.corrupt_gate(p.pre, what);
      }
    }
    SCOPED_TRACE(what);
    const std::vector<unsigned char> out0 = prob.in.out.bytes, pool0 = prob.pool.bytes;
    if (run([&] { decode(p); }, what) == Outcome::kRefused) {
      ++refused;
      EXPECT_TRUE(prob.in.out.bytes == out0) << "out written before the error";
      EXPECT_TRUE(prob.pool.bytes == pool0) << "pool written before the error";
    }
    EXPECT_TRUE(prob.in.out.guard_intact() && prob.pool.guard_intact()) << "write past the end of an output";
    if (HasFailure()) break;
  }
  EXPECT_GT(refused, kCases / 2);
  EXPECT_LT(refused, kCases);
}

}  // namespace
}  // namespace flashkda::test
