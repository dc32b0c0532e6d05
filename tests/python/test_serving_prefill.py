"""Serving prefill through the Python API (docs/SPEC.md §9): chunk_kda / fwd against a state pool
(both layouts, fp32 and bf16 pools, padding, has_initial_state), checkpoints (dense and into pool
slots), fla's return_intermediate_states, the fp64 reference's pool and checkpoints, and the GPU's
gather -> prefill -> scatter path. numpy and CPU torch; the GPU cases skip without a Hopper GPU."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from conftest import BF16, gate_kwargs, make_problem, to_numpy, to_torch
from kda_reference import kda_forward, rel_rms

import flashkda

H, K, V = 2, 32, 16
HAS_TORCH = importlib.util.find_spec("torch") is not None
FRAMEWORKS = ["numpy"] + (["torch"] if HAS_TORCH else [])
LENGTHS = [70, 0, 130, 64, 33]  # with the padding entry below: sequence 3
PADDING = 3


def _fw(framework, x):
    return to_torch(x) if framework == "torch" and x is not None else x


def _np(x):
    return to_numpy(x) if not isinstance(x, np.ndarray) else x


def _problem(rng, lengths=LENGTHS):
    return make_problem(rng, H=H, K=K, V=V, gate="lower_bound", lengths=lengths)


def _pool(rng, P, v_first, dtype=np.float32):
    shape = (P, H, V, K) if v_first else (P, H, K, V)
    pool = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return pool.astype(dtype) if dtype is not np.float32 else pool


def _slots(rng, N, P, padding=PADDING):
    slots = rng.permutation(P)[:N].astype(np.int32)
    slots[padding] = -1
    return slots


def _call(fw, p, **kw):
    return flashkda.chunk_kda(*[_fw(fw, p[n]) for n in ("q", "k", "v", "g", "beta")],
                              cu_seqlens=_fw(fw, p["cu_seqlens"]), use_qk_l2norm_in_kernel=True,
                              use_beta_sigmoid_in_kernel=True, **gate_kwargs(p, {n: _fw(fw, p[n]) for n in
                                                                                 ("A_log", "dt_bias")}), **kw)


def _to_vk(x, v_first):
    return x if v_first else np.swapaxes(x, -1, -2)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("v_first", [True, False])
@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16"])
def test_pool_prefill_equals_gather_prefill_scatter(rng, fw, v_first, pool_dtype):
    if pool_dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes not installed")
    p = _problem(rng)
    N, P = p["N"], 8
    pool = _pool(rng, P, v_first, BF16 if pool_dtype == "bfloat16" else np.float32)
    before = pool.copy()
    slots = _slots(rng, N, P)
    has = np.array([n % 2 == 0 for n in range(N)])
    user_pool = _fw(fw, pool)
    o, second = _call(fw, p, state_pool=user_pool, state_indices=_fw(fw, slots), has_initial_state=has,
                      state_v_first=v_first)
    assert second is user_pool
    o, after = _np(o), _np(user_pool).astype(np.float32)

    # The plain prefill from the gathered states, its final state rounded to the pool's dtype.
    h0 = np.stack([before[s].astype(np.float32) if s >= 0 and has[n] else np.zeros(before.shape[1:], np.float32)
                   for n, s in enumerate(slots)])
    o_ref, ht = _call(fw, p, initial_state=_fw(fw, h0.astype(pool.dtype)), output_final_state=True,
                      state_v_first=v_first)
    o_ref, ht = _np(o_ref), _np(ht).astype(pool.dtype).astype(np.float32)
    cu = p["cu_seqlens"]
    for n, s in enumerate(slots):
        rows = slice(cu[n], cu[n + 1])
        if s < 0:
            assert not o[0, rows].any(), "padding output rows are zero"
            continue
        np.testing.assert_array_equal(o[0, rows], o_ref[0, rows])
        np.testing.assert_array_equal(after[s], ht[n])
    for s in set(range(P)) - set(slots.tolist()):
        np.testing.assert_array_equal(after[s], before[s].astype(np.float32), err_msg=f"slot {s} not named")


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("v_first", [True, False])
def test_checkpoints_match_the_reference_and_cut_prefills(rng, fw, v_first):
    p = _problem(rng, [200, 64, 0, 130, 63])
    N, P = p["N"], 8
    pool = _pool(rng, P, v_first)
    before = pool.copy()
    slots = _slots(rng, N, P, padding=4)
    lengths = np.diff(p["cu_seqlens"])
    count = flashkda.checkpoint_count(lengths, 64)
    assert count == 3 + 1 + 0 + 2 + 0
    ck = np.full((count,) + pool.shape[1:], np.nan, np.float32)
    ck_fw = _fw(fw, ck)
    _call(fw, p, state_pool=_fw(fw, pool), state_indices=_fw(fw, slots), checkpoint_every=64, checkpoints=ck_fw,
          state_v_first=v_first)
    ck = _to_vk(_np(ck_fw), v_first)

    # The reference on the same pool, and the same sequences cut at each checkpoint.
    _, _, ref_ck = flashkda.reference_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=p["A_log"],
                                              dt_bias=p["dt_bias"], lower_bound=p["lower_bound"],
                                              cu_seqlens=p["cu_seqlens"], state_pool=_to_vk(before, v_first),
                                              state_indices=slots, checkpoint_every=64)
    assert rel_rms(ck, ref_ck) <= 1e-5
    i, cu = 0, p["cu_seqlens"]
    for n in range(N):
        for j in range(lengths[n] // 64):
            end = cu[n] + 64 * (j + 1)
            cut = {name: p[name][:, cu[n]:end] for name in ("q", "k", "v", "g", "beta")}
            cut.update({name: p[name] for name in ("A_log", "dt_bias", "lower_bound", "gate")})
            h0 = _to_vk(before[slots[n]], v_first)[None].copy()
            ref_o, ref_h = kda_forward(cut["q"], cut["k"], cut["v"], cut["g"], cut["beta"], l2norm=True,
                                       beta_logit=True, initial_state=h0, gate="lower_bound", A_log=p["A_log"],
                                       dt_bias=p["dt_bias"], lower_bound=p["lower_bound"])
            if slots[n] >= 0:
                assert rel_rms(ck[i], ref_h[0]) <= 1e-5, f"checkpoint {i}"
            else:
                assert not ck[i].any(), "a padding sequence's checkpoints are zero"
            i += 1
    assert i == count


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_checkpoints_into_pool_slots(rng, fw):
    """fla's [K, V] pool layout: the named slots are gathered, the call runs, and they go back."""
    p = _problem(rng, [130, 64])
    N, P = 2, 7
    pool = _pool(rng, P, False)
    before = pool.copy()
    slots = np.array([5, 1], np.int32)
    ck_slots = np.array([2, -1, 6], np.int32)  # sequence 0's checkpoints at 64 and 128, then sequence 1's at 64
    user_pool = _fw(fw, pool)
    _call(fw, p, state_pool=user_pool, state_indices=_fw(fw, slots), checkpoint_every=64,
          checkpoint_slots=_fw(fw, ck_slots))
    after = _np(user_pool)
    # The same call with dense checkpoints, from the same pool.
    dense = _fw(fw, np.zeros((3, H, K, V), np.float32))
    _call(fw, p, state_pool=_fw(fw, before.copy()), state_indices=_fw(fw, slots), checkpoint_every=64,
          checkpoints=dense)
    dense = _np(dense)
    np.testing.assert_array_equal(after[2], dense[0])
    np.testing.assert_array_equal(after[6], dense[2])
    for s in (0, 3, 4):
        np.testing.assert_array_equal(after[s], before[s])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("v_first", [True, False])
