// Argument validation for decode (docs/SPEC.md §5): shapes, dtypes, pointers and, where the memory is
// host-readable (CPU backend), cu_seqlens, state_indices and num_accepted_tokens; on the GPU the
// 16-byte alignment of q, k, v, g, dt_bias and state_pool.
//
// What the GPU backend cannot check without a host sync, and what its kernel does instead:
//   - cu_seqlens lengths: a sequence of length 0 touches nothing; longer than 16 runs the same
//     recurrence (in speculative mode tokens t >= indices_stride have no slot and are not stored);
//     a range outside [0, T] (T: the total tokens) is treated as empty: nothing read or written.
//   - a start slot >= pool_size, or num_accepted_tokens outside [1, indices_stride]: the sequence
//     is treated as padding (no slot read or written, its outputs set to zero).
//   - a per-token slot >= pool_size (speculative): that store is skipped.
//   - a slot named by two sequences: not detected on the GPU (the sequences race on it); the
//     CPU backend refuses it, naming both positions.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend.h"
#include "common/host_math.h"

namespace flashkda::detail {
namespace {


bool is_float_dtype(DType t) { return t == DType::kF32 || t == DType::kBF16; }

int64_t cu_at(const DecodeParams& p, int64_t i) { return host::offset_at(p.cu_seqlens, p.cu_seqlens_dtype, i); }

void check_pointers(const DecodeParams& p) {
  FLASHKDA_CHECK_ARG(p.q != nullptr, "decode: q must not be null");
  FLASHKDA_CHECK_ARG(p.k != nullptr, "decode: k must not be null");
  FLASHKDA_CHECK_ARG(p.v != nullptr, "decode: v must not be null");
  FLASHKDA_CHECK_ARG(p.g != nullptr, "decode: g must not be null");
  FLASHKDA_CHECK_ARG(p.beta != nullptr, "decode: beta must not be null");
  FLASHKDA_CHECK_ARG(p.out != nullptr, "decode: out must not be null");
  FLASHKDA_CHECK_ARG(p.state_pool != nullptr, "decode: state_pool must not be null");
  FLASHKDA_CHECK_ARG(p.state_indices != nullptr, "decode: state_indices must not be null");
}

void check_dtypes(const DecodeParams& p) {
  // bf16 only on the GPU: a valid call it does not serve (kUnsupported), checked after every other
  // check (validate_decode), as prefill's.
  FLASHKDA_CHECK_ARG(is_float_dtype(p.dtype), "decode: q, k, v, out must be float32 or bfloat16, got ",
                     dtype_name(p.dtype));
  FLASHKDA_CHECK_ARG(is_float_dtype(p.g_dtype), "decode: g must be float32 or bfloat16, got ",
                     dtype_name(p.g_dtype));
  FLASHKDA_CHECK_ARG(is_float_dtype(p.beta_dtype), "decode: beta must be float32 or bfloat16, got ",
                     dtype_name(p.beta_dtype));
  FLASHKDA_CHECK_ARG(is_float_dtype(p.state_dtype), "decode: state_pool must be float32 or bfloat16, got ",
                     dtype_name(p.state_dtype));
  if (p.cu_seqlens != nullptr) {
    FLASHKDA_CHECK_ARG(p.cu_seqlens_dtype == DType::kI32 || p.cu_seqlens_dtype == DType::kI64,
                       "decode: cu_seqlens must be int32 or int64, got ", dtype_name(p.cu_seqlens_dtype));
  }
}

void check_shapes(const DecodeParams& p) {
  FLASHKDA_CHECK_ARG(p.num_seqs >= 0, "decode: num_seqs must be >= 0, got ", p.num_seqs);
  FLASHKDA_CHECK_ARG(p.H >= 1, "decode: H must be >= 1, got ", p.H);
  FLASHKDA_CHECK_ARG(p.K >= 1 && p.V >= 1, "decode: K and V must be >= 1, got K=", p.K, ", V=", p.V);
  // the GPU's K = V = 128: validate_decode, after every other check
  if (p.cu_seqlens == nullptr) {
    FLASHKDA_CHECK_ARG(p.T >= 1 && p.T <= kMaxDecodeTokens, "decode: T (tokens per sequence) must lie in [1, ",
                       kMaxDecodeTokens, "], got ", p.T);
  } else {
    FLASHKDA_CHECK_ARG(p.T >= 0, "decode: T (total tokens with cu_seqlens) must be >= 0, got ", p.T);
  }
  FLASHKDA_CHECK_ARG(p.pool_size >= 1, "decode: pool_size must be >= 1, got ", p.pool_size);
  FLASHKDA_CHECK_ARG(p.indices_stride >= 1, "decode: indices_stride must be >= 1, got ", p.indices_stride);
  const int64_t rows = p.cu_seqlens == nullptr ? p.num_seqs : 1;
  check_element_count("decode: q [N, T, H, K]", {rows, p.T, p.H, std::max(p.K, p.V)});
  check_element_count("decode: state_pool [P, H, V, K]", {p.pool_size, p.H, p.V, p.K});
  check_element_count("decode: state_indices [N, indices_stride]", {p.num_seqs, p.indices_stride});
  if (p.num_accepted_tokens != nullptr && p.cu_seqlens == nullptr) {
    FLASHKDA_CHECK_ARG(p.indices_stride >= p.T, "decode: indices_stride must be >= T (one slot per token) with "
                       "num_accepted_tokens, got indices_stride=", p.indices_stride, ", T=", p.T);
  }
}

// Host-readable cu_seqlens: starts at 0, ends at T, every length in [1, 16]. Returns the longest.
int64_t check_cu_seqlens(const DecodeParams& p) {
  FLASHKDA_CHECK_ARG(cu_at(p, 0) == 0, "decode: cu_seqlens[0] must be 0, got ", cu_at(p, 0));
  int64_t t_max = 0;
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t len = cu_at(p, n + 1) - cu_at(p, n);
    FLASHKDA_CHECK_ARG(len >= 1 && len <= kMaxDecodeTokens, "decode: every sequence must have 1..",
                       kMaxDecodeTokens, " tokens; cu_seqlens[", n + 1, "]=", cu_at(p, n + 1), " - cu_seqlens[", n,
                       "]=", cu_at(p, n), " = ", len);
    t_max = std::max(t_max, len);
  }
  FLASHKDA_CHECK_ARG(cu_at(p, p.num_seqs) == p.T, "decode: cu_seqlens[", p.num_seqs, "]=", cu_at(p, p.num_seqs),
                     " must equal T (total tokens) = ", p.T);
  return t_max;
}

void check_slot(const DecodeParams& p, int64_t n, int64_t t) {
  const int32_t slot = p.state_indices[n * p.indices_stride + t];
  FLASHKDA_CHECK_ARG(slot < p.pool_size, "decode: state_indices[", n, ", ", t, "]=", slot,
                     " must be < pool_size=", p.pool_size, " (negative marks padding)");
}

// Host-readable state_indices / num_accepted_tokens (CPU backend).
void check_indices(const DecodeParams& p) {
  thread_local std::vector<SlotUse> uses;  // kept: steady-state calls allocate nothing
  uses.clear();
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    if (p.num_accepted_tokens == nullptr) {
      check_slot(p, n, 0);
      const int32_t slot = p.state_indices[n * p.indices_stride];
      if (slot >= 0) uses.push_back({slot, n, "state_indices", n, 0});
      continue;
    }
    const int64_t accepted = p.num_accepted_tokens[n];
    FLASHKDA_CHECK_ARG(accepted >= 1 && accepted <= p.indices_stride, "decode: num_accepted_tokens[", n, "]=",
                       accepted, " must lie in [1, indices_stride=", p.indices_stride, "]");
    const int64_t len = p.cu_seqlens != nullptr ? cu_at(p, n + 1) - cu_at(p, n) : p.T;
    for (int64_t t = 0; t < std::max(len, accepted); ++t) {
      check_slot(p, n, t);
      const int32_t slot = p.state_indices[n * p.indices_stride + t];
      const bool used = t < len || t == accepted - 1;  // written after token t, or read as the start
      if (slot >= 0 && used) uses.push_back({slot, n, "state_indices", n, t});
    }
  }
  // No live slot may be used by two sequences: the GPU would race on it, and no order of the
  // sequences is defined.
  check_distinct_slots(uses, "decode: ", "two sequences of one call cannot share a state; negative marks padding");
}

}  // namespace

