"""flashkda.chunk_kda on numpy arrays (CPU backend) against the independent fp64 reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import GATES, gate_kwargs, make_problem
from kda_reference import kda_forward, rel_rms

import flashkda

# rel-RMS bounds (output, final state): fp32 inputs; bf16 inputs (the bf16 output rounding dominates,
# the fp32 state stays close to the fp64 one).
TOL = {np.float32: (1e-5, 1e-5), "bf16": (5e-3, 1e-4)}


def run_chunk(p, *, l2norm=True, beta_logit=True, scale=None, state_v_first=False, **extra):
    h0 = p.get("h0_vk")
    if h0 is not None and not state_v_first:
        h0 = np.ascontiguousarray(np.swapaxes(h0, -1, -2))
    kw = gate_kwargs(p)
    kw.update(extra)
    return flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], scale=scale, initial_state=h0,
                              output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                              use_beta_sigmoid_in_kernel=beta_logit, state_v_first=state_v_first,
                              cu_seqlens=p["cu_seqlens"], **kw)


def run_ref(p, *, l2norm=True, beta_logit=True, scale=None):
    return kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=l2norm, beta_logit=beta_logit,
                       scale=scale, initial_state=p.get("h0_vk"), cu_seqlens=p["cu_seqlens"], **p.ref_kwargs())


def check(p, o, ht_vk, tol, **flags):
    tol_o, tol_h = tol if isinstance(tol, tuple) else (tol, tol)
    ref_o, ref_h = run_ref(p, **flags)
    assert o.dtype == p["q"].dtype
    assert rel_rms(o, ref_o) <= tol_o, f"output rel-RMS {rel_rms(o, ref_o):.2e} > {tol_o}"
    assert rel_rms(ht_vk, ref_h) <= tol_h, f"final state rel-RMS {rel_rms(ht_vk, ref_h):.2e} > {tol_h}"


@pytest.mark.parametrize("gate", GATES)
def test_every_gate_form_fp32(rng, gate):
    p = make_problem(rng, gate=gate, state=True)
    o, ht = run_chunk(p)
    check(p, o, np.swapaxes(ht, -1, -2), TOL[np.float32])


@pytest.mark.parametrize("gate", GATES)
def test_every_gate_form_bf16(rng, need_bf16, gate):
    p = make_problem(rng, gate=gate, state=True, dtype=need_bf16)
    o, ht = run_chunk(p)
    assert ht.dtype == np.float32
    check(p, o, np.swapaxes(ht, -1, -2), TOL["bf16"])


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("beta_logit", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_flags(rng, l2norm, beta_logit, scale):
    p = make_problem(rng, gate="lower_bound", state=True)
    if not l2norm:  # keep unnormalised keys in the stable range of the delta rule
        p["k"] = (p["k"] / np.sqrt(p["k"].shape[-1])).astype(np.float32)
        p["q"] = (p["q"] / np.sqrt(p["q"].shape[-1])).astype(np.float32)
    if not beta_logit:
        p["beta"] = rng.random(p["beta"].shape).astype(np.float32)
    flags = dict(l2norm=l2norm, beta_logit=beta_logit, scale=scale)
    o, ht = run_chunk(p, **flags)
    check(p, o, np.swapaxes(ht, -1, -2), TOL[np.float32], **flags)


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
def test_varlen_with_initial_state(rng, cu_dtype):
    p = make_problem(rng, lengths=[17, 0, 40, 1, 16], state=True, cu_dtype=cu_dtype)
    o, ht = run_chunk(p)
    check(p, o, np.swapaxes(ht, -1, -2), TOL[np.float32])
    # a zero-length sequence passes its initial state through
    np.testing.assert_allclose(np.swapaxes(ht[1], -1, -2), p["h0_vk"][1], rtol=0, atol=0)


def test_varlen_as_python_list(rng):
    p = make_problem(rng, lengths=[5, 20], state=False)
    o1, h1 = run_chunk(p)
    o2, h2 = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                cu_seqlens=[int(c) for c in p["cu_seqlens"]], **gate_kwargs(p))
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(h1, h2)


def test_batched_matches_varlen(rng):
    p = make_problem(rng, B=3, T=21, state=True)
    o, ht = run_chunk(p)
    check(p, o, np.swapaxes(ht, -1, -2), TOL[np.float32])
    flat = {n: p[n].reshape((1, -1) + p[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}
    pv = type(p)(p, **flat, cu_seqlens=np.array([0, 21, 42, 63], np.int64))
    ov, htv = run_chunk(pv)
    np.testing.assert_allclose(ov.reshape(o.shape), o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(htv, ht, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_state_layouts(rng, need_bf16, state_dtype):
    sd = np.float32 if state_dtype == "f32" else need_bf16
    p = make_problem(rng, lengths=[30, 9], state=True, state_dtype=sd, K=32, V=48)
    o_kv, ht_kv = run_chunk(p, state_v_first=False)
    o_vk, ht_vk = run_chunk(p, state_v_first=True)
    assert ht_kv.shape == (2, 2, 32, 48) and ht_vk.shape == (2, 2, 48, 32)
    np.testing.assert_array_equal(o_kv, o_vk)
    np.testing.assert_array_equal(np.swapaxes(ht_kv, -1, -2), ht_vk)
    check(p, o_vk, ht_vk, TOL[np.float32] if state_dtype == "f32" else 1e-4)


def test_without_final_state_and_without_initial_state(rng):
    p = make_problem(rng)
    o, ht = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], use_qk_l2norm_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, **gate_kwargs(p))
    assert ht is None
    ref_o, _ = run_ref(p)
    assert rel_rms(o, ref_o) <= TOL[np.float32][0]


def test_strongly_negative_precomputed_gate(rng):
    p = make_problem(rng, gate="precomputed", T=48, state=True)
    a = -rng.random(p["g"].shape) * 5.0
    a[:, ::7] = -1000.0  # whole tokens that wipe the state
    p["g"] = a.astype(np.float32)
    o, ht = run_chunk(p)
    # The state after a wipe is built from a few tokens, so fp32 rounding shows a little more here
    # (measured 1.2e-5 on the CPU backend).
    check(p, o, np.swapaxes(ht, -1, -2), 5e-5)


def test_lower_bound_gate_without_A_log(rng):
    p = make_problem(rng, gate="lower_bound")
    kw = gate_kwargs(p)
    kw["A_log"] = None
    o, ht = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **kw)
    p["A_log"] = np.zeros_like(p["A_log"])  # fla: lower_bound * sigmoid(g + dt_bias)
    check(p, o, np.swapaxes(ht, -1, -2), TOL[np.float32])


def test_safe_gate_with_lower_bound(rng):
    p = make_problem(rng, gate="lower_bound")
    o1, _ = run_chunk(p)
    o2, _ = run_chunk(p, safe_gate=True)
    np.testing.assert_array_equal(o1, o2)


def test_dt_bias_flat_or_2d(rng):
    p = make_problem(rng, gate="softplus")
    o1, h1 = run_chunk(p)
    p["dt_bias"] = p["dt_bias"].reshape(-1)
    o2, h2 = run_chunk(p)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(h1, h2)


def test_mixed_input_dtypes(rng, need_bf16):
    p = make_problem(rng, dtype=need_bf16, g_dtype=np.float32, beta_dtype=np.float32, state=True)
    o, ht = run_chunk(p)
    assert o.dtype == need_bf16
    check(p, o, np.swapaxes(ht, -1, -2), TOL["bf16"])


def test_non_contiguous_inputs_are_accepted(rng):
    p = make_problem(rng, state=True)
    o, ht = run_chunk(p)
    for name in ("q", "k", "v", "g"):
        p[name] = np.asfortranarray(p[name])
    p["h0_vk"] = np.swapaxes(np.ascontiguousarray(np.swapaxes(p["h0_vk"], -1, -2)), -1, -2)
    o2, ht2 = run_chunk(p, state_v_first=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(ht, np.swapaxes(ht2, -1, -2))


def test_inputs_are_not_modified(rng):
    p = make_problem(rng, state=True)
    before = {n: p[n].copy() for n in ("q", "k", "v", "g", "beta", "h0_vk")}
    run_chunk(p, state_v_first=True)
    for n, x in before.items():
        np.testing.assert_array_equal(p[n], x)


# ---- fla keyword arguments -----------------------------------------------------------------------


def test_grouped_value_heads_repeat_q_and_k(rng):
    """fla's GVA: q and k with H heads, v, g, beta, the gate's parameters and the states with HV = 2H;
    value head hv reads q and k head hv // 2. The result of q and k repeated head by head, bit for bit,
    and the reference's; varlen with a state."""
    p = make_problem(rng, H=4, gate="softplus", state=True, lengths=[17, 20])
    q2, k2 = p["q"][:, :, ::2].copy(), p["k"][:, :, ::2].copy()
    p["q"], p["k"] = np.repeat(q2, 2, axis=2), np.repeat(k2, 2, axis=2)
    o_rep, ht_rep = run_chunk(p)
    check(p, o_rep, np.swapaxes(ht_rep, -1, -2), 1e-5)
    p["q"], p["k"] = q2, k2
    o, ht = run_chunk(p)
    np.testing.assert_array_equal(o, o_rep)
    np.testing.assert_array_equal(ht, ht_rep)


def test_fla_options_without_effect_are_accepted(rng):
    p = make_problem(rng)
    o1, _ = run_chunk(p)
    o2, _ = run_chunk(p, disable_recompute=True, use_graph=False, chunk_size=32, cu_seqlens_cpu=None,
                      allow_neg_eigval=False, return_intermediate_states=False, cp_context=None)
    np.testing.assert_array_equal(o1, o2)


def test_unsupported_fla_options_raise(rng):
    p = make_problem(rng)
    with pytest.raises(NotImplementedError, match="cp_context"):
        run_chunk(p, cp_context=object())


def test_unknown_keyword_raises(rng):
    p = make_problem(rng)
    with pytest.raises(TypeError, match="use_qk_l2_norm"):
        run_chunk(p, use_qk_l2_norm=True)


def test_transpose_state_layout_is_a_deprecated_alias(rng):
    p = make_problem(rng, state=True)
    o1, h1 = run_chunk(p, state_v_first=True)
    h0 = p["h0_vk"]
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o2, h2 = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=h0,
                                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, transpose_state_layout=True, **gate_kwargs(p))
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(h1, h2)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="both"):
        warnings.simplefilter("ignore")
        run_chunk(p, state_v_first=True, transpose_state_layout=True)
