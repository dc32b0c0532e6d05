// The chunk-pair form: two 16-token chunks A, B per recurrence step, in fp64 against the token
// recurrence. It is the algebra a K2 step over 32 tokens would run (docs/DESIGN.md, "Two chunks
// per step"): one read of the state for both chunks, the second chunk's dependence on the first
// carried by two 16x16 cross matrices, and one state update of depth 32:
//
//   W_A = kd_A S              W_B = (kd_B e^{Γ_A}) S                   (one product, N = 32)
//   U_A = inv_A (v_A - W_A)   U_B = inv_B (v_B - W_B - C_BA U_A)       C_BA = kd_B kr_A^T
//   O_A = qd_A S + Mqk_A U_A  O_B = (qd_B e^{Γ_A}) S + D_BA U_A + Mqk_B U_B,   D_BA = qd_B kr_A^T
//   S'  = e^{Γ_A+Γ_B} S + (kr_A e^{Γ_B})^T U_A + kr_B^T U_B           (one update, K = 32)
//
// with kd, qd, kr, inv = (I + L)^{-1} diag(b) and Mqk of each chunk as in docs/SPEC.md §4. Every
// exponent is <= 0 (decays measured forward from a chunk's start or to its end), so the form
// stays finite for any gate; the test asserts that as well as the agreement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend.h"
#include "common/host_math.h"
#include "cpu/chunk.h"
#include "kda_test_utils.h"

