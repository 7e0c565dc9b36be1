"""The grain cut's steps (a sweep with `grains`, grain_grid.py): whole blocks, attention sublayers or MLP sublayers
removed at matched savings, every cell recovered by the sweep's one arm and every model scored on the same items.

Matched savings (prune/matched.py): at each k the block cut removes the k lowest-ranked blocks (its own one-shot
ranking) and each finer grain the prefix of its own ranking that saves about as much (parameters, KV-cache bytes per
token, or the speedup measured at the plan stage); a k no servable prefix can reach is refused before any scoring
(`check_reachable`, from the block order); every measurement is kept in the plan.

The steps here: score-GRAIN (one scoring pass per grain, nothing saved: scored/GRAIN.json), plan (grain_plan.json:
every cell's removals and savings) and prune-GRAIN-kK (pruned/GRAIN-kK/: whole blocks cut from the files, sublayers
saved in the Nemotron-NAS layout). The stages around them (the evaluations, the k = 0 controls' and the cells'
recoveries, replicate by replicate, and the report, grain_report.py) are the sweep's (sweep_cells.py, sweep.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.core.settings import RunSettings
from layerprune.pipeline.studies.grain_grid import PLAN_FILE, grain_names, matching, score_file
from layerprune.prune.matched import config_sizes, measured_speed, order_rankings, plan_matched

if TYPE_CHECKING:
    from layerprune.prune.target import ModelSizes, Removal

log = logging.getLogger(__name__)


# --- matched savings (prune/matched.py plans them) ----------------------------------------------------------------

def check_reachable(study: Any, settings: RunSettings) -> None:
    """Refuse, before any scoring or pruning, a level that no servable prefix of a finer grain matches: the plan from
    the block order (`order_rankings`), one line from `matched_prefix` where it fails."""
    sizes = study_sizes(study, settings)
    depth = len({r for r in sizes.costs if isinstance(r, int)})
    plan_matched(matching(study), sizes, order_rankings(grain_names(study), depth,
                                                         study.prune.protected_blocks(depth)))


def study_sizes(study: Any, settings: RunSettings) -> ModelSizes:
    """Per-removal costs of the original, from its config (the hub's, or a known public shape offline)."""
    from layerprune.pipeline.plan import model_config

    config, note = model_config(study.model, settings)
    if config is None:
        raise LayerpruneError(f"the grain study prices removals from the config: {note}")
    return config_sizes(config)


# --- stages ----------------------------------------------------------------------------------------------------------

def score_grain(study: Any, settings: RunSettings, root: Path, grain: str) -> None:
    """One one-shot scoring pass of every candidate at `grain` (nothing saved): scored/GRAIN.json."""
    from layerprune.prune.api import prune_model

    fields = study.prune.model_dump(exclude={"drop", "layers", "granularity"})
    recipe = study.prune.model_validate({**fields, "granularity": grain, "drop": 1})
    report = prune_model(study.model, recipe, settings, None, dry_run=True).report
    scores = report["scores"] if grain == "block" else report["sublayer_scores"]
    named = {str(i): s for i, s in enumerate(scores)} if grain == "block" else dict(scores)
    record = {"grain": grain, "score": study.prune.score, "scores": named,
              "protect": report["method"]["protect"], "depth": report["num_blocks_before"]}
    write_atomic(score_file(root, grain), json.dumps(record, indent=1))


def read_ranking(root: Path, grain: str) -> list[Removal]:
    """A grain's candidates least important first, protected blocks left out: blocks by score (ties: the later block
    first); sublayers in `servable_order`, so that every prefix is one the Nemotron-NAS layout serves (none longer)."""
    from layerprune.models.sublayers import parse_sublayer
    from layerprune.prune.sublayer_scores import servable_order
    from layerprune.prune.target import rank_removals

    record = json.loads(score_file(root, grain).read_text())
    removals = [int(k) if grain == "block" else parse_sublayer(k) for k in record["scores"]]
    protected = set(record["protect"])
    kept = [(s, r) for s, r in zip(record["scores"].values(), removals, strict=True)
            if (r if isinstance(r, int) else r.block) not in protected]
    if grain == "block":
        return rank_removals([s for s, _ in kept], [r for _, r in kept])
    return servable_order({r: s for s, r in kept}, record["depth"])  # type: ignore[misc]


def make_plan(study: Any, settings: RunSettings, root: Path) -> None:
    """grain_plan.json: every cell's removals and savings from the rankings."""
    cuts = study.grains
    speed, bench = measured_speed(study.model, settings, cuts.speed_repeats) if cuts.match == "speedup" \
        else (None, None)
    plan = plan_matched(matching(study), study_sizes(study, settings),
                        {g: read_ranking(root, g) for g in grain_names(study)}, speed)
    write_atomic(root / PLAN_FILE, json.dumps({"match": cuts.match, "tolerance": cuts.tolerance,
                                               **({"timing": bench} if bench else {}), "cells": plan}, indent=1))


def read_plan(root: Path) -> dict[str, Any]:
    return json.loads((root / PLAN_FILE).read_text())


def prune_cell(study: Any, settings: RunSettings, root: Path, name: str) -> None:
    """The cell's planned removals cut from the original (whole blocks, or sublayers in the Nemotron-NAS layout)."""
    from layerprune.prune.api import prune_model

    planned = read_plan(root)["cells"][name]
    fields = study.prune.model_dump(exclude={"drop", "layers", "granularity"})
    recipe = study.prune.model_validate({**fields, "granularity": planned["grain"], "layers": planned["removals"]})
    prune_model(study.model, recipe, settings, root / "pruned" / name, overwrite=True)
