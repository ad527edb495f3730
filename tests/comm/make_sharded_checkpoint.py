#!/usr/bin/env python3
"""Writes two small sharded NVFP4 checkpoints (Hugging Face index + 2 shards) for the CLI's
`bench --tp --weights` tests: good/ (an up_proj and a down_proj whose tensors are spread over
both shards) and broken/ (the same, with one tensor in both shards). Fresh random bytes each
run. Usage: make_sharded_checkpoint.py OUT_DIR"""

import json
import os
import random
import struct
import sys


def tensor(dtype, shape, data):
    return {"dtype": dtype, "shape": shape, "data": data}


def nvfp4_layer(name, n, k, rng):
    """A ModelOpt NVFP4 layer: E2M1 codes, positive finite E4M3 block scales, an FP32 scale."""
    return {
        f"{name}.weight": tensor("U8", [n, k // 2], bytes(rng.getrandbits(8) for _ in range(n * k // 2))),
        f"{name}.weight_scale": tensor(
            "F8_E4M3", [n, k // 16], bytes(rng.randint(0x28, 0x48) for _ in range(n * k // 16))),
        f"{name}.weight_scale_2": tensor("F32", [1], struct.pack("<f", 2.0 ** -6)),
    }


def write_safetensors(path, tensors):
    header, data = {}, b""
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": t["dtype"], "shape": t["shape"],
                        "data_offsets": [len(data), len(data) + len(t["data"])]}
        data += t["data"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def write_checkpoint(folder, shards):
    os.makedirs(folder, exist_ok=True)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(folder, file), tensors)
        for name in tensors:
            weight_map.setdefault(name, file)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def main():
    out = sys.argv[1]
    rng = random.Random()
    up = nvfp4_layer("model.layers.0.mlp.up_proj", 256, 128, rng)
    down = nvfp4_layer("model.layers.0.mlp.down_proj", 128, 256, rng)
    first = {**up, "model.layers.0.mlp.down_proj.weight_scale_2": down.pop(
        "model.layers.0.mlp.down_proj.weight_scale_2")}
    write_checkpoint(os.path.join(out, "good"), [first, down])
    twice = "model.layers.0.mlp.up_proj.weight_scale"
    write_checkpoint(os.path.join(out, "broken"), [first, {**down, twice: first[twice]}])


if __name__ == "__main__":
    main()
