"""`prune_model`: score decoder blocks, drop the least important, save a smaller HF model."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from layerprune.data import resolve_data_dir
from layerprune.errors import LayerpruneError
from layerprune.models import LoadedModel, drop_blocks, find_decoder_stack, load_model, resolve_model
from layerprune.models.blocks import check_block_indices, text_config
from layerprune.models.layer_fields import FIELD_RULES, check_layer_fields
from layerprune.models.loading import copy_tokenizer_files
from layerprune.models.surgery import check_config_matches_weights, dtype_name, skip_reference_logits, verify_surgery, write_pretrained
from layerprune.outputs import atomic_output_dir, check_output_dir
from layerprune.prune.calib import CalibSet, load_calibration, tokenize_calibration
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.report import model_card, package_versions, plot_scores, write_report
from layerprune.prune.scores import SCORES, ScoreContext, ScoreResult, score_blocks
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
DATA_FREE_SCORES = {"last", "random"}
PROBE_TEXT = ["The quick brown fox jumps over the lazy dog. Question: what is 12 + 7? Answer: 19",
              "You are a helpful assistant. Natalia sold clips to 48 of her friends in April."]


@dataclass
class PruneResult:
    """The pruned model (in memory), its report, and where it was saved (None on a dry run)."""

    loaded: LoadedModel
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
    source = resolve_model(model, settings)
    if output is not None and not dry_run:
        check_output_dir(output, overwrite, (Path(source.location),) if source.is_local else ())
    calib = read_calibration(recipe, settings)  # bad calibration data fails before the model loads
    loaded = load_model(source, settings)
    if source.kind == "local":  # the exact weights pruned (memoized; evaluate reuses the same memo)
        from layerprune.evaluate.results import model_hash

        source.identity["weights_sha256"] = model_hash(source, settings.resolved_cache_dir() / "eval")
    depth = len(find_decoder_stack(loaded.model))
    check_layer_fields(text_config(loaded.model), depth, recipe.force)  # before scoring: an unknown field stops it early
    protected = recipe.protected_blocks(depth)
    check_request(recipe, depth, protected)
    params_before = loaded.model.num_parameters()
    log.info("plan: %s, %d -> %d blocks, %.1fM -> ~%.1fM parameters, score %s", source.spec, depth, depth - recipe.n_drop,
             params_before / 1e6, _estimate_params_after(loaded, recipe.n_drop) / 1e6, recipe.method_name)
    calib, result, score_seconds = choose_blocks(loaded, recipe, settings, protected, calib)
    config_before = _per_layer_config(loaded.model)
    probe = _reference(loaded, calib, result.drop) if recipe.verify and not dry_run and output is not None else None
    kept = drop_blocks(loaded.model, result.drop, recipe.force)
    report = build_report(loaded, recipe, settings, protected, calib, result, kept, depth, params_before)
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
            f"dropping {recipe.n_drop} of {depth} blocks leaves fewer than the {len(protected)} protected block(s) plus one"
        )


def read_calibration(recipe: PruneRecipe, settings: RunSettings) -> CalibSet | None:
    """The calibration items the recipe's score needs (None for explicit layers and data-free scores)."""
    if recipe.layers is not None or recipe.score in DATA_FREE_SCORES:
        return None
    calib = load_calibration(recipe.calib, recipe.calib_samples, settings.seed, resolve_data_dir(recipe.data_dir))
    log.info("calibration: %s", calib.description)
    return calib


def choose_blocks(
    loaded: LoadedModel, recipe: PruneRecipe, settings: RunSettings, protected: list[int],
    calib: CalibSet | None = None,
) -> tuple[CalibSet | None, ScoreResult, float]:
    """Explicit layers, or the recipe's score over calibration data (read here unless given)."""
    depth = len(find_decoder_stack(loaded.model))
    if recipe.layers is not None:
        return None, ScoreResult([None] * depth, sorted(recipe.layers)), 0.0
    batches = []
    calib = calib or read_calibration(recipe, settings)
    if calib is not None:
        batches = [b.to(loaded.model.device) for b in
                   tokenize_calibration(calib, loaded.tokenizer, recipe.calib_seq_len, recipe.batch_size)]
    ctx = _context(loaded, recipe, settings, protected, calib, batches)
    start = time.perf_counter()
    if batches and (recipe.score == "taylor" or (recipe.score == "ablation" and recipe.metric == "nll")):
        ctx.stack.check_logits(batches[0].input_ids[:2], batches[0].attention_mask[:2])  # once per run
    with _progress_bar(f"scoring {depth} blocks ({recipe.score})") as progress:
        ctx.progress = progress
        result = score_blocks(recipe.score, ctx)
    if len(result.drop) != recipe.n_drop:
        raise LayerpruneError(f"score '{recipe.score}' found only {len(result.drop)} droppable blocks, not {recipe.n_drop}")
    return calib, result, time.perf_counter() - start


