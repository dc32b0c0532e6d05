// CPU prefill backend: the chunk-16 form of docs/SPEC.md §4 with OpenMP over (sequence, head).
// Per chunk: load and preprocess 16 tokens, build L and Mqk, then one pass over the state's V
// rows (in blocks of kRows) that reads, solves, writes the output and updates the state while
// the rows sit in L1. The fp32 engine is compiled twice, for AVX2+FMA and for the baseline ISA,
// and picked at run time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "backend.h"
#include "common/host_math.h"
#include "cpu/chunk.h"

// The engine's helpers are forced inline so each ISA entry point gets its own vectorised copy.
#if defined(__GNUC__)
#define FLASHKDA_INLINE inline __attribute__((always_inline))
#else
#define FLASHKDA_INLINE inline
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define FLASHKDA_X86_DISPATCH 1
#endif

namespace flashkda::cpu {
namespace {

constexpr int C = kChunk;
constexpr int64_t kLane = 16;  // K is padded to a multiple of this inside the engine
constexpr int kRows = 8;        // state rows (columns of S) handled together in the state pass
constexpr int kReadRows = 2;    // rows per register tile of the reads (2 x 2C accumulators)
constexpr int kUpdateRows = 4;  // rows per register tile of the state update (4 x kLane)

// Order-preserving map between float bit patterns and int32 (its own inverse): lets clamps use
// integer min/max. Float compares under the default -ftrapping-math block if-conversion, and a
// loop with them does not vectorise.
constexpr int32_t float_order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

// e^x for the engine's channel loops, written so the compiler vectorises it. float: range
// reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial (Cephes expf coefficients; measured
// <= 1.5 ulp), 2^n applied in two halves so results down to the subnormal range stay correct;
// like std::exp, NaN gives NaN and arguments beyond the float range +inf (a NaN or +inf gate
// must not come out as a finite result), below it 0. double: std::exp, as the fp64
// instantiation is the accuracy yardstick.
FLASHKDA_INLINE double engine_exp(double x) { return std::exp(x); }
FLASHKDA_INLINE float engine_exp(float x) {
  constexpr int32_t kLo = float_order_key(__builtin_bit_cast(int32_t, -104.0f));  // e^-104 rounds to 0
  constexpr int32_t kHi = float_order_key(__builtin_bit_cast(int32_t, 88.5f));    // e^88.5 ~ 2.7e38
  constexpr int32_t kOver = float_order_key(__builtin_bit_cast(int32_t, 88.73f));  // e^88.73 > FLT_MAX
  const int32_t bits = __builtin_bit_cast(int32_t, x);
  const int32_t raw_key = float_order_key(bits);
  // Masks (all ones or zero) from integer min/max only: a comparison here would become a branch
  // and stop the loops around this function from vectorising.
  const int32_t nan_mask = -std::min(std::max((bits & 0x7fffffff) - 0x7f800000, 0), 1);
  const int32_t over_mask = -std::min(std::max(std::max(raw_key, 0) - kOver, 0), 1);
  const int32_t key = std::min(std::max(raw_key, kLo), kHi);
  x = __builtin_bit_cast(float, float_order_key(key));
  const int32_t ni = int32_t(x * 1.44269504088896341f + 128.5f) - 128;  // round(x / ln2); argument > 0
  const float n = float(ni);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t n1 = ni >> 1, n2 = ni - n1;  // each in [-75, 64]: 2^n1 and 2^n2 are normal floats
  const float e = y * __builtin_bit_cast(float, (n1 + 127) << 23) * __builtin_bit_cast(float, (n2 + 127) << 23);
  int32_t out = __builtin_bit_cast(int32_t, e);
  out = (out & ~over_mask) | (0x7f800000 & over_mask);         // +inf
  out = (out & ~nan_mask) | ((bits | 0x00400000) & nan_mask);  // the input NaN, quiet
  return __builtin_bit_cast(float, out);
}

// Per-thread scratch for one 16-token chunk of one head. Channel arrays have stride Kp
// (K rounded up to kLane); the padding channels hold k = q = 0 and never change the result.
template <typename T>
struct ChunkScratch {
  int64_t K, Kp, V;
  std::vector<T> q, k, v, gate_a;    // [C, Kp] ([C, V] for v): preprocessed rows, log-decay a
  // [C, Kp]: G in double. With precomputed or softplus gates |G| reaches thousands within a chunk;
  // G rounded to float there is off by ~1e-3 in absolute terms, and e^{G_i - G_j} with it by the
  // same relative amount although G_i - G_j may be small. Exponents are differences of these.
  std::vector<double> G64;
  std::vector<T> kq_decayed_t;       // [Kp, 2C]: column i = k_decayed_i, column C + i = q_decayed_i
  std::vector<T> k_restored;         // [C, Kp]: k_i * e^{Γ - G_i}
  std::vector<T> decay_total;        // [Kp]: e^Γ
  std::vector<double> mid;           // [Kp]: per-channel shift (G_first + G_last) / 2
  std::vector<T> decay_mid;          // [Kp]: e^{Γ - mid}
  std::vector<T> e_row;              // [Kp]: e^{G_i} of the row being built
  std::vector<T> k_decayed_s, q_decayed_s, k_inv_s;  // [C, Kp]: shifted factors
  std::vector<T> o;                  // [C, V]
  std::vector<float> zero_bias;      // [K]: dt_bias of a head when none is given
  std::vector<T> S;                  // [V, Kp]: the state, v-first
  T b[C];
  T L[C * C];
  T Mqk[C * C];

