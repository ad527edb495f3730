"""metrale.torch's mixture-of-experts layer: an experts module that runs a model's MoE experts on
metrale (one call per layer: the grouped GEMMs and the glue around them, ops/moe.h), and the op
``torch.ops.metrale.moe_experts(x, top_k_index, top_k_weights, experts)`` under it, registered
through torch.library with a fake implementation (torch.compile traces it without a graph break).

The module stands where transformers puts its experts (Qwen3MoeExperts, GptOssExperts, ...):
forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]; the router
stays transformers' own. ``experts`` is the handle ``register_experts`` returns: an int, as
metrale.torch.linear's weights are (Note [torch op handles] in docs/NOTES.md).
"""

from __future__ import annotations

import itertools
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

import metrale

from . import _metrale
from .errors import argument_error

__all__ = ["MoeExperts", "moe_experts", "register_experts"]

_GLUS = ("silu", "clamped_swiglu")
_ROUTES = ("auto", "decode", "fused", "tiled")  # Model.moe_experts' grouped GEMM routes


def upload_layout(runtime: metrale.Model, host: Any, allow_unverified: bool) -> str:
    """The layout a checkpoint's weights are uploaded in: "auto", but "decode" for INT4 weights on
    a GPU backend opted in to kernels no device run has verified. CUDA reads INT4 only in the INT4
    decode layout, whose kernels are unverified, so "auto" leaves INT4 in the source layout there,
    which every plan on CUDA refuses."""
    if allow_unverified and runtime.backend != "cpu" and str(host.format) == "int4":
        return "decode"
    return "auto"


@dataclass(frozen=True)
class _Experts:
    model: metrale.Model
    gate_up: Any  # metrale.GroupedWeights [E x 2I, H]
    down: Any  # metrale.GroupedWeights [E x H, I]
    glu: str
    alpha: float
    limit: float
    allow_unverified: bool
    route: str


# On the extension module, as metrale.torch's: a reload of this module keeps them. Handles
# start at 2^40, apart from metrale.torch.linear's, so one is never the other's.
_entries: dict[int, _Experts] = _metrale.__dict__.setdefault("_torch_moe_entries", {})
_handles = _metrale.__dict__.setdefault("_torch_moe_handles", itertools.count(1 << 40))
_lock = _metrale.__dict__.setdefault("_torch_moe_lock", threading.Lock())


