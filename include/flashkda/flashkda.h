// flashkda public C++ API: Kimi Delta Attention prefill and decode, on the CPU or a CUDA GPU.
// The backend is chosen by where the tensors live (all host or all device memory). GPU calls never
// synchronise the host and never allocate: the caller passes workspace and stream, so they can be
// captured in a CUDA graph. CPU calls reuse per-thread scratch, allocated on a thread's first call
// with a head size. Bad input throws flashkda::Error (see error.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkda/config.h"
#include "flashkda/error.h"
#include "flashkda/params.h"
#include "flashkda/types.h"

namespace flashkda {

using Stream = void*;  // a cudaStream_t; nullptr is the legacy default stream

enum class Backend : int { kCpu = 0, kCuda = 1 };

// Where the call runs, decided from the location of the q pointer.
Backend backend_of(const void* ptr);

// True when this build has the CUDA backend and a Hopper (sm_90) GPU is visible.
bool cuda_available();

// Validates params (throws flashkda::Error) and returns the workspace bytes forward() needs.
size_t workspace_size(const PrefillParams& params);

// Chunked KDA forward (docs/SPEC.md §3/§4). Writes out and, when non-null, final_state.
// workspace: at least workspace_size(params) bytes in the same memory as the tensors.
void forward(const PrefillParams& params, void* workspace, size_t workspace_bytes, Stream stream = nullptr);

// One decode step (docs/SPEC.md §5): updates the named slots of state_pool in place and writes out.
void decode(const DecodeParams& params, Stream stream = nullptr);

// The number of checkpoints a prefill writes (PrefillParams::checkpoint_every, docs/SPEC.md §9):
// sum over the sequences of floor(length / checkpoint_every); 0 when checkpoint_every is 0. Reads
// cu_seqlens, which must be host memory here (engines that keep the lengths on the host compute
// the same sum themselves).
int64_t checkpoint_count(const PrefillParams& params);

// fp64 token recurrence (docs/SPEC.md §3) on host memory: the reference every backend is tested against.
// Inputs may be fp32 or bf16 as described by params; out and final_state are written as fp64
// ([B, T, H, V] and [N, H, V, K]; final_state may be null). With a state pool the initial states
// are read from it (it is never written); final_state then holds the states of the sequences in
// order (zeros for padding). checkpoints, when non-null: the params' checkpoints in fp64,
// [num_checkpoints, H, V, K] (zeros for padding), whichever destination the params name.
void reference_forward(const PrefillParams& params, double* out, double* final_state,
                       double* checkpoints = nullptr);

const char* version();

}  // namespace flashkda
