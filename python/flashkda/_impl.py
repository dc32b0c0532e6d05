"""Eager implementations of the public functions, for numpy arrays and torch tensors alike.

Two paths, each making one call into flashkda._C (through _launch):
- direct: torch tensors already in the kernels' form (_in_kernel_form: contiguous, kernel dtypes,
  v-first states) go straight to the extension, whose C++ validation names any bad argument;
- checked: everything else is checked here as far as its conversion needs (messages name the
  argument), made contiguous, cast, and turned from fla's state layout [N, H, K, V] into the
  kernels' [N, H, V, K] and back; the values (lengths, slots, gate bounds) are still the C++
  validation's to judge.
The torch custom ops (_torch_ops.py) call these same functions.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

Array = object  # in annotations: an array of the call's kind (numpy, or torch: _torch_ops's schemas)

from . import _launch
from ._arrays import BF16, F32, I32, I64, NumpyOps, TorchOps, is_numpy, is_torch
from ._launch import Preprocess

_FLOATS = (BF16, F32)
MAX_DECODE_TOKENS = 16  # docs/SPEC.md §5: a decode step takes 1..16 tokens per sequence


class Serving(NamedTuple):
    """chunk_kda / fwd's serving-prefill keywords (flashkda's own), as the caller passed them."""

    state_pool: object = None
    state_indices: object = None
    has_initial_state: object = None
    checkpoint_every: int = 0
    checkpoints: object = None
    checkpoint_slots: object = None
    return_intermediate_states: bool = False  # fla's flag (chunk_kda only)

    def wanted(self) -> bool:
        return (any(x is not None for x in (self.state_pool, self.state_indices, self.has_initial_state,
                                            self.checkpoints, self.checkpoint_slots))
                or bool(self.checkpoint_every) or bool(self.return_intermediate_states))


def _shape(x):
    return list(x.shape)


def _type_name(x):
    return f"{type(x).__module__}.{type(x).__name__}"


def _require_array(ops, x, name):
    if not ops.is_array(x):
        raise TypeError(f"{name}: expected a {ops.name} array like q, got {_type_name(x)}")
    return x


def _same_device(ops, q, x, name):
    if ops is TorchOps and x.device != q.device:
        raise ValueError(f"{name}: is on {x.device} but q is on {q.device} (all tensors must share q's device)")


def _float_dtype(ops, x, name, allowed=_FLOATS):
    dt = ops.dtype_name(x)
    if dt not in allowed:
        raise ValueError(f"{name}: dtype {dt} is not supported (expected {' or '.join(allowed)})")
    return dt


def _qkvgb(ops, q, k, v, g, beta):
    """Checks q, k, v, g, beta ([B,T,H,K] x3 ... [B,T,H]) and returns them contiguous."""
    arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in arrays.items():
        _require_array(ops, x, name)
        _same_device(ops, q, x, name)
    if ops is TorchOps and q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: tensors on device {q.device} are not supported (expected cpu or cuda)")
    if q.ndim != 4:
        raise ValueError(f"q: expected a 4-d array [B, T, H, K], got shape {_shape(q)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        if v.ndim == 4 and tuple(v.shape[:2]) == (B, T) and v.shape[2] != H:
            raise ValueError(f"v: grouped value heads (HV={v.shape[2]} != H={H}) are not supported")
        raise ValueError(f"v: expected shape [B, T, H, V] = [{B}, {T}, {H}, V], got {_shape(v)}")
    for name, x, want in (("k", k, [B, T, H, K]), ("g", g, [B, T, H, K]), ("beta", beta, [B, T, H])):
        if _shape(x) != want:
            extra = ""
            if name == "beta" and _shape(x) == [B, T, H, v.shape[3]]:
                extra = " (per-channel beta [B, T, H, V] is not supported)"
            raise ValueError(f"{name}: expected shape {want}, got {_shape(x)}{extra}")
    dt = _float_dtype(ops, q, "q")
    for name, x in (("k", k), ("v", v)):
        if ops.dtype_name(x) != dt:
            raise ValueError(f"{name}: dtype {ops.dtype_name(x)} differs from q's {dt} (q, k, v share one dtype)")
    _float_dtype(ops, g, "g")
    _float_dtype(ops, beta, "beta")
    return [ops.aligned(ops.contiguous(x)) for x in (q, k, v, g, beta)]


def _cu_seqlens(ops, q, cu_seqlens):
    """cu_seqlens as a contiguous int32/int64 array of q's framework and device; returns (cu, N)."""
    if cu_seqlens is None:
        return None, q.shape[0]
    if ops is TorchOps or is_numpy(cu_seqlens) or isinstance(cu_seqlens, (list, tuple)):
        cu = ops.as_index_array(cu_seqlens, q, "cu_seqlens")
    else:
        raise TypeError(f"cu_seqlens: expected an integer array, got {_type_name(cu_seqlens)}")
    _same_device(ops, q, cu, "cu_seqlens")
    if ops.dtype_name(cu) not in (I32, I64):
        raise ValueError(f"cu_seqlens: dtype {ops.dtype_name(cu)} is not supported (expected int32 or int64)")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens: expected a 1-d array [N + 1], got shape {_shape(cu)}")
    if q.shape[0] != 1:
        raise ValueError(
            f"q: the batch size is expected to be 1 rather than {q.shape[0]} when using cu_seqlens "
            "(flatten the sequences into one)")
    return cu, cu.shape[0] - 1


