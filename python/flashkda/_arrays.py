"""Framework adaptors: the few array operations the wrappers need, for numpy and torch alike.

numpy arrays run on the CPU backend (bfloat16 through ml_dtypes); torch tensors run where they
live. torch is imported only when a torch tensor is seen, so numpy-only installs never load it.
"""

from __future__ import annotations

import sys

import numpy as np

# Canonical dtype names used in messages and checks.
BF16, F32, F16, F64, I32, I64 = "bfloat16", "float32", "float16", "float64", "int32", "int64"


_torch_module = None


def _torch():
    """torch if it has been imported (by anyone), else None; cached once found."""
    global _torch_module
    if _torch_module is None:
        _torch_module = sys.modules.get("torch")
    return _torch_module


def is_torch(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)


class NumpyOps:
    """Operations on numpy arrays (host memory, CPU backend)."""

    name = "numpy"

    @staticmethod
    def dtype_name(x) -> str:
        return str(x.dtype)  # 'bfloat16' for ml_dtypes.bfloat16

    @staticmethod
    def bf16_dtype():
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - only without ml_dtypes
            raise ImportError("bfloat16 numpy arrays need ml_dtypes: pip install ml_dtypes") from e
        return ml_dtypes.bfloat16

    @classmethod
    def np_dtype(cls, name: str):
        return cls.bf16_dtype() if name == BF16 else np.dtype(name)

    @staticmethod
    def is_array(x) -> bool:
        return isinstance(x, np.ndarray)

    @staticmethod
    def contiguous(x):
        return np.ascontiguousarray(x)

    @staticmethod
    def is_contiguous(x) -> bool:
        return x.flags.c_contiguous

    @staticmethod
    def aligned(x):
        return x  # the CPU backend reads any alignment

    @classmethod
    def empty(cls, shape, dtype: str, like):
        return np.empty(shape, dtype=cls.np_dtype(dtype))

    @classmethod
    def zeros(cls, shape, dtype: str, like):
        return np.zeros(shape, dtype=cls.np_dtype(dtype))

    @classmethod
    def astype(cls, x, dtype: str):
        return np.ascontiguousarray(x.astype(cls.np_dtype(dtype), copy=False))

    @staticmethod
    def swap_last2(x):
        """Contiguous copy with the last two axes swapped ([.., K, V] <-> [.., V, K])."""
        return np.ascontiguousarray(np.swapaxes(x, -1, -2))

    @staticmethod
    def swap_last2_view(x):
        return np.swapaxes(x, -1, -2)

    @staticmethod
    def copy_(dst, src):
        np.copyto(dst, src)
        return dst

    @staticmethod
    def arange_i32(n, like):
        return np.arange(n, dtype=np.int32)

    # Row gathers and scatters along axis 0, and the elementwise ops of the named-slot copies.
    @staticmethod
    def take_rows(x, rows):
        return np.take(x, rows, axis=0)

    @staticmethod
    def put_rows_(x, rows, values):
        x[rows] = values  # rows naming one slot twice carry identical values (see _impl)
        return x

    @staticmethod
    def where(cond, a, b):
        return np.where(cond, a, b)

    @staticmethod
    def sigmoid_f32(x):
        """The logistic of x in fp32 (exp(-x) = inf far below zero gives sigmoid's limit 0)."""
        b = x.astype(np.float32)
        with np.errstate(over="ignore"):
            return (np.float32(1.0) / (np.float32(1.0) + np.exp(-b))).astype(np.float32)

    @staticmethod
    def repeat_axis2(x, n):
        """Each index of axis 2 n times, side by side."""
        return np.repeat(x, n, axis=2)

    @staticmethod
    def first_true(mask):
        """Index of the first True of a 1-d mask (0 when there is none), as a 0-d integer array."""
        return np.argmax(mask)

    @staticmethod
    def first_equal(x):
        """For each entry of a 1-d integer array, the index of the first entry equal to it (int32)."""
        order = np.argsort(x, kind="stable")
        s = x[order]
        start = np.ones(s.shape[0], bool)
        start[1:] = s[1:] != s[:-1]
        run = np.maximum.accumulate(np.where(start, np.arange(s.shape[0]), 0))
        first = np.empty_like(order)
        first[order] = order[run]
        return first.astype(np.int32)

    @classmethod
    def as_index_array(cls, x, like, name):
        return np.ascontiguousarray(np.asarray(x))

    @staticmethod
    def as_flags(x, like):
        """A contiguous bool array (has_initial_state) from any array-like."""
        return np.ascontiguousarray(np.asarray(x).astype(bool, copy=False))

    @staticmethod
    def concat(xs):
        return np.concatenate(xs, axis=0)

    @staticmethod
    def to_ext(x):
        """The object handed to flashkda._C: bfloat16 numpy arrays travel as their uint16 bits."""
        if x is not None and x.dtype.name == BF16:
            return x.view(np.uint16)
        return x

    @staticmethod
    def device_str(x) -> str:
        return "cpu"

    @staticmethod
    def is_cuda(x) -> bool:
        return False

    @staticmethod
    def host_values(x, sync=False):
        """Host copy of a small integer array, or None when reading it would synchronise (unless sync)."""
        return np.asarray(x)


