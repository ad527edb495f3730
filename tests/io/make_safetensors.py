#!/usr/bin/env python3
"""Writes the safetensors files that tests/io/safetensors_test.cpp reads, into OUTDIR.

Valid files come from the reference package `safetensors` (its low-level `serialize`, so the
header, the dtype names, the tensor order and the padding are the reference writer's own).
numpy has no BF16 or FP8 type, so those tensors are handed to the writer as raw bytes with the
dtype named as torch names it: BF16 as uint16 bit patterns with dtype "bfloat16", E4M3 scales as
uint8 with dtype "float8_e4m3fn"; the writer records them as "BF16" and "F8_E4M3". Nothing is
patched by hand in those files. (safetensors >= 0.7 takes TensorSpec objects, older versions a
dict of {dtype, shape, data}; both are handled.)

The NVFP4 layers follow NVIDIA ModelOpt's export: "<layer>.weight" uint8 [N, K/2] packing two
E2M1 codes a byte (low nibble = even k), "<layer>.weight_scale" float8_e4m3fn [N, K/16],
"<layer>.weight_scale_2" float32 scalar and "<layer>.input_scale" float32 scalar.

Beside the files, raw little-endian sidecars (*.bin) hold what was written, and for the NVFP4
layer the dequantized weights computed here (e2m1 x e4m3 x tensor scale, exact in float64, then
rounded once to float32), so the test compares against Python's values, not its own.

The FP8 layers (fp8_*.safetensors, tests/io/fp8_checkpoint_test.cpp) follow the DeepSeek-V3 /
Qwen FP8 export: "<layer>.weight" float8_e4m3fn [N, K] and "<layer>.weight_scale_inv" float32
[ceil(N/128), ceil(K/128)]; their sidecar holds the dequantized weights in float64 (exact).

Malformed files are written by hand (write_raw): the format itself is built here byte by byte.

Usage: make_safetensors.py OUTDIR
"""

import json
import os
import struct
import sys

import numpy as np
import safetensors

try:
    from safetensors import TensorSpec
except ImportError:  # safetensors < 0.7
    TensorSpec = None

RNG = np.random.default_rng(20240607)


def serialize(tensors, metadata=None):
    """tensors: {name: (dtype as torch names it, shape, numpy array holding the bytes)}."""
    arrays = {}
    for name, (dtype, shape, array) in tensors.items():
        arrays[name] = (dtype, list(shape), np.ascontiguousarray(array))
    if TensorSpec is not None:
        specs = {
            name: TensorSpec(dtype=dtype, shape=shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
            for name, (dtype, shape, a) in arrays.items()
        }
        out = safetensors.serialize(specs, metadata=metadata)  # arrays stay alive until here
    else:
        out = safetensors.serialize(
            {
                name: {"dtype": dtype, "shape": shape, "data": a.tobytes()}
                for name, (dtype, shape, a) in arrays.items()
            },
            metadata=metadata,
        )
    return bytes(out)


def save(path, tensors, metadata=None):
    with open(path, "wb") as f:
        f.write(serialize(tensors, metadata))


def write_raw(path, header, data=b"", header_len=None):
    """A file built by hand: header is a dict (dumped as JSON) or the header bytes themselves."""
    if not isinstance(header, bytes):
        header = json.dumps(header).encode()
    n = len(header) if header_len is None else header_len
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + header + data)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_value(code):
    v = E2M1[code & 7]
    return -v if code & 8 else v


