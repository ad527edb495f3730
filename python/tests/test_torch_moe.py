"""Mixture-of-experts models through metrale.torch against transformers' own forward, and the MoE
call under them (Model.moe_experts) against float64.

The checkpoints (tests/fixtures/models, each with the script that made it): gpt-oss's MXFP4
experts packed as openai/gpt-oss-20b ships them (make_gptoss.py; ModelOpt's MXFP4 quantizer, read
back here by transformers' own reader, integrations/mxfp4.py), a small Qwen3-MoE quantized by
ModelOpt (NVFP4), llm-compressor (NVFP4A16, W4A16), transformers' FP8 block quantization, and
GPTQ (Qwen's own GPTQ-Int4 settings) and AWQ packed from those libraries' code, the same two of
a small Mixtral (its checkpoints' own names: block_sparse_moe, w1 / w3 / w2), GPTQ of a small
Qwen2-MoE (biases on quantized q, k, v; a shared expert and its gate), GPTQ with desc_act of the
Qwen3-MoE (every expert's columns in orders of its own), and a small DeepSeek-V3 (sigmoid
routing in groups with its correction bias, a shared expert, a dense first layer, MLA attention)
quantized by ModelOpt (NVFP4) and transformers (FP8, DeepSeek-V3's own layout), experts as
linears of their own (make_moe_models.py, make_deepseek.py; read back by the library that wrote
them, test_torch_model.library_weights). FP8 experts run W8A8 (the grouped
W8A8 op), their reference casting each GEMM's input as the checkpoint's dynamic scheme does.

The whole-model check is test_torch_model's (Note [whole-model check]) with the experts in it:
every metrale call is checked where it ran, on the inputs the real forward gave it (each Linear
by the per-element GEMM bound; each MoE layer per token against the float64 layer of the same
routing on the library's weights), every quantized layer must have run, and transformers' model
with exact weights, fed metrale's checked outputs layer by layer, must give the same logits bit
for bit: nothing outside the GEMMs and the experts differs (router, attention, norms, biases).
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest
from conftest import need

import metrale

torch = need("torch")
transformers = need("transformers")
mt = need("metrale.torch")
need("compressed_tensors")
need("modelopt")
from test_torch_model import (ROOT, casts_activations, check_gemm_in_place,  # noqa: E402
                              checkpoint_biases, checkpoint_tensors, fp8_layers,
                              library_weights, prompts, quantize_activations)

MODELS = ROOT / "models"
MOE_FIXTURES = [MODELS / m for m in ("gptoss-mxfp4", "qwen3moe-modelopt-nvfp4",
                                     "qwen3moe-ct-nvfp4a16", "qwen3moe-ct-w4a16",
                                     "qwen3moe-transformers-fp8", "qwen3moe-gptq", "qwen3moe-awq",
                                     "mixtral-gptq", "mixtral-awq", "qwen2moe-gptq",
                                     "qwen3moe-gptq-desc-act", "deepseek-modelopt-nvfp4",
                                     "deepseek-transformers-fp8")]
U = 2.0**-8
# A layer's output against its float64 layer: four BF16 roundings stand between them (gate_up's
# C, the activation, down's C, the combine), each within 2^-8 of its value (Note [MoE routing]).
MOE_BOUND = 4 * U


def _glu64(glu: str, h: torch.Tensor) -> torch.Tensor:
    """The gated activation in float64 as transformers' experts write it."""
    if glu == "silu":
        gate, up = h.chunk(2, dim=-1)
        return gate / (1 + torch.exp(-gate)) * up
    gate, up = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
    return gate / (1 + torch.exp(-1.702 * gate)) * (up + 1)


def experts64(x, ids, w, layer: dict) -> torch.Tensor:
    """The float64 layer of a routing: per token Σ_j w_j · (down_e · glu(gate_up_e · x + b1) + b2).
    FP8 experts (layer["fp8"]) take each GEMM's input cast as the checkpoint's dynamic scheme
    casts it (per row per 128 K, test_torch_model.quantize_activations), and down's input is the
    activation as the W8A8 layer defines it: gate_up's output rounded to BF16, the gated activation
    in FP32 rounded once to BF16, then cast. The cast is discontinuous (Note [whole-model check]):
    casting the float64 activation instead moves about one code in twenty by a whole E4M3 step
    (seen: 1.7e-2 normalized), which says nothing of the op."""
    fp8 = layer.get("fp8", False)
    x64 = quantize_activations(x) if fp8 else x.double()
    ref = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = layer["gate_up"][e] @ x64[t]
            if layer["gate_up_bias"] is not None:
                h = h + layer["gate_up_bias"][e]
            if fp8:
                act = _glu64(layer["glu"], h.to(torch.bfloat16).float()).to(torch.bfloat16)
                y = layer["down"][e] @ quantize_activations(act)
            else:
                y = layer["down"][e] @ _glu64(layer["glu"], h)
            if layer["down_bias"] is not None:
                y = y + layer["down_bias"][e]
            ref[t] += float(w[t, j]) * y
    return ref


def check_experts_in_place(name: str, inputs, output, layer: dict) -> None:
    """One call's output against the float64 layer of its routing, by normalized error over
    the call's tokens (as MoeLayer.Qwen3ExpertsAgainstFloat64 holds the C++ ops)."""
    x, ids, w = inputs
    assert torch.isfinite(output).all(), f"{name}: an output is not finite"
    ref = experts64(x, ids, w.double(), layer)
    err = float((output.double() - ref).norm() / ref.norm())
    assert err <= MOE_BOUND, f"{name}: normalized error is {err:.3g} (bound {MOE_BOUND:.3g})"


# Mixtral's checkpoints name its experts' linears as Mixtral's own expert module did
# (MixtralBlockSparseTop2MLP.forward: w2(act_fn(w1(x)) * w3(x)): w1 the gate, w3 the up, w2 the down
# projection), under "block_sparse_moe"; transformers 5's MixtralForCausalLM holds the router and
# the fused experts under "mlp". Written here from Mixtral's module, not from metrale's reading.
CHECKPOINT_NAMES = {"mixtral": ((".block_sparse_moe.", ".mlp."),
                                {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})}


