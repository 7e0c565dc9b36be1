"""Verify a written model block-major: never more than one decoder block in memory, for any model size.

The model's own forward runs on a skeleton (embeddings, final norm and head loaded; blocks on the meta device)
with each block's weights loaded from its own files just before it runs and emptied right after, so the hidden
states of a few sequences are carried from block to block by the model's code itself. The original runs with the
dropped blocks skipped (their output replaced by their input); the written model runs as written; the logits
must agree. Beside the logits, the blocks built from the new config must be the kept blocks of the old one
(attention kind, sliding window and every other per-layer setting), which a short probe cannot always show.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import find_decoder_stack
from layerprune.models.blockwise import BlockwiseModel, empty_block, empty_model, fill_block, load_skeleton
from layerprune.models.shards import block_prefix, read_checkpoint

PER_LAYER_NAMES = ("layer_idx", "layer_index")  # renumbered by the surgery: the one setting that may differ


@contextlib.contextmanager
def streamed_blocks(bw: BlockwiseModel, skip: Sequence[int] = ()) -> Iterator[None]:
    """While open, the skeleton's own forward loads each block just before it runs and empties it after;
    a block in `skip` returns its input (it still runs, so the model sees the same call pattern)."""
    skipped = set(skip)
    handles = []
    for index, block in enumerate(bw.stack.layers):
        handles.append(block.register_forward_pre_hook(_before(bw, index)))
        handles.append(block.register_forward_hook(_after(bw, index, index in skipped), with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for index in range(len(bw)):
            empty_block(bw, index)


def _before(bw: BlockwiseModel, index: int) -> Any:
    def hook(module: nn.Module, args: tuple) -> None:
        fill_block(bw, index)

    return hook


def _after(bw: BlockwiseModel, index: int, skipped: bool) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        empty_block(bw, index)
        if not skipped:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook


def block_major_logits(
    bw: BlockwiseModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, skip: Sequence[int] = ()
) -> torch.Tensor:
    """The model's own logits (float32), computed one loaded block at a time."""
    device = bw.device
    mask = attention_mask.to(device) if attention_mask is not None else None
    with torch.inference_mode(), streamed_blocks(bw, skip):
        out = bw.model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False)
    return out.logits.float()


def check_blockwise_head(bw: BlockwiseModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         hidden: torch.Tensor) -> float:
    """Block-major `DecoderStack.check_logits`: norm + head on the last block's output (`hidden`, from the scorer's
    own pass) against the model's own forward; refuse the model when they differ."""
    own = block_major_logits(bw, input_ids, attention_mask)
    with torch.inference_mode():
        ours = bw.stack.logits(hidden.to(bw.device)).float()
    diff = float((own - ours).abs().max())
    if not diff <= 1e-3 * float(own.abs().max()) + 1e-4:
        raise LayerpruneError(
            f"{type(bw.model).__name__}: the logits from its final norm and head differ from its own forward "
            f"(max |diff| {diff:.3g}, block-major); scores computed from them would be wrong, "
            "so this model is refused for this score"
        )
    return diff


def block_settings(block: nn.Module) -> dict[str, Any]:
    """Every plain setting (bool, int, float, str, None) of a block and its submodules, but its index."""
    found = {}
    for prefix, module in block.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or key in PER_LAYER_NAMES or key == "training":
                continue
            if value is None or isinstance(value, (bool, int, float, str)):
                found[f"{prefix}.{key}" if prefix else key] = value
    return found


def check_per_layer_settings(source_config: Any, written_config: Any, kept: Sequence[int]) -> int:
    """The blocks the written config builds are the kept blocks of the source config, setting by setting (on
    the meta device); raise naming the first difference. Returns how many settings were compared."""
    before = find_decoder_stack(empty_model(source_config)).layers
    after = find_decoder_stack(empty_model(written_config)).layers
    if len(after) != len(kept):
        raise LayerpruneError(f"surgery check failed: the written config builds {len(after)} blocks, not {len(kept)}")
    compared = 0
    for new, old in enumerate(kept):
        want, got = block_settings(before[old]), block_settings(after[new])
        for key in sorted(set(want) | set(got)):
            if want.get(key, "<absent>") != got.get(key, "<absent>"):
                raise LayerpruneError(
                    f"surgery check failed: written block {new} (was {old}) has {key}={got.get(key, '<absent>')!r}, "
                    f"the original block {old} has {want.get(key, '<absent>')!r}; nothing was written"
                )
        compared += len(want)
    return compared


