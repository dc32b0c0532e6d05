"""Bad input raises before any work, with a message that names the argument; the low-level
flashkda._C maps the library's errors to ValueError / RuntimeError with the same text."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem

import flashkda
from flashkda import _C


def chunk(p, **over):
    args = dict(q=p["q"], k=p["k"], v=p["v"], g=p["g"], beta=p["beta"])
    args.update(over)
    return flashkda.chunk_kda(**args)


@pytest.mark.parametrize("name,shape,pattern", [
    ("k", (1, 9, 2, 64), r"k: expected shape \[1, 8, 2, 64\], got \[1, 9, 2, 64\]"),
    ("g", (1, 8, 2, 32), r"g: expected shape \[1, 8, 2, 64\]"),
    ("beta", (1, 8, 3), r"beta: expected shape \[1, 8, 2\]"),
    ("v", (1, 8, 2), r"v: expected shape \[B, T, H, V\]"),
    ("q", (8, 2, 64), r"q: expected a 4-d array"),
])
def test_shape_errors_name_the_argument(rng, name, shape, pattern):
    p = make_problem(rng, T=8)
    with pytest.raises(ValueError, match=pattern):
        chunk(p, **{name: np.zeros(shape, np.float32)})


def test_dtype_errors(rng, need_bf16):
    p = make_problem(rng, T=8)
    with pytest.raises(ValueError, match="q: dtype float64 is not supported"):
        chunk(p, q=p["q"].astype(np.float64))
    with pytest.raises(ValueError, match="k: dtype bfloat16 differs from q's float32"):
        chunk(p, k=p["k"].astype(need_bf16))
    with pytest.raises(ValueError, match="g: dtype float16 is not supported"):
        chunk(p, g=p["g"].astype(np.float16))
    with pytest.raises(ValueError, match="cu_seqlens: dtype float32"):
        chunk(p, cu_seqlens=np.array([0.0, 8.0], np.float32))


def test_type_errors(rng):
    p = make_problem(rng, T=8)
    with pytest.raises(TypeError, match="q: expected a numpy array or a torch tensor"):
        chunk(p, q=p["q"].tolist())
    with pytest.raises(TypeError, match="k: expected a numpy array like q"):
        chunk(p, k=p["k"].tolist())


def test_grouped_value_heads_not_a_multiple_and_per_channel_beta_are_rejected(rng):
    p = make_problem(rng, T=8)
    with pytest.raises(ValueError, match="grouped value heads need HV a multiple of H"):
        chunk(p, v=np.zeros((1, 8, 3, 64), np.float32))
    with pytest.raises(ValueError, match="grouped value heads"):  # fewer value heads than q's
        chunk(p, v=np.zeros((1, 8, 1, 64), np.float32))
    with pytest.raises(ValueError, match=r"g: expected shape \[1, 8, 4, 64\]"):  # grouped: g has HV heads
        chunk(p, v=np.zeros((1, 8, 4, 64), np.float32))
    with pytest.raises(ValueError, match="per-channel beta"):
        chunk(p, beta=np.zeros((1, 8, 2, 64), np.float32))


def test_varlen_errors(rng):
    p = make_problem(rng, B=2, T=8)
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        chunk(p, cu_seqlens=np.array([0, 8], np.int64))
    p = make_problem(rng, lengths=[3, 5])
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[N, H, K, V\]"):
        chunk(p, cu_seqlens=p["cu_seqlens"], initial_state=np.zeros((1, 2, 64, 64), np.float32))
    # checked by the library (host-readable cu_seqlens): ValueError with its message
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk(p, cu_seqlens=np.array([0, 5, 3], np.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk(p, cu_seqlens=np.array([0, 3, 9], np.int32))


def test_gate_errors(rng):
    p = make_problem(rng, T=8, gate="softplus")
    with pytest.raises(ValueError, match="A_log: must be provided"):
        chunk(p, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="lower_bound: must be specified when safe_gate=True"):
        chunk(p, use_gate_in_kernel=True, safe_gate=True, A_log=p["A_log"])
    with pytest.raises(ValueError, match=r"lower_bound: must lie in \[-5, 0\)"):
        chunk(p, use_gate_in_kernel=True, lower_bound=-7.0)
    with pytest.raises(ValueError, match=r"dt_bias: expected 128 elements"):
        chunk(p, use_gate_in_kernel=True, A_log=p["A_log"], dt_bias=np.zeros(64, np.float32))


# ---- the extension itself -------------------------------------------------------------------------


def ext_args(p):
    out = np.empty(p["v"].shape, np.float32)
    return (p["q"], p["k"], p["v"], p["g"], p["beta"], out)


def test_ext_library_errors_are_value_errors_with_the_library_text(rng):
    p = make_problem(rng, T=8, gate="lower_bound")
    with pytest.raises(ValueError, match="lower_bound"):
        _C.forward(*ext_args(p), A_log=p["A_log"], lower_bound=1.0)


def test_ext_checks_shapes_and_contiguity(rng):
    p = make_problem(rng, T=8, gate="precomputed")
    q, k, v, g, beta, out = ext_args(p)
    with pytest.raises(ValueError, match="k: must be C-contiguous"):
        _C.forward(q, np.asfortranarray(k), v, g, beta, out, gate="precomputed")
    with pytest.raises(ValueError, match=r"out: expected shape \[1, 8, 2, 64\]"):
        _C.forward(q, k, v, g, beta, out[:, :4], gate="precomputed")
    with pytest.raises(ValueError, match="gate: expected"):
        _C.forward(q, k, v, g, beta, out, gate="sigmoid")
    with pytest.raises(ValueError, match="A_log: required for the softplus gate"):
        _C.forward(q, k, v, g, beta, out, gate="softplus")


def test_ext_uint16_is_bf16_only_when_flagged(rng, need_bf16):
    p = make_problem(rng, T=8, gate="precomputed", dtype=need_bf16)
    u16 = [p[n].view(np.uint16) for n in ("q", "k", "v", "g", "beta")]
    out = np.empty(p["v"].shape, need_bf16)
    with pytest.raises(ValueError, match="u16_is_bf16"):
        _C.forward(*u16, out.view(np.uint16), gate="precomputed")
    _C.forward(*u16, out.view(np.uint16), gate="precomputed", u16_is_bf16=True)
    o, _ = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], use_qk_l2norm_in_kernel=True,
                              use_beta_sigmoid_in_kernel=True)
    np.testing.assert_array_equal(out, o)


def test_ext_read_only_inputs_are_fine_but_outputs_must_be_writable(rng):
    p = make_problem(rng, T=8, gate="precomputed")
    q, k, v, g, beta, out = ext_args(p)
    for x in (q, k, v, g, beta):
        x.setflags(write=False)
    _C.forward(q, k, v, g, beta, out, gate="precomputed")
    out.setflags(write=False)
    with pytest.raises(TypeError):
        _C.forward(q, k, v, g, beta, out, gate="precomputed")


def test_ext_info():
    assert isinstance(flashkda.version(), str) and flashkda.version() == flashkda.__version__
    assert isinstance(flashkda.cuda_available(), bool)
    assert isinstance(flashkda.built_with_cuda, bool)
    if not flashkda.built_with_cuda:
        assert not flashkda.cuda_available()
    assert _C.workspace_size(*ext_args(make_problem(np.random.default_rng(0), T=4, gate="precomputed")),
                             gate="precomputed") == 0


def test_precision_is_checked_by_name(rng):
    p = make_problem(rng, T=8)
    o_precise, _ = chunk(p)
    for mode in ("fast", "balanced"):  # the CPU backend computes in fp32 in every mode
        np.testing.assert_array_equal(o_precise, chunk(p, precision=mode)[0])
    with pytest.raises(ValueError, match=r"precision: expected 'precise', 'balanced' or 'fast', got 'fp64'"):
        chunk(p, precision="fp64")
    out = np.zeros_like(p["v"])
    with pytest.raises(ValueError, match="precision: expected 'precise', 'balanced' or 'fast'"):
        flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.1, out, np.zeros(2, np.float32), None, -1.0,
                     precision=None)
    with pytest.raises(ValueError, match="precision: expected 'precise', 'balanced' or 'fast'"):
        _C.forward(p["q"], p["k"], p["v"], p["g"], p["beta"], out, gate="precomputed", precision="exact")


@pytest.mark.parametrize("output_final_state", [False, True])
def test_empty_cu_seqlens_is_named_on_every_path(rng, output_final_state):
    """An empty cu_seqlens (no N + 1 entries) is a ValueError naming it, also on the torch direct path,
    which sized the final state from it first (the argument fuzzer's seed 10401950: a RuntimeError
    from torch.empty with N = -1)."""
    torch = pytest.importorskip("torch")
    from conftest import to_torch

    p = make_problem(rng, T=8)
    for cu in (np.zeros(0, np.int32), torch.zeros(0, dtype=torch.int32)):
        for arrays in ("numpy", "torch"):
            args = {n: p[n] if arrays == "numpy" else to_torch(p[n]) for n in ("q", "k", "v", "g", "beta")}
            cu_arg = cu if arrays == "torch" or isinstance(cu, np.ndarray) else cu.numpy()
            with pytest.raises(ValueError, match="cu_seqlens"):
                flashkda.chunk_kda(**args, cu_seqlens=cu_arg, output_final_state=output_final_state)
