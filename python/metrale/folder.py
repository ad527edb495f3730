"""metrale.load: a checkpoint folder's linear layers on one Model, and what it loaded.

    with metrale.load("path/to/checkpoint") as ckpt:   # a folder, an index or a file
        print(ckpt.summary)
        w = ckpt.layers["model.layers.0.mlp.down_proj"]
        c = ckpt.model.gemm(a, w, allow_e4m3=w.format == "e4m3_block128")

Never a silent partial load: a tensor that looks quantized but that metrale cannot read, or
layers that disagree with the quantization the folder's config declares, raise IoError naming
them before anything is uploaded.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from . import _metrale
from .errors import IoError, argument_error
from .model import Model

_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
# What metrale.Checkpoint.source says of a layer the checkpoint holds in FP4 (metrale.torch too).
FP4_SOURCES = ("ModelOpt NVFP4", "compressed-tensors NVFP4", "compressed-tensors MXFP4")
INT4_SOURCES = ("compressed-tensors INT4", "GPTQ INT4", "AWQ INT4")
# The layers Model.upload_weights takes, as their producers stored them.
FOUR_BIT_SOURCES = FP4_SOURCES + INT4_SOURCES


@dataclass
class Loaded:
    """What load() made of a checkpoint. A context manager: leaving it closes ``model``.

    layers: quantized layers on ``model`` (Weights; Fp8Weights, which run the W8A8 op with
    allow_e4m3=True; GroupedWeights for an MoE projection the file packs for every expert, as
    gpt-oss does, with its bias: Model.moe_experts). sources: what the file held for each. dense: the linear layers the
    checkpoint keeps in floats (lm_head, what its quantizer excluded), not quantized: BF16 ones
    as DenseWeights on ``model`` (Model.gemm runs the backend's dense BF16 GEMM on them), F16 and
    F32 ones as host arrays (the dense GEMM is BF16, and rounding them would change the layer).
    other: every other tensor's name (embeddings, norms).
    declared: the folder config's declared quantization (metrale.Checkpoint.declared) or None.
    """

    model: Model
    path: str
    layers: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)
    other: list = field(default_factory=list)
    declared: Any = None
    checkpoint: Any = None  # the metrale.Checkpoint it was read from (tensor() reads it again)

    @property
    def summary(self) -> str:
        """One line of what was loaded: layers per format, dense layers, other tensors, and what
        the config declares."""
        by_source: dict = {}
        for layer, source in self.sources.items():
            by_source.setdefault(source, []).append(layer)
        parts = [f"{len(v)} layer(s) {k}" for k, v in sorted(by_source.items())]
        if self.dense:
            parts.append(f"{len(self.dense)} layer(s) kept in floats, not quantized "
                         f"({', '.join(sorted(self.dense))})")
        if self.other:
            parts.append(f"{len(self.other)} other tensor(s) (embeddings, norms), not loaded")
        if self.declared is not None:
            note = f"; {self.declared['activations']}" if self.declared["activations"] else ""
            parts.append(f"declared {self.declared['describe']}{note}")
        return f"{self.path}: " + "; ".join(parts)

    def tensor(self, name: str) -> np.ndarray:
        """A tensor of the checkpoint (one in ``other``, say) read as a host array."""
        return _read_array(self.checkpoint, name)

    def close(self, check: bool = True) -> Any:
        """Closes the model: every uploaded layer's memory back, the ledger at 0 bytes."""
        return self.model.close(check)

    def __enter__(self) -> "Loaded":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.model.close(check=exc_type is None)
        return False


def _with_prefix(names: list, prefix: str) -> list:
    """The names of sorted list ``names`` that start with ``prefix``."""
    start = bisect.bisect_left(names, prefix)
    end = start
    while end < len(names) and names[end].startswith(prefix):
        end += 1
    return names[start:end]


def load(path: str, backend: str = "auto") -> Loaded:
    """Every linear layer of a checkpoint (a model folder, a sharded index, or a safetensors file)
    loaded as its producer stored it: FP4 (ModelOpt NVFP4, compressed-tensors nvfp4/mxfp4), INT4
    (compressed-tensors pack-quantized, GPTQ, AWQ) and FP8 block-128 layers uploaded to one Model on ``backend``; BF16/F32 linears kept as they are
    (``dense``); everything else named (``other``). A checkpoint without any quantized layer is
    refused: quantize its layers yourself (quantize_nvfp4) rather than have them quantized
    behind your back."""
    api = "metrale.load"
    ckpt = _metrale.load_safetensors(path)
    unread = [r for r in ckpt.rejected if r["quantized"]]
    if unread:
        raise argument_error(api, "tensors that look quantized but that metrale cannot read: " +
                             "; ".join(f"{r['tensor']}: {r['why']}" for r in unread), IoError)
    fp4 = [layer for layer in ckpt.layers if ckpt.source(layer) in FOUR_BIT_SOURCES]
    plain = [layer for layer in ckpt.layers if layer not in fp4]
    packed = list(ckpt.experts)
    if not fp4 and not ckpt.fp8_layers and not packed:
        raise argument_error(api, f"{ckpt.path} holds no quantized layer (its linears are in "
                             "floats); quantize them with metrale.quantize_nvfp4 or "
                             "metrale.torch.swap_linears", IoError)
    sources = {layer: ckpt.source(layer) for layer in fp4 + list(ckpt.fp8_layers)}
    sources.update({p["projection"]: p["source"] for p in packed})
    # Embedding tables are 2-D float matrices too; the config's ignore list and the plain
    # Linears are told apart by name, as transformers names them.
    dense = [layer for layer in plain if not _is_embedding(layer)]
    # An MoE router (transformers' Qwen3MoeTopKRouter, DeepseekV3TopkRouter) is a matrix but no
    # Linear: quantizers that take every Linear leave it alone, so it is no skipped layer.
    routers = _routers(dense, ckpt.tensors)
    # A packed projection is held to the ignore list by its experts module, the module
    # transformers' quantizer converts (and skips, when the list names it).
    declared = [(layer, source) for layer, source in sources.items()
                if layer not in {p["projection"] for p in packed}]
    declared += sorted({(p["projection"].rpartition(".")[0], p["source"]) for p in packed})
    ckpt.check_declared(declared, [d for d in dense if d not in routers], api)
    model = Model(backend)
    try:
        loaded = Loaded(model, ckpt.path, sources=sources, declared=ckpt.declared,
                        checkpoint=ckpt)
        for layer in fp4:
            loaded.layers[layer] = model.upload_weights(ckpt.weights(layer), label=layer)
        for layer in ckpt.fp8_layers:
            loaded.layers[layer] = model.upload_fp8_weights(*ckpt.fp8_weights(layer), label=layer)
        for p in packed:
            hosts, bias = ckpt.expert_weights(p["projection"])
            loaded.layers[p["projection"]] = model.upload_grouped_weights(
                hosts, bias=None if bias is None else bias.view(ml_dtypes.bfloat16),
                label=p["projection"])
        for layer in dense:
            w = _read_array(ckpt, layer + ".weight")
            loaded.dense[layer] = (model.upload_dense_weights(w, label=layer)
                                   if w.dtype == ml_dtypes.bfloat16 and w.ndim == 2 else w)
        # A packed projection's tensors are "<projection>_blocks" and its kin.
        # By bisection in the sorted names: a scan of every name per layer took 94 s for 18.6k
        # layers of 74.5k tensors (a review's measure).
        names = sorted(ckpt.tensors)
        linear = {t for layer in sources for t in _with_prefix(names, layer + ".")}
        linear |= {t for p in packed for t in _with_prefix(names, p["projection"] + "_")}
        linear |= {layer + ".weight" for layer in dense}
        loaded.other = sorted(t for t in ckpt.tensors if t not in linear)
    except BaseException:
        model.close(check=False)
        raise
    return loaded


# An MoE block's routers: its router over the experts ("gate", "router") and Qwen2-MoE's gate on
# its shared expert (Linear(H, 1), which no 4-bit layout packs and GPTQModel and AutoAWQ leave in
# floats).
ROUTER_LEAVES = ("gate", "router", "shared_expert_gate")


def _routers(layers: list, tensors: list) -> set:
    """The layers named as an MoE block's router (ROUTER_LEAVES) beside experts of the same block
    ("<block>.experts...")."""
    blocks = {t.split(".experts.")[0] for t in tensors if ".experts." in t}
    return {layer for layer in layers
            if layer.rpartition(".")[2] in ROUTER_LEAVES and layer.rpartition(".")[0] in blocks}


def _is_embedding(layer: str) -> bool:
    return layer.rpartition(".")[2] in ("embed_tokens", "wte", "word_embeddings", "embed_in",
                                        "tok_embeddings")


def _read_array(ckpt: Any, name: str) -> np.ndarray:
    dtype, shape, raw = ckpt.tensor_bytes(name)
    np_dtype = _DTYPES.get(dtype)
    if np_dtype is None:
        raise argument_error("metrale.load", f"tensor '{name}': dtype {dtype} is not a float "
                             "type this reads (BF16, F16, F32)", IoError)
    return raw.reshape(-1).view(np_dtype).reshape(shape)
