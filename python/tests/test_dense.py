"""BF16 weights as they are, on the backend's dense GEMM: Model.upload_dense_weights and
Model.gemm against float64 (the products of BF16 values are exact in FP32, so the bound is the
exact routes': toolkit/gemm_tolerance.h), and metrale.load's BF16 layers (lm_head) on it."""

from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np
import pytest
from conftest import bf16, check_bound, poisoned

import metrale

CHECKPOINTS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "checkpoints"


def _check_dense(out, a: np.ndarray, w: np.ndarray, bias=None) -> float:
    """Per element |out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·(K + 8)·2^-23·S, S = Σ|a·w| + |bias|;
    the normalized error ≤ 8e-3. Returns the normalized error."""
    a64, w64 = np.asarray(a, dtype=np.float64), np.asarray(w, dtype=np.float64)
    ref, mag = a64 @ w64.T, np.abs(a64) @ np.abs(w64).T
    if bias is not None:
        b64 = np.asarray(bias, dtype=np.float64)
        ref, mag = ref + b64, mag + np.abs(b64)
    got = check_bound(out, ref, mag, w64.shape[1])
    norm = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert norm <= 8e-3, f"normalized error {norm:.3g}"
    return norm


@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (5, 257, 96), (33, 130, 200)])
def test_dense_gemm_against_float64(rng, model, m, n, k):
    w = bf16(rng.standard_normal((n, k)))
    dw = model.upload_dense_weights(w, label="head")
    assert (dw.n, dw.k, dw.format, dw.label, dw.nbytes) == (n, k, "bf16", "head", n * k * 2)
    assert model.stats()["owned_bytes"] >= n * k * 2
    a, bias, out = bf16(rng.standard_normal((m, k))), bf16(rng.standard_normal(n)), poisoned(m, n)
    assert model.gemm(a, dw, out=out, bias=bias) is out
    _check_dense(out, a, w, bias)
    _check_dense(model.gemm(a, dw), a, w)
    assert "dense" in str(model.plan(m, dw, bias=True))


def test_dense_check_fails_on_a_planted_fault(rng, model):
    w = bf16(rng.standard_normal((64, 48)))
    a = bf16(rng.standard_normal((4, 48)))
    out = np.asarray(model.gemm(a, model.upload_dense_weights(w))).copy()
    wrong = w.copy()
    wrong[3, 7] = -wrong[3, 7] if wrong[3, 7] != 0 else ml_dtypes.bfloat16(1.0)
    with pytest.raises(AssertionError):
        _check_dense(out, a, wrong)


def test_dense_weights_refuse_bad_arguments(rng, model):
    w = model.upload_dense_weights(bf16(rng.standard_normal((32, 16))))
    with pytest.raises(metrale.DtypeError, match=r"\[upload_dense_weights\] w: dtype float32"):
        model.upload_dense_weights(np.zeros((4, 4), np.float32))
    with pytest.raises(metrale.InvalidArgumentError, match=r"\[gemm\] a: shape"):
        model.gemm(bf16(np.ones((2, 8))), w)
    with pytest.raises(metrale.InvalidArgumentError, match="route: 'tiled' given for BF16"):
        model.gemm(bf16(np.ones((2, 16))), w, route="tiled")
    with metrale.Model("cpu") as other:
        with pytest.raises(metrale.InvalidArgumentError, match="uploaded to another model"):
            other.gemm(bf16(np.ones((2, 16))), w)
    assert model.stats()["borrowed_count"] == 0


def test_a_checkpoints_bf16_layer_runs_on_the_dense_gemm(rng):
    """ModelOpt kept lm_head in BF16: metrale.load uploads it as it is, and gemm runs it."""
    with metrale.load(str(CHECKPOINTS / "modelopt-nvfp4"), backend="cpu") as ckpt:
        head = ckpt.dense["lm_head"]
        assert isinstance(head, metrale.DenseWeights)
        w = ckpt.tensor("lm_head.weight")
        assert w.dtype == ml_dtypes.bfloat16 and (head.n, head.k) == w.shape
        a = bf16(rng.standard_normal((3, head.k)))
        _check_dense(ckpt.model.gemm(a, head), a, w)
    assert ckpt.model.report.clean
