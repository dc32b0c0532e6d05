"""flashkda on CUDA torch tensors (Hopper, CUDA backend): accuracy against the fp64 reference,
in-place semantics, CUDA-graph capture and replay, torch.compile, the workspace from torch's allocator."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GATES, gate_kwargs, make_problem, to_numpy, to_torch, torch_problem
from kda_reference import kda_decode, kda_forward, rel_rms

torch = pytest.importorskip("torch", reason="no CUDA GPU (torch is not installed)")

import flashkda  # noqa: E402

if not (torch.cuda.is_available() and flashkda.cuda_available()):
    pytest.skip("no CUDA GPU (needs torch.cuda and a flashkda build with the CUDA backend on a Hopper GPU; "
                f"built_with_cuda={flashkda.built_with_cuda})", allow_module_level=True)

H, K, V = 4, 128, 128
LENGTHS = [300, 17, 1024, 77]  # docs/SPEC.md §6
TOL_O, TOL_H = 1e-2, 1e-2  # bf16 inputs; docs/SPEC.md §6 measures 4e-3..6e-3 for fla / FlashKDA


@pytest.fixture
def bf16(need_bf16):
    return need_bf16


def cuda_problem(rng, bf16, gate="lower_bound", lengths=LENGTHS, state=True, **kw):
    p = make_problem(rng, lengths=lengths, H=H, K=K, V=V, dtype=bf16, gate=gate, state=state, **kw)
    return p, torch_problem(p, "cuda")


def chunk(p, t, state_v_first=True, **over):
    kw = dict(initial_state=None if "h0_vk" not in t else (t["h0_vk"] if state_v_first
                                                          else t["h0_vk"].transpose(-1, -2).contiguous()),
              output_final_state=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              state_v_first=state_v_first, cu_seqlens=t.get("cu_seqlens"), **gate_kwargs(p, t))
    kw.update(over)
    return flashkda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)


def reference(p):
    return kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=True, beta_logit=True,
                       initial_state=p.get("h0_vk"), cu_seqlens=p["cu_seqlens"], **p.ref_kwargs())


@pytest.mark.parametrize("gate", GATES)
def test_chunk_kda_matches_reference(rng, bf16, gate):
    p, t = cuda_problem(rng, bf16, gate=gate)
    o, ht = chunk(p, t)
    assert o.is_cuda and o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    ref_o, ref_h = reference(p)
    assert rel_rms(to_numpy(o), ref_o) <= TOL_O
    assert rel_rms(to_numpy(ht), ref_h) <= TOL_H


@pytest.mark.parametrize("segment_chunks", [-1, 3, 16])
def test_internal_launch_segments_match_reference(rng, bf16, segment_chunks):
    """flashkda._internal.launch reaches the kernels: sequences never cut (-1) or cut into segments of
    3 and 16 chunks give the reference's result, and cutting changes the bits. Without transition
    skipping: a segment whose start skips runs the serial arithmetic from zero, and where every start
    skips (strong decay) the outputs can be the serial call's, bit for bit."""
    from flashkda import _internal

    p, t = cuda_problem(rng, bf16)
    with _internal.launch(segment_chunks=segment_chunks, skip_transitions=-1):
        o, ht = chunk(p, t)
    ref_o, ref_h = reference(p)
    assert rel_rms(to_numpy(o), ref_o) <= TOL_O
    assert rel_rms(to_numpy(ht), ref_h) <= TOL_H
    if segment_chunks > 0:
        with _internal.launch(segment_chunks=-1):
            o_serial, _ = chunk(p, t)
        assert not torch.equal(o, o_serial)


