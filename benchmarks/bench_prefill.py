"""Prefill benchmark on one GPU: flashkda against fla `chunk_kda`, MoonshotAI FlashKDA and cuDNN
frontend's fused sm90 KDA kernel, on identical inputs in one process.

Times are medians of CUDA-graph replays (one call per graph; `--eager` adds eager-call medians),
fp32 initial and final state unless the case says otherwise. Two gate regimes (SPEC §7):

- random: g ~ N(0, 1), A_log ~ U(0, 1), dt_bias ~ U(0, 1) (FlashKDA's benchmark inputs; every
  channel decays fast);
- long:   the same, but 8 of the 128 channels of every head with dt_bias = -8 (near-zero decay,
  as trained models keep for long-range memory).

Floor = q, k, v, g, beta read once, out written once, states read and written once, at the
device copy rate measured in the same run. "best peer" is the fastest of the peers that ran.

    FLA_FLASH_KDA=0 python benchmarks/bench_prefill.py --table few --out results.md

Peers are optional: whichever of fla, flash_kda and cudnn imports is measured. The flashkda
columns: the default launch, "serial" (the same kernels with sequences never cut into segments:
flashkda._internal.launch(segment_chunks=-1), what flashkda ran before segments) and the fast
precision mode.
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile

import torch

os.environ.setdefault("FLA_FLASH_KDA", "0")

import flashkda  # noqa: E402
from flashkda import _internal  # noqa: E402

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
try:
    from cudnn.linear_attention.hopper import cuda_host as cudnn_kda
except Exception as exc:  # noqa: BLE001
    cudnn_kda = None
    print(f"cudnn sm90 KDA not importable: {exc}", file=sys.stderr)

D = 128
LOWER_BOUND = -5.0

# (name, H, sequence lengths, with state)
MANY = [
    ("T=8192 H=96 one seq, no state", 96, [8192], False),
    ("T=8192 H=96 one seq", 96, [8192], True),
    ("T=8192 H=96 varlen6", 96, [1300, 547, 2048, 963, 271, 3063], True),
    ("T=8192 H=96 8x1024", 96, [1024] * 8, True),
    ("T=8192 H=64 one seq", 64, [8192], True),
    ("T=2048 H=96 one seq", 96, [2048], True),
    ("T=16384 H=32 16x1024", 32, [1024] * 16, True),
    ("T=8192 H=32 128x64", 32, [64] * 128, True),
]
FEW = [
    ("T=2048 H=12 one seq", 12, [2048], True),
    ("T=8192 H=12 one seq", 12, [8192], True),
    ("T=32768 H=12 one seq", 12, [32768], True),
    ("T=131072 H=12 one seq", 12, [131072], True),
    ("T=65536 H=16 one seq", 16, [65536], True),
    ("T=16384 H=16 8x2048", 16, [2048] * 8, True),
    ("T=8192 H=24 4x2048", 24, [2048] * 4, True),
    ("T=32768 H=32 one seq", 32, [32768], True),
    ("T=131072 H=32 one seq", 32, [131072], True),
]


def tree_name():
    """What ran: HEAD's short hash where the files (ignored ones left out) are HEAD's, else "tree <hash>"
    of the files as they are (a device's copy carries a checkout's files over the git metadata of an
    earlier commit; `git log --format='%h %T' | grep <hash>` finds the commit). Empty outside git."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*argv, **kw):
        return subprocess.run(["git", "-C", here, *argv], capture_output=True, text=True, **kw).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
        git("add", "-A", ":/", env=env)
        tree = git("write-tree", env=env)
    return head if tree and tree == git("rev-parse", "HEAD^{tree}") else f"tree {tree[:10]}" if tree else head


def make_inputs(H, seqlens, with_state, regime="random", seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(seqlens)
    dev = "cuda"

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    dt_bias = torch.rand(H, D, generator=gen, device=dev).float()
    if regime == "long":
        dt_bias[:, :8] = -8.0  # 8 long-memory channels per head
    x = dict(
        q=rnd(1, T, H, D), k=rnd(1, T, H, D), v=rnd(1, T, H, D), g=rnd(1, T, H, D), beta=rnd(1, T, H),
        A_log=torch.rand(H, generator=gen, device=dev).float(), dt_bias=dt_bias,
        cu_seqlens=torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0).tolist()), device=dev, dtype=torch.int64),
    )
    N = len(seqlens)
    x["h0"] = (0.1 * torch.randn(N, H, D, D, generator=gen, device=dev)) if with_state else None  # [N,H,V,K]
    return x


