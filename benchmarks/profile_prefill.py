"""Where flashkda's prefill time goes: per-kernel GPU time (torch.profiler) for a few cases, in
both precision modes, plus the wall time of one eager call. Same inputs as bench_prefill.py.

    python benchmarks/profile_prefill.py [--quick | --host-only]

--quick (used by scripts/gpu_ab.sh to compare candidates): the per-kernel table only, without the
host-time table and the V-split comparison. --host-only: the host-time table only.
"""
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from bench_prefill import CASES, make_inputs, run_flashkda, time_ms  # noqa: E402


def kernel_times(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name.split("(")[0][-40:]] += e.device_time / reps / 1e3  # ms
    return acc


def host_us(fn, reps=20):
    """Median host time of one call (enqueue only: the GPU is idle when each call starts)."""
    import statistics
    import time
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
    return call, None, None


def host_overhead():
    """Host microseconds per eager call (after 10 warm-up calls), flashkda on its direct and its
    checked path, and FlashKDA when importable, same inputs, one process."""
    from bench_prefill import flash_kda, run_flash_kda
    peers = [("FlashKDA", run_flash_kda)] if flash_kda is not None else []
    print("| case | library | host us per call | eager ms |")
    print("|---|---|---|---|")
    for name, H, seqlens in [CASES[0], CASES[8]]:
        x = make_inputs(H, seqlens, True)
        for lib, make in [("flashkda", run_flashkda), ("flashkda, checked path", run_flashkda_checked)] + peers:
            fn = make(x, True)[0]
            for _ in range(10):
                fn()
            print(f"| {name} | {lib} | {host_us(fn, reps=50):.0f} | {time_ms(fn, reps=10):.3f} |", flush=True)
        del x
        torch.cuda.empty_cache()


def main():
    quick = "--quick" in sys.argv[1:]
    if not quick:
        host_overhead()
    if "--host-only" in sys.argv[1:]:
        return
    print("| case | precise | eager call ms | kernel | ms per call |")
    print("|---|---|---|---|---|")
    # one sequence at H=96 and H=32 (latency-bound recurrence), 8 x 1024 at H=96 and 128 x 64
    # (throughput-bound: more (sequence, head) pairs than SMs)
    for name, H, seqlens in [CASES[0], CASES[2], CASES[6], CASES[8]]:
        x = make_inputs(H, seqlens, True)
        for precise in os.environ.get("PROFILE_MODES", "1 0").split():  # FLASHKDA_PRECISE values
            os.environ["FLASHKDA_PRECISE"] = precise
            fn = run_flashkda(x, True)[0]
            wall = time_ms(fn, reps=10)
            for kname, ms in sorted(kernel_times(fn).items(), key=lambda kv: -kv[1]):
                print(f"| {name} | {precise} | {wall:.3f} | {kname} | {ms:.3f} |", flush=True)
        del x
        torch.cuda.empty_cache()
    os.environ["FLASHKDA_PRECISE"] = "1"
    if quick:
        return
    print("| case | FLASHKDA_V_SPLITS | recurrence kernel ms |")
    print("|---|---|---|")
    for name, H, seqlens in [CASES[0], CASES[6]]:
        x = make_inputs(H, seqlens, True)
        for splits in ("1", "2"):
            os.environ["FLASHKDA_V_SPLITS"] = splits
            times = kernel_times(run_flashkda(x, True)[0], reps=5)
            print(f"| {name} | {splits} | {sum(v for k, v in times.items() if 'recur' in k):.3f} |", flush=True)
        del x
    os.environ.pop("FLASHKDA_V_SPLITS")


if __name__ == "__main__":
    main()