@pytest.mark.parametrize("mode", ["balanced", "fast"])
@pytest.mark.parametrize("gate", GATES)
def test_precision_modes_match_reference_and_differ_from_precise(rng, bf16, gate, mode):
    p, t = cuda_problem(rng, bf16, gate=gate)
    o_p, h_p = chunk(p, t, scale=K ** -0.5)
    o_f, h_f = chunk(p, t, scale=K ** -0.5, precision=mode)
    ref_o, ref_h = reference(p)
    e_p, e_f = rel_rms(to_numpy(o_p), ref_o), rel_rms(to_numpy(o_f), ref_o)
    assert e_f <= TOL_O and rel_rms(to_numpy(h_f), ref_h) <= TOL_H
    assert not torch.equal(o_p, o_f), f"precision={mode!r} gave the precise mode's bits"
    if mode == "fast":
        assert e_p < e_f, (e_p, e_f)  # the split operands remove most of the bf16 rounding
    out = torch.full(t["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    ht = torch.full(t["h0_vk"].shape, float("nan"), dtype=torch.float32, device="cuda")
    if gate == "lower_bound":  # fwd takes the same switch
        flashkda.fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], K ** -0.5, out, t["A_log"], t["dt_bias"],
                     p["lower_bound"], initial_state=t["h0_vk"], final_state=ht, cu_seqlens=t["cu_seqlens"],
                     precision=mode)
        torch.testing.assert_close(out, o_f, rtol=0, atol=0)
        torch.testing.assert_close(ht, h_f, rtol=0, atol=0)
    with pytest.raises(ValueError, match="precision"):
        chunk(p, t, precision="fp64")


def test_chunk_kda_state_layouts_and_batched(rng, bf16):
    p, t = cuda_problem(rng, bf16, lengths=None, B=2, T=200)
    o1, h1 = chunk(p, t, state_v_first=True)
    o2, h2 = chunk(p, t, state_v_first=False)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(h1, h2.transpose(-1, -2), rtol=0, atol=0)
    ref_o, ref_h = reference(p)
    assert rel_rms(to_numpy(o1), ref_o) <= TOL_O and rel_rms(to_numpy(h1), ref_h) <= TOL_H


def test_chunk_kda_matches_the_cpu_backend(rng, bf16):
    p, t = cuda_problem(rng, bf16, lengths=[100, 33])
    o, ht = chunk(p, t)
    o_cpu, ht_cpu = flashkda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["h0_vk"],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, state_v_first=True,
                                       cu_seqlens=p["cu_seqlens"], **gate_kwargs(p, p))
    assert rel_rms(to_numpy(o), o_cpu) <= TOL_O and rel_rms(to_numpy(ht), ht_cpu) <= TOL_H


@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_fwd_writes_in_place(rng, bf16, state_dtype):
    sd = np.float32 if state_dtype == "f32" else bf16
    p, t = cuda_problem(rng, bf16, state_dtype=sd, cu_dtype=np.int64)
    out = torch.full(t["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    ht = torch.full(t["h0_vk"].shape, float("nan"), dtype=t["h0_vk"].dtype, device="cuda")
    flashkda.fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], K ** -0.5, out, t["A_log"], t["dt_bias"],
                 p["lower_bound"], initial_state=t["h0_vk"], final_state=ht, cu_seqlens=t["cu_seqlens"])
    ref_o, ref_h = reference(p)
    assert rel_rms(to_numpy(out), ref_o) <= TOL_O
    assert rel_rms(to_numpy(ht), ref_h) <= (TOL_H if state_dtype == "f32" else 2e-2)


@pytest.mark.parametrize("lengths", [[2048], LENGTHS], ids=["one sequence (few-head pieces)", "varlen"])
def test_fwd_final_state_over_the_initial_one(rng, bf16, lengths):
    # one tensor as both initial_state and final_state (a caller updating its states in place): the bits
    # of two tensors, where pieces of one sequence read the initial state while others write the final
    p, t = cuda_problem(rng, bf16, lengths=lengths, cu_dtype=np.int64)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], K ** -0.5)
    gate = (t["A_log"], t["dt_bias"], p["lower_bound"])
    out = torch.full(t["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    ht = torch.full(t["h0_vk"].shape, float("nan"), dtype=t["h0_vk"].dtype, device="cuda")
    flashkda.fwd(*args, out, *gate, initial_state=t["h0_vk"], final_state=ht, cu_seqlens=t["cu_seqlens"])
    state, out2 = t["h0_vk"].clone(), torch.full_like(out, float("nan"))
    flashkda.fwd(*args, out2, *gate, initial_state=state, final_state=state, cu_seqlens=t["cu_seqlens"])
    assert torch.equal(out2, out) and torch.equal(state, ht)
    assert not torch.equal(state, t["h0_vk"])


def decode_problem(rng, bf16, N, T, P):
    p = make_problem(rng, B=N, T=T, H=H, K=K, V=V, dtype=bf16, gate="lower_bound")
    t = torch_problem(p, "cuda")
    pool_vk = (0.1 * rng.standard_normal((P, H, V, K))).astype(np.float32)
    return p, t, pool_vk


def decode(p, t, pool, **kw):
    return flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=pool,
                                        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                        state_v_first=True, **gate_kwargs(p, t), **kw)


def test_fused_recurrent_pool_with_padding(rng, bf16):
    N, P = 6, 10
    p, t, pool_vk = decode_problem(rng, bf16, N, 1, P)
    idx = np.array([9, 0, -1, 4, 5, 2], np.int32)
    pool = to_torch(pool_vk, "cuda")
    before = pool.clone()
    o, ht = decode(p, t, pool, ssm_state_indices=to_torch(idx, "cuda"))
    assert ht is pool
    ref_o, ref_pool = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, idx, l2norm=True,
                                 beta_logit=True, **p.ref_kwargs())
    assert rel_rms(to_numpy(o), ref_o) <= TOL_O
    written = [9, 0, 4, 5, 2]
    assert rel_rms(to_numpy(pool)[written], ref_pool[written]) <= TOL_H
    for s in (1, 3, 6, 7, 8):
        assert torch.equal(pool[s], before[s]), f"slot {s} not named but changed"


