"""`import flashkda` on its own, in a fresh interpreter, in both orders with torch and without
torch: each must exit cleanly (a crash here is a crash in every user's first line)."""
import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None

CASES = {
    "flashkda alone": ("import flashkda; flashkda.cuda_available()", {}),
    "flashkda, then torch": ("import flashkda, torch; flashkda.cuda_available()", {}),
    "torch, then flashkda": ("import torch, flashkda; flashkda.cuda_available()", {}),
    "FLASHKDA_NO_TORCH=1": ("import flashkda; flashkda.cuda_available()", {"FLASHKDA_NO_TORCH": "1"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_import_in_fresh_interpreter_exits_cleanly(name):
    code, extra_env = CASES[name]
    if "torch" in code.replace("flashkda", "") and not HAS_TORCH:
        pytest.skip("torch is not installed")
    env = dict(os.environ, **extra_env)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit code {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"


def test_demo_help_prints_whole_sentences():
    r = subprocess.run([sys.executable, "-m", "flashkda.demo", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    # the description and the epilog are the docstring's two paragraphs, whole (it stopped at "and" before)
    assert "checked against the fp64 reference on a sample." in text
    assert "the first sequence, all heads." in text
