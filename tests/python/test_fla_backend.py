"""flashkda as a backend of fla 0.6 (`import flashkda.fla`): fla's own chunk_kda and
fused_recurrent_kda calls return flashkda's results bit for bit; calls flashkda cannot serve are
declined with a reason; FLA_FLASHKDA=0 switches the backend off. CPU tensors here (fla's own
kernels need a GPU, so a served CPU call shows the dispatch); the CUDA cases run where a Hopper
GPU is visible."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BF16, make_problem, torch_problem

torch = pytest.importorskip("torch", reason="torch is not installed: fla backend tests skipped")
pytest.importorskip("fla.ops.kda", reason="fla (flash-linear-attention 0.6) is not installed: fla backend tests skipped")

import fla.ops.kda as fla_kda  # noqa: E402
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: E402

import flashkda  # noqa: E402
import flashkda.fla as backend  # noqa: E402

if BF16 is None:
    pytest.skip("ml_dtypes is not installed", allow_module_level=True)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashkda.cuda_available() else [])


def inputs(rng, device, T=40, H=2, K=128, V=128):
    p = make_problem(rng, B=1, T=T, H=H, K=K, V=V, gate="lower_bound", state=True, dtype=BF16)
    t = torch_problem(p, device)
    t["dt_bias"] = t["dt_bias"].reshape(-1)
    kw = dict(scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=p["lower_bound"], state_v_first=True,
              A_log=t["A_log"], dt_bias=t["dt_bias"])
    return t, kw


@pytest.mark.parametrize("device", DEVICES)
def test_fla_chunk_kda_returns_flashkdas_result(rng, device):
    t, kw = inputs(rng, device)
    with torch.no_grad():
        o_fla, ht_fla = fla_kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0_vk"], **kw)
        o, ht = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0_vk"], **kw)
    assert torch.equal(o_fla, o) and torch.equal(ht_fla, ht)


@pytest.mark.parametrize("device", DEVICES)
def test_fla_fused_recurrent_kda_and_the_serving_call(rng, device):
    t, kw = inputs(rng, device, T=3)
    for n in ("safe_gate", "scale"):
        kw.pop(n)
    with torch.no_grad():
        # fla's public function: initial_state only read
        h0 = t["h0_vk"].clone()
        o_fla, ht_fla = fla_kda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0, **kw)
        o, ht = flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0, **kw)
        assert torch.equal(h0, t["h0_vk"])
        assert torch.equal(o_fla, o) and torch.equal(ht_fla, ht)
        # vLLM's call: a pool updated in place through slot indices
        pool = torch.randn(5, *t["h0_vk"].shape[1:], device=device) * 0.1
        pool_ref = pool.clone()
        idx = torch.tensor([3], dtype=torch.int32, device=device)
        kw.pop("output_final_state")
        o_fla, _ = fused_recurrent_kda_fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=pool,
                                           inplace_final_state=True, ssm_state_indices=idx, **kw)
        o, _ = flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=pool_ref,
                                            inplace_final_state=True, ssm_state_indices=idx, **kw)
        assert torch.equal(o_fla, o) and torch.equal(pool, pool_ref)


def test_unservable_calls_are_declined_with_a_reason(rng):
    t, kw = inputs(rng, "cpu")
    chunk = backend.FlashkdaChunkBackend()
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    assert chunk.chunk_kda_verifier(*args, **kw) == (True, None)
    cases = {
        "context parallel": dict(cp_context=object()),
        "every 64 tokens": dict(return_intermediate_states=True, chunk_size=32),  # fla's h then every 32
    }
    # served on both backends (on the GPU checked against fla's own below)
    assert chunk.chunk_kda_verifier(*args, **{**kw, "return_intermediate_states": True}) == (True, None)
    assert chunk.chunk_kda_verifier(*args, **{**kw, "chunk_size": 32}) == (True, None)
    assert chunk.chunk_kda_verifier(*args, **{**kw, "allow_neg_eigval": True}) == (True, None)
    for needle, extra in cases.items():
        ok, reason = chunk.chunk_kda_verifier(*args, **{**kw, **extra})
        assert not ok and needle in reason
    ok, reason = chunk.chunk_kda_verifier(t["q"], t["k"], t["v"][:, :, :1], t["g"], t["beta"], **kw)
    assert not ok and "GVA" in reason
    q = t["q"].clone().requires_grad_(True)
    ok, reason = chunk.chunk_kda_verifier(q, *args[1:], **kw)
    assert not ok and "inference" in reason
    with torch.no_grad():  # the same tensor without autograd is served
        assert chunk.chunk_kda_verifier(q, *args[1:], **kw)[0]
    rec = backend.FlashkdaKDABackend()
    ok, reason = rec.fused_recurrent_kda_fwd_verifier(*args, initial_state=None, inplace_final_state=True)
    assert not ok and "initial_state" in reason
    # what flashkda's own functions would refuse where fla runs: declined, so fla runs them
    for needle, call_args, call_kw in (
            ("lower_bound in [-5, 0)", args, {**kw, "safe_gate": False, "lower_bound": -8.0}),
            ("g and beta", (*args[:3], t["g"].half(), t["beta"]), kw),
            ("g and beta", (*args[:4], t["beta"].half()), kw),
            ("initial_state", args, {**kw, "initial_state": t["h0_vk"].double()})):
        ok, reason = chunk.chunk_kda_verifier(*call_args, **call_kw)
        assert not ok and needle in reason, (needle, reason)
    # fla's graph mode: cu_seqlens may end short of the token buffer (padding rows), which flashkda refuses
    T = t["q"].shape[1]
    short, full = torch.tensor([0, 10, T - 5]), torch.tensor([0, 10, T])
    h0 = t["h0_vk"][:1].expand(2, -1, -1, -1).contiguous()
    for cu, served in ((full, True), (short, False)):
        ok, reason = chunk.chunk_kda_verifier(*args, **{**kw, "initial_state": h0, "cu_seqlens": cu, "use_graph": True})
        assert ok == served and (served or "B*T" in reason), reason
    assert chunk.chunk_kda_verifier(*args, **{**kw, "initial_state": h0, "cu_seqlens": short})[0]  # refused by
    # flashkda's checks, as by fla's (no graph mode: fla's chunk list needs the real end too)


def test_deprecated_state_layout_keyword_reaches_the_backend(rng):
    """fla's chunk_kda converts transpose_state_layout to state_v_first only after its backends are asked, so
    the backend gets the old keyword: the state must still be read and written [V, K] (at K = V = 128 the
    other layout has the same shape, so a dropped keyword would go unnoticed)."""
    t, kw = inputs(rng, "cpu")
    kw.pop("state_v_first")
    h0 = t["h0_vk"]
    with torch.no_grad():
        want_o, want_ht = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0,
                                             state_v_first=True, **kw)
        with pytest.warns(DeprecationWarning, match="state_v_first"):
            o, ht = fla_kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0,
                                      transpose_state_layout=True, **kw)
        other_o, _ = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0, **kw)
    assert torch.equal(o, want_o) and torch.equal(ht, want_ht)
    assert not torch.equal(o, other_o)  # the layouts differ on these inputs


def test_a_declined_call_runs_flas_own_path(rng, monkeypatch):
    """A call that needs autograd is declined, so fla's own kernels run: on the CPU they need Triton's
    GPU backend and fail, which shows the call did not go to flashkda (on the GPU fla's result returns,
    with the graph flashkda's would not have)."""
    t, kw = inputs(rng, DEVICES[-1])
    q = t["q"].clone().requires_grad_(True)
    with torch.enable_grad():
        try:
            o, _ = fla_kda.chunk_kda(q, t["k"], t["v"], t["g"], t["beta"], **kw)
        except Exception as e:  # noqa: BLE001 - fla's Triton path on a machine without its GPU backend
            assert t["q"].device.type == "cpu", f"fla's own path failed on the GPU: {e}"
            return
    assert o.shape == t["v"].shape and o.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_allow_neg_eigval_is_served(rng, device, monkeypatch):
    """allow_neg_eigval=True (beta = 2 sigmoid(raw beta)): fla's calls return flashkda's results, the
    same as flashkda given that beta itself; on the GPU also within both implementations' rounding of
    fla's own kernels (FLA_FLASHKDA=0)."""
    t, kw = inputs(rng, device)
    beta2 = 2.0 * torch.sigmoid(t["beta"].float())
    with torch.no_grad():
        o_fla, ht_fla = fla_kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0_vk"],
                                          allow_neg_eigval=True, **kw)
        o, ht = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], beta2, initial_state=t["h0_vk"],
                                   **{**kw, "use_beta_sigmoid_in_kernel": False})
    assert torch.equal(o_fla, o) and torch.equal(ht_fla, ht)
    if device != "cuda":
        return
    monkeypatch.setenv("FLA_FLASHKDA", "0")
    with torch.no_grad():
        o_own, ht_own = fla_kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0_vk"],
                                          allow_neg_eigval=True, **kw)

    def rel(a, b):
        return (torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double())).item()

    assert rel(o, o_own) <= 2e-2 and rel(ht, ht_own) <= 2e-2, (rel(o, o_own), rel(ht, ht_own))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_value_heads_are_served(rng, device):
    """fla's GVA (q and k with one head, v, g, beta and the states with two): fla's call returns
    flashkda's result, which is that of q and k repeated per head."""
    t, kw = inputs(rng, device)
    q1, k1 = t["q"][:, :, :1].contiguous(), t["k"][:, :, :1].contiguous()
    with torch.no_grad():
        o_fla, ht_fla = fla_kda.chunk_kda(q1, k1, t["v"], t["g"], t["beta"], initial_state=t["h0_vk"], **kw)
        o, ht = flashkda.chunk_kda(q1.repeat(1, 1, 2, 1), k1.repeat(1, 1, 2, 1), t["v"], t["g"], t["beta"],
                                   initial_state=t["h0_vk"], **kw)
    assert torch.equal(o_fla, o) and torch.equal(ht_fla, ht)


