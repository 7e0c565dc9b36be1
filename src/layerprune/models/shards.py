"""Drop decoder blocks from a safetensors checkpoint without loading the model: stream it shard by shard.

Shards are planned by huggingface_hub's `split_torch_state_dict_into_shards` from the headers (tensors mapped by
safetensors' lazy `safe_open`, never read) and written as byte copies of the source's data ranges under the new
names (`safetensors_copy`): one chunk in memory, in each tensor's own dtype, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import STACK_PATHS, check_block_indices, drop_blocks, find_decoder_stack
from layerprune.models.safetensors_check import open_safetensors
from layerprune.models.safetensors_copy import (
    CopyResult,
    copy_tensors,
    plan_layout,
    read_headers,
)

INDEX_NAME = "model.safetensors.index.json"
SIDE_FILES = ("generation_config.json",)
_BLOCK_KEY = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")


@dataclass
class Checkpoint:
    """A directory of safetensors files: which file holds each tensor."""

    directory: Path
    weight_map: dict[str, str]

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def read_checkpoint(directory: Path) -> Checkpoint:
    """The tensor -> file map, from the index json or from the headers of the *.safetensors files."""
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted(f for f in set(weight_map.values()) if not (directory / f).is_file())  # a stat per file
        if missing:
            raise LayerpruneError(f"{directory} lacks shard(s) {missing[:3]} named in {INDEX_NAME}")
        return Checkpoint(directory, dict(weight_map))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LayerpruneError(f"{directory} holds no *.safetensors files")
    weight_map = {}
    for file in files:
        with open_safetensors(file) as handle:
            weight_map.update({key: file.name for key in handle.keys()})
    return Checkpoint(directory, weight_map)


def block_prefix(names: Sequence[str], depth: int) -> str:
    """The key prefix of the decoder blocks ('model.layers'): the one whose indices cover 0..depth-1."""
    indices: dict[str, set[int]] = defaultdict(set)
    for name in names:
        match = _BLOCK_KEY.match(name)
        if match:
            indices[match["prefix"]].add(int(match["index"]))
    fits = [p for p, seen in indices.items() if set(range(depth)) <= seen]
    if len(fits) > 1:
        fits = [p for p in fits if any(p == s or p.endswith("." + s) for s in STACK_PATHS)] or fits
    if len(fits) != 1:
        found = ", ".join(sorted(indices)) or "none"
        raise LayerpruneError(f"cannot tell which tensors are the {depth} decoder blocks (numbered prefixes: {found})")
    return fits[0]


def rename_map(names: Sequence[str], prefix: str, kept: Sequence[int], depth: int) -> dict[str, str]:
    """Old -> new name of every kept tensor; blocks renumbered, extra blocks past the stack (MTP) shifted down."""
    new_index = {old: new for new, old in enumerate(kept)}
    shift = depth - len(kept)
    renamed = {}
    for name in names:
        match = _BLOCK_KEY.match(name)
        if not match or match["prefix"] != prefix:
            renamed[name] = name
            continue
        index = int(match["index"])
        if index >= depth:
            renamed[name] = f"{prefix}.{index - shift}.{match['rest']}"
        elif index in new_index:
            renamed[name] = f"{prefix}.{new_index[index]}.{match['rest']}"
    return renamed


@dataclass
class StreamPlan:
    """What a streamed prune writes: renamed tensors, grouped into output shards."""

    checkpoint: Checkpoint
    renamed: dict[str, str]  # old name -> new name, kept tensors only
    shards: dict[str, list[str]]  # output file -> new names
    metadata: dict[str, Any]  # total_size etc. for the index
    sharded: bool
    dtypes: dict[str, int]  # dtype -> tensor count
    kept: list[int]
    prefix: str

    @property
    def total_bytes(self) -> int:
        return int(self.metadata.get("total_size", 0))


def plan_stream(checkpoint: Checkpoint, drop: Sequence[int], depth: int, max_shard_size: int | str) -> StreamPlan:
    """Decide every output name and shard from the headers alone (the tensors are mapped, never read)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    drop = check_block_indices(drop, depth, "blocks to drop")
    kept = [i for i in range(depth) if i not in set(drop)]
    prefix = block_prefix(list(checkpoint.weight_map), depth)
    renamed = rename_map(list(checkpoint.weight_map), prefix, kept, depth)
    dtypes: dict[str, int] = defaultdict(int)
    with _open_lazy(checkpoint) as tensors:
        lazy = {renamed[old]: tensors(old) for old in renamed}
        for tensor in lazy.values():
            dtypes[str(tensor.dtype).removeprefix("torch.")] += 1
        split = split_torch_state_dict_into_shards(lazy, max_shard_size=max_shard_size)
        del lazy
    return StreamPlan(checkpoint, renamed, {f: list(n) for f, n in split.filename_to_tensors.items()},
                      dict(split.metadata), split.is_sharded, dict(dtypes), kept, prefix)


