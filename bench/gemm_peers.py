#!/usr/bin/env python3
"""Peers of w4a16_gemm on the same shapes, on the same GPU, for scripts/device-check.sh.

Where the machine's Python has torch with CUDA: BF16 matmul (A[M, K] @ W[N, K]^T),
torch._weight_int4pack_mm (int4 weights, BF16 activations, group 128) and torch._scaled_mm
(E4M3 x E4M3, M a multiple of 16). Each is timed as a CUDA graph of back-to-back calls (the median
of 5 replays), like bench_gemm_gpu, so launch overhead does not count. Prints one JSON object per
line: {"peer", "shape", "m", "n", "k", "us"} or {"peer", ..., "error"}. Without torch or a GPU it
prints one line saying so and exits 0: peers are a comparison, not a requirement.
"""
import json
import sys
import time

SHAPES = [("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 28672, 4096),
          ("8b.down", 4096, 14336), ("70b.qkv", 10240, 8192), ("70b.o", 8192, 8192),
          ("70b.gate_up", 57344, 8192), ("70b.down", 8192, 28672)]


def emit(**row):
    print(json.dumps(row), flush=True)


def time_graph(torch, fn):
    """Seconds per call of fn, from replays of a graph of calls filling about 20 ms."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-7))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture requires
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[2] / reps


def int4pack(torch, w_codes, n, k):
    """torch's packed int4 weights and its scales-and-zeros (group 128), across torch versions."""
    group = 128
    scales = torch.ones(k // group, n, 2, dtype=torch.bfloat16, device="cuda")
    scales[:, :, 1] = 8.0  # zero point of the unsigned codes
    try:  # torch >= 2.5: uint8 [N, K/2]
        packed = torch._convert_weight_to_int4pack(w_codes, 2)
    except (RuntimeError, TypeError):  # older: int32 [N, K] of values 0..15
        unpacked = torch.stack([w_codes & 0xF, w_codes >> 4], dim=-1).reshape(n, k).to(torch.int32)
        packed = torch._convert_weight_to_int4pack(unpacked, 2)
    return packed, scales, group


def main():
    quick = "--quick" in sys.argv
    ms = [1, 2, 4, 8, 16, 4096] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 512, 4096]
    try:
        import torch
    except ImportError:
        emit(peer="torch", error="torch is not installed")
        return 0
    if not torch.cuda.is_available():
        emit(peer="torch", error="torch has no CUDA device")
        return 0
    emit(peer="torch", version=torch.__version__, device=torch.cuda.get_device_name())
    for name, n, k in SHAPES:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        w_codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        w8 = w.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device="cuda")
        try:
            packed = int4pack(torch, w_codes, n, k)
        except Exception as e:  # noqa: BLE001 - report any torch failure as the peer's error
            packed = e
        for m in ms:
            a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            peers = {"torch.bf16_matmul": lambda: torch.matmul(a, w.t())}
            if not isinstance(packed, Exception):
                p, sz, g = packed
                peers["torch._weight_int4pack_mm"] = lambda: torch._weight_int4pack_mm(a, p, g, sz)
            else:
                emit(peer="torch._weight_int4pack_mm", shape=name, m=m, n=n, k=k,
                     error=str(packed).splitlines()[0])
            if m % 16 == 0:
                a8 = a.to(torch.float8_e4m3fn)
                peers["torch._scaled_mm"] = lambda: torch._scaled_mm(
                    a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            for peer, fn in peers.items():
                try:
                    emit(peer=peer, shape=name, m=m, n=n, k=k, us=time_graph(torch, fn) * 1e6)
                except Exception as e:  # noqa: BLE001
                    emit(peer=peer, shape=name, m=m, n=n, k=k, error=str(e).splitlines()[0])
        del w, w_codes, w8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
