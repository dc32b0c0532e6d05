// CPU prefill backend: the chunk-16 form of docs/SPEC.md §4 with OpenMP over (sequence, head).
// Per chunk: load and preprocess 16 tokens, build L and Mqk, then one pass over the state's V
// rows (in blocks of kRows) that reads, solves, writes the output and updates the state while
// the rows sit in L1. The fp32 engine is compiled three times, for the baseline ISA, AVX2+FMA and
// AVX-512 (each with its own register tiles for the state products), and picked at run time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "backend.h"
#include "common/host_math.h"
#include "cpu/chunk.h"
#include "cpu/gate_avx2.h"
#include "cpu/isa.h"
#include "cpu/vec_avx2.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// The engine's helpers are forced inline so each ISA entry point gets its own vectorised copy.
#if defined(__GNUC__)
#define FLASHKDA_INLINE inline __attribute__((always_inline))
#else
#define FLASHKDA_INLINE inline
#endif

#ifdef FLASHKDA_X86_DISPATCH
#include <immintrin.h>
#endif

namespace flashkda::cpu {
namespace {

constexpr int C = kChunk;
constexpr int64_t kLane = 16;  // K and V are padded to multiples of this inside the engine
// The state pass works on panels of kPanel value columns of the transposed state S^T [K, V]
// (K x 16 fp32 = 8 KB at K = 128: in L1 with the chunk's factors), with register tiles of
// kTileRows rows x kPanel columns: 4 x 16 fp32 accumulators are 8 AVX2 registers, and each step
// of a tile's loop issues 8 FMAs against 2 loads and 4 broadcasts (FMA-bound, as sgemm is).
constexpr int kPanel = int(kLane);
constexpr int kTileRows = 4;
// A work item steps up to kHeadGroup heads of one sequence chunk by chunk, the heads of a chunk
// one after another: their rows of a token lie side by side (kHeadGroup * 256 bytes in bf16 at
// K = 128), where one head alone reads 4 tensors x 16 rows, each on its own page at H >= 16 (the
// row stride is H * 256 bytes). Measured (CI-class VM): the loads of a chunk's rows were ~17% of
// the engine's time with one head per item.
constexpr int kHeadGroup = 4;

}  // namespace

// The widest instruction set the processor has, found once; `requested` (cpu_isa: 0 = rule, the
// widest) is capped at it.
int engine_isa(int requested) {
#ifdef FLASHKDA_X86_DISPATCH
  static const int widest = [] {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return kIsaBaseline;
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return avx512 ? kIsaAvx512 : kIsaAvx2;
  }();
#else
  constexpr int widest = kIsaBaseline;
#endif
  return requested > 0 ? std::min(requested, widest) : widest;
}

namespace {

// Order-preserving map between float bit patterns and int32 (its own inverse): lets clamps use
// integer min/max. Float compares under the default -ftrapping-math block if-conversion, and a
// loop with them does not vectorise.
constexpr int32_t float_order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

// The exp kernels' shared core: n = round(xn / ln2) (xn: x clamped to a range where the
// conversion is defined), r = x - n ln2 in two parts, and e^r by a degree-6 polynomial (Cephes
// expf coefficients); returns e^r and sets ni = n. The caller applies 2^n.
FLASHKDA_INLINE float exp_reduced(float xn, float x, int32_t& ni) {
  ni = int32_t(xn * 1.44269504088896341f + 256.5f) - 256;  // round(xn / ln2); argument > 0 for xn > -177
  const float n = float(ni);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// e^x for the engine's channel loops, written so the compiler vectorises it. float: exp_reduced's range
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
  int32_t ni;
  const float y = exp_reduced(x, x, ni);
  const int32_t n1 = ni >> 1, n2 = ni - n1;  // each in [-75, 64]: 2^n1 and 2^n2 are normal floats
  const float e = y * __builtin_bit_cast(float, (n1 + 127) << 23) * __builtin_bit_cast(float, (n2 + 127) << 23);
  int32_t out = __builtin_bit_cast(int32_t, e);
  out = (out & ~over_mask) | (0x7f800000 & over_mask);         // +inf
  out = (out & ~nan_mask) | ((bits | 0x00400000) & nan_mask);  // the input NaN, quiet
  return __builtin_bit_cast(float, out);
}

// e^x for |x| <= kMaxFactorisedShift (80) or NaN, the shifted factors' exponent: the same range
// reduction and polynomial as engine_exp (the same bits for every such x), without its overflow and
// NaN masks and with 2^n in one factor (e^{±80} and every 2^n on the way are normal floats). x is
// clamped only where n is formed (no float-to-int conversion of a NaN), so a NaN reaches r and the
// result.
FLASHKDA_INLINE double engine_exp_shift(double x) { return std::exp(x); }
FLASHKDA_INLINE float engine_exp_shift(float x) {
  constexpr int32_t kLo = float_order_key(__builtin_bit_cast(int32_t, -88.0f));
  constexpr int32_t kHi = float_order_key(__builtin_bit_cast(int32_t, 88.0f));
  const int32_t key = std::min(std::max(float_order_key(__builtin_bit_cast(int32_t, x)), kLo), kHi);
  const float xc = __builtin_bit_cast(float, float_order_key(key));
  int32_t ni;
  const float y = exp_reduced(xc, x, ni);
  return y * __builtin_bit_cast(float, (ni + 127) << 23);
}

// The engine's elementary functions for the lower-bound gate (gate.h via host::HeadGate::row):
// the vectorisable exp above and true division.
template <typename T>
struct EngineMath {
  FLASHKDA_INLINE static T exp(T x) { return engine_exp(x); }
  FLASHKDA_INLINE static T quot(T a, T b) { return a / b; }
};

// Per-thread scratch for one 16-token chunk of one head. Channel arrays have stride Kp (K rounded
// up to kLane) and value arrays stride Vp (V rounded up to kLane, plus one panel: a state row of
// 128 fp32 is 512 bytes, so a panel's 128 rows would fall in 8 of a 32 KB 8-way L1's 64 sets and
// evict each other between the products' passes; padded, in all of them: 1.03-1.04x on a 2-core
// Zen 3, nine alternating pairs, 2026-12-04). The padding holds zeros that never change the result.
// Rows of a partial chunk past its end are zeroed (k_decayed, q_decayed, k_restored, b).
// Cache-line-aligned storage for the scratch arrays: rows of a 64-byte multiple stride (the state's
// Vp = 144 floats) then start on a line, so no 32-byte load or store of a panel row straddles two
// lines (std::vector's 16-byte alignment put every row of the state at one offset, often a
// straddling one). Measured on a 2-core Zen 3 VM, one thread, T=4096 H=4: 0.968x the whole
// process's time (eleven alternating pairs, 0.942-0.994), 2026-12-04.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

template <typename T>
struct ChunkScratch {
  int64_t K, Kp, V, Vp;
  LineVector<T> q, k, v, gate_a;    // [C, Kp] ([C, Vp] for v): preprocessed rows, log-decay a
  // [C, Kp]: G in double. With precomputed or softplus gates |G| reaches thousands within a chunk;
  // G rounded to float there is off by ~1e-3 in absolute terms, and e^{G_i - G_j} with it by the
  // same relative amount although G_i - G_j may be small. Exponents are differences of these.
  LineVector<double> G64;
  LineVector<T> kq_decayed;         // [2C, Kp]: row i = k_decayed_i, row C + i = q_decayed_i
  LineVector<T> k_restored;         // [C, Kp]: k_i * e^{Γ - G_i}
  LineVector<T> decay_total;        // [Kp]: e^Γ
  LineVector<double> mid;           // [Kp]: per-channel shift (G_first + G_last) / 2
  LineVector<T> decay_mid;          // [Kp]: e^{Γ - mid}
  LineVector<T> e_mid;              // [Kp]: e^{mid} (shifted chunks with every mid >= -80)
  LineVector<T> e_row;              // [Kp]: e^{G_i} of the row being built
  LineVector<T> k_decayed_s, q_decayed_s, k_inv_s;  // [C, Kp]: shifted factors
  LineVector<T> o;                  // [C, Vp]
  LineVector<T> states;             // [kHeadGroup][Kp, Vp]: the states of a head group, transposed
  T* St = nullptr;                   // [Kp, Vp]: the state of the head being stepped (channel-major)
  T b[C];
  T L[C * C];
  T Mqk[C * C];
  // Per chunk, shared by every panel (chunk_solve_factors): A = (I + L)^{-1} diag(b) and
  // W = Mqk A, both lower-triangular, rows and columns [0, n).
  alignas(32) T A[C * C];
  alignas(32) T W[C * C];

