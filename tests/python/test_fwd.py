"""flashkda.fwd (MoonshotAI FlashKDA's signature) on numpy arrays: in-place outputs, semantics, errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem
from kda_reference import kda_forward, rel_rms

import flashkda


def fwd_args(p, dtype):
    B, T, H, _ = p["q"].shape
    V = p["v"].shape[-1]
    out = np.full((B, T, H, V), np.nan, dtype=dtype)
    return out


def reference(p):
    return kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], gate="lower_bound", A_log=p["A_log"],
                       dt_bias=p["dt_bias"], lower_bound=p["lower_bound"], l2norm=True, beta_logit=True,
                       scale=0.25, initial_state=p.get("h0_vk"), cu_seqlens=p["cu_seqlens"])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_writes_out_and_final_state_in_place(rng, need_bf16, dtype, state_dtype):
    dt = np.float32 if dtype == "f32" else need_bf16
    sd = np.float32 if state_dtype == "f32" else need_bf16
    p = make_problem(rng, dtype=dt, lengths=[33, 1, 20], state=True, state_dtype=sd, cu_dtype=np.int64)
    out = fwd_args(p, dt)
    ht = np.full(p["h0_vk"].shape, np.nan, dtype=sd)
    out_id, ht_id = id(out), id(ht)
    ret = flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25, out, p["A_log"], p["dt_bias"],
                       p["lower_bound"], initial_state=p["h0_vk"], final_state=ht, cu_seqlens=p["cu_seqlens"])
    assert ret is None and id(out) == out_id and id(ht) == ht_id
    assert out.dtype == dt and ht.dtype == sd
    assert np.isfinite(out.astype(np.float32)).all() and np.isfinite(ht.astype(np.float32)).all()
    ref_o, ref_h = reference(p)
    tol_o = 1e-5 if dtype == "f32" else 5e-3
    tol_h = 1e-5 if (dtype, state_dtype) == ("f32", "f32") else (1e-4 if state_dtype == "f32" else 5e-3)
    assert rel_rms(out, ref_o) <= tol_o
    assert rel_rms(ht, ref_h) <= tol_h


@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_final_state_over_the_initial_one(rng, need_bf16, state_dtype):
    # one array as both initial_state and final_state (a caller updating its states in place): the
    # bits of two arrays
    sd = np.float32 if state_dtype == "f32" else need_bf16
    p = make_problem(rng, lengths=[40, 0, 17], state=True, state_dtype=sd, cu_dtype=np.int64)
    out, ht = fwd_args(p, np.float32), np.full(p["h0_vk"].shape, np.nan, dtype=sd)
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25)
    gate = (p["A_log"], p["dt_bias"], p["lower_bound"])
    flashkda.fwd(*args, out, *gate, initial_state=p["h0_vk"], final_state=ht, cu_seqlens=p["cu_seqlens"])
    state, out2 = p["h0_vk"].copy(), fwd_args(p, np.float32)
    flashkda.fwd(*args, out2, *gate, initial_state=state, final_state=state, cu_seqlens=p["cu_seqlens"])
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(state, ht)
    assert not np.array_equal(state, p["h0_vk"])


def test_matches_chunk_kda_with_the_same_options(rng):
    p = make_problem(rng, B=2, T=29, state=True)
    out = fwd_args(p, np.float32)
    ht = np.empty_like(p["h0_vk"])
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25, out, p["A_log"], p["dt_bias"], p["lower_bound"],
                 initial_state=p["h0_vk"], final_state=ht)
    o2, ht2 = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], scale=0.25, initial_state=p["h0_vk"],
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True, lower_bound=p["lower_bound"], A_log=p["A_log"],
                                 dt_bias=p["dt_bias"], state_v_first=True)
    np.testing.assert_array_equal(out, o2)
    np.testing.assert_array_equal(ht, ht2)


def test_without_states(rng):
    p = make_problem(rng, B=2, T=18)
    out = fwd_args(p, np.float32)
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25, out, p["A_log"], p["dt_bias"], p["lower_bound"])
    ref_o, _ = reference(p)
    assert rel_rms(out, ref_o) <= 1e-5


def test_final_state_only(rng):
    p = make_problem(rng, lengths=[7, 12])
    out = fwd_args(p, np.float32)
    ht = np.full((2, 2, 64, 64), np.nan, np.float32)
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25, out, p["A_log"], p["dt_bias"], p["lower_bound"],
                 final_state=ht, cu_seqlens=p["cu_seqlens"])
    _, ref_h = reference(p)
    assert rel_rms(ht, ref_h) <= 1e-5


def call_fwd(p, **over):
    args = dict(q=p["q"], k=p["k"], v=p["v"], g=p["g"], beta=p["beta"], scale=0.25, out=fwd_args(p, np.float32),
                A_log=p["A_log"], dt_bias=p["dt_bias"], lower_bound=p["lower_bound"])
    args.update(over)
    return flashkda.fwd(**args)


def test_out_errors_name_the_argument(rng):
    p = make_problem(rng, B=1, T=8)
    with pytest.raises(ValueError, match=r"out: expected shape \[1, 8, 2, 64\]"):
        call_fwd(p, out=np.empty((1, 8, 2, 32), np.float32))
    with pytest.raises(ValueError, match="out: dtype float64"):
        call_fwd(p, out=np.empty((1, 8, 2, 64), np.float64))
    with pytest.raises(ValueError, match="out: must be contiguous"):
        call_fwd(p, out=np.empty((1, 8, 64, 2), np.float32).swapaxes(-1, -2))
    with pytest.raises(ValueError, match="final_state: expected shape"):
        call_fwd(p, final_state=np.empty((1, 2, 64, 63), np.float32))
    with pytest.raises(ValueError, match="initial_state: expected shape"):
        call_fwd(p, initial_state=np.empty((2, 2, 64, 64), np.float32))


def test_required_gate_arguments(rng):
    p = make_problem(rng, B=1, T=8)
    with pytest.raises(ValueError, match="A_log"):
        call_fwd(p, A_log=None)
    with pytest.raises(ValueError, match="lower_bound"):
        call_fwd(p, lower_bound=-6.0)
    with pytest.raises(ValueError, match="lower_bound"):
        call_fwd(p, lower_bound=0.0)
    with pytest.raises(ValueError, match="scale"):
        call_fwd(p, scale=None)
    with pytest.raises(ValueError, match=r"A_log: expected 2 elements"):
        call_fwd(p, A_log=np.zeros(3, np.float32))


def test_every_internal_prefill_field_reaches_the_call(rng):
    """Each of flashkda._internal.launch's prefill fields is a keyword of the extension's call (a
    name missing there would raise TypeError inside the block), and a call with it set matches the
    reference (the CPU backend reads few of them)."""
    from flashkda import _internal

    p = make_problem(rng, dtype=np.float32, lengths=[40, 3, 17], state=True)
    ref_o, ref_h = reference(p)
    for name in sorted(_internal._PREFILL):
        out = fwd_args(p, np.float32)
        ht = np.full(p["h0_vk"].shape, np.nan, dtype=np.float32)
        with _internal.launch(**{name: 1 if name != "cpu_isa" else _internal.cpu_engine_isa()}):
            flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25, out, p["A_log"], p["dt_bias"],
                         p["lower_bound"], initial_state=p["h0_vk"], final_state=ht, cu_seqlens=p["cu_seqlens"])
        assert rel_rms(out, ref_o) <= 1e-5 and rel_rms(ht, ref_h) <= 1e-5, name


def test_every_cpu_instruction_set_reaches_the_engine(rng):
    """flashkda._internal.launch(cpu_isa=...) picks the CPU engine's build (1 baseline ISA, 2 AVX2 +
    FMA, 3 AVX-512, capped at the processor's): each matches the reference, and a request above what
    the processor has runs the widest it has, with the same bits."""
    from flashkda import _internal

    widest = _internal.cpu_engine_isa()
    assert widest in (1, 2, 3) and _internal.cpu_engine_isa(1) == 1
    assert [_internal.cpu_engine_isa(i) for i in (1, 2, 3)] == [min(i, widest) for i in (1, 2, 3)]
    p = make_problem(rng, dtype=np.float32, lengths=[40, 3, 17], state=True)
    ref_o, ref_h = reference(p)
    results = {}
    for isa in (1, 2, 3):
        out = fwd_args(p, np.float32)
        ht = np.full(p["h0_vk"].shape, np.nan, dtype=np.float32)
        with _internal.launch(cpu_isa=isa):
            flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25, out, p["A_log"], p["dt_bias"],
                         p["lower_bound"], initial_state=p["h0_vk"], final_state=ht, cu_seqlens=p["cu_seqlens"])
        assert rel_rms(out, ref_o) <= 1e-5 and rel_rms(ht, ref_h) <= 1e-5, isa
        results[_internal.cpu_engine_isa(isa)] = results.get(_internal.cpu_engine_isa(isa), []) + [(out, ht)]
    for runs in results.values():  # the same build asked for twice (capped): the same bits
        for out, ht in runs[1:]:
            np.testing.assert_array_equal(out, runs[0][0])
            np.testing.assert_array_equal(ht, runs[0][1])