def model_name(folder: pathlib.Path, name: str) -> str:
    """A checkpoint's tensor or layer name as the model's: the module renamed, an expert's
    linear ("<experts>.<e>.<leaf>") by its role."""
    kind = json.loads((folder / "config.json").read_text())["model_type"]
    if kind not in CHECKPOINT_NAMES:
        return name
    (old, new), roles = CHECKPOINT_NAMES[kind]
    name = name.replace(old, new)
    parent, _, leaf = name.rpartition(".")
    if parent.rpartition(".")[0].endswith(".experts") and leaf in roles:
        return f"{parent}.{roles[leaf]}"
    return name


def is_gptoss(folder: pathlib.Path) -> bool:
    return json.loads((folder / "config.json").read_text())["model_type"] == "gpt_oss"


def moe_reference(folder: pathlib.Path) -> tuple:
    """(linears, experts): the quantized linears' float64 weights as the library that wrote them
    reads them, and per experts module its float64 gate_up [E, 2I, H], down [E, H, I], biases
    and activation; gpt-oss's packed experts as transformers reads them
    (convert_moe_packed_tensors, in FP32: every E2M1 value times a power of two is exact)."""
    tensors = checkpoint_tensors(folder)
    experts: dict = {}
    if is_gptoss(folder):
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        for name in tensors:
            if name.endswith(".gate_up_proj_blocks"):
                parent = name[: -len(".gate_up_proj_blocks")]
                layer = {"glu": "clamped_swiglu"}
                for proj in ("gate_up", "down"):
                    p = f"{parent}.{proj}_proj"
                    # Its [E, N, K] before the transpose onto the model's [E, K, N] parameter.
                    layer[proj] = convert_moe_packed_tensors(
                        tensors[p + "_blocks"], tensors[p + "_scales"], dtype=torch.float32
                    ).transpose(1, 2).double()
                    layer[proj + "_bias"] = tensors[p + "_bias"].double()
                experts[parent] = layer
        return {}, experts
    linears = {model_name(folder, k): v for k, v in library_weights(folder).items()}
    fp8 = casts_activations(folder) and bool(fp8_layers(folder))
    for name in list(linears):
        parent, _, proj = name.rpartition(".")
        parent, _, e = parent.rpartition(".")
        if not proj.endswith("_proj") or not parent.endswith(".experts"):
            continue
        layer = experts.setdefault(parent, {"glu": "silu", "gate_up_bias": None,
                                            "down_bias": None, "parts": {}, "fp8": fp8})
        layer["parts"][(int(e), proj)] = linears.pop(name)
    for layer in experts.values():
        count = 1 + max(e for e, _ in layer["parts"])
        parts = layer.pop("parts")
        layer["gate_up"] = torch.stack([torch.cat([parts[(e, "gate_proj")],
                                                   parts[(e, "up_proj")]]) for e in range(count)])
        layer["down"] = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    return linears, experts


class ExactExperts(torch.nn.Module):
    """An experts module of the exact model: fed metrale's checked output for the same inputs
    (which must be the inputs metrale's layer saw: the router and everything before it agree)."""

    def __init__(self, name: str, feed: dict) -> None:
        super().__init__()
        self.name, self.feed = name, feed

    def forward(self, hidden_states, top_k_index, top_k_weights):
        inputs, output = self.feed[self.name].pop(0)
        assert torch.equal(hidden_states, inputs[0]), f"{self.name}: another input"
        assert torch.equal(top_k_index, inputs[1]), f"{self.name}: another routing"
        assert torch.equal(top_k_weights, inputs[2]), f"{self.name}: other routing weights"
        return output


class FedLinear(torch.nn.Module):
    def __init__(self, name: str, feed: dict) -> None:
        super().__init__()
        self.name, self.feed = name, feed

    def forward(self, x):
        return self.feed[self.name].pop(0)


def fed_model(folder: pathlib.Path, linears: dict, experts: dict, feed: dict):
    """transformers' BF16 model of the checkpoint, every other tensor as the file holds it, its
    quantized linears and experts fed metrale's checked outputs."""
    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantized = tuple(p + "." for p in list(linears) + list(experts))
    plain = {model_name(folder, k): v for k, v in checkpoint_tensors(folder).items()}
    plain = {k: v for k, v in plain.items()
             if not k.startswith(quantized) or k.endswith("_proj_bias") or k.endswith(".bias")}
    plain = {k: v for k, v in plain.items() if not k.endswith(("_blocks", "_scales"))}
    model.load_state_dict(plain, strict=False)
    for name in list(linears) + list(experts):
        parent, _, leaf = name.rpartition(".")
        module = FedLinear(name, feed) if name in linears else ExactExperts(name, feed)
        setattr(model.get_submodule(parent), leaf, module)
    return model.eval()


@torch.no_grad()
def checked_moe_forward(model, folder: pathlib.Path, ids: torch.Tensor):
    """metrale's logits with every metrale call checked where it ran and every quantized layer
    required to have run; the fed transformers model must give the same logits bit for bit."""
    linears, experts = moe_reference(folder)
    biases = checkpoint_biases(folder, lambda name: model_name(folder, name))
    fp8 = fp8_layers(folder) if casts_activations(folder) else set()
    seen: dict = {}

    def linear_hook(name):
        def check(module, inputs, output):
            check_gemm_in_place(name, inputs[0], output, linears[name], biases.get(name),
                                fp8=name in fp8)
            seen.setdefault(name, []).append(output.to(inputs[0].dtype))
        return check

    def experts_hook(name):
        def check(module, inputs, output):
            check_experts_in_place(name, inputs, output, experts[name])
            seen.setdefault(name, []).append((inputs, output))
        return check

    handles = []
    for n, m in model.named_modules():
        if isinstance(m, mt.Linear):
            handles.append(m.register_forward_hook(linear_hook(n)))
        elif isinstance(m, mt.MoeExperts):
            handles.append(m.register_forward_hook(experts_hook(n)))
    try:
        logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == set(linears) | set(experts), "layers that never ran on metrale: " \
        f"{sorted(set(linears) | set(experts) - set(seen))}"
    fed = fed_model(folder, linears, experts, seen)(ids).logits
    assert all(not v for v in seen.values()), "the fed model took fewer calls than metrale ran"
    assert torch.equal(logits, fed), "the logits differ outside the GEMMs and the experts"
    return logits, experts


