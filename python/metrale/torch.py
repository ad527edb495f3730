"""metrale for PyTorch: metrale's GEMMs as torch custom ops, a Linear module, and transformers
models whose quantized linears run on metrale.

    import metrale.torch as mt
    model = mt.from_pretrained("path/to/checkpoint")   # a transformers model
    logits = model(input_ids).logits
    model.metrale.close()                              # the quantized weights' memory, to 0 bytes

The op ``torch.ops.metrale.linear(x, weights, bias)`` is registered through ``torch.library``
with a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces a model that
calls it without a graph break. ``weights`` is the handle ``register`` returns for weights on a
metrale.Model: an int, so the compiled graph holds it as a constant (Note [torch op handles] in
docs/NOTES.md).

Who owns what: quantized weights live in the metrale.Model they were uploaded to (its ledger
counts them) until that model closes; a Linear only names them, and calling it after the model
closed raises metrale.StateError. Biases and every other parameter are torch tensors, owned by
torch. Activations and outputs are torch tensors; metrale borrows them for the call alone.

Where a CUDA call runs: ``cuda_stream()`` is "own" by default (metrale's stream, each call waited
for: what a GPU run verified) or "torch" (torch's current stream, nothing waited for, capturable
by torch.cuda.graph after one call outside the capture). Note [foreign streams] in docs/NOTES.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

import metrale

from . import _metrale, torch_moe, torch_native
from .errors import argument_error
from .folder import FOUR_BIT_SOURCES, ROUTER_LEAVES

from .torch_moe import MoeExperts, moe_experts, register_experts  # noqa: E402,F401

__all__ = ["Linear", "MoeExperts", "cuda_stream", "from_pretrained", "linear", "moe_experts",
           "native", "register", "register_experts", "share_threads", "swap_linears", "timing"]


@dataclass(frozen=True)
class _Entry:
    model: metrale.Model
    weights: Any  # metrale.Weights or metrale.Fp8Weights
    allow_e4m3: bool


# The handles' table, counter and lock live on the extension module, which importlib.reload of
# this module leaves as it is: fresh ones handed out handles that modules made before the reload
# still held (they ran the new layers' weights), and dropped the old entries' weights while the
# C++ operator still pointed at them.
_entries: dict[int, _Entry] = _metrale.__dict__.setdefault("_torch_linear_entries", {})
_handles = _metrale.__dict__.setdefault("_torch_linear_handles", itertools.count(1))
_lock = _metrale.__dict__.setdefault("_torch_linear_lock", threading.Lock())
# Open timing() blocks, innermost last: the {"seconds", "calls"} each yielded, which the Python
# operator adds its calls to (the C++ operator's are added when a block ends: _frames).
_timing: list = []


def register(model: metrale.Model, weights: Any, allow_e4m3: bool = False) -> int:
    """The handle of ``weights`` (on ``model``) for torch.ops.metrale.linear: an int, unique in
    this process. FP8 weights run the W8A8 op, which casts activations to E4M3: they need
    ``allow_e4m3=True``, as Model.gemm does."""
    if not isinstance(model, metrale.Model):
        raise argument_error("metrale.torch.register",
                             f"model: {type(model).__name__} is not a metrale.Model")
    if not isinstance(weights, (metrale.Weights, metrale.Fp8Weights)):
        raise argument_error("metrale.torch.register", f"weights: {type(weights).__name__} is "
                             "not weights on a device (model.upload_weights)", metrale.DtypeError)
    fp8 = isinstance(weights, metrale.Fp8Weights)
    if fp8 and not allow_e4m3:
        raise argument_error("metrale.torch.register", "weights: FP8 weights run the W8A8 op, "
                             "which casts activations to E4M3; pass allow_e4m3=True")
    with _lock:
        handle = next(_handles)
        # The C++ operator runs CPU models' calls itself; CUDA ones come to Python. Bound
        # first, so a refused bind leaves no entry holding the model.
        if _native is not None and model.backend == "cpu":
            torch_native.bind(_native, handle, model, weights, fp8)
        _entries[handle] = _Entry(model, weights, bool(allow_e4m3))
    return handle


def unregister(handle: int) -> None:
    """Forgets a handle (a Linear does so when it is collected); the weights stay with their
    model until it closes."""
    with _lock:
        if _native is not None:
            _native.metrale_torch_unbind(handle)
        _entries.pop(handle, None)


def _entry(api: str, handle: int) -> _Entry:
    entry = _entries.get(handle)
    if entry is None:
        raise argument_error(api, f"weights: {handle} is not a registered handle "
                             "(metrale.torch.register)")
    return entry


def _linear_python(x: torch.Tensor, weights: int,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.ops.metrale.linear in Python: what the C++ operator runs where it cannot be built,
    on CUDA, and for every call it does not run itself (a bad argument: the error is raised
    here, so both builds fail alike)."""
    api = "metrale.torch.linear"
    entry = _entry(api, weights)
    w = entry.weights
    if x.dtype != torch.bfloat16:
        raise argument_error(api, f"x: dtype {x.dtype}, expected torch.bfloat16",
                             metrale.DtypeError)
    if x.dim() < 1 or x.shape[-1] != w.k:
        raise argument_error(api, f"x: shape {tuple(x.shape)}, expected (..., {w.k})")
    if bias is not None and bias.dtype != torch.bfloat16:
        raise argument_error(api, f"bias: dtype {bias.dtype}, expected torch.bfloat16",
                             metrale.DtypeError)
    rows = x.numel() // w.k
    out = torch.empty((rows, w.n), dtype=torch.bfloat16, device=x.device)
    if rows > 0:
        x2 = x.reshape(rows, w.k).contiguous()
        if x2.data_ptr() % 16:  # contiguous at an offset: as the C++ operator, take a copy
            x2 = x2.clone()
        start = time.perf_counter() if _timing else 0.0
        if x.device.type == "cpu":
            _run_on_host(entry, x2, out, bias)
        elif _cuda_stream == "torch":
            stream = torch.cuda.current_stream(x.device).cuda_stream
            entry.model.gemm(x2, w, out=out, bias=bias, allow_e4m3=entry.allow_e4m3,
                             stream=stream)
        else:
            if torch.cuda.is_current_stream_capturing():
                raise argument_error(api, "a CUDA graph is capturing, and metrale runs on its "
                                     "own stream and waits for each call; capture needs "
                                     "metrale.torch.cuda_stream(\"torch\") (or "
                                     "METRALE_TORCH_STREAM=torch)", metrale.CaptureError)
            entry.model.gemm(x2, w, out=out, bias=bias, allow_e4m3=entry.allow_e4m3)
        if _timing:
            _timing[-1]["seconds"] += time.perf_counter() - start
            _timing[-1]["calls"] += 1
    return out.reshape(*x.shape[:-1], w.n)


