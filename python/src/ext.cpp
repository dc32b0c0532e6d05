// flashkda._C: nanobind bindings of the C++ API (include/flashkda/flashkda.h). Arrays arrive from
// any DLPack framework (numpy, torch, jax, cupy) as nb::ndarray; this file reads their pointer,
// shape, dtype and device, checks shapes against each other and fills PrefillParams/DecodeParams.
// flashkda::Error becomes ValueError (kInvalidArgument), NotImplementedError (kUnsupported) or
// RuntimeError (kCuda, kInternal).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flashkda/flashkda.h"
#include "launch_config.h"

namespace nb = nanobind;

namespace flashkda::python {
namespace {

using InArray = nb::ndarray<nb::ro>;  // inputs: any dtype, shape and device; read-only is fine
using OutArray = nb::ndarray<>;       // outputs: must be writable
using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

// DLPack device types (dlpack.h): host-readable memory vs CUDA device memory.
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;
constexpr int kDLCUDAManaged = 13;

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: return "dlpack dtype code " + std::to_string(int(t.code));
  }
  return kind + std::to_string(int(t.bits));
}

// Strides (in elements) of a dense row-major array; size-1 dims may have any stride, and an empty
// array is always fine.
template <typename Array>
bool is_c_contiguous(const Array& a) {
  int64_t expected = 1;
  bool contiguous = true;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) contiguous = false;
    expected *= int64_t(a.shape(i));
  }
  return contiguous || expected == 0;
}

// One array argument as the C++ API sees it: pointer, element type, shape and location.
struct View {
  std::string name;
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int device_type = kDLCPU;
  int device_id = 0;
  bool is_bool = false;  // a bool array (make_view with bools=true); dtype is then unused

