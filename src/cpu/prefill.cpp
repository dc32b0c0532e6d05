// CPU prefill backend: the chunk-16 form of SPEC.md §4 with OpenMP over (sequence, head).
// Per chunk: load and preprocess 16 tokens, build L and Mqk, then one pass over the state's V
// rows that reads, solves, writes the output and updates the state while the row sits in L1.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend.h"
#include "common/host_math.h"
#include "cpu/chunk.h"

namespace flashkda::cpu {
namespace {

constexpr int C = kChunk;

// Per-thread scratch for one 16-token chunk of one head (K, V <= 256).
template <typename T>
struct ChunkScratch {
  int64_t K, V;
  std::vector<T> q, k, v, g_cumsum;  // [C, K] ([C, V] for v): preprocessed rows, G
  std::vector<T> kq_decayed_t;       // [K, 2C]: column i = k_decayed_i, column C + i = q_decayed_i
  std::vector<T> k_restored;         // [C, K]: k_i * e^{Γ - G_i}
  std::vector<T> decay_total;        // [K]: e^Γ
  std::vector<T> mid;                // [K]: per-channel shift (G_first + G_last) / 2
  std::vector<T> k_decayed_s, q_decayed_s, k_inv_s;  // [C, K]: shifted factors
  std::vector<T> o;                  // [C, V]
  T b[C];
  T L[C * C];
  T Mqk[C * C];

  ChunkScratch(int64_t K_, int64_t V_)
      : K(K_), V(V_), q(C * K), k(C * K), v(C * V), g_cumsum(C * K), kq_decayed_t(K * 2 * C), k_restored(C * K),
        decay_total(K), mid(K), k_decayed_s(C * K), q_decayed_s(C * K), k_inv_s(C * K), o(C * V) {}
};

// Rows [tok0, tok0 + n) of head h, preprocessed; g_cumsum holds the log-decay a until the prefix sum.
template <typename T>
void load_chunk(const PrefillParams& p, int64_t h, int64_t tok0, int n, const host::HeadGate<T>& gate,
                ChunkScratch<T>& s) {
  const int64_t H = p.H, K = s.K, V = s.V;
  for (int i = 0; i < n; ++i) {
    const int64_t row = (tok0 + i) * H + h;
    T* qi = &s.q[i * K];
    T* ki = &s.k[i * K];
    T* ai = &s.g_cumsum[i * K];
    host::load_row(p.q, p.dtype, row * K, K, qi);
    host::load_row(p.k, p.dtype, row * K, K, ki);
    host::load_row(p.v, p.dtype, row * V, V, &s.v[i * V]);
    host::load_row(p.g, p.g_dtype, row * K, K, ai);
    if (p.pre.l2norm_qk) {
      host::l2_normalize(qi, K);
      host::l2_normalize(ki, K);
    }
    for (int64_t c = 0; c < K; ++c) ai[c] = gate(c, ai[c]);
    s.b[i] = host::beta_activation(p.pre, host::load<T>(p.beta, p.beta_dtype, row));
  }
}

// G, the decayed/restored keys and queries, L and Mqk for the n valid rows of a chunk.
template <typename T>
void build_chunk_matrices(ChunkScratch<T>& s, int n, T scale) {
  const int64_t K = s.K;
  T* G = s.g_cumsum.data();
  for (int i = 1; i < n; ++i) {
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) G[i * K + c] += G[(i - 1) * K + c];
  }
  const T* gamma = &G[(n - 1) * K];

  T max_shift = T(0);
  for (int64_t c = 0; c < K; ++c) {
    s.mid[c] = (G[c] + gamma[c]) * T(0.5);
    s.decay_total[c] = std::exp(gamma[c]);
    for (int i = 0; i < n; ++i) max_shift = std::max(max_shift, std::abs(G[i * K + c] - s.mid[c]));
  }

  // Rows past the sequence end read as k = q = 0: their columns of the transposed block are zero.
  std::fill(s.kq_decayed_t.begin(), s.kq_decayed_t.end(), T(0));
  for (int i = 0; i < n; ++i) {
    const T* qi = &s.q[i * K];
    const T* ki = &s.k[i * K];
    const T* Gi = &G[i * K];
    for (int64_t c = 0; c < K; ++c) {
      const T e = std::exp(Gi[c]);  // <= 1 for a <= 0; may underflow to 0, which is exact enough
      s.kq_decayed_t[c * 2 * C + i] = ki[c] * e;
      s.kq_decayed_t[c * 2 * C + C + i] = scale * qi[c] * e;
      s.k_restored[i * K + c] = ki[c] * std::exp(gamma[c] - Gi[c]);
    }
  }