def _param(ops, q, x, name, numel, shape):
    """A_log / dt_bias: any float array of q's framework with the right element count -> fp32 `shape`."""
    _require_array(ops, x, name)
    _same_device(ops, q, x, name)
    n = 1
    for s in x.shape:
        n *= s
    if n != numel:
        raise ValueError(f"{name}: expected {numel} elements (shape {list(shape)}), got shape {_shape(x)}")
    if tuple(x.shape) != tuple(shape):
        x = ops.contiguous(x).reshape(shape)
    return ops.aligned(ops.astype(x, F32))


def _gate(ops, q, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate=False):
    """fla's gate options -> (form, A_log [H] fp32, dt_bias [H,K] fp32, lower_bound)."""
    if not use_gate_in_kernel:
        return "precomputed", None, None, -5.0  # g is already the log-decay
    H, K = q.shape[2], q.shape[3]
    if safe_gate and lower_bound is None:
        raise ValueError("lower_bound: must be specified when safe_gate=True and use_gate_in_kernel=True")
    if lower_bound is not None:
        lower_bound = float(lower_bound)
        if not -5.0 <= lower_bound < 0.0:
            raise ValueError(f"lower_bound: must lie in [-5, 0), got {lower_bound}")
        form = "lower_bound"
        if A_log is None:
            # fla's form without A_log, lower_bound * sigmoid(g + dt_bias): exp(0) = 1.
            A_log = ops.zeros((H,), F32, q)
    else:
        form = "softplus"
        if A_log is None:
            raise ValueError("A_log: must be provided when use_gate_in_kernel=True and lower_bound is not set")
    A_log = _param(ops, q, A_log, "A_log", H, (H,))
    if dt_bias is not None:
        dt_bias = _param(ops, q, dt_bias, "dt_bias", H * K, (H, K))
    return form, A_log, dt_bias, (-5.0 if lower_bound is None else lower_bound)


def _checked_inputs(ops, q, k, v, g, beta, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                    safe_gate=False):
    """The checked path's common start: (q, k, v, g, beta) contiguous, (cu_seqlens, N), _gate's tuple."""
    arrays = _qkvgb(ops, q, k, v, g, beta)
    cu, N = _cu_seqlens(ops, arrays[0], cu_seqlens)
    return arrays, cu, N, _gate(ops, arrays[0], use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate)


def _state_in(ops, q, x, name, N, H, K, V, v_first, allow_larger_pool=False):
    """A state in the user's layout ([N,H,K,V], or [N,H,V,K] when v_first) -> contiguous [N,H,V,K]."""
    _require_array(ops, x, name)
    _same_device(ops, q, x, name)
    _float_dtype(ops, x, name)
    want = [N, H, V, K] if v_first else [N, H, K, V]
    got = _shape(x)
    ok = got == want or (allow_larger_pool and len(got) == 4 and got[1:] == want[1:] and got[0] >= N)
    if not ok:
        layout = "[N, H, V, K] (state_v_first=True)" if v_first else "[N, H, K, V]"
        lead = f"at least {N}" if allow_larger_pool else f"N={N}"
        raise ValueError(f"{name}: expected shape {layout} = {want} with {lead} states, got {got}")
    return ops.contiguous(x) if v_first else ops.swap_last2(x)


def _state_out(ops, x_vk, v_first):
    """[N,H,V,K] kernel state -> the user's layout."""
    return x_vk if v_first else ops.swap_last2(x_vk)


def _scale(scale):
    return None if scale is None else float(scale)


# ---- chunk_kda (fla semantics) ----------------------------------------------------------------


def _all_tensors(required, optional):
    Tensor = TorchOps.tensor_type()
    return (all(isinstance(x, Tensor) for x in required)
            and all(x is None or isinstance(x, Tensor) for x in optional))


def _in_kernel_form(q, data=(), params=(), indices=(), int32_only=()):
    """True when every tensor is already what flashkda._C takes as it is: contiguous, on q's device
    (16-byte aligned there when it is a GPU), data in bfloat16 / float32, A_log and dt_bias float32,
    indices int32 (cu_seqlens also int64). Then the direct paths make one call and its errors are
    the answer (the C++ validation names every bad shape and value); anything else takes the
    checked path, which converts what it can and names what it cannot. None entries are absent."""
    torch = __import__("torch")
    Tensor, device, cuda = torch.Tensor, q.device, q.is_cuda  # q's device once (each .device is a new object)
    groups = ((data, (torch.bfloat16, torch.float32)), (params, (torch.float32,)),
              (indices, (torch.int32, torch.int64)), (int32_only, (torch.int32,)))
    for tensors, dtypes in groups:
        for x in tensors:
            if x is None:
                continue
            if (not isinstance(x, Tensor) or x.dtype not in dtypes or x.device != device
                    or not x.is_contiguous() or (cuda and x.data_ptr() % 16)):
                return False
    return True


def _direct_gate(use_gate, lower_bound, safe_gate, A_log, dt_bias):
    """_gate's form for the direct paths: (form, lower_bound, A_log, dt_bias), or None where the
    checked path has work to do (a default A_log) or an error to name."""
    if not use_gate:
        return "precomputed", -5.0, None, None
    if A_log is None or (safe_gate and lower_bound is None):
        return None
    if lower_bound is not None:
        return "lower_bound", float(lower_bound), A_log, dt_bias
    return "softplus", -5.0, A_log, dt_bias


def _precision(precision):
    """The prefill precision mode ('precise', 'balanced' or 'fast'; flashkda::Precision), checked by name."""
    if precision not in ("precise", "balanced", "fast"):
        raise ValueError(f"precision: expected 'precise', 'balanced' or 'fast', got {precision!r}")
    return precision


