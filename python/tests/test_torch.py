"""torch CPU tensors in and out without a copy (skipped where torch is not installed: CI's
default, see README; `pip install torch` runs it)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import check_gemm, need

import metrale

torch = need("torch")


def test_torch_cpu_tensors_in_place():
    g = torch.Generator().manual_seed(1)
    host = metrale.quantize_nvfp4(torch.randn(96, 256, generator=g))
    a = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    with metrale.Model("cpu") as model:
        w = model.upload_weights(host)
        out = torch.full((5, 96), float("nan"), dtype=torch.bfloat16)
        assert model.gemm(a, w, out=out) is out
        arr = model.gemm(a, w)
        c = torch.from_dlpack(arr)
        a64 = a.double().numpy()
        check_gemm(out.float().numpy(), a64, host)
        check_gemm(c.float().numpy(), a64, host)
        c[0, 0] = 7.0  # the tensor and the Array share memory
        assert float(arr.numpy()[0, 0]) == 7.0 and c.data_ptr() == arr.data_ptr
    codes = torch.from_numpy(np.array(host.codes))
    again = metrale.HostWeights(codes, torch.from_numpy(np.array(host.scales)), n=96, k=256,
                                tensor_scale=host.tensor_scale)
    np.testing.assert_array_equal(again.dequantize(), host.dequantize())
