"""The numeric check itself fails on planted faults, so a passing GEMM test means something."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import BF16_NAN, bf16, check_gemm

import metrale


@pytest.fixture
def good(rng, model):
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 128)).astype(np.float32))
    a = bf16(rng.standard_normal((8, 128)))
    out = np.asarray(model.gemm(a, model.upload_weights(host))).copy()
    check_gemm(out, a, host)  # the unplanted result passes
    return out, a, host


def test_one_wrong_element_fails(good):
    out, a, host = good
    out[3, 7] = out[3, 7] * 1.05 + 0.01
    with pytest.raises(AssertionError, match="past its bound"):
        check_gemm(out, a, host)


def test_an_unwritten_element_fails(good):
    out, a, host = good
    out.view(np.uint16)[5, 60] = BF16_NAN
    with pytest.raises(AssertionError, match="NaN"):
        check_gemm(out, a, host)


def test_other_weights_fail(good, rng):
    out, a, host = good
    # A swapped nibble order, as a wrong unpack would read the codes.
    codes = np.array(host.codes)
    swapped = ((codes >> 4) | (codes << 4)).astype(np.uint8)
    wrong = metrale.HostWeights(swapped, np.array(host.scales), n=64, k=128,
                                tensor_scale=host.tensor_scale)
    with pytest.raises(AssertionError):
        check_gemm(out, a, wrong)


def test_a_missing_bias_fails(good, rng):
    out, a, host = good
    bias = rng.standard_normal(64).astype(ml_dtypes.bfloat16)
    with pytest.raises(AssertionError):
        check_gemm(out, a, host, bias)