def test_fused_recurrent_speculative(rng, bf16):
    N, T, P = 3, 3, 12
    p, t, pool_vk = decode_problem(rng, bf16, N, T, P)
    idx = np.array([[0, 1, 2], [3, 4, -1], [6, 7, 8]], np.int32)
    acc = np.array([1, 3, 2], np.int32)
    pool = to_torch(pool_vk, "cuda")
    o, _ = decode(p, t, pool, ssm_state_indices=to_torch(idx, "cuda"), num_accepted_tokens=to_torch(acc, "cuda"))
    ref_o, ref_pool = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, idx, acc, l2norm=True,
                                 beta_logit=True, **p.ref_kwargs())
    assert rel_rms(to_numpy(o), ref_o) <= TOL_O
    written = [0, 1, 2, 3, 4, 6, 7, 8]
    assert rel_rms(to_numpy(pool)[written], ref_pool[written]) <= TOL_H
    assert np.array_equal(to_numpy(pool)[[5, 9, 10, 11]], pool_vk[[5, 9, 10, 11]])


def test_fused_recurrent_kv_pool_gathered_slots(rng, bf16):
    # fla's [K, V] pool goes through a gathered copy of its named slots: a slot >= P is padding there
    # as in the kernel (output zero, nothing written), and a speculative slot named twice by one
    # sequence keeps the later state
    N, T, P = 3, 3, 9
    p, t, pool_vk = decode_problem(rng, bf16, N, T, P)
    idx = np.array([[5, 5, 6], [P + 3, 1, 2], [7, 8, 0]], np.int32)
    acc = np.array([1, 1, 2], np.int32)
    ref_idx = idx.copy()
    ref_idx[1, 0] = -1  # what the kernel makes of a start slot >= P
    ref_o, ref_pool = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, ref_idx, acc, l2norm=True,
                                 beta_logit=True, **p.ref_kwargs())
    pool = to_torch(np.ascontiguousarray(np.swapaxes(pool_vk, -1, -2)), "cuda")
    o, _ = flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=pool,
                                        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                        ssm_state_indices=to_torch(idx, "cuda"),
                                        num_accepted_tokens=to_torch(acc, "cuda"), **gate_kwargs(p, t))
    got = np.swapaxes(to_numpy(pool), -1, -2)
    assert rel_rms(to_numpy(o), ref_o) <= TOL_O
    assert np.all(to_numpy(o)[1] == 0), "the padding entry's outputs"
    written = [0, 5, 6, 7, 8]
    assert rel_rms(got[written], ref_pool[written]) <= TOL_H
    assert np.array_equal(got[[1, 2, 3, 4]], pool_vk[[1, 2, 3, 4]])


