"""The from-files route: choose blocks by index or score them block-major, then stream the checkpoint; the model
is never loaded whole."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from layerprune.data import resolve_data_dir
from layerprune.models import ModelSource, load_model
from layerprune.models.layer_fields import check_layer_fields
from layerprune.models.shards import count_parameters, plan_stream, read_checkpoint
from layerprune.models.surgery import checkpoint_dtype, compare_reloaded_logits, dtype_name
from layerprune.prune.calib import CalibSet, load_calibration, tokenize_calibration
from layerprune.prune.common import (
    DATA_FREE_SCORES,
    add_weights_hash,
    build_report,
    check_request,
    progress_bar,
    reference_probe,
    torch_dtype,
    write_report_files,
)
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.scores import ScoreContext, ScoreResult, run_importance_score
from layerprune.prune.streaming import describe_source, per_layer_config, save_streamed
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)


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
    """Choose blocks by index (explicit, last, random) and stream the checkpoint: the model is never loaded."""
    add_weights_hash(source, settings)
    _, config, depth, params_before = describe_source(source, settings)
    check_layer_fields(config.get_text_config() if hasattr(config, "get_text_config") else config, depth, recipe.force)
    protected = recipe.protected_blocks(depth)
    check_request(recipe, depth, protected)
    calib, score_seconds = None, 0.0
    if recipe.layers is not None:
        result = ScoreResult([None] * depth, sorted(recipe.layers))
    elif recipe.score in DATA_FREE_SCORES:
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
    report["timings"] = {"load_s": 0.0, "score_s": round(score_seconds, 2)}
    if not dry_run and output is not None:

        def finish(tmp: Path, report: dict[str, Any]) -> None:
            if recipe.verify:
                _verify_streamed(source, config, settings, tmp, report, result.drop)
            write_report_files(tmp, report)

        report["dtype"] = _streamed_dtypes(config, source_dir, settings)
        save_streamed(source, source_dir, result.drop, report, output, overwrite, settings, finish, recipe.force)
    report["timings"]["total_s"] = round(time.perf_counter() - started, 2)
    return report


def _streamed_dtypes(config: Any, source_dir: Path, settings: RunSettings) -> dict[str, Any]:
    stored = checkpoint_dtype(config, source_dir)
    name = dtype_name(stored) if stored else None
    return {
        "checkpoint": name,
        "computed_in": dtype_name(settings.resolved_dtype()),
        "saved": name,
        "chosen_by": "checkpoint",
    }


def _verify_streamed(
    source: ModelSource, config: Any, settings: RunSettings, tmp: Path, report: dict[str, Any], drop: list[int]
) -> None:
    """Logits of the written model against the original with `drop` skipped, when both fit in memory at once
    (the streamed files were already checked tensor by tensor and against the new config on the meta device)."""
    needed = 3 * report["saved"]["bytes"]  # the original, the reloaded copy, and room for activations
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > available:
        report["verification"]["logits"] = (
            f"skipped: comparing logits needs ~{needed / 2**30:.1f} GiB of memory and "
            f"{available / 2**30:.1f} GiB are free"
        )
        return
    start = time.perf_counter()
    loaded = load_model(source, settings)
    probe = reference_probe(loaded, None, drop)
    lossless = True  # the streamed files are the source's tensors, bit for bit
    compute = torch_dtype(loaded)
    record = compare_reloaded_logits(
        tmp,
        probe.input_ids,
        probe.attention_mask,
        probe.logits,
        compute,
        probe.input_ids.device,
        1e-3 if compute == torch.float32 and lossless else 2e-2,
    )
    del loaded
    report["verification"] = {
        **report["verification"],
        "checked": True,
        "tokens": int(probe.input_ids.numel()),
        **record,
        "seconds": round(report["verification"]["seconds"] + time.perf_counter() - start, 2),
    }
    report["timings"]["verify_s"] = report["verification"]["seconds"]


def _score_block_major(
    source: ModelSource, source_dir: Path, config: Any, recipe: PruneRecipe, settings: RunSettings, protected: list[int]
) -> tuple[CalibSet, ScoreResult, float]:
    """Score one block at a time from the files; print the memory plan first."""
    from layerprune.models.blockwise import load_skeleton
    from layerprune.models.loading import load_tokenizer
    from layerprune.prune.blockwise import plan_for, score_blockwise

    calib = load_calibration(recipe.calib, recipe.calib_samples, settings.seed, resolve_data_dir(recipe.data_dir))
    batches = tokenize_calibration(calib, load_tokenizer(source, settings), recipe.calib_seq_len, recipe.batch_size)
    plan = plan_for(config, recipe.score, batches, settings.resolved_dtype(), recipe.n_drop)
    for line in ["block-major plan:", *plan.lines()]:
        log.info(line)
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
            recipe.angular_tokens,
        )
    result.details["memory_plan"] = {**vars(plan), "peak_bytes": plan.peak_bytes}
    return calib, result, time.perf_counter() - start


def config_only(path: Path) -> bool:
    return (path / "config.json").is_file() and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin"))


def plan_only(directory: Path, recipe: PruneRecipe, settings: RunSettings) -> dict[str, Any]:
    """`--dry-run` on a directory holding only a config.json: the block-major memory plan, from the config alone."""
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
