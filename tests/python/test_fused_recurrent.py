"""flashkda.fused_recurrent_kda on numpy arrays: decode steps on a state pool (docs/SPEC.md §5) against the
independent fp64 reference; untouched slots stay bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GATES, gate_kwargs, make_problem
from kda_reference import kda_decode, kda_forward, rel_rms

import flashkda

H, K, V = 2, 64, 32


def decode_ref(p, pool_vk, idx=None, acc=None):
    return kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, idx, acc, l2norm=True, beta_logit=True,
                      cu_seqlens=p["cu_seqlens"], **p.ref_kwargs())


def call(p, **kw):
    kw = {**gate_kwargs(p), **kw}
    return flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True, cu_seqlens=p["cu_seqlens"], **kw)


def random_pool(rng, P, dtype=np.float32):
    return (0.1 * rng.standard_normal((P, H, V, K))).astype(dtype)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("state_v_first", [True, False])
def test_one_token_with_pool_and_padding(rng, decode_ready, gate, state_v_first):
    N, P = 5, 9
    p = make_problem(rng, B=N, T=1, H=H, K=K, V=V, gate=gate)
    pool_vk = random_pool(rng, P)
    idx = np.array([7, -1, 0, 3, 8], np.int32)  # -1: a padding entry
    pool = pool_vk.copy() if state_v_first else np.ascontiguousarray(np.swapaxes(pool_vk, -1, -2))
    before = pool.copy()
    o, ht = call(p, initial_state=pool, ssm_state_indices=idx, state_v_first=state_v_first)
    assert ht is pool
    ref_o, ref_pool = decode_ref(p, pool_vk, idx)
    got_vk = pool if state_v_first else np.swapaxes(pool, -1, -2)
    assert rel_rms(o, ref_o) <= 1e-5
    assert rel_rms(got_vk[[7, 0, 3, 8]], ref_pool[[7, 0, 3, 8]]) <= 1e-5
    untouched = [1, 2, 4, 5, 6]
    np.testing.assert_array_equal(pool[untouched], before[untouched])
    np.testing.assert_array_equal(o[1], 0)  # padding entry: output zero


def test_multi_token_without_indices_not_in_place(rng, decode_ready):
    N, T = 3, 4
    p = make_problem(rng, B=N, T=T, H=H, K=K, V=V, gate="lower_bound")
    h0_vk = random_pool(rng, N)
    h0_kv = np.ascontiguousarray(np.swapaxes(h0_vk, -1, -2))
    keep = h0_kv.copy()
    o, ht = call(p, initial_state=h0_kv, output_final_state=True, inplace_final_state=False)
    np.testing.assert_array_equal(h0_kv, keep)  # only read
    assert ht.shape == (N, H, K, V) and ht.dtype == np.float32
    ref_o, ref_h = decode_ref(p, h0_vk)
    assert rel_rms(o, ref_o) <= 1e-5
    assert rel_rms(np.swapaxes(ht, -1, -2), ref_h) <= 1e-5
    _, none = call(p, initial_state=h0_kv, output_final_state=False, inplace_final_state=False)
    assert none is None


def test_grouped_value_heads_repeat_q_and_k(rng, decode_ready):
    """fla's GVA in decode: q and k with one head, v, g, beta and the pool with two; both value heads
    read the one q and k head: the result of q and k repeated, bit for bit, and the reference's."""
    N, T = 3, 2
    p = make_problem(rng, B=N, T=T, H=H, K=K, V=V, gate="lower_bound")
    q1, k1 = p["q"][:, :, :1].copy(), p["k"][:, :, :1].copy()
    p["q"], p["k"] = np.repeat(q1, H, axis=2), np.repeat(k1, H, axis=2)
    pool = random_pool(rng, N + 2)
    idx = np.array([4, 0, 2], np.int32)
    pool_rep = pool.copy()
    o_rep, _ = call(p, initial_state=pool_rep, ssm_state_indices=idx, state_v_first=True)
    ref_o, ref_h = decode_ref(p, pool, idx)
    assert rel_rms(o_rep, ref_o) <= 1e-5
    p["q"], p["k"] = q1, k1
    o, _ = call(p, initial_state=pool, ssm_state_indices=idx, state_v_first=True)
    np.testing.assert_array_equal(o, o_rep)
    np.testing.assert_array_equal(pool, pool_rep)


