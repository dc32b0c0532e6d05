// A segment's state transition is low rank where most channels decay (docs/DESIGN.md "Long memory:
// the transition is low rank"), in fp64 against the token recurrence. Over the chunks 1..n of a
// segment S_out = A S_in + B, A = A_n ... A_1, and each chunk's map is diagonal plus rank C
// (docs/SPEC.md §4):
//
//   A_c = diag(e^{Γ_c}) - kr_c^T inv_c kd_c                 inv_c = (I + L_c)^{-1} diag(b_c)
//
// Expanding the first m chunks' product (Γ_{<c} = Γ_1 + ... + Γ_{c-1}, Γ_{≤m} likewise),
//
//   A_m ... A_1 = diag(e^{Γ_{≤m}}) - Σ_{c≤m} (A_m ... A_{c+1}) kr_c^T inv_c kd_c diag(e^{Γ_{<c}})
//
// so, with J the channels whose decay over chunks 1..m is not below the bound,
//
//   A = T G + E     T = A_n ... A_{m+1} F
//   F = [ e_j e^{Γ_{≤m},j} (j in J) | (A_m ... A_{c+1}) kr_c^T (c ≤ m) ]     K x r, r = |J| + m C
//   G = [ e_j^T (j in J) ; -inv_c kd_c diag(e^{Γ_{<c}}) (c ≤ m) ]            r x K
//   ||E||_2 ≤ ||A_n ... A_{m+1}||_2 · max_{j not in J} e^{Γ_{≤m},j}
//
// and ||A_n ... A_{m+1}||_2 ≤ Π_t max(1, |1 - b_t |k_t|^2|) max_j e^{a_t,j} over the tokens after
// chunk m. T is what the recurrence makes of r extra state rows with zero values that start empty
// and take kr_c at the end of chunk c and e_j e^{Γ_{≤m},j} at the end of chunk m; the segment's
// start state X then enters only through the r x V coordinates Y = G X: the end state is T Y + B,
// and a token t after chunk m reads o_zero_t + (scale T_t^T q_t)^T Y. With the benchmark's gates
// every channel but the long-memory ones decays below 2^-30 within one chunk, so r = |J| + C where
// the plain transition carries K columns.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "backend.h"
#include "common/host_math.h"
#include "cpu/chunk.h"
#include "kda_test_utils.h"