def _chunk_kda_direct(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, use_gate, beta_sigmoid,
                      safe_gate, lower_bound, A_log, dt_bias, state_v_first, cu_seqlens, precision):
    """chunk_kda's fast path for torch tensors already in the kernels' layout (states absent or
    [N, H, V, K]): flashkda._C checks shapes, dtypes, devices, contiguity and values itself
    (ValueError, before any work). Returns None when it refuses or the call needs the checked
    path's layout work (transposed states, a default A_log, casts)."""
    gate = _direct_gate(use_gate, lower_bound, safe_gate, A_log, dt_bias)
    if gate is None or (initial_state is not None and not state_v_first):
        return None
    form, lb, A_log, dt_bias = gate
    if not _all_tensors((q, k, v, g, beta), (A_log, dt_bias, initial_state, cu_seqlens)):
        return None
    if not _in_kernel_form(q, (q, k, v, g, beta, initial_state), (A_log, dt_bias), (cu_seqlens,)):
        return None
    if q.dim() != 4 or v.dim() != 4 or (cu_seqlens is not None and cu_seqlens.dim() != 1):
        return None
    if A_log is not None and A_log.dim() != 1:
        return None  # the checked path reshapes it
    if cu_seqlens is not None and cu_seqlens.shape[0] < 1:
        return None  # the checked path names it (the final state below is sized from it)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    out = TorchOps.empty(tuple(v.shape), TorchOps.dtype_name(q), q)
    ht = TorchOps.empty((N, H, V, K), F32, q) if output_final_state else None
    pre = Preprocess(form, A_log, dt_bias, lb, bool(l2norm), bool(beta_sigmoid), _scale(scale))
    _launch.forward(TorchOps, q, k, v, g, beta, out, pre, initial_state=initial_state, final_state=ht,
                    cu_seqlens=cu_seqlens, precision=precision)
    return out, (None if ht is None else _state_out(TorchOps, ht, state_v_first))


# The argument lists of chunk_kda, fwd and fused_recurrent_kda below are the one written list of each
# operation's arguments: the torch custom ops (_torch_ops.py) take their schemas from these
# signatures (the annotations name the types), and the public functions (__init__.py) call these
# by keyword.


def chunk_kda(ops, q: Array, k: Array, v: Array, g: Array, beta: Array, scale: Optional[float] = None,
              initial_state: Optional[Array] = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, safe_gate: bool = False,
              lower_bound: Optional[float] = None, A_log: Optional[Array] = None,
              dt_bias: Optional[Array] = None, state_v_first: bool = False, cu_seqlens: Optional[Array] = None,
              precision: str = "precise", state_pool: Optional[Array] = None,
              state_indices: Optional[Array] = None, has_initial_state: Optional[Array] = None,
              checkpoint_every: int = 0, checkpoints: Optional[Array] = None,
              checkpoint_slots: Optional[Array] = None, return_intermediate_states: bool = False):
    """Returns (o, final_state), (o, state_pool) with a pool, and fla's h third with
    return_intermediate_states."""
    precision = _precision(precision)
    serving = Serving(state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints, checkpoint_slots,
                      bool(return_intermediate_states))
    if ops is TorchOps and not serving.wanted():
        res = _chunk_kda_direct(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate, lower_bound, A_log,
                                dt_bias, state_v_first, cu_seqlens, precision)
        if res is not None:
            return res
    (q, k, v, g, beta), cu, N, (form, A_log, dt_bias, lb) = _checked_inputs(
        ops, q, k, v, g, beta, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate)
    B, T, H, K = q.shape
    V = v.shape[3]
    h0 = None if initial_state is None else _state_in(ops, q, initial_state, "initial_state", N, H, K, V,
                                                       state_v_first)
    out = ops.empty(tuple(v.shape), ops.dtype_name(q), q)
    pool = serving.state_pool
    if pool is not None and initial_state is not None:
        raise ValueError("initial_state: pass either initial_state or state_pool (the pool holds the initial states)")
    ht = ops.empty((N, H, V, K), F32, q) if output_final_state and pool is None else None
    pre = Preprocess(form, A_log, dt_bias, lb, bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel),
                     _scale(scale))
    if not serving.wanted():
        _launch.forward(ops, q, k, v, g, beta, out, pre, initial_state=h0, final_state=ht, cu_seqlens=cu,
                        precision=precision)
        return out, (None if ht is None else _state_out(ops, ht, state_v_first))
    h = _serving_prefill(ops, q, k, v, g, beta, out, pre, cu, N, H, K, V, state_v_first, precision, serving,
                         h0=h0, ht=ht)
    second = pool if pool is not None else (None if ht is None else _state_out(ops, ht, state_v_first))
    return (out, second, h) if serving.return_intermediate_states else (out, second)


# ---- fwd (MoonshotAI FlashKDA semantics) --------------------------------------------------------


def _inplace_target(ops, q, x, name, want, dtypes):
    _require_array(ops, x, name)
    _same_device(ops, q, x, name)
    if _shape(x) != want:
        raise ValueError(f"{name}: expected shape {want}, got {_shape(x)}")
    _float_dtype(ops, x, name, dtypes)
    if not ops.is_contiguous(x):
        raise ValueError(f"{name}: must be contiguous (it is written in place)")
    return x


