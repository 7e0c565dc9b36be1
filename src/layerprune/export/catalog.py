"""The exportable families, by transformers model_type; any other is refused in one line (`family_for`)."""

from __future__ import annotations

from typing import Any

import gguf

from layerprune.core.errors import LayerpruneError
from layerprune.export.deci import deci_extra, deci_fix, deci_metadata
from layerprune.export.families import Family, gemma3_fix, gemma3_metadata, llama_fix, llama_metadata

FAMILIES: dict[str, Family] = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, llama_metadata, llama_fix),
    "gemma3_text": Family(gguf.MODEL_ARCH.GEMMA3, gemma3_metadata, gemma3_fix),
    "nemotron-nas": Family(gguf.MODEL_ARCH.DECI, deci_metadata, deci_fix, deci_extra),
}
# llama.cpp's deci graph adds attention biases where the file has them (a Qwen2 source's q/k/v biases in the layout)
ATTENTION_BIASES = ("nemotron-nas",)
TRANSFORMERS_READS = (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.GEMMA3)  # architectures its GGUF loader reads


def family_for(config: Any) -> Family:
    """The family of a config, or one line naming those that export."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise LayerpruneError(f"export --gguf does not support model_type '{model_type}' yet; "
                              f"supported: {', '.join(sorted(FAMILIES))}")
    attention_bias = getattr(config, "attention_bias", False) and model_type not in ATTENTION_BIASES
    if attention_bias or getattr(config, "mlp_bias", False):
        raise LayerpruneError(f"export --gguf: {model_type} with bias tensors is not exported yet")
    return FAMILIES[model_type]