def _linear_fake(x: torch.Tensor, weights: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    w = _entry("metrale.torch.linear", weights).weights
    return x.new_empty((*x.shape[:-1], w.n))


# The operator: C++ where it can be built (torch_native.py), else a Python custom op. Either way
# torch.ops.metrale.linear(x, weights, bias) with this fake implementation, and CUDA tensors run
# in Python.
_native = torch_native.load(_linear_python)
if _native is not None:
    torch.library.register_fake("metrale::linear", _linear_fake)
    _cuda = torch.library.Library("metrale", "IMPL")
    _cuda.impl("linear", _linear_python, "CUDA")
    linear = torch.ops.metrale.linear
else:
    linear = torch.library.custom_op("metrale::linear", _linear_python, mutates_args=())
    linear.register_fake(_linear_fake)


_STREAM_MODES = ("own", "torch")


def _stream_mode_from_env() -> str:
    mode = os.environ.get("METRALE_TORCH_STREAM", "") or "own"
    if mode not in _STREAM_MODES:
        import warnings

        warnings.warn(f"METRALE_TORCH_STREAM={mode!r} is neither 'own' nor 'torch'; 'own' is "
                      "used", stacklevel=2)
        return "own"
    return mode


# Where the op runs a CUDA call (Note [foreign streams] in docs/NOTES.md): "own", metrale's stream,
# waited for before the op returns (what a GPU run has verified, so the default), or "torch",
# torch's current stream, in order with torch's work, nothing waited for, capturable in a CUDA
# graph (checked on the fake driver; the default once a device run verifies it).
_cuda_stream = _stream_mode_from_env()


def cuda_stream(mode: Optional[str] = None) -> str:
    """Where torch.ops.metrale.linear runs CUDA calls: "own" (metrale's stream, each call waited
    for) or "torch" (torch's current stream, nothing waited for, capturable by
    torch.cuda.graph). Sets it when ``mode`` is given (the start value comes from
    METRALE_TORCH_STREAM); returns the mode now."""
    global _cuda_stream
    if mode is not None:
        if mode not in _STREAM_MODES:
            raise argument_error("metrale.torch.cuda_stream",
                                 f"mode: {mode!r}, expected 'own' or 'torch'")
        _cuda_stream = mode
    return _cuda_stream


def native() -> tuple:
    """(True, "") when torch.ops.metrale.linear is the C++ operator, else (False, why not)."""
    return (_native is not None, torch_native.why)


def share_threads(on: bool = True) -> bool:
    """Whether the C++ operator runs metrale's CPU kernels on torch's intra-op threads (the
    default: one pool for both, Note [one pool with torch]) or on metrale's own pool. Returns
    whether they are shared now: never without the C++ operator."""
    if _native is None:
        return False
    _native.metrale_torch_share_threads(int(bool(on)))
    return bool(on)


@contextlib.contextmanager
def timing():
    """Counts the seconds and calls metrale's GEMMs take inside the block (eager calls of the op,
    in this process): yields a dict {"seconds", "calls"}, complete when the block ends. A block
    opened inside another counts its calls for itself alone."""
    block = {"seconds": 0.0, "calls": 0}
    # The C++ operator counts in two process-wide sums while any block is open: a block takes
    # their growth over its life, less what the blocks inside it took.
    frame = {"block": block, "start": _native_timed(), "inner": [0.0, 0]}
    _timing.append(block)
    _frames.append(frame)
    if _native is not None:
        _native.metrale_torch_timing(1)
    try:
        yield block
    finally:
        _timing.pop()
        _frames.pop()
        now = _native_timed()
        took = (now[0] - frame["start"][0], now[1] - frame["start"][1])
        block["seconds"] += took[0] - frame["inner"][0]
        block["calls"] += took[1] - frame["inner"][1]
        if _frames:
            _frames[-1]["inner"][0] += took[0]
            _frames[-1]["inner"][1] += took[1]
        elif _native is not None:
            _native.metrale_torch_timing(0)


_frames: list = []


def _native_timed() -> tuple:
    return torch_native.timed(_native) if _native is not None else (0.0, 0)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _run_on_host(entry: _Entry, x: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> None:
    """Model.gemm's call on CPU tensors, handed over as NumPy views of their BF16 bits: a torch
    tensor's DLPack export costs 2 µs apiece (docs/PERF.md, the Python API's per-call cost). The
    extension checks every operand as Model.gemm would have it checked."""
    m, w = entry.model._m, entry.weights
    b = None if bias is None else _bits(bias)
    if isinstance(w, metrale.Fp8Weights):
        m.w8a8_gemm(_bits(x), True, w, _bits(out), True, b, b is not None)
    else:
        m.gemm(_bits(x), True, w, _bits(out), True, "auto", entry.allow_e4m3, b, b is not None)


class Linear(torch.nn.Module):
    """A linear layer whose weights are metrale's: y = x · dequant(W)ᵀ + bias.

    Inputs of any float dtype are cast to BF16 for the GEMM and the output cast back; the
    weights stay in their metrale.Model (see the module's text for who owns what).
    """

    def __init__(self, model: metrale.Model, weights: Any, bias: Optional[torch.Tensor] = None,
                 *, allow_e4m3: bool = False) -> None:
        super().__init__()
        self.handle = register(model, weights, allow_e4m3)
        weakref.finalize(self, unregister, self.handle)
        self.in_features = int(weights.k)
        self.out_features = int(weights.n)
        self.format = str(weights.format)
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise argument_error("metrale.torch.Linear", f"bias: shape {tuple(bias.shape)}, "
                                     f"expected ({self.out_features},)")
            bias = bias.detach().to(torch.bfloat16).contiguous()
            if bias.data_ptr() % 16:  # a view at an offset, which every call would refuse
                bias = bias.clone()
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, layer: torch.nn.Linear, model: metrale.Model,
                    format: str = "nvfp4") -> "Linear":
        """A torch Linear's weights quantized ("nvfp4" or "mxfp4") and uploaded to ``model``."""
        quantize = {"nvfp4": metrale.quantize_nvfp4, "mxfp4": metrale.quantize_mxfp4}.get(format)
        if quantize is None:
            raise argument_error("metrale.torch.Linear.from_linear",
                                 f"format: '{format}', expected nvfp4 or mxfp4")
        host = quantize(layer.weight)
        return cls(model, model.upload_weights(host, label="torch linear"), layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:  # the usual case: no cast, each costs a dispatch
            return torch.ops.metrale.linear(x, self.handle, self.bias)
        y = torch.ops.metrale.linear(x.to(torch.bfloat16), self.handle, self.bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format}")


def swap_linears(module: torch.nn.Module, model: metrale.Model, format: str = "nvfp4",
                 skip: tuple = ("lm_head",)) -> int:
    """Replaces every torch.nn.Linear inside ``module`` (but those named in ``skip``, matched by
    their last name) by a Linear with its weights quantized to ``format`` on ``model``; returns
    how many it replaced. For a BF16 model of one's own; checkpoints: from_pretrained."""
    swapped = 0
    for name, old in list(module.named_modules()):
        if not isinstance(old, torch.nn.Linear) or name.rpartition(".")[2] in skip:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, leaf,
                Linear.from_linear(old, model, format))
        swapped += 1
    return swapped




def from_pretrained(path: str, *, backend: str = "auto", dtype: torch.dtype = torch.bfloat16,
                    allow_unverified: bool = False, moe_route: str = "auto") -> torch.nn.Module:
    """The transformers model of a checkpoint folder, its quantized linears on metrale.

    The model is built by transformers from the folder's config.json; every layer the checkpoint
    holds quantized (ModelOpt NVFP4, compressed-tensors nvfp4/mxfp4-pack-quantized, FP8
    block-128 in the DeepSeek/Qwen, compressed-tensors and ModelOpt layouts) becomes a Linear on
    one metrale.Model (``model.metrale``; close it to release them), and every other tensor is
    loaded by torch as the file holds it (BF16 layers stay BF16, in ``dtype``). FP8 layers run
    the W8A8 op, which casts activations to E4M3 per row per 128 K. A mixture of experts whose
    4-bit experts the checkpoint holds, packed (gpt-oss's MXFP4) or as linears of their own
    (Qwen3-MoE from ModelOpt, llm-compressor, GPTQ or AWQ; Mixtral's w1, w3, w2, named as
    transformers' own conversion mapping names them), gets a MoeExperts module in place of
    transformers' experts: every expert of a layer in one call (on CUDA, kernels no device run
    has verified yet: ``allow_unverified=True`` runs them; ``moe_route`` names the grouped GEMMs'
    route as Model.moe_experts takes it). Never a partial load: a
    tensor that looks quantized but that metrale cannot read, a checkpoint tensor the model has
    no place for, a model parameter the checkpoint does not give, or layers that disagree with
    the quantization the folder's config declares raise IoError naming them.
    """
    import transformers

    api = "metrale.torch.from_pretrained"
    if moe_route not in torch_moe._ROUTES:
        raise argument_error(api, f"moe_route: {moe_route!r}, expected one of "
                             f"{', '.join(torch_moe._ROUTES)}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "is not a folder" if not os.path.isdir(path) else "holds no config.json"
        raise argument_error(api, f"{path}: {what}; give a model folder (config.json and its "
                             "safetensors)", metrale.NotFoundError)
    ckpt = metrale.load_safetensors(path)
    unread = [r for r in ckpt.rejected if r["quantized"]]
    if unread:
        raise argument_error(api, "tensors that look quantized but that metrale cannot read: " +
                             "; ".join(f"{r['tensor']}: {r['why']}" for r in unread),
                             metrale.IoError)
    fp4 = [layer for layer in ckpt.layers if ckpt.source(layer) in FOUR_BIT_SOURCES]
    quantized = fp4 + list(ckpt.fp8_layers)
    packed = list(ckpt.experts)  # MoE projections stored packed (gpt-oss)
    config = transformers.AutoConfig.from_pretrained(path)
    # The checkpoint's quantization is metrale's to read: transformers builds the plain model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # The checkpoint's names as the model's, by transformers' own renaming (Mixtral's
    # block_sparse_moe is the model's mlp); quantized layers keep their names in the checkpoint.
    names = torch_moe.naming(model)
    # What transformers itself leaves unread (_keys_to_ignore_on_load_unexpected): DeepSeek-V3's
    # multi-token-prediction layer 61, which its official checkpoints ship and no model module
    # takes. Left out here too, quantized or not, rather than refused as a layer without a module.
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                       or [])]

    def kept(name: str) -> bool:
        return not any(p.search(name) or p.search(names.rename(name)) for p in ignored)

    fp4 = [layer for layer in fp4 if kept(layer)]
    quantized = [layer for layer in quantized if kept(layer)]
    packed = [p for p in packed if kept(p["projection"])]
    state = {names.rename(k): v for k, v in _read_tensors(
        _tensor_files(ckpt.path), quantized, tuple(p["projection"] + "_" for p in packed),
        kept).items()}
    runtime = metrale.Model(backend)
    try:
        # Experts stored as linears of their own go to the model's fused experts modules.
        experts = torch_moe.swap_expert_linears(api, model, ckpt, quantized, runtime,
                                                allow_unverified, moe_route, names)
        for layer in (layer for layer in fp4 if layer not in experts):
            host = ckpt.weights(layer)
            weights = runtime.upload_weights(
                host, label=layer,
                layout=torch_moe.upload_layout(runtime, host, allow_unverified))
            _swap_linear(api, model, names.layer(layer), weights, state, runtime)
        for layer in (layer for layer in ckpt.fp8_layers if layer not in experts and kept(layer)):
            weights = runtime.upload_fp8_weights(*ckpt.fp8_weights(layer), label=layer)
            _swap_linear(api, model, names.layer(layer), weights, state, runtime)
        torch_moe.swap_packed_experts(api, model, ckpt, packed, runtime, allow_unverified,
                                      moe_route)
        _load_state(api, model, state, dtype)
        # The layers hold what the folder's config declares (metrale.Checkpoint.check_declared):
        # its format in each quantized one, and no Linear left in floats that it quantizes.
        # An MoE block's routers are no skipped Linear (metrale.load's rule: folder.ROUTER_LEAVES).
        blocks = {n.rpartition(".")[0] for n, m in model.named_modules()
                  if isinstance(m, torch_moe.MoeExperts)}
        plain = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and
                       not (n.rpartition(".")[2] in ROUTER_LEAVES and
                            n.rpartition(".")[0] in blocks))
        # A packed projection by its experts module, as metrale.load holds it (folder.py).
        ckpt.check_declared([(layer, ckpt.source(layer)) for layer in quantized] +
                            sorted({(p["projection"].rpartition(".")[0], p["source"])
                                    for p in packed}), plain, api)
    except BaseException:
        runtime.close(check=False)
        raise
    model.metrale = runtime
    return model.eval()