  bool on_cuda() const { return device_type == kDLCUDA || device_type == kDLCUDAManaged; }
  int64_t dim(size_t i) const { return shape[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  std::string where() const { return on_cuda() ? "cuda:" + std::to_string(device_id) : "cpu"; }
};

// bools: the array must be bool (one byte per element), as has_initial_state is.
template <typename Array>
View make_view(const char* name, const Array& a, bool u16_is_bf16, bool bools = false) {
  View v;
  v.name = name;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.device_type = a.device_type();
  v.device_id = a.device_id();
  for (size_t i = 0; i < a.ndim(); ++i) v.shape.push_back(int64_t(a.shape(i)));

  const nb::dlpack::dtype t = a.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  FLASHKDA_CHECK_ARG(t.lanes == 1, name, ": vector dtypes (lanes=", int(t.lanes), ") are not supported");
  if (bools) {
    FLASHKDA_CHECK_ARG(code == nb::dlpack::dtype_code::Bool && t.bits == 8, name, ": expected dtype bool, got ",
                       dlpack_dtype_name(t));
    v.is_bool = true;
  } else if (code == nb::dlpack::dtype_code::Float && t.bits == 32) {
    v.dtype = DType::kF32;
  } else if (code == nb::dlpack::dtype_code::Bfloat && t.bits == 16) {
    v.dtype = DType::kBF16;
  } else if (code == nb::dlpack::dtype_code::UInt && t.bits == 16 && u16_is_bf16) {
    v.dtype = DType::kBF16;  // numpy + ml_dtypes bfloat16, viewed as uint16 on the Python side
  } else if (code == nb::dlpack::dtype_code::Int && t.bits == 32) {
    v.dtype = DType::kI32;
  } else if (code == nb::dlpack::dtype_code::Int && t.bits == 64) {
    v.dtype = DType::kI64;
  } else {
    FLASHKDA_CHECK_ARG(false, name, ": dtype ", dlpack_dtype_name(t), " is not supported",
                       (code == nb::dlpack::dtype_code::UInt && t.bits == 16)
                           ? " (uint16 holding bfloat16 bits needs u16_is_bf16=True)"
                           : "");
  }

  FLASHKDA_CHECK_ARG(v.device_type == kDLCPU || v.device_type == kDLCUDAHost || v.on_cuda(), name,
                     ": arrays on DLPack device type ", v.device_type,
                     " are not supported (expected CPU or CUDA memory)");

  FLASHKDA_CHECK_ARG(is_c_contiguous(a), name, ": must be C-contiguous (dense row-major); shape ",
                     shape_str(v.shape));
  return v;
}

View view_in(const char* name, const InArray& a, bool u16_is_bf16) { return make_view(name, a, u16_is_bf16); }
View view_out(const char* name, const OutArray& a, bool u16_is_bf16) { return make_view(name, a, u16_is_bf16); }

void expect_shape(const View& v, const std::vector<int64_t>& shape) {
  FLASHKDA_CHECK_ARG(v.shape == shape, v.name, ": expected shape ", shape_str(shape), ", got ",
                     shape_str(v.shape));
}

// v [B, T, HV, V] with HV != H: fla's grouped value heads, named as such.
void expect_value_heads(const View& v, int64_t B, int64_t T, int64_t H) {
  FLASHKDA_CHECK_ARG(!(v.dim(0) == B && v.dim(1) == T && v.dim(2) != H), "v: grouped value heads (HV=", v.dim(2),
                     " != H=", H, ") are not supported; expected shape [", B, ", ", T, ", ", H, ", V]");
}

// beta [B, T, H]; a per-channel beta [B, T, H, V] is named as such.
void expect_beta(const View& beta, int64_t B, int64_t T, int64_t H, int64_t V) {
  FLASHKDA_CHECK_ARG(beta.shape != std::vector<int64_t>({B, T, H, V}), "beta: per-channel beta [B, T, H, V] is not ",
                     "supported; expected shape ", shape_str({B, T, H}));
  expect_shape(beta, {B, T, H});
}

void expect_rank(const View& v, size_t rank, const char* layout) {
  FLASHKDA_CHECK_ARG(v.shape.size() == rank, v.name, ": expected a ", rank, "-d array ", layout, ", got shape ",
                     shape_str(v.shape));
}

void expect_dtype(const View& v, DType want) {
  FLASHKDA_CHECK_ARG(v.dtype == want, v.name, ": expected dtype ", dtype_name(want), ", got ", dtype_name(v.dtype));
}

void expect_float(const View& v) {
  FLASHKDA_CHECK_ARG(v.dtype == DType::kF32 || v.dtype == DType::kBF16, v.name,
                     ": expected dtype bfloat16 or float32, got ", dtype_name(v.dtype));
}

// Every array of one call lives in the same memory: all host-readable, or all on one CUDA device.
void expect_same_device(const View& ref, const View& v) {
  FLASHKDA_CHECK_ARG(ref.on_cuda() == v.on_cuda() && (!ref.on_cuda() || ref.device_id == v.device_id), v.name,
                     ": is on ", v.where(), " but ", ref.name, " is on ", ref.where(),
                     " (all arrays of one call must live on the same device)");
}

GateForm parse_gate(const std::string& gate) {
  if (gate == "lower_bound") return GateForm::kLowerBound;
  if (gate == "softplus") return GateForm::kSoftplus;
  if (gate == "precomputed") return GateForm::kPrecomputed;
  FLASHKDA_CHECK_ARG(false, "gate: expected 'lower_bound', 'softplus' or 'precomputed', got '", gate, "'");
  return GateForm::kPrecomputed;
}

Precision parse_precision(const std::string& precision) {
  if (precision == "precise") return Precision::kPrecise;
  if (precision == "balanced") return Precision::kBalanced;
  if (precision == "fast") return Precision::kFast;
  FLASHKDA_CHECK_ARG(false, "precision: expected 'precise', 'balanced' or 'fast', got '", precision, "'");
  return Precision::kPrecise;
}

// The preprocessing options shared by forward, reference_forward and decode (docs/SPEC.md §2).
struct PreArgs {
  OptIn A_log, dt_bias;
  std::string gate;
  float lower_bound;
  bool l2norm_qk, beta_is_logit;
  std::optional<float> scale;
};

Preprocess make_preprocess(const PreArgs& a, const View& q, int64_t H, int64_t K, std::vector<View>& views) {
  Preprocess pre;
  pre.gate = parse_gate(a.gate);
  pre.lower_bound = a.lower_bound;
  pre.l2norm_qk = a.l2norm_qk;
  pre.beta_is_logit = a.beta_is_logit;
  pre.has_scale = a.scale.has_value();
  pre.scale = a.scale.value_or(0.0f);
  if (pre.gate != GateForm::kPrecomputed) {
    FLASHKDA_CHECK_ARG(a.A_log.has_value(), "A_log: required for the ", gate_form_name(pre.gate), " gate ([H]=[",
                       H, "] float32)");
  }
  if (a.A_log) {
    View v = view_in("A_log", *a.A_log, false);
    expect_dtype(v, DType::kF32);
    expect_shape(v, {H});
    expect_same_device(q, v);
    pre.A_log = static_cast<const float*>(v.data);
    views.push_back(v);
  }
  if (a.dt_bias) {
    View v = view_in("dt_bias", *a.dt_bias, false);
    expect_dtype(v, DType::kF32);
    FLASHKDA_CHECK_ARG(v.shape == std::vector<int64_t>({H, K}) || v.shape == std::vector<int64_t>({H * K}),
                       "dt_bias: expected shape [", H, ", ", K, "] or [", H * K, "], got ", shape_str(v.shape));
    expect_same_device(q, v);
    pre.dt_bias = static_cast<const float*>(v.data);
    views.push_back(v);
  }
  return pre;
}

// cu_seqlens [N + 1] (int32 or int64) of packed sequences; the batch size B of q must be 1.
View view_cu_seqlens(const InArray& a, int64_t B) {
  View cu = view_in("cu_seqlens", a, false);
  expect_rank(cu, 1, "[N + 1]");
  FLASHKDA_CHECK_ARG(cu.dtype == DType::kI32 || cu.dtype == DType::kI64,
                     "cu_seqlens: expected dtype int32 or int64, got ", dtype_name(cu.dtype));
  FLASHKDA_CHECK_ARG(cu.dim(0) >= 1, "cu_seqlens: needs at least one entry (N + 1 boundaries), got shape ",
                     shape_str(cu.shape));
  FLASHKDA_CHECK_ARG(B == 1, "q: with cu_seqlens the batch size B must be 1 (flatten the sequences), got B=", B);
  return cu;
}

// The tensors of one prefill problem, checked against each other (docs/SPEC.md §1).
struct PrefillArrays {
  PrefillParams p;
  View q;
  int64_t N = 0;
};

PrefillArrays make_prefill(const InArray& q_, const InArray& k_, const InArray& v_, const InArray& g_,
                           const InArray& beta_, const OptIn& initial_state_, const OptIn& cu_seqlens_,
                           const PreArgs& pre_args, bool u16_is_bf16) {
  PrefillArrays r;
  PrefillParams& p = r.p;
  View q = view_in("q", q_, u16_is_bf16);
  expect_rank(q, 4, "[B, T, H, K]");
  expect_float(q);
  View v = view_in("v", v_, u16_is_bf16);
  expect_rank(v, 4, "[B, T, H, V]");
  p.B = q.dim(0), p.T = q.dim(1), p.H = q.dim(2), p.K = q.dim(3), p.V = v.dim(3);
  View k = view_in("k", k_, u16_is_bf16);
  View g = view_in("g", g_, u16_is_bf16);
  View beta = view_in("beta", beta_, u16_is_bf16);
  expect_shape(k, q.shape);
  expect_value_heads(v, p.B, p.T, p.H);
  expect_shape(v, {p.B, p.T, p.H, p.V});
  expect_shape(g, q.shape);
  expect_beta(beta, p.B, p.T, p.H, p.V);
  expect_dtype(k, q.dtype);
  expect_dtype(v, q.dtype);
  expect_float(g);
  expect_float(beta);
  std::vector<View> views = {k, v, g, beta};

  r.N = p.B;
  if (cu_seqlens_) {
    const View cu = view_cu_seqlens(*cu_seqlens_, p.B);
    p.cu_seqlens = cu.data;
    p.cu_seqlens_dtype = cu.dtype;
    p.num_seqs = r.N = cu.dim(0) - 1;
    views.push_back(cu);
  }
  if (initial_state_) {
    View h0 = view_in("initial_state", *initial_state_, u16_is_bf16);
    expect_float(h0);
    expect_shape(h0, {r.N, p.H, p.V, p.K});
    p.initial_state = h0.data;
    p.initial_state_dtype = h0.dtype;
    views.push_back(h0);
  }
  p.pre = make_preprocess(pre_args, q, p.H, p.K, views);
  for (const View& x : views) expect_same_device(q, x);

  p.q = q.data, p.k = k.data, p.v = v.data, p.g = g.data, p.beta = beta.data;
  p.dtype = q.dtype, p.g_dtype = g.dtype, p.beta_dtype = beta.dtype;
  r.q = q;
  return r;
}

void attach_outputs(PrefillArrays& r, const OutArray& out_, const OptOut& final_state_, bool u16_is_bf16) {
  PrefillParams& p = r.p;
  View out = view_out("out", out_, u16_is_bf16);
  expect_shape(out, {p.B, p.T, p.H, p.V});
  expect_dtype(out, p.dtype);
  expect_same_device(r.q, out);
  p.out = out.data;
  if (final_state_) {
    View ht = view_out("final_state", *final_state_, u16_is_bf16);
    expect_float(ht);
    expect_shape(ht, {r.N, p.H, p.V, p.K});
    expect_same_device(r.q, ht);
    p.final_state = ht.data;
    p.final_state_dtype = ht.dtype;
  }
}

// Serving prefill (docs/SPEC.md §9): the pool, its indices and the checkpoints.
struct ServingArgs {
  OptOut state_pool;
  OptIn state_indices, has_initial_state;
  int64_t checkpoint_every = 0;
  OptOut checkpoints;
  OptIn checkpoint_slots;
};

// fp64_checkpoints: reference_forward's checkpoints are float64 (taken by the caller), so only
// their count is read here.
void attach_serving(PrefillArrays& r, const ServingArgs& a, bool u16_is_bf16, bool fp64_checkpoints = false) {
  PrefillParams& p = r.p;
  const int64_t N = r.N;
  if (a.state_pool) {
    View pool = view_out("state_pool", *a.state_pool, u16_is_bf16);
    expect_rank(pool, 4, "[P, H, V, K]");
    expect_float(pool);
    expect_shape(pool, {pool.dim(0), p.H, p.V, p.K});
    expect_same_device(r.q, pool);
    p.state_pool = pool.data, p.state_pool_dtype = pool.dtype, p.pool_size = pool.dim(0);
  }
  if (a.state_indices) {
    View idx = view_in("state_indices", *a.state_indices, false);
    expect_dtype(idx, DType::kI32);
    expect_shape(idx, {N});
    expect_same_device(r.q, idx);
    p.state_indices = static_cast<const int32_t*>(idx.data);
  }
  if (a.has_initial_state) {
    View has = make_view("has_initial_state", *a.has_initial_state, false, /*bools=*/true);
    expect_shape(has, {N});
    expect_same_device(r.q, has);
    p.has_initial_state = static_cast<const bool*>(has.data);
  }
  p.checkpoint_every = a.checkpoint_every;
  if (a.checkpoints) {
    FLASHKDA_CHECK_ARG(a.checkpoints->ndim() == 4, "checkpoints: expected a 4-d array [num_checkpoints, H, V, K]");
    const int64_t count = int64_t(a.checkpoints->shape(0));
    if (!fp64_checkpoints) {
      View ck = view_out("checkpoints", *a.checkpoints, u16_is_bf16);
      expect_float(ck);
      expect_same_device(r.q, ck);
      p.checkpoints = ck.data, p.checkpoint_dtype = ck.dtype;
    }
    const std::vector<int64_t> want = {count, p.H, p.V, p.K};
    std::vector<int64_t> got;
    for (size_t i = 0; i < 4; ++i) got.push_back(int64_t(a.checkpoints->shape(i)));
    FLASHKDA_CHECK_ARG(got == want, "checkpoints: expected shape ", shape_str(want), ", got ", shape_str(got));
    p.num_checkpoints = count;
  }
  if (a.checkpoint_slots) {
    View slots = view_in("checkpoint_slots", *a.checkpoint_slots, false);
    expect_dtype(slots, DType::kI32);
    expect_rank(slots, 1, "[num_checkpoints]");
    FLASHKDA_CHECK_ARG(!a.checkpoints || slots.dim(0) == p.num_checkpoints, "checkpoint_slots: expected shape [",
                       p.num_checkpoints, "] like checkpoints, got ", shape_str(slots.shape));
    expect_same_device(r.q, slots);
    p.checkpoint_slots = static_cast<const int32_t*>(slots.data);
    p.num_checkpoints = slots.dim(0);
  }
}

// A workspace array's raw bytes (any dtype: only where it lives matters), on q's device.
std::pair<void*, size_t> workspace_bytes(const OutArray& a, const View& q) {
  View w;
  w.name = "workspace";
  w.device_type = a.device_type();
  w.device_id = a.device_id();
  expect_same_device(q, w);
  return {a.data(), size_t(a.nbytes())};
}

void forward(const InArray& q, const InArray& k, const InArray& v, const InArray& g, const InArray& beta,
             const OutArray& out, OptIn A_log, OptIn dt_bias, const std::string& gate, float lower_bound,
             bool l2norm_qk, bool beta_is_logit, std::optional<float> scale, OptIn initial_state,
             OptOut final_state, OptIn cu_seqlens, OptOut state_pool, OptIn state_indices, OptIn has_initial_state,
             int64_t checkpoint_every, OptOut checkpoints, OptIn checkpoint_slots, OptOut workspace,
             nb::object workspace_alloc, uintptr_t stream, bool u16_is_bf16, const std::string& precision,
             int v_splits, int64_t segment_chunks, int f16_operands, int ckpt_in_segments, int skip_transitions,
             int64_t skip_run_chunks, int64_t skip_warmup_chunks, int seg_ctas_per_sm, int record_copy,
             int early_launch, int cpu_isa, int skip_bound, int fused_v2,
             int64_t fused_min_tokens, int64_t fused_pieces, int fused_warmup, int fused_order, int fused_chain,
             int lowrank_transitions, int pieces_graph_if) {
  PreArgs pre{A_log, dt_bias, gate, lower_bound, l2norm_qk, beta_is_logit, scale};
  PrefillArrays r = make_prefill(q, k, v, g, beta, initial_state, cu_seqlens, pre, u16_is_bf16);
  attach_outputs(r, out, final_state, u16_is_bf16);
  attach_serving(r, {state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints, checkpoint_slots},
                 u16_is_bf16);
  r.p.precision = parse_precision(precision);
  internal::PrefillLaunch launch;  // by name: a field added to PrefillLaunch keeps its default here
  launch.v_splits = v_splits, launch.segment_chunks = segment_chunks, launch.f16_operands = f16_operands;
  launch.checkpoints_in_segments = ckpt_in_segments, launch.skip_transitions = skip_transitions;
  launch.skip_run_chunks = skip_run_chunks, launch.skip_warmup_chunks = skip_warmup_chunks;
  launch.seg_ctas_per_sm = seg_ctas_per_sm, launch.record_copy = record_copy, launch.early_launch = early_launch;
  launch.cpu_isa = cpu_isa, launch.skip_bound = skip_bound, launch.fused_v2 = fused_v2;
  launch.fused_min_tokens = fused_min_tokens;
  launch.fused_pieces = fused_pieces, launch.fused_warmup = fused_warmup, launch.fused_order = fused_order;
  launch.fused_chain = fused_chain, launch.lowrank_transitions = lowrank_transitions;
  launch.pieces_graph_if = pieces_graph_if;
  // workspace_alloc(nbytes) -> array: asked only when no workspace was passed and the backend needs
  // one, after the library validated the call (once: workspace_size and then forward validate twice).
  if (!workspace && !workspace_alloc.is_none()) {
    nb::object allocated;  // kept until the kernels are queued (the caller's allocator orders its reuse)
    const std::function<void*(size_t)> alloc = [&](size_t nbytes) -> void* {
      nb::gil_scoped_acquire gil;
      allocated = workspace_alloc(nbytes);
      const OutArray array = nb::cast<OutArray>(allocated);  // a view of `allocated`, which owns the bytes
      const auto [data, bytes] = workspace_bytes(array, r.q);
      FLASHKDA_CHECK_ARG(bytes >= nbytes, "workspace_alloc: returned ", bytes, " bytes, need ", nbytes);
      return data;
    };
    nb::gil_scoped_release nogil;
    internal::forward_allocating(r.p, launch, alloc, reinterpret_cast<Stream>(stream));
    return;
  }
  void* ws = nullptr;
  size_t ws_bytes = 0;
  if (workspace) {
    std::tie(ws, ws_bytes) = workspace_bytes(*workspace, r.q);
  }
  nb::gil_scoped_release nogil;
  internal::forward(r.p, launch, ws, ws_bytes, reinterpret_cast<Stream>(stream));
}

// An index array the slot checks below read on the host.
View host_view(const char* name, const InArray& a) {
  View v = view_in(name, a, false);
  FLASHKDA_CHECK_ARG(!v.on_cuda(), name, ": must be host memory here");
  return v;
}

// internal::check_pool_slots on host int32 index arrays (the Python path that hands forward a
// gathered copy of the named slots).
void check_pool_slots(const InArray& state_indices, OptIn checkpoint_slots, int64_t pool_size) {
  auto host_indices = [](const char* name, const InArray& a) {
    View v = host_view(name, a);
    expect_dtype(v, DType::kI32);
    expect_rank(v, 1, "[n]");
    return v;
  };
  const View idx = host_indices("state_indices", state_indices);
  std::optional<View> ck;
  if (checkpoint_slots) ck = host_indices("checkpoint_slots", *checkpoint_slots);
  internal::check_pool_slots(static_cast<const int32_t*>(idx.data), idx.dim(0),
                             ck ? static_cast<const int32_t*>(ck->data) : nullptr, ck ? ck->dim(0) : 0, pool_size);
}

// internal::check_decode_slots on host arrays: state_indices [N] or [N, S] int32, num_accepted_tokens
// [N] int32, cu_seqlens [N + 1] int32/int64, T the tokens (per sequence, or in all with cu_seqlens).
void check_decode_slots(const InArray& state_indices, OptIn num_accepted_tokens, OptIn cu_seqlens, int64_t T,
                        int64_t pool_size) {
  const View idx = host_view("state_indices", state_indices);
  expect_dtype(idx, DType::kI32);
  FLASHKDA_CHECK_ARG(idx.shape.size() == 1 || idx.shape.size() == 2, "state_indices: expected [N] or [N, S]");
  DecodeParams p;
  p.state_indices = static_cast<const int32_t*>(idx.data);
  p.num_seqs = idx.dim(0);
  p.indices_stride = idx.shape.size() == 2 ? idx.dim(1) : 1;
  p.T = T, p.pool_size = pool_size;
  if (num_accepted_tokens) {
    const View acc = host_view("num_accepted_tokens", *num_accepted_tokens);
    expect_dtype(acc, DType::kI32);
    p.num_accepted_tokens = static_cast<const int32_t*>(acc.data);
  }
  if (cu_seqlens) {
    const View cu = host_view("cu_seqlens", *cu_seqlens);
    FLASHKDA_CHECK_ARG(cu.dtype == DType::kI32 || cu.dtype == DType::kI64, "cu_seqlens: expected int32 or int64");
    p.cu_seqlens = cu.data, p.cu_seqlens_dtype = cu.dtype;
  }
  internal::check_decode_slots(p);
}

size_t workspace_size(const InArray& q, const InArray& k, const InArray& v, const InArray& g, const InArray& beta,
                      const OutArray& out, OptIn A_log, OptIn dt_bias, const std::string& gate, float lower_bound,
                      bool l2norm_qk, bool beta_is_logit, std::optional<float> scale, OptIn initial_state,
                      OptOut final_state, OptIn cu_seqlens, bool u16_is_bf16, int v_splits,
                      int64_t segment_chunks) {
  PreArgs pre{A_log, dt_bias, gate, lower_bound, l2norm_qk, beta_is_logit, scale};
  PrefillArrays r = make_prefill(q, k, v, g, beta, initial_state, cu_seqlens, pre, u16_is_bf16);
  attach_outputs(r, out, final_state, u16_is_bf16);
  return internal::workspace_size(r.p, {v_splits, segment_chunks});
}

void reference_forward(const InArray& q, const InArray& k, const InArray& v, const InArray& g,
                       const InArray& beta, const OutArray& out, OptIn A_log, OptIn dt_bias,
                       const std::string& gate, float lower_bound, bool l2norm_qk, bool beta_is_logit,
                       std::optional<float> scale, OptIn initial_state, OptOut final_state, OptIn cu_seqlens,
                       OptOut state_pool, OptIn state_indices, OptIn has_initial_state, int64_t checkpoint_every,
                       OptOut checkpoints, bool u16_is_bf16) {
  PreArgs pre{A_log, dt_bias, gate, lower_bound, l2norm_qk, beta_is_logit, scale};
  PrefillArrays r = make_prefill(q, k, v, g, beta, initial_state, cu_seqlens, pre, u16_is_bf16);
  FLASHKDA_CHECK_ARG(!r.q.on_cuda(), "q: reference_forward runs on the host; got arrays on ", r.q.where());
  attach_serving(r, {state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints, std::nullopt},
                 u16_is_bf16, /*fp64_checkpoints=*/true);
  PrefillParams& p = r.p;
  auto f64_view = [&](const OutArray& a, const char* name, const std::vector<int64_t>& shape) -> double* {
    FLASHKDA_CHECK_ARG(a.dtype() == nb::dtype<double>(), name, ": reference_forward writes float64, got ",
                       dlpack_dtype_name(a.dtype()));
    FLASHKDA_CHECK_ARG(a.device_type() == kDLCPU || a.device_type() == kDLCUDAHost, name,
                       ": must be host memory");
    std::vector<int64_t> got;
    for (size_t i = 0; i < a.ndim(); ++i) got.push_back(int64_t(a.shape(i)));
    FLASHKDA_CHECK_ARG(got == shape, name, ": expected shape ", shape_str(shape), ", got ", shape_str(got));
    FLASHKDA_CHECK_ARG(is_c_contiguous(a), name, ": must be C-contiguous");
    return static_cast<double*>(a.data());
  };
  double* o = f64_view(out, "out", {p.B, p.T, p.H, p.V});
  double* ht = final_state ? f64_view(*final_state, "final_state", {r.N, p.H, p.V, p.K}) : nullptr;
  double* ck = checkpoints ? f64_view(*checkpoints, "checkpoints", {p.num_checkpoints, p.H, p.V, p.K}) : nullptr;
  r.p.out = o;  // validation wants a non-null out; the reference writes through the fp64 pointer
  nb::gil_scoped_release nogil;
  flashkda::reference_forward(r.p, o, ht, ck);
}

void decode(const InArray& q_, const InArray& k_, const InArray& v_, const InArray& g_, const InArray& beta_,
            const OutArray& out_, const OutArray& state_pool_, const InArray& state_indices_,
            OptIn num_accepted_tokens_, OptIn cu_seqlens_, OptIn A_log, OptIn dt_bias, const std::string& gate,
            float lower_bound, bool l2norm_qk, bool beta_is_logit, std::optional<float> scale, uintptr_t stream,
            bool check_slots, bool u16_is_bf16, int persistent, int internal_check_slots, int cpu_isa) {
  DecodeParams p;
  p.check_slots = check_slots;
  View q = view_in("q", q_, u16_is_bf16);
  expect_rank(q, 4, "[N, T, H, K] (or [1, total, H, K] with cu_seqlens)");
  expect_float(q);
  View v = view_in("v", v_, u16_is_bf16);
  expect_rank(v, 4, "[N, T, H, V] (or [1, total, H, V] with cu_seqlens)");
  const int64_t B = q.dim(0);
  p.T = q.dim(1), p.H = q.dim(2), p.K = q.dim(3), p.V = v.dim(3);
  View k = view_in("k", k_, u16_is_bf16);
  View g = view_in("g", g_, u16_is_bf16);
  View beta = view_in("beta", beta_, u16_is_bf16);
  View out = view_out("out", out_, u16_is_bf16);
  expect_shape(k, q.shape);
  expect_value_heads(v, B, p.T, p.H);
  expect_shape(v, {B, p.T, p.H, p.V});
  expect_shape(g, q.shape);
  expect_beta(beta, B, p.T, p.H, p.V);
  expect_shape(out, v.shape);
  expect_dtype(k, q.dtype);
  expect_dtype(v, q.dtype);
  expect_dtype(out, q.dtype);
  expect_float(g);
  expect_float(beta);
  std::vector<View> views = {k, v, g, beta, out};

  p.num_seqs = B;
  if (cu_seqlens_) {
    const View cu = view_cu_seqlens(*cu_seqlens_, B);
    p.cu_seqlens = cu.data;
    p.cu_seqlens_dtype = cu.dtype;
    p.num_seqs = cu.dim(0) - 1;
    views.push_back(cu);
  }
  const int64_t N = p.num_seqs;

  View pool = view_out("state_pool", state_pool_, u16_is_bf16);
  expect_rank(pool, 4, "[P, H, V, K]");
  expect_float(pool);
  expect_shape(pool, {pool.dim(0), p.H, p.V, p.K});
  p.state_pool = pool.data;
  p.state_dtype = pool.dtype;
  p.pool_size = pool.dim(0);
  views.push_back(pool);

  View idx = view_in("state_indices", state_indices_, false);
  expect_dtype(idx, DType::kI32);
  FLASHKDA_CHECK_ARG((idx.shape.size() == 1 || idx.shape.size() == 2) && idx.dim(0) == N,
                     "state_indices: expected shape [N] or [N, S] with N=", N, ", got ", shape_str(idx.shape));
  p.state_indices = static_cast<const int32_t*>(idx.data);
  p.indices_stride = idx.shape.size() == 2 ? idx.dim(1) : 1;
  views.push_back(idx);
  if (num_accepted_tokens_) {
    View acc = view_in("num_accepted_tokens", *num_accepted_tokens_, false);
    expect_dtype(acc, DType::kI32);
    expect_shape(acc, {N});
    p.num_accepted_tokens = static_cast<const int32_t*>(acc.data);
    views.push_back(acc);
  }
  PreArgs pre{A_log, dt_bias, gate, lower_bound, l2norm_qk, beta_is_logit, scale};
  p.pre = make_preprocess(pre, q, p.H, p.K, views);
  for (const View& x : views) expect_same_device(q, x);

  p.q = q.data, p.k = k.data, p.v = v.data, p.g = g.data, p.beta = beta.data, p.out = out.data;
  p.dtype = q.dtype, p.g_dtype = g.dtype, p.beta_dtype = beta.dtype;
  nb::gil_scoped_release nogil;
  internal::decode(p, {persistent, internal_check_slots, cpu_isa}, reinterpret_cast<Stream>(stream));
}

}  // namespace
}  // namespace flashkda::python

