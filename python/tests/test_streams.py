"""Where CUDA calls run, checked without a GPU: the caller's-stream argument of Model.gemm is
refused where it cannot apply, and metrale.torch's stream mode (Note [foreign streams]) is set,
read from METRALE_TORCH_STREAM and refused by name. test_gpu.py runs the modes on a device."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import need

import metrale

torch = need("torch")
mt = need("metrale.torch")


@pytest.mark.parametrize("stream", [0, 0x7f00])
def test_a_stream_for_a_cpu_model_is_refused_by_name(rng, model, stream):
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 128)).astype(np.float32))
    w = model.upload_weights(host)
    a = rng.standard_normal((2, 128)).astype(ml_dtypes.bfloat16)
    with pytest.raises(metrale.InvalidArgumentError,
                       match=rf"\[gemm\] stream: 0x{stream:x} given to a model that does not run "
                             "on CUDA"):
        model.gemm(a, w, stream=stream)
    assert model.stats()["borrowed_count"] == 0


@pytest.mark.parametrize("stream", ["0", -1, 2**64, True, 1.0])
def test_a_stream_that_is_no_handle_is_refused_by_name(rng, model, stream):
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 128)).astype(np.float32))
    w = model.upload_weights(host)
    a = rng.standard_normal((2, 128)).astype(ml_dtypes.bfloat16)
    with pytest.raises(metrale.InvalidArgumentError, match=r"\[gemm\] stream: .* is not a CUDA "
                                                           "stream handle"):
        model.gemm(a, w, stream=stream)


def test_the_stream_mode_is_set_read_and_refused_by_name():
    start = mt.cuda_stream()
    try:
        assert mt.cuda_stream("torch") == "torch"
        assert mt.cuda_stream() == "torch"
        assert mt.cuda_stream("own") == "own"
        with pytest.raises(metrale.InvalidArgumentError,
                           match=r"\[metrale.torch.cuda_stream\] mode: 'graph', expected"):
            mt.cuda_stream("graph")
        assert mt.cuda_stream() == "own"
    finally:
        mt.cuda_stream(start)


@pytest.mark.parametrize("value, mode", [("", "own"), ("own", "own"), ("torch", "torch")])
def test_the_stream_mode_comes_from_the_environment(monkeypatch, value, mode):
    monkeypatch.setenv("METRALE_TORCH_STREAM", value)
    assert mt._stream_mode_from_env() == mode


def test_an_unknown_stream_mode_in_the_environment_is_warned_of(monkeypatch):
    monkeypatch.setenv("METRALE_TORCH_STREAM", "current")
    with pytest.warns(UserWarning, match="METRALE_TORCH_STREAM='current' is neither"):
        assert mt._stream_mode_from_env() == "own"


def test_without_the_variable_the_mode_is_the_one_a_device_verified(monkeypatch):
    """"own" until a GPU run verifies "torch" (docs/GPU.md); the run that does flips this."""
    monkeypatch.delenv("METRALE_TORCH_STREAM", raising=False)
    assert mt._stream_mode_from_env() == "own"


def test_the_extension_refuses_a_stream_on_the_cpu_backend(rng, model):
    """Past the Python check, the extension's call path adopts the stream first: the CPU backend
    refuses by name, and nothing stays lent."""
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 128)).astype(np.float32))
    w = model.upload_weights(host)
    a = rng.standard_normal((2, 128)).astype(ml_dtypes.bfloat16).view(np.uint16)
    out = np.zeros((2, 64), dtype=np.uint16)
    with pytest.raises(metrale.UnavailableError,
                       match=r"\[gemm\] the cpu backend runs no work on another library's "
                             r"streams \(stream 0x0\)"):
        model._m.gemm(a, True, w, out, True, "auto", False, None, False, 0)
    assert model.stats()["borrowed_count"] == 0
