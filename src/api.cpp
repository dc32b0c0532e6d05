// Public entry points: pick the backend from where the tensors live, validate, dispatch.
#include <cmath>

#include "backend.h"
#include "common/host_math.h"

namespace flashkda {

const char* version() { return FLASHKDA_VERSION; }

bool cuda_available() {
#ifdef FLASHKDA_WITH_CUDA
  return cuda::available();
#else
  return false;
#endif
}

Backend backend_of(const void* ptr) {
  const detail::MemorySpace space = detail::pointer_info(ptr).space;
  return space == detail::MemorySpace::kDevice || space == detail::MemorySpace::kManaged ? Backend::kCuda
                                                                                         : Backend::kCpu;
}

size_t workspace_size(const PrefillParams& params) { return internal::workspace_size(params, {}); }

void forward(const PrefillParams& params, void* workspace, size_t workspace_bytes, Stream stream) {
  internal::forward(params, {}, workspace, workspace_bytes, stream);
}

void decode(const DecodeParams& params, Stream stream) { internal::decode(params, {}, stream); }

int64_t checkpoint_count(const PrefillParams& params) {
  if (params.checkpoint_every <= 0) return 0;
  if (params.cu_seqlens == nullptr) return detail::num_sequences(params) * (params.T / params.checkpoint_every);
  detail::check_reachable(Backend::kCpu, {{params.cu_seqlens, "cu_seqlens"}}, "checkpoint_count: ");
  thread_local std::vector<int64_t> first;  // kept: steady-state calls allocate nothing
  return detail::first_checkpoints(params, first);
}

namespace internal {

namespace {
Backend validated_backend(const PrefillParams& params) {
  const Backend backend = backend_of(params.q);
  detail::check_reachable(params, backend);  // first: the CPU rules read cu_seqlens
  detail::validate_prefill(params, backend);
  return backend;
}
}  // namespace

size_t workspace_size(const PrefillParams& params, const PrefillLaunch& launch) {
  [[maybe_unused]] const Backend backend = validated_backend(params);
#ifdef FLASHKDA_WITH_CUDA
  if (backend == Backend::kCuda) return cuda::prefill_workspace_size(params, launch);
#endif
  (void)launch;
  return 0;
}

#ifdef FLASHKDA_WITH_CUDA
int64_t chosen_segment_chunks(const PrefillParams& params, const PrefillLaunch& launch) {
  return cuda::prefill_segment_chunks(params, launch);
}
int64_t chosen_run_chunks(const PrefillParams& params, const PrefillLaunch& launch) {
  return cuda::prefill_run_chunks(params, launch);
}
#else
int64_t chosen_segment_chunks(const PrefillParams&, const PrefillLaunch&) { return 0; }
int64_t chosen_run_chunks(const PrefillParams&, const PrefillLaunch&) { return 0; }
#endif

int cpu_engine_isa(int requested) { return cpu::engine_isa(requested); }

namespace {
// forward after validated_backend
void forward_validated(const PrefillParams& params, const PrefillLaunch& launch, Backend backend, void* workspace,
                       size_t workspace_bytes, Stream stream) {
#ifdef FLASHKDA_WITH_CUDA
  if (backend == Backend::kCuda) {
    // The rule's pieces (chained: one sequence at many heads; unchained: one at few heads) take
    // workspace of their own, which a caller that sized its workspace for another call may not have
    // given: the call then runs without them, and only that smaller size is required.
    PrefillLaunch run = launch;
    size_t needed = cuda::prefill_workspace_size(params, run);
    if (workspace_bytes < needed && launch.fused_pieces == 0 && launch.fused_chain == 0) {
      run.fused_pieces = -1;
      needed = cuda::prefill_workspace_size(params, run);
    }
    FLASHKDA_CHECK_ARG(workspace_bytes >= needed && (needed == 0 || workspace != nullptr),
                       "workspace: need ", needed, " bytes of device memory, got ", workspace_bytes,
                       workspace == nullptr ? " (null pointer)" : "");
    detail::check_aligned16({{workspace, "workspace"}}, "");
    detail::check_reachable(backend, {{workspace, "workspace"}}, "");  // the CPU backend ignores it
    cuda::forward(params, run, workspace, workspace_bytes, stream);
    return;
  }
#else
  (void)backend;
#endif
  (void)workspace;
  (void)workspace_bytes;
  (void)stream;
  cpu::forward(params, launch.cpu_isa);
}
}  // namespace

void forward(const PrefillParams& params, const PrefillLaunch& launch, void* workspace, size_t workspace_bytes,
             Stream stream) {
  forward_validated(params, launch, validated_backend(params), workspace, workspace_bytes, stream);
}

void forward_allocating(const PrefillParams& params, const PrefillLaunch& launch,
                        const std::function<void*(size_t)>& alloc, Stream stream) {
  const Backend backend = validated_backend(params);
  size_t bytes = 0;
#ifdef FLASHKDA_WITH_CUDA
  if (backend == Backend::kCuda) bytes = cuda::prefill_workspace_size(params, launch);
#endif
  FLASHKDA_CHECK_ARG(bytes == 0 || alloc, "alloc: the call needs ", bytes, " bytes of workspace and no allocator was given");
  void* const workspace = bytes > 0 ? alloc(bytes) : nullptr;
  forward_validated(params, launch, backend, workspace, bytes, stream);
}

void decode(const DecodeParams& params, const DecodeLaunch& launch, Stream stream) {
  const Backend backend = backend_of(params.q);
  detail::check_reachable(params, backend);  // first: the CPU rules read cu_seqlens and the indices
  detail::validate_decode(params, backend);
#ifdef FLASHKDA_WITH_CUDA
  if (backend == Backend::kCuda) {
    cuda::decode(params, launch, stream);
    return;
  }
#endif
  (void)stream;
  cpu::decode(params, launch.cpu_isa);
}

namespace {
// segment_transition writes no out: validate the problem as a forward into v's shape and dtype.
PrefillParams without_out(const PrefillParams& params) {
  PrefillParams p = params;
  if (p.out == nullptr) p.out = const_cast<void*>(p.v);
  p.initial_state = nullptr, p.final_state = nullptr;
  p.state_pool = nullptr, p.state_indices = nullptr, p.has_initial_state = nullptr;  // the transition only
  p.checkpoint_every = 0, p.checkpoints = nullptr, p.checkpoint_slots = nullptr, p.num_checkpoints = 0;
  return p;
}

// The problem of a transition-only call (segment_transition's workspace, chunk_log_bounds), validated
// as a forward into v's shape, and the backend of its q.
PrefillParams validated_without_out(const PrefillParams& params_in, Backend& backend) {
  const PrefillParams params = without_out(params_in);
  backend = backend_of(params.q);
  detail::check_reachable(params, backend);
  detail::validate_prefill(params, backend);
  return params;
}
}  // namespace

void check_pool_slots(const int32_t* state_indices, int64_t num_seqs, const int32_t* checkpoint_slots,
                      int64_t num_checkpoints, int64_t pool_size) {
  detail::check_pool_slots(state_indices, num_seqs, checkpoint_slots, num_checkpoints, pool_size);
}

void check_decode_slots(const DecodeParams& params) { detail::validate_decode_indices(params); }

size_t segment_transition_workspace_size(const PrefillParams& params_in) {
  Backend backend;
  [[maybe_unused]] const PrefillParams params = validated_without_out(params_in, backend);
#ifdef FLASHKDA_WITH_CUDA
  if (backend == Backend::kCuda) return cuda::segment_transition_workspace_size(params);
#endif
  return 0;
}

void segment_transition(const PrefillParams& params_in, float* transition, float* zero_start, void* workspace,
                        size_t workspace_bytes, Stream stream) {
  const PrefillParams params = without_out(params_in);
  const Backend backend = backend_of(params.q);
  detail::check_reachable(params, backend);
  detail::check_reachable(backend, {{transition, "transition"}, {zero_start, "zero_start"}}, "");
  detail::validate_prefill(params, backend);
  FLASHKDA_CHECK_ARG(transition != nullptr && zero_start != nullptr, "segment_transition: transition and zero_start are required");
#ifdef FLASHKDA_WITH_CUDA
  if (backend == Backend::kCuda) {
    const size_t needed = cuda::segment_transition_workspace_size(params);
    FLASHKDA_CHECK_ARG(workspace_bytes >= needed && (needed == 0 || workspace != nullptr), "workspace: need ", needed,
                       " bytes of device memory, got ", workspace_bytes);
    detail::check_aligned16({{workspace, "workspace"}, {transition, "transition"}, {zero_start, "zero_start"}}, "");
    detail::check_reachable(backend, {{workspace, "workspace"}}, "");
    cuda::segment_transition(params, transition, zero_start, workspace, workspace_bytes, stream);
    return;
  }
#endif
  (void)workspace, (void)workspace_bytes, (void)stream;
  cpu::segment_transition(params, transition, zero_start);
}

namespace {
// The GPU problem chunk_log_bounds reads (its records and bounds alone).
PrefillParams bounds_problem(const PrefillParams& params_in) {
  Backend backend;
  const PrefillParams params = validated_without_out(params_in, backend);
  FLASHKDA_CHECK(backend == Backend::kCuda, ErrorCode::kUnsupported,
                 "chunk_log_bounds: q must be on a GPU (transition skipping runs on the GPU only)");
  return params;
}
}  // namespace

size_t chunk_log_bounds_workspace_size(const PrefillParams& params_in) {
  [[maybe_unused]] const PrefillParams params = bounds_problem(params_in);
#ifdef FLASHKDA_WITH_CUDA
  return cuda::chunk_log_bounds_workspace_size(params);
#else
  return 0;
#endif
}

void chunk_log_bounds(const PrefillParams& params_in, const PrefillLaunch& launch, float* bounds, void* workspace,
                      size_t workspace_bytes, Stream stream) {
  [[maybe_unused]] const PrefillParams params = bounds_problem(params_in);
  FLASHKDA_CHECK_ARG(bounds != nullptr, "chunk_log_bounds: bounds is required");
#ifdef FLASHKDA_WITH_CUDA
  const size_t needed = cuda::chunk_log_bounds_workspace_size(params);
  FLASHKDA_CHECK_ARG(workspace_bytes >= needed && workspace != nullptr, "workspace: need ", needed,
                     " bytes of device memory, got ", workspace_bytes);
  detail::check_reachable(Backend::kCuda, {{workspace, "workspace"}, {bounds, "bounds"}}, "");
  cuda::chunk_log_bounds(params, launch, bounds, workspace, stream);
#else
  (void)launch, (void)workspace, (void)workspace_bytes, (void)stream;
#endif
}

}  // namespace internal

namespace detail {

float effective_scale(const Preprocess& pre, int64_t K) { return host::output_scale<float>(pre, K); }

int64_t num_sequences(const PrefillParams& p) { return p.cu_seqlens != nullptr ? p.num_seqs : p.B; }

PointerInfo pointer_info(const void* ptr) {
#ifdef FLASHKDA_WITH_CUDA
  if (ptr != nullptr) return cuda::pointer_info(ptr);
#else
  (void)ptr;
#endif
  return {};
}

void check_reachable(const PrefillParams& p, Backend backend) {
  check_reachable(backend,
                  {{p.q, "q"}, {p.k, "k"}, {p.v, "v"}, {p.g, "g"}, {p.beta, "beta"}, {p.out, "out"},
                   {p.initial_state, "initial_state"}, {p.final_state, "final_state"}, {p.cu_seqlens, "cu_seqlens"},
                   {p.pre.A_log, "A_log"}, {p.pre.dt_bias, "dt_bias"}, {p.state_pool, "state_pool"},
                   {p.state_indices, "state_indices"}, {p.has_initial_state, "has_initial_state"},
                   {p.checkpoints, "checkpoints"}, {p.checkpoint_slots, "checkpoint_slots"}},
                  "");
}

void check_reachable(const DecodeParams& p, Backend backend) {
  check_reachable(backend,
                  {{p.q, "q"}, {p.k, "k"}, {p.v, "v"}, {p.g, "g"}, {p.beta, "beta"}, {p.out, "out"},
                   {p.state_pool, "state_pool"}, {p.state_indices, "state_indices"},
                   {p.num_accepted_tokens, "num_accepted_tokens"}, {p.cu_seqlens, "cu_seqlens"},
                   {p.pre.A_log, "A_log"}, {p.pre.dt_bias, "dt_bias"}},
                  "decode: ");
}

void check_reachable(Backend backend, std::initializer_list<NamedPointer> tensors, const char* prefix) {
#ifdef FLASHKDA_WITH_CUDA
  const int device = backend == Backend::kCuda ? cuda::current_device() : -1;
  for (const NamedPointer& t : tensors) {
    if (t.ptr != nullptr) check_memory_space(backend, device, t.name, cuda::pointer_info(t.ptr), prefix);
  }
#else
  (void)backend, (void)tensors, (void)prefix;  // without CUDA every pointer is host memory
#endif
}

int64_t first_checkpoints(const PrefillParams& p, std::vector<int64_t>& first) {
  const int64_t N = num_sequences(p), every = p.checkpoint_every;
  first.resize(size_t(N + 1));
  first[0] = 0;
  for (int64_t n = 0; n < N; ++n) first[n + 1] = first[n] + (every > 0 ? seq_range(p, n).len() / every : 0);
  return first[N];
}

StateSource initial_state_source(const PrefillParams& p, int64_t n) {
  if (p.state_pool == nullptr) return {p.initial_state, p.initial_state_dtype, n};
  const bool read = p.has_initial_state == nullptr || p.has_initial_state[n];
  return {read ? p.state_pool : nullptr, p.state_pool_dtype, p.state_indices[n]};
}

template <typename T>
void load_initial_state(const PrefillParams& p, int64_t n, int64_t h, T* dst) {
  const StateSource src = initial_state_source(p, n);
  host::load_state(src.tensor, src.dtype, src.index, h, p.H, p.V, p.K, dst);
}
template void load_initial_state<float>(const PrefillParams&, int64_t, int64_t, float*);
template void load_initial_state<double>(const PrefillParams&, int64_t, int64_t, double*);

namespace {
SeqRange seq_range(const void* cu_seqlens, DType dtype, int64_t tokens_per_seq, int64_t n) {
  if (cu_seqlens == nullptr) return {n * tokens_per_seq, (n + 1) * tokens_per_seq};
  return {host::offset_at(cu_seqlens, dtype, n), host::offset_at(cu_seqlens, dtype, n + 1)};
}
}  // namespace

SeqRange seq_range(const PrefillParams& p, int64_t n) { return seq_range(p.cu_seqlens, p.cu_seqlens_dtype, p.T, n); }
SeqRange seq_range(const DecodeParams& p, int64_t n) { return seq_range(p.cu_seqlens, p.cu_seqlens_dtype, p.T, n); }

}  // namespace detail
}  // namespace flashkda
