"""The GIL is released while a GEMM runs, and calls from several threads stay correct."""

from __future__ import annotations

import threading
import time

import numpy as np
from conftest import bf16, check_gemm

import metrale


def test_gil_is_released_during_a_gemm(rng, model):
    host = metrale.quantize_nvfp4(rng.standard_normal((4096, 4096)).astype(np.float32))
    w = model.upload_weights(host, layout="source")
    a = bf16(rng.standard_normal((256, 4096)))
    model.gemm(a, w, route="tiled")  # warm-up
    span = {}

    def work() -> None:
        span["start"] = time.perf_counter()
        model.gemm(a, w, route="tiled")
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=work)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    call = span["end"] - span["start"]
    inside = [t for t in ticks if span["start"] <= t <= span["end"]]
    gaps = np.diff([span["start"], *inside, span["end"]])
    # A call that held the GIL would stall this loop for all of its length; released, the loop
    # runs on beside it, paused only by the OS and the interpreter's switch interval (5 ms).
    assert call > 0.02, f"the call took {call * 1e3:.1f} ms, too short to tell"
    assert gaps.max() < 0.5 * call, f"this thread stalled {gaps.max() * 1e3:.1f} ms of a " \
                                    f"{call * 1e3:.1f} ms call"


def test_threads_share_a_model(rng, model):
    host = metrale.quantize_mxfp4(rng.standard_normal((64, 128)).astype(np.float32))
    w = model.upload_weights(host)
    inputs = [bf16(rng.standard_normal((3, 128))) for _ in range(4)]
    results, errors = {}, []

    def work(i: int) -> None:
        try:
            for _ in range(200):
                results[i] = model.gemm(inputs[i], w)
        except Exception as e:  # reported below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, a in enumerate(inputs):
        check_gemm(results[i], a, host)
    assert model.stats()["borrowed_count"] == 0
