"""What each exportable family writes: the llama.cpp architecture, per-layer metadata and tensor fixes.

Only what llama.cpp's converter does for these families, written with the gguf package's names; the table of
exportable families is `export/catalog.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from layerprune.core.errors import LayerpruneError


@dataclass(frozen=True)
class Family:
    """A transformers model_type and how its checkpoint becomes llama.cpp's architecture `arch`."""

    arch: gguf.MODEL_ARCH
    metadata: Callable[[gguf.GGUFWriter, Any], None]
    fix: Callable[[str, np.ndarray, Any], np.ndarray]
    extra: Callable[[Any], Iterable[tuple[str, np.ndarray]]] = lambda config: ()


def per_layer(values: list[Any]) -> Any:
    """A scalar when every layer has the same value (llama.cpp reads either), else the per-layer list."""
    return values[0] if len(set(values)) == 1 else values


def heads(config: Any, name: str) -> Any:
    value = getattr(config, name)
    return per_layer(list(value)) if isinstance(value, (list, tuple)) else value


def rope_theta(config: Any, layer_type: str | None = None) -> float:
    """rope_theta from transformers 5's rope_parameters (flat, or keyed by layer type), or the older field."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type and layer_type in params:
        params = params[layer_type]
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def common_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads(config, "num_attention_heads"))
    writer.add_head_count_kv(heads(config, "num_key_value_heads"))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    common_metadata(writer, config)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_rope_dimension_count(head_dim(config))
    if (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default") != "default":
        raise LayerpruneError("export --gguf: rope scaling is not exported yet (rope_type other than default)")


def permute_rope(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's llama graph rotates interleaved pairs; Hugging Face rotates halves (its converter's permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama_fix(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        return permute_rope(data, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return permute_rope(data, config.num_key_value_heads)
    return data


def gemma3_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """Gemma-3: per-layer sliding-window pattern from the (pruned) config's layer_types, not the every-6th default
    that llama.cpp assumes when the pattern is absent."""
    common_metadata(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(rope_theta(config, "full_attention"))
    types = list(config.layer_types)
    if config.sliding_window and "sliding_attention" in types:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        writer.add_rope_freq_base_swa(rope_theta(config, "sliding_attention"))
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.query_pre_attn_scalar != config.head_dim:
        raise LayerpruneError("export --gguf: Gemma-3 with query_pre_attn_scalar != head_dim is not exported yet")


def gemma3_fix(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    """Gemma's RMSNorm scales by (1 + weight); llama.cpp's by weight: store weight + 1, as its converter does."""
    return data + 1.0 if name.endswith("norm.weight") else data