@pytest.mark.parametrize("folder", MOE_FIXTURES, ids=[f.name for f in MOE_FIXTURES])
def test_moe_logits_match_transformers(rng, folder):
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        moe = {n for n, m in model.named_modules() if isinstance(m, mt.MoeExperts)}
        # DeepSeek-V3's first layers are dense (first_k_dense_replace).
        dense = getattr(model.config, "first_k_dense_replace", 0)
        assert len(moe) == model.config.num_hidden_layers - dense
        logits, experts = checked_moe_forward(model, folder, prompts(rng, model.config.vocab_size))
        assert moe == set(experts)
        # The checked layers, again at decode: a few greedy steps (one token a step, KV cache).
        checked = []

        def hook(name):
            def check(module, inputs, output):
                check_experts_in_place(name, inputs, output, experts[name])
                checked.append(inputs[0].shape[0])
            return check

        hooks = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
                 if isinstance(m, mt.MoeExperts)]
        try:
            ids = prompts(rng, model.config.vocab_size)
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                               min_new_tokens=4, do_sample=False, pad_token_id=0)
        finally:
            for h in hooks:
                h.remove()
        assert ids.shape[0] in checked, "no decode step ran the experts"
    finally:
        assert model.metrale.close().clean


def test_moe_check_fails_on_planted_faults(rng):
    """The experts check is shown failing: the gated activation of another family, a dropped
    bias, and another expert's weights each put the call past the bound."""
    folder = MODELS / "gptoss-mxfp4"
    _, experts = moe_reference(folder)
    name, layer = sorted(experts.items())[0]
    h = layer["gate_up"].shape[2]
    x = torch.from_numpy(rng.standard_normal((5, h))).to(torch.bfloat16)
    ids = torch.from_numpy(np.stack([rng.choice(8, 2, replace=False) for _ in range(5)]))
    w = torch.softmax(torch.from_numpy(rng.standard_normal((5, 2))), -1).to(torch.bfloat16)
    good = experts64(x, ids, w.double(), layer)
    check_experts_in_place(name, (x, ids, w), good.to(torch.bfloat16), layer)
    faults = {"silu": dict(layer, glu="silu"), "no bias": dict(layer, down_bias=None),
              "another expert": dict(layer, gate_up=layer["gate_up"].roll(1, 0))}
    for what, planted in faults.items():
        bad = experts64(x, ids, w.double(), planted)
        with pytest.raises(AssertionError, match="error is"):
            check_experts_in_place(name, (x, ids, w), bad.to(torch.bfloat16), layer)


def test_fp8_moe_check_fails_on_planted_faults(rng):
    """The FP8 experts check is shown failing: a reference with activations left uncast (a W8A16
    layer) or another expert's down weights puts a call of the real op past the bound that the
    op's own reference meets."""
    folder = MODELS / "qwen3moe-transformers-fp8"
    _, experts = moe_reference(folder)
    name, layer = sorted(experts.items())[0]
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        module = model.get_submodule(name)
        h = layer["gate_up"].shape[2]
        x = torch.from_numpy(rng.standard_normal((24, h))).to(torch.bfloat16)
        ids = torch.from_numpy(np.stack([rng.choice(8, 2, replace=False) for _ in range(24)]))
        w = torch.softmax(torch.from_numpy(rng.standard_normal((24, 2))), -1).to(torch.bfloat16)
        with torch.no_grad():
            out = module(x, ids, w)
        check_experts_in_place(name, (x, ids, w), out, layer)
        faults = {"uncast": dict(layer, fp8=False),
                  "another expert": dict(layer, down=layer["down"].roll(1, 0))}
        for what, planted in faults.items():
            with pytest.raises(AssertionError, match="error is"):
                check_experts_in_place(name, (x, ids, w), out, planted)
    finally:
        assert model.metrale.close().clean


def test_packed_experts_read_as_transformers_reads_them():
    """Checkpoint.experts and expert_weights on gpt-oss's packed experts: each expert's weights,
    dequantized, equal transformers' own reading of the file exactly, and the bias is the file's."""
    folder = MODELS / "gptoss-mxfp4"
    ckpt = metrale.load_safetensors(str(folder))
    found = {e["projection"]: e for e in ckpt.experts}
    assert sorted(found) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                             for p in ("down_proj", "gate_up_proj")]
    assert not [r for r in ckpt.rejected if r["quantized"]]
    _, experts = moe_reference(folder)
    for projection, info in found.items():
        parent, _, leaf = projection.rpartition(".")
        hosts, bias = ckpt.expert_weights(projection)
        assert len(hosts) == info["experts"] == 8 and info["source"] == "gpt-oss MXFP4"
        want = experts[parent][leaf[: -len("_proj")]]
        for e, host in enumerate(hosts):
            assert (host.format, host.n, host.k) == ("mxfp4", info["n"], info["k"])
            got = torch.from_numpy(np.asarray(host.dequantize(), dtype=np.float64))
            assert torch.equal(got, want[e]), f"{projection} expert {e}"
        file_bias = checkpoint_tensors(folder)[projection + "_bias"]
        assert torch.equal(torch.from_numpy(bias.view(ml_dtypes.bfloat16).astype(np.float32)),
                           file_bias.float())


def test_fp8_experts_run_on_the_grouped_w8a8_op():
    """transformers' FP8 Qwen3-MoE (experts as FP8 block-128 linears, their scales squeezed as
    transformers 5.17 saves them, which the loader reads): from_pretrained puts each experts module
    on the grouped W8A8 op, gate and up stacked; metrale.load still takes each FP8 linear as it
    would any."""
    model = mt.from_pretrained(str(MODELS / "qwen3moe-transformers-fp8"), backend="cpu")
    try:
        experts = [m for m in model.modules() if isinstance(m, mt.MoeExperts)]
        assert len(experts) == 2 and {m.format for m in experts} == {"e4m3_block128"}
        assert not [n for n, m in model.named_modules() if isinstance(m, mt.Linear)
                    and ".experts." in n]
    finally:
        assert model.metrale.close().clean
    with metrale.load(str(MODELS / "qwen3moe-transformers-fp8"), backend="cpu") as ckpt:
        w = ckpt.layers["model.layers.1.mlp.experts.7.down_proj"]
        assert isinstance(w, metrale.Fp8Weights) and (w.n, w.k) == (256, 128)


