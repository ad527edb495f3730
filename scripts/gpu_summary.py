#!/usr/bin/env python3
"""The GEMM goals of issue 5, from one device-check run: bench_gemm_gpu's JSON lines (ours, with
the copy bandwidth and cuBLASLt measured in the same run) and bench/gemm_peers.py's (torch).

usage: gpu_summary.py OURS.jsonl [PEERS.jsonl [BENCH.json]]
Prints a short table: decode share of the copy bandwidth (on the source layout, "decode", and on
the decode layout, "decode-dl", with the second's speed-up over the first case by case), M = 1 on
8192 x 28672 against torch's BF16 matmul, M = 4096 against cuBLASLt BF16, and every peer as a
ratio (peer time / our time, so above 1 means we are faster; decode cases against decode-dl where
it ran). BENCH.json, `metrale bench --json` of the 70B block with every route side by side: each
route's speed against the dense BF16 baseline of the same run, per M, with the goals of issue 16
(w8a8 >= 1.3x, fused >= 1.0x, dequant >= 0.9x at M = 4096).
"""
import json
import sys


def load(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    rows.append(json.loads(line))
    except OSError as e:
        print(f"gpu_summary: cannot read {path}: {e}")
    return rows


def main():
    bench_ok = side_by_side(sys.argv[3]) if len(sys.argv) > 3 else True
    ours = [r for r in load(sys.argv[1]) if r.get("ok")]
    peers = load(sys.argv[2]) if len(sys.argv) > 2 else []
    wrong = [r for r in load(sys.argv[1]) if r.get("ok") is False]
    if not ours:
        print("gemm: no measured case (see the bench-gemm-gpu log)")
        return 1
    # The automatic exact route's row comes first for each case; forced routes follow it.
    exact = {}
    for r in ours:
        if r["route"] not in ("e4m3", "decode-dl", "fused"):
            exact.setdefault((r["shape"], r["m"]), r)
    by_route = {}
    for r in ours:
        by_route.setdefault(r["route"], {})[(r["shape"], r["m"])] = r
    e4m3 = {(r["shape"], r["m"]): r for r in ours if r["route"] == "e4m3"}
    packed = {(r["shape"], r["m"]): r for r in ours if r["route"] == "decode-dl"}

    for name, table in (("decode", exact), ("decode-dl", packed)):
        decode = [r for r in table.values() if r["m"] <= 16]
        if decode:
            worst = min(decode, key=lambda r: r["pct_copy"])
            print(f"{name} M<=16: {min(r['pct_copy'] for r in decode):.1f}%..."
                  f"{max(r['pct_copy'] for r in decode):.1f}% of copy bandwidth "
                  f"(worst {worst['shape']} M={worst['m']}; goal >= 60%, stretch 90%)")
    pairs = [(key, exact[key]["us"] / r["us"]) for key, r in packed.items() if key in exact]
    if pairs:
        slowest = min(pairs, key=lambda kv: kv[1])
        print(f"decode-dl vs decode: {slowest[1]:.2f}x...{max(v for _, v in pairs):.2f}x faster "
              f"(slowest {slowest[0][0]} M={slowest[0][1]}; must not be below 1x)")
    bf16 = [p for p in peers if p.get("peer") == "torch.bf16_matmul" and p.get("shape") == "70b.down"
            and p.get("m") == 1 and "us" in p]
    for name, table in (("decode", exact), ("decode-dl", packed)):
        big = table.get(("70b.down", 1))
        if big and bf16:
            print(f"M=1 8192x28672 {name}: {bf16[0]['us'] / big['us']:.2f}x torch BF16 matmul "
                  f"(goal >= 2.2x, stretch 3.2x)")
    if not bf16:
        print("M=1 8192x28672 vs torch BF16: not measured (no torch or no case)")
    goals = {"tiled": "> 1x", "dequant": ">= 0.9x", "fused": ">= 1.0x, stretch 1.1x",
             "e4m3": "> 1x"}
    for route in ("tiled", "dequant", "fused", "e4m3"):
        table = by_route.get(route, {})
        prefill = [r for r in table.values() if r["m"] == 4096 and r.get("cublas_us", 0) > 0]
        if prefill:
            ratios = [r["cublas_us"] / r["us"] for r in prefill]
            print(f"M=4096 {route}: {min(ratios):.2f}x...{max(ratios):.2f}x cuBLASLt BF16 speed "
                  f"(goal {goals[route]}), {max(r['tflops'] for r in prefill):.0f} TFLOP/s best")
    names = sorted({p["peer"] for p in peers if "shape" in p})
    for name in names:
        # FP8 peers against our E4M3 route where it ran, the rest against the exact route.
        table = e4m3 if "scaled_mm" in name and e4m3 else {**exact, **packed}
        ratios = []
        for p in peers:
            if p.get("peer") == name and "us" in p and (p["shape"], p["m"]) in table:
                ratios.append((p["m"], p["us"] / table[(p["shape"], p["m"])]["us"]))
        errors = [p for p in peers if p.get("peer") == name and "error" in p]
        if ratios:
            by_m = {}
            for m, r in ratios:
                by_m.setdefault(m, []).append(r)
            cells = ", ".join(f"M={m}: {min(v):.2f}-{max(v):.2f}x" for m, v in sorted(by_m.items()))
            print(f"vs {name}: {cells}")
        elif errors:
            print(f"vs {name}: not run ({errors[0]['error'][:80]})")
    if wrong:
        print(f"WRONG RESULTS: {len(wrong)} case(s), e.g. {wrong[0]}")
        return 1
    return 0 if bench_ok else 1


def side_by_side(path):
    """Each route's speed against the BF16 baseline, from metrale bench --json; False on a wrong
    result or an unreadable file."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        print(f"bench: cannot read {path}: {e}")
        return False
    rows = doc.get("routes", []) + doc.get("layers", [])
    base = {(r["layer"], r["M"]): r["ms"] for r in rows if r["variant"] == "bf16" and r["ms"] > 0}
    goals = {"w8a8": ">= 1.3x", "fused": ">= 1.0x", "dequant": ">= 0.9x"}
    by_variant = {}
    for r in rows:
        key = (r["layer"], r["M"])
        if r["variant"] != "bf16" and r["ms"] > 0 and key in base:
            by_variant.setdefault(r["variant"], {}).setdefault(r["M"], []).append(base[key] / r["ms"])
    for variant, by_m in sorted(by_variant.items()):
        cells = ", ".join(f"M={m}: {min(v):.2f}-{max(v):.2f}x" for m, v in sorted(by_m.items()))
        goal = f" (goal at M=4096 {goals[variant]})" if variant in goals else ""
        print(f"bench 70b {variant} vs cuBLASLt BF16: {cells}{goal}")
    for why in doc.get("routes_skipped", []):
        if why.startswith("w8a8"):
            print(f"bench 70b: {why}")
            break
    if not doc.get("passed", False):
        print("bench 70b: a check FAILED (see the bench-70b log)")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
