"""Static SASS census of one kernel: its instructions attributed to the source functions that the
producer's and the consumers' per-chunk loops call (the inlined call chain of each instruction, from
-lineinfo), so that a change to a phase can be weighed in instructions before it runs on a GPU.

    python scripts/sass_census.py OBJECT KERNEL_SUBSTRING [--anchors A,B,...] [--most N]

OBJECT: a compiled .o or .cubin with line info (the CMake build compiles with -lineinfo), e.g. the
object of src/cuda/sm90/prefill_v2/fused.cu; KERNEL_SUBSTRING: enough of the mangled name to pick one
kernel (the first match is taken; the list of matches is printed). Each instruction counts once,
under "anchor > callee": the first anchor function found in its inline chain (default: the
producer's produce_chunk and produce_item, the consumers' consume_chunk and consume_item) and the
function it called; instructions outside every anchor count under their innermost functions.
Counts are static: a loop's body counts once however often it runs (the per-chunk phases are
unrolled, so their counts are close to one warp's instructions a chunk).

Needs nvdisasm and cuobjdump on PATH (the CUDA toolkit's, or pip's nvidia-cuda-nvdisasm and
nvidia-cuda-cuobjdump wheels: their nvidia/cu13/bin).
"""
import argparse
import collections
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


def census(sass, anchors):
    sources = Sources()
    counts = collections.Counter()
    block, chain = [], ()
    for line in sass.split("\n"):
        m = LINE.search(line)
        if m:
            block.append((m.group(1), int(m.group(2))))
            continue
        if INSTR.search(line):
            if block:  # the chain of the lines printed before this instruction, innermost first
                chain = tuple(sources.function(p, n) for p, n in block)
                block = []
            counts[chain] += 1
    by = collections.Counter()
    for chain, n in counts.items():
        names = [c.split(":", 1)[1] for c in chain]
        key = " < ".join(chain[:3]) or "(no line info)"
        for anchor in anchors:
            if anchor in names:
                i = names.index(anchor)
                key = f"{chain[i]} > {chain[i - 1] if i > 0 else '(its own lines)'}"
                break
        by[key] += n
    return by


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("object")
    ap.add_argument("kernel")
    ap.add_argument("--anchors", default=",".join(DEFAULT_ANCHORS))
    ap.add_argument("--most", type=int, default=40)
    a = ap.parse_args()
    by = census(disassemble(a.object, a.kernel), a.anchors.split(","))
    total = sum(by.values())
    print("| instructions | share | where (anchor > callee) |")
    print("|---|---|---|")
    for key, n in by.most_common(a.most):
        print(f"| {n} | {100 * n / total:.1f}% | {key} |")
    print(f"| {total} | 100% | the kernel |")


if __name__ == "__main__":
    main()