def test_fp8_experts_upload_layouts(rng):
    """upload_grouped_fp8_weights' layout: auto (the CPU's panels), source and panels upload as
    asked; decode (FP8 experts have none) and an unknown name are refused by name."""
    codes = rng.integers(0, 0x7E, size=(2, 64, 128), dtype=np.uint8)
    scales = np.ones((2, 1, 1), np.float32)
    with metrale.Model("cpu") as m:
        for layout, packing in (("auto", "panels"), ("source", "source"), ("panels", "panels")):
            w = m.upload_grouped_fp8_weights(codes, scales, layout=layout, label=layout)
            assert w.packing == packing, layout
        with pytest.raises(metrale.InvalidArgumentError, match="no decode layout"):
            m.upload_grouped_fp8_weights(codes, scales, layout="decode")
        with pytest.raises(metrale.InvalidArgumentError, match="layout: 'tiles'"):
            m.upload_grouped_fp8_weights(codes, scales, layout="tiles")


@pytest.mark.parametrize("name,up", [("qwen3moe-ct-w4a16", "model.layers.1.mlp.experts.5.up_proj"),
                                     ("mixtral-gptq",
                                      "model.layers.1.block_sparse_moe.experts.5.w3")])
def test_expert_linears_missing_an_expert_are_refused(tmp_path, name, up):
    """A checkpoint without one expert's up projection: refused by its name in the checkpoint,
    nothing loaded."""
    src = MODELS / name
    from safetensors.torch import save_file

    tensors = {k: v for k, v in checkpoint_tensors(src).items() if not k.startswith(up + ".")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(metrale.IoError, match=f"not in the checkpoint: {re.escape(up)}"):
        mt.from_pretrained(str(tmp_path), backend="cpu")


def test_experts_whose_gate_and_up_orders_differ_are_refused(tmp_path, rng):
    """GPTQ's desc_act orders an expert's gate_proj and up_proj alike (they read one input); a
    checkpoint whose up_proj has another order (here expert 3's of qwen3moe-gptq-desc-act, its
    g_idx shuffled) cannot stack them into one gate_up: refused naming the expert."""
    from safetensors.torch import save_file

    src = MODELS / "qwen3moe-gptq-desc-act"
    tensors = checkpoint_tensors(src)
    name = "model.layers.1.mlp.experts.3.up_proj"
    g_idx = tensors[name + ".g_idx"]
    tensors[name + ".g_idx"] = g_idx[torch.from_numpy(rng.permutation(g_idx.numel()))]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(metrale.IoError, match=r"experts\.3: its gate_proj and up_proj cannot be "
                                              r"one gate_up .*act order in another K order"):
        mt.from_pretrained(str(tmp_path), backend="cpu")


def test_experts_of_another_gate_are_refused(rng):
    """An experts class with a gate of its own (DeepSeek-V4's and Step-3.7's clamp gate and up
    before SiLU(gate) · up) or without transformers' experts decorator computes something else
    than the grouped GEMMs' SiLU(gate) · up: refused naming what differs, the module left in
    place and nothing held (a review found DeepseekV4Experts taken and run unclamped)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    experts, hidden, inter = 4, 64, 32
    config = Qwen3MoeConfig(num_experts=experts, hidden_size=hidden, moe_intermediate_size=inter)

    class Clamped(Qwen3MoeExperts):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.clamp(max=1.0).chunk(2, dim=-1)
            return self.act_fn(gate) * up

    class Undecorated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            inner = Qwen3MoeExperts(config)
            self.gate_up_proj, self.down_proj, self.act_fn = (inner.gate_up_proj,
                                                              inner.down_proj, inner.act_fn)

    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    hosts = {f"experts.{e}.{p}": metrale.quantize_mxfp4(
        rng.standard_normal(shape).astype(np.float32)) for e in range(experts)
        for p, shape in shapes.items()}

    class Checkpoint:
        fp8_layers: list = []

        def weights(self, name):
            return hosts[name]

    undecorated = r"\(is_concatenated=unset, .*has_gate=unset, its _apply_gate\)"
    for make, why in ((lambda: Clamped(config), r"\(its _apply_gate\)"),
                      (Undecorated, undecorated)):
        holder = torch.nn.Module()
        holder.experts = make()
        runtime = metrale.Model("cpu")
        with pytest.raises(metrale.IoError, match=r"\[load\] experts: a \w+ " + why):
            mt.torch_moe.swap_expert_linears("load", holder, Checkpoint(), list(hosts), runtime,
                                             False)
        assert not isinstance(holder.experts, mt.MoeExperts)
        assert runtime.close().clean


def test_layers_transformers_ignores_are_left_out(tmp_path, rng):
    """DeepSeek-V3's official checkpoints ship a multi-token-prediction layer 61, quantized like
    the others, which transformers leaves unread (_keys_to_ignore_on_load_unexpected). The FP8
    fixture with its layer 1 copied to layer 61 loads as the fixture does, the same logits bit
    for bit (a review found it refused: 'a quantized layer the model has no module for')."""
    from safetensors.torch import save_file

    src = MODELS / "deepseek-transformers-fp8"
    tensors = checkpoint_tensors(src)
    tensors.update({k.replace("model.layers.1.", "model.layers.61."): v.clone()
                    for k, v in tensors.items() if k.startswith("model.layers.1.")})
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    plain, with_mtp = (mt.from_pretrained(str(f), backend="cpu") for f in (src, tmp_path))
    try:
        ids = prompts(rng, plain.config.vocab_size)
        with torch.no_grad():
            assert torch.equal(plain(ids).logits, with_mtp(ids).logits)
    finally:
        assert plain.metrale.close().clean and with_mtp.metrale.close().clean


@pytest.mark.parametrize("pattern", ["model.layers.0.mlp.experts", "model.layers.*.mlp",
                                     "experts"])
def test_experts_the_config_leaves_unconverted_are_refused(tmp_path, pattern):
    """gpt-oss's modules_to_not_convert read as transformers' Mxfp4 quantizer reads it, against
    the experts module: one naming the experts (by name, a regex from the start, or the name's
    end) would leave them in BF16, so packed experts contradict the config. Both loaders refuse
    it naming the module (a review found it loaded: the list was matched as whole-name globs
    against the projections)."""
    src = MODELS / "gptoss-mxfp4"
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(pattern)
    (tmp_path / "config.json").write_text(json.dumps(config))
    why = r"ignores model\.layers\.0\.mlp\.experts.*which the checkpoint holds"
    with pytest.raises(metrale.IoError, match=why):
        metrale.load(str(tmp_path), backend="cpu")
    with pytest.raises(metrale.IoError, match=why):
        mt.from_pretrained(str(tmp_path), backend="cpu")


def _quantized_experts(rng, fmt: str, count: int, n: int, k: int) -> list:
    quantize = {"nvfp4": metrale.quantize_nvfp4, "mxfp4": metrale.quantize_mxfp4,
                "int4": lambda w: metrale.quantize_int4(w, 32, True)}[fmt]
    return [quantize(rng.standard_normal((n, k)).astype(np.float32) / math.sqrt(k))
            for _ in range(count)]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4"])
@pytest.mark.parametrize("glu", ["silu", "clamped_swiglu"])
def test_moe_experts_against_float64(rng, fmt, glu):
    """Model.moe_experts on fresh random experts and routings (an id outside [0, E) included, one
    expert taking every token), with biases: per token within MOE_BOUND of the float64 layer;
    out is poisoned first, so an unwritten element fails."""
    count, h, inter = 8, 128, 64
    with metrale.Model("cpu") as m:
        gu = _quantized_experts(rng, fmt, count, 2 * inter, h)
        dn = _quantized_experts(rng, fmt, count, h, inter)
        b1 = (rng.standard_normal((count, 2 * inter)) * 0.1).astype(ml_dtypes.bfloat16)
        b2 = (rng.standard_normal((count, h)) * 0.1).astype(ml_dtypes.bfloat16)
        w1 = m.upload_grouped_weights(gu, bias=b1, label="gate_up")
        w2 = m.upload_grouped_weights(dn, bias=b2, label="down")
        layer = {"glu": glu,
                 "gate_up": torch.stack([torch.from_numpy(g.dequantize().astype(np.float64))
                                         for g in gu]),
                 "down": torch.stack([torch.from_numpy(d.dequantize().astype(np.float64))
                                      for d in dn]),
                 "gate_up_bias": torch.from_numpy(b1.astype(np.float64)),
                 "down_bias": torch.from_numpy(b2.astype(np.float64))}
        for tokens, skew in ((1, False), (7, False), (33, True)):
            x = (rng.standard_normal((tokens, h)) * 2).astype(ml_dtypes.bfloat16)
            ids = np.stack([rng.choice(count, 2, replace=False) for _ in range(tokens)])
            if skew:
                ids[:, 0] = 3  # one expert takes every token
                ids[:, 1] = np.where(ids[:, 1] == 3, 4, ids[:, 1])
            ids[0, 1] = -1  # no expert: this slot adds nothing
            ids = ids.astype(np.int32)
            w = rng.random((tokens, 2)).astype(np.float32)
            out = np.full((tokens, h), np.nan, dtype=ml_dtypes.bfloat16)
            m.moe_experts(x, ids, w, w1, w2, glu=glu, out=out)
            valid = torch.from_numpy(np.where(ids < 0, 0, ids))
            wv = torch.from_numpy(np.where(ids < 0, 0.0, w))
            check_experts_in_place(f"{fmt} {glu} T={tokens}",
                                   (torch.from_numpy(x.astype(np.float32)), valid, wv),
                                   torch.from_numpy(out.astype(np.float32)), layer)


def test_moe_experts_bad_arguments(rng):
    with metrale.Model("cpu") as m:
        gu = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 64), label="gu")
        dn = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 32), label="dn")
        other = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 64), label="o")
        x = np.zeros((3, 64), dtype=ml_dtypes.bfloat16)
        ids = np.zeros((3, 2), dtype=np.int32)
        w = np.ones((3, 2), dtype=np.float32)
        m.moe_experts(x, ids, w, gu, dn)
        with pytest.raises(metrale.DtypeError, match=r"\[moe_experts\] ids"):
            m.moe_experts(x, ids.astype(np.int64), w, gu, dn)
        with pytest.raises(metrale.InvalidArgumentError, match=r"\[moe_experts\] weights"):
            m.moe_experts(x, ids, w[:, :1].copy(), gu, dn)
        with pytest.raises(metrale.InvalidArgumentError, match=r"\[moe_experts\] down"):
            m.moe_experts(x, ids, w, gu, other)
        with pytest.raises(metrale.InvalidArgumentError, match="glu: 'gelu'"):
            m.moe_experts(x, ids, w, gu, dn, glu="gelu")
        with pytest.raises(metrale.DtypeError, match="not GroupedWeights"):
            m.moe_experts(x, ids, w, gu, "dn")
        with pytest.raises(metrale.InvalidArgumentError, match=r"\[upload_grouped_weights\]"):
            m.upload_grouped_weights([])
        mixed = _quantized_experts(rng, "nvfp4", 1, 64, 64) + _quantized_experts(rng, "mxfp4", 1,
                                                                                 64, 64)
        with pytest.raises(metrale.InvalidArgumentError, match="expert 1"):
            m.upload_grouped_weights(mixed)
    with pytest.raises(metrale.StateError):
        m.moe_experts(x, ids, w, gu, dn)


def test_take_rows_takes_integer_rows_only(rng):
    """Row indices as given: a float array (truncated before, 2.7 taking row 2) or a matrix
    (flattened before) is DtypeError naming take_rows; a [1, n] row as k_perm is taken; the
    binding converts nothing."""
    w = _quantized_experts(rng, "mxfp4", 1, 4, 64)[0]
    assert metrale.take_rows(w, [3, 0]).n == 2
    assert metrale.take_rows(w, np.array([[3, 0, 1]], np.int32)).n == 3
    for rows in (np.array([2.7]), np.array([[0, 1], [2, 3]])):
        with pytest.raises(metrale.DtypeError, match=r"\[take_rows\] rows: a .* array of shape "
                                                     r".*; expected integer row indices"):
            metrale.take_rows(w, rows)
    with pytest.raises(TypeError):
        metrale._metrale.take_rows(w, np.array([2.7]))


def test_act_ordered_experts_through_model_moe_experts(rng):
    """Model.moe_experts on GPTQ desc_act experts: gate_up's order is gathered with x, a down
    that still has its own is refused (fold it first, Note [Experts' act order]); folded with
    take_rows and in_stored_order, the call runs and matches the float64 layer."""
    ckpt = metrale.load_safetensors(str(MODELS / "qwen3moe-gptq-desc-act"))
    p = "model.layers.0.mlp.experts"
    gate = [ckpt.weights(f"{p}.{e}.gate_proj") for e in range(8)]
    up = [ckpt.weights(f"{p}.{e}.up_proj") for e in range(8)]
    down = [ckpt.weights(f"{p}.{e}.down_proj") for e in range(8)]
    assert all(w.k_perm is not None for w in gate + up + down)
    x = (rng.standard_normal((5, 256)) / 4).astype(ml_dtypes.bfloat16)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(5)]).astype(np.int32)
    w = rng.uniform(0.2, 1.0, (5, 2)).astype(np.float32)
    with metrale.Model("cpu") as m:
        gu = m.upload_grouped_weights([metrale.stack_rows([g, u]) for g, u in zip(gate, up)])
        with pytest.raises(metrale.InvalidArgumentError,
                           match=r"\[moe_experts\] down: act-ordered experts"):
            m.moe_experts(x, ids, w, gu, m.upload_grouped_weights(down))
        folded = [[metrale.take_rows(h, d.k_perm) for h in (g, u)] for g, u, d in
                  zip(gate, up, down)]
        gu = m.upload_grouped_weights([metrale.stack_rows(parts) for parts in folded])
        dn = m.upload_grouped_weights([metrale.in_stored_order(d) for d in down])
        got = torch.from_numpy(np.asarray(m.moe_experts(x, ids, w, gu, dn)).astype(np.float32))
    layer = {"glu": "silu", "gate_up_bias": None, "down_bias": None,
             "gate_up": torch.stack([torch.cat([torch.from_numpy(g.dequantize(exact=True)),
                                                torch.from_numpy(u.dequantize(exact=True))])
                                     for g, u in zip(gate, up)]),
             "down": torch.stack([torch.from_numpy(d.dequantize(exact=True)) for d in down])}
    check_experts_in_place("layer 0", (torch.from_numpy(x.astype(np.float32)).bfloat16(),
                                       torch.from_numpy(ids), torch.from_numpy(w)), got, layer)


def test_int4_checkpoints_opted_in_on_a_gpu_upload_in_the_int4_decode_layout(rng):
    """from_pretrained's upload layout (torch_moe.upload_layout): INT4 weights on a GPU backend
    opted in to unverified kernels go to the INT4 decode layout, the only one CUDA reads INT4 in
    (its kernels unverified, "auto" would leave them in the source layout, which every CUDA plan
    refuses); other formats, the CPU, and no opt-in keep "auto"."""
    from metrale.torch_moe import upload_layout

    class Runtime:
        def __init__(self, backend):
            self.backend = backend

    w = rng.standard_normal((32, 128)).astype(np.float32)
    int4 = metrale.quantize_int4(w, group=128)
    nvfp4 = metrale.quantize_nvfp4(w)
    assert upload_layout(Runtime("cuda"), int4, True) == "decode"
    assert upload_layout(Runtime("cuda"), int4, False) == "auto"
    assert upload_layout(Runtime("cuda"), nvfp4, True) == "auto"
    assert upload_layout(Runtime("cpu"), int4, True) == "auto"


def test_moe_experts_routes(rng):
    """Model.moe_experts' route: on the CPU, decode is what auto takes (the same bytes, for 4-bit
    and FP8 experts); tiled (CUDA's FP8 kernel) is refused by name, as is each kind's other route
    and an unknown name, nothing written; MoeExperts and from_pretrained refuse an unknown route
    before anything is loaded."""
    codes = rng.integers(0, 0x7E, size=(4, 64, 64), dtype=np.uint8)
    down_codes = rng.integers(0, 0x7E, size=(4, 64, 32), dtype=np.uint8)
    scales = np.full((4, 1, 1), 2.0 ** -6, np.float32)
    x = (rng.standard_normal((5, 64))).astype(ml_dtypes.bfloat16)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(5)]).astype(np.int32)
    w = rng.random((5, 2)).astype(np.float32)
    with metrale.Model("cpu") as m:
        kinds = {
            "fp8": (m.upload_grouped_fp8_weights(codes, scales, label="gu8"),
                    m.upload_grouped_fp8_weights(down_codes, scales, label="dn8")),
            "nvfp4": (m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 64),
                                               label="gu"),
                      m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 32),
                                               label="dn")),
        }
        for kind, (gu, dn) in kinds.items():
            auto = m.moe_experts(x, ids, w, gu, dn)
            decode = np.full((5, 64), np.nan, dtype=ml_dtypes.bfloat16)
            m.moe_experts(x, ids, w, gu, dn, route="decode", out=decode)
            assert np.asarray(auto).tobytes() == decode.tobytes(), kind
        refused = [("fp8", "tiled", metrale.UnavailableError,
                    r"no kernel fp8::gemm_grouped_e4m3_block128_tiled \(the tiled route is CUDA's"),
                   ("fp8", "fused", metrale.InvalidArgumentError,
                    "route fused is not a grouped W8A8 route"),
                   ("nvfp4", "tiled", metrale.InvalidArgumentError,
                    "route tiled is not a grouped route"),
                   ("fp8", "dense", metrale.InvalidArgumentError,
                    r"route: 'dense', expected auto, decode, fused \(4-bit experts\) or tiled")]
        for kind, route, error, match in refused:
            out = np.full((5, 64), np.nan, dtype=ml_dtypes.bfloat16)
            with pytest.raises(error, match=match):
                m.moe_experts(x, ids, w, *kinds[kind], route=route, out=out)
            assert np.isnan(out.astype(np.float32)).all(), (kind, route)
        with pytest.raises(metrale.InvalidArgumentError, match="route: 'dense'"):
            mt.MoeExperts(m, *kinds["fp8"], route="dense")
    with pytest.raises(metrale.InvalidArgumentError, match="moe_route: 'dense'"):
        mt.from_pretrained(str(MODELS / "qwen3moe-transformers-fp8"), backend="cpu",
                           moe_route="dense")


def test_moe_op_compiles_without_a_graph_break(rng):
    """torch.compile(fullgraph=True) traces a MoeExperts call (the op's fake gives the shape) and
    the compiled call gives the eager call's bits."""
    with metrale.Model("cpu") as m:
        gu = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 64), label="gu")
        dn = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 32), label="dn")
        layer = mt.MoeExperts(m, gu, dn)
        x = torch.from_numpy(rng.standard_normal((5, 64))).to(torch.bfloat16)
        ids = torch.from_numpy(np.stack([rng.choice(4, 2, replace=False) for _ in range(5)]))
        w = torch.softmax(torch.randn(5, 2), -1).to(torch.bfloat16)
        eager = layer(x, ids, w)
        compiled = torch.compile(layer, fullgraph=True, backend="eager")(x, ids, w)
        assert torch.equal(eager, compiled)


