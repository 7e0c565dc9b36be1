"""The sweep's dry run: the grid it would run, each arm's recovery plan and memory, the budget points, the stages
already complete in its directory, and a time estimate from the measured 2-core rates (cells.RATES)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from layerprune.core.errors import LayerpruneError
from layerprune.core.reports import read_report
from layerprune.core.settings import RunSettings
from layerprune.pipeline.stages import RunPaths, RunState, first_names, in_brief, owns
from layerprune.pipeline.studies.cells import RATES, check_chat_template, rates_apply
from layerprune.pipeline.studies.recovery_plan import (
    PROMPT_TOKENS,
    answers,
    budget_lines,
    budget_runs,
    budget_seconds,
    held_out_seconds,
    learning_rate,
    run_tokens,
    states_seconds,
    training,
)
from layerprune.pipeline.studies.sweep import arms_added
from layerprune.pipeline.studies.sweep_cells import cells, disk_need, stage_names
from layerprune.pipeline.studies.sweep_grid import (
    GSM8K,
    SweepStudy,
    arm_names,
    both_formats,
    fixed_probes,
    gsm8k_gated,
    has_control,
    instrument,
    models,
)
from layerprune.pipeline.studies.sweep_time import left_seconds, measured_line
from layerprune.recover import lr_search
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


def dry_run(study: SweepStudy, settings: RunSettings) -> str:
    """The plan: model and data, the grid (the sweep's points, or a grain study's cells: grain_plan.py), what each
    model is scored on, the recoveries and their memory, the stages (those a run in the output has complete) and a
    time estimate from the measured CPU rates; no work."""
    from layerprune.pipeline.plan import check_data, check_model
    from layerprune.pipeline.studies import grain_plan

    if study.grains is not None:
        what = "grain study"
        body, seconds, runs = grain_plan.plan_lines(study, settings)
    else:
        what = "pruning-ratio sweep" if len(study.ratios) > 1 else \
            f"one-cut sweep (k = {study.ratios[0]}: a recovery study)"
        size = sizing(study)
        body, seconds, runs = _sweep_lines(study, settings, size), size.seconds, sum(size.runs.values())
        if study.run_dir().exists():  # a run to resume: what its stages left will take, and what the timed ones took
            seconds = {**seconds, "left": left_seconds(study, seconds), "timed": measured_line(study, seconds)}
    lines = [f"{what} '{study.name}' -> {study.run_dir()}", f"model: {check_model(study.model, settings)}",
             *[f"data: {line}" for line in check_data(instrument(study))], *body,
             f"recoveries: {runs}; stages: {in_brief(stage_names(study))}",
             *(line for arm in arm_names(study) for line in _memory_lines(study, settings, arm)),
             *progress_lines(study, study.run_dir()), *_disk_lines(study, settings), _estimate(study, seconds)]
    return "\n".join(lines)


def _disk_lines(study: SweepStudy, settings: RunSettings) -> list[str]:
    """What the models still to save take against the space free (a sweep's; a grain study's cells save their
    own)."""
    disk = disk_need(study, settings, study.run_dir()) if study.grains is None else None
    return [disk.line()] if disk is not None else []


def _sweep_lines(study: SweepStudy, settings: RunSettings, size: Sizing) -> list[str]:
    """The sweep's part of the dry run: its cut, gates, models and their items, probe format, recoveries, budget
    points and replicates."""
    limits, candidates, families = size.limits, size.candidates, size.families
    return [_cut_line(study),
            (f"probes-calibrated: {len(candidates)} candidate levels x {study.probes.items} "
             f"calibration-stream items; keep {100 * study.probes.low:.0f}-{100 * study.probes.high:.0f}%, at most "
             f"{study.probes.per_family} per family ({len(families)} families: {', '.join(sorted(families))})"
             if study.probes is not None else "probes-calibrated: no gate (probes: null); the probe tasks scored "
             "are the fixed ones"),
            _gsm8k_line(study, limits),
            f"models evaluated: {size.n_models} ({first_names(models(study))}) on the same items each: "
            f"{', '.join(f'{t} {_size(limits.get(t))}' for t in study.classification)}"
            + (f"; fixed (every model, never gated): {', '.join(f'{t} {_size(limits.get(t))}' for t in study.fixed)}"
               if study.fixed else "")
            + (f"; at most {size.most_probes} probe levels x {size.probe_limit} items"
               if study.probes is not None else ""),
            ("probe format: plain few-shot text and, as the recovery data is chat-formatted, through the chat "
             "template too (the same items; eval-chat/<model>); " + check_chat_template(study.model, settings)
             if both_formats(study) else
             "probe format: plain few-shot text (the recovery data is plain: generate.chat_template false)"),
            *_recovery_lines(study, size.shared, size.plans, size.runs),
            *budget_lines(study),
            *(f"arm {arm} trains on its own prompts: {study.arm_recipe(arm, '<pruned>').prompts.samples} from "
              f"{study.arm_recipe(arm, '<pruned>').prompts.source} (evaluation probe seeds "
              f"{study.arm_recipe(arm, '<pruned>').prompts.exclude_probe_seeds} excluded, the count in its report), "
              f"answered by the teacher once (selfgen-{arm}.jsonl)" + _format_of(study, arm)
              for arm in study.arm_prompts),
            _replicate_line(study, size.shared, size.answer_sets)]


def _format_of(study: SweepStudy, arm: str) -> str:
    """How an arm with prompts of its own has them answered, where its arm_generate sets it."""
    if arm not in study.arm_generate:
        return ""
    generate = study.arm_recipe(arm, "<pruned>").generate
    return (f", in {'the chat format' if generate.chat_template else 'plain text to the stop ' + repr(generate.stop)}"
            f", at most {generate.max_new_tokens} new tokens (arm_generate)")


@dataclass(frozen=True)
class Sizing:
    """What the dry run counts: the tasks' planned items, the probe levels, the models, each arm's recovery plan
    and runs, and the seconds of each phase at the measured 2-core rates (cells.RATES)."""

    shared: RecoverRecipe
    limits: dict[str, float | None]
    candidates: list[str]
    families: set[str]
    most_probes: int
    probe_limit: int
    n_models: int
    plans: dict[str | None, tuple[float, str, float]]
    runs: dict[str | None, int]
    answer_sets: int
    seconds: dict[str, float]


def sizing(study: SweepStudy) -> Sizing:
    """The sweep's size and the seconds of each phase (no work, no model loaded)."""
    from layerprune.evaluate.suites import plan_tasks
    from layerprune.tasks.data import resolve_data_dir
    from layerprune.tasks.probes import family_of

    shared = study.shared_recipe("<pruned>")
    planned, _ = plan_tasks(instrument(study).evaluate, resolve_data_dir(study.evaluate.data_dir))
    limits = {t.spec.name: t.limit for t in planned}
    cls_docs = sum(int(limits[t]) if (limits.get(t) or 0) >= 1 else 0 for t in study.classification)
    candidates = study.probes.candidates if study.probes is not None else []
    probe_limit = int(max([(limits.get(t) or 0) for t in candidates], default=0))
    families = {family_of(task) for task in candidates}
    most_probes = len(families) * study.probes.per_family if study.probes is not None else 0
    chat_items = most_probes * probe_limit + sum(_items(limits, t) for t in fixed_probes(study))
    per_model = (cls_docs / RATES["classification docs/s"] + most_probes * probe_limit / RATES["probe items/s"]
                 + fixed_seconds(study, limits))
    n_models = len(models(study))
    plans = {arm: training(study.arm_recipe(arm, "<pruned>")) for arm in arm_names(study)}
    runs = {arm: (len(study.ratios) + has_control(study, arm)) * study.replicates
            + len(study.lr_grid.get(arm or "", [])) if not study.budgets else len(budget_runs(study, arm))
            for arm in plans}
    answer_sets = study.replicates if shared.generate.temperature > 0 else 1
    seconds = {"calibrate": len(candidates) * (study.probes.items if study.probes else 0)
               / RATES["calibration items/s"],
               "gate": study.gsm8k_gate.limit / RATES["gsm8k items/s"] if study.gsm8k_gate and gsm8k_gated(study)
               else 0.0,
               "teacher answers": answer_seconds(shared, study.replicates),
               **{f"teacher answers {arm}": answer_seconds(study.arm_recipe(arm, "<pruned>"), study.replicates)
                  for arm in study.arm_prompts},
               **({"training" if arm is None else f"training {arm}": runs[arm] * trained / rate
                   for arm, (trained, _, rate) in plans.items()} if not study.budgets else
                  {"training" if arm is None else f"training {arm}": budget_seconds(study, arm)
                   for arm in plans}),
               "held-out evaluations": sum(held_out_seconds(study, arm, run_tokens(study, arm, plans, runs))
                                           for arm in plans),
               "teacher states": sum(states_seconds(study, arm) for arm in plans),
               "evaluation": n_models * per_model,
               **({"chat-format probes": n_models * chat_items / RATES["probe items/s"]}
                  if both_formats(study) else {})}
    return Sizing(shared, limits, candidates, families, most_probes, probe_limit, n_models, plans, runs, answer_sets,
                  seconds)


