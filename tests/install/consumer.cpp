// Downstream use of an installed flashkda: one prefill with the lower-bound gate, bf16 inputs and
// an fp32 initial/final state, on the host and (CUDA builds, Hopper GPU visible) on the device with
// an explicit workspace and the caller's stream, each checked against the fp64 reference.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <flashkda/flashkda.h>

#ifdef CONSUMER_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

constexpr int64_t kB = 1, kT = 50, kH = 2, kK = 128, kV = 128;
constexpr double kTolerance = 1e-2;  // rel-RMS against fp64; bf16 output rounding alone is ~2e-3

struct Problem {
  std::vector<flashkda::bf16> q, k, v, g, beta;
  std::vector<float> A_log, dt_bias, h0;
};

Problem make_problem() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto fill = [&](int64_t n, float sigma) {
    std::vector<float> x(n);
    for (auto& e : x) e = sigma * normal(rng);
    return x;
  };
  auto to_bf16 = [](const std::vector<float>& x) {
    return std::vector<flashkda::bf16>(x.begin(), x.end());
  };
  Problem pr;
  pr.q = to_bf16(fill(kB * kT * kH * kK, 1.0f));
  pr.k = to_bf16(fill(kB * kT * kH * kK, 1.0f));
  pr.v = to_bf16(fill(kB * kT * kH * kV, 1.0f));
  pr.g = to_bf16(fill(kB * kT * kH * kK, 1.0f));
  pr.beta = to_bf16(fill(kB * kT * kH, 1.0f));
  pr.A_log = fill(kH, 0.5f);
  pr.dt_bias = fill(kH * kK, 0.5f);
  pr.h0 = fill(kB * kH * kV * kK, 0.1f);
  return pr;
}

// Shapes and options; the caller points the tensor fields at host or device memory.
flashkda::PrefillParams make_params() {
  flashkda::PrefillParams p;
  p.B = kB;
  p.T = kT;
  p.H = kH;
  p.K = kK;
  p.V = kV;
  p.dtype = p.g_dtype = p.beta_dtype = flashkda::DType::kBF16;
  p.initial_state_dtype = p.final_state_dtype = flashkda::DType::kF32;
  p.pre.gate = flashkda::GateForm::kLowerBound;
  p.pre.lower_bound = -5.0f;
  return p;
}

double rel_rms(const std::vector<float>& x, const std::vector<double>& ref) {
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (x[i] - ref[i]) * (x[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(err / norm);
}

std::vector<float> to_float(const std::vector<flashkda::bf16>& x) { return std::vector<float>(x.begin(), x.end()); }

bool report(const char* where, double out_err, double state_err) {
  const bool ok = out_err < kTolerance && state_err < kTolerance;
  std::printf("%s: out rel-RMS %.2e, final state rel-RMS %.2e vs fp64 reference: %s\n", where, out_err, state_err,
              ok ? "ok" : "FAILED");
  return ok;
}

#ifdef CONSUMER_WITH_CUDA
#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    const cudaError_t e = (call);                                                     \
    if (e != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e));        \
      return false;                                                                   \
    }                                                                                 \
  } while (0)

template <typename T>
T* to_device(const std::vector<T>& x, cudaStream_t stream) {
  void* d = nullptr;
  if (cudaMallocAsync(&d, x.size() * sizeof(T), stream) != cudaSuccess) return nullptr;
  cudaMemcpyAsync(d, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice, stream);
  return static_cast<T*>(d);
}

bool run_gpu(const Problem& pr, const std::vector<double>& out_ref, const std::vector<double>& state_ref) {
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  flashkda::PrefillParams p = make_params();
  auto* q = to_device(pr.q, stream);
  auto* k = to_device(pr.k, stream);
  auto* v = to_device(pr.v, stream);
  auto* g = to_device(pr.g, stream);
  auto* beta = to_device(pr.beta, stream);
  auto* A_log = to_device(pr.A_log, stream);
  auto* dt_bias = to_device(pr.dt_bias, stream);
  auto* h0 = to_device(pr.h0, stream);
  std::vector<flashkda::bf16> out(pr.v.size());
  std::vector<float> ht(pr.h0.size());
  auto* d_out = to_device(out, stream);
  auto* d_ht = to_device(ht, stream);
  p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.out = d_out;
  p.initial_state = h0, p.final_state = d_ht;
  p.pre.A_log = A_log, p.pre.dt_bias = dt_bias;

  // The library never allocates: the caller owns the workspace and the stream.
  const size_t ws_bytes = flashkda::workspace_size(p);
  void* ws = nullptr;
  CHECK_CUDA(cudaMallocAsync(&ws, ws_bytes, stream));
  flashkda::forward(p, ws, ws_bytes, stream);
  CHECK_CUDA(cudaMemcpyAsync(out.data(), d_out, out.size() * sizeof(out[0]), cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaMemcpyAsync(ht.data(), d_ht, ht.size() * sizeof(ht[0]), cudaMemcpyDeviceToHost, stream));
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)g, (void*)beta, (void*)A_log, (void*)dt_bias, (void*)h0,
                    (void*)d_out, (void*)d_ht, ws}) {
    CHECK_CUDA(cudaFreeAsync(ptr, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return report("GPU", rel_rms(to_float(out), out_ref), rel_rms(ht, state_ref));
}
#endif

}  // namespace

int main() {
  try {
    std::printf("flashkda %s, CUDA available: %s\n", flashkda::version(), flashkda::cuda_available() ? "yes" : "no");
    const Problem pr = make_problem();
    flashkda::PrefillParams p = make_params();
    std::vector<flashkda::bf16> out(pr.v.size());
    std::vector<float> ht(pr.h0.size());
    p.q = pr.q.data(), p.k = pr.k.data(), p.v = pr.v.data(), p.g = pr.g.data(), p.beta = pr.beta.data();
    p.out = out.data();
    p.initial_state = pr.h0.data(), p.final_state = ht.data();
    p.pre.A_log = pr.A_log.data(), p.pre.dt_bias = pr.dt_bias.data();

    std::vector<double> out_ref(out.size()), state_ref(ht.size());
    flashkda::reference_forward(p, out_ref.data(), state_ref.data());

    const size_t ws_bytes = flashkda::workspace_size(p);  // 0 on the CPU backend
    std::vector<char> ws(ws_bytes);
    flashkda::forward(p, ws.data(), ws_bytes);
    bool ok = report("CPU", rel_rms(to_float(out), out_ref), rel_rms(ht, state_ref));

    // Bad input throws flashkda::Error naming the argument.
    p.pre.lower_bound = 1.0f;
    try {
      flashkda::forward(p, nullptr, 0);
      std::printf("lower_bound=1 was accepted: FAILED\n");
      ok = false;
    } catch (const flashkda::Error& e) {
      std::printf("bad argument rejected: %s\n", e.what());
      ok = ok && e.code() == flashkda::ErrorCode::kInvalidArgument;
    }

#ifdef CONSUMER_WITH_CUDA
    if (flashkda::cuda_available()) {
      ok = run_gpu(pr, out_ref, state_ref) && ok;
    } else {
      std::printf("GPU: skipped (no Hopper GPU visible)\n");
    }
#endif
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