def register_experts(model: metrale.Model, gate_up: Any, down: Any, glu: str = "silu",
                     alpha: float = 1.702, limit: float = 7.0,
                     allow_unverified: bool = False, route: str = "auto") -> int:
    """The handle of one MoE layer's experts (gate_up and down GroupedWeights on ``model``) for
    torch.ops.metrale.moe_experts: an int, unique in this process. glu and route as
    Model.moe_experts takes them; allow_unverified runs kernels no device run has verified
    (CUDA's, today)."""
    api = "metrale.torch.register_experts"
    if not isinstance(model, metrale.Model):
        raise argument_error(api, f"model: {type(model).__name__} is not a metrale.Model")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, metrale.GroupedWeights):
            raise argument_error(api, f"{name}: {type(w).__name__} is not GroupedWeights "
                                 "(model.upload_grouped_weights)", metrale.DtypeError)
    if glu not in _GLUS:
        raise argument_error(api, f"glu: {glu!r}, expected 'silu' or 'clamped_swiglu'")
    if route not in _ROUTES:
        raise argument_error(api, f"route: {route!r}, expected one of {', '.join(_ROUTES)}")
    if (down.experts, down.n, down.k) != (gate_up.experts, gate_up.k, gate_up.n // 2):
        raise argument_error(api, f"down: {down.experts} experts of {down.n} x {down.k}, "
                             f"expected {gate_up.experts} of {gate_up.k} x {gate_up.n // 2} "
                             f"for gate_up's {gate_up.n} x {gate_up.k}")
    with _lock:
        handle = next(_handles)
        _entries[handle] = _Experts(model, gate_up, down, glu, float(alpha), float(limit),
                                    bool(allow_unverified), route)
    return handle


def unregister_experts(handle: int) -> None:
    """Forgets a handle (a MoeExperts does so when it is collected)."""
    with _lock:
        _entries.pop(handle, None)


def _entry(handle: int) -> _Experts:
    entry = _entries.get(handle)
    if entry is None:
        raise argument_error("metrale.torch.moe_experts", f"experts: {handle} is not a "
                             "registered handle (metrale.torch.register_experts)")
    return entry


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 experts: int) -> torch.Tensor:
    api = "metrale.torch.moe_experts"
    entry = _entry(experts)
    h = entry.gate_up.k
    if x.dtype != torch.bfloat16:
        raise argument_error(api, f"x: dtype {x.dtype}, expected torch.bfloat16",
                             metrale.DtypeError)
    if x.dim() != 2 or x.shape[1] != h:
        raise argument_error(api, f"x: shape {tuple(x.shape)}, expected (tokens, {h})")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise argument_error(api, f"top_k_index: shape {tuple(top_k_index.shape)}, expected "
                             f"({x.shape[0]}, top_k)")
    if top_k_weights.shape != top_k_index.shape:
        raise argument_error(api, f"top_k_weights: shape {tuple(top_k_weights.shape)}, "
                             f"expected {tuple(top_k_index.shape)} as top_k_index")
    if top_k_index.dtype not in (torch.int32, torch.int64) or not top_k_weights.is_floating_point():
        raise argument_error(api, f"top_k_index {top_k_index.dtype}, top_k_weights "
                             f"{top_k_weights.dtype}: expected integer ids and float weights",
                             metrale.DtypeError)
    out = x.new_empty(x.shape)  # contiguous whatever x's strides, as the fake gives it
    if x.shape[0] == 0:
        return out
    # The op takes int32 ids and FP32 weights (the cast of a BF16 weight is exact). An id outside
    # [0, E) contributes nothing; int64 ones past int32 are made -1 first, not wrapped onto one.
    experts_count = entry.gate_up.experts
    ids = torch.where((top_k_index < 0) | (top_k_index >= experts_count),
                      torch.full_like(top_k_index, -1), top_k_index).to(torch.int32).contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    x = x.contiguous()
    if x.data_ptr() % 16 != 0:  # contiguous at an odd offset of its storage: the kernels' 16 bytes
        x = x.clone()
    m = entry.model
    if x.device.type == "cpu":
        m._m.moe_experts(_bits(x), True, ids.numpy(), weights.numpy(), entry.gate_up, entry.down,
                         entry.glu, entry.alpha, entry.limit, _bits(out), True,
                         entry.allow_unverified, entry.route, None)
    else:
        from . import torch as mt

        stream = None
        if mt.cuda_stream() == "torch":
            stream = torch.cuda.current_stream(x.device).cuda_stream
        elif torch.cuda.is_current_stream_capturing():
            raise argument_error(api, "a CUDA graph is capturing, and metrale runs on its own "
                                 "stream and waits for each call; capture needs "
                                 "metrale.torch.cuda_stream(\"torch\")", metrale.CaptureError)
        m.moe_experts(x, ids, weights, entry.gate_up, entry.down, glu=entry.glu,
                      alpha=entry.alpha, limit=entry.limit, out=out,
                      allow_unverified=entry.allow_unverified, route=entry.route, stream=stream)
    return out


moe_experts = torch.library.custom_op("metrale::moe_experts", _moe_experts, mutates_args=())


@moe_experts.register_fake
def _moe_experts_fake(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      experts: int) -> torch.Tensor:
    return x.new_empty(x.shape)


