// Shared helpers of the C++ test suites: random KDA prefill inputs on the host for a given shape
// and options (fresh seed per instance), PrefillParams pointing at them, NaN-poisoned outputs
// with guard bytes after every buffer, rel-RMS comparison, and the fp64 reference run.
// GPU tests reuse KdaInputs: copy the host buffers to the device and swap the pointers.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flashkda/flashkda.h"

namespace flashkda::test {

// Which state tensor a run gets: none, fp32 or bf16.
enum class StateKind { kNone, kF32, kBF16 };

inline const char* state_kind_name(StateKind s) {
  return s == StateKind::kNone ? "none" : (s == StateKind::kF32 ? "f32" : "bf16");
}
inline DType state_dtype(StateKind s) { return s == StateKind::kBF16 ? DType::kBF16 : DType::kF32; }

// Bytes of every guard region; 0xFF bytes read as NaN in fp32 and bf16 alike.
constexpr size_t kGuardBytes = 256;
constexpr unsigned char kPoison = 0xFF;

// A host tensor of `count` elements of `dtype`, followed by kGuardBytes poison bytes.
struct HostTensor {
  DType dtype = DType::kF32;
  int64_t count = 0;
  std::vector<unsigned char> bytes;

  HostTensor() = default;
  HostTensor(DType dt, int64_t n) : dtype(dt), count(n), bytes(size_t(n) * dtype_size(dt) + kGuardBytes, kPoison) {}

  size_t data_bytes() const { return size_t(count) * dtype_size(dtype); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  void poison() { std::fill(bytes.begin(), bytes.end(), kPoison); }

  bool guard_intact() const {
    for (size_t i = data_bytes(); i < bytes.size(); ++i)
      if (bytes[i] != kPoison) return false;
    return true;
  }

  void set(int64_t i, double x) {
    if (dtype == DType::kBF16) {
      const uint16_t b = bf16::from_float(float(x));
      std::memcpy(&bytes[size_t(i) * 2], &b, 2);
    } else if (dtype == DType::kF32) {
      const float f = float(x);
      std::memcpy(&bytes[size_t(i) * 4], &f, 4);
    } else if (dtype == DType::kI32) {
      const int32_t v = int32_t(x);
      std::memcpy(&bytes[size_t(i) * 4], &v, 4);
    } else {
      const int64_t v = int64_t(x);
      std::memcpy(&bytes[size_t(i) * 8], &v, 8);
    }
  }

  double get(int64_t i) const {
    if (dtype == DType::kBF16) {
      uint16_t b;
      std::memcpy(&b, &bytes[size_t(i) * 2], 2);
      return bf16::to_float(b);
    }
    if (dtype == DType::kF32) {
      float f;
      std::memcpy(&f, &bytes[size_t(i) * 4], 4);
      return f;
    }
    if (dtype == DType::kI32) {
      int32_t v;
      std::memcpy(&v, &bytes[size_t(i) * 4], 4);
      return v;
    }
    int64_t v;
    std::memcpy(&v, &bytes[size_t(i) * 8], 8);
    return double(v);
  }

  std::vector<double> values() const {
    std::vector<double> out(count);
    for (int64_t i = 0; i < count; ++i) out[i] = get(i);
    return out;
  }
};

// Shape and options of one random prefill problem.
struct KdaOptions {
  int64_t B = 1, T = 64, H = 2, K = 128, V = 128;
  std::vector<int64_t> seqlens;  // non-empty: varlen with cu_seqlens (B = 1, T = sum of lengths)
  DType cu_dtype = DType::kI32;
  DType dtype = DType::kBF16, g_dtype = DType::kBF16, beta_dtype = DType::kBF16;

  GateForm gate = GateForm::kLowerBound;
  float lower_bound = -5.0f;
  bool with_dt_bias = true;
  double A_log_min = -1.0, A_log_max = 1.0;  // A_log[h] uniform in this range
  double dt_bias_min = -1.0, dt_bias_max = 1.0;
  double g_min = -3.0, g_max = 3.0;  // raw gate (log-decay for kPrecomputed) uniform in this range

  bool l2norm = true;       // without it q and k are generated with unit norm
  bool beta_is_logit = true;
  double beta_min = -3.0, beta_max = 3.0;  // logit range (activated beta: [0, 1] is used)
  bool has_scale = false;
  float scale = 0.0f;
  Precision precision = Precision::kPrecise;  // the GPU recurrence's mode