def _plant_silu_for_gptoss(monkeypatch, model):
    register = mt.torch_moe.register_experts
    monkeypatch.setattr(mt.torch_moe, "register_experts",
                        lambda m, gu, dn, glu, *a, **k: register(m, gu, dn, "silu", *a, **k))


def _plant_up_before_gate(monkeypatch, model):
    stack = metrale.stack_rows
    monkeypatch.setattr(metrale, "stack_rows", lambda parts: stack(list(parts)[::-1]))


def _plant_router_change(monkeypatch, model):
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        router.weight[3] += 0.05  # metrale's router only: the fed model keeps the file's


def _plant_no_correction_bias(monkeypatch, model):
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()


# Each plant's folder, its changes before and after the load, and the failure it must give: the
# experts' own check (their normalized error) or, for a change outside the experts, the fed
# transformers model (its experts fed another routing than metrale's, or other logits).
EXPERTS_FAIL = r"normalized error is .* \(bound"
LOGITS_FAIL = r"another routing|the logits differ outside the GEMMs and the experts"
PLANTS = {"gpt-oss activation as silu": ("gptoss-mxfp4", _plant_silu_for_gptoss, None,
                                         EXPERTS_FAIL),
          "DeepSeek's correction bias dropped": ("deepseek-modelopt-nvfp4", None,
                                                 _plant_no_correction_bias, LOGITS_FAIL),
          "up stacked before gate": ("qwen3moe-ct-w4a16", _plant_up_before_gate, None,
                                     EXPERTS_FAIL),
          "a router weight changed": ("qwen3moe-ct-nvfp4a16", None, _plant_router_change,
                                      LOGITS_FAIL)}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_moe_model_faults_fail_the_check(rng, monkeypatch, plant):
    """The whole-model check is shown failing on faults planted in metrale's model: an
    activation of another family, gate and up stacked the wrong way round, and a change outside
    the experts (the router) that the experts' own check cannot see."""
    name, before_load, after_load, failure = PLANTS[plant]
    folder = MODELS / name
    if before_load:
        before_load(monkeypatch, None)
    model = mt.from_pretrained(str(folder), backend="cpu")
    try:
        if after_load:
            after_load(monkeypatch, model)
        with pytest.raises(AssertionError, match=failure):
            checked_moe_forward(model, folder, prompts(rng, model.config.vocab_size))
    finally:
        assert model.metrale.close().clean


