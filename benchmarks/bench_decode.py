"""Decode benchmark on one GPU: flashkda.fused_recurrent_kda against fla's fused_recurrent_kda_fwd.

Serving setup of docs/SPEC.md §8: a state pool [P, H, V, K] (state_v_first) updated in place through
ssm_state_indices, lower-bound gate, L2 norm and beta sigmoid fused, bf16 q/k/v/g/beta.
T_n = 1: one slot per sequence (read, then written). T_n > 1: speculative decoding as vLLM runs
it, ssm_state_indices [N, T] and num_accepted_tokens = 1: the start state is read from slot
[n, 0] and the state after token t written to slot [n, t] (1 read + T writes per state).

Same inputs and the same pool for both implementations in one run. Times are medians of CUDA-event
timings of CUDA-graph replays (each graph holds --inner calls; the per-call figure excludes Python
and launch overhead that graphs remove), plus the median eager per-call time for context. State
bandwidth = state bytes read + written / time; "% copy" relates it to the device-to-device copy
bandwidth (read + write) measured in the same run.

    FLA_FLASH_KDA=0 python benchmarks/bench_decode.py --out decode.md

--slot-check adds our decode without the shared-slot check (internal::DecodeLaunch::check_slots = -1;
the default checks every call of two or more sequences) and the default's time against it: the
check's cost. --kernels 0 1 2 3 adds our decode with each kernel forced
(internal::DecodeLaunch::persistent: 0 the tile kernels, 1 the persistent kernel, 2 and 3 its
bulk-copy variant with four and three buffers): time, % copy, and whether out and pool are the
default's bit for bit. --mix adds ours against the device's read-alone and write-alone rates mixed as a
step's traffic, one read and T writes ("% mix"): a speculative T = 4 step is four-fifths writes, which the
copy's one-to-one yardstick does not weigh (issue 13's bf16 T = 4 rows stayed at 85-87% of the copy rate
on an H100 in every kernel, run 171).
"""
import argparse
import datetime
import os
import statistics
import sys

import torch

os.environ.setdefault("FLA_FLASH_KDA", "0")

try:
    import flashkda
    ours = getattr(flashkda, "fused_recurrent_kda", None)
    if ours is None:
        print("flashkda has no fused_recurrent_kda: our decode is not measured", file=sys.stderr)
except Exception as exc:  # noqa: BLE001 - any import failure means "not measurable"
    ours = None
    print(f"flashkda not importable ({exc}): our decode is not measured", file=sys.stderr)
try:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd
except Exception as exc:  # noqa: BLE001
    fla_fwd = None
    print(f"fla not importable: {exc}", file=sys.stderr)

D = 128
LOWER_BOUND = -5.0


def make_case(H, N, T, state_dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16, std=1.0):
        return (std * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)

    case = dict(
        q=rnd(N, T, H, D), k=rnd(N, T, H, D), v=rnd(N, T, H, D), g=rnd(N, T, H, D), beta=rnd(N, T, H),
        A_log=rnd(H, dtype=torch.float32, std=0.5), dt_bias=rnd(H * D, dtype=torch.float32, std=0.5),
        out=torch.empty(N, T, H, D, device="cuda", dtype=torch.bfloat16),
    )
    P = N * T
    # Slots in random order, so sequences do not walk the pool contiguously.
    slots = torch.randperm(P, generator=torch.Generator().manual_seed(seed + 1)).to(torch.int32).cuda()
    if T == 1:
        case["indices"], case["accepted"] = slots, None
    else:
        case["indices"] = slots.view(N, T).contiguous()
        case["accepted"] = torch.ones(N, device="cuda", dtype=torch.int32)
    case["pool"] = rnd(P, H, D, D, dtype=state_dtype, std=0.1)
    esize = torch.finfo(state_dtype).bits // 8
    case["state_bytes"] = N * H * D * D * esize * (1 + T)  # one read, one write per token-slot (T = 1: 2)
    return case