  StateKind initial_state = StateKind::kNone;
  StateKind final_state = StateKind::kNone;
  double initial_state_std = 0.1;

  uint64_t seed = 0;  // 0: a fresh seed
};

inline uint64_t fresh_seed() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t base = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  return base + 0x9E3779B97F4A7C15ull * (++counter);
}

// Host inputs and poisoned outputs of one problem; params() points at them.
struct KdaInputs {
  KdaOptions opt;
  uint64_t seed = 0;
  int64_t N = 0;  // sequences
  HostTensor q, k, v, g, beta, out, initial_state, final_state, cu_seqlens;
  std::vector<float> A_log, dt_bias;

  explicit KdaInputs(const KdaOptions& o) : opt(o) {
    if (!opt.seqlens.empty()) {
      opt.B = 1;
      opt.T = 0;
      for (int64_t len : opt.seqlens) opt.T += len;
    }
    seed = opt.seed != 0 ? opt.seed : fresh_seed();
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    auto uniform = [&rng](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };

    const int64_t B = opt.B, T = opt.T, H = opt.H, K = opt.K, V = opt.V;
    const int64_t rows = B * T * H;
    N = opt.seqlens.empty() ? B : int64_t(opt.seqlens.size());

    q = HostTensor(opt.dtype, rows * K);
    k = HostTensor(opt.dtype, rows * K);
    v = HostTensor(opt.dtype, rows * V);
    g = HostTensor(opt.g_dtype, rows * K);
    beta = HostTensor(opt.beta_dtype, rows);
    out = HostTensor(opt.dtype, rows * V);

    std::vector<double> row(K);
    for (HostTensor* t : {&q, &k}) {
      for (int64_t r = 0; r < rows; ++r) {
        double norm = 0.0;
        for (int64_t c = 0; c < K; ++c) norm += (row[c] = normal(rng)) * row[c];
        const double f = opt.l2norm ? 1.0 : 1.0 / std::sqrt(norm);
        for (int64_t c = 0; c < K; ++c) t->set(r * K + c, row[c] * f);
      }
    }
    for (int64_t i = 0; i < rows * V; ++i) v.set(i, normal(rng));
    for (int64_t i = 0; i < rows * K; ++i) g.set(i, uniform(opt.g_min, opt.g_max));
    for (int64_t i = 0; i < rows; ++i)
      beta.set(i, opt.beta_is_logit ? uniform(opt.beta_min, opt.beta_max) : uniform(0.0, 1.0));

    A_log.resize(H);
    for (auto& x : A_log) x = float(uniform(opt.A_log_min, opt.A_log_max));
    if (opt.with_dt_bias) {
      dt_bias.resize(H * K);
      for (auto& x : dt_bias) x = float(uniform(opt.dt_bias_min, opt.dt_bias_max));
    }

    const int64_t state_elems = N * H * V * K;
    if (opt.initial_state != StateKind::kNone) {
      initial_state = HostTensor(state_dtype(opt.initial_state), state_elems);
      for (int64_t i = 0; i < state_elems; ++i) initial_state.set(i, opt.initial_state_std * normal(rng));
    }
    if (opt.final_state != StateKind::kNone) final_state = HostTensor(state_dtype(opt.final_state), state_elems);

    if (!opt.seqlens.empty()) {
      cu_seqlens = HostTensor(opt.cu_dtype, N + 1);
      int64_t acc = 0;
      cu_seqlens.set(0, 0);
      for (int64_t n = 0; n < N; ++n) cu_seqlens.set(n + 1, double(acc += opt.seqlens[n]));
    }
  }

  PrefillParams params() {
    PrefillParams p;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.g = g.data();
    p.beta = beta.data();
    p.out = out.data();
    p.dtype = opt.dtype;
    p.g_dtype = opt.g_dtype;
    p.beta_dtype = opt.beta_dtype;
    if (opt.initial_state != StateKind::kNone) {
      p.initial_state = initial_state.data();
      p.initial_state_dtype = initial_state.dtype;
    }
    if (opt.final_state != StateKind::kNone) {
      p.final_state = final_state.data();
      p.final_state_dtype = final_state.dtype;
    }
    if (!opt.seqlens.empty()) {
      p.cu_seqlens = cu_seqlens.data();
      p.cu_seqlens_dtype = opt.cu_dtype;
      p.num_seqs = N;
    }
    p.B = opt.B;
    p.T = opt.T;
    p.H = opt.H;
    p.K = opt.K;
    p.V = opt.V;
    p.pre.gate = opt.gate;
    p.pre.lower_bound = opt.lower_bound;
    p.pre.A_log = A_log.data();
    p.pre.dt_bias = opt.with_dt_bias ? dt_bias.data() : nullptr;
    p.pre.l2norm_qk = opt.l2norm;
    p.pre.beta_is_logit = opt.beta_is_logit;
    p.pre.has_scale = opt.has_scale;
    p.pre.scale = opt.scale;
    p.precision = opt.precision;
    return p;
  }

