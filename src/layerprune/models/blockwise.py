"""A model that fits nowhere whole, run block-major: one decoder block in memory at a time.

The skeleton is built with accelerate's `init_empty_weights` (parameters on the meta device, buffers real);
embeddings, final norm and head are loaded, and each block's weights are loaded from the safetensors files
with `set_module_tensor_to_device` just before every hidden state goes through it, then sent back to meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import DecoderStack, find_decoder_stack, text_config
from layerprune.models.shards import Checkpoint, _open_lazy, block_prefix, read_checkpoint


@dataclass
class BlockwiseModel:
    """The skeleton model (blocks on meta), where each block's tensors live, and where to compute."""

    model: nn.Module
    stack: DecoderStack
    checkpoint: Checkpoint
    prefix: str
    device: torch.device
    dtype: torch.dtype
    on_load: Callable[[str, torch.Tensor], None] | None = None  # sees each tensor read from the files (its key)

    def __len__(self) -> int:
        return len(self.stack)


def empty_model(config: Any, dtype: torch.dtype | None = None) -> nn.Module:
    """The model with parameters on the meta device (no memory) and real buffers (rotary tables), its weight
    initialisation skipped (on the meta device it only costs time: about 0.2 s for 32 blocks)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # a tied head is not tied on the meta device until asked
    return model


def load_skeleton(directory: Path, config: Any, device: torch.device, dtype: torch.dtype,
                  model: nn.Module | None = None, on_load: Callable[[str, torch.Tensor], None] | None = None,
                  shared: BlockwiseModel | None = None) -> BlockwiseModel:
    """Everything but the blocks, loaded; the blocks left empty. `model`: the empty model of `config` when the
    caller has built it; `on_load`: called with each tensor read from the files; `shared`: a skeleton whose
    loaded tensors of the same names are used instead of reading them again (one copy in memory)."""
    model = (model if model is not None else empty_model(config, dtype)).eval()
    stack = find_decoder_stack(model)
    checkpoint = read_checkpoint(directory)
    prefix = block_prefix(list(checkpoint.weight_map), len(stack))
    in_blocks = {id(p) for p in stack.layers.parameters()}
    reuse = dict(shared.model.named_parameters()) if shared is not None else {}
    with _open_lazy(checkpoint) as tensors:
        for name, param in model.named_parameters():
            if id(param) in in_blocks:
                continue
            if name not in checkpoint.weight_map:
                if _tied(model, name):
                    continue
                raise LayerpruneError(
                    f"block-major scoring: {name} is not in the checkpoint (renamed tensors are not supported)"
                )
            if name in reuse and reuse[name].shape == param.shape and reuse[name].device == device:
                _set(model, name, reuse[name].detach(), device, None)
                continue
            _set(model, name, _read(tensors, name, on_load), device, dtype)
    model.tie_weights()
    for name, buffer in model.named_buffers():
        if buffer.device != device:
            _set(model, name, buffer, device, None)
    return BlockwiseModel(model, stack, checkpoint, prefix, device, dtype, on_load)


def _read(tensors: Any, key: str, on_load: Callable[[str, torch.Tensor], None] | None) -> torch.Tensor:
    value = tensors(key)
    if on_load is not None:
        on_load(key, value)
    return value


def _tied(model: nn.Module, name: str) -> bool:
    return bool(getattr(text_config(model), "tie_word_embeddings", False)) and name.endswith("lm_head.weight")


def _set(module: nn.Module, name: str, value: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> None:
    from accelerate.utils import set_module_tensor_to_device

    floating = value.is_floating_point()
    set_module_tensor_to_device(module, name, device, value=value, dtype=dtype if floating else None)


@contextlib.contextmanager
def loaded_block(bw: BlockwiseModel, index: int) -> Iterator[nn.Module]:
    """Block `index` with its weights on the compute device, emptied again on exit."""
    try:
        yield fill_block(bw, index)
    finally:
        empty_block(bw, index)


def fill_block(bw: BlockwiseModel, index: int) -> nn.Module:
    """Load block `index`'s weights from the files onto the compute device."""
    block = bw.stack.layers[index]
    with _open_lazy(bw.checkpoint) as tensors:
        for name, _ in list(block.named_parameters()):
            key = f"{bw.prefix}.{index}.{name}"
            if key not in bw.checkpoint.weight_map:
                raise LayerpruneError(f"block-major: {key} is not in the checkpoint")
            _set(block, name, _read(tensors, key, bw.on_load), bw.device, bw.dtype)
    return block


