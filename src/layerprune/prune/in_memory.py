"""The in-memory route: load the model, score its blocks, drop them, save (streamed when the files allow), verify."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import atomic_output_dir
from layerprune.core.settings import RunSettings
from layerprune.models import LoadedModel, ModelSource, drop_blocks, find_decoder_stack, load_model
from layerprune.models.blocks import text_config
from layerprune.models.layer_fields import FIELD_RULES, check_layer_fields
from layerprune.models.loading import copy_tokenizer_files, device_map_kwargs
from layerprune.models.logits_check import logits_rtol
from layerprune.models.surgery import check_config_matches_weights, dtype_name, verify_surgery, write_pretrained
from layerprune.models.verify_blockwise import BlockMajorUnsupported, fits_whole, verify_block_major
from layerprune.prune.calib import CalibSet, tokenize_calibration
from layerprune.prune.common import (
    Probe,
    add_weights_hash,
    build_report,
    check_request,
    close_report,
    progress_bar,
    read_calibration,
    recipe_force,
    reference_probe,
    torch_dtype,
    write_report_files,
)
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.report import Dtypes, Saved, TargetRecord, Timings, Verification
from layerprune.prune.scores import ScoreContext, ScoreResult, run_importance_score
from layerprune.prune.streaming import checkpoint_dir, save_streamed

log = logging.getLogger(__name__)


def prune_in_memory(
    source: ModelSource,
    recipe: PruneRecipe,
    settings: RunSettings,
    output: Path | None,
    overwrite: bool,
    dry_run: bool,
    started: float,
) -> tuple[LoadedModel, dict[str, Any]]:
    """Load, score, drop and (unless dry_run) save; the pruned model in memory and its report."""
    calib = read_calibration(recipe, settings)  # bad calibration data fails before the model loads
    loaded = load_model(source, settings)
    add_weights_hash(source, settings)
    depth = len(find_decoder_stack(loaded.model))
    # before scoring: an unknown field stops it early
    check_layer_fields(text_config(loaded.model), depth, recipe.force)
    protected = recipe.protected_blocks(depth)
    check_request(recipe, depth, protected)
    priced_from = _kquant_source(loaded, recipe, settings, depth)  # refused before any scoring
    params_before = loaded.model.num_parameters()
    _log_plan(source, recipe, loaded, depth, params_before)
    calib, result, score_seconds = choose_blocks(loaded, recipe, settings, protected, calib)
    planned = _to_target(loaded, recipe, settings, protected, result, priced_from)
    config_before = _per_layer_config(loaded.model)
    verify = recipe.verify and not dry_run and output is not None
    probe = reference_probe(loaded, calib, result.drop) if verify else None
    kept = drop_blocks(loaded.model, result.drop, recipe.force)
    report = build_report(
        source, recipe, settings, protected, calib, result, kept, depth, params_before, loaded.model.num_parameters()
    )
    if planned is not None:
        report["target"] = planned
    report["config_per_layer"] = {"before": config_before, "after": _per_layer_config(loaded.model)}
    report["dtype"] = _dtypes(loaded, settings)
    report["timings"] = Timings(load_s=round(loaded.load_seconds, 2), score_s=round(score_seconds, 2))
    if not dry_run and output is not None:
        save_pruned(loaded, report, output, overwrite, settings, probe)
    return loaded, close_report(report, started)


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
    if recipe.target is not None:  # every block scored; the plan takes as many as the target needs
        ctx.drop = max(depth - len(protected) - 1, 0)
    start = time.perf_counter()
    if batches and (recipe.score == "taylor" or (recipe.score == "ablation" and recipe.metric == "nll")):
        ctx.stack.check_logits(batches[0].input_ids[:2], batches[0].attention_mask[:2])  # once per run
    with progress_bar(f"scoring {depth} blocks ({recipe.score})") as progress:
        ctx.progress = progress
        result = run_importance_score(recipe.score, ctx)
    if recipe.target is None and len(result.drop) != recipe.n_drop:
        raise LayerpruneError(
            f"score '{recipe.score}' found only {len(result.drop)} droppable blocks, not {recipe.n_drop}"
        )
    return calib, result, time.perf_counter() - start


def _log_plan(source: ModelSource, recipe: PruneRecipe, loaded: LoadedModel, depth: int, params: int) -> None:
    if recipe.target is not None:
        log.info("plan: %s, %d blocks, %.1fM parameters, score %s, to the target %s", source.spec, depth, params / 1e6,
                 recipe.method_name, recipe.target)
        return
    after = _estimate_params_after(loaded, recipe.n_drop)
    log.info("plan: %s, %d -> %d blocks, %.1fM -> ~%.1fM parameters, score %s", source.spec, depth,
             depth - recipe.n_drop, params / 1e6, after / 1e6, recipe.method_name)


def _kquant_source(loaded: LoadedModel, recipe: PruneRecipe, settings: RunSettings, depth: int) -> Path | None:
    """The GGUF a k-quant --outtype prices the memory target from (checked now, before scoring); None otherwise."""
    from layerprune.models.gguf_types import K_QUANTS

    if recipe.outtype not in K_QUANTS:
        return None
    from layerprune.models.kquant_price import kquant_source

    return kquant_source(loaded.source, settings.resolved_cache_dir(), recipe.outtype, depth)


def _to_target(
    loaded: LoadedModel, recipe: PruneRecipe, settings: RunSettings, protected: list[int], result: ScoreResult,
    priced_from: Path | None = None,
) -> TargetRecord | None:
    """With --target: the blocks its plan takes replace the score's choice; the plan's record (else None)."""
    if recipe.target is None:
        return None
    from layerprune.prune.target import parse_target, plan_blocks, plan_lines

    plan = plan_blocks(loaded.model, parse_target(recipe.target), result.scores, protected,
                       _save_dtype(loaded, settings), outtype=recipe.outtype, source=priced_from,
                       work_root=settings.resolved_cache_dir() / "tmp")
    result.drop = sorted(int(r) for r in plan.removals)
    record = plan.record()
    for line in plan_lines(record):
        log.info(line)
    return record


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
        params=recipe.score_params,
    )


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
            _verify(loaded, tmp, report, probe, True, settings)
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
        report["saved"] = Saved(how="save_pretrained of the model in memory")
        report["timings"].save_s = round(time.perf_counter() - start, 2)
        lossless = saved in (torch_dtype(loaded), loaded.checkpoint_dtype, torch.float32)
        _verify(loaded, tmp, report, probe, lossless, settings)
        write_report_files(tmp, report)


def _verify(
    loaded: LoadedModel, tmp: Path, report: dict[str, Any], probe: Probe | None, lossless: bool, settings: RunSettings
) -> None:
    """Compare what was written with the skip reference (a record; raises on a mismatch): reloaded whole when a
    second copy fits beside the model on its device, else block-major (a device-mapped model always)."""
    report.setdefault("verification", Verification(checked=False))  # a streamed save has done the meta check already
    if probe is None:
        return
    record: dict[str, Any] | None = None
    if not _whole_reload_fits(loaded, tmp, settings):
        try:
            record = _verify_block_major(loaded, tmp, probe, lossless)
        except BlockMajorUnsupported as exc:
            log.warning("verification: block-major is not possible (%s); reloading the written model whole", exc)
    if record is None:
        ids, mask = probe.input_ids, probe.attention_mask
        verified = verify_surgery(loaded.model, tmp, ids, mask, probe.logits, lossless, device_map_kwargs(settings))
        record = {**verified, "logits_check": "whole-model"}
    verification = Verification(**{**record, "seconds": round(record["seconds"] + probe.seconds, 2)})
    report["verification"] = verification
    report["timings"].verify_s = verification.seconds


def _whole_reload_fits(loaded: LoadedModel, tmp: Path, settings: RunSettings) -> bool:
    devices = set((getattr(loaded.model, "hf_device_map", None) or {}).values())
    if settings.device_map or len(devices) > 1:
        return False
    written = sum(path.stat().st_size for path in tmp.glob("*.safetensors"))
    return fits_whole(written, loaded.model.device)


def _verify_block_major(loaded: LoadedModel, tmp: Path, probe: Probe, lossless: bool) -> dict[str, Any]:
    start = time.perf_counter()
    keys = check_config_matches_weights(loaded.model)
    compute = torch_dtype(loaded)
    rtol = logits_rtol(compute, lossless)
    device = probe.input_ids.device
    record = verify_block_major(
        probe.config, tmp, probe.drop, probe.input_ids, probe.attention_mask, device, compute, rtol, probe.logits
    )
    return {"checked": True, "keys": keys, **record, "seconds": round(time.perf_counter() - start, 2)}


def _save_dtype(loaded: LoadedModel, settings: RunSettings) -> Any:
    """--dtype when given, else the checkpoint's own dtype (else the one it was loaded in)."""
    if settings.dtype != "auto":
        return settings.resolved_dtype()
    return loaded.checkpoint_dtype or torch_dtype(loaded)


def _dtypes(loaded: LoadedModel, settings: RunSettings) -> Dtypes:
    stored = loaded.checkpoint_dtype
    return Dtypes(checkpoint=dtype_name(stored) if stored else None, computed_in=dtype_name(torch_dtype(loaded)),
                  saved=dtype_name(_save_dtype(loaded, settings)),
                  chosen_by="--dtype" if settings.dtype != "auto" else "checkpoint")
