"""The from-files route: choose blocks by index or score them block-major, then stream the checkpoint; the model
is never loaded whole."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models import ModelSource, load_model
from layerprune.models.copy_check import copy_check
from layerprune.models.layer_fields import check_layer_fields
from layerprune.models.loading import device_map_kwargs, load_tokenizer
from layerprune.models.logits_check import logits_rtol
from layerprune.models.safetensors_copy import Stored
from layerprune.models.shards import count_parameters, plan_stream, read_checkpoint
from layerprune.models.surgery import checkpoint_dtype, compare_reloaded_logits, dtype_name
from layerprune.models.verify_blockwise import BlockMajorUnsupported, fits_whole, verify_block_major
from layerprune.prune.calib import CalibSet, load_calibration, tokenize_calibration
from layerprune.prune.common import (
    add_weights_hash,
    build_report,
    check_request,
    close_report,
    probe_inputs,
    progress_bar,
    reference_probe,
    torch_dtype,
    write_report_files,
)
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.report import Dtypes, Timings, Verification
from layerprune.prune.scores import ScoreContext, ScoreResult, run_importance_score
from layerprune.prune.streaming import checkpoint_dir, describe_source, per_layer_config, save_streamed
from layerprune.tasks.data import resolve_data_dir

log = logging.getLogger(__name__)
PROBE_POSITIONS = 4  # per row, in the streamed block-major check
PROBE_ROWS = 1  # of the probe batch, in the streamed block-major check


def stream_when_possible(source: ModelSource, recipe: PruneRecipe, settings: RunSettings, output: Path | None,
                         overwrite: bool, dry_run: bool, started: float) -> dict[str, Any] | None:
    """The from-files route's report when it applies (blocks chosen without data, saved in the checkpoint's own
    dtype, from safetensors files; or --block-major, which must have them); None when the model is to be loaded."""
    by_index = recipe.target is None and not recipe.needs_calibration
    if not ((by_index and settings.dtype == "auto") or settings.block_major):  # --dtype asks for a cast: load, save
        return None
    source_dir = checkpoint_dir(source)
    if source_dir is not None:
        return prune_from_files(source, source_dir, recipe, settings, output, overwrite, dry_run, started)
    if settings.block_major:
        raise LayerpruneError(f"--block-major reads the safetensors files, and {source.spec} has none")
    return None


def prune_from_files(
    source: ModelSource,
    source_dir: Path,
    recipe: PruneRecipe,
    settings: RunSettings,
    output: Path | None,
    overwrite: bool,
    dry_run: bool,
    started: float,
) -> dict[str, Any]:
    """Choose blocks by index (explicit, last, random) and stream the checkpoint: the model is never loaded.

    When blocks are chosen without data and the output is written, the weights the hash memo does not know are
    hashed beside the copy (a thread reads each file while its kept ranges are copied; one page cache), not by a
    pass of its own; the hash is in the report before it is written."""
    writes = not dry_run and output is not None
    hash_in_copy = writes and source.kind == "local" and not recipe.needs_calibration
    refuse_sublayers(recipe)
    if not hash_in_copy:
        add_weights_hash(source, settings)
    _, config, depth, params_before = describe_source(source, settings)
    check_layer_fields(config.get_text_config() if hasattr(config, "get_text_config") else config, depth, recipe.force)
    protected = recipe.protected_blocks(depth)
    check_request(recipe, depth, protected)
    calib, score_seconds = None, 0.0
    if recipe.layers is not None:
        result = ScoreResult([None] * depth, sorted(recipe.layers))
    elif not recipe.needs_calibration:
        result = run_importance_score(
            recipe.score,
            ScoreContext(
                model=None,
                tokenizer=None,
                stack=None,
                batches=[],
                calib=CalibSet([], "none"),
                drop=recipe.n_drop,
                protected=protected,
                seed=settings.seed,
                params=recipe.score_params,
                num_blocks=depth,
            ),
        )
    else:
        calib, result, score_seconds = _score_block_major(source, source_dir, config, recipe, settings, protected)
    plan = plan_stream(read_checkpoint(source_dir), result.drop, depth, settings.max_shard_size)
    log.info(
        "plan: %s, %d -> %d blocks, streamed from %d file(s) into %d shard(s), %.2f GB (%s)",
        source.spec,
        depth,
        len(plan.kept),
        len(plan.checkpoint.files),
        len(plan.shards),
        plan.total_bytes / 1e9,
        plan.dtypes,
    )
    report = build_report(
        source,
        recipe,
        settings,
        protected,
        calib,
        result,
        plan.kept,
        depth,
        params_before,
        count_parameters(plan.checkpoint, list(plan.renamed)),
    )
    report["config_per_layer"] = {"before": per_layer_config(config), "after": per_layer_config(config, plan.kept)}
    report["timings"] = Timings(load_s=0.0, score_s=round(score_seconds, 2))
    if writes:
        assert output is not None

        written: dict[str, Any] = {}

        compute = _compute_dtype(config, source_dir, settings)

        def finish(tmp: Path, report: dict[str, Any]) -> None:
            if recipe.verify:
                _verify_streamed(source, source_dir, config, settings, tmp, report, result.drop, calib,
                                 written["tensor_digests"], written["models"])
            write_report_files(tmp, report)

        report["dtype"] = _streamed_dtypes(config, source_dir, settings)
        save_streamed(source, source_dir, result.drop, report, output, overwrite, settings, finish, recipe.force,
                      hash_weights=hash_in_copy, written_out=written, model_dtype=compute if recipe.verify else None,
                      plan=plan)
    return close_report(report, started)


def _streamed_dtypes(config: Any, source_dir: Path, settings: RunSettings) -> Dtypes:
    stored = checkpoint_dtype(config, source_dir)
    name = dtype_name(stored) if stored else None
    return Dtypes(checkpoint=name, computed_in=dtype_name(settings.resolved_dtype()), saved=name,
                  chosen_by="checkpoint")


def _compute_dtype(config: Any, source_dir: Path, settings: RunSettings) -> torch.dtype:
    """The verification's: the stored dtype with --dtype auto (not float32 on the CPU: one block of the stored size
    at a time), else --dtype's."""
    stored = checkpoint_dtype(config, source_dir)
    return stored if settings.dtype == "auto" and stored is not None else settings.resolved_dtype()


