"""Calls written for fla 0.6.0 and for vLLM's serving loop work unchanged (numpy, CPU backend):
fla's positional order, fla's fused_recurrent_kda semantics, pools in fla's [K, V] layout,
the serving path with long prefills, and index validation."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from conftest import make_problem, to_numpy, to_torch
from kda_reference import kda_decode, kda_forward, rel_rms

import flashkda
from flashkda import _arrays

H, K, V = 2, 32, 16
FRAMEWORKS = ["numpy"] + (["torch"] if importlib.util.find_spec("torch") is not None else [])


class Arrays:
    """Inputs in one framework (numpy arrays, or CPU torch tensors with the same values)."""

    def __init__(self, framework):
        self.torch = framework == "torch"

    def __call__(self, x):
        return to_torch(x) if self.torch and x is not None else x

    def np(self, x):
        return to_numpy(x) if self.torch else x

    def args(self, p):
        return [self(p[n]) for n in ("q", "k", "v", "g", "beta")]

    @property
    def ops(self):
        return _arrays.TorchOps if self.torch else _arrays.NumpyOps


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return Arrays(request.param)


def _ref_prefill(p, h0_vk, cu=None, neg_eigval=False):
    """The fp64 reference; neg_eigval: fla's allow_neg_eigval, beta = 2 sigmoid(raw beta)."""
    beta = p["beta"]
    if neg_eigval:
        beta = 2.0 / (1.0 + np.exp(-np.asarray(beta).astype(np.float64)))
    return kda_forward(p["q"], p["k"], p["v"], p["g"], beta, l2norm=True, beta_logit=not neg_eigval,
                       initial_state=h0_vk, cu_seqlens=cu, **p.ref_kwargs())


def test_chunk_kda_takes_fla_positional_order(rng):
    p = make_problem(rng, B=2, T=40, H=H, K=K, V=V, gate="lower_bound", state=True)
    h0_kv = np.ascontiguousarray(np.swapaxes(p["h0_vk"], -1, -2))
    # fla 0.6.0: scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    # use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
    # return_intermediate_states, state_v_first
    o, ht = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], None, h0_kv, True, True, True, True, False,
                               True, p["lower_bound"], False, False, False, A_log=p["A_log"], dt_bias=p["dt_bias"])
    ref_o, ref_h = _ref_prefill(p, p["h0_vk"])
    assert rel_rms(o, ref_o) <= 1e-5
    assert rel_rms(np.swapaxes(ht, -1, -2), ref_h) <= 1e-5
    # allow_neg_eigval (the seventh): beta = 2 sigmoid(raw beta), which fla requires as a logit
    o2, _ = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], None, h0_kv, False, True, True, True, True,
                               True, p["lower_bound"], A_log=p["A_log"], dt_bias=p["dt_bias"])
    assert rel_rms(o2, _ref_prefill(p, p["h0_vk"], neg_eigval=True)[0]) <= 1e-5
    assert rel_rms(o2, o) > 1e-2  # the doubled beta changes the result
    with pytest.raises(ValueError, match="use_beta_sigmoid_in_kernel"):
        flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], None, None, False, True, True, False, True)
    with pytest.raises(NotImplementedError, match="cp_context"):
        flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], cp_context=object())
    # accepted and without effect here
    flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], disable_recompute=True, use_graph=True,
                       max_num_seqs=4, cu_seqlens_cpu=None, chunk_size=64)


def test_fused_recurrent_kda_takes_fla_positional_order(rng):
    p = make_problem(rng, B=2, T=3, H=H, K=K, V=V, gate="lower_bound", state=True)
    h0_kv = np.ascontiguousarray(np.swapaxes(p["h0_vk"], -1, -2))
    # fla 0.6.0: A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    # use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound
    o, ht = flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], None,
                                         h0_kv, True, True, True, True, False, p["lower_bound"])
    ref_o, ref_h = _ref_prefill(p, p["h0_vk"])
    assert rel_rms(o, ref_o) <= 1e-5 and rel_rms(np.swapaxes(ht, -1, -2), ref_h) <= 1e-5
    # allow_neg_eigval (the ninth): beta = 2 sigmoid(raw beta)
    o2, ht2 = flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], None,
                                           h0_kv, True, True, True, True, True, p["lower_bound"])
    ref_o2, ref_h2 = _ref_prefill(p, p["h0_vk"], neg_eigval=True)
    assert rel_rms(o2, ref_o2) <= 1e-5 and rel_rms(np.swapaxes(ht2, -1, -2), ref_h2) <= 1e-5
    with pytest.raises(ValueError, match="use_beta_sigmoid_in_kernel"):
        flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], None, h0_kv,
                                     True, True, True, False, True, p["lower_bound"])
    # chunk_size means nothing to fla's fused_recurrent_kda, which ignores it whatever its value; so here
    o3, _ = flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], None,
                                         h0_kv, True, True, True, True, False, p["lower_bound"], chunk_size=128)
    np.testing.assert_array_equal(o3, o)
    with pytest.raises(ValueError, match="chunk_size"):  # chunk_kda's takes 16, 32 or 64 (fla's: 32 or 64)
        flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], chunk_size=128)


