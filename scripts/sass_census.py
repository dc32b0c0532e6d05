"""Static SASS census of one kernel: its instructions attributed to the source functions that the
producer's and the consumers' per-chunk loops call (the inlined call chain of each instruction, from
-lineinfo), so that a change to a phase can be weighed in instructions before it runs on a GPU.

    python scripts/sass_census.py OBJECT KERNEL_SUBSTRING [--anchors A,B,...] [--most N] [--samples CSV]

OBJECT: a compiled .o or .cubin with line info (the CMake build compiles with -lineinfo), e.g. the
object of src/cuda/sm90/prefill_v2/fused.cu; KERNEL_SUBSTRING: enough of the mangled name to pick one
kernel (the first match is taken; the list of matches is printed). Each instruction counts once,
under "anchor > callee": the first anchor function found in its inline chain (default: the
producer's produce_chunk and produce_item, the consumers' consume_chunk and consume_item) and the
function it called; instructions outside every anchor count under their innermost functions.
Counts are static: a loop's body counts once however often it runs (the per-chunk phases are
unrolled, so their counts are close to one warp's instructions a chunk).

--samples CSV: ncu's source page of the same kernel from the same object (`ncu -i REPORT --page source
--csv --print-source sass`, gpu_check.sh's ncu_source_csv): each instruction then counts its executed
warp-instructions and its stall samples (all, and by reason) instead of once; the page's rows are
matched to the disassembly by position, their opcodes checked.

Needs nvdisasm and cuobjdump on PATH (the CUDA toolkit's, or pip's nvidia-cuda-nvdisasm and
nvidia-cuda-cuobjdump wheels: their nvidia/cu13/bin).
"""
import argparse
import collections
import csv
import os
import re
import subprocess
import sys
import tempfile

DEFAULT_ANCHORS = ("produce_chunk", "produce_item", "consume_chunk", "consume_item")
LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*")
DEF = re.compile(r"\s*(?:template\s*<.*>\s*)?(?:static\s+)?(?:__host__\s+)?(?:__device__|__global__)\b.*?\b([A-Za-z_]\w*)\s*\(")
LAMBDA = re.compile(r"\s*(?:const\s+)?auto\s+(\w+)\s*=\s*\[")


class Sources:
    """The function enclosing a source line: the last definition that starts at or before it."""

    def __init__(self):
        self.defs = {}

    def function(self, path, line):
        if path not in self.defs:
            found = []
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    for i, text in enumerate(f, 1):
                        text = re.sub(r"__launch_bounds__\([^)]*\)", "", text)
                        m = DEF.match(text) or LAMBDA.match(text)
                        if m and "operator" not in text:
                            found.append((i, m.group(1)))
            self.defs[path] = found
        name = "?"
        for start, fn in self.defs[path]:
            if start > line:
                break
            name = fn
        return f"{os.path.basename(path)}:{name}"


def disassemble(obj, kernel):
    with tempfile.TemporaryDirectory() as tmp:
        cubin = obj
        if not obj.endswith(".cubin"):
            subprocess.run(["cuobjdump", "-xelf", "all", os.path.abspath(obj)], cwd=tmp, check=True,
                           stdout=subprocess.DEVNULL)
            cubins = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".cubin")]
            if not cubins:
                sys.exit(f"{obj}: no cubin inside")
            cubin = cubins[0]
        text = subprocess.run(["nvdisasm", "-gi", cubin], check=True, capture_output=True, text=True).stdout
    sections = re.split(r"\n(?=\s*\.section\s+\.text\.)", text)
    matches = [s for s in sections if re.match(r"\s*\.section\s+\.text\.\S*" + re.escape(kernel), s)]
    names = [re.match(r"\s*\.section\s+\.text\.([^\s,]+)", s).group(1) for s in matches]
    if not matches:
        sys.exit(f"no kernel in {obj} matches {kernel}")
    print(f"{len(matches)} kernel(s) match; taking {names[0]}", file=sys.stderr)
    return matches[0]


def instructions(sass):
    """(opcode, inline chain innermost first) of each instruction, in address order."""
    sources = Sources()
    out, block, chain = [], [], ()
    for line in sass.split("\n"):
        m = LINE.search(line)
        if m:
            block.append((m.group(1), int(m.group(2))))
            continue
        i = INSTR.search(line)
        if i:
            if block:  # the chain of the lines printed before this instruction, innermost first
                chain = tuple(sources.function(p, n) for p, n in block)
                block = []
            out.append((i.group(0).split()[-1], chain))
    return out