def test_fla_flashkda_0_switches_it_off(monkeypatch):
    assert backend.FlashkdaChunkBackend().is_enabled()
    monkeypatch.setenv("FLA_FLASHKDA", "0")
    assert not backend.FlashkdaChunkBackend().is_enabled()
    assert not backend.FlashkdaKDABackend().is_enabled()


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a Hopper GPU with a CUDA build of flashkda (fla's own "
                    "kernels run on the GPU only)")
def test_return_intermediate_states_matches_flas_own(rng, monkeypatch):
    """fla's chunk_kda(return_intermediate_states=True) with flashkda switched off (fla's own Triton
    chunk-64 kernels) and flashkda's: the same layout [B, NT, H, K, V] and dtype, and values within
    both implementations' rounding (fla's bf16 h, SPEC §6: ~4e-3 on its own)."""
    t, kw = inputs(rng, "cuda", T=300)
    kw["state_v_first"] = False
    h0 = t["h0_vk"].transpose(-1, -2).contiguous()
    monkeypatch.setenv("FLA_FLASHKDA", "0")
    with torch.inference_mode():  # fla allows return_intermediate_states only there
        o_fla, ht_fla, h_fla = fla_kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0,
                                                 return_intermediate_states=True, **kw)
        o, ht, h = flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0,
                                      return_intermediate_states=True, **kw)
    assert h.shape == h_fla.shape and h.dtype == h_fla.dtype, (h.shape, h_fla.shape, h.dtype, h_fla.dtype)
    rel = (torch.linalg.norm((h.double() - h_fla.double())) / torch.linalg.norm(h_fla.double())).item()
    assert rel <= 2e-2, rel
    assert (torch.linalg.norm(o.double() - o_fla.double()) / torch.linalg.norm(o_fla.double())).item() <= 2e-2
