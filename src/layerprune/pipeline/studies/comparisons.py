"""Comparisons a study recipe declares (issue 56): named contrasts grouped in families, each drawn with its paired
interval (two-level over runs and items where there are replicates) and its Holm interval over exactly its family.

A contrast is one statistic of a recovered point (arm `a` at k = `at`) minus the same statistic of another (arm `b`,
default `a`, at `b_at`, default `at`): arm against arm at a k, k against k for an arm; with neither `b` nor `b_at`, the
statistic itself against 0. Its `measure`: the recovered share (recovered - pruned) / (original - pruned), net of the
arm's own k = 0 control with `net_of_control`; the recovered score (net of the control: minus the control's change);
the chance-normalised retention; paper B's retention gap (classification - generative retention after recovery).
A family marked `exploratory` was declared after the results were read, and every report says so beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from layerprune.core import paired
from layerprune.core.paired import format_interval
from layerprune.pipeline.paired_table import Figures

Measure = Literal["share", "score", "retention", "gap"]
Kind = Literal["classification", "generative"]
NO_ARMS = "recovered"  # the one recovery of a sweep without arms, as a contrast names it
EXPLORATORY = "exploratory (declared after the results were read)"
NAMES = {"share": "recovered share", "score": "recovered score", "retention": "retention after recovery "
         "(chance-norm.)", "gap": "retention gap after recovery (classification - generative, chance-norm.)"}


class Contrast(BaseModel):
    """One declared comparison: a statistic of arm `a` at k = `at` minus that of arm `b` at `b_at` (or against 0)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, description="Its name in the report (default: drawn from the rest)")
    a: str = Field(description="The arm whose recovered point is the first side")
    at: int = Field(description="The k of the first side (one of ratios)")
    b: str | None = Field(None, description="The arm of the second side (default: a; with neither b nor b_at the "
                          "statistic is compared with 0)")
    b_at: int | None = Field(None, description="The k of the second side (default: at)")
    measure: Measure = Field("share", description="share (recovered share of the drop), score (recovered score), "
                             "retention (chance-normalised, after recovery) or gap (classification - generative "
                             "retention after recovery: paper B's retention gap)")
    kind: Kind = Field("generative", description="The kind of task the measure is taken on (gap takes both)")
    net_of_control: bool = Field(False, description="share or score net of each side's own k = 0 control (the same "
                                 "recovery of the unpruned original)")

    @model_validator(mode="after")
    def _one_contrast(self) -> Contrast:
        if self.net_of_control and self.measure not in ("share", "score"):
            raise ValueError(f"net_of_control applies to share and score, not {self.measure}")
        if (self.b or self.a, self.b_at or self.at) == (self.a, self.at) and not self.against_zero:
            raise ValueError(f"{self.label}: compares {self.a} at k = {self.at} with itself")
        return self

    @property
    def against_zero(self) -> bool:
        """Whether the statistic itself is compared with 0 (no second side)."""
        return self.b is None and self.b_at is None

    @property
    def sides(self) -> list[tuple[str, int]]:
        """(arm, k) of each side: one, or two."""
        return [(self.a, self.at)] + ([] if self.against_zero else [(self.b or self.a, self.b_at or self.at)])

    @property
    def label(self) -> str:
        """Its name, or one drawn from its sides and measure: 'kd-k2-vs-sft-k2-share'."""
        net = "-net" if self.net_of_control else ""
        return self.name or "-vs-".join(f"{arm}-k{k}" for arm, k in self.sides) + f"-{self.measure}{net}"


class ComparisonFamily(BaseModel):
    """Contrasts tested together: Holm over exactly these; a list of contrasts alone is a confirmatory family."""

    model_config = ConfigDict(extra="forbid")

    exploratory: bool = Field(False, description="Declared after the results were read: reported as exploratory")
    contrasts: list[Contrast] = Field(min_length=1, description="The family's contrasts")

    @model_validator(mode="before")
    @classmethod
    def _a_list_is_a_family(cls, value: Any) -> Any:
        return {"contrasts": value} if isinstance(value, list) else value


def check_comparisons(families: dict[str, ComparisonFamily], arms: list[str] | None, ratios: list[int],
                      controlled: Callable[[str | None], bool]) -> None:
    """Raise ValueError (one line) for a contrast naming an arm or k not in the grid, a duplicate name, or a net of a
    control an arm does not have. `controlled(arm)`: whether the arm (None: the one recovery) has its k = 0 control."""
    names = list(arms) if arms else [NO_ARMS]
    seen: set[str] = set()
    for family, declared in families.items():
        for contrast in declared.contrasts:
            where = f"comparisons.{family}.{contrast.label}"
            if contrast.label in seen:
                raise ValueError(f"{where}: a duplicate name (every contrast's name is unique across the families)")
            seen.add(contrast.label)
            for arm, k in contrast.sides:
                if arm not in names:
                    raise ValueError(f"{where}: arm '{arm}' is not in arms ({', '.join(names)})")
                if k not in ratios:
                    raise ValueError(f"{where}: k = {k} is not in ratios ({', '.join(map(str, ratios))})")
                if contrast.net_of_control and not controlled(None if arm == NO_ARMS else arm):
                    raise ValueError(f"{where}: net_of_control, but arm '{arm}' has no k = 0 control")