  // Fills out and final_state (data and guards) with NaN bytes.
  void poison_outputs() {
    out.poison();
    final_state.poison();
  }

  std::string describe() const {
    std::ostringstream os;
    os << "seed=" << seed << " B=" << opt.B << " T=" << opt.T << " H=" << opt.H << " K=" << opt.K << " V=" << opt.V
       << " dtype=" << dtype_name(opt.dtype) << " g=" << dtype_name(opt.g_dtype)
       << " beta=" << dtype_name(opt.beta_dtype) << " gate=" << gate_form_name(opt.gate)
       << " l2norm=" << opt.l2norm << " beta_is_logit=" << opt.beta_is_logit << " state="
       << state_kind_name(opt.initial_state) << "->" << state_kind_name(opt.final_state);
    if (!opt.seqlens.empty()) {
      os << " seqlens=[";
      for (size_t i = 0; i < opt.seqlens.size(); ++i) os << (i ? "," : "") << opt.seqlens[i];
      os << "] cu=" << dtype_name(opt.cu_dtype);
    }
    return os.str();
  }
};

// fp64 reference of a problem: out [B*T*H*V] and the final state [N*H*V*K] (always computed).
struct Reference {
  std::vector<double> out, final_state;
};

inline Reference run_reference(KdaInputs& in) {
  Reference ref;
  ref.out.assign(size_t(in.opt.B * in.opt.T * in.opt.H * in.opt.V), std::nan(""));
  ref.final_state.assign(size_t(in.N * in.opt.H * in.opt.V * in.opt.K), std::nan(""));
  PrefillParams p = in.params();
  p.final_state = nullptr;
  reference_forward(p, ref.out.data(), ref.final_state.data());
  return ref;
}

// sqrt(sum (got - ref)^2 / sum ref^2); 0 for two empty vectors, inf on a non-finite element.
inline double rel_rms(const std::vector<double>& got, const std::vector<double>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (num == 0.0) return 0.0;
  return std::sqrt(num / (den > 0.0 ? den : 1e-300));
}

// The end state of start states x ([N*H][V][K], v-first) under segment transitions
// (internal::segment_transition: transition [N*H][K][K] = A^T, zero_start [N*H][V][K] = B^T):
// x^T A^T + B^T for each (sequence, head), in fp64.
inline std::vector<double> apply_transition(const std::vector<float>& transition, const std::vector<float>& zero_start,
                                            const std::vector<double>& x, int64_t NH, int64_t V, int64_t K) {
  std::vector<double> y(size_t(NH * V * K));
  for (int64_t nh = 0; nh < NH; ++nh)
    for (int64_t v = 0; v < V; ++v)
      for (int64_t c = 0; c < K; ++c) {
        double acc = zero_start[(nh * V + v) * K + c];
        for (int64_t r = 0; r < K; ++r) acc += x[(nh * V + v) * K + r] * double(transition[(nh * K + r) * K + c]);
        y[(nh * V + v) * K + c] = acc;
      }
  return y;
}

// Prints a measured figure in the test log ("[ measure  ] name: value") and records it in the XML.
inline void report(const std::string& name, double value) {
  std::printf("[ measure  ] %s: %.3e\n", name.c_str(), value);
  ::testing::Test::RecordProperty(name, std::to_string(value));
}

// Number of non-finite elements (NaN poison left in place means an element was not written).
// Calls fn and expects flashkda::Error(code, kInvalidArgument unless named) whose message contains `needle`.
inline void expect_invalid(const std::function<void()>& fn, const std::string& needle,
                           ErrorCode code = ErrorCode::kInvalidArgument) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not mention '" << needle << "'";
  }
}

inline int64_t count_nonfinite(const std::vector<double>& x) {
  int64_t bad = 0;
  for (double e : x) bad += std::isfinite(e) ? 0 : 1;
  return bad;
}

}  // namespace flashkda::test
