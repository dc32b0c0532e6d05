"""Where flashkda's prefill time goes: per-kernel GPU time (torch.profiler) for a few cases, in
both precision modes and with and without segments, plus the host time of one eager call.
Same inputs as bench_prefill.py.

    python benchmarks/profile_prefill.py [--quick | --host-only | --host-calls | --verdict | --pieces | --lowrank
                                          | --serving | --fused-paths [--once] | --pieces-fit]

--quick: the per-kernel table only. --host-only: the host-time table only. --verdict: where the
time of K0's choice goes (batches through device cu_seqlens, the default call against the fused
kernel forced): each kernel's time and the span of a call, first kernel start to last kernel end.
--pieces: the few-head pieces (the rule) against the same calls without them, kernel by kernel, with
each call's CUDA-graph median (--early: also with the chunk-16 kernels after the pieces launched early).
--host-calls: where an eager call's host time goes: the CUDA runtime and driver calls (torch.profiler's
CPU events, per call), at few heads and at many.
--lowrank: the low-rank segment transitions (a candidate) against the rule's, kernel by kernel.
--serving: the serving prefill's cases (bench_prefill.py --serving) kernel by kernel: the plain call, the
pool, the pool with checkpoints, each call's span and CUDA-graph median.
--fused-paths: T=8192 H=96 one sequence, both gate regimes, kernel by kernel: the rule, the unsplit fused
kernel (its arguments in the kernel's parameters), the same through device cu_seqlens (its sequence's
arguments in shared memory), the pieces' kernel with one chained piece and with four (--once: each path's
call once, random gates, for a profiler such as ncu).
--pieces-fit: the few-head pieces' kernel alone against the chunks a piece walks (one sequence, H = 12,
random gates, T = 2048 to 65536 and forced piece counts): its time, and the least-squares line
time = fixed + periods x period through it, periods = the longest piece's chunks + its warm-up.
"""
import os
import re
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from bench_prefill import (FEW, MANY, make_inputs, run_flashkda, run_flashkda_pool, time_eager_ms,  # noqa: E402
                           time_graph_ms)

CASES = [MANY[1], MANY[3], FEW[1], FEW[3], FEW[7]]  # H=96 one seq, H=96 8x1024, H=12 T=8192 / 131072, H=32 T=32768


def kernel_name(name):
    """A kernel's name without namespaces and argument list, its template arguments kept (K1 and K2
    of one policy end alike)."""
    base = name.replace("(anonymous namespace)::", "").split("(")[0].replace("void ", "")
    return re.sub(r"[A-Za-z_]\w*::", "", base).replace("SplitPolicy", "P")


def gpu_events(fn, reps):
    """The CUDA events of reps calls of fn (after one warm-up call), queued back to back."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_times(fn, reps=10):
    acc = defaultdict(float)
    for e in gpu_events(fn, reps):
        acc[kernel_name(e.name)] += e.device_time / reps / 1e3  # ms
    return acc


def host_us(fn, reps=20):
    """Median host time of one call (enqueue only: the GPU is idle when each call starts)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def run_flashkda_checked(x, with_state):
    """flashkda.fwd with its direct path switched off: the Python checks and layout work first."""
    import flashkda._impl as impl
    fn = run_flashkda(x, with_state)[0]

    def call():
        direct, impl._fwd_direct = impl._fwd_direct, lambda *args: False
        try:
            fn()
        finally:
            impl._fwd_direct = direct
    return call, None


def host_overhead():
    """Host microseconds per eager call (after 10 warm-up calls), flashkda on its direct and its
    checked path, and FlashKDA when importable, same inputs, one process; at many heads and at few
    (T = 2048 and 8192, H = 12: the few-head pieces' nine launches against ~60-150 us of GPU time)."""
    from bench_prefill import flash_kda, run_flash_kda
    peers = [("FlashKDA", run_flash_kda)] if flash_kda is not None else []
    print("| case | library | host us per call | eager ms |")
    print("|---|---|---|---|")
    for name, H, seqlens, state in [MANY[1], MANY[7], FEW[0], FEW[1]]:
        x = make_inputs(H, seqlens, state)
        for lib, make in [("flashkda", run_flashkda), ("flashkda, checked path", run_flashkda_checked)] + peers:
            fn = make(x, state)[0]
            for _ in range(10):
                fn()
            print(f"| {name} | {lib} | {host_us(fn, reps=50):.0f} | {time_eager_ms(fn, reps=10):.3f} |", flush=True)
        del x
        torch.cuda.empty_cache()


