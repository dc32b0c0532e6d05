"""CPU backend benchmark: tokens/s and GFLOP/s of flashkda's chunk-16 CPU forward, next to the
library's fp64 token recurrence (flashkda.reference_forward) and this machine's sgemm rate.

    python benchmarks/bench_cpu.py                      # T in 2048 8192, H in 4 16 32, decode N in 1 64 256
    python benchmarks/bench_cpu.py --out cpu.md         # also write the markdown section to a file

Inputs as in FlashKDA's fwd: bf16 q, k, v, g, beta (ml_dtypes), lower-bound gate (A_log, dt_bias
fp32), L2-normalised q and k, beta logits, fp32 initial and final state, one sequence. The CPU
backend is timed through flashkda.fwd (median of --reps runs after one warm-up). The reference
costs exactly T times its per-token cost, so it runs on the first --ref-T tokens and is scaled.

FLOP counts (multiply-add = 2 FLOPs; preprocessing, exponentials and the decay scaling not counted):
- chunk form (docs/SPEC.md §4), per chunk of C = 16 tokens of one head:
    Kd S0 (u), Qd S0 (O), Kr^T U (S1)       3 x 2 C K V
    L (i > j) and Mqk (i >= j)             2 C^2 K      (C(C-1)/2 + C(C+1)/2 = C^2 dot products)
    (I + L)^{-1} u and Mqk U               2 C^2 V      (forward substitution + lower-triangular product)
  = 6 C K V + 2 C^2 (K + V) per chunk, i.e. 6 K V + 2 C (K + V) = 106,496 per token and head at 128.
- token recurrence (docs/SPEC.md §3), per token of one head: S^T k, the rank-1 update, S^T q
  = 3 x 2 K V, plus K V for the decay = 7 K V = 114,688 at K = V = 128.
The sgemm yardstick is numpy's float32 matmul of two --gemm-n square matrices (2 n^3 FLOPs). With
OpenBLAS it is also timed in a child process per forced kernel family (OPENBLAS_CORETYPE: Haswell,
and SkylakeX where the processor has AVX-512), since OpenBLAS may pick a narrower family than the
processor runs (on a 2-core AMD VM with AVX-512 it picked its AVX2 kernels: 233 GFLOP/s, against 460
with SkylakeX forced); "% of best sgemm" relates to the fastest of them. Decode moves each state
line of its pool once in and once out, so its yardstick is an in-place multiply of the same pool
(torch's, on the OpenMP thread count, where torch is installed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

import flashkda
from flashkda import _internal

CHUNK = 16
ENGINES = {1: "baseline ISA", 2: "AVX2 + FMA", 3: "AVX-512"}
BF16 = ml_dtypes.bfloat16


def chunk_flops_per_token(K, V):
    return 6 * K * V + 2 * CHUNK * (K + V)


def token_flops_per_token(K, V):
    return 7 * K * V


def make_inputs(T, H, K, V, seed):
    rng = np.random.default_rng(seed)
    return dict(
        q=rng.standard_normal((1, T, H, K), np.float32).astype(BF16),
        k=rng.standard_normal((1, T, H, K), np.float32).astype(BF16),
        v=rng.standard_normal((1, T, H, V), np.float32).astype(BF16),
        g=rng.standard_normal((1, T, H, K), np.float32).astype(BF16),
        beta=rng.standard_normal((1, T, H), np.float32).astype(BF16),
        A_log=(0.5 * rng.standard_normal(H)).astype(np.float32),
        dt_bias=(0.5 * rng.standard_normal((H, K))).astype(np.float32),
        h0=(0.1 * rng.standard_normal((1, H, V, K))).astype(np.float32),
    )


def run_flashkda(x, T, lower_bound):
    """flashkda.fwd on the first T tokens; returns (out, final_state)."""
    q, k, v, g, beta = (x[n][:, :T] for n in ("q", "k", "v", "g", "beta"))
    K = q.shape[-1]
    out = np.empty(v.shape, BF16)
    ht = np.empty(x["h0"].shape, np.float32)
    flashkda.fwd(q, k, v, g, beta, K**-0.5, out, x["A_log"], x["dt_bias"], lower_bound, initial_state=x["h0"],
                 final_state=ht)
    return out, ht


def softplus_log_decay(x, T):
    """The softplus gate's log-decay -exp(A_log) softplus(g + dt_bias) of the first T tokens, fp32."""
    g = np.asarray(x["g"][:, :T], np.float32) + x["dt_bias"]
    return (-np.exp(x["A_log"])[:, None] * np.logaddexp(0.0, g)).astype(np.float32)


