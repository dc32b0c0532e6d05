// The CPU engine's two state products at its panel shapes (docs/DESIGN.md "The CPU backend"): its
// own AVX2 panel products (avx2::panel_reads and panel_update, src/cpu/vec_avx2.h) against
// libxsmm's JIT kernels where libxsmm is installed (Debian: libxsmm-dev), one thread, every operand
// in L1, K = V = 128, a full 16-token chunk, the state's rows padded to 144 floats as the engine's:
//   R = [k_decayed; q_decayed] S^T[:, panel]                 32 x 128 by 128 x 16
//   S^T[:, panel] <- e^Γ ⊙ S^T[:, panel] + k_restored^T U     128 x 16 by 16 x 16, added
// each on its own over the 8 panels of a state, and the two a panel at a time as the engine runs them.
// libxsmm is given k_restored transposed (its kernels take no transposed operand), outside the
// timing, and the e^Γ scaling as its own pass (the engine's tile folds it into its loads).
//
//   g++ -O3 -march=native -Isrc benchmarks/cpu_small_gemm.cpp -o /tmp/cpu_small_gemm \
//       -lxsmm -lxsmmnoblas -lpthread -ldl && /tmp/cpu_small_gemm
// (without libxsmm, or with -DNO_LIBXSMM: drop the -l flags; only the engine's tiles are timed).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/vec_avx2.h"

#if !defined(NO_LIBXSMM) && __has_include(<libxsmm.h>)
#include <libxsmm.h>
#define HAVE_LIBXSMM 1
#endif

namespace {

constexpr int kC = 16, kK = 128, kV = 128, kKp = 128, kVp = 144, kPanel = 16;

struct Operands {
  std::vector<float> kq = std::vector<float>(2 * kC * kKp);  // [2C, Kp]
  std::vector<float> kr = std::vector<float>(kC * kKp);      // [C, Kp]
  std::vector<float> krT = std::vector<float>(kKp * kC);     // [Kp, C], for libxsmm
  std::vector<float> decay = std::vector<float>(kKp);
  std::vector<float> St = std::vector<float>(kKp * kVp);     // [Kp, Vp]
  std::vector<float> U = std::vector<float>(kC * kPanel);    // [C, 16]
  std::vector<float> R = std::vector<float>(2 * kC * kPanel);
};

// R and the update for one panel, the engine's own functions (6, 6, 4 rows for k_decayed, then for
// q_decayed; 20 tiles of 6 channels, then 2 of 4).
__attribute__((target("avx2,fma"))) void reads(const Operands& o, const float* St, float* R) {
  flashkda::cpu::avx2::panel_reads<kC>(o.kq.data(), kKp, St, kVp, kC, R);
}
__attribute__((target("avx2,fma"))) void update(const Operands& o, float* St) {
  flashkda::cpu::avx2::panel_update(o.kr.data(), o.decay.data(), kKp, o.U.data(), kC, St, kVp);
}

// Seconds per call of f over the 8 panels, the best of 7 runs of `reps` calls.
template <class F>
double time_panels(F f, int reps) {
  double best = 1e30;
  for (int run = 0; run < 7; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i)
      for (int v0 = 0; v0 < kV; v0 += kPanel) f(v0);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps);
  }
  return best;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::printf("this processor has no AVX2 + FMA: nothing to time\n");
    return 0;
  }
  Operands o;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* v : {&o.kq, &o.kr, &o.St, &o.U}) for (float& x : *v) x = u(rng);
  for (float& x : o.decay) x = 0.99f;  // keeps the repeatedly updated state bounded
  for (int i = 0; i < kC; ++i)
    for (int c = 0; c < kKp; ++c) o.krT[c * kC + i] = o.kr[i * kKp + c];
  const double reads_flops = 2.0 * 2 * kC * kK * kPanel * (kV / kPanel);
  const double update_flops = 2.0 * kK * kC * kPanel * (kV / kPanel);
  const int reps = 4000;

  const double t_reads = time_panels([&](int v0) { reads(o, &o.St[v0], o.R.data()); }, reps);
  const double t_update = time_panels([&](int v0) { update(o, &o.St[v0]); }, reps);
  const double t_both = time_panels([&](int v0) { reads(o, &o.St[v0], o.R.data()), update(o, &o.St[v0]); }, reps);
  std::printf("engine tiles: R %.1f GFLOP/s, update %.1f GFLOP/s, both a panel at a time %.1f GFLOP/s "
              "(K = V = 128, C = 16, one thread)\n",
              reads_flops / t_reads * 1e-9, update_flops / t_update * 1e-9, (reads_flops + update_flops) / t_both * 1e-9);
#ifdef HAVE_LIBXSMM
  libxsmm_init();
  // column-major views of the engine's row-major operands: R^T = S_panel^T-view x kq^T-view
  const libxsmm_blasint lda_r = kVp, ldb_r = kKp, ldc_r = kPanel, lda_u = kPanel, ldb_u = kC, ldc_u = kVp;
  const float one = 1.0f, zero = 0.0f;
  const libxsmm_smmfunction r_kernel =
      libxsmm_smmdispatch(kPanel, 2 * kC, kK, &lda_r, &ldb_r, &ldc_r, &one, &zero, nullptr, nullptr);
  const libxsmm_smmfunction u_kernel =
      libxsmm_smmdispatch(kPanel, kK, kC, &lda_u, &ldb_u, &ldc_u, &one, &one, nullptr, nullptr);
  if (r_kernel == nullptr || u_kernel == nullptr) {
    std::printf("libxsmm: no kernel for these shapes\n");
    return 1;
  }
  // the same R both ways, to time the same product
  std::vector<float> r_engine(o.R.size()), r_xsmm(o.R.size());
  reads(o, o.St.data(), r_engine.data());
  r_kernel(o.St.data(), o.kq.data(), r_xsmm.data());
  double diff = 0.0;
  for (size_t i = 0; i < r_engine.size(); ++i) diff = std::max(diff, double(std::abs(r_engine[i] - r_xsmm[i])));
  const double t_xr = time_panels([&](int v0) { r_kernel(&o.St[v0], o.kq.data(), o.R.data()); }, reps);
  const double t_xu = time_panels([&](int v0) { u_kernel(o.U.data(), o.krT.data(), &o.St[v0]); }, reps);
  const double t_xu_decay = time_panels(
      [&](int v0) {
        for (int c = 0; c < kKp; ++c)
          for (int w = 0; w < kPanel; ++w) o.St[c * kVp + v0 + w] *= o.decay[c];
        u_kernel(o.U.data(), o.krT.data(), &o.St[v0]);
      },
      reps);
  std::printf("libxsmm %d.%d.%d: R %.1f GFLOP/s (largest |difference| from the engine's R %.1e), update %.1f GFLOP/s "
              "without the e^Γ scaling, %.1f with it\n",
              LIBXSMM_VERSION_MAJOR, LIBXSMM_VERSION_MINOR, LIBXSMM_VERSION_UPDATE, reads_flops / t_xr * 1e-9, diff,
              update_flops / t_xu * 1e-9, update_flops / t_xu_decay * 1e-9);
  libxsmm_finalize();
#else
  std::printf("libxsmm: not built in (not installed, Debian: libxsmm-dev; or -DNO_LIBXSMM), not timed\n");
#endif
  return 0;
}
