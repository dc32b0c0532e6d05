"""flashkda: Kimi Delta Attention (KDA) prefill and decode (docs/SPEC.md), on the CPU or a Hopper GPU.

Public functions (numpy arrays run on the CPU backend, bfloat16 through ml_dtypes; torch tensors run
where they live, CUDA on the current stream):

- chunk_kda(q, k, v, g, beta, ...)            fla's chunk_kda: returns (o, final_state)
- fwd(q, k, v, g, beta, scale, out, ...)      MoonshotAI FlashKDA's fwd: writes out/final_state
- fused_recurrent_kda(q, k, v, g, beta, ...)  fla's fused_recurrent_kda plus vLLM's state pool
- reference_forward(...)                      the fp64 token recurrence, for checking
- checkpoint_count(lengths, every)            how many checkpoints a serving prefill writes
- cuda_available(), version()

With torch installed the three are also torch.ops.flashkda.{chunk_kda, fwd, fused_recurrent_kda}
(custom ops: torch.compile and CUDA graphs see one node per call). Forward only: where autograd
records, a backward through chunk_kda's outputs raises RuntimeError (fla's chunk_kda trains).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import warnings

_WANT_TORCH = os.environ.get("FLASHKDA_NO_TORCH", "") in ("", "0") and importlib.util.find_spec("torch") is not None
if _WANT_TORCH:
    # torch first: loading the CUDA extension before torch's own CUDA libraries crashed the
    # interpreter on the H200 machine (`python -c "import flashkda"`); torch first is the order
    # every torch extension is tested in.
    try:
        import torch  # noqa: F401
    except Exception:  # pragma: no cover - a broken torch install must not break numpy use
        _WANT_TORCH = False

from . import _C, _impl  # noqa: E402
from ._arrays import is_torch, ops_for  # noqa: E402

__all__ = ["chunk_kda", "fwd", "fused_recurrent_kda", "reference_forward", "checkpoint_count", "cuda_available",
           "version", "built_with_cuda"]

__version__ = _C.version()
built_with_cuda = bool(_C.built_with_cuda)


def version() -> str:
    """Version of the C++ library behind this package."""
    return _C.version()


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a Hopper (sm_90) GPU is visible."""
    return bool(_C.cuda_available())


reference_forward = _impl.reference_forward
checkpoint_count = _impl.checkpoint_count

_torch_ops = None
if _WANT_TORCH:
    try:  # (not `from . import`: that would return the None bound above)
        _torch_ops = importlib.import_module("._torch_ops", __name__)
    except Exception as e:  # pragma: no cover - a broken torch install must not break numpy use
        warnings.warn(f"flashkda: torch custom ops not registered ({type(e).__name__}: {e})", stacklevel=2)
        _torch_ops = None


def _use_op(q) -> bool:
    """Route torch tensors through torch.ops.flashkda.* while torch.compile traces (one opaque
    node); eager calls run the same implementation directly, without the dispatcher's overhead."""
    if _torch_ops is None or not is_torch(q):
        return False
    import torch

    return torch.compiler.is_compiling()


# fla 0.6 options with nothing to do here (inference forward, one algorithm): accepted, ignored.
_IGNORED_KWARGS = ("chunk_size",)


def _fla_kwargs(fn_name, kwargs, state_v_first, return_intermediate_states=False):
    """fla's extra keyword arguments: the deprecated alias, the ignored ones, typos. chunk_kda's chunk_size
    changes nothing but the spacing of fla's intermediate states, which flashkda returns every 64 tokens:
    with return_intermediate_states another chunk_size raises NotImplementedError, not a differently
    spaced h. fused_recurrent_kda ignores chunk_size whatever its value, as fla's does."""
    kwargs = dict(kwargs)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    chunk_size = kwargs.get("chunk_size", 64) if fn_name == "chunk_kda" else 64
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size: must be 16, 32 or 64, got {chunk_size} (flashkda chooses its own chunk sizes)")
    if return_intermediate_states and chunk_size != 64:
        raise NotImplementedError(f"{fn_name}: return_intermediate_states with chunk_size={chunk_size}: flashkda "
                                  "returns fla's intermediate states every 64 tokens (chunk_size=64, fla's default)")
    for name in _IGNORED_KWARGS:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"{fn_name}: unexpected keyword argument(s) {', '.join(sorted(kwargs))}")
    return state_v_first