def test_fused_recurrent_kda_never_writes_initial_state_by_default(rng):
    p = make_problem(rng, B=2, T=2, H=H, K=K, V=V, gate="softplus", state=True)
    h0_kv = np.ascontiguousarray(np.swapaxes(p["h0_vk"], -1, -2))
    keep = h0_kv.copy()
    kw = dict(A_log=p["A_log"], dt_bias=p["dt_bias"], initial_state=h0_kv, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    o1, ht1 = flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], **kw)
    o2, ht2 = flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], **kw)
    assert ht1 is None and ht2 is None  # output_final_state=False
    np.testing.assert_array_equal(h0_kv, keep)
    np.testing.assert_array_equal(o1, o2)  # a repeated identical call gives the same answer


@pytest.mark.parametrize("state_v_first", [True, False])
def test_pool_in_either_layout_copies_only_the_named_slots(rng, monkeypatch, fw, state_v_first):
    N, P = 3, 40
    p = make_problem(rng, B=N, T=1, H=H, K=K, V=V, gate="precomputed")
    pool_vk = (0.1 * rng.standard_normal((P, H, V, K))).astype(np.float32)
    pool = fw(pool_vk.copy() if state_v_first else np.ascontiguousarray(np.swapaxes(pool_vk, -1, -2)))
    before = fw.np(pool).copy()
    idx = np.array([31, -1, 4], np.int32)
    largest = []
    swap = fw.ops.swap_last2
    monkeypatch.setattr(fw.ops, "swap_last2", staticmethod(lambda x: largest.append(x.shape[0]) or swap(x)))
    o, ht = flashkda.fused_recurrent_kda(*fw.args(p), initial_state=pool, use_qk_l2norm_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, state_v_first=state_v_first,
                                         ssm_state_indices=fw(idx))
    assert ht is pool
    assert max(largest, default=0) <= N  # the named slots only, never the 40-slot pool
    ref_o, ref_pool = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, idx, l2norm=True,
                                 beta_logit=True)
    o, pool = fw.np(o), fw.np(pool)
    got = pool if state_v_first else np.swapaxes(pool, -1, -2)
    assert rel_rms(o, ref_o) <= 1e-5 and rel_rms(got[[31, 4]], ref_pool[[31, 4]]) <= 1e-5
    untouched = [s for s in range(P) if s not in (31, 4)]
    np.testing.assert_array_equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("state_v_first", [True, False])
def test_serving_call_with_long_prefill_through_the_pool(rng, fw, state_v_first):
    """ssm_state_indices with T > 16: the chunked forward from and into each sequence's slot."""
    N, T, P = 3, 40, 7
    p = make_problem(rng, B=N, T=T, H=H, K=K, V=V, gate="lower_bound")
    pool_vk = (0.1 * rng.standard_normal((P, H, V, K))).astype(np.float32)
    pool = fw(pool_vk.copy() if state_v_first else np.ascontiguousarray(np.swapaxes(pool_vk, -1, -2)))
    before = fw.np(pool).copy()
    idx = np.array([5, -1, 2], np.int32)
    o, ht = flashkda.fused_recurrent_kda(*fw.args(p), fw(p["A_log"]), fw(p["dt_bias"]),
                                         initial_state=pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, lower_bound=p["lower_bound"],
                                         state_v_first=state_v_first, ssm_state_indices=fw(idx),
                                         inplace_final_state=True)
    assert ht is pool
    o, pool = fw.np(o), fw.np(pool)
    ref_o, ref_h = _ref_prefill(p, pool_vk[[5, 0, 2]])
    got = pool if state_v_first else np.swapaxes(pool, -1, -2)
    assert rel_rms(o[[0, 2]], ref_o[[0, 2]]) <= 1e-5
    assert rel_rms(got[[5, 2]], ref_h[[0, 2]]) <= 1e-5
    np.testing.assert_array_equal(o[1], 0)  # padding: output zero
    untouched = [s for s in range(P) if s not in (5, 2)]
    np.testing.assert_array_equal(pool[untouched], before[untouched])
    # varlen: one long sequence among decode-sized ones
    q = make_problem(rng, lengths=[3, 30, 1], H=H, K=K, V=V, gate="precomputed")
    pool2 = fw(pool_vk.copy())
    idx2 = np.array([6, 1, -1], np.int32)
    o2, _ = flashkda.fused_recurrent_kda(*fw.args(q), initial_state=pool2, use_qk_l2norm_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, state_v_first=True,
                                         cu_seqlens=fw(q["cu_seqlens"]), ssm_state_indices=fw(idx2))
    o2, pool2 = fw.np(o2), fw.np(pool2)
    ref_o2, ref_h2 = _ref_prefill(q, pool_vk[[6, 1, 0]], q["cu_seqlens"])
    assert rel_rms(o2[:, :33], ref_o2[:, :33]) <= 1e-5
    np.testing.assert_array_equal(o2[:, 33:], 0)
    assert rel_rms(pool2[[6, 1]], ref_h2[[0, 1]]) <= 1e-5
    np.testing.assert_array_equal(pool2[0], pool_vk[0])


