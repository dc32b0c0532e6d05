"""Calls into flashkda._C for arrays that the wrappers have already checked and laid out.

On CUDA tensors the work goes on torch's current stream with a workspace from torch's caching
allocator, taken for the call on that stream and given back when it returns (so it is reused by the
next call on the stream, without a cudaMalloc, and held by no stream that is gone); nothing here
synchronises the host, so the calls can be captured in a CUDA graph (during capture the workspace
comes from the graph's pool).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from . import _C
from ._arrays import TorchOps


class Preprocess(NamedTuple):
    """docs/SPEC.md §2 options, as flashkda._C takes them."""

    gate: str = "lower_bound"  # 'lower_bound' | 'softplus' | 'precomputed'
    A_log: object = None  # [H] float32
    dt_bias: object = None  # [H, K] or [H*K] float32
    lower_bound: float = -5.0
    l2norm_qk: bool = True
    beta_is_logit: bool = True
    scale: Optional[float] = None

    def ext_kwargs(self, ops):
        return dict(
            gate=self.gate,
            A_log=ops.to_ext(self.A_log),
            dt_bias=ops.to_ext(self.dt_bias),
            lower_bound=float(self.lower_bound),
            l2norm_qk=bool(self.l2norm_qk),
            beta_is_logit=bool(self.beta_is_logit),
            scale=None if self.scale is None else float(self.scale),
            u16_is_bf16=True,
        )


# The internal launch configuration (flashkda._internal.launch): empty = the launchers' own rules.
_config: dict = {}


def _workspace(torch, device, nbytes: int):
    # torch's allocator ties the block to the current stream (the call's); once freed it serves only
    # later allocations on that stream, which run after this call's kernels.
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _cuda_call(q, fn):
    """Run fn(stream_handle, torch) with q's device current; returns what fn returns."""
    import torch

    with torch.cuda.device(q.device):
        return fn(torch.cuda.current_stream(q.device).cuda_stream, torch)


def forward(ops, q, k, v, g, beta, out, pre: Preprocess, initial_state=None, final_state=None, cu_seqlens=None,
            precision="precise", serving=None):
    """flashkda::forward on checked, contiguous arrays; writes out and final_state ([N,H,V,K]).

    serving: flashkda._C.forward's serving-prefill arguments (state_pool, state_indices,
    has_initial_state, checkpoint_every, checkpoints, checkpoint_slots), written in place."""
    args = [ops.to_ext(x) for x in (q, k, v, g, beta, out)]
    kw = pre.ext_kwargs(ops)
    kw.update(initial_state=ops.to_ext(initial_state), final_state=ops.to_ext(final_state),
              cu_seqlens=ops.to_ext(cu_seqlens), precision=precision)
    for name, x in (serving or {}).items():
        kw[name] = x if name == "checkpoint_every" else ops.to_ext(x)
    kw.update(_config.get("prefill", {}))
    if ops is TorchOps and q.is_cuda:
        def run(stream, torch):
            _C.forward(*args, workspace_alloc=lambda nbytes: _workspace(torch, q.device, nbytes),
                       stream=stream, **kw)

        _cuda_call(q, run)
    else:
        _C.forward(*args, **kw)


def decode(ops, q, k, v, g, beta, out, state_pool, state_indices, pre: Preprocess, num_accepted_tokens=None,
           cu_seqlens=None, check_slots=True):
    """flashkda::decode on checked, contiguous arrays; updates state_pool ([P,H,V,K]) in place."""
    args = [ops.to_ext(x) for x in (q, k, v, g, beta, out, state_pool, state_indices)]
    kw = pre.ext_kwargs(ops)
    kw.update(num_accepted_tokens=ops.to_ext(num_accepted_tokens), cu_seqlens=ops.to_ext(cu_seqlens),
              check_slots=check_slots)
    kw.update(_config.get("decode", {}))
    if ops is TorchOps and q.is_cuda:
        _cuda_call(q, lambda stream, torch: _C.decode(*args, stream=stream, **kw))
    else:
        _C.decode(*args, **kw)