def _swap_linear(api: str, model: torch.nn.Module, layer: str, weights: Any, state: dict,
                 runtime: metrale.Model) -> None:
    """The model's Linear ``layer`` replaced by a metrale Linear of ``weights``, taking its bias
    out of ``state`` (the checkpoint's other tensors, named as the model's)."""
    bias = state.pop(layer + ".bias", None)
    try:
        old = model.get_submodule(layer)
    except AttributeError:
        raise argument_error(api, f"{layer}: a quantized layer the model has no module for",
                             metrale.IoError) from None
    if not isinstance(old, torch.nn.Linear):
        raise argument_error(api, f"{layer}: the model's module is a {type(old).__name__}, not "
                             "a Linear", metrale.IoError)
    if (weights.n, weights.k) != (old.out_features, old.in_features):
        raise argument_error(api, f"{layer}: the checkpoint's weights are {weights.n} x "
                             f"{weights.k}, the model's Linear {old.out_features} x "
                             f"{old.in_features}", metrale.IoError)
    if (old.bias is None) != (bias is None):
        what = "not in the checkpoint" if bias is None else "in the checkpoint, but the " \
            "model's Linear has none"
        raise argument_error(api, f"{layer}.bias: {what}", metrale.IoError)
    new = Linear(runtime, weights, bias, allow_e4m3=isinstance(weights, metrale.Fp8Weights))
    parent, _, name = layer.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)