def empty_block(bw: BlockwiseModel, index: int) -> None:
    """Send block `index`'s weights back to the meta device (its memory is freed)."""
    from accelerate.utils import set_module_tensor_to_device

    block = bw.stack.layers[index]
    for name, _ in list(block.named_parameters()):
        set_module_tensor_to_device(block, name, "meta")


class _Captured(Exception):
    """Raised by the last block's stand-in: every block's call arguments are recorded."""


def block_call_args(
    bw: BlockwiseModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """The first block's input and every block's other call arguments, with no block run (each is a stand-in
    that returns its input)."""
    records: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    first: list[torch.Tensor] = []
    depth = len(bw.stack)

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not first:
            first.append(args[0] if args else kwargs["hidden_states"])
        records.append((tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        if len(records) == depth:
            raise _Captured

    def passthrough(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    handles = [block.register_forward_pre_hook(pre_hook, with_kwargs=True) for block in bw.stack.layers]
    for block in bw.stack.layers:
        block.forward = passthrough
    try:
        bw.stack.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
        for block in bw.stack.layers:
            del block.forward
    if len(records) != depth:
        raise LayerpruneError("block-major scoring: the model did not call every decoder block")
    return first[0], records


@dataclass
class MemoryPlan:
    """Bytes a block-major pass holds at once, from the config alone."""

    model_bytes: int  # the whole model at the compute dtype
    resident_bytes: int  # embeddings, final norm, head: loaded for the whole pass
    block_bytes: int  # the largest decoder block
    state_bytes: int  # one hidden state over all calibration tokens
    states: int  # hidden states alive at the peak (full model, candidates, the one being skipped)
    work_bytes: int  # one batch inside a block (MLP, attention scores) and its logits at the end

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.block_bytes + self.state_bytes * self.states + self.work_bytes

    def lines(self) -> list[str]:
        gib = 2**30
        return [
            f"whole model {self.model_bytes / gib:.2f} GiB; "
            f"resident (embeddings, norm, head) {self.resident_bytes / gib:.2f} GiB; "
            f"largest block {self.block_bytes / gib:.3f} GiB",
            f"hidden states: {self.state_bytes / gib:.3f} GiB per candidate state x {self.states} alive at the peak = "
            f"{self.state_bytes * self.states / gib:.2f} GiB; one batch's work {self.work_bytes / gib:.2f} GiB",
            f"peak about {self.peak_bytes / gib:.2f} GiB ({self.peak_bytes / self.model_bytes:.0%} of the whole model)",
        ]


def memory_plan(config: Any, tokens: int, batch_shape: tuple[int, int], dtype: torch.dtype, states: int) -> MemoryPlan:
    """Plan for `tokens` calibration tokens in batches of `batch_shape` (rows, longest sequence)."""
    model = empty_model(config, dtype)
    stack = find_decoder_stack(model)
    size = torch.empty((), dtype=dtype).element_size()
    blocks = [sum(p.numel() for p in block.parameters()) * size for block in stack.layers]
    total = sum({id(p): p.numel() for p in model.parameters()}.values()) * size
    text = text_config(model)
    rows, seq = batch_shape
    intermediate = max(getattr(text, "intermediate_size", 0) or 0, 4 * text.hidden_size)
    heads = getattr(text, "num_attention_heads", 1) or 1
    vocab = getattr(text, "vocab_size", 0) or 0
    work = (
        rows * seq * (intermediate * 3 + text.hidden_size * 4) * size
        + rows * heads * seq * seq * 4
        + rows * seq * vocab * 4
    )
    return MemoryPlan(total, total - sum(blocks), max(blocks), tokens * text.hidden_size * size, states, work)
