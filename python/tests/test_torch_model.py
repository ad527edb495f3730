"""A whole transformers model through metrale.torch against transformers' own forward.

The checkpoints were made by llm-compressor, ModelOpt and transformers' own FP8 block
quantization (a small Llama and a small Qwen3 from transformers' config classes, hidden 256, 2
layers: tests/fixtures/models; and the one-layer models of tests/fixtures/checkpoints), each with
the script that made it. Each quantized layer is read back by the library that wrote it
(compressed-tensors, ModelOpt; FP8 by transformers' Fp8Dequantize steps), in float64; an FP8
layer's activations are cast as its config's dynamic per-token-group scheme casts them. Note
[whole-model check] in docs/NOTES.md: the model metrale.torch builds is transformers' own module
tree with each quantized Linear swapped for a metrale one, so the test (1) checks every metrale
GEMM where it runs, on the activations the real forward gives it, against the float64 product
with the library's dequantization under the per-element GEMM bound of the C++ suites
(toolkit/gemm_tolerance.h), and that every quantized layer ran; (2) runs transformers' forward
with exact GEMMs (the library's weights in float64, rounded once to BF16: what a correct BF16
W4A16 runtime computes) fed, layer by layer, metrale's checked outputs, and requires the logits
bit for bit: nothing outside the GEMMs differs; (3) compares greedy generation of 32 tokens with
the exact-GEMM forward's, a divergence allowed only at a near-tie.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import sys

import pytest
from conftest import need
from test_w8a8 import _check_w8a8

import metrale

torch = need("torch")
transformers = need("transformers")
mt = need("metrale.torch")
need("compressed_tensors")
need("modelopt")
from safetensors.torch import load_file, save_file  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"
CHECKPOINTS = ROOT / "checkpoints"
sys.path.insert(0, str(CHECKPOINTS))
import int4_readers  # noqa: E402  (the GPTQ and AWQ readers the fixture scripts check against)
MODELS = [f"{arch}-{kind}" for arch in ("llama", "qwen3")
          for kind in ("ct-nvfp4a16", "ct-mxfp4a16", "modelopt-nvfp4", "transformers-fp8")] + [
              "llama-transformers-fp8-ue8m0", "llama-modelopt-fp8pb"]
# INT4: compressed-tensors W4A16 written by llm-compressor (symmetric groups of 32, asymmetric
# groups of 128), and GPTQ (act order) and AWQ packed from those libraries' code (make_int4.py).
INT4 = ("ct-w4a16", "ct-w4a16-asym", "gptq-desc-act", "awq")
FIXTURES = [ROOT / "models" / m for m in MODELS] + [
    CHECKPOINTS / c for c in ("ct-nvfp4a16", "ct-mxfp4a16", "modelopt-nvfp4", "ct-fp8-block")
] + [CHECKPOINTS / c for c in INT4]
IDS = [f.name for f in FIXTURES]
PROMPTS, PROMPT_LEN, NEW_TOKENS = 3, 12, 32
U = 2.0**-8  # BF16's unit roundoff


def checkpoint_tensors(folder: pathlib.Path) -> dict:
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(folder / "model.safetensors")
    shards = set(json.loads(index.read_text())["weight_map"].values())
    return {k: v for s in sorted(shards) for k, v in load_file(folder / s).items()}


def library_weights(folder: pathlib.Path) -> dict:
    """Each quantized layer's weights as the library that wrote them reads them back, in
    float64 (their own `decompress` rounds the product to the model's BF16; the steps are theirs,
    the dtype ours)."""
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = checkpoint_tensors(folder)
    if any(_is_fp8_weight(k, t) for k, t in tensors.items()):
        return fp8_weights(tensors)
    if config["quant_method"] in ("gptq", "awq"):
        # No GPTQ or AWQ library is installed here: their readers' dequantization, written from
        # their code (fixtures/checkpoints/int4_readers.py; exact: FP16 scales times integers).
        return int4_readers.library_weights(tensors, config)
    if config["quant_method"] == "modelopt":
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

        out = {}
        for name in tensors:
            if name.endswith(".weight_scale_2"):
                layer = name[: -len(".weight_scale_2")]
                packed = tensors[layer + ".weight"]
                q = NVFP4QTensor(torch.Size([packed.shape[0], 2 * packed.shape[1]]),
                                 torch.float64, packed)
                out[layer] = q.dequantize(dtype=torch.float64,
                                          scale=tensors[layer + ".weight_scale"].double(),
                                          double_scale=tensors[name].double(),
                                          block_sizes={-1: 16}).double()
        return out
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    parsed = QuantizationConfig.model_validate(config)
    if parsed.format == "pack-quantized":
        return int4_weights(tensors, parsed)
    compressor = {"nvfp4-pack-quantized": NVFP4PackedCompressor,
                  "mxfp4-pack-quantized": MXFP4PackedCompressor}[parsed.format]
    args = next(iter(parsed.config_groups.values())).weights
    out = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            layer = name[: -len(".weight_packed")]
            packed = tensors[name]
            codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2,
                                          dtype=torch.float64)
            scale = compressor._decompress_scale(tensors[layer + ".weight_scale"], torch.float64)
            g = tensors.get(layer + ".weight_global_scale")
            out[layer] = dequantize(x_q=codes, scale=scale, args=args, dtype=torch.float64,
                                    global_scale=None if g is None else g.double())
    return out



def int4_weights(tensors: dict, parsed) -> dict:
    """compressed-tensors INT4 (pack-quantized) layers as the library reads them back: its own
    unpacking of codes and zero points, then its dequantize, in float64."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = next(iter(parsed.config_groups.values())).weights
    out = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            layer = name[: -len(".weight_packed")]
            shape = tensors[layer + ".weight_shape"]
            scale = tensors[layer + ".weight_scale"].double()
            codes = unpack_from_int32(tensors[name], 4, shape).double()
            zp = tensors.get(layer + ".weight_zero_point")
            if zp is not None:
                zp = unpack_from_int32(zp, 4, torch.Size([int(shape[0]), scale.shape[1]]),
                                       packed_dim=0).double()
            out[layer] = dequantize(x_q=codes, scale=scale, zero_point=zp, args=args,
                                    dtype=torch.float64).double()
    return out