def test_load_keeps_the_shared_experts_gate_in_floats():
    """metrale.load on GPTQ's Qwen2-MoE: its shared expert's gate, Linear(H, 1), which no 4-bit
    layout packs, is a router kept in floats, not a layer the config's every-Linear
    quantization skipped."""
    with metrale.load(str(MODELS / "qwen2moe-gptq"), backend="cpu") as loaded:
        assert "model.layers.1.mlp.shared_expert_gate" in loaded.dense
        assert "62 layer(s) GPTQ INT4" in loaded.summary


def test_load_uploads_packed_experts():
    """metrale.load on gpt-oss: each packed projection one GroupedWeights with its bias, named
    with its source; the attention and router stay plain; nothing silently skipped."""
    with metrale.load(str(MODELS / "gptoss-mxfp4"), backend="cpu") as ckpt:
        grouped = {k: v for k, v in ckpt.layers.items() if isinstance(v, metrale.GroupedWeights)}
        assert sorted(grouped) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                   for p in ("down_proj", "gate_up_proj")]
        assert all(ckpt.sources[k] == "gpt-oss MXFP4" for k in grouped)
        assert all(w.experts == 8 and w.has_bias for w in grouped.values())
        assert "model.layers.0.mlp.router" in ckpt.dense
        assert not any("_blocks" in t or "_scales" in t for t in ckpt.other)
        assert "4 layer(s) gpt-oss MXFP4" in ckpt.summary