def test_slot_errors_name_the_argument(rng, fw, v_first):
    p = _problem(rng, [64, 64, 20])
    pool = _fw(fw, _pool(rng, 4, v_first))
    with pytest.raises(ValueError, match=r"state_indices\[0\] and state_indices\[2\] both name slot 1"):
        _call(fw, p, state_pool=pool, state_indices=_fw(fw, np.array([1, 0, 1], np.int32)), state_v_first=v_first)
    with pytest.raises(ValueError, match=r"state_indices\[1\]=4 must be < pool_size=4"):
        _call(fw, p, state_pool=pool, state_indices=_fw(fw, np.array([1, 4, 0], np.int32)), state_v_first=v_first)
    with pytest.raises(ValueError, match=r"state_indices\[0\] and checkpoint_slots\[1\] both name slot 2"):
        _call(fw, p, state_pool=pool, state_indices=_fw(fw, np.array([2, 0, 1], np.int32)), checkpoint_every=64,
              checkpoint_slots=_fw(fw, np.array([3, 2], np.int32)), state_v_first=v_first)
    with pytest.raises(ValueError, match="multiple of 64"):
        _call(fw, p, state_pool=pool, state_indices=_fw(fw, np.array([2, 0, 1], np.int32)), checkpoint_every=32,
              checkpoint_slots=_fw(fw, np.array([3, -1], np.int32)), state_v_first=v_first)
    with pytest.raises(ValueError, match="initial_state"):
        _call(fw, p, state_pool=pool, state_indices=_fw(fw, np.array([2, 0, 1], np.int32)),
              initial_state=_fw(fw, np.zeros((3, H, K, V), np.float32)), state_v_first=v_first)
    with pytest.raises(ValueError, match="state_indices"):
        _call(fw, p, state_pool=pool, state_v_first=v_first)
    with pytest.raises(ValueError, match=r"state_indices: expected .*\[N\]"):
        _call(fw, p, state_pool=pool, state_indices=_fw(fw, np.array([[2], [0], [1]], np.int32)),
              state_v_first=v_first)
    with pytest.raises(ValueError, match=r"checkpoint_slots: expected a 1-d array"):
        _call(fw, p, state_pool=pool, state_indices=_fw(fw, np.array([2, 0, 1], np.int32)), checkpoint_every=64,
              checkpoint_slots=_fw(fw, np.array([[3], [-1]], np.int32)), state_v_first=v_first)
    with pytest.raises(ValueError, match="num_checkpoints must be 2"):
        _call(fw, p, checkpoint_every=64, checkpoints=_fw(fw, np.zeros((3, H, K, V), np.float32)))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("v_first", [True, False])
