"""python -m metrale bench-model: a whole model's prefill and decode tokens/s through
metrale.torch against the same model in torch BF16, side by side in one run.

    python -m metrale bench-model DIR                   # a checkpoint folder (from_pretrained)
    python -m metrale bench-model --shape llama3-8b     # Llama-3-8B's layers, random weights

Both models are transformers' own; they differ only in their linears: metrale's quantized ones,
or torch's BF16 ones holding the same weights dequantized. Each repeat times metrale, then torch,
then torch, then metrale (so drift hits both alike), and the median of each is reported with the
share of metrale's time spent inside its GEMMs. Exit codes: 0, 2 for bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

# Llama-3-8B's layer shapes, with a small vocabulary so that the layers are what is timed.
SHAPES = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      vocab_size=256, max_position_embeddings=4096),
}


def parse(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="metrale bench-model", description=__doc__.split("\n")[0])
    p.add_argument("folder", nargs="?", help="a checkpoint folder metrale.torch.from_pretrained "
                   "reads")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a model of these layer shapes with "
                   "random weights instead of a folder")
    p.add_argument("--layers", type=int, default=1, help="layers of a --shape model (1)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"],
                   help="how a --shape model's linears are quantized (nvfp4)")
    p.add_argument("--prompt", type=int, default=128, help="prefill tokens (128)")
    p.add_argument("--decode", type=int, default=32, help="decode steps timed (32)")
    p.add_argument("--repeat", type=int, default=3, help="repeats of each timing (3)")
    p.add_argument("--pool", choices=["shared", "own"], default="shared",
                   help="metrale's CPU kernels on torch's intra-op threads (shared, the default) "
                        "or on metrale's own pool (own)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args(argv)
    if (args.folder is None) == (args.shape is None):
        p.error("give a checkpoint folder or --shape, not both")
    for name in ("layers", "prompt", "decode", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: {getattr(args, name)}, expected at least 1")
    return args


def models(args: argparse.Namespace, runtime: Any) -> tuple:
    """(metrale's model, torch's BF16 model, a one-line description)."""
    import copy

    import torch
    import transformers

    import metrale.torch as mt

    if args.shape:
        config = transformers.AutoConfig.for_model(**SHAPES[args.shape],
                                                   num_hidden_layers=args.layers)
        torch.manual_seed(0)
        theirs = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        ours = copy.deepcopy(theirs)
        swapped = mt.swap_linears(ours, runtime, args.format)
        what = f"--shape {args.shape}, {args.layers} layer(s), {swapped} linears {args.format}"
        return ours.eval(), theirs.eval(), what
    ours = mt.from_pretrained(args.folder, backend="cpu")
    runtime.close()  # from_pretrained brought its own
    theirs = _torch_twin(args.folder, ours)
    swapped = sum(isinstance(m, mt.Linear) for m in ours.modules())
    what = f"{args.folder}: {type(ours).__name__}, {ours.config.num_hidden_layers} layer(s), " \
        f"{swapped} linears on metrale"
    return ours, theirs, what


def _torch_twin(folder: str, ours: Any) -> Any:
    """The same model with torch BF16 linears holding metrale's weights dequantized."""
    import copy

    import torch

    import metrale
    import metrale.torch as mt

    ckpt = metrale.load_safetensors(folder)
    runtime = ours.__dict__.pop("metrale")  # the copy shares nothing of metrale's
    try:
        theirs = copy.deepcopy(ours)
    finally:
        ours.metrale = runtime
    for layer, old in list(theirs.named_modules()):
        if not isinstance(old, mt.Linear):
            continue
        w = _dequantized(ckpt, layer).to(torch.bfloat16)
        new = torch.nn.Linear(w.shape[1], w.shape[0], bias=old.bias is not None,
                              dtype=torch.bfloat16)
        with torch.no_grad():
            new.weight.copy_(w)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        parent, _, name = layer.rpartition(".")
        setattr(theirs.get_submodule(parent), name, new)
    return theirs.eval()


