"""flashkda on CPU torch tensors: same results as numpy, in-place semantics, the custom ops
(schema/fake checks through torch.library.opcheck) and torch.compile."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem, to_numpy, torch_problem
from kda_reference import kda_decode, kda_forward, rel_rms

torch = pytest.importorskip("torch", reason="torch is not installed: torch CPU tests skipped")

import flashkda  # noqa: E402

if flashkda._torch_ops is None:
    pytest.skip("flashkda did not register its torch custom ops (FLASHKDA_NO_TORCH set?)", allow_module_level=True)


def chunk_kwargs(t, p):
    return dict(use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=p["lower_bound"],
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True,
                cu_seqlens=t.get("cu_seqlens"))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_chunk_kda_matches_numpy_and_reference(rng, need_bf16, dtype):
    dt = np.float32 if dtype == "f32" else need_bf16
    p = make_problem(rng, lengths=[20, 3, 17], dtype=dt, state=True)
    t = torch_problem(p)
    h0 = t["h0_vk"].transpose(-1, -2).contiguous()
    o, ht = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0, **chunk_kwargs(t, p))
    assert isinstance(o, torch.Tensor) and o.dtype == t["q"].dtype and ht.dtype == torch.float32
    o_np, ht_np = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"],
                                     initial_state=np.ascontiguousarray(np.swapaxes(p["h0_vk"], -1, -2)),
                                     **chunk_kwargs(p, p))
    np.testing.assert_array_equal(to_numpy(o), o_np.astype(np.float32))
    np.testing.assert_array_equal(ht.numpy(), ht_np)
    ref_o, ref_h = kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=True, beta_logit=True,
                               initial_state=p["h0_vk"], cu_seqlens=p["cu_seqlens"], **p.ref_kwargs())
    assert rel_rms(to_numpy(o), ref_o) <= (1e-5 if dtype == "f32" else 5e-3)
    assert rel_rms(ht.transpose(-1, -2).numpy(), ref_h) <= (1e-5 if dtype == "f32" else 1e-4)


def test_chunk_kda_accepts_grad_requiring_and_strided_tensors(rng):
    p = make_problem(rng, T=24)
    t = torch_problem(p)
    o1, _ = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **chunk_kwargs(t, p))
    q = t["q"].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    o2, _ = flashkda.chunk_kda(q, t["k"], t["v"], t["g"], t["beta"], **chunk_kwargs(t, p))
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


def test_chunk_kda_backward_raises_where_autograd_records(rng):
    """fla's chunk_kda trains; flashkda's is forward only. Where autograd records (grad mode on, an input
    requiring grad) a backward through o or the final state raises RuntimeError naming the function,
    instead of leaving the inputs without gradients; the values are the no_grad call's bits, the outputs
    can still be changed in place, and under no_grad / inference_mode nothing is recorded. A caller's
    pool comes back as itself, not recorded."""
    p = make_problem(rng, T=24)
    t = torch_problem(p)
    kw = chunk_kwargs(t, p)
    with torch.no_grad():
        o_ref, ht_ref = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
    for name in ("v", "A_log"):
        x = {n: t[n] for n in ("q", "k", "v", "g", "beta")}
        grad_kw = dict(kw)
        if name == "v":
            x["v"] = t["v"].clone().requires_grad_()
        else:
            grad_kw["A_log"] = t["A_log"].clone().requires_grad_()
        o, ht = flashkda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **grad_kw)
        assert o.requires_grad and ht.requires_grad, name
        torch.testing.assert_close(o.detach(), o_ref, rtol=0, atol=0)
        torch.testing.assert_close(ht.detach(), ht_ref, rtol=0, atol=0)
        for out in (o, ht):
            with pytest.raises(RuntimeError, match="chunk_kda computes the forward only"):
                out.sum().backward(retain_graph=True)
        o.mul_(2.0)  # an inference-style in-place update of the output stays allowed
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx():
                o2, ht2 = flashkda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **grad_kw)
            assert not o2.requires_grad and not ht2.requires_grad
    _, _, H, K = t["q"].shape
    pool = torch.zeros((3, H, K, t["v"].shape[3]))
    v = t["v"].clone().requires_grad_()
    o, second = flashkda.chunk_kda(t["q"], t["k"], v, t["g"], t["beta"], state_pool=pool,
                                   state_indices=torch.tensor([1], dtype=torch.int32),
                                   **{n: x for n, x in kw.items() if n != "output_final_state"})
    assert second is pool and not pool.requires_grad and o.requires_grad
    for v_first in (False, True):  # fla's h (a view in the [K, V] layout), changed in place as well
        o, ht, h = flashkda.chunk_kda(t["q"], t["k"], v, t["g"], t["beta"], return_intermediate_states=True,
                                      state_v_first=v_first, **kw)
        assert h.requires_grad
        h.mul_(1.0)
        with pytest.raises(RuntimeError, match="chunk_kda computes the forward only"):
            h.sum().backward()


def test_chunk_kda_cu_seqlens_as_list(rng):
    p = make_problem(rng, lengths=[4, 9])
    t = torch_problem(p)
    kw = chunk_kwargs(t, p)
    o1, h1 = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
    kw["cu_seqlens"] = [0, 4, 13]
    o2, h2 = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)


def test_fwd_writes_in_place(rng):
    p = make_problem(rng, lengths=[9, 30], state=True, cu_dtype=np.int64)
    t = torch_problem(p)
    out = torch.full(t["v"].shape, float("nan"))
    ht = torch.full(t["h0_vk"].shape, float("nan"))
    assert flashkda.fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], 0.125, out, t["A_log"], t["dt_bias"],
                        p["lower_bound"], initial_state=t["h0_vk"], final_state=ht, cu_seqlens=t["cu_seqlens"]) is None
    ref_o, ref_h = kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=True, beta_logit=True, scale=0.125,
                               initial_state=p["h0_vk"], cu_seqlens=p["cu_seqlens"], **p.ref_kwargs())
    assert rel_rms(out.numpy(), ref_o) <= 1e-5 and rel_rms(ht.numpy(), ref_h) <= 1e-5


def test_fwd_errors_are_value_errors(rng):
    p = make_problem(rng, T=8)
    t = torch_problem(p)
    with pytest.raises(ValueError, match="out: expected shape"):
        flashkda.fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], 0.125, torch.empty(1, 8, 2, 3), t["A_log"],
                     t["dt_bias"], -2.0)


def _count_ext_calls(monkeypatch, name):
    """Counts the calls of flashkda._C.<name> (in one list entry per test)."""
    from flashkda import _launch
    calls = []
    real = getattr(_launch._C, name)

    class Counting:
        def __getattr__(self, attr):
            if attr != name:
                return getattr(_launch._C, attr)

            def counted(*args, **kwargs):
                calls[:] = [calls[0] + 1] if calls else [1]
                return real(*args, **kwargs)
            return counted

    monkeypatch.setattr(_launch, "_C", Counting())
    return calls


def _spy_direct(monkeypatch, name):
    """Records, per call, whether the direct path _impl.<name> (arguments already in the kernels'
    layout, straight to flashkda._C) took the call."""
    from flashkda import _impl
    taken = []
    real = getattr(_impl, name)

    def spy(*args):
        res = real(*args)
        taken.append(res is True or (res is not None and res is not False))
        return res

    monkeypatch.setattr(_impl, name, spy)
    return taken


def test_fwd_direct_path_and_checked_path_agree(rng, monkeypatch):
    """Tensors in the kernels' layout go straight to flashkda._C; anything it refuses (float64
    A_log, flat dt_bias, a strided q) takes the checked path, which fixes the layout: same results."""
    taken = _spy_direct(monkeypatch, "_fwd_direct")
    p = make_problem(rng, lengths=[9, 30], state=True, cu_dtype=np.int64)
    t = torch_problem(p)
    H, K = t["q"].shape[2], t["q"].shape[3]

    def run(q, A_log, dt_bias):
        out = torch.full(t["v"].shape, float("nan"))
        ht = torch.full(t["h0_vk"].shape, float("nan"))
        flashkda.fwd(q, t["k"], t["v"], t["g"], t["beta"], 0.125, out, A_log, dt_bias, p["lower_bound"],
                     initial_state=t["h0_vk"], final_state=ht, cu_seqlens=t["cu_seqlens"])
        return out, ht

    o1, h1 = run(t["q"], t["A_log"], t["dt_bias"])
    strided_q = t["q"].transpose(-1, -2).contiguous().transpose(-1, -2)
    o2, h2 = run(strided_q, t["A_log"].double(), t["dt_bias"].double().reshape(H * K))
    assert taken == [True, False]
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)


@pytest.mark.parametrize("case, pattern", [
    ("out shape", r"out: expected shape \[1, 8, 2, 64\]"),
    ("v heads", r"v: grouped value heads"),
    ("lower_bound", r"lower_bound:? must lie in \[-5, 0\)"),
    ("cu batch", r"q: .*batch size .*1"),
    ("state shape", r"initial_state: expected shape"),
])
def test_fwd_errors_name_the_argument(rng, monkeypatch, case, pattern):
    """Tensors already in the kernels' form go to flashkda._C in one call, and its validation names
    the bad argument (no second, Python-checked attempt)."""
    calls = _count_ext_calls(monkeypatch, "forward")
    p = make_problem(rng, B=2 if case == "cu batch" else 1, T=8)
    t = torch_problem(p)
    args = dict(q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"], scale=0.125,
                out=torch.empty(t["v"].shape), A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=-2.0)
    if case == "out shape":
        args["out"] = torch.empty(1, 8, 2, 3)
    elif case == "v heads":
        args["v"] = torch.randn(1, 8, 4, 64)
    elif case == "lower_bound":
        args["lower_bound"] = 1.0
    elif case == "cu batch":
        args["cu_seqlens"] = torch.tensor([0, 8])
    elif case == "state shape":
        args["initial_state"] = torch.zeros(2, 2, 64, 64)
    with pytest.raises(ValueError, match=pattern):
        flashkda.fwd(**args)
    assert calls == [1] or (calls == [] and case == "cu batch")  # one call, or named before any


def test_chunk_kda_direct_path_and_checked_path_agree(rng, monkeypatch):
    """v-first states and fp32 gate parameters go straight to flashkda._C; [N, H, K, V] states and
    float64 A_log take the checked path (transposes, casts): same results. Without the gate in the
    kernel the direct path ignores A_log and dt_bias like the checked path."""
    taken = _spy_direct(monkeypatch, "_chunk_kda_direct")
    p = make_problem(rng, lengths=[9, 30], state=True, cu_dtype=np.int64)
    t = torch_problem(p)
    H, K = t["q"].shape[2], t["q"].shape[3]
    kw = chunk_kwargs(t, p)
    kw["dt_bias"] = t["dt_bias"].reshape(H * K)
    o1, h1 = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0_vk"],
                                state_v_first=True, **kw)
    kw2 = dict(kw, A_log=t["A_log"].double())
    o2, h2 = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                initial_state=t["h0_vk"].transpose(-1, -2).contiguous(), **kw2)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(h1, h2.transpose(-1, -2), rtol=0, atol=0)
    g = torch.nn.functional.logsigmoid(t["g"])  # a log-decay <= 0 for the precomputed form
    o3, _ = flashkda.chunk_kda(t["q"], t["k"], t["v"], g, t["beta"], A_log=torch.zeros(7), dt_bias=torch.zeros(3),
                               cu_seqlens=t["cu_seqlens"])
    o4, _ = flashkda.chunk_kda(t["q"], t["k"], t["v"], g, t["beta"], cu_seqlens=t["cu_seqlens"])
    torch.testing.assert_close(o3, o4, rtol=0, atol=0)
    assert taken == [True, False, True, True]


@pytest.mark.parametrize("case, pattern", [
    ("v heads", r"v: grouped value heads"),
    ("beta per channel", r"per-channel beta"),
    ("lower_bound", r"lower_bound:? must lie in \[-5, 0\)"),
    ("safe_gate", r"lower_bound: must be specified when safe_gate=True"),
    ("softplus without A_log", r"A_log: must be provided"),
    ("state shape", r"initial_state: expected shape"),
])
def test_chunk_kda_errors_name_the_argument(rng, case, pattern):
    p = make_problem(rng, B=1, T=8)
    t = torch_problem(p)
    args = dict(q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"], use_gate_in_kernel=True,
                A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=-2.0, state_v_first=True)
    if case == "v heads":
        args["v"] = torch.randn(1, 8, 3, 64)
    elif case == "beta per channel":
        args["beta"] = torch.randn(1, 8, 2, 64)
    elif case == "lower_bound":
        args["lower_bound"] = 1.0
    elif case == "safe_gate":
        args.update(lower_bound=None, safe_gate=True)
    elif case == "softplus without A_log":
        args.update(lower_bound=None, A_log=None)
    elif case == "state shape":
        args["initial_state"] = torch.zeros(2, 2, 64, 64)
    with pytest.raises(ValueError, match=pattern):
        flashkda.chunk_kda(**args)


def test_fused_recurrent_pool_in_place(rng):
    H, K, V = 2, 64, 64
    p = make_problem(rng, B=3, T=1, H=H, K=K, V=V)
    t = torch_problem(p)
    pool_vk = (0.1 * rng.standard_normal((5, H, V, K))).astype(np.float32)
    pool = torch.from_numpy(pool_vk.copy())
    idx = torch.tensor([4, -1, 1])  # int64 indices are accepted
    o, ht = flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"],
                                         dt_bias=t["dt_bias"], initial_state=pool, use_qk_l2norm_in_kernel=True,
                                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                         lower_bound=p["lower_bound"], state_v_first=True, ssm_state_indices=idx)
    assert ht is pool
    ref_o, ref_pool = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, np.array([4, -1, 1]),
                                 l2norm=True, beta_logit=True, **p.ref_kwargs())
    assert rel_rms(o.numpy(), ref_o) <= 1e-5
    assert rel_rms(pool.numpy()[[4, 1]], ref_pool[[4, 1]]) <= 1e-5
    np.testing.assert_array_equal(pool.numpy()[[0, 2, 3]], pool_vk[[0, 2, 3]])


@pytest.mark.parametrize("speculative", [False, True])
def test_fused_recurrent_direct_path_and_checked_path_agree(rng, monkeypatch, speculative):
    """The serving call (a [P, H, V, K] pool updated in place through int32 indices) goes straight to
    flashkda._C; int64 indices and a strided out take the checked path (casts, a copy): same pool
    and outputs, bit for bit."""
    taken = _spy_direct(monkeypatch, "_decode_direct")
    H, K, V, N, T = 2, 64, 64, 3, (3 if speculative else 1)
    p = make_problem(rng, B=N, T=T, H=H, K=K, V=V)
    t = torch_problem(p)
    pool0 = torch.from_numpy((0.1 * rng.standard_normal((9, H, V, K))).astype(np.float32))
    idx = torch.tensor([[4, 6, 7], [-1, 0, 0], [1, 2, 3]] if speculative else [4, -1, 1], dtype=torch.int32)
    acc = torch.tensor([1, 2, 3], dtype=torch.int32) if speculative else None

    def run(idx, acc, out):
        pool = pool0.clone()
        o, ht = flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"],
                                             dt_bias=t["dt_bias"], initial_state=pool, use_qk_l2norm_in_kernel=True,
                                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                             lower_bound=p["lower_bound"], state_v_first=True,
                                             ssm_state_indices=idx, num_accepted_tokens=acc, out=out)
        assert ht is pool
        return o, pool

    o1, pool1 = run(idx, acc, None)
    strided_out = torch.empty(N, T, V, H).transpose(-1, -2)
    o2, pool2 = run(idx.long(), None if acc is None else acc.long(), strided_out)
    assert taken == [True, False]
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(pool1, pool2, rtol=0, atol=0)


def test_fused_recurrent_errors_name_the_argument(rng):
    p = make_problem(rng, B=3, T=1, H=2, K=64, V=64)
    t = torch_problem(p)
    kw = dict(A_log=t["A_log"], dt_bias=t["dt_bias"], use_gate_in_kernel=True, lower_bound=p["lower_bound"],
              state_v_first=True)
    small_pool = torch.zeros(2, 2, 64, 64)  # two slots for three sequences, one of them padding: fine
    flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=small_pool,
                                 ssm_state_indices=torch.tensor([0, 1, -1], dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match=r"state_indices\[2, 0\]=2 must be < pool_size=2"):
        flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=small_pool,
                                     ssm_state_indices=torch.tensor([0, 1, 2], dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match=r"initial_state: expected a state pool .* P >= 3"):
        flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=small_pool,
                                     inplace_final_state=True, **kw)  # no indices: slot n for sequence n
    with pytest.raises(ValueError, match=r"ssm_state_indices: expected an int32 or int64 array \[N\] or \[N, S\] with N=3"):
        flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=torch.zeros(4, 2, 64, 64),
                                     ssm_state_indices=torch.tensor([0, 1], dtype=torch.int32), **kw)

    for dt in (torch.bool, torch.float16, torch.int32):  # the serving path allocated out before checking q
        with pytest.raises(ValueError, match=r"q: dtype .* is not supported"):
            flashkda.fused_recurrent_kda(t["q"].to(dt), t["k"], t["v"], t["g"], t["beta"],
                                         initial_state=torch.zeros(4, 2, 64, 64),
                                         ssm_state_indices=torch.tensor([0, 1, 2], dtype=torch.int32), **kw)


def test_fused_recurrent_kv_layout_not_in_place(rng):
    p = make_problem(rng, B=2, T=3, H=2, K=32, V=16, gate="precomputed", state=True)
    t = torch_problem(p)
    h0 = t["h0_vk"].transpose(-1, -2).contiguous()
    keep = h0.clone()
    o, ht = flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0,
                                         output_final_state=True, inplace_final_state=False,
                                         use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    torch.testing.assert_close(h0, keep, rtol=0, atol=0)
    ref_o, ref_h = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], p["h0_vk"], l2norm=True, beta_logit=True)
    assert rel_rms(o.numpy(), ref_o) <= 1e-5
    assert rel_rms(ht.transpose(-1, -2).numpy(), ref_h) <= 1e-5


# ---- custom ops ---------------------------------------------------------------------------------


def test_custom_ops_are_registered():
    for name in ("chunk_kda", "fwd", "fused_recurrent_kda"):
        assert hasattr(torch.ops.flashkda, name)


def test_opcheck_chunk_kda(rng):
    p = make_problem(rng, lengths=[5, 11], state=True, K=32, V=16)
    t = torch_problem(p)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], None, t["h0_vk"].transpose(-1, -2).contiguous(), True,
            True, True, True, False, -2.0, t["A_log"], t["dt_bias"], False, t["cu_seqlens"], "precise")
    no_serving = (None, None, None, 0, None, None)
    torch.library.opcheck(torch.ops.flashkda.chunk_kda.default, args + no_serving)
    torch.library.opcheck(torch.ops.flashkda.chunk_kda.default, args[:-1] + ("fast",) + no_serving)
    # The serving prefill: a pool ([P, H, K, V], updated in place) and dense checkpoints.
    p = make_problem(rng, lengths=[70, 64], K=32, V=16)
    t = torch_problem(p)
    pool = torch.randn(3, 2, 32, 16) * 0.1
    checkpoints = torch.zeros(2, 2, 32, 16)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, False, True, True, True, False, -2.0,
            t["A_log"], t["dt_bias"], False, t["cu_seqlens"], "precise", pool, torch.tensor([2, 0], dtype=torch.int32),
            torch.tensor([True, False]), 64, checkpoints, None)
    torch.library.opcheck(torch.ops.flashkda.chunk_kda.default, args)


def test_opcheck_fwd(rng):
    p = make_problem(rng, B=2, T=7, state=True, K=32, V=16)
    t = torch_problem(p)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], 0.2, torch.empty(t["v"].shape), t["A_log"], t["dt_bias"],
            -2.0, t["h0_vk"], torch.empty(t["h0_vk"].shape), None, "precise", None, None, None, 0, None, None)
    torch.library.opcheck(torch.ops.flashkda.fwd.default, args)
    pool = torch.randn(4, 2, 16, 32) * 0.1
    args = args[:10] + (None, None, None, "precise", pool, torch.tensor([3, 1], dtype=torch.int32), None, 0, None,
                        None)
    torch.library.opcheck(torch.ops.flashkda.fwd.default, args)


def test_opcheck_fused_recurrent_kda(rng):
    p = make_problem(rng, B=2, T=2, K=32, V=16)
    t = torch_problem(p)
    pool = torch.randn(3, 2, 16, 32) * 0.1
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], None, pool, False, True, True,
            True, -2.0, True, None, torch.tensor([2, 0], dtype=torch.int32), None, True, torch.empty(t["v"].shape))
    torch.library.opcheck(torch.ops.flashkda.fused_recurrent_kda.default, args)


def test_torch_compile_fullgraph(rng):
    p = make_problem(rng, B=2, T=20, K=32, V=16)
    t = torch_problem(p)
    pool0 = torch.randn(2, 2, 16, 32) * 0.1

    def step(q, k, v, g, beta, A_log, dt_bias, pool):
        o, ht = flashkda.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                   lower_bound=-2.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                   output_final_state=True, state_v_first=True)
        o2, _ = flashkda.fused_recurrent_kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], A_log=A_log,
                                             dt_bias=dt_bias, initial_state=pool, use_gate_in_kernel=True,
                                             lower_bound=-2.0, use_qk_l2norm_in_kernel=True,
                                             use_beta_sigmoid_in_kernel=True, state_v_first=True,
                                             inplace_final_state=True)
        return o * 2, ht + 1, o2

    args = [t[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    pool_eager, pool_comp = pool0.clone(), pool0.clone()
    eager = step(*args, pool_eager)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args, pool_comp)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(pool_eager, pool_comp, rtol=0, atol=0)  # the in-place update survives compile
    assert not torch.equal(pool_eager, pool0)


def test_torch_compile_pool_prefill(rng):
    """chunk_kda through a state pool, with checkpoints, inside a compiled graph: the pool and the
    checkpoints written in place, as in eager mode."""
    p = make_problem(rng, B=2, T=70, K=32, V=16)
    t = torch_problem(p)
    pool0 = torch.randn(4, 2, 16, 32) * 0.1
    idx = torch.tensor([3, 1], dtype=torch.int32)

    def step(q, k, v, g, beta, A_log, dt_bias, pool, checkpoints):
        o, _ = flashkda.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                  lower_bound=-2.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                  state_v_first=True, state_pool=pool, state_indices=idx, checkpoint_every=64,
                                  checkpoints=checkpoints)
        return o + 1

    args = [t[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    pool_eager, pool_comp = pool0.clone(), pool0.clone()
    ck_eager, ck_comp = torch.zeros(2, 2, 16, 32), torch.zeros(2, 2, 16, 32)
    eager = step(*args, pool_eager, ck_eager)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args, pool_comp, ck_comp)
    torch.testing.assert_close(eager, compiled, rtol=0, atol=0)
    torch.testing.assert_close(pool_eager, pool_comp, rtol=0, atol=0)
    torch.testing.assert_close(ck_eager, ck_comp, rtol=0, atol=0)
    assert not torch.equal(pool_eager, pool0) and ck_eager.abs().sum() > 0
    assert torch.equal(pool_eager[[0, 2]], pool0[[0, 2]])


def test_torch_compile_intermediate_states_leave_the_graph(rng):
    """return_intermediate_states inside a compiled function: h's shape depends on the lengths, so the
    call runs eagerly at a graph break (fla's chunk_kda always does), with the eager call's results; under
    fullgraph=True the break is torch's error, as for fla's."""
    p = make_problem(rng, B=1, T=70, K=32, V=16)
    t = torch_problem(p)

    def step(q, k, v, g, beta, A_log, dt_bias):
        o, ht, h = flashkda.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=-2.0, use_qk_l2norm_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, output_final_state=True,
                                      return_intermediate_states=True)
        return o * 2, ht, h

    args = [t[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    with torch.inference_mode():
        eager = step(*args)
        compiled = torch.compile(step, backend="aot_eager")(*args)
        assert eager[2].shape[1] == 2  # h every 64 tokens: at 0 and 64
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="(?i)graph break|disable|skip"):
            torch.compile(step, fullgraph=True, backend="aot_eager")(*args)


def test_meta_tensors_are_a_value_error():
    q = torch.randn(1, 4, 2, 16, device="meta")
    beta = torch.randn(1, 4, 2, device="meta")
    calls = (lambda: flashkda.chunk_kda(q, q, q, q, beta),
             lambda: flashkda.fwd(q, q, q, q, beta, 0.25, torch.empty_like(q), torch.zeros(2, device="meta"), None,
                                  -5.0),
             lambda: flashkda.fused_recurrent_kda(q, q, q, q, beta))
    for call in calls:  # raised BufferError from DLPack before
        with pytest.raises(ValueError, match="device meta"):
            call()
