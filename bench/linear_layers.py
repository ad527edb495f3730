"""Llama-3-8B's linear shapes through metrale.torch.Linear (NVFP4) beside torch's BF16 linear on
the same weights, side by side in one process: medians of 7 calls after 2, each pair timed twice
in turn. docs/PERF.md ("Prefill per layer") records a run.

    python bench/linear_layers.py [--m 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import metrale
import metrale.torch as mt

SHAPES = {"q, o": (4096, 4096), "k, v": (1024, 4096), "gate, up": (14336, 4096),
          "down": (4096, 14336)}


def median_seconds(f, n: int = 7) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=128, help="rows of the activations (128)")
    p.add_argument("--threads", type=int, default=2, help="torch's threads (2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng()
    print(f"M = {args.m}, {args.threads} torch threads; ms (two turns each), torch / metrale")
    with metrale.Model("cpu") as model, torch.no_grad():
        for name, (n, k) in SHAPES.items():
            dense = torch.nn.Linear(k, n, bias=False)
            dense.weight.data = torch.from_numpy(
                rng.standard_normal((n, k)).astype(np.float32) * 0.02)
            ours = mt.Linear.from_linear(dense, model)
            w = dense.weight.data.bfloat16()
            x = torch.randn(args.m, k).bfloat16()
            turns = [(median_seconds(lambda: ours(x)),
                      median_seconds(lambda: torch.nn.functional.linear(x, w))) for _ in range(2)]
            ms = ", ".join(f"{a * 1e3:.2f} / {b * 1e3:.2f}" for a, b in turns)
            ratio = ", ".join(f"{b / a:.2f}" for a, b in turns)
            print(f"{name:9s} {n:5d} x {k:5d}: metrale / torch {ms} ms; {ratio}")


if __name__ == "__main__":
    main()
