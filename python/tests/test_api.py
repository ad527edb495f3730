"""Every path of the Python API on the CPU backend, with NumPy arrays."""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest
from conftest import bf16, check_gemm, poisoned

import metrale


def test_backends_lists_cpu_and_says_why_cuda_is_missing():
    found = {b["name"]: b for b in metrale.backends()}
    assert found["cpu"]["available"] and found["cpu"]["device"]
    assert any(m["name"] == "w4a16" for m in found["cpu"]["modules"])
    cuda = found.get("cuda")
    if cuda is not None and not cuda["available"]:
        assert cuda["reason"], "an unavailable backend must say why"


def test_model_is_a_context_manager_with_a_clean_report():
    with metrale.Model("cpu") as model:
        assert model.backend == "cpu" and not model.closed
        model.upload_weights(metrale.quantize_nvfp4(np.ones((16, 32), np.float32)))
        assert model.stats()["owned_bytes"] > 0
    assert model.closed and model.report.clean
    assert model.report["released"] >= 2 and model.report["live_bytes_after"] == 0
    assert model.close() is model.report  # once only


def test_a_dirty_teardown_raises_leak_error():
    model = metrale.Model("cpu")
    real = model._m.teardown

    def leaky():
        report = real()
        return dict(report, clean=False, swept=1, summary="1 allocation(s), 4.0 KiB: from x.cpp:1")

    model._m = type("Stub", (), {"teardown": staticmethod(leaky)})()
    with pytest.raises(metrale.LeakError, match="x.cpp:1") as caught:
        model.close()
    assert isinstance(caught.value, RuntimeError) and caught.value.report["swept"] == 1


def test_closed_model_refuses_calls(rng):
    w = metrale.quantize_nvfp4(rng.standard_normal((16, 32)).astype(np.float32))
    with metrale.Model("cpu") as model:
        wd = model.upload_weights(w)
    with pytest.raises(metrale.StateError, match=r"\[gemm\].*torn down"):
        model.gemm(bf16(np.ones((1, 32))), wd)
    with pytest.raises(metrale.StateError, match=r"\[upload_weights\]"):
        model.upload_weights(w)


def test_weights_of_another_model_are_refused(rng, model):
    w = metrale.quantize_nvfp4(rng.standard_normal((16, 32)).astype(np.float32))
    with metrale.Model("cpu") as other:
        wd = other.upload_weights(w, label="theirs")
        with pytest.raises(metrale.InvalidArgumentError, match="w: weights 'theirs'"):
            model.gemm(bf16(np.ones((1, 32))), wd)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 3, 16, 70])
def test_gemm_against_float64(rng, model, fmt, m):
    n, k = 96, 256
    host = getattr(metrale, f"quantize_{fmt}")(rng.standard_normal((n, k)).astype(np.float32))
    assert (host.format, host.n, host.k) == (fmt, n, k)
    w = model.upload_weights(host)
    a = bf16(rng.standard_normal((m, k)))
    check_gemm(model.gemm(a, w), a, host)


@pytest.mark.parametrize("route", ["decode", "tiled", "dequant"])
def test_each_route_with_bias_into_a_poisoned_out(rng, model, route):
    n, k, m = 64, 128, 8
    host = metrale.quantize_nvfp4(rng.standard_normal((n, k)).astype(np.float32))
    w = model.upload_weights(host, layout="source")
    a, bias, out = bf16(rng.standard_normal((m, k))), bf16(rng.standard_normal(n)), poisoned(m, n)
    assert model.plan(m, w, route=route, bias=True).route == route
    assert model.gemm(a, w, out=out, route=route, bias=bias) is out
    check_gemm(out, a, host, bias, route)


def test_upload_from_codes_and_scales_arrays(rng, model):
    host = metrale.quantize_nvfp4(rng.standard_normal((32, 64)).astype(np.float32))
    w = model.upload_weights(np.array(host.codes), np.array(host.scales),
                             tensor_scale=host.tensor_scale, label="q_proj")
    assert (w.n, w.k, w.label, w.format) == (32, 64, "q_proj", "nvfp4")
    again = metrale.HostWeights(host.codes, host.scales, n=32, k=64,
                                tensor_scale=host.tensor_scale)
    np.testing.assert_array_equal(again.dequantize(), host.dequantize())
    a = bf16(rng.standard_normal((2, 64)))
    check_gemm(model.gemm(a, w), a, host)


