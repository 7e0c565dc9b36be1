"""Read an exported GGUF back tensor by tensor, for architectures transformers' GGUF loader does not read (deci).

Every tensor of the file is decoded (gguf's dequantizers) and compared with the directory's tensor as the exporter
fixed it (names mapped, q/k permuted); none may be missing or unexpected, and the token list must be the tokenizer's.
What it proves is the file's content, not llama.cpp's graph: `export/llamacpp.py` runs that where it is installed.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from transformers import AutoTokenizer

from layerprune.export.families import Family
from layerprune.export.writer import checkpoint_tensors
from layerprune.models.gguf_once import fast_reader


def read_back_weights(model_dir: Path, path: Path, family: Family, config: Any) -> dict[str, Any]:
    """Per-tensor relative error of the decoded file against the directory, missing/unexpected names, tokens."""
    reader = fast_reader(path)
    stored = {tensor.name: tensor for tensor in reader.tensors}
    names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    arrays = ((name, tensor.float().numpy()) for name, tensor in checkpoint_tensors(model_dir))
    errors: dict[str, float] = {}
    missing = []
    for name, array in itertools.chain(arrays, family.extra(config)):
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target not in stored:
            missing.append(name)
            continue
        errors[target] = _relative_error(stored[target], family.fix(name, array, config))
    worst = max(errors, key=errors.__getitem__) if errors else None
    return {"tensors_compared": len(errors), "missing": missing, "unexpected": sorted(set(stored) - set(errors)),
            "max_relative_error": round(errors[worst], 6) if worst else None, "worst_tensor": worst,
            "tokens_equal": _tokens(reader) == _tokenizer_tokens(model_dir, len(_tokens(reader)))}


def _relative_error(tensor: Any, expected: np.ndarray) -> float:
    decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(expected.shape)
    scale = float(np.abs(expected).max())
    return float(np.abs(decoded - expected).max()) / scale if scale else float(np.abs(decoded).max())


def _tokens(reader: gguf.GGUFReader) -> list[str]:
    return list(reader.fields["tokenizer.ggml.tokens"].contents())


def _tokenizer_tokens(model_dir: Path, size: int) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [str(tokenizer.convert_ids_to_tokens(index)) for index in range(size)]