def _tensor_files(path: str) -> list:
    if not path.endswith(".index.json"):
        return [path]
    with open(path) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(os.path.dirname(path), s) for s in shards]


def _read_tensors(files: list, quantized: list, packed: tuple = (),
                  kept: Any = lambda name: True) -> dict:
    """Every tensor of the files that ``kept`` takes but the quantized layers' own (their bias
    aside) and those of the packed expert projections (names starting with one of ``packed``)."""
    from safetensors import safe_open

    prefixes = tuple(layer + "." for layer in quantized) + packed
    biases = {layer + ".bias" for layer in quantized}
    state = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if kept(name) and (not name.startswith(prefixes) or name in biases):
                    state[name] = st.get_tensor(name)
    return state


def _load_state(api: str, model: torch.nn.Module, state: dict, dtype: torch.dtype) -> None:
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False)
    # A parameter tied to a loaded one (lm_head to embed_tokens) is loaded with it, and a metrale
    # Linear's bias buffer was given it by _swap_linear (Qwen2's q, k and v biases).
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    swapped = {f"{n}.bias" for n, m in model.named_modules()
               if isinstance(m, Linear) and m.bias is not None}
    missing = [k for k in result.missing_keys
               if not (k in params and id(params[k]) in loaded) and k not in swapped]
    parts = []
    if missing:
        parts.append("not in the checkpoint: " + ", ".join(sorted(missing)))
    if result.unexpected_keys:
        parts.append("in the checkpoint but not in the model: " +
                     ", ".join(sorted(result.unexpected_keys)))
    if parts:
        raise argument_error(api, "; ".join(parts), metrale.IoError)
