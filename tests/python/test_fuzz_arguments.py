"""Corrupted arguments (shapes, dtypes, layouts, values, types) to fwd, chunk_kda and
fused_recurrent_kda must end in a return or a ValueError / TypeError / NotImplementedError, never
another exception or a crash. The fuzzer runs in a child process, so a crash fails this test with
the case that caused it. FLASHKDA_FUZZ_CASES sets the number of cases per run (default 600)."""
import importlib.util
import os
import subprocess
import sys

import pytest

import flashkda

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = int(os.environ.get("FLASHKDA_FUZZ_CASES", "600"))
HAS_TORCH = importlib.util.find_spec("torch") is not None


def run_fuzzer(seed, mode):
    r = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_arguments.py"), str(seed), str(CASES), mode],
                       capture_output=True, text=True, timeout=600)
    lines = r.stdout.splitlines()
    findings = [ln for ln in lines if ln.startswith("FINDING")]
    assert r.returncode == 0 and lines and lines[-1] == "DONE 0", (
        f"exit code {r.returncode}; last case: {lines[-1] if lines else '(none)'}\n"
        + "\n".join(findings[:20]) + f"\nstderr: {r.stderr[-2000:]}\n"
        f"rerun one case: FUZZ_ONLY=<seed> python {os.path.join(HERE, 'fuzz_arguments.py')} {seed} {CASES} {mode}")
    # Both outcomes occur, or the corruptions (or the valid calls) are not what they claim to be.
    returned, refused = (int(x) for x in lines[-2].split()[1::2])
    assert returned >= CASES // 20 and refused >= CASES // 2, lines[-2]


@pytest.mark.parametrize("seed", [1, 2])
def test_numpy_arguments(seed):
    run_fuzzer(seed, "numpy")


@pytest.mark.parametrize("seed", [3, 4])
def test_torch_cpu_arguments(seed):
    if not HAS_TORCH:
        pytest.skip("torch is not installed: torch argument fuzzing skipped")
    run_fuzzer(seed, "torch")


def test_torch_cuda_arguments():
    if not HAS_TORCH or not flashkda.cuda_available():
        pytest.skip("no CUDA GPU: CUDA argument fuzzing skipped")
    run_fuzzer(5, "cuda")
