// CPU decode step (docs/SPEC.md §5): the token recurrence of docs/SPEC.md §3 in fp32 on a state pool
// updated in place, OpenMP over (sequence, head). Compiled for the baseline ISA, AVX2 + FMA and
// AVX-512, picked at run time as the prefill engine is (internal::DecodeLaunch::cpu_isa).
//
// Slot rules (shared with the GPU kernel, src/cuda/sm90/decode/kernel.cuh):
//   - without num_accepted_tokens: slot = state_indices[n * indices_stride]; read before the
//     first token, written after the last.
//   - with num_accepted_tokens (speculative): the start state is read from
//     state_indices[n, num_accepted_tokens[n] - 1]; the state after token t is written to
//     state_indices[n, t] unless that entry is negative.
//   - a negative start slot marks padding: no slot is read or written, outputs are set to zero.
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend.h"
#include "common/host_math.h"
#include "cpu/gate_avx2.h"
#include "cpu/isa.h"

namespace flashkda::cpu {
namespace {

int32_t start_slot(const DecodeParams& p, int64_t n) {
  const int64_t t = p.num_accepted_tokens != nullptr ? p.num_accepted_tokens[n] - 1 : 0;
  return p.state_indices[n * p.indices_stride + t];
}

// Per-thread buffers of one (sequence, head), kept between calls (OpenMP's threads persist): a
// call allocates only when it sees a larger head size than its thread has served before.
struct DecodeScratch {
  std::vector<float> state, q, k, decay, v, o;
  void fit(int64_t K, int64_t V) {
    if (int64_t(state.size()) < V * K) state.resize(size_t(V * K));
    for (std::vector<float>* x : {&q, &k, &decay})
      if (int64_t(x->size()) < K) x->resize(size_t(K));
    for (std::vector<float>* x : {&v, &o})
      if (int64_t(x->size()) < V) x->resize(size_t(V));
  }
};

DecodeScratch& thread_scratch(int64_t K, int64_t V) {
  thread_local DecodeScratch s;
  s.fit(K, V);
  return s;
}

// One state row (one value column of S) through one token: decay, delta-rule correction along
// k, then the read along q; returns the output element. The two reductions run in kLanes partial
// sums so the loops vectorise without reassociation flags (a plain running sum is a chain of K
// dependent adds).
FLASHKDA_HOST_INLINE float step_row(float* row, const float* decay, const float* k, const float* q, float v, float b,
                                    int64_t K) {
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  const int64_t whole = K - K % kLanes;  // the loops' bound computed once (with c0 + kLanes <= K GCC's
  // AVX2 build of this step took 1.3x the time once the rows came prefetched)
  for (int64_t c0 = 0; c0 < whole; c0 += kLanes) {
#pragma omp simd
    for (int w = 0; w < kLanes; ++w) {
      const float r = row[c0 + w] * decay[c0 + w];
      row[c0 + w] = r;
      part[w] += r * k[c0 + w];
    }
  }
  for (int64_t c = whole; c < K; ++c) {
    row[c] *= decay[c];
    part[0] += row[c] * k[c];
  }
  float pred = 0.0f;
  for (int w = 0; w < kLanes; ++w) pred += part[w], part[w] = 0.0f;
  const float delta = b * (v - pred);
  for (int64_t c0 = 0; c0 < whole; c0 += kLanes) {
#pragma omp simd
    for (int w = 0; w < kLanes; ++w) {
      const float r = row[c0 + w] + delta * k[c0 + w];
      row[c0 + w] = r;
      part[w] += r * q[c0 + w];
    }
  }
  for (int64_t c = whole; c < K; ++c) {
    row[c] += delta * k[c];
    part[0] += row[c] * q[c];
  }
  float acc = 0.0f;
  for (int w = 0; w < kLanes; ++w) acc += part[w];
  return acc;
}

#ifdef FLASHKDA_X86_DISPATCH
// step_row and host::l2_normalize for the two FMA builds, in intrinsics: lane w of the 16 partial sums
// is the fused multiply-add chain over channels w, w + 16, ... that the loops compile to where the
// compiler vectorises and contracts them, but fixed in the source, so that the AVX2 build (two ymm a
// step) and the AVX-512 build (one zmm) give the same bits whatever a compiler makes of the loops (run
// 171: GCC 13.3's two builds of the loops gave different pool bits; GCC 12's too where K is not a
// multiple of 16). The 16 sums are added in lane order, as in the loops; the channels past the last 16
// go into lane 0 in the rows, into lanes 0, 1, ... in the norms, as there, but fused. Bit for bit where
// no NaN meets another: which of two NaNs an operation passes on is the compiler's operand order.
FLASHKDA_TARGET_AVX2 inline void partial_sums_avx2(__m256 lo, __m256 hi, float (&part)[16]) {
  _mm256_storeu_ps(part, lo), _mm256_storeu_ps(part + 8, hi);
}
// The 16 partial sums added in lane order.
inline float sum_lanes(const float (&part)[16]) {
  float sum = 0.0f;
  for (int w = 0; w < 16; ++w) sum += part[w];
  return sum;
}
FLASHKDA_TARGET_AVX2 inline float step_row_avx2(float* row, const float* decay, const float* k, const float* q,
                                                float v, float b, int64_t K) {
  const int64_t whole = K - K % 16;
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < whole; c0 += 16) {
    const __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(row + c0), _mm256_loadu_ps(decay + c0));
    const __m256 r1 = _mm256_mul_ps(_mm256_loadu_ps(row + c0 + 8), _mm256_loadu_ps(decay + c0 + 8));
    _mm256_storeu_ps(row + c0, r0), _mm256_storeu_ps(row + c0 + 8, r1);
    lo = _mm256_fmadd_ps(r0, _mm256_loadu_ps(k + c0), lo), hi = _mm256_fmadd_ps(r1, _mm256_loadu_ps(k + c0 + 8), hi);
  }
  float part[16];
  partial_sums_avx2(lo, hi, part);
  for (int64_t c = whole; c < K; ++c) row[c] *= decay[c], part[0] = std::fma(row[c], k[c], part[0]);
  const float pred = sum_lanes(part);
  const float delta = b * (v - pred);
  const __m256 d = _mm256_set1_ps(delta);
  lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < whole; c0 += 16) {
    const __m256 r0 = _mm256_fmadd_ps(d, _mm256_loadu_ps(k + c0), _mm256_loadu_ps(row + c0));
    const __m256 r1 = _mm256_fmadd_ps(d, _mm256_loadu_ps(k + c0 + 8), _mm256_loadu_ps(row + c0 + 8));
    _mm256_storeu_ps(row + c0, r0), _mm256_storeu_ps(row + c0 + 8, r1);
    lo = _mm256_fmadd_ps(r0, _mm256_loadu_ps(q + c0), lo), hi = _mm256_fmadd_ps(r1, _mm256_loadu_ps(q + c0 + 8), hi);
  }
  partial_sums_avx2(lo, hi, part);
  for (int64_t c = whole; c < K; ++c) row[c] = std::fma(delta, k[c], row[c]), part[0] = std::fma(row[c], q[c], part[0]);
  return sum_lanes(part);
}
FLASHKDA_TARGET_AVX512 inline float step_row_avx512(float* row, const float* decay, const float* k, const float* q,
                                                    float v, float b, int64_t K) {
  const int64_t whole = K - K % 16;
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < whole; c0 += 16) {
    const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + c0), _mm512_loadu_ps(decay + c0));
    _mm512_storeu_ps(row + c0, r);
    sum = _mm512_fmadd_ps(r, _mm512_loadu_ps(k + c0), sum);
  }
  float part[16];
  _mm512_storeu_ps(part, sum);
  for (int64_t c = whole; c < K; ++c) row[c] *= decay[c], part[0] = std::fma(row[c], k[c], part[0]);
  const float pred = sum_lanes(part);
  const float delta = b * (v - pred);
  const __m512 d = _mm512_set1_ps(delta);
  sum = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < whole; c0 += 16) {
    const __m512 r = _mm512_fmadd_ps(d, _mm512_loadu_ps(k + c0), _mm512_loadu_ps(row + c0));
    _mm512_storeu_ps(row + c0, r);
    sum = _mm512_fmadd_ps(r, _mm512_loadu_ps(q + c0), sum);
  }
  _mm512_storeu_ps(part, sum);
  for (int64_t c = whole; c < K; ++c) row[c] = std::fma(delta, k[c], row[c]), part[0] = std::fma(row[c], q[c], part[0]);
  return sum_lanes(part);
}
// host::l2_normalize's sums of squares, as above.
FLASHKDA_TARGET_AVX2 inline void l2_normalize_avx2(float* x, int64_t n) {
  const int64_t whole = n - n % 16;
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    lo = _mm256_fmadd_ps(x0, x0, lo), hi = _mm256_fmadd_ps(x1, x1, hi);
  }
  float part[16];
  partial_sums_avx2(lo, hi, part);
  for (int64_t i = whole, w = 0; i < n; ++i, ++w) part[w] = std::fma(x[i], x[i], part[w]);
  const float sum = sum_lanes(part);
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}
FLASHKDA_TARGET_AVX512 inline void l2_normalize_avx512(float* x, int64_t n) {
  const int64_t whole = n - n % 16;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 xi = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(xi, xi, acc);
  }
  float part[16];
  _mm512_storeu_ps(part, acc);
  for (int64_t i = whole, w = 0; i < n; ++i, ++w) part[w] = std::fma(x[i], x[i], part[w]);
  const float sum = sum_lanes(part);
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

