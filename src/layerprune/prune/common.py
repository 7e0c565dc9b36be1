"""What both prune routes share: request checks, calibration, the report, its files, and the verification probe."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from layerprune.core.errors import LayerpruneError
from layerprune.core.model_card import write_card
from layerprune.core.provenance import collect_provenance
from layerprune.core.settings import RunSettings
from layerprune.models import LoadedModel, ModelSource
from layerprune.models.blocks import check_block_indices
from layerprune.models.identity import weights_digest
from layerprune.models.surgery import skip_reference_logits
from layerprune.prune.calib import CalibSet, load_calibration, tokenize_calibration
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.report import Timings, model_card, plot_scores, write_prune_report
from layerprune.tasks.data import resolve_data_dir

log = logging.getLogger(__name__)
PROBE_TEXT = ["The quick brown fox jumps over the lazy dog. Question: what is 12 + 7? Answer: 19",
              "You are a helpful assistant. Natalia sold clips to 48 of her friends in April."]


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
    if not recipe.needs_calibration:
        return None
    calib = load_calibration(recipe.calib, recipe.calib_samples, settings.seed, resolve_data_dir(recipe.data_dir))
    log.info("calibration: %s", calib.description)
    return calib


class progress_bar:
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


def write_report_files(directory: Path, report: dict[str, Any]) -> None:
    """Score chart, prune_report.json and model card."""
    title = f"{report['source']['spec'] or 'model'}: {report['method']['score']} scores, dropped {report['dropped']}"
    if any(s is not None for s in report["scores"]):
        plot_scores(
            directory / "block_scores.png", report["scores"], report["dropped"], report["method"]["protect"], title
        )
        report["scores_png"] = "block_scores.png"
    write_card(directory, str(model_card(write_prune_report(directory, report))))


def close_report(report: dict[str, Any], started: float) -> dict[str, Any]:
    """`report` with the run's total set on its typed timings (after the file was written, as before) and its
    typed pieces as the plain values the file holds, which is how callers (--json, benches) read them."""
    timings: Timings = report["timings"]
    timings.total_s = round(time.perf_counter() - started, 2)
    return {key: value.model_dump() if isinstance(value, BaseModel) else value for key, value in report.items()}


def add_weights_hash(source: ModelSource, settings: RunSettings,
                     known: Mapping[str, tuple[int, int, str]] | None = None) -> None:
    """Record which weights a local source's prune read: `identity.weights_digest` (xxh3-128, memoized; `known`:
    file digests a copy took on its own pass), under a key that names the hash. Not `model_hash` (sha256), the key
    of the evaluation caches, which those compute when they need it: at a tenth of the speed it would be most
    of a streamed prune's time."""
    if source.kind == "local":
        source.identity["weights_xxh3_128"] = weights_digest(Path(source.location), settings.resolved_cache_dir(),
                                                             known)


def recipe_force(report: dict[str, Any]) -> bool:
    return bool(report["recipe"].get("force"))


@dataclass
class Probe:
    """One batch and the original model's logits on it with the dropped blocks skipped (the verification reference),
    and the original's config (the per-layer settings the written blocks must keep)."""

    input_ids: Any
    attention_mask: Any
    logits: Any
    seconds: float
    drop: list[int] = field(default_factory=list)
    config: Any = None


def probe_inputs(tokenizer: Any, calib: CalibSet | None, device: Any) -> tuple[Any, Any]:
    """The first calibration batch (two rows, up to 128 tokens), or a fixed text, on `device`."""
    if calib is not None and calib.items:
        batch = tokenize_calibration(CalibSet(calib.items[:2], calib.description), tokenizer, 128, 2)[0]
        batch = batch.to(device)
        return batch.input_ids, batch.attention_mask
    enc = tokenizer(PROBE_TEXT, return_tensors="pt", padding=True).to(device)
    return enc["input_ids"], enc["attention_mask"]


def reference_probe(loaded: LoadedModel, calib: CalibSet | None, drop: list[int]) -> Probe:
    """The probe batch and its skip-reference logits."""
    start = time.perf_counter()
    ids, mask = probe_inputs(loaded.tokenizer, calib, loaded.model.device)
    logits = skip_reference_logits(loaded.model, ids, mask, drop)
    config = copy.deepcopy(loaded.model.config)
    return Probe(ids, mask, logits, time.perf_counter() - start, list(drop), config)


def torch_dtype(loaded: LoadedModel) -> Any:
    return next(loaded.model.parameters()).dtype
