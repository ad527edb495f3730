"""Arrays cross into and out of metrale without a copy: same addresses, writes seen both ways."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest
from conftest import bf16, check_gemm, need, poisoned

import metrale


class _DLTensor(ctypes.Structure):
    # DLPack's DLTensor (dlpack.h): what a capsule's DLManagedTensor starts with.
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _capsule_tensor(capsule) -> _DLTensor:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return _DLTensor.from_address(get(capsule, b"dltensor"))


@pytest.fixture
def setup(rng, model):
    host = metrale.quantize_nvfp4(rng.standard_normal((48, 64)).astype(np.float32))
    return model, host, model.upload_weights(host), bf16(rng.standard_normal((4, 64)))


def test_output_exports_its_own_memory_as_bf16_dlpack(setup):
    model, host, w, a = setup
    c = model.gemm(a, w)
    view = np.asarray(c)
    assert view.dtype == ml_dtypes.bfloat16
    assert view.__array_interface__["data"][0] == c.data_ptr
    assert c.__dlpack_device__() == (1, 0)
    capsule = c.__dlpack__()
    t = _capsule_tensor(capsule)
    assert t.data + t.byte_offset == c.data_ptr  # the consumer gets the same bytes
    assert (t.code, t.bits, t.lanes, t.ndim) == (4, 16, 1, 2)  # kDLBfloat16, 2-D
    assert (t.shape[0], t.shape[1]) == (4, 48)
    # A write through NumPy is seen through the DLPack address, and the other way round.
    raw = (ctypes.c_uint16 * (4 * 48)).from_address(t.data + t.byte_offset)
    view[0, 0] = 3.0
    assert raw[0] == np.array(3.0, ml_dtypes.bfloat16).view(np.uint16)
    raw[1] = int(np.array(-2.0, ml_dtypes.bfloat16).view(np.uint16))
    assert float(view[0, 1]) == -2.0
    check_gemm(model.gemm(a, w), a, host)


def test_out_is_written_in_place(setup):
    model, host, w, a = setup
    out = poisoned(4, 48)
    address = out.__array_interface__["data"][0]
    assert model.gemm(a, w, out=out) is out
    assert out.__array_interface__["data"][0] == address
    check_gemm(out, a, host)  # every element written, in the caller's own memory


def test_inputs_are_lent_not_copied(setup):
    model, host, w, a = setup
    before = model.stats()
    model.gemm(a, w)
    after = model.stats()
    # a and out were lent (borrowed) for the call and given back; metrale allocated nothing.
    assert after["borrow_count"] - before["borrow_count"] == 2
    assert after["allocation_count"] == before["allocation_count"]
    assert after["borrowed_count"] == 0


def test_a_metrale_output_feeds_the_next_gemm_in_place(rng, model):
    h1 = metrale.quantize_nvfp4(rng.standard_normal((64, 32)).astype(np.float32))
    h2 = metrale.quantize_nvfp4(rng.standard_normal((16, 64)).astype(np.float32))
    w1, w2 = model.upload_weights(h1), model.upload_weights(h2)
    a = bf16(rng.standard_normal((2, 32)))
    mid = model.gemm(a, w1)
    check_gemm(model.gemm(mid, w2), np.asarray(mid), h2)


def test_uint16_bits_are_not_taken_for_bf16(setup):
    model, _, w, a = setup
    with pytest.raises(metrale.DtypeError, match="a: dtype uint16"):
        model.gemm(a.view(np.uint16), w)


def test_numpy_dlpack_refuses_bf16_so_arrays_offer_numpy(setup):
    model, _, w, a = setup
    c = model.gemm(a, w)
    # NumPy has no bfloat16: its from_dlpack refuses BF16 from any producer (torch's too).
    with pytest.raises((BufferError, TypeError, RuntimeError)):
        np.from_dlpack(c)
    assert c.numpy().dtype == ml_dtypes.bfloat16


def test_an_array_from_a_dlpack_capsule_lives_through_the_call(rng, model):
    """A capsule that alone holds its tensor: the extension keeps the imported array for the
    whole call (it kept only the address, so torch freed the 64 MiB before the GEMM read it:
    SIGSEGV through the extension's own entry point)."""
    torch = need("torch")
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 4096)).astype(np.float32))
    w = model.upload_weights(host)
    x = bf16(rng.standard_normal((8192, 4096)))
    want = model.gemm(x, w, out=poisoned(8192, 64))
    # BF16 values are exact in float32, so torch's BF16 copy holds x's bits.
    capsule = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).__dlpack__()
    out = poisoned(8192, 64)
    model._m.gemm(capsule, False, w, out.view(np.uint16), True, "auto", False, None, False, None)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
