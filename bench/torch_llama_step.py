#!/usr/bin/python3
"""The PyTorch side of bench/llama_step: the plain-torch LLaMA of
tests/models/torch_llama.py in fp32, one training step (forward, cross-entropy,
backward) timed; prints the median seconds per step."""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
from torch_llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

parser = argparse.ArgumentParser()
for name in ("vocab", "hidden", "intermediate", "layers", "heads", "kv-heads", "seq", "batch", "steps", "threads"):
    parser.add_argument("--" + name, type=int, required=True)
parser.add_argument("--warmup", type=int, default=1)
a = parser.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(1)
config = LlamaConfig(a.vocab, a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.seq, 1e-5)
model = LlamaForCausalLM(config).float()
tokens = torch.randint(0, a.vocab, (a.batch, a.seq))
targets = torch.randint(0, a.vocab, (a.batch, a.seq))
times = []
for step in range(-a.warmup, a.steps):  # negative steps warm up
    start = time.perf_counter()
    model.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(tokens).reshape(-1, a.vocab), targets.reshape(-1))
    loss.backward()
    if step >= 0:
        times.append(time.perf_counter() - start)
times.sort()
print(times[len(times) // 2])
