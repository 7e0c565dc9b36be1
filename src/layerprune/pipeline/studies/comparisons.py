"""Comparisons a study recipe declares (issue 56): named contrasts grouped in families, each drawn with its paired
interval (two-level over runs and items where there are replicates) and its Holm interval over exactly its family.

A contrast is one statistic of a recovered point (arm `a` at k = `at`) minus the same statistic of another (arm `b`,
default `a`, at `b_at`, default `at`): arm against arm at a k, k against k for an arm; with neither `b` nor `b_at`, the
statistic itself against 0. Its `measure`: the recovered share (recovered - pruned) / (original - pruned), net of the
arm's own k = 0 control with `net_of_control`; the recovered score (net of the control: minus the control's change);
the chance-normalised retention; paper B's retention gap (classification - generative retention after recovery).
A family marked `exploratory` was declared after the results were read, and every report says so beside it.

A contrast that names a `task` or a budget (`budget`, `b_budget`: a sweep with budgets, issue 58) is a budget contrast:
its sides are recovered points at those budgets, its statistic taken on that one task; a family of them (its contrasts
all budget contrasts, or none) is drawn in budget.md, never in sweep.md, and does not stand in for the sweep's default
family there.

A recovery study is a sweep of one k (issue 56): its contrasts name that k (`at`), as any sweep's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from layerprune.core import paired
from layerprune.core.paired import format_signed
from layerprune.pipeline.paired_table import Figures

Measure = Literal["share", "score", "retention", "gap"]
Kind = Literal["classification", "generative", "trained", "unseen"]
NO_ARMS = "recovered"  # the one recovery of a sweep without arms, as a contrast names it
EXPLORATORY = "exploratory (declared after the results were read)"
NAMES = {"share": "recovered share", "score": "recovered score", "retention": "retention after recovery "
         "(chance-norm.)", "gap": "retention gap after recovery (classification - generative, chance-norm.)"}


class Contrast(BaseModel):
    """One declared comparison: a statistic of arm `a` at k = `at` minus that of arm `b` at `b_at` (or against 0)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, description="Its name in the report (default: drawn from the rest)")
    a: str = Field(description="The arm whose recovered point is the first side")
    at: int | None = Field(None, description="The k of the first side (one of ratios; a sweep's contrast needs it: "
                           "a sweep of one k, a recovery study, names that k)")
    b: str | None = Field(None, description="The arm of the second side (default: a; with neither b nor b_at the "
                          "statistic is compared with 0)")
    b_at: int | None = Field(None, description="The k of the second side (default: at)")
    measure: Measure = Field("share", description="share (recovered share of the drop), score (recovered score), "
                             "retention (chance-normalised, after recovery) or gap (classification - generative "
                             "retention after recovery: paper B's retention gap)")
    kind: Kind = Field("generative", description="The kind of task the measure is taken on (gap takes both): "
                       "generative or classification; trained or unseen: the generative tasks whose own prompts "
                       "the recovery data held, or the others (a task-aligned recovery)")
    net_of_control: bool = Field(False, description="share or score net of each side's own k = 0 control (the same "
                                 "recovery of the unpruned original)")
    task: str | None = Field(None, min_length=1, description="One task to take the measure on instead of kind's group "
                             "(a budget contrast: drawn in budget.md)")
    budget: int | None = Field(None, ge=1, description="The first side's budget in unpadded target tokens (one of "
                               "budgets; default: the largest, the recovered point itself; a budget contrast)")
    b_budget: int | None = Field(None, ge=1, description="The second side's budget (default: budget; with neither b, "
                                 "b_at nor b_budget the statistic is compared with 0)")

    @model_validator(mode="after")
    def _one_contrast(self) -> Contrast:
        if self.net_of_control and self.measure not in ("share", "score"):
            raise ValueError(f"net_of_control applies to share and score, not {self.measure}")
        if self.task is not None and self.measure == "gap":
            raise ValueError(f"{self.label}: gap takes both kinds of task, not one task ({self.task})")
        if len(set(self.points)) == 1 and not self.against_zero:
            at = "" if self.at is None else f" at k = {self.at}"
            raise ValueError(f"{self.label}: compares {self.a}{at} with itself")
        return self

    @property
    def against_zero(self) -> bool:
        """Whether the statistic itself is compared with 0 (no second side)."""
        return self.b is None and self.b_at is None and self.b_budget is None

    @property
    def for_budget(self) -> bool:
        """Whether it is a budget contrast (names a task or a budget): drawn in budget.md."""
        return self.task is not None or self.budget is not None or self.b_budget is not None

    @property
    def points(self) -> list[tuple[str, int | None, int | None]]:
        """(arm, k, budget; None: the largest) of each side: one, or two."""
        second = [] if self.against_zero else [(self.b or self.a, self.b_at or self.at, self.b_budget or self.budget)]
        return [(self.a, self.at, self.budget), *second]

    @property
    def sides(self) -> list[tuple[str, int | None]]:
        """(arm, k) of each side: one, or two."""
        return [(self.a, self.at)] + ([] if self.against_zero else [(self.b or self.a, self.b_at or self.at)])

    @property
    def label(self) -> str:
        """Its name, or one drawn from its sides and measure: 'kd-k2-vs-sft-k2-share'."""
        net = "-net" if self.net_of_control else ""
        task = f"-{self.task}" if self.task else ""
        return self.name or "-vs-".join(arm + ("" if k is None else f"-k{k}") + (f"@{b}" if b else "")
                                        for arm, k, b in self.points) \
            + f"-{self.measure}{net}{task}"


