// fp64 token recurrence of docs/SPEC.md §3 (flashkda::reference_forward): the definition every
// backend is tested against. One token at a time: decay, delta-rule update, read.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend.h"
#include "common/host_math.h"

namespace flashkda {
namespace {

// Runs the recurrence of sequence n, head h; S is the [V, K] (v-first) state, updated in place.
// checkpoints (when non-null): S after each p.checkpoint_every tokens, numbered from first.
void recur_sequence_head(const PrefillParams& p, int64_t n, int64_t h, double scale, double* out, double* S,
                         double* checkpoints, int64_t first) {
  const int64_t H = p.H, K = p.K, V = p.V;
  const SeqRange r = detail::seq_range(p, n);
  const host::HeadGate<double> gate(p.pre, h, K);
  std::vector<double> q(K), k(K), v(V), a(K);

  for (int64_t t = r.bos; t < r.eos; ++t) {
    const int64_t row = t * H + h;
    const double b = host::load_token(p, gate, t, h, q.data(), k.data(), v.data(), a.data());  // a: e^{log-decay}

    for (int64_t j = 0; j < V; ++j) {
      double* s = S + j * K;  // column j of S (S^T row j)
      double pred = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        s[c] *= a[c];
        pred += s[c] * k[c];
      }
      const double delta = b * (v[j] - pred);
      double o = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        s[c] += delta * k[c];
        o += s[c] * q[c];
      }
      out[row * V + j] = scale * o;
    }
    const int64_t done = t + 1 - r.bos;
    if (checkpoints != nullptr && p.checkpoint_every > 0 && done % p.checkpoint_every == 0) {
      std::copy(S, S + V * K, checkpoints + ((first + done / p.checkpoint_every - 1) * H + h) * V * K);
    }
  }
}

}  // namespace

void reference_forward(const PrefillParams& params_in, double* out, double* final_state, double* checkpoints) {
  // The results go to the fp64 out and final_state arguments: params.out and params.final_state
  // are not used (and may be null); everything else is validated as for forward.
  PrefillParams params = params_in;
  params.out = out;
  params.final_state = nullptr;
  if (params.checkpoint_slots == nullptr && checkpoints != nullptr) params.checkpoints = checkpoints;
  detail::check_reachable(params, Backend::kCpu);  // host memory only, cu_seqlens included
  detail::check_reachable(Backend::kCpu,
                          {{out, "out (fp64)"}, {final_state, "final_state (fp64)"},
                           {checkpoints, "checkpoints (fp64)"}},
                          "");
  FLASHKDA_CHECK_ARG(out != nullptr || params.B * params.T * params.H == 0,
                     "reference_forward: out (the fp64 output [B, T, H, V]) must not be null");
  detail::validate_prefill(params, Backend::kCpu);
  const int64_t N = detail::num_sequences(params);
  const int64_t H = params.H, K = params.K, V = params.V;
  const double scale = host::output_scale<double>(params.pre, K);
  const int64_t every = params.checkpoint_every;
  std::vector<int64_t> first;  // the first checkpoint of each sequence
  detail::first_checkpoints(params, first);

#pragma omp parallel
  {
    std::vector<double> S(V * K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nh = 0; nh < N * H; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      if (params.state_pool != nullptr && params.state_indices[n] < 0) {
        // Padding: zero outputs, final state and checkpoints; the pool is never written here.
        const SeqRange r = detail::seq_range(params, n);
        for (int64_t t = r.bos; t < r.eos; ++t) std::fill(out + (t * H + h) * V, out + (t * H + h + 1) * V, 0.0);
        if (final_state != nullptr) std::fill(final_state + nh * V * K, final_state + (nh + 1) * V * K, 0.0);
        for (int64_t j = 0; checkpoints != nullptr && every > 0 && j < r.len() / every; ++j) {
          double* at = checkpoints + ((first[n] + j) * H + h) * V * K;
          std::fill(at, at + V * K, 0.0);
        }
        continue;
      }
      detail::load_initial_state(params, n, h, S.data());
      recur_sequence_head(params, n, h, scale, out, S.data(), checkpoints, first[n]);
      if (final_state != nullptr) {
        std::copy(S.begin(), S.end(), final_state + (n * H + h) * V * K);
      }
    }
  }
}

}  // namespace flashkda
