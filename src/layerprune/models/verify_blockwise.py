"""Verify a written model block-major: never more than one decoder block in memory, for any model size.

The model's own forward runs on a skeleton (embeddings, final norm and head loaded; blocks on the meta device)
with each block's weights loaded from its own files just before it runs and emptied right after, so the hidden
states of a few sequences are carried from block to block by the model's code itself. The written model runs as
written (with a streamed prune, each tensor it loads is checked against the copy's digest of its source tensor as
it is read: `CopyCheck`); the original runs with the dropped blocks skipped (their output replaced by their input,
their weights never read); the logits must agree. When the bytes are checked, the original does not recompute the
blocks before the one before the first dropped block: it starts there from the written model's hidden state (both
have the same bytes there), and it shares the written skeleton's embeddings, norm and head; and when the configs
are alike, it runs its own forward from the start with each kept block proven to be the written block on the same
arguments replayed from the written model's forward, not run again (`block_replay`). Beside the logits, the
blocks built from the new config must be the kept blocks of the old one (attention kind, sliding window and every
other per-layer setting), which a short probe cannot always show.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError
from layerprune.models.block_replay import (
    NOT_COMPUTED,
    PER_LAYER_NAMES,
    Replay,
    block_settings,
    built_alike,
    configs_alike,
    recording,
    same_value,
)
from layerprune.models.blocks import find_decoder_stack
from layerprune.models.blockwise import BlockwiseModel, empty_model, load_skeleton
from layerprune.models.copy_check import CopyCheck, copy_check
from layerprune.models.logits_check import WRITTEN_LOGITS_DIFFER, check_head_logits, check_logits_agree
from layerprune.models.safetensors_copy import Stored
from layerprune.models.shards import _open_lazy, block_prefix, read_checkpoint

__all__ = ["PER_LAYER_NAMES", "block_settings"]  # re-exported: they moved to block_replay
THREAD_WORK = 1 << 28  # multiply-adds of a check's largest product per CPU thread (about 10 ms of one core)
READ_ROWS = 16  # rows below which a product costs about what reading its weight costs
Parked = dict[int, list[tuple[nn.Module, str, nn.Parameter]]]  # block index -> (module, name, its meta parameter)


@dataclass
class Relay:
    """What one block-major forward hands the next: the hidden state entering block `at` (taken by the first, put in
    by the second), and what each block class returns (a tensor: None; a tuple: its length), so a block that is not
    run can return its input the way the model's loop expects it."""

    at: int = 0
    state: torch.Tensor | None = None
    returns: dict[type, int | None] = field(default_factory=dict)