def place(chain, anchors):
    names = [c.split(":", 1)[1] for c in chain]
    for anchor in anchors:
        if anchor in names:
            i = names.index(anchor)
            return f"{chain[i]} > {chain[i - 1] if i > 0 else '(its own lines)'}"
    return " < ".join(chain[:3]) or "(no line info)"


def read_samples(path, count):
    """The numeric columns of ncu's source page, one dict a SASS row, and each row's opcode."""
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if any(c.strip().strip('#').strip() == "Address" for c in r))
    names = [c.strip() for c in rows[head]]
    src = next(i for i, n in enumerate(names) if n == "Source")
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(names) or not r[src].strip():
            continue
        vals = {}
        for n, c in zip(names, r):
            try:
                vals[n] = float(c.replace(",", ""))
            except ValueError:
                pass
        text = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip())
        out.append((text.split()[0] if text else "", vals))
    if len(out) != count:
        print(f"{path}: {len(out)} rows against {count} instructions in the disassembly", file=sys.stderr)
    return out


def census(sass, anchors, samples=None):
    instrs = instructions(sass)
    if samples is None:
        by = collections.Counter()
        for _, chain in instrs:
            by[place(chain, anchors)] += 1
        return by
    rows = read_samples(samples, len(instrs))
    bad = sum(1 for (op, _), (op2, _) in zip(instrs, rows) if op.split(".")[0] != op2.split(".")[0])
    if bad:
        print(f"{bad} opcodes differ between the page and the disassembly (another build?)", file=sys.stderr)
    by = collections.defaultdict(collections.Counter)
    for (_, chain), (_, vals) in zip(instrs, rows):
        key = place(chain, anchors)
        by[key]["instructions"] += 1
        for n, v in vals.items():
            by[key][n] += v
    return by


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("object")
    ap.add_argument("kernel")
    ap.add_argument("--anchors", default=",".join(DEFAULT_ANCHORS))
    ap.add_argument("--most", type=int, default=40)
    ap.add_argument("--samples", help="ncu's source page (CSV) of this kernel from this object")
    a = ap.parse_args()
    by = census(disassemble(a.object, a.kernel), a.anchors.split(","), a.samples)
    if a.samples:
        return print_samples(by, a.most)
    total = sum(by.values())
    print("| instructions | share | where (anchor > callee) |")
    print("|---|---|---|")
    for key, n in by.most_common(a.most):
        print(f"| {n} | {100 * n / total:.1f}% | {key} |")
    print(f"| {total} | 100% | the kernel |")


def print_samples(by, most):
    """Per place: static and executed instructions, stall samples in all and their main reasons."""
    cols = sorted({n for c in by.values() for n in c})
    def pick(*words):
        return next((n for n in cols if all(w in n.lower() for w in words)), None)
    executed = pick("instructions executed") or pick("inst_executed")
    samples = pick("sampling", "all") or pick("samples")
    reasons = [n for n in cols if (n.lower().startswith("stall") or "stall " in n.lower()) and "sampling" not in n.lower()]
    tot = {n: sum(c[n] for c in by.values()) for n in cols}
    order = sorted(by, key=lambda k: -by[k][samples] if samples else -by[k]["instructions"])
    print("columns:", ", ".join(cols), file=sys.stderr)
    print(f"| where (anchor > callee) | static | executed | samples | top reasons (share of the place's samples) |")
    print("|---|---|---|---|---|")
    for k in order[:most]:
        c = by[k]
        top = sorted(((c[n], n) for n in reasons if c[n] > 0), reverse=True)[:4]
        why = ", ".join(f"{n} {100 * v / max(c[samples], 1):.0f}%" for v, n in top) if samples else ""
        ex = f"{c[executed]:.3g}" if executed else "-"
        sm = f"{100 * c[samples] / max(tot[samples], 1):.1f}%" if samples else "-"
        print(f"| {k} | {c['instructions']:.0f} | {ex} | {sm} | {why} |")


if __name__ == "__main__":
    main()