def test_speculative_slots_with_long_prefill_are_refused_by_name(rng):
    p = make_problem(rng, B=2, T=20, H=H, K=K, V=V, gate="precomputed")
    pool = np.zeros((8, H, V, K), np.float32)
    with pytest.raises(ValueError, match="per-token slots"):
        flashkda.fused_recurrent_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=pool, state_v_first=True,
                                     ssm_state_indices=np.arange(40, dtype=np.int32).reshape(2, 20) % 8,
                                     num_accepted_tokens=np.array([1, 1], np.int32))


def test_pool_smaller_than_the_batch_with_padding(rng, fw):
    N, P = 4, 2
    p = make_problem(rng, B=N, T=1, H=H, K=K, V=V, gate="precomputed")
    pool_vk = (0.1 * rng.standard_normal((P, H, V, K))).astype(np.float32)
    pool = fw(pool_vk.copy())
    idx = np.array([-1, 1, -1, 0], np.int32)
    o, _ = flashkda.fused_recurrent_kda(*fw.args(p), initial_state=pool, state_v_first=True,
                                        ssm_state_indices=fw(idx), use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True)
    ref_o, ref_pool = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, idx, l2norm=True,
                                 beta_logit=True)
    assert rel_rms(fw.np(o), ref_o) <= 1e-5 and rel_rms(fw.np(pool), ref_pool) <= 1e-5


def test_int64_slots_are_validated_before_narrowing(rng, fw):
    p = make_problem(rng, B=2, T=1, H=H, K=K, V=V, gate="precomputed")
    pool = fw(np.zeros((4, H, V, K), np.float32))
    with pytest.raises(ValueError, match="must be < pool_size"):  # 2**33 + 1 does not wrap to slot 1
        flashkda.fused_recurrent_kda(*fw.args(p), initial_state=pool, state_v_first=True,
                                     ssm_state_indices=fw(np.array([1, 2**33 + 1], np.int64)))
    np.testing.assert_array_equal(fw.np(pool), 0)
    o, _ = flashkda.fused_recurrent_kda(*fw.args(p), initial_state=pool, state_v_first=True,
                                        ssm_state_indices=fw(np.array([1, -2**40], np.int64)))
    np.testing.assert_array_equal(fw.np(o)[1], 0)  # far negative: padding, as in int32


def test_first_equal_maps_each_entry_to_the_first_equal_one(rng, fw):
    """The helper behind the GPU's gathered pools (another layout than [P, H, V, K]): entries naming
    one slot get one local index, so the kernels see the repeat and refuse the call."""
    x = rng.integers(-3, 6, size=40).astype(np.int32)
    want = np.array([int(np.flatnonzero(x == v)[0]) for v in x], np.int32)
    np.testing.assert_array_equal(fw.np(fw.ops.first_equal(fw(x))), want)
    assert fw.np(fw.ops.first_equal(fw(np.zeros(0, np.int32)))).shape == (0,)


@pytest.mark.parametrize("state_v_first", [True, False])
def test_duplicate_live_slots_are_refused_in_long_steps(rng, fw, state_v_first):
    # T > 16 runs the chunked forward through the pool (the serving prefill): the same refusal
    p = make_problem(rng, B=3, T=20, H=H, K=K, V=V, gate="precomputed")
    pool = fw(np.zeros((4, H, V, K) if state_v_first else (4, H, K, V), np.float32))
    with pytest.raises(ValueError, match=r"state_indices\[0(, 0)?\] and state_indices\[2(, 0)?\] both name slot 3"):
        flashkda.fused_recurrent_kda(*fw.args(p), initial_state=pool, state_v_first=state_v_first,
                                     ssm_state_indices=fw(np.array([3, -1, 3], np.int32)))
    np.testing.assert_array_equal(fw.np(pool), 0)


@pytest.mark.parametrize("check_slots", [True, False])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_duplicate_live_slots_are_refused_naming_both(rng, fw, state_v_first, check_slots):
    # state_v_first=False (fla's [K, V] pool) runs on a gathered copy of the named slots, whose
    # indices alone no longer show the caller's slots: the same check, on the caller's indices.
    # check_slots=False leaves out only the GPU's device-side check: the CPU still refuses.
    p = make_problem(rng, B=3, T=1, H=H, K=K, V=V, gate="precomputed")
    pool = fw(np.zeros((4, H, V, K) if state_v_first else (4, H, K, V), np.float32))
    with pytest.raises(ValueError, match=r"state_indices\[0, 0\] and state_indices\[2, 0\] both name slot 3"):
        flashkda.fused_recurrent_kda(*fw.args(p), initial_state=pool, state_v_first=state_v_first,
                                     ssm_state_indices=fw(np.array([3, -1, 3], np.int32)), check_slots=check_slots)
    np.testing.assert_array_equal(fw.np(pool), 0)
    # padding entries may repeat
    flashkda.fused_recurrent_kda(*fw.args(p), initial_state=pool, state_v_first=state_v_first,
                                 ssm_state_indices=fw(np.array([-1, 2, -1], np.int32)))