void validate_decode(const DecodeParams& p, Backend backend) {
  check_pointers(p);
  check_dtypes(p);
  check_shapes(p);
  validate_preprocess(p.pre);  // shared with prefill (validate.cpp)
  if (backend == Backend::kCuda) {
    // The GPU kernel moves q, k, v, g, dt_bias and the state with 16-byte vector accesses.
    check_aligned16({{p.q, "q"}, {p.k, "k"}, {p.v, "v"}, {p.g, "g"}, {p.state_pool, "state_pool"},
                     {p.pre.dt_bias, "dt_bias"}},
                    "decode: ");
    // What the GPU kernels serve of the valid calls (kUnsupported: NotImplementedError in Python).
    FLASHKDA_CHECK(p.K == kCudaHeadDim && p.V == kCudaHeadDim, ErrorCode::kUnsupported,
                   "decode: the GPU backend supports K = V = 128 only, got K=", p.K, ", V=", p.V);
    FLASHKDA_CHECK(p.dtype == DType::kBF16, ErrorCode::kUnsupported,
                   "decode: q, k, v, out must be bfloat16 on the GPU, got ", dtype_name(p.dtype));
    return;
  }
  validate_decode_indices(p);
}

void validate_decode_indices(const DecodeParams& p) {
  if (p.cu_seqlens != nullptr) {
    const int64_t t_max = check_cu_seqlens(p);
    if (p.num_accepted_tokens != nullptr) {
      FLASHKDA_CHECK_ARG(p.indices_stride >= t_max, "decode: indices_stride must be >= the longest sequence (",
                         t_max, ") with num_accepted_tokens, got ", p.indices_stride);
    }
  }
  check_indices(p);
}

}  // namespace flashkda::detail