def uses_default_family(families: dict[str, ComparisonFamily]) -> bool:
    """Whether the report draws today's family (every pair of arms at every k): no confirmatory family is declared."""
    return all(family.exploratory for family in families.values())


def draw_families(families: dict[str, ComparisonFamily], figures: Figures,
                  label: Callable[[str | None, int], str]) -> dict[str, dict[str, Any]]:
    """Every declared family: each contrast's paired interval (or why it cannot be stated) and its Holm interval over
    exactly its family (`Figures.family`: one that cannot be stated counts in it, never declared). `label(arm, k)`:
    the logical label of a recovered point."""
    out = {}
    for name, family in families.items():
        rows, statistics = [], {}
        for contrast in family.contrasts:
            stat, why = _statistic(contrast, figures, label)
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


def _statistic(contrast: Contrast, figures: Figures,
               label: Callable[[str | None, int], str]) -> tuple[Callable[[np.ndarray], Any] | None, str]:
    """(the contrast's statistic, '') or (None, why it cannot be stated)."""
    sides = [(None if arm == NO_ARMS else arm, k) for arm, k in contrast.sides]
    kinds = ("classification", "generative") if contrast.measure == "gap" else (contrast.kind,)
    missing = [kind for kind in kinds if not figures.has(kind)]
    if missing:
        return None, f"n/a ({' and '.join(missing)} not scored)"
    needed = [label(arm, k) for arm, k in sides] + [label(arm, 0) for arm, _ in sides if contrast.net_of_control]
    absent = [m for m in needed if m not in figures.labels]
    if absent:
        return None, f"n/a ({', '.join(absent)} not scored)"
    if contrast.measure == "share":
        for _, k in sides:
            state = paired.share_state(figures.difference("baseline", f"pruned-k{k}", contrast.kind))
            if state is not None:
                return None, state
    one = [_measure(contrast, figures, label(arm, k), k, label(arm, 0)) for arm, k in sides]
    return (one[0] if len(one) == 1 else lambda m: one[0](m) - one[1](m)), ""


def _measure(contrast: Contrast, figures: Figures, rec: str, k: int,
             control: str) -> Callable[[np.ndarray], np.ndarray]:
    """The statistic of one side (task means -> values)."""
    kind, net = contrast.kind, contrast.net_of_control

    def change(m: np.ndarray) -> Any:
        return figures.mean(m, control, kind) - figures.mean(m, "baseline", kind) if net else 0.0

    if contrast.measure == "share":
        return lambda m: paired.share(figures.mean(m, "baseline", kind), figures.mean(m, f"pruned-k{k}", kind),
                                      figures.mean(m, rec, kind) - change(m))
    if contrast.measure == "score":
        return lambda m: figures.mean(m, rec, kind) - change(m)
    if contrast.measure == "retention":
        return lambda m: figures.retention(rec, kind, m)
    return lambda m: figures.retention(rec, "classification", m) - figures.retention(rec, "generative", m)


def format_families(drawn: dict[str, dict[str, Any]], replicates: int) -> list[str]:
    """One paragraph per declared family: its size, whether exploratory, and one line per contrast with its paired
    interval and its Holm interval; 'differ' is said only where the Holm interval excludes 0."""
    runs = ("two-level over runs and items" if replicates > 1 else "one replicate: item sampling only")
    lines: list[str] = []
    for name, family in drawn.items():
        flag = f", {EXPLORATORY}" if family["exploratory"] else ""
        size = f"{family['size']} contrast{'s' if family['size'] != 1 else ''}"
        lines += [f"Declared comparisons, family {name} ({size}{flag}; 95% paired intervals, "
                  f"{runs}; Holm over exactly these {family['size']}, and a difference is said only where its Holm "
                  "interval excludes 0):", ""]
        lines += [_contrast_line(row) for row in family["contrasts"]] + [""]
    return lines


def _contrast_line(row: dict[str, Any]) -> str:
    sides = [(row["a"], row["at"])] + ([] if row["b"] is None and row["b_at"] is None else
                                       [(row["b"] or row["a"], row["b_at"] or row["at"])])
    what = " - ".join(f"{arm} at k = {k}" for arm, k in sides)
    measure = NAMES[row["measure"]] + (" net of the k = 0 control" if row["net_of_control"] else "")
    kind = "" if row["measure"] == "gap" else f", {row['kind']}"
    ci = row["interval"]
    value = f"{_signed(ci)}, {row['status']}" if isinstance(ci, dict) else ci
    return f"- {row['name']}: {what}{kind}, {measure}: {value}{_holm(row['holm'], len(sides) == 1)}"


def _holm(ci: dict[str, Any] | None, against_zero: bool) -> str:
    if not ci or ci.get("low") is None:
        return ""
    said = ("differs from 0 (Holm)" if against_zero else "differ (Holm)") if ci.get("declared") else (
        "not shown to differ from 0" if against_zero else "not shown to differ")
    return f" (Holm {100 * ci['level']:.1f}% over {ci['family']}: {_signed(ci)}, {said})"


def _signed(ci: dict[str, Any]) -> str:
    text = format_interval(ci, missing="undefined")
    return f"+{text}" if (ci.get("value") or 0) > 0 else text