  ChunkScratch(int64_t K_, int64_t V_)
      : K(K_), Kp((K_ + kLane - 1) / kLane * kLane), V(V_), Vp((V_ + kLane - 1) / kLane * kLane + kLane),
        q(C * Kp, T(0)), k(C * Kp, T(0)), v(C * Vp, T(0)), gate_a(C * Kp, T(0)), G64(C * Kp, 0.0),
        kq_decayed(2 * C * Kp, T(0)), k_restored(C * Kp, T(0)), decay_total(Kp, T(1)), mid(Kp, 0.0),
        decay_mid(Kp, T(0)), e_mid(Kp, T(0)), e_row(Kp), k_decayed_s(C * Kp), q_decayed_s(C * Kp),
        k_inv_s(C * Kp), o(C * Vp), states(kHeadGroup * Kp * Vp, T(0)), St(states.data()) {}
  ChunkScratch(const ChunkScratch&) = delete;
  ChunkScratch& operator=(const ChunkScratch&) = delete;
  T* state_of(int j) { return states.data() + j * Kp * Vp; }
};

// Asks for rows [tok0, tok0 + n) of head h of q, k, v and g in the cache (n <= 0: nothing), one
// prefetch per 64-byte line.
FLASHKDA_INLINE void prefetch_chunk(const PrefillParams& p, int64_t h, int64_t tok0, int64_t n, int64_t K, int64_t V) {
  const int64_t H = p.H;
  const auto rows = [&](const void* base, size_t elem, int64_t width) {
    const char* b = static_cast<const char*>(base);
    for (int64_t i = 0; i < n; ++i) {
      const char* row = b + ((tok0 + i) * H + h) * width * int64_t(elem);
      const char* first = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63));
      for (const char* line = first; line < row + width * int64_t(elem); line += 64) __builtin_prefetch(line, 0, 3);
    }
  };
  const size_t e = p.dtype == DType::kBF16 ? 2 : 4;
  rows(p.q, e, K), rows(p.k, e, K), rows(p.v, e, V);
  rows(p.g, p.g_dtype == DType::kBF16 ? 2 : 4, K);
}

#ifdef FLASHKDA_X86_DISPATCH
// host::l2_normalize of rows [0, n) of x (stride Kp) on AVX2 vectors, eight rows at once: their
// sums of squares as eight independent chains (over all Kp channels: the padding holds zeros) and
// one lane_sums tree, where each row alone ends in a chain of 16 dependent adds. Only channels
// [0, K) are scaled: a NaN row's 1/norm would turn the padding's zeros into NaN, which no later
// load rewrites (the scratch outlives the call).
FLASHKDA_TARGET_AVX2 inline void l2_normalize_rows_avx2(float* x, int64_t K, int64_t Kp, int n) {
  for (int i0 = 0; i0 < n; i0 += 8) {
    const int rows = std::min(8, n - i0);
    float* x0 = x + i0 * Kp;
    __m256 sq[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) sq[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < Kp; c += 8)
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        if (r >= rows) break;
        const __m256 v = _mm256_loadu_ps(x0 + r * Kp + c);
        sq[r] = _mm256_fmadd_ps(v, v, sq[r]);
      }
    alignas(32) float inv[8];
    const __m256 sums = _mm256_add_ps(avx2::lane_sums(sq), _mm256_set1_ps(1e-6f));
    _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(sums)));
    for (int r = 0; r < rows; ++r) {
      float* xr = x0 + r * Kp;
      const __m256 s = _mm256_set1_ps(inv[r]);
      int64_t c = 0;
      for (; c + 8 <= K; c += 8) _mm256_storeu_ps(xr + c, _mm256_mul_ps(s, _mm256_loadu_ps(xr + c)));
      for (; c < K; ++c) xr[c] *= inv[r];
    }
  }
}
#endif

// Rows [tok0, tok0 + n) of head h, preprocessed; gate_a holds the log-decay a (G64 its prefix sums).
// Every row is loaded first, then normalised and gated: the loads of all 64 rows are then in
// flight together (~0.99x the call against one row at a time).
template <typename T, int kTiles>
FLASHKDA_INLINE void load_chunk(const PrefillParams& p, int64_t h, int64_t tok0, int n,
                                const host::HeadGate<T>& gate, ChunkScratch<T>& s) {
  const int64_t H = p.H, K = s.K, Kp = s.Kp, V = s.V;
  for (int i = 0; i < n; ++i) {
    const int64_t row = (tok0 + i) * H + h;
    host::load_row(p.q, p.dtype, row * K, K, &s.q[i * Kp]);
    host::load_row(p.k, p.dtype, row * K, K, &s.k[i * Kp]);
    host::load_row(p.v, p.dtype, row * V, V, &s.v[i * s.Vp]);
    host::load_row(p.g, p.g_dtype, row * K, K, &s.gate_a[i * Kp]);
    s.b[i] = host::beta_activation(p.pre, host::load<T>(p.beta, p.beta_dtype, row));
  }
  if (p.pre.l2norm_qk) {
#ifdef FLASHKDA_X86_DISPATCH
    if constexpr (kTiles != kIsaBaseline && std::is_same_v<T, float>) {
      l2_normalize_rows_avx2(s.q.data(), K, Kp, n);
      l2_normalize_rows_avx2(s.k.data(), K, Kp, n);
    } else
#endif
      for (int i = 0; i < n; ++i) {
        host::l2_normalize(&s.q[i * Kp], K);
        host::l2_normalize(&s.k[i * Kp], K);
      }
  }
  for (int i = 0; i < n; ++i) {
    T* ai = &s.gate_a[i * Kp];
#ifdef FLASHKDA_X86_DISPATCH
    if constexpr (kTiles != kIsaBaseline && std::is_same_v<T, float>) {
      if (avx2::gate_row<EngineMath<float>>(gate, ai, K)) continue;
    }
#endif
    gate.template row<EngineMath<T>>(ai, ai, K);
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

#ifdef FLASHKDA_X86_DISPATCH
// build_shifted on AVX2 register tiles: row i against key rows j0 .. j0 + 3 at once, 8 accumulators
// (4 of L, 4 of Mqk) and 6 loads per 8 FMAs where dot2 has 3 per 2, then all 8 lane sums by one
// tree (vec_avx2.h lane_sums) where dot2 adds 16 partial sums in a chain. Rows j > i of a block
// are computed and dropped (so are those past a partial chunk's end, which hold stale factors).
FLASHKDA_TARGET_AVX2 inline void build_shifted_avx2(ChunkScratch<float>& s, int n, float scale) {
  const int64_t Kp = s.Kp;
  for (int i = 0; i < n; ++i) {
    const float* kds = &s.k_decayed_s[i * Kp];
    const float* qds = &s.q_decayed_s[i * Kp];
    for (int j0 = 0; j0 <= i; j0 += 4) {
      const float* kis = &s.k_inv_s[j0 * Kp];
      __m256 acc[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t c = 0; c < Kp; c += 8) {
        const __m256 kd = _mm256_loadu_ps(kds + c), qd = _mm256_loadu_ps(qds + c);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const __m256 x = _mm256_loadu_ps(kis + r * Kp + c);
          acc[r] = _mm256_fmadd_ps(kd, x, acc[r]);
          acc[4 + r] = _mm256_fmadd_ps(qd, x, acc[4 + r]);
        }
      }
      alignas(32) float sums[8];
      _mm256_store_ps(sums, avx2::lane_sums(acc));
      for (int r = 0; r < 4 && j0 + r <= i; ++r) {
        if (j0 + r < i) s.L[i * C + j0 + r] = s.b[i] * sums[r];
        s.Mqk[i * C + j0 + r] = scale * sums[4 + r];
      }
    }
  }
}

// One row's pointers for shifted_cols_avx2, each at the row's channel 0.
struct ShiftedRow {
  const double *G, *mid;
  const float *k, *q, *decay_mid, *e_mid;
  float *kds, *qds, *kis, *kr, *kd, *qd;
};

// Channels [c, c + 8N) of one row of build_chunk_matrices' shifted path where every e^{mid} is
// normal: the shifted factors (k_decayed_s, q_decayed_s, k_inv_s), k_restored and the decayed key
// and query (e^{G} = e^{G - mid} e^{mid}) on N AVX2 vectors side by side (padding channels hold
// k = q = G = mid = 0 and come out 0). G - mid is formed in double and rounded once, as in the
// generic loop.
template <int N>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void shifted_cols_avx2(const ShiftedRow& r, int64_t c,
                                                                                  __m256 scale) {
  __m256 up[N];
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const int64_t cj = c + 8 * j;
    const __m128 d0 = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_loadu_pd(r.G + cj), _mm256_loadu_pd(r.mid + cj)));
    const __m128 d1 = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_loadu_pd(r.G + cj + 4), _mm256_loadu_pd(r.mid + cj + 4)));
    up[j] = _mm256_set_m128(d1, d0);
  }
  avx2::exp_shift<N>(up);
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const int64_t cj = c + 8 * j;
    const __m256 down = _mm256_div_ps(_mm256_set1_ps(1.0f), up[j]);
    const __m256 k = _mm256_loadu_ps(r.k + cj), q = _mm256_loadu_ps(r.q + cj);
    _mm256_storeu_ps(r.kds + cj, _mm256_mul_ps(k, up[j]));
    _mm256_storeu_ps(r.qds + cj, _mm256_mul_ps(q, up[j]));
    _mm256_storeu_ps(r.kis + cj, _mm256_mul_ps(k, down));
    _mm256_storeu_ps(r.kr + cj, _mm256_mul_ps(k, _mm256_mul_ps(_mm256_loadu_ps(r.decay_mid + cj), down)));
    const __m256 e = _mm256_mul_ps(up[j], _mm256_loadu_ps(r.e_mid + cj));
    _mm256_storeu_ps(r.kd + cj, _mm256_mul_ps(k, e));
    _mm256_storeu_ps(r.qd + cj, _mm256_mul_ps(_mm256_mul_ps(scale, q), e));
  }
}