  ChunkScratch(int64_t K_, int64_t V_)
      : K(K_), Kp((K_ + kLane - 1) / kLane * kLane), V(V_), q(C * Kp, T(0)), k(C * Kp, T(0)), v(C * V),
        gate_a(C * Kp, T(0)), G64(C * Kp, 0.0), kq_decayed_t(Kp * 2 * C), k_restored(C * Kp, T(0)),
        decay_total(Kp, T(1)), mid(Kp, 0.0), decay_mid(Kp, T(0)), e_row(Kp), k_decayed_s(C * Kp),
        q_decayed_s(C * Kp), k_inv_s(C * Kp), o(C * V), zero_bias(K, 0.0f), S(V * Kp, T(0)) {}
};

// Rows [tok0, tok0 + n) of head h, preprocessed; gate_a holds the log-decay a (G64 its prefix sums).
template <typename T>
FLASHKDA_INLINE void load_chunk(const PrefillParams& p, int64_t h, int64_t tok0, int n,
                                const host::HeadGate<T>& gate, ChunkScratch<T>& s) {
  const int64_t H = p.H, K = s.K, Kp = s.Kp, V = s.V;
  for (int i = 0; i < n; ++i) {
    const int64_t row = (tok0 + i) * H + h;
    T* qi = &s.q[i * Kp];
    T* ki = &s.k[i * Kp];
    T* ai = &s.gate_a[i * Kp];
    host::load_row(p.q, p.dtype, row * K, K, qi);
    host::load_row(p.k, p.dtype, row * K, K, ki);
    host::load_row(p.v, p.dtype, row * V, V, &s.v[i * V]);
    host::load_row(p.g, p.g_dtype, row * K, K, ai);
    if (p.pre.l2norm_qk) {
      host::l2_normalize(qi, K);
      host::l2_normalize(ki, K);
    }
    if (gate.form == GateForm::kLowerBound) {
      // a = lb * sigmoid(x) = lb / (1 + e^{-x}); for x << 0 the clamped exponent leaves a ~ 0.
      const float* bias = gate.bias != nullptr ? gate.bias : s.zero_bias.data();
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) {
        const T x = gate.a_scale * (ai[c] + T(bias[c]));
        ai[c] = gate.lower_bound / (T(1) + engine_exp(-x));
      }
    } else {
      for (int64_t c = 0; c < K; ++c) ai[c] = gate(c, ai[c]);
    }
    s.b[i] = host::beta_activation(p.pre, host::load<T>(p.beta, p.beta_dtype, row));
  }
}

// l = a . x and m = b . x over n (a multiple of kLane) channels, with kLane partial sums so the
// loop vectorises without reassociation flags.
template <typename T>
FLASHKDA_INLINE void dot2(const T* a, const T* b, const T* x, int64_t n, T& l, T& m) {
  T lp[kLane] = {}, mp[kLane] = {};
  for (int64_t c0 = 0; c0 < n; c0 += kLane) {
#pragma omp simd
    for (int w = 0; w < kLane; ++w) {
      lp[w] += a[c0 + w] * x[c0 + w];
      mp[w] += b[c0 + w] * x[c0 + w];
    }
  }
  l = m = T(0);
  for (int w = 0; w < kLane; ++w) {
    l += lp[w];
    m += mp[w];
  }
}

// L and Mqk from the shifted factors: kd_s_i . ki_s_j = sum_c k_i,c k_j,c e^{G_i,c - G_j,c},
// every factor within e^{±kMaxFactorisedShift}.
template <typename T>
FLASHKDA_INLINE void build_shifted(ChunkScratch<T>& s, int n, T scale) {
  const int64_t Kp = s.Kp;
  for (int i = 0; i < n; ++i) {
    const T* kds = &s.k_decayed_s[i * Kp];
    const T* qds = &s.q_decayed_s[i * Kp];
    for (int j = 0; j <= i; ++j) {
      const T* kis = &s.k_inv_s[j * Kp];
      T l = T(0), m = T(0);
      dot2(kds, qds, kis, Kp, l, m);
      if (j < i) s.L[i * C + j] = s.b[i] * l;
      s.Mqk[i * C + j] = scale * m;
    }
  }
}

// L and Mqk pairwise, for chunks whose gate spread is too wide for one shift (softplus or
// precomputed gates): e^{G_i - G_j} with exponent <= 0 for j <= i, so nothing overflows and tiny
// terms underflow correctly.
template <typename T>
FLASHKDA_INLINE void build_pairwise(ChunkScratch<T>& s, int n, T scale) {
  const int64_t Kp = s.Kp;
  const double* G = s.G64.data();
  for (int i = 0; i < n; ++i) {
    const T* qi = &s.q[i * Kp];
    const T* ki = &s.k[i * Kp];
    const double* Gi = &G[i * Kp];
    for (int j = 0; j <= i; ++j) {
      const T* kj = &s.k[j * Kp];
      const double* Gj = &G[j * Kp];
      // Padding channels hold k = q = G = 0 and add nothing.
      T lp[kLane] = {}, mp[kLane] = {};
      for (int64_t c0 = 0; c0 < Kp; c0 += kLane) {
#pragma omp simd
        for (int w = 0; w < kLane; ++w) {
          const int64_t c = c0 + w;
          const T kje = kj[c] * engine_exp(T(Gi[c] - Gj[c]));
          lp[w] += ki[c] * kje;
          mp[w] += qi[c] * kje;
        }
      }
      T l = T(0), m = T(0);
      for (int w = 0; w < kLane; ++w) {
        l += lp[w];
        m += mp[w];
      }
      if (j < i) s.L[i * C + j] = s.b[i] * l;
      s.Mqk[i * C + j] = scale * m;
    }
  }
}

// G, the decayed/restored keys and queries, L and Mqk for the n valid rows of a chunk.
template <typename T>
FLASHKDA_INLINE void build_chunk_matrices(ChunkScratch<T>& s, int n, T scale) {
  const int64_t K = s.K, Kp = s.Kp;
  // The prefix sums in double; every exponent below is a difference of them, rounded to T once.
  const T* a = s.gate_a.data();
  double* G = s.G64.data();
#pragma omp simd
  for (int64_t c = 0; c < K; ++c) G[c] = double(a[c]);
  for (int i = 1; i < n; ++i) {
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) G[i * Kp + c] = G[(i - 1) * Kp + c] + double(a[i * Kp + c]);
  }
  const double* gamma = &G[(n - 1) * Kp];

#pragma omp simd
  for (int64_t c = 0; c < K; ++c) {
    s.mid[c] = (G[c] + gamma[c]) * 0.5;
    s.decay_total[c] = engine_exp(T(gamma[c]));
    s.decay_mid[c] = engine_exp(T(gamma[c] - s.mid[c]));
  }
  double max_shift = 0.0;
  for (int i = 0; i < n; ++i) {
#pragma omp simd reduction(max : max_shift)
    for (int64_t c = 0; c < K; ++c) max_shift = std::max(max_shift, std::abs(G[i * Kp + c] - s.mid[c]));
  }
  const bool shifted = max_shift <= kMaxFactorisedShift;