class ComparisonFamily(BaseModel):
    """Contrasts tested together: Holm over exactly these; a list of contrasts alone is a confirmatory family."""

    model_config = ConfigDict(extra="forbid")

    exploratory: bool = Field(False, description="Declared after the results were read: reported as exploratory")
    contrasts: list[Contrast] = Field(min_length=1, description="The family's contrasts")

    @model_validator(mode="before")
    @classmethod
    def _a_list_is_a_family(cls, value: Any) -> Any:
        return {"contrasts": value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _one_report(self) -> ComparisonFamily:
        if len({c.for_budget for c in self.contrasts}) > 1:
            raise ValueError("a family's contrasts either all name a task or a budget (budget.md's) or none do "
                             "(sweep.md's)")
        return self

    @property
    def for_budget(self) -> bool:
        """Whether its contrasts are budget contrasts (`Contrast.for_budget`): drawn in budget.md, not sweep.md."""
        return self.contrasts[0].for_budget


def check_comparisons(families: dict[str, ComparisonFamily], arms: list[str] | None, ratios: list[int],
                      controlled: Callable[[str | None], bool]) -> None:
    """Raise ValueError (one line) for a contrast naming an arm or k not in the grid, a duplicate name, or a net of a
    control an arm does not have. `controlled(arm)`: whether the arm (None: the one recovery) has its k = 0 control."""
    names = list(arms) if arms else [NO_ARMS]
    for where, contrast in _named(families):
        if contrast.at is None:
            raise ValueError(f"{where}: name the k of the first side (at: one of ratios)")
        for arm, k in contrast.sides:
            if arm not in names:
                raise ValueError(f"{where}: arm '{arm}' is not in arms ({', '.join(names)})")
            if k not in ratios:
                raise ValueError(f"{where}: k = {k} is not in ratios ({', '.join(map(str, ratios))})")
            if contrast.net_of_control and not controlled(None if arm == NO_ARMS else arm):
                raise ValueError(f"{where}: net_of_control, but arm '{arm}' has no k = 0 control")


def _named(families: dict[str, ComparisonFamily]) -> list[tuple[str, Contrast]]:
    """('comparisons.FAMILY.NAME', contrast) for every contrast; ValueError for a name used twice."""
    out: list[tuple[str, Contrast]] = []
    seen: set[str] = set()
    for family, declared in families.items():
        for contrast in declared.contrasts:
            where = f"comparisons.{family}.{contrast.label}"
            if contrast.label in seen:
                raise ValueError(f"{where}: a duplicate name (every contrast's name is unique across the families)")
            seen.add(contrast.label)
            out.append((where, contrast))
    return out


def check_budget_contrasts(families: dict[str, ComparisonFamily], budgets: list[int] | None,
                           budgets_of: Callable[[str | None], list[int]] | None = None) -> None:
    """Raise ValueError (one line) for a budget contrast naming a budget not in `budgets`, or any, without them; with
    `budgets_of(arm)`, a side's budget must be one of its arm's own (arm_budgets), and two arms whose largest budgets
    differ (an arm of arm_budgets against one of budgets) are compared at a budget the contrast names, never each at
    its own largest."""
    for family, declared in families.items():
        for contrast in declared.contrasts:
            where = f"comparisons.{family}.{contrast.label}"
            for arm, _, budget in contrast.points:
                own = budgets or [] if budgets_of is None else budgets_of(None if arm == NO_ARMS else arm)
                if budget is not None and budget not in own:
                    whose = "budgets" if own == (budgets or []) else f"{arm}'s budgets"
                    raise ValueError(f"{where}: budget {budget} is not one of {whose} "
                                     f"({', '.join(map(str, own)) or 'none declared'})")
            if budgets and budgets_of is not None and len({arm for arm, _, _ in contrast.points}) == 2 \
                    and any(budget is None for *_, budget in contrast.points):
                owns = [budgets_of(None if arm == NO_ARMS else arm) for arm, _, _ in contrast.points]
                ends = [budget or own[-1] for (*_, budget), own in zip(contrast.points, owns, strict=True)]
                if ends[0] != ends[1]:
                    both = sorted(set(owns[0]) & set(owns[1]))
                    raise ValueError(f"{where}: {contrast.points[0][0]} ends at {ends[0]} target tokens and "
                                     f"{contrast.points[1][0]} at {ends[1]}: name the budget they are compared at "
                                     f"(budget: {both[-1] if both else 'one both have'}; b_budget alone names the "
                                     "second side's)")


def uses_default_family(families: dict[str, ComparisonFamily], budget: bool = False) -> bool:
    """Whether the report draws its default family (sweep.md: every pair of arms at every k; budget.md with `budget`:
    budget_report's): no confirmatory family of that report is declared."""
    return all(family.exploratory for family in families.values() if family.for_budget == budget)


def sweep_pruned(k: int | None) -> str:
    """A sweep's label of the model pruned at k."""
    return f"pruned-k{k}"


def draw_families(families: dict[str, ComparisonFamily], figures: Figures, label: Callable[[str | None, int], str],
                  at_budget: Callable[[str | None, int, int], str] | None = None,
                  pruned: Callable[[int | None], str] = sweep_pruned) -> dict[str, dict[str, Any]]:
    """Every declared family of one report: each contrast's paired interval (or why it cannot be stated) and its Holm
    interval over exactly its family (`Figures.family`: one that cannot be stated counts in it, never declared).
    `label(arm, k)`: the logical label of a recovered point; `at_budget(arm, k, budget)`: its label at a budget below
    the largest. Without `at_budget` the families of sweep.md (no budget contrasts); with it, budget.md's.
    `pruned(k)`: the label of the model pruned at k; label(arm, 0) is the arm's k = 0 control."""
    out = {}
    for name, family in families.items():
        if family.for_budget != (at_budget is not None):
            continue
        rows, statistics = [], {}
        for contrast in family.contrasts:
            stat, why = _statistic(contrast, figures, _point_label(label, at_budget), pruned)
            statistics[contrast.label] = stat
            ci = figures.interval(stat) if stat is not None else why
            rows.append({**contrast.model_dump(mode="json"), "name": contrast.label, "interval": ci,
                         "status": _side(ci)})
        for row, holm in zip(rows, figures.family(statistics).values(), strict=True):
            row["holm"] = holm
        out[name] = {"exploratory": family.exploratory, "size": len(rows), "contrasts": rows}
    return out


def _side(ci: Any) -> str:
    if not isinstance(ci, dict) or ci.get("low") is None:
        return "not shown"
    return "above 0" if ci["low"] > 0 else "below 0" if ci["high"] < 0 else "holds 0"


PointLabel = Callable[[str | None, int, int | None], str]  # (arm, k, budget; None: the largest) -> logical label


def _point_label(label: Callable[[str | None, int], str],
                 at_budget: Callable[[str | None, int, int], str] | None) -> PointLabel:
    """label(arm, k, budget): the recovered point's logical label (budget None: the largest, the point itself)."""

    def point(arm: str | None, k: int, budget: int | None) -> str:
        return label(arm, k) if budget is None or at_budget is None else at_budget(arm, k, budget)

    return point


def _statistic(contrast: Contrast, figures: Figures, label: PointLabel,
               pruned: Callable[[int | None], str]) -> tuple[Callable[[np.ndarray], Any] | None, str]:
    """(the contrast's statistic, '') or (None, why it cannot be stated)."""
    sides = [(None if arm == NO_ARMS else arm, k, budget) for arm, k, budget in contrast.points]
    kinds = ("classification", "generative") if contrast.measure == "gap" else (contrast.task or contrast.kind,)
    missing = [kind for kind in kinds if not figures.has(kind)]
    if missing:
        return None, f"n/a ({' and '.join(missing)} not scored)"
    if contrast.net_of_control and any(budget is not None for *_, budget in sides):
        return None, "n/a (the k = 0 control trains to the largest budget only)"
    needed = [*(label(arm, k, b) for arm, k, b in sides),
              *(["baseline"] if contrast.measure != "score" or contrast.net_of_control else []),
              *(label(arm, 0, None) for arm, _, _ in sides if contrast.net_of_control),
              *(pruned(k) for _, k, _ in sides if contrast.measure == "share")]
    absent = [m for m in dict.fromkeys(needed) if m not in figures.labels]
    if absent:
        return None, f"n/a ({', '.join(absent)} not scored)"
    points = [label(arm, k, b) for arm, k, b in sides]
    if len(sides) == 2 and sides[0][:2] == sides[1][:2] and len({figures.seeds(p) for p in points}) > 1:
        return None, f"n/a ({' and '.join(points)} not scored on the same replicates yet)"  # one run's checkpoints
    if contrast.measure == "share":
        for _, k, _ in sides:
            state = paired.share_state(figures.difference("baseline", pruned(k), kinds[0]))
            if state is not None:
                return None, state
    one = [_measure(contrast, figures, label(arm, k, b), pruned(k), label(arm, 0, None)) for arm, k, b in sides]
    return (one[0] if len(one) == 1 else lambda m: one[0](m) - one[1](m)), ""


def _measure(contrast: Contrast, figures: Figures, rec: str, cut: str,
             control: str) -> Callable[[np.ndarray], np.ndarray]:
    """The statistic of one side (task means -> values)."""
    kind, net = contrast.task or contrast.kind, contrast.net_of_control

    def change(m: np.ndarray) -> Any:
        return figures.mean(m, control, kind) - figures.mean(m, "baseline", kind) if net else 0.0

    if contrast.measure == "share":
        return lambda m: paired.share(figures.mean(m, "baseline", kind), figures.mean(m, cut, kind),
                                      figures.mean(m, rec, kind) - change(m))
    if contrast.measure == "score":
        return lambda m: figures.mean(m, rec, kind) - change(m)
    if contrast.measure == "retention":
        return lambda m: figures.retention(rec, kind, m)
    return lambda m: figures.retention(rec, "classification", m) - figures.retention(rec, "generative", m)


def format_families(drawn: dict[str, dict[str, Any]], replicates: int, declared: bool = True,
                    kinds: dict[str, str] | None = None) -> list[str]:
    """One paragraph per family: its size, whether exploratory, and one line per contrast with its paired interval
    and its Holm interval; 'differ' is said only where the Holm interval excludes 0. `declared`: False for a report's
    default family (the recipe declares none). `kinds`: how the report names a kind ('probe average'), where not
    by itself."""
    runs = ("two-level over runs and items" if replicates > 1 else "one replicate: item sampling only")
    lines: list[str] = []
    for name, family in drawn.items():
        flag = f", {EXPLORATORY}" if family["exploratory"] else ""
        size = f"{family['size']} contrast{'s' if family['size'] != 1 else ''}"
        lines += [f"{'Declared' if declared else 'Default'} comparisons, family {name} ({size}{flag}; 95% paired "
                  "intervals, "
                  f"{runs}; Holm over exactly these {family['size']}, and a difference is said only where its Holm "
                  "interval excludes 0):", ""]
        lines += [_contrast_line(row, kinds or {}) for row in family["contrasts"]] + [""]
    return lines


def _contrast_line(row: dict[str, Any], kinds: dict[str, str]) -> str:
    budget, b_budget = row.get("budget"), row.get("b_budget")
    second = row["b"] is None and row["b_at"] is None and b_budget is None
    sides = [(row["a"], row["at"], budget)] + ([] if second else
                                               [(row["b"] or row["a"], row["b_at"] or row["at"], b_budget or budget)])
    largest = " and the largest budget" if budget or b_budget or row.get("task") else ""  # a budget contrast
    what = " - ".join(arm + ("" if k is None else f" at k = {k}") + (f" and {b} tokens" if b else largest)
                      for arm, k, b in sides)
    measure = NAMES[row["measure"]] + (" net of the k = 0 control" if row["net_of_control"] else "")
    kind = "" if row["measure"] == "gap" else f", {row.get('task') or kinds.get(row['kind'], row['kind'])}"
    ci = row["interval"]
    value = f"{format_signed(ci)}, {row['status']}" if isinstance(ci, dict) else ci
    return f"- {row['name']}: {what}{kind}, {measure}: {value}{_holm(row['holm'], len(sides) == 1)}"


def _holm(ci: dict[str, Any] | None, against_zero: bool) -> str:
    if not ci or ci.get("low") is None:
        return ""
    said = ("differs from 0 (Holm)" if against_zero else "differ (Holm)") if ci.get("declared") else (
        "not shown to differ from 0" if against_zero else "not shown to differ")
    return f" (Holm {100 * ci['level']:.1f}% over {ci['family']}: {format_signed(ci)}, {said})"
