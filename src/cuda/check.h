// CUDA error checks for the CUDA backend: every runtime call and every launch goes through these
// and turns a failure into flashkda::Error(kCuda) naming the call, the file and the line.
#pragma once

#include <cuda_runtime.h>

#include "flashkda/error.h"

#define FLASHKDA_CUDA_CHECK(call)                                                               \
  do {                                                                                          \
    const cudaError_t flashkda_err_ = (call);                                                   \
    FLASHKDA_CHECK(flashkda_err_ == cudaSuccess, ::flashkda::ErrorCode::kCuda, #call " failed: ", \
                   cudaGetErrorString(flashkda_err_), " (", __FILE__, ":", __LINE__, ")");      \
  } while (0)

// After a <<<...>>> launch: reports bad launch configurations without synchronising.
#define FLASHKDA_CHECK_LAUNCH() FLASHKDA_CUDA_CHECK(cudaPeekAtLastError())