@contextlib.contextmanager
def streamed_blocks(bw: BlockwiseModel, skip: Sequence[int] = (), relay: Relay | None = None,
                    start: int = 0, replay: Replay | None = None) -> Iterator[None]:
    """While open, the skeleton's own forward loads each block just before it runs and empties it after. A block in
    `skip` and, from `start` > 0, every block before it return their input without their weights being read (when
    `relay` knows what their class returns; else they run and their output is replaced by their input); block
    `start` takes `relay.state` as its input. With `start` 0, `relay` (if any) is filled: the state entering block
    `relay.at`, what each block class returns. A kept block that `replay` may serve returns the written block's
    output when called with its very arguments, and is loaded and run only when not (see `block_replay`)."""
    passed = set(skip) | set(range(start))
    handles, patched = [], []
    parked: Parked = {}
    written_index = {old: new for new, old in enumerate(replay.kept)} if replay is not None else {}
    for index, block in enumerate(bw.stack.layers):
        if index in passed and relay is not None and type(block) in relay.returns:
            block.forward = _passthrough(relay.returns[type(block)])
            patched.append(block)
            continue
        if replay is not None and index not in passed and written_index.get(index) in replay.alike:
            block.forward = _replayer(bw, index, written_index[index], replay, parked)
            patched.append(block)
            continue
        handles.append(block.register_forward_pre_hook(_before(bw, index, parked)))
        handles.append(block.register_forward_hook(_after(index, index in passed, relay, parked), with_kwargs=True))
        if relay is not None and index == relay.at and (start or relay.at):
            handles.append(block.register_forward_pre_hook(_relay(relay, put=bool(start)), with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for block in patched:
            del block.forward
        for index in list(parked):
            unload_block(parked, index)


def _passthrough(returns: int | None) -> Any:
    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return hidden_states if returns is None else (hidden_states, *([None] * (returns - 1)))

    return forward


def _replayer(bw: BlockwiseModel, index: int, written: int, replay: Replay, parked: Parked) -> Any:
    """Block `index`'s forward: the written block's output when called as the written block was, else its own."""
    block = bw.stack.layers[index]

    def forward(*args: Any, **kwargs: Any) -> Any:
        args_in, kwargs_in, output = replay.calls.get(written, (None, None, None))
        if args_in is not None and same_value(args, args_in) and same_value(kwargs, kwargs_in):
            replay.replayed.append(index)
            return output
        replay.computed.append(index)
        load_block(bw, index, parked)
        try:
            return type(block).forward(block, *args, **kwargs)
        finally:
            unload_block(parked, index)

    return forward


def _relay(relay: Relay, put: bool) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not put:
            relay.state = (args[0] if args else kwargs["hidden_states"]).clone()
            return None
        if args:
            return (relay.state, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": relay.state}

    return hook


def load_block(bw: BlockwiseModel, index: int, parked: Parked) -> nn.Module:
    """What `blockwise.fill_block` does (each tensor read from the files, seen by `bw.on_load`, put on the compute
    device in the compute dtype), without accelerate's per-tensor bookkeeping (a tenth of a small check's time): the
    loaded tensor replaces the meta parameter, which `parked` keeps for `unload_block`."""
    block = bw.stack.layers[index]
    if index in parked:
        return block
    kept = parked.setdefault(index, [])
    with _open_lazy(bw.checkpoint) as tensors:
        for name, param in list(block.named_parameters()):
            key = f"{bw.prefix}.{index}.{name}"
            if key not in bw.checkpoint.weight_map:
                raise LayerpruneError(f"block-major: {key} is not in the checkpoint")
            value = tensors(key)
            if bw.on_load is not None:
                bw.on_load(key, value)
            path, _, attr = name.rpartition(".")
            module = block.get_submodule(path)
            kept.append((module, attr, param))
            dtype = bw.dtype if value.is_floating_point() else None
            module._parameters[attr] = nn.Parameter(value.to(device=bw.device, dtype=dtype), requires_grad=False)
    return block


def unload_block(parked: Parked, index: int) -> None:
    """Put block `index`'s meta parameters back (the loaded tensors are freed)."""
    for module, attr, param in reversed(parked.pop(index, [])):
        module._parameters[attr] = param


def _before(bw: BlockwiseModel, index: int, parked: Parked) -> Any:
    def hook(module: nn.Module, args: tuple) -> None:
        load_block(bw, index, parked)

    return hook


def _after(index: int, skipped: bool, relay: Relay | None, parked: Parked) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        unload_block(parked, index)
        if relay is not None and not skipped:
            relay.returns.setdefault(type(module), len(output) if isinstance(output, tuple) else None)
        if not skipped:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook


def block_major_logits(
    bw: BlockwiseModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, skip: Sequence[int] = (),
    relay: Relay | None = None, start: int = 0, replay: Replay | None = None,
) -> torch.Tensor:
    """The model's own logits (float32), computed one loaded block at a time (see `streamed_blocks`)."""
    device = bw.device
    mask = attention_mask.to(device) if attention_mask is not None else None
    with torch.inference_mode(), streamed_blocks(bw, skip, relay, start, replay):
        out = bw.model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False)
    return out.logits.float()


def check_blockwise_head(bw: BlockwiseModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         hidden: torch.Tensor) -> float:
    """Block-major `DecoderStack.check_logits`: norm + head on the last block's output (`hidden`, from the scorer's
    own pass) against the model's own forward; refuse the model when they differ."""
    own = block_major_logits(bw, input_ids, attention_mask)
    with torch.inference_mode():
        ours = bw.stack.logits(hidden.to(bw.device)).float()
    return check_head_logits(own, ours, type(bw.model).__name__, how="block-major")


def check_per_layer_settings(source_config: Any, written_config: Any, kept: Sequence[int],
                             models: tuple[nn.Module, nn.Module] | None = None) -> int:
    """The blocks the written config builds are the kept blocks of the source config, setting by setting (on
    the meta device; `models`: both empty models when the caller has built them); raise naming the first
    difference. Returns how many settings were compared."""
    source, written = models or (empty_model(source_config), empty_model(written_config))
    before = find_decoder_stack(source).layers
    after = find_decoder_stack(written).layers
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


def skeleton(directory: Path, config: Any, device: torch.device, dtype: torch.dtype, **given: Any) -> BlockwiseModel:
    """`load_skeleton` (`given`: its optional arguments), refused up front (`BlockMajorUnsupported`) when a block's
    weights cannot be found."""
    try:
        bw = load_skeleton(directory, config, device, dtype, **given)
    except LayerpruneError as exc:
        raise BlockMajorUnsupported(str(exc)) from exc
    check_block_keys(bw)
    return bw


def _keys_only(directory: Path, config: Any, model: nn.Module | None = None) -> BlockwiseModel:
    """A skeleton with nothing loaded: enough to check the names of the block weights."""
    model = model if model is not None else empty_model(config)
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
    digests: Mapping[Stored, str] | None = None,
    empty_written: nn.Module | None = None,
    empty_source: nn.Module | None = None,
) -> dict[str, Any]:
    """Compare the written model with the original-with-skips, one block at a time; raise on a mismatch.

    `reference` is the original's logits with `drop` skipped when the caller has them; else they are computed
    block-major from `source_dir`. With `source_config`, the per-layer settings are compared as well. With
    `digests` (the copy's, of each source tensor it wrote), every written tensor is checked against the source
    tensor that belongs at its name as the written model loads it; then the original starts from the written
    model's state entering the block before the first dropped one and shares its embeddings, norm and head; when,
    besides, the two configs are alike (`block_replay.configs_alike`), the original runs its own forward from the
    start and each of its kept blocks built like its written block and called with the written block's very
    arguments returns that block's output instead of being loaded and run again (`block_replay`).
    `empty_written`, `empty_source`: the empty models (`blockwise.empty_model`) the caller built of the written and
    the source config, each used when it is what would be built here (`built_from`: the config in `written_dir` as
    it is now, or `source_config`, in `dtype`), else built again."""
    from transformers import AutoConfig

    start = time.perf_counter()
    written_config = AutoConfig.from_pretrained(written_dir)
    reuse = empty_written is not None and built_from(empty_written, written_config, dtype)
    written_model = empty_written if reuse and empty_written is not None else empty_model(written_config, dtype)
    check_block_keys(_keys_only(written_dir, written_config, written_model))  # refused before any weight is read
    with check_threads(find_decoder_stack(written_model).layers, device, input_ids.numel()):
        settings: int | str = "skipped: no source config"
        source_model, kept = None, list[int]()
        if source_config is not None:
            reuse = empty_source is not None and built_from(empty_source, source_config, dtype)
            source_model = empty_source if reuse and empty_source is not None else empty_model(source_config, dtype)
            depth = len(find_decoder_stack(source_model))
            kept = [i for i in range(depth) if i not in set(drop)]
            settings = check_per_layer_settings(source_config, written_config, kept, (source_model, written_model))
        phases = {"settings": time.perf_counter() - start}
        copies = None
        if digests is not None:
            assert source_dir is not None and source_model is not None
            copies = copy_check(source_dir, written_dir, drop, len(find_decoder_stack(source_model)), digests)
        replay = None
        if copies is not None and source_config is not None and configs_alike(source_config, written_config, kept):
            replay = Replay(kept)
        relay = Relay(at=max(min(drop) - 1, 0) if copies is not None and drop and replay is None else 0)
        written = skeleton(written_dir, written_config, device, dtype, model=written_model,
                           on_load=copies.tensor if copies is not None else None)
        with contextlib.ExitStack() as hooks:
            if replay is not None:
                hooks.enter_context(recording(written.stack.layers, replay))
            if copies is not None:
                hooks.enter_context(checked_in_use(written, copies.tensor))
            logits = block_major_logits(written, input_ids, attention_mask, relay=relay)
        phases["written"] = time.perf_counter() - start - sum(phases.values())
        record: dict[str, Any] = {}
        if copies is not None:
            record["bytes_compared"] = copies.rest()  # what the forward did not load (none in a plain decoder)
            phases["bytes"] = time.perf_counter() - start - sum(phases.values())
        if reference is None:
            assert source_dir is not None and source_config is not None
            shared = written if copies is not None else None
            del written
            reference = _reference_logits(source_dir, source_config, input_ids, attention_mask, drop, device, dtype,
                                          source_model, relay, shared, _Replaying(replay, copies) if replay else None)
            phases["reference"] = time.perf_counter() - start - sum(phases.values())
            if replay is not None:
                record["reference_blocks"] = {"replayed": len(replay.replayed),
                                              "computed": len(replay.kept) - len(replay.replayed)}
        agreement = check_logits_agree(logits, reference, rtol, WRITTEN_LOGITS_DIFFER, how="block-major",
                                       then="nothing was written")
        return {"logits_check": "block-major", **agreement.record(),
                "per_layer_settings": settings, "tokens": int(input_ids.numel()), **record,
                "seconds": round(time.perf_counter() - start, 2),
                "phase_seconds": {name: round(seconds, 3) for name, seconds in phases.items()}}


def built_from(model: nn.Module, config: Any, dtype: torch.dtype) -> bool:
    """Whether the empty `model` is what `empty_model(config, dtype)` builds: its config equal to `config` in every
    field a model is built from (`block_replay.NOT_COMPUTED` aside), its floating parameters in `dtype`."""
    def fields(settings: Any) -> dict[str, Any]:
        return {key: value for key, value in settings.to_dict().items() if key not in NOT_COMPUTED}

    return (fields(model.config) == fields(config)
            and all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()))


