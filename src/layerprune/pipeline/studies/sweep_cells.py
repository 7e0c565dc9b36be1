"""A sweep's stages as data: each a Cell built from the grid (sweep_grid.py), with its output and what its step is
given (label, k, arm, replicate, budget, the budget points its run saves), in the order they run. The runner (sweep.py)
binds each step to its action; the dry run (sweep_plan.py) counts them and reads which are complete. Nothing parses a
stage's name back."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.studies.cells import CALIBRATION_FILE, CHAT_EVAL
from layerprune.pipeline.studies.grain_grid import (
    CONTROL,
    PLAN_FILE,
    cell_levels,
    grain_arm,
    grain_names,
    replicas,
    score_file,
)
from layerprune.pipeline.studies.sweep_grid import (
    DEDICATED,
    SweepStudy,
    arm_names,
    both_formats,
    budget_tag,
    dedicated_points,
    gsm8k_gated,
    has_control,
    point_label,
    trains_each_budget,
)
from layerprune.recover.lr_search import lr_search_file

REPORTED = ".reported"  # written by the report stage after every report of a finished run (study_reports.py)
STATES = "teacher-states"  # the teacher's hidden states a local arm's runs share (sweep.states_folder), a folder a
# cut and seed, each removed once no stage left reads it (sweep.release_states)


@dataclass(frozen=True)
class Cell:
    """One stage of the grid as data: its name, its output (complete when it exists), the step it runs and what that
    step is given. The runner (sweep.py) binds `step` to its action; nothing reads a stage's name back."""

    name: str
    output: Path
    step: str  # calibrate, score, gate, eval, chat, lr, prune, recover, report; with grains score-grain, plan,
    # prune-grain
    label: str = ""  # the model it scores or writes (baseline, pruned-kK, a recovered point's label)
    k: int = 0  # the cut (prune, recover; lr: the k it searches at); 0: the unpruned original
    arm: str | None = None  # the recovery arm (None: a sweep without arms)
    replicate: int = 0
    budget: int | None = None  # the target tokens a recovery trains to (None: its recipe's own budget)
    snapshots: tuple[tuple[int, str], ...] = ()  # (budget, point label): checkpoints a run saves as those points
    model: Path | None = None  # the model the step reads: evaluated, or a recovery's student (None: the original)
    calibration: Path | None = None  # an evaluation's: the pruned folder whose calibration items it records
    cut: int | None = None  # the cut whose stages it is among (in_run_order; 0: the controls'), None: before them