def test_zero_initial_state_in_place_default(rng, decode_ready):
    p = make_problem(rng, B=2, T=3, H=H, K=K, V=V, gate="softplus")
    o, ht = call(p, output_final_state=True, state_v_first=True)
    ref_o, ref_h = decode_ref(p, np.zeros((2, H, V, K)))
    assert rel_rms(o, ref_o) <= 1e-5 and rel_rms(ht, ref_h) <= 1e-5


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
def test_varlen_decode(rng, decode_ready, cu_dtype):
    lengths = [1, 16, 3, 2]
    p = make_problem(rng, lengths=lengths, H=H, K=K, V=V, cu_dtype=cu_dtype)
    pool_vk = random_pool(rng, 6)
    idx = np.array([5, 0, 2, 4], np.int32)
    pool = pool_vk.copy()
    o, _ = call(p, initial_state=pool, ssm_state_indices=idx, state_v_first=True)
    ref_o, ref_pool = decode_ref(p, pool_vk, idx)
    assert rel_rms(o, ref_o) <= 1e-5
    assert rel_rms(pool, ref_pool) <= 1e-5
    np.testing.assert_array_equal(pool[[1, 3]], pool_vk[[1, 3]])


def test_speculative_decode(rng, decode_ready):
    N, T, P = 3, 4, 16
    p = make_problem(rng, B=N, T=T, H=H, K=K, V=V, gate="lower_bound")
    pool_vk = random_pool(rng, P)
    idx = np.array([[0, 1, 2, 3], [4, 5, -1, 6], [8, 9, 10, 11]], np.int32)
    acc = np.array([1, 2, 4], np.int32)
    pool = pool_vk.copy()
    o, _ = call(p, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc, state_v_first=True)
    ref_o, ref_pool = decode_ref(p, pool_vk, idx, acc)
    assert rel_rms(o, ref_o) <= 1e-5
    written = [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
    assert rel_rms(pool[written], ref_pool[written]) <= 1e-5
    np.testing.assert_array_equal(pool[[7, 12, 13, 14, 15]], pool_vk[[7, 12, 13, 14, 15]])


def test_bf16_inputs_and_state(rng, decode_ready, need_bf16):
    p = make_problem(rng, B=4, T=2, H=H, K=K, V=V, dtype=need_bf16, gate="lower_bound")
    pool_vk = random_pool(rng, 4, need_bf16)
    pool = pool_vk.copy()
    o, _ = call(p, initial_state=pool, state_v_first=True, inplace_final_state=True)
    ref_o, ref_pool = decode_ref(p, pool_vk)
    assert o.dtype == need_bf16
    assert rel_rms(o, ref_o) <= 5e-3
    assert rel_rms(pool, ref_pool) <= 5e-3


def test_out_buffer_is_written_in_place(rng, decode_ready):
    p = make_problem(rng, B=2, T=1, H=H, K=K, V=V)
    out = np.full(p["v"].shape, np.nan, np.float32)
    o, _ = call(p, out=out)
    assert o is out and np.isfinite(out).all()
    ref_o, _ = decode_ref(p, np.zeros((2, H, V, K)))
    assert rel_rms(out, ref_o) <= 1e-5


def test_long_sequences_run_the_chunked_forward(rng):
    # T > 16 is no decode step; the same recurrence comes from the chunked forward
    p = make_problem(rng, B=2, T=40, H=H, K=K, V=V, gate="lower_bound")
    h0_vk = random_pool(rng, 2)
    pool = h0_vk.copy()
    o, ht = call(p, initial_state=pool, state_v_first=True, output_final_state=True, inplace_final_state=True)
    assert ht is pool
    ref_o, ref_h = kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=True, beta_logit=True,
                               initial_state=h0_vk, **p.ref_kwargs())
    assert rel_rms(o, ref_o) <= 1e-5 and rel_rms(pool, ref_h) <= 1e-5


