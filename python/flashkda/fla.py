"""flashkda as a backend of fla 0.6's KDA ops: `import flashkda.fla` and fla's own calls run here.

    import flashkda.fla                      # registers the backend with fla's registry
    from fla.ops.kda import chunk_kda
    o, ht = chunk_kda(q, k, v, g, beta, ...)  # served by flashkda when it can be, else by fla

Registered (fla.backends.register, priority 2, ahead of fla's FlashKDA backend at 3):

- `fla.ops.kda.chunk_kda`: every call flashkda's chunk_kda computes (inference, bf16 or fp32 on the
  CPU, bf16 with K = V = 128 on a Hopper GPU, the lower-bound, softplus and precomputed gates,
  both state layouts, cu_seqlens);
- `fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd` (fla's public fused_recurrent_kda and the
  serving call vLLM makes): the same, plus the state pool through ssm_state_indices, speculative
  slots with num_accepted_tokens, in place or not.

Calls it cannot serve (autograd, per-channel beta, context parallelism, a GPU without the CUDA
backend, float16 gates, a lower_bound outside [-5, 0), use_graph's padded token buffers, ...) are
declined with a reason (fla logs it at INFO) and fla runs its own kernels. `FLA_FLASHKDA=0`
switches the backend off, as `FLA_FLASH_KDA=0` does fla's FlashKDA backend.
"""

from __future__ import annotations

import torch
from fla.backends import BaseBackend, register
from fla.ops.kda.chunk import chunk_kda as _fla_chunk_kda

import flashkda

__all__ = ["FlashkdaChunkBackend", "FlashkdaKDABackend"]

_FLOATS = (torch.bfloat16, torch.float32)


def _requires_grad(*xs):
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def _common_reason(q, k, v, g, beta, initial_state, A_log, dt_bias, use_gate_in_kernel, lower_bound):
    """Why flashkda cannot serve this call, or None. The reasons name what flashkda requires."""
    if _requires_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return "flashkda only supports inference (tensors require grad)"
    if q.dim() != 4 or v.dim() != 4:
        return f"flashkda requires 4-d q and v, got {q.dim()}-d and {v.dim()}-d"
    B, T, H, K = q.shape
    if v.shape[2] != H and (v.shape[2] < H or v.shape[2] % H != 0):
        return f"flashkda does not support GVA with HV={v.shape[2]}, H={H} (HV a multiple of H only)"
    H = v.shape[2]  # the value heads: dt_bias's, g's and beta's (grouped value heads repeat q and k)
    if beta.dim() != 3:
        return "flashkda does not support per-channel beta"
    V = v.shape[3]
    if q.is_cuda:
        if not (flashkda.built_with_cuda and flashkda.cuda_available()):
            return "flashkda's CUDA backend is not available (built without it, or no Hopper GPU)"
        if q.dtype != torch.bfloat16:
            return f"flashkda requires bfloat16 q, k, v on the GPU, got {q.dtype}"
        if K != 128 or V != 128:
            return f"flashkda requires K=V=128 on the GPU, got K={K}, V={V}"
    elif q.device.type != "cpu":
        return f"flashkda runs on cpu and cuda tensors, got {q.device}"
    elif q.dtype not in _FLOATS or K > 256 or V > 256:
        return f"flashkda requires bfloat16 or float32 and K, V <= 256 on the CPU, got {q.dtype}, K={K}, V={V}"
    if any(x.dtype != q.dtype for x in (k, v)):
        return "flashkda requires q, k and v of one dtype"
    if any(x.dtype not in _FLOATS for x in (g, beta)):
        return f"flashkda requires bfloat16 or float32 g and beta, got {g.dtype} and {beta.dtype}"
    if initial_state is not None and initial_state.dtype not in _FLOATS:
        return f"flashkda requires a bfloat16 or float32 initial_state, got {initial_state.dtype}"
    if use_gate_in_kernel and lower_bound is None and A_log is None:
        return "flashkda requires A_log for the softplus gate (use_gate_in_kernel without lower_bound)"
    if use_gate_in_kernel and lower_bound is not None and not -5.0 <= lower_bound < 0.0:
        return f"flashkda requires lower_bound in [-5, 0), got {lower_bound}"
    if use_gate_in_kernel and dt_bias is not None and dt_bias.numel() != H * K:
        return f"flashkda requires a per-channel dt_bias of H*K={H * K} elements, got {tuple(dt_bias.shape)}"
    return None