namespace flashkda::test {
namespace {

constexpr int C = kChunk;

// The preprocessed inputs of one head over one sequence, in fp64.
struct HeadInputs {
  int64_t len = 0, K = 0, V = 0;
  std::vector<double> q, k, v, a, b;  // q (scaled), k: [len][K]; v: [len][V]; a (log-decay): [len][K]; b: [len]
};

HeadInputs load_head(const PrefillParams& p, int64_t h, const SeqRange& r) {
  const host::HeadGate<double> gate(p.pre, h, p.K);
  const double scale = host::output_scale<double>(p.pre, p.K);
  HeadInputs x;
  x.len = r.eos - r.bos, x.K = p.K, x.V = p.V;
  x.q.resize(x.len * x.K), x.k.resize(x.len * x.K), x.v.resize(x.len * x.V), x.a.resize(x.len * x.K);
  x.b.resize(x.len);
  for (int64_t t = 0; t < x.len; ++t) {
    double* a = &x.a[t * x.K];
    x.b[t] = host::load_token_inputs(p, r.bos + t, h, &x.q[t * x.K], &x.k[t * x.K], &x.v[t * x.V], a);
    for (int64_t c = 0; c < x.K; ++c) x.q[t * x.K + c] *= scale, a[c] = gate(c, a[c]);
  }
  return x;
}

// One token of the recurrence on `rows` state rows (rows of S^T, K values each): x <- e^a ⊙ x, then
// x <- x + b k (value - k . x); values[row] is the row's value of this token (null: zero).
void token_step(const HeadInputs& x, int64_t t, int64_t rows, std::vector<double>& S, const double* values) {
  const int64_t K = x.K;
  const double* k = &x.k[t * K];
  const double* a = &x.a[t * K];
  for (int64_t r = 0; r < rows; ++r) {
    double* s = &S[r * K];
    double dot = 0.0;
    for (int64_t c = 0; c < K; ++c) dot += k[c] * (s[c] *= std::exp(a[c]));
    const double d = x.b[t] * ((values != nullptr ? values[r] : 0.0) - dot);
    for (int64_t c = 0; c < K; ++c) s[c] += d * k[c];
  }
}

double row_dot(const double* x, const double* y, int64_t K) {
  double s = 0.0;
  for (int64_t c = 0; c < K; ++c) s += x[c] * y[c];
  return s;
}

// The factored transition of one segment, built as a kernel would: T's rows by the recurrence with
// injections, G from the first m chunks' factors.
struct Factored {
  bool factored = false;  // false: r would not be below K (the plain transition is no larger)
  int m = 0;
  int64_t r = 0, J = 0;
  double log2_error = -std::numeric_limits<double>::infinity();  // bound on log2 ||A - T G||_2
  std::vector<double> T, G;   // T^T: [r][K] (row i = T e_i); G: [r][K]
  std::vector<double> w;      // [len][r]: scale T_t^T q_t for the tokens after chunk m (else 0)
  std::vector<double> log2_error_at;  // [len]: the bound for A_t (the map to token t's state)
};

// log2 of the bound on ||M_t||_2 = ||(I - b k k^T) diag(e^a)||_2.
double log2_token_norm(const HeadInputs& x, int64_t t) {
  const double kk = row_dot(&x.k[t * x.K], &x.k[t * x.K], x.K);
  const double amax = *std::max_element(x.a.begin() + t * x.K, x.a.begin() + (t + 1) * x.K);
  return std::log2(std::max(1.0, std::abs(1.0 - x.b[t] * kk))) + amax / std::log(2.0);
}

Factored factor(const HeadInputs& x, double log2_tol, int max_m) {
  const int64_t K = x.K, len = x.len;
  Factored f;
  const int full = int(len / C);
  // The bound on the rest's norm after m chunks, and the channels above the tolerance: pick the m
  // that minimises r = |J_m| + m C.
  std::vector<double> tail(len + 1, 0.0);  // tail[t] = Σ_{s >= t} log2 ||M_s||
  for (int64_t t = len - 1; t >= 0; --t) tail[t] = tail[t + 1] + log2_token_norm(x, t);
  std::vector<double> cum(K, 0.0);  // Σ a over chunks 1..m, per channel
  int64_t best_r = K;
  for (int m = 1; m <= std::min(full, max_m); ++m) {
    for (int64_t t = (m - 1) * C; t < m * C; ++t)
      for (int64_t c = 0; c < K; ++c) cum[c] += x.a[t * K + c];
    int64_t J = 0;
    for (int64_t c = 0; c < K; ++c) J += cum[c] / std::log(2.0) + tail[m * C] > log2_tol;
    if (J + m * C < best_r) best_r = J + m * C, f.m = m;
  }
  if (f.m == 0) return f;
  f.factored = true;
  const int m = f.m;
  std::fill(cum.begin(), cum.end(), 0.0);
  for (int64_t t = 0; t < m * C; ++t)
    for (int64_t c = 0; c < K; ++c) cum[c] += x.a[t * K + c];
  std::vector<int64_t> J;
  double dropped = -std::numeric_limits<double>::infinity();  // log2 of the largest dropped decay
  for (int64_t c = 0; c < K; ++c) {
    const double l2 = cum[c] / std::log(2.0);
    if (l2 + tail[m * C] > log2_tol) J.push_back(c);
    else dropped = std::max(dropped, l2);
  }
  f.J = int64_t(J.size()), f.r = f.J + m * C;
  f.log2_error = dropped + tail[m * C];
  const int64_t r = f.r;

  // G: the J rows e_j^T, then each chunk's -inv_c kd_c diag(e^{Γ_{<c}}).
  f.G.assign(r * K, 0.0);
  for (int64_t i = 0; i < f.J; ++i) f.G[i * K + J[i]] = 1.0;
  std::vector<double> before(K, 0.0);  // Γ_{<c}
  std::vector<std::vector<double>> kr(m, std::vector<double>(C * K));
  for (int c = 0; c < m; ++c) {
    const int64_t t0 = int64_t(c) * C;
    std::vector<double> G(C * K), L(C * C, 0.0), kd(C * K);
    for (int i = 0; i < C; ++i)
      for (int64_t ch = 0; ch < K; ++ch) G[i * K + ch] = (i > 0 ? G[(i - 1) * K + ch] : 0.0) + x.a[(t0 + i) * K + ch];
    for (int i = 0; i < C; ++i)
      for (int64_t ch = 0; ch < K; ++ch) {
        const double k = x.k[(t0 + i) * K + ch];
        kd[i * K + ch] = k * std::exp(G[i * K + ch] + before[ch]);
        kr[c][i * K + ch] = k * std::exp(G[(C - 1) * K + ch] - G[i * K + ch]);
      }
    for (int i = 0; i < C; ++i)
      for (int j = 0; j < i; ++j) {
        double l = 0.0;
        for (int64_t ch = 0; ch < K; ++ch)
          l += x.k[(t0 + i) * K + ch] * x.k[(t0 + j) * K + ch] * std::exp(G[i * K + ch] - G[j * K + ch]);
        L[i * C + j] = x.b[t0 + i] * l;
      }
    // Rows of -(I + L)^{-1} diag(b) kd: solve (I + L) Y = diag(b) kd for all K columns at once.
    std::vector<double> Y(C * K);
    for (int i = 0; i < C; ++i)
      for (int64_t ch = 0; ch < K; ++ch) Y[i * K + ch] = x.b[t0 + i] * kd[i * K + ch];
    for (int i = 1; i < C; ++i)
      for (int j = 0; j < i; ++j)
        for (int64_t ch = 0; ch < K; ++ch) Y[i * K + ch] -= L[i * C + j] * Y[j * K + ch];
    for (int i = 0; i < C; ++i)
      for (int64_t ch = 0; ch < K; ++ch) f.G[(f.J + int64_t(c) * C + i) * K + ch] = -Y[i * K + ch];
    for (int64_t ch = 0; ch < K; ++ch) before[ch] += G[(C - 1) * K + ch];
  }

  // T: r rows through the recurrence, kr_c injected at the end of chunk c, e_j e^{Γ_{≤m},j} at the
  // end of chunk m; w_t and the bound for each later token.
  f.T.assign(r * K, 0.0);
  f.w.assign(len * r, 0.0);
  f.log2_error_at.assign(len, f.log2_error);
  double head = dropped;  // dropped + Σ log2 ||M_s|| over mC <= s <= t
  for (int64_t t = 0; t < len; ++t) {
    token_step(x, t, r, f.T, nullptr);
    if (t >= m * C) {
      head += log2_token_norm(x, t);
      f.log2_error_at[t] = head;
      for (int64_t i = 0; i < r; ++i) f.w[t * r + i] = row_dot(&f.T[i * K], &x.q[t * K], K);
    }
    if ((t + 1) % C == 0 && (t + 1) / C <= m) {
      const int c = int((t + 1) / C) - 1;
      for (int i = 0; i < C; ++i)
        std::copy(&kr[c][i * K], &kr[c][(i + 1) * K], &f.T[(f.J + int64_t(c) * C + i) * K]);
      if (c == m - 1)
        for (int64_t i = 0; i < f.J; ++i) {
          std::fill(&f.T[i * K], &f.T[(i + 1) * K], 0.0);
          f.T[i * K + J[i]] = std::exp(cum[J[i]]);
        }
    }
  }
  return f;
}

struct Checked {
  int64_t segments = 0, factored = 0, max_r = 0, max_m = 0;
  double worst_log2_error = -std::numeric_limits<double>::infinity();  // the largest bound among them
  double worst_ratio = 0.0;  // the largest measured error over its bound (must stay <= 1)
};

// Every (sequence, head) of opt taken as one segment: A, B and the outputs by the token recurrence
// (from the identity, from zero and from a random X), against T G, T (G X) + B and o_zero + w^T G X.
Checked check_factored(KdaInputs& in, double log2_tol, int max_m) {
  SCOPED_TRACE(in.describe());
  const PrefillParams p = in.params();
  const int64_t K = p.K, V = p.V;
  std::mt19937_64 rng(in.seed + 1);
  std::normal_distribution<double> normal(0.0, 1.0);
  Checked out;
  for (int64_t n = 0; n < in.N; ++n)
    for (int64_t h = 0; h < p.H; ++h) {
      const HeadInputs x = load_head(p, h, detail::seq_range(p, n));
      const Factored f = factor(x, log2_tol, max_m);
      ++out.segments;
      if (!f.factored) continue;
      ++out.factored;
      out.max_r = std::max(out.max_r, f.r);
      out.max_m = std::max<int64_t>(out.max_m, f.m);
      out.worst_log2_error = std::max(out.worst_log2_error, f.log2_error);
      EXPECT_EQ(f.r, f.J + f.m * C);
      EXPECT_LT(f.r, K);
      // A^T (row i = A e_i) from the identity, S^T from zero and from X (rows: value columns).
      std::vector<double> At(K * K, 0.0), S0(V * K, 0.0), SX(V * K), X(V * K);
      for (int64_t i = 0; i < K; ++i) At[i * K + i] = 1.0;
      for (double& e : X) e = normal(rng);
      SX = X;
      // Y^T = X^T G^T: [V][r], the start state's coordinates.
      std::vector<double> Y(V * f.r);
      for (int64_t j = 0; j < V; ++j)
        for (int64_t i = 0; i < f.r; ++i) Y[j * f.r + i] = row_dot(&X[j * K], &f.G[i * K], K);
      double xnorm = 0.0;  // the largest column norm of X (a row of X^T)
      for (int64_t j = 0; j < V; ++j) xnorm = std::max(xnorm, std::sqrt(row_dot(&X[j * K], &X[j * K], K)));
      std::vector<double> values(V);
      for (int64_t t = 0; t < x.len; ++t) {
        std::copy(&x.v[t * V], &x.v[(t + 1) * V], values.begin());
        token_step(x, t, K, At, nullptr);
        token_step(x, t, V, S0, values.data());
        token_step(x, t, V, SX, values.data());
        if (t < f.m * C) continue;
        // Token t's output from X against o_zero + w_t^T Y.
        const double* q = &x.q[t * K];
        const double bound = (std::exp2(f.log2_error_at[t]) + 1e-12) * std::sqrt(row_dot(q, q, K)) * xnorm;
        for (int64_t j = 0; j < V; ++j) {
          const double want = row_dot(&SX[j * K], q, K);
          const double got = row_dot(&S0[j * K], q, K) + row_dot(&f.w[t * f.r], &Y[j * f.r], f.r);
          const double err = std::abs(got - want);
          out.worst_ratio = std::max(out.worst_ratio, err / bound);
          if (err > bound) {
            ADD_FAILURE() << "n " << n << " h " << h << " token " << t << " value " << j << ": |o - o_T| " << err
                          << " > bound " << bound;
            return out;
          }
        }
      }
      // A against T G, entry by entry (|entry| <= the spectral norm), and the end state from X.
      const double bound = std::exp2(f.log2_error) + 1e-12;
      for (int64_t i = 0; i < K; ++i)      // column i of A: row i of A^T
        for (int64_t c = 0; c < K; ++c) {  // row c of A
          double tg = 0.0;
          for (int64_t l = 0; l < f.r; ++l) tg += f.T[l * K + c] * f.G[l * K + i];
          const double err = std::abs(At[i * K + c] - tg);
          out.worst_ratio = std::max(out.worst_ratio, err / bound);
          if (err > bound) {
            ADD_FAILURE() << "A[" << c << "][" << i << "], n " << n << " h " << h << ": " << err << " > " << bound;
            return out;
          }
        }
      for (int64_t j = 0; j < V; ++j)
        for (int64_t c = 0; c < K; ++c) {
          double got = S0[j * K + c];
          for (int64_t l = 0; l < f.r; ++l) got += Y[j * f.r + l] * f.T[l * K + c];
          if (std::abs(got - SX[j * K + c]) > bound * xnorm) {
            ADD_FAILURE() << "end state, n " << n << " h " << h << ": " << std::abs(got - SX[j * K + c]);
            return out;
          }
        }
    }
  return out;
}

// The benchmark's gates (bench_prefill.py): lower bound -5, A_log and dt_bias in [0, 1], the raw
// gate of unit variance; with long memory 8 of the 128 channels of each head have dt_bias = -8.
KdaInputs bench_inputs(bool long_memory) {
  KdaOptions o;
  o.seqlens = {16, 37, 200, 513};
  o.H = 2, o.K = 128, o.V = 32;
  o.dtype = DType::kF32;
  o.A_log_min = 0.0, o.A_log_max = 1.0;
  o.dt_bias_min = 0.0, o.dt_bias_max = 1.0;
  o.g_min = -1.7, o.g_max = 1.7;
  KdaInputs in(o);
  if (long_memory)
    for (int64_t h = 0; h < o.H; ++h)
      for (int64_t c = 0; c < 8; ++c) in.dt_bias[h * o.K + c] = -8.0f;
  return in;
}

// Precomputed log-decays uniform in [g_min, 0] (no dt_bias), fp32 inputs, V = 16.
KdaInputs precomputed_inputs(std::vector<int64_t> seqlens, int64_t K, double g_min) {
  KdaOptions o;
  o.seqlens = std::move(seqlens);
  o.H = 2, o.K = K, o.V = 16;
  o.dtype = DType::kF32;
  o.gate = GateForm::kPrecomputed, o.with_dt_bias = false;
  o.g_min = g_min, o.g_max = 0.0;
  return KdaInputs(o);
}

void report_checked(const std::string& name, const Checked& c) {
  report(name + "_rank", double(c.max_r));
  report(name + "_log2_error_bound", c.worst_log2_error);
  report(name + "_error_over_bound", c.worst_ratio);
}

// With long memory the transition needs the 8 long channels and one chunk's C columns: rank 24 of
// 128, every dropped term below 2^-30.
TEST(LowRankTransition, LongMemoryKeepsTheLongChannelsAndOneChunk) {
  KdaInputs in = bench_inputs(true);
  const Checked c = check_factored(in, -30.0, 4);
  EXPECT_EQ(c.factored, c.segments);
  EXPECT_LE(c.max_r, 8 + C + 4);  // a random-gate channel rarely stays above 2^-30 over a chunk
  EXPECT_GE(c.max_r, 8 + C);
  EXPECT_LE(c.worst_log2_error, -30.0);
  report_checked("long_memory", c);
}

TEST(LowRankTransition, RandomGatesNeedOneChunk) {
  KdaInputs in = bench_inputs(false);
  const Checked c = check_factored(in, -30.0, 4);
  EXPECT_EQ(c.factored, c.segments);
  EXPECT_LE(c.max_r, C + 4);
  EXPECT_LE(c.worst_log2_error, -30.0);
  report_checked("random", c);
}

// Decay of about 2^-23 a chunk: one chunk would keep every channel (r = K + C), two keep none, so
// F folds two chunks (r = 2 C) and the tolerance stays 2^-30.
TEST(LowRankTransition, TwoChunksFoldWhereOneDoesNotDecayEnough) {
  KdaInputs in = precomputed_inputs({32, 45, 300}, 128, -2.0);
  const Checked c = check_factored(in, -30.0, 4);
  EXPECT_EQ(c.factored, c.segments);
  EXPECT_EQ(c.max_m, 2);
  EXPECT_LE(c.max_r, 2 * C + 4);
  EXPECT_LE(c.worst_log2_error, -30.0);
  report_checked("two_chunks", c);
}

// Weak decay and a loose tolerance: the bound is what the dropped channels leave (~2^-6), several
// chunks fold into F (m > 1), and the measured error must stay within the bound.
TEST(LowRankTransition, TheBoundHoldsWhereDroppedTermsAreLarge) {
  KdaInputs in = precomputed_inputs({64, 300}, 128, -0.5);
  const Checked c = check_factored(in, -6.0, 8);
  EXPECT_EQ(c.factored, c.segments);
  EXPECT_GT(c.worst_log2_error, -20.0);  // something above rounding was dropped
  EXPECT_LE(c.worst_ratio, 1.0);
  report_checked("weak_decay_tol6", c);
}

// Little decay: no m makes |J| + m C smaller than K, so the plain transition stays; softplus gates
// over a wide range: whatever is factored holds its bound.
TEST(LowRankTransition, LittleDecayIsNotFactoredAndWideGatesHoldTheBound) {
  KdaInputs little = precomputed_inputs({100}, 64, -0.02);
  EXPECT_EQ(check_factored(little, -30.0, 4).factored, 0);

  KdaOptions o = little.opt;
  o.seqlens = {33, 250};
  o.gate = GateForm::kSoftplus, o.with_dt_bias = true;
  o.g_min = -8.0, o.g_max = 8.0;
  KdaInputs wide(o);
  const Checked c = check_factored(wide, -30.0, 4);
  EXPECT_LE(c.worst_ratio, 1.0);
  report_checked("softplus_wide", c);
}

}  // namespace
}  // namespace flashkda::test
