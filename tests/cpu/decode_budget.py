#!/usr/bin/env python3
"""The AVX2 decode kernel's one-row loop held to its instruction budget, counted in its machine code.

Note [AVX2 decode budget] in docs/NOTES.md derives the budget: at 85% of the development VM's read
bandwidth a core has 2.56 cycles per 16 weights, so at most 7.7 multiply-adds, shuffles and shifts
(the operations Zen 3's three contended FP pipes run) and 10.2 vector operations in all. This
reads `objdump -d` of decode_avx2.cpp's object, takes each format's one-row function, finds its
steady loop (the innermost backward jump holding the most vpshufb: the unrolled batch of steps,
four vpshufb per 64-weight step), and fails when a count per 16 weights is over its limit.

Usage: decode_budget.py OBJECT. METRALE_DECODE_BUDGET_CONTENDED and METRALE_DECODE_BUDGET_VECTOR
lower the limits (a planted budget the kernel must fail).
"""
import os
import re
import subprocess
import sys

FUNCTIONS = {
    "NVFP4": "decode_rows<false, 1>",
    "MXFP4": "decode_rows<true, 1>",
}
CATEGORIES = [
    ("multiply-add", ("vfmadd", "vmulps")),
    ("add", ("vaddps",)),
    ("shuffle", ("vpshufb", "vpunpck", "vpermps", "vpermd", "vpmovzx", "vperm2", "vinsert",
                 "vextract", "vshufps", "vpshufd", "vpbroadcast", "vbroadcast")),
    ("shift", ("vpsll", "vpsrl", "vpsra")),
    ("logic", ("vpand", "vpor", "vpxor", "vxorps", "vandps", "vpblendvb", "vpcmpeq")),
    ("convert", ("vcvt",)),
]
CONTENDED = ("multiply-add", "shuffle", "shift")


def category(op):
    for name, prefixes in CATEGORIES:
        if op.startswith(prefixes):
            return name
    return None


def function_body(listing, name):
    lines = listing.splitlines()
    start = next((i for i, l in enumerate(lines) if l.endswith(">:") and name in l), None)
    if start is None:
        sys.exit(f"decode_budget: no function {name!r} in the object")
    body = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        m = re.match(r"\s*([0-9a-f]+):\s+(\S+)\s*(.*)", line)
        if m:
            body.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return body


def steady_loop(body):
    loops = []
    for i, (addr, op, args) in enumerate(body):
        target = re.search(r"\b([0-9a-f]+) <", args)
        if op.startswith("j") and target and int(target.group(1), 16) < addr:
            head = int(target.group(1), 16)
            loops.append([x for x in body if head <= x[0] <= addr])
    # Innermost: no backward jump inside but its own last instruction.
    def innermost(loop):
        return not any(
            op.startswith("j") and re.search(r"\b([0-9a-f]+) <", a)
            and int(re.search(r"\b([0-9a-f]+) <", a).group(1), 16) < addr
            for addr, op, a in loop[:-1])
    candidates = [l for l in loops if innermost(l)]
    return max(candidates, key=lambda l: sum(op == "vpshufb" for _, op, _ in l), default=None)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", sys.argv[1]],
                             capture_output=True, text=True, check=True).stdout
    contended_limit = float(os.environ.get("METRALE_DECODE_BUDGET_CONTENDED", "7.7"))
    vector_limit = float(os.environ.get("METRALE_DECODE_BUDGET_VECTOR", "10.2"))
    failed = False
    for fmt, name in FUNCTIONS.items():
        loop = steady_loop(function_body(listing, name))
        shuffles = sum(op == "vpshufb" for _, op, _ in loop or [])
        if not loop or shuffles == 0 or shuffles % 4:
            sys.exit(f"decode_budget: {fmt}: no steady loop with whole steps in {name}")
        weights = 64 * shuffles // 4
        counts = {c: 0 for c, _ in CATEGORIES}
        for _, op, _ in loop:
            c = category(op)
            if c:
                counts[c] += 1
        per16 = {c: n * 16 / weights for c, n in counts.items()}
        contended = sum(per16[c] for c in CONTENDED)
        vector = sum(per16.values())
        print(f"{fmt}: {len(loop)} instructions per {weights} weights; per 16 weights: " +
              ", ".join(f"{c} {v:.2f}" for c, v in per16.items()) +
              f"; contended {contended:.2f} (limit {contended_limit}), vector {vector:.2f} "
              f"(limit {vector_limit})")
        if contended > contended_limit or vector > vector_limit:
            print(f"{fmt}: OVER BUDGET")
            failed = True
    if failed:
        sys.exit(1)
    print("decode budget met")


if __name__ == "__main__":
    main()