class BlockMajorUnsupported(LayerpruneError):
    """The checkpoint's tensor names are not the model's (converted on load, or shared between blocks)."""


def check_block_keys(bw: BlockwiseModel) -> None:
    """Every block's weights are in the files under their own names (else the block-major way cannot load them)."""
    for index, block in enumerate(bw.stack.layers):
        for name, _ in block.named_parameters():
            if f"{bw.prefix}.{index}.{name}" not in bw.checkpoint.weight_map:
                raise BlockMajorUnsupported(
                    f"{bw.prefix}.{index}.{name} is not in the files (this family converts or shares block weights "
                    "on load)"
                )


def skeleton(directory: Path, config: Any, device: torch.device, dtype: torch.dtype) -> BlockwiseModel:
    """`load_skeleton`, refused up front (`BlockMajorUnsupported`) when a block's weights cannot be found."""
    try:
        bw = load_skeleton(directory, config, device, dtype)
    except LayerpruneError as exc:
        raise BlockMajorUnsupported(str(exc)) from exc
    check_block_keys(bw)
    return bw


def _keys_only(directory: Path, config: Any) -> BlockwiseModel:
    """A skeleton with nothing loaded: enough to check the names of the block weights."""
    model = empty_model(config)
    checkpoint = read_checkpoint(directory)
    stack = find_decoder_stack(model)
    prefix = block_prefix(list(checkpoint.weight_map), len(stack))
    return BlockwiseModel(model, stack, checkpoint, prefix, torch.device("meta"), torch.float32)


def fits_whole(nbytes: int, device: torch.device, copies: float = 1.2) -> bool:
    """Whether `copies` x `nbytes` fit in the free memory of `device` (GPU memory, or RAM for the CPU)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return nbytes * copies <= free


def verify_block_major(
    source_config: Any | None,
    written_dir: Path,
    drop: Sequence[int],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    rtol: float,
    reference: torch.Tensor | None = None,
    source_dir: Path | None = None,
) -> dict[str, Any]:
    """Compare the written model with the original-with-skips, one block at a time; raise on a mismatch.

    `reference` is the original's logits with `drop` skipped when the caller has them; else they are computed
    block-major from `source_dir`. With `source_config`, the per-layer settings are compared as well."""
    from transformers import AutoConfig

    start = time.perf_counter()
    written_config = AutoConfig.from_pretrained(written_dir)
    check_block_keys(_keys_only(written_dir, written_config))  # refused before any weight is read
    settings: int | str = "skipped: no source config"
    if source_config is not None:
        text = source_config.get_text_config() if hasattr(source_config, "get_text_config") else source_config
        kept = [i for i in range(text.num_hidden_layers) if i not in set(drop)]
        settings = check_per_layer_settings(source_config, written_config, kept)
    phases = {"settings": time.perf_counter() - start}
    if reference is None:
        assert source_dir is not None and source_config is not None
        reference = _reference_logits(source_dir, source_config, input_ids, attention_mask, drop, device, dtype)
        phases["reference"] = time.perf_counter() - start - sum(phases.values())
    logits = block_major_logits(skeleton(written_dir, written_config, device, dtype), input_ids, attention_mask)
    phases["written"] = time.perf_counter() - start - sum(phases.values())
    diff = float((logits - reference.to(logits.device)).abs().max())
    scale = float(reference.abs().max())
    tolerance = rtol * scale + 1e-4
    if not diff <= tolerance:
        raise LayerpruneError(
            f"surgery check failed: the written model's logits differ from the original with the blocks skipped "
            f"(max |diff| {diff:.3g} > {tolerance:.3g}, block-major); nothing was written"
        )
    return {"logits_check": "block-major", "max_abs_diff": diff, "tolerance": tolerance, "reference_max_abs": scale,
            "per_layer_settings": settings, "tokens": int(input_ids.numel()),
            "seconds": round(time.perf_counter() - start, 2),
            "phase_seconds": {name: round(seconds, 3) for name, seconds in phases.items()}}


def _reference_logits(source_dir: Path, source_config: Any, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, drop: Sequence[int], device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor:
    """The original's logits with `drop` skipped, its skeleton freed before they are returned (by reference
    counting; a full garbage collection, 0.1-0.6 s with transformers loaded, only if a cycle keeps it alive)."""
    bw = skeleton(source_dir, source_config, device, dtype)
    alive = weakref.ref(bw.model)
    logits = block_major_logits(bw, input_ids, attention_mask, drop)
    del bw
    if alive() is not None:
        gc.collect()
    return logits

