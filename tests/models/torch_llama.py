#!/usr/bin/python3
"""The LLaMA oracle for tests/models/llama_test.cc.

A reference LLaMA in plain torch that mirrors Hugging Face's modeling_llama
(LlamaForCausalLM: RMSNorm computed in at least fp32, rotate_half RoPE, GQA via
repeat_kv, causal softmax, SwiGLU MLP) with the same state_dict names, and the
fixtures the C++ tests compare against.

  torch_llama.py OUT_DIR           writes the fixtures (JSON files of named flat
                                   lists, row-major, PyTorch layouts, plus one
                                   Hugging Face style model directory)
  torch_llama.py --check-hf DIR    loads a model directory as from_pretrained
                                   would (config.json keys, strict state_dict),
                                   runs DIR/tokens.json through it and writes
                                   DIR/logits.json
  torch_llama.py --check-lora DIR  the same for DIR/base with the PEFT adapter
                                   directory DIR/adapter applied (PEFT's names,
                                   shapes and config keys)
  torch_llama.py --check-loss DIR  the loss with ignore_index=-100 of each row
                                   of DIR/rows.json under the model directory
                                   DIR, into DIR/losses.json

Where Hugging Face's `transformers` and `peft` are importable (they are not
Debian packages; the GPU machine has them), --check-hf loads the directory with
LlamaForCausalLM.from_pretrained, --check-lora with PeftModel.from_pretrained,
and the fixture's model directories are written by save_pretrained: the real
libraries are then the oracle. ESTUARY_REQUIRE_HF=1 makes their absence an
error, so a run that must use them cannot fall back silently.

Inputs and weights are drawn in fp32 (so C++ holds them exactly); the oracle
then computes in fp64, so a C++ error is C++'s own.
"""
import json
import math
import os
import struct
import sys

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:  # fail loudly: these tests are the numerics oracle
    sys.exit(f"torch_llama.py: PyTorch and numpy are required (python3-torch, python3-numpy): {e}")

COMPUTE = torch.float64


def hugging_face():
    """(transformers, peft) where both import, else None (or exit, under ESTUARY_REQUIRE_HF=1)."""
    try:
        import peft
        import transformers
        return transformers, peft
    except ImportError as e:
        if os.environ.get("ESTUARY_REQUIRE_HF") == "1":
            sys.exit(f"torch_llama.py: ESTUARY_REQUIRE_HF=1 but transformers/peft do not import: {e}")
        return None


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


# ----------------------------------------------------------------------------
# The reference model (names and structure as transformers' modeling_llama).

class LlamaConfig:
    def __init__(self, vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
                 num_key_value_heads, max_position_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=False):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.tie_word_embeddings = tie_word_embeddings
        self.head_dim = hidden_size // num_attention_heads

    def to_json(self):
        return dict(vars(self))


