"""`prune_model`: score decoder blocks, drop the least important, save a smaller HF model."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerprune.data import resolve_data_dir
from layerprune.errors import LayerpruneError
from layerprune.models import LoadedModel, ModelSource, drop_blocks, find_decoder_stack, load_model, resolve_model
from layerprune.models.blocks import check_block_indices, text_config
from layerprune.models.identity import model_hash
from layerprune.models.layer_fields import FIELD_RULES, check_layer_fields
from layerprune.models.loading import copy_tokenizer_files
from layerprune.models.shards import count_parameters, plan_stream, read_checkpoint
from layerprune.models.surgery import (
    check_config_matches_weights,
    checkpoint_dtype,
    compare_reloaded_logits,
    dtype_name,
    skip_reference_logits,
    verify_surgery,
    write_pretrained,
)
from layerprune.outputs import atomic_output_dir, check_output_dir
from layerprune.provenance import collect_provenance
from layerprune.prune.calib import CalibSet, load_calibration, tokenize_calibration
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.report import model_card, plot_scores, write_prune_report
from layerprune.prune.scores import SCORES, ScoreContext, ScoreResult, run_importance_score
from layerprune.prune.streaming import checkpoint_dir, describe_source, per_layer_config, save_streamed
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
DATA_FREE_SCORES = {"last", "random"}
PROBE_TEXT = ["The quick brown fox jumps over the lazy dog. Question: what is 12 + 7? Answer: 19",
              "You are a helpful assistant. Natalia sold clips to 48 of her friends in April."]


@dataclass
class PruneResult:
    """The pruned model (in memory; None when it was streamed from the files), its report, and where it was saved
    (None on a dry run)."""

    loaded: LoadedModel | None
    report: dict[str, Any]
    output: Path | None


def prune_model(
    model: str | None,
    recipe: PruneRecipe,
    settings: RunSettings | None = None,
    output: Path | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
) -> PruneResult:
    """Load `model`, choose `recipe.n_drop` blocks, drop them and (unless dry_run) save to `output`."""
    settings = settings or RunSettings()
    started = time.perf_counter()
    if recipe.layers is None:
        SCORES.get(recipe.score)  # an unknown name fails before any loading
        if settings.block_major:
            from layerprune.prune.blockwise import check_blockwise

            check_blockwise(recipe.score, recipe.metric, recipe.iterative)
    if dry_run and model is not None and _config_only(Path(str(model)).expanduser()):
        return PruneResult(None, plan_only(Path(str(model)).expanduser(), recipe, settings), None)
    source = resolve_model(model, settings)
    if output is not None and not dry_run:
        check_output_dir(output, overwrite, (Path(source.location),) if source.is_local else ())
    by_index = recipe.layers is not None or recipe.score in DATA_FREE_SCORES
    if (by_index and settings.dtype == "auto") or settings.block_major:  # --dtype asks for a cast: load and save
        source_dir = checkpoint_dir(source)
        if source_dir is not None:
            return _prune_from_files(source, source_dir, recipe, settings, output, overwrite, dry_run, started)
        if settings.block_major:
            raise LayerpruneError(f"--block-major reads the safetensors files, and {source.spec} has none")
    calib = read_calibration(recipe, settings)  # bad calibration data fails before the model loads
    loaded = load_model(source, settings)
    _add_weights_hash(source, settings)
    depth = len(find_decoder_stack(loaded.model))
    # before scoring: an unknown field stops it early
    check_layer_fields(text_config(loaded.model), depth, recipe.force)
    protected = recipe.protected_blocks(depth)
    check_request(recipe, depth, protected)
    params_before = loaded.model.num_parameters()
    log.info(
        "plan: %s, %d -> %d blocks, %.1fM -> ~%.1fM parameters, score %s",
        source.spec,
        depth,
        depth - recipe.n_drop,
        params_before / 1e6,
        _estimate_params_after(loaded, recipe.n_drop) / 1e6,
        recipe.method_name,
    )
    calib, result, score_seconds = choose_blocks(loaded, recipe, settings, protected, calib)
    config_before = _per_layer_config(loaded.model)
    probe = _reference(loaded, calib, result.drop) if recipe.verify and not dry_run and output is not None else None
    kept = drop_blocks(loaded.model, result.drop, recipe.force)
    report = build_report(
        source, recipe, settings, protected, calib, result, kept, depth, params_before, loaded.model.num_parameters()
    )
    report["config_per_layer"] = {"before": config_before, "after": _per_layer_config(loaded.model)}
    report["dtype"] = _dtypes(loaded, settings)
    report["timings"] = {"load_s": round(loaded.load_seconds, 2), "score_s": round(score_seconds, 2)}
    if not dry_run and output is not None:
        save_pruned(loaded, report, output, overwrite, settings, probe)
    report["timings"]["total_s"] = round(time.perf_counter() - started, 2)
    return PruneResult(loaded, report, None if dry_run else output)


def check_request(recipe: PruneRecipe, depth: int, protected: list[int]) -> None:
    """Depth-dependent checks of --drop / --layers against the model and the protected blocks."""
    if recipe.layers is not None:
        check_block_indices(recipe.layers, depth)
        clash = sorted(set(recipe.layers) & set(protected))
        if clash:
            raise LayerpruneError(f"--layers drops protected block(s) {clash}; change --protect to allow it")
    if depth - recipe.n_drop < len(protected) + 1:
        raise LayerpruneError(
            f"dropping {recipe.n_drop} of {depth} blocks leaves fewer than the {len(protected)} protected block(s) "
            "plus one"
        )


def read_calibration(recipe: PruneRecipe, settings: RunSettings) -> CalibSet | None:
    """The calibration items the recipe's score needs (None for explicit layers and data-free scores)."""
    if recipe.layers is not None or recipe.score in DATA_FREE_SCORES:
        return None
    calib = load_calibration(recipe.calib, recipe.calib_samples, settings.seed, resolve_data_dir(recipe.data_dir))
    log.info("calibration: %s", calib.description)
    return calib


