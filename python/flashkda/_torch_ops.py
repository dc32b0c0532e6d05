"""PyTorch custom ops torch.ops.flashkda.{chunk_kda, fwd, fused_recurrent_kda}.

Registered with torch.library.custom_op so torch.compile treats each call as one opaque node (the
fake implementations give it output shapes) and records in-place writes (mutates_args). Imported by
flashkda/__init__.py only when torch is importable. The real work is _impl's, on torch tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _impl
from ._arrays import TorchOps


def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _no_state(q: Tensor) -> Tensor:
    """Stands for 'no final state': custom ops cannot return None."""
    return q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("flashkda::chunk_kda", mutates_args=("state_pool", "checkpoints"))
def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
              initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
              use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, safe_gate: bool,
              lower_bound: Optional[float], A_log: Optional[Tensor], dt_bias: Optional[Tensor],
              state_v_first: bool, cu_seqlens: Optional[Tensor], precision: str, state_pool: Optional[Tensor],
              state_indices: Optional[Tensor], has_initial_state: Optional[Tensor], checkpoint_every: int,
              checkpoints: Optional[Tensor], checkpoint_slots: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The pool and the checkpoints are written in place; the second output is the final state
    only when one is created here (output_final_state without a pool), else an empty tensor."""
    serving = _impl.Serving(state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints,
                            checkpoint_slots)
    o, ht = _impl.chunk_kda(TorchOps, q, k, v, g, beta, scale, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate,
                            lower_bound, A_log, dt_bias, state_v_first, cu_seqlens, precision, serving)
    return o, (_no_state(q) if ht is None or ht is state_pool else ht)


@chunk_kda.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
      use_beta_sigmoid_in_kernel, safe_gate, lower_bound, A_log, dt_bias, state_v_first, cu_seqlens, precision,
      state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints, checkpoint_slots):
    o = v.new_empty(v.shape, dtype=q.dtype)
    if not output_final_state or state_pool is not None:
        return o, _no_state(q)
    N, H, K, V = _num_seqs(q, cu_seqlens), q.shape[2], q.shape[3], v.shape[3]
    return o, q.new_empty((N, H, V, K) if state_v_first else (N, H, K, V), dtype=torch.float32)


@torch.library.custom_op("flashkda::fwd", mutates_args=("out", "final_state", "state_pool", "checkpoints"))
def fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, out: Tensor, A_log: Tensor,
        dt_bias: Optional[Tensor], lower_bound: float, initial_state: Optional[Tensor],
        final_state: Optional[Tensor], cu_seqlens: Optional[Tensor], precision: str, state_pool: Optional[Tensor],
        state_indices: Optional[Tensor], has_initial_state: Optional[Tensor], checkpoint_every: int,
        checkpoints: Optional[Tensor], checkpoint_slots: Optional[Tensor]) -> None:
    serving = _impl.Serving(state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints,
                            checkpoint_slots)
    _impl.fwd(TorchOps, q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
              cu_seqlens, precision, serving)


@fwd.register_fake
def _(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens, precision,
      state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints, checkpoint_slots):
    return None


@torch.library.custom_op("flashkda::fused_recurrent_kda", mutates_args=("initial_state", "out"))
def fused_recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                        dt_bias: Optional[Tensor], scale: Optional[float], initial_state: Optional[Tensor],
                        output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                        use_beta_sigmoid_in_kernel: bool, lower_bound: Optional[float], state_v_first: bool,
                        cu_seqlens: Optional[Tensor], ssm_state_indices: Optional[Tensor],
                        num_accepted_tokens: Optional[Tensor], inplace_final_state: bool, out: Tensor) -> Tensor:
    """Writes out (and the pool initial_state when inplace_final_state) in place; returns a new final
    state only when one is created here (not in place), else an empty tensor."""
    _, ht = _impl.fused_recurrent_kda(TorchOps, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                      use_beta_sigmoid_in_kernel, lower_bound, state_v_first, cu_seqlens,
                                      ssm_state_indices, num_accepted_tokens, inplace_final_state, out)
    if ht is None or ht is initial_state:
        return _no_state(q)
    return ht


@fused_recurrent_kda.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, state_v_first, cu_seqlens, ssm_state_indices,
      num_accepted_tokens, inplace_final_state, out):
    if not output_final_state or (inplace_final_state and initial_state is not None):
        return _no_state(q)
    N, H, K, V = _num_seqs(q, cu_seqlens), q.shape[2], q.shape[3], v.shape[3]
    return q.new_empty((N, H, V, K) if state_v_first else (N, H, K, V), dtype=torch.float32)