class MoeExperts(torch.nn.Module):
    """An MoE layer's experts on metrale, where transformers has its experts module:
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], the sum
    over each token's experts of weight · down(glu(gate_up(x))). Inputs of any float dtype are
    cast to BF16 and the output cast back. The weights stay in their metrale.Model."""

    def __init__(self, model: metrale.Model, gate_up: Any, down: Any, glu: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0, *,
                 allow_unverified: bool = False, route: str = "auto") -> None:
        super().__init__()
        self.handle = register_experts(model, gate_up, down, glu, alpha, limit, allow_unverified,
                                       route)
        weakref.finalize(self, unregister_experts, self.handle)
        self.num_experts = int(gate_up.experts)
        self.hidden_dim = int(gate_up.k)
        self.intermediate_dim = int(down.k)
        self.format = str(gate_up.format)
        self.glu = glu

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        y = torch.ops.metrale.moe_experts(x.to(torch.bfloat16), top_k_index, top_k_weights,
                                          self.handle)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, format={self.format}, glu={self.glu}")


# transformers' experts modules whose gated activation is not SiLU(gate) · up on [gate | up]:
# gpt-oss's clamped SwiGLU on interleaved columns (GptOssExperts._apply_gate).
_CLAMPED_SWIGLU = ("GptOssExperts",)


def swap_packed_experts(api: str, model: torch.nn.Module, ckpt: Any, packed: list,
                        runtime: metrale.Model, allow_unverified: bool,
                        route: str = "auto") -> None:
    """Replaces each experts module whose projections the checkpoint packs (``packed``:
    Checkpoint.experts) by a MoeExperts on ``runtime``; IoError naming the module for a
    projection the model has no place for or whose shape, bias or activation does not fit."""
    by_module: dict = {}
    for p in packed:
        parent, _, leaf = p["projection"].rpartition(".")
        by_module.setdefault(parent, {})[leaf] = p
    for parent, projections in sorted(by_module.items()):
        if set(projections) != {"gate_up_proj", "down_proj"}:
            raise argument_error(api, f"{parent}: the checkpoint packs {sorted(projections)}, "
                                 "expected gate_up_proj and down_proj", metrale.IoError)
        try:
            old = model.get_submodule(parent)
        except AttributeError:
            raise argument_error(api, f"{parent}: packed experts the model has no module for",
                                 metrale.IoError) from None
        kind = type(old).__name__
        # The packed layout is gpt-oss's, and so is the activation it implies (interleaved gate
        # and up, clamped): another module's packed experts would be read with a rule not its own.
        if kind not in _CLAMPED_SWIGLU:
            raise argument_error(api, f"{parent}: packed experts for a {kind}; metrale reads "
                                 "them for gpt-oss's experts (GptOssExperts) only",
                                 metrale.IoError)
        glu = "clamped_swiglu"
        weights = {}
        for leaf, p in projections.items():
            param = getattr(old, leaf, None)
            e, n, k = p["experts"], p["n"], p["k"]
            # GptOssExperts holds each projection transposed, [E, K, N] (x @ W).
            if param is None or tuple(param.shape) != (e, k, n):
                shape = None if param is None else tuple(param.shape)
                raise argument_error(api, f"{p['projection']}: the checkpoint holds {e} experts "
                                     f"of {n} x {k}, the model's {kind} has {shape}",
                                     metrale.IoError)
            has_bias = getattr(old, leaf + "_bias", None) is not None
            if has_bias != p["bias"]:
                what = "not in the checkpoint" if has_bias else "in the checkpoint, but the " \
                    "model's experts have none"
                raise argument_error(api, f"{p['projection']}_bias: {what}", metrale.IoError)
            hosts, bias = ckpt.expert_weights(p["projection"])
            if bias is not None:
                bias = bias.view(ml_dtypes.bfloat16)
            weights[leaf] = runtime.upload_grouped_weights(
                hosts, bias=bias, label=p["projection"],
                layout=upload_layout(runtime, hosts[0], allow_unverified))
        alpha = float(getattr(old, "alpha", 1.702))
        limit = float(getattr(old, "limit", 7.0))
        new = MoeExperts(runtime, weights["gate_up_proj"], weights["down_proj"], glu, alpha,
                         limit, allow_unverified=allow_unverified, route=route)
        model.set_submodule(parent, new)