  std::fill(s.L, s.L + C * C, T(0));
  std::fill(s.Mqk, s.Mqk + C * C, T(0));
  if (max_shift <= T(kMaxShift)) {
    // Exact per-channel shift: kd_s_i . ki_s_j = sum_c k_i,c k_j,c e^{G_i,c - G_j,c}, every factor
    // within e^{±kMaxShift}.
    for (int i = 0; i < n; ++i) {
      const T* qi = &s.q[i * K];
      const T* ki = &s.k[i * K];
      const T* Gi = &G[i * K];
      T* kds = &s.k_decayed_s[i * K];
      T* qds = &s.q_decayed_s[i * K];
      T* kis = &s.k_inv_s[i * K];
      for (int64_t c = 0; c < K; ++c) {
        const T up = std::exp(Gi[c] - s.mid[c]);
        const T down = std::exp(s.mid[c] - Gi[c]);
        kds[c] = ki[c] * up;
        qds[c] = scale * qi[c] * up;
        kis[c] = ki[c] * down;
      }
    }
    for (int i = 0; i < n; ++i) {
      const T* kds = &s.k_decayed_s[i * K];
      const T* qds = &s.q_decayed_s[i * K];
      for (int j = 0; j <= i; ++j) {
        const T* kis = &s.k_inv_s[j * K];
        T l = T(0), m = T(0);
#pragma omp simd reduction(+ : l, m)
        for (int64_t c = 0; c < K; ++c) {
          l += kds[c] * kis[c];
          m += qds[c] * kis[c];
        }
        if (j < i) s.L[i * C + j] = s.b[i] * l;
        s.Mqk[i * C + j] = m;
      }
    }
  } else {
    // Spread too wide for one shift (softplus or precomputed gates): e^{G_i - G_j} per pair,
    // exponent <= 0 for j <= i, so nothing overflows and tiny terms underflow correctly.
    for (int i = 0; i < n; ++i) {
      const T* qi = &s.q[i * K];
      const T* ki = &s.k[i * K];
      const T* Gi = &G[i * K];
      for (int j = 0; j <= i; ++j) {
        const T* kj = &s.k[j * K];
        const T* Gj = &G[j * K];
        T l = T(0), m = T(0);
        for (int64_t c = 0; c < K; ++c) {
          const T e = std::exp(Gi[c] - Gj[c]);
          l += ki[c] * kj[c] * e;
          m += qi[c] * kj[c] * e;
        }
        if (j < i) s.L[i * C + j] = s.b[i] * l;
        s.Mqk[i * C + j] = scale * m;
      }
    }
  }
}

// One pass over the V rows of the state S ([V, K], v-first): for each column j of S,
//   u_i = b_i (v_i,j - kd_i . S_j),  U = (I + L)^{-1} u,  o_i,j = qd_i . S_j + sum_{l<=i} Mqk[i,l] U_l,
//   S_j <- e^Γ ⊙ S_j + sum_i U_i kr_i.
// Columns are independent, so each S row is read and written once per chunk.
template <typename T>
void state_pass(ChunkScratch<T>& s, int n, T* S) {
  const int64_t K = s.K, V = s.V;
  const T* kq_t = s.kq_decayed_t.data();
  for (int64_t j = 0; j < V; ++j) {
    T* Sj = S + j * K;
    T acc[2 * C] = {};
    for (int64_t c = 0; c < K; ++c) {
      const T sc = Sj[c];
      const T* col = kq_t + c * 2 * C;
#pragma omp simd
      for (int m = 0; m < 2 * C; ++m) acc[m] += col[m] * sc;
    }
    T U[C];
    for (int i = 0; i < n; ++i) U[i] = s.b[i] * (s.v[i * V + j] - acc[i]);
    solve_unit_lower(s.L, U, n);
    for (int i = 0; i < n; ++i) {
      T o = acc[C + i];
      for (int l = 0; l <= i; ++l) o += s.Mqk[i * C + l] * U[l];
      s.o[i * V + j] = o;
    }
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) Sj[c] *= s.decay_total[c];
    for (int i = 0; i < n; ++i) {
      const T ui = U[i];
      const T* kr = &s.k_restored[i * K];
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) Sj[c] += ui * kr[c];
    }
  }
}

template <typename T>
void forward_sequence_head(const PrefillParams& p, int64_t n, int64_t h, T scale, ChunkScratch<T>& s, T* S,
                           T* out) {
  const int64_t H = p.H, V = s.V;
  const SeqRange r = detail::seq_range(p, n);
  const host::HeadGate<T> gate(p.pre, h, s.K);
  for (int64_t tok0 = r.bos; tok0 < r.eos; tok0 += C) {
    const int len = int(std::min<int64_t>(C, r.eos - tok0));
    load_chunk(p, h, tok0, len, gate, s);
    build_chunk_matrices(s, len, scale);
    state_pass(s, len, S);
    for (int i = 0; i < len; ++i) {
      const int64_t row = (tok0 + i) * H + h;
      if (out != nullptr) {
        std::copy(&s.o[i * V], &s.o[i * V] + V, out + row * V);
      } else {
        host::store_row(p.out, p.dtype, row * V, V, &s.o[i * V]);
      }
    }
  }
}

}  // namespace

template <typename T>
void chunk_forward(const PrefillParams& p, T* out, T* final_state) {
  const int64_t N = detail::num_sequences(p);
  const int64_t H = p.H, K = p.K, V = p.V;
  const T scale = p.pre.has_scale ? T(p.pre.scale) : T(1) / std::sqrt(T(K));
  if (N * H == 0) return;

#pragma omp parallel
  {
    ChunkScratch<T> scratch(K, V);
    std::vector<T> S(V * K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nh = 0; nh < N * H; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      host::load_state(p.initial_state, p.initial_state_dtype, n, h, H, V, K, S.data());
      forward_sequence_head(p, n, h, scale, scratch, S.data(), out);
      if (final_state != nullptr) {
        std::copy(S.begin(), S.end(), final_state + (n * H + h) * V * K);
      } else if (p.final_state != nullptr) {
        host::store_state(p.final_state, p.final_state_dtype, n, h, H, V, K, S.data());
      }
    }
  }
}

template void chunk_forward<float>(const PrefillParams&, float*, float*);
template void chunk_forward<double>(const PrefillParams&, double*, double*);

void forward(const PrefillParams& p) { chunk_forward<float>(p); }

}  // namespace flashkda::cpu