_NO_BACKWARD = None  # the autograd Function of _forward_only, made at its first use (torch is optional)


def _forward_only(fn_name, compute, fresh, inputs):
    """fla's chunk_kda is an autograd Function (fla trains with it); flashkda computes the forward only.
    Where autograd records (grad mode on and an input that requires grad: a model called outside
    torch.no_grad / inference_mode), compute() runs inside a node whose backward raises, so that a
    training step fails loudly instead of leaving q, k, v, g, beta, A_log and dt_bias without gradients;
    the outputs at the indices `fresh` (tensors the call made) come out of that node, the others (the
    caller's pool) as they are. Otherwise compute() runs as it is. Returns compute()'s tuple."""
    global _NO_BACKWARD
    import torch

    needs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] if torch.is_grad_enabled() else []
    if not needs:
        return compute()
    if _NO_BACKWARD is None:
        class NoBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, name, run, *needs):  # run(): the outputs the node gives out (made inside it)
                ctx.name = name
                return run()

            @staticmethod
            def backward(ctx, *grads):
                raise RuntimeError(f"flashkda.{ctx.name} computes the forward only (no backward): use fla's "
                                   f"{ctx.name} to train, or call it under torch.no_grad() / torch.inference_mode()")

        _NO_BACKWARD = NoBackward
    result = []

    def run():
        result.extend(compute())
        for i in fresh:  # views (fla's h in the [K, V] layout) as tensors of their own: a node's view
            # outputs may not be changed in place
            if i < len(result) and result[i] is not None and result[i]._base is not None:
                result[i] = result[i].clone()
        return tuple(x for i, x in enumerate(result) if i in fresh and x is not None)

    made = iter(_NO_BACKWARD.apply(fn_name, run, *needs))
    return tuple(next(made) if i in fresh and x is not None else x for i, x in enumerate(result))


def _not_supported(fn_name, **options):
    """fla options flashkda does not implement: NotImplementedError when one is set, never a silent misread."""
    for name, value in options.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"{fn_name}: {name}={value!r} is not supported by flashkda")


def _neg_eigval_beta(fn_name, beta, use_beta_sigmoid_in_kernel):
    """fla's allow_neg_eigval=True: beta = 2 sigmoid(raw beta), in (0, 2), so that a token's transition
    I - beta k k^T may have a negative eigenvalue. fla requires the raw beta then (the ValueError is
    fla's). Formed here in fp32 ([B, T, H], small beside q) and passed as beta itself, which every
    backend takes in fp32; returns it with use_beta_sigmoid_in_kernel=False (the kernels' own sigmoid
    is not used)."""
    if not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{fn_name}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    return 2 * ops_for(beta, "beta").sigmoid_f32(beta), False


