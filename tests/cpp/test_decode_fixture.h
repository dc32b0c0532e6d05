// Decode test fixture shared by the CPU (test_decode.cpp) and GPU (gpu/test_decode_gpu.cpp)
// suites: a random decode problem on a sentinel-filled state pool (slot layout: plain, padding,
// speculative), DecodeParams pointing at host memory, the fp64 reference of every slot a decode
// must write, and one check: outputs vs reference, written slots vs reference, every other byte of
// the pool bit-exact unchanged, padding outputs exactly zero, guard bytes intact.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kda_test_utils.h"

namespace flashkda::test {

struct DecodeOptions {
  int64_t N = 4, T = 1;           // fixed T tokens per sequence unless seqlens is given
  std::vector<int64_t> seqlens;   // varlen (cu_seqlens) lengths, each 1..16
  DType cu_dtype = DType::kI32;
  int64_t H = 2, K = 128, V = 128;
  DType dtype = DType::kBF16, g_dtype = DType::kBF16, beta_dtype = DType::kBF16;
  DType state_dtype = DType::kF32;
  GateForm gate = GateForm::kLowerBound;
  float lower_bound = -5.0f;
  bool with_dt_bias = true;
  bool l2norm = true;
  bool beta_is_logit = true;
  bool has_scale = false;
  float scale = 0.0f;
  double g_min = -3.0, g_max = 3.0;

  std::vector<int64_t> padding;         // sequences whose start index is negative
  bool speculative = false;             // num_accepted_tokens given, one slot per token
  int64_t indices_stride = 1;           // >= longest sequence when speculative
  std::vector<int32_t> accepted;        // speculative: per sequence (empty: random in [1, stride])
  std::vector<std::pair<int64_t, int64_t>> skipped_stores;  // speculative (n, t) with index -1
  int64_t extra_slots = 5;              // unnamed slots in the pool (must stay bit-exact)
};

// One random decode problem with its state pool; params() describes it on host memory.
struct DecodeProblem {
  DecodeOptions opt;
  KdaInputs in;  // q, k, v, g, beta, out, A_log, dt_bias, cu_seqlens (B = N or varlen)
  int64_t N = 0, P = 0, slice = 0;
  std::vector<int64_t> bos, len;
  std::vector<int32_t> indices, accepted;
  HostTensor pool, pool_before, gathered;  // gathered: [N, H, V, K] start states (for the reference)
  std::set<int64_t> padding;

  static KdaOptions kda_options(const DecodeOptions& o) {
    KdaOptions k;
    k.B = o.N;
    k.T = o.T;
    k.seqlens = o.seqlens;
    k.cu_dtype = o.cu_dtype;
    k.H = o.H, k.K = o.K, k.V = o.V;
    k.dtype = o.dtype, k.g_dtype = o.g_dtype, k.beta_dtype = o.beta_dtype;
    k.gate = o.gate;
    k.lower_bound = o.lower_bound;
    k.with_dt_bias = o.with_dt_bias;
    k.l2norm = o.l2norm;
    k.beta_is_logit = o.beta_is_logit;
    k.has_scale = o.has_scale;
    k.scale = o.scale;
    k.g_min = o.g_min, k.g_max = o.g_max;
    return k;
  }

  explicit DecodeProblem(const DecodeOptions& o) : opt(o), in(kda_options(o)) {
    N = in.N;
    slice = opt.H * opt.V * opt.K;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t l = opt.seqlens.empty() ? opt.T : opt.seqlens[n];
      bos.push_back(n == 0 ? 0 : bos.back() + len.back());
      len.push_back(l);
    }
    padding.insert(opt.padding.begin(), opt.padding.end());
    std::mt19937_64 rng(in.seed ^ 0x5bd1e995u);