@pytest.mark.parametrize("T", [1, 20])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_fused_recurrent_shared_slot_poisons_both_sequences(rng, bf16, state_v_first, T):
    # Two live sequences naming one slot (the CPU refuses it by name; the GPU cannot read device
    # indices on the host). A decode step (T = 1): both get NaN outputs and store nothing, the
    # padding entry between them gets zeros, the third sequence runs as usual, and no slot changes
    # but the third's (SPEC §5). T = 20 is longer than a decode step: the serving prefill through
    # the pool, whose check poisons the whole call and leaves every slot as it was (SPEC §9).
    N, P = 4, 6
    p, t, pool_vk = decode_problem(rng, bf16, N, T, P)
    idx = np.array([3, -1, 3, 5], np.int32)
    pool = to_torch(pool_vk if state_v_first else np.ascontiguousarray(np.swapaxes(pool_vk, -1, -2)), "cuda")
    before = pool.clone()
    o, _ = flashkda.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=pool,
                                        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                        state_v_first=state_v_first, ssm_state_indices=to_torch(idx, "cuda"),
                                        **gate_kwargs(p, t))
    got = to_numpy(o).astype(np.float32)
    if T > 16:
        assert np.isnan(got).all(), "a shared slot in the serving prefill poisons the whole call"
        for s in range(P):
            assert torch.equal(pool[s], before[s]), f"slot {s} changed"
        return
    assert np.isnan(got[[0, 2]]).all(), "the sequences that share slot 3"
    assert (got[1] == 0).all(), "the padding entry"
    ref_o, ref_pool = kda_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], pool_vk, np.array([-1, -1, -1, 5], np.int32),
                                 l2norm=True, beta_logit=True, **p.ref_kwargs())
    assert rel_rms(got[3], ref_o[3]) <= TOL_O
    for s in range(P):
        if s != 5:
            assert torch.equal(pool[s], before[s]), f"slot {s} changed"


def test_fused_recurrent_check_slots_false_gives_the_same_bits(rng, bf16):
    # The caller's opt-out of the shared-slot check (distinct slots guaranteed): the unchecked
    # kernels, whose results on valid calls are the checked ones bit for bit.
    N, P = 5, 8
    p, t, pool_vk = decode_problem(rng, bf16, N, 1, P)
    idx = to_torch(np.array([6, 0, -1, 3, 2], np.int32), "cuda")
    pools, outs = [], []
    for check in (True, False):
        pool = to_torch(pool_vk, "cuda")
        o, _ = decode(p, t, pool, ssm_state_indices=idx, check_slots=check)
        pools.append(pool), outs.append(o)
    assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])
    # and the flag reaches the kernels: a shared slot without the check gives finite outputs
    o, _ = decode(p, t, to_torch(pool_vk, "cuda"), ssm_state_indices=to_torch(np.array([6, 0, -1, 6, 2], np.int32),
                                                                              "cuda"), check_slots=False)
    assert torch.isfinite(o.float()).all()


# ---- CUDA graphs --------------------------------------------------------------------------------