def test_upload_in_the_panel_layout(rng, model):
    host = metrale.quantize_nvfp4(rng.standard_normal((70, 96)).astype(np.float32))
    try:
        panels = model.upload_weights(host, layout="panels")
    except metrale.Error as e:  # a backend whose kernels do not read it says so
        assert "panel layout" in str(e)
        return
    assert panels.packing == "panels"
    for m in (1, 3, 20):
        a = bf16(rng.standard_normal((m, 96)))
        check_gemm(model.gemm(a, panels), a, host)


def test_upload_in_the_decode_layout_and_the_transposed_source(rng, model):
    host = metrale.quantize_mxfp4(rng.standard_normal((64, 128)).astype(np.float32))
    packed = model.upload_weights(host, layout="decode")
    assert packed.packing == "decode"
    a = bf16(rng.standard_normal((4, 128)))
    check_gemm(model.gemm(a, packed), a, host)
    t = metrale.HostWeights(np.ascontiguousarray(np.array(host.codes).T),
                            np.ascontiguousarray(np.array(host.scales).T), n=64, k=128,
                            format="mxfp4", layout="transposed")
    assert t.layout == "transposed" and t.codes.shape == (64, 64)
    check_gemm(model.gemm(a, model.upload_weights(t, layout="source")), a, host)


def test_plan_names_route_kernels_grid_and_workspace(rng, model):
    # The source layout: the forced dequant route below reads no other (the CPU prefers panels).
    w = model.upload_weights(metrale.quantize_nvfp4(rng.standard_normal((128, 256)).astype(np.float32)),
                             layout="source")
    p = model.plan(1, w)
    assert (p.route, p.m, p.n, p.k) == ("decode", 1, 128, 256)
    assert p.launches and all({"kernel", "grid", "block", "smem_bytes"} <= set(x) for x in p.launches)
    assert p.launches[0]["kernel"].startswith("w4a16::")
    assert p.workspace_bytes >= 0 and "decode M=1" in p.describe()
    assert model.plan(256, w, route="dequant").dense is not None


def test_stats_tell_owned_from_borrowed(rng, model):
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 64)).astype(np.float32))
    w = model.upload_weights(host)
    before = model.stats()
    assert before["owned_bytes"] >= w.nbytes and before["borrowed_bytes"] == 0
    model.gemm(bf16(np.ones((2, 64))), w)
    after = model.stats()
    assert after["borrow_count"] == before["borrow_count"] + 2  # a and out, lent for the call
    assert after["borrowed_bytes"] == 0 and after["borrowed_count"] == 0  # given back
    assert after["owned_bytes"] == before["owned_bytes"]  # nothing of the caller's is copied in


def _write_safetensors(path, tensors: dict) -> None:
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_checkpoint_layers_load_and_run(tmp_path, rng, model):
    w32 = rng.standard_normal((32, 64)).astype(np.float32)
    host = metrale.quantize_nvfp4(w32)
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, {
        "mlp.down.weight": ("U8", (32, 32), np.array(host.codes).tobytes()),
        "mlp.down.weight_scale": ("F8_E4M3", (32, 4), np.array(host.scales).tobytes()),
        "mlp.down.weight_scale_2": ("F32", (), struct.pack("<f", host.tensor_scale)),
        "mlp.down.input_scale": ("F32", (), struct.pack("<f", 0.5)),
        "lm.weight": ("F32", (16, 64), w32[:16].tobytes()),
        "odd.weight": ("F32", (4, 4), np.zeros((4, 4), np.float32).tobytes()),
    })
    ckpt = metrale.load_safetensors(str(path))
    assert ckpt.layers == ["lm", "mlp.down"]
    assert [r["layer"] for r in ckpt.rejected] == ["odd"] and ckpt.rejected[0]["why"]
    assert ckpt.input_scale("mlp.down") == 0.5 and ckpt.input_scale("lm") is None
    loaded = ckpt.weights("mlp.down")
    np.testing.assert_array_equal(loaded.dequantize(), host.dequantize())
    a = bf16(rng.standard_normal((3, 64)))
    check_gemm(model.gemm(a, model.upload_weights(loaded)), a, loaded)
    with pytest.raises(metrale.NotFoundError, match="nope"):
        ckpt.weights("nope")


CHECKPOINTS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "checkpoints"