def _routers(experts: int):
    """transformers' own routers of the three families, in FP32, whose linear is the identity so
    that their logits are the test's (config classes' defaults otherwise)."""
    from transformers import DeepseekV3Config, GptOssConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    qwen = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=experts, num_experts=experts,
                                             num_experts_per_tok=8, norm_topk_prob=True))
    oss = GptOssTopKRouter(GptOssConfig(hidden_size=experts, num_local_experts=experts,
                                        num_experts_per_tok=4))
    deepseek = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=8, n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5))
    for r in (qwen, oss, deepseek):
        r.float()
        with torch.no_grad():
            r.weight.copy_(torch.eye(experts))
            if getattr(r, "bias", None) is not None:
                r.bias.zero_()
    return qwen, oss, deepseek


def test_moe_route_matches_transformers_routers(rng):
    """Model.moe_route against transformers' own routers (Qwen3-MoE softmax then top 8
    renormalized; gpt-oss top 4 then softmax; DeepSeek-V3 sigmoid, 8 groups of which the best 4,
    e_score_correction_bias, x 2.5) on fresh random logits: the same experts for every token but
    where two candidates lie within FP32 rounding of each other, weights within 1e-6."""
    experts, tokens = 64, 256
    qwen, oss, deepseek = _routers(experts)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1
    deepseek.e_score_correction_bias.copy_(torch.from_numpy(bias))
    cases = [("softmax", qwen, 8, dict(renormalize=True), lambda l: l),
             ("topk_softmax", oss, 4, {}, lambda l: l),
             ("sigmoid", deepseek, 8, dict(renormalize=True, scale=2.5, groups=8, topk_groups=4,
                                           bias=bias), lambda l: 1 / (1 + np.exp(-l)) + bias)]
    with metrale.Model("cpu") as m:
        for scoring, router, k, kw, choice in cases:
            logits = (rng.standard_normal((tokens, experts)) * 2).astype(np.float32)
            ids, w = m.moe_route(logits, k, scoring=scoring, **kw)
            with torch.no_grad():
                _, tw, ti = router(torch.from_numpy(logits))
            tw, ti = tw.double().numpy(), ti.numpy()
            values = choice(logits.astype(np.float64))
            mismatched = 0
            for t in range(tokens):
                ours = sorted(zip(ids[t].tolist(), w[t].tolist()))
                theirs = sorted(zip(ti[t].tolist(), tw[t].tolist()))
                if [e for e, _ in ours] != [e for e, _ in theirs]:
                    # Only a near-tie may choose otherwise: the k-th and (k+1)-th choice values
                    # within FP32 rounding, or (grouped) the last chosen group's score and the
                    # next's.
                    v = np.sort(values[t])[::-1]
                    near = v[k - 1] - v[k] < 1e-6 * max(1.0, abs(v[k]))
                    if "groups" in kw:
                        g = np.sort(np.sort(values[t].reshape(kw["groups"], -1), 1)[:, -2:]
                                    .sum(1))[::-1]
                        tg = kw["topk_groups"]
                        near = near or g[tg - 1] - g[tg] < 1e-6 * max(1.0, abs(g[tg]))
                    assert near, f"{scoring} token {t}: {ours} against {theirs}"
                    mismatched += 1
                    continue
                for (_, a), (_, b) in zip(ours, theirs):
                    assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), f"{scoring} token {t}"
            assert mismatched <= 2, f"{scoring}: {mismatched} near-ties"
            if scoring == "sigmoid":
                # Planted: the correction bias dropped chooses other experts for many tokens,
                # far past what the near-tie allowance above lets through.
                plain = {k2: v2 for k2, v2 in kw.items() if k2 != "bias"}
                wrong, _ = m.moe_route(logits, k, scoring=scoring, **plain)
                moved = sum(sorted(wrong[t]) != sorted(ti[t]) for t in range(tokens))
                assert moved > 10, moved
        with pytest.raises(metrale.InvalidArgumentError, match="scoring: 'max'"):
            m.moe_route(np.zeros((2, 8), np.float32), 2, scoring="max")
        with pytest.raises(metrale.InvalidArgumentError, match=r"\[moe_route\] top_k = 9"):
            m.moe_route(np.zeros((2, 8), np.float32), 9)
        with pytest.raises(metrale.InvalidArgumentError, match=r"top_k = 100000 is outside"):
            m.moe_route(np.zeros((2, 8), np.float32), 100000)
        with pytest.raises(metrale.DtypeError, match=r"\[moe_route\] logits"):
            m.moe_route(np.zeros((2, 8), np.float64), 2)