def call_ours(c):
    ours(c["q"], c["k"], c["v"], c["g"], c["beta"], A_log=c["A_log"], dt_bias=c["dt_bias"],
         initial_state=c["pool"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
         use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, state_v_first=True,
         ssm_state_indices=c["indices"], num_accepted_tokens=c["accepted"], inplace_final_state=True,
         out=c["out"])


def call_ours_unchecked(c):
    from flashkda import _internal
    with _internal.launch(check_slots=-1):
        call_ours(c)


def call_ours_kernel(c, kernel):
    from flashkda import _internal
    with _internal.launch(persistent=kernel):
        call_ours(c)


def same_bits(case, kernel):
    """Whether the forced kernel writes the default's out and pool, bit for bit (on copies)."""
    pool0 = case["pool"].clone()
    call_ours(case)
    out_a, pool_a = case["out"].clone(), case["pool"].clone()
    case["pool"].copy_(pool0)
    call_ours_kernel(case, kernel)
    same = torch.equal(case["out"].view(torch.int16), out_a.view(torch.int16)) and torch.equal(
        case["pool"].view(torch.int16), pool_a.view(torch.int16))
    case["pool"].copy_(pool0)
    return same


def call_fla(c):
    fla_fwd(c["q"], c["k"], c["v"], c["g"], c["beta"], A_log=c["A_log"], dt_bias=c["dt_bias"],
            initial_state=c["pool"], inplace_final_state=True, state_v_first=True,
            ssm_state_indices=c["indices"], num_accepted_tokens=c["accepted"], use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=c["out"])


def time_graph(fn, inner, outer):
    """Median seconds per call over `outer` replays of a graph holding `inner` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside capture (Triton compilation, lazy init)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(outer):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / inner)
    del graph
    return statistics.median(times)


def time_eager(fn, reps):
    """Median seconds of one eager call (host overhead included), CUDA events around each call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def copy_bandwidth(nbytes=4 << 30):
    """Device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    # Eager copies: inside a CUDA graph a device-to-device copy_ becomes a memcpy node that ran at
    # 2.78 TB/s on the H200 against 4.15 TB/s for the same copy issued eagerly (2026-11-29).
    t = time_eager(lambda: dst.copy_(src), reps=20)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / t


def read_write_rates(nbytes=4 << 30):
    """The device's rates for reads alone (a sum over a buffer) and writes alone (a fill of it), bytes per
    second, eager as copy_bandwidth's copy."""
    buf = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).fill_(1.0)
    t_read = time_eager(lambda: buf.sum(), reps=20)
    t_write = time_eager(lambda: buf.fill_(0.5), reps=20)
    del buf
    torch.cuda.empty_cache()
    return nbytes / t_read, nbytes / t_write


def mix_rate(rates, T):
    """The rate of one read and T writes of the same bytes, each at its own rate (reads, writes): (1 + T) /
    (1 / R + T / W). A T = 4 step's traffic is four-fifths writes, which a copy's one-to-one mix does not
    weigh."""
    read_bw, write_bw = rates
    return (1 + T) / (1 / read_bw + T / write_bw)


def check_agreement(case):
    """Runs both on copies of the pool: max relative difference of out and of the written slots."""
    pool0 = case["pool"].clone()
    call_ours(case)
    out_ours, pool_ours = case["out"].float().clone(), case["pool"].float().clone()
    case["pool"].copy_(pool0)
    call_fla(case)
    # clone(): for an fp32 pool .float() is the pool itself, which the next line resets.
    out_fla, pool_fla = case["out"].float().clone(), case["pool"].float().clone()
    case["pool"].copy_(pool0)
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    return rel(out_ours, out_fla), rel(pool_ours, pool_fla)