def answer_seconds(recipe: RecoverRecipe, replicates: int) -> float:
    """The teacher's time for one recipe's answers, each of max_new_tokens (its own: an arm's arm_generate), one set
    per replicate where they are sampled."""
    sets = replicates if recipe.generate.temperature > 0 else 1
    return sets * answers(recipe) * recipe.generate.max_new_tokens / RATES["teacher tokens/s"]


def estimate_seconds(study: SweepStudy, settings: RunSettings) -> float | None:
    """The dry run's whole-study estimate in seconds (complete stages included), None where the measured rates do
    not apply (a model other than the embedded one)."""
    if not rates_apply(study.model):
        return None
    if study.grains is not None:
        from layerprune.pipeline.studies import grain_plan

        return sum(grain_plan.seconds(study, settings).values())
    return sum(sizing(study).seconds.values())


def _cut_line(study: SweepStudy) -> str:
    """How the blocks are chosen: one scoring pass cut at every k, or the one cut given (prune.layers)."""
    if study.given_cut:
        return (f"cut given: blocks {sorted(study.prune.layers or [])} (prune.layers; no scoring pass), k = "
                f"{study.ratios[0]}: one cut, every arm recovers the same pruned model")
    ks = ", ".join(map(str, study.ratios))
    one = "; one k: every arm recovers the same pruned model" if len(study.ratios) == 1 else ""
    return (f"score once: {study.prune.score} ({study.prune.metric}, one-shot) on {study.prune.calib} "
            f"({study.prune.calib_samples} items); cut at k = {ks} blocks{one}")