@contextlib.contextmanager
def checked_in_use(bw: BlockwiseModel, check: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """While open, each block tensor `bw` loads from its files is passed to `check` (with its key) just before the
    module that owns it runs, not as it is loaded: a check that reads the bytes (a hash) brings a weight into the CPU
    cache for its product, instead of a block's weights read from memory twice (the whole block hashed, then
    multiplied; on a CPU that was a third of the check's time). Whatever a block loaded and no module used by then
    is checked when the block returns, and all that is left on a normal exit; the tensors checked are the ones
    read from the files (before any cast to the compute dtype)."""
    loaded: dict[str, torch.Tensor] = {}
    before, bw.on_load = bw.on_load, loaded.__setitem__

    def flush(keys: Iterable[str]) -> None:
        for key in keys:
            if key in loaded:
                check(key, loaded.pop(key))

    handles = []
    for index, block in enumerate(bw.stack.layers):
        for path, module in block.named_modules():
            keys = [f"{bw.prefix}.{index}.{path + '.' if path else ''}{name}"
                    for name, _ in module.named_parameters(recurse=False)]
            if keys:
                handles.append(module.register_forward_pre_hook(lambda *_, keys=keys: flush(keys)))
        head = f"{bw.prefix}.{index}."
        handles.append(block.register_forward_hook(lambda *_, head=head: flush([k for k in loaded if
                                                                                 k.startswith(head)])))
    try:
        yield
        flush(list(loaded))
    finally:
        bw.on_load = before
        loaded.clear()
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def check_threads(blocks: nn.Module, device: torch.device, tokens: int) -> Iterator[int]:
    """While open, a check's CPU work on `tokens` tokens through `blocks` uses one thread per `THREAD_WORK`
    multiply-adds of its largest product (tokens x elements of the largest block weight, at least `READ_ROWS` rows:
    below that a product costs what reading its weight costs), at least one and at most torch's own count;
    restored on exit. A check multiplies each weight by a handful of rows: memory-bound work that one core does at
    memory speed, where each extra thread adds a barrier per product, and a barrier waits for a thread the scheduler
    may not run for a whole time slice on a busy machine (16 rows by a 4096 x 1024 bf16 weight: 2.4 ms on one
    thread, 20 ms on two with the other core busy). Yields the count."""
    before = torch.get_num_threads()
    if device.type != "cpu":
        yield before
        return
    largest = max((p.numel() for p in blocks.parameters()), default=0)
    count = max(1, min(before, max(tokens, READ_ROWS) * largest // THREAD_WORK))
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


@dataclass
class _Replaying:
    """The written model's recorded block calls and the byte check that saw its tensors load."""

    replay: Replay
    copies: CopyCheck


def _mark_alike(replaying: _Replaying, source: BlockwiseModel, written: BlockwiseModel) -> None:
    """The written blocks whose source block may be replayed: every tensor of the written block was loaded and
    hashed equal to the source tensor that belongs there, and the two blocks are built alike."""
    replay, seen = replaying.replay, replaying.copies.seen
    if source.prefix != written.prefix:
        return
    for new, old in enumerate(replay.kept):
        block = written.stack.layers[new]
        checked = all(f"{written.prefix}.{new}.{name}" in seen for name, _ in block.named_parameters())
        if checked and built_alike(source.stack.layers[old], block):
            replay.alike.add(new)


def _reference_logits(source_dir: Path, source_config: Any, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, drop: Sequence[int], device: torch.device,
                      dtype: torch.dtype, model: nn.Module | None = None, relay: Relay | None = None,
                      shared: BlockwiseModel | None = None, replaying: _Replaying | None = None) -> torch.Tensor:
    """The original's logits with `drop` skipped, from block `relay.at` on (the blocks before it shared), its
    non-block tensors taken from `shared` where given, its kept blocks replayed where `replaying` proves them the
    written ones; a skeleton with tensors of its own is freed before they are returned (by reference counting; a
    full garbage collection, 0.1-0.6 s with transformers loaded, only if a cycle keeps it alive)."""
    bw = skeleton(source_dir, source_config, device, dtype, model=model, shared=shared)
    own_tensors = shared is None  # else its embeddings, norm and head are the shared ones: nothing to free early
    if replaying is not None and shared is not None:
        _mark_alike(replaying, bw, shared)
    del model, shared
    alive = weakref.ref(bw.model)
    start = relay.at if relay is not None and relay.state is not None else 0
    logits = block_major_logits(bw, input_ids, attention_mask, drop, relay, start,
                                replaying.replay if replaying is not None else None)
    del bw
    if own_tensors and alive() is not None:
        gc.collect()
    return logits
