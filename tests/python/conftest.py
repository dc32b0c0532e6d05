"""Shared fixtures for the flashkda Python tests: random KDA problems and small helpers."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import flashkda

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None

GATES = ("precomputed", "lower_bound", "softplus")


class Problem(dict):
    """Inputs of one problem (numpy), plus the options to hand to the reference."""

    def ref_kwargs(self):
        return {n: self[n] for n in ("gate", "A_log", "dt_bias", "lower_bound") if n in self}


def make_problem(rng, *, B=1, T=37, H=2, K=64, V=64, dtype=np.float32, gate="lower_bound", lengths=None,
                 state=False, state_dtype=np.float32, cu_dtype=np.int32, g_dtype=None, beta_dtype=None):
    """Random KDA inputs. With lengths, B = 1, T = sum(lengths) and cu_seqlens is set."""
    if lengths is not None:
        B, T = 1, int(sum(lengths))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(cu_dtype)
        N = len(lengths)
    else:
        cu, N = None, B
    g_dtype = dtype if g_dtype is None else g_dtype
    beta_dtype = dtype if beta_dtype is None else beta_dtype
    p = Problem(
        q=rng.standard_normal((B, T, H, K)).astype(dtype),
        k=rng.standard_normal((B, T, H, K)).astype(dtype),
        v=rng.standard_normal((B, T, H, V)).astype(dtype),
        beta=rng.standard_normal((B, T, H)).astype(beta_dtype),
        gate=gate,
        cu_seqlens=cu,
        N=N,
    )
    if gate == "precomputed":
        # log-decays in [-0.7, 0): a realistic spread without vanishing states
        p["g"] = (-0.7 * rng.random((B, T, H, K))).astype(g_dtype)
    else:
        p["g"] = rng.standard_normal((B, T, H, K)).astype(g_dtype)
        p["A_log"] = (0.3 * rng.standard_normal(H)).astype(np.float32)
        p["dt_bias"] = (0.5 * rng.standard_normal((H, K))).astype(np.float32)
        if gate == "lower_bound":
            p["lower_bound"] = -2.0
    if state:
        p["h0_vk"] = (0.1 * rng.standard_normal((N, H, V, K))).astype(state_dtype)
    return p


def gate_kwargs(p, arrays=None):
    """The gate arguments of the fla-style entry points for problem p; A_log and dt_bias come from
    `arrays` (e.g. torch_problem(p)) when given, else from p itself."""
    if p["gate"] == "precomputed":
        return {}
    arrays = p if arrays is None else arrays
    kw = dict(use_gate_in_kernel=True, A_log=arrays["A_log"], dt_bias=arrays["dt_bias"])
    if p["gate"] == "lower_bound":
        kw["lower_bound"] = p["lower_bound"]
    return kw


@pytest.fixture
def rng(request):
    # fresh inputs per test, reproducible per test name
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def need_bf16():
    if BF16 is None:
        pytest.skip("ml_dtypes not installed (numpy bfloat16)")
    return BF16


def decode_not_built_reason():
    """The message while the C++ decode backend is a placeholder, else None."""
    rng = np.random.default_rng(0)
    p = make_problem(rng, B=1, T=1, H=1, K=16, V=16, gate="precomputed")
    try:
        flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"])
    except RuntimeError as e:
        if "not built yet" in str(e):
            return str(e)
        raise
    return None


@pytest.fixture(scope="session")
def decode_ready():
    reason = decode_not_built_reason()
    if reason is not None:
        pytest.xfail(f"C++ decode backend not built yet: {reason}")


# ---- torch helpers (torch is imported only when these are called) ------------------------------------


def to_torch(x, device="cpu"):
    """numpy (float32, int, or ml_dtypes bfloat16) -> a new torch tensor on device, same bits."""
    import torch

    if x is None:
        return None
    if x.dtype.name == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(device, copy=True)  # never shares memory with the numpy array


def to_numpy(t):
    """torch tensor -> numpy (bfloat16 as float32, exact)."""
    import torch

    t = t.detach().cpu()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def torch_problem(p, device="cpu"):
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "h0_vk")
    return {n: to_torch(p[n], device) for n in names if p.get(n) is not None}