def cells(study: SweepStudy, root: Path) -> list[Cell]:
    """Every stage of the sweep in order, built from the grid: the probe gate, the scoring pass and the GSM8K gate,
    the original's evaluation, each arm's learning-rate search, then every cut and its recoveries and the controls
    (`in_run_order`: by default replicate by replicate, so a study run in parts holds whole replicates of the design
    after each part), and the report."""
    if study.grains is not None:
        return grain_cells(study, root)
    chat, scored = both_formats(study), root / "scored"

    def evals(label: str, replicate: int = 0) -> list[Cell]:
        model = None if label == "baseline" else model_dir(root, label)
        return [Cell(f"eval-{label}", root / "eval" / label / SUMMARY_FILE, "eval", label, replicate=replicate,
                     model=model, calibration=scored),
                *([Cell(CHAT_EVAL + label, root / CHAT_EVAL / label / SUMMARY_FILE, "chat", label,
                        replicate=replicate, model=model, calibration=scored)] if chat else [])]

    def recovery(arm: str | None, k: int, replicate: int, tag: str = "", budget: int | None = None,
                 snapshots: tuple[tuple[int, str], ...] = ()) -> list[Cell]:
        label = point_label(arm, k, replicate, tag)
        student = model_dir(root, f"pruned-k{k}") if k else None
        return [Cell(f"recover-{label.removeprefix('recovered-')}", model_dir(root, label) / "recover_report.json",
                     "recover", label, k, arm, replicate, budget, snapshots, student), *evals(label, replicate)]

    def arm_at(k: int, arm: str | None) -> list[Cell]:  # a checkpoint is scored after the run that saves it
        own = study.budgets_of(arm)
        largest = own[-1] if own else None
        smaller = [] if k == 0 else own[:-1]
        runs = range(study.replicates)
        if trains_each_budget(study, arm):  # local: every budget a run of its own
            return [c for b in smaller for r in runs for c in recovery(arm, k, r, f"@{budget_tag(b)}", b)] + \
                [c for r in runs for c in recovery(arm, k, r, budget=largest)]
        points = {r: tuple((b, point_label(arm, k, r, f"@{budget_tag(b)}")) for b in smaller) for r in runs}
        dedicated = [] if not dedicated_points(study, k, arm) else [
            c for r in runs for c in recovery(arm, k, r, f"@{budget_tag(study.dedicated_at)}{DEDICATED}",
                                              study.dedicated_at)]
        return [*(c for r in runs for c in recovery(arm, k, r, budget=largest, snapshots=points[r])),
                *(c for b in range(len(smaller)) for r in runs for c in evals(points[r][b][1], r)), *dedicated]

    cuts = {k: [Cell(f"prune-k{k}", model_dir(root, f"pruned-k{k}") / "prune_report.json", "prune", f"pruned-k{k}",
                     k), *evals(f"pruned-k{k}"), *(c for a in arm_names(study) for c in arm_at(k, a))]
            for k in study.ratios}
    cuts[0] = [c for arm in arm_names(study) if has_control(study, arm) for c in arm_at(0, arm)]
    first = [*([Cell("calibrate-probes", root / CALIBRATION_FILE, "calibrate")] if study.probes is not None else []),
             *([] if study.given_cut else [Cell("score", root / "scored" / "prune_report.json", "score")]),
             *([Cell("gate-gsm8k", gate_summary(root), "gate")] if gsm8k_gated(study) else [])]
    return [*first, *evals("baseline"),
            *(Cell(f"lr-{arm}", lr_search_file(root, arm), "lr", k=study.lr_k, arm=arm) for arm in study.lr_grid),
            *in_run_order(study, cuts), Cell("report", root / REPORTED, "report")]


def in_run_order(study: SweepStudy, cuts: dict[int, list[Cell]]) -> list[Cell]:
    """Each cut's stages (0: the k = 0 controls') in the order they run: replicate by replicate, each one's cuts in
    `ratios` order and then its controls (a stable sort), or with `run_order` cut by cut, each with every replicate
    before the next (the first cut's comparisons whole before the others start)."""
    tagged = {k: [replace(c, cut=k) for c in group] for k, group in cuts.items()}
    if study.run_order is None:
        return sorted([c for k in [*study.ratios, 0] for c in tagged[k]], key=lambda c: c.replicate)
    return [c for k in study.run_order for c in sorted(tagged[k], key=lambda c: c.replicate)]