def _grouped_value_heads(q, k, v):
    """fla's grouped value heads (GVA): v, g, beta, A_log, dt_bias and the states with HV heads, q and
    k with H, HV a multiple of H; value head hv reads q and k head hv // (HV / H). Served by repeating
    each q and k head HV / H times, side by side, before the call: the same recurrence, at HV / H
    times q's and k's memory (fla's own kernels read them in place)."""
    if (getattr(q, "ndim", 0) != 4 or getattr(k, "ndim", 0) != 4 or getattr(v, "ndim", 0) != 4
            or is_torch(q) != is_torch(k) or k.shape[2] != q.shape[2]):
        return q, k  # the usual type and shape errors
    H, HV = q.shape[2], v.shape[2]
    if HV == H or H == 0 or HV < H:
        return q, k
    if HV % H != 0:
        raise ValueError(f"v: grouped value heads need HV a multiple of H, got HV={HV}, H={H}")
    ops = ops_for(q)
    return ops.repeat_axis2(q, HV // H), ops.repeat_axis2(k, HV // H)


_PARAMS = {fn: tuple(inspect.signature(fn).parameters)[1:] for fn in (_impl.chunk_kda, _impl.fwd,
                                                                      _impl.fused_recurrent_kda)}


def _args(fn, **values) -> dict:
    """The arguments of _impl's fn (its parameters after ops) by name, checked against its signature,
    which is where each operation's argument list is defined (_torch_ops takes the custom op's
    schema from it): a name missing, extra or out of order raises TypeError at the first call. Passed
    as keywords rather than taken from locals(), which torch.compile (2.11) cannot trace."""
    if tuple(values) != _PARAMS[fn]:
        raise TypeError(f"{fn.__name__}: arguments {tuple(values)} do not match _impl's {_PARAMS[fn]}")
    return values


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None,
              precision="precise", state_pool=None, state_indices=None, has_initial_state=None,
              checkpoint_every=0, checkpoints=None, checkpoint_slots=None, **kwargs):
    """Chunked KDA forward with fla 0.6's `chunk_kda` semantics. Returns (o, final_state).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K]; beta: [B, T, H]. q, k, v bfloat16 or float32
    (float32 on the CPU only), g and beta either. o has q's dtype.

    - use_gate_in_kernel=False: g is the log-decay itself (<= 0). With True, g is the raw gate:
      `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` when lower_bound is set (A_log optional:
      None means `lower_bound * sigmoid(g + dt_bias)`), else `-exp(A_log) * softplus(g + dt_bias)`.
      A_log: [H]; dt_bias: [H*K] or [H, K]; both fp32. safe_gate=True requires lower_bound.
    - use_qk_l2norm_in_kernel: L2-normalise q and k; use_beta_sigmoid_in_kernel: beta is a logit.
    - scale: default K**-0.5.
    - initial_state: [N, H, K, V] ([N, H, V, K] with state_v_first=True), float32 or bfloat16.
      final_state (output_final_state=True): float32, same layout; otherwise None.
    - cu_seqlens: [N + 1] int32/int64 boundaries of N sequences packed along T (then B must be 1).
    - precision (flashkda's own): 'precise' (default), 'balanced' or 'fast', the GPU recurrence's
      mode: how its tensor-core operands are rounded. 'precise' keeps the errors at the bf16
      rounding of the output (fp16 state operands under a range guard, the rest split into bf16
      hi + lo); 'balanced' rounds the state to bf16 (no faster than 'precise' since fp16 state
      operands, up to 1.4x its error; kept for callers that name it), 'fast' splits nothing (about
      2x the output error, the shortest prefill; docs/BENCHMARKS.md). The CPU computes in fp32 in
      every mode.
    - return_intermediate_states=True (fla's): returns (o, final_state, h), h the state at the start
      of every 64-token chunk of every sequence, [B, NT, H, K, V] ([1, sum NT, ...] with cu_seqlens;
      V before K with state_v_first) in k's dtype, NT = ceil(T / 64). On CUDA tensors this reads the
      lengths on the host (a synchronisation, as fla's own does).

    Serving prefill (flashkda's own keywords, docs/SPEC.md §9):
    - state_pool [P, H, K, V] ([P, H, V, K] with state_v_first) with state_indices [N] int: sequence n
      starts from slot state_indices[n] (zeros where has_initial_state [N] bool is False) and its
      final state is written back there; a negative index marks padding (output zero, nothing read or
      written). Replaces initial_state; the second result is the pool, updated in place.
    - checkpoint_every (a multiple of 64): the state after every checkpoint_every tokens of each
      sequence, checkpoint_count(lengths, checkpoint_every) of them in sequence order, into
      checkpoints [C, H, K, V] (state layout; written in place, zeros for padding) or into the pool
      slots checkpoint_slots [C] (negative: not written). On the GPU a slot outside [0, P) is padding
      and a live slot named twice gives NaN outputs and leaves the pool unchanged (the indices stay
      on the device, so nothing is raised; on the CPU it raises ValueError naming both positions).

    The positional order is fla 0.6.0's; A_log, dt_bias and precision are keywords. fla options
    without effect here (disable_recompute, cu_seqlens_cpu, use_graph, max_num_seqs, chunk_size) are
    accepted, but cu_seqlens[-1] must equal the token count B*T (the padded token buffers fla's use_graph
    allows are refused: ValueError on the CPU, NaN outputs on the GPU); cp_context raises
    NotImplementedError when set. allow_neg_eigval=True (fla's, with
    use_beta_sigmoid_in_kernel=True) takes beta as 2 sigmoid(beta), formed in fp32 before the call.
    Grouped value heads (fla's GVA: v, g, beta, A_log, dt_bias and the states with HV heads, q and k
    with H, HV a multiple of H) repeat q's and k's heads before the call.
    """
    state_v_first = _fla_kwargs("chunk_kda", kwargs, state_v_first, return_intermediate_states)
    _not_supported("chunk_kda", cp_context=cp_context)
    q, k = _grouped_value_heads(q, k, v)
    if allow_neg_eigval:
        beta, use_beta_sigmoid_in_kernel = _neg_eigval_beta("chunk_kda", beta, use_beta_sigmoid_in_kernel)
    return_intermediate_states = bool(return_intermediate_states)
    args = _args(_impl.chunk_kda, q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
                 state_v_first=state_v_first, cu_seqlens=cu_seqlens, precision=precision, state_pool=state_pool,
                 state_indices=state_indices, has_initial_state=has_initial_state,
                 checkpoint_every=checkpoint_every, checkpoints=checkpoints, checkpoint_slots=checkpoint_slots,
                 return_intermediate_states=return_intermediate_states)
    if not _use_op(q):
        if not is_torch(q):
            return _impl.chunk_kda(ops_for(q), **args)
        return _chunk_kda_torch_eager(args)
    if return_intermediate_states:
        # h's shape depends on the sequence lengths, so no op's fake can give it: the call leaves the
        # compiled graph and runs eagerly (a graph break, as every fla chunk_kda call is: fla's is
        # torch.compiler.disable'd); under fullgraph=True that is torch's error, as with fla
        import torch

        return torch.compiler.disable(_chunk_kda_torch_eager)(args)
    o, ht = _torch_ops.chunk_kda(args)
    if state_pool is not None:
        return o, state_pool
    return o, (ht if output_final_state else None)