def run_gate_form(x, T, form):
    """flashkda.chunk_kda on the first T tokens with the softplus gate in the kernel ('softplus', Kimi
    Linear's) or its log-decay precomputed in fp32 ('precomputed'); returns (out, final_state)."""
    q, k, v, beta = (x[n][:, :T] for n in ("q", "k", "v", "beta"))
    common = dict(initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, state_v_first=True)
    if form == "softplus":
        return flashkda.chunk_kda(q, k, v, x["g"][:, :T], beta, use_gate_in_kernel=True, A_log=x["A_log"],
                                  dt_bias=x["dt_bias"], **common)
    return flashkda.chunk_kda(q, k, v, x["a"][:, :T], beta, **common)


def reference_gate_form(x, T, form):
    q, k, v, beta = (x[n][:, :T] for n in ("q", "k", "v", "beta"))
    if form == "softplus":
        return flashkda.reference_forward(q, k, v, x["g"][:, :T], beta, gate="softplus", A_log=x["A_log"],
                                          dt_bias=x["dt_bias"], initial_state=x["h0"])
    return flashkda.reference_forward(q, k, v, x["a"][:, :T], beta, gate="precomputed", initial_state=x["h0"])


def gate_form_rows(args, best_gemm, chunk_fpt):
    """The prefill with the other two gate forms at one shape (--gate-shape), same inputs otherwise."""
    T, H = args.gate_shape
    K = V = args.K
    x = make_inputs(T, H, K, V, seed=H)
    x["a"] = softplus_log_decay(x, T)
    rows = []
    for form in ("softplus", "precomputed"):
        t = timed(lambda: run_gate_form(x, T, form), args.reps)
        ref_T = min(args.ref_T, T)
        out_ref, ht_ref = reference_gate_form(x, ref_T, form)
        out, ht = run_gate_form(x, ref_T, form)
        gflops = T * H * chunk_fpt / t / 1e9
        rows.append((form, T, H, t * 1e3, gflops, 100 * gflops / best_gemm, rel_rms(out, out_ref), rel_rms(ht, ht_ref)))
        print(f"T={T} H={H} {form} gate: flashkda {t * 1e3:.1f} ms", flush=True)
    return rows


def run_reference(x, T, lower_bound):
    q, k, v, g, beta = (x[n][:, :T] for n in ("q", "k", "v", "g", "beta"))
    return flashkda.reference_forward(q, k, v, g, beta, gate="lower_bound", A_log=x["A_log"], dt_bias=x["dt_bias"],
                                      lower_bound=lower_bound, initial_state=x["h0"])