def grain_cells(study: SweepStudy, root: Path) -> list[Cell]:
    """A grain study's stages (grain_grid.py): each grain's scoring pass, the plan, every cell's cut, the original's
    evaluation, then replicate by replicate (a stable sort, as a sweep's: a study run in parts holds whole
    replicates after each part) the k = 0 control's recovery and evaluation and, cell by cell, its evaluation before
    recovery (with replicate 0) and its recovery and evaluation; the report (grain.md). An evaluation records the
    calibration items of its cell's pruned model (the original's and the controls': the first cell's)."""
    arm, cuts = grain_arm(study), cell_levels(study)
    first = root / "pruned" / cuts[0][0]

    def evaluation(label: str, model: Path | None, calibration: Path, replicate: int = 0) -> Cell:
        return Cell(f"eval-{label}", root / "eval" / label / SUMMARY_FILE, "eval", label, replicate=replicate,
                    model=model, calibration=calibration)

    def recoveries(logical: str, folder: str, k: int, student: Path | None, calibration: Path) -> list[Cell]:
        return [c for r, label in enumerate(replicas(study, logical)) for c in (
            Cell(f"recover-{label}", root / folder / label / "recover_report.json", "recover", label, k, arm, r,
                 model=student),
            evaluation(label, root / folder / label, calibration, r))]

    return [*(Cell(f"score-{g}", score_file(root, g), "score-grain", g) for g in grain_names(study)),
            Cell("plan", root / PLAN_FILE, "plan"),
            *(Cell(f"prune-{name}", root / "pruned" / name / "prune_report.json", "prune-grain", name, level)
              for name, level in cuts),
            evaluation("baseline", None, first),
            *sorted([*(recoveries(CONTROL, "controls", 0, None, first) if study.controls else []),
                     *(c for name, level in cuts for pruned in [root / "pruned" / name] for c in (
                         evaluation(f"pruned-{name}", pruned, pruned),
                         *recoveries(name, "recovered", level, pruned, pruned)))], key=lambda c: c.replicate),
            Cell("report", root / REPORTED, "report")]


def stage_names(study: SweepStudy) -> list[str]:
    """The stages' names in order (the dry run, progress lines and tests read them)."""
    return [cell.name for cell in cells(study, Path())]


def model_dir(root: Path, label: str) -> Path:
    """The folder of a model the sweep writes: pruned-kK, recovered-kK[...] or ARM-kK[...] (its label)."""
    return root / label


def gate_summary(root: Path) -> Path:
    """The GSM8K gate's scores of the original."""
    return root / "eval" / "gate-gsm8k" / SUMMARY_FILE


@dataclass(frozen=True)
class Disk:
    """What the models a study has still to save take, and the space free where they go."""

    models: int
    need: float  # bytes: each model at its cut's share of the original's weights, in the dtype it is saved in
    free: float  # bytes free on the output's file system

    @property
    def short(self) -> bool:
        """The models left will not fit in the space free."""
        return self.need > self.free

    def line(self) -> str:
        return (f"disk: {self.models} models still to save (cuts, recoveries, budget points, lr candidates): about "
                f"{self.need / 1e9:.1f} GB, a running recovery's work folder (two checkpoints) and local's teacher "
                f"states (one cut and seed's at a time) on top; {self.free / 1e9:.1f} GB free there"
                + (" - not enough: free space or choose another --output" if self.short else ""))


def disk_need(study: SweepStudy, settings: Any, root: Path) -> Disk | None:
    """The models the stages left will save (a prune, a recovery and each budget point it keeps, each lr candidate)
    at the bytes a weight they are saved in (the original's, or the dtype a recovery loads in where wider: float32
    on a CPU) less the blocks cut; None where the original's config cannot be read or sized. Plans only: a variant
    not yet made is sized on its source model (loading.planning)."""
    import shutil

    from layerprune.models.loading import planning
    from layerprune.pipeline.plan import model_config
    from layerprune.recover.memory import model_shape

    try:
        with planning():
            config, _ = model_config(study.model, settings)
        shape = model_shape(config) if config is not None else None
    except Exception:  # advisory: a config this cannot size leaves the line out, never the run
        shape = None
    if shape is None:
        return None
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    saved = 4 if "32" in dtype else 2
    loaded = settings.resolved_dtype().itemsize
    per_block = shape.linear_params / shape.layers
    left = [c for c in cells(study, root) if c.step in ("prune", "recover", "lr") and not c.output.exists()]
    sizes = [((shape.params - c.k * per_block) * (saved if c.step == "prune" else max(saved, loaded)),
              1 + len(c.snapshots) if c.step != "lr" else len(study.lr_grid.get(c.arm or "", []))) for c in left]
    where = next(p for p in (root, *root.parents) if p.exists())
    return Disk(sum(n for _, n in sizes), sum(size * n for size, n in sizes), shutil.disk_usage(where).free)