  // Rows past the sequence end read as k = q = 0: their columns of the transposed block are zero.
  std::fill(s.kq_decayed_t.begin(), s.kq_decayed_t.end(), T(0));
  for (int i = 0; i < n; ++i) {
    const T* qi = &s.q[i * Kp];
    const T* ki = &s.k[i * Kp];
    const double* Gi = &G[i * Kp];
    T* e = s.e_row.data();
    T* kr = &s.k_restored[i * Kp];
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) e[c] = engine_exp(T(Gi[c]));  // <= 1; underflow to 0 is harmless
    for (int64_t c = 0; c < K; ++c) {
      s.kq_decayed_t[c * 2 * C + i] = ki[c] * e[c];
      s.kq_decayed_t[c * 2 * C + C + i] = scale * qi[c] * e[c];
    }
    if (shifted) {
      // |G - mid| <= kMaxFactorisedShift: up and 1/up are finite, and e^{Γ - G} = e^{Γ - mid} e^{mid - G}
      // is a product of two finite factors (Γ - mid lies within the same bound).
      T* kds = &s.k_decayed_s[i * Kp];
      T* qds = &s.q_decayed_s[i * Kp];
      T* kis = &s.k_inv_s[i * Kp];
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) {
        const T up = engine_exp(T(Gi[c] - s.mid[c]));
        const T down = T(1) / up;
        kds[c] = ki[c] * up;
        qds[c] = qi[c] * up;
        kis[c] = ki[c] * down;
        kr[c] = ki[c] * (s.decay_mid[c] * down);
      }
      for (int64_t c = K; c < Kp; ++c) kds[c] = qds[c] = kis[c] = T(0);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) kr[c] = ki[c] * engine_exp(T(gamma[c] - Gi[c]));
    }
  }

  std::fill(s.L, s.L + C * C, T(0));
  std::fill(s.Mqk, s.Mqk + C * C, T(0));
  if (shifted) {
    build_shifted(s, n, scale);
  } else {
    build_pairwise(s, n, scale);
  }
}