def test_cuda_graph_capture_chunk_kda(rng, bf16):
    p, t = cuda_problem(rng, bf16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture
        chunk(p, t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, ht_static = chunk(p, t)
    # new contents in the same buffers, then replay
    p2, _ = cuda_problem(rng, bf16)
    for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0_vk"):
        t[n].copy_(to_torch(p2[n], "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    o_eager, ht_eager = chunk(p, t)
    torch.testing.assert_close(o_static, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(ht_static, ht_eager, rtol=0, atol=0)
    p2["cu_seqlens"] = p["cu_seqlens"]
    ref_o, ref_h = reference(p2)
    assert rel_rms(to_numpy(o_static), ref_o) <= TOL_O and rel_rms(to_numpy(ht_static), ref_h) <= TOL_H


def test_cuda_graph_replay_with_new_cu_seqlens(rng, bf16):
    # vLLM-style: same N and total T, different boundaries written into the captured cu_seqlens
    p, t = cuda_problem(rng, bf16, lengths=[100, 200, 212])
    chunk(p, t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, ht_static = chunk(p, t)
    new_cu = np.array([0, 50, 401, 512], p["cu_seqlens"].dtype)
    t["cu_seqlens"].copy_(to_torch(new_cu, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    p["cu_seqlens"] = new_cu
    ref_o, ref_h = reference(p)
    assert rel_rms(to_numpy(o_static), ref_o) <= TOL_O
    assert rel_rms(to_numpy(ht_static), ref_h) <= TOL_H


def test_cuda_graph_capture_fused_recurrent_kda(rng, bf16):
    N, P = 8, 16
    p, t, pool_vk = decode_problem(rng, bf16, N, 1, P)
    pool = to_torch(pool_vk, "cuda")
    idx = to_torch(np.arange(N, dtype=np.int32) * 2, "cuda")
    decode(p, t, pool.clone(), ssm_state_indices=idx)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, _ = decode(p, t, pool, ssm_state_indices=idx)
    pool.copy_(to_torch(pool_vk, "cuda"))  # capture does not run the kernels: reset anyway
    new_idx = np.array([15, 1, 3, -1, 7, 9, 11, 13], np.int32)
    idx.copy_(to_torch(new_idx, "cuda"))
    p2, _, _ = decode_problem(rng, bf16, N, 1, P)
    for n in ("q", "k", "v", "g", "beta"):
        t[n].copy_(to_torch(p2[n], "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    p2["A_log"], p2["dt_bias"] = p["A_log"], p["dt_bias"]
    ref_o, ref_pool = kda_decode(p2["q"], p2["k"], p2["v"], p2["g"], p2["beta"], pool_vk, new_idx, l2norm=True,
                                 beta_logit=True, **p2.ref_kwargs())
    assert rel_rms(to_numpy(o_static), ref_o) <= TOL_O
    written = [15, 1, 3, 7, 9, 11, 13]
    assert rel_rms(to_numpy(pool)[written], ref_pool[written]) <= TOL_H
    untouched = [s for s in range(P) if s not in written]
    assert np.array_equal(to_numpy(pool)[untouched], pool_vk[untouched])


# ---- torch.compile, streams, errors ---------------------------------------------------------------


def test_torch_compile(rng, bf16):
    p, t = cuda_problem(rng, bf16, lengths=None, B=2, T=64)
    pool0 = torch.randn(2, H, V, K, device="cuda") * 0.1

    def step(q, k, v, g, beta, A_log, dt_bias, pool):
        o, ht = flashkda.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                   lower_bound=-2.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                   output_final_state=True, state_v_first=True)
        o2, _ = flashkda.fused_recurrent_kda(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:],
                                             A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                             use_gate_in_kernel=True, lower_bound=-2.0,
                                             use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                             state_v_first=True, inplace_final_state=True)
        return o.float() * 2, ht + 1, o2

    args = [t[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    pool_eager, pool_comp = pool0.clone(), pool0.clone()
    eager = step(*args, pool_eager)
    compiled = torch.compile(step, fullgraph=True)(*args, pool_comp)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(pool_eager, pool_comp, rtol=0, atol=0)


def test_torch_compile_intermediate_states_leave_the_graph(rng, bf16):
    # fla's h has a length-dependent shape: the call runs eagerly at a graph break, with eager's bits
    p, t = cuda_problem(rng, bf16, lengths=None, B=1, T=130)

    def step(q, k, v, g, beta, A_log, dt_bias):
        o, ht, h = flashkda.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=-2.0, use_qk_l2norm_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, output_final_state=True,
                                      return_intermediate_states=True)
        return o.float() * 2, ht, h

    args = [t[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    with torch.inference_mode():
        eager = step(*args)
        compiled = torch.compile(step)(*args)
    assert eager[2].shape[1] == 3  # h at tokens 0, 64 and 128
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_workspace_is_not_held_per_stream(rng, bf16):
    # The workspace comes from torch's allocator per call: calls on streams that are then dropped
    # leave no memory allocated (a cache per stream grew by a workspace for every new stream).
    p, t = cuda_problem(rng, bf16, lengths=[64, 64])
    o1, _ = chunk(p, t)
    del _
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outs = []
    for _ in range(4):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outs.append(chunk(p, t)[0])
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for o in outs:
        torch.testing.assert_close(o1, o, rtol=0, atol=0)
    del outs, o, side
    assert torch.cuda.memory_allocated() == before


def test_gpu_argument_errors(rng, bf16):
    p, t = cuda_problem(rng, bf16, lengths=[16])
    with pytest.raises(NotImplementedError, match="bfloat16"):  # valid, not served on the GPU
        flashkda.chunk_kda(t["q"].float(), t["k"].float(), t["v"].float(), t["g"], t["beta"])
    with pytest.raises(ValueError, match="A_log: is on cpu but q is on cuda"):
        chunk(p, t, A_log=t["A_log"].cpu())
    small = make_problem(rng, T=16, H=2, K=64, V=64, dtype=bf16)
    s = torch_problem(small, "cuda")
    with pytest.raises(NotImplementedError, match="K must be 128"):
        flashkda.chunk_kda(s["q"], s["k"], s["v"], s["g"], s["beta"])