def choose_blocks(
    loaded: LoadedModel,
    recipe: PruneRecipe,
    settings: RunSettings,
    protected: list[int],
    calib: CalibSet | None = None,
) -> tuple[CalibSet | None, ScoreResult, float]:
    """Explicit layers, or the recipe's score over calibration data (read here unless given)."""
    depth = len(find_decoder_stack(loaded.model))
    if recipe.layers is not None:
        return None, ScoreResult([None] * depth, sorted(recipe.layers)), 0.0
    batches = []
    calib = calib or read_calibration(recipe, settings)
    if calib is not None:
        batches = [
            b.to(loaded.model.device)
            for b in tokenize_calibration(calib, loaded.tokenizer, recipe.calib_seq_len, recipe.batch_size)
        ]
    ctx = _context(loaded, recipe, settings, protected, calib, batches)
    start = time.perf_counter()
    if batches and (recipe.score == "taylor" or (recipe.score == "ablation" and recipe.metric == "nll")):
        ctx.stack.check_logits(batches[0].input_ids[:2], batches[0].attention_mask[:2])  # once per run
    with _progress_bar(f"scoring {depth} blocks ({recipe.score})") as progress:
        ctx.progress = progress
        result = run_importance_score(recipe.score, ctx)
    if len(result.drop) != recipe.n_drop:
        raise LayerpruneError(
            f"score '{recipe.score}' found only {len(result.drop)} droppable blocks, not {recipe.n_drop}"
        )
    return calib, result, time.perf_counter() - start


def _context(loaded, recipe, settings, protected, calib, batches) -> ScoreContext:  # noqa: ANN001
    only_short = calib is not None and all(item.stop == "\n" for item in calib.items)
    return ScoreContext(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        stack=find_decoder_stack(loaded.model),
        batches=batches,
        calib=calib or CalibSet([], "none"),
        drop=recipe.n_drop,
        protected=protected,
        metric=recipe.metric,
        iterative=recipe.iterative,
        seed=settings.seed,
        batch_size=recipe.batch_size,
        max_new_tokens=recipe.max_new_tokens or (8 if only_short else 256),
        stack_candidates=recipe.stack_candidates,
        angular_tokens=recipe.angular_tokens,
    )