// The decay factors e^a of one token from its raw gates, in place, on AVX2 vectors (avx2::gate_row,
// then avx2::exp four vectors at a time; std::exp past the last whole vector): with std::log1p and
// std::exp per channel the softplus gate cost a third of a decode step (N=256 H=16, one thread:
// 40.5 ms against 27.5 with precomputed gates).
FLASHKDA_TARGET_AVX2 inline void decay_row_avx2(const host::HeadGate<float>& gate, float* decay, int64_t K) {
  if (!avx2::gate_row<host::StdMath<float>>(gate, decay, K))
    for (int64_t c = 0; c < K; ++c) decay[c] = gate(c, decay[c]);  // precomputed: a = g
  int64_t c = 0;
  for (; c + 32 <= K; c += 32) {
    __m256 x[4];
    for (int j = 0; j < 4; ++j) x[j] = _mm256_loadu_ps(decay + c + 8 * j);
    avx2::exp<4>(x);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(decay + c + 8 * j, x[j]);
  }
  for (; c + 8 <= K; c += 8) _mm256_storeu_ps(decay + c, avx2::exp(_mm256_loadu_ps(decay + c)));
  for (; c < K; ++c) decay[c] = std::exp(decay[c]);
}
#endif

// A slot stepped in place streams from memory row by row, and one thread's demand misses alone
// left it at ~60% of what the same thread moves where the lines are asked for ahead: each row's
// lines are prefetched (for writing) kPrefetchRows rows early, 4 KB at K = 128 (measured on a
// 2-core AVX-512 VM, one thread, H = 16: N = 256 43.6 -> 25.0 ms, N = 64 ~8.6 -> ~4.6; 4-8 rows
// ahead alike, 16 and more, or four rows stepped side by side, slower).
constexpr int64_t kPrefetchRows = 8;
FLASHKDA_HOST_INLINE void prefetch_row(const float* row, int64_t K) {
#if defined(__GNUC__)
  for (int64_t c = 0; c < K; c += 64 / int64_t(sizeof(float))) __builtin_prefetch(row + c, 1, 3);
#else
  (void)row, (void)K;
#endif
}

