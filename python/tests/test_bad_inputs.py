"""The bad-input catalogue (docs/RELIABILITY.md) on the Python surface: each bad argument raises
a metrale.Error naming the call and the argument, writes nothing and leaves nothing behind."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest
from conftest import BF16_NAN, bf16, poisoned

import metrale

M, N, K = 4, 32, 64


class _DLManaged(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8),
                ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _OnAnotherDevice:
    """A BF16 [M, K] array that says, through DLPack, that it lives on cuda:0 (its pointer is
    never read: the check refuses it first)."""

    def __init__(self) -> None:
        self._shape = (ctypes.c_int64 * 2)(M, K)
        self._t = _DLManaged(data=0x10000, device_type=2, device_id=0, ndim=2, code=4, bits=16,
                             lanes=1, shape=self._shape)

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **_):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                        ctypes.c_void_p]
        return new(ctypes.addressof(self._t), b"dltensor", None)


def _misaligned() -> np.ndarray:
    raw = np.zeros(M * K + 8, np.uint16)
    return raw[1:1 + M * K].view(ml_dtypes.bfloat16).reshape(M, K)  # 2 bytes past 16


def _read_only(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False
    return x


@pytest.fixture
def parts(rng, model):
    host = metrale.quantize_nvfp4(rng.standard_normal((N, K)).astype(np.float32))
    return model, model.upload_weights(host), bf16(rng.standard_normal((M, K)))


# (what, keyword arguments that replace the good ones, exception class, text the message has)
GEMM_CASES = [
    ("a float32", {"a": lambda a: a.astype(np.float32)}, metrale.DtypeError,
     "[gemm] a: dtype float32, expected bfloat16"),
    ("a uint16 bits not declared BF16", {"a": lambda a: a.view(np.uint16)}, metrale.DtypeError,
     "[gemm] a: dtype uint16, expected bfloat16"),
    ("a not an array", {"a": lambda a: [[1.0] * K] * M}, metrale.DtypeError, "a: list"),
    ("a with the wrong K", {"a": lambda a: bf16(np.ones((M, K + 16)))},
     metrale.InvalidArgumentError, f"a: shape ({M}, {K + 16}), expected (*, {K})"),
    ("a 3-D", {"a": lambda a: a.reshape(1, M, K)}, metrale.InvalidArgumentError,
     "a: shape (1, 4, 64) has 3 dimension(s), expected 2"),
    ("a with no rows", {"a": lambda a: a[:0]}, metrale.InvalidArgumentError, "at least one row"),
    ("a strided", {"a": lambda a: bf16(np.ones((M, 2 * K)))[:, ::2]},
     metrale.InvalidArgumentError, "a: strides (128, 2) elements are not C-contiguous"),
    ("a transposed", {"a": lambda a: np.ascontiguousarray(a.T).T}, metrale.InvalidArgumentError,
     "not C-contiguous"),
    ("a on another device", {"a": lambda a: _OnAnotherDevice()}, metrale.InvalidArgumentError,
     "a: lives on cuda:0, the model runs on cpu"),
    ("a misaligned", {"a": lambda a: _misaligned()}, metrale.InvalidArgumentError,
     "is not 16-byte aligned"),
    ("out of the wrong shape", {"out": lambda a: poisoned(M, N + 1)},
     metrale.InvalidArgumentError, f"out: shape ({M}, {N + 1}), expected ({M}, {N})"),
    ("out float32", {"out": lambda a: np.zeros((M, N), np.float32)}, metrale.DtypeError,
     "out: dtype float32"),
    ("out read-only", {"out": lambda a: _read_only(poisoned(M, N))},
     metrale.InvalidArgumentError, "out: the array is read-only"),
    ("out overlapping a", {"out": "a"}, metrale.InvalidArgumentError, "out: overlaps a"),
    ("bias of the wrong length", {"bias": lambda a: bf16(np.ones(N - 1))},
     metrale.InvalidArgumentError, f"bias: shape ({N - 1},), expected ({N},)"),
    ("bias int32", {"bias": lambda a: np.ones(N, np.int32)}, metrale.DtypeError,
     "bias: dtype int32"),
    ("an unknown route", {"route": "fastest"}, metrale.InvalidArgumentError,
     "route: 'fastest', expected auto"),
    ("e4m3 not allowed", {"route": "e4m3"}, metrale.InvalidArgumentError,
     "[gemm] the e4m3 route casts A to E4M3, but the caller asked for exact BF16"),
]


@pytest.mark.parametrize("what,change,cls,text", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_gemm_bad_argument(parts, what, change, cls, text):
    model, w, a = parts
    kwargs = {"a": a, "w": w, "out": poisoned(M, N)}
    for key, value in change.items():
        if value == "a":
            kwargs[key] = a.reshape(-1)[: M * N].reshape(M, N)  # shares a's bytes
        else:
            kwargs[key] = value(a) if callable(value) else value
    out = kwargs["out"]
    before = model.stats()
    with pytest.raises(cls) as caught:
        model.gemm(**kwargs)
    assert text in str(caught.value), str(caught.value)
    assert caught.value.api == "gemm" and str(caught.value).startswith("[gemm] ")
    if isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16 and out is not a:
        if out.base is None or out.base is not a:
            assert (out.view(np.uint16) == BF16_NAN).all() or change.get("out") == "a", \
                "a refused call wrote its output"
    after = model.stats()
    assert after["borrowed_count"] == 0 and after["owned_bytes"] == before["owned_bytes"]


def test_host_weights_are_not_device_weights(parts):
    model, w, a = parts
    host = metrale.quantize_nvfp4(np.ones((N, K), np.float32))
    for call in (lambda: model.gemm(a, host), lambda: model.plan(M, host)):
        with pytest.raises(metrale.DtypeError, match="w: HostWeights is not weights on a "
                                                     "device .upload it first"):
            call()


UPLOAD_CASES = [
    ("codes of the wrong size", dict(weights=np.zeros(10, np.uint8), scales=np.zeros(8, np.uint8),
                                     n=4, k=32), metrale.InvalidArgumentError,
     "codes: 10 bytes, expected 64"),
    ("codes float32", dict(weights=np.zeros((4, 16), np.float32), scales=np.zeros(8, np.uint8)),
     metrale.DtypeError, "codes: dtype float32, expected uint8"),
    ("k not a multiple of the group", dict(weights=np.zeros((4, 12), np.uint8),
                                           scales=np.zeros(4, np.uint8)),
     metrale.InvalidArgumentError, "k a multiple of 16"),
    ("an unknown format", dict(weights=np.zeros((4, 16), np.uint8), scales=np.zeros(8, np.uint8),
                               format="int4"), metrale.InvalidArgumentError, "format: 'int4'"),
    ("a NaN tensor scale", dict(weights=np.zeros((4, 16), np.uint8),
                                scales=np.zeros(8, np.uint8), tensor_scale=float("nan")),
     metrale.InvalidArgumentError, "tensor_scale: nan"),
    ("no scales", dict(weights=np.zeros((4, 16), np.uint8)), metrale.InvalidArgumentError,
     "scales: needed"),
    ("an unknown layout", dict(weights=metrale.quantize_nvfp4(np.ones((4, 16))), layout="fast"),
     metrale.InvalidArgumentError, "layout: 'fast'"),
]


@pytest.mark.parametrize("what,kwargs,cls,text", UPLOAD_CASES, ids=[c[0] for c in UPLOAD_CASES])
def test_upload_bad_argument(model, what, kwargs, cls, text):
    before = model.stats()
    with pytest.raises(cls, match=None) as caught:
        model.upload_weights(**kwargs)
    assert text in str(caught.value), str(caught.value)
    assert model.stats()["owned_bytes"] == before["owned_bytes"]  # nothing half-uploaded


@pytest.mark.parametrize("w,cls,text", [
    (np.ones(32, np.float32), metrale.InvalidArgumentError, "has 1 dimension(s), expected 2"),
    (np.ones((2, 24), np.float32), metrale.InvalidArgumentError, "multiple of 16"),
    (np.full((2, 16), np.nan, np.float32), metrale.InvalidArgumentError, "[quantize_nvfp4]"),
    ("weights", metrale.InvalidArgumentError, "w: cannot be read as float32"),
])
def test_quantize_bad_argument(w, cls, text):
    with pytest.raises(cls) as caught:
        metrale.quantize_nvfp4(w)
    assert text in str(caught.value)


def test_a_bias_overlapping_a_is_refused_by_name(parts):
    """Reading one range twice is harmless, but it cannot be lent twice: the borrow ledger's own
    message ('[borrow] 0x... overlaps borrowed memory') came out before."""
    model, w, _ = parts
    a = bf16(np.ones((M, K)))
    with pytest.raises(metrale.InvalidArgumentError, match=r"\[gemm\] bias: overlaps a"):
        model.gemm(a, w, bias=a.reshape(-1)[:N])


def test_outputs_are_sized_only_from_matrices(parts):
    """A 1-D a of 2e6 elements sized a 2e6-row output (15.6 GiB at this N) before the call
    refused it; now the shape is refused first, as the call refuses it."""
    model, w, _ = parts
    with pytest.raises(metrale.InvalidArgumentError,
                       match=r"\[gemm\] a: shape \(2000000,\) has 1 dimension\(s\), expected 2"):
        model.gemm(bf16(np.ones(2_000_000)), w)
    with pytest.raises(metrale.InvalidArgumentError, match="expected at least one column"):
        model.gemm(np.zeros((10**12, 0), ml_dtypes.bfloat16), w)
    # The same elements as one column: refused by its K before the output is sized.
    with pytest.raises(metrale.InvalidArgumentError,
                       match=rf"\[gemm\] a: shape \(2000000, 1\), expected \(\*, {K}\)"):
        model.gemm(bf16(np.ones((2_000_000, 1))), w)


def test_host_weights_whose_size_does_not_fit_are_refused(parts):
    """n * k wrapped: n = 2^62 + 1, k = 64 took 32 code bytes."""
    with pytest.raises(metrale.InvalidArgumentError, match="too large to address"):
        metrale.HostWeights(np.zeros(32, np.uint8), np.zeros(4, np.uint8), n=2**62 + 1, k=64)


def test_an_array_holds_bf16_only():
    """Array(storage) reads storage's bytes as BF16 bits: a float32 array read as twice the
    columns."""
    with pytest.raises(metrale.DtypeError, match="storage: dtype float32, expected bfloat16"):
        metrale.Array(np.ones((4, 32), np.float32))


def test_unknown_and_missing_backends():
    with pytest.raises(metrale.InvalidArgumentError, match="nope"):
        metrale.Model("nope")
    cuda = {b["name"]: b for b in metrale.backends()}.get("cuda")
    if cuda is not None and not cuda["available"]:
        with pytest.raises(metrale.UnavailableError) as caught:
            metrale.Model("cuda")
        assert isinstance(caught.value, RuntimeError) and caught.value.reason


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(metrale.IoError, match="absent.safetensors"):
        metrale.load_safetensors(str(tmp_path / "absent.safetensors"))
