"""Prune without loading the model: `--layers`, `last` and `random` stream the checkpoint shard by shard."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import atomic_output_dir
from layerprune.core.settings import RunSettings
from layerprune.models.blocks import find_decoder_stack, skipped_blocks, slice_layer_config
from layerprune.models.blockwise import empty_model
from layerprune.models.identity import undigested_files
from layerprune.models.loading import (
    ModelSource,
    _load_config,
    check_decoder_only,
    copy_tokenizer_files,
    load_tokenizer,
)
from layerprune.models.safetensors_copy import CopyResult
from layerprune.models.shards import (
    StreamPlan,
    copy_side_files,
    count_parameters,
    plan_stream,
    read_checkpoint,
    verify_stream,
    write_stream,
    written_shapes,
)
from layerprune.models.surgery import NO_SPACE, check_config_builds, check_config_matches_weights, check_free_space
from layerprune.prune.common import add_weights_hash
from layerprune.prune.report import Saved, Verification

log = logging.getLogger(__name__)


def checkpoint_dir(source: ModelSource) -> Path | None:
    """The local directory of the source's safetensors files (downloaded for the hub); None when it has none."""
    if source.kind == "hub":  # at the commit the id resolves to, only the files the checkpoint's index names
        from layerprune.models.hub import download_checkpoint, resolve_revision

        path = download_checkpoint(source.location, resolve_revision(source))
        source.identity.setdefault("revision", path.name)
    else:
        path = Path(source.location)
    return path if any(path.glob("*.safetensors")) else None


def stream_pruned(source_dir: Path, drop: list[int], target: Path, settings: RunSettings, config: Any = None,
                  force: bool = False, label: Path | str | None = None,
                  digest_files: Collection[str] = (), model_dtype: torch.dtype | None = None,
                  plan: StreamPlan | None = None) -> dict[str, Any]:
    """Write the weights of the model without `drop`, plus its config, into `target`; return what was written
    (with `file_digests`: the `file_digest` of each source file in `digest_files`, from the copy's own pass;
    `tensor_digests`: the digest of each source tensor copied, of the bytes written, for the byte check;
    `models`: the empty source model the surgery ran on and, with `model_dtype`, the written one, for the
    verification to use rather than build again).

    The surgery runs on the source model built empty (`blockwise.empty_model`, in the config's dtype), undone
    after: the new config is its config with the blocks dropped. The new config is checked before it is kept: the
    model class built from it on the meta device expects exactly the written tensors (names and shapes). With
    `model_dtype`, that model is built from the config as written, read back, in `model_dtype` with real buffers:
    the empty written model the verification needs. `plan`: the caller's `plan_stream` of the same prune."""
    start = time.perf_counter()
    config = config if config is not None else _source_config(source_dir)
    source_model = empty_model(copy.deepcopy(config), _stored_dtype(config))
    if plan is None:
        plan = plan_stream(read_checkpoint(source_dir), drop, _text(config).num_hidden_layers, settings.max_shard_size)
    with skipped_blocks(source_model, drop, force) as kept:  # a config the family cannot express: before writing
        if len(find_decoder_stack(source_model)) != len(kept):
            raise LayerpruneError("surgery on the meta model left the wrong number of blocks")
        copied = _write_stream(plan, target, digest_files, label or target)
        verify_start = time.perf_counter()
        keys: int | str = "skipped: this family converts its checkpoint keys on load (checked by reloading instead)"
        source_model.config.save_pretrained(target)  # in a temp dir: a refused config goes with it
        built = check_config_builds(source_model, _written_model(target, model_dtype) if model_dtype else None)
        if not _converts_keys_on_load(source_model, plan.renamed.values()):
            keys = check_config_matches_weights(source_model, written_shapes(target), built)
        verify_stream(plan, target, source_model.config)
    copy_side_files(source_dir, target)
    return {"shards": len(plan.shards), "bytes": plan.total_bytes, "dtypes": plan.dtypes, "kept": plan.kept,
            "seconds": round(time.perf_counter() - start, 2), "file_digests": copied.file_digests,
            "tensor_digests": copied.tensor_digests,
            "models": {"source": source_model, "written": built if model_dtype is not None else None},
            "meta_check": {"keys": keys, "seconds": round(time.perf_counter() - verify_start, 2)}}


