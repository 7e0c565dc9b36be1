"""The pruning-ratio sweep: one scoring pass, the same ranking cut at each k, each pruned model recovered the same way.

Stages (each skipped when its output is complete, so an interrupted sweep resumes stage by stage):
calibrate-probes (which probe levels the original can do, on the calibration stream), score (one ablation pass over
every block: the ranking), gate-gsm8k (GSM8K is scored only where the original reaches the gate), eval-baseline,
with `controls` the k = 0 control (recover-k0, eval-recovered-k0: the same recovery of the unpruned original), then
per k: prune-k (the k lowest-ranked blocks, cut from the files), eval-pruned-k, recover-k (SFT on the original
model's own answers to generic instructions, generated once and shared by every k), eval-recovered-k; each recovery
once per replicate (replicate r > 0: recover-kK@rR with seed settings.seed + r); and the report (sweep_report.py:
paired intervals over the same items for every model, across-run spread over the replicates).

With `arms` (recovery methods by label, as a recovery study's: each arm's recipe is the shared `recover` recipe with
the arm's method and section, cells.derive_arm_recipe), every k (and the control, for the arms that can have
one) is recovered by every arm: model ARM-kK (replicate r > 0: ARM-kK@rR), its folder and eval folder of that name,
stages recover-ARM-kK and eval-ARM-kK. The teacher answers are shared by every arm and k, as by every k without arms.
A finished sweep given another arm (its other arms unchanged) resumes: only the new arm's stages run.
An arm with a learning-rate grid (`lr_grid`, recover/lr_search.py) gets a stage lr-ARM after eval-baseline:
its recipe trained at each rate on the model pruned at k = `lr_at` (default the middle ratio) under seed settings.seed
+ 1000 (no scored replicate's), the lowest held-out loss chosen for every k, replicate and control of the arm; the
search runs are not scored.

One k (`ratios: [N]`) is a recovery study: one cut, recovered by every arm at one budget (issue 56: the recovery
study's own engine is gone). Its cut may be given (`prune.layers`: no score stage), its probe gate left out
(`probes: null`), and `fixed` names the generative tasks scored on every model whatever the gates keep (a retrieval
control such as copy_l7; gsm8k there is scored without its gate stage).

With `grains` (grain_grid.py) the sweep is the grain study: each grain's scoring pass, the matched plan and every
cell's cut (grain.py's steps), then the same evaluations and replicated recoveries by its one arm, and the grain
report (grain.md) instead of the sweep's.
"""

from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path

from layerprune.core.errors import LayerpruneError
from layerprune.core.reports import read_report, write_report
from layerprune.core.settings import RunSettings
from layerprune.evaluate.schema import EvalSettings
from layerprune.pipeline.runner import TIMES, Stage, run_stages
from layerprune.pipeline.stages import RunPaths, RunState, claim_run_dir, owns, recipe_fingerprint
from layerprune.pipeline.studies import grain
from layerprune.pipeline.studies.cells import (
    CHAT_EVAL,
    SEARCH_REPLICATE,
    calibrate,
    check_chat_template,
    data_dir_of,
    recover_sharing_answers,
    replicate_settings,
)
from layerprune.pipeline.studies.grain import check_reachable
from layerprune.pipeline.studies.progress import check_same_weights
from layerprune.pipeline.studies.study_reports import report_file, unmark_if_left, write_reports
from layerprune.pipeline.studies.sweep_cells import STATES, Cell, cells, disk_need, model_dir
from layerprune.pipeline.studies.sweep_grid import (
    GSM8K,
    SweepStudy,
    arm_names,
    both_formats,
    instrument,
    trains_each_budget,
)
from layerprune.pipeline.studies.sweep_inputs import chat_tasks, evaluated_tasks, ranking
from layerprune.recover import lr_search
from layerprune.recover.job import leftover_of
from layerprune.recover.lr_search import with_learning_rate
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