def _fwd_direct(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
                precision):
    """fwd's fast path for torch tensors already in the kernels' layout: flashkda._C checks every
    shape, dtype, device, contiguity and value itself (ValueError, before any work), so the
    Python checks below only need to run when it refuses. Returns False then."""
    if not _all_tensors((q, k, v, g, beta, out, A_log), (dt_bias, initial_state, final_state, cu_seqlens)):
        return False
    if not _in_kernel_form(q, (q, k, v, g, beta, out, initial_state, final_state), (A_log, dt_bias), (cu_seqlens,)):
        return False  # the checked path makes the layout (casts, copies) or names the problem
    if A_log.dim() != 1:
        return False
    pre = Preprocess("lower_bound", A_log, dt_bias, float(lower_bound), True, True, float(scale))
    _launch.forward(TorchOps, q, k, v, g, beta, out, pre, initial_state=initial_state, final_state=final_state,
                    cu_seqlens=cu_seqlens, precision=precision)
    return True


def fwd(ops, q: Array, k: Array, v: Array, g: Array, beta: Array, scale: float, out: Array,
        A_log: Array, dt_bias: Optional[Array], lower_bound: float, initial_state: Optional[Array] = None,
        final_state: Optional[Array] = None, cu_seqlens: Optional[Array] = None, precision: str = "precise",
        state_pool: Optional[Array] = None, state_indices: Optional[Array] = None,
        has_initial_state: Optional[Array] = None, checkpoint_every: int = 0,
        checkpoints: Optional[Array] = None, checkpoint_slots: Optional[Array] = None):
    precision = _precision(precision)
    serving = Serving(state_pool, state_indices, has_initial_state, checkpoint_every, checkpoints, checkpoint_slots)
    if (ops is TorchOps and not serving.wanted() and scale is not None and lower_bound is not None and A_log is not None
            and _fwd_direct(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                            cu_seqlens, precision)):
        return
    q, k, v, g, beta = _qkvgb(ops, q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[3]
    cu, N = _cu_seqlens(ops, q, cu_seqlens)
    if scale is None:
        raise ValueError("scale: required (FlashKDA's fwd takes it explicitly; K**-0.5 is the usual value)")
    if A_log is None:
        raise ValueError("A_log: required ([H] float32)")
    if lower_bound is None:
        raise ValueError("lower_bound: required (a float in [-5, 0))")
    form, A_log, dt_bias, lb = _gate(ops, q, True, A_log, dt_bias, lower_bound)
    _inplace_target(ops, q, out, "out", [B, T, H, V], (ops.dtype_name(q),))
    h0 = None if initial_state is None else _state_in(ops, q, initial_state, "initial_state", N, H, K, V, True)
    if final_state is not None:
        _inplace_target(ops, q, final_state, "final_state", [N, H, V, K], _FLOATS)
    pre = Preprocess(form, A_log, dt_bias, lb, True, True, float(scale))
    if serving.wanted():
        if serving.state_pool is not None and (initial_state is not None or final_state is not None):
            raise ValueError("state_pool: replaces initial_state and final_state (the pool holds both)")
        _serving_prefill(ops, q, k, v, g, beta, out, pre, cu, N, H, K, V, True, precision, serving, h0=h0,
                         ht=final_state)
        return
    _launch.forward(ops, q, k, v, g, beta, out, pre, initial_state=h0, final_state=final_state, cu_seqlens=cu,
                    precision=precision)


# ---- fused_recurrent_kda (fla semantics, serving extensions of fused_recurrent_kda_fwd) ------------


def _long_sequences(ops, T, cu, N):
    """True when some sequence is known (without a device sync) to lie outside decode's 1..16 tokens."""
    if cu is None:
        return T == 0 or T > MAX_DECODE_TOKENS
    if ops.host_values(cu) is None:  # device cu_seqlens: decode validates what it can
        return False
    return any(n == 0 or n > MAX_DECODE_TOKENS for n in _host_lengths(ops, cu, N, T))


def _decode_direct(q, k, v, g, beta, A_log, dt_bias, scale, pool, l2norm, use_gate, beta_sigmoid, lower_bound,
                   cu_seqlens, idx, acc, out, check_slots):
    """The serving call's fast path (torch tensors, a [P, H, V, K] pool updated in place through
    int32 indices): flashkda._C checks every shape, dtype, device and contiguity before any work.
    Returns None when it refuses or the call needs the checked path's conversions."""
    gate = _direct_gate(use_gate, lower_bound, False, A_log, dt_bias)
    if gate is None or not _all_tensors((q, k, v, g, beta, pool, idx), (A_log, dt_bias, cu_seqlens, acc, out)):
        return None
    if q.dim() != 4 or (cu_seqlens is not None and cu_seqlens.dim() != 1):
        return None
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if pool.dim() != 4 or idx.dim() == 0 or idx.shape[0] != N:
        return None  # the checked path names the pool's shape, and ssm_state_indices by that name
    if not _in_kernel_form(q, (q, k, v, g, beta, pool, out), (A_log, dt_bias), (cu_seqlens,), (idx, acc)):
        return None  # the checked path converts (int64 indices, casts, copies) or names the problem
    if A_log is not None and A_log.dim() != 1:
        return None
    if _long_sequences(TorchOps, q.shape[1], cu_seqlens, N):
        return None  # longer than a decode step: the checked path runs the chunked forward
    form, lb, A_log, dt_bias = gate
    if out is None:
        out = TorchOps.empty(tuple(v.shape), TorchOps.dtype_name(q), q)
    pre = Preprocess(form, A_log, dt_bias, lb, bool(l2norm), bool(beta_sigmoid), _scale(scale))
    _launch.decode(TorchOps, q, k, v, g, beta, out, pool, idx, pre, num_accepted_tokens=acc, cu_seqlens=cu_seqlens,
                   check_slots=check_slots)
    return out, pool


_INT32_MAX = 2**31 - 1


def _slot_indices(ops, x, q, N, name="ssm_state_indices"):
    """ssm_state_indices as int32 [N] or [N, S]. int64 values outside int32 become padding (negative)
    or INT32_MAX (past any pool: refused on the CPU, skipped on the GPU) instead of wrapping."""
    idx = ops.as_index_array(x, q, name)
    _same_device(ops, q, idx, name)
    if ops.dtype_name(idx) not in (I32, I64) or idx.ndim not in (1, 2) or idx.shape[0] != N:
        raise ValueError(f"{name}: expected an int32 or int64 array [N] or [N, S] with N={N}, "
                         f"got shape {_shape(idx)} {ops.dtype_name(idx)}")
    if ops.dtype_name(idx) == I64:
        idx = ops.astype(ops.where(idx < 0, -1, ops.where(idx > _INT32_MAX, _INT32_MAX, idx)), I32)
    return ops.contiguous(idx)


def _gather_slots(ops, q, pool, idx, state_v_first, keep_repeats=False):
    """The named slots of a user pool ([P, H, ., .], any layout) as a contiguous [n, H, V, K] pool,
    with indices into it; padding entries stay negative. Copies n = idx.size slots, not the pool.
    keep_repeats: entries naming one slot get one index (its first entry's), so that the kernels
    see the repeat (and refuse the call, leaving the copy and hence the pool as they were)."""
    flat = idx.reshape(-1)
    n = flat.shape[0]
    rows = ops.where(flat >= 0, flat, 0)
    sub = ops.take_rows(pool, rows)
    sub = ops.contiguous(sub) if state_v_first else ops.swap_last2(sub)
    local = ops.where(flat >= 0, ops.first_equal(flat) if keep_repeats else ops.arange_i32(n, q), -1)
    return sub, ops.astype(local, I32).reshape(tuple(idx.shape))


def _scatter_slots(ops, pool, idx, sub, state_v_first, local=None):
    """Writes the live rows of sub back to their slots of the user pool; padding entries write
    nothing. Each padding row is sent to the first live entry's slot with that entry's values, so
    every slot receives one value however the rows are ordered (with no live entry, slot 0 its own
    unchanged copy). local: the gathered indices (_gather_slots with keep_repeats), whose row of
    sub each entry takes, so that entries naming one slot all write the row the kernel wrote."""
    flat = idx.reshape(-1)
    live = flat >= 0
    first = ops.first_true(live)
    target = ops.where(live, flat, ops.where(flat[first] >= 0, flat[first], 0))
    rows = ops.arange_i32(flat.shape[0], sub) if local is None else local.reshape(-1)
    source = ops.where(live, rows, ops.where(flat[first] >= 0, rows[first], first))
    values = ops.take_rows(sub, source)
    ops.put_rows_(pool, target, values if state_v_first else ops.swap_last2(values))


def fused_recurrent_kda(ops, q: Array, k: Array, v: Array, g: Array, beta: Array,
                        A_log: Optional[Array] = None, dt_bias: Optional[Array] = None,
                        scale: Optional[float] = None, initial_state: Optional[Array] = None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                        lower_bound: Optional[float] = None, state_v_first: bool = False,
                        cu_seqlens: Optional[Array] = None, ssm_state_indices: Optional[Array] = None,
                        num_accepted_tokens: Optional[Array] = None, inplace_final_state: bool = False,
                        out: Optional[Array] = None, check_slots: bool = True):
    """Returns (out, final_state); see flashkda.fused_recurrent_kda for the state semantics."""
    if (ops is TorchOps and inplace_final_state and state_v_first and initial_state is not None
            and ssm_state_indices is not None):
        res = _decode_direct(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, use_qk_l2norm_in_kernel,
                             use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, cu_seqlens,
                             ssm_state_indices, num_accepted_tokens, out, bool(check_slots))
        if res is not None:
            return res
    (q, k, v, g, beta), cu, N, (form, A_log, dt_bias, lb) = _checked_inputs(
        ops, q, k, v, g, beta, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    B, T, H, K = q.shape
    V = v.shape[3]
    pre = Preprocess(form, A_log, dt_bias, lb, bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel),
                     _scale(scale))

    # out: the caller's buffer when given (written in place), else a new one.
    if out is None:
        out = ops.empty(tuple(v.shape), ops.dtype_name(q), q)
    else:
        _require_array(ops, out, "out")
        _same_device(ops, q, out, "out")
        if _shape(out) != _shape(v) or ops.dtype_name(out) != ops.dtype_name(q):
            raise ValueError(f"out: expected shape {_shape(v)} and dtype {ops.dtype_name(q)}, "
                             f"got {_shape(out)} {ops.dtype_name(out)}")
    out_c = out if ops.is_contiguous(out) else ops.empty(tuple(v.shape), ops.dtype_name(q), q)

    # Slot indices into the pool.
    idx = acc = None
    if ssm_state_indices is not None:
        idx = _slot_indices(ops, ssm_state_indices, q, N)
    if num_accepted_tokens is not None:
        if idx is None:
            raise ValueError("num_accepted_tokens: needs ssm_state_indices (the slots of each token's state)")
        acc = ops.as_index_array(num_accepted_tokens, q, "num_accepted_tokens")
        _same_device(ops, q, acc, "num_accepted_tokens")
        if ops.dtype_name(acc) not in (I32, I64) or _shape(acc) != [N]:
            raise ValueError(f"num_accepted_tokens: expected an integer array [{N}], got shape {_shape(acc)}")
        acc = ops.astype(acc, I32)
    long_steps = _long_sequences(ops, T, cu, N)
    if idx is not None and long_steps and (idx.ndim == 2 and idx.shape[1] > 1 or acc is not None):
        raise ValueError("ssm_state_indices: per-token slots (speculative decoding) take at most "
                         f"{MAX_DECODE_TOKENS} tokens per sequence; for a longer prefill through the pool "
                         "pass 1-d ssm_state_indices")

    # The pool the kernel updates: [P, H, V, K], contiguous. A user pool in another layout (or not
    # contiguous) is read and written back through its named slots only.
    user_pool = None  # the caller's pool, updated in place
    gathered = False  # pool holds copies of the named slots (indices remapped)
    user_idx = idx
    if inplace_final_state:
        if initial_state is None:
            if idx is not None:
                raise ValueError("initial_state: the state pool is required with ssm_state_indices")
            pool = ops.zeros((N, H, V, K), F32, q)
        else:
            user_pool = initial_state
            _require_array(ops, user_pool, "initial_state")
            _same_device(ops, q, user_pool, "initial_state")
            _float_dtype(ops, user_pool, "initial_state")
            inner = [H, V, K] if state_v_first else [H, K, V]
            got = _shape(user_pool)
            least = 1 if idx is not None else N  # with indices the slots say where; padding needs none
            if len(got) != 4 or got[1:] != inner or got[0] < least:
                layout = "[P, H, V, K] (state_v_first=True)" if state_v_first else "[P, H, K, V]"
                raise ValueError(f"initial_state: expected a state pool {layout} with [H, ., .] = {inner} and "
                                 f"P >= {least}, got shape {got}")
            if idx is None:
                idx = ops.arange_i32(N, q)
                user_idx = idx
            if state_v_first and ops.is_contiguous(user_pool):
                pool = user_pool
            else:
                P = _shape(user_pool)[0]
                if ops.is_cuda(q):  # the kernel's rule, without reading the slots: outside [0, P) is padding
                    idx = ops.where(idx < P, idx, -1)
                else:  # the C++ rule on the caller's slots: the gathered copy's indices no longer show it
                    from . import _C

                    _C._check_decode_slots(ops.to_ext(idx), None if acc is None else ops.to_ext(acc),
                                           None if cu is None else ops.to_ext(cu), T, P)
                user_idx = idx
                pool, idx = _gather_slots(ops, q, user_pool, idx, state_v_first, keep_repeats=True)
                gathered = True
    else:
        if idx is not None:
            raise ValueError("inplace_final_state: False with ssm_state_indices (per-token state outputs) "
                             "is not supported; use inplace_final_state=True")
        pool = ops.zeros((N, H, V, K), F32, q)
        if initial_state is not None:
            ops.copy_(pool, _state_in(ops, q, initial_state, "initial_state", N, H, K, V, state_v_first))

    if long_steps:
        # Longer than a decode step: the chunked forward computes the same recurrence, from and into
        # each sequence's slot: the slot n without indices, else the serving prefill on the pool
        # (SPEC §9: padding entries read and write nothing and output zeros; two sequences naming
        # one live slot are refused by name on the CPU, NaN outputs and an untouched pool on the GPU).
        if idx is None:
            ht = ops.empty((N, H, V, K), ops.dtype_name(pool), q)
            _launch.forward(ops, q, k, v, g, beta, out_c, pre, initial_state=ops.contiguous(pool[:N]),
                            final_state=ht, cu_seqlens=cu)
            ops.copy_(pool[:N], ht)
        else:
            _launch.forward(ops, q, k, v, g, beta, out_c, pre, cu_seqlens=cu,
                            serving=dict(state_pool=pool, state_indices=ops.contiguous(idx.reshape(-1))))
    else:
        if idx is None:
            idx = ops.arange_i32(N, q)
        _launch.decode(ops, q, k, v, g, beta, out_c, pool, idx, pre, num_accepted_tokens=acc, cu_seqlens=cu,
                       check_slots=bool(check_slots))

    if out_c is not out:
        ops.copy_(out, out_c)
    if user_pool is not None:
        if gathered:
            _scatter_slots(ops, user_pool, user_idx, pool, state_v_first, local=idx)
        return out, user_pool
    if output_final_state:
        return out, _state_out(ops, pool, state_v_first)
    return out, None


# ---- serving prefill (docs/SPEC.md §9): state pools, checkpoints, fla's intermediate states ---------

FLA_STATE_EVERY = 64  # fla's return_intermediate_states: the state at the start of every 64-token chunk


def checkpoint_count(seq_lens, checkpoint_every):
    """How many checkpoints a prefill writes: sum over the sequences of length // checkpoint_every."""
    every = int(checkpoint_every)
    if every <= 0 or every % 64:
        raise ValueError(f"checkpoint_every: must be a positive multiple of 64, got {checkpoint_every}")
    return sum(int(n) // every for n in seq_lens)


def _host_lengths(ops, cu, N, T, sync=False):
    """Sequence lengths on the host (cu_seqlens on the CPU, or N sequences of T tokens); None where
    reading device cu_seqlens would synchronise, unless sync."""
    if cu is None:
        return [T] * N
    host = ops.host_values(cu, sync)
    if host is None:
        return None
    return [int(host[n + 1]) - int(host[n]) for n in range(N)]


def _initial_rows(ops, q, pool, idx, has, N, H, K, V, state_v_first):
    """The initial states the pool gives each sequence, [N, H, V, K] in the pool's dtype: its slot
    (zeros for padding, a slot outside [0, P) included, or where has_initial_state is False)."""
    live = (idx >= 0) & (idx < pool.shape[0])
    rows = ops.take_rows(pool, ops.where(live, idx, 0))
    rows = ops.contiguous(rows) if state_v_first else ops.swap_last2(rows)
    read = live if has is None else live & has
    return ops.where(read.reshape((N, 1, 1, 1)), rows, ops.zeros((N, H, V, K), ops.dtype_name(pool), q))


def _pool_shape_check(ops, q, pool, H, K, V, state_v_first):
    _require_array(ops, pool, "state_pool")
    _same_device(ops, q, pool, "state_pool")
    _float_dtype(ops, pool, "state_pool")
    inner = [H, V, K] if state_v_first else [H, K, V]
    if pool.ndim != 4 or _shape(pool)[1:] != inner:
        layout = "[P, H, V, K] (state_v_first=True)" if state_v_first else "[P, H, K, V]"
        raise ValueError(f"state_pool: expected a pool {layout} with [H, ., .] = {inner}, got {_shape(pool)}")


def _serving_prefill(ops, q, k, v, g, beta, out, pre, cu, N, H, K, V, state_v_first, precision, sv: Serving,
                     h0=None, ht=None):
    """One prefill with the serving keywords. h0 / ht: the plain initial / final states ([N,H,V,K],
    without a pool). Writes out, the pool and the checkpoints in place; returns fla's intermediate
    states h when sv.return_intermediate_states, else None."""
    every = int(sv.checkpoint_every or 0)
    fla_h = bool(sv.return_intermediate_states)
    if fla_h and (every or sv.checkpoints is not None or sv.checkpoint_slots is not None):
        raise ValueError("return_intermediate_states: fla's states every 64 tokens; it does not combine with "
                         "checkpoint_every / checkpoints / checkpoint_slots")
    pool = sv.state_pool
    if pool is not None:
        _pool_shape_check(ops, q, pool, H, K, V, state_v_first)
        if sv.state_indices is None:
            raise ValueError("state_indices: required with state_pool (the slot of each sequence, [N] int32)")
    idx = None if sv.state_indices is None else _slot_indices(ops, sv.state_indices, q, N, "state_indices")
    if idx is not None and idx.ndim != 1:  # the GPU path and the gathered copy index with it directly
        raise ValueError(f"state_indices: expected a 1-d array [N] with N={N}, got shape {_shape(idx)}")
    has = None if sv.has_initial_state is None else ops.as_flags(sv.has_initial_state, q)
    if has is not None and _shape(has) != [N]:
        raise ValueError(f"has_initial_state: expected a bool array [N] with N={N}, got shape {_shape(has)}")
    ck_slots = None
    if sv.checkpoint_slots is not None:
        n_ck = len(sv.checkpoint_slots) if isinstance(sv.checkpoint_slots, (list, tuple)) else sv.checkpoint_slots.shape[0]
        ck_slots = _slot_indices(ops, sv.checkpoint_slots, q, n_ck, "checkpoint_slots")
        if ck_slots.ndim != 1:
            raise ValueError(f"checkpoint_slots: expected a 1-d array [num_checkpoints], got shape {_shape(ck_slots)}")

    # The pool (or a copy of its named slots in the kernels' layout) goes to the C++ call, on either
    # backend. On the GPU nothing here reads the indices on the host (no synchronisation), except
    # fla's return_intermediate_states, whose layout needs the lengths.
    if fla_h:
        lengths = _host_lengths(ops, cu, N, q.shape[1], sync=True)  # fla's layout needs them (as fla does)
        every = FLA_STATE_EVERY
        ck_vk = ops.empty((sum(n // every for n in lengths), H, V, K), ops.dtype_name(q), q)
        if pool is not None:
            first_states = _initial_rows(ops, q, pool, idx, has, N, H, K, V, state_v_first)
        else:
            first_states = h0 if h0 is not None else ops.zeros((N, H, V, K), F32, q)
    else:
        ck_user = sv.checkpoints
        ck_vk = ck_user
        if ck_user is not None:
            _require_array(ops, ck_user, "checkpoints")
            _same_device(ops, q, ck_user, "checkpoints")
            if ck_user.ndim != 4:
                raise ValueError(f"checkpoints: expected [num_checkpoints, H, ., .], got shape {_shape(ck_user)}")
            if not state_v_first or not ops.is_contiguous(ck_user):
                ck_vk = ops.empty((ck_user.shape[0], H, V, K), ops.dtype_name(ck_user), q)
    native_pool, native_idx, native_ck_slots, gathered = pool, idx, ck_slots, None
    if pool is not None and not (state_v_first and ops.is_contiguous(pool)):
        named = idx if ck_slots is None else ops.concat([idx, ck_slots])
        if ops.is_cuda(q):  # the kernels' rule, without reading the slots: outside [0, P) is padding
            named = ops.where(named < pool.shape[0], named, -1)
        else:  # the C++ rule on the caller's slots: the gathered copy's indices no longer show it
            from . import _C

            _C._check_pool_slots(ops.to_ext(idx), None if ck_slots is None else ops.to_ext(ck_slots), pool.shape[0])
        native_pool, local = _gather_slots(ops, q, pool, named, state_v_first, keep_repeats=ops.is_cuda(q))
        native_idx = local[:N]
        native_ck_slots = None if ck_slots is None else ops.contiguous(local[N:])
        gathered = named
    serving = dict(state_pool=native_pool, state_indices=native_idx, has_initial_state=has, checkpoint_every=every,
                   checkpoints=ck_vk, checkpoint_slots=native_ck_slots)
    _launch.forward(ops, q, k, v, g, beta, out, pre, initial_state=h0, final_state=ht, cu_seqlens=cu,
                    precision=precision, serving={n: x for n, x in serving.items() if x is not None})
    if gathered is not None:
        _scatter_slots(ops, pool, gathered, native_pool, state_v_first)
    if not fla_h:
        if ck_vk is not sv.checkpoints:
            ops.copy_(sv.checkpoints, ck_vk if state_v_first else ops.swap_last2_view(ck_vk))
        return None
    return _fla_intermediate_states(ops, q, first_states, ck_vk, lengths, cu is not None, state_v_first)


def _fla_intermediate_states(ops, q, first_states, checkpoints, lengths, varlen, state_v_first):
    """fla's h: the state at the start of every 64-token chunk of every sequence ([B, NT, H, K, V],
    [1, sum NT, ...] with cu_seqlens; V before K with state_v_first), in q's dtype: the initial state,
    then the checkpoints but the one at a sequence's end."""
    import numpy as np

    N = len(lengths)
    rows, first = [], 0
    for n, length in enumerate(lengths):
        chunks = -(-length // FLA_STATE_EVERY)
        if chunks:
            rows.append(n)
            rows.extend(N + first + j for j in range(chunks - 1))
        first += length // FLA_STATE_EVERY
    dt = ops.dtype_name(q)
    source = ops.concat([ops.astype(first_states, dt), checkpoints])
    h = ops.take_rows(source, ops.as_index_array(np.asarray(rows, np.int64), q, "rows"))
    H, V, K = source.shape[1:]
    h = h.reshape((1, len(rows), H, V, K) if varlen else (N, len(rows) // max(N, 1), H, V, K))
    return h if state_v_first else ops.swap_last2(h)


# ---- reference ----------------------------------------------------------------------------------


def reference_forward(q, k, v, g, beta, *, gate="lower_bound", A_log=None, dt_bias=None, lower_bound=-5.0,
                      l2norm_qk=True, beta_is_logit=True, scale=None, initial_state=None, cu_seqlens=None,
                      state_pool=None, state_indices=None, has_initial_state=None, checkpoint_every=0):
    """The library's fp64 token recurrence (docs/SPEC.md §3) on host arrays (numpy or CPU torch).

    initial_state is [N, H, V, K]. Returns float64 numpy arrays (out [B,T,H,V], final_state [N,H,V,K]).
    With state_pool [P, H, V, K] and state_indices [N] (and has_initial_state [N]) the initial states
    are read from the pool (never written; final_state holds the states in sequence order, zeros for
    padding). With checkpoint_every it returns a third array, the checkpoints [C, H, V, K] (SPEC §9).
    """
    import numpy as np

    from . import _C

    ops = NumpyOps if is_numpy(q) else (TorchOps if is_torch(q) else None)
    if ops is None:
        raise TypeError(f"q: expected a numpy array or a CPU torch tensor, got {_type_name(q)}")
    if ops.is_cuda(q):
        raise ValueError("q: reference_forward runs on the host; move the tensors to the CPU first")
    q, k, v, g, beta = _qkvgb(ops, q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[3]
    cu, N = _cu_seqlens(ops, q, cu_seqlens)
    if gate != "precomputed":
        A_log = _param(ops, q, A_log, "A_log", H, (H,)) if A_log is not None else None
        dt_bias = _param(ops, q, dt_bias, "dt_bias", H * K, (H, K)) if dt_bias is not None else None
    else:
        A_log = dt_bias = None  # unused by the precomputed form, whatever they are (as in chunk_kda)
    h0 = None if initial_state is None else _state_in(ops, q, initial_state, "initial_state", N, H, K, V, True)
    out = np.empty((B, T, H, V), np.float64)
    ht = np.empty((N, H, V, K), np.float64)
    pre = Preprocess(gate, A_log, dt_bias, lower_bound, l2norm_qk, beta_is_logit, _scale(scale))
    serving = {}
    if state_pool is not None:
        _pool_shape_check(ops, q, state_pool, H, K, V, True)
        serving["state_pool"] = ops.contiguous(state_pool)
    if state_indices is not None:
        serving["state_indices"] = _slot_indices(ops, state_indices, q, N, "state_indices")
    if has_initial_state is not None:
        serving["has_initial_state"] = ops.as_flags(has_initial_state, q)
    ck = None
    if checkpoint_every:
        every = int(checkpoint_every)
        ck = np.empty((checkpoint_count(_host_lengths(ops, cu, N, T), every), H, V, K), np.float64)
        serving.update(checkpoint_every=every, checkpoints=ck)
    _C.reference_forward(*[ops.to_ext(x) for x in (q, k, v, g, beta)], out, initial_state=ops.to_ext(h0),
                         final_state=ht, cu_seqlens=ops.to_ext(cu), **pre.ext_kwargs(ops),
                         **{n: x if n in ("checkpoint_every", "checkpoints") else ops.to_ext(x)
                            for n, x in serving.items()})
    return (out, ht) if ck is None else (out, ht, ck)