def _gsm8k_line(study: SweepStudy, limits: dict[str, float | None]) -> str:
    """Whether GSM8K is scored: past its gate, fixed (every model), or not at all."""
    if GSM8K in study.fixed:
        return f"gsm8k: fixed, scored on every model ({_size(limits.get(GSM8K))} items), no gate"
    if study.gsm8k_gate is None:
        return "gsm8k: not scored (gsm8k_gate: null)"
    return (f"gsm8k: scored only if the original reaches {100 * study.gsm8k_gate.min_score:.0f}% on "
            f"{study.gsm8k_gate.limit} items (then {_size(limits.get(GSM8K))} items per model)")


def _items(limits: dict[str, float | None], task: str) -> int:
    """Items a task is planned with (its suite limit; 0 where it is a share of the set or unknown)."""
    limit = limits.get(task) or 0
    return int(limit) if limit >= 1 else 0


def fixed_seconds(study: SweepStudy, limits: dict[str, float | None]) -> float:
    """One model's scoring of the fixed tasks at the measured rates (GSM8K at its own)."""
    return sum(_items(limits, t) / RATES["gsm8k items/s" if t == GSM8K else "probe items/s"] for t in study.fixed)


def progress_lines(study: SweepStudy, root: Path) -> list[str]:
    """Where the output already holds a run: how many of the sweep's stages are complete there (a run resumes, so
    they are skipped) and which are left, or that the sweep would be refused there."""
    paths = RunPaths(root)
    if not paths.state.is_file():
        return []
    added = arms_added(study, paths)
    if not holds_its_run(study, root):
        return [f"{root} holds another recipe's run (or this sweep changed): the sweep would be refused there; "
                "--overwrite starts it over, --output chooses another folder"]
    stages = [cell for cell in cells(study, root) if cell.step != "report"]
    names, left = [c.name for c in stages], [c.name for c in stages if not c.output.exists()]
    arms = f"; arms {', '.join(added[1])} would be added to it" if added else ""
    kind = "sweep" if study.grains is None else "grain study"
    return [f"{root} holds a run of this {kind}{arms}: {len(names) - len(left)} of {len(names)} stages complete "
            f"(skipped when it resumes; the estimate below counts them all); "
            f"left: {in_brief(left) if left else 'none'}"]