def torch_chunked(x, T, lower_bound, C=64):
    """A plain torch implementation for comparison (chunk 64, fp32): the chunk form of docs/SPEC.md §4
    with e^{G} e^{-G} factors, batched over heads, one chunk at a time (on this kind of machine it ran
    2x faster than the token-parallel WY variant that precomputes every chunk's (I + L)^{-1}).
    Returns (out [T, H, V], final state [H, V, K]) as numpy float32; where a chunk's e^{-G} overflows
    (strong decay over 64 tokens) they are not finite: flashkda's chunk form never forms e^{-G}."""
    import torch

    f = {n: torch.from_numpy(np.asarray(x[n][0, :T], np.float32)) for n in ("q", "k", "v", "g", "beta")}
    H, K, V = f["q"].shape[1], f["q"].shape[2], f["v"].shape[2]
    q = torch.nn.functional.normalize(f["q"], dim=-1, eps=1e-3)
    k = torch.nn.functional.normalize(f["k"], dim=-1, eps=1e-3)
    A = torch.from_numpy(x["A_log"]).exp()[:, None]
    a = lower_bound * torch.sigmoid(A * (f["g"] + torch.from_numpy(x["dt_bias"])))  # [T, H, K]
    b = torch.sigmoid(f["beta"])
    S = torch.from_numpy(x["h0"][0]).transpose(-1, -2).contiguous()  # [H, K, V]
    out = torch.empty(T, H, V)
    eye, strict = torch.eye(C), torch.ones(C, C).tril(-1)
    for t0 in range(0, T, C):
        n = min(C, T - t0)
        qc, kc, vc, ac = (y[t0:t0 + n].transpose(0, 1) for y in (q, k, f["v"], a))  # [H, n, .]
        bc = b[t0:t0 + n].transpose(0, 1)[..., None]
        G = ac.cumsum(1)
        kd, ki, qd = kc * G.exp(), kc * (-G).exp(), K ** -0.5 * qc * G.exp()
        L = bc * (kd @ ki.transpose(1, 2)) * strict[:n, :n]
        U = torch.linalg.solve_triangular(eye[:n, :n] + L, bc * (vc - kd @ S), upper=False, unitriangular=True)
        Aqk = (qd @ ki.transpose(1, 2)) * (strict[:n, :n] + eye[:n, :n])
        out[t0:t0 + n] = (qd @ S + Aqk @ U).transpose(0, 1)
        S = G[:, -1:].transpose(1, 2).exp() * S + (kc * (G[:, -1:] - G).exp()).transpose(1, 2) @ U
    return out.numpy(), S.transpose(-1, -2).numpy()


# Seconds to wait before timing anything: a library's thread pool keeps its threads spinning for a
# while after its last call (OpenBLAS's, after the sgemm yardstick; torch's), and on a 2-core machine
# they share the cores with the code timed next (measured: flashkda.fwd right after a numpy sgemm,
# T=2048 H=4, a median of 15.8 ms against 7.3 after this pause).
PAUSE_S = 0.5


def timed(fn, reps, warmup=1):
    time.sleep(PAUSE_S)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref**2)))


def sgemm_gflops(n, reps):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), np.float32)
    b = rng.standard_normal((n, n), np.float32)
    t = timed(lambda: a @ b, reps)
    return 2 * n**3 / t / 1e9


def pool_scale_gbps(pool, reps):
    """The decode's memory yardstick: its own fp32 pool multiplied by 1 in place, each line read and
    written once as decode reads and writes the lines of the slots it steps; GB/s counting both. torch's
    mul_ on the OpenMP thread count where torch is installed, else numpy's (one thread). The same pages
    as the decode's: on this kind of VM a fresh 256 MB array moved 47-84 GB/s from one process to the
    next (its pages' backing, not its contents), the decode's speed staying put. Returns (GB/s, what)."""
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))))
        pt = torch.from_numpy(pool)
        t = timed(lambda: pt.mul_(1.0), reps)
        what = f"torch, {torch.get_num_threads()} threads"
    except ImportError:
        t = timed(lambda: np.multiply(pool, np.float32(1.0), out=pool), reps)
        what = "numpy, one thread: torch is not installed"
    return 2 * pool.nbytes / t / 1e9, what


