"""Per-call cost of the Python API on the CPU backend, side by side in one run (docs/PERF.md).

A 64 x 64 NVFP4 layer at M = 1, so the kernel's own work is small and the figures are the
binding's: argument checks, the borrow and give-back of each array, the plan, the launch and
the wait. numpy.matmul of the same float32 shapes and a bare extension call stand beside them
as floors. Where torch is installed, metrale.torch's op and Linear (eager and compiled) and
torch's own BF16 linear of the same shapes follow. Run: build/venv/bin/python
bench/python_calls.py
"""

import timeit

import ml_dtypes
import numpy as np

import metrale


def main() -> None:
    rng = np.random.default_rng(0)
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 64)).astype(np.float32))
    a = rng.standard_normal((1, 64)).astype(ml_dtypes.bfloat16)
    a32, w32 = a.astype(np.float32), host.dequantize().T.copy()
    out = np.empty((1, 64), ml_dtypes.bfloat16)
    with metrale.Model("cpu") as model:
        w = model.upload_weights(host)
        cases = {
            "model.gemm(a, w, out=out)": lambda: model.gemm(a, w, out=out),
            "model.gemm(a, w) (new Array)": lambda: model.gemm(a, w),
            "model.plan(1, w)": lambda: model.plan(1, w),
            "numpy.matmul, float32 (floor)": lambda: np.matmul(a32, w32),
            "model.stats() (a bare extension call)": lambda: model.stats(),
        }
        cases.update(torch_cases(model, w, host))
        for name, call in cases.items():
            n = 20000
            best = min(timeit.repeat(call, number=n, repeat=5)) / n
            print(f"{name:40s} {best * 1e6:8.2f} us")


def torch_cases(model, w, host) -> dict:
    try:
        import torch

        import metrale.torch as mt
    except ImportError:
        print("(torch is not installed: the metrale.torch rows are left out)")
        return {}
    x = torch.randn(1, 64).to(torch.bfloat16)
    layer = mt.Linear(model, w)
    compiled = torch.compile(layer, fullgraph=True)
    w16 = torch.from_numpy(host.dequantize().astype(np.float32)).to(torch.bfloat16)
    with torch.no_grad():
        compiled(x)  # compiled once, outside the timing
    return {
        "torch.ops.metrale.linear(x, handle)": lambda: torch.ops.metrale.linear(x, layer.handle),
        "metrale.torch.Linear(x)": lambda: layer(x),
        "torch.compile(Linear)(x)": lambda: compiled(x),
        "torch F.linear, BF16 (torch's own)": lambda: torch.nn.functional.linear(x, w16),
    }


if __name__ == "__main__":
    main()
