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
    """The keys of transformers' LlamaConfig this oracle reads; qkv_bias and
    o_bias are attention_bias split as Qwen2 needs (biases on q, k, v only)."""
    def __init__(self, vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
                 num_key_value_heads, max_position_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=False, head_dim=None, rope_scaling=None, qkv_bias=False, o_bias=False,
                 mlp_bias=False):
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
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rope_scaling = rope_scaling
        self.qkv_bias = qkv_bias
        self.o_bias = o_bias
        self.mlp_bias = mlp_bias

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


def rope_inverse_frequencies(config):
    """modeling_rope_utils' default, linear and llama3 inverse frequencies (in fp64)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(COMPUTE) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths stretched by factor, short ones kept, a blend between.
        stretched = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * stretched / factor + smooth * stretched
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, stretched)
    assert kind == "default", scaling
    return inv_freq


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

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
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)

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
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

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

SAFETENSORS_DTYPES = {"F32": (torch.float32, torch.int32), "BF16": (torch.bfloat16, torch.int16),
                      "F16": (torch.float16, torch.int16)}


def read_safetensors(path):
    """name -> tensor in the stored dtype (F32, BF16 or F16), and the metadata."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] in SAFETENSORS_DTYPES, f"{path}: {name} is {info['dtype']}"
        dtype, bits = SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        raw = np.frombuffer(body[begin:end], dtype="<i4" if bits == torch.int32 else "<i2").copy()
        tensors[name] = torch.from_numpy(raw).view(dtype).reshape(info["shape"])
    return tensors, header.get("__metadata__")


