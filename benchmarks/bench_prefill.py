"""Prefill benchmark on one GPU: flashkda against fla `chunk_kda` and MoonshotAI FlashKDA.

Same inputs for every implementation in one run; median of CUDA-event timings; speed-up over
each peer; fraction of the memory floor (q, k, v, g, beta read once, out written once, states
read/written once) at the device-to-device copy bandwidth measured in the same run. A second
table gives the accuracy of each implementation against an fp64 token recurrence (SPEC.md §6).

    FLA_FLASH_KDA=0 python benchmarks/bench_prefill.py --out results.md

Peers are optional: whichever of `fla` and `flash_kda` imports is measured.
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys

import torch

os.environ.setdefault("FLA_FLASH_KDA", "0")

import flashkda  # noqa: E402

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
except Exception as exc:  # noqa: BLE001 - any import failure means "peer absent"
    fla_chunk_kda = None
    print(f"fla not importable: {exc}", file=sys.stderr)
try:
    import flash_kda
except Exception as exc:  # noqa: BLE001
    flash_kda = None
    print(f"flash_kda not importable: {exc}", file=sys.stderr)

D = 128
LOWER_BOUND = -5.0

# (name, H, sequence lengths)
CASES = [
    ("T=8192 H=96 one seq", 96, [8192]),
    ("T=8192 H=96 varlen6", 96, [1300, 547, 2048, 963, 271, 3063]),
    ("T=8192 H=96 8x1024", 96, [1024] * 8),
    ("T=8192 H=64 one seq", 64, [8192]),
    ("T=8192 H=64 varlen6", 64, [1300, 547, 2048, 963, 271, 3063]),
    ("T=8192 H=64 8x1024", 64, [1024] * 8),
    ("T=32768 H=32 one seq", 32, [32768]),
    ("T=16384 H=32 16x1024", 32, [1024] * 16),
    ("T=8192 H=32 128x64", 32, [64] * 128),
]


def make_inputs(H, seqlens, with_state, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(seqlens)
    dev = "cuda"

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    x = dict(
        q=rnd(1, T, H, D), k=rnd(1, T, H, D), v=rnd(1, T, H, D), g=rnd(1, T, H, D), beta=rnd(1, T, H),
        A_log=(torch.rand(H, generator=gen, device=dev) * 2 - 1).float(),
        dt_bias=(torch.rand(H, D, generator=gen, device=dev) * 2 - 1).float(),
        cu_seqlens=torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0).tolist()), device=dev, dtype=torch.int64),
    )
    N = len(seqlens)
    x["h0"] = (0.1 * torch.randn(N, H, D, D, generator=gen, device=dev)) if with_state else None  # [N,H,V,K]
    return x


def run_flashkda(x, with_state, precision="precise"):
    out = torch.empty_like(x["v"])
    ht = torch.empty_like(x["h0"]) if with_state else None
    return lambda: flashkda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, out, x["A_log"], x["dt_bias"],
                                LOWER_BOUND, initial_state=x["h0"], final_state=ht, cu_seqlens=x["cu_seqlens"],
                                precision=precision), out, ht


def run_flash_kda(x, with_state):
    out = torch.empty_like(x["v"])
    ht = torch.empty_like(x["h0"]) if with_state else None
    return lambda: flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, out, x["A_log"], x["dt_bias"],
                                 LOWER_BOUND, initial_state=x["h0"], final_state=ht, cu_seqlens=x["cu_seqlens"]), out, ht


def run_fla(x, with_state):
    H = x["q"].shape[2]
    res = {}

    def call():
        o, ht = fla_chunk_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, initial_state=x["h0"],
            output_final_state=with_state, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, A_log=x["A_log"],
            dt_bias=x["dt_bias"].reshape(H * D), state_v_first=True, cu_seqlens=x["cu_seqlens"])
        res["o"], res["ht"] = o, ht

    return call, res


def time_ms(fn, reps=30, warmup=5, inner=1):
    """Median ms per call over `reps` samples. A sample times `inner` back-to-back calls between two
    events: inner=1 includes each call's host overhead (eager), inner>1 lets the host run ahead so
    the figure is the device time per call whenever the host is faster than the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), reps=20)
    return 2 * x.numel() / (ms * 1e-3)  # bytes read + written per second