def _verify_streamed(
    source: ModelSource,
    source_dir: Path,
    config: Any,
    settings: RunSettings,
    tmp: Path,
    report: dict[str, Any],
    drop: list[int],
    calib: CalibSet | None,
    digests: Mapping[Stored, str],
    models: Mapping[str, nn.Module | None] | None = None,
) -> None:
    """Every written tensor byte for byte the source tensor that belongs at its name (its digest against the one the
    copy took of the source bytes it wrote: the source is not read again), checked as the written model's
    block-major forward loads it; then the written model's logits against the original's own forward with `drop`
    skipped, each kept block of which is replayed from the written forward where it is proven the same computation
    on the same arguments, else loaded and run (one block in memory at a time; `models.block_replay`). For a family
    whose files the block-major way cannot read, the bytes are read and checked on their own, and both models
    reloaded whole one after the other when that fits. The streamed files were already checked by name and against
    the new config on the meta device; `models`: the empty source and written models the copy built for its own
    checks (`stream_pruned`), used where they are what the verification would build."""
    start = time.perf_counter()
    meta: Verification = report["verification"]
    device = settings.resolved_device()
    compute = _compute_dtype(config, source_dir, settings)
    ids, mask = probe_positions(*probe_inputs(load_tokenizer(source, settings), calib, device))
    rtol = logits_rtol(compute)  # the streamed files are the source's tensors, bit for bit
    try:
        record = verify_block_major(config, tmp, drop, ids, mask, device, compute, rtol, source_dir=source_dir,
                                    digests=digests, empty_written=(models or {}).get("written"),
                                    empty_source=(models or {}).get("source"))
    except BlockMajorUnsupported as exc:
        bytes_start = time.perf_counter()
        compared = copy_check(source_dir, tmp, drop, _depth(config), digests).rest()
        bytes_seconds = round(time.perf_counter() - bytes_start, 3)
        record = {**_verify_whole(source, source_dir, settings, tmp, drop, calib, rtol, str(exc)),
                  "bytes_compared": compared, "phase_seconds": {"bytes": bytes_seconds}}
    verification = Verification(**{
        **meta.model_dump(),
        **record,
        "checked": isinstance(record.get("max_abs_diff"), float),
        "seconds": round((meta.seconds or 0.0) + time.perf_counter() - start, 2),
    })
    report["verification"] = verification
    report["timings"].verify_s = verification.seconds


def _depth(config: Any) -> int:
    return int((config.get_text_config() if hasattr(config, "get_text_config") else config).num_hidden_layers)


