"""Plot prefill time against sequence length from bench_prefill.py tables (markdown, one or more
files; a later file's figure replaces an earlier one's for the same case, regime and column).

    python benchmarks/plot_prefill.py run1.md run2.md --out docs/prefill_few_heads.png [--gpu H100]
    python benchmarks/plot_prefill.py bench_fused.log --fused-batch --out docs/prefill_fused_rule.png

One panel per gate regime: one sequence at H = 12 (the tensor-parallel serving shape), time
against T on log-log axes, one line per implementation. With --fused-batch: the table of
`bench_prefill.py --fused-batch-sweep` (the fused chunk-32 kernel and the default call against the
chunk-16 kernels), their time ratio against the CTAs the fused kernel runs (N H), one line per
batch shape.
"""
import argparse
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SKIP = {"case", "gates", "best peer", "vs best peer", "floor", "% of floor", "eager"}
COLORS = {"flashkda": "tab:blue", "flashkda serial": "tab:cyan", "flashkda balanced": "tab:purple", "flashkda fast": "tab:olive", "fla": "tab:green",
          "FlashKDA": "tab:orange", "cuDNN": "tab:red"}


def read_tables(paths):
    data = defaultdict(dict)  # (case, regime) -> {column: ms}
    for path in paths:
        header = None
        for line in open(path):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 3:
                header = None if not line.startswith("|") else header
                continue
            if cells[0] == "case" and cells[1] == "gates":
                header = cells
                continue
            if header is None or set(cells[0]) <= set("-"):
                continue
            for name, value in zip(header, cells):
                if name in SKIP:
                    continue
                try:
                    data[(cells[0], cells[1])][name] = float(value.strip("*"))  # bold: the fastest
                except ValueError:
                    pass
    return data


def plot_fused_batch(paths, out, gpu):
    """fused / chunk-16 and default / chunk-16 against N H, one line per batch shape."""
    shapes = defaultdict(list)  # shape -> [(ctas, fused ratio, default ratio)]
    for path in paths:
        header = None
        for line in open(path):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells and cells[0] == "N x T":
                header = cells
                default = next(k for k in header if k.startswith("default"))  # "default (rule)" or "default, floor N"
                continue
            if header is None or len(cells) != len(header) or set(cells[0]) <= set("-"):
                continue
            row = dict(zip(header, cells))
            c16, fused, rule = (float(row[k]) for k in ("chunk-16 kernels", "fused v2", default))
            shapes[row["N x T"]].append((int(row["CTAs (N H)"]), fused / c16, rule / c16))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, which, title in ((axes[0], 1, "fused chunk-32 kernel (forced)"), (axes[1], 2, "default call (the rule)")):
        for i, (shape, pts) in enumerate(shapes.items()):  # tab20 and two markers: no two shapes look alike
            pts.sort()
            ax.plot([p[0] for p in pts], [p[which] for p in pts], "-" + "os"[i % 2], markersize=4, label=shape,
                    color=plt.cm.tab20(i % 20))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axvline(2 * 132 / 3, color="gray", linestyle=":", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CTAs of the fused kernel (sequences x heads; dotted: 2/3 of 132 SMs)")
        ax.set_title(f"{title} / chunk-16 kernels", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(f"time ratio (CUDA-graph medians, {gpu}; < 1: faster)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tables", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--columns", default="", help="comma-separated columns to draw (default: all)")
    ap.add_argument("--fused-batch", action="store_true", help="the --fused-batch-sweep table instead (see above)")
    ap.add_argument("--gpu", default="H200", help="the card the tables were measured on, for the axis label")
    args = ap.parse_args()
    if args.fused_batch:
        return plot_fused_batch(args.tables, args.out, args.gpu)
    data = read_tables(args.tables)
    regimes = ("random", "long")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, regime in zip(axes, regimes):
        series = defaultdict(list)
        for (case, reg), cols in data.items():
            m = re.match(rf"T=(\d+) H={args.heads} one seq$", case)
            if reg != regime or not m:
                continue
            for name, ms in cols.items():
                series[name].append((int(m.group(1)), ms))
        keep = [c for c in args.columns.split(",") if c]
        for name in sorted(series, key=lambda n: (not n.startswith("flashkda"), n)):
            if keep and name not in keep:
                continue
            pts = sorted(series[name])
            style = "-o" if name == "flashkda" else ("--o" if name.startswith("flashkda") else ":s")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, markersize=4,
                    color=COLORS.get(name))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T (one sequence)")
        ax.set_title(f"H = {args.heads}, " + ("long-memory gates (8 channels per head near zero decay)" if regime == "long"
                                             else "random gates"), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"ms (CUDA-graph median, {args.gpu})")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
