"""python -m flashkda.demo: one KDA forward on a realistic shape, timed, and checked against the fp64
reference on a sample.

Runs on torch CUDA when torch sees a GPU and this build has the CUDA backend (T=8192, H=16,
K=V=128, bf16, lower-bound gate, 6 packed sequences), else on numpy with the CPU backend at a
smaller shape (T=2048) so that it finishes in seconds. The accuracy check runs the library's fp64
token recurrence (flashkda.reference_forward) on the first sequence, all heads.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import numpy as np

import flashkda

GPU_LENGTHS = [1300, 547, 2048, 963, 271, 3063]  # T = 8192 (docs/SPEC.md §7)
CPU_LENGTHS = [700, 300, 1048]  # T = 2048


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2) / max(np.mean(ref * ref), 1e-300)))


def make_inputs(lengths, H, K, V, seed):
    """bf16 inputs (ml_dtypes) of one packed batch, fp32 gate parameters, fp32 initial state."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    T, N = int(sum(lengths)), len(lengths)
    bf16 = ml_dtypes.bfloat16
    return dict(
        q=rng.standard_normal((1, T, H, K)).astype(bf16),
        k=rng.standard_normal((1, T, H, K)).astype(bf16),
        v=rng.standard_normal((1, T, H, V)).astype(bf16),
        g=rng.standard_normal((1, T, H, K)).astype(bf16),
        beta=rng.standard_normal((1, T, H)).astype(bf16),
        A_log=(0.5 * rng.standard_normal(H)).astype(np.float32),
        dt_bias=(0.5 * rng.standard_normal((H, K))).astype(np.float32),
        initial_state=(0.1 * rng.standard_normal((N, H, V, K))).astype(np.float32),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    )


def pick_backend(requested):
    have_torch_cuda = False
    if requested in ("auto", "cuda") and importlib.util.find_spec("torch") is not None:
        import torch

        have_torch_cuda = torch.cuda.is_available() and flashkda.cuda_available()
    if requested == "cuda" and not have_torch_cuda:
        sys.exit("demo: --backend cuda needs torch with a CUDA GPU and a flashkda build with the CUDA backend "
                 f"(built_with_cuda={flashkda.built_with_cuda}, cuda_available={flashkda.cuda_available()})")
    return "cuda" if have_torch_cuda else "cpu"


def time_cpu(fn, iters):
    fn()  # warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_cuda(fn, iters):
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashkda.demo", description=" ".join(__doc__.split("\n\n")[0].split()),
                                 epilog=" ".join(__doc__.split("\n\n")[1].split()))
    ap.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--lengths", type=str, default=None,
                    help="comma-separated sequence lengths (default: 6 sequences, T=8192 on CUDA; 3, T=2048 on CPU)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs (default 20 on CUDA, 3 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    backend = pick_backend(args.backend)
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
               else (GPU_LENGTHS if backend == "cuda" else CPU_LENGTHS))
    iters = args.iters or (20 if backend == "cuda" else 3)
    H, K, V = args.heads, 128, 128
    T, N = sum(lengths), len(lengths)
    x = make_inputs(lengths, H, K, V, args.seed)
    scale, lower_bound = K ** -0.5, -5.0

    if backend == "cuda":
        import torch

        dev = torch.device("cuda")
        to_dev = {n: (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype.name == "bfloat16"
                      else torch.from_numpy(a)).to(dev) for n, a in x.items()}
        arrays = to_dev
        out = torch.empty((1, T, H, V), dtype=torch.bfloat16, device=dev)
        final = torch.empty((N, H, V, K), dtype=torch.float32, device=dev)
        where = f"torch CUDA ({torch.cuda.get_device_name(dev)})"
        timer = time_cuda
    else:
        arrays = x
        out = np.empty((1, T, H, V), dtype=x["q"].dtype)
        final = np.empty((N, H, V, K), dtype=np.float32)
        where = "numpy, CPU backend"
        timer = time_cpu

    def run():
        flashkda.fwd(arrays["q"], arrays["k"], arrays["v"], arrays["g"], arrays["beta"], scale, out,
                     arrays["A_log"], arrays["dt_bias"], lower_bound, initial_state=arrays["initial_state"],
                     final_state=final, cu_seqlens=arrays["cu_seqlens"])

    seconds = timer(run, iters)
    out_h = out.float().cpu().numpy() if backend == "cuda" else out.astype(np.float32)
    final_h = final.cpu().numpy() if backend == "cuda" else final

    # fp64 reference on the first sequence (all heads)
    n0 = lengths[0]
    ref_o, ref_h = flashkda.reference_forward(
        *(x[n][:, :n0] for n in ("q", "k", "v", "g", "beta")), gate="lower_bound", A_log=x["A_log"],
        dt_bias=x["dt_bias"], lower_bound=lower_bound, scale=scale, initial_state=x["initial_state"][:1])

    print(f"flashkda {flashkda.version()}  fwd (FlashKDA API): lower-bound gate, l2norm q/k, sigmoid beta, "
          "fp32 initial/final state")
    print(f"backend      : {where}")
    print(f"shape        : T={T} (varlen {lengths}), H={H}, K={K}, V={V}, bf16")
    print(f"median time  : {seconds * 1e3:.3f} ms over {iters} runs")
    print(f"throughput   : {T / seconds:,.0f} tokens/s ({T * H / seconds:,.0f} token-heads/s)")
    print(f"accuracy     : first sequence ({n0} tokens, {H} heads) vs fp64 token recurrence: "
          f"rel-RMS output {rel_rms(out_h[:, :n0], ref_o):.2e}, final state {rel_rms(final_h[:1], ref_h):.2e}")
    ok = np.isfinite(out_h).all() and np.isfinite(final_h).all()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
