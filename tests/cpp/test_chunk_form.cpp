// The chunk-16 form itself: the fp64 instantiation against the fp64 token recurrence, the exact
// (I + L)^{-1} by forward substitution, and the repeated-key input that breaks a Neumann series.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cpu/chunk.h"
#include "kda_test_utils.h"

namespace flashkda::test {
namespace {

constexpr int C = kChunk;

// Runs chunk_forward<double> and the reference on the same inputs; returns {out, state} rel-RMS.
std::pair<double, double> chunk_fp64_vs_reference(const KdaOptions& opt) {
  KdaInputs in(opt);
  SCOPED_TRACE(in.describe());
  const Reference ref = run_reference(in);
  std::vector<double> out(ref.out.size(), std::nan("")), fs(ref.final_state.size(), std::nan(""));
  cpu::chunk_forward<double>(in.params(), out.data(), fs.data());
  EXPECT_EQ(count_nonfinite(out), 0);
  EXPECT_EQ(count_nonfinite(fs), 0);
  return {rel_rms(out, ref.out), rel_rms(fs, ref.final_state)};
}

TEST(ChunkForm, MatchesTokenRecurrenceFp64) {
  struct Case {
    const char* name;
    KdaOptions opt;
  };
  std::vector<Case> cases;
  {
    KdaOptions o;
    o.seqlens = {1, 15, 16, 17, 31, 300};
    o.H = 2;
    o.initial_state = StateKind::kF32;
    cases.push_back({"lower_bound varlen", o});
  }
  {
    KdaOptions o;
    o.B = 2;
    o.T = 100;
    o.H = 1;
    o.K = 40;
    o.V = 24;
    o.dtype = o.g_dtype = o.beta_dtype = DType::kF32;
    o.gate = GateForm::kSoftplus;
    o.A_log_max = 3.0;
    o.g_min = -8.0;
    o.g_max = 8.0;
    o.dt_bias_min = -8.0;
    o.dt_bias_max = 8.0;
    o.initial_state = StateKind::kBF16;
    cases.push_back({"softplus extremes (pairwise chunks), odd K and V", o});
  }
  {
    KdaOptions o;
    o.T = 200;
    o.H = 2;
    o.gate = GateForm::kPrecomputed;
    o.g_dtype = DType::kF32;
    o.g_min = -10.0;
    o.g_max = 0.0;
    o.l2norm = false;
    o.beta_is_logit = false;
    o.has_scale = true;
    o.scale = 0.7f;
    cases.push_back({"precomputed [-10, 0]: shifted and pairwise chunks mixed", o});
  }
  {
    KdaOptions o;
    o.T = 64;
    o.H = 1;
    o.gate = GateForm::kPrecomputed;
    o.g_dtype = DType::kF32;
    o.g_min = -1000.0;
    o.g_max = 0.0;
    cases.push_back({"precomputed down to -1000", o});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const auto [out_err, state_err] = chunk_fp64_vs_reference(c.opt);
    report(std::string("fp64 chunk vs token, ") + c.name + ", out", out_err);
    report(std::string("fp64 chunk vs token, ") + c.name + ", final_state", state_err);
    EXPECT_LE(out_err, 1e-12);
    EXPECT_LE(state_err, 1e-12);
  }
}

// (I + L)^{-1} for L = b * (strictly lower ones), the matrix of 16 identical normalised keys
// without decay: X[i][j] = -b (1 - b)^{i-j-1} for i > j. The Neumann series of the same matrix
// has terms up to C(15,7) b^15 and cancels them back to O(1).
TEST(InverseSolve, ExactForIdenticalKeysNoDecay) {
  for (double b : {0.5, 0.99, 0.9999, 1.0}) {
    SCOPED_TRACE(b);
    float L[C * C] = {};
    for (int i = 0; i < C; ++i)
      for (int j = 0; j < i; ++j) L[i * C + j] = float(b);
    double max_err = 0.0;
    for (int col = 0; col < C; ++col) {
      float x[C] = {};
      x[col] = 1.0f;
      cpu::solve_unit_lower(L, x, C);
      for (int i = 0; i < C; ++i) {
        const double bf = double(float(b));
        const double exact = i < col ? 0.0 : (i == col ? 1.0 : -bf * std::pow(1.0 - bf, i - col - 1));
        max_err = std::max(max_err, std::abs(double(x[i]) - exact));
      }
    }
    EXPECT_LE(max_err, 1e-6);

    // The same inverse with all 16 right-hand sides at once (the engine solves rows of the state
    // in blocks this way): X <- (I + L)^{-1} I.
    float X[C * C] = {};
    for (int i = 0; i < C; ++i) X[i * C + i] = 1.0f;
    cpu::solve_unit_lower<float, C>(L, X, C);
    double max_err_multi = 0.0;
    for (int i = 0; i < C; ++i) {
      for (int col = 0; col < C; ++col) {
        const double bf = double(float(b));
        const double exact = i < col ? 0.0 : (i == col ? 1.0 : -bf * std::pow(1.0 - bf, i - col - 1));
        max_err_multi = std::max(max_err_multi, std::abs(double(X[i * C + col]) - exact));
      }
    }
    EXPECT_LE(max_err_multi, 1e-6);
  }
}

// Random strictly lower L of moderate size: (I + L) X = I to fp32 accuracy, and X agrees with the
// fp64 solve.
TEST(InverseSolve, ResidualOfRandomLowerTriangular) {
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<double> u(-0.5, 0.5);
  double Ld[C * C] = {};
  float Lf[C * C] = {};
  for (int i = 0; i < C; ++i)
    for (int j = 0; j < i; ++j) Lf[i * C + j] = float(Ld[i * C + j] = u(rng));
  for (int i = 0; i < C; ++i)
    for (int j = 0; j < i; ++j) Ld[i * C + j] = Lf[i * C + j];
  for (int n : {1, 7, 16}) {
    for (int col = 0; col < n; ++col) {
      float xf[C] = {};
      double xd[C] = {};
      xf[col] = 1.0f;
      xd[col] = 1.0;
      cpu::solve_unit_lower(Lf, xf, n);
      cpu::solve_unit_lower(Ld, xd, n);
      for (int i = 0; i < n; ++i) {
        double r = xd[i];
        for (int j = 0; j < i; ++j) r += Ld[i * C + j] * xd[j];
        EXPECT_NEAR(r, i == col ? 1.0 : 0.0, 1e-13);
        EXPECT_NEAR(xf[i], xd[i], 1e-5 * (1.0 + std::abs(xd[i])));
      }
    }
  }
}

// Identical normalised keys, b ~ 1, no decay: one chunk and a 2000-token run through the fp32
// backend against the reference.
TEST(ChunkForm, RepeatedKeyMatchesReference) {
  for (int64_t T : {16, 2000}) {
    KdaOptions o;
    o.T = T;
    o.H = 2;
    o.dtype = o.g_dtype = o.beta_dtype = DType::kF32;
    o.gate = GateForm::kPrecomputed;
    o.g_min = o.g_max = 0.0;
    o.beta_min = o.beta_max = 12.0;  // b = sigmoid(12) = 0.999994
    o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < o.H; ++h)
        for (int64_t c = 0; c < o.K; ++c) in.k.set((t * o.H + h) * o.K + c, in.k.get(h * o.K + c));
    const Reference ref = run_reference(in);
    forward(in.params(), nullptr, 0);
    const auto out = in.out.values(), fs = in.final_state.values();
    EXPECT_EQ(count_nonfinite(out), 0);
    EXPECT_LE(rel_rms(out, ref.out), 1e-5);
    EXPECT_LE(rel_rms(fs, ref.final_state), 1e-5);

    std::vector<double> out64(ref.out.size()), fs64(ref.final_state.size());
    cpu::chunk_forward<double>(in.params(), out64.data(), fs64.data());
    EXPECT_LE(rel_rms(out64, ref.out), 1e-12);
    EXPECT_LE(rel_rms(fs64, ref.final_state), 1e-12);
  }
}

}  // namespace
}  // namespace flashkda::test