def write_safetensors(path, tensors, dtype="F32"):
    """As safetensors.torch.save_file does it: format "pt" metadata, tensors in
    name order (not state_dict order), data 8-byte aligned. Each tensor is
    rounded to `dtype` by torch (tensor.to(torch.bfloat16) and the like)."""
    torch_dtype, bits = SAFETENSORS_DTYPES[dtype]
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch_dtype).contiguous()
        blob = t.view(bits).numpy().astype("<i4" if bits == torch.int32 else "<i2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def config_from_hf_json(path):
    """The keys LlamaConfig (MistralConfig, Qwen2Config) reads, with its defaults."""
    with open(path) as f:
        j = json.load(f)
    arch = [a for a in j.get("architectures", ["LlamaForCausalLM"]) if a in ARCHITECTURES]
    assert len(arch) == 1, j
    arch = arch[0]
    assert j.get("model_type", ARCHITECTURES[arch]) == ARCHITECTURES[arch] and j.get("hidden_act", "silu") == "silu", j
    heads = j.get("num_attention_heads", 32)
    attention_bias = j.get("attention_bias", False) if arch == "LlamaForCausalLM" else False
    qwen2 = arch == "Qwen2ForCausalLM"
    return LlamaConfig(j.get("vocab_size", 32000), j.get("hidden_size", 4096), j.get("intermediate_size", 11008),
                       j.get("num_hidden_layers", 32), heads, j.get("num_key_value_heads") or heads,
                       j.get("max_position_embeddings", 2048), j.get("rms_norm_eps", 1e-6),
                       j.get("rope_theta", 10000.0), j.get("tie_word_embeddings", False), head_dim=j.get("head_dim"),
                       rope_scaling=j.get("rope_scaling"), qkv_bias=attention_bias or qwen2, o_bias=attention_bias,
                       mlp_bias=j.get("mlp_bias", False))


def hf_config_json(config, architecture="LlamaForCausalLM"):
    """config.json as save_pretrained writes it for `architecture`."""
    j = {"architectures": [architecture], "model_type": ARCHITECTURES[architecture], "bos_token_id": 1,
         "eos_token_id": 2, "hidden_act": "silu", "hidden_size": config.hidden_size,
         "intermediate_size": config.intermediate_size, "max_position_embeddings": config.max_position_embeddings,
         "num_attention_heads": config.num_attention_heads, "num_hidden_layers": config.num_hidden_layers,
         "num_key_value_heads": config.num_key_value_heads, "rms_norm_eps": config.rms_norm_eps,
         "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings,
         "torch_dtype": "float32", "transformers_version": "4.40.0", "use_cache": True,
         "vocab_size": config.vocab_size}
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        j["head_dim"] = config.head_dim
    if config.rope_scaling:
        j["rope_scaling"] = config.rope_scaling
    if architecture == "LlamaForCausalLM":
        assert config.qkv_bias == config.o_bias, "Llama's attention_bias covers q, k, v and o"
        j["attention_bias"] = config.qkv_bias
        j["mlp_bias"] = config.mlp_bias
    elif architecture == "Qwen2ForCausalLM":
        assert config.qkv_bias and not config.o_bias and not config.mlp_bias
        j["use_sliding_window"] = False
        j["sliding_window"] = config.max_position_embeddings
    else:
        assert not (config.qkv_bias or config.o_bias or config.mlp_bias)
        j["sliding_window"] = None
    return j


def check_hf(model_dir):
    hf = hugging_face()
    if hf is not None:
        transformers = hf[0]
        with open(os.path.join(model_dir, "config.json")) as f:
            architecture = json.load(f)["architectures"][0]
        model = getattr(transformers, architecture).from_pretrained(model_dir, torch_dtype=COMPUTE,
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
    model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=not config.tie_word_embeddings)
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
    """Random fp32 weights: matrices and biases normal(0, 0.1), norms
    1 + normal(0, 0.1) (not ones, so the norms' gradients matter), then fp64."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape))
            elif p.dim() == 1:
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
    # What LlamaForCausalLM also allows: a head_dim that is not hidden / heads
    # (q_proj [heads * 12, 32]), attention_bias (q, k, v and o), mlp_bias and
    # linear RoPE scaling.
    "biased_head_dim": (LlamaConfig(vocab_size=45, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=12,
                                    rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False, head_dim=12,
                                    rope_scaling={"rope_type": "linear", "factor": 2.5}, qkv_bias=True, o_bias=True,
                                    mlp_bias=True), 2, 7),
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
        hf_config = hf_config_json(config)
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        hf = hugging_face()
        if hf is not None:  # the real save_pretrained overwrites both files
            transformers = hf[0]
            hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
                k: v for k, v in hf_config.items() if k not in ("architectures", "transformers_version")}))
            hf_model.config.head_dim = config.head_dim
            hf_model.load_state_dict(weights, strict=not config.tie_word_embeddings)
            hf_model.save_pretrained(hf_dir, safe_serialization=True)


# LoRA on both decoders: every projection of the untied one (rank 4, alpha 8),
# the attention of the tied one (rank 3, alpha 5: a scale that is not a power
# of two). A and B are both random and non-zero, so the adapter path matters.
LORA = {
    "untied_gqa": dict(r=4, lora_alpha=8.0, target_modules=list(LORA_MODULES)),
    "tied_mqa": dict(r=3, lora_alpha=5.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "biased_head_dim": dict(r=2, lora_alpha=3.0, target_modules=list(LORA_MODULES)),
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


# Published models' configurations, cut to two layers and a 1000-token
# vocabulary (and TinyLlama's and Llama 3.2's hidden size to 512, keeping
# their heads and grouping) so that fp64 torch and the C++ test stay quick:
# architecture, config, batch, seq. Each is loaded by the C++ side through
# LoadHfCheckpoint at a context of 32, whatever max_position_embeddings says.
REAL = {
    # SmolLM-135M: 9 heads of 64, 3 kv heads, tied.
    "smollm_135m": ("LlamaForCausalLM", LlamaConfig(
        vocab_size=1000, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True), 2, 16),
    # TinyLlama-1.1B: 32 heads, 4 kv heads, intermediate 2.75 x hidden, untied (hidden 2048 -> 512).
    "tinyllama_1b": ("LlamaForCausalLM", LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False), 2, 16),
    # Llama-3.2-1B: head_dim 64, 4 query heads per kv head, llama3 RoPE scaling,
    # theta 500000, tied (hidden 2048 -> 512: 8 heads, 2 kv heads).
    "llama32_1b": ("LlamaForCausalLM", LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=True, head_dim=64,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}), 2, 16),
    # Qwen2-0.5B: 14 heads of 64, 2 kv heads, biases on q, k and v, tied (intermediate 4864 -> 1216).
    "qwen2_05b": ("Qwen2ForCausalLM", LlamaConfig(
        vocab_size=1000, hidden_size=896, intermediate_size=1216, num_hidden_layers=2, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, qkv_bias=True), 2, 16),
}
REAL_LORA = dict(r=8, lora_alpha=16.0, target_modules=list(LORA_MODULES))


def make_real_model(config, seed):
    """Hugging Face's init scale: matrices normal(0, 0.02); biases normal(0, 0.02);
    norms 1 + normal(0, 0.1) so their gradients matter. fp32 draws, then fp64."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith(".bias"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.02 * torch.randn(p.shape))
    return model.to(COMPUTE)


def write_hf_dir(path, config, architecture, weights, dtype="F32"):
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"), weights, dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_json(config, architecture), f, indent=2)


def write_sharded_dir(path, config, architecture, weights, shards=3):
    """save_pretrained's sharded form: model-0000i-of-0000n.safetensors and an
    index whose weight_map names each tensor's shard."""
    os.makedirs(path, exist_ok=True)
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names[i::shards]}
        write_safetensors(os.path.join(path, file), part)
        weight_map.update({k: file for k in part})
    total = sum(4 * t.numel() for t in weights.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_json(config, architecture), f, indent=2)