def floor_bytes(H, T, N, with_state):
    b = (4 * T * H * D + T * H + T * H * D) * 2
    if with_state:
        b += 2 * N * H * D * D * 4
    return b


# ---- accuracy against an fp64 token recurrence (SPEC.md §3, lower-bound gate) ---------------
def reference_fp64(x, seqlens):
    q, k, v, g, beta = (x[n][0].double() for n in ("q", "k", "v", "g", "beta"))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a = LOWER_BOUND * torch.sigmoid(x["A_log"].double().exp()[:, None] * (g + x["dt_bias"].double()))
    b = torch.sigmoid(beta)
    out = torch.zeros_like(v)
    states = []
    bos = 0
    for n, L in enumerate(seqlens):
        S = x["h0"][n].double().transpose(-1, -2).clone() if x["h0"] is not None else \
            torch.zeros(q.shape[1], D, D, dtype=torch.float64, device=q.device)  # [H, K, V]
        for t in range(bos, bos + L):
            S = S * a[t].exp()[:, :, None]
            pred = torch.einsum("hk,hkv->hv", k[t], S)
            S = S + torch.einsum("hk,hv->hkv", k[t], b[t][:, None] * (v[t] - pred))
            out[t] = D ** -0.5 * torch.einsum("hk,hkv->hv", q[t], S)
        states.append(S.transpose(-1, -2))  # [H, V, K]
        bos += L
    return out, torch.stack(states)


def rel_rms(got, ref):
    got = got.double()
    return (torch.linalg.norm(got - ref) / torch.linalg.norm(ref)).item()


def repeated_key(x):
    """Adversarial: one key for every token, raw gate -12, raw beta 8 (near-collinear keys)."""
    x["k"][:] = x["k"][:, :1]
    x["g"].fill_(-12.0)
    x["beta"].fill_(8.0)
    return x


def accuracy_table(seqlens, adversarial=False):
    x = make_inputs(4, seqlens, with_state=True, seed=1)
    if adversarial:
        x = repeated_key(x)
    ref_o, ref_s = reference_fp64(x, seqlens)
    rows = []
    for precision in ("precise", "fast"):
        fn, o, ht = run_flashkda(x, True, precision)
        fn()
        rows.append((f"flashkda {precision}", rel_rms(o[0], ref_o), rel_rms(ht, ref_s)))
    if fla_chunk_kda is not None:
        fn, res = run_fla(x, True)
        fn()
        rows.append(("fla chunk_kda", rel_rms(res["o"][0], ref_o), rel_rms(res["ht"], ref_s)))
    if flash_kda is not None:
        fn, o, ht = run_flash_kda(x, True)
        fn()
        rows.append(("FlashKDA", rel_rms(o[0], ref_o), rel_rms(ht, ref_s)))
    return rows