def _chunk_kda_torch_eager(args):
    """chunk_kda on torch tensors outside a compiled graph (forward only, _forward_only)."""
    q = args["q"]
    # the tensors the call makes: o, a final state (not the caller's pool, returned second), fla's h
    fresh = (0, 2) if args["state_pool"] is not None else (0, 1, 2)
    return _forward_only("chunk_kda", lambda: _impl.chunk_kda(ops_for(q), **args), fresh,
                         tuple(args[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")))


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None, precision="precise", *, state_pool=None, state_indices=None, has_initial_state=None,
        checkpoint_every=0, checkpoints=None, checkpoint_slots=None):
    """MoonshotAI FlashKDA's `flash_kda.fwd`: writes `out` (and `final_state`) in place, returns None.

    q, k, v, g: [B, T, H, K|V] bfloat16 (float32 also on the CPU); beta: [B, T, H] logits (sigmoid
    applied); gate `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` with A_log [H] fp32,
    dt_bias [H, K] fp32, lower_bound in [-5, 0); q and k are L2-normalised; out: [B, T, H, V].
    initial_state / final_state: [N, H, V, K] float32 or bfloat16 (None: zeros / not written); one
    tensor may be both (the states updated in place, with the bits of two tensors).
    cu_seqlens: [N + 1] int64 (or int32) with B = 1.
    precision (flashkda's own): 'precise' (default), 'balanced' or 'fast'; see chunk_kda.
    state_pool [P, H, V, K], state_indices, has_initial_state, checkpoint_every, checkpoints
    [C, H, V, K], checkpoint_slots (flashkda's own): the serving prefill of chunk_kda, in place of
    initial_state / final_state; layouts V before K as everywhere in fwd.
    """
    args = _args(_impl.fwd, q=q, k=k, v=v, g=g, beta=beta, scale=scale, out=out, A_log=A_log, dt_bias=dt_bias,
                 lower_bound=lower_bound, initial_state=initial_state, final_state=final_state,
                 cu_seqlens=cu_seqlens, precision=precision, state_pool=state_pool, state_indices=state_indices,
                 has_initial_state=has_initial_state, checkpoint_every=checkpoint_every, checkpoints=checkpoints,
                 checkpoint_slots=checkpoint_slots)
    if _use_op(q):
        _torch_ops.fwd(args)
    else:
        _impl.fwd(ops_for(q), **args)
    return None


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, *, ssm_state_indices=None, num_accepted_tokens=None,
                        inplace_final_state=None, out=None, check_slots=True, **kwargs):
    """Token-by-token KDA (decode), fla's `fused_recurrent_kda(_fwd)` semantics. Returns (out, final_state).

    Shapes and gate/beta/scale options as in chunk_kda; q: [N, T, H, K] (T = 1..16 tokens per step),
    or [1, total, H, K] with cu_seqlens.

    States (layout [., H, K, V], or [., H, V, K] with state_v_first=True):
    - inplace_final_state=False (the default without ssm_state_indices: fla 0.6's public
      fused_recurrent_kda): initial_state [N, ...] is only read; final_state is a new float32
      [N, ...] when output_final_state, else None.
    - inplace_final_state=True (the default with ssm_state_indices: the serving call of fla's
      fused_recurrent_kda_fwd as vLLM makes it): initial_state is a state pool [P, H, ., .] updated in place and returned as
      final_state. Sequence n reads and writes slot ssm_state_indices[n] (a negative index skips the
      sequence: nothing read or written, output zero), or slot n without indices. With 2-d
      ssm_state_indices [N, S] and num_accepted_tokens (speculative decoding) token t's state goes
      to slot ssm_state_indices[n, t] and the start state is read from
      ssm_state_indices[n, num_accepted_tokens[n] - 1]. Without initial_state the states start at
      zero and final_state is a new [N, ...] float32 tensor (when output_final_state). Two
      sequences may not name one live slot: on the CPU that raises ValueError naming both; on the
      GPU (indices on the device, no host sync) both sequences get NaN outputs and store nothing,
      their slots keep their contents, the other sequences run as usual (docs/SPEC.md §5); in a
      call longer than a decode step (the serving prefill through the pool) every output is NaN
      and no slot is written (§9).
    out: optional output buffer [.., V] of q's dtype, written in place.
    check_slots: False leaves out the GPU decode kernels' shared-slot check (0-12% of a decode step)
      for a caller that guarantees distinct live slots, as serving engines' slot allocators do; a
      shared slot's contents are then undefined. The CPU checks on the host either way, and inputs
      longer than a decode step (the serving prefill through the pool) are checked always.

    The positional order is fla 0.6.0's (allow_neg_eigval=True, with use_beta_sigmoid_in_kernel=True,
    takes beta as 2 sigmoid(beta), formed in fp32 before the call, as chunk_kda; grouped value heads
    repeat q's and k's heads, as chunk_kda); the serving arguments are keywords. The kernels keep
    states as [P, H, V, K]; with other layouts only the named slots are transposed around the call.
    Inputs longer than a decode step (T > 16, or host-side cu_seqlens with a longer sequence) run the
    chunked forward, which computes the same recurrence, also through a pool with 1-d
    ssm_state_indices.
    """
    state_v_first = _fla_kwargs("fused_recurrent_kda", kwargs, state_v_first)
    q, k = _grouped_value_heads(q, k, v)
    if allow_neg_eigval:
        beta, use_beta_sigmoid_in_kernel = _neg_eigval_beta("fused_recurrent_kda", beta, use_beta_sigmoid_in_kernel)
    if inplace_final_state is None:
        inplace_final_state = ssm_state_indices is not None
    use_op = _use_op(q)
    if use_op and out is None:  # the op writes the caller's buffer in place
        out = v.new_empty(v.shape, dtype=q.dtype)
    args = _args(_impl.fused_recurrent_kda, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                 initial_state=initial_state, output_final_state=output_final_state,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound,
                 state_v_first=state_v_first, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                 num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state, out=out,
                 check_slots=check_slots)
    if not use_op:
        return _impl.fused_recurrent_kda(ops_for(q), **args)
    ht = _torch_ops.fused_recurrent_kda(args)
    if inplace_final_state and initial_state is not None:
        return out, initial_state
    return out, (ht if output_final_state else None)
