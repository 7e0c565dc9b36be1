"""The grain study's part of the dry run (sweep_plan.py frames it): its cells planned at matched savings (on the
model's shapes, no weights), the recovery, replicates and gates, and the seconds of each phase at the measured 2-core
rates (cells.RATES)."""

from __future__ import annotations

from layerprune.core.settings import RunSettings
from layerprune.pipeline.studies.cells import RATES
from layerprune.pipeline.studies.grain import study_sizes
from layerprune.pipeline.studies.grain_grid import (
    cells,
    grain_arm,
    grain_names,
    logical_models,
    matching,
)
from layerprune.pipeline.studies.recovery_plan import answers
from layerprune.pipeline.studies.sweep_grid import SweepStudy, instrument
from layerprune.prune.matched import order_rankings, plan_matched
from layerprune.prune.target import ModelSizes
from layerprune.recover.schema import RecoverRecipe

PRUNE_SECONDS = 20.0  # one cell's cut, verification and save (assumed, not measured)

TIMING_SECONDS = 2.7  # match speedup: one repeat of a candidate and the original (bench/bench_grain_speed.py, 1 thread)

TIMED_PER_CELL = 4  # prefixes a finer cell's search times (the prediction, then a step or three either way)


def plan_lines(study: SweepStudy, settings: RunSettings) -> tuple[list[str], dict[str, float], int]:
    """The grain study's part of the dry run (sweep_plan.dry_run): every cell's removals and savings (from the block
    order: the scores choose which), the recovery's budget, replicates, controls and gates; the seconds of each phase
    at the measured rates and the recoveries."""
    sizes = study_sizes(study, settings)
    depth = model_depth(sizes)
    plan = plan_matched(matching(study), sizes, order_rankings(grain_names(study), depth,
                                                               study.prune.protected_blocks(depth)))
    recipe, cuts = study.arm_recipe(grain_arm(study), "<pruned>"), study.grains
    train = recipe.train
    seconds, models, runs = phase_seconds(study, recipe, depth)
    lines = [f"rank: one one-shot {study.prune.score} ({study.prune.metric}) pass per grain on {study.prune.calib} "
             f"({study.prune.calib_samples} items); matched on {cuts.match} within {100 * cuts.tolerance:g}% of the "
             "block arm's savings" + (" (speed gained), timed at the plan stage; below, the FLOP model's prediction "
                                      "stands in" if cuts.match == "speedup" else ""),
             "cells (planned from the block order; the scores choose which, the counts hold where blocks are alike):",
             *[f"  {name}: {len(c['removals'])} removals, {c['params_removed'] / 1e6:.2f}M parameters "
               f"({100 * c['params_fraction']:.1f}%), KV cache -{100 * c['kv_fraction']:.1f}%, predicted speedup "
               f"{c['predicted_speedup']:.3f}x, gap {100 * c['gap']:+.2f}%" for name, c in plan.items()],
             f"models evaluated: {models}, each on the instrument ({', '.join(instrument(study).evaluate.only or [])})",
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
             f"{100 * study.grains.gates.margin:g} points; a level is read only where the block arm's drop is clear"]
    return lines, seconds, runs


def model_depth(sizes: ModelSizes) -> int:
    """The model's blocks, from its sizes (costs keyed by block index, and by sublayer)."""
    return len({r for r in sizes.costs if isinstance(r, int)})


def seconds(study: SweepStudy, settings: RunSettings) -> dict[str, float]:
    """Seconds per phase at the measured rates (`--max-hours`: no matched plan is made, only the shapes read)."""
    depth = model_depth(study_sizes(study, settings))
    return phase_seconds(study, study.arm_recipe(grain_arm(study), "<pruned>"), depth)[0]


def phase_seconds(study: SweepStudy, recipe: RecoverRecipe, depth: int) -> tuple[dict[str, float], int, int]:
    """Seconds per phase at the measured rates (cells.RATES; the cut and the timing assumed above), the evaluations
    and the recoveries (`depth`: the model's blocks)."""
    from layerprune.evaluate.suites import plan_tasks
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
    seconds = {"scoring": candidates * study.prune.calib_samples / RATES["scoring candidate-items/s"],
               "teacher answers": answers(recipe) * recipe.generate.max_new_tokens
               / RATES["teacher tokens/s"],
               f"pruning ({PRUNE_SECONDS:g} s a cell, assumed)": len(cells(study)) * PRUNE_SECONDS,
               "training": runs * trained / RATES["target tokens/s"],
               **({"timing": len(study.ratios) * (1 + TIMED_PER_CELL * len(study.grains.compare))
                   * study.grains.speed_repeats * TIMING_SECONDS} if study.grains.match == "speedup" else {}),
               "evaluation": models * per_model}
    return seconds, models, runs
