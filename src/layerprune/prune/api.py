"""`prune_model`: score decoder blocks (or their sublayers), drop the least important, save a smaller HF model.

Three routes, one module each: `in_memory` loads the model; `from_files` streams the checkpoint (blocks chosen by
index, or scored block-major) and never loads it whole; `in_memory_sublayers` takes attention and MLP sublayers at a
finer --granularity. This module checks the flags that no route accepts and picks the route; each route decides
in its own module whether it applies (`from_files.stream_when_possible`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import check_output_dir
from layerprune.core.settings import RunSettings
from layerprune.models import LoadedModel, resolve_model
from layerprune.prune.common import read_calibration
from layerprune.prune.from_files import config_only, plan_only, stream_when_possible
from layerprune.prune.in_memory import prune_in_memory
from layerprune.prune.in_memory_sublayers import prune_sublayers_in_memory
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.scores import SCORES

__all__ = ["PruneResult", "prune_model", "read_calibration"]


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
    """Load `model`, choose `recipe.n_drop` blocks (sublayers at a finer granularity), drop them and (unless dry_run)
    save to `output`."""
    settings = settings or RunSettings()
    started = time.perf_counter()
    if recipe.granularity != "block" and settings.block_major:
        raise LayerpruneError(f"--block-major ranks whole blocks; --granularity {recipe.granularity} runs in memory")
    config_dir = model is not None and config_only(Path(str(model)).expanduser())
    if recipe.target is not None and (settings.block_major or config_dir):
        raise LayerpruneError("--target needs the model in memory: not with --block-major or a config-only directory")
    if recipe.layers is None:
        SCORES.get(recipe.score)  # an unknown name fails before any loading
        if settings.block_major:
            from layerprune.prune.blockwise import check_blockwise

            check_blockwise(recipe.score, recipe.metric, recipe.iterative)
    if dry_run and config_dir:
        return PruneResult(None, plan_only(Path(str(model)).expanduser(), recipe, settings), None)
    source = resolve_model(model, settings)
    if output is not None and not dry_run:
        check_output_dir(output, overwrite, (Path(source.location),) if source.is_local else ())
    saved = None if dry_run else output
    if recipe.granularity != "block":
        loaded, report = prune_sublayers_in_memory(source, recipe, settings, output, dry_run, started)
        return PruneResult(loaded, report, saved)
    streamed = stream_when_possible(source, recipe, settings, output, overwrite, dry_run, started)
    if streamed is not None:
        return PruneResult(None, streamed, saved)
    loaded, report = prune_in_memory(source, recipe, settings, output, overwrite, dry_run, started)
    return PruneResult(loaded, report, saved)
