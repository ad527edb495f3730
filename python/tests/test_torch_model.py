"""A whole transformers model through metrale.torch against transformers' own forward.

The checkpoints are the ones llm-compressor and ModelOpt made (tests/fixtures/checkpoints, with
the scripts that made them); beside each lies what the quantizing library itself reads back from
every quantized layer. Note [whole-model check] in docs/NOTES.md: the model metrale.torch builds
is transformers' own module tree with each quantized Linear swapped for a metrale one, so the
test (1) checks every metrale GEMM where it runs, on the activations the real forward gives it,
against the float64 product with the library's exact dequantization under the per-element GEMM
bound of the C++ suites (toolkit/gemm_tolerance.h), and that every quantized layer ran; (2) runs
transformers' forward with exact GEMMs (the library's weights in float64, rounded once to BF16:
what a correct BF16 W4A16 runtime computes) fed, layer by layer, metrale's checked outputs, and
requires the logits bit for bit: nothing outside the GEMMs differs; (3) compares greedy
generation of 32 tokens with the exact-GEMM forward's, a divergence allowed only at a near-tie.
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

import metrale
from conftest import need

torch = need("torch")
transformers = need("transformers")
mt = need("metrale.torch")
from safetensors.torch import load_file, save_file  # noqa: E402

CHECKPOINTS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "checkpoints"
FIXTURES = ["ct-nvfp4a16", "ct-mxfp4a16", "modelopt-nvfp4"]
PROMPTS, PROMPT_LEN, NEW_TOKENS = 3, 12, 32
U = 2.0**-8  # BF16's unit roundoff


def exact_weights(folder: pathlib.Path) -> dict:
    """Each quantized layer's weights as the library reads them, in float64 without rounding:
    compressed-tensors' E2M1 values times its block scales over the global scale (its own
    `decompress` rounds the product to BF16), ModelOpt's NVFP4QTensor.dequantize in F32 (exact
    but for one F32 rounding of the scale product)."""
    ref = load_file(folder / "reference.safetensors")
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, deq in ref.items():
        if not name.endswith(".dequantized"):
            continue
        layer = name[: -len(".dequantized")]
        if layer + ".codes" not in ref:
            out[layer] = deq.double()
            continue
        codes, scales = ref[layer + ".codes"].double(), ref[layer + ".block_scale"].double()
        w = codes * scales.repeat_interleave(codes.shape[1] // scales.shape[1], dim=1)
        g = tensors.get(layer + ".weight_global_scale")
        out[layer] = w / g.double() if g is not None else w
    return out


class ExactLinear(torch.nn.Module):
    """y = x · Wᵀ + b in float64 from the exact weights, rounded once to x's dtype; or, when
    `feed` holds an output for this call, that output (metrale's, checked)."""

    def __init__(self, name: str, w: torch.Tensor, bias, feed: dict) -> None:
        super().__init__()
        self.name, self.w, self.b, self.feed = name, w, bias, feed

    def forward(self, x):
        if self.name in self.feed:
            return self.feed[self.name].pop(0)
        y = x.double() @ self.w.T
        return (y if self.b is None else y + self.b.double()).to(x.dtype)


def exact_model(folder: pathlib.Path, feed: dict = None) -> torch.nn.Module:
    """transformers' BF16 model of the checkpoint with exact GEMMs in its quantized layers."""
    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    weights = exact_weights(folder)
    plain = {k: v for k, v in load_file(folder / "model.safetensors").items()
             if k.rpartition(".")[0] not in weights or k.endswith(".bias")}
    result = model.load_state_dict(plain, strict=False)
    assert not result.unexpected_keys, result
    assert {k.rpartition(".")[0] for k in result.missing_keys} == set(weights), result
    for layer, w in weights.items():
        parent, _, name = layer.rpartition(".")
        old = model.get_submodule(layer)
        setattr(model.get_submodule(parent), name, ExactLinear(layer, w, old.bias, feed or {}))
    return model.eval()


def prompts(rng, vocab: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, vocab, (PROMPTS, PROMPT_LEN))).long()