def _stored_dtype(config: Any) -> Any:
    """The config's own dtype entry, as `from_config` reads it when given none (the new config keeps it)."""
    dtype = getattr(config, "dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _write_stream(plan: StreamPlan, target: Path, digest_files: Collection[str], label: Path | str) -> CopyResult:
    check_free_space(target, plan.total_bytes, label)
    try:
        return write_stream(plan, target, digest_files)
    except Exception as exc:
        if NO_SPACE.search(str(exc)) or getattr(exc, "errno", None) == 28:
            raise LayerpruneError(f"no space left on device while writing {label}: it needs about "
                                  f"{plan.total_bytes / 1e9:.2f} GB; nothing was written") from exc
        raise


def _written_model(target: Path, dtype: torch.dtype) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import AutoConfig

        return empty_model(AutoConfig.from_pretrained(target), dtype)

    return build


def _converts_keys_on_load(meta: Any, written_names: Collection[str]) -> bool:
    """Whether the pruned model class's state dict names (`meta`, built on the meta device) differ from the names
    the files are written with (e.g. MoE experts fused on load): the same answer as for the source, whose names
    are these but for the block numbers, without building the source model a second time."""
    return not set(written_names) <= set(meta.state_dict())


def _source_config(source_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source_dir)


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def describe_source(source: ModelSource, settings: RunSettings) -> tuple[Path, Any, int, int]:
    """Checkpoint dir, config, depth and stored parameter count, read from the files alone."""
    directory = checkpoint_dir(source)
    if directory is None:
        raise LayerpruneError(f"{source.spec} has no safetensors files to stream")
    config = _load_config(source, settings)
    check_decoder_only(config, source.spec)
    return directory, config, _text(config).num_hidden_layers, count_parameters(read_checkpoint(directory))


def per_layer_config(config: Any, kept: list[int] | None = None) -> dict[str, Any]:
    """The per-layer fields of a config (after slicing to `kept` when given)."""
    import copy

    text = copy.deepcopy(_text(config))
    if kept is not None:
        slice_layer_config(text, kept, text.num_hidden_layers, force=True)  # a record only; the prune checked it
    keys = ("num_hidden_layers", "layer_types", "max_window_layers", "sliding_window")
    return {key: getattr(text, key) for key in keys if getattr(text, key, None) is not None}


def save_streamed(source: ModelSource, source_dir: Path, drop: list[int], report: dict[str, Any], output: Path,
                  overwrite: bool, settings: RunSettings, finish: Any, force: bool = False,
                  hash_weights: bool = False, written_out: dict[str, Any] | None = None,
                  model_dtype: torch.dtype | None = None, plan: StreamPlan | None = None) -> None:
    """Stream the weights into a temp dir, add tokenizer and report files (`finish(tmp)`), rename into place.

    With `hash_weights` (a local source whose identity the caller left for now), the weight files the digest memo
    does not know are digested by the copy's own pass, and `source.identity["weights_xxh3_128"]` is set before
    `finish`.
    `written_out`, when given, receives what `stream_pruned` returned (the copy's digests among it) before `finish`;
    `model_dtype`, `plan`: see `stream_pruned`."""
    start = time.perf_counter()
    cache = settings.resolved_cache_dir()
    pending = undigested_files(source_dir, cache) if hash_weights else []
    with atomic_output_dir(output, overwrite) as tmp:
        written = stream_pruned(source_dir, drop, tmp, settings, force=force, label=output,
                                digest_files={path.name for path in pending if path.suffix == ".safetensors"},
                                model_dtype=model_dtype, plan=plan)
        if written_out is not None:
            written_out.update(written)
        if hash_weights:
            add_weights_hash(source, settings, written["file_digests"])
        copy_tokenizer_files(source, tmp, load_tokenizer(source, settings))
        report["saved"] = Saved(how="streamed from the source safetensors files", shards=written["shards"],
                                bytes=written["bytes"], dtypes=written["dtypes"])
        report["verification"] = Verification(checked="meta", keys=written["meta_check"]["keys"],
                                              seconds=written["meta_check"]["seconds"])
        report["timings"].save_s = round(time.perf_counter() - start, 2)
        finish(tmp, report)
