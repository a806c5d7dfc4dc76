#!/usr/bin/python3
"""The transformers + peft side of `bench/lora_gpu --peft`: LoRA fine-tuning
of a model built from a Hugging Face config.json, the way its users run it —
the base in bf16, the adapters in fp32 under bf16 autocast, transformers'
default attention (sdpa), fused torch.optim.AdamW over the adapters — on the
same GPU, with random tokens, after the Estuary runs have given their memory
back. Prints its report, then a line "RESULT <tokens/s> <peak allocated
bytes> <drop in free device bytes>" for lora_gpu to read (zeros where nothing
could be measured, with the reason on standard error)."""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True, help="a directory holding config.json")
for name, default in (("seq", 1024), ("batch", 8), ("steps", 30), ("warmup", 3), ("rank", 8)):
    parser.add_argument("--" + name, type=int, default=default)
parser.add_argument("--alpha", type=float, default=16)
parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
a = parser.parse_args()


def nothing(why):
    print(f"torch_peft_gpu: {why}; nothing measured", file=sys.stderr)
    print("RESULT 0 0 0")
    sys.exit(0)


if not torch.cuda.is_available():
    nothing("no CUDA device visible to PyTorch")
try:
    import peft
    import transformers
except ImportError as e:
    nothing(f"transformers and peft are needed ({e})")

torch.cuda.init()
torch.cuda.reset_peak_memory_stats()
free_before = torch.cuda.mem_get_info()[0]

config = transformers.AutoConfig.from_pretrained(a.config)
config.use_cache = False  # training: no KV cache
torch.manual_seed(1)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
model.to(device="cuda", dtype=torch.bfloat16)
lora = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                       target_modules=a.targets.split(","))
model = peft.get_peft_model(model, lora)
trainable = [p for p in model.parameters() if p.requires_grad]
for p in trainable:  # fp32 adapters over the bf16 base, as peft's autocast_adapter_dtype makes them
    p.data = p.data.float()
model.train()
opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=True)
vocab = config.vocab_size
tokens = torch.randint(0, vocab, (a.batch, a.seq), device="cuda")
targets = torch.randint(0, vocab, (a.batch, a.seq), device="cuda")


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=tokens).logits
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    opt.step()
    return loss


for _ in range(a.warmup):
    first = step()
first = first.item()
drop = free_before - torch.cuda.mem_get_info()[0]
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(a.steps):
    loss = step()
torch.cuda.synchronize()
seconds = (time.perf_counter() - start) / a.steps
peak = torch.cuda.max_memory_allocated()
tps = a.batch * a.seq / seconds
n_trainable = sum(p.numel() for p in trainable)
print(f"transformers {transformers.__version__} + peft {peft.__version__} (bf16 base, fp32 adapters, "
      f"{getattr(model.config, '_attn_implementation', 'default')} attention): {n_trainable / 1e6:.2f}M trainable, "
      f"{a.steps} steps: {tps:,.0f} tokens/s, {seconds * 1e3:.1f} ms/step (loss {first:.4f} -> {loss.item():.4f})\n"
      f"  memory: peak allocated {peak / 2**30:.3f} GiB (free device memory dropped by {drop / 2**30:.3f} GiB)")
print(f"RESULT {tps:.1f} {peak} {drop}")