class _FlashkdaBackend(BaseBackend):
    """What both of flashkda's fla backends share: fla's switches and priority."""

    backend_type = "flashkda"
    package_name = "flashkda"
    env_var = "FLA_FLASHKDA"
    default_enable = True
    priority = 2


@register(_fla_chunk_kda)
class FlashkdaChunkBackend(_FlashkdaBackend):
    """fla's chunk_kda on flashkda's chunked forward (inference only)."""

    def chunk_kda_verifier(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                           return_intermediate_states=False, state_v_first=False, cu_seqlens=None,
                           cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None,
                           dt_bias=None, **kwargs):
        reason = _common_reason(q, k, v, g, beta, initial_state, A_log, dt_bias, use_gate_in_kernel, lower_bound)
        if reason is None and cp_context is not None:
            reason = "flashkda does not support context parallel"
        if reason is None and safe_gate and lower_bound is None:
            reason = "flashkda requires lower_bound with safe_gate=True"
        if reason is None and return_intermediate_states and kwargs.get("chunk_size", 64) != 64:
            reason = "flashkda returns intermediate states every 64 tokens only (chunk_size=64)"
        if reason is None and use_graph and cu_seqlens is not None:
            # fla's graph mode lets cu_seqlens end short of the token buffer (padding rows, left undefined);
            # flashkda requires cu_seqlens[-1] == B*T and refuses other calls (on the GPU by NaN outputs)
            cpu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens if not cu_seqlens.is_cuda else None
            if cpu is None:
                reason = ("flashkda requires cu_seqlens[-1] == B*T, which use_graph's padded buffers may break: "
                          "pass cu_seqlens_cpu for the check")
            elif int(cpu[-1]) != q.shape[0] * q.shape[1]:
                reason = (f"flashkda requires cu_seqlens[-1] == B*T={q.shape[0] * q.shape[1]} (no padded token "
                          f"buffers), got {int(cpu[-1])}")
        return reason is None, reason

    def chunk_kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, **kwargs):
        # fla's deprecated transpose_state_layout reaches backends unconverted (fla's chunk_kda maps it to
        # state_v_first after the dispatch): flashkda's chunk_kda converts it as fla does, and checks chunk_size
        fla_kwargs = {name: kwargs[name] for name in ("transpose_state_layout", "chunk_size") if name in kwargs}
        return flashkda.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  use_gate_in_kernel=use_gate_in_kernel,
                                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                  allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate,
                                  lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                  return_intermediate_states=return_intermediate_states, A_log=A_log,
                                  dt_bias=dt_bias, **fla_kwargs)


@register("kda")
class FlashkdaKDABackend(_FlashkdaBackend):
    """fla's fused_recurrent_kda_fwd (behind fla's fused_recurrent_kda and vLLM's serving call) on
    flashkda's decode kernels and, for longer inputs, its chunked forward."""

    def fused_recurrent_kda_fwd_verifier(self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
                                         scale=None, output_final_state=False, inplace_final_state=True,
                                         state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                                         num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                                         use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                         allow_neg_eigval=False, lower_bound=None, out=None, **kwargs):
        reason = _common_reason(q, k, v, g, beta, initial_state, A_log, dt_bias, use_gate_in_kernel, lower_bound)
        if reason is None and inplace_final_state and initial_state is None:
            reason = "flashkda requires initial_state (the pool) with inplace_final_state=True"
        if reason is None and not inplace_final_state and ssm_state_indices is not None:
            reason = "flashkda requires inplace_final_state=True with ssm_state_indices"
        if (reason is None and ssm_state_indices is not None and cu_seqlens is None and q.shape[1] > 16
                and (ssm_state_indices.dim() == 2 or num_accepted_tokens is not None)):
            reason = "flashkda takes at most 16 tokens per sequence with per-token slots"
        return reason is None, reason

    def fused_recurrent_kda_fwd(self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                                output_final_state=False, inplace_final_state=True, state_v_first=False,
                                cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None,
                                **kwargs):
        return flashkda.fused_recurrent_kda(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            # fla's kernel doubles beta only after its sigmoid (allow_neg_eigval alone is ignored there)
            allow_neg_eigval=allow_neg_eigval and use_beta_sigmoid_in_kernel,
            lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
            inplace_final_state=inplace_final_state, out=out)
