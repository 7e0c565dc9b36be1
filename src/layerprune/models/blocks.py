"""Find a model's decoder blocks, drop some for good, or skip some for a while."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError
from layerprune.models.layer_fields import slice_layer_config
from layerprune.models.logits_check import check_head_logits

STACK_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
               "model.language_model.layers", "language_model.model.layers", "transformer.layers")
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")


@dataclass
class DecoderStack:
    """The `ModuleList` of decoder blocks and the modules around it."""

    model: nn.Module
    base: nn.Module
    attr: str
    config: Any

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.base, self.attr)

    def __len__(self) -> int:
        return len(self.layers)

    def final_norm(self) -> nn.Module:
        for name in FINAL_NORM_NAMES:
            module = getattr(self.base, name, None)
            if isinstance(module, nn.Module):
                return module
        raise LayerpruneError(f"cannot find the final norm of {type(self.base).__name__}")

    def lm_head(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise LayerpruneError(f"{type(self.model).__name__} has no language-model head")
        return head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, head and the family's logit scaling, applied to the last block's output.

        Granite divides by `logits_scaling`, Cohere multiplies by `logit_scale`, Falcon-H1 by
        `lm_head_multiplier`, Gemma soft-caps; `check_logits` proves it equals the model's own forward.
        """
        logits = self.lm_head()(self.final_norm()(hidden))
        config = self.config
        if getattr(config, "logits_scaling", None):
            logits = logits / config.logits_scaling
        for name in ("logit_scale", "lm_head_multiplier"):
            if getattr(config, name, None) is not None:
                logits = logits * getattr(config, name)
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def check_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> float:
        """Refuse a model whose own forward gives other logits than norm + head on the last block's output."""
        captured: list[torch.Tensor] = []
        handle = self.layers[-1].register_forward_hook(
            lambda module, args, output: captured.append(output[0] if isinstance(output, (tuple, list)) else output))
        try:
            with torch.inference_mode():
                own = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
                ours = self.logits(captured[-1]).float()
        finally:
            handle.remove()
        return check_head_logits(own, ours, type(self.model).__name__)


def text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def find_decoder_stack(model: nn.Module) -> DecoderStack:
    """Locate the one `ModuleList` holding the decoder blocks; fail clearly when there is none."""
    config = text_config(model)
    depth = getattr(config, "num_hidden_layers", None)
    for path in STACK_PATHS:
        parent_path, _, attr = path.rpartition(".")
        parent = _get_path(model, parent_path)
        layers = getattr(parent, attr, None) if parent is not None else None
        if isinstance(layers, nn.ModuleList) and len(layers) > 0 and (depth is None or len(layers) == depth):
            return DecoderStack(model, parent, attr, config)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and depth and len(module) == depth and _has_attention(module[0]):
            parent_name, _, attr = name.rpartition(".")
            return DecoderStack(model, model.get_submodule(parent_name), attr, config)
    raise LayerpruneError(f"{type(model).__name__} has no list of decoder blocks (is it a decoder-only LM?)")


def _get_path(root: nn.Module, path: str) -> nn.Module | None:
    module: Any = root
    for part in path.split(".") if path else []:
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _has_attention(block: nn.Module) -> bool:
    return any(hasattr(module, "layer_idx") for module in block.modules())


def check_block_indices(indices: Sequence[int], depth: int, what: str = "--layers") -> list[int]:
    """Sorted unique indices; duplicates or out-of-range values are errors."""
    dupes = sorted({i for i in indices if list(indices).count(i) > 1})
    if dupes:
        raise LayerpruneError(f"{what} lists block(s) {dupes} more than once")
    bad = [i for i in indices if not 0 <= i < depth]
    if bad:
        raise LayerpruneError(f"{what} has block index(es) {bad} outside 0..{depth - 1}")
    return sorted(indices)


def drop_blocks(model: nn.Module, drop: Sequence[int], force: bool = False) -> list[int]:
    """Remove blocks in place, re-index attention, rewrite the block fields of the config; return kept indices.

    A config that cannot describe the kept blocks is refused before anything changes; `force` lets unknown
    layer-looking fields through (lists with one entry per block are sliced, the rest left as they are).
    """
    if getattr(text_config(model), "model_type", None) == "nemotron-nas":  # its KV slots count attention blocks only
        raise LayerpruneError("dropping whole blocks of a Nemotron-NAS (DeciLM) model is not supported; prune its "
                              "source with --granularity sublayer instead")
    stack = find_decoder_stack(model)
    depth = len(stack)
    drop = check_block_indices(drop, depth, "blocks to drop")
    kept = [i for i in range(depth) if i not in set(drop)]
    if not kept:
        raise LayerpruneError("cannot drop every block")
    configs = _configs(model)
    sliced = [copy.copy(config) for config in configs]
    for config in sliced:  # on copies first: a refusal leaves the model as it was
        slice_layer_config(config, kept, depth, force)
    setattr(stack.base, stack.attr, nn.ModuleList([stack.layers[i] for i in kept]))
    reindex_layers(stack.layers)
    for config, new in zip(configs, sliced, strict=False):
        config.__dict__.update(vars(new))
    return kept


def reindex_layers(layers: nn.ModuleList) -> None:
    for new_idx, block in enumerate(layers):
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_idx


def _configs(model: nn.Module) -> list[Any]:
    configs = [model.config]
    text = text_config(model)
    return configs if text is model.config else configs + [text]


@contextlib.contextmanager
def skipped_blocks(model: nn.Module, skip: Sequence[int], force: bool = True) -> Iterator[list[int]]:
    """Behave as if `skip` were dropped (generation and KV cache included; `force`: see `drop_blocks`), then
    restore: the blocks, their indices and the configs as they were (a field the surgery added is removed)."""
    if not skip:
        yield list(range(len(find_decoder_stack(model))))
        return
    stack = find_decoder_stack(model)
    original_layers = stack.layers
    saved_configs = [(config, copy.copy(vars(config))) for config in _configs(model)]
    try:
        yield drop_blocks(model, skip, force=force)
    finally:
        setattr(stack.base, stack.attr, original_layers)
        reindex_layers(original_layers)
        for config, attrs in saved_configs:
            config.__dict__.clear()
            config.__dict__.update(attrs)
