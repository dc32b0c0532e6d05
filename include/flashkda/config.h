// flashkda constants of the computation, defined once (docs/SPEC.md §4, §5) and used by every backend.
#pragma once

namespace flashkda {

constexpr int kChunk = 16;            // C: tokens per chunk of the chunked form
constexpr int kCudaHeadDim = 128;     // K = V on the CUDA backend
constexpr int kMaxDecodeTokens = 16;  // new tokens per sequence in one decode step

// Largest |G - mid| (in-chunk log-decay around its per-channel midpoint) for which a chunk's L and
// Mqk are built from factors e^{G-mid} and e^{mid-G}: e^80 ~ 5.5e34 stays inside fp32/bf16 range.
// Chunks beyond it are built pairwise with e^{G_i - G_j} <= 1.
constexpr double kMaxFactorisedShift = 80.0;

}  // namespace flashkda
