#!/usr/bin/python3
"""The sampling oracle for tests/models/generate_test.cc.

  torch_sampling.py OUT_DIR    writes OUT_DIR/sampling.json: rows of logits and,
                               per (temperature, top_k, top_p) case, the
                               distribution Hugging Face's generate samples from

The warpers mirror transformers' TemperatureLogitsWarper, TopKLogitsWarper and
TopPLogitsWarper (min_tokens_to_keep 1), applied in the order generate applies
them; where `transformers` is importable, its own classes are used instead.
Logits are drawn in fp32 (so C++ holds them exactly) and filtered in fp64.
"""
import json
import os
import sys

import torch


def hf_warpers(temperature, top_k, top_p):
    """The warpers generate(do_sample=True) applies, in its order; each maps scores to scores."""
    try:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
        warpers = [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k > 0 else None,
                   TopPLogitsWarper(top_p) if top_p < 1 else None]
        return [(lambda s, w=w: w(None, s)) for w in warpers if w is not None]
    except ImportError as e:
        if os.environ.get("ESTUARY_REQUIRE_HF") == "1":
            sys.exit(f"torch_sampling.py: ESTUARY_REQUIRE_HF=1 but transformers' warpers do not import: {e}")
        warpers = [lambda s: s / temperature, (lambda s: top_k_filter(s, top_k)) if top_k > 0 else None,
                   (lambda s: top_p_filter(s, top_p)) if top_p < 1 else None]
        return [w for w in warpers if w is not None]


def top_k_filter(scores, top_k):
    top_k = min(max(top_k, 1), scores.size(-1))
    remove = scores < torch.topk(scores, top_k)[0][..., -1, None]
    return scores.masked_fill(remove, -float("inf"))


def top_p_filter(scores, top_p):
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative <= (1 - top_p)
    sorted_remove[..., -1:] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, -float("inf"))


def distribution(logits, temperature, top_k, top_p):
    scores = logits.double().unsqueeze(0)
    for warp in hf_warpers(temperature, top_k, top_p):
        scores = warp(scores)
    return scores.softmax(dim=-1)[0]


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    generator = torch.Generator().manual_seed(2024)
    rows = {
        "normal": (torch.randn(64, generator=generator) * 2).float(),
        # Integer logits: several tokens tie at the top-k boundary, and all stay.
        "ties": torch.randint(0, 6, (40,), generator=generator).float(),
        "small": torch.randn(12, generator=generator).float(),
    }
    cases = []
    settings = {
        "normal": [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.0, 0, 0.9), (1.3, 20, 0.8), (0.5, 0, 0.95), (1.0, 5, 0.6),
                   (1.0, 1, 1.0), (2.0, 0, 0.05), (0.9, 3, 0.999)],
        "ties": [(1.0, 3, 1.0), (1.0, 7, 1.0)],
        "small": [(0.9, 8, 0.9), (1.0, 0, 1.0)],
    }
    for name, row in rows.items():
        for temperature, top_k, top_p in settings[name]:
            probs = distribution(row, temperature, top_k, top_p)
            cases.append({"logits": name, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                          "probs": probs.tolist()})
    with open(os.path.join(out_dir, "sampling.json"), "w") as f:
        json.dump({"logits": {k: v.tolist() for k, v in rows.items()}, "cases": cases}, f)


if __name__ == "__main__":
    main()