@pytest.mark.parametrize("varlen", [True, False])
def test_return_intermediate_states_is_flas(rng, fw, v_first, varlen):
    """fla's h: the state at the start of every 64-token chunk (the initial state first), in k's
    dtype, [B, NT, H, K, V] or [1, sum NT, H, K, V] with cu_seqlens."""
    lengths = [130, 64, 0, 65] if varlen else None
    p = make_problem(rng, B=1 if varlen else 2, T=150, H=H, K=K, V=V, gate="lower_bound", lengths=lengths)
    N = p["N"]
    h0_vk = (0.1 * rng.standard_normal((N, H, V, K))).astype(np.float32)
    h0 = h0_vk if v_first else np.ascontiguousarray(np.swapaxes(h0_vk, -1, -2))
    o, ht, h = _call(fw, p, initial_state=_fw(fw, h0), output_final_state=True, return_intermediate_states=True,
                     state_v_first=v_first)
    o2, ht2 = _call(fw, p, initial_state=_fw(fw, h0), output_final_state=True, state_v_first=v_first)
    np.testing.assert_array_equal(_np(o), _np(o2))
    np.testing.assert_array_equal(_np(ht), _np(ht2))
    h = _np(h)
    seq_lens = lengths if varlen else [150] * N
    chunks = [-(-n // 64) for n in seq_lens]
    inner = (H, V, K) if v_first else (H, K, V)
    assert h.shape == ((1, sum(chunks)) + inner if varlen else (N, chunks[0]) + inner)
    assert h.dtype == _np(_fw(fw, p["q"])).dtype
    flat = h.reshape((-1,) + inner)
    i = 0
    for n in range(N):
        bos = 0 if not varlen else int(p["cu_seqlens"][n])
        b = 0 if varlen else n
        for j in range(chunks[n]):
            if j == 0:
                want = h0[n]
            else:
                cut = {name: p[name][b:b + 1, bos:bos + 64 * j] for name in ("q", "k", "v", "g", "beta")}
                _, ref_h = kda_forward(cut["q"], cut["k"], cut["v"], cut["g"], cut["beta"], l2norm=True,
                                       beta_logit=True, initial_state=h0_vk[n:n + 1], gate="lower_bound",
                                       A_log=p["A_log"], dt_bias=p["dt_bias"], lower_bound=p["lower_bound"])
                want = _to_vk(ref_h[0], v_first) if v_first else np.swapaxes(ref_h[0], -1, -2)
            assert rel_rms(flat[i], want) <= 1e-5, f"sequence {n}, chunk {j}"
            i += 1


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_return_intermediate_states_refuses_other_chunk_sizes(rng, fw):
    """fla spaces h by chunk_size (32 or 64); flashkda's h is every 64 tokens, so chunk_size=32 with
    return_intermediate_states is NotImplementedError, not an h of other spacing; without
    return_intermediate_states chunk_size changes nothing (the same bits)."""
    p = make_problem(rng, B=1, T=100, H=H, K=K, V=V, gate="lower_bound")
    o, ht, h = _call(fw, p, output_final_state=True, return_intermediate_states=True, chunk_size=64)
    assert h.shape[1] == 2  # ceil(100 / 64)
    with pytest.raises(NotImplementedError, match="every 64 tokens"):
        _call(fw, p, return_intermediate_states=True, chunk_size=32)
    o32, ht32 = _call(fw, p, output_final_state=True, chunk_size=32)
    np.testing.assert_array_equal(_np(o32), _np(o))
    np.testing.assert_array_equal(_np(ht32), _np(ht))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_fwd_takes_the_pool(rng, fw):
    p = _problem(rng, [40, 100])
    pool = _pool(rng, 3, True)
    before = pool.copy()
    slots = np.array([2, 0], np.int32)
    user_pool = _fw(fw, pool)
    out = _fw(fw, np.zeros_like(p["v"]))
    flashkda.fwd(*[_fw(fw, p[n]) for n in ("q", "k", "v", "g", "beta")], K ** -0.5, out, _fw(fw, p["A_log"]),
                 _fw(fw, p["dt_bias"]), p["lower_bound"], cu_seqlens=_fw(fw, p["cu_seqlens"]),
                 state_pool=user_pool, state_indices=_fw(fw, slots))
    ref_o, ref_h = kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=True, beta_logit=True,
                               initial_state=before[slots], cu_seqlens=p["cu_seqlens"], **p.ref_kwargs())
    assert rel_rms(_np(out), ref_o) <= 1e-5
    assert rel_rms(_np(user_pool)[slots], ref_h) <= 1e-5
    np.testing.assert_array_equal(_np(user_pool)[1], before[1])


def _gpu_reason():
    if not HAS_TORCH:
        return "torch not installed"
    return None if flashkda.cuda_available() else "no Hopper (sm_90) GPU with a CUDA build of flashkda"


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("v_first", [True, False])
def test_gpu_pool_prefill_matches_gathered_states(rng, v_first):
    import torch

    p = make_problem(rng, H=H, K=128, V=128, gate="lower_bound", lengths=[70, 0, 130, 64, 33], dtype=BF16)
    N, P = p["N"], 8
    pool = torch.randn((P, H, 128, 128), device="cuda") * 0.1
    before = pool.clone()
    slots = _slots(rng, N, P)
    has = torch.tensor([n % 2 == 0 for n in range(N)], device="cuda")
    t = {n: to_torch(p[n], "cuda") for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens")}
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(cu_seqlens=t["cu_seqlens"], use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=p["lower_bound"],
              state_v_first=v_first)
    idx = torch.tensor(slots, device="cuda")
    o, _ = flashkda.chunk_kda(*args, state_pool=pool, state_indices=idx, has_initial_state=has, **kw)
    h0 = torch.stack([before[s] if s >= 0 and bool(has[n]) else torch.zeros_like(before[0])
                      for n, s in enumerate(slots)])
    o_ref, ht = flashkda.chunk_kda(*args, initial_state=h0, output_final_state=True, **kw)
    torch.cuda.synchronize()
    cu = p["cu_seqlens"]
    for n, s in enumerate(slots):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        if s < 0:
            assert not o[0, rows].any()
            continue
        assert torch.equal(o[0, rows], o_ref[0, rows])
        assert torch.equal(pool[s], ht[n])
    for s in set(range(P)) - set(slots.tolist()):
        assert torch.equal(pool[s], before[s])


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("v_first", [True, False])
def test_gpu_live_slot_named_twice_gives_nan_and_leaves_the_pool(rng, v_first):
    """The GPU cannot raise without a host synchronisation: a live slot named twice (two sequences,
    or a sequence and a checkpoint) fills the outputs with NaN and writes nothing to the pool, in
    the kernels' layout and through the gathered copy of another layout alike."""
    import torch

    p = make_problem(rng, H=H, K=128, V=128, gate="lower_bound", lengths=[200, 64, 130], dtype=BF16)
    P = 6
    pool = torch.randn((P, H, 128, 128), device="cuda") * 0.1
    before = pool.clone()
    t = {n: to_torch(p[n], "cuda") for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens")}
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(cu_seqlens=t["cu_seqlens"], use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=p["lower_bound"],
              state_v_first=v_first)
    twice = torch.tensor([4, 1, 4], dtype=torch.int32, device="cuda")
    o, _ = flashkda.chunk_kda(*args, state_pool=pool, state_indices=twice, **kw)
    torch.cuda.synchronize()
    assert torch.isnan(o.float()).all()
    assert torch.equal(pool, before)
    count = flashkda.checkpoint_count([200, 64, 130], 64)
    ck_slots = torch.full((count,), -1, dtype=torch.int32, device="cuda")
    ck_slots[count - 1] = 3  # sequence 2's slot
    o, _ = flashkda.chunk_kda(*args, state_pool=pool, state_indices=torch.tensor([4, 1, 3], dtype=torch.int32,
                                                                                  device="cuda"),
                              checkpoint_every=64, checkpoint_slots=ck_slots, **kw)
    torch.cuda.synchronize()
    assert torch.isnan(o.float()).all()
    assert torch.equal(pool, before)
    # padding may repeat: negative, and past the pool
    o, _ = flashkda.chunk_kda(*args, state_pool=pool, state_indices=torch.tensor([-1, P, 2], dtype=torch.int32,
                                                                                  device="cuda"), **kw)
    torch.cuda.synchronize()
    assert not torch.isnan(o.float()).any()


CK_SLOTS = [1, -1, 2, 4, 6, 8]


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("v_first", [True, False])
def test_gpu_checkpoints_and_fla_states_match_the_cpu(rng, v_first):
    """Checkpoints on the GPU (dense and into pool slots) and fla's return_intermediate_states
    against the CPU backend's on the same inputs (both against the same recurrence: close, not
    bit-equal)."""
    import torch

    p = make_problem(rng, H=H, K=128, V=128, gate="lower_bound", lengths=[200, 0, 130, 64, 33], dtype=BF16)
    N, P = p["N"], 10
    slots = [3, 0, 7, -1, 5]
    host = {n: to_torch(p[n], "cpu") for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens")}
    dev = {n: x.cuda() for n, x in host.items()}
    pool = torch.randn((P, H, 128, 128)) * 0.1
    count = flashkda.checkpoint_count([200, 0, 130, 64, 33], 64)
    assert count == len(CK_SLOTS)  # 3 of sequence 0, 2 of sequence 2, 1 of the padding sequence 3
    results = {}
    for where, t in (("cpu", host), ("cuda", dev)):
        args = [t[n] for n in ("q", "k", "v", "g", "beta")]
        kw = dict(cu_seqlens=t["cu_seqlens"], use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=p["lower_bound"],
                  state_v_first=v_first)
        pl = pool.clone().to(where)
        idx = torch.tensor(slots, dtype=torch.int32, device=where)
        ck = torch.full((count, H, 128, 128), float("nan"), device=where)
        o, _ = flashkda.chunk_kda(*args, state_pool=pl, state_indices=idx, checkpoint_every=64, checkpoints=ck, **kw)
        pl2 = pool.clone().to(where)
        ck_slots = torch.tensor(CK_SLOTS, dtype=torch.int32, device=where)
        flashkda.chunk_kda(*args, state_pool=pl2, state_indices=idx, checkpoint_every=64, checkpoint_slots=ck_slots,
                           **kw)
        h0 = torch.stack([pool[s] if s >= 0 else torch.zeros_like(pool[0]) for s in slots]).to(where)
        _, _, h = flashkda.chunk_kda(*args, initial_state=h0, output_final_state=True,
                                     return_intermediate_states=True, **kw)
        results[where] = [x.float().cpu() for x in (o, pl, ck, pl2, h)]
    (o_c, pl_c, ck_c, pl2_c, h_c), (o_g, pl_g, ck_g, pl2_g, h_g) = results["cpu"], results["cuda"]
    assert not torch.isnan(ck_g).any()
    assert rel_rms(o_g.numpy(), o_c.numpy()) <= 6e-3
    assert rel_rms(ck_g.numpy(), ck_c.numpy()) <= 1e-4
    assert rel_rms(pl_g.numpy(), pl_c.numpy()) <= 1e-4
    assert rel_rms(pl2_g.numpy(), pl2_c.numpy()) <= 1e-4
    for c, s in enumerate(CK_SLOTS):  # the checkpoint slots hold the dense checkpoints, bit for bit
        if s >= 0:  # checkpoint 5 is the padding sequence's: its slot keeps its state
            assert torch.equal(pl2_g[s], pool[s] if c == 5 else ck_g[c]), (c, s)
    assert h_g.shape == h_c.shape and rel_rms(h_g.numpy(), h_c.numpy()) <= 6e-3