_ROLES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Naming:
    """How transformers maps a checkpoint's names onto its model (its conversion mapping for the
    model, transformers/conversion_mapping.py): ``rename`` applies its WeightRenamings to a tensor
    name (Mixtral: ".block_sparse_moe." -> ".mlp."), and ``leaves`` names each expert linear's
    role by the leaf its WeightConverters read into the fused experts (Mixtral's w1, w3, w2 into
    gate_up_proj = [gate; up] and down_proj; "gate_proj", "up_proj", "down_proj" where none)."""
    renamings: tuple = ()
    leaves: tuple = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"),
                     ("down_proj", "down_proj"))

    def rename(self, name: str) -> str:
        if not self.renamings:
            return name
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(name, list(self.renamings), [])[0]

    def layer(self, layer: str) -> str:
        """A checkpoint's linear layer name as the model's module path."""
        return self.rename(layer + ".weight")[: -len(".weight")]

    def role(self, leaf: str) -> str | None:
        return dict(self.leaves).get(leaf)


def naming(model: torch.nn.Module) -> Naming:
    """transformers' own renaming of checkpoint names for ``model`` (Naming)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    renamings = tuple(t for t in transforms if isinstance(t, WeightRenaming))
    leaves = dict(Naming.leaves)
    for t in transforms:
        if not isinstance(t, WeightConverter) or len(t.target_patterns) != 1:
            continue
        # ".experts.*.w1.weight" reads leaf "w1"; gate_up_proj concatenates its sources in order.
        target = t.target_patterns[0]
        sources = [p.split(".")[-2] for p in t.source_patterns if re.search(
            r"experts\.\*\.\w+\.weight$", p)]
        if target.endswith("experts.gate_up_proj") and len(sources) == 2:
            leaves.pop("gate_proj", None), leaves.pop("up_proj", None)
            leaves[sources[0]], leaves[sources[1]] = "gate_proj", "up_proj"
        elif target.endswith("experts.down_proj") and len(sources) == 1:
            leaves.pop("down_proj", None)
            leaves[sources[0]] = "down_proj"
    return Naming(renamings, tuple(leaves.items()))


_EXPERT_LINEAR = re.compile(r"^(?P<parent>.+)\.(?P<expert>\d+)\.(?P<leaf>\w+)$")


def _fused_experts(model: torch.nn.Module, parent: str) -> Any:
    """The module at ``parent`` when it is an experts module with fused parameters (transformers
    5's Qwen3MoeExperts and kin: gate_up_proj [E, 2I, H], down_proj [E, H, I]), else None."""
    try:
        module = model.get_submodule(parent)
    except AttributeError:
        return None
    fused = all(isinstance(getattr(module, p, None), torch.nn.Parameter)
                for p in ("gate_up_proj", "down_proj"))
    return module if fused else None


def _fp8_gate_up(api: str, ckpt: Any, gate: str, up: str) -> tuple:
    """One expert's FP8 gate_proj and up_proj as one gate_up: codes and 128 x 128 block scales
    stacked [gate; up], which needs gate's rows to end on a block (N a multiple of 128)."""
    (gc, gs), (uc, us) = ckpt.fp8_weights(gate), ckpt.fp8_weights(up)
    if gc.shape[0] % 128 != 0 or gc.shape[1] != uc.shape[1]:
        raise argument_error(api, f"{gate} ({gc.shape[0]} x {gc.shape[1]}) and {up} ({uc.shape[0]}"
                             f" x {uc.shape[1]}): FP8 gate and up stack into one gate_up only "
                             "with one K and gate's rows a multiple of 128 (its block scales' "
                             "rows)", metrale.IoError)
    return np.concatenate([gc, uc]), np.concatenate([gs, us])


def swap_expert_linears(api: str, model: torch.nn.Module, ckpt: Any, layers: list,
                        runtime: metrale.Model, allow_unverified: bool,
                        route: str = "auto", names: Naming = Naming()) -> set:
    """Replaces each fused experts module whose experts the checkpoint stores as linears of their
    own ("<experts>.<e>.gate_proj" / up_proj / down_proj: Qwen3-MoE and DeepSeek-V3 as ModelOpt,
    llm-compressor, transformers' FP8, GPTQ and AWQ write them; "<e>.w1" / w3 / w2 under
    "block_sparse_moe" in Mixtral's, as ``names`` reads them) by a MoeExperts on ``runtime``, each
    expert's gate and up stacked into its gate_up: 4-bit experts on the grouped GEMM, FP8
    block-128 ones on the grouped W8A8 op (activations cast to E4M3 per row per 128 K, as the
    checkpoint's dynamic scheme casts them). Returns the layers it took; IoError naming the module
    or expert for a missing projection, shapes that do not fit, experts of two formats, or gate
    and up that cannot be stacked."""
    fp8_layers = set(ckpt.fp8_layers)
    by_module: dict = {}
    for layer in layers:
        m = _EXPERT_LINEAR.match(names.layer(layer))
        role = names.role(m["leaf"]) if m else None
        if role and _fused_experts(model, m["parent"]) is not None:
            by_module.setdefault(m["parent"], {})[(int(m["expert"]), role)] = layer
    taken = set()
    for parent, found in sorted(by_module.items()):
        old = _fused_experts(model, parent)
        kind = type(old).__name__
        count, width, hidden = (int(d) for d in old.gate_up_proj.shape)
        # Missing linears by their names in the checkpoint (Mixtral's "block_sparse_moe...w3").
        leaf = {role: leaf for leaf, role in names.leaves}
        stored = next(iter(found.values())).rsplit(".", 2)[0]
        missing = [f"{stored}.{e}.{leaf[p]}" for e in range(count) for p in _ROLES
                   if (e, p) not in found]
        extra = sorted(layer for (e, _), layer in found.items() if e >= count)
        if missing or extra:
            raise argument_error(api, f"{parent} ({kind}, {count} experts): " + "; ".join(
                part for part in (("not in the checkpoint: " + ", ".join(missing[:8]) +
                                   (" ..." if len(missing) > 8 else "")) if missing else "",
                                  ("experts past its count: " + ", ".join(extra[:8]))
                                  if extra else "") if part), metrale.IoError)
        fp8 = {layer in fp8_layers for layer in found.values()}
        if len(fp8) > 1:
            raise argument_error(api, f"{parent}: experts of two formats (FP8 block-128 and "
                                 "4-bit); one grouped GEMM runs one format", metrale.IoError)
        fp8 = fp8.pop()
        # What transformers says of the module's layout (use_experts_implementation): stacked
        # gate and up are [gate; up] rows, read as x · Wᵀ, without biases, and the decorator's
        # default gate, act_fn(gate) · up, with SiLU. A class without the decorator's layout, or
        # with a gate of its own (DeepSeek-V4's and Step-3.7's clamp gate and up), computes
        # something else: refused, never run as plain SiLU(gate) · up.
        layout = {"is_concatenated": True, "is_transposed": False, "has_bias": False,
                  "has_gate": True}
        differs = [f"{a}={getattr(old, a, 'unset')}" for a, want in layout.items()
                   if getattr(old, a, None) != want]
        if type(getattr(old, "act_fn", None)).__name__ != "SiLUActivation":
            differs.append("its act_fn")
        if getattr(type(old), "_apply_gate", None) is not _default_apply_gate():
            differs.append("its _apply_gate")
        if differs:
            raise argument_error(api, f"{parent}: a {kind} ({', '.join(differs)}) is not "
                                 "SiLU(gate) · up on [gate; up] rows without biases, the "
                                 "experts metrale builds from linears of their own",
                                 metrale.IoError)
        want = {leaf: tuple(int(d) for d in getattr(old, leaf).shape)
                for leaf in ("gate_up_proj", "down_proj")}
        uploaded = (_upload_fp8_experts(api, ckpt, parent, kind, count, found, want, runtime)
                    if fp8 else _upload_experts(api, ckpt, parent, kind, count, found, want,
                                                runtime, allow_unverified))
        new = MoeExperts(runtime, *uploaded, allow_unverified=allow_unverified, route=route)
        model.set_submodule(parent, new)
        taken.update(found.values())
    return taken


def _default_apply_gate() -> Any:
    """transformers' default gate of a decorated experts class: act_fn(gate) · up (None for a
    transformers without the experts decorator, whose classes the layout check refuses)."""
    try:
        from transformers.integrations import moe as tf_moe
    except ImportError:
        return None
    return getattr(tf_moe, "_default_apply_gate", None)


def _check_expert_shape(api: str, parent: str, kind: str, e: int, leaf: str, shape: tuple,
                        want: tuple) -> None:
    if shape != want[1:]:
        what = "gate_proj and up_proj" if leaf == "gate_up_proj" else "down_proj"
        raise argument_error(api, f"{parent}.{e}: its {what} give {shape[0]} x {shape[1]}, the "
                             f"model's {kind}.{leaf} is {want}", metrale.IoError)


def _upload_experts(api: str, ckpt: Any, parent: str, kind: str, count: int, found: dict,
                    want: dict, runtime: metrale.Model, allow_unverified: bool) -> list:
    """4-bit experts as GroupedWeights (gate_up, down), in upload_layout's layout. INT4 act order
    (GPTQ desc_act): gate_up keeps its own, which the MoE call gathers x in; down's is folded
    into gate_up's rows (Note [Experts' act order])."""
    gate_up, down = [], []
    for e in range(count):
        parts = [ckpt.weights(found[(e, p)]) for p in _ROLES]
        down_part = parts.pop()
        if down_part.k_perm is not None:
            # down reads its input in its stored K order: the activation's element j is then
            # row order[j] of gate and of up.
            order = down_part.k_perm.reshape(-1)
            parts = [metrale.take_rows(p, order) for p in parts]
            down_part = metrale.in_stored_order(down_part)
        try:
            gate_up.append(metrale.stack_rows(parts))
        except metrale.Error as err:
            raise argument_error(api, f"{parent}.{e}: its gate_proj and up_proj cannot be "
                                 f"one gate_up ({err})", metrale.IoError) from None
        down.append(down_part)
    for leaf, hosts in (("gate_up_proj", gate_up), ("down_proj", down)):
        for e, h in enumerate(hosts):
            _check_expert_shape(api, parent, kind, e, leaf, (h.n, h.k), want[leaf])
    try:
        return [runtime.upload_grouped_weights(
                    hosts, label=f"{parent}.{leaf}",
                    layout=upload_layout(runtime, hosts[0], allow_unverified))
                for leaf, hosts in (("gate_up_proj", gate_up), ("down_proj", down))]
    except metrale.InvalidArgumentError as err:
        raise argument_error(api, f"{parent}: its experts cannot be one grouped weights "
                             f"({err})", metrale.IoError) from None


def _upload_fp8_experts(api: str, ckpt: Any, parent: str, kind: str, count: int, found: dict,
                        want: dict, runtime: metrale.Model) -> list:
    """FP8 block-128 experts as GroupedWeights for the grouped W8A8 op (gate_up, down)."""
    out = []
    for leaf in ("gate_up_proj", "down_proj"):
        codes, scales = [], []
        for e in range(count):
            c, s = (_fp8_gate_up(api, ckpt, found[(e, "gate_proj")], found[(e, "up_proj")])
                    if leaf == "gate_up_proj" else ckpt.fp8_weights(found[(e, "down_proj")]))
            _check_expert_shape(api, parent, kind, e, leaf, tuple(c.shape), want[leaf])
            codes.append(c)
            scales.append(s)
        try:
            out.append(runtime.upload_grouped_fp8_weights(np.stack(codes), np.stack(scales),
                                                          label=f"{parent}.{leaf}"))
        except metrale.InvalidArgumentError as err:
            raise argument_error(api, f"{parent}: its FP8 experts cannot be one grouped weights "
                                 f"({err})", metrale.IoError) from None
    return out