# Each runner returns (call, outputs): call() runs one forward; outputs() -> (o [T, H, V], ht or None).
def run_flashkda(x, with_state, precision="precise", launch=None, device_cu_seqlens=False):
    out = torch.empty_like(x["v"])
    ht = torch.empty_like(x["h0"]) if with_state else None
    launch = launch or {}
    # One sequence goes without cu_seqlens, as a [1, T, H, K] call names it (the fused kernel's rule
    # serves only such calls: the host cannot read device offsets), unless device_cu_seqlens.
    cu = None if x["cu_seqlens"].numel() == 2 and not device_cu_seqlens else x["cu_seqlens"]

    def call():
        with _internal.launch(**launch):
            flashkda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, out, x["A_log"], x["dt_bias"],
                         LOWER_BOUND, initial_state=x["h0"], final_state=ht, cu_seqlens=cu,
                         precision=precision)

    return call, lambda: (out[0], ht)


def run_flashkda_pool(x, checkpoint_every=0, precision="precise"):
    """The serving prefill (SPEC §9) on the same inputs: states in a pool of N + 4 fp32 slots (sequence
    n in slot n + 2), read and written in place, and with checkpoint_every the checkpoints into free
    pool slots (any past the pool's last slot are skipped)."""
    N, H = x["h0"].shape[:2]
    pool = torch.zeros(N + 4, H, D, D, device="cuda")
    pool[2:N + 2] = x["h0"]
    idx = torch.arange(2, N + 2, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x["v"])
    kw = {}
    if checkpoint_every:
        lens = (x["cu_seqlens"][1:] - x["cu_seqlens"][:-1]).tolist()
        count = flashkda.checkpoint_count(lens, checkpoint_every)
        slots = torch.full((count,), -1, dtype=torch.int32, device="cuda")
        free = [0, 1, N + 2, N + 3]
        slots[:min(count, 4)] = torch.tensor(free[:min(count, 4)], dtype=torch.int32, device="cuda")
        kw = dict(checkpoint_every=checkpoint_every, checkpoint_slots=slots)

    def call():
        flashkda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, out, x["A_log"], x["dt_bias"],
                     LOWER_BOUND, cu_seqlens=x["cu_seqlens"], precision=precision, state_pool=pool,
                     state_indices=idx, **kw)

    return call, lambda: (out[0], pool[2:N + 2])


