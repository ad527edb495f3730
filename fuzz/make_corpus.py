#!/usr/bin/env python3
"""Writes the generated seeds of the committed corpus (fuzz/corpus/<target>/):

- fuzz_safetensors/layer-*.safetensors: real files from the reference package, through
  tests/io/make_safetensors.py's writer, each a few hundred bytes, so the fuzzer mutates whole
  NVFP4, BF16 and F32 layers quickly. The malformed seeds beside them are that script's own
  files, copied.
- fuzz_gemm_args/*: calls encoded the way fuzz_gemm_args.cpp decodes them (FuzzedDataProvider
  reads integers big-endian from the end of the input): valid calls of every op and route, and
  a few invalid ones.

Usage: fuzz/make_corpus.py OUTROOT   (e.g. fuzz/corpus)
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "io"))
import make_safetensors as st  # noqa: E402


def safetensors_seeds(out):
    os.makedirs(out, exist_ok=True)
    p = lambda name: os.path.join(out, name)  # noqa: E731
    nvfp4, _, _, _ = st.nvfp4_layer(2, 32, 0.5, input_scale=0.25)
    st.save(p("layer-nvfp4.safetensors"), st.prefixed("l", nvfp4))
    nvfp4_1, _, _, _ = st.nvfp4_layer(1, 16, 2.0, scale2_shape=(1,))
    st.save(p("layer-nvfp4-scale2-shape1.safetensors"), st.prefixed("a.b", nvfp4_1))
    bf16 = st.f32_to_bf16_bits(st.RNG.normal(0.0, 1.0, size=(2, 16)))
    st.save(p("layer-bf16.safetensors"), {"x.weight": ("bfloat16", bf16.shape, bf16)},
            {"format": "pt"})
    f32 = st.RNG.normal(0.0, 1.0, size=(1, 16)).astype(np.float32)
    st.save(p("layer-f32-input-scale.safetensors"),
            {"y.weight": ("float32", f32.shape, f32),
             "y.input_scale": ("float32", (), np.array(1.0, dtype=np.float32))})
    codes = np.zeros((1, 8), dtype=np.uint8)
    st.save(p("layer-nvfp4-missing-scale.safetensors"), {"z.weight": ("uint8", codes.shape, codes)})
    fp8, _, _, _ = st.fp8_layer(3, 130)  # scales [1, 2]: a partial second K block
    st.save(p("layer-fp8.safetensors"), st.prefixed("f", fp8))


def fdp(*values):
    """(value, lo, hi) in the order the harness consumes them -> the input bytes."""
    stream = b""
    for value, lo, hi in values:
        span, n = hi - lo, 0
        while n < 8 and span >> (8 * n):
            n += 1
        stream += (value - lo).to_bytes(n, "big") if n else b""
    return stream[::-1]


U8, U32 = (0, 255), (0, 2**32 - 1)


def dim(v, small, step=1):
    return [(0, *U8), (v // step - 1, 0, small - 1)]


def ptr(choice=0, delta=1, buffers=3):
    """A pointer choice (0: a fresh exact buffer); 8 picks the first of `buffers` made so far."""
    return [(delta - 1, *U8), (choice, 0, 9)] + ([(0, 0, buffers - 1)] if choice >= 8 else [])


def gemm(m, n, k, mx=0, transposed=0, allow=0, route=0, bias=False, c=(0, 1), tail=()):
    v = [(1234, *U32), (0, 0, 5), (mx, 0, 255), (transposed, 0, 255)]
    v += dim(m, 80) + dim(n, 64) + dim(k, 8, 32) + [(255, *U8), (allow, *U8), (route, *U8)]
    v += ptr() + ptr() + ptr() + [(int(bias), *U8)] + (ptr() if bias else []) + ptr(*c)
    return fdp(*v, (0, 0, 3), (2, 0, 5), *tail)


def gemm_seeds(out):
    os.makedirs(out, exist_ok=True)
    seeds = {
        "gemm-decode-nvfp4-bias": gemm(1, 8, 32, bias=True),
        "gemm-tiled-mxfp4-transposed": gemm(20, 16, 64, mx=1, transposed=1),
        "gemm-e4m3": gemm(64, 4, 32, allow=1, route=3),
        "gemm-c-misaligned": gemm(2, 8, 32, c=(4, 5)),
        "gemm-c-freed": gemm(2, 8, 32, c=(7, 1)),
        "gemm-c-aliases-a": gemm(2, 8, 32, c=(8, 1)),
        "route-auto-e4m3": fdp((1, *U32), (1, 0, 5), (0, *U8), (0, *U8),
                               *dim(70, 80), *dim(8, 64), *dim(32, 8, 32), (255, *U8),
                               (1, *U8), (0, *U8)),
        "cast": fdp((7, *U32), (2, 0, 5), *dim(100, 2048), *ptr(), *ptr()),
        "upload": fdp((9, *U32), (3, 0, 5), (0, *U8), (0, *U8), *dim(8, 64), *dim(32, 8, 32),
                      (128, 0, 4096), (16, 0, 256)),
        "fill": fdp((3, *U32), (4, 0, 5), *dim(100, 2048), *ptr(), (0xDEADBEEF, *U32)),
        "axpy": fdp((5, *U32), (5, 0, 5), *dim(50, 2048), *ptr(), *ptr()),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    root = sys.argv[1]
    safetensors_seeds(os.path.join(root, "fuzz_safetensors"))
    gemm_seeds(os.path.join(root, "fuzz_gemm_args"))