// One row of it over all Kp channels (a multiple of 16), four vectors a step (18.5 TSC cycles a
// vector against one a step's 22.5, its data in L1; its six stores a vector, 48 KB a chunk, bound it).
FLASHKDA_TARGET_AVX2 inline void shifted_row_avx2(ChunkScratch<float>& s, int i, float scale) {
  const int64_t Kp = s.Kp, at = i * Kp;
  const ShiftedRow r{&s.G64[at], s.mid.data(), &s.k[at], &s.q[at], s.decay_mid.data(), s.e_mid.data(),
                     &s.k_decayed_s[at], &s.q_decayed_s[at], &s.k_inv_s[at], &s.k_restored[at],
                     &s.kq_decayed[at], &s.kq_decayed[C * Kp + at]};
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t c = 0;
  for (; c + 32 <= Kp; c += 32) shifted_cols_avx2<4>(r, c, sc);
  for (; c < Kp; c += 16) shifted_cols_avx2<2>(r, c, sc);
}
#endif

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

// The chunk's per-channel scan: G (the prefix sums of the log-decay, in double), mid, e^Γ,
// e^{Γ - mid}; whether the largest |G - mid| allows the shifted factors (shifted) and whether every
// e^{mid} is then a normal float (mid_normal; e_mid holds them).
template <typename T>
FLASHKDA_INLINE void scan_chunk(ChunkScratch<T>& s, int n, bool& shifted, bool& mid_normal) {
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
  // The largest |G - mid| over the chunk, in kLane partial maxima (std::max and std::abs on
  // doubles stop the vectoriser). NaN compares false and does not raise it: a NaN gate then takes
  // the shifted path, whose exponentials carry the NaN through.
  double part[kLane] = {};
  for (int i = 0; i < n; ++i) {
    const double* Gi = &G[i * Kp];
    for (int64_t c0 = 0; c0 < Kp; c0 += kLane) {
#pragma omp simd
      for (int w = 0; w < kLane; ++w) {
        const double d = Gi[c0 + w] - s.mid[c0 + w];
        const double ad = d < 0.0 ? -d : d;
        part[w] = part[w] > ad ? part[w] : ad;
      }
    }
  }
  double max_shift = 0.0;
  for (int w = 0; w < kLane; ++w) max_shift = part[w] > max_shift ? part[w] : max_shift;
  shifted = max_shift <= kMaxFactorisedShift;
  // On the shifted path e^{G} = e^{G - mid} e^{mid}, one exponential per element fewer, where every
  // e^{mid} is a normal float (mid >= -80: the product then differs from e^{G} by a rounding);
  // below that e^{G} is formed directly (NaN compares false here and keeps the direct form).
  mid_normal = shifted;
  for (int64_t c = 0; c < K && mid_normal; ++c) mid_normal = s.mid[c] >= -80.0;
  if (mid_normal) {
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) s.e_mid[c] = engine_exp(T(s.mid[c]));
  }
}

#ifdef FLASHKDA_X86_DISPATCH
// scan_chunk on AVX2 vectors over all Kp channels (a multiple of 16; padding channels: a = 0, so
// G = mid = 0), 16 channels a step: each channel's running sum stays in a register (the generic
// loop reloads the row it just stored), four chains of dependent adds side by side (one at a time
// ran at their latency: 0.66x the scan's time), and the largest |G - mid| is a max that skips NaN (x86's max returns its
// second operand, the running maximum, when the other is NaN), so a NaN gate never raises it.
FLASHKDA_TARGET_AVX2 inline void scan_chunk_avx2(ChunkScratch<float>& s, int n, bool& shifted, bool& mid_normal) {
  constexpr int kCols = 4;  // vectors of 4 doubles a step
  const int64_t Kp = s.Kp;
  const float* a = s.gate_a.data();
  double* G = s.G64.data();
  const __m256d abs_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
  __m256d max_shift[kCols], low_mid = _mm256_setzero_pd();  // low_mid: lanes where some mid < -80 or NaN
  for (int j = 0; j < kCols; ++j) max_shift[j] = _mm256_setzero_pd();
  for (int64_t c = 0; c < Kp; c += 4 * kCols) {
    __m256d g[kCols], mid[kCols];
#pragma GCC unroll 4
    for (int j = 0; j < kCols; ++j) g[j] = _mm256_cvtps_pd(_mm_loadu_ps(a + c + 4 * j)), _mm256_storeu_pd(G + c + 4 * j, g[j]);
    for (int i = 1; i < n; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < kCols; ++j) {
        g[j] = _mm256_add_pd(g[j], _mm256_cvtps_pd(_mm_loadu_ps(a + i * Kp + c + 4 * j)));
        _mm256_storeu_pd(G + i * Kp + c + 4 * j, g[j]);
      }
#pragma GCC unroll 4
    for (int j = 0; j < kCols; ++j) {
      mid[j] = _mm256_mul_pd(_mm256_add_pd(_mm256_loadu_pd(G + c + 4 * j), g[j]), _mm256_set1_pd(0.5));
      _mm256_storeu_pd(&s.mid[c + 4 * j], mid[j]);
      low_mid = _mm256_or_pd(low_mid, _mm256_cmp_pd(mid[j], _mm256_set1_pd(-80.0), _CMP_NGE_UQ));
    }
    for (int i = 0; i < n; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < kCols; ++j) {
        const __m256d d = _mm256_and_pd(_mm256_sub_pd(_mm256_loadu_pd(G + i * Kp + c + 4 * j), mid[j]), abs_mask);
        max_shift[j] = _mm256_max_pd(d, max_shift[j]);
      }
  }
  // e^Γ and e^{Γ - mid}, 8 channels a step, the two exponentials side by side
  for (int64_t c = 0; c < Kp; c += 8) {
    const double* gamma = &G[(n - 1) * Kp + c];
    __m256 e[2] = {_mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(gamma + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(gamma))),
                   _mm256_set_m128(
                       _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_loadu_pd(gamma + 4), _mm256_loadu_pd(&s.mid[c + 4]))),
                       _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_loadu_pd(gamma), _mm256_loadu_pd(&s.mid[c]))))};
    avx2::exp<2>(e);
    _mm256_storeu_ps(&s.decay_total[c], e[0]);
    _mm256_storeu_ps(&s.decay_mid[c], e[1]);
  }
  alignas(32) double m[4];
  _mm256_store_pd(m, _mm256_max_pd(_mm256_max_pd(max_shift[0], max_shift[1]), _mm256_max_pd(max_shift[2], max_shift[3])));
  shifted = std::max(std::max(m[0], m[1]), std::max(m[2], m[3])) <= kMaxFactorisedShift;
  mid_normal = shifted && _mm256_movemask_pd(low_mid) == 0;
  if (!mid_normal) return;
  for (int64_t c = 0; c < Kp; c += 16) {
    __m256 e[2];
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j)
      e[j] = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(&s.mid[c + 8 * j + 4])), _mm256_cvtpd_ps(_mm256_loadu_pd(&s.mid[c + 8 * j])));
    avx2::exp<2>(e);
    _mm256_storeu_ps(&s.e_mid[c], e[0]), _mm256_storeu_ps(&s.e_mid[c + 8], e[1]);
  }
}
#endif