def run_sweep(study: SweepStudy, settings: RunSettings, overwrite: bool = False) -> Path:
    """Run every incomplete stage in order; return the report (sweep.md; grain.md with grains)."""
    from layerprune.pipeline.plan import validate_data
    root = study.run_dir()
    grid = cells(study, root)
    cut = next(c for c in grid if c.step in ("score", "prune", "plan"))  # the ranking, the given cut, or the plan
    pending = overwrite or not cut.output.exists()
    if pending and study.grains is not None:
        check_reachable(study, settings)  # a k no finer grain's servable prefix matches: refused before any scoring
    validate_data(instrument(study), settings, prune_pending=pending)
    check_prompts(study)
    if both_formats(study):
        check_chat_template(study.model, settings)
    if not overwrite:
        adopt_added_arms(study, RunPaths(root))
    claim_run_dir(RunPaths(root), study, overwrite)
    if not overwrite:
        check_same_weights(study, settings, root)  # a resumed run (restored progress too) on the weights it scored
    disk = disk_need(study, settings, root) if study.grains is None else None
    if disk is not None and disk.short:  # said before hours of stages, not at the save that fails
        log.warning("%s", disk.line())
    unmark_if_left(study, root)  # stages added to a finished run: its reports are drawn again once they have run
    run_stages(sweep_stages(study, settings, root, grid), root, times=root / TIMES)
    shutil.rmtree(root / STATES, ignore_errors=True)  # every run that could read the kept states has run
    return report_file(study, root)


def states_folder(study: SweepStudy, root: Path, arm: str | None, search: bool = False,
                  cell: Cell | None = None) -> Path | None:
    """Where an arm's runs keep the teacher's hidden states for each other (recover/local.span_states): an arm that
    trains a block on them (local) and runs more than once on one cut and seed (a run per budget; with `search`, its
    lr grid's runs); None where nothing would read them again. A folder of its own for each cut and seed (`cell`'s)
    and for the lr search, so each goes as soon as no stage left reads it (`release_states`)."""
    methods = study.arm_recipe(arm, "<pruned>").chain_methods()
    again = len(study.lr_grid.get(arm or "", [])) > 1 if search else trains_each_budget(study, arm)
    if not (again and any(method.caches_states for method in methods)):
        return None
    return root / STATES / ("lr" if search else "" if cell is None else f"k{cell.k}-r{cell.replicate}")


def release_states(study: SweepStudy, root: Path) -> None:
    """Remove the teacher states no recovery or search left to run reads: a cut and seed's once its runs are
    complete, the search's once it is, and any file of the one-folder layout before them (nothing reads it now).
    About 1.5 GB a cut and seed at the budget study's size: kept to the end, they were 15 GB at once."""
    folder = root / STATES
    if not folder.is_dir():
        return
    read = {states_folder(study, root, c.arm, search=c.step == "lr", cell=c) for c in cells(study, root)
            if c.step in ("recover", "lr") and not c.output.exists()}
    for path in folder.iterdir():
        if path in read:
            continue
        try:  # a removal that fails costs disk, never the stage
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
            log.info("teacher states %s: no stage left reads them, removed", path.name)
        except OSError as err:
            log.warning("teacher states %s: not removed (%s)", path, err)


def check_prompts(study: SweepStudy) -> None:
    """Every arm's prompts read as its recovery reads them (the GSM8K test questions they exclude included), so a
    bad prompt file ends the run before any stage, not at the first recovery hours later."""
    from layerprune.recover.prompts import load_prompts, prompts_data_dir

    sources = {p.model_dump_json(): p for p in (study.arm_recipe(a, "<pruned>").prompts for a in arm_names(study))}
    for source in sources.values():
        load_prompts(source, prompts_data_dir(source, data_dir_of(study)))


def adopt_added_arms(study: SweepStudy, paths: RunPaths) -> list[str]:
    """A sweep given another arm resumes where it stands: when paths' run.json records this sweep with fewer arms
    (arms_added), run.json is rewritten to this recipe (its provenance kept), so the new arms' stages run and the
    others are skipped. Return the arms added (none: run.json untouched, and claim_run_dir judges the directory as
    before)."""
    found = arms_added(study, paths)
    if found is None:
        return []
    state, added = found
    write_report(paths.state, state.model_copy(update={
        "fingerprint": recipe_fingerprint(study), "recipe": study.model_dump(mode="json")}))
    log.info("%s: arms %s added to the sweep's %s; its stages are kept", paths.root, ", ".join(added),
             ", ".join(a for a in study.arms or {} if a not in added))
    return added


