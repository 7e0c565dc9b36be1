"""Nemotron-NAS (DeciLM) configuration: a Llama configuration whose blocks each say whether their attention and
FFN exist, and how wide they are.

Written as NVIDIA's published Nemotron-NAS checkpoints are (model_type `nemotron-nas`, a `block_configs` list of
`{"attention": {...}, "ffn": {...}}`), so vLLM's `DeciLMForCausalLM` and llama.cpp's `deci` converter read it.
Self-contained (torch and transformers only): a saved model carries this file beside its config.json. Reads on
every transformers 5: the dataclass configurations of recent releases (`__post_init__`) and the keyword `__init__`
of the first ones (5.0).
"""

import dataclasses
from typing import Any

from transformers import LlamaConfig

ATTENTION_EXTRAS = {"window_length": None, "num_sink_tokens": None, "use_prefill_window_in_sink_attention": False,
                    "unshifted_sink": False, "sparsify": None}
FFN_EXTRAS = {"sparsify": None}


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """A block's attention: absent (`no_op`), or grouped-query attention with `n_heads_in_group` query heads per
    key-value head. The published fields this implementation does not run are kept so a config reads back whole."""

    no_op: bool = False
    replace_with_linear: bool = False
    n_heads_in_group: int | None = None
    window_length: int | None = None
    num_sink_tokens: int | None = None
    use_prefill_window_in_sink_attention: bool = False
    unshifted_sink: bool = False
    sparsify: list | None = None


@dataclasses.dataclass(frozen=True)
class FFNConfig:
    """A block's FFN: absent (`no_op`), or a gated MLP of intermediate size `ffn_mult_to_intermediate_size`."""

    no_op: bool = False
    replace_with_linear: bool = False
    ffn_mult: float | None = None
    sparsify: list | None = None


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    attention: AttentionConfig
    ffn: FFNConfig

    @classmethod
    def from_dict(cls, data: dict[str, Any], index: int = 0) -> "BlockConfig":
        unknown = set(data) - {"attention", "ffn"}
        if unknown:
            raise ValueError(f"block_configs[{index}] has unknown keys {sorted(unknown)}")
        return cls(_part(AttentionConfig, data.get("attention") or {}, index),
                   _part(FFNConfig, data.get("ffn") or {}, index))

    def to_dict(self) -> dict[str, Any]:
        """The published keys, and any other field only where it is set."""
        return {"attention": _as_dict(self.attention, ATTENTION_EXTRAS), "ffn": _as_dict(self.ffn, FFN_EXTRAS)}


def _part(kind: type, data: dict[str, Any], index: int) -> Any:
    known = {field.name for field in dataclasses.fields(kind)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"block_configs[{index}] {kind.__name__} has unknown keys {sorted(unknown)}")
    return kind(**data)


def _as_dict(part: Any, extras: dict[str, Any]) -> dict[str, Any]:
    values = dataclasses.asdict(part)
    return {key: value for key, value in values.items() if key not in extras or value != extras[key]}


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """The published rule: int(2 * ffn_mult * hidden / 3), rounded up to a multiple of 256."""
    size = int(2 * ffn_mult * hidden_size / 3)
    return size if size % 256 == 0 else size + 256 - size % 256


class DeciLMConfig(LlamaConfig):
    """A Llama configuration with one `BlockConfig` per decoder block (`block_configs`)."""

    model_type = "nemotron-nas"

    block_configs: list | None = None

    if dataclasses.is_dataclass(LlamaConfig):  # transformers' dataclass configurations
        def __post_init__(self, **kwargs: Any) -> None:
            self._read_blocks()
            super().__post_init__(**kwargs)
    else:  # transformers 5.0: configurations take keywords in __init__
        def __init__(self, block_configs: list | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.block_configs = block_configs
            self._read_blocks()

    def _read_blocks(self) -> None:
        if self.block_configs is not None:
            self.block_configs = [block if isinstance(block, BlockConfig) else BlockConfig.from_dict(block, index)
                                  for index, block in enumerate(self.block_configs)]
            if len(self.block_configs) != self.num_hidden_layers:
                raise ValueError(f"block_configs has {len(self.block_configs)} entries for "
                                 f"{self.num_hidden_layers} hidden layers")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.block_configs is not None:
            out["block_configs"] = [block.to_dict() for block in self.block_configs]
        return out


__all__ = ["AttentionConfig", "BlockConfig", "DeciLMConfig", "FFNConfig", "ffn_mult_to_intermediate_size"]
