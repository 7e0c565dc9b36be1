"""Config fields that describe decoder blocks, and how each one changes when blocks are dropped.

Every field that holds per-block values, block indices, a count of leading blocks or a period is listed in
`RULES`; dropping blocks rewrites it for the kept numbering, turns a period into the explicit per-block form
the family accepts, or refuses naming the field. A field that looks layer-related and is not listed stops
the prune (unless forced), because guessing would write a model that loads with the wrong blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from layerprune.core.errors import LayerpruneError

Updates = dict[str, Any]


@dataclass(frozen=True)
class FieldRule:
    """Fields handled together, what happens to them, and the function that rewrites them."""

    fields: tuple[str, ...]
    how: str
    apply: Callable[[Any, Sequence[int], int], Updates]


def _kept_entries(config: Any, kept: Sequence[int], depth: int, name: str) -> Updates:
    value = getattr(config, name)
    if not isinstance(value, (list, tuple)):
        return {}
    if len(value) < depth:
        raise LayerpruneError(f"config field {name} has {len(value)} entries for {depth} blocks; cannot slice it")
    return {name: type(value)(value[i] for i in kept)}


def _renumbered(config: Any, kept: Sequence[int], name: str) -> Updates:
    value = getattr(config, name)
    if not isinstance(value, (list, tuple)):
        return {}
    new_index = {old: new for new, old in enumerate(kept)}
    return {name: type(value)(new_index[i] for i in value if i in new_index)}


def _leading_count(config: Any, kept: Sequence[int], name: str) -> Updates:
    value = getattr(config, name)
    return {name: sum(1 for i in kept if i < value)} if isinstance(value, int) and not isinstance(value, bool) else {}


def per_block(name: str) -> FieldRule:
    return FieldRule(
        (name,), "one entry per block: the kept blocks' entries", lambda c, k, d: _kept_entries(c, k, d, name)
    )


def index_list(name: str) -> FieldRule:
    return FieldRule(
        (name,), "block indices: kept ones renumbered, dropped ones removed", lambda c, k, d: _renumbered(c, k, name)
    )


def leading_count(name: str) -> FieldRule:
    return FieldRule(
        (name,), "the first N blocks: N counts the kept blocks below it", lambda c, k, d: _leading_count(c, k, name)
    )


def unaffected(name: str, why: str) -> FieldRule:
    return FieldRule((name,), f"unchanged: {why}", lambda c, k, d: {})


def refused(name: str, why: str, applies: Callable[[Any], bool] = lambda value: bool(value)) -> FieldRule:
    def apply(config: Any, kept: Sequence[int], depth: int) -> Updates:
        if applies(getattr(config, name)):
            raise LayerpruneError(f"cannot drop blocks of {_model_type(config)}: config field {name} ({why})")
        return {}

    return FieldRule((name,), f"refused: {why}", apply)


def _qwen_moe_sparsity(config: Any, kept: Sequence[int], depth: int) -> Updates:
    """Qwen2/3-MoE: block i is sparse unless listed in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""
    only = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    experts = getattr(config, "num_experts", 0) or 0
    sparse = [i not in only and experts > 0 and (i + 1) % step == 0 for i in range(depth)]
    return {"mlp_only_layers": [new for new, old in enumerate(kept) if not sparse[old]], "decoder_sparse_step": 1}


def _deepseek_moe(config: Any, kept: Sequence[int], depth: int) -> Updates:
    """DeepSeek-V3 style: MoE from block first_k_dense_replace on, every moe_layer_freq-th (remote code)."""
    first = getattr(config, "first_k_dense_replace", None) or 0
    freq = getattr(config, "moe_layer_freq", 1)
    updates = (
        {"first_k_dense_replace": sum(1 for i in kept if i < first)} if hasattr(config, "first_k_dense_replace") else {}
    )
    if freq in (None, 1):
        return updates
    wanted = [i >= first and i % freq == 0 for i in kept]
    fit = _fit_threshold_period(wanted)
    if fit is None:
        raise LayerpruneError(
            f"cannot drop blocks {_dropped(kept, depth)} of {_model_type(config)}: "
            "config fields first_k_dense_replace and "
            f"moe_layer_freq cannot express which kept blocks are mixture-of-experts ({_pattern(wanted)})"
        )
    return {"first_k_dense_replace": fit[0], "moe_layer_freq": fit[1]}


def _fit_threshold_period(pattern: list[bool]) -> tuple[int, int] | None:
    n = len(pattern)
    for freq in range(1, n + 2):
        for first in range(n + 1):
            if [i >= first and i % freq == 0 for i in range(n)] == pattern:
                return first, freq
    return None


def _fit_period(pattern: list[bool]) -> tuple[int, int] | None:
    """(period, offset) with offset < period such that block i is marked iff i % period == offset."""
    n = len(pattern)
    for period in range(1, n + 2):
        for offset in range(period):
            if [i % period == offset for i in range(n)] == pattern:
                return period, offset
    return None


def _jamba_periods(config: Any, kept: Sequence[int], depth: int) -> Updates:
    """Jamba: attention (and expert) blocks are every `period`-th from `offset`; re-fit both for the kept blocks."""
    updates: Updates = {}
    if isinstance(
        vars(config).get("layers_block_type"), list
    ):  # Zamba: an explicit list (sliced); periods only built it
        return updates
    for kind in ("attn", "expert"):
        if not hasattr(config, f"{kind}_layer_period"):
            continue
        period, offset = getattr(config, f"{kind}_layer_period"), getattr(config, f"{kind}_layer_offset")
        wanted = [i % period == offset for i in kept]
        fit = _fit_period(wanted)
        if fit is None:
            raise LayerpruneError(
                f"cannot drop blocks {_dropped(kept, depth)} of {_model_type(config)}: "
                f"config fields {kind}_layer_period/{kind}_layer_offset cannot express the kept pattern "
                f"({_pattern(wanted)}); choose blocks that keep it periodic"
            )
        updates[f"{kind}_layer_period"], updates[f"{kind}_layer_offset"] = fit
    return updates


