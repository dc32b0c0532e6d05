// Argument validation of a prefill problem (detail::validate_prefill): every check throws
// flashkda::Error(kInvalidArgument) naming the argument and the expectation, before any output
// is written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "backend.h"
#include "common/host_math.h"

namespace flashkda::detail {
namespace {

void check_float_dtype(const char* name, DType dtype) {
  FLASHKDA_CHECK_ARG(dtype == DType::kBF16 || dtype == DType::kF32, name, " must be bfloat16 or float32, got ",
                     dtype_name(dtype));
}

void check_shape(const PrefillParams& p) {
  FLASHKDA_CHECK_ARG(p.B >= 0, "B must be >= 0, got B=", p.B);
  FLASHKDA_CHECK_ARG(p.T >= 0, "T must be >= 0, got T=", p.T);
  FLASHKDA_CHECK_ARG(p.H >= 0, "H must be >= 0, got H=", p.H);
  // Every backend's range; the GPU serves K = V = 128 of it (check_cuda_serves, after every other check).
  FLASHKDA_CHECK_ARG(p.K >= 1 && p.K <= 256, "K must be in [1, 256], got K=", p.K);
  FLASHKDA_CHECK_ARG(p.V >= 1 && p.V <= 256, "V must be in [1, 256], got V=", p.V);
  check_element_count("q [B, T, H, K]", {p.B, p.T, p.H, p.K});
  check_element_count("v [B, T, H, V]", {p.B, p.T, p.H, p.V});
}

// Tensors with elements must be given; an empty problem (B*T*H == 0) may pass null pointers,
// as frameworks hand out null data pointers for empty tensors.
void check_pointers(const PrefillParams& p) {
  if (p.B * p.T * p.H == 0) return;
  FLASHKDA_CHECK_ARG(p.q != nullptr, "q must not be null (shape [B, T, H, K] = [", p.B, ", ", p.T, ", ", p.H, ", ",
                     p.K, "])");
  FLASHKDA_CHECK_ARG(p.k != nullptr, "k must not be null");
  FLASHKDA_CHECK_ARG(p.v != nullptr, "v must not be null");
  FLASHKDA_CHECK_ARG(p.g != nullptr, "g must not be null");
  FLASHKDA_CHECK_ARG(p.beta != nullptr, "beta must not be null");
  FLASHKDA_CHECK_ARG(p.out != nullptr, "out must not be null");
}

void check_dtypes(const PrefillParams& p) {
  // bf16 only on the GPU: check_cuda_serves, after every other check.
  FLASHKDA_CHECK_ARG(p.dtype == DType::kBF16 || p.dtype == DType::kF32,
                     "dtype (of q, k, v, out) must be bfloat16 or float32, got ", dtype_name(p.dtype));
  check_float_dtype("g_dtype", p.g_dtype);
  check_float_dtype("beta_dtype", p.beta_dtype);
  if (p.initial_state != nullptr) check_float_dtype("initial_state_dtype", p.initial_state_dtype);
  if (p.final_state != nullptr) check_float_dtype("final_state_dtype", p.final_state_dtype);
}

template <typename I>
void check_cu_seqlens_values(const I* cu, int64_t num_seqs, int64_t total) {
  FLASHKDA_CHECK_ARG(cu[0] == 0, "cu_seqlens[0] must be 0, got ", int64_t(cu[0]));
  for (int64_t n = 1; n <= num_seqs; ++n) {
    FLASHKDA_CHECK_ARG(cu[n] >= cu[n - 1], "cu_seqlens must be non-decreasing; cu_seqlens[", n, "]=", int64_t(cu[n]),
                       " < cu_seqlens[", n - 1, "]=", int64_t(cu[n - 1]));
  }
  FLASHKDA_CHECK_ARG(cu[num_seqs] == total, "cu_seqlens[", num_seqs, "]=", int64_t(cu[num_seqs]),
                     " must equal the token count B*T=", total);
}

void check_cu_seqlens(const PrefillParams& p, Backend backend) {
  if (p.cu_seqlens == nullptr) return;
  FLASHKDA_CHECK_ARG(p.B == 1, "B must be 1 when cu_seqlens is given (tokens are packed along T), got B=", p.B);
  FLASHKDA_CHECK_ARG(p.num_seqs >= 0, "num_seqs must be >= 0 with cu_seqlens, got num_seqs=", p.num_seqs);
  FLASHKDA_CHECK_ARG(p.cu_seqlens_dtype == DType::kI32 || p.cu_seqlens_dtype == DType::kI64,
                     "cu_seqlens_dtype must be int32 or int64, got ", dtype_name(p.cu_seqlens_dtype));
  // Device-resident offsets cannot be read without a synchronisation; the CPU backend checks them.
  if (backend != Backend::kCpu) return;
  // num_seqs == 0 is legal: cu_seqlens = [0] then demands T == 0 through the last check.
  if (p.cu_seqlens_dtype == DType::kI64) {
    check_cu_seqlens_values(static_cast<const int64_t*>(p.cu_seqlens), p.num_seqs, p.B * p.T);
  } else {
    check_cu_seqlens_values(static_cast<const int32_t*>(p.cu_seqlens), p.num_seqs, p.B * p.T);
  }
}

// Serving prefill (docs/SPEC.md §9): the pool fields, then the checkpoint fields.
void check_pool(const PrefillParams& p) {
  if (p.state_pool == nullptr) {
    FLASHKDA_CHECK_ARG(p.state_indices == nullptr, "state_indices needs state_pool (the pool it indexes)");
    FLASHKDA_CHECK_ARG(p.has_initial_state == nullptr, "has_initial_state needs state_pool");
    FLASHKDA_CHECK_ARG(p.checkpoint_slots == nullptr, "checkpoint_slots needs state_pool (the pool it indexes)");
    return;
  }
  FLASHKDA_CHECK_ARG(p.initial_state == nullptr && p.final_state == nullptr,
                     "state_pool replaces initial_state and final_state: pass either the pool or the state tensors");
  check_float_dtype("state_pool_dtype", p.state_pool_dtype);
  FLASHKDA_CHECK_ARG(p.pool_size >= 0, "pool_size must be >= 0, got ", p.pool_size);
  check_element_count("state_pool [P, H, V, K]", {p.pool_size, p.H, p.V, p.K});
  FLASHKDA_CHECK_ARG(p.state_indices != nullptr || num_sequences(p) == 0,
                     "state_indices must not be null with state_pool (the slot of each sequence, [N] int32)");
}

void check_checkpoints(const PrefillParams& p) {
  if (p.checkpoint_every == 0) {
    FLASHKDA_CHECK_ARG(p.checkpoints == nullptr && p.checkpoint_slots == nullptr,
                       "checkpoints / checkpoint_slots need checkpoint_every > 0");
    return;
  }
  FLASHKDA_CHECK_ARG(p.checkpoint_every > 0 && p.checkpoint_every % 64 == 0,
                     "checkpoint_every must be a positive multiple of 64 (or 0: no checkpoints), got ",
                     p.checkpoint_every);
  FLASHKDA_CHECK_ARG((p.checkpoints != nullptr) + (p.checkpoint_slots != nullptr) == 1 || p.num_checkpoints == 0,
                     "checkpoint_every=", p.checkpoint_every,
                     " needs exactly one destination: checkpoints (a dense tensor) or checkpoint_slots (pool slots)");
  FLASHKDA_CHECK_ARG(p.num_checkpoints >= 0, "num_checkpoints must be >= 0, got ", p.num_checkpoints);
  if (p.checkpoints != nullptr) check_float_dtype("checkpoint_dtype", p.checkpoint_dtype);
  check_element_count("checkpoints [num_checkpoints, H, V, K]", {p.num_checkpoints, p.H, p.V, p.K});
}

// The caller's num_checkpoints equal to what the lengths give (host-readable cu_seqlens, or none).
void check_checkpoint_count(const PrefillParams& p) {
  if (p.checkpoint_every <= 0) return;
  const int64_t want = checkpoint_count(p);
  FLASHKDA_CHECK_ARG(p.num_checkpoints == want, "num_checkpoints must be ", want, " (the sum over sequences of ",
                     "floor(length / checkpoint_every=", p.checkpoint_every, ")), got ", p.num_checkpoints);
}

// Host-readable indices (CPU backend): slots inside the pool, no live slot named twice, and the
// caller's num_checkpoints equal to what the lengths give.
void check_pool_indices(const PrefillParams& p) {
  check_checkpoint_count(p);
  if (p.state_pool == nullptr) return;
  check_pool_slots(p.state_indices, num_sequences(p), p.checkpoint_slots,
                   p.checkpoint_slots != nullptr ? p.num_checkpoints : 0, p.pool_size);
}

}  // namespace

void check_pool_slots(const int32_t* state_indices, int64_t num_seqs, const int32_t* checkpoint_slots,
                      int64_t num_checkpoints, int64_t pool_size) {
  thread_local std::vector<SlotUse> uses;  // kept: steady-state calls allocate nothing
  uses.clear();
  for (int64_t n = 0; n < num_seqs; ++n) {
    const int32_t slot = state_indices[n];
    FLASHKDA_CHECK_ARG(slot < pool_size, "state_indices[", n, "]=", slot, " must be < pool_size=", pool_size,
                       " (negative marks padding)");
    if (slot >= 0) uses.push_back({slot, int64_t(uses.size()), "state_indices", n, -1});
  }
  for (int64_t c = 0; c < num_checkpoints; ++c) {
    const int32_t slot = checkpoint_slots[c];
    FLASHKDA_CHECK_ARG(slot < pool_size, "checkpoint_slots[", c, "]=", slot, " must be < pool_size=", pool_size,
                       " (negative: not written)");
    if (slot >= 0) uses.push_back({slot, int64_t(uses.size()), "checkpoint_slots", c, -1});
  }
  check_distinct_slots(uses, "", "each slot holds one state: a sequence's or one checkpoint's; negative skips");
}

void check_distinct_slots(std::vector<SlotUse>& uses, const char* prefix, const char* why) {
  std::sort(uses.begin(), uses.end(),
            [](const SlotUse& a, const SlotUse& b) { return a.slot != b.slot ? a.slot < b.slot : a.owner < b.owner; });
  auto where = [](const SlotUse& u) {
    return std::string(u.array) + "[" + std::to_string(u.i) + (u.j >= 0 ? ", " + std::to_string(u.j) : "") + "]";
  };
  for (size_t i = 1; i < uses.size(); ++i) {
    const SlotUse& a = uses[i - 1];
    const SlotUse& b = uses[i];
    if (a.slot == b.slot && a.owner != b.owner) {
      FLASHKDA_CHECK_ARG(false, prefix, where(a), " and ", where(b), " both name slot ", a.slot, " (", why, ")");
    }
  }
}

void validate_preprocess(const Preprocess& pre) {
  switch (pre.gate) {
    case GateForm::kLowerBound:
      // Written as a negated range test so that NaN is rejected as well.
      FLASHKDA_CHECK_ARG(pre.lower_bound >= -5.0f && pre.lower_bound < 0.0f,
                         "lower_bound must lie in [-5, 0) for the lower-bound gate, got ", pre.lower_bound);
      FLASHKDA_CHECK_ARG(pre.A_log != nullptr, "A_log must not be null for the lower_bound gate form");
      break;
    case GateForm::kSoftplus:
      FLASHKDA_CHECK_ARG(pre.A_log != nullptr, "A_log must not be null for the softplus gate form");
      break;
    case GateForm::kPrecomputed:
      break;
    default:
      FLASHKDA_CHECK_ARG(false, "gate must be a GateForm (lower_bound, softplus or precomputed), got ",
                         int(pre.gate));
  }
  if (pre.has_scale) {
    FLASHKDA_CHECK_ARG(std::isfinite(pre.scale), "scale must be finite when has_scale is set, got ", pre.scale);
  }
}

int64_t check_element_count(const char* what, std::initializer_list<int64_t> dims) {
  int64_t n = 1;
  bool too_many = false;
  for (int64_t d : dims) too_many = too_many || __builtin_mul_overflow(n, d, &n) || n > kMaxElements;
  if (too_many) {
    std::string shape;
    for (int64_t d : dims) shape += (shape.empty() ? "[" : ", ") + std::to_string(d);
    FLASHKDA_CHECK_ARG(false, what, ": shape ", shape, "] gives more than 2^56 elements");
  }
  return n;
}

void check_memory_space(Backend backend, int device, const char* name, const PointerInfo& info, const char* prefix) {
  if (backend == Backend::kCpu) {
    FLASHKDA_CHECK_ARG(info.space != MemorySpace::kDevice, prefix, name, " is device memory (device ", info.device,
                       ") but q is host memory: the call runs on the CPU, which cannot read it");
    return;
  }
  FLASHKDA_CHECK_ARG(info.space != MemorySpace::kHost, prefix, name,
                     " is pageable host memory but q is on the GPU: the kernels cannot read it (pass device, "
                     "managed or page-locked memory)");
  FLASHKDA_CHECK_ARG(info.space != MemorySpace::kDevice || info.device == device, prefix, name, " is on device ",
                     info.device, " but the call runs on device ", device,
                     " (the current device; make the tensors' device current)");
}

void check_aligned16(std::initializer_list<NamedPointer> tensors, const char* prefix) {
  for (const NamedPointer& t : tensors) {
    FLASHKDA_CHECK_ARG(reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0, prefix, t.name,
                       " must be 16-byte aligned on the GPU");
  }
}

// What the GPU kernels serve of the valid calls: K = V = 128 and bf16 q, k, v, out. Otherwise
// kUnsupported (NotImplementedError in Python), as decode's K; checked after every argument check, so
// that a bad argument is named as one (kInvalidArgument) whatever the shape.
void check_cuda_serves(const PrefillParams& p) {
  FLASHKDA_CHECK(p.K == kCudaHeadDim, ErrorCode::kUnsupported, "K must be 128 on the CUDA backend, got K=", p.K);
  FLASHKDA_CHECK(p.V == kCudaHeadDim, ErrorCode::kUnsupported, "V must be 128 on the CUDA backend, got V=", p.V);
  FLASHKDA_CHECK(p.dtype == DType::kBF16, ErrorCode::kUnsupported,
                 "dtype (of q, k, v, out) must be bfloat16 on the CUDA backend, got ", dtype_name(p.dtype));
}

void validate_prefill(const PrefillParams& p, Backend backend) {
  check_shape(p);
  check_pointers(p);
  check_dtypes(p);
  // Before cu_seqlens is read: a huge num_seqs fails here, not by reading past its end. (A negative
  // one passes this product and is named by check_cu_seqlens.)
  check_element_count("states [N, H, V, K]", {num_sequences(p), p.H, p.V, p.K});
  check_cu_seqlens(p, backend);
  check_pool(p);
  check_checkpoints(p);
  if (backend == Backend::kCpu) check_pool_indices(p);
  validate_preprocess(p.pre);
  FLASHKDA_CHECK_ARG(p.precision == Precision::kPrecise || p.precision == Precision::kBalanced ||
                         p.precision == Precision::kFast,
                     "precision must be Precision::kPrecise, kBalanced or kFast, got ", int(p.precision));
  if (backend == Backend::kCuda) {
    // The indices and lengths live on the GPU: slots outside [0, P) are padding there (as in
    // decode); a live slot named twice, and with cu_seqlens a num_checkpoints other than the
    // lengths give, make K0 refuse the call (NaN outputs, the pool untouched); without cu_seqlens
    // the host counts the checkpoints.
    if (p.cu_seqlens == nullptr) check_checkpoint_count(p);
    // K1's grid has one CTA per (chunk slot, head): at most one partial chunk per sequence.
    const int64_t chunk_slots = (p.B * p.T + kChunk - 1) / kChunk + num_sequences(p);
    FLASHKDA_CHECK(chunk_slots <= std::numeric_limits<int32_t>::max() / std::max<int64_t>(p.H, 1),
                   ErrorCode::kUnsupported, "(B*T/16 + N) * H = (", p.B * p.T, "/16 + ", num_sequences(p), ") * ",
                   p.H, " chunk-head pairs exceed the GPU grid limit (2^31 - 1)");
    check_aligned16({{p.q, "q"}, {p.k, "k"}, {p.v, "v"}, {p.g, "g"}, {p.out, "out"}, {p.pre.dt_bias, "dt_bias"},
                     {p.initial_state, "initial_state"}, {p.final_state, "final_state"}, {p.state_pool, "state_pool"},
                     {p.checkpoints, "checkpoints"}},
                    "");
    check_cuda_serves(p);
  }
}

}  // namespace flashkda::detail