def e4m3_value(bits):
    sign = -1.0 if bits & 0x80 else 1.0
    exp = (bits >> 3) & 0xF
    man = bits & 7
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def f32_to_bf16_bits(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def nvfp4_layer(n, k, tensor_scale, input_scale=None, scale2_shape=()):
    """A ModelOpt-style NVFP4 layer: its tensors, and the dequantized weights [n, k]."""
    q = RNG.integers(0, 16, size=(n, k), dtype=np.uint8)  # E2M1 codes, one per element
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # ModelOpt's packing
    scales = RNG.integers(0, 0x7F, size=(n, k // 16), dtype=np.uint8)  # finite, >= 0
    ts = np.float32(tensor_scale)
    deq = np.empty((n, k), dtype=np.float32)
    for r in range(n):
        for c in range(k):
            deq[r, c] = np.float32(
                e2m1_value(int(q[r, c])) * e4m3_value(int(scales[r, c // 16])) * float(ts)
            )
    tensors = {
        "weight": ("uint8", packed.shape, packed),
        "weight_scale": ("float8_e4m3fn", scales.shape, scales),
        "weight_scale_2": ("float32", scale2_shape, np.full(scale2_shape, ts, dtype=np.float32)),
    }
    if input_scale is not None:
        tensors["input_scale"] = ("float32", (), np.array(input_scale, dtype=np.float32))
    return tensors, packed, scales, deq


def fp8_layer(n, k):
    """A DeepSeek-V3 / Qwen FP8 layer: its tensors, codes, scales and dequantized weights [n, k].

    "<layer>.weight" float8_e4m3fn [n, k] (every finite code but NaN's 0x7F/0xFF) and
    "<layer>.weight_scale_inv" float32 [ceil(n/128), ceil(k/128)], the multiplier of each
    128 x 128 block; the dequantized weights are e4m3 x scale in float64 (exact).
    """
    codes = RNG.integers(0, 256, size=(n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # NaN codes become 1.0
    nb, kb = -(-n // 128), -(-k // 128)
    scales = RNG.uniform(1e-4, 1e-2, size=(nb, kb)).astype(np.float32)
    deq = np.empty((n, k), dtype=np.float64)
    for r in range(n):
        for c in range(k):
            deq[r, c] = e4m3_value(int(codes[r, c])) * float(scales[r // 128, c // 128])
    tensors = {
        "weight": ("float8_e4m3fn", codes.shape, codes),
        "weight_scale_inv": ("float32", scales.shape, scales),
    }
    return tensors, codes, scales, deq


def fp8_files(p):
    """The FP8 checkpoint files of tests/io/fp8_checkpoint_test.cpp."""
    down, codes, scales, deq = fp8_layer(200, 300)  # partial blocks on both axes
    o_proj, _, _, _ = fp8_layer(128, 128)
    model = {}
    model.update(prefixed("model.layers.0.mlp.down_proj", down))
    model.update(prefixed("model.layers.0.self_attn.o_proj", o_proj))
    norm = f32_to_bf16_bits(np.ones(64))
    model["model.norm.weight"] = ("bfloat16", norm.shape, norm)
    save(p("fp8_model.safetensors"), model, {"format": "pt", "quant_method": "fp8"})
    codes.tofile(p("fp8_down.codes.bin"))
    scales.astype("<f4").tofile(p("fp8_down.scales.bin"))
    deq.astype("<f8").tofile(p("fp8_down.dequant.bin"))

    def f8(shape, fill=0x38):
        return ("float8_e4m3fn", shape, np.full(shape, fill, dtype=np.uint8))

    def f32(shape, value=1.0):
        return ("float32", shape, np.full(shape, value, dtype=np.float32))

    good = {"weight": f8((4, 8)), "weight_scale_inv": f32((1, 1))}
    nan_code = np.full((4, 8), 0x38, dtype=np.uint8)
    nan_code[1, 3] = 0x7F
    neg_nan_code = np.full((4, 8), 0x38, dtype=np.uint8)
    neg_nan_code[3, 7] = 0xFF
    layers = {
        "no_scale": {"weight": f8((4, 8))},
        "no_weight": {"weight_scale_inv": f32((1, 1))},
        "weight_bf16": {**good, "weight": ("bfloat16", (4, 8), np.zeros((4, 8), np.uint16))},
        "weight_e5m2": {**good, "weight": ("float8_e5m2", (4, 8), np.zeros((4, 8), np.uint8))},
        "rank1": {**good, "weight": f8((8,))},
        "rank3": {**good, "weight": f8((2, 4, 8))},
        "zero_n": {"weight": f8((0, 8)), "weight_scale_inv": f32((0, 1))},
        "zero_k": {"weight": f8((4, 0)), "weight_scale_inv": f32((1, 0))},
        "scale_bf16": {**good, "weight_scale_inv": ("bfloat16", (1, 1),
                                                    np.full((1, 1), 0x3F80, np.uint16))},
        "scale_shape": {"weight": f8((200, 300)), "weight_scale_inv": f32((2, 2))},
        "scale_transposed": {"weight": f8((130, 300)), "weight_scale_inv": f32((3, 2))},
        "scale_rank1": {**good, "weight_scale_inv": f32((1,))},
        "nan_scale": {"weight": f8((4, 200)),
                      "weight_scale_inv": ("float32", (1, 2),
                                           np.array([[1.0, np.nan]], dtype=np.float32))},
        "inf_scale": {**good, "weight_scale_inv": f32((1, 1), np.inf)},
        "neg_scale": {**good, "weight_scale_inv": f32((1, 1), -0.5)},
        "nan_code": {**good, "weight": ("float8_e4m3fn", (4, 8), nan_code)},
        "neg_nan_code": {**good, "weight": ("float8_e4m3fn", (4, 8), neg_nan_code)},
        # These load: a zero scale is an all-zero block, -0 reads as 0.
        "zero_scale": {**good, "weight_scale_inv": f32((1, 1), 0.0)},
        "neg_zero_scale": {**good, "weight_scale_inv": f32((1, 1), -0.0)},
    }
    bad = {}
    for layer, tensors in layers.items():
        bad.update(prefixed(layer, tensors))
    save(p("fp8_bad_layers.safetensors"), bad)
    # A valid file (the reference reader takes it) whose F32 scales start at data byte 3: the
    # reference writer never places them so, hence built by hand. The header is padded to 8
    # bytes, so only the offset misaligns them.
    header = json.dumps({
        "m.weight": {"dtype": "F8_E4M3", "shape": [1, 3], "data_offsets": [0, 3]},
        "m.weight_scale_inv": {"dtype": "F32", "shape": [1, 1], "data_offsets": [3, 7]},
    }).encode()
    header += b" " * (-(8 + len(header)) % 8)
    write_raw(p("fp8_misaligned.safetensors"), header,
              bytes([0x38] * 3) + struct.pack("<f", 1.0))


def prefixed(layer, tensors):
    return {f"{layer}.{suffix}": t for suffix, t in tensors.items()}


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_safetensors.py OUTDIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    p = lambda name: os.path.join(out, name)  # noqa: E731

    # ---- a small model, as the reference package writes it ----
    down, codes, scales, deq = nvfp4_layer(8, 64, 0.0123, input_scale=0.75)
    up, _, _, _ = nvfp4_layer(4, 32, 2.5, scale2_shape=(1,))
    o_proj = f32_to_bf16_bits(RNG.normal(0.0, 0.05, size=(6, 48)))
    q_proj = RNG.normal(0.0, 1.0, size=(4, 32)).astype(np.float32)
    norm = f32_to_bf16_bits(np.ones(64))
    model = {}
    model.update(prefixed("model.layers.0.mlp.down_proj", down))
    model.update(prefixed("model.layers.0.mlp.up_proj", up))
    model["model.layers.0.self_attn.o_proj.weight"] = ("bfloat16", o_proj.shape, o_proj)
    model["model.layers.0.self_attn.q_proj.weight"] = ("float32", q_proj.shape, q_proj)
    model["model.norm.weight"] = ("bfloat16", norm.shape, norm)
    save(p("model.safetensors"), model, {"format": "pt", "producer": "make_safetensors.py"})
    codes.tofile(p("down_proj.codes.bin"))
    scales.tofile(p("down_proj.scales.bin"))
    deq.astype("<f4").tofile(p("down_proj.dequant.bin"))
    o_proj.astype("<u2").tofile(p("o_proj.bf16.bin"))

    # ---- a BF16 layer whose weights are all subnormal (0x0001..0x007F, either sign): quantized
    # to NVFP4 on load, it must be computed within the bound (metrale bench, issue 33) ----
    sub_rng = np.random.default_rng(33)  # its own generator: the other files' data is unchanged
    tiny = sub_rng.integers(1, 0x80, size=(16, 16)) | (sub_rng.integers(0, 2, size=(16, 16)) << 15)
    tiny = tiny.astype(np.uint16)
    save(p("subnormal_bf16.safetensors"),
         {"model.layers.0.mlp.down_proj.weight": ("bfloat16", tiny.shape, tiny)})
    q_proj.astype("<f4").tofile(p("q_proj.f32.bin"))

    # One 8-byte tensor (bytes 0, 1, ..., 7) of each dtype the installed reference writer knows,
    # named by the dtype as torch names it. float4_e2m1fn_x2 takes the storage shape (bytes) and
    # the writer records the logical one (two F4 values a byte).
    raw = np.arange(8, dtype=np.uint8)
    all_dtypes = {}
    for dtype, shape in [
        ("bool", (8,)), ("uint8", (8,)), ("int8", (2, 4)), ("float8_e4m3fn", (8,)),
        ("float8_e5m2", (8,)), ("float8_e8m0fnu", (8,)), ("float8_e4m3fnuz", (8,)),
        ("float8_e5m2fnuz", (8,)), ("float4_e2m1fn_x2", (8,)), ("int16", (4,)),
        ("uint16", (4,)), ("float16", (4,)), ("bfloat16", (4,)), ("int32", (2,)),
        ("uint32", (2,)), ("float32", (2,)), ("int64", (1,)), ("uint64", (1,)),
        ("float64", (1,)), ("complex64", (1,)),
    ]:
        try:
            serialize({dtype: (dtype, shape, raw)})
        except Exception:  # an older writer without this dtype
            print(f"make_safetensors: this safetensors cannot write {dtype}; left out")
            continue
        all_dtypes[dtype] = (dtype, shape, raw)
    all_dtypes["scalar"] = ("float32", (), np.array(1.5, dtype=np.float32))
    all_dtypes["zero_size"] = ("float32", (0, 4), np.zeros((0, 4), dtype=np.float32))
    save(p("all_dtypes.safetensors"), all_dtypes)
    save(p("empty.safetensors"), {}, {"note": "no tensors"})

    # ---- layers that are valid files but not loadable as NVFP4 (reference writer) ----
    def u8(*shape):
        return ("uint8", shape, np.zeros(shape, dtype=np.uint8))

    def f8(*shape):
        return ("float8_e4m3fn", shape, np.full(shape, 0x38, dtype=np.uint8))  # 1.0

    def f32(shape, value=1.0):
        return ("float32", shape, np.full(shape, value, dtype=np.float32))

    def bf16(*shape):
        return ("bfloat16", shape, np.full(shape, 0x3F80, dtype=np.uint16))  # 1.0

    good = {"weight": u8(4, 8), "weight_scale": f8(4, 1), "weight_scale_2": f32(())}
    layers = {
        "scale_dtype": {**good, "weight_scale": f32((4, 1))},
        "scale_shape": {**good, "weight_scale": f8(4, 2)},
        "scale2_shape": {**good, "weight_scale_2": f32((2,))},
        "scale2_dtype": {**good, "weight_scale_2": ("bfloat16", (), np.array(0x3F80, np.uint16))},
        "odd_k": {**good, "weight": u8(4, 4)},
        "rank3": {**good, "weight": u8(2, 4, 8)},
        "no_scale": {"weight": u8(4, 8), "weight_scale_2": f32(())},
        "no_scale2": {"weight": u8(4, 8), "weight_scale": f8(4, 1)},
        "f16": {"weight": ("float16", (4, 16), np.zeros((4, 16), dtype=np.float16))},
        "bf16_odd_k": {"weight": bf16(4, 24)},
        "bf16_with_scale": {"weight": bf16(2, 16), "weight_scale": f8(2, 1)},
        "input_dtype": {**good, "input_scale": ("bfloat16", (), np.array(0x3F80, np.uint16))},
        "input_shape": {**good, "input_scale": f32((1, 1))},
        # Loadable by the header; the data is wrong.
        "nan_scale": {**good, "weight_scale": ("float8_e4m3fn", (4, 1),
                                               np.array([[0x38], [0x7F], [0x38], [0x38]],
                                                        dtype=np.uint8))},
        "neg_scale2": {**good, "weight_scale_2": f32((), -1.0)},
        "inf_weight": {"weight": ("float32", (2, 16),
                                  np.where(np.arange(32).reshape(2, 16) == 19, np.inf,
                                           1.0).astype(np.float32))},
    }
    bad_layers = {}
    for layer, tensors in layers.items():
        bad_layers.update(prefixed(layer, tensors))
    save(p("bad_layers.safetensors"), bad_layers)
    # A file none of whose candidates loads, each for a reason of its own (and a norm vector).
    no_loadable = {}
    for layer in ("scale_shape", "odd_k", "f16", "scale2_dtype"):
        no_loadable.update(prefixed(layer, layers[layer]))
    no_loadable["norm.weight"] = bf16(64)
    save(p("no_loadable_layers.safetensors"), no_loadable)

    fp8_files(p)

    # ---- malformed files, by hand ----
    def entry(dtype, shape, begin, end):
        return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}

    small = serialize({"trunc.weight": ("float32", (16,), np.ones(16, dtype=np.float32))})
    with open(p("truncated.safetensors"), "wb") as f:
        f.write(small[:-10])
    with open(p("tiny.safetensors"), "wb") as f:
        f.write(small[:5])
    with open(p("header_past_end.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(small) - 8 + 1) + small[8:])
    with open(p("header_absurd.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 1 << 40) + small[8:])
    write_raw(p("invalid_json.safetensors"), b'{"a.weight": {"dtype": "F32", "shape": [1],', b"")
    write_raw(p("not_object.safetensors"), b"[1, 2, 3]")
    write_raw(p("empty_header.safetensors"), b"")
    write_raw(p("entry_not_object.safetensors"), {"bad.entry": 5})
    write_raw(p("unknown_dtype.safetensors"), {"odd.dtype": entry("Q4", [2], 0, 2)}, bytes(2))
    write_raw(p("dtype_not_string.safetensors"), {"num.dtype": entry(8, [2], 0, 2)}, bytes(2))
    write_raw(p("no_offsets.safetensors"), {"no.offsets": {"dtype": "U8", "shape": [2]}}, bytes(2))
    write_raw(p("no_shape.safetensors"), {"no.shape": {"dtype": "U8", "data_offsets": [0, 2]}},
              bytes(2))
    write_raw(p("negative_shape.safetensors"), {"neg.shape": entry("U8", [-2], 0, 2)}, bytes(2))
    write_raw(p("float_shape.safetensors"), {"float.shape": entry("U8", [2.5], 0, 2)}, bytes(2))
    write_raw(p("shape_not_list.safetensors"), {"flat.shape": entry("U8", 2, 0, 2)}, bytes(2))
    write_raw(p("huge_shape.safetensors"),
              {"huge.shape": entry("F64", [1 << 62, 1 << 62], 0, 8)}, bytes(8))
    write_raw(p("size_mismatch.safetensors"), {"size.mismatch": entry("F32", [4], 0, 12)},
              bytes(12))
    write_raw(p("f4_odd.safetensors"), {"odd.f4": entry("F4", [3], 0, 2)}, bytes(2))
    write_raw(p("reversed_offsets.safetensors"), {"rev.offsets": entry("U8", [0], 8, 0)},
              bytes(8))
    write_raw(p("bad_offsets.safetensors"), {"bad.offsets": entry("U8", [2], 0, "2")}, bytes(2))
    write_raw(p("overlap.safetensors"),
              {"first.weight": entry("U8", [16], 0, 16), "second.weight": entry("U8", [16], 8, 24)},
              bytes(24))
    write_raw(p("out_of_range.safetensors"), {"far.weight": entry("U8", [1000], 0, 1000)},
              bytes(16))
    write_raw(p("gap.safetensors"),
              {"before.gap": entry("U8", [8], 0, 8), "after.gap": entry("U8", [8], 16, 24)},
              bytes(24))
    write_raw(p("trailing.safetensors"), {"short.weight": entry("U8", [8], 0, 8)}, bytes(16))
    write_raw(p("non_utf8_name.safetensors"),
              b'{"bad\xff.weight": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
              bytes(2))
    write_raw(p("non_utf8_dtype.safetensors"),
              b'{"ok.name": {"dtype": "U\xc3\x288", "shape": [2], "data_offsets": [0, 2]}}',
              bytes(2))
    write_raw(p("duplicate.safetensors"),
              b'{"dup.weight": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},'
              b' "dup.weight": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}',
              bytes(4))
    write_raw(p("duplicate_key.safetensors"),
              b'{"twice.dtype": {"dtype": "U8", "dtype": "I8", "shape": [2],'
              b' "data_offsets": [0, 2]}}',
              bytes(2))
    write_raw(p("metadata_not_string.safetensors"),
              {"__metadata__": {"layers": 3}, "t": entry("U8", [2], 0, 2)}, bytes(2))
    write_raw(p("metadata_not_object.safetensors"), {"__metadata__": "x"})
    print(f"make_safetensors: wrote {len(os.listdir(out))} files to {out} "
          f"(safetensors {safetensors.__version__}, numpy {np.__version__})")


if __name__ == "__main__":
    main()
