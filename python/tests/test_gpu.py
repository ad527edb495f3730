"""CUDA tensors through torch on the device, without a copy; torch.ops.metrale.linear and a whole
transformers model on CUDA (skipped without a GPU and torch; scripts/device-check.sh fails the
step on a skip where it finds a GPU)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import metrale

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not any(
        b["name"] == "cuda" and b["available"] for b in metrale.backends()):
    pytest.skip("needs a CUDA GPU, torch with CUDA and metrale's CUDA backend",
                allow_module_level=True)

MODELS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
BF16_BOUND = 8e-3  # normalized error of one BF16 GEMM with K ≤ 1024 against float64


def _normalized(got: torch.Tensor, ref: np.ndarray) -> float:
    got64 = got.double().cpu().numpy()
    assert np.isfinite(got64).all(), "an output element is NaN (unwritten?)"
    return float(np.linalg.norm(got64 - ref) / np.linalg.norm(ref))


def test_torch_cuda_tensors_in_place(rng):
    host = metrale.quantize_nvfp4(torch.from_numpy(rng.standard_normal((512, 1024))).float())
    a = torch.from_numpy(rng.standard_normal((16, 1024))).to(torch.bfloat16).cuda()
    with metrale.Model("cuda") as model:
        w = model.upload_weights(host)
        out = torch.full((16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert model.gemm(a, w, out=out) is out
        c = model.gemm(a, w)  # allocated by torch on a's device
        tc = torch.from_dlpack(c)
        assert tc.data_ptr() == c.data_ptr and tc.device.type == "cuda"
        ref = a.double().cpu().numpy() @ host.dequantize(exact=True).T
        for got in (out, tc):
            assert _normalized(got, ref) < BF16_BOUND
        assert model.stats()["borrowed_count"] == 0


def test_dense_weights_on_cuda(rng):
    """BF16 weights as they are, on cuBLASLt's dense GEMM, with CUDA tensors (ragged N)."""
    w = torch.from_numpy(rng.standard_normal((257, 512))).to(torch.bfloat16)
    a = torch.from_numpy(rng.standard_normal((8, 512))).to(torch.bfloat16).cuda()
    bias = torch.from_numpy(rng.standard_normal(257)).to(torch.bfloat16).cuda()
    with metrale.Model("cuda") as model:
        dw = model.upload_dense_weights(w)
        out = torch.full((8, 257), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert model.gemm(a, dw, out=out, bias=bias) is out
        ref = a.double().cpu().numpy() @ w.double().numpy().T + bias.double().cpu().numpy()
        assert _normalized(out, ref) < BF16_BOUND


def test_torch_op_on_cuda_tensors(rng):
    """torch.ops.metrale.linear with CUDA tensors (3-D input, a bias), eager and through
    torch.compile(fullgraph=True): the op's CUDA kernel is metrale.Model.gemm on the model's
    stream."""
    mt = pytest.importorskip("metrale.torch")
    host = metrale.quantize_mxfp4(torch.from_numpy(rng.standard_normal((384, 512))).float())
    x = torch.from_numpy(rng.standard_normal((2, 3, 512))).to(torch.bfloat16).cuda()
    bias = torch.from_numpy(rng.standard_normal(384)).to(torch.bfloat16).cuda()
    with metrale.Model("cuda") as model:
        handle = mt.register(model, model.upload_weights(host))
        y = torch.ops.metrale.linear(x, handle, bias)
        assert y.device == x.device and y.shape == (2, 3, 384) and y.dtype == torch.bfloat16
        ref = (x.double().cpu().numpy().reshape(6, 512) @ host.dequantize(exact=True).T +
               bias.double().cpu().numpy()).reshape(2, 3, 384)
        assert _normalized(y, ref) < BF16_BOUND
        twice = torch.compile(lambda t: torch.ops.metrale.linear(t, handle, bias) * 2,
                              fullgraph=True, backend="aot_eager")
        assert torch.equal(twice(x), y * 2)
        mt.unregister(handle)


def _logits(folder: pathlib.Path, backend: str, ids: torch.Tensor) -> tuple:
    mt = pytest.importorskip("metrale.torch")
    model = mt.from_pretrained(str(folder), backend=backend)
    device = "cuda" if backend == "cuda" else "cpu"
    with torch.no_grad():
        return model.to(device)(ids.to(device)).logits.double().cpu(), model


@pytest.mark.parametrize("name", ["llama-ct-nvfp4a16", "qwen3-modelopt-nvfp4"])
def test_whole_model_on_cuda_matches_the_cpu_backend(rng, name):
    """A transformers model from an llm-compressor / ModelOpt checkpoint, its quantized linears
    on the CUDA backend and the rest on torch's CUDA, against the same model on the CPU backend
    (checked against transformers' forward by test_torch_model): logits within BF16 noise, and
    a planted fault (one layer's weights swapped for another's) is seen."""
    pytest.importorskip("transformers")
    folder = MODELS / name
    ids = torch.from_numpy(rng.integers(0, 256, (2, 12)))
    cpu, cpu_model = _logits(folder, "cpu", ids)
    gpu, gpu_model = _logits(folder, "cuda", ids)
    try:
        err = float((gpu - cpu).norm() / cpu.norm())
        assert err < 2e-2, f"{name}: logits differ by {err:.3g} (normalized)"
        # The planted fault: layer 0's down projection computes with layer 1's weights.
        layers = gpu_model.model.layers
        layers[0].mlp.down_proj, saved = layers[1].mlp.down_proj, layers[0].mlp.down_proj
        with torch.no_grad():
            wrong = gpu_model(ids.cuda()).logits.double().cpu()
        layers[0].mlp.down_proj = saved
        assert float((wrong - cpu).norm() / cpu.norm()) > 2e-2, "the planted fault went unseen"
    finally:
        cpu_model.metrale.close()
        gpu_model.metrale.close()