def _dequantized(ckpt: Any, layer: str) -> Any:
    """A layer's weights as float32: FP4 by the loader, FP8 as code times block scale."""
    import torch

    if layer not in ckpt.fp8_layers:
        return torch.from_numpy(ckpt.weights(layer).dequantize())
    codes, scales = ckpt.fp8_weights(layer)
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    full = torch.from_numpy(scales).repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w * full[: w.shape[0], : w.shape[1]]


def prefill_seconds(model: Any, ids: Any) -> float:
    """Seconds for one forward over the prompt, without the KV cache; metrale's GEMMs inside it
    are counted by an open metrale.torch.timing block."""
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        model(ids, use_cache=False)
        return time.perf_counter() - start


def decode_seconds(model: Any, ids: Any, steps: int) -> float:
    """Seconds for `steps` greedy tokens after the prompt, one token a step with the KV cache;
    the prompt's forward runs outside any timing block (it is not a decode step)."""
    import torch

    import metrale.torch as mt

    with torch.no_grad():
        with mt.timing():  # an inner block: the prompt's GEMMs do not reach the caller's
            out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - start


def side_by_side(repeat: int, ours: Callable[[], float], theirs: Callable[[], float]) -> tuple:
    """Medians of ours() and theirs(), timed ours, theirs, theirs, ours per repeat, after one
    warm-up call of each; with the share of ours' time inside metrale's GEMMs."""
    import metrale.torch as mt

    ours(), theirs()
    a, b, share = [], [], []
    for _ in range(repeat):
        for which in (0, 1, 1, 0):
            if which:
                b.append(theirs())
                continue
            with mt.timing() as t:
                seconds = ours()
            a.append(seconds)
            share.append(t["seconds"] / seconds)
    return statistics.median(a), statistics.median(b), statistics.median(share)


def run(args: argparse.Namespace) -> dict:
    import torch

    import metrale

    import metrale.torch as mt

    shared = mt.share_threads(args.pool == "shared")
    runtime = metrale.Model("cpu")
    ours, theirs, what = models(args, runtime)
    try:
        vocab = ours.config.vocab_size
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (1, args.prompt), generator=g)
        pre = side_by_side(args.repeat, lambda: prefill_seconds(ours, ids),
                           lambda: prefill_seconds(theirs, ids))
        dec = side_by_side(args.repeat, lambda: decode_seconds(ours, ids, args.decode),
                           lambda: decode_seconds(theirs, ids, args.decode))
    finally:
        (getattr(ours, "metrale", None) or runtime).close(check=False)
    return {
        "model": what,
        "threads": {"torch": torch.get_num_threads(),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
                    "metrale": "torch's intra-op threads" if shared else "its own pool" + (
                        "" if mt.native()[0] else f" ({mt.native()[1]})")},
        "prefill": _row(args.prompt, pre),
        "decode": _row(args.decode, dec),
    }


def _row(tokens: int, timed: tuple) -> dict:
    ours, theirs, share = timed
    return {"tokens": tokens, "metrale_tok_s": tokens / ours, "torch_tok_s": tokens / theirs,
            "ratio": theirs / ours, "gemm_share": share}


def print_table(result: dict) -> None:
    print(f"model: {result['model']}")
    t = result["threads"]
    print(f"torch threads {t['torch']}, OMP_WAIT_POLICY {t['OMP_WAIT_POLICY']}, metrale's "
          f"kernels on {t['metrale']}; medians of side-by-side runs")
    print(f"{'':18s} {'metrale tok/s':>14s} {'torch BF16 tok/s':>17s} {'metrale/torch':>14s} "
          f"{'in metrale GEMMs':>17s}")
    for name in ("prefill", "decode"):
        r = result[name]
        label = f"{name} ({r['tokens']} tok)"
        print(f"{label:18s} {r['metrale_tok_s']:14.1f} {r['torch_tok_s']:17.1f} "
              f"{r['ratio']:13.2f}x {r['gemm_share'] * 100:16.0f}%")


def main(argv: Optional[list] = None) -> int:
    import metrale

    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        result = run(args)
    except ImportError as e:
        print(f"metrale bench-model: needs torch and transformers ({e})", file=sys.stderr)
        return 2
    except (metrale.Error, OSError, ValueError) as e:  # a folder metrale or transformers refuse
        print(f"metrale bench-model: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0