def test_varlen_with_long_or_empty_sequences_runs_the_chunked_forward(rng):
    p = make_problem(rng, lengths=[30, 0, 5], H=H, K=K, V=V)
    o, ht = call(p, output_final_state=True, inplace_final_state=False)
    ref_o, ref_h = kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=True, beta_logit=True,
                               cu_seqlens=p["cu_seqlens"], **p.ref_kwargs())
    assert rel_rms(o, ref_o) <= 1e-5 and rel_rms(np.swapaxes(ht, -1, -2), ref_h) <= 1e-5


def test_argument_errors(rng):
    p = make_problem(rng, B=2, T=1, H=H, K=K, V=V)
    idx = np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match="initial_state: the state pool is required"):
        call(p, ssm_state_indices=idx)
    with pytest.raises(ValueError, match="inplace_final_state"):
        call(p, initial_state=random_pool(rng, 2), state_v_first=True, ssm_state_indices=idx,
             inplace_final_state=False)
    with pytest.raises(ValueError, match="num_accepted_tokens: needs ssm_state_indices"):
        call(p, num_accepted_tokens=np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match=r"ssm_state_indices: expected an int32 or int64 array \[N\]"):
        call(p, initial_state=random_pool(rng, 2), state_v_first=True, ssm_state_indices=np.array([0], np.int32))
    with pytest.raises(ValueError, match="initial_state: expected a state pool"):
        call(p, initial_state=random_pool(rng, 1), state_v_first=True, inplace_final_state=True)
    with pytest.raises(ValueError, match="initial_state: expected shape"):
        call(p, initial_state=random_pool(rng, 1), state_v_first=True)  # fla's call: one state per sequence
    with pytest.raises(ValueError, match=r"out: expected shape"):
        call(p, out=np.empty((2, 1, H, V + 1), np.float32))


@pytest.mark.parametrize("state_v_first", [True, False])
def test_slot_out_of_range_is_a_value_error(rng, decode_ready, state_v_first):
    p = make_problem(rng, B=2, T=1, H=H, K=K, V=V)
    pool = random_pool(rng, 3)
    pool = pool if state_v_first else np.ascontiguousarray(np.swapaxes(pool, -1, -2))
    with pytest.raises(ValueError, match=r"state_indices\[1, 0\]=3 must be < pool_size=3"):
        call(p, initial_state=pool, state_v_first=state_v_first, ssm_state_indices=np.array([0, 3], np.int32))


@pytest.mark.parametrize("state_v_first", [True, False])
def test_speculative_slot_repeated_within_a_sequence(rng, decode_ready, state_v_first):
    # one sequence stores the states after tokens 0 and 1 into one slot: the later one stays, in
    # either pool layout (the [K, V] pool through its gathered named slots)
    N, T, P = 2, 3, 8
    p = make_problem(rng, B=N, T=T, H=H, K=K, V=V, gate="lower_bound")
    pool_vk = random_pool(rng, P)
    idx = np.array([[5, 5, 6], [1, 2, 3]], np.int32)
    acc = np.array([1, 1], np.int32)
    ref_o, ref_pool = decode_ref(p, pool_vk, idx, acc)
    pool = pool_vk.copy() if state_v_first else np.ascontiguousarray(np.swapaxes(pool_vk, -1, -2))
    o, _ = call(p, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc, state_v_first=state_v_first)
    got = pool if state_v_first else np.swapaxes(pool, -1, -2)
    assert rel_rms(o, ref_o) <= 1e-5
    assert rel_rms(got[[1, 2, 3, 5, 6]], ref_pool[[1, 2, 3, 5, 6]]) <= 1e-5
    np.testing.assert_array_equal(got[[0, 4, 7]], pool_vk[[0, 4, 7]])
