// Random valid problems and corruptions of PrefillParams / DecodeParams shared by the CPU
// (test_fuzz_params.cpp) and GPU (gpu/test_*_gpu.cpp) fuzz cases, and the outcome check: a call
// runs or throws flashkda::Error with kInvalidArgument / kUnsupported.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "test_decode_fixture.h"

namespace flashkda::test {

constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

struct Fuzz {
  std::mt19937_64 rng{fresh_seed()};

  int64_t below(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng); }
  template <typename T>
  T pick(std::initializer_list<T> values) {
    return values.begin()[below(int64_t(values.size()))];
  }
  DType bad_float_dtype() { return pick({DType::kI32, DType::kI64, static_cast<DType>(77), static_cast<DType>(-1)}); }
  DType bad_index_dtype() { return pick({DType::kBF16, DType::kF32, static_cast<DType>(77)}); }
  // A size that shrinks (to lo .. orig, the valid size of the buffers) or becomes invalid /
  // overflowing. Always relative to orig: an earlier corruption may have left a larger value.
  int64_t shrunk_or_bad(int64_t orig, int64_t lo = 0) {
    if (below(2) == 0) return lo + below(orig - lo + 1);
    return pick<int64_t>({-1, kI64Min, int64_t(1) << 60, kI64Max});
  }
  float bad_float() {
    return pick({std::nanf(""), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                 0.0f, 1.0f, -5.5f, -5.0f});
  }
  void corrupt_gate(Preprocess& pre, std::string& what) {
    switch (below(5)) {
      case 0: pre.gate = static_cast<GateForm>(pick({9, -1})), what += " gate=bad"; break;
      case 1: pre.gate = pick({GateForm::kLowerBound, GateForm::kSoftplus, GateForm::kPrecomputed}), what += " gate"; break;
      case 2: pre.lower_bound = bad_float(), what += " lower_bound=" + std::to_string(pre.lower_bound); break;
      case 3: pre.has_scale = true, pre.scale = bad_float(), what += " scale=" + std::to_string(pre.scale); break;
      default: pre.A_log = nullptr, what += " A_log=null";
    }
  }
  // A valid prefill problem: H = 2, every gate form and state combination, B x T dense or varlen
  // (empty sequences included), under max_len tokens per sequence. Sizes and dtypes are the caller's.
  KdaOptions prefill_problem(int64_t max_len) {
    KdaOptions o;
    o.H = 2;
    o.gate = pick({GateForm::kLowerBound, GateForm::kSoftplus, GateForm::kPrecomputed});
    o.initial_state = pick({StateKind::kNone, StateKind::kF32, StateKind::kBF16});
    o.final_state = pick({StateKind::kNone, StateKind::kF32, StateKind::kBF16});
    if (below(2)) {
      for (int64_t n = 1 + below(4); n > 0; --n) o.seqlens.push_back(below(max_len));
      o.cu_dtype = pick({DType::kI32, DType::kI64});
    } else {
      o.B = 1 + below(3);
      o.T = below(max_len);
    }
    return o;
  }
  // A valid decode step: 1..4 sequences of 1..4 tokens, fixed T or varlen, plain or speculative
  // (4 slots per sequence), either pool dtype. Head sizes and input dtypes are the caller's.
  DecodeOptions decode_problem() {
    DecodeOptions o;
    o.H = 2;
    o.state_dtype = pick({DType::kF32, DType::kBF16});
    o.N = 1 + below(4);
    if (below(2)) {
      for (int64_t n = 0; n < o.N; ++n) o.seqlens.push_back(1 + below(4));
      o.cu_dtype = pick({DType::kI32, DType::kI64});
    } else {
      o.T = 1 + below(4);
    }
    if (below(2)) {
      o.speculative = true;
      o.indices_stride = 4;
    }
    return o;
  }
  // One tensor pointer set to null.
  void null_pointer(PrefillParams& p, std::string& what) {
    const void** ptrs[] = {&p.q, &p.k, &p.v, &p.g, &p.beta};
    if (below(6) == 5) p.out = nullptr, what += " out=null";
    else *ptrs[below(5)] = nullptr, what += " an input=null";
  }
  void null_pointer(DecodeParams& p, std::string& what) {
    const void** ptrs[] = {&p.q, &p.k, &p.v, &p.g, &p.beta};
    switch (below(4)) {
      case 0: p.out = nullptr; break;
      case 1: p.state_pool = nullptr; break;
      case 2: p.state_indices = nullptr; break;
      default: *ptrs[below(5)] = nullptr;
    }
    what += " a pointer=null";
  }
  // B, T or H shrunk or made bad (relative to p0, the valid params).
  void corrupt_batch(PrefillParams& p, const PrefillParams& p0, std::string& what) {
    int64_t* sizes[] = {&p.B, &p.T, &p.H};
    const int64_t orig[] = {p0.B, p0.T, p0.H}, i = below(3);
    *sizes[i] = shrunk_or_bad(orig[i]), what += " B/T/H=" + std::to_string(*sizes[i]);
  }
  // Index-array element i (stored in dtype) set to a bad value, in a copy the caller keeps alive.
  void corrupt_cu(HostTensor& cu, int64_t n_entries, std::string& what) {
    const int64_t i = below(n_entries);
    const double v = pick<double>({-1.0, cu.get(i) + 1, cu.get(i) - 1, -2147483648.0, 2147483647.0});
    cu.set(i, v);
    what += " cu[" + std::to_string(i) + "]=" + std::to_string(int64_t(v));
  }
};

// How a call ended: ran, or threw flashkda::Error with an argument / unsupported code.
enum class Outcome { kRan, kRefused };

inline Outcome run(const std::function<void()>& call, const std::string& what) {
  try {
    call();
    return Outcome::kRan;
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kUnsupported)
        << what << ": " << e.what();
    return Outcome::kRefused;
  }
}

}  // namespace flashkda::test
