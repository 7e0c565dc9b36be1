"""Read an exported GGUF back with transformers' GGUF loader and compare it with the model directory: config fields,
tokenizer ids, and the verdict of models/verification.compare (top-1 at every position of prompt + continuation up
to near-ties, greedy continuations, largest logit error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from layerprune.models.gguf_once import fast_reader
from layerprune.models.verification import VERIFY_PROMPTS, near_tie_for, prompt_ids, reference, transformers_verdict

CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "sliding_window")


def read_back(model_dir: Path, path: Path, tokenizer: Any = None) -> dict[str, Any]:
    """Config fields, tokenizer ids and the verdict of the GGUF (through transformers) against the directory.

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
    expected = reference(hf, hf_tok)
    verdict = transformers_verdict(loaded, hf_tok, expected, near_tie_for(file_encoding(path)))
    return {
        "config_fields_differing": {f: v for f, v in fields.items() if v[0] != v[1]},
        "tokenizer_ids_equal": prompt_ids(hf_tok, VERIFY_PROMPTS) == prompt_ids(gguf_tok, VERIFY_PROMPTS),
        "logit_scale": round(max(row.abs().max().item() for row in expected.logits), 3),
        **verdict,
    }


def file_encoding(path: Path) -> str:
    """The GGUF's file type as a lower-case encoding name: f32, f16, bf16, q8_0, q4_k_m, ..."""
    import gguf

    value = int(fast_reader(path).fields["general.file_type"].contents())
    return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