def probe_positions(ids: torch.Tensor, mask: torch.Tensor | None, positions: int = PROBE_POSITIONS,
                    rows: int = PROBE_ROWS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The probe cut to its first `rows` rows and their first `positions` columns (their last ones when the mask is
    padded on the left: some row starts with padding and ends with a real token), so every row keeps a real token.
    The side is read from the whole batch's mask, not the tokenizer: calibration batches are padded on the right
    whatever the tokenizer's side. Enough for what the streamed check is there to see beyond the byte comparison
    (blocks in the wrong order, a config the model code reads by block index, a head or embedding mapped wrong,
    rotary against no-rope layers); attention windows are longer than any probe of a real model. On a CPU each
    forward's cost grows with the tokens: with 2 x 27 of the fixed text, the two were most of a CPU prune's time,
    and a second row of 4 still cost a tenth of it (each weight's product with 8 rows instead of 4)."""
    left = mask is not None and bool(((mask[:, 0] == 0) & (mask[:, -1] != 0)).any())
    cut = slice(-positions, None) if left else slice(0, positions)
    return ids[:rows, cut], mask[:rows, cut] if mask is not None else None


def _verify_whole(
    source: ModelSource,
    source_dir: Path,
    settings: RunSettings,
    tmp: Path,
    drop: list[int],
    calib: CalibSet | None,
    rtol: float,
    why: str,
) -> dict[str, Any]:
    """The original loaded whole, its skip logits kept, the original freed, then the written model reloaded (on
    the same device map); skipped when the original does not fit."""
    size = sum(path.stat().st_size for path in source_dir.glob("*.safetensors"))
    if not settings.device_map and not fits_whole(size, settings.resolved_device()):
        return {"logits_check": f"skipped: block-major is not possible ({why}) and the whole model does not fit"}
    loaded = load_model(source, settings)
    probe = reference_probe(loaded, calib, drop)
    compute, device = torch_dtype(loaded), probe.input_ids.device
    del loaded
    gc.collect()
    record = compare_reloaded_logits(tmp, probe.input_ids, probe.attention_mask, probe.logits, compute, device, rtol,
                                     device_map_kwargs(settings))
    return {**record, "logits_check": "whole-model", "block_major": f"not possible: {why}",
            "tokens": int(probe.input_ids.numel())}


def _score_block_major(
    source: ModelSource, source_dir: Path, config: Any, recipe: PruneRecipe, settings: RunSettings, protected: list[int]
) -> tuple[CalibSet, ScoreResult, float]:
    """Score one block at a time from the files; print the memory plan first."""
    from layerprune.models.blockwise import load_skeleton
    from layerprune.prune.blockwise import plan_for, score_blockwise

    calib = load_calibration(recipe.calib, recipe.calib_samples, settings.seed, resolve_data_dir(recipe.data_dir))
    batches = tokenize_calibration(calib, load_tokenizer(source, settings), recipe.calib_seq_len, recipe.batch_size)
    plan = plan_for(config, recipe.score, batches, settings.resolved_dtype(), recipe.n_drop)
    for line in ["block-major plan:", *plan.lines()]:
        log.info(line)
    check_max_memory(plan.peak_bytes, plan.lines(), settings)
    start = time.perf_counter()
    bw = load_skeleton(source_dir, config, settings.resolved_device(), settings.resolved_dtype())
    with progress_bar(f"scoring {len(bw)} blocks block-major ({recipe.score})") as progress:
        result = score_blockwise(
            recipe.score,
            bw,
            batches,
            recipe.n_drop,
            protected,
            recipe.metric,
            recipe.iterative,
            progress,
            recipe.score_params,
        )
    result.details["memory_plan"] = {**vars(plan), "peak_bytes": plan.peak_bytes}
    return calib, result, time.perf_counter() - start


def check_max_memory(peak_bytes: int, lines: list[str], settings: RunSettings) -> None:
    """--max-memory as a bound: refuse before any weight is loaded when the plan's peak exceeds the compute
    device's entry (its index, or cpu), with the plan's numbers."""
    limits = settings.resolved_max_memory() or {}
    device = settings.resolved_device()
    key: int | str = "cpu" if device.type == "cpu" else (device.index or 0)
    if key not in limits:
        return
    from accelerate.utils import convert_file_size_to_int

    limit = convert_file_size_to_int(limits[key])
    if peak_bytes > limit:
        raise LayerpruneError(
            f"the block-major plan needs about {peak_bytes / 2**30:.2f} GiB on {device}, over --max-memory "
            f"{key}={limits[key]}: {'; '.join(lines)}; lower --calib-samples, --calib-seq-len or --batch-size"
        )


def refuse_sublayers(recipe: PruneRecipe) -> None:
    if recipe.granularity != "block":
        raise LayerpruneError(f"the streamed route drops whole blocks only; --granularity {recipe.granularity} "
                              "needs the model's weights, loaded in memory")


def config_only(path: Path) -> bool:
    return (path / "config.json").is_file() and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin"))


def plan_only(directory: Path, recipe: PruneRecipe, settings: RunSettings) -> dict[str, Any]:
    """`--dry-run` on a directory holding only a config.json: the block-major memory plan, from the config alone."""
    refuse_sublayers(recipe)
    from transformers import AutoConfig

    from layerprune.models.blockwise import memory_plan
    from layerprune.prune.blockwise import live_states

    config = AutoConfig.from_pretrained(directory)
    depth = (config.get_text_config() if hasattr(config, "get_text_config") else config).num_hidden_layers
    score = "ablation" if recipe.layers is not None else recipe.score
    plan = memory_plan(
        config,
        recipe.calib_samples * recipe.calib_seq_len,
        (recipe.batch_size, recipe.calib_seq_len),
        settings.resolved_dtype(),
        live_states(score, depth, recipe.n_drop),
    )
    lines = [
        f"block-major plan for {directory} ({depth} blocks, {str(settings.resolved_dtype()).removeprefix('torch.')}, "
        f"{score}, {recipe.calib_samples} x {recipe.calib_seq_len} calibration tokens at most):",
        *plan.lines(),
    ]
    return {"plan_only": True, "plan_lines": lines, "memory_plan": {**vars(plan), "peak_bytes": plan.peak_bytes}}