def upcast(x):
    # Hugging Face computes RMSNorm and softmax in fp32 under half precision;
    # the oracle runs in fp64, which must not be cut down to fp32.
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = upcast(hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(COMPUTE) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv_freq = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(x.dtype)
        freqs = (inv_freq @ position_ids[:, None, :].to(x.dtype)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


# "eager" is modeling_llama's eager attention (the oracle's); the GPU benchmark
# sets "sdpa", transformers' default, F.scaled_dot_product_attention (fused
# flash attention on a GPU), the strongest baseline plain PyTorch offers.
ATTENTION = "eager"


def causal_attention(query, key, value, n_rep):
    """The attention of modeling_llama on [b, heads, t, head_dim] tensors
    (probs is None under sdpa, which never forms them)."""
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    if ATTENTION == "sdpa":
        return F.scaled_dot_product_attention(query, key, value, is_causal=True), None
    t = query.shape[2]
    scores = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(query.shape[-1])
    mask = torch.full((t, t), torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device).triu(1)
    probs = F.softmax(upcast(scores + mask), dim=-1).to(query.dtype)
    return torch.matmul(probs, value), probs


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out, _ = causal_attention(q, k, v, self.num_heads // self.num_key_value_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :].expand(input_ids.shape[0], -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


# ----------------------------------------------------------------------------
# LoRA, as PEFT's LoraLayer (lora.Linear) computes it with lora_dropout 0:
# y = base_layer(x) + lora_B(lora_A(x)) * (lora_alpha / r). The names follow
# PEFT's: the wrapped Linear becomes base_layer, and PEFT saves the adapters
# as "base_model.model." + "<module>.lora_A.weight" (the adapter name
# "default" removed).

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."


class LoraLinear(nn.Module):
    def __init__(self, base_layer, r, lora_alpha):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False)
        self.scaling = lora_alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model, r, lora_alpha, target_modules):
    """Wraps the targeted projections of every block (in place, as PEFT's
    inject_adapter does) and freezes every base weight. Returns the adapters'
    parameters by PEFT's saved names, in the model's module order."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LORA_MODULES:
                if name in target_modules and hasattr(parent, name):
                    setattr(parent, name, LoraLinear(getattr(parent, name), r, lora_alpha))
    return {PEFT_PREFIX + k: p for k, p in model.named_parameters() if ".lora_" in k}


def check_lora(work_dir):
    """Loads WORK_DIR/base (a Hugging Face directory) and WORK_DIR/adapter (a
    PEFT adapter directory) the way PeftModel.from_pretrained does for these
    keys (strict names and shapes), runs WORK_DIR/tokens.json and writes
    WORK_DIR/logits.json."""
    base_dir, adapter_dir = os.path.join(work_dir, "base"), os.path.join(work_dir, "adapter")
    hf = hugging_face()
    if hf is not None:
        transformers, peft = hf
        base = transformers.LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=COMPUTE,
                                                             attn_implementation="eager")
        model = peft.PeftModel.from_pretrained(base, adapter_dir, torch_dtype=COMPUTE).eval()
        print(f"torch_llama.py: loaded with peft {peft.__version__}, transformers {transformers.__version__}",
              file=sys.stderr)
        with open(os.path.join(work_dir, "tokens.json")) as f:
            tokens = torch.tensor(json.load(f)["tokens"])
        with open(os.path.join(work_dir, "logits.json"), "w") as f:
            json.dump({"logits": flat(hf_logits(model, tokens))}, f)
        return
    config = config_from_hf_json(os.path.join(base_dir, "config.json"))
    tensors, _ = read_safetensors(os.path.join(base_dir, "model.safetensors"))
    model = LlamaForCausalLM(config)
    model.load_state_dict(tensors, strict=not config.tie_word_embeddings)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        ac = json.load(f)
    assert ac["peft_type"] == "LORA" and ac["task_type"] == "CAUSAL_LM" and ac["bias"] == "none", ac
    assert not ac.get("use_rslora") and not ac.get("use_dora") and not ac.get("fan_in_fan_out"), ac
    assert isinstance(ac["target_modules"], list), ac
    adapters = add_lora(model, ac["r"], ac["lora_alpha"], ac["target_modules"])
    saved, metadata = read_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert metadata is not None and metadata.get("format") == "pt", metadata
    assert set(saved) == set(adapters), f"names differ: {sorted(set(saved) ^ set(adapters))}"
    with torch.no_grad():
        for name, p in adapters.items():
            assert tuple(saved[name].shape) == tuple(p.shape), f"{name}: {saved[name].shape} vs {p.shape}"
            p.copy_(saved[name])
    model.to(COMPUTE)
    with open(os.path.join(work_dir, "tokens.json")) as f:
        tokens = torch.tensor(json.load(f)["tokens"])
    with torch.no_grad():
        logits = model(tokens)
    with open(os.path.join(work_dir, "logits.json"), "w") as f:
        json.dump({"logits": flat(logits)}, f)


# ----------------------------------------------------------------------------
# Hugging Face model directories (config.json + model.safetensors), by hand:
# neither transformers nor safetensors is a Debian package.

def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", f"{path}: {name} is {info['dtype']}"
        begin, end = info["data_offsets"]
        tensors[name] = torch.from_numpy(np.frombuffer(body[begin:end], dtype="<f4").copy()).reshape(info["shape"])
    return tensors, header.get("__metadata__")


def write_safetensors(path, tensors):
    """As safetensors.torch.save_file does it: format "pt" metadata, tensors in
    name order (not state_dict order), data 8-byte aligned."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        blob = tensors[name].detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def config_from_hf_json(path):
    """The keys LlamaConfig reads, with its defaults."""
    with open(path) as f:
        j = json.load(f)
    assert "LlamaForCausalLM" in j.get("architectures", ["LlamaForCausalLM"]), j
    assert j.get("model_type", "llama") == "llama" and j.get("hidden_act", "silu") == "silu", j
    heads = j.get("num_attention_heads", 32)
    return LlamaConfig(j.get("vocab_size", 32000), j.get("hidden_size", 4096), j.get("intermediate_size", 11008),
                       j.get("num_hidden_layers", 32), heads, j.get("num_key_value_heads") or heads,
                       j.get("max_position_embeddings", 2048), j.get("rms_norm_eps", 1e-6),
                       j.get("rope_theta", 10000.0), j.get("tie_word_embeddings", False))


def check_hf(model_dir):
    hf = hugging_face()
    if hf is not None:
        transformers = hf[0]
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=COMPUTE,
                                                              attn_implementation="eager").eval()
        print(f"torch_llama.py: loaded with transformers {transformers.__version__}", file=sys.stderr)
        with open(os.path.join(model_dir, "tokens.json")) as f:
            tokens = torch.tensor(json.load(f)["tokens"])
        with open(os.path.join(model_dir, "logits.json"), "w") as f:
            json.dump({"logits": flat(hf_logits(model, tokens))}, f)
        return
    config = config_from_hf_json(os.path.join(model_dir, "config.json"))
    tensors, metadata = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    assert metadata is not None and metadata.get("format") == "pt", f"from_pretrained needs format=pt: {metadata}"
    model = LlamaForCausalLM(config)
    expected = dict(model.named_parameters())  # the tied lm_head is not a separate parameter
    assert set(tensors) == set(expected), f"names differ: {sorted(set(tensors) ^ set(expected))}"
    for name, t in tensors.items():
        assert tuple(t.shape) == tuple(expected[name].shape), f"{name}: {t.shape} vs {expected[name].shape}"
    model.load_state_dict(tensors, strict=not config.tie_word_embeddings)
    model.to(COMPUTE)
    with open(os.path.join(model_dir, "tokens.json")) as f:
        tokens = torch.tensor(json.load(f)["tokens"])
    with torch.no_grad():
        logits = model(tokens)
    with open(os.path.join(model_dir, "logits.json"), "w") as f:
        json.dump({"logits": flat(logits)}, f)