def sweep_variants(reps):
    """flashkda only: value-column splits x precision mode (FLASHKDA_V_SPLITS, FLASHKDA_PRECISE)."""
    print("| case | splits | precise | ms |")
    print("|---|---|---|---|")
    for name, H, seqlens in [CASES[0], CASES[6], CASES[8]]:
        x = make_inputs(H, seqlens, True)
        for splits in ("1", "2"):
            for precise in ("0", "1"):
                os.environ["FLASHKDA_V_SPLITS"], os.environ["FLASHKDA_PRECISE"] = splits, precise
                print(f"| {name} | {splits} | {precise} | {time_ms(run_flashkda(x, True)[0], reps=reps):.3f} |",
                      flush=True)
        del x
    os.environ.pop("FLASHKDA_V_SPLITS")
    os.environ.pop("FLASHKDA_PRECISE")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also time every recurrence variant of flashkda")
    ap.add_argument("--inner", type=int, default=1,
                    help="back-to-back calls per timed sample (1: eager, host overhead included; 10: device time)")
    ap.add_argument("--no-accuracy", action="store_true",
                    help="skip the accuracy table (it does not depend on --inner; the eager run measures it)")
    ap.add_argument("--accuracy-only", action="store_true", help="the accuracy table only, no timings")
    ap.add_argument("--also", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                    help="one more flashkda column timed with these environment variables set, e.g. "
                         "balanced:FLASHKDA_PRECISE=2 (kernel switches of a candidate build)")
    args = ap.parse_args()
    extra = []
    for spec in args.also:
        label, _, assigns = spec.partition(":")
        extra.append((label, dict(kv.split("=", 1) for kv in assigns.split(",") if kv)))
    if args.sweep:
        sweep_variants(args.reps)

    bw = copy_bandwidth()
    lines = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines.append(f"GPU: {torch.cuda.get_device_name()} | date: {datetime.date.today()} | commit: {commit or 'n/a'} | "
                 f"copy bandwidth: {bw / 1e12:.2f} TB/s | torch {torch.__version__} | "
                 f"{'eager calls' if args.inner == 1 else f'{args.inner} back-to-back calls'} per timed sample")
    lines.append("")
    lines.append("| case | state | flashkda ms | fla ms | FlashKDA ms | vs fla | vs FlashKDA | floor ms | % of floor "
                 "| flashkda fast ms | fast vs fla | fast vs FlashKDA |"
                 + "".join(f" {label} ms | {label} vs FlashKDA |" for label, _ in extra))
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(extra))
    print("\n".join(lines), flush=True)
    for name, H, seqlens in ([] if args.accuracy_only else CASES):
        for with_state in (False, True):
            x = make_inputs(H, seqlens, with_state)
            timed = dict(reps=args.reps, inner=args.inner)
            t_ours = time_ms(run_flashkda(x, with_state)[0], **timed)
            t_fast = time_ms(run_flashkda(x, with_state, "fast")[0], **timed)
            t_extra = []
            for _, env in extra:
                saved = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                try:
                    t_extra.append(time_ms(run_flashkda(x, with_state)[0], **timed))
                finally:
                    for key, value in saved.items():
                        if value is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = value
            t_fla = time_ms(run_fla(x, with_state)[0], **timed) if fla_chunk_kda else float("nan")
            t_fk = time_ms(run_flash_kda(x, with_state)[0], **timed) if flash_kda else float("nan")
            floor = floor_bytes(H, sum(seqlens), len(seqlens), with_state) / bw * 1e3
            lines.append(f"| {name} | {'fp32' if with_state else 'none'} | {t_ours:.3f} | {t_fla:.3f} | {t_fk:.3f} | "
                         f"{t_fla / t_ours:.2f}x | {t_fk / t_ours:.2f}x | {floor:.3f} | {100 * floor / t_ours:.0f}% | "
                         f"{t_fast:.3f} | {t_fla / t_fast:.2f}x | {t_fk / t_fast:.2f}x |"
                         + "".join(f" {t:.3f} | {t_fk / t:.2f}x |" for t in t_extra))
            print(lines[-1], flush=True)
            del x
            torch.cuda.empty_cache()
    if not args.no_accuracy:
        lines.append("")
        lines.append("Accuracy, rel-RMS vs fp64 token recurrence (H=4, fp32 initial state x0.1, bf16 inputs, "
                     "lower-bound gate):")
        lines.append("")
        lines.append("| inputs | implementation | output | final state |")
        lines.append("|---|---|---|---|")
        print("\n".join(lines[-5:]), flush=True)
        for label, seqlens, adversarial in (("varlen [300, 17, 1024, 77]", [300, 17, 1024, 77], False),
                                            ("repeated key, g=-12, beta=8, T=4096", [4096], True)):
            for name, eo, es in accuracy_table(seqlens, adversarial):
                lines.append(f"| {label} | {name} | {eo:.2e} | {es:.2e} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
