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


def test_torch_op_on_torch_stream_and_in_a_cuda_graph(rng):
    """metrale.torch.cuda_stream("torch"): the op runs on torch's current stream, in order with
    the work before it (a side stream whose input is written after a long device sleep: a call
    not ordered after the copy reads zeros), returns without waiting, and is captured by
    torch.cuda.graph (global capture mode) after the warm-up torch asks for; each replay
    computes the fresh input. The ledger holds no borrow afterwards."""
    mt = pytest.importorskip("metrale.torch")
    host = metrale.quantize_nvfp4(torch.from_numpy(rng.standard_normal((384, 1024))).float())
    wq = host.dequantize(exact=True)

    def fresh():
        return torch.from_numpy(rng.standard_normal((4, 1024))).to(torch.bfloat16).cuda()

    with metrale.Model("cuda") as model:
        handle = mt.register(model, model.upload_weights(host))
        previous = mt.cuda_stream("torch")
        try:
            side = torch.cuda.Stream()
            src = fresh()
            x = torch.zeros((4, 1024), dtype=torch.bfloat16, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # about 0.1 s of device time before the copy
                x.copy_(src)
                y = torch.ops.metrale.linear(x, handle)
            side.synchronize()
            assert _normalized(y, src.double().cpu().numpy() @ wq.T) < BF16_BOUND

            static_x = torch.zeros((4, 1024), dtype=torch.bfloat16, device="cuda")
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                for _ in range(2):
                    torch.ops.metrale.linear(static_x, handle)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = torch.ops.metrale.linear(static_x, handle)
            for _ in range(2):
                src = fresh()
                static_x.copy_(src)
                graph.replay()
                torch.cuda.synchronize()
                assert _normalized(static_y, src.double().cpu().numpy() @ wq.T) < BF16_BOUND
            del graph
        finally:
            mt.cuda_stream(previous)
            mt.unregister(handle)
        assert model.stats()["borrowed_count"] == 0


def test_model_gemm_on_a_caller_stream_in_a_cuda_graph(rng):
    """Model.gemm(stream=...) with 4-bit and BF16 dense weights (cuBLASLt under capture, its
    workspace allocated inside the capture), captured on torch's capture stream and replayed."""
    host = metrale.quantize_mxfp4(torch.from_numpy(rng.standard_normal((256, 512))).float())
    dense = torch.from_numpy(rng.standard_normal((264, 512))).to(torch.bfloat16)
    x = torch.zeros((8, 512), dtype=torch.bfloat16, device="cuda")
    with metrale.Model("cuda") as model:
        w = model.upload_weights(host)
        dw = model.upload_dense_weights(dense)
        y4 = torch.empty((8, 256), dtype=torch.bfloat16, device="cuda")
        yd = torch.empty((8, 264), dtype=torch.bfloat16, device="cuda")
        model.gemm(x, w, out=y4)  # warm-up on metrale's stream: kernels resolved, plans made
        model.gemm(x, dw, out=yd)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stream = torch.cuda.current_stream().cuda_stream
            model.gemm(x, w, out=y4, stream=stream)
            model.gemm(x, dw, out=yd, stream=stream)
        src = torch.from_numpy(rng.standard_normal((8, 512))).to(torch.bfloat16).cuda()
        x.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        a = src.double().cpu().numpy()
        assert _normalized(y4, a @ host.dequantize(exact=True).T) < BF16_BOUND
        assert _normalized(yd, a @ dense.double().numpy().T) < BF16_BOUND
        del graph
        assert model.stats()["borrowed_count"] == 0


def test_a_capture_in_own_stream_mode_is_refused_by_name(rng):
    """In the default mode (metrale's own stream, each call waited for) a capture cannot hold the
    op: it says so, naming the switch, instead of breaking the capture."""
    mt = pytest.importorskip("metrale.torch")
    host = metrale.quantize_nvfp4(torch.from_numpy(rng.standard_normal((128, 256))).float())
    x = torch.zeros((2, 256), dtype=torch.bfloat16, device="cuda")
    with metrale.Model("cuda") as model:
        handle = mt.register(model, model.upload_weights(host))
        previous = mt.cuda_stream("own")
        try:
            graph = torch.cuda.CUDAGraph()
            with pytest.raises(metrale.CaptureError, match="cuda_stream"):
                with torch.cuda.graph(graph):
                    torch.ops.metrale.linear(x, handle)
        finally:
            mt.cuda_stream(previous)
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


@pytest.mark.parametrize("name,route", [("gptoss-mxfp4", "auto"), ("qwen3moe-ct-w4a16", "auto"),
                                        ("qwen3moe-ct-w4a16", "fused"),
                                        ("qwen3moe-gptq", "auto"), ("qwen3moe-awq", "fused"),
                                        ("qwen3moe-gptq-desc-act", "auto"),
                                        ("qwen3moe-transformers-fp8", "auto"),
                                        ("qwen3moe-transformers-fp8", "tiled")])
def test_moe_model_on_cuda_against_float64_and_the_cpu_backend(rng, name, route):
    """An MoE model (gpt-oss MXFP4 experts packed; Qwen3-MoE INT4 experts per expert, on the
    decode kernels and on the fused one, with BF16 scales (compressed-tensors) and FP16 ones
    (GPTQ's groups of 128, AWQ's groups of 64 with zero points), and FP8 block-128 ones on the grouped W8A8 op, on its
    decode kernel and on its tiled one) with its
    experts on the CUDA backend, opted in to the MoE kernels and grouped GEMMs no device had run
    (allow_unverified): every MoE layer's output against its float64 layer of the same routing
    (test_torch_moe's check), the logits against the CPU backend's within BF16 noise, and a
    planted fault (layer 0's experts computing with layer 1's) seen."""
    pytest.importorskip("transformers")
    mt = pytest.importorskip("metrale.torch")
    from test_torch_moe import check_experts_in_place, moe_reference

    folder = MODELS / name
    _, experts = moe_reference(folder)
    ids = torch.from_numpy(rng.integers(0, 256, (2, 12)))
    cpu, cpu_model = _logits(folder, "cpu", ids)
    gpu_model = mt.from_pretrained(str(folder), backend="cuda", allow_unverified=True,
                                   moe_route=route).cuda()
    checked = []

    def hook(n):
        def check(module, inputs, output):
            check_experts_in_place(n, tuple(i.cpu() for i in inputs), output.cpu(), experts[n])
            checked.append(n)
        return check

    hooks = [m.register_forward_hook(hook(n)) for n, m in gpu_model.named_modules()
             if isinstance(m, mt.MoeExperts)]
    try:
        with torch.no_grad():
            gpu = gpu_model(ids.cuda()).logits.double().cpu()
        assert sorted(set(checked)) == sorted(experts)
        for h in hooks:
            h.remove()
        err = float((gpu - cpu).norm() / cpu.norm())
        assert err < 2e-2, f"{name}: logits differ by {err:.3g} (normalized)"
        mlp = [layer.mlp for layer in gpu_model.model.layers]
        mlp[0].experts, saved = mlp[1].experts, mlp[0].experts
        with torch.no_grad():
            wrong = gpu_model(ids.cuda()).logits.double().cpu()
        mlp[0].experts = saved
        assert float((wrong - cpu).norm() / cpu.norm()) > 2e-2, "the planted fault went unseen"
    finally:
        cpu_model.metrale.close()
        gpu_model.metrale.close()