    // Distinct slots for every index entry, in random order, plus unnamed extra slots.
    const int64_t entries = N * opt.indices_stride;
    P = entries + opt.extra_slots;
    std::vector<int32_t> perm(P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    indices.assign(perm.begin(), perm.begin() + entries);
    if (opt.speculative) {
      accepted = opt.accepted;
      if (accepted.empty()) {
        for (int64_t n = 0; n < N; ++n)
          accepted.push_back(int32_t(std::uniform_int_distribution<int64_t>(1, opt.indices_stride)(rng)));
      }
      for (auto [n, t] : opt.skipped_stores) indices[n * opt.indices_stride + t] = -1;
    }
    for (int64_t n : padding) indices[n * opt.indices_stride + start_entry(n)] = -1 - int32_t(n % 3);

    // Sentinel pool (0xFF bytes: NaN in fp32 and bf16); random start states in the start slots.
    pool = HostTensor(opt.state_dtype, P * slice);
    gathered = HostTensor(opt.state_dtype, N * slice);
    std::normal_distribution<double> normal(0.0, 0.1);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < slice; ++i) gathered.set(n * slice + i, 0.0);
      if (is_padding(n)) continue;
      const int32_t s = start_slot(n);
      for (int64_t i = 0; i < slice; ++i) {
        pool.set(s * slice + i, normal(rng));
        gathered.set(n * slice + i, pool.get(s * slice + i));
      }
    }
    pool_before = pool;
    in.poison_outputs();
  }

  // The GPU backend cannot validate indices without a sync: out-of-range accepted counts and start
  // slots make a padding entry there, out-of-range store slots are skipped (the CPU rejects both).
  bool accepted_valid(int64_t n) const {
    return !opt.speculative || (accepted[n] >= 1 && accepted[n] <= opt.indices_stride);
  }
  int64_t start_entry(int64_t n) const { return opt.speculative ? accepted[n] - 1 : 0; }
  int32_t start_slot(int64_t n) const { return accepted_valid(n) ? indices[n * opt.indices_stride + start_entry(n)] : -1; }
  bool is_padding(int64_t n) const { return start_slot(n) < 0 || start_slot(n) >= P; }

  DecodeParams params() {
    DecodeParams p;
    p.q = in.q.data();
    p.k = in.k.data();
    p.v = in.v.data();
    p.g = in.g.data();
    p.beta = in.beta.data();
    p.out = in.out.data();
    p.dtype = opt.dtype;
    p.g_dtype = opt.g_dtype;
    p.beta_dtype = opt.beta_dtype;
    p.state_pool = pool.data();
    p.state_dtype = opt.state_dtype;
    p.pool_size = P;
    p.state_indices = indices.data();
    p.indices_stride = opt.indices_stride;
    p.num_accepted_tokens = opt.speculative ? accepted.data() : nullptr;
    if (!opt.seqlens.empty()) {
      p.cu_seqlens = in.cu_seqlens.data();
      p.cu_seqlens_dtype = opt.cu_dtype;
    }
    p.num_seqs = N;
    p.T = in.opt.T;  // total tokens with cu_seqlens
    p.H = opt.H, p.K = opt.K, p.V = opt.V;
    p.pre = in.params().pre;
    return p;
  }

  // fp64 reference of the first `tokens` tokens of sequence n from its start state.
  Reference reference_prefix(int64_t n, int64_t tokens) {
    PrefillParams p = in.params();
    const int64_t H = opt.H, K = opt.K, V = opt.V, row = bos[n] * H;
    p.q = static_cast<const char*>(in.q.data()) + row * K * dtype_size(opt.dtype);
    p.k = static_cast<const char*>(in.k.data()) + row * K * dtype_size(opt.dtype);
    p.v = static_cast<const char*>(in.v.data()) + row * V * dtype_size(opt.dtype);
    p.g = static_cast<const char*>(in.g.data()) + row * K * dtype_size(opt.g_dtype);
    p.beta = static_cast<const char*>(in.beta.data()) + row * dtype_size(opt.beta_dtype);
    p.cu_seqlens = nullptr;
    p.num_seqs = 0;
    p.B = 1;
    p.T = tokens;
    p.initial_state = static_cast<const char*>(gathered.data()) + n * slice * dtype_size(opt.state_dtype);
    p.initial_state_dtype = opt.state_dtype;
    p.final_state = nullptr;
    Reference ref;
    ref.out.resize(size_t(tokens * H * V));
    ref.final_state.resize(size_t(slice));
    reference_forward(p, ref.out.data(), ref.final_state.data());
    return ref;
  }

  // Slot -> expected state of every slot the decode must write.
  std::map<int64_t, std::vector<double>> expected_slots() {
    std::map<int64_t, std::vector<double>> slots;
    for (int64_t n = 0; n < N; ++n) {
      if (is_padding(n)) continue;
      if (!opt.speculative) {
        slots[start_slot(n)] = reference_prefix(n, len[n]).final_state;
        continue;
      }
      for (int64_t t = 0; t < len[n]; ++t) {
        const int32_t s = indices[n * opt.indices_stride + t];
        if (s >= 0 && s < P) slots[s] = reference_prefix(n, t + 1).final_state;
      }
    }
    return slots;
  }

  std::string describe() const {
    std::ostringstream os;
    os << in.describe() << " state_pool=" << dtype_name(opt.state_dtype) << " P=" << P
       << " speculative=" << opt.speculative << " stride=" << opt.indices_stride << " padding=" << padding.size();
    return os.str();
  }

  // Compares the decode results now in in.out and pool against the reference (see file comment).
  void check(double tol_out, double tol_state, const std::string& tag = "") {
    SCOPED_TRACE(describe() + (tag.empty() ? "" : " [" + tag + "]"));
    const int64_t H = opt.H, V = opt.V;
    ASSERT_TRUE(in.out.guard_intact()) << "out: bytes written past the end";
    ASSERT_TRUE(pool.guard_intact()) << "state_pool: bytes written past the end";

    std::vector<double> got, want;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t first = bos[n] * H * V, count = len[n] * H * V;
      if (is_padding(n)) {
        for (int64_t i = 0; i < count; ++i) ASSERT_EQ(in.out.get(first + i), 0.0) << "padding output of sequence " << n;
        continue;
      }
      const Reference ref = reference_prefix(n, len[n]);
      for (int64_t i = 0; i < count; ++i) got.push_back(in.out.get(first + i));
      want.insert(want.end(), ref.out.begin(), ref.out.end());
    }
    const double err_out = rel_rms(got, want);
    report("decode_out_rel_rms" + tag, err_out);
    EXPECT_LE(err_out, tol_out);

    const auto slots = expected_slots();
    got.clear();
    want.clear();
    for (const auto& [s, state] : slots) {
      for (int64_t i = 0; i < slice; ++i) got.push_back(pool.get(s * slice + i));
      want.insert(want.end(), state.begin(), state.end());
    }
    const double err_state = rel_rms(got, want);
    report("decode_state_rel_rms" + tag, err_state);
    EXPECT_LE(err_state, tol_state);

    const size_t slice_bytes = size_t(slice) * dtype_size(opt.state_dtype);
    for (int64_t s = 0; s < P; ++s) {
      if (slots.count(s)) continue;
      EXPECT_EQ(std::memcmp(pool.bytes.data() + s * slice_bytes, pool_before.bytes.data() + s * slice_bytes,
                            slice_bytes),
                0)
          << "slot " << s << " is not named for writing but changed";
    }
  }
};

}  // namespace flashkda::test