class _progress_bar:
    """A tqdm bar on stderr fed by the scores' progress callback."""

    def __init__(self, title: str) -> None:
        self.title = title

    def __enter__(self) -> Callable[[str, int], None]:
        from tqdm.auto import tqdm

        self.bar = tqdm(desc=self.title, unit="step", leave=False)

        def update(message: str, steps: int) -> None:
            self.bar.set_postfix_str(message, refresh=False)
            self.bar.update(steps)

        return update

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def _estimate_params_after(loaded: LoadedModel, n_drop: int) -> float:
    layers = find_decoder_stack(loaded.model).layers
    per_block = sum(p.numel() for p in layers.parameters()) / len(layers)
    return loaded.model.num_parameters() - n_drop * per_block


def _per_layer_config(model: Any) -> dict[str, Any]:
    from layerprune.models.blocks import text_config

    config = text_config(model)
    keys = ("num_hidden_layers", *FIELD_RULES, "sliding_window")
    return {
        key: getattr(config, key)
        for key in dict.fromkeys(keys)
        if key in vars(config) and getattr(config, key) is not None
    }


def build_report(
    source, recipe, settings, protected, calib, result, kept, depth, params_before, params_after
) -> dict[str, Any]:  # noqa: ANN001
    """Everything needed to know how the model was made."""
    return {
        "source": {"spec": source.spec, "location": source.location, "kind": source.kind, "identity": source.identity},
        "method": {
            "score": recipe.method_name,
            "metric": recipe.metric,
            "iterative": recipe.iterative,
            "protect": protected,
            "seed": settings.seed,
        },
        "recipe": recipe.model_dump(mode="json"),
        "calibration": None
        if calib is None
        else {
            "description": calib.description,
            "samples": len(calib.items),
            "seq_len": recipe.calib_seq_len,
            "fallback": calib.fallback,
            "items": calib.record(),
        },
        "scores": result.scores,
        "steps": result.steps,
        "score_details": result.details,
        "dropped": sorted(result.drop),
        "kept": kept,
        "num_blocks_before": depth,
        "num_blocks_after": len(kept),
        "params_before": params_before,
        "params_after": params_after,
        "provenance": collect_provenance().model_dump(mode="json"),
    }


def save_pruned(
    loaded: LoadedModel,
    report: dict[str, Any],
    output: Path,
    overwrite: bool,
    settings: RunSettings,
    probe: Probe | None = None,
) -> None:
    """Write the pruned model to a temp dir: streamed from the source safetensors files (bit-exact, in their dtype)
    when there are some and no --dtype asks for a cast, else `save_pretrained` in the checkpoint's dtype; then
    tokenizer, report, card and chart; verify the written model against `probe` (unless None); only then rename it
    into place."""
    source_dir = checkpoint_dir(loaded.source)
    if source_dir is not None and settings.dtype == "auto":
        if probe is not None:
            check_config_matches_weights(loaded.model)  # cheap: fail before writing anything big

        def finish(tmp: Path, report: dict[str, Any]) -> None:
            _verify(loaded, tmp, report, probe, lossless=True)
            write_report_files(tmp, report)

        save_streamed(
            loaded.source,
            source_dir,
            report["dropped"],
            report,
            output,
            overwrite,
            settings,
            finish,
            recipe_force(report),
        )
        return
    start = time.perf_counter()
    with atomic_output_dir(output, overwrite) as tmp:
        saved = _save_dtype(loaded, settings)
        if probe is not None:
            check_config_matches_weights(loaded.model)  # cheap: fail before writing anything big
        write_pretrained(loaded.model, tmp, saved, settings.max_shard_size, output)
        copy_tokenizer_files(loaded.source, tmp, loaded.tokenizer)
        report["saved"] = {"how": "save_pretrained of the model in memory"}
        report["timings"]["save_s"] = round(time.perf_counter() - start, 2)
        lossless = saved in (torch_dtype(loaded), loaded.checkpoint_dtype, torch.float32)
        _verify(loaded, tmp, report, probe, lossless)
        write_report_files(tmp, report)