def check_loss(model_dir):
    """The loss F.cross_entropy(ignore_index=-100) gives for each row of
    MODEL_DIR/rows.json ({"tokens": [[...]], "targets": [[...]]}) under the
    model directory's weights, into MODEL_DIR/losses.json (estuary-lm score's
    oracle; the reference model, not transformers, so it runs anywhere)."""
    config = config_from_hf_json(os.path.join(model_dir, "config.json"))
    tensors, _ = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    model = LlamaForCausalLM(config)
    model.load_state_dict(tensors, strict=not config.tie_word_embeddings)
    model.to(COMPUTE)
    with open(os.path.join(model_dir, "rows.json")) as f:
        rows = json.load(f)
    losses = []
    with torch.no_grad():
        for tokens, targets in zip(rows["tokens"], rows["targets"]):
            logits = model(torch.tensor([tokens]))[0]
            losses.append(float(F.cross_entropy(logits, torch.tensor(targets), ignore_index=IGNORE_INDEX)))
    with open(os.path.join(model_dir, "losses.json"), "w") as f:
        json.dump({"losses": losses}, f)


# ----------------------------------------------------------------------------
# Fixtures.

def flat(t):
    return [float(v) for v in t.detach().reshape(-1).tolist()]


def rand(*shape, scale=1.0):
    """fp32 draws, held in fp64 for the computation."""
    return (torch.randn(*shape) * scale).to(torch.float32).to(COMPUTE).requires_grad_()