def arms_added(study: SweepStudy, paths: RunPaths) -> tuple[RunState, list[str]] | None:
    """(run.json, the arms this sweep adds) when run.json records this sweep with fewer arms: each recorded arm
    unchanged and, the added arms' learning-rate grids aside, the fingerprint stored there this sweep's; else None."""
    if study.arms is None or not paths.state.is_file():
        return None
    try:
        state = read_report(paths.state, RunState)
        recorded = SweepStudy.model_validate(state.recipe)
    except (LayerpruneError, ValueError):
        return None  # claim_run_dir says what is wrong with it
    kept = recorded.arms or {}
    added = [arm for arm in study.arms if arm not in kept]
    if not kept or not added or any(study.arms.get(arm) != recipe for arm, recipe in kept.items()):
        return None
    before = study.model_copy(update={"arms": kept, "lr_grid": {a: g for a, g in study.lr_grid.items() if a in kept}})
    return (state, added) if owns(state, before) else None


def sweep_stages(study: SweepStudy, settings: RunSettings, root: Path, grid: list[Cell]) -> list[Stage]:
    """The grid's cells (sweep_cells.cells) as stages, each complete when its output exists; the report is redrawn
    after any work."""
    return [Stage(cell.name, cell.output, functools.partial(STEPS[cell.step], study, settings, root, cell),
                  refresh=cell.step == "report", leftover=leftover_of(cell.output)) for cell in grid]


