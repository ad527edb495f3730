"""Shared pieces of the Python tests: fresh random data, the float64 reference and its bounds."""

from __future__ import annotations

import importlib
import os

import ml_dtypes
import numpy as np
import pytest

import metrale

BF16_NAN = 0x7FC0
# Modules whose absence fails a test rather than skipping it: scripts/python-test.sh installs
# them and names them here, so a CI run whose torch went missing is red, not quietly skipped.
REQUIRED = set(filter(None, os.environ.get("METRALE_TEST_REQUIRE", "").split(",")))  # poison: an element metrale never wrote reads as NaN


def need(module: str):
    """The module, imported; skips the calling test file where it is not installed, unless
    METRALE_TEST_REQUIRE names it (then the import error fails it)."""
    if module.partition(".")[0] in REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator with a fresh seed each run, printed so a failure can be replayed
    (METRALE_TEST_SEED=... pins it)."""
    seed = int(os.environ.get("METRALE_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    print(f"{request.node.name}: seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def model():
    """A CPU model, torn down (and leak-checked) after the test."""
    with metrale.Model("cpu") as m:
        yield m


def bf16(values: np.ndarray) -> np.ndarray:
    """values rounded to BF16 (ml_dtypes.bfloat16, C-contiguous)."""
    return np.ascontiguousarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16)


def poisoned(rows: int, cols: int) -> np.ndarray:
    """A BF16 output array filled with NaN, so an element left unwritten fails the check."""
    return np.full((rows, cols), BF16_NAN, dtype=np.uint16).view(ml_dtypes.bfloat16)


def int4_magnitudes(w: metrale.HostWeights) -> np.ndarray:
    """What an INT4 product's roundings scale with (toolkit/gemm_tolerance.h, "INT4"): the kernels
    sum a·(code − 8) and a·(8 − zero) apart, so (|code − 8| + |8 − zero|)·scale per weight, [N, K]
    in W's own K order; |W| itself for symmetric weights."""
    codes = np.array(w.codes)
    q = np.empty((w.n, w.k), np.float64)
    q[:, 0::2], q[:, 1::2] = codes & 15, codes >> 4
    bits = np.array(w.scales).view(np.uint16)
    if w.scale_type == "fp16":
        scale = bits.view(np.float16).astype(np.float64)
    else:
        scale = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    zeros = np.full(scale.shape, 8.0) if w.zeros is None else np.array(w.zeros, np.float64)
    stored = (np.abs(q - 8) + np.abs(8 - np.repeat(zeros, w.group, axis=1))) * np.abs(
        np.repeat(scale, w.group, axis=1))
    if w.k_perm is None:
        return stored
    out = np.empty_like(stored)
    out[:, np.array(w.k_perm)[0]] = stored
    return out


def reference(a: np.ndarray, w: metrale.HostWeights, bias=None) -> tuple[np.ndarray, np.ndarray]:
    """(A · Wᵀ + bias in float64 from the exact weights, S = Σ_k |a·w| + |bias| per element; for
    INT4, Σ_k |a|·int4_magnitudes)."""
    a64 = np.asarray(a, dtype=np.float64)
    w64 = w.dequantize(exact=True)
    ref = a64 @ w64.T
    mag = np.abs(a64) @ (int4_magnitudes(w) if w.format == "int4" else np.abs(w64)).T
    if bias is not None:
        b64 = np.asarray(bias, dtype=np.float64)
        ref, mag = ref + b64, mag + np.abs(b64)
    return ref, mag


def check_gemm(out, a: np.ndarray, w: metrale.HostWeights, bias=None, route="auto") -> float:
    """Holds out to the float64 reference as the C++ suites do (toolkit/gemm_tolerance.h):
    per element |out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·(γ + u_w + γ·u_w)·S with γ = (K + 8)·2^-23
    and u_w the weights' own rounding (on the dequant route 2^-7: W rounded to BF16, and the
    product rounded once more before the bias by cuBLASLt where N % 8 != 0, Note [cuBLASLt bias
    rounding]; else 0); normalized error ≤ 8e-3 (+ 2^-8 on the dequant route, from 256 outputs)
    for K ≤ 1040. Returns the normalized error."""
    ref, mag = reference(a, w, bias)
    dequant = route == "dequant"
    got = check_bound(out, ref, mag, w.k, 2.0**-7 if dequant else 0.0)
    norm = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))
    if w.k <= 1040 and (not dequant or got.size >= 256):
        assert norm <= 8e-3 + (2.0**-8 if dequant else 0.0), f"normalized error {norm:.3g}"
    return norm


def check_bound(out, ref: np.ndarray, mag: np.ndarray, k: int, u_w: float = 0.0) -> np.ndarray:
    """Holds every element of out to |out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·(γ + u_w + γ·u_w)·S,
    γ = (K + 8)·2^-23, S = mag (toolkit/gemm_tolerance.h); out written everywhere. Returns out
    in float64."""
    got = np.asarray(out).astype(np.float64)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "an output element is NaN or infinite (unwritten?)"
    gamma = (k + 8) * 2.0**-23
    bound = 2.0**-8 * np.abs(ref) + (1 + 2.0**-8) * (gamma + u_w + gamma * u_w) * mag
    worst = np.max(np.abs(got - ref) - bound)
    assert worst <= 0, f"an element is {worst:.3g} past its bound"
    return got