def check_gemm_in_place(name: str, x, y, w: torch.Tensor, bias) -> None:
    """metrale's output y for input x within the per-element bound of the C++ suites:
    |y − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·γ·S, γ = (K + 8)·2^-23, S = Σ_k |x·w| (+ |bias|)."""
    x64 = x.reshape(-1, w.shape[1]).double()
    ref, mag = x64 @ w.T, x64.abs() @ w.abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    got = y.reshape(ref.shape).double()
    assert torch.isfinite(got).all(), f"{name}: an output is not finite"
    gamma = (w.shape[1] + 8) * 2.0**-23
    excess = float(((got - ref).abs() - (U * ref.abs() + (1 + U) * gamma * mag)).max())
    assert excess <= 0, f"{name}: an element is {excess:.3g} past its bound"


@torch.no_grad()
def checked_forward(model, folder: pathlib.Path, ids: torch.Tensor) -> torch.Tensor:
    """metrale's logits, every metrale GEMM checked where it ran and every quantized layer
    required to have run; then the exact-GEMM model fed those outputs must give the same logits
    bit for bit."""
    weights = exact_weights(folder)
    seen: dict = {}

    def hook(name):
        def check(module, inputs, output):
            check_gemm_in_place(name, inputs[0], output, weights[name], module.bias)
            seen.setdefault(name, []).append(output.to(inputs[0].dtype))
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, mt.Linear)]
    try:
        logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == set(weights), f"layers that never ran on metrale: " \
        f"{sorted(set(weights) - set(seen))}"
    fed = exact_model(folder, feed=seen)(ids).logits
    assert all(not v for v in seen.values()), "the exact model took fewer GEMMs than metrale ran"
    assert torch.equal(logits, fed), "the logits differ outside the GEMMs"
    return logits