// G, the decayed/restored keys and queries, L and Mqk for the n valid rows of a chunk.
template <typename T, int kTiles>
FLASHKDA_INLINE void build_chunk_matrices(ChunkScratch<T>& s, int n, T scale) {
  const int64_t K = s.K, Kp = s.Kp;
  bool shifted, mid_normal;
#ifdef FLASHKDA_X86_DISPATCH
  if constexpr (kTiles != kIsaBaseline && std::is_same_v<T, float>) scan_chunk_avx2(s, n, shifted, mid_normal); else
#endif
  scan_chunk(s, n, shifted, mid_normal);
  const double* G = s.G64.data();
  const double* gamma = &G[(n - 1) * Kp];

  // Rows past the sequence end (a partial last chunk) read as k = q = b = 0: nothing of theirs
  // enters U, the outputs or the state.
  if (n < C) {
    std::fill(s.kq_decayed.begin() + n * Kp, s.kq_decayed.begin() + C * Kp, T(0));
    std::fill(s.kq_decayed.begin() + (C + n) * Kp, s.kq_decayed.end(), T(0));
    std::fill(s.k_restored.begin() + n * Kp, s.k_restored.end(), T(0));
    std::fill(s.b + n, s.b + C, T(0));
  }
  for (int i = 0; i < n; ++i) {
    const T* qi = &s.q[i * Kp];
    const T* ki = &s.k[i * Kp];
    const double* Gi = &G[i * Kp];
    T* e = s.e_row.data();
    T* kr = &s.k_restored[i * Kp];
    T* kd = &s.kq_decayed[i * Kp];
    T* qd = &s.kq_decayed[(C + i) * Kp];
#ifdef FLASHKDA_X86_DISPATCH
    if constexpr (kTiles != kIsaBaseline && std::is_same_v<T, float>) {
      if (mid_normal) {
        shifted_row_avx2(s, i, scale);
        continue;
      }
    }
#endif
    if (shifted) {
      // |G - mid| <= kMaxFactorisedShift: up and 1/up are finite, and e^{Γ - G} = e^{Γ - mid} e^{mid - G}
      // is a product of two finite factors (Γ - mid lies within the same bound).
      T* kds = &s.k_decayed_s[i * Kp];
      T* qds = &s.q_decayed_s[i * Kp];
      T* kis = &s.k_inv_s[i * Kp];
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) {
        const T up = engine_exp_shift(T(Gi[c] - s.mid[c]));
        const T down = T(1) / up;
        kds[c] = ki[c] * up;
        qds[c] = qi[c] * up;
        kis[c] = ki[c] * down;
        kr[c] = ki[c] * (s.decay_mid[c] * down);
        e[c] = up * s.e_mid[c];  // replaced below unless mid_normal
      }
      for (int64_t c = K; c < Kp; ++c) kds[c] = qds[c] = kis[c] = T(0);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) kr[c] = ki[c] * engine_exp(T(gamma[c] - Gi[c]));
    }
    if (!mid_normal) {
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) e[c] = engine_exp(T(Gi[c]));  // <= 1; underflow to 0 is harmless
    }
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) {
      kd[c] = ki[c] * e[c];
      qd[c] = scale * qi[c] * e[c];
    }
  }

  std::fill(s.L, s.L + C * C, T(0));
  std::fill(s.Mqk, s.Mqk + C * C, T(0));
  if (shifted) {
#ifdef FLASHKDA_X86_DISPATCH
    if constexpr (kTiles != kIsaBaseline && std::is_same_v<T, float>) return build_shifted_avx2(s, n, scale);
#endif
    build_shifted(s, n, scale);
  } else {
    build_pairwise(s, n, scale);
  }
}

// One kTileRows x kPanel register tile: acc[r][w] (+)= sum over `depth` of a[r * lda + d] * b[d * ldb + w].
template <typename T>
FLASHKDA_INLINE void tile_accumulate(T (&acc)[kTileRows][kPanel], const T* a, int64_t lda, const T* b, int64_t ldb,
                                     int64_t depth) {
  for (int64_t d = 0; d < depth; ++d) {
    const T* bd = b + d * ldb;
    for (int r = 0; r < kTileRows; ++r) {
      const T x = a[r * lda + d];
#pragma omp simd
      for (int w = 0; w < kPanel; ++w) acc[r][w] += x * bd[w];
    }
  }
}

// R = [k_decayed; q_decayed] S^T[:, panel] (2C x K times K x kPanel), rows past a partial chunk's
// end skipped; generic version (any T, any ISA the compiler vectorises for).
template <typename T>
FLASHKDA_INLINE void panel_reads(const ChunkScratch<T>& s, int n, const T* St, T (&R)[2 * C][kPanel]) {
  const int64_t Kp = s.Kp, Vp = s.Vp;
  for (int m0 = 0; m0 < 2 * C; m0 += kTileRows) {
    if (m0 < C ? m0 >= n : m0 - C >= n) continue;  // rows past a partial chunk's end: unused
    T acc[kTileRows][kPanel] = {};
    tile_accumulate(acc, &s.kq_decayed[m0 * Kp], Kp, St, Vp, Kp);
    for (int r = 0; r < kTileRows; ++r)
#pragma omp simd
      for (int w = 0; w < kPanel; ++w) R[m0 + r][w] = acc[r][w];
  }
}

// S^T[:, panel] <- e^Γ ⊙ S^T[:, panel] + k_restored^T U (K x C times C x kPanel), tiles of
// kTileRows channels with depth n tokens; generic version.
template <typename T>
FLASHKDA_INLINE void panel_update(const ChunkScratch<T>& s, int n, T* St, const T (&U)[C][kPanel]) {
  const int64_t Kp = s.Kp, Vp = s.Vp;
  const T* dt = s.decay_total.data();
  for (int64_t c0 = 0; c0 < Kp; c0 += kTileRows) {
    T acc[kTileRows][kPanel];
    for (int r = 0; r < kTileRows; ++r)
#pragma omp simd
      for (int w = 0; w < kPanel; ++w) acc[r][w] = dt[c0 + r] * St[(c0 + r) * Vp + w];
    for (int i = 0; i < n; ++i) {
      const T* kr = &s.k_restored[i * Kp + c0];
      for (int r = 0; r < kTileRows; ++r) {
        const T x = kr[r];
#pragma omp simd
        for (int w = 0; w < kPanel; ++w) acc[r][w] += x * U[i][w];
      }
    }
    for (int r = 0; r < kTileRows; ++r)
#pragma omp simd
      for (int w = 0; w < kPanel; ++w) St[(c0 + r) * Vp + w] = acc[r][w];
  }
}

