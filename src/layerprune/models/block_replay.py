"""The original's kept blocks replayed from the written model's forward, where that is provably the same computation.

A streamed prune's written block j holds the very bytes of the original's block kept[j] (the byte check hashes each
tensor as the written model's forward loads it). When, besides, the two blocks are built alike (the same module
classes, plain settings and buffers; the two configs the same but for the per-layer lists sliced to the kept blocks)
and the original's forward calls block kept[j] with exactly the arguments (hidden state included, compared with
`torch.equal`) that the written model's forward called block j with, running it would compute exactly what block j
returned: that output is handed back instead of being computed again. Anything not proven equal (a block built
differently, an argument that differs, a config field that is not the sliced one, bytes not checked) is computed
from the original's own files as before. The original's embeddings, loop, final norm, head and logit processing
always run as its own code: only the block bodies are replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

PER_LAYER_NAMES = ("layer_idx", "layer_index")  # renumbered by the surgery: the one setting that may differ
NOT_COMPUTED = ("_name_or_path", "transformers_version", "architectures", "_commit_hash", "dtype", "torch_dtype")


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


@dataclass
class Replay:
    """The written model's block calls (written index -> args, kwargs, output; the hidden state cloned before the
    block ran), the written blocks whose source block may be replayed, and which source blocks were."""

    kept: list[int]
    calls: dict[int, tuple[tuple, dict, Any]] = field(default_factory=dict)
    alike: set[int] = field(default_factory=set)  # written indices: same build, bytes checked
    replayed: list[int] = field(default_factory=list)  # source indices
    computed: list[int] = field(default_factory=list)

    def record(self) -> dict[str, int]:
        return {"replayed": len(self.replayed), "computed": len(self.computed)}


@contextlib.contextmanager
def recording(layers: Sequence[nn.Module], replay: Replay) -> Iterator[None]:
    """While open, every call of `layers[j]` is kept in `replay.calls[j]`."""
    handles = []
    for index, block in enumerate(layers):
        handles.append(block.register_forward_pre_hook(_keep_input(replay, index), with_kwargs=True))
        handles.append(block.register_forward_hook(_keep_output(replay, index), with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _keep_input(replay: Replay, index: int) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if args:
            args = _first_cloned(args)
        elif "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": _first_cloned((kwargs["hidden_states"],))[0]}
        replay.calls[index] = (args, dict(kwargs), None)

    return hook


def _keep_output(replay: Replay, index: int) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        args_in, kwargs_in, _ = replay.calls[index]
        kept = _first_cloned(output) if isinstance(output, tuple) else _first_cloned((output,))[0]
        replay.calls[index] = (args_in, kwargs_in, kept)

    return hook


def _first_cloned(values: tuple) -> tuple:
    """`values` with its first item cloned when it is a tensor (the hidden state: what a later in-place step could
    change after it was recorded)."""
    if values and isinstance(values[0], torch.Tensor):
        return (values[0].clone(), *values[1:])
    return values


def same_value(a: Any, b: Any) -> bool:
    """Exactly equal: tensors by dtype, shape, device and every element; containers item by item; plain values by
    `==`; any other object only if it is the same object."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device)):
        return type(a) is type(b) and a == b
    return a is b


def built_alike(source: nn.Module, written: nn.Module) -> bool:
    """The same module classes under the same names, parameters of the same names, shapes and dtypes, the same
    plain settings (but the block index) and buffers equal element for element."""
    if [(n, type(m)) for n, m in source.named_modules()] != [(n, type(m)) for n, m in written.named_modules()]:
        return False
    shapes = [[(n, p.shape, p.dtype) for n, p in model.named_parameters()] for model in (source, written)]
    if shapes[0] != shapes[1] or block_settings(source) != block_settings(written):
        return False
    buffers = [dict(model.named_buffers()) for model in (source, written)]
    return buffers[0].keys() == buffers[1].keys() and all(
        not value.is_meta and same_value(value, buffers[1][name]) for name, value in buffers[0].items())


def configs_alike(source: Any, written: Any, kept: Sequence[int]) -> bool:
    """`written` is `source` with every per-layer list (one entry per source block) cut to the kept blocks and
    `num_hidden_layers` the kept count; every other field equal (nested configs alike)."""
    return _dicts_alike(source.to_dict(), written.to_dict(), kept)


def _dicts_alike(source: dict, written: dict, kept: Sequence[int]) -> bool:
    depth = source.get("num_hidden_layers")
    keys = (set(source) | set(written)) - set(NOT_COMPUTED)
    for key in keys:
        want, got = source.get(key, "<absent>"), written.get(key, "<absent>")
        if key == "num_hidden_layers" and isinstance(want, int):
            want = len(kept)
        elif isinstance(want, list) and depth is not None and len(want) == depth:
            want = [want[index] for index in kept]
        elif isinstance(want, dict) and isinstance(got, dict) and "num_hidden_layers" in want:
            if not _dicts_alike(want, got, kept):
                return False
            continue
        if want != got:
            return False
    return True