def calibrate_probes(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    assert study.probes is not None
    calibrate(study.model, study.probes, settings, root)


def gate_gsm8k(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    assert study.gsm8k_gate is not None
    gate = study.evaluate.model_copy(update={"only": [GSM8K], "limit": study.gsm8k_gate.limit})
    evaluate(study, settings, root, "gate-gsm8k", study.model, gate, root / "scored")


def score(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    """The one scoring pass: every block ranked, the largest k's cut dropped (scored/)."""
    from layerprune.prune.api import prune_model

    prune_model(study.model, study.prune, settings, cell.output.parent, overwrite=True)


def evaluate_model_of(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    assert cell.calibration is not None
    evaluate(study, settings, root, cell.label, str(cell.model) if cell.model else study.model,
             study.eval_settings(evaluated_tasks(study, root)), cell.calibration)


def evaluate(study: SweepStudy, settings: RunSettings, root: Path, label: str, model: str | None,
             eval_settings: EvalSettings, calibration: Path, evals: str = "eval") -> None:
    """`model` scored into `evals`/`label`, recording the calibration items of the pruned folder `calibration`."""
    from layerprune.evaluate.runner import evaluate_model

    evaluate_model(model, eval_settings, settings, root / evals / label, overwrite=True,
                   progress=lambda message: log.info("  %s/%s: %s", evals, label, message),
                   calibration_from=calibration)


def chat_eval(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    """The fixed probe tasks and kept probe levels of one model scored through the chat template (probe_format chat),
    the same items, in eval-chat/<label>/; nothing where there is none (the stage then runs again, as a no-op, on
    resume)."""
    probes, label = chat_tasks(study, root), cell.label
    if not probes:
        log.info("  %s%s: no fixed probe task and the gate kept no probe level; nothing to score in chat format",
                 CHAT_EVAL, label)
        return
    assert cell.calibration is not None
    chat = study.evaluate.model_copy(update={"only": probes, "probe_format": "chat"})
    evaluate(study, settings, root, label, str(cell.model) if cell.model else study.model, chat, cell.calibration,
             evals=CHAT_EVAL.rstrip("/"))


def prune_cut(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    prune_at(study, settings, root, cell.k)


def prune_at(study: SweepStudy, settings: RunSettings, root: Path, k: int) -> None:
    """The k lowest-ranked blocks dropped from the original's files (no scoring, no model in memory)."""
    from layerprune.prune.api import prune_model
    from layerprune.prune.recipe import PruneRecipe

    fields = study.prune.model_dump(exclude={"drop", "layers"})
    recipe = PruneRecipe.model_validate({**fields, "layers": ranking(root, study.ratios, study.prune.layers)[k]})
    prune_model(study.model, recipe, settings, model_dir(root, f"pruned-k{k}"), overwrite=True)


def recover_at(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    """One replicate of an arm's recovery of pruned-kK (k = 0: of the unpruned original) on the teacher's answers,
    generated by the first run that needs them and shared by the others (an arm with prompts of its own: its own).
    Replicate r runs with seed settings.seed + r; its teacher answers are replicate 0's at temperature 0 (greedy: the
    same), its own at a temperature above 0. The run trains to the cell's budget (with budgets) and saves a model at
    each of its snapshot budgets, as those points."""
    release_states(study, root)
    student = cell.model or original_copy(study, settings, root)
    rate = lr_search.chosen(root, cell.arm, study.lr_grid) if cell.arm else None
    recipe = with_budget(with_learning_rate(study.arm_recipe(cell.arm, str(student)), rate), cell.budget)
    snapshots = {budget: model_dir(root, label) for budget, label in cell.snapshots}
    answers = root / study.answers_file(cell.arm, recipe, cell.replicate)
    recover_with_snapshots(recipe, cell.output.parent, answers, settings, cell.replicate, data_dir_of(study),
                           snapshots, states_folder(study, root, cell.arm, cell=cell),
                           reach_budget=cell.budget is not None)


def with_budget(recipe: RecoverRecipe, tokens: int | None) -> RecoverRecipe:
    """The recipe trained to `tokens` target tokens (train.max_tokens; None: as it is)."""
    if tokens is None:
        return recipe
    from layerprune.core.recipe_loading import merge_layers

    return RecoverRecipe.model_validate(merge_layers(recipe.model_dump(mode="json"), {"train": {"max_tokens": tokens}}))


def recover_with_snapshots(recipe: RecoverRecipe, output: Path, answers: Path, settings: RunSettings, replicate: int,
                           data_dir: Path | None, snapshots: dict[int, Path], states: Path | None = None,
                           reach_budget: bool = False) -> None:
    """One replicate's recovery (resumed from its last checkpoint, under the run seed + replicate) with the teacher
    answers shared in `answers`, its run also saving a model on reaching each budget of `snapshots` (budget ->
    folder), and keeping the teacher's hidden states in `states` for the arm's other runs (states_folder).
    `reach_budget`: the recipe's train.max_tokens is the point's budget: a run that ends before it is refused."""
    from layerprune.recover.job import RecoverJob

    job = RecoverJob(output=output, settings=replicate_settings(settings, replicate), overwrite=True,
                     resume=True, data_dir=data_dir, snapshots=snapshots, states=states, reach_budget=reach_budget)
    recover_sharing_answers(recipe, job, answers)


def search_lr(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    """The arm's learning-rate grid searched on the model pruned at k = lr_k (cut here if its stage has not run): the
    arm's recipe at each rate in lr_search/ARM/lrI under seed settings.seed + SEARCH_REPLICATE (a held-out split,
    data order and initialisation of its own: no scored replicate is a run the choice was made on, and the search's
    runs are never scored), the lowest held-out loss chosen (lr_search/ARM.json)."""
    k, arm = cell.k, str(cell.arm)
    release_states(study, root)
    if not (model_dir(root, f"pruned-k{k}") / "prune_report.json").is_file():
        prune_at(study, settings, root, k)
    student = str(model_dir(root, f"pruned-k{k}"))

    def train(rate: float, output: Path) -> None:  # with budgets: at the smallest
        recipe = with_budget(with_learning_rate(study.arm_recipe(arm, student), rate), (study.budgets or [None])[0])
        answers = root / study.answers_file(arm, recipe, SEARCH_REPLICATE)
        recover_with_snapshots(recipe, output, answers, settings, SEARCH_REPLICATE, data_dir_of(study), {},
                               states_folder(study, root, arm, search=True), reach_budget=bool(study.budgets))

    record = lr_search.search(root, arm, study.lr_grid[arm], train, k=k, seed_offset=SEARCH_REPLICATE)
    lr_search.write_search(root, record)


def original_copy(study: SweepStudy, settings: RunSettings, root: Path) -> Path:
    """The unpruned original as the control's student: its files linked into `root`/original (pipeline/student.py;
    the recovery refuses a student that is its own teacher)."""
    from layerprune.pipeline.student import original_as_student

    return original_as_student(study.model, settings, root / "original")


def score_grain(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    grain.score_grain(study, settings, root, cell.label)


def plan_cells(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    grain.make_plan(study, settings, root)


def prune_grain(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    grain.prune_cell(study, settings, root, cell.label)


STEPS = {"calibrate": calibrate_probes, "score": score, "gate": gate_gsm8k, "eval": evaluate_model_of,
         "chat": chat_eval, "lr": search_lr, "prune": prune_cut, "recover": recover_at, "report": write_reports,
         "score-grain": score_grain, "plan": plan_cells, "prune-grain": prune_grain}
