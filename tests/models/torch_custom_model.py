"""The oracle of custom_model_test: PyTorch writes a safetensors file of
mixed dtypes (what a state dict with BatchNorm buffers, half weights and
masks holds) and checks what models/custom_model.cc writes back.

  torch_custom_model.py write DIR       DIR/initial.safetensors, DIR/expected.json
  torch_custom_model.py same DIR FILE   FILE has initial's tensors bit for bit
  torch_custom_model.py changed DIR FILE F32
      FILE's float tensors are F32's (fp32) values cast by torch's .to(dtype);
      its integer and bool tensors are initial's, bit for bit

The safetensors format is read and written here by hand (8-byte length,
JSON header, raw little-endian data), so the check does not lean on the
code under test.
"""

import hashlib
import json
import struct
import sys

import torch

DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


def state_dict():
    g = torch.Generator().manual_seed(7)
    return {
        "conv.weight": torch.randn(2, 3, generator=g),
        # bf16 and f16 values that are not fp32-simple: exact widening matters
        "bn.running_mean": (torch.randn(4, generator=g) * 1000).to(torch.bfloat16),
        "bn.scale": torch.tensor([6.1e-5, 65504.0, -0.333, 1e-7], dtype=torch.float16),
        "bn.num_batches_tracked": torch.tensor(123456789012, dtype=torch.int64),
        "mask": torch.tensor([True, False, True, True, False]),
        "temperature": torch.tensor(0.7, dtype=torch.float32),
        "ids": torch.tensor([[1, -2], [2**31 - 1, -(2**31)]], dtype=torch.int32),
        "pixels": torch.tensor([0, 7, 255], dtype=torch.uint8),
        "empty": torch.zeros(0, 3),
    }


def raw(t):
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.view(-1).view(torch.uint8).numpy().tobytes()


def write(path, tensors):
    header, data = {}, b""
    for name, t in tensors.items():
        b = raw(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        begin, end = v["data_offsets"]
        dtype = DTYPES[v["dtype"]]
        chunk = bytearray(data[begin:end])
        t = torch.frombuffer(chunk, dtype=torch.uint8) if chunk else torch.zeros(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(v["shape"]).clone()
    return out


def model_name(tensors):
    lines = "".join(f"{name}\t{NAMES[t.dtype]}\t{','.join(str(d) for d in t.shape)}\n"
                    for name, t in sorted(tensors.items()))
    return "custom@" + hashlib.sha256(lines.encode()).hexdigest()[:12]


def same_bits(a, b):
    return a.dtype == b.dtype and list(a.shape) == list(b.shape) and raw(a) == raw(b)


def main():
    mode, directory = sys.argv[1], sys.argv[2]
    initial = state_dict()
    if mode == "write":
        write(f"{directory}/initial.safetensors", initial)
        expected = {"name": model_name(initial),
                    "layout": [[k, NAMES[t.dtype], list(t.shape)] for k, t in initial.items()]}
        with open(f"{directory}/expected.json", "w") as f:
            json.dump(expected, f)
        return 0
    got = read(sys.argv[3])
    if list(got) != list(initial):
        print(f"tensors {list(got)}, expected {list(initial)} in that order")
        return 1
    reference = read(sys.argv[4]) if mode == "changed" else {}
    bad = []
    for name, t in initial.items():
        floating = t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.numel() > 0
        if mode == "changed" and floating:
            want = reference[name].reshape(t.shape).to(t.dtype)
        else:
            want = t
        if not same_bits(got[name], want):
            bad.append(f"{name}: {got[name]} ({got[name].dtype}), expected {want} ({want.dtype})")
    if bad:
        print("\n".join(bad))
        return 1
    print(f"{mode}: {len(initial)} tensors as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