def save(out_dir, name, **values):
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({k: flat(v) if torch.is_tensor(v) else v for k, v in values.items()}, f)


def make_model(config, seed):
    """Random fp32 weights: matrices normal(0, 0.1), norms 1 + normal(0, 0.1)
    (not ones, so the norms' gradients matter), then fp64."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.1 * torch.randn(p.shape))
    return model.to(COMPUTE)


def write_op_fixtures(out_dir):
    torch.manual_seed(2024)

    # Embedding, with repeated ids so the scatter-add matters.
    table, tokens = rand(11, 6), torch.tensor([[3, 7, 3, 0, 10], [7, 7, 1, 3, 5]])
    out = F.embedding(tokens, table)
    dout = rand(*out.shape)
    out.backward(dout)
    save(out_dir, "op_embedding", tokens=flat(tokens), table=table, out=out, dout=dout, dtable=table.grad)

    # RMSNorm.
    norm = LlamaRMSNorm(16, 1e-5).to(COMPUTE)
    with torch.no_grad():
        norm.weight.copy_(rand(16, scale=0.3) + 1)
    x = rand(7, 16, scale=2.0)
    y = norm(x)
    dy = rand(*y.shape)
    y.backward(dy)
    save(out_dir, "op_rmsnorm", eps=1e-5, x=x, weight=norm.weight, y=y, dy=dy, dx=x.grad, dweight=norm.weight.grad)

    # RoPE on q [b, t, heads * head_dim] rows, theta 500 (not the default).
    b, t, heads, head_dim, theta = 2, 6, 3, 8, 500.0
    config = LlamaConfig(1, heads * head_dim, 1, 1, heads, heads, t, rope_theta=theta)
    x = rand(b, t, heads * head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(t)[None, :].expand(b, -1))
    xh = x.view(b, t, heads, head_dim).transpose(1, 2)
    y, _ = apply_rotary_pos_emb(xh, xh, cos, sin)
    y = y.transpose(1, 2).reshape(b, t, -1)
    dy = rand(*y.shape)
    y.backward(dy)
    save(out_dir, "op_rope", batch=b, seq=t, heads=heads, head_dim=head_dim, theta=theta, x=x, y=y, dy=dy,
         dx=x.grad)

    # SwiGLU on a fused [n, 2 * hidden] gate/up buffer.
    gate_up = rand(5, 2 * 9, scale=2.0)
    gate, up = gate_up[:, :9], gate_up[:, 9:]
    out = F.silu(gate) * up
    dout = rand(*out.shape)
    out.backward(dout)
    save(out_dir, "op_swiglu", hidden=9, gate_up=gate_up, out=out, dout=dout, dgate_up=gate_up.grad)

    # Cross-entropy over a vocabulary-sized row, mean over the rows.
    logits, targets = rand(9, 300, scale=3.0), torch.randint(0, 300, (9,))
    loss = F.cross_entropy(logits, targets)
    loss.backward()
    save(out_dir, "op_cross_entropy", vocab=300, logits=logits, targets=flat(targets), loss=[float(loss)],
         dlogits=logits.grad)

    # The same with ignored rows (ignore_index=-100, the first and two more):
    # the mean is over the scored rows only.
    logits = logits.detach().clone().requires_grad_()
    targets = targets.clone()
    targets[[0, 4, 5]] = IGNORE_INDEX
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    loss.backward()
    save(out_dir, "op_cross_entropy_ignored", vocab=300, logits=logits, targets=flat(targets), loss=[float(loss)],
         dlogits=logits.grad)

    # Causal attention on a fused qkv buffer: grouped, multi-query, multi-head.
    for name, heads, kv_heads in (("gqa", 4, 2), ("mqa", 4, 1), ("mha", 2, 2)):
        b, t, head_dim = 2, 7, 8
        qkv = rand(b, t, (heads + 2 * kv_heads) * head_dim)
        q = qkv[..., : heads * head_dim].view(b, t, heads, head_dim).transpose(1, 2)
        k = qkv[..., heads * head_dim:(heads + kv_heads) * head_dim].view(b, t, kv_heads, head_dim).transpose(1, 2)
        v = qkv[..., (heads + kv_heads) * head_dim:].view(b, t, kv_heads, head_dim).transpose(1, 2)
        out, probs = causal_attention(q, k, v, heads // kv_heads)
        out = out.transpose(1, 2).reshape(b, t, heads * head_dim)
        dout = rand(*out.shape)
        out.backward(dout)
        save(out_dir, "op_attention_" + name, batch=b, seq=t, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
             qkv=qkv, probs=probs, out=out, dout=dout, dqkv=qkv.grad)


# Two decoders: untied with grouped-query attention, and tied with one kv
# head, another theta and eps, and seq == max_seq_len.
DECODERS = {
    "untied_gqa": (LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False), 3, 9),
    "tied_mqa": (LlamaConfig(vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                             num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=8,
                             rms_norm_eps=1e-6, rope_theta=500.0, tie_word_embeddings=True), 2, 8),
}

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index, and Hugging Face's label for "no loss here"


def mask_prompt(targets, seq):
    """Targets as an instruction example's: each sequence's first third (the
    prompt) and its last position (padding) ignored, the rest scored."""
    masked = targets.clone()
    masked[:, : seq // 3] = IGNORE_INDEX
    masked[:, -1] = IGNORE_INDEX
    return masked


def write_decoder_fixtures(out_dir):
    for index, (name, (config, batch, seq)) in enumerate(DECODERS.items()):
        model = make_model(config, seed=100 + index)
        g = torch.Generator().manual_seed(200 + index)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        targets = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
        loss.backward()
        grads = {k + ".grad": p.grad.detach().clone() for k, p in model.named_parameters()}

        # The same model and tokens with the prompts' targets ignored.
        model.zero_grad()
        masked = mask_prompt(targets, seq)
        masked_loss = F.cross_entropy(model(tokens).reshape(-1, config.vocab_size), masked.reshape(-1),
                                      ignore_index=IGNORE_INDEX)
        masked_loss.backward()
        save(out_dir, "masked_decoder_" + name, targets=flat(masked), loss=[float(masked_loss)],
             **{k + ".grad": p.grad for k, p in model.named_parameters()})
        # named_parameters() is the state_dict less the tied lm_head.weight.
        shapes = [list(v.shape) for v in weights.values()]
        save(out_dir, "decoder_" + name, config=config.to_json(), batch=batch, seq=seq, tokens=flat(tokens),
             targets=flat(targets), names=list(weights), shapes=shapes, logits=logits, loss=[float(loss)],
             **weights, **grads)

        # Ten AdamW steps on the same batch: the loss and the global gradient
        # norm before each step, and the weights after the last.
        model = make_model(config, seed=100 + index)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        losses, grad_norms = [], []
        for _ in range(10):
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens).reshape(-1, config.vocab_size), targets.reshape(-1))
            loss.backward()
            grad_norms.append(float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))))
            opt.step()
            losses.append(float(loss))
        save(out_dir, "adamw_" + name, lr=ADAMW["lr"], beta1=ADAMW["betas"][0], beta2=ADAMW["betas"][1],
             eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], losses=losses, grad_norms=grad_norms,
             **{k + ".after": v for k, v in model.named_parameters()})

        # A Hugging Face style directory of the same weights, as save_pretrained
        # writes it (tied lm_head left out), for the C++ loader.
        hf_dir = os.path.join(out_dir, "hf_" + name)
        os.makedirs(hf_dir, exist_ok=True)
        write_safetensors(os.path.join(hf_dir, "model.safetensors"), weights)
        hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
                     "eos_token_id": 2, "hidden_act": "silu", "hidden_size": config.hidden_size,
                     "intermediate_size": config.intermediate_size,
                     "max_position_embeddings": config.max_position_embeddings,
                     "num_attention_heads": config.num_attention_heads,
                     "num_hidden_layers": config.num_hidden_layers,
                     "num_key_value_heads": config.num_key_value_heads, "rms_norm_eps": config.rms_norm_eps,
                     "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings,
                     "torch_dtype": "float32", "transformers_version": "4.40.0", "use_cache": True,
                     "vocab_size": config.vocab_size}
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        hf = hugging_face()
        if hf is not None:  # the real save_pretrained overwrites both files
            transformers = hf[0]
            hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
                k: v for k, v in hf_config.items() if k not in ("architectures", "transformers_version")}))
            hf_model.load_state_dict(weights, strict=not config.tie_word_embeddings)
            hf_model.save_pretrained(hf_dir, safe_serialization=True)


# LoRA on both decoders: every projection of the untied one (rank 4, alpha 8),
# the attention of the tied one (rank 3, alpha 5: a scale that is not a power
# of two). A and B are both random and non-zero, so the adapter path matters.
LORA = {
    "untied_gqa": dict(r=4, lora_alpha=8.0, target_modules=list(LORA_MODULES)),
    "tied_mqa": dict(r=3, lora_alpha=5.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}
LORA_ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_lora_model(config, name, index):
    model = make_model(config, seed=100 + index)
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    spec = LORA[name]
    adapters = add_lora(model, spec["r"], spec["lora_alpha"], spec["target_modules"])
    torch.manual_seed(300 + index)
    with torch.no_grad():
        for p in adapters.values():
            p.copy_((0.2 * torch.randn(p.shape)).to(torch.float32))
    model.to(COMPUTE)
    return model, weights, adapters


def write_lora_fixtures(out_dir):
    for index, (name, (config, batch, seq)) in enumerate(DECODERS.items()):
        model, weights, adapters = make_lora_model(config, name, index)
        g = torch.Generator().manual_seed(200 + index)  # the decoder fixture's tokens
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        targets = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        start = {k: v.detach().clone() for k, v in adapters.items()}
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
        loss.backward()
        frozen_grads = [k for k, p in model.named_parameters() if p.grad is not None and ".lora_" not in k]
        assert not frozen_grads, frozen_grads
        grads = {k + ".grad": p.grad.detach().clone() for k, p in adapters.items()}  # zero_grad may reuse them

        # The same with the prompts' targets ignored.
        for p in adapters.values():
            p.grad = None
        masked = mask_prompt(targets, seq)
        masked_loss = F.cross_entropy(model(tokens).reshape(-1, config.vocab_size), masked.reshape(-1),
                                      ignore_index=IGNORE_INDEX)
        masked_loss.backward()
        save(out_dir, "masked_lora_" + name, targets=flat(masked), loss=[float(masked_loss)],
             **{k + ".grad": p.grad for k, p in adapters.items()})
        for p in adapters.values():
            p.grad = None

        # Five AdamW steps over the adapters only.
        opt = torch.optim.AdamW(list(adapters.values()), **LORA_ADAMW)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            step_loss = F.cross_entropy(model(tokens).reshape(-1, config.vocab_size), targets.reshape(-1))
            step_loss.backward()
            opt.step()
            losses.append(float(step_loss))
        after = {k + ".after": p for k, p in adapters.items()}
        spec = LORA[name]
        save(out_dir, "lora_" + name, config=config.to_json(), batch=batch, seq=seq, tokens=flat(tokens),
             targets=flat(targets), r=spec["r"], lora_alpha=spec["lora_alpha"],
             target_modules=spec["target_modules"], adapter_names=list(adapters),
             adapter_shapes=[list(p.shape) for p in adapters.values()], logits=logits, loss=[float(loss)],
             lr=LORA_ADAMW["lr"], beta1=LORA_ADAMW["betas"][0], beta2=LORA_ADAMW["betas"][1],
             eps=LORA_ADAMW["eps"], weight_decay=LORA_ADAMW["weight_decay"], losses=losses,
             **weights, **start, **grads, **after)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--check-hf":
        check_hf(sys.argv[2])
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--check-lora":
        check_lora(sys.argv[2])
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--check-loss":
        check_loss(sys.argv[2])
        return
    if len(sys.argv) != 2:
        sys.exit("usage: torch_llama.py OUT_DIR | --check-hf MODEL_DIR | --check-lora WORK_DIR | --check-loss MODEL_DIR")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    write_op_fixtures(out_dir)
    write_decoder_fixtures(out_dir)
    write_lora_fixtures(out_dir)


if __name__ == "__main__":
    main()