// Writes zeros to the outputs of a padding entry.
void zero_outputs(const DecodeParams& p, SeqRange seq, int64_t h, std::vector<float>& zeros) {
  std::fill(zeros.begin(), zeros.begin() + p.V, 0.0f);
  for (int64_t t = seq.bos; t < seq.eos; ++t) host::store_row(p.out, p.dtype, (t * p.H + h) * p.V, p.V, zeros.data());
}

// Token recurrence of one (sequence, head) on its fp32 state slice [V, K]: the pool's own, or a copy.
// kIsa: the build (kIsaAvx2 and kIsaAvx512: the gate and e^a by decay_row_avx2, the rows and the L2
// norms by step_row_avx2 / _avx512 and l2_normalize_avx2 / _avx512).
template <int kIsa>
FLASHKDA_HOST_INLINE void decode_head(const DecodeParams& p, int64_t n, int64_t h, float scale) {
  const int64_t K = p.K, V = p.V, H = p.H;
  const SeqRange seq = detail::seq_range(p, n);
  const int32_t slot = start_slot(p, n);
  DecodeScratch& scratch = thread_scratch(K, V);
  if (slot < 0) {
    zero_outputs(p, seq, h, scratch.o);
    return;
  }
  std::vector<float>&q = scratch.q, &k = scratch.k, &decay = scratch.decay, &v = scratch.v, &o = scratch.o;
  // An fp32 pool without per-token slots is stepped where it lies: each 64-byte line of the state is
  // read once and written back once. Copied in and out through the scratch, the copy's stores to the
  // pool first read every line again (~3 state sizes of memory traffic where 2 suffice).
  const bool in_place = p.state_dtype == DType::kF32 && p.num_accepted_tokens == nullptr;
  float* const state = in_place ? static_cast<float*>(p.state_pool) + (int64_t(slot) * H + h) * V * K
                                : scratch.state.data();
  if (!in_place) host::load_state(p.state_pool, p.state_dtype, slot, h, H, V, K, state);
  const host::HeadGate<float> gate(p.pre, h, K);

  for (int64_t t = seq.bos; t < seq.eos; ++t) {
    float b;
#ifdef FLASHKDA_X86_DISPATCH
    if constexpr (kIsa != kIsaBaseline) {
      const auto norm = [](float* x, int64_t n) {  // the norms in intrinsics
        if constexpr (kIsa == kIsaAvx512) l2_normalize_avx512(x, n);
        else l2_normalize_avx2(x, n);
      };
      b = host::load_token_inputs(p, t, h, q.data(), k.data(), v.data(), decay.data(), norm);
      decay_row_avx2(gate, decay.data(), K);
    } else
#endif
      b = host::load_token(p, gate, t, h, q.data(), k.data(), v.data(), decay.data());
    for (int64_t c = 0; c < K; ++c) q[c] *= scale;

    for (int64_t i = 0; i < V; ++i) {
      if (in_place && i + kPrefetchRows < V) prefetch_row(state + (i + kPrefetchRows) * K, K);
      float* const row = state + i * K;
#ifdef FLASHKDA_X86_DISPATCH
      if constexpr (kIsa == kIsaAvx512) o[i] = step_row_avx512(row, decay.data(), k.data(), q.data(), v[i], b, K);
      else if constexpr (kIsa == kIsaAvx2) o[i] = step_row_avx2(row, decay.data(), k.data(), q.data(), v[i], b, K);
      else
#endif
        o[i] = step_row(row, decay.data(), k.data(), q.data(), v[i], b, K);
    }
    host::store_row(p.out, p.dtype, (t * H + h) * V, V, o.data());

    if (p.num_accepted_tokens != nullptr) {
      const int32_t dst = p.state_indices[n * p.indices_stride + (t - seq.bos)];
      if (dst >= 0) host::store_state(p.state_pool, p.state_dtype, dst, h, H, V, K, state);
    }
  }
  if (!in_place && p.num_accepted_tokens == nullptr)
    host::store_state(p.state_pool, p.state_dtype, slot, h, H, V, K, state);
}