namespace flashkda::test {
namespace {

constexpr int C = kChunk;

// One 16-token chunk of one head, prepared: rows past the sequence end have k = q = 0, a = 0,
// b = 0, v = 0 (they then contribute nothing).
struct Chunk {
  int64_t K = 0, V = 0;
  std::vector<double> q, k, G, v, b;  // q, k, G: [C][K] (G: in-chunk inclusive prefix sum of a); v: [C][V]
  double G_at(int i, int64_t c) const { return G[i * K + c]; }
  double gamma_log(int64_t c) const { return G[(C - 1) * K + c]; }  // Γ = G_C
};

Chunk load_chunk(const PrefillParams& p, int64_t h, int64_t first, int64_t rows, double scale) {
  const int64_t H = p.H, K = p.K, V = p.V;
  const host::HeadGate<double> gate(p.pre, h, K);
  Chunk ch;
  ch.K = K, ch.V = V;
  ch.q.assign(C * K, 0.0), ch.k.assign(C * K, 0.0), ch.G.assign(C * K, 0.0), ch.v.assign(C * V, 0.0);
  ch.b.assign(C, 0.0);
  std::vector<double> a(K);
  for (int i = 0; i < C; ++i) {
    if (i < rows) {
      const int64_t row = (first + i) * H + h;
      host::load_row(p.q, p.dtype, row * K, K, &ch.q[i * K]);
      host::load_row(p.k, p.dtype, row * K, K, &ch.k[i * K]);
      host::load_row(p.v, p.dtype, row * V, V, &ch.v[i * V]);
      host::load_row(p.g, p.g_dtype, row * K, K, a.data());
      if (p.pre.l2norm_qk) {
        host::l2_normalize(&ch.q[i * K], K);
        host::l2_normalize(&ch.k[i * K], K);
      }
      for (int64_t c = 0; c < K; ++c) ch.q[i * K + c] *= scale, a[c] = gate(c, a[c]);
      ch.b[i] = host::beta_activation(p.pre, host::load<double>(p.beta, p.beta_dtype, row));
    } else {
      std::fill(a.begin(), a.end(), 0.0);
    }
    for (int64_t c = 0; c < K; ++c) ch.G[i * K + c] = (i > 0 ? ch.G[(i - 1) * K + c] : 0.0) + a[c];
  }
  return ch;
}

// e^x for an exponent the form guarantees to be <= 0; counts violations.
struct Exp {
  int64_t positive = 0;
  double operator()(double x) {
    if (x > 1e-12) ++positive;
    return std::exp(x);
  }
};

// inv = (I + L)^{-1} diag(b) and Mqk of one chunk, pairwise (exponents G_i - G_j <= 0 for i >= j).
void chunk_matrices(const Chunk& ch, Exp& e, std::vector<double>& inv, std::vector<double>& mqk) {
  const int64_t K = ch.K;
  std::vector<double> L(C * C, 0.0);
  mqk.assign(C * C, 0.0);
  for (int i = 0; i < C; ++i)
    for (int j = 0; j <= i; ++j) {
      double l = 0.0, m = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        const double d = e(ch.G_at(i, c) - ch.G_at(j, c));
        l += ch.k[i * K + c] * ch.k[j * K + c] * d;
        m += ch.q[i * K + c] * ch.k[j * K + c] * d;
      }
      if (i > j) L[i * C + j] = ch.b[i] * l;
      mqk[i * C + j] = m;
    }
  // Column j of (I + L)^{-1} diag(b): solve (I + L) x = b_j e_j.
  inv.assign(C * C, 0.0);
  for (int j = 0; j < C; ++j) {
    std::vector<double> x(C, 0.0);
    x[j] = ch.b[j];
    cpu::solve_unit_lower<double>(L.data(), x.data(), C);
    for (int i = 0; i < C; ++i) inv[i * C + j] = x[i];
  }
}

// One pair step on the [V][K] state S of one head; writes the outputs of the valid rows.
void pair_step(const Chunk& A, const Chunk& B, int rows_a, int rows_b, Exp& e, std::vector<double>& S,
               std::vector<double>& out_a, std::vector<double>& out_b) {
  const int64_t K = A.K, V = A.V;
  std::vector<double> inv_a, mqk_a, inv_b, mqk_b;
  chunk_matrices(A, e, inv_a, mqk_a);
  chunk_matrices(B, e, inv_b, mqk_b);

  // Per-channel factors, all exponents <= 0.
  std::vector<double> kd_a(C * K), qd_a(C * K), kr_a2(C * K), kd_b2(C * K), qd_b2(C * K), kr_b(C * K),
      kr_a(C * K), kd_b(C * K), qd_b(C * K), gamma_ab(K);
  for (int64_t c = 0; c < K; ++c) {
    const double ga = A.gamma_log(c), gb = B.gamma_log(c);
    gamma_ab[c] = e(ga + gb);
    for (int i = 0; i < C; ++i) {
      const int64_t ic = i * K + c;
      kd_a[ic] = A.k[ic] * e(A.G[ic]);
      qd_a[ic] = A.q[ic] * e(A.G[ic]);
      kr_a[ic] = A.k[ic] * e(ga - A.G[ic]);
      kr_a2[ic] = A.k[ic] * e(ga - A.G[ic] + gb);  // kr_A e^{Γ_B}: decay from token i to the end of B
      kd_b[ic] = B.k[ic] * e(B.G[ic]);
      qd_b[ic] = B.q[ic] * e(B.G[ic]);
      kd_b2[ic] = B.k[ic] * e(ga + B.G[ic]);  // kd_B e^{Γ_A}: decay from the start of A
      qd_b2[ic] = B.q[ic] * e(ga + B.G[ic]);
      kr_b[ic] = B.k[ic] * e(gb - B.G[ic]);
    }
  }
  std::vector<double> c_ba(C * C, 0.0), d_ba(C * C, 0.0);
  for (int i = 0; i < C; ++i)
    for (int j = 0; j < C; ++j)
      for (int64_t c = 0; c < K; ++c) {
        c_ba[i * C + j] += kd_b[i * K + c] * kr_a[j * K + c];
        d_ba[i * C + j] += qd_b[i * K + c] * kr_a[j * K + c];
      }

  auto dot = [K](const double* x, const double* y) {
    double s = 0.0;
    for (int64_t c = 0; c < K; ++c) s += x[c] * y[c];
    return s;
  };
  std::vector<double> ua(C), ub(C), Ua(C), Ub(C);
  for (int64_t j = 0; j < V; ++j) {
    double* s = &S[j * K];
    for (int i = 0; i < C; ++i) ua[i] = A.v[i * V + j] - dot(&kd_a[i * K], s);
    for (int i = 0; i < C; ++i) {
      Ua[i] = 0.0;
      for (int m = 0; m < C; ++m) Ua[i] += inv_a[i * C + m] * ua[m];
    }
    for (int i = 0; i < C; ++i) {
      ub[i] = B.v[i * V + j] - dot(&kd_b2[i * K], s);
      for (int m = 0; m < C; ++m) ub[i] -= c_ba[i * C + m] * Ua[m];
    }
    for (int i = 0; i < C; ++i) {
      Ub[i] = 0.0;
      for (int m = 0; m < C; ++m) Ub[i] += inv_b[i * C + m] * ub[m];
    }
    for (int i = 0; i < rows_a; ++i) {
      double o = dot(&qd_a[i * K], s);
      for (int m = 0; m < C; ++m) o += mqk_a[i * C + m] * Ua[m];
      out_a[i * V + j] = o;
    }
    for (int i = 0; i < rows_b; ++i) {
      double o = dot(&qd_b2[i * K], s);
      for (int m = 0; m < C; ++m) o += d_ba[i * C + m] * Ua[m] + mqk_b[i * C + m] * Ub[m];
      out_b[i * V + j] = o;
    }
    for (int64_t c = 0; c < K; ++c) {
      double x = gamma_ab[c] * s[c];
      for (int m = 0; m < C; ++m) x += kr_a2[m * K + c] * Ua[m] + kr_b[m * K + c] * Ub[m];
      s[c] = x;
    }
  }
}

// The whole forward in the pair form; returns {out rel-RMS, state rel-RMS} against the reference.
std::pair<double, double> pair_form_vs_reference(const KdaOptions& opt, int64_t* positive_exponents) {
  KdaInputs in(opt);
  SCOPED_TRACE(in.describe());
  const Reference ref = run_reference(in);
  const PrefillParams p = in.params();
  const int64_t N = in.N, H = p.H, K = p.K, V = p.V;
  const double scale = host::output_scale<double>(p.pre, K);
  std::vector<double> out(ref.out.size(), std::nan("")), fs(ref.final_state.size(), std::nan(""));
  Exp e;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> S(V * K);
      host::load_state(p.initial_state, p.initial_state_dtype, n, h, H, V, K, S.data());
      const SeqRange r = detail::seq_range(p, n);
      for (int64_t t0 = r.bos; t0 < r.eos; t0 += 2 * C) {
        const int rows_a = int(std::min<int64_t>(C, r.eos - t0));
        const int rows_b = int(std::clamp<int64_t>(r.eos - t0 - C, 0, C));
        const Chunk A = load_chunk(p, h, t0, rows_a, scale);
        const Chunk B = load_chunk(p, h, t0 + C, rows_b, scale);
        std::vector<double> oa(C * V), ob(C * V);
        pair_step(A, B, rows_a, rows_b, e, S, oa, ob);
        for (int i = 0; i < rows_a; ++i)
          for (int64_t j = 0; j < V; ++j) out[((t0 + i) * H + h) * V + j] = oa[i * V + j];
        for (int i = 0; i < rows_b; ++i)
          for (int64_t j = 0; j < V; ++j) out[((t0 + C + i) * H + h) * V + j] = ob[i * V + j];
      }
      std::copy(S.begin(), S.end(), fs.begin() + (n * H + h) * V * K);
    }
  EXPECT_EQ(count_nonfinite(out), 0);
  EXPECT_EQ(count_nonfinite(fs), 0);
  *positive_exponents = e.positive;
  return {rel_rms(out, ref.out), rel_rms(fs, ref.final_state)};
}