def host_calls(reps=20):
    """Where the host time of an eager call goes (after 10 warm-up calls): the median host time of a
    call, then torch.profiler's CPU events over `reps` calls (the CUDA runtime and driver calls CUPTI
    reports, torch's own ops), each name's count and microseconds per call, the largest first."""
    for name, H, seqlens, state in [FEW[0], FEW[1], MANY[1]]:
        x = make_inputs(H, seqlens, state)
        fn = run_flashkda(x, state)[0]
        for _ in range(10):
            fn()
        host = host_us(fn, reps=50)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        acc, count = defaultdict(float), defaultdict(int)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU:
                acc[e.name] += e.cpu_time_total / reps
                count[e.name] += 1
        print(f"\n{name}: host {host:.0f} us per call; CPU events per call (count, us):", flush=True)
        print("| event | count | us per call |")
        print("|---|---|---|")
        for ev, us in sorted(acc.items(), key=lambda kv: -kv[1])[:20]:
            print(f"| {ev} | {count[ev] / reps:.1f} | {us:.1f} |", flush=True)
        del x
        torch.cuda.empty_cache()


def call_spans(fn, reps=10):
    """Per kernel (in launch order) the mean device microseconds, and the median span of one call
    from its first kernel's start to its last kernel's end (calls queued back to back, so the GPU
    runs behind the host and the gaps are the GPU's own)."""
    kernels = sorted(((e.time_range.start, e.time_range.end, kernel_name(e.name)) for e in gpu_events(fn, reps)),
                     key=lambda k: k[0])
    per_call = len(kernels) // reps
    calls = [kernels[i * per_call:(i + 1) * per_call] for i in range(reps)]
    spans = sorted(c[-1][1] - c[0][0] for c in calls)
    names = [k[2] for k in calls[0]]
    means = [statistics.mean(c[i][1] - c[i][0] for c in calls) for i in range(per_call)]
    gaps = [statistics.mean(c[i + 1][0] - c[i][1] for c in calls) for i in range(per_call - 1)]
    return names, means, gaps, spans[len(spans) // 2]


def span_row(x, launch, fn=None):
    """The last two cells of a spans table for flashkda's call with `launch` on x (fp32 states), or for
    fn: each kernel's mean us with the gap after it in brackets, then the call's span."""
    names, means, gaps, span = call_spans(fn or run_flashkda(x, True, launch=launch)[0])
    parts = [f"{n.split('<')[0]} {m:.1f}" + (f" [{gaps[i]:.1f}]" if i < len(gaps) else "")
             for i, (n, m) in enumerate(zip(names, means))]
    return f"{'; '.join(parts)} | {span:.1f}"


def verdict_profile():
    """K0's choice (the fused kernel launched after the chunk-16 kernels, on its verdict) against the
    fused kernel forced, on batches through device cu_seqlens: the call's kernels, their times, the
    gaps between them and the call's span (us)."""
    print("| case | H | launch | kernels (us each, gaps in brackets) | span us |")
    print("|---|---|---|---|---|")
    for name, seqlens in (("8 x 1024", [1024] * 8), ("16 x 512", [512] * 16), ("8 x 2048", [2048] * 8)):
        for H in (16, 96):
            x = make_inputs(H, seqlens, True)
            for label, launch in (("default", {}), ("fused v2", dict(fused_v2=1)), ("chunk-16", dict(fused_v2=-1))):
                print(f"| {name} | {H} | {label} | {span_row(x, launch)} |", flush=True)
            del x
            torch.cuda.empty_cache()


def pieces_profile():
    """The default call (the few-head pieces of the fused kernel, the rule since 8efee91) against the
    same call without them (internal fused_pieces = -1: the chunk-16 kernels alone), one sequence at
    H = 12 and 32, random gates and long memory: each kernel's time, the gaps and the call's span (us).
    With long memory the pre-check stops the pieces and the chunk-16 kernels run the call, K1 strided
    (after the pieces) or one chunk a CTA (without them): what the pieces cost there."""
    early = "--early" in sys.argv[1:]  # the chunk-16 kernels after the pieces launched early (a candidate)
    print("| case | gates | launch | kernels (us each, gaps in brackets) | span us | CUDA-graph ms |")
    print("|---|---|---|---|---|---|")
    for T, H in ((2048, 12), (8192, 12), (131072, 12), (32768, 32)):
        for regime in ("random", "long"):
            x = make_inputs(H, [T], True, regime)
            launches = [("default", {}), ("no pieces", dict(fused_pieces=-1))]
            if early:  # an early launch turns the rule's pieces off: force the count the rule takes on 132 SMs
                P = min(132 // H, T // 32 // 4)
                launches += [(f"{P} pieces", dict(fused_pieces=P)),
                             (f"{P} pieces, early K2, chain, combine", dict(fused_pieces=P, early_launch=14)),
                             (f"{P} pieces, early chain, combine", dict(fused_pieces=P, early_launch=12))]
            for label, launch in launches:
                graph = time_graph_ms(run_flashkda(x, True, launch=launch)[0], reps=10)
                print(f"| T={T} H={H} | {regime} | {label} | {span_row(x, launch)} | {graph:.4f} |", flush=True)
            del x
            torch.cuda.empty_cache()


def lowrank_profile():
    """Low-rank segment transitions (internal lowrank_transitions = 1, a candidate, the pieces off; 2:
    the pieces' rule kept, low-rank transitions after a stop) against the rule's exact transitions at
    H = 12, both gate regimes: each kernel's time, the gaps and the call's span (us), with each launch's
    own segment count and with both forced to the same segment length (the low-rank rule cuts more
    segments: its transition rows are fewer)."""
    print("| case | gates | launch | kernels (us each, gaps in brackets) | span us |")
    print("|---|---|---|---|---|")
    for T in (8192, 131072):
        for regime in ("random", "long"):
            x = make_inputs(12, [T], True, regime)
            forced = (T // 16 + 5) // 6, (T // 16 + 7) // 8  # 6 and 8 segments
            rows = [("rule", {}), ("lowrank", dict(lowrank_transitions=1)),
                    ("lowrank after the pieces", dict(lowrank_transitions=2))]
            for L in forced:
                rows += [(f"rule L={L}", dict(segment_chunks=L)),
                         (f"lowrank L={L}", dict(lowrank_transitions=1, segment_chunks=L))]
            for label, launch in rows:
                print(f"| T={T} H=12 | {regime} | {label} | {span_row(x, launch)} |", flush=True)
            del x
            torch.cuda.empty_cache()


def serving_profile():
    """The serving prefill's cost (bench_prefill.py --serving's cases) kernel by kernel: the plain call
    against the pool (device cu_seqlens, as engines call it) and the pool with checkpoints into free
    slots: each kernel's time, the gaps, the call's span (us) and its CUDA-graph median (ms)."""
    print("| case | call | kernels (us each, gaps in brackets) | span us | CUDA-graph ms |")
    print("|---|---|---|---|---|")
    for T, H, every in ((8192, 96, 4096), (8192, 12, 1024), (32768, 12, 4096)):
        x = make_inputs(H, [T], True)
        for label, fn in (("plain", run_flashkda(x, True)[0]), ("pool", run_flashkda_pool(x)[0]),
                          (f"pool, checkpoints every {every}", run_flashkda_pool(x, every)[0])):
            graph = time_graph_ms(fn, reps=20)
            print(f"| T={T} H={H} | {label} | {span_row(x, None, fn)} | {graph:.4f} |", flush=True)
        del x
        torch.cuda.empty_cache()


def fused_paths_profile():
    """Where the pieces' path loses to the unsplit fused kernel (run 163: one chained piece 1.048 ms
    against 0.984 in CUDA graphs at T=8192 H=96): each fused path's kernels, their times, the gaps, the
    call's span (us) and its CUDA-graph median (ms)."""
    once = "--once" in sys.argv[1:]
    if not once:
        print("| gates | path | kernels (us each, gaps in brackets) | span us | CUDA-graph ms |")
        print("|---|---|---|---|---|")
    for regime in ("random",) if once else ("random", "long"):
        x = make_inputs(96, [8192], True, regime)
        unsplit = dict(fused_v2=1)
        paths = [("the rule", run_flashkda(x, True)[0]),
                 ("unsplit", run_flashkda(x, True, launch=unsplit)[0]),
                 ("unsplit, device cu_seqlens", run_flashkda(x, True, launch=unsplit, device_cu_seqlens=True)[0]),
                 ("one chained piece", run_flashkda(x, True, launch=dict(fused_pieces=1, fused_chain=1))[0]),
                 ("four chained pieces", run_flashkda(x, True, launch=dict(fused_pieces=4, fused_chain=1))[0])]
        for label, fn in paths:
            if once:
                fn()
                torch.cuda.synchronize()
                continue
            graph = time_graph_ms(fn, reps=20)
            print(f"| {regime} | {label} | {span_row(x, None, fn)} | {graph:.4f} |", flush=True)
        del x
        torch.cuda.empty_cache()


def pieces_fit_profile():
    """How the pieces' kernel's time splits into a cost a chunk and a cost a call: the kernel's mean
    time (torch.profiler, the largest kernel of the call) for one sequence at H = 12 with random gates,
    by the rule's piece count and by forced ones, against the periods its longest piece walks (its
    chunks plus one warm-up chunk, none for a sequence's first piece alone), and the line through them."""
    H, sms = 12, torch.cuda.get_device_properties(0).multi_processor_count
    print("| T | pieces | chunks a piece + warm-up | pieces kernel us | other kernels us | span us | CUDA-graph ms |")
    print("|---|---|---|---|---|---|---|")
    points = []
    for T, forced in ((2048, None), (4096, None), (8192, None), (16384, None), (32768, None), (65536, None),
                      (8192, 6), (8192, 3), (32768, 6), (32768, 3)):
        chunks = (T + 31) // 32
        P = forced or max(1, min(sms // H, chunks // 4))  # config.h fused_few_head_pieces, for the label
        periods = -(-chunks // P) + (1 if P > 1 else 0)
        x = make_inputs(H, [T], True, "random")
        fn = run_flashkda(x, True, launch=dict(fused_pieces=forced) if forced else {})[0]
        names, means, gaps, span = call_spans(fn)
        main_us = max(means)
        graph = time_graph_ms(fn, reps=10)
        print(f"| {T} | {P}{' forced' if forced else ''} | {periods} | {main_us:.1f} | {sum(means) - main_us:.1f} | "
              f"{span:.1f} | {graph:.4f} |", flush=True)
        points.append((periods, main_us))
        del x
        torch.cuda.empty_cache()
    n = len(points)
    mx = sum(p for p, _ in points) / n
    my = sum(t for _, t in points) / n
    slope = sum((p - mx) * (t - my) for p, t in points) / sum((p - mx) ** 2 for p, _ in points)
    print(f"\nline: pieces kernel us = {my - slope * mx:.1f} + {slope:.3f} x periods; residuals: " +
          ", ".join(f"{t - (my - slope * mx) - slope * p:+.1f}" for p, t in points))


def main():
    modes = {"--pieces-fit": pieces_fit_profile, "--fused-paths": fused_paths_profile, "--serving": serving_profile,
             "--lowrank": lowrank_profile, "--verdict": verdict_profile, "--pieces": pieces_profile,
             "--host-calls": host_calls}
    for flag, profile_mode in modes.items():
        if flag in sys.argv[1:]:
            profile_mode()
            return
    if "--quick" not in sys.argv[1:]:
        host_overhead()
    if "--host-only" in sys.argv[1:]:
        return
    print("| case | precision | launch | kernel | ms per call |")
    print("|---|---|---|---|---|")
    for name, H, seqlens, state in CASES:
        x = make_inputs(H, seqlens, state)
        for precision in ("precise", "balanced", "fast"):
            for label, launch in (("default", {}), ("serial", dict(segment_chunks=-1))):
                fn = run_flashkda(x, state, precision, launch)[0]
                times = kernel_times(fn)
                for kname, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                    print(f"| {name} | {precision} | {label} | {kname} | {ms:.3f} |", flush=True)
                print(f"| {name} | {precision} | {label} | all | {sum(times.values()):.3f} |", flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