def serving_rows(reps):
    """Issue 13's cost target: pool prefill with checkpoints against the plain prefill, same inputs,
    same run; the last column is the former rule (internal checkpoints_in_segments=-1: segment
    lengths that divide checkpoint_every, no checkpoints inside segments)."""
    rows = ["", "Serving prefill against the plain call (fp32 states; pool of N + 4 slots; CUDA-graph medians, ms):",
            "", "| case | plain | pool | pool + checkpoints | cost of pool + checkpoints "
            "| the same, segments dividing checkpoint_every (former rule) | its cost |",
            "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    cases = (("T=8192 H=96 one seq, checkpoints every 4096", 96, [8192], 4096),
             ("T=8192 H=12 one seq, checkpoints every 1024", 12, [8192], 1024),
             ("T=32768 H=12 one seq, checkpoints every 4096", 12, [32768], 4096))
    for name, H, seqlens, every in cases:
        x = make_inputs(H, seqlens, True)
        plain = time_graph_ms(run_flashkda(x, True)[0], reps=reps)
        pool = time_graph_ms(run_flashkda_pool(x)[0], reps=reps)
        ck = time_graph_ms(run_flashkda_pool(x, every)[0], reps=reps)
        with _internal.launch(checkpoints_in_segments=-1):
            divisor = time_graph_ms(run_flashkda_pool(x, every)[0], reps=reps)
        rows.append(f"| {name} | {plain:.3f} | {pool:.3f} | {ck:.3f} | {100 * (ck / plain - 1):+.1f}% "
                    f"| {divisor:.3f} | {100 * (divisor / plain - 1):+.1f}% |")
        print(rows[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def runs_sweep_rows(reps, cases=""):
    """Transition skipping (docs/DESIGN.md "Segments"): the default call against the same call without
    skipping, with the former (token) chunk bound, and with forced piece lengths F and longest warm-ups
    w (a multiple of F), one sequence at few heads, both gate regimes (internal launch fields
    skip_run_chunks, skip_warmup_chunks, skip_bound)."""
    grid = [(F, 1) for F in (8, 16, 24, 32, 48, 64, 96, 128)]
    rows = ["", "Transition skipping: piece length F and longest warm-up w x F (CUDA-graph medians, ms):", "",
            "| case | gates | default | no skipping | token bound | " + " | ".join(f"F={F} w={w:g}" for F, w in grid)
            + " |", "|---" * (5 + len(grid)) + "|"]
    print("\n".join(rows), flush=True)
    wanted = [c for c in cases.split(",") if c]
    for H, T in ((12, 2048), (12, 8192), (12, 32768), (12, 131072), (16, 65536), (32, 32768), (32, 131072)):
        name = f"T={T} H={H}"
        if wanted and not any(w in name for w in wanted):
            continue
        for regime in ("random", "long"):
            x = make_inputs(H, [T], True, regime=regime)
            launches = [{}, dict(skip_transitions=-1), dict(skip_bound=-1)] + [
                dict(skip_run_chunks=F, skip_warmup_chunks=int(w * F)) for F, w in grid]
            times = []
            for launch in launches:
                times.append(time_graph_ms(run_flashkda(x, True, launch=launch)[0], reps=reps))
                torch.cuda.empty_cache()
            rows.append(f"| {name} | {regime} | " + " | ".join(f"{t:.3f}" for t in times) + " |")
            print(rows[-1], flush=True)
            del x
            torch.cuda.empty_cache()
    return rows


def _up8(x):
    return (x + 7) // 8 * 8


def layouts(C, H, sms):
    """Candidate segment / piece layouts for one sequence of C chunks at H heads on sms SMs, as
    internal launch fields (docs/DESIGN.md "Segments"): P = sms // H pieces per head fill the 2 * sms
    warpgroup slots of two CTAs an SM once where every boundary skips (two warpgroups per piece);
    then the rules at two and at three CTAs an SM (the rule takes three from H = 16 up)."""
    P = max(1, sms // H)
    F1, F2 = _up8(-(-C // P)), _up8(-(-C // (2 * P)))
    S_rule = max(1, (2 * sms // H + 2) // 4)  # the exact path's segment count (launch.cu)
    seg_rule = max(16, -(-C // S_rule))
    two = dict(seg_ctas_per_sm=2)  # the layouts above were planned for two CTAs an SM
    return [("one piece a segment", dict(segment_chunks=F1, skip_run_chunks=F1, **two)),
            ("two pieces a segment", dict(segment_chunks=2 * F1, skip_run_chunks=F1, **two)),
            ("one piece, two waves", dict(segment_chunks=F2, skip_run_chunks=F2, **two)),
            ("rule's segments halved", dict(segment_chunks=seg_rule, skip_run_chunks=_up8(-(-seg_rule // 2)), **two)),
            ("K2 at 2 CTAs an SM, its rules", dict(two)),
            ("K2 at 2 CTAs an SM, no skipping", dict(skip_transitions=-1, **two)),
            ("K2 at 3 CTAs an SM, its rules", dict(seg_ctas_per_sm=3)),
            ("K2 at 3 CTAs an SM, no skipping", dict(seg_ctas_per_sm=3, skip_transitions=-1))]


def chunk16_and_fused_ms(H, seqlens, reps, rule=False, floor=0):
    """One shape through the chunk-16 kernels and through the fused chunk-32 kernel (internal fused_v2
    -1 and 1), and with `rule` the default call (fused_v2 0: the rule, K0's verdict with cu_seqlens),
    random gates, fp32 states; `floor` > 0: the default call with that floor on the longest sequence
    (internal fused_min_tokens) instead of the rule's: CUDA-graph medians, ms."""
    x = make_inputs(H, seqlens, True)
    launches = [dict(fused_v2=-1), dict(fused_v2=1)]
    if rule:
        extra = dict(fused_min_tokens=floor) if floor > 0 else {}
        launches.append(dict(fused_v2=0, **extra))
    times = [time_graph_ms(run_flashkda(x, True, launch=launch)[0], reps=reps) for launch in launches]
    del x
    torch.cuda.empty_cache()
    return times


def fused_sweep_rows(reps):
    """Issue 11's fused chunk-32 kernel against today's kernels on one sequence across head counts
    (internal fused_v2 1 against -1; docs/DESIGN.md "Prefill v2"): where one CTA a head fills the GPU
    well enough for the fused kernel to win, the data behind the rule (launch.cu fused_by_rule).
    Random gates, fp32 states."""
    rows = ["", "The fused chunk-32 kernel against today's kernels, one sequence (random gates, fp32 states; "
            "CUDA-graph medians, ms):", "",
            "| T | H | chunk-16 kernels | fused v2 | fused / chunk-16 |", "|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for T in (2048, 8192, 32768):
        for H in (48, 64, 80, 96, 112, 128, 160):
            times = chunk16_and_fused_ms(H, [T], reps)
            ours, fused = times[0], times[1]
            rows.append(f"| {T} | {H} | {ours:.3f} | {fused:.3f} | {fused / ours:.2f} |")
            print(rows[-1], flush=True)
    return rows


def fused_batch_sweep_rows(reps, only_shapes="", only_heads="", floor=0):
    """The fused chunk-32 kernel over several sequences (grid H x N, device cu_seqlens; internal
    fused_v2 1 against -1) across head counts and batch shapes, and the default call (the rule:
    config.h fused_rule, decided by K0 from the device cu_seqlens), with mixed lengths: a long
    prompt among short ones (which the rule leaves to the chunk-16 kernels at few heads), spread
    lengths, and many short prompts about the rule's floor.
    Random gates, fp32 states."""
    rows = ["", "The fused chunk-32 kernel against today's kernels, batches through device cu_seqlens, and the "
            "default call (the rule; random gates, fp32 states; CUDA-graph medians, ms):", "",
            "| N x T | H | CTAs (N H) | chunk-16 kernels | fused v2 | "
            + (f"default, floor {floor} | " if floor > 0 else "default (rule) | ") +
            "fused / chunk-16 | default / best |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    # one sequence and batches about the rule's 64-token floor: where the floor could go
    shapes = [(f"{N} x {T}", [T] * N) for N, T in ((1, 32), (1, 64), (1, 128), (1, 256), (1, 384), (1, 512), (1, 1024),
                                                   (16, 512), (8, 1024), (8, 2048), (4, 4096), (64, 384), (128, 128),
                                                   (256, 64), (256, 32))]
    shapes += [("2048 + 30 x 64", [2048] + [64] * 30), ("8 mixed 512-1024", [1024, 700, 512, 900, 600, 800, 1000, 512]),
               ("256 x 200", [200] * 256)]  # many short prompts
    shape_filter = [x.strip() for x in only_shapes.split(",") if x.strip()]
    head_filter = [int(x) for x in only_heads.split(",") if x.strip()]
    for name, seqlens in shapes:
        if shape_filter and name not in shape_filter:
            continue
        for H in ((96,) if len(seqlens) == 1 else (12, 16, 24, 32, 64, 96)):
            if head_filter and H not in head_filter:
                continue
            ours, fused, rule = chunk16_and_fused_ms(H, seqlens, reps, rule=True, floor=floor)
            rows.append(f"| {name} | {H} | {len(seqlens) * H} | {ours:.3f} | {fused:.3f} | {rule:.3f} | "
                        f"{fused / ours:.2f} | {rule / min(ours, fused):.2f} |")
            print(rows[-1], flush=True)
    return rows


def fused_order_rows(reps):
    """Mixed lengths through device cu_seqlens at many heads, the default call (the fused kernel's
    rule) with K0's longest-first order of the sequences against the batch's order (internal
    fused_order -1). Random gates, fp32 states."""
    rows = ["", "Longest first: the default call with K0's order of the sequences and in the batch's order "
            "(random gates, fp32 states; CUDA-graph medians, ms):", "",
            "| lengths | H | longest first | batch order | longest first / batch order |", "|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for name, seqlens in (("1300, 547, 2048, 963, 271, 3063", [1300, 547, 2048, 963, 271, 3063]),
                          ("64 x 128 + 3063", [128] * 64 + [3063]), ("8 mixed 512-1024", [1024, 700, 512, 900, 600, 800, 1000, 512])):
        for H in (64, 96):
            x = make_inputs(H, seqlens, True)
            first, batch = (time_graph_ms(run_flashkda(x, True, launch=dict(fused_order=o))[0], reps=reps) for o in (0, -1))
            del x
            torch.cuda.empty_cache()
            rows.append(f"| {name} | {H} | {first:.3f} | {batch:.3f} | {first / batch:.2f} |")
            print(rows[-1], flush=True)
    return rows


def layouts_sweep_rows(reps, cases=""):
    """Transition skipping's layouts: the default call against the same call without skipping and with
    the candidate layouts of `layouts` (segments and pieces forced), one sequence at few heads, both
    gate regimes."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = ((12, 2048), (12, 8192), (12, 32768), (12, 131072), (16, 65536), (32, 32768), (32, 131072))
    labels = [lab for lab, _ in layouts(512, 12, sms)]
    rows = ["", "Transition skipping: segment / piece layouts (CUDA-graph medians, ms; segments / pieces in chunks):",
            "", "| case | gates | default | no skipping | " + " | ".join(labels) + " |", "|---" * (4 + len(labels)) + "|"]
    print("\n".join(rows), flush=True)
    wanted = [c for c in cases.split(",") if c]
    for H, T in shapes:
        name = f"T={T} H={H}"
        if wanted and not any(w in name for w in wanted):
            continue
        cand = layouts(-(-T // 16), H, sms)
        for regime in ("random", "long"):
            x = make_inputs(H, [T], True, regime=regime)
            times = []
            for launch in [{}, dict(skip_transitions=-1)] + [l for _, l in cand]:
                times.append(time_graph_ms(run_flashkda(x, True, launch=launch)[0], reps=reps))
                torch.cuda.empty_cache()
            rows.append(f"| {name} | {regime} | {times[0]:.3f} | {times[1]:.3f} | " + " | ".join(
                f"{t:.3f}" + (f" ({l['segment_chunks']}/{l['skip_run_chunks']})" if "segment_chunks" in l else "")
                for t, (_, l) in zip(times[2:], cand)) + " |")
            print(rows[-1], flush=True)
            del x
            torch.cuda.empty_cache()
    return rows


def run_flash_kda(x, with_state):
    out = torch.empty_like(x["v"])
    ht = torch.empty_like(x["h0"]) if with_state else None

    def call():
        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, out, x["A_log"], x["dt_bias"],
                      LOWER_BOUND, initial_state=x["h0"], final_state=ht, cu_seqlens=x["cu_seqlens"])

    return call, lambda: (out[0], ht)


def run_fla(x, with_state):
    H = x["q"].shape[2]
    res = {}
    cu_cpu = x["cu_seqlens"].cpu()

    def call():
        o, ht = fla_chunk_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, initial_state=x["h0"],
            output_final_state=with_state, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, A_log=x["A_log"],
            dt_bias=x["dt_bias"].reshape(H * D), state_v_first=True, cu_seqlens=x["cu_seqlens"],
            cu_seqlens_cpu=cu_cpu)
        res["o"], res["ht"] = o, ht

    return call, lambda: (res["o"][0], res["ht"])


def run_cudnn(x, with_state):
    """cuDNN frontend's fused sm90 kernel through its launcher (what its engine calls): fp32 gate,
    beta and state, int32 cu_seqlens, the lower-bound ("safe") gate, L2 norm and beta sigmoid
    fused. The conversions happen once, outside the timed call."""
    T, H = x["q"].shape[1], x["q"].shape[2]
    N = x["cu_seqlens"].numel() - 1
    g32, beta32 = x["g"].float().contiguous(), x["beta"].float().contiguous()
    cu32 = x["cu_seqlens"].to(torch.int32)
    h0 = x["h0"] if with_state else torch.zeros(N, H, D, D, device="cuda")
    out = torch.empty_like(x["v"])
    ht = torch.empty(N, H, D, D, device="cuda")
    dt = x["dt_bias"].reshape(H * D).contiguous()
    flags = cudnn_kda.FLAG_L2NORM | cudnn_kda.FLAG_SAFE_GATE | cudnn_kda.FLAG_BETA_SIGMOID

    def call():
        cudnn_kda.launch(device=torch.cuda.current_device(), stream=torch.cuda.current_stream().cuda_stream,
                         q=x["q"].data_ptr(), k=x["k"].data_ptr(), v=x["v"].data_ptr(), g=g32.data_ptr(),
                         beta=beta32.data_ptr(), cu_seqlens=cu32.data_ptr(), initial_state=h0.data_ptr(),
                         o=out.data_ptr(), final_state=ht.data_ptr(), total_tokens=T, n_seqs=N, n_heads=H,
                         a_log=x["A_log"].data_ptr(), dt_bias=dt.data_ptr(), gate_lower_bound=LOWER_BOUND,
                         flags=flags, q_scale=D ** -0.5, n_qk_heads=H)

    return call, lambda: (out[0], ht if with_state else None)


# --cold: each implementation is timed a second time with every timed replay following a write of
# L2_FLUSH_FACTOR times the GPU's L2 (untimed), so that none of the call's inputs, workspace or code is
# left in L2 by the replay before, as in a serving engine, where other layers' kernels run between two
# calls of one layer.
L2_FLUSH_FACTOR = 4


def _l2_flush_buffer():
    size = L2_FLUSH_FACTOR * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return torch.empty(max(size, 1 << 26), dtype=torch.uint8, device="cuda")


def time_graph_ms(fn, reps=20, flush=None):
    """Median ms of CUDA-graph replays of one call (warmed up and captured first); with a flush buffer
    each replay follows a write of it (an L2 flush), outside the timed span."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # a warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    ms = _median_event_ms(graph.replay, reps, before=None if flush is None else lambda: flush.fill_(1))
    del graph
    return ms


def time_eager_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    return _median_event_ms(fn, reps)


def _median_event_ms(run, reps, before=None):
    """Median ms of `reps` calls of run() on the current stream, each timed by CUDA events (before(),
    where given, runs ahead of each call, untimed)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_eager_ms(lambda: y.copy_(x), reps=20)
    return 2 * x.numel() / (ms * 1e-3)  # bytes read + written per second


def floor_bytes(H, T, N, with_state):
    b = (4 * T * H * D + T * H + T * H * D) * 2
    if with_state:
        b += 2 * N * H * D * D * 4
    return b


def implementations(args):
    impls = [("flashkda", lambda x, s: run_flashkda(x, s))]
    if not args.no_serial:
        impls.append(("flashkda serial", lambda x, s: run_flashkda(x, s, launch=dict(segment_chunks=-1))))
    if not args.no_balanced:
        impls.append(("flashkda balanced", lambda x, s: run_flashkda(x, s, "balanced")))
    if not args.no_fast:
        impls.append(("flashkda fast", lambda x, s: run_flashkda(x, s, "fast")))
    if args.early_variants:  # which kernels launch early (internal early_launch bits, launch_config.h)
        for name, bits in (("all early", 15), ("K2 early", 2), ("chain, combine early", 12)):
            impls.append((f"flashkda {name}", lambda x, s, b=bits: run_flashkda(x, s, launch=dict(early_launch=b))))
    if args.candidates or args.skip_variants:  # segments without transition skipping
        impls.append(("flashkda no skipping",
                      lambda x, s: run_flashkda(x, s, launch=dict(skip_transitions=-1))))
    if args.skip_variants:  # transition skipping on the former chunk bound, each token's max_c e^a
        impls.append(("flashkda token bound",
                      lambda x, s: run_flashkda(x, s, launch=dict(skip_bound=-1))))
    if args.candidates or args.fused_v2:  # prefill v2's fused kernel wherever it serves the call, and never
        impls.append(("flashkda fused v2", lambda x, s: run_flashkda(x, s, launch=dict(fused_v2=1))))
        impls.append(("flashkda chunk-16", lambda x, s: run_flashkda(x, s, launch=dict(fused_v2=-1))))
    if args.no_pieces:  # the rule without the fused kernel's pieces (internal fused_pieces -1): the chunk-16
        # segments at few heads, the unsplit fused kernel where its rule takes one sequence
        impls.append(("flashkda no pieces", lambda x, s: run_flashkda(x, s, launch=dict(fused_pieces=-1))))
    if args.graph_if:  # a candidate: in a graph, the kernels after the pieces in a conditional node the pieces'
        # flag opens (internal pieces_graph_if 1), where the rule launches them as an eager call does
        impls.append(("flashkda graph if", lambda x, s: run_flashkda(x, s, launch=dict(pieces_graph_if=1))))
    if args.lowrank:  # low-rank segment transitions (a candidate; DESIGN.md "Long memory: the transition is low rank")
        impls.append(("flashkda low-rank transitions",
                      lambda x, s: run_flashkda(x, s, launch=dict(lowrank_transitions=1))))
    for pieces in args.fused_pieces:  # the fused kernel in pieces (a candidate; DESIGN.md "Prefill v2")
        impls.append((f"flashkda pieces {pieces}",
                      lambda x, s, n=pieces: run_flashkda(x, s, launch=dict(fused_pieces=n,
                                                                              fused_warmup=args.fused_warmup))))
    for pieces in args.fused_chain:  # the same, chained: a piece whose warm-up bounds nothing waits for the one before
        impls.append((f"flashkda chained {pieces}",
                      lambda x, s, n=pieces: run_flashkda(x, s, launch=dict(fused_pieces=n, fused_chain=1,
                                                                              fused_warmup=args.fused_warmup))))
    if args.candidates:  # internal candidates (src/launch_config.h), not public modes
        impls.append(("flashkda split-state precise",
                      lambda x, s: run_flashkda(x, s, launch=dict(f16_operands=-1))))
        # K2's record stream by every thread's cp.async, the former rule (DESIGN.md "Segments")
        impls.append(("flashkda cp.async records",
                      lambda x, s: run_flashkda(x, s, launch=dict(record_copy=-1))))
    peers = []
    if flash_kda is not None:
        peers.append(("FlashKDA", run_flash_kda))
    if fla_chunk_kda is not None:
        peers.append(("fla", run_fla))
    if cudnn_kda is not None:
        peers.append(("cuDNN", run_cudnn))
    return impls, peers


# ---- accuracy against an fp64 token recurrence (docs/SPEC.md §3, lower-bound gate) ---------------
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


def accuracy_rows(args):
    impls, peers = implementations(args)
    cases = [("varlen [300, 17, 1024, 77], random", [300, 17, 1024, 77], "random", False),
             ("3000 tokens, long memory", [3000], "long", False),
             ("repeated key, g=-12, beta=8, T=4096", [4096], "random", True)]
    rows = []
    for label, seqlens, regime, adversarial in cases:
        x = make_inputs(4, seqlens, with_state=True, regime=regime, seed=1)
        if adversarial:
            x = repeated_key(x)
        ref_o, ref_s = reference_fp64(x, seqlens)
        for name, make in impls + peers:
            try:
                call, outputs = make(x, True)
                call()
                torch.cuda.synchronize()
                o, ht = outputs()
                rows.append(f"| {label} | {name} | {rel_rms(o, ref_o):.2e} | {rel_rms(ht, ref_s):.2e} |")
            except Exception as exc:  # noqa: BLE001 - a peer failing on an input is a result
                rows.append(f"| {label} | {name} | failed: {type(exc).__name__} | |")
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--table", choices=("many", "few", "both", "none"), default="both")
    ap.add_argument("--regime", choices=("random", "long", "both"), default="both")
    ap.add_argument("--cases", default="", help="comma-separated substrings: only cases whose name contains one")
    ap.add_argument("--eager", action="store_true", help="also eager-call medians of the default flashkda call")
    ap.add_argument("--no-serial", action="store_true", help="skip the serial (no segments) flashkda column")
    ap.add_argument("--no-balanced", action="store_true", help="skip the balanced-precision flashkda column")
    ap.add_argument("--no-fast", action="store_true", help="skip the fast-precision flashkda column")
    ap.add_argument("--no-peers", action="store_true", help="flashkda only")
    ap.add_argument("--candidates", action="store_true",
                    help="also the internal variants: the precise mode with the bf16 split of the state in place of "
                         "its fp16 policy (docs/DESIGN.md 'Precision as an option'), and segments without "
                         "transition skipping (docs/DESIGN.md 'Segments', runs), and K2's record stream by every "
                         "thread's cp.async in place of bulk copies (internal record_copy -1), and prefill v2's fused "
                         "kernel (--fused-v2)")
    ap.add_argument("--fused-v2", action="store_true",
                    help="also flashkda through prefill v2's fused chunk-32 kernel wherever it serves the call (one "
                         "sequence, the lower-bound gate, fp32 states: internal fused_v2 1; the rule runs it from "
                         "H >= 2/3 of the SMs), and through the chunk-16 kernels only (fused_v2 -1)")
    ap.add_argument("--no-pieces", action="store_true",
                    help="also the default call without the fused kernel's pieces (internal fused_pieces -1: the rule "
                         "before few-head pieces)")
    ap.add_argument("--graph-if", action="store_true",
                    help="also the default call with the kernels after the pieces in a conditional graph node that the "
                         "pieces' flag opens (internal pieces_graph_if 1, a candidate)")
    ap.add_argument("--lowrank", action="store_true",
                    help="also the default call with low-rank segment transitions (internal lowrank_transitions = 1, "
                         "a candidate: the chunk-16 segments where the rule runs them at two CTAs an SM)")
    ap.add_argument("--fused-order", action="store_true",
                    help="also mixed lengths at H = 64 and 96 with K0's longest-first order of the sequences against "
                         "the batch's order (internal fused_order -1)")
    ap.add_argument("--fused-pieces", type=int, nargs="*", default=[],
                    help="also flashkda through the fused kernel with each sequence in this many pieces, each after "
                         "the first from a warm-up (internal fused_pieces, a candidate; one column per count; where a "
                         "warm-up does not bound its transition the chunk-16 kernels run the call)")
    ap.add_argument("--fused-chain", type=int, nargs="*", default=[],
                    help="a column per piece count: the fused kernel in chained pieces (internal fused_pieces with "
                         "fused_chain = 1: a piece whose warm-up does not bound its transition waits for the piece "
                         "before it instead of stopping the call)")
    ap.add_argument("--fused-warmup", type=int, default=1,
                    help="with --fused-pieces: the warm-up in 32-token chunks (internal fused_warmup)")
    ap.add_argument("--skip-variants", action="store_true",
                    help="also segments without transition skipping and transition skipping on the former chunk "
                         "bound, the product of each token's max_c e^a (internal skip_transitions -1, skip_bound -1; "
                         "docs/DESIGN.md 'Segments')")
    ap.add_argument("--early-variants", action="store_true",
                    help="also flashkda with every kernel after the call's first launched early, with K2 alone, and "
                         "with the chain and combine alone (internal early_launch 15, 2, 12; docs/DESIGN.md)")
    ap.add_argument("--peers", default="", help="comma-separated peer names to run (default: every importable one)")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--accuracy-only", action="store_true")
    ap.add_argument("--serving", action="store_true", help="also the serving prefill's cost (pool, checkpoints)")
    ap.add_argument("--cold", action="store_true",
                    help="also time each implementation with L2 flushed before every timed replay (untimed), in "
                         "columns of their own: a serving engine's call, with other kernels between two calls "
                         "of a layer, finds nothing of itself in L2")
    ap.add_argument("--runs-sweep", action="store_true",
                    help="also transition skipping's piece lengths and warm-ups (docs/DESIGN.md 'Segments')")
    ap.add_argument("--fused-sweep", action="store_true",
                    help="also the fused chunk-32 kernel against today's kernels on one sequence at T = 2048, 8192, "
                         "32768 and H = 48-160 (docs/DESIGN.md 'Prefill v2'): the data for a per-shape rule")
    ap.add_argument("--fused-batch-sweep", action="store_true",
                    help="also the fused chunk-32 kernel against today's kernels on batches through device "
                         "cu_seqlens (16 x 512 to 4 x 4096 tokens, H = 12-96): the data for a rule beyond one sequence")
    ap.add_argument("--fused-batch-shapes", default="",
                    help="with --fused-batch-sweep: only these shapes, comma-separated names (e.g. '8 x 1024,256 x 200')")
    ap.add_argument("--fused-floor", type=int, default=0,
                    help="with --fused-batch-sweep: the default column with this floor on the longest "
                         "sequence (internal fused_min_tokens, a candidate) instead of the rule's 64 tokens")
    ap.add_argument("--fused-batch-heads", default="", help="with --fused-batch-sweep: only these H, comma-separated")
    ap.add_argument("--layouts-sweep", action="store_true",
                    help="also transition skipping's segment / piece layouts (docs/DESIGN.md 'Segments')")
    args = ap.parse_args()

    impls, peers = implementations(args)
    if args.no_peers:
        peers = []
    elif args.peers:
        peers = [(n, f) for n, f in peers if n in args.peers.split(",")]
    bw = copy_bandwidth()
    flush = _l2_flush_buffer() if args.cold else None
    commit = os.environ.get("BENCH_COMMIT") or tree_name()
    lines = [f"GPU: {torch.cuda.get_device_name()} | date: {datetime.date.today()} | commit: {commit or 'n/a'} | "
             f"copy bandwidth: {bw / 1e12:.2f} TB/s | torch {torch.__version__} | CUDA-graph medians of "
             f"{args.reps} replays, ms" + ("; \"cold\": L2 flushed before each replay" if args.cold else ""), ""]
    names = [n for n, _ in impls] + [n for n, _ in peers]
    cold_names = [n + " cold" for n in names] if args.cold else []
    header = ("| case | gates | " + " | ".join(names) + " | best peer | vs best peer | floor | % of floor |"
              + "".join(f" {n} |" for n in cold_names) + (" cold: vs best peer |" if cold_names else "")
              + (" eager |" if args.eager else ""))
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    print("\n".join(lines), flush=True)
    tables = {"many": MANY, "few": FEW, "both": MANY + FEW, "none": []}[args.table]
    regimes = ("random", "long") if args.regime == "both" else (args.regime,)
    wanted = [c for c in args.cases.split(",") if c]
    for name, H, seqlens, with_state in ([] if args.accuracy_only else tables):
        if wanted and not any(w in name for w in wanted):
            continue
        for regime in regimes:
            x = make_inputs(H, seqlens, with_state, regime)
            times = {}
            for label, make in impls + peers:
                try:
                    fn = make(x, with_state)[0]
                    times[label] = time_graph_ms(fn, reps=args.reps)
                    if flush is not None:
                        times[label + " cold"] = time_graph_ms(fn, reps=args.reps, flush=flush)
                except Exception as exc:  # noqa: BLE001
                    print(f"{label} failed on {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    times[label] = times[label + " cold"] = float("nan")
                torch.cuda.synchronize()
            peer_times = [times[n] for n, _ in peers if times[n] == times[n]]
            best = min(peer_times) if peer_times else float("nan")
            best_name = next((n for n, _ in peers if times[n] == best), "-")
            floor = floor_bytes(H, sum(seqlens), len(seqlens), with_state) / bw * 1e3
            ours = times["flashkda"]
            ratio = f"{best / ours:.2f}x" if peer_times else "-"
            row = (f"| {name} | {regime} | " + " | ".join(f"{times[n]:.3f}" for n in names)
                   + f" | {best_name} | {ratio} | {floor:.3f} | {100 * floor / ours:.0f}% |")
            if cold_names:
                cold_peers = [times[n + " cold"] for n, _ in peers if times[n + " cold"] == times[n + " cold"]]
                row += "".join(f" {times[n]:.3f} |" for n in cold_names)
                row += f" {min(cold_peers) / times['flashkda cold']:.2f}x |" if cold_peers else " - |"
            if args.eager:
                row += f" {time_eager_ms(run_flashkda(x, with_state)[0], reps=args.reps):.3f} |"
            lines.append(row)
            print(row, flush=True)
            del x
            torch.cuda.empty_cache()
    if args.serving:
        lines += serving_rows(args.reps)
    if args.runs_sweep:
        lines += runs_sweep_rows(args.reps, args.cases)
    if args.layouts_sweep:
        lines += layouts_sweep_rows(args.reps, args.cases)
    if args.fused_sweep:
        lines += fused_sweep_rows(args.reps)
    if args.fused_batch_sweep:
        lines += fused_batch_sweep_rows(args.reps, args.fused_batch_shapes, args.fused_batch_heads, args.fused_floor)
    if args.fused_order:
        lines += fused_order_rows(args.reps)
    if not args.no_accuracy:
        lines += ["", "Accuracy, rel-RMS vs the fp64 token recurrence (H=4, fp32 initial state x0.1, bf16 inputs, "
                  "lower-bound gate):", "", "| inputs | implementation | output | final state |", "|---|---|---|---|"]
        print("\n".join(lines[-5:]), flush=True)
        lines += accuracy_rows(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