// Rows j0 .. j0 + R of the state (columns of S): for each,
//   u_i = b_i (v_i,j - kd_i . S_j),  U = (I + L)^{-1} u,  o_i,j = qd_i . S_j + sum_{l<=i} Mqk[i,l] U_l,
//   S_j <- e^Γ ⊙ S_j + sum_i U_i kr_i.
// Columns of S are independent, so each row is read and written once per chunk; the solve runs
// on all R rows at once (vectorised over rows).
template <typename T, int R>
FLASHKDA_INLINE void state_rows(ChunkScratch<T>& s, int n, int64_t j0) {
  const int64_t Kp = s.Kp, V = s.V;
  T* S = s.S.data() + j0 * Kp;
  const T* kq_t = s.kq_decayed_t.data();

  // Reads of the old state: acc[i][r] = kd_i . S_r, acc[C + i][r] = qd_i . S_r
  // (register tiles of RT rows x 2C columns, outer products over the channels).
  T acc[2 * C][R];
  constexpr int RT = R < kReadRows ? R : kReadRows;
  for (int r0 = 0; r0 < R; r0 += RT) {
    T tile[RT][2 * C] = {};
    for (int64_t c = 0; c < Kp; ++c) {
      const T* col = kq_t + c * 2 * C;
      for (int r = 0; r < RT; ++r) {
        const T x = S[(r0 + r) * Kp + c];
#pragma omp simd
        for (int m = 0; m < 2 * C; ++m) tile[r][m] += col[m] * x;
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int m = 0; m < 2 * C; ++m) acc[m][r0 + r] = tile[r][m];
  }

  // U = (I + L)^{-1} u, then o = qd . S + Mqk U.
  T U[C][R];
  for (int i = 0; i < n; ++i) {
#pragma omp simd
    for (int r = 0; r < R; ++r) U[i][r] = s.b[i] * (s.v[i * V + j0 + r] - acc[i][r]);
  }
  solve_unit_lower<T, R>(s.L, &U[0][0], n);
  for (int i = 0; i < n; ++i) {
    T o[R];
#pragma omp simd
    for (int r = 0; r < R; ++r) o[r] = acc[C + i][r];
    for (int l = 0; l <= i; ++l) {
      const T m = s.Mqk[i * C + l];
#pragma omp simd
      for (int r = 0; r < R; ++r) o[r] += m * U[l][r];
    }
#pragma omp simd
    for (int r = 0; r < R; ++r) s.o[i * V + j0 + r] = o[r];
  }

  // State update, register tiles of RU rows x kLane channels, inner loop over the chunk's tokens.
  const T* dt = s.decay_total.data();
  constexpr int RU = R < kUpdateRows ? R : kUpdateRows;
  for (int r0 = 0; r0 < R; r0 += RU) {
    T* Sr = S + r0 * Kp;
    for (int64_t c0 = 0; c0 < Kp; c0 += kLane) {
      T a[RU][kLane];
      for (int r = 0; r < RU; ++r) {
#pragma omp simd
        for (int w = 0; w < kLane; ++w) a[r][w] = dt[c0 + w] * Sr[r * Kp + c0 + w];
      }
      for (int i = 0; i < n; ++i) {
        const T* kr = &s.k_restored[i * Kp + c0];
        for (int r = 0; r < RU; ++r) {
          const T ui = U[i][r0 + r];
#pragma omp simd
          for (int w = 0; w < kLane; ++w) a[r][w] += ui * kr[w];
        }
      }
      for (int r = 0; r < RU; ++r) {
#pragma omp simd
        for (int w = 0; w < kLane; ++w) Sr[r * Kp + c0 + w] = a[r][w];
      }
    }
  }
}

template <typename T>
FLASHKDA_INLINE void state_pass(ChunkScratch<T>& s, int n) {
  int64_t j = 0;
  for (; j + kRows <= s.V; j += kRows) state_rows<T, kRows>(s, n, j);
  for (; j < s.V; ++j) state_rows<T, 1>(s, n, j);
}

// The whole recurrence of sequence n, head h, with the state in s.S; writes out (in T when
// out is non-null, else in p.dtype).
template <typename T>
FLASHKDA_INLINE void forward_sequence_head(const PrefillParams& p, int64_t n, int64_t h, T scale,
                                           ChunkScratch<T>& s, T* out) {
  const int64_t H = p.H, V = s.V;
  const SeqRange r = detail::seq_range(p, n);
  const host::HeadGate<T> gate(p.pre, h, s.K);
  for (int64_t tok0 = r.bos; tok0 < r.eos; tok0 += C) {
    const int len = int(std::min<int64_t>(C, r.eos - tok0));
    load_chunk(p, h, tok0, len, gate, s);
    build_chunk_matrices(s, len, scale);
    state_pass(s, len);
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

template <typename T>
void run_default(const PrefillParams& p, int64_t n, int64_t h, T scale, ChunkScratch<T>& s, T* out) {
  forward_sequence_head(p, n, h, scale, s, out);
}

#ifdef FLASHKDA_X86_DISPATCH
__attribute__((target("avx2,fma"))) void run_avx2(const PrefillParams& p, int64_t n, int64_t h, float scale,
                                                  ChunkScratch<float>& s, float* out) {
  forward_sequence_head(p, n, h, scale, s, out);
}
#endif

template <typename T>
void run_sequence_head(const PrefillParams& p, int64_t n, int64_t h, T scale, ChunkScratch<T>& s, T* out) {
#ifdef FLASHKDA_X86_DISPATCH
  if constexpr (std::is_same_v<T, float>) {
    static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (has_avx2) return run_avx2(p, n, h, scale, s, out);
  }
#endif
  run_default(p, n, h, scale, s, out);
}

// The per-thread scratch of chunk_forward, kept between calls (OpenMP's threads persist): a call
// allocates only when its thread meets a head size it has not served last. Reuse is safe as the
// engine never writes the padding channels (they stay zero) and rewrites every other element it
// reads before reading it, within a call as across calls.
template <typename T>
struct ScratchSet {
  std::unique_ptr<ChunkScratch<T>> chunk;
  std::vector<T> state;
};

template <typename T>
ScratchSet<T>& thread_scratch(int64_t K, int64_t V) {
  thread_local ScratchSet<T> set;
  if (!set.chunk || set.chunk->K != K || set.chunk->V != V) {
    set.chunk = std::make_unique<ChunkScratch<T>>(K, V);
    set.state.assign(size_t(V * K), T(0));
  }
  return set;
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
    ScratchSet<T>& set = thread_scratch<T>(K, V);
    ChunkScratch<T>& s = *set.chunk;
    std::vector<T>& state = set.state;
#pragma omp for schedule(dynamic, 1)
    for (int64_t nh = 0; nh < N * H; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      host::load_state(p.initial_state, p.initial_state_dtype, n, h, H, V, K, state.data());
      for (int64_t j = 0; j < V; ++j) std::copy(&state[j * K], &state[j * K] + K, &s.S[j * s.Kp]);
      run_sequence_head(p, n, h, scale, s, out);
      for (int64_t j = 0; j < V; ++j) std::copy(&s.S[j * s.Kp], &s.S[j * s.Kp] + K, &state[j * K]);
      if (final_state != nullptr) {
        std::copy(state.begin(), state.end(), final_state + (n * H + h) * V * K);
      } else if (p.final_state != nullptr) {
        host::store_state(p.final_state, p.final_state_dtype, n, h, H, V, K, state.data());
      }
    }
  }
}

template void chunk_forward<float>(const PrefillParams&, float*, float*);
template void chunk_forward<double>(const PrefillParams&, double*, double*);

void forward(const PrefillParams& p) { chunk_forward<float>(p); }

}  // namespace flashkda::cpu