def forced_sgemm_gflops(n, reps, coretype):
    """numpy's sgemm in a child process with OPENBLAS_CORETYPE=coretype (read when OpenBLAS loads)."""
    code = ("import time, numpy as np\n"
            f"n, reps = {int(n)}, {int(reps)}\n"
            "rng = np.random.default_rng(0)\n"
            "a = rng.standard_normal((n, n), np.float32); b = rng.standard_normal((n, n), np.float32)\n"
            "a @ b\n"
            "ts = []\n"
            "for _ in range(reps):\n"
            "    t = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t)\n"
            "print(2 * n**3 / sorted(ts)[len(ts) // 2] / 1e9)\n")
    env = dict(os.environ, OPENBLAS_CORETYPE=coretype)
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                             check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - any failure: not measured, and said why
        print(f"sgemm with OPENBLAS_CORETYPE={coretype} not measured: {e}", file=sys.stderr)
        return float("nan")


def blas_name():
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - older numpy: no dict mode
        return "unknown BLAS"


def machine():
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        model = platform.processor() or model
    isa = ", ".join(f for f in ("avx2", "fma", "avx512f") if f in flags) or "no AVX2"
    return model, isa


def git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def torch_decode_loop(pool, idx, x, lower_bound):
    """A plain torch serving step for comparison: gather the named states, one token of the
    recurrence (docs/SPEC.md §3) batched over sequences and heads, scatter them back."""
    import torch

    f = {n: torch.from_numpy(np.asarray(x[n][:, 0], np.float32)) for n in ("q", "k", "v", "g", "beta")}  # [N, H, .]
    q = torch.nn.functional.normalize(f["q"], dim=-1, eps=1e-3)
    k = torch.nn.functional.normalize(f["k"], dim=-1, eps=1e-3)
    a = lower_bound * torch.sigmoid(torch.from_numpy(x["A_log"]).exp()[:, None] * (f["g"] + torch.from_numpy(x["dt_bias"])))
    b = torch.sigmoid(f["beta"])[..., None]
    S = pool[idx]  # [N, H, V, K]
    S = S * a.exp()[:, :, None, :]
    S = S + (b * (f["v"] - (S @ k[..., None])[..., 0]))[..., None] * k[:, :, None, :]
    o = (S @ q[..., None])[..., 0] * q.shape[-1] ** -0.5
    pool[idx] = S
    return o