@pytest.mark.parametrize("folder, fmt, source", [
    ("ct-nvfp4a16", "nvfp4", "compressed-tensors NVFP4"),
    ("ct-mxfp4a16", "mxfp4", "compressed-tensors MXFP4"),
])
def test_compressed_tensors_checkpoints_load_and_run(folder, fmt, source, rng, model):
    # Made by llm-compressor (tests/fixtures/checkpoints/make_compressed_tensors.py).
    ckpt = metrale.load_safetensors(str(CHECKPOINTS / folder / "model.safetensors"))
    quantized = [l for l in ckpt.layers if ckpt.source(l) == source]
    assert len(quantized) == 7 and not any(r["quantized"] for r in ckpt.rejected)
    assert ckpt.source("lm_head") == "BF16, quantized to NVFP4 on load"
    loaded = ckpt.weights("model.layers.0.mlp.down_proj")
    assert loaded.format == fmt and (loaded.n, loaded.k) == (64, 128)
    a = bf16(rng.standard_normal((3, 128)))
    check_gemm(model.gemm(a, model.upload_weights(loaded)), a, loaded)


def test_a_sharded_folder_loads_as_its_single_file():
    # The same model saved in shards (a layer's global scale in another shard than its codes).
    sharded = metrale.load_safetensors(str(CHECKPOINTS / "ct-nvfp4a16-sharded"))
    single = metrale.load_safetensors(str(CHECKPOINTS / "ct-nvfp4a16" / "model.safetensors"))
    assert sharded.path.endswith("model.safetensors.index.json")
    assert sharded.layers == single.layers
    for layer in single.layers:
        a, b = sharded.weights(layer), single.weights(layer)
        np.testing.assert_array_equal(a.dequantize(), b.dequantize())
        assert sharded.source(layer) == single.source(layer)
    with pytest.raises(metrale.NotFoundError, match="nope"):
        sharded.weights("nope")


def test_int4_layers_load_as_int4():
    ckpt = metrale.load_safetensors(str(CHECKPOINTS / "ct-w4a16" / "model.safetensors"))
    assert len(ckpt.layers) == 9 and not [r for r in ckpt.rejected if r["quantized"]]
    w = ckpt.weights("model.layers.0.mlp.down_proj")
    assert ckpt.source("model.layers.0.mlp.down_proj") == "compressed-tensors INT4"
    assert (w.format, w.n, w.k, w.group, w.scale_type) == ("int4", 64, 128, 32, "bf16")
    assert w.zeros is None and w.k_perm is None  # symmetric, K in its own order
    assert np.array(w.scales).shape == (64, 2 * 128 // 32)
    act = metrale.load_safetensors(str(CHECKPOINTS / "gptq-desc-act")).weights(
        "model.layers.0.mlp.down_proj")
    assert act.scale_type == "fp16" and sorted(np.array(act.k_perm)[0]) == list(range(256))


@pytest.mark.parametrize("group,zero_points,fp16", [(32, False, False), (64, True, True),
                                                    (128, True, False), (256, False, True)])
def test_int4_gemm_matches_float64(rng, group, zero_points, fp16):
    host = metrale.quantize_int4(rng.standard_normal((40, 512)) + (1.5 if zero_points else 0),
                                 group=group, zero_points=zero_points, fp16_scales=fp16)
    assert (host.format, host.group) == ("int4", group)
    assert (host.zeros is not None) == zero_points
    with metrale.Model("cpu") as model:
        w = model.upload_weights(host)
        for m in (1, 3, 17):
            a = bf16(rng.standard_normal((m, 512)))
            check_gemm(model.gemm(a, w, out=poisoned(m, 40)), a, host)


def test_bad_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(metrale.IoError, match="broken.safetensors"):
        metrale.load_safetensors(str(path))


def test_quantizers_take_any_float_array(rng):
    w64 = rng.standard_normal((8, 64))
    a = metrale.quantize_nvfp4(w64)
    b = metrale.quantize_nvfp4(w64.astype(np.float32))
    np.testing.assert_array_equal(np.array(a.codes), np.array(b.codes))
    assert metrale.quantize_mxfp4(w64).format == "mxfp4"
    deq = a.dequantize(exact=True)
    assert deq.dtype == np.float64 and np.abs(deq - w64).max() < 0.5 * np.abs(w64).max()


def test_output_array_outlives_its_model(rng):
    host = metrale.quantize_nvfp4(rng.standard_normal((16, 32)).astype(np.float32))
    a = bf16(rng.standard_normal((2, 32)))
    with metrale.Model("cpu") as model:
        c = model.gemm(a, model.upload_weights(host))
    assert c.shape == (2, 16) and c.dtype == "bfloat16"
    check_gemm(c, a, host)  # still readable: NumPy owns its memory, not the model