// Item i of a call (sequence i / H, head i % H), per instruction set; the two FMA builds fuse the
// rows' and the norms' multiply-adds and take the gates' AVX2 exponentials, so their bits differ from
// the baseline's (and are the same in both).
void decode_items(const DecodeParams& p, int64_t i, float scale) {
  decode_head<kIsaBaseline>(p, i / p.H, i % p.H, scale);
}
#ifdef FLASHKDA_X86_DISPATCH
FLASHKDA_TARGET_AVX2 void decode_items_avx2(const DecodeParams& p, int64_t i, float scale) {
  decode_head<kIsaAvx2>(p, i / p.H, i % p.H, scale);
}
FLASHKDA_TARGET_AVX512 void decode_items_avx512(const DecodeParams& p, int64_t i, float scale) {
  decode_head<kIsaAvx512>(p, i / p.H, i % p.H, scale);
}
#endif

}  // namespace

void decode(const DecodeParams& p, int cpu_isa) {
  const float scale = detail::effective_scale(p.pre, p.K);
  const int64_t work = p.num_seqs * p.H;
  if (work == 0) return;
  auto item = decode_items;
  const int isa = engine_isa(cpu_isa);
#ifdef FLASHKDA_X86_DISPATCH
  if (isa == kIsaAvx512) item = decode_items_avx512;
  else if (isa == kIsaAvx2) item = decode_items_avx2;
#else
  (void)isa;
#endif
#pragma omp parallel
  {
    thread_scratch(p.K, p.V);  // every thread, whether or not it gets an item this call
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < work; ++i) item(p, i, scale);
  }
}

}  // namespace flashkda::cpu