def holds_its_run(study: SweepStudy, root: Path) -> bool:
    """Whether `root` holds a run of this sweep (its run.json this recipe's, or this recipe's less arms it adds)."""
    paths = RunPaths(root)
    try:
        owned = paths.state.is_file() and owns(read_report(paths.state, RunState), study)
    except LayerpruneError:
        owned = False
    return owned or arms_added(study, paths) is not None


def _recovery_lines(study: SweepStudy, shared: RecoverRecipe, plans: dict[str | None, tuple[float, str, float]],
                    runs: dict[str | None, int]) -> list[str]:
    """The recovery at every k (without arms), or the shared teacher answers and each arm's method, schedule and
    recoveries."""
    train, gen = shared.train, shared.generate
    asked = f"{answers(shared)} teacher answers to {shared.prompts.source} prompts"
    tail = f"(planned from {gen.max_new_tokens} + {PROMPT_TOKENS} tokens per answer; the report counts them)"
    if study.arms is None:
        trained, schedule, _ = plans[None]
        return [f"recovery at every k: {shared.method} on {asked} (generated once; {gen.max_new_tokens} new tokens "
                f"at temperature {gen.temperature:g}), {schedule}{_rate(study, None, shared)}, batch "
                f"{train.batch_size} x {train.grad_accum}, held-out {train.held_out:g} every {train.eval_steps} "
                f"steps: about {trained / 1000:.0f}k trained tokens per k {tail}"]
    lines = [f"arms ({len(study.arms)}, each at every k, paired on the same items): {', '.join(study.arms)}; every "
             f"arm{' but ' + ', '.join(study.arm_prompts) if study.arm_prompts else ''} on the same {asked} "
             f"(generated once for every arm and k; {gen.max_new_tokens} new tokens at "
             f"temperature {gen.temperature:g}), batch {train.batch_size} x {train.grad_accum}, held-out "
             f"{train.held_out:g}"]
    for arm, (trained, schedule, _) in plans.items():
        recipe = study.arm_recipe(arm, "<pruned>")
        size = (f"about {trained / 1000:.0f}k trained tokens per k" if not study.budgets else
                "each run to its budget (below)")
        lines.append(f"arm {arm}: {recipe.chain_name()}, {schedule}{_rate(study, arm, recipe)}: {size}; "
                     f"{runs[arm]} recoveries {tail}")
    return lines