def write_stream(plan: StreamPlan, target: Path, digest_files: Collection[str] = ()) -> CopyResult:
    """Write the planned shards (and index) into `target` as byte copies of the source's tensor data (one chunk at a
    time), each tensor's digest taken of the bytes written; the source files in `digest_files` get their
    `file_digest` from the same pass."""
    stored = read_headers(plan.checkpoint.directory, plan.checkpoint.files)
    old_name = {new: old for old, new in plan.renamed.items()}
    layouts = {f: plan_layout({name: stored[old_name[name]] for name in names}) for f, names in plan.shards.items()}
    result = copy_tensors(plan.checkpoint.directory, layouts, target, digest_files)
    if plan.sharded:
        weight_map = {name: f for f, names in plan.shards.items() for name in names}
        index = {
            "metadata": {**plan.metadata, "total_parameters": count_parameters(plan.checkpoint, list(plan.renamed))},
            "weight_map": weight_map,
        }
        (target / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return result


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@contextlib.contextmanager
def _open_lazy(checkpoint: Checkpoint) -> Iterator[Any]:
    """`get(name)` -> the tensor mapped from its file; files open on first use and close on exit."""
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get(name: str) -> torch.Tensor:
            file = checkpoint.weight_map[name]
            if file not in handles:
                handles[file] = stack.enter_context(open_safetensors(checkpoint.directory / file))
            return handles[file].get_tensor(name)

        yield get


def count_parameters(checkpoint: Checkpoint, names: Sequence[str] | None = None) -> int:
    """Elements stored in the checkpoint (all tensors, or `names`), read from the headers."""
    wanted = set(checkpoint.weight_map if names is None else names)
    total = 0
    for file in checkpoint.files:
        with open_safetensors(checkpoint.directory / file) as handle:
            total += sum(_numel(handle.get_slice(k).get_shape()) for k in handle.keys() if k in wanted)
    return total


def sliced_config(config: Any, drop: Sequence[int], force: bool = False) -> Any:
    """The config of the pruned model: `drop_blocks` applied to the model built on the meta device."""
    return pruned_meta_model(config, drop, force).config


def pruned_meta_model(config: Any, drop: Sequence[int], force: bool = False) -> Any:
    """The model built from `config` on the meta device with `drop` removed by `drop_blocks` (config rewritten)."""
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():  # initialising meta tensors only costs time
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))  # drop_blocks rewrites the config in place
    kept = drop_blocks(model, drop, force)
    if len(find_decoder_stack(model)) != len(kept):
        raise LayerpruneError("surgery on the meta model left the wrong number of blocks")
    return model


def written_shapes(target: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the safetensors files of `target` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(target.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
    return shapes


def verify_stream(plan: StreamPlan, target: Path, config: Any) -> None:
    """The written files hold the planned tensors; new block i has exactly the tensors of kept block i."""
    written = read_checkpoint(target)
    if set(written.weight_map) != set(plan.renamed.values()):
        raise LayerpruneError(f"streamed checkpoint in {target} does not hold the planned tensors")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text.num_hidden_layers != len(plan.kept):
        raise LayerpruneError(
            f"sliced config has {text.num_hidden_layers} blocks, the streamed weights {len(plan.kept)}"
        )
    suffixes: dict[int, set[str]] = defaultdict(set)
    for name in written.weight_map:
        match = _BLOCK_KEY.match(name)
        if match and match["prefix"] == plan.prefix and int(match["index"]) < len(plan.kept):
            suffixes[int(match["index"])].add(match["rest"])
    if any(suffixes[new] != _block_suffixes(plan, old) for new, old in enumerate(plan.kept)):
        raise LayerpruneError("streamed blocks are not renumbered 0..N-1 with their original tensors")


def _block_suffixes(plan: StreamPlan, index: int) -> set[str]:
    head = f"{plan.prefix}.{index}."
    return {name[len(head) :] for name in plan.checkpoint.weight_map if name.startswith(head)}


def copy_side_files(source: Path, target: Path) -> None:
    """Files that travel unchanged with the weights (generation config)."""
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