def fmt_diff(x):
    """An agreement figure, or "skipped" where the check did not run (--no-check, no fla, pools over 4 GiB)."""
    return "skipped" if x != x else f"{x:.1e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--H", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--N", type=int, nargs="+", default=[1, 32, 256, 1024])
    ap.add_argument("--T", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--state", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    ap.add_argument("--inner", type=int, default=20, help="calls per graph")
    ap.add_argument("--outer", type=int, default=15, help="timed graph replays")
    ap.add_argument("--eager-reps", type=int, default=50)
    ap.add_argument("--no-check", action="store_true",
                    help="skip the ours-vs-fla agreement check (always skipped for pools over 4 GiB)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--slot-check", action="store_true", help="also ours without the shared-slot check: the check's cost")
    ap.add_argument("--kernels", type=int, nargs="*", default=[], choices=[0, 1, 2, 3],
                    help="also ours with each kernel forced (internal::DecodeLaunch::persistent)")
    ap.add_argument("--no-fla", action="store_true", help="skip fla (flashkda only)")
    ap.add_argument("--mix", action="store_true",
                    help="also ours against the read and write rates mixed as the step's traffic (1 read, T writes)")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth()
    rates = read_write_rates() if args.mix else None
    dev = torch.cuda.get_device_name()
    lines = [
        f"# Decode benchmark: {dev}, {datetime.date.today()}, torch {torch.__version__}",
        "",
        f"Command: `{' '.join(sys.argv)}`",
        "",
        f"Device-to-device copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s. "
        "Times: median per call from CUDA-graph replays (eager per-call median in parentheses). "
        "State traffic: N·H·128·128·bytes × (1 read + T writes); T > 1 is speculative "
        "(indices [N, T], num_accepted_tokens = 1)."
        + (f" Reads alone (a sum) {rates[0] / 1e12:.2f} TB/s, writes alone (a fill) {rates[1] / 1e12:.2f} TB/s; "
           "% mix: ours against (1 + T) / (1 / reads + T / writes)." if rates else ""),
        "",
        "| H | state | N | T | ours µs (eager) | fla µs (eager) | fla / ours | ours TB/s | ours % copy "
        "| fla TB/s | out rel diff | state rel diff |" + (" ours without the slot check µs | ours / that |"
                                                         if args.slot_check else "")
        + "".join(f" kernel {k} µs | % copy | same bits |" for k in args.kernels) + (" ours % mix |" if rates else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.slot_check else "")
        + "---|---|---|" * len(args.kernels) + ("---|" if rates else ""),
    ]
    global fla_fwd
    if args.no_fla:
        fla_fwd = None
    print("\n".join(lines), flush=True)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    for H in args.H:
        for state in args.state:
            for N in args.N:
                for T in args.T:
                    case = make_case(H, N, T, dtypes[state])
                    diff_out = diff_state = float("nan")
                    if ours and fla_fwd and not args.no_check and case["pool"].nbytes <= (4 << 30):
                        diff_out, diff_state = check_agreement(case)
                    t_ours = t_fla = e_ours = e_fla = float("nan")
                    if ours:
                        t_ours = time_graph(lambda: call_ours(case), args.inner, args.outer)
                        e_ours = time_eager(lambda: call_ours(case), args.eager_reps)
                    if fla_fwd:
                        t_fla = time_graph(lambda: call_fla(case), args.inner, args.outer)
                        e_fla = time_eager(lambda: call_fla(case), args.eager_reps)
                    bw_ours, bw_fla = case["state_bytes"] / t_ours, case["state_bytes"] / t_fla
                    row = (f"| {H} | {state} | {N} | {T} | {t_ours * 1e6:.1f} ({e_ours * 1e6:.1f}) "
                           f"| {t_fla * 1e6:.1f} ({e_fla * 1e6:.1f}) | {t_fla / t_ours:.2f}× "
                           f"| {bw_ours / 1e12:.2f} | {100 * bw_ours / copy_bw:.0f}% | {bw_fla / 1e12:.2f} "
                           f"| {fmt_diff(diff_out)} | {fmt_diff(diff_state)} |")
                    if args.slot_check and ours:
                        t_off = time_graph(lambda: call_ours_unchecked(case), args.inner, args.outer)
                        row += f" {t_off * 1e6:.1f} | {t_ours / t_off:.3f} |"
                    for k in args.kernels if ours else []:
                        t_k = time_graph(lambda: call_ours_kernel(case, k), args.inner, args.outer)
                        bw_k = case["state_bytes"] / t_k
                        row += f" {t_k * 1e6:.1f} | {100 * bw_k / copy_bw:.0f}% | {'yes' if same_bits(case, k) else 'NO'} |"
                    if rates:
                        row += f" {100 * bw_ours / mix_rate(rates, T):.0f}% |"
                    lines.append(row)
                    print(row, flush=True)
                    del case
                    torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
