"""100,000 calls leave the process's memory and the model's ledger where they were."""

from __future__ import annotations

import gc
import os

import ml_dtypes
import numpy as np
import pytest

import metrale

CALLS = int(os.environ.get("METRALE_LEAK_CALLS", "100000"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_many_calls_keep_rss_and_ledger_steady(rng):
    host = metrale.quantize_nvfp4(rng.standard_normal((64, 64)).astype(np.float32))
    a = rng.standard_normal((1, 64)).astype(ml_dtypes.bfloat16)
    with metrale.Model("cpu") as model:
        w = model.upload_weights(host)
        out = np.empty((1, 64), ml_dtypes.bfloat16)

        def burst(n: int) -> None:
            # Both kinds of call: into the caller's out, and into a new Array.
            for i in range(n):
                model.gemm(a, w, out=out) if i % 2 else model.gemm(a, w)
            gc.collect()

        burst(CALLS // 10)  # warm-up: allocator pools, plan caches, interned strings
        rss, ledger = _rss_bytes(), model.stats()
        burst(CALLS)
        grown, after = _rss_bytes() - rss, model.stats()
    # A leak of one 128-byte output per call would be 12.8 MB here.
    assert grown < 2 << 20, f"RSS grew by {grown} bytes over {CALLS} calls"
    assert after["owned_bytes"] == ledger["owned_bytes"]
    assert after["owned_count"] == ledger["owned_count"]
    assert after["borrowed_bytes"] == 0 and after["borrowed_count"] == 0
    assert after["borrow_count"] - ledger["borrow_count"] == 2 * CALLS
    assert model.report.clean