NB_MODULE(_C, m) {
  namespace py = flashkda::python;
  using nb::arg;
  m.doc() = "flashkda C++ bindings (low level). Arrays: C-contiguous, any DLPack framework; "
            "uint16 arrays are read as bfloat16 when u16_is_bf16=True.";

  nb::register_exception_translator([](const std::exception_ptr& e, void*) {
    try {
      std::rethrow_exception(e);
    } catch (const flashkda::Error& err) {
      // kUnsupported (valid arguments this build or backend does not serve, e.g. K != 128 on the
      // GPU) is NotImplementedError, itself a RuntimeError.
      PyObject* type = err.code() == flashkda::ErrorCode::kInvalidArgument ? PyExc_ValueError
                       : err.code() == flashkda::ErrorCode::kUnsupported   ? PyExc_NotImplementedError
                                                                            : PyExc_RuntimeError;
      PyErr_SetString(type, err.what());
    }
  });

#ifdef FLASHKDA_PY_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  m.def("version", [] { return std::string(flashkda::version()); }, "Library version string.");
  m.def(
      "_cpu_engine_isa", [](int requested) { return flashkda::internal::cpu_engine_isa(requested); },
      arg("requested") = 0,
      "The CPU engine's instruction set for launch field cpu_isa = requested (1 baseline, 2 AVX2 + FMA, 3 AVX-512).");
  m.def("cuda_available", &flashkda::cuda_available,
        "True when this build has the CUDA backend and a Hopper (sm_90) GPU is visible.");

  m.def("forward", &py::forward, arg("q"), arg("k"), arg("v"), arg("g"), arg("beta"), arg("out"), nb::kw_only(),
        arg("A_log").none() = nb::none(), arg("dt_bias").none() = nb::none(), arg("gate") = "lower_bound",
        arg("lower_bound") = -5.0f, arg("l2norm_qk") = true, arg("beta_is_logit") = true,
        arg("scale").none() = nb::none(), arg("initial_state").none() = nb::none(),
        arg("final_state").none() = nb::none(), arg("cu_seqlens").none() = nb::none(),
        arg("state_pool").none() = nb::none(), arg("state_indices").none() = nb::none(),
        arg("has_initial_state").none() = nb::none(), arg("checkpoint_every") = 0,
        arg("checkpoints").none() = nb::none(), arg("checkpoint_slots").none() = nb::none(),
        arg("workspace").none() = nb::none(), arg("workspace_alloc").none() = nb::none(), arg("stream") = 0,
        arg("u16_is_bf16") = false, arg("precision") = "precise", arg("_v_splits") = 0, arg("_segment_chunks") = 0,
        arg("_f16_operands") = 0, arg("_ckpt_in_segments") = 0, arg("_skip_transitions") = 0,
        arg("_skip_run_chunks") = 0, arg("_skip_warmup_chunks") = 0, arg("_seg_ctas_per_sm") = 0,
        arg("_record_copy") = 0, arg("_early_launch") = 0, arg("_cpu_isa") = 0, arg("_skip_bound") = 0,
        arg("_fused_v2") = 0, arg("_fused_min_tokens") = 0,
        arg("_fused_pieces") = 0, arg("_fused_warmup") = 0, arg("_fused_order") = 0, arg("_fused_chain") = 0,
        arg("_lowrank_transitions") = 0, arg("_pieces_graph_if") = 0,
        "Chunked KDA forward (docs/SPEC.md §3/§4): writes out [B,T,H,V] and final_state [N,H,V,K] in place. "
        "state_pool [P,H,V,K] with state_indices [N] int32 (and has_initial_state [N] bool) in place of the "
        "state tensors; checkpoint_every with checkpoints [C,H,V,K] or checkpoint_slots [C] int32 (SPEC §9). "
        "workspace: device bytes (any dtype); or workspace_alloc(nbytes) -> array, called when needed. "
        "precision: 'precise', 'balanced' or 'fast' (the GPU recurrence; flashkda::Precision). "
        "_v_splits, _segment_chunks, _f16_operands, _ckpt_in_segments, _skip_transitions, _skip_run_chunks, "
        "_skip_warmup_chunks, _seg_ctas_per_sm, _record_copy, _early_launch, _cpu_isa, _skip_bound, _fused_v2, "
        "_fused_min_tokens, _fused_pieces, _fused_warmup, _fused_order, _fused_chain, "
        "_lowrank_transitions, _pieces_graph_if: "
        "internal launch "
        "configuration (tests, benchmarks; 0 = the "
        "launcher's rule).");

  m.def("_check_decode_slots", &py::check_decode_slots, arg("state_indices"),
        arg("num_accepted_tokens").none() = nb::none(), arg("cu_seqlens").none() = nb::none(), arg("T"),
        arg("pool_size"), "internal: decode's slot rule on host int32 indices (docs/SPEC.md §5).");
  m.def("_check_pool_slots", &py::check_pool_slots, arg("state_indices"), arg("checkpoint_slots").none() = nb::none(),
        arg("pool_size"), "internal: the serving prefill's slot rule on host int32 indices (docs/SPEC.md §9).");
  m.def("workspace_size", &py::workspace_size, arg("q"), arg("k"), arg("v"), arg("g"), arg("beta"), arg("out"),
        nb::kw_only(), arg("A_log").none() = nb::none(), arg("dt_bias").none() = nb::none(),
        arg("gate") = "lower_bound", arg("lower_bound") = -5.0f, arg("l2norm_qk") = true,
        arg("beta_is_logit") = true, arg("scale").none() = nb::none(), arg("initial_state").none() = nb::none(),
        arg("final_state").none() = nb::none(), arg("cu_seqlens").none() = nb::none(), arg("u16_is_bf16") = false,
        arg("_v_splits") = 0, arg("_segment_chunks") = 0,
        "Validates a forward() call and returns the workspace bytes it needs (0 on the CPU).");

  m.def("reference_forward", &py::reference_forward, arg("q"), arg("k"), arg("v"), arg("g"), arg("beta"),
        arg("out"), nb::kw_only(), arg("A_log").none() = nb::none(), arg("dt_bias").none() = nb::none(),
        arg("gate") = "lower_bound", arg("lower_bound") = -5.0f, arg("l2norm_qk") = true,
        arg("beta_is_logit") = true, arg("scale").none() = nb::none(), arg("initial_state").none() = nb::none(),
        arg("final_state").none() = nb::none(), arg("cu_seqlens").none() = nb::none(),
        arg("state_pool").none() = nb::none(), arg("state_indices").none() = nb::none(),
        arg("has_initial_state").none() = nb::none(), arg("checkpoint_every") = 0,
        arg("checkpoints").none() = nb::none(), arg("u16_is_bf16") = false,
        "fp64 token recurrence on host arrays: writes float64 out [B,T,H,V] and final_state [N,H,V,K] "
        "(and float64 checkpoints [C,H,V,K]); a state_pool is only read.");

  m.def("decode", &py::decode, arg("q"), arg("k"), arg("v"), arg("g"), arg("beta"), arg("out"), arg("state_pool"),
        arg("state_indices"), nb::kw_only(), arg("num_accepted_tokens").none() = nb::none(),
        arg("cu_seqlens").none() = nb::none(), arg("A_log").none() = nb::none(), arg("dt_bias").none() = nb::none(),
        arg("gate") = "lower_bound", arg("lower_bound") = -5.0f, arg("l2norm_qk") = true,
        arg("beta_is_logit") = true, arg("scale").none() = nb::none(), arg("stream") = 0, arg("check_slots") = true,
        arg("u16_is_bf16") = false, arg("_persistent") = -1, arg("_check_slots") = 0, arg("_cpu_isa") = 0,
        "One decode step (docs/SPEC.md §5): updates the named slots of state_pool [P,H,V,K] in place, writes out.");
}
