#!/usr/bin/env python3
"""The oracle for `estuary-server export`'s merged model on a Hugging Face base.

Usage: torch_merge_check.py BASE_DIR ADAPTER_DIR MERGED_DIR

Reads the base's model.safetensors, the PEFT adapter (adapter_config.json's
r and lora_alpha, adapter_model.safetensors in PEFT's names) and the merged
model.safetensors, forms W + (alpha/r)·B·A in torch (float64) for every
adapted weight, and compares every tensor of the merged file with it. Prints
one line: the tensors compared, the adapted ones and the largest relative
error; exits 1 when a tensor is missing or off by more than 1e-6 relative
(fp32 rounding of one product and one sum).
"""
import json
import struct
import sys

import torch


def read_safetensors(path):
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        assert spec["dtype"] == "F32", f"{path}: {name} is {spec['dtype']}"
        begin, end = spec["data_offsets"]
        values = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.float32)
        tensors[name] = values.reshape(spec["shape"]).double()
    return tensors


def main():
    base_dir, adapter_dir, merged_dir = sys.argv[1:4]
    base = read_safetensors(f"{base_dir}/model.safetensors")
    adapter = read_safetensors(f"{adapter_dir}/adapter_model.safetensors")
    merged = read_safetensors(f"{merged_dir}/model.safetensors")
    with open(f"{adapter_dir}/adapter_config.json") as f:
        config = json.load(f)
    scale = config["lora_alpha"] / config["r"]
    expected = dict(base)
    adapted = 0
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len("base_model.model."):-len(".lora_A.weight")]
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        expected[module + ".weight"] = base[module + ".weight"] + scale * (b @ a)
        adapted += 1
    worst = 0.0
    for name, want in expected.items():
        if name not in merged:
            print(f"merged model lacks {name}")
            return 1
        got = merged[name]
        err = ((got - want).norm() / max(want.norm().item(), 1e-30)).item()
        worst = max(worst, err)
        if err > 1e-6:
            print(f"{name}: relative error {err:.3g}")
            return 1
    if set(merged) != set(expected):
        print(f"merged model has extra tensors {sorted(set(merged) - set(expected))}")
        return 1
    print(f"{len(expected)} tensors, {adapted} adapted, max relative error {worst:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
