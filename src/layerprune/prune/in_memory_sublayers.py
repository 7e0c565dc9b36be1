"""The in-memory route at a finer grain: load the model, score its attention and/or MLP sublayers, choose the
cheapest (or the named ones), report the plan, and save in the Nemotron-NAS layout (models/nas_surgery.py).

Whole-block pruning never comes here; its outputs stay standard configs of the source family.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models import LoadedModel, ModelSource, find_decoder_stack, load_model
from layerprune.models.blocks import DecoderStack
from layerprune.models.nas_surgery import check_expressible, most_removable, removal_refusal, save_nas
from layerprune.models.sublayers import (
    Sublayer,
    all_sublayers,
    parse_sublayers,
    sublayer_module,
    sublayer_norm,
    whole_blocks,
)
from layerprune.prune.calib import CalibSet, tokenize_calibration
from layerprune.prune.common import (
    add_weights_hash,
    build_report,
    close_report,
    progress_bar,
    read_calibration,
    write_report_files,
)
from layerprune.prune.in_memory import _context, _dtypes, _per_layer_config, _save_dtype
from layerprune.prune.metrics import kv_cache_kept
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.report import TargetRecord, Timings, Verification
from layerprune.prune.scores import ScoreResult
from layerprune.prune.sublayer_scores import SublayerResult, candidates, score_sublayers, servable_order
from layerprune.prune.target import parse_target, plan_lines, plan_sublayers

log = logging.getLogger(__name__)


def prune_sublayers_in_memory(
    source: ModelSource,
    recipe: PruneRecipe,
    settings: RunSettings,
    output: Path | None,
    dry_run: bool,
    started: float,
) -> tuple[LoadedModel, dict[str, Any]]:
    """Load, score the sublayers of `recipe.granularity`, choose `recipe.n_drop` and (unless dry_run) save to
    `output` (checked by the caller); the model in memory (unchanged: the layout's surgery happens on save) and the
    report."""
    saving = not dry_run and output is not None
    calib = read_calibration(recipe, settings)
    loaded = load_model(source, settings)
    add_weights_hash(source, settings)
    stack = find_decoder_stack(loaded.model)
    if saving:
        check_expressible(loaded.model.config, [])  # the family and its config, before any scoring
    protected = recipe.protected_blocks(len(stack))
    named = check_sublayer_request(recipe, len(stack), protected)
    calib, result, score_seconds = choose_sublayers(loaded, recipe, settings, protected, named, calib)
    planned = _to_target(loaded, recipe, settings, protected, result)
    if saving:
        check_expressible(loaded.model.config, result.drop)
    report = sublayer_report(loaded, recipe, settings, protected, calib, result)
    if planned is not None:
        report["target"] = planned
    report["timings"] = Timings(load_s=round(loaded.load_seconds, 2), score_s=round(score_seconds, 2))
    log.info("plan: %s, removes %s", source.spec, ", ".join(report["removed_sublayers"]))
    if saving:
        assert output is not None
        _save_sublayers(loaded, report, output, settings)
    return loaded, close_report(report, started)


def check_sublayer_request(recipe: PruneRecipe, depth: int, protected: list[int]) -> list[Sublayer] | None:
    """Depth-dependent checks of --layers / --drop at a sublayer grain; the named sublayers (None: score them)."""
    named = None if recipe.layers is None else parse_sublayers([str(name) for name in recipe.layers], depth)
    clash = [str(sub) for sub in named or [] if sub.block in protected]
    if clash:
        raise LayerpruneError(f"--layers removes {', '.join(clash)} of a protected block; change --protect to allow it")
    pool = candidates(depth, recipe.parts, protected)
    if recipe.n_drop > len(pool):
        raise LayerpruneError(
            f"removing {recipe.n_drop} sublayers at --granularity {recipe.granularity}: only {len(pool)} are "
            f"unprotected in {depth} blocks ({len(protected)} protected)"
        )
    refusal = removal_refusal(depth, named) if named is not None else None
    if refusal is not None:
        raise LayerpruneError(f"--layers {','.join(map(str, named or []))}: {refusal}")
    most = most_removable(depth, pool)
    if recipe.n_drop > most:
        raise LayerpruneError(
            f"removing {recipe.n_drop} sublayers at --granularity {recipe.granularity}: at most {most} of the "
            f"{len(pool)} unprotected can go, as the Nemotron-NAS layout keeps the attention of the first block it "
            "keeps; drop fewer or change --protect"
        )
    return named


def choose_sublayers(
    loaded: LoadedModel,
    recipe: PruneRecipe,
    settings: RunSettings,
    protected: list[int],
    named: list[Sublayer] | None,
    calib: CalibSet | None,
) -> tuple[CalibSet | None, SublayerResult, float]:
    """The named sublayers, or the recipe's score over calibration data."""
    if named is not None:
        return None, SublayerResult({}, named), 0.0
    batches = []
    if calib is not None:
        encoded = tokenize_calibration(calib, loaded.tokenizer, recipe.calib_seq_len, recipe.batch_size)
        batches = [batch.to(loaded.model.device) for batch in encoded]
    ctx = _context(loaded, recipe, settings, protected, calib, batches)
    if recipe.target is not None:  # every sublayer scored; the plan takes as many as the target needs
        ctx.drop = len(candidates(ctx.depth, recipe.parts, protected))
    start = time.perf_counter()
    if batches and recipe.score == "ablation" and recipe.metric == "nll":
        ctx.stack.check_logits(batches[0].input_ids[:2], batches[0].attention_mask[:2])
    what = "sublayers" if recipe.granularity == "sublayer" else f"{recipe.granularity} sublayers"
    with progress_bar(f"scoring {what} ({recipe.score})") as progress:
        ctx.progress = progress
        result = score_sublayers(recipe.score, ctx, recipe.parts)
    if recipe.target is None and len(result.drop) != recipe.n_drop:
        raise LayerpruneError(
            f"score '{recipe.score}' found only {len(result.drop)} removable sublayers, not {recipe.n_drop}"
        )
    return calib, result, time.perf_counter() - start


def _to_target(
    loaded: LoadedModel, recipe: PruneRecipe, settings: RunSettings, protected: list[int], result: SublayerResult
) -> TargetRecord | None:
    """With --target: the sublayers its plan takes (the shortest servable prefix of the ranking) replace the score's
    choice; the plan's record (else None)."""
    if recipe.target is None:
        return None
    depth = len(find_decoder_stack(loaded.model))
    scores = {sub: score for sub, score in result.scores.items() if sub.block not in protected}
    plan = plan_sublayers(loaded.model, parse_target(recipe.target), servable_order(scores, depth),
                          _save_dtype(loaded, settings), outtype=recipe.outtype)
    result.drop = sorted(sub for sub in plan.removals if isinstance(sub, Sublayer))
    record = plan.record()
    for line in plan_lines(record):
        log.info(line)
    return record


def sublayer_report(
    loaded: LoadedModel,
    recipe: PruneRecipe,
    settings: RunSettings,
    protected: list[int],
    calib: CalibSet | None,
    result: SublayerResult,
) -> dict[str, Any]:
    """The prune report of a sublayer plan: `dropped` holds the blocks that lose both sublayers (the layout removes
    them), `removed_sublayers` every sublayer, `sublayer_scores` each one scored, `kv_cache_kept` the attention
    sublayers kept over all of them."""
    stack = find_decoder_stack(loaded.model)
    depth, removed = len(stack), sorted(result.drop)
    gone = whole_blocks(removed)
    before = loaded.model.num_parameters()
    after = before - removed_parameters(stack, removed)
    blocks = ScoreResult([None] * depth, gone, result.steps, result.details)
    kept = [block for block in range(depth) if block not in gone]
    report = build_report(loaded.source, recipe, settings, protected, calib, blocks, kept, depth, before, after)
    report["removed_sublayers"] = [str(sub) for sub in removed]
    report["sublayer_scores"] = {str(sub): result.scores.get(sub) for sub in all_sublayers(depth, recipe.parts)}
    report["kv_cache_kept"] = kv_cache_kept(depth, sum(sub.part == "attn" for sub in removed))
    report["config_per_layer"] = {"before": _per_layer_config(loaded.model)}
    report["dtype"] = _dtypes(loaded, settings)
    return report


def removed_parameters(stack: DecoderStack, removed: list[Sublayer]) -> int:
    """Parameters the removal takes: the whole block where both sublayers go, else the sublayer module's own and the
    pre-norm feeding it (the Nemotron-NAS layout keeps neither)."""
    gone = set(whole_blocks(removed))
    modules = [stack.layers[block] for block in sorted(gone)]
    for sub in removed:
        if sub.block not in gone:
            block = stack.layers[sub.block]
            modules += [module for module in (sublayer_module(block, sub.part), sublayer_norm(block, sub.part))
                        if module is not None]
    return sum(param.numel() for module in modules for param in module.parameters())


def _save_sublayers(loaded: LoadedModel, report: dict[str, Any], output: Path, settings: RunSettings) -> None:
    """Save the model with `report["removed_sublayers"]` removed in the Nemotron-NAS layout; the report files are
    written inside the folder before it appears, with the layout's verification in them."""
    removed = parse_sublayers(report["removed_sublayers"], report["num_blocks_before"])
    start = time.perf_counter()

    def finish(tmp: Path, record: dict[str, Any]) -> None:
        report["verification"] = Verification(**record["verification"])
        report["timings"].save_s = round(time.perf_counter() - start, 2)
        write_report_files(tmp, report)

    save_nas(loaded.model, loaded.tokenizer, removed, output, _save_dtype(loaded, settings),
             max_shard_size=settings.max_shard_size, overwrite=True, finish=finish)  # output checked by prune_model