// The chunk's solve, once for all its panels: X = (I + L)^{-1} by forward substitution on the
// identity (16 right-hand sides at once, as the panels solved theirs; exact for unit
// lower-triangular L and stable for near-collinear keys: test_chunk_form's InverseSolve),
// A = X diag(b) and W = Mqk A. A panel then takes U = A d and O = R_q + W d with d = v - R_k:
// two small products on register tiles instead of a forward substitution and a triangular
// product per panel, each a chain of dependent FMAs (~14% of the engine's time, perf, 2026-12-04).
// Row i of A and W depends on rows <= i only, so a token's output still depends on no later token.
template <typename T>
FLASHKDA_INLINE void chunk_solve_factors(ChunkScratch<T>& s, int n) {
  alignas(32) T X[C][C];
  for (int i = 0; i < C; ++i)
#pragma omp simd
    for (int j = 0; j < C; ++j) X[i][j] = T(i == j ? 1 : 0);
  solve_unit_lower<T, C>(s.L, &X[0][0], n);
  for (int i = 0; i < n; ++i)
#pragma omp simd
    for (int l = 0; l < C; ++l) s.A[i * C + l] = X[i][l] * s.b[l];
  for (int i = 0; i < n; ++i) {
    T w[C] = {};
    for (int m = 0; m <= i; ++m) {
      const T mq = s.Mqk[i * C + m];
#pragma omp simd
      for (int l = 0; l < C; ++l) w[l] += mq * s.A[m * C + l];
    }
#pragma omp simd
    for (int l = 0; l < C; ++l) s.W[i * C + l] = w[l];
  }
}

// U = A d and o = R_q + W d for the panel's rows [0, n) (A, W lower-triangular: row i sums over
// l <= i); o goes to s.o at columns v0 ..; generic version.
template <typename T>
FLASHKDA_INLINE void panel_solve_output(ChunkScratch<T>& s, int n, int64_t v0, const T (&D)[C][kPanel],
                                        const T (&R)[2 * C][kPanel], T (&U)[C][kPanel]) {
  for (int i = 0; i < n; ++i) {
    T u[kPanel] = {}, o[kPanel];
#pragma omp simd
    for (int w = 0; w < kPanel; ++w) o[w] = R[C + i][w];
    for (int l = 0; l <= i; ++l) {
      const T a = s.A[i * C + l], m = s.W[i * C + l];
#pragma omp simd
      for (int w = 0; w < kPanel; ++w) u[w] += a * D[l][w], o[w] += m * D[l][w];
    }
#pragma omp simd
    for (int w = 0; w < kPanel; ++w) U[i][w] = u[w], s.o[i * s.Vp + v0 + w] = o[w];
  }
}

#ifdef FLASHKDA_X86_DISPATCH
// The same two products with AVX2 intrinsics are avx2::panel_reads and avx2::panel_update
// (vec_avx2.h, on avx2::tile): the compiler keeps the generic versions' accumulators in memory when
// it turns their final copies into memcpy (measured: 0.4 FMA per cycle in the update).

// One depth step l of solve_output_rows_avx2 for rows r >= r_first (A, W: column l of the tile's rows).
template <int kRows>
FLASHKDA_TARGET_AVX2 inline __attribute__((always_inline)) void solve_output_step_avx2(
    const float* A, const float* W, const float* d, int r_first, __m256 (&ul)[kRows], __m256 (&uh)[kRows],
    __m256 (&ol)[kRows], __m256 (&oh)[kRows]) {
  const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
#pragma GCC unroll 8
  for (int r = r_first; r < kRows; ++r) {
    const __m256 a = _mm256_broadcast_ss(A + r * C), m = _mm256_broadcast_ss(W + r * C);
    ul[r] = _mm256_fmadd_ps(a, d0, ul[r]), uh[r] = _mm256_fmadd_ps(a, d1, uh[r]);
    ol[r] = _mm256_fmadd_ps(m, d0, ol[r]), oh[r] = _mm256_fmadd_ps(m, d1, oh[r]);
  }
}

// panel_solve_output on AVX2 register tiles: kRows rows of U and of o (4 ymm a row: 12
// accumulators at 3 rows), the full depth l < i0 for every row, then the triangle row by row;
// each step 2 loads of d_l and 2 kRows broadcasts for 4 kRows FMAs. The AVX-512 build runs it too
// (the same bits in both).
template <int kRows>
FLASHKDA_TARGET_AVX2 inline void solve_output_rows_avx2(ChunkScratch<float>& s, int i0, int64_t v0,
                                                        const float (&D)[C][kPanel],
                                                        const float (&R)[2 * C][kPanel], float (&U)[C][kPanel]) {
  __m256 ul[kRows], uh[kRows], ol[kRows], oh[kRows];
  const float* A = s.A + i0 * C;
  const float* W = s.W + i0 * C;
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    ul[r] = uh[r] = _mm256_setzero_ps();
    ol[r] = _mm256_loadu_ps(R[C + i0 + r]), oh[r] = _mm256_loadu_ps(R[C + i0 + r] + 8);
  }
  for (int l = 0; l < i0; ++l) solve_output_step_avx2<kRows>(A + l, W + l, D[l], 0, ul, uh, ol, oh);
#pragma GCC unroll 8
  for (int dl = 0; dl < kRows; ++dl) solve_output_step_avx2<kRows>(A + i0 + dl, W + i0 + dl, D[i0 + dl], dl, ul, uh, ol, oh);
  float* o = s.o.data() + v0;
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(U[i0 + r], ul[r]), _mm256_storeu_ps(U[i0 + r] + 8, uh[r]);
    _mm256_storeu_ps(o + (i0 + r) * s.Vp, ol[r]), _mm256_storeu_ps(o + (i0 + r) * s.Vp + 8, oh[r]);
  }
}

FLASHKDA_TARGET_AVX2 inline void panel_solve_output_avx2(ChunkScratch<float>& s, int n, int64_t v0,
                                                         const float (&D)[C][kPanel],
                                                         const float (&R)[2 * C][kPanel], float (&U)[C][kPanel]) {
  int i = 0;
  for (; i + 3 <= n; i += 3) solve_output_rows_avx2<3>(s, i, v0, D, R, U);
  for (; i < n; ++i) solve_output_rows_avx2<1>(s, i, v0, D, R, U);
}

// The same two products with AVX-512: one zmm holds a row's 16 panel columns, so a tile of kRows
// rows has kRows independent FMA chains (16 cover two 512-bit FMA pipes' latency) against one load
// and kRows broadcasts a step. Where the FMA units are 512 bits wide (AMD Zen 5, Intel server
// cores) this doubles the products' peak over the ymm tiles above; where a 512-bit FMA issues as
// two 256-bit halves (Zen 4) it only halves their instructions. Every output element is the same
// fma chain, in the same depth order, as in the AVX2 tiles, so the bits are the AVX2 build's.
// kLda > 0: the row stride a compile-time constant (then `lda` is unused), so the 16 rows' broadcasts
// are constant offsets from one pointer; a run-time stride took more address registers than the
// loop has and reloaded them from the stack every step (the constant: ~1% of the call, eleven
// alternating pairs at T=4096 H=2 and T=8192 H=16, 2026-12-03).
template <int kRows, int kLda = 0>
FLASHKDA_TARGET_AVX512 inline void tile_avx512(__m512 (&acc)[kRows], const float* a, int64_t lda, int64_t lda_d,
                                               const float* b, int64_t ldb, int64_t depth) {
  if constexpr (kLda > 0) lda = kLda;
#pragma GCC unroll 2
  for (int64_t d = 0; d < depth; ++d, a += lda_d, b += ldb) {
    const __m512 bd = _mm512_loadu_ps(b);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda]), bd, acc[r]);
  }
}