class TorchOps:
    """Operations on torch tensors (CPU or CUDA; CUDA work is enqueued on the current stream)."""

    name = "torch"

    @staticmethod
    def _dt(name):
        torch = _torch()
        return {BF16: torch.bfloat16, F32: torch.float32, I32: torch.int32, I64: torch.int64,
                F16: torch.float16, F64: torch.float64}[name]

    _dtype_names: dict = {}

    @staticmethod
    def tensor_type():
        return _torch().Tensor

    @classmethod
    def dtype_name(cls, x) -> str:
        dt = x.dtype
        name = cls._dtype_names.get(dt)
        if name is None:
            name = cls._dtype_names[dt] = str(dt).replace("torch.", "")
        return name

    @staticmethod
    def is_array(x) -> bool:
        return is_torch(x)

    @staticmethod
    def contiguous(x):
        return x.contiguous()

    @staticmethod
    def is_contiguous(x) -> bool:
        return x.is_contiguous()

    @staticmethod
    def aligned(x):
        """x, or a copy at a 16-byte aligned address (the GPU kernels load 16 bytes at a time)."""
        return x.clone() if x.is_cuda and x.data_ptr() % 16 else x

    @classmethod
    def empty(cls, shape, dtype: str, like):
        return _torch().empty(shape, dtype=cls._dt(dtype), device=like.device)

    @classmethod
    def zeros(cls, shape, dtype: str, like):
        return _torch().zeros(shape, dtype=cls._dt(dtype), device=like.device)

    @classmethod
    def astype(cls, x, dtype: str):
        if cls.dtype_name(x) == dtype and x.is_contiguous():
            return x
        return x.to(cls._dt(dtype)).contiguous()

    @staticmethod
    def swap_last2(x):
        return x.transpose(-1, -2).contiguous()

    @staticmethod
    def swap_last2_view(x):
        return x.transpose(-1, -2)

    @staticmethod
    def copy_(dst, src):
        dst.copy_(src)
        return dst

    @staticmethod
    def arange_i32(n, like):
        torch = _torch()
        return torch.arange(n, dtype=torch.int32, device=like.device)

    # Device-side throughout: nothing here reads a value on the host (no synchronisation).
    @staticmethod
    def take_rows(x, rows):
        return x.index_select(0, rows.long())

    @staticmethod
    def put_rows_(x, rows, values):
        return x.index_copy_(0, rows.long(), values)  # duplicates carry identical values (see _impl)

    @staticmethod
    def where(cond, a, b):
        return _torch().where(cond, a, b)

    @staticmethod
    def sigmoid_f32(x):
        return _torch().sigmoid(x.float())

    @staticmethod
    def repeat_axis2(x, n):
        return x.repeat_interleave(n, dim=2)

    @staticmethod
    def first_true(mask):
        return mask.to(_torch().int32).argmax()

    @staticmethod
    def first_equal(x):
        torch = _torch()
        order = torch.sort(x, stable=True).indices
        s = x[order]
        start = torch.ones_like(s, dtype=torch.bool)
        start[1:] = s[1:] != s[:-1]
        pos = torch.arange(s.shape[0], device=x.device)
        run = torch.cummax(torch.where(start, pos, torch.zeros_like(pos)), 0).values
        first = torch.empty_like(order)
        first[order] = order[run]
        return first.to(torch.int32)

    @staticmethod
    def as_index_array(x, like, name):
        torch = _torch()
        if isinstance(x, torch.Tensor):
            return x.contiguous()
        return torch.as_tensor(np.asarray(x), device=like.device).contiguous()

    @staticmethod
    def as_flags(x, like):
        torch = _torch()
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x), device=like.device)
        return x.to(torch.bool).contiguous()

    @staticmethod
    def concat(xs):
        return _torch().cat(xs, dim=0)

    @staticmethod
    def to_ext(x):
        """A DLPack capsule for flashkda._C (torch.utils.dlpack.to_dlpack: ~0.7 us, against ~4 us for
        the ext's own tensor.__dlpack__() call; no stream synchronisation either way). Single use.
        Tensors DLPack cannot carry (meta, other devices) are a ValueError naming the device."""
        if x is None:
            return None
        try:
            return _torch().utils.dlpack.to_dlpack(x)
        except BufferError as e:
            raise ValueError(f"tensors on device {x.device} are not supported (expected cpu or cuda): {e}") from None

    @staticmethod
    def device_str(x) -> str:
        return str(x.device)

    @staticmethod
    def is_cuda(x) -> bool:
        return x.device.type == "cuda"

    @staticmethod
    def host_values(x, sync=False):
        if x.device.type != "cpu":
            return x.detach().cpu().numpy() if sync else None
        return x.detach().numpy()


def ops_for(q, name: str = "q"):
    """The adaptor for q's framework; a clear TypeError for anything else."""
    if is_numpy(q):
        return NumpyOps
    if is_torch(q):
        return TorchOps
    raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(q).__module__}.{type(q).__name__}")