def write_real_fixtures(out_dir):
    for index, (name, (architecture, config, batch, seq)) in enumerate(REAL.items()):
        model = make_real_model(config, seed=500 + index)
        g = torch.Generator().manual_seed(600 + index)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        targets = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        weights = {k: v.detach().to(torch.float32).clone() for k, v in model.named_parameters()}
        write_hf_dir(os.path.join(out_dir, "real_" + name), config, architecture, weights)
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
        loss.backward()
        expected = {"logits": logits.detach()}
        expected.update({k + ".grad": p.grad for k, p in model.named_parameters()})

        # LoRA on every projection, A and B random (so both paths matter).
        lora_model = make_real_model(config, seed=500 + index)
        adapters = add_lora(lora_model, REAL_LORA["r"], REAL_LORA["lora_alpha"], REAL_LORA["target_modules"])
        torch.manual_seed(700 + index)
        with torch.no_grad():
            for p in adapters.values():
                p.copy_((0.02 * torch.randn(p.shape)).to(torch.float32))
        lora_model.to(COMPUTE)
        lora_logits = lora_model(tokens)
        lora_loss = F.cross_entropy(lora_logits.reshape(-1, config.vocab_size), targets.reshape(-1))
        lora_loss.backward()
        expected.update({"lora_logits": lora_logits.detach()})
        expected.update({"lora:" + k: p.detach() for k, p in adapters.items()})
        expected.update({"lora:" + k + ".grad": p.grad for k, p in adapters.items()})
        write_safetensors(os.path.join(out_dir, f"real_{name}_expected.safetensors"), expected)
        save(out_dir, "real_" + name, architecture=architecture, batch=batch, seq=seq, tokens=flat(tokens),
             targets=flat(targets), loss=[float(loss)], lora_loss=[float(lora_loss)], lora=REAL_LORA,
             inv_freq=rope_inverse_frequencies(config), names=list(weights))

        if name == "smollm_135m":
            # The same weights stored as published models are: rounded by torch
            # to bf16 and to f16, with what torch makes of them in fp32; and in
            # three shards.
            for dtype, torch_dtype in (("BF16", torch.bfloat16), ("F16", torch.float16)):
                write_hf_dir(os.path.join(out_dir, f"real_{name}_{dtype.lower()}"), config, architecture, weights,
                             dtype)
                write_safetensors(os.path.join(out_dir, f"real_{name}_{dtype.lower()}_as_f32.safetensors"),
                                  {k: v.to(torch_dtype).to(torch.float32) for k, v in weights.items()})
            write_sharded_dir(os.path.join(out_dir, f"real_{name}_sharded"), config, architecture, weights)

    # Every half-precision bit pattern, and the fp32 torch widens each to.
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    halves = {"f16": patterns.view(torch.float16), "bf16": patterns.view(torch.bfloat16)}
    path = os.path.join(out_dir, "halves.safetensors")
    write_safetensors(path + ".f16", {"f16": halves["f16"]}, "F16")
    write_safetensors(path + ".bf16", {"bf16": halves["bf16"]}, "BF16")
    write_safetensors(path, {k + "_as_f32": v.to(torch.float32) for k, v in halves.items()})


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
    write_real_fixtures(out_dir)


if __name__ == "__main__":
    main()