def int4_magnitudes(folder: pathlib.Path) -> dict:
    """What an asymmetric INT4 layer's roundings scale with (toolkit/gemm_tolerance.h, "INT4"):
    metrale sums a·(code − 8) and a·(8 − zero) apart, so (|code − 8| + |8 − zero|)·scale per
    weight, from the reference's codes, zero points and scales (groups in K's own order)."""
    path = folder / "reference.safetensors"
    if not path.exists():
        return {}
    ref = load_file(path)
    out = {}
    for key, zeros in ref.items():
        if key.endswith(".zeros") and bool((zeros != 8).any()):
            layer = key[: -len(".zeros")]
            codes, scale = ref[layer + ".codes"].double(), ref[layer + ".scales"].double()
            g = codes.shape[1] // scale.shape[1]
            z = zeros.double().repeat_interleave(g, 1)
            out[layer] = ((codes - 8).abs() + (8 - z).abs()) * scale.abs().repeat_interleave(g, 1)
    return out


def fp8_weights(tensors: dict) -> dict:
    """FP8 block-128 layers as transformers dequantizes them (Fp8Dequantize in
    integrations/finegrained_fp8.py: each E4M3 value times its 128 x 128 block's multiplier,
    weight_scale_inv; compressed-tensors' FP8_BLOCK stores the same multiplier as BF16
    weight_scale), in float64."""
    out = {}
    for name, t in tensors.items():
        if not _is_fp8_weight(name, t):
            continue
        layer = name[: -len(".weight")]
        scale = tensors.get(layer + ".weight_scale_inv", tensors.get(layer + ".weight_scale"))
        if scale.dim() == 4:  # ModelOpt's [N/128, 1, K/128, 1]: its own FP8QTensor reads it
            from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

            out[layer] = FP8QTensor(t.shape, torch.float64, t).dequantize(
                dtype=torch.float64, scale=scale.double().reshape(scale.shape[0], scale.shape[2]),
                block_sizes={-1: 128, -2: 128})
            continue
        if scale.dim() < 2:
            # transformers 5.17 saves an expert's [ceil(N/128), ceil(K/128)] block scales with
            # their unit dimensions squeezed; the weight's shape gives them back, in the same
            # row-major order.
            scale = scale.reshape(-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        out[layer] = t.double() * full[: t.shape[0], : t.shape[1]]
    return out


def fp8_layers(folder: pathlib.Path) -> set:
    """The layers the checkpoint holds in FP8: metrale runs them on the W8A8 op."""
    return {k[: -len(".weight")] for k, v in checkpoint_tensors(folder).items()
            if _is_fp8_weight(k, v)}


def casts_activations(folder: pathlib.Path) -> bool:
    """Whether the folder's config quantizes activations (FP8 W8A8 with dynamic per-token-group
    casts) or declares FP8 weights alone (ModelOpt's fp8_pb_wo), which metrale still runs on its
    W8A8 op: then the model's own product is on BF16 activations."""
    return bool(metrale.load_safetensors(str(folder)).declared["quantized_activations"])


def _is_fp8_weight(name: str, t: torch.Tensor) -> bool:
    """An FP8 layer's weight (NVFP4's E4M3 block scales are named weight_scale)."""
    return name.endswith(".weight") and t.dtype == torch.float8_e4m3fn


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x[..., K] as the dynamic per-token-group FP8 scheme the configs declare casts it (the
    Hopper kernels transformers and DeepGEMM run: per row per 128 K, s = amax / 448 in FP32,
    e4m3(x / s) rounded to nearest even), dequantized exactly in float64."""
    k = x.shape[-1]
    blocks = -(-k // 128)
    xf = torch.nn.functional.pad(x.float(), (0, blocks * 128 - k)).unflatten(-1, (blocks, 128))
    amax = xf.abs().amax(-1, keepdim=True)
    s = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    codes = (xf / s).to(torch.float8_e4m3fn)
    return (codes.double() * s.double()).flatten(-2)[..., :k]


class ExactLinear(torch.nn.Module):
    """y = x · Wᵀ + b in float64 from the exact weights, rounded once to x's dtype; or, when
    `feed` holds an output for this call, that output (metrale's, checked)."""

    def __init__(self, name: str, w: torch.Tensor, bias, feed: dict, fp8: bool) -> None:
        super().__init__()
        self.name, self.w, self.b, self.feed, self.fp8 = name, w, bias, feed, fp8

    def forward(self, x):
        if self.name in self.feed:
            return self.feed[self.name].pop(0)
        y = (quantize_activations(x) if self.fp8 else x.double()) @ self.w.T
        return (y if self.b is None else y + self.b.double()).to(x.dtype)


def exact_model(folder: pathlib.Path, feed: dict = None) -> torch.nn.Module:
    """transformers' BF16 model of the checkpoint with exact GEMMs in its quantized layers (FP8
    ones on activations cast as the config's dynamic scheme casts them)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    weights = library_weights(folder)
    plain = {k: v for k, v in checkpoint_tensors(folder).items()
             if k.rpartition(".")[0] not in weights or k.endswith(".bias")}
    result = model.load_state_dict(plain, strict=False)
    assert not result.unexpected_keys, result
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {k for k in result.missing_keys
            if any(params[k] is params[p] for p in plain if p in params)}
    assert {k.rpartition(".")[0] for k in set(result.missing_keys) - tied} == set(weights), result
    fp8 = fp8_layers(folder) if casts_activations(folder) else set()
    for layer, w in weights.items():
        parent, _, name = layer.rpartition(".")
        old = model.get_submodule(layer)
        setattr(model.get_submodule(parent), name,
                ExactLinear(layer, w, old.bias, feed or {}, layer in fp8))
    return model.eval()


def prompts(rng, vocab: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, vocab, (PROMPTS, PROMPT_LEN))).long()


def check_gemm_in_place(name: str, x, y, w: torch.Tensor, bias, fp8: bool = False,
                        cast: bool = True, mag_w: torch.Tensor = None) -> None:
    """metrale's output y for input x within the per-element bound of the C++ suites:
    |y − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·γ·S, γ = (K + 8)·2^-23, S = Σ_k |x·w| (+ |bias|). For an
    FP8 layer (the W8A8 op) whose config casts activations (`cast`), x is first cast as the
    config's dynamic scheme casts it (quantize_activations): metrale's cast is the same IEEE FP32
    division and round-to-nearest-even E4M3 (kernels/fp8_cast.h), so its codes are those, and
    only the FP32 sums differ. For FP8 weights alone, the model's product is on x itself: the
    W8A8 op's bound with its activation-cast term (test_w8a8.py)."""
    if fp8 and not cast:
        try:
            _check_w8a8(y.reshape(-1, w.shape[0]).double().numpy(),
                        x.reshape(-1, w.shape[1]).double().numpy(), w.numpy(),
                        None if bias is None else bias.double().numpy())
        except AssertionError as e:
            raise AssertionError(f"{name}: {str(e).splitlines()[0]}") from None
        return
    if fp8:
        x = quantize_activations(x)
    x64 = x.reshape(-1, w.shape[1]).double()
    ref, mag = x64 @ w.T, x64.abs() @ (w.abs() if mag_w is None else mag_w).T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    got = y.reshape(ref.shape).double()
    assert torch.isfinite(got).all(), f"{name}: an output is not finite"
    gamma = (w.shape[1] + 8) * 2.0**-23
    excess = float(((got - ref).abs() - (U * ref.abs() + (1 + U) * gamma * mag)).max())
    assert excess <= 0, f"{name}: an element is {excess:.3g} past its bound"


def checkpoint_biases(folder: pathlib.Path, rename=lambda name: name) -> dict:
    """{layer: bias} of the checkpoint's tensors ("<layer>.bias", named as ``rename`` maps
    them): the GEMM checks add the file's bias, not the one metrale's Linear holds, so a bias
    lost or misplaced on load fails them."""
    return {rename(k)[: -len(".bias")]: v for k, v in checkpoint_tensors(folder).items()
            if k.endswith(".bias")}


@torch.no_grad()
def checked_forward(model, folder: pathlib.Path, ids: torch.Tensor) -> torch.Tensor:
    """metrale's logits, every metrale GEMM checked where it ran and every quantized layer
    required to have run; then the exact-GEMM model fed those outputs must give the same logits
    bit for bit."""
    weights = library_weights(folder)
    biases = checkpoint_biases(folder)
    fp8, cast = fp8_layers(folder), casts_activations(folder)
    magnitudes = int4_magnitudes(folder)
    seen: dict = {}

    def hook(name):
        def check(module, inputs, output):
            check_gemm_in_place(name, inputs[0], output, weights[name], biases.get(name),
                                name in fp8, cast, magnitudes.get(name))
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


@pytest.mark.parametrize("folder", FIXTURES, ids=IDS)
def test_logits_match_transformers(rng, folder):
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        swapped = {n for n, m in model.named_modules() if isinstance(m, mt.Linear)}
        # q, k, v, o, gate, up, down of every layer; lm_head stays BF16
        assert swapped == set(library_weights(folder))
        assert len(swapped) == 7 * model.config.num_hidden_layers
        assert type(model.lm_head) is torch.nn.Linear
        assert model.lm_head.weight.dtype == torch.bfloat16
        ids = prompts(rng, model.config.vocab_size)
        ours = checked_forward(model, folder, ids)
        with torch.no_grad():
            exact = exact_model(folder)(ids).logits
        print(f"{folder.name}: normalized difference from the exact-GEMM forward "
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


def _bf16_ulp(v: float) -> float:
    """The spacing of BF16 values at v (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(v), 2.0**-126))) - 7)


def greedy_divergences(model, folder: pathlib.Path, ids: torch.Tensor) -> int:
    """Generates NEW_TOKENS greedy tokens with `model` (KV cache, one token a step) and compares
    each with the exact-GEMM forward's choice over the same tokens; a divergence only at a
    near-tie: where the two tokens' logits lie within what one BF16 rounding of each element of
    lm_head's input moves them, U·(S_a + S_b) with S_j = Σ_k |h_k·w_jk| (a rounding flip anywhere
    upstream reaches the logits through that input; the GEMMs themselves are checked in place,
    test above), plus the logits' own rounding to BF16 in both models, half a BF16 ulp of each
    logit in each: ulp(L_a) + ulp(L_b). Returns the prompts that diverged (each ends its
    comparison there)."""
    exact = exact_model(folder)
    seen = {}
    hook = exact.lm_head.register_forward_hook(lambda m, i, o: seen.update(h=i[0]))
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            assert out.shape == (ids.shape[0], ids.shape[1] + NEW_TOKENS)
            ref = exact(out).logits.double()
    finally:
        hook.remove()
    magnitude = seen["h"].double().abs() @ exact.lm_head.weight.detach().double().abs().T
    # generate() chose among the scores its logits processors left: min_new_tokens bars the
    # end-of-sequence tokens at every step here, so the reference's choice is made on the same
    # scores, by transformers' own processor (a raw argmax that fell on EOS failed as a
    # divergence of up to the EOS logit's lead).
    eos = model.generation_config.eos_token_id
    bar_eos = transformers.MinNewTokensLengthLogitsProcessor(ids.shape[1], NEW_TOKENS, eos) \
        if eos is not None else (lambda seq, scores: scores)
    diverged = 0
    for p in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1, ids.shape[1] + NEW_TOKENS - 1):
            row = bar_eos(out[p:p + 1, :t + 1], ref[p:p + 1, t])[0]
            chosen, best = int(out[p, t + 1]), int(row.argmax())
            if chosen != best:
                gap = float(row[best] - row[chosen])
                allowed = U * float(magnitude[p, t, best] + magnitude[p, t, chosen]) + \
                    _bf16_ulp(float(row[best])) + _bf16_ulp(float(row[chosen]))
                assert gap <= allowed, f"prompt {p}, step {t}: gap {gap:.3g} > {allowed:.3g}"
                diverged += 1
                break  # past a divergence the two sequences differ
    return diverged


@pytest.mark.parametrize("folder", FIXTURES, ids=IDS)
def test_greedy_generation_matches(rng, folder):
    if fp8_layers(folder) and not casts_activations(folder):
        pytest.skip("FP8 weights alone: metrale runs them W8A8 (it has no FP8 W8A16 route), so "
                    "its tokens are not the checkpoint's W8A16 model's; the GEMMs are held to it "
                    "in place, with the activation-cast term")
    if fp8_layers(folder):
        pytest.skip("W8A8: casting activations to E4M3 is discontinuous, so a one-ulp difference "
                    "upstream (an FP32 sum's order) can move an E4M3 code by 2^-3 and the "
                    "logits by more than any BF16 near-tie rule allows (seen: 5 ulps); the "
                    "GEMMs are held in place and the fed logits bit for bit "
                    "(Note [whole-model check])")
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        diverged = greedy_divergences(model, folder, prompts(rng, model.config.vocab_size))
        print(f"{folder.name}: {diverged} of {PROMPTS} prompts diverged, each at a near-tie")
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


FP8_MODEL = ROOT / "models" / "llama-transformers-fp8"
FP8_LAYER = "model.layers.1.self_attn.q_proj"  # 256 x 256: a square grid of 2 x 2 block scales


def _invert_fp8_scales(t):
    """A loader that took weight_scale_inv for the quantizer's divisor."""
    t[FP8_LAYER + ".weight_scale_inv"] = 1.0 / t[FP8_LAYER + ".weight_scale_inv"]


def _transpose_fp8_scales(t):
    s = t[FP8_LAYER + ".weight_scale_inv"]
    assert s.shape == (2, 2) and not torch.equal(s, s.t())
    t[FP8_LAYER + ".weight_scale_inv"] = s.t().contiguous()


@pytest.mark.parametrize("plant", [_invert_fp8_scales, _transpose_fp8_scales])
def test_planted_fp8_faults_fail_the_check(rng, tmp_path, plant):
    out = tmp_path / "planted"
    shutil.copytree(FP8_MODEL, out)
    tensors = load_file(out / "model.safetensors")
    plant(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    model = mt.from_pretrained(str(out), backend="cpu")
    try:
        with pytest.raises(AssertionError, match=FP8_LAYER + ": an element is .* past its bound"):
            checked_forward(model, FP8_MODEL, prompts(rng, model.config.vocab_size))
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


def test_unreadable_quantized_layers_are_refused_by_name(tmp_path):
    from test_load import without_gptq_zeros

    shutil.copy(CHECKPOINTS / "gptq-v1" / "config.json", tmp_path)
    with pytest.raises(metrale.IoError, match=r"look quantized.*qzeros: not in the file"):
        mt.from_pretrained(str(without_gptq_zeros(tmp_path)), backend="cpu")


def test_a_path_that_is_no_model_folder_is_refused_by_name(tmp_path):
    file = CHECKPOINTS / "ct-nvfp4a16" / "model.safetensors"
    with pytest.raises(metrale.NotFoundError, match=r"model.safetensors: is not a folder"):
        mt.from_pretrained(str(file), backend="cpu")
    shutil.copy(file, tmp_path)
    with pytest.raises(metrale.NotFoundError, match=r"holds no config.json"):
        mt.from_pretrained(str(tmp_path), backend="cpu")


def test_a_config_of_another_model_is_refused_by_name(tmp_path):
    shutil.copy(ROOT / "models" / "llama-ct-nvfp4a16" / "model.safetensors", tmp_path)
    shutil.copy(ROOT / "models" / "qwen3-ct-nvfp4a16" / "config.json", tmp_path)
    with pytest.raises(metrale.IoError, match=r"not in the checkpoint: .*q_norm.weight"):
        mt.from_pretrained(str(tmp_path), backend="cpu")


def _with_config(tmp_path, fixture: pathlib.Path, change) -> pathlib.Path:
    out = tmp_path / fixture.name
    shutil.copytree(fixture, out)
    config = json.loads((out / "config.json").read_text())
    change(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_declared_format_is_held_to_the_tensors(tmp_path):
    """The config says what the checkpoint holds: another format, a quantized layer on its
    ignore list, or a Linear it quantizes left in BF16 (a layer its quantizer skipped) is refused
    by name."""
    nvfp4 = ROOT / "models" / "llama-ct-nvfp4a16"
    bad = _with_config(tmp_path, nvfp4, lambda q: q.update(format="mxfp4-pack-quantized"))
    with pytest.raises(metrale.IoError, match=r"declares compressed-tensors 'mxfp4-pack-quantized'"
                       r" \(compressed-tensors MXFP4 layers\), but these layers hold another format: .*down_proj \(compressed-tensors "
                       r"NVFP4\)"):
        mt.from_pretrained(str(bad), backend="cpu")
    shutil.rmtree(bad)
    bad = _with_config(tmp_path, nvfp4, lambda q: q["ignore"].append("re:.*\\.o_proj"))
    with pytest.raises(metrale.IoError, match=r"ignores model.layers.0.self_attn.o_proj, "
                       r"model.layers.1.self_attn.o_proj, which the checkpoint holds quantized"):
        mt.from_pretrained(str(bad), backend="cpu")
    shutil.rmtree(bad)
    bad = _with_config(tmp_path, nvfp4, lambda q: q.update(ignore=[]))
    with pytest.raises(metrale.IoError, match=r"yet the checkpoint holds these in plain floats: "
                       r"lm_head"):
        mt.from_pretrained(str(bad), backend="cpu")
    bad = _with_config(tmp_path, ROOT / "models" / "qwen3-modelopt-nvfp4",
                       lambda q: q.update(quant_algo="FP8"))
    with pytest.raises(metrale.IoError, match=r"declares modelopt 'FP8', which metrale does not "
                       r"read"):
        mt.from_pretrained(str(bad), backend="cpu")