template <int kRows>
FLASHKDA_TARGET_AVX512 inline void reads_rows_avx512(const ChunkScratch<float>& s, const float* St, int m0,
                                                     float (&R)[2 * C][kPanel]) {
  __m512 acc[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  if (s.Kp == 128) tile_avx512<kRows, 128>(acc, &s.kq_decayed[m0 * s.Kp], s.Kp, 1, St, s.Vp, s.Kp);
  else tile_avx512<kRows>(acc, &s.kq_decayed[m0 * s.Kp], s.Kp, 1, St, s.Vp, s.Kp);
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(R[m0 + r], acc[r]);
}

FLASHKDA_TARGET_AVX512 inline void panel_reads_avx512(const ChunkScratch<float>& s, int n, const float* St,
                                                      float (&R)[2 * C][kPanel]) {
  for (const int base : {0, C}) {  // as avx2::panel_reads
    int m = 0;
    for (; m + 16 <= n; m += 16) reads_rows_avx512<16>(s, St, base + m, R);
    for (; m + 8 <= n; m += 8) reads_rows_avx512<8>(s, St, base + m, R);
    for (; m + 4 <= n; m += 4) reads_rows_avx512<4>(s, St, base + m, R);
    for (; m < n; ++m) reads_rows_avx512<1>(s, St, base + m, R);
  }
}

template <int kRows>
FLASHKDA_TARGET_AVX512 inline void update_rows_avx512(const ChunkScratch<float>& s, int n, float* St, int64_t c0,
                                                      const float (&U)[C][kPanel]) {
  const int64_t Vp = s.Vp;
  __m512 acc[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r)
    acc[r] = _mm512_mul_ps(_mm512_set1_ps(s.decay_total[c0 + r]), _mm512_loadu_ps(St + (c0 + r) * Vp));
  tile_avx512<kRows>(acc, &s.k_restored[c0], 1, s.Kp, &U[0][0], kPanel, n);
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(St + (c0 + r) * Vp, acc[r]);
}

FLASHKDA_TARGET_AVX512 inline void panel_update_avx512(const ChunkScratch<float>& s, int n, float* St,
                                                       const float (&U)[C][kPanel]) {
  for (int64_t c0 = 0; c0 < s.Kp; c0 += 16) update_rows_avx512<16>(s, n, St, c0, U);  // Kp: a multiple of 16
}
#endif

// Value columns v0 .. v0 + kPanel of one chunk (columns of S are independent given the chunk's
// factors), with the transposed state S^T [Kp, Vp]:
//   R = [k_decayed; q_decayed] S^T[:, panel]                       (2C x K times K x 16)
//   u_i = b_i (v_i - R_i),  U = (I + L)^{-1} u,  o_i = R_{C+i} + sum_{l<=i} Mqk[i,l] U_l
//   S^T[:, panel] <- e^Γ ⊙ S^T[:, panel] + k_restored^T U              (K x C times C x 16)
// Both products are sgemm-shaped: their register tiles run down the rows with the panel's 16
// columns as the vector dimension. kTiles: the two products' register tiles, kIsaAvx2 or kIsaAvx512
// for the intrinsics versions (float only), else the generic loops.
template <typename T, int kTiles>
FLASHKDA_INLINE void state_panel(ChunkScratch<T>& s, int n, int64_t v0) {
  const int64_t Vp = s.Vp;
  T* St = s.St + v0;
  alignas(32) T R[2 * C][kPanel];
#ifdef FLASHKDA_X86_DISPATCH
  if constexpr (kTiles == kIsaAvx512 && std::is_same_v<T, float>) panel_reads_avx512(s, n, St, R);
  else if constexpr (kTiles == kIsaAvx2 && std::is_same_v<T, float>)
    avx2::panel_reads<C>(s.kq_decayed.data(), s.Kp, St, Vp, n, &R[0][0]);
  else
#endif
    panel_reads(s, n, St, R);

  // d = v - R_k; U = (I + L)^{-1} diag(b) d = A d, o = qd . S + Mqk U = R_q + W d.
  alignas(32) T D[C][kPanel];
  alignas(32) T U[C][kPanel];
  for (int i = 0; i < n; ++i) {
#pragma omp simd
    for (int w = 0; w < kPanel; ++w) D[i][w] = s.v[i * Vp + v0 + w] - R[i][w];
  }
#ifdef FLASHKDA_X86_DISPATCH
  if constexpr ((kTiles == kIsaAvx512 || kTiles == kIsaAvx2) && std::is_same_v<T, float>)
    panel_solve_output_avx2(s, n, v0, D, R, U);
  else
#endif
    panel_solve_output(s, n, v0, D, R, U);

#ifdef FLASHKDA_X86_DISPATCH
  if constexpr (kTiles == kIsaAvx512 && std::is_same_v<T, float>) panel_update_avx512(s, n, St, U);
  else if constexpr (kTiles == kIsaAvx2 && std::is_same_v<T, float>)
    avx2::panel_update(s.k_restored.data(), s.decay_total.data(), s.Kp, &U[0][0], n, St, Vp);
  else
#endif
    panel_update(s, n, St, U);
}

// The rows the next step of a work item loads (its next head's, or its first head's next chunk),
// asked for while the state pass before it runs: a few rows after each panel, so they reach L1
// shortly before load_chunk reads them. Asked for a whole chunk ahead, before the pass, they had
// left L1 by then (the pass streams the 74 KB state through a 32 KB L1): the loads still drew ~7%
// of the engine's samples, and this spread 0.97-0.98x the call (nine alternating pairs at one
// thread, T=4096 H=4; five at two, T=8192 H=16; 2026-12-04).
struct NextRows {
  const PrefillParams* p = nullptr;
  int64_t h = 0, tok0 = 0, n = 0;  // rows [tok0, tok0 + n) of head h; n <= 0: none
};

// The panels [v_begin, v_end) of the state, one chunk; `next` prefetched along the way.
template <typename T, int kTiles>
FLASHKDA_INLINE void state_pass(ChunkScratch<T>& s, int n, int64_t v_begin, int64_t v_end, const NextRows& next) {
  chunk_solve_factors(s, n);
  const int64_t panels = (v_end - v_begin + kPanel - 1) / kPanel, per_panel = (next.n + panels - 1) / panels;
  for (int64_t v0 = v_begin, row = 0; v0 < v_end; v0 += kPanel, row += per_panel) {
    state_panel<T, kTiles>(s, n, v0);
    prefetch_chunk(*next.p, next.h, next.tok0 + row, std::min(per_panel, next.n - row), s.K, s.V);
  }
}

// dst[i * ldd + j] = src[j * lds + i] for i < rows, j < cols (the state between its tensors'
// [V, K] layout and the engine's transposed one), in 8 x 8 tiles: an element at a time down a
// column, every store or load went to another line (a 64 KB state in and out took ~2 chunks' time
// of its head; tiled, 0.49x the call of one chunk at H = 32).
template <typename T>
void transpose_block(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 8;
  for (int64_t i0 = 0; i0 < rows; i0 += kTile)
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t i1 = std::min(rows, i0 + kTile), j1 = std::min(cols, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = j0; j < j1; ++j) dst[i * ldd + j] = src[j * lds + i];
    }
}

#ifdef FLASHKDA_X86_DISPATCH
FLASHKDA_TARGET_AVX2 void transpose_block_avx2(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows,
                                               int64_t cols) {
  for (int64_t i0 = 0; i0 < rows; i0 += 8)
    for (int64_t j0 = 0; j0 < cols; j0 += 8) avx2::transpose8x8(dst + i0 * ldd + j0, ldd, src + j0 * lds + i0, lds);
}
#endif

