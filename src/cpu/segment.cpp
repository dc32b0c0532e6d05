// The segment transition on the CPU (launch_config.h internal::segment_transition): the chunk
// form run on the augmented state [B | A] of V + K columns, from [0 | I] with values [v | 0]. The
// delta rule is linear in (S, v) jointly, so the first V columns end as B (the state from zero)
// and the last K as A (the image of each basis state).
#include <algorithm>
#include <vector>

#include "backend.h"
#include "common/host_math.h"
#include "cpu/chunk.h"

namespace flashkda::cpu {

void segment_transition(const PrefillParams& p, float* transition, float* zero_start) {
  const int64_t N = detail::num_sequences(p);
  const int64_t H = p.H, K = p.K, V = p.V, W = V + K, rows = p.B * p.T * H;
  // q, k as fp32 (exact for bf16 inputs), v padded with K zero columns.
  std::vector<float> q(rows * K), k(rows * K), v(rows * W, 0.0f);
  host::load_row(p.q, p.dtype, 0, rows * K, q.data());
  host::load_row(p.k, p.dtype, 0, rows * K, k.data());
  for (int64_t r = 0; r < rows; ++r) host::load_row(p.v, p.dtype, r * V, V, &v[r * W]);
  std::vector<float> start(N * H * W * K, 0.0f), end(N * H * W * K), out(rows * W);
  for (int64_t nh = 0; nh < N * H; ++nh)
    for (int64_t r = 0; r < K; ++r) start[(nh * W + V + r) * K + r] = 1.0f;  // row V + r of S^T: e_r

  PrefillParams a = p;
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.dtype = DType::kF32, a.V = W;
  a.initial_state = start.data(), a.initial_state_dtype = DType::kF32;
  a.final_state = nullptr, a.out = nullptr;
  chunk_forward<float>(a, out.data(), end.data());
  for (int64_t nh = 0; nh < N * H; ++nh) {
    const float* s = &end[nh * W * K];
    std::copy(s, s + V * K, zero_start + nh * V * K);
    std::copy(s + V * K, s + W * K, transition + nh * K * K);
  }
}

}  // namespace flashkda::cpu