def _dropped(kept: Sequence[int], depth: int) -> list[int]:
    return [i for i in range(depth) if i not in set(kept)]


def _pattern(flags: list[bool]) -> str:
    return "".join("x" if flag else "." for flag in flags)


def _model_type(config: Any) -> str:
    return getattr(config, "model_type", None) or type(config).__name__


RULES: list[FieldRule] = [
    unaffected("num_hidden_layers", "set to the number of kept blocks"),
    *(
        per_block(name)
        for name in (
            "layer_types",
            "layers_block_type",
            "mlp_layer_types",
            "no_rope_layers",
            "activation_sparsity_pattern",
            "layer_rope_theta",
            "num_attention_heads_per_layer",
            "indexer_types",
        )
    ),
    per_block("intermediate_size"),  # Gemma-3n: a list, one per block (an int elsewhere: left alone)
    *(index_list(name) for name in ("moe_layers", "cross_attention_layers", "attn_layer_indices", "full_attn_idxs")),
    *(leading_count(name) for name in ("max_window_layers", "num_dense_layers")),
    FieldRule(
        ("mlp_only_layers", "decoder_sparse_step"),
        "Qwen-MoE: made explicit: mlp_only_layers lists the kept dense blocks, decoder_sparse_step = 1",
        _qwen_moe_sparsity,
    ),
    FieldRule(
        ("first_k_dense_replace", "moe_layer_freq"),
        "DeepSeek-style: count of kept leading dense blocks; a moe_layer_freq > 1 re-fitted or refused",
        _deepseek_moe,
    ),
    FieldRule(
        ("attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset"),
        "Jamba: period and offset re-fitted to the kept blocks, refused where no period fits",
        _jamba_periods,
    ),
    unaffected(
        "interleave_moe_layer_step", "Llama-4 only uses it when moe_layers is empty, and moe_layers is renumbered"
    ),
    unaffected("no_rope_layer_interval", "only builds a missing no_rope_layers, which is sliced"),
    unaffected("num_nextn_predict_layers", "multi-token-prediction heads, not decoder blocks"),
    unaffected("num_mtp_layers", "multi-token-prediction heads, not decoder blocks"),
    refused("num_kv_shared_layers", "the last blocks reuse the KV cache of earlier ones by position"),
    refused(
        "hidden_size_per_layer_input",
        "per-layer input embeddings (embed_tokens_per_layer) are sized by the block count",
    ),
    unaffected("vocab_size_per_layer_input", "a vocabulary size; the per-layer embeddings are refused above"),
    refused("hybrid_layer_ids", "shared attention blocks are assigned to hybrid blocks by position"),
]
FIELD_RULES: dict[str, FieldRule] = {name: rule for rule in RULES for name in rule.fields}
NOT_PER_BLOCK = {
    "architectures",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "mlp_multipliers",
    "ssm_multipliers",
    "time_step_limit",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
}


def looks_layer_related(name: str, value: Any, depth: int) -> bool:
    """An int list or a small int whose name mentions layers, or any list with one entry per block."""
    if name.startswith("_") or isinstance(value, bool) or name in NOT_PER_BLOCK:
        return False
    if isinstance(value, (list, tuple)) and len(value) == depth:
        return True
    if "layer" not in name.lower():
        return False
    if isinstance(value, int):
        return 0 <= value <= depth
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def unknown_layer_fields(config: Any, depth: int) -> list[str]:
    """Layer-looking fields of `config` that no rule handles."""
    depth_attr = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    return sorted(
        name
        for name, value in vars(config).items()
        if name != depth_attr and name not in FIELD_RULES and looks_layer_related(name, value, depth)
    )


def check_layer_fields(config: Any, depth: int, force: bool = False) -> list[str]:
    """Refuse unknown layer-looking fields (unless forced); return them."""
    unknown = unknown_layer_fields(config, depth)
    if unknown and not force:
        raise LayerpruneError(
            f"{_model_type(config)} config field(s) {', '.join(unknown)} look layer-related "
            "and layerprune does not know "
            "how to renumber them; pass --force to prune anyway (the saved model is still verified)"
        )
    return unknown


def slice_layer_config(config: Any, kept: Sequence[int], depth: int, force: bool = False) -> None:
    """Rewrite every block-describing field for the kept blocks (not a truncation: patterns may interleave)."""
    if getattr(config, "num_hidden_layers", None) != depth:
        return
    unknown = check_layer_fields(config, depth, force)
    updates: Updates = {}
    for rule in {id(FIELD_RULES[name]): FIELD_RULES[name] for name in vars(config) if name in FIELD_RULES}.values():
        updates.update(rule.apply(config, kept, depth))
    for name in unknown:  # forced: the old behaviour, lists with one entry per block are sliced, the rest left
        value = getattr(config, name)
        if isinstance(value, (list, tuple)) and len(value) == depth:
            updates[name] = type(value)(value[i] for i in kept)
    for name, value in updates.items():
        setattr(config, name, value)
    config.num_hidden_layers = len(kept)
