"""The W8A8 op from Python: E4M3 weights with 128 x 128 block scales, A cast per row per 128 K,
held to the float64 product of A and the E4M3 weights (toolkit/w8a8_reference.h's bound)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import bf16, poisoned

import metrale


def _fp8_weights(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """W[n, k] = e4m3(code) · scale of its 128 x 128 block, in float64 (exact)."""
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    full = np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)
    return values * full[: codes.shape[0], : codes.shape[1]]


def _check_w8a8(out, a: np.ndarray, w: np.ndarray, bias=None) -> None:
    """Per element: |out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·(E + γ·S8), E = Σ Ea·|w| with
    Ea = max(2^-4·|a|, 2^-10·sa) + 2^-23·|a| (sa: the row block's amax / 448), γ = (K +
    2·ceil(K/128) + 8)·2^-23, S8 = Σ (|a| + Ea)·|w| + |bias|."""
    a64 = np.asarray(a, dtype=np.float64)
    m, k = a64.shape
    blocks = -(-k // 128)
    padded = np.zeros((m, blocks * 128))
    padded[:, :k] = np.abs(a64)
    sa = np.repeat(padded.reshape(m, blocks, 128).max(axis=2) / 448.0, 128, axis=1)[:, :k]
    ea = np.maximum(2.0**-4 * np.abs(a64), 2.0**-10 * sa) + 2.0**-23 * np.abs(a64)
    ref = a64 @ w.T
    b = np.zeros(w.shape[0]) if bias is None else np.asarray(bias, dtype=np.float64)
    ref = ref + b
    e = ea @ np.abs(w).T
    s8 = (np.abs(a64) + ea) @ np.abs(w).T + np.abs(b)
    gamma = (k + 2 * blocks + 8) * 2.0**-23
    got = np.asarray(out).astype(np.float64)
    assert np.isfinite(got).all(), "an output element is NaN (unwritten?)"
    bound = 2.0**-8 * np.abs(ref) + (1 + 2.0**-8) * (e + gamma * s8)
    worst = np.max(np.abs(got - ref) - bound)
    assert worst <= 0, f"an element is {worst:.3g} past its bound"


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (5, 300, 300), (32, 256, 512)])
def test_w8a8_against_float64(rng, model, m, n, k):
    codes, scales = metrale.quantize_e4m3_block128(rng.standard_normal((n, k)))
    assert codes.shape == (n, k) and scales.shape == (-(-n // 128), -(-k // 128))
    w = model.upload_fp8_weights(codes, scales, label="fp8 layer")
    assert (w.n, w.k, w.format) == (n, k, "e4m3_block128")
    plan = model.plan(m, w, allow_e4m3=True, bias=True)
    assert plan.route == "w8a8" and plan.launches[0]["kernel"] == "fp8::cast_e4m3_block128"
    a, bias, out = bf16(rng.standard_normal((m, k))), bf16(rng.standard_normal(n)), poisoned(m, n)
    assert model.gemm(a, w, out=out, allow_e4m3=True, bias=bias) is out
    _check_w8a8(out, a, _fp8_weights(codes, scales), bias)
    _check_w8a8(model.gemm(a, w, allow_e4m3=True), a, _fp8_weights(codes, scales))


def test_w8a8_check_fails_on_a_planted_fault(rng, model):
    codes, scales = metrale.quantize_e4m3_block128(rng.standard_normal((64, 128)))
    w = model.upload_fp8_weights(codes, scales)
    a = bf16(rng.standard_normal((4, 128)))
    out = np.asarray(model.gemm(a, w, allow_e4m3=True)).copy()
    wrong = scales.copy()
    wrong[0, 0] *= 1.25  # a wrong block scale
    with pytest.raises(AssertionError):
        _check_w8a8(out, a, _fp8_weights(codes, wrong))


def test_w8a8_needs_allow_e4m3_and_the_auto_route(rng, model):
    codes, scales = metrale.quantize_e4m3_block128(rng.standard_normal((32, 128)))
    w = model.upload_fp8_weights(codes, scales)
    a = bf16(np.ones((1, 128)))
    with pytest.raises(metrale.InvalidArgumentError, match="allow_e4m3=True"):
        model.gemm(a, w)
    with pytest.raises(metrale.InvalidArgumentError, match="route: 'tiled'"):
        model.gemm(a, w, route="tiled", allow_e4m3=True)


@pytest.mark.parametrize("codes,scales,text", [
    (np.zeros((32, 128), np.float32), np.ones((1, 1), np.float32), "codes: dtype float32"),
    (np.zeros((32, 128), np.uint8), np.ones((1, 2), np.float32),
     "scales: shape (1, 2), expected (1, 1)"),
    (np.zeros(128, np.uint8), np.ones((1, 1), np.float32), "codes: shape (128,)"),
])
def test_fp8_upload_bad_argument(model, codes, scales, text):
    with pytest.raises(metrale.InvalidArgumentError) as caught:
        model.upload_fp8_weights(codes, scales)
    assert text in str(caught.value) and "[upload_fp8_weights]" in str(caught.value)
    assert model.stats()["owned_count"] == 0