// transpose_block on AVX2 8 x 8 blocks where the instruction set has them and both sizes are
// multiples of 8: the state in and out of every item, which short sequences pay per chunk or two
// (element by element, 256 sequences of 16 tokens at H = 16 ran at 55% of one long sequence's rate).
template <typename T>
void transpose_state(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t cols, int isa) {
#ifdef FLASHKDA_X86_DISPATCH
  if constexpr (std::is_same_v<T, float>) {
    if (isa >= kIsaAvx2 && rows % 8 == 0 && cols % 8 == 0) return transpose_block_avx2(dst, ldd, src, lds, rows, cols);
  }
#endif
  (void)isa;
  transpose_block(dst, ldd, src, lds, rows, cols);
}

// State (i, h) of a [., H, V, K] tensor where T is float and the tensor is fp32 and present, else null.
template <typename T>
const T* f32_state(const void* tensor, DType dtype, int64_t i, int64_t h, int64_t H, int64_t V, int64_t K) {
  if constexpr (std::is_same_v<T, float>) {
    if (tensor != nullptr && dtype == DType::kF32) return static_cast<const float*>(tensor) + (i * H + h) * V * K;
  }
  return nullptr;
}

// Where the checkpoints of one (sequence, head) go (PrefillParams::checkpoint_every): the state
// after each checkpoint_every tokens of the sequence, columns [v0, v1), numbered from `first`.
template <typename T>
struct CheckpointSink {
  const PrefillParams* p = nullptr;
  int64_t first = 0, h = 0, v0 = 0, v1 = 0;
  T* dense = nullptr;  // [num_checkpoints, H, V, K] in T instead of p->checkpoints, or null
  T* buf = nullptr;    // [V, K] scratch

  // Checkpoint j (0-based within the sequence) from the transposed state s.St.
  void save(const ChunkScratch<T>& s, int64_t j) const {
    const int64_t K = s.K, V = s.V, Vp = s.Vp, H = p->H;
    transpose_block(buf + v0 * K, K, s.St + v0, Vp, v1 - v0, K);
    const int64_t ck = first + j, count = (v1 - v0) * K;
    if (dense != nullptr) {
      std::copy(&buf[v0 * K], &buf[v1 * K], dense + ((ck * H + h) * V + v0) * K);
    } else if (p->checkpoints != nullptr) {
      host::store_row(p->checkpoints, p->checkpoint_dtype, ((ck * H + h) * V + v0) * K, count, &buf[v0 * K]);
    } else if (p->checkpoint_slots != nullptr && p->checkpoint_slots[ck] >= 0) {
      const int64_t slot = p->checkpoint_slots[ck];
      host::store_row(p->state_pool, p->state_pool_dtype, ((slot * H + h) * V + v0) * K, count, &buf[v0 * K]);
    }
  }
};

// The whole recurrence of sequence n, heads [h0, h0 + heads) (heads <= kHeadGroup), for value
// columns [v_begin, v_end) (whole panels, or up to V), with the transposed state of head h0 + j in
// s.state_of(j); chunk by chunk, the heads of a chunk one after another. Writes those columns of
// out (in T when out is non-null, else in p.dtype) and the checkpoints the sinks name (ck[j]: head
// h0 + j).
template <typename T, int kTiles>
FLASHKDA_INLINE void forward_sequence_heads(const PrefillParams& p, int64_t n, int64_t h0, int heads, T scale,
                                            ChunkScratch<T>& s, T* out, int64_t v_begin, int64_t v_end,
                                            const CheckpointSink<T>* ck) {
  const int64_t H = p.H, V = s.V, Vp = s.Vp;
  const int64_t width = std::min(v_end, V) - v_begin;
  const SeqRange r = detail::seq_range(p, n);
  for (int64_t tok0 = r.bos; tok0 < r.eos; tok0 += C) {
    const int len = int(std::min<int64_t>(C, r.eos - tok0));
    for (int j = 0; j < heads; ++j) {
      const int64_t h = h0 + j;
      s.St = s.state_of(j);
      load_chunk<T, kTiles>(p, h, tok0, len, host::HeadGate<T>(p.pre, h, s.K), s);
      build_chunk_matrices<T, kTiles>(s, len, scale);
      const NextRows next = j + 1 < heads ? NextRows{&p, h + 1, tok0, len}
                                          : NextRows{&p, h0, tok0 + C, std::min<int64_t>(C, r.eos - tok0 - C)};
      state_pass<T, kTiles>(s, len, v_begin, v_end, next);
      // every is a multiple of 64, so checkpoint positions fall on chunk ends (chunks start at bos)
      const int64_t done = tok0 + len - r.bos, every = p.checkpoint_every;
      if (every > 0 && done % every == 0) ck[j].save(s, done / every - 1);
      for (int i = 0; i < len; ++i) {
        const int64_t row = (tok0 + i) * H + h;
        if (out != nullptr) {
          std::copy(&s.o[i * Vp + v_begin], &s.o[i * Vp + v_begin] + width, out + row * V + v_begin);
        } else {
          host::store_row(p.out, p.dtype, row * V + v_begin, width, &s.o[i * Vp + v_begin]);
        }
      }
    }
  }
}

template <typename T>
void run_default(const PrefillParams& p, int64_t n, int64_t h0, int heads, T scale, ChunkScratch<T>& s, T* out,
                 int64_t v0, int64_t v1, const CheckpointSink<T>* ck) {
  forward_sequence_heads<T, kIsaBaseline>(p, n, h0, heads, scale, s, out, v0, v1, ck);
}

// The engine's entry points per instruction set (internal::PrefillLaunch::cpu_isa): the baseline
// ISA, AVX2 + FMA (the two state products as intrinsics microkernels, the rest vectorised by the
// compiler at 256 bits) and AVX-512 (zmm microkernels, the rest at 512 bits: half the
// instructions for the exponentials, the factors and the small products; the same bits as AVX2).
// Measured on 2-core AVX-512 VMs: 1.14-1.20x the AVX2 build with the ymm microkernels, more with
// the zmm ones where the FMA units are 512 bits wide (docs/DESIGN.md "The CPU backend").
#ifdef FLASHKDA_X86_DISPATCH
FLASHKDA_TARGET_AVX2 void run_avx2(const PrefillParams& p, int64_t n, int64_t h0, int heads,
                                   float scale, ChunkScratch<float>& s, float* out, int64_t v0,
                                   int64_t v1, const CheckpointSink<float>* ck) {
  forward_sequence_heads<float, kIsaAvx2>(p, n, h0, heads, scale, s, out, v0, v1, ck);
}
FLASHKDA_TARGET_AVX512 void run_avx512(
    const PrefillParams& p, int64_t n, int64_t h0, int heads, float scale, ChunkScratch<float>& s, float* out,
    int64_t v0, int64_t v1, const CheckpointSink<float>* ck) {
  forward_sequence_heads<float, kIsaAvx512>(p, n, h0, heads, scale, s, out, v0, v1, ck);
}
#endif

template <typename T>
void run_sequence_heads(const PrefillParams& p, int64_t n, int64_t h0, int heads, T scale, ChunkScratch<T>& s,
                        T* out, int64_t v0, int64_t v1, const CheckpointSink<T>* ck, int isa) {
#ifdef FLASHKDA_X86_DISPATCH
  if constexpr (std::is_same_v<T, float>) {
    if (isa == kIsaAvx512) return run_avx512(p, n, h0, heads, scale, s, out, v0, v1, ck);
    if (isa == kIsaAvx2) return run_avx2(p, n, h0, heads, scale, s, out, v0, v1, ck);
  }
#endif
  (void)isa;
  run_default(p, n, h0, heads, scale, s, out, v0, v1, ck);
}