TEST(ChunkPairForm, MatchesTokenRecurrenceFp64) {
  std::vector<std::pair<const char*, KdaOptions>> cases;
  {
    KdaOptions o;  // every length class of a pair: empty, one token, within A, A full, into B, B full, a second pair
    o.seqlens = {0, 1, 15, 16, 17, 31, 32, 33, 100};
    o.H = 2, o.K = 64, o.V = 48;
    o.initial_state = StateKind::kF32;
    cases.push_back({"lower_bound varlen", o});
  }
  {
    KdaOptions o;  // softplus with extreme gates: spreads far beyond what e^{-G} could hold
    o.B = 2, o.T = 70, o.H = 1, o.K = 40, o.V = 24;
    o.dtype = o.g_dtype = o.beta_dtype = DType::kF32;
    o.gate = GateForm::kSoftplus;
    o.A_log_max = 3.0;
    o.g_min = -8.0, o.g_max = 8.0, o.dt_bias_min = -8.0, o.dt_bias_max = 8.0;
    o.initial_state = StateKind::kBF16;
    cases.push_back({"softplus extremes, odd K and V", o});
  }
  {
    KdaOptions o;  // precomputed log-decays down to -1000
    o.T = 48, o.H = 1, o.K = 32, o.V = 16;
    o.gate = GateForm::kPrecomputed;
    o.g_min = -1000.0, o.g_max = 0.0;
    o.g_dtype = DType::kF32;
    cases.push_back({"precomputed to -1000", o});
  }
  for (auto& [name, opt] : cases) {
    SCOPED_TRACE(name);
    int64_t positive = -1;
    const auto [err_out, err_state] = pair_form_vs_reference(opt, &positive);
    report(std::string("pair_form_out_") + name, err_out);
    EXPECT_LT(err_out, 1e-10);
    EXPECT_LT(err_state, 1e-10);
    EXPECT_EQ(positive, 0) << "an exponent of the pair form was positive";
  }
}

}  // namespace
}  // namespace flashkda::test
