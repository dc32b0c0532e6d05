// Device copies of a test problem for the GPU prefill tests (tests/cpp/gpu/test_*prefill*_gpu.cpp).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "kda_test_utils.h"
#include "launch_config.h"

namespace flashkda::test {

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n > 0 && cudaMalloc(&ptr, n) != cudaSuccess) ptr = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
};

// Device copies (data + guard bytes) of every host tensor of a problem.
struct DeviceProblem {
  KdaInputs& in;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  void *q, *k, *v, *g, *beta, *out, *init = nullptr, *fin = nullptr, *cu = nullptr;
  float *A_log = nullptr, *dt_bias = nullptr;
  std::unique_ptr<DeviceBuffer> workspace;
  internal::PrefillLaunch launch;  // the launcher's rules unless a test forces a variant
  // Set once by a test binary of the chunk-16 kernels (test_prefill_gpu, test_serving_prefill_gpu): a
  // launch that forces neither the fused kernel (fused_v2) nor its pieces (fused_pieces) runs without the pieces (fused_pieces
  // -1), so that its few-head calls keep testing the chunk-16 segments the rule's pieces would replace
  // (config.h fused_few_head_pieces; test_prefill32_gpu tests the pieces and the rule).
  static inline bool chunk16_rule = false;

  explicit DeviceProblem(KdaInputs& inputs, internal::PrefillLaunch launch_ = {}) : in(inputs), launch(launch_) {
    if (chunk16_rule && launch.fused_v2 == 0 && launch.fused_pieces == 0) launch.fused_pieces = -1;
    q = upload(in.q.bytes.data(), in.q.bytes.size());
    k = upload(in.k.bytes.data(), in.k.bytes.size());
    v = upload(in.v.bytes.data(), in.v.bytes.size());
    g = upload(in.g.bytes.data(), in.g.bytes.size());
    beta = upload(in.beta.bytes.data(), in.beta.bytes.size());
    out = upload(in.out.bytes.data(), in.out.bytes.size());
    A_log = static_cast<float*>(upload(in.A_log.data(), in.A_log.size() * 4));
    if (!in.dt_bias.empty()) dt_bias = static_cast<float*>(upload(in.dt_bias.data(), in.dt_bias.size() * 4));
    if (!in.initial_state.bytes.empty()) init = upload(in.initial_state.bytes.data(), in.initial_state.bytes.size());
    if (!in.final_state.bytes.empty()) fin = upload(in.final_state.bytes.data(), in.final_state.bytes.size());
    if (!in.cu_seqlens.bytes.empty()) cu = upload(in.cu_seqlens.bytes.data(), in.cu_seqlens.bytes.size());
    const size_t ws = internal::workspace_size(params(), launch);
    workspace = std::make_unique<DeviceBuffer>(ws);
  }

  void* upload(const void* src, size_t bytes) {
    keep.push_back(std::make_unique<DeviceBuffer>(bytes));
    void* p = keep.back()->ptr;
    if (p) cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice);
    return p;
  }

  PrefillParams params() const {
    PrefillParams p = in.params();
    p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.out = out;
    p.pre.A_log = A_log;
    p.pre.dt_bias = dt_bias;
    if (p.initial_state) p.initial_state = init;
    if (p.final_state) p.final_state = fin;
    if (p.cu_seqlens) p.cu_seqlens = cu;
    return p;
  }

  // Poisons the device outputs (data and guards) with NaN bytes.
  void poison() {
    cudaMemset(out, kPoison, in.out.bytes.size());
    if (fin) cudaMemset(fin, kPoison, in.final_state.bytes.size());
  }

  void run(cudaStream_t stream = nullptr) {
    internal::forward(params(), launch, workspace->ptr, workspace->bytes, stream);
  }

  // Copies the device outputs (with guards) back into the host tensors.
  void download() {
    cudaMemcpy(in.out.bytes.data(), out, in.out.bytes.size(), cudaMemcpyDeviceToHost);
    if (fin) cudaMemcpy(in.final_state.bytes.data(), fin, in.final_state.bytes.size(), cudaMemcpyDeviceToHost);
  }
};

}  // namespace flashkda::test
