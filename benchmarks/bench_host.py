"""Host time of flashkda.fwd's argument path: the Python checks, the layout work and the DLPack
conversion into flashkda._C, without any kernel. The kernel call is replaced by _C.workspace_size,
which imports and validates the same arguments, so this runs anywhere (CPU tensors, no GPU).

    python benchmarks/bench_host.py [--H 96] [--T 16] [--reps 7]

On a GPU the full eager overhead is measured by benchmarks/profile_prefill.py (host us per call).
"""
import argparse
import statistics
import time

import torch

import flashkda
import flashkda._launch as launch


class _NoKernel:
    """flashkda._C with forward() replaced by the argument import + validation of workspace_size()."""

    def __init__(self, real):
        self._real = real

    def forward(self, *args, workspace_alloc=None, stream=0, workspace=None, precision="precise", **kwargs):
        return self._real.workspace_size(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--H", type=int, default=96)
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--api", choices=["fwd", "chunk_kda"], default="fwd")
    args = ap.parse_args()
    H, T, D = args.H, args.T, 128
    rnd = lambda *s: torch.randn(*s).to(torch.bfloat16)  # noqa: E731
    q, k, v, g = (rnd(1, T, H, D) for _ in range(4))
    beta = rnd(1, T, H)
    A_log, dt_bias = torch.rand(H), torch.rand(H, D)
    cu = torch.tensor([0, T])
    h0 = torch.randn(1, H, D, D)
    out, ht = torch.empty_like(v), torch.empty_like(h0)

    def call():
        flashkda.fwd(q, k, v, g, beta, D ** -0.5, out, A_log, dt_bias, -5.0, initial_state=h0, final_state=ht,
                     cu_seqlens=cu)

    if args.api == "chunk_kda":  # fla's call as in benchmarks/bench_prefill.py (flat dt_bias, v-first states)
        def call():
            flashkda.chunk_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                               safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias.reshape(H * D),
                               state_v_first=True, cu_seqlens=cu)

    real = launch._C
    launch._C = _NoKernel(real)
    try:
        samples = []
        for _ in range(args.reps):
            for _ in range(200):
                call()
            n = 2000
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            samples.append((time.perf_counter() - t0) / n * 1e6)
    finally:
        launch._C = real
    print(f"flashkda.{args.api} argument path, H={H}: median {statistics.median(samples):.1f} us per call "
          f"(samples: {', '.join(f'{s:.1f}' for s in samples)})")


if __name__ == "__main__":
    main()
