"""The grain study's dry run: its cells planned at matched savings (on the model's shapes, no weights), each arm's
recovery plan, and a time estimate from the measured 2-core rates below."""

from __future__ import annotations

import logging

from layerprune.core.settings import RunSettings
from layerprune.pipeline.studies.grain import study_sizes
from layerprune.pipeline.studies.grain_grid import (
    cells,
    grain_arm,
    grain_names,
    logical_models,
    matching,
)
from layerprune.pipeline.studies.sweep_cells import stage_names
from layerprune.pipeline.studies.sweep_grid import SweepStudy, instrument
from layerprune.pipeline.studies.sweep_plan import in_brief
from layerprune.prune.matched import order_rankings, plan_matched
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


SCORE_RATE = 7.6  # ablation candidate-items/s: the demo's one-shot pass, 30 blocks x 32 items in 126 s (2 idle cores)


TARGET_RATE = 76.0  # unpadded target tokens/s of LoRA SFT or kd (recovery-transfer-replicated: 16k in 205-215 s)


PRUNE_SECONDS = 20.0  # one cell's cut, verification and save (assumed, not measured)


TIMING_SECONDS = 2.7  # match speedup: one repeat of a candidate and the original (bench/bench_grain_speed.py, 1 thread)


TIMED_PER_CELL = 4  # prefixes a finer cell's search times (the prediction, then a step or three either way)


def dry_run(study: SweepStudy, settings: RunSettings) -> str:
    """The plan: model and data, every cell's removals and savings (from the block order: the scores choose which),
    the recovery's budget, replicates, controls, gates, the stages and a time estimate; no work."""
    from layerprune.pipeline.plan import check_data, check_model

    sizes = study_sizes(study, settings)
    depth = len({r for r in sizes.costs if isinstance(r, int)})
    plan = plan_matched(matching(study), sizes, order_rankings(grain_names(study), depth,
                                                               study.prune.protected_blocks(depth)))
    recipe, stages, cuts = study.arm_recipe(grain_arm(study), "<pruned>"), stage_names(study), study.grains
    train = recipe.train
    lines = [f"grain study '{study.name}' -> {study.run_dir()}", f"model: {check_model(study.model, settings)}",
             *[f"data: {line}" for line in check_data(instrument(study))],
             f"rank: one one-shot {study.prune.score} ({study.prune.metric}) pass per grain on {study.prune.calib} "
             f"({study.prune.calib_samples} items); matched on {cuts.match} within {100 * cuts.tolerance:g}% of the "
             "block arm's savings" + (" (speed gained), timed at the plan stage; below, the FLOP model's prediction "
                                      "stands in" if cuts.match == "speedup" else ""),
             "cells (planned from the block order; the scores choose which, the counts hold where blocks are alike):",
             *[f"  {name}: {len(c['removals'])} removals, {c['params_removed'] / 1e6:.2f}M parameters "
               f"({100 * c['params_fraction']:.1f}%), KV cache -{100 * c['kv_fraction']:.1f}%, predicted speedup "
               f"{c['predicted_speedup']:.3f}x, gap {100 * c['gap']:+.2f}%" for name, c in plan.items()],
             f"recovery of every cell and control: {recipe.chain_name()} on {recipe.prompts.samples or 'all'} "
             f"{recipe.prompts.source} prompts' teacher answers (temperature {recipe.generate.temperature:g}, "
             f"{recipe.generate.max_new_tokens} new tokens); budget {train.max_tokens or 'no'} unpadded target tokens "
             f"or {train.max_steps} steps of {train.batch_size} x {train.grad_accum} (whichever first), lr "
             f"{train.learning_rate:g}",
             f"replicates: {study.replicates} per cell" + (" (run-to-run variance not measured)"
                                                          if study.replicates == 1 else ", seeds run seed + r")
             + ("; k = 0 controls: the recovery of the original, one per replicate" if study.controls
                else "; no k = 0 control"),
             f"gates: control shift {100 * study.grains.gates.control_shift:g} points; margin "
             f"{100 * study.grains.gates.margin:g} points; a level is read only where the block arm's drop is clear",
             f"stages: {in_brief(stages)}",
             estimate(study, recipe, depth)]
    return "\n".join(lines)


def estimate(study: SweepStudy, recipe: RecoverRecipe, depth: int) -> str:
    """Minutes per phase at the embedded model's measured 2-core rates (`depth`: the model's blocks)."""
    from layerprune.pipeline.studies.cells import RATES, rates_apply

    if not rates_apply(study.model):
        return "time: no estimate (the rates were measured for the embedded model on 2 CPU cores)"
    seconds, models, runs = phase_seconds(study, recipe, depth)
    return (f"time estimate ({models} evaluations, {runs} recoveries; rates: scoring {SCORE_RATE} candidate-items/s, "
            f"training {TARGET_RATE:g} target tokens/s, classification {RATES['classification docs/s']} docs/s, "
            f"probes {RATES['probe items/s']} items/s, teacher {RATES['teacher tokens/s']:g} tokens/s; pruning "
            f"{PRUNE_SECONDS:g} s a cell, assumed): " + ", ".join(f"{k} {v / 60:.0f} min" for k, v in seconds.items())
            + f"; total about {sum(seconds.values()) / 60:.0f} min")


def phase_seconds(study: SweepStudy, recipe: RecoverRecipe, depth: int) -> tuple[dict[str, float], int, int]:
    """Seconds per phase at the measured rates, the evaluations and the recoveries (`depth`: the model's blocks)."""
    from layerprune.evaluate.suites import plan_tasks
    from layerprune.pipeline.studies.cells import RATES
    from layerprune.tasks.data import resolve_data_dir
    from layerprune.tasks.probes import probe_tasks

    planned, _ = plan_tasks(instrument(study).evaluate, resolve_data_dir(study.evaluate.data_dir))
    per_model = sum((t.limit if (t.limit or 0) >= 1 else 100) / (RATES["probe items/s"] if t.spec.name in probe_tasks()
                                                                  else RATES["classification docs/s"]) for t in planned)
    models = sum(len(labels) for labels in logical_models(study).values())
    runs = (len(cells(study)) + study.controls) * study.replicates
    train = recipe.train
    trained = train.max_tokens or train.max_steps * train.batch_size * train.grad_accum * recipe.generate.max_new_tokens
    candidates = (depth - len(study.prune.protected_blocks(depth))) * len(grain_names(study))  # every unprotected one
    seconds = {"scoring": candidates * study.prune.calib_samples / SCORE_RATE,
               "teacher answers": (recipe.prompts.samples or 256) * recipe.generate.max_new_tokens
               / RATES["teacher tokens/s"],
               "pruning": len(cells(study)) * PRUNE_SECONDS, "training": runs * trained / TARGET_RATE,
               **({"timing": len(study.ratios) * (1 + TIMED_PER_CELL * len(study.grains.compare))
                   * study.grains.speed_repeats * TIMING_SECONDS} if study.grains.match == "speedup" else {}),
               "evaluation": models * per_model}
    return seconds, models, runs


def estimate_seconds(study: SweepStudy, settings: RunSettings) -> float | None:
    """The dry run's whole-study estimate in seconds, None where the measured rates do not apply."""
    from layerprune.pipeline.studies.cells import rates_apply

    if not rates_apply(study.model):
        return None
    depth = len({r for r in study_sizes(study, settings).costs if isinstance(r, int)})
    return sum(phase_seconds(study, study.arm_recipe(grain_arm(study), "<pruned>"), depth)[0].values())
