"""metrale.load on checkpoints the field's quantizers made (tests/fixtures/checkpoints:
llm-compressor's compressed-tensors NVFP4A16, MXFP4A16, FP8_BLOCK and INT4 W4A16 (symmetric,
asymmetric, per channel), ModelOpt's NVFP4 export, a sharded folder, and GPTQ and AWQ folders
packed from those libraries' code): every quantized layer uploaded and its GEMM held to the weights
as the library that wrote them reads them back (reference.safetensors beside each, written by
make_compressed_tensors.py / make_modelopt.py / make_int4.py with the library's own
dequantization), the
BF16 linears kept as the file holds them, what was loaded said, and what cannot be loaded refused
by name with nothing left on a device."""

from __future__ import annotations

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest
from conftest import bf16, poisoned
from test_w8a8 import _check_w8a8

import metrale

CHECKPOINTS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "checkpoints"
U = 2.0**-8  # BF16's unit roundoff


def _library_weights(folder: pathlib.Path) -> dict:
    """Each quantized layer's weights as the producing library dequantizes them, in float64: its
    E2M1 values times its block scales (divided by the global scale, compressed-tensors' divisor)
    where the reference holds them (its own `dequantized` is rounded to BF16); INT4 from
    compressed-tensors: (code − zero) times scale per group, from the library's own unpacking
    (its `dequantized` is rounded to BF16); else its `dequantized` (ModelOpt's, exact in float32;
    FP8: code times block scale; GPTQ and AWQ: (code − zero) times FP16 scale, exact)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    ref = load_file(str(folder / "reference.safetensors"))
    out = {}
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        for key, v in ref.items():
            if not key.endswith(".dequantized"):
                continue
            layer = key[: -len(".dequantized")]
            if layer + ".codes" not in ref or (layer + ".zeros" in ref
                                               and layer + ".weight_packed" not in f.keys()):
                out[layer] = v.astype(np.float64)
                continue
            if layer + ".zeros" in ref:  # compressed-tensors INT4: groups in K's own order
                codes, zeros = ref[layer + ".codes"].astype(np.float64), ref[layer + ".zeros"]
                scale = ref[layer + ".scales"].astype(np.float64)
                g = codes.shape[1] // scale.shape[1]
                out[layer] = (codes - np.repeat(zeros, g, axis=1)) * np.repeat(scale, g, axis=1)
                continue
            codes, scale = ref[layer + ".codes"], ref[layer + ".block_scale"]
            w = codes.astype(np.float64) * np.repeat(scale.astype(np.float64),
                                                     codes.shape[1] // scale.shape[1], axis=1)
            if layer + ".weight_global_scale" in f.keys():
                w /= float(f.get_tensor(layer + ".weight_global_scale")[0])
            out[layer] = w
    return out


def _check_w4a16(out, a: np.ndarray, w: np.ndarray, mag_w: np.ndarray = None) -> None:
    """|out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·γ·S per element, γ = (K + 8)·2^-23, S = Σ|a|·mag_w
    with mag_w = |w| (the C++ suites' GEMM bound, toolkit/gemm_tolerance.h), or INT4's
    (|code − 8| + |8 − zero|)·scale where given (_int4_magnitudes)."""
    a64 = np.asarray(a, dtype=np.float64)
    ref, mag = a64 @ w.T, np.abs(a64) @ (np.abs(w) if mag_w is None else mag_w).T
    got = np.asarray(out).astype(np.float64)
    assert np.isfinite(got).all(), "an output element is NaN (unwritten?)"
    gamma = (w.shape[1] + 8) * 2.0**-23
    worst = np.max(np.abs(got - ref) - (U * np.abs(ref) + (1 + U) * gamma * mag))
    assert worst <= 0, f"an element is {worst:.3g} past its bound"


def _int4_magnitudes(folder: pathlib.Path) -> dict:
    """What an INT4 layer's roundings scale with (toolkit/gemm_tolerance.h, "INT4"): metrale's
    kernels sum a·(code − 8) and a·(8 − zero) apart, so S takes (|code − 8| + |8 − zero|)·scale.
    From the reference's codes, zeros and scales, for the layers whose groups lie in K's order."""
    from safetensors.numpy import load_file

    ref = load_file(str(folder / "reference.safetensors"))
    out = {}
    for key, zeros in ref.items():
        if key.endswith(".zeros"):
            layer = key[: -len(".zeros")]
            codes, scale = ref[layer + ".codes"].astype(np.float64), ref[layer + ".scales"]
            g = codes.shape[1] // scale.shape[1]
            z = np.repeat(zeros.astype(np.float64), g, axis=1)
            out[layer] = (np.abs(codes - 8) + np.abs(8 - z)) * np.repeat(
                scale.astype(np.float64), g, axis=1)
    return out


FOLDERS = {
    "ct-nvfp4a16": "7 layer(s) compressed-tensors NVFP4",
    "ct-mxfp4a16": "7 layer(s) compressed-tensors MXFP4",
    "modelopt-nvfp4": "7 layer(s) ModelOpt NVFP4",
    "ct-fp8-block": "7 layer(s) compressed-tensors FP8 block-128",
    "ct-nvfp4a16-sharded": "7 layer(s) compressed-tensors NVFP4",
    "ct-w4a16": "7 layer(s) compressed-tensors INT4",
    "ct-w4a16-asym": "7 layer(s) compressed-tensors INT4",
    "ct-w4a16-channel": "7 layer(s) compressed-tensors INT4",
    "gptq-v1": "7 layer(s) GPTQ INT4",
    "gptq-v2": "7 layer(s) GPTQ INT4",
    "gptq-desc-act": "7 layer(s) GPTQ INT4",
    "awq": "7 layer(s) AWQ INT4",
}


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_every_layer_computes_with_the_library_weights(rng, name):
    folder = CHECKPOINTS / name
    library = _library_weights(CHECKPOINTS / name.removesuffix("-sharded"))
    magnitudes = _int4_magnitudes(CHECKPOINTS / name.removesuffix("-sharded"))
    with metrale.load(str(folder), backend="cpu") as ckpt:
        assert set(ckpt.layers) == set(library)
        assert ckpt.summary.split(": ", 1)[1].startswith(FOLDERS[name])
        for layer, w in ckpt.layers.items():
            a = bf16(rng.standard_normal((5, w.k)))
            out = poisoned(5, w.n)
            fp8 = w.format == "e4m3_block128"
            ckpt.model.gemm(a, w, out=out, allow_e4m3=fp8)
            try:
                if fp8:
                    _check_w8a8(out, a, library[layer])
                else:
                    _check_w4a16(out, a, library[layer], magnitudes.get(layer))
            except AssertionError as e:
                raise AssertionError(f"{layer}: {e}") from None
        assert ckpt.model.stats()["owned_bytes"] > 0
    assert ckpt.model.closed and ckpt.model.report.clean


def test_what_was_loaded_is_said():
    folder = CHECKPOINTS / "modelopt-nvfp4"
    with metrale.load(str(folder), backend="cpu") as ckpt:
        s = ckpt.summary
        assert s.startswith(f"{folder}/model.safetensors: 7 layer(s) ModelOpt NVFP4; ")
        assert "1 layer(s) kept in floats, not quantized (lm_head)" in s
        assert "4 other tensor(s) (embeddings, norms), not loaded" in s
        assert "declared modelopt 'NVFP4'" in s and "metrale keeps them BF16 and runs W4A16" in s
        assert set(ckpt.sources.values()) == {"ModelOpt NVFP4"}
        assert ckpt.other == ["model.embed_tokens.weight",
                              "model.layers.0.input_layernorm.weight",
                              "model.layers.0.post_attention_layernorm.weight",
                              "model.norm.weight"]
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "np") as f:
            head = f.get_slice("lm_head.weight")
            # Kept BF16, on the model as it is: the dense GEMM runs it (test_dense.py).
            assert isinstance(ckpt.dense["lm_head"], metrale.DenseWeights)
            assert (ckpt.dense["lm_head"].n, ckpt.dense["lm_head"].k) == tuple(head.get_shape())
        norm = ckpt.tensor("model.norm.weight")
        assert norm.dtype == ml_dtypes.bfloat16 and norm.shape == (64,)
        # Every tensor of the file is accounted for: a layer's own, a dense layer, or other.
        assert ckpt.declared["every_linear"] and ckpt.declared["ignore"] == ["lm_head",
                                                                           "model.embed_tokens"]


def without_gptq_zeros(tmp_path: pathlib.Path) -> pathlib.Path:
    """The GPTQ fixture with its zero points renamed in the header (the file otherwise the same):
    layers that look quantized but cannot be read."""
    import struct

    raw = (CHECKPOINTS / "gptq-v1" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = {k.replace(".qzeros", ".qzeros_renamed"): v
              for k, v in json.loads(raw[8:8 + n]).items()}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return tmp_path


def test_unreadable_quantized_layers_are_refused_by_name(tmp_path):
    with pytest.raises(metrale.IoError, match=r"\[metrale.load\] tensors that look quantized but "
                       r"that metrale cannot read: model.layers.0.mlp.down_proj.qzeros: not in "
                       r"the file, but GPTQ and AWQ weights need their zero points"):
        metrale.load(str(without_gptq_zeros(tmp_path)), backend="cpu")


def test_a_checkpoint_without_quantized_layers_is_refused(tmp_path):
    from safetensors.numpy import save_file

    save_file({"model.layers.0.mlp.up_proj.weight": np.ones((32, 64), np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(metrale.IoError, match=r"holds no quantized layer .*quantize_nvfp4"):
        metrale.load(str(tmp_path), backend="cpu")


def test_layers_that_disagree_with_the_config_are_refused(tmp_path):
    src = CHECKPOINTS / "ct-fp8-block"
    shutil.copy(src / "model.safetensors", tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["ignore"] = []
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(metrale.IoError, match=r"quantizes every Linear but its ignore list, yet "
                       r"the checkpoint holds these in plain floats: lm_head"):
        metrale.load(str(tmp_path), backend="cpu")
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*down_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(metrale.IoError, match=r"ignores model.layers.0.mlp.down_proj, which the "
                       r"checkpoint holds quantized"):
        metrale.load(str(tmp_path), backend="cpu")


def test_a_failed_upload_leaves_nothing(monkeypatch):
    made = []

    class Recording(metrale.Model):
        def __init__(self, backend):
            super().__init__(backend)
            made.append(self)

        def upload_fp8_weights(self, *args, **kwargs):
            if len(made[0].stats()) and self.stats()["owned_bytes"] > 0:
                raise metrale.OutOfMemoryError("planted: out of memory on the second layer")
            return super().upload_fp8_weights(*args, **kwargs)

    monkeypatch.setattr(metrale.folder, "Model", Recording)
    with pytest.raises(metrale.OutOfMemoryError, match="planted"):
        metrale.load(str(CHECKPOINTS / "ct-fp8-block"), backend="cpu")
    assert len(made) == 1 and made[0].closed and made[0].report.clean


@pytest.mark.parametrize("name,block", [("ct-nvfp4a16", 16), ("ct-mxfp4a16", 32),
                                        ("ct-fp8-block", 128), ("ct-w4a16-asym", 128),
                                        ("awq", 128)])
def test_the_check_fails_on_a_planted_fault(rng, name, block):
    """The check above, shown failing: one block of the reference weights scaled by 1.25, and
    two layers' references swapped."""
    library = _library_weights(CHECKPOINTS / name)
    with metrale.load(str(CHECKPOINTS / name), backend="cpu") as ckpt:
        layer, other = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"
        w = ckpt.layers[layer]
        fp8 = w.format == "e4m3_block128"
        check = _check_w8a8 if fp8 else _check_w4a16
        a = bf16(rng.standard_normal((5, w.k)))
        out = ckpt.model.gemm(a, w, allow_e4m3=fp8)
        check(out, a, library[layer])
        wrong = library[layer].copy()
        wrong[:block, :block] *= 1.25
        with pytest.raises(AssertionError, match="past its bound"):
            check(out, a, wrong)
        with pytest.raises(AssertionError, match="past its bound"):
            check(out, a, library[other])


def test_plain_layers_are_not_quantized_to_be_named(tmp_path):
    """Naming a layer's source quantized every BF16 layer to NVFP4 and threw it away (0.15 s for
    a 4096 x 4096 one), so an inf in a layer the config leaves in floats failed the whole load.
    The source now comes from the header: lm_head, ignored and holding an inf, loads as it is."""
    from conftest import need

    torch = need("torch")
    from safetensors.torch import load_file, save_file

    src = CHECKPOINTS / "ct-nvfp4a16"
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    tensors["lm_head.weight"][0, 0] = float("inf")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = metrale.load(str(tmp_path), backend="cpu")
    try:
        assert "lm_head" in loaded.dense
        assert "lm_head" not in loaded.layers
    finally:
        loaded.model.close()
