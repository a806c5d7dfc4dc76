#!/usr/bin/python3
"""The PyTorch side of bench/llama_gpu: the plain-torch LLaMA of
tests/models/torch_llama.py on the GPU, trained with bf16 autocast (fp32
master weights, as the Estuary engine) and fused torch.optim.AdamW, in this
one process: eager with modeling_llama's eager attention (it forms the
seq x seq scores, as the Estuary engine does), eager with
F.scaled_dot_product_attention (flash attention: transformers' default, the
baseline), and that under torch.compile. Prints tokens/s for each and last a
line "RESULT <eager sdpa tok/s> <compiled tok/s> <eager math tok/s>" for
bench/llama_gpu to read (0 for a mode that could not run)."""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
import torch_llama  # noqa: E402
from torch_llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

parser = argparse.ArgumentParser()
for name, default in (("vocab", 50304), ("hidden", 768), ("intermediate", 2048), ("layers", 12), ("heads", 12),
                      ("kv-heads", 12), ("seq", 1024), ("batch", 8), ("steps", 50), ("warmup", 3)):
    parser.add_argument("--" + name, type=int, default=default)
parser.add_argument("--untied", action="store_true")
a = parser.parse_args()

if not torch.cuda.is_available():
    print("torch_llama_gpu: no CUDA device visible to PyTorch; nothing to measure", file=sys.stderr)
    print("RESULT 0 0")
    sys.exit(0)


def measure(compiled):
    torch.manual_seed(1)
    config = LlamaConfig(a.vocab, a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.seq, 1e-5,
                         tie_word_embeddings=not a.untied)
    model = LlamaForCausalLM(config).cuda().float()
    with torch.no_grad():  # transformers' _init_weights (initializer_range 0.02), as the engine initializes
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01,
                            **({"fused": True} if "fused" in torch.optim.AdamW.__init__.__code__.co_varnames else {}))
    step_model = torch.compile(model) if compiled else model
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), device="cuda")
    targets = torch.randint(0, a.vocab, (a.batch, a.seq), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tps = a.steps * a.batch * a.seq / seconds
    print(f"pytorch {'torch.compile' if compiled else 'eager'} ({torch_llama.ATTENTION} attention): {tps:,.0f} tokens/s "
          f"({seconds / a.steps * 1e3:.1f} ms/step, final loss {loss.item():.4f})")
    return tps


torch_llama.ATTENTION = "eager"
eager_math = measure(False)
torch_llama.ATTENTION = "sdpa"
eager = measure(False)
try:
    compiled = measure(True)
except Exception as e:  # torch.compile needs triton and a working toolchain; report, do not hide
    print(f"pytorch torch.compile: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
          file=sys.stderr)
    compiled = 0.0
if compiled > 0:
    print(f"ratio (torch.compile / eager): {compiled / eager:.2f}")
print(f"RESULT {eager:.1f} {compiled:.1f} {eager_math:.1f}")
