#!/usr/bin/python3
"""The PyTorch side of bench/llama_step: the plain-torch LLaMA of
tests/models/torch_llama.py in fp32, one training step timed.

--model DIR is the model the bench wrote: DIR/config.json and
DIR/model.safetensors (the bench's weights), DIR/tokens.json (tokens and
targets, [batch, seq]) and, with --lora-rank, DIR/adapter (its PEFT adapter
directory); so both sides start from the same bits.

A full step is forward, cross-entropy, backward (every weight's gradient). A
LoRA step (--lora-rank R) wraps the projections the adapter names as PEFT
does (tests/models/torch_llama.py's LoraLinear: the base frozen, so autograd
forms no gradient of a base weight) and ends with torch.optim.AdamW over the
adapters only.

It runs in step with the bench: "ready" once the model is loaded, then for
each "step" line on its input one step and "step SECONDS CPU_SECONDS LOSS"
(wall-clock and process CPU time); it exits at the end of its input."""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
from torch_llama import LlamaForCausalLM, add_lora, config_from_hf_json, read_safetensors  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--lora-rank", type=int, default=0)
parser.add_argument("--lora-alpha", type=float, default=0)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--weight-decay", type=float, default=1e-2)
a = parser.parse_args()
torch.set_num_threads(a.threads)

config = config_from_hf_json(os.path.join(a.model, "config.json"))
model = LlamaForCausalLM(config)
weights, _ = read_safetensors(os.path.join(a.model, "model.safetensors"))
# Tied: the file has no lm_head.weight (it is the embedding).
model.load_state_dict(weights, strict=not config.tie_word_embeddings)
del weights
with open(os.path.join(a.model, "tokens.json")) as f:
    data = json.load(f)
tokens, targets = torch.tensor(data["tokens"]), torch.tensor(data["targets"])
model = model.float()
vocab = config.vocab_size

optimizer = None
if a.lora_rank > 0:
    with open(os.path.join(a.model, "adapter", "adapter_config.json")) as f:
        ac = json.load(f)
    assert ac["r"] == a.lora_rank and ac["lora_alpha"] == a.lora_alpha, ac
    adapters = add_lora(model, ac["r"], ac["lora_alpha"], ac["target_modules"])
    saved, _ = read_safetensors(os.path.join(a.model, "adapter", "adapter_model.safetensors"))
    assert set(saved) == set(adapters), f"adapter names differ: {sorted(set(saved) ^ set(adapters))}"
    with torch.no_grad():
        for name, p in adapters.items():
            p.copy_(saved[name])
    optimizer = torch.optim.AdamW(list(adapters.values()), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=a.weight_decay)


def step():
    start, cpu = time.perf_counter(), time.process_time()
    if optimizer:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(tokens).reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    if optimizer:
        optimizer.step()
    return time.perf_counter() - start, time.process_time() - cpu, loss.item()


print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "step":
        sys.exit(f"torch_llama_step.py: unknown request {line.strip()!r}")
    seconds, cpu_seconds, loss = step()
    print(f"step {seconds:.6f} {cpu_seconds:.6f} {loss:.9g}", flush=True)
