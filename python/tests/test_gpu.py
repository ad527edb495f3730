"""CUDA tensors through torch on the device, without a copy (skipped without a GPU and torch)."""

from __future__ import annotations

import numpy as np
import pytest

import metrale

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not any(
        b["name"] == "cuda" and b["available"] for b in metrale.backends()):
    pytest.skip("needs a CUDA GPU, torch with CUDA and metrale's CUDA backend",
                allow_module_level=True)


def test_torch_cuda_tensors_in_place():
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(512, 1024, generator=g)
    host = metrale.quantize_nvfp4(w32)
    a = torch.randn(16, 1024, generator=g).to(torch.bfloat16).cuda()
    with metrale.Model("cuda") as model:
        w = model.upload_weights(host)
        out = torch.full((16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert model.gemm(a, w, out=out) is out
        c = model.gemm(a, w)  # allocated by torch on a's device
        tc = torch.from_dlpack(c)
        assert tc.data_ptr() == c.data_ptr and tc.device.type == "cuda"
        ref = a.double().cpu().numpy() @ host.dequantize(exact=True).T
        for got in (out, tc):
            got64 = got.double().cpu().numpy()
            assert np.isfinite(got64).all()
            assert np.linalg.norm(got64 - ref) / np.linalg.norm(ref) < 8e-3
        assert model.stats()["borrowed_count"] == 0