// Zeros for a padding sequence (negative slot): its output rows and dense checkpoints, columns
// [v0, v1) of head h; buf holds at least V * K elements.
template <typename T>
void zero_padding(const PrefillParams& p, int64_t n, int64_t h, int64_t v0, int64_t v1, int64_t first_checkpoint,
                  T* out, T* checkpoints, std::vector<T>& buf) {
  const int64_t H = p.H, K = p.K, V = p.V;
  std::fill(buf.begin(), buf.end(), T(0));
  const SeqRange r = detail::seq_range(p, n);
  for (int64_t t = r.bos; t < r.eos; ++t) {
    const int64_t at = (t * H + h) * V + v0;
    if (out != nullptr) std::fill(out + at, out + at + (v1 - v0), T(0));
    else host::store_row(p.out, p.dtype, at, v1 - v0, buf.data());
  }
  if (p.checkpoint_every == 0) return;
  for (int64_t j = 0; j < r.len() / p.checkpoint_every; ++j) {
    const int64_t at = (((first_checkpoint + j) * H + h) * V + v0) * K;
    if (checkpoints != nullptr) std::fill(checkpoints + at, checkpoints + at + (v1 - v0) * K, T(0));
    else if (p.checkpoints != nullptr)
      host::store_row(p.checkpoints, p.checkpoint_dtype, at, (v1 - v0) * K, buf.data());
  }
}

// The per-thread scratch of chunk_forward, kept between calls (OpenMP's threads persist): a call
// allocates only when its thread meets a head size it has not served last. Reuse is safe as the
// padding of the loaded rows (q, k, v, the log-decay a: channels [K, Kp)) is never written and stays
// zero, and every other element the engine reads it rewrites before reading, within a call as
// across calls (the AVX2 paths write the factors' padding too, from those zeros: zeros again, or
// for G, mid and the e^{...} rows, values that only ever multiply a zero).
template <typename T>
struct ScratchSet {
  std::unique_ptr<ChunkScratch<T>> chunk;
  std::vector<T> state;  // [V, K]: one state in the tensors' v-first layout
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
void chunk_forward(const PrefillParams& p, T* out, T* final_state, T* checkpoints, int cpu_isa) {
  const int isa = engine_isa(cpu_isa);
  const int64_t N = detail::num_sequences(p);
  const int64_t H = p.H, K = p.K, V = p.V;
  const T scale = host::output_scale<T>(p.pre, K);
  if (N * H == 0) return;
  thread_local std::vector<int64_t> first_checkpoint;  // kept: steady-state calls allocate nothing
  if (p.checkpoint_every > 0) detail::first_checkpoints(p, first_checkpoint);
  const int64_t* first = first_checkpoint.data();
  // Work items: (sequence, group of up to kHeadGroup heads) while that leaves at least two items
  // per thread or an even split (smaller groups otherwise), and when there are fewer (sequence,
  // head) pairs than threads, (sequence, head, group of value panels) (columns of S evolve
  // independently given the chunk's factors, which each item computes for itself): parallelism
  // beyond (sequence, head) for one long sequence of few heads.
  const int64_t panels = (V + kPanel - 1) / kPanel;
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  // A group size is kept below two items a thread where its items are equal work that fills the
  // threads evenly (sequences of one length, groups of one size): one sequence of 4 heads on 2
  // threads runs as 2 items of 2 heads, not 4 of 1 (T=8192: 0.94x, seven alternating pairs' minima).
  const auto groups_fit = [&](int64_t hpi) {
    const int64_t items = N * ((H + hpi - 1) / hpi);
    return items >= 2 * int64_t(threads) || (p.cu_seqlens == nullptr && H % hpi == 0 && items % threads == 0);
  };
  int64_t heads_per_item = kHeadGroup;
  while (heads_per_item > 1 && !groups_fit(heads_per_item)) heads_per_item /= 2;
  const int64_t head_items = (H + heads_per_item - 1) / heads_per_item;
  const int64_t groups = N * H >= threads ? 1 : std::min<int64_t>(panels, (threads + N * H - 1) / (N * H));
  const int64_t per_group = (panels + groups - 1) / groups;

#pragma omp parallel
  {
    ScratchSet<T>& set = thread_scratch<T>(K, V);
    ChunkScratch<T>& s = *set.chunk;
    std::vector<T>& state = set.state;
    const int64_t Vp = s.Vp;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < N * head_items * groups; ++item) {
      const int64_t nh = item / groups, grp = item % groups;
      const int64_t n = nh / head_items, h0 = nh % head_items * heads_per_item;
      const int heads = int(std::min<int64_t>(heads_per_item, H - h0));
      const int64_t v0 = grp * per_group * kPanel, v1 = std::min(V, (grp + 1) * per_group * kPanel);
      if (v0 >= v1) continue;
      const int64_t first_n = p.checkpoint_every > 0 ? first[n] : 0;
      // The initial state: from the pool slot (zeros when has_initial_state says so; padding
      // reads and writes nothing), else from initial_state (zeros when null).
      const int32_t slot = p.state_pool != nullptr ? p.state_indices[n] : -1;
      if (p.state_pool != nullptr && slot < 0) {
        for (int j = 0; j < heads; ++j) zero_padding(p, n, h0 + j, v0, v1, first_n, out, checkpoints, state);
        continue;
      }
      CheckpointSink<T> ck[kHeadGroup];
      const detail::StateSource src = detail::initial_state_source(p, n);
      for (int j = 0; j < heads; ++j) {
        T* St = s.state_of(j);
        // straight from an fp32 tensor where it lies; zeros; or converted through `state`
        if (const T* direct = f32_state<T>(src.tensor, src.dtype, src.index, h0 + j, H, V, K)) {
          transpose_state(St + v0, Vp, direct + v0 * K, K, K, v1 - v0, isa);
        } else if (src.tensor == nullptr) {
          for (int64_t c = 0; c < K; ++c) std::fill(St + c * Vp + v0, St + c * Vp + v1, T(0));
        } else {
          detail::load_initial_state(p, n, h0 + j, state.data());
          transpose_state(St + v0, Vp, state.data() + v0 * K, K, K, v1 - v0, isa);
        }
        // The padding channels' rows [K, Kp) to zero: the update writes them (e^Γ = 1 times the row
        // plus k_restored = 0 times U), and a NaN in U leaves NaN there, which a later item of
        // this thread's scratch would read into every R (0 times NaN).
        std::fill(St + K * Vp, St + s.Kp * Vp, T(0));
        ck[j] = CheckpointSink<T>{&p, first_n, h0 + j, v0, v1, checkpoints, state.data()};
      }
      run_sequence_heads(p, n, h0, heads, scale, s, out, v0, v1, ck, isa);
      for (int j = 0; j < heads; ++j) {
        const int64_t h = h0 + j;
        const T* St = s.state_of(j);
        // the final state: straight into an fp32 destination, else converted through `state`
        T* direct = p.state_pool != nullptr ? const_cast<T*>(f32_state<T>(p.state_pool, p.state_pool_dtype, slot, h, H, V, K))
                    : final_state != nullptr ? final_state + (n * H + h) * V * K
                                             : const_cast<T*>(f32_state<T>(p.final_state, p.final_state_dtype, n, h, H, V, K));
        if (direct != nullptr) {
          transpose_state(direct + v0 * K, K, St + v0, Vp, v1 - v0, K, isa);
          continue;
        }
        if (p.state_pool == nullptr && p.final_state == nullptr) continue;
        transpose_state(state.data() + v0 * K, K, St + v0, Vp, v1 - v0, K, isa);
        if (p.state_pool != nullptr) {
          host::store_row(p.state_pool, p.state_pool_dtype, (slot * H + h) * V * K + v0 * K, (v1 - v0) * K,
                          &state[v0 * K]);
        } else {
          host::store_row(p.final_state, p.final_state_dtype, (n * H + h) * V * K + v0 * K, (v1 - v0) * K,
                          &state[v0 * K]);
        }
      }
    }
  }
}

template void chunk_forward<float>(const PrefillParams&, float*, float*, float*, int);
template void chunk_forward<double>(const PrefillParams&, double*, double*, double*, int);

void forward(const PrefillParams& p, int cpu_isa) { chunk_forward<float>(p, nullptr, nullptr, nullptr, cpu_isa); }

}  // namespace flashkda::cpu
