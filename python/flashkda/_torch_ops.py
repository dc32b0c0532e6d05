"""PyTorch custom ops torch.ops.flashkda.{chunk_kda, fwd, fused_recurrent_kda}.

Registered with torch.library.custom_op so torch.compile treats each call as one opaque node (the
fake implementations give it output shapes) and records in-place writes (mutates_args). Imported by
flashkda/__init__.py only when torch is importable. Each op's schema is the signature of the _impl
function of the same name (its annotations name the types; "Array" is a tensor here), and the op
runs that function on torch tensors (the registered schema keeps defaults only after the last
argument written in place: _op_schema).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import _impl
from ._arrays import TorchOps

_TYPES = {"Array": Tensor, "Optional[Array]": Optional[Tensor], "Optional[float]": Optional[float], "bool": bool,
          "float": float, "int": int, "str": str}


def _schema(fn) -> inspect.Signature:
    """fn's signature without its first parameter (ops), with the annotations as types."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return inspect.Signature([p.replace(annotation=_TYPES[p.annotation]) for p in params])


def _op_schema(sig: inspect.Signature, mutates: Tuple[str, ...]) -> inspect.Signature:
    """The registered schema: sig with no defaults up to its last mutated argument. The dispatcher
    drops trailing arguments equal to their defaults before it calls the op, and torch's in-place
    bookkeeping (2.11) then looks a mutated argument up by a position that is no longer there."""
    params = list(sig.parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in mutates)
    return sig.replace(parameters=[p.replace(default=inspect.Parameter.empty) if i <= last else p
                                   for i, p in enumerate(params)])


def _normalised(sig: inspect.Signature, args: dict) -> dict:
    """args as the schema's types: bool(), float() and int() of what the caller passed, integer lists
    as tensors beside q; a required argument that is None raises ValueError naming it."""
    q = args["q"]
    out = {}
    for name, x in args.items():
        kind = sig.parameters[name].annotation
        if x is None and kind in (Tensor, float):
            raise ValueError(f"{name}: required ({'a tensor' if kind is Tensor else 'a float'})")
        if kind in (Tensor, Optional[Tensor]):
            x = _tensor(q, x, name)
        elif kind is bool:
            x = bool(x)
        elif kind is int:
            x = int(x or 0)
        elif kind in (float, Optional[float]):
            x = None if x is None else float(x)
        out[name] = x
    return out


def _tensor(q: Tensor, x, name: str):
    """A tensor argument: tensors stay, integer lists (lengths, slots, flags) become tensors beside q."""
    if x is None or isinstance(x, Tensor):
        return x
    if name in ("cu_seqlens", "ssm_state_indices", "num_accepted_tokens", "state_indices", "checkpoint_slots",
                "has_initial_state") and isinstance(x, (list, tuple)):
        if name == "has_initial_state":
            return torch.tensor(x, dtype=torch.bool, device=q.device)
        return torch.tensor(x, dtype=torch.int64 if name == "cu_seqlens" else torch.int32, device=q.device)
    raise TypeError(f"{name}: expected a torch tensor like q, got {type(x).__module__}.{type(x).__name__}")


def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    # an empty cu_seqlens is refused by name by the op itself; its fake output stays a valid shape
    return q.shape[0] if cu_seqlens is None else max(cu_seqlens.shape[0] - 1, 0)


def _no_state(q: Tensor) -> Tensor:
    """Stands for 'no final state': custom ops cannot return None."""
    return q.new_empty((0,), dtype=torch.float32)


def _new_state(a: dict) -> Tensor:
    """The float32 final state a call creates ([N, H, V, K] or fla's [N, H, K, V])."""
    q, v = a["q"], a["v"]
    N, H, K, V = _num_seqs(q, a["cu_seqlens"]), q.shape[2], q.shape[3], v.shape[3]
    return q.new_empty((N, H, V, K) if a["state_v_first"] else (N, H, K, V), dtype=torch.float32)


class _Op:
    """One custom op: the schema of _impl.<name>, a result adapter (what _impl returns -> the op's
    outputs) and a fake (the bound arguments -> outputs of the right shapes)."""

    def __init__(self, name: str, returns, mutates: Tuple[str, ...], result: Callable, fake: Callable):
        impl = getattr(_impl, name)
        self.sig = _schema(impl)

        def op(*args, **kwargs):
            a = self._bound(args, kwargs)
            return result(impl(TorchOps, **a), a)

        op.__signature__ = _op_schema(self.sig, mutates).replace(return_annotation=returns)
        op.__name__ = name
        self.op = torch.library.custom_op(f"flashkda::{name}", mutates_args=mutates)(op)
        self.op.register_fake(lambda *args, **kwargs: fake(self._bound(args, kwargs)))
        self.name = name

    def _bound(self, args, kwargs) -> dict:
        """The op's arguments by name, defaults filled in."""
        bound = self.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def __call__(self, args: dict):
        """Calls torch.ops.flashkda.<name> with args (keywords of _impl.<name>) as the schema's types."""
        return getattr(torch.ops.flashkda, self.name)(**_normalised(self.sig, args))


# chunk_kda: the pool and the checkpoints are written in place; the second output is the final state
# only when one is created here (output_final_state without a pool), else an empty tensor.
chunk_kda = _Op("chunk_kda", Tuple[Tensor, Tensor], ("state_pool", "checkpoints"),
                lambda r, a: (r[0], _no_state(a["q"]) if r[1] is None or r[1] is a["state_pool"] else r[1]),
                lambda a: (a["v"].new_empty(a["v"].shape, dtype=a["q"].dtype),
                           _new_state(a) if a["output_final_state"] and a["state_pool"] is None else _no_state(a["q"])))

fwd = _Op("fwd", None, ("out", "final_state", "state_pool", "checkpoints"), lambda r, a: None, lambda a: None)

# fused_recurrent_kda: writes out (and the pool initial_state when inplace_final_state) in place;
# returns a new final state only when one is created here (not in place), else an empty tensor.
fused_recurrent_kda = _Op(
    "fused_recurrent_kda", Tensor, ("initial_state", "out"),
    lambda r, a: _no_state(a["q"]) if r[1] is None or r[1] is a["initial_state"] else r[1],
    lambda a: (_new_state(a) if a["output_final_state"] and not (a["inplace_final_state"] and a["initial_state"] is not None)
               else _no_state(a["q"])))
