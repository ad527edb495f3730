"""Arrays in and out of metrale through DLPack, without a copy.

Inputs: any object with ``__dlpack__`` on the model's device (NumPy >= 1.22, torch, CuPy, JAX),
or a NumPy array of ml_dtypes.bfloat16 (NumPy has no bfloat16 of its own and will not export one
through DLPack, so its bits go in as uint16 and are declared BF16).

Outputs: :class:`Array`, a BF16 matrix that ``torch.from_dlpack`` takes without a copy and that
``numpy()`` (or ``np.asarray``) shows as an ml_dtypes.bfloat16 array over the same memory.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from . import _metrale
from .errors import DtypeError, argument_error

_KDL_CPU, _KDL_CUDA = 1, 2


class Array:
    """A BF16 matrix metrale wrote, in memory it does not own (NumPy's or torch's).

    It outlives the model that wrote it. ``torch.from_dlpack(x)`` and ``np.asarray(x)`` share
    its memory; ``np.from_dlpack(x)`` cannot work, since NumPy has no bfloat16 dtype.
    """

    __slots__ = ("_storage", "_bits", "_view")

    def __init__(self, storage: Any) -> None:
        dtype = str(getattr(storage, "dtype", type(storage).__name__))
        if dtype not in ("bfloat16", "torch.bfloat16"):
            # Its bytes would be read as BF16 bits: a float32 array as twice the columns.
            raise argument_error("Array", f"storage: dtype {dtype}, expected bfloat16 "
                                 "(ml_dtypes.bfloat16 or torch.bfloat16)", DtypeError)
        self._storage = storage
        if isinstance(storage, np.ndarray):
            self._bits = storage.view(np.uint16)
            self._view = _metrale._bf16_view(self._bits, self._bits)
        else:  # a torch tensor of dtype bfloat16 exports BF16 itself
            self._bits = None
            self._view = storage

    @property
    def shape(self) -> tuple[int, ...]:
        """(rows, columns)."""
        return tuple(self._storage.shape)

    @property
    def dtype(self) -> str:
        """Always "bfloat16"."""
        return "bfloat16"

    @property
    def data_ptr(self) -> int:
        """The address of the first element."""
        if self._bits is not None:
            return int(self._bits.__array_interface__["data"][0])
        return int(self._storage.data_ptr())

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._view.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._view.__dlpack_device__()

    def numpy(self) -> np.ndarray:
        """The same memory as a NumPy array of ml_dtypes.bfloat16 (host arrays only)."""
        if self._bits is None:
            raise argument_error("Array.numpy", "the array lives on a GPU; copy it to the host "
                                 "first (torch.from_dlpack(x).cpu())")
        return self._bits.view(ml_dtypes.bfloat16)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self.numpy()
        if dtype is not None and np.dtype(dtype) != values.dtype:
            return values.astype(dtype)
        return values.copy() if copy else values

    def __repr__(self) -> str:
        return f"metrale.Array(shape={self.shape}, dtype=bfloat16)"


def device_of(x: Any) -> tuple[int, int]:
    """DLPack's (device type, id) of an array argument; (1, 0) for NumPy and plain buffers."""
    if not hasattr(x, "__dlpack_device__"):
        return _KDL_CPU, 0
    dev = x.__dlpack_device__()
    return int(dev[0]), int(dev[1])


def as_input(api: str, name: str, x: Any, stream: int | None) -> tuple[Any, bool]:
    """What the extension takes for argument `name`: (array or DLPack capsule, bits_are_bf16).

    A CUDA array is exported with the model's stream, so its producer orders its pending writes
    before metrale's work (the DLPack stream rule). Nothing is copied.
    """
    if isinstance(x, Array):
        return (x._bits, True) if x._bits is not None else (x._storage, False)
    if isinstance(x, np.ndarray):
        if x.dtype == ml_dtypes.bfloat16:
            return x.view(np.uint16), True
        return x, False
    if hasattr(x, "__dlpack__"):
        if type(x).__module__.startswith("torch"):
            _check_torch_tensor(api, name, x)
        dev_type, _ = device_of(x)
        if dev_type == _KDL_CUDA and stream is not None:
            return x.__dlpack__(stream=stream), False
        return x, False
    raise argument_error(
        api, f"{name}: {type(x).__name__} is not an array (no __dlpack__)", DtypeError)


def _check_torch_tensor(api: str, name: str, x: Any) -> None:
    """What torch's own __dlpack__ refuses, refused here by name: nanobind imports such a tensor
    through torch.utils.dlpack.to_dlpack instead, which exports its memory as it lies."""
    if x.is_neg() or x.is_conj():
        # A lazy negation or conjugation: the memory holds the other values.
        raise argument_error(api, f"{name}: a torch view with its negative or conjugate bit "
                             "set, whose memory holds other values (pass x.resolve_neg() or "
                             "x.resolve_conj())")
    if name == "out" and x.requires_grad:
        raise argument_error(api, "out: requires grad, and metrale writes it in place, outside "
                             "autograd (pass a tensor that does not)")


def empty_like_output(api: str, a: Any, rows: int, cols: int, on_cuda: bool) -> Any:
    """Storage for an output the caller did not pass: NumPy's on the host, torch's on a GPU."""
    if not on_cuda:
        return np.empty((rows, cols), dtype=ml_dtypes.bfloat16)
    if type(a).__module__.startswith("torch"):
        import torch

        return torch.empty((rows, cols), dtype=torch.bfloat16, device=a.device)
    raise argument_error(api, "out: on a GPU, pass out= (a BF16 array on the model's device) "
                         "or torch tensors, from which metrale allocates it")