def decode_rows(args, lower_bound, engine):
    """flashkda's CPU decode (one token per sequence, fp32 pool updated in place through indices)
    against the torch gather / step / scatter loop, same inputs; and the same decode with the engine
    compiled for the baseline ISA and (on an AVX-512 processor) for AVX2 (launch field cpu_isa)."""
    rows = []
    H, K = 16, args.K
    for N in args.decode_n:
        P = N + 8
        rng = np.random.default_rng(N)
        x = make_inputs(1, H, K, K, seed=N)
        x = {n: (np.repeat(v, N, axis=0) if n in ("q", "k", "v", "g", "beta") else v) for n, v in x.items()}
        for n in ("q", "k", "v", "g", "beta"):
            x[n] = (rng.standard_normal(x[n].shape).astype(np.float32)).astype(BF16)
        pool = (0.1 * rng.standard_normal((P, H, K, K))).astype(np.float32)
        idx = rng.permutation(P)[:N].astype(np.int32)

        def ours():
            flashkda.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                         initial_state=pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
                                         state_v_first=True, ssm_state_indices=idx)
        t_ours = timed(ours, args.reps)
        t_isa = {}
        for isa in (1, 2) if engine == 3 else (1,):
            with _internal.launch(cpu_isa=isa):
                t_isa[isa] = timed(ours, args.reps)
        t_torch = float("nan")
        try:
            import torch

            pool_t = torch.from_numpy(pool.copy())
            idx_t = torch.from_numpy(idx).long()
            t_torch = timed(lambda: torch_decode_loop(pool_t, idx_t, x, lower_bound), args.reps)
        except ImportError:
            pass
        state_bytes = 2 * N * H * K * K * 4
        mem, mem_what = pool_scale_gbps(pool, args.reps)
        rows.append((N, H, t_ours * 1e6, t_torch * 1e6, t_torch / t_ours, state_bytes / t_ours / 1e9,
                     t_isa[1] * 1e6, t_isa.get(2, float("nan")) * 1e6, mem, mem_what))
        print(f"decode N={N}: flashkda {t_ours * 1e6:.0f} us, torch {t_torch * 1e6:.0f} us", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192], help="tokens (one sequence)")
    ap.add_argument("--heads", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--K", type=int, default=128, help="head size (K = V)")
    ap.add_argument("--ref-T", type=int, default=256, help="tokens the fp64 reference runs on (then scaled to T)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gemm-n", type=int, default=4096)
    ap.add_argument("--lower-bound", type=float, default=-5.0)
    ap.add_argument("--decode-n", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--no-torch", action="store_true", help="skip the torch columns")
    ap.add_argument("--gate-shape", type=int, nargs=2, default=[8192, 16], metavar=("T", "H"),
                    help="the shape the softplus and precomputed gate forms run at")
    ap.add_argument("--no-gate-forms", action="store_true", help="skip the softplus and precomputed rows")
    ap.add_argument("--out", help="also write the markdown section to this file")
    args = ap.parse_args()
    K = args.K
    V = K
    try:
        import torch  # noqa: F401

        have_torch = not args.no_torch
    except ImportError:
        have_torch = False
        print("torch is not installed: the torch columns are skipped", flush=True)

    model, isa = machine()
    engine = _internal.cpu_engine_isa()
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    gemm = sgemm_gflops(args.gemm_n, args.reps)
    forced = {}
    if "openblas" in blas_name().lower():
        for coretype in ("Haswell", "SkylakeX") if "avx512f" in isa else ("Haswell",):
            forced[coretype] = forced_sgemm_gflops(args.gemm_n, args.reps, coretype)
    best_gemm = max([gemm] + [g for g in forced.values() if g == g])
    chunk_fpt = chunk_flops_per_token(K, V)
    token_fpt = token_flops_per_token(K, V)

    rows = []
    for T in args.T:
        ref_T = min(args.ref_T, T)
        for H in args.heads:
            x = make_inputs(T, H, K, V, seed=H)
            t_cpu = timed(lambda: run_flashkda(x, T, args.lower_bound), args.reps)
            t_avx2 = float("nan")
            if engine == 3:  # the AVX2 engine beside the AVX-512 one, on the same inputs
                with _internal.launch(cpu_isa=2):
                    t_avx2 = timed(lambda: run_flashkda(x, T, args.lower_bound), args.reps)
            t_torch = timed(lambda: torch_chunked(x, T, args.lower_bound), max(1, args.reps // 2)) if have_torch \
                else float("nan")
            t_ref = timed(lambda: run_reference(x, ref_T, args.lower_bound), 1, warmup=0)
            out_ref, ht_ref = run_reference(x, ref_T, args.lower_bound)
            out_cpu, ht_cpu = run_flashkda(x, ref_T, args.lower_bound)
            cpu_gflops = T * H * chunk_fpt / t_cpu / 1e9
            rows.append((T, H, t_cpu * 1e3, cpu_gflops, 100 * cpu_gflops / gemm, t_torch * 1e3, t_torch / t_cpu,
                         t_ref * T / ref_T * 1e3, t_ref * T / ref_T / t_cpu, rel_rms(out_cpu, out_ref),
                         rel_rms(ht_cpu, ht_ref), t_avx2 * 1e3, 100 * cpu_gflops / best_gemm))
            print(f"T={T} H={H}: flashkda {t_cpu * 1e3:.1f} ms, torch {t_torch * 1e3:.1f} ms", flush=True)
    grows = [] if args.no_gate_forms else gate_form_rows(args, best_gemm, chunk_fpt)
    drows = decode_rows(args, args.lower_bound, engine) if args.decode_n else []

    lines = [
        f"- machine: {model}, {os.cpu_count()} cores (nproc), {isa}; OpenMP threads: {threads}",
        f"- date: {datetime.date.today().isoformat()}; commit: {git_commit()}; flashkda {flashkda.version()}",
        f"- command: `python benchmarks/bench_cpu.py --T {' '.join(map(str, args.T))} --heads "
        f"{' '.join(map(str, args.heads))} --ref-T {args.ref_T} --reps {args.reps} --gemm-n {args.gemm_n}`",
        f"- sgemm yardstick: numpy float32 matmul {args.gemm_n}x{args.gemm_n} ({blas_name()}): "
        f"**{gemm:.1f} GFLOP/s**" + "".join(f"; with OPENBLAS_CORETYPE={k} {v:.1f}" for k, v in forced.items())
        + f"; best {best_gemm:.1f}",
        f"- inputs: one sequence of T tokens, K=V={K}, bf16 q/k/v/g/beta, lower-bound gate ({args.lower_bound}), "
        f"fp32 initial and final state; flashkda times are the median of {args.reps} runs",
        "- torch chunked: `torch_chunked` in this file (chunk 64, fp32, batched over heads; its e^{-G} "
        "factors overflow on these gates, so its outputs are not finite: timing only)",
        f"- fp64 reference: `flashkda.reference_forward` timed once on the first tokens (--ref-T), scaled to T; "
        "the error columns compare the CPU backend with it there",
        f"- FLOPs: chunk form {chunk_fpt:,} per token and head (6KV + 2C(K+V), C=16)",
        f"- CPU engine: {ENGINES[engine]}" + ("; the AVX2 engine's time on the same inputs beside it (launch field "
                                             "cpu_isa=2, the same bits)" if engine == 3 else ""),
        "",
        "| T | H | CPU backend ms | GFLOP/s | % of sgemm | % of best sgemm | torch chunked ms | vs torch "
        "| fp64 reference ms (scaled) | vs reference | out rel-RMS | state rel-RMS |"
        + (" AVX2 engine ms | AVX-512 speed-up |" if engine == 3 else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if engine == 3 else ""),
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.0f}% | {r[12]:.0f}% | {r[5]:.0f} | {r[6]:.1f}x "
                     f"| {r[7]:,.0f} | {r[8]:.1f}x | {r[9]:.1e} | {r[10]:.1e} |"
                     + (f" {r[11]:.1f} | {r[11] / r[2]:.2f}x |" if engine == 3 else ""))
    if grows:
        lines += ["", "The other gate forms at one shape (flashkda.chunk_kda, the same inputs: the softplus gate "
                  "-exp(A_log) softplus(g + dt_bias) in the kernel, Kimi Linear's; and that log-decay "
                  "precomputed in fp32 and passed as g):", "",
                  "| gate | T | H | CPU backend ms | GFLOP/s | % of best sgemm | out rel-RMS | state rel-RMS |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in grows:
            lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.0f}% | {r[6]:.1e} | {r[7]:.1e} |")
    if drows:
        lines += ["", "Decode, one token per sequence, H=16, fp32 pool [P, H, V, K] updated in place through "
                  "indices (flashkda.fused_recurrent_kda; torch: gather, one recurrence step, scatter); the "
                  f"yardstick: the same pool [N + 8, H, V, K] multiplied by 1 in place ({drows[0][9]}):", "",
                  "| N | H | flashkda us | torch loop us | vs torch | state GB/s (read + written) "
                  "| pool in-place GB/s | % of it "
                  "| baseline-ISA engine us |"
                  + (" AVX2 engine us |" if engine == 3 else ""),
                  "|---|---|---|---|---|---|---|---|---|" + ("---|" if engine == 3 else "")]
        for r in drows:
            lines.append(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.1f}x | {r[5]:.1f} | {r[8]:.1f} "
                         f"| {100 * r[5] / r[8]:.0f}% "
                         f"| {r[6]:.0f} |" + (f" {r[7]:.0f} |" if engine == 3 else ""))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