def test_refused_calls_leave_nothing_allocated(rng):
    """A call refused for its routing's shape or its activation is refused before any scratch is
    sized from it: the model's owned bytes stay as they were (a review found 134 MB kept)."""
    with metrale.Model("cpu") as m:
        gu = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 64), label="gu")
        dn = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 32), label="dn")
        x = np.zeros((3, 64), dtype=ml_dtypes.bfloat16)
        m.moe_experts(x, np.zeros((3, 2), np.int32), np.ones((3, 2), np.float32), gu, dn)
        before = m.stats()["owned_bytes"]
        with pytest.raises(metrale.InvalidArgumentError, match=r"top_k = 5000"):
            m.moe_experts(x, np.zeros((3, 5000), np.int32), np.ones((3, 5000), np.float32), gu, dn)
        with pytest.raises(metrale.InvalidArgumentError, match=r"limit = 0"):
            m.moe_experts(x, np.zeros((3, 2), np.int32), np.ones((3, 2), np.float32), gu, dn,
                          glu="clamped_swiglu", limit=0.0)
        assert m.stats()["owned_bytes"] == before
        with pytest.raises(metrale.DtypeError, match=r"parts\[1\]"):
            metrale.stack_rows([_quantized_experts(rng, "nvfp4", 1, 16, 32)[0], None])


def test_torch_op_ids_and_strides(rng):
    """The op's ids outside [0, E), int64 ones past int32 included, contribute nothing (never
    wrapped onto an expert), and an x of other strides, or contiguous at an offset of its storage
    that is not 16-byte aligned, gives the contiguous x's result."""
    with metrale.Model("cpu") as m:
        gu = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 64), label="gu")
        dn = m.upload_grouped_weights(_quantized_experts(rng, "nvfp4", 4, 64, 32), label="dn")
        layer = mt.MoeExperts(m, gu, dn)
        x = torch.from_numpy(rng.standard_normal((6, 64))).to(torch.bfloat16)
        ids = torch.from_numpy(np.stack([rng.choice(4, 2, replace=False) for _ in range(6)]))
        w = torch.softmax(torch.randn(6, 2), -1)
        want = layer(x, ids, w)
        strided = x.t().contiguous().t()
        assert not strided.is_contiguous()
        assert torch.equal(layer(strided, ids, w), want)
        shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)
        shifted.copy_(x)
        assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0
        assert torch.equal(layer(shifted, ids, w), want)
        # Slot 1 of every token out of range: only slot 0's expert remains.
        for far in (4, 2**32 + 1, -3):
            bad = ids.clone()
            bad[:, 1] = far
            only = ids.clone()
            w0 = w.clone()
            w0[:, 1] = 0.0
            assert torch.equal(layer(x, bad, w), layer(x, only, w0)), far


def test_a_misshapen_expert_is_refused_by_name(tmp_path):
    """One expert's down_proj 16 rows short: IoError naming the module and the expert."""
    from safetensors.torch import save_file

    src = MODELS / "qwen3moe-modelopt-nvfp4"
    tensors = checkpoint_tensors(src)
    for part in ("weight", "weight_scale"):
        name = f"model.layers.1.mlp.experts.5.down_proj.{part}"
        tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "hf_quant_config.json"):
        (tmp_path / f).write_text((src / f).read_text())
    with pytest.raises(metrale.IoError, match=r"model\.layers\.1\.mlp\.experts\.5: its down_proj"):
        mt.from_pretrained(str(tmp_path), backend="cpu")
