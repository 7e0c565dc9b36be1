"""Prune without loading the model: `--layers`, `last` and `random` stream the checkpoint shard by shard."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import atomic_output_dir
from layerprune.core.settings import RunSettings
from layerprune.models.blocks import slice_layer_config
from layerprune.models.identity import undigested_files
from layerprune.models.loading import (
    ModelSource,
    _load_config,
    check_decoder_only,
    copy_tokenizer_files,
    load_tokenizer,
)
from layerprune.models.shards import (
    copy_side_files,
    count_parameters,
    plan_stream,
    pruned_meta_model,
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
                  digest_files: Collection[str] = ()) -> dict[str, Any]:
    """Write the weights of the model without `drop`, plus its config, into `target`; return what was written
    (with `file_digests`: the `file_digest` of each source file in `digest_files`, from the copy's own pass;
    `tensor_digests`: the digest of each source tensor copied, of the bytes written, for the byte check).

    The new config is checked before it is kept: the model class built from it on the meta device expects exactly
    the written tensors (names and shapes)."""
    start = time.perf_counter()
    config = config if config is not None else _source_config(source_dir)
    depth = _text(config).num_hidden_layers
    meta = pruned_meta_model(config, drop, force)  # a config the family cannot express is refused before writing
    plan = plan_stream(read_checkpoint(source_dir), drop, depth, settings.max_shard_size)
    label = label or target
    check_free_space(target, plan.total_bytes, label)
    try:
        copied = write_stream(plan, target, digest_files)
    except Exception as exc:
        if NO_SPACE.search(str(exc)) or getattr(exc, "errno", None) == 28:
            raise LayerpruneError(f"no space left on device while writing {label}: it needs about "
                                  f"{plan.total_bytes / 1e9:.2f} GB; nothing was written") from exc
        raise
    verify_start = time.perf_counter()
    keys: int | str = "skipped: this family converts its checkpoint keys on load (checked by reloading instead)"
    if not _converts_keys_on_load(meta, plan.renamed.values()):
        keys = check_config_matches_weights(meta, written_shapes(target))
    else:
        check_config_builds(meta)
    meta.config.save_pretrained(target)
    verify_stream(plan, target, meta.config)
    copy_side_files(source_dir, target)
    return {"shards": len(plan.shards), "bytes": plan.total_bytes, "dtypes": plan.dtypes, "kept": plan.kept,
            "seconds": round(time.perf_counter() - start, 2), "file_digests": copied.file_digests,
            "tensor_digests": copied.tensor_digests,
            "meta_check": {"keys": keys, "seconds": round(time.perf_counter() - verify_start, 2)}}


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
                  hash_weights: bool = False, written_out: dict[str, Any] | None = None) -> None:
    """Stream the weights into a temp dir, add tokenizer and report files (`finish(tmp)`), rename into place.

    With `hash_weights` (a local source whose identity the caller left for now), the weight files the digest memo
    does not know are digested by the copy's own pass, and `source.identity["weights_xxh3_128"]` is set before
    `finish`.
    `written_out`, when given, receives what `stream_pruned` returned (the copy's digests among it) before `finish`."""
    start = time.perf_counter()
    cache = settings.resolved_cache_dir()
    pending = undigested_files(source_dir, cache) if hash_weights else []
    with atomic_output_dir(output, overwrite) as tmp:
        written = stream_pruned(source_dir, drop, tmp, settings, force=force, label=output,
                                digest_files={path.name for path in pending if path.suffix == ".safetensors"})
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
