"""metrale: a runtime for quantized LLM inference (NVFP4/MXFP4 GEMMs) on CUDA and the CPU.

    import metrale, numpy as np, ml_dtypes
    w = metrale.quantize_nvfp4(np.random.randn(256, 512).astype(np.float32))
    with metrale.Model("cpu") as model:
        wd = model.upload_weights(w)
        a = np.random.randn(4, 512).astype(ml_dtypes.bfloat16)
        c = model.gemm(a, wd)            # metrale.Array [4, 256], BF16
        print(np.asarray(c)[0, :4])
"""

from __future__ import annotations

from typing import Any

from . import _metrale, errors
from ._array import Array
from ._metrale import (Checkpoint, DenseWeights, Fp8Weights, GroupedWeights, HostWeights, Plan,
                       Weights, backends, load_safetensors)
from .errors import (CaptureError, DeviceFaultError, DriverError, DtypeError, Error,
                     InternalError, InvalidArgumentError, IoError, LeakError, NotFoundError,
                     OutOfMemoryError, StateError, TimedOutError, UnavailableError)
from .folder import Loaded, load
from .model import Model, TeardownReport, as_float32

_metrale._set_error_classes({**errors.BY_CODE, "dtype": DtypeError})

__version__ = "0.1.0"


def quantize_nvfp4(w: Any) -> HostWeights:
    """Quantizes W[N, K] (NumPy or torch, any float dtype; K a multiple of 16) to NVFP4."""
    return _metrale.quantize_nvfp4(as_float32("quantize_nvfp4", w))


def quantize_mxfp4(w: Any) -> HostWeights:
    """Quantizes W[N, K] (NumPy or torch, any float dtype; K a multiple of 32) to MXFP4."""
    return _metrale.quantize_mxfp4(as_float32("quantize_mxfp4", w))


def quantize_int4(w: Any, group: int = 128, zero_points: bool = False,
                  fp16_scales: bool = False) -> HostWeights:
    """Quantizes W[N, K] (NumPy or torch, any float dtype) to INT4 by rounding to nearest in
    groups of ``group`` (32, 64, a multiple of 128, or K): symmetric (zero point 8) or with
    ``zero_points``; BF16 or (``fp16_scales``) FP16 scales. GPTQ, AWQ and compressed-tensors
    checkpoints load as INT4 too (load_safetensors)."""
    return _metrale.quantize_int4(as_float32("quantize_int4", w), group, zero_points, fp16_scales)


def stack_rows(parts: list) -> HostWeights:
    """HostWeights whose rows are each part's in turn (an MoE expert's gate and up projections as
    one gate_up [2I, H]): every part of one format, K and tensor scale (INT4: group, scale type
    and zero-point kind), row-major, and one act order (none, or the same k_perm)."""
    return _metrale.stack_rows(list(parts))


def take_rows(w: HostWeights, rows: Any) -> HostWeights:
    """W[rows, :] of row-major HostWeights: row i of the result is row rows[i] (an MoE expert's
    gate and up rows in its down projection's act order, Note [Experts' act order]); rows are
    integers, 1-D or [1, n] as a k_perm is, anything else DtypeError."""
    import numpy as np

    picked = np.asarray(rows)
    if picked.ndim == 2 and picked.shape[0] == 1:  # a k_perm as HostWeights gives it, [1, K]
        picked = picked[0]
    if picked.ndim != 1 or not np.issubdtype(picked.dtype, np.integer):
        # Row indices as given: a float array would be truncated, a matrix flattened.
        raise errors.argument_error("take_rows", f"rows: a {picked.dtype} array of shape "
                                    f"{picked.shape}; expected integer row indices, 1-D or "
                                    "[1, n] (as k_perm)", DtypeError)
    return _metrale.take_rows(w, np.ascontiguousarray(picked, dtype=np.int64))


def in_stored_order(w: HostWeights) -> HostWeights:
    """Act-ordered INT4 weights as weights without act order whose K is the stored order,
    W[:, k_perm] (for a caller that gives A in that order); other weights as they are."""
    return _metrale.in_stored_order(w)


def quantize_e4m3_block128(w: Any) -> tuple:
    """Quantizes W[N, K] (NumPy or torch, any float dtype) to E4M3 codes (uint8 [N, K]) and
    FP32 scales, one per 128 x 128 block ([ceil(N/128), ceil(K/128)]): the W8A8 op's weights."""
    return _metrale.quantize_e4m3_block128(as_float32("quantize_e4m3_block128", w))


__all__ = [
    "Array", "CaptureError", "Checkpoint", "DenseWeights", "DeviceFaultError", "DriverError",
    "DtypeError",
    "Error", "Fp8Weights", "GroupedWeights", "HostWeights", "InternalError", "InvalidArgumentError", "IoError", "LeakError", "Loaded",
    "Model", "NotFoundError", "OutOfMemoryError", "Plan", "StateError", "TeardownReport", "TimedOutError",
    "UnavailableError", "Weights", "backends", "load", "load_safetensors", "quantize_e4m3_block128", "quantize_int4",
    "quantize_mxfp4", "quantize_nvfp4", "stack_rows", "take_rows", "in_stored_order",
]