def _context(loaded, recipe, settings, protected, calib, batches) -> ScoreContext:  # noqa: ANN001
    only_short = calib is not None and all(item.stop == "\n" for item in calib.items)
    return ScoreContext(
        model=loaded.model, tokenizer=loaded.tokenizer, stack=find_decoder_stack(loaded.model), batches=batches,
        calib=calib or CalibSet([], "none"), drop=recipe.n_drop, protected=protected, metric=recipe.metric,
        iterative=recipe.iterative, seed=settings.seed, batch_size=recipe.batch_size,
        max_new_tokens=recipe.max_new_tokens or (8 if only_short else 256), stack_candidates=recipe.stack_candidates,
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
    return {key: getattr(config, key) for key in dict.fromkeys(keys) if key in vars(config) and getattr(config, key) is not None}


def build_report(loaded, recipe, settings, protected, calib, result, kept, depth, params_before) -> dict[str, Any]:  # noqa: ANN001
    """Everything needed to know how the model was made."""
    source = loaded.source
    return {
        "source": {"spec": source.spec, "location": source.location, "kind": source.kind, "identity": source.identity},
        "method": {"score": recipe.method_name, "metric": recipe.metric, "iterative": recipe.iterative,
                   "protect": protected, "seed": settings.seed},
        "recipe": recipe.model_dump(mode="json"),
        "calibration": None if calib is None else {
            "description": calib.description, "samples": len(calib.items), "seq_len": recipe.calib_seq_len,
            "fallback": calib.fallback, "items": calib.record()},
        "scores": result.scores,
        "steps": result.steps,
        "score_details": result.details,
        "dropped": sorted(result.drop),
        "kept": kept,
        "num_blocks_before": depth,
        "num_blocks_after": len(kept),
        "params_before": params_before,
        "params_after": loaded.model.num_parameters(),
        "versions": package_versions(),
    }


def save_pruned(loaded: LoadedModel, report: dict[str, Any], output: Path, overwrite: bool, settings: RunSettings,
                probe: "Probe | None" = None) -> None:
    """Write model shards (in the checkpoint's dtype), tokenizer, report, card and chart to a temp dir; verify the
    written model against `probe` (unless None); only then rename it into place."""
    start = time.perf_counter()
    with atomic_output_dir(output, overwrite) as tmp:
        saved = _save_dtype(loaded, settings)
        if probe is not None:
            check_config_matches_weights(loaded.model)  # cheap: fail before writing anything big
        write_pretrained(loaded.model, tmp, saved, settings.max_shard_size, output)
        copy_tokenizer_files(loaded.source, tmp, loaded.tokenizer)
        report["timings"]["save_s"] = round(time.perf_counter() - start, 2)
        report["verification"] = {"checked": False}
        if probe is not None:
            lossless = saved in (torch_dtype(loaded), loaded.checkpoint_dtype, torch.float32)
            report["verification"] = verify_surgery(loaded.model, tmp, probe.input_ids, probe.attention_mask, probe.logits, lossless)
            report["verification"]["seconds"] = round(report["verification"]["seconds"] + probe.seconds, 2)
            report["timings"]["verify_s"] = report["verification"]["seconds"]
        title = f"{report['source']['spec'] or 'model'}: {report['method']['score']} scores, dropped {report['dropped']}"
        if any(s is not None for s in report["scores"]):
            plot_scores(tmp / "block_scores.png", report["scores"], report["dropped"], report["method"]["protect"], title)
            report["scores_png"] = "block_scores.png"
        write_report(tmp, report)
        (tmp / "README.md").write_text(model_card(report))


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
    return {"checkpoint": dtype_name(stored) if stored else None, "computed_in": dtype_name(torch_dtype(loaded)),
            "saved": dtype_name(_save_dtype(loaded, settings)), "chosen_by": "--dtype" if settings.dtype != "auto" else "checkpoint"}