def recipe_force(report: dict[str, Any]) -> bool:
    return bool(report["recipe"].get("force"))


def _verify(loaded: LoadedModel, tmp: Path, report: dict[str, Any], probe: Probe | None, lossless: bool) -> None:
    """Reload what was written and compare with the skip reference (a record; raises on a mismatch)."""
    report.setdefault("verification", {"checked": False})  # a streamed save has done the meta check already
    if probe is not None:
        report["verification"] = verify_surgery(
            loaded.model, tmp, probe.input_ids, probe.attention_mask, probe.logits, lossless
        )
        report["verification"]["seconds"] = round(report["verification"]["seconds"] + probe.seconds, 2)
        report["timings"]["verify_s"] = report["verification"]["seconds"]


@dataclass
class Probe:
    """One batch and the original model's logits on it with the dropped blocks skipped (the verification reference)."""

    input_ids: Any
    attention_mask: Any
    logits: Any
    seconds: float


def _reference(loaded: LoadedModel, calib: CalibSet | None, drop: list[int]) -> Probe:
    """The first calibration batch (two rows), or a fixed text, and its skip-reference logits."""
    start = time.perf_counter()
    if calib is not None and calib.items:
        batch = tokenize_calibration(CalibSet(calib.items[:2], calib.description), loaded.tokenizer, 128, 2)[0]
        batch = batch.to(loaded.model.device)
        ids, mask = batch.input_ids, batch.attention_mask
    else:
        enc = loaded.tokenizer(PROBE_TEXT, return_tensors="pt", padding=True).to(loaded.model.device)
        ids, mask = enc["input_ids"], enc["attention_mask"]
    logits = skip_reference_logits(loaded.model, ids, mask, drop)
    return Probe(ids, mask, logits, time.perf_counter() - start)


def torch_dtype(loaded: LoadedModel) -> Any:
    return next(loaded.model.parameters()).dtype


def _save_dtype(loaded: LoadedModel, settings: RunSettings) -> Any:
    """--dtype when given, else the checkpoint's own dtype (else the one it was loaded in)."""
    if settings.dtype != "auto":
        return settings.resolved_dtype()
    return loaded.checkpoint_dtype or torch_dtype(loaded)


def _dtypes(loaded: LoadedModel, settings: RunSettings) -> dict[str, Any]:
    stored = loaded.checkpoint_dtype
    return {
        "checkpoint": dtype_name(stored) if stored else None,
        "computed_in": dtype_name(torch_dtype(loaded)),
        "saved": dtype_name(_save_dtype(loaded, settings)),
        "chosen_by": "--dtype" if settings.dtype != "auto" else "checkpoint",
    }


def write_report_files(directory: Path, report: dict[str, Any]) -> None:
    """Score chart, prune_report.json and model card."""
    title = f"{report['source']['spec'] or 'model'}: {report['method']['score']} scores, dropped {report['dropped']}"
    if any(s is not None for s in report["scores"]):
        plot_scores(
            directory / "block_scores.png", report["scores"], report["dropped"], report["method"]["protect"], title
        )
        report["scores_png"] = "block_scores.png"
    model_card(write_prune_report(directory, report)).save(directory / "README.md")


def _add_weights_hash(source: ModelSource, settings: RunSettings) -> None:
    if source.kind == "local":  # the exact weights pruned (memoized; evaluate reuses the same memo)
        source.identity["weights_sha256"] = model_hash(source, settings.resolved_cache_dir())


def _prune_from_files(
    source: ModelSource,
    source_dir: Path,
    recipe: PruneRecipe,
    settings: RunSettings,
    output: Path | None,
    overwrite: bool,
    dry_run: bool,
    started: float,
) -> PruneResult:
    """Choose blocks by index (explicit, last, random) and stream the checkpoint: the model is never loaded."""
    _add_weights_hash(source, settings)
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
    return PruneResult(None, report, None if dry_run else output)


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
    probe = _reference(loaded, None, drop)
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
    with _progress_bar(f"scoring {len(bw)} blocks block-major ({recipe.score})") as progress:
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


def _config_only(path: Path) -> bool:
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
