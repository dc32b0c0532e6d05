// Internal interfaces between the public API (api.cpp), argument validation and the backends.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "flashkda/flashkda.h"
#include "launch_config.h"

namespace flashkda {

// [bos, eos) token range of sequence n in the flattened [B*T] token axis (host-readable params).
struct SeqRange {
  int64_t bos = 0;
  int64_t eos = 0;
  int64_t len() const { return eos - bos; }
};

namespace detail {
int64_t num_sequences(const PrefillParams& p);  // N
// Needs host-readable cu_seqlens; without it every sequence has T tokens (decode: T per sequence).
SeqRange seq_range(const PrefillParams& p, int64_t n);
SeqRange seq_range(const DecodeParams& p, int64_t n);
float effective_scale(const Preprocess& pre, int64_t K);
// The checkpoint numbering of docs/SPEC.md §9: first[n] = the index of sequence n's first
// checkpoint (the sum of floor(length / checkpoint_every) over the sequences before it), n = 0..N,
// so first[N] is the count (0 when checkpoint_every <= 0). first is resized (only grows in
// capacity: a kept vector makes steady-state calls allocate nothing). Host-readable cu_seqlens.
int64_t first_checkpoints(const PrefillParams& p, std::vector<int64_t>& first);
// The initial state of sequence n, head h as [V, K] in T: from its pool slot (zeros where
// has_initial_state says so), else from initial_state (zeros when null). Not for padding entries.
template <typename T>
void load_initial_state(const PrefillParams& p, int64_t n, int64_t h, T* dst);
// Where sequence n's initial state lies: row `index` of the [., H, V, K] tensor `tensor` in `dtype`
// (initial_state, or state_pool's slot); tensor null: zeros.
struct StateSource {
  const void* tensor;
  DType dtype;
  int64_t index;
};
StateSource initial_state_source(const PrefillParams& p, int64_t n);

// Throw flashkda::Error naming the first bad argument; nothing is written before they pass.
// backend decides which checks can read memory (cu_seqlens on the host) and which dtypes apply.
void validate_prefill(const PrefillParams& p, Backend backend);
void validate_decode(const DecodeParams& p, Backend backend);
// The host part of validate_decode: cu_seqlens, state_indices and num_accepted_tokens (host memory).
void validate_decode_indices(const DecodeParams& p);
void validate_preprocess(const Preprocess& pre);  // gate form, lower_bound, A_log, scale

// One pool slot a call reads or writes, with the index array element that names it
// (array[i] or array[i, j] when j >= 0) and its owner: uses of one slot by the same owner are
// allowed (decode: a sequence reading and writing its slot), by two owners not.
struct SlotUse {
  int32_t slot;
  int64_t owner;
  const char* array;
  int64_t i, j;
};
// Serving prefill slots on the host (docs/SPEC.md §9): every slot < pool_size and no live slot
// named twice across state_indices [num_seqs] and checkpoint_slots [num_checkpoints]; throws
// naming the position(s).
void check_pool_slots(const int32_t* state_indices, int64_t num_seqs, const int32_t* checkpoint_slots,
                      int64_t num_checkpoints, int64_t pool_size);

// Throws naming the first two uses of one slot by different owners: "<prefix><array>[..] and
// <array>[..] both name slot s (<why>)". Sorts uses.
void check_distinct_slots(std::vector<SlotUse>& uses, const char* prefix, const char* why);

// The GPU kernels use 8- and 16-byte vector accesses: each named pointer (null passes) must be
// 16-byte aligned, else "<prefix><name> must be 16-byte aligned on the GPU".
struct NamedPointer {
  const void* ptr;
  const char* name;
};
void check_aligned16(std::initializer_list<NamedPointer> tensors, const char* prefix);

// Sizes (each >= 0) whose product, the element count of tensor `what`, must stay below
// kMaxElements, so that every element and byte offset the backends form fits in int64:
// else "<what>: <dims> give more than 2^56 elements". Returns the product.
constexpr int64_t kMaxElements = int64_t(1) << 56;
int64_t check_element_count(const char* what, std::initializer_list<int64_t> dims);

// Where a pointer lives, as the CUDA runtime reports it: kHost for pageable host memory (and for
// everything in builds or on machines without CUDA), kPinnedHost for page-locked host memory
// (device-accessible), kDevice for device memory of `device`, kManaged for managed memory.
enum class MemorySpace { kHost, kPinnedHost, kDevice, kManaged };
struct PointerInfo {
  MemorySpace space = MemorySpace::kHost;
  int device = -1;
};
PointerInfo pointer_info(const void* ptr);

// Every non-null tensor must be reachable by the backend q chose: the CPU backend cannot read
// device memory; the CUDA backend, running on `device` (the current one), cannot read pageable
// host memory or another device's memory. Else "<prefix><name>: ..." naming where it lives.
// check_memory_space is the rule for one pointer (its location given); check_reachable queries.
void check_memory_space(Backend backend, int device, const char* name, const PointerInfo& info, const char* prefix);
void check_reachable(Backend backend, std::initializer_list<NamedPointer> tensors, const char* prefix);
// Every tensor of a problem (workspace aside). Runs before validate_*: the CPU rules read
// cu_seqlens and the decode indices, which must be host memory for that.
void check_reachable(const PrefillParams& p, Backend backend);
void check_reachable(const DecodeParams& p, Backend backend);
}  // namespace detail

namespace cpu {
// chunk-16 form, fp32 state, OpenMP over (sequence, head); cpu_isa: internal::PrefillLaunch::cpu_isa
void forward(const PrefillParams& p, int cpu_isa = 0);
int engine_isa(int requested);  // internal::cpu_engine_isa
void decode(const DecodeParams& p, int cpu_isa = 0);  // cpu_isa: internal::DecodeLaunch::cpu_isa
void segment_transition(const PrefillParams& p, float* transition, float* zero_start);  // launch_config.h
}  // namespace cpu

#ifdef FLASHKDA_WITH_CUDA
namespace cuda {
bool available();
detail::PointerInfo pointer_info(const void* ptr);  // cudaPointerGetAttributes; kHost when it fails
int current_device();
int64_t prefill_segment_chunks(const PrefillParams& p, const internal::PrefillLaunch& launch);
int64_t prefill_run_chunks(const PrefillParams& p, const internal::PrefillLaunch& launch);
size_t prefill_workspace_size(const PrefillParams& p, const internal::PrefillLaunch& launch);
void forward(const PrefillParams& p, const internal::PrefillLaunch& launch, void* workspace, size_t workspace_bytes,
             Stream stream);
void decode(const DecodeParams& p, const internal::DecodeLaunch& launch, Stream stream);
size_t segment_transition_workspace_size(const PrefillParams& p);
void segment_transition(const PrefillParams& p, float* transition, float* zero_start, void* workspace,
                        size_t workspace_bytes, Stream stream);
size_t chunk_log_bounds_workspace_size(const PrefillParams& p);
void chunk_log_bounds(const PrefillParams& p, const internal::PrefillLaunch& launch, float* bounds, void* workspace,
                      Stream stream);
}  // namespace cuda
#endif

}  // namespace flashkda
