// Shared by the serving prefill tests (tests/cpp/test_serving_prefill.cpp on the CPU backend,
// tests/cpp/gpu/test_serving_prefill_gpu.cpp on the GPU): pools of random states, byte
// comparisons of slots, sequence ranges and a sequence's inputs cut at a checkpoint.
#pragma once

#include <cstring>
#include <random>
#include <vector>

#include "kda_test_utils.h"

namespace flashkda::test::serving {

constexpr int64_t kH = 2, kK = 128, kV = 128, kState = kH * kV * kK;  // elements of one slot

// A pool of P slots filled with random states (the sentinel: untouched slots keep these bytes).
inline HostTensor random_pool(DType dtype, int64_t P, uint64_t seed) {
  HostTensor pool(dtype, P * kState);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.1);
  for (int64_t i = 0; i < P * kState; ++i) pool.set(i, normal(rng));
  return pool;
}

inline bool same_bytes(const HostTensor& a, int64_t a_elem, const HostTensor& b, int64_t b_elem, int64_t count) {
  const size_t w = dtype_size(a.dtype);
  return a.dtype == b.dtype && std::memcmp(a.bytes.data() + a_elem * w, b.bytes.data() + b_elem * w, count * w) == 0;
}

// Varlen inputs of these lengths with kH heads.
inline KdaOptions pool_options(const std::vector<int64_t>& seqlens) {
  KdaOptions o;
  o.seqlens = seqlens;
  o.H = kH;
  return o;
}

// [bos, eos) of sequence n.
struct Range {
  int64_t bos, eos;
  int64_t len() const { return eos - bos; }
};

inline Range range_of(const KdaInputs& in, int64_t n) {
  int64_t bos = 0;
  for (int64_t m = 0; m < n; ++m) bos += in.opt.seqlens[m];
  return {bos, bos + in.opt.seqlens[n]};
}

// Sequence r of `in` alone, its first `tokens` tokens (bf16 inputs, the same gate parameters).
inline KdaInputs cut_sequence(const KdaInputs& in, Range r, int64_t tokens) {
  KdaOptions o = pool_options({tokens});
  o.seed = in.seed;
  KdaInputs cut(o);
  const int64_t rows = tokens * kH;
  std::memcpy(cut.q.data(), in.q.bytes.data() + r.bos * kH * kK * 2, rows * kK * 2);
  std::memcpy(cut.k.data(), in.k.bytes.data() + r.bos * kH * kK * 2, rows * kK * 2);
  std::memcpy(cut.v.data(), in.v.bytes.data() + r.bos * kH * kV * 2, rows * kV * 2);
  std::memcpy(cut.g.data(), in.g.bytes.data() + r.bos * kH * kK * 2, rows * kK * 2);
  std::memcpy(cut.beta.data(), in.beta.bytes.data() + r.bos * kH * 2, rows * 2);
  cut.A_log = in.A_log;
  cut.dt_bias = in.dt_bias;
  return cut;
}

// The states of sequences in these pool slots, in sequence order ([N][kState], zeros where the
// slot is padding: negative or >= P), as fp64 values to compare with the reference's.
inline std::vector<double> states_in_slots(const HostTensor& pool, const std::vector<int32_t>& slots, int64_t P) {
  std::vector<double> states(slots.size() * size_t(kState), 0.0);
  for (size_t n = 0; n < slots.size(); ++n)
    for (int64_t i = 0; slots[n] >= 0 && slots[n] < P && i < kState; ++i)
      states[n * kState + i] = pool.get(slots[n] * kState + i);
  return states;
}

}  // namespace flashkda::test::serving
