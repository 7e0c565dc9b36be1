"""Read an exported GGUF back with transformers' GGUF loader and compare it with the model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from layerprune.models.verification import VERIFY_PROMPTS, prompt_ids, reference

CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "sliding_window")


def read_back(model_dir: Path, path: Path, tokenizer: Any = None) -> dict[str, Any]:
    """Config fields, tokenizer ids and logits of the GGUF (through transformers) against the directory.

    transformers' GGUF loader reads no per-layer sliding-window pattern (it assumes Gemma-3's every-6th default),
    so the model is built from the directory's config and only the weights and tokenizer come from the file.
    export_gguf calls it inside `parsed_once()`, so the file's three loads here parse it once, with the directory's
    tokenizer it loaded (`tokenizer`; loaded here when None)."""
    config = AutoConfig.from_pretrained(model_dir)
    hf_tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    gguf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                  dtype=torch.float32).eval()
    fields = {f: [getattr(config, f, None), getattr(found, f, None)] for f in CONFIG_FIELDS}
    expected, got = reference(hf, hf_tok, max_new_tokens=0), reference(loaded, hf_tok, max_new_tokens=0)
    diffs = [(a - b).abs().max().item() for a, b in zip(expected.logits, got.logits, strict=True)]
    positions = sum(len(row) for row in expected.top1)
    same = sum(a == b for e, g in zip(expected.top1, got.top1, strict=True) for a, b in zip(e, g, strict=True))
    return {
        "config_fields_differing": {f: v for f, v in fields.items() if v[0] != v[1]},
        "tokenizer_ids_equal": prompt_ids(hf_tok, VERIFY_PROMPTS) == prompt_ids(gguf_tok, VERIFY_PROMPTS),
        "max_abs_logit_diff": round(max(diffs), 5),
        "logit_scale": round(max(row.abs().max().item() for row in expected.logits), 3),
        "top1_agreement": f"{same}/{positions}",
    }