def _rate(study: SweepStudy, arm: str | None, recipe: RecoverRecipe) -> str:
    """', lr 0.001' (the recipe's), or for an arm with a grid the rate its search chose once it has run."""
    grid, rate = study.lr_grid.get(arm or ""), learning_rate(recipe)
    if not grid:
        return "" if rate is None else f", lr {rate:g}"
    searched = lr_search.lr_search_file(study.run_dir(), str(arm)).is_file() and holds_its_run(study, study.run_dir())
    section = "" if recipe.lr_section() == "train" or recipe.trainer_method() is None else f"{recipe.lr_section()} "
    chosen = f"{section}lr {lr_search.chosen(study.run_dir(), str(arm), study.lr_grid):g} chosen by lr-{arm} from" \
        if searched else f"{section}lr from"
    return (f", {chosen} the grid {', '.join(f'{rate:g}' for rate in grid)} (the arm's recipe trained at each on "
            f"pruned-k{study.lr_k} under a seed of its own, the lowest held-out loss chosen; {len(grid)} of the "
            "recoveries are that search, never scored)")


def _replicate_line(study: SweepStudy, shared: RecoverRecipe, answer_sets: int) -> str:
    """What the replicates vary and the control adds."""
    runs = (f"{study.replicates} replicates of every recovery (seeds settings.seed + 0..{study.replicates - 1}: "
            f"held-out split, data order, adapter init; {answer_sets} teacher answer set(s))"
            if study.replicates > 1 else "1 replicate of every recovery (run-to-run variance not measured)")
    from layerprune.recover.methods import cut_methods

    if not study.controls:
        control = "no k = 0 control (controls: false)"
    elif study.arms is not None:
        cut = [arm for arm in study.arms if not has_control(study, arm)]
        control = (f"k = 0 controls (the arm's recovery of the unpruned original, ARM-k0): "
                   f"{', '.join(a for a in study.arms if a not in cut) or 'none'}"
                   + (f"; none for {', '.join(cut)} (a cut is needed: {cut_methods()})" if cut else ""))
    elif has_control(study):
        control = "k = 0 control: the same recovery of the unpruned original (recovered-k0), scored on the same items"
    else:
        control = f"no k = 0 control: {shared.chain_name()} needs a cut ({cut_methods()} change cut blocks)"
    return f"{runs}; {control}"


def _memory_lines(study: SweepStudy, settings: RunSettings, arm: str | None) -> list[str]:
    """The recovery's (an arm's) memory plan at the smallest k (the largest student: the original itself with the
    control)."""
    import copy

    from layerprune.pipeline.plan import model_config
    from layerprune.recover import memory
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.methods import plan_for

    config, note = model_config(study.model, settings)
    if config is None:
        return [f"memory plan: not made ({note or 'the config was not readable'})"]
    teacher = copy.deepcopy(config)
    first = 0 if has_control(study, arm) or study.grains is not None else study.ratios[0]  # a finer cell keeps all
    config.num_hidden_layers = teacher.num_hidden_layers - first
    _, plan = plan_for(study.arm_recipe(arm, "<pruned>"), config,
                       RecoverJob(output=study.run_dir() / "recovered-k1", settings=settings), cuda=True,
                       teacher_config=teacher)
    text = memory.format_plan(plan, f"{study.model or 'embedded'} minus {first} blocks")
    return [text if arm is None else f"arm {arm}: {text}"]


def _estimate(study: SweepStudy, seconds: dict[str, float]) -> str:
    if not rates_apply(study.model):
        return "time: no estimate (the rates were measured for the embedded model on 2 CPU cores)"
    left, timed = seconds.pop("left", None), seconds.pop("timed", None)
    return ("time estimate at the embedded model's measured 2-core rates (" + ", ".join(
        f"{k} {v:g}" for k, v in RATES.items()) + "): " + ", ".join(f"{k} {v / 60:.0f} min" for k, v in seconds.items())
        + f"; total about {sum(seconds.values()) / 60:.0f} min"
        + (f"; left (the stages not complete) about {left / 60:.0f} min" if left is not None else "")
        + (f"\n{timed}" if timed else ""))


def _size(limit: float | None) -> str:
    return "all" if limit is None else f"{100 * limit:g}%" if limit < 1 else str(int(limit))
