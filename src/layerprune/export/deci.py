"""The Nemotron-NAS layout (DeciLM `block_configs`) as llama.cpp's `deci` architecture.

llama.cpp reads three per-layer arrays: head count, KV head count and feed-forward length. A block whose attention
is `no_op` gets 0 heads (llama.cpp passes the residual stream through, no norm); a block whose MLP is `no_op` cannot
get feed-forward length 0 while its attention is kept: llama.cpp's deci graph `continue`s before the attention's
residual add when `n_ff == 0` (the attention output is dropped), and aborts when that layer is the last. Such a block
gets a zero FFN instead (`ZERO_FFN` wide, down projection all zeros: it adds exactly nothing, in every encoding).
llama3 RoPE travels as llama.cpp's converter writes it: a `rope_freqs` tensor of per-frequency divisors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from layerprune.core.errors import LayerpruneError
from layerprune.export.families import head_dim, permute_rope, rope_theta
from layerprune.models.gguf_types import ZERO_FFN
from layerprune.models.nemotron_nas.configuration_decilm import ffn_mult_to_intermediate_size


@dataclass(frozen=True)
class DeciLayer:
    """One block of a DeciLM config as llama.cpp sees it."""

    heads: int
    kv_heads: int
    ffn: int
    zero_ffn: bool = False


def _field(node: Any, name: str) -> Any:
    return node.get(name) if isinstance(node, dict) else getattr(node, name, None)


def deci_layers(config: Any) -> list[DeciLayer]:
    """Per block: heads, KV heads, feed-forward length (0 for a `no_op` MLP of an attention-free block)."""
    heads = config.num_attention_heads
    layers = []
    for block in config.block_configs:
        attention, ffn = _field(block, "attention"), _field(block, "ffn")
        if _field(attention, "replace_with_linear") or _field(ffn, "replace_with_linear"):
            raise LayerpruneError("export --gguf: DeciLM blocks replaced with linear layers are not exported")
        group = None if _field(attention, "no_op") else _field(attention, "n_heads_in_group")
        n_heads, n_kv = (0, 0) if group is None else (heads, heads // group)
        mult = None if _field(ffn, "no_op") else _field(ffn, "ffn_mult")
        width = 0 if mult is None else ffn_mult_to_intermediate_size(mult, config.hidden_size)
        zero = width == 0 and n_heads > 0
        layers.append(DeciLayer(n_heads, n_kv, ZERO_FFN if zero else width, zero))
    if layers and layers[-1].heads == 0 and layers[-1].ffn == 0:
        raise LayerpruneError("export --gguf: the last DeciLM block does nothing (llama.cpp cannot run that)")
    return layers


def deci_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """What llama.cpp's converter writes for `block_configs` models: the three per-layer arrays and the rest."""
    layers = deci_layers(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(len(layers))
    writer.add_head_count([layer.heads for layer in layers])
    writer.add_head_count_kv([layer.kv_heads for layer in layers])
    writer.add_feed_forward_length([layer.ffn for layer in layers])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_rope_dimension_count(head_dim(config))
    rope_factors(config)  # a rope type llama.cpp's deci cannot carry fails before any tensor is written


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("full_attention", params)


def rope_factors(config: Any) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` for llama3 RoPE (None for default RoPE): per rotary frequency the divisor
    transformers applies to it, 1 above the high-frequency cut, `factor` below the low one, smoothed between, as
    llama.cpp's llama and deci converters compute it. Any other rope type is refused in one line."""
    params = _rope_parameters(config)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise LayerpruneError(f"export --gguf: rope type '{kind}' is not exported (llama.cpp's deci converter "
                              "writes default and llama3 RoPE only)")
    dim = head_dim(config)
    freqs = 1.0 / (rope_theta(config) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old_context = float(params.get("original_max_position_embeddings",
                                   getattr(config, "original_max_position_embeddings", None) or 8192))
    factors = []
    for freq in freqs.astype(np.float32):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _block(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() else None


def deci_fix(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    """llama.cpp rotates interleaved pairs: permute q and k (and their biases, a Qwen2 source's) per block, with that
    block's head counts."""
    block = _block(name)
    if block is None or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return data
    layer = deci_layers(config)[block]
    return permute_rope(data, layer.heads if ".q_proj." in name else layer.kv_heads)


def deci_extra(config: Any) -> Iterator[tuple[str, np.ndarray]]:
    """llama3 RoPE's frequency factors (`rope_freqs`, as llama.cpp's converter writes them), and the zero FFN (and its
    norm) of each block whose MLP is removed and whose attention is kept."""
    factors = rope_factors(config)
    if factors is not None:
        yield "rope.freqs.weight", factors
    hidden = config.hidden_size
    for index, layer in enumerate(deci_layers(config)):
        if layer.zero_ffn:
            prefix = f"model.layers.{index}"
            yield f"{prefix}.post_attention_layernorm.weight", np.ones(hidden, dtype=np.float32)
            yield f"{prefix}.mlp.gate_proj.weight", np.zeros((ZERO_FFN, hidden), dtype=np.float32)
            yield f"{prefix}.mlp.up_proj.weight", np.zeros((ZERO_FFN, hidden), dtype=np.float32)
            yield f"{prefix}.mlp.down_proj.weight", np.zeros((hidden, ZERO_FFN), dtype=np.float32)