def normalized(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("fixture", FIXTURES)
def test_logits_match_transformers(rng, fixture):
    folder = CHECKPOINTS / fixture
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        swapped = [n for n, m in model.named_modules() if isinstance(m, mt.Linear)]
        assert len(swapped) == 7, swapped  # q, k, v, o, gate, up, down; lm_head stays BF16
        assert type(model.lm_head) is torch.nn.Linear
        assert model.lm_head.weight.dtype == torch.bfloat16
        ids = prompts(rng, model.config.vocab_size)
        ours = checked_forward(model, folder, ids)
        with torch.no_grad():
            exact = exact_model(folder)(ids).logits
        print(f"{fixture}: normalized difference from the exact-GEMM forward "
              f"{normalized(ours, exact):.3g}")
    finally:
        assert model.metrale.close().clean


def test_sharded_checkpoint_gives_the_same_logits(rng):
    one = mt.from_pretrained(str(CHECKPOINTS / "ct-nvfp4a16"), backend="cpu")
    shards = mt.from_pretrained(str(CHECKPOINTS / "ct-nvfp4a16-sharded"), backend="cpu")
    try:
        ids = prompts(rng, one.config.vocab_size)
        with torch.no_grad():
            assert torch.equal(one(ids).logits, shards(ids).logits)
    finally:
        one.metrale.close()
        shards.metrale.close()


@pytest.mark.parametrize("fixture", FIXTURES)
def test_greedy_generation_matches(rng, fixture):
    """32 greedy tokens from several prompts, as the exact-GEMM forward chooses them; a
    divergence only where that forward's top two logits lie within one BF16 rounding of the
    row's largest logit (each way), which metrale's checked GEMM roundings may flip."""
    folder = CHECKPOINTS / fixture
    model = mt.from_pretrained(str(folder), backend="cpu")
    exact = exact_model(folder)
    try:
        ids = prompts(rng, model.config.vocab_size)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            assert out.shape == (PROMPTS, PROMPT_LEN + NEW_TOKENS)
            ref = exact(out).logits.double()
        diverged = 0
        for p in range(PROMPTS):
            for t in range(PROMPT_LEN - 1, PROMPT_LEN + NEW_TOKENS - 1):
                chosen, row = int(out[p, t + 1]), ref[p, t]
                if chosen != int(row.argmax()):
                    gap = float(row.max() - row[chosen])
                    assert gap <= 2 * U * float(row.abs().max()), (p, t, gap)
                    diverged += 1
                    break  # past a divergence the two sequences differ
        print(f"{fixture}: {diverged} of {PROMPTS} prompts diverged, each at a near-tie")
    finally:
        assert model.metrale.close().clean


# ---- planted faults: each must fail the check ----


def _planted(tmp_path: pathlib.Path, change) -> pathlib.Path:
    """ct-nvfp4a16 with one tensor of down_proj changed as a misreading loader would see it."""
    out = tmp_path / "planted"
    shutil.copytree(CHECKPOINTS / "ct-nvfp4a16", out)
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


LAYER = "model.layers.0.mlp.down_proj"


def _swap_nibbles(t):
    b = t[LAYER + ".weight_packed"]
    t[LAYER + ".weight_packed"] = ((b & 0x0F) << 4) | (b >> 4)


def _invert_global_scale(t):
    t[LAYER + ".weight_global_scale"] = 1.0 / t[LAYER + ".weight_global_scale"]


def _transpose_scales(t):
    s = t[LAYER + ".weight_scale"]
    t[LAYER + ".weight_scale"] = s.t().contiguous().reshape(s.shape)


@pytest.mark.parametrize("plant", [_swap_nibbles, _invert_global_scale, _transpose_scales])
def test_planted_checkpoint_faults_fail_the_check(rng, tmp_path, plant):
    model = mt.from_pretrained(str(_planted(tmp_path, plant)), backend="cpu")
    try:
        # Held to the library's reading of the true checkpoint.
        with pytest.raises(AssertionError, match=LAYER + ": an element is .* past its bound"):
            checked_forward(model, CHECKPOINTS / "ct-nvfp4a16",
                            prompts(rng, model.config.vocab_size))
    finally:
        model.metrale.close()


class _Zero(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x.new_zeros((*x.shape[:-1], self.n))


def test_a_skipped_layer_fails_the_check(rng):
    folder = CHECKPOINTS / "ct-nvfp4a16"
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        model.get_submodule("model.layers.0.mlp").down_proj = _Zero(64)
        with pytest.raises(AssertionError, match="never ran on metrale: .*down_proj"):
            checked_forward(model, folder, prompts(rng, model.config.vocab_size))
    finally:
        model.metrale.close()


def test_swapped_layers_fail_the_check(rng):
    folder = CHECKPOINTS / "ct-nvfp4a16"
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        mlp = model.get_submodule("model.layers.0.mlp")
        mlp.gate_proj, mlp.up_proj = mlp.up_proj, mlp.gate_proj
        with pytest.raises(AssertionError, match="_proj: an element is .* past its bound"):
            checked_forward(model, folder, prompts(rng, model.config.vocab_size))
    finally:
        model.metrale.close()


def test_a_layer_the_loader_skips_is_refused(tmp_path, monkeypatch):
    """A loader that passed over a quantized layer would leave transformers' random weights in
    it: from_pretrained refuses, naming the tensor the checkpoint did not give."""
    monkeypatch.setattr(mt, "_swap_linear", lambda api, model, layer, *rest: None)
    with pytest.raises(metrale.IoError, match=r"not in the checkpoint: .*down_proj.weight"):
        mt.from_pretrained(str(CHECKPOINTS / "ct-nvfp4a16"), backend="cpu")


def test_unreadable_quantized_layers_are_refused_by_name():
    with pytest.raises(metrale.IoError, match=r"look quantized.*weight_packed"):
        mt.from_pretrained(str(CHECKPOINTS / "ct-w4a16"), backend="cpu")
