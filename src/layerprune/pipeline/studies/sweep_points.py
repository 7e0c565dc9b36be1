"""The figures of a sweep's report (sweep_report.py): per k (and arm) the scores, drop, chance-normalised retention
and recovered share with their paired intervals, the k = 0 control, the run-to-run spread, the verdicts computed from
the intervals, and the arms compared pairwise.

Every model answered the same items, so one clustered paired bootstrap (items drawn within each task, the same draw for
every model) gives every figure its interval: drops, chance-normalised retention (model - chance) / (original -
chance), the recovered share (recovered - pruned) / (original - pruned), and the differences the verdicts test.

With arms (several recoveries of every k), every figure is given per arm (a point carries its `arm`), the verdicts
per arm, and every pair of arms is compared at every k: the paired difference of their recovered shares and of their
recovered scores, two-level over runs and items where there are replicates, each also with its Holm interval over its
family (every pair of arms at every k and kind, in one format: the shares one family, the scores another); two arms
are said to differ only where that family-wise interval excludes 0. A share is stated only where the drop's interval
stays `paired.SHARE_MARGIN` above 0 (else 'unbounded'). The statistics are all core/paired.py's.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import numpy as np

from layerprune.core import paired
from layerprune.core.paired import NO_CLEAR_DROP, format_interval
from layerprune.pipeline.paired_table import Figures
from layerprune.pipeline.studies.figures import KINDS, SPLIT
from layerprune.pipeline.studies.sweep_grid import recovered_label


def kinds_of(figures: Figures) -> list[str]:
    """The groups a point is given: the kinds, then the trained / unseen split where the report has it."""
    return [kind for kind in (*KINDS, *SPLIT) if figures.has(kind)]
CONTROL = "recovered-k0"  # the k = 0 control: the same recovery of the unpruned original (ARM-k0 with arms)


def point(study: Any, figures: Figures, k: int, arm: str | None = None, models: str = "") -> dict[str, Any]:
    """One k of the sweep (of one arm's recovery: the point carries `arm`): per kind the scores, drop,
    chance-normalised retention, recovered share (and, with the k = 0 control, the share net of the control's own
    change), the across-run spread; and the gap. `models`: the prefix of the original's and pruned models' labels
    the arm is measured against (sweeps joined with their own models: NAME:)."""
    out: dict[str, Any] = {"k": k, **({"arm": arm} if arm is not None else {})}
    control = recovered_label(arm, 0) in figures.labels
    rec, base, pruned = recovered_label(arm, k), f"{models}baseline", f"{models}pruned-k{k}"
    for kind in kinds_of(figures):
        row = {"baseline": figures.score(base, kind), "pruned": figures.score(pruned, kind),
               "drop": figures.difference(base, pruned, kind)}
        row["retention_pruned"] = figures.interval(lambda m, kind=kind: figures.retention(pruned, kind, m, base))
        if rec in figures.labels:
            row["recovered"] = figures.score(rec, kind)
            row["retention_recovered"] = figures.interval(lambda m, kind=kind: figures.retention(rec, kind, m, base))
            state = paired.share_state(row["drop"])  # None: the drop is bounded away from 0, a share can be stated
            row["recovered_share"] = figures.interval(
                lambda m, kind=kind: _share(figures, k, kind, m, arm, models)) if state is None else state
            if control:
                row["recovered_share_net"] = figures.interval(
                    lambda m, kind=kind: _net_share(figures, k, kind, m, arm, models)) if state is None else state
            row["gain"] = figures.difference(rec, pruned, kind)
            row["spread"] = spread(figures, rec, kind)
        out[kind] = row
    if all(figures.has(kind) for kind in KINDS) and rec in figures.labels:
        out["gap_recovered"] = figures.interval(
            lambda m: figures.retention(rec, "classification", m, base) - figures.retention(rec, "generative", m, base))
    out["costs"] = any(_above(out.get(kind, {}).get("drop")) for kind in KINDS)
    return out


def control_point(figures: Figures, arm: str | None = None, models: str = "") -> dict[str, Any] | None:
    """The k = 0 control (of `arm`) per kind: the original (labelled `models`baseline), the original after the same
    recovery, the change (control - baseline) and the across-run spread; None without a control."""
    control, base = recovered_label(arm, 0), f"{models}baseline"
    if control not in figures.labels:
        return None
    return {kind: {"baseline": figures.score(base, kind), "control": figures.score(control, kind),
                   "change": figures.difference(control, base, kind), "spread": spread(figures, control, kind)}
            for kind in kinds_of(figures)}


def spread(figures: Figures, label: str, group: str) -> dict[str, Any]:
    """Across-run SD of a recovered point's group score over its replicates (None with one replicate) beside the
    item-sampling SE."""
    return dict(figures.spread(label, group))


def _above(ci: dict[str, Any] | None) -> bool:
    return bool(ci and ci.get("low") is not None and ci["low"] > 0)


def shown(ci: dict[str, Any] | None) -> str:
    """What an interval shows about 'above 0': shown (all above), contradicted (all below) or not shown (it holds 0,
    or there is none)."""
    if not ci or ci.get("low") is None:
        return "not shown"
    return "shown" if ci["low"] > 0 else "contradicted" if ci["high"] < 0 else "not shown"


def verdicts(study: Any, figures: Figures, points: list[dict[str, Any]],
             arm: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """(a) per k: after recovery, classification retention above generative, the gap's interval above 0 (shown),
    below (contradicted) or holding 0 (not shown); (b) as written, the recovered share of the generative drop at the
    smallest k with a clear generative drop against the largest (also net of the k = 0 control when there is one),
    and as retention, generative retention after recovery at the smallest against the largest k. Said with the
    numbers either way. With arms: `points` and the verdicts are one arm's. One k (a recovery study): (b), a k
    against another, does not apply and is left out."""
    lines, tests = _verdict_a(points)
    if study is not None and len(study.ratios) < 2:
        return lines, tests
    b_lines, b_tests = _verdict_b(figures, points, arm)
    return lines + b_lines, {**tests, **b_tests}


def _verdict_a(points: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    tested = [p for p in points if "gap_recovered" in p]
    if not tested:
        return ["(a) cannot be tested: no recovered model, or a kind was not scored."], {}
    per_k = {p["k"]: {"status": shown(p["gap_recovered"]), "gap": p["gap_recovered"], "costs": p["costs"]}
             for p in tested}
    by = {s: [k for k, v in per_k.items() if v["status"] == s] for s in ("shown", "not shown", "contradicted")}
    costly = [k for k, v in per_k.items() if v["costs"]]
    holds = bool(costly) and all(per_k[k]["status"] == "shown" for k in costly)
    summary = ("shown at every k where pruning costs something" if holds else
               "; ".join(f"{s} at k = {', '.join(map(str, ks))}" for s, ks in by.items() if ks))
    detail = "; ".join(f"k={k}: {v['status']}, {ci_pct(v['gap'])}" + ("" if v["costs"] else " (no clear drop)")
                       for k, v in per_k.items())
    line = (f"(a) After recovery, classification keeps more of its margin above chance than generative reasoning: "
            f"{summary} (gap in chance-normalised retention, classification - generative, 95% paired interval, per "
            f"k: {detail}). Shown: the interval is above 0; not shown: it holds 0; contradicted: it is below 0.")
    return [line], {"a": {"holds": holds, "per_k": per_k, "shown_at": by["shown"], "not_shown_at": by["not shown"],
                          "contradicted_at": by["contradicted"], "ks": costly}}


def _verdict_b(figures: Figures, points: list[dict[str, Any]],
               arm: str | None = None) -> tuple[list[str], dict[str, Any]]:
    lines, tests = [], {}
    clear = [p["k"] for p in points if isinstance(p.get("generative", {}).get("recovered_share"), dict)]
    if len(clear) >= 2:
        small, large = clear[0], clear[-1]
        for key, share, name in (("b", _share, "recovered share"), ("b_net", _net_share, "recovered share net of the "
                                                                                         "k = 0 control")):
            field = "recovered_share" if key == "b" else "recovered_share_net"
            if field not in _point(points, small, arm)["generative"]:
                continue
            diff = figures.interval(lambda m, share=share: share(figures, small, "generative", m, arm)
                                    - share(figures, large, "generative", m, arm))
            status = shown(diff)
            lines.append(f"({key.replace('_net', ', net of the control')}) The {name} of the generative drop is "
                         f"larger at k={small} than at k={large}: {status} (shares "
                         f"{share_pct(_point(points, small, arm)['generative'][field])} and "
                         f"{share_pct(_point(points, large, arm)['generative'][field])}; difference "
                         f"{share_pct(diff)}).")
            tests[key] = {"holds": status == "shown", "status": status, "small": small, "large": large,
                          "difference": diff}
    else:
        lines.append(f"(b) cannot be tested as a share: the generative drop is clear (interval above 0) at {len(clear)}"
                     f" k ({', '.join(map(str, clear)) or 'none'}), and two are needed.")
    recovered = [p["k"] for p in points if "retention_recovered" in p.get("generative", {})]
    if len(recovered) >= 2:
        small, large = recovered[0], recovered[-1]
        diff = figures.interval(lambda m: figures.retention(recovered_label(arm, small), "generative", m)
                                - figures.retention(recovered_label(arm, large), "generative", m))
        status = shown(diff)
        ret = {k: _point(points, k, arm)["generative"] for k in (small, large)}
        lines.append(f"(b, as retention) Generative retention after recovery is higher at k={small} than at "
                     f"k={large}: {status} ({ci_pct(ret[small]['retention_recovered'])} and "
                     f"{ci_pct(ret[large]['retention_recovered'])}, difference {ci_pct(diff)}; pruned alone "
                     f"{ci_pct(ret[small]['retention_pruned'])} and {ci_pct(ret[large]['retention_pruned'])}).")
        tests["b_retention"] = {"holds": status == "shown", "status": status, "small": small, "large": large,
                                "difference": diff}
    return lines, tests


def _share(figures: Figures, k: int, kind: str, m: np.ndarray, arm: str | None = None,
           models: str = "") -> np.ndarray:
    return figures.share_of(recovered_label(arm, k), f"{models}pruned-k{k}", kind, m, f"{models}baseline")


def _net_share(figures: Figures, k: int, kind: str, m: np.ndarray, arm: str | None = None,
               models: str = "") -> np.ndarray:
    """(recovered - pruned - (control - baseline)) / (baseline - pruned): the share beyond what the recovery does to
    the unpruned original; nan where the drop is not positive."""
    base, pruned = figures.mean(m, f"{models}baseline", kind), figures.mean(m, f"{models}pruned-k{k}", kind)
    change = figures.mean(m, recovered_label(arm, 0), kind) - base
    return paired.share(base, pruned, figures.mean(m, recovered_label(arm, k), kind) - change)


def comparisons(figures: Figures, points: list[dict[str, Any]], arms: list[str],
                models: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every pair of arms (in their order: first - second) at every k both recovered: per kind the paired difference
    of their recovered shares (where the drop is clear) and of their recovered scores, each with its interval
    (two-level over runs and items with replicates) and where it lies against 0. `models`: each arm's prefix of the
    original's and pruned models' labels (sweeps joined with their own models); the shares are then each against
    the arm's own drop, net of each arm's own control where both have one (`share_net_of_controls`). Each difference
    also gets its Holm interval over its family (`share_holm`, `score_holm`: `paired.holm_intervals` over every pair,
    k and kind here; a share difference that cannot be stated counts in its family, never declared)."""
    out: list[dict[str, Any]] = []
    families: dict[str, dict[tuple[int, str], Any]] = {"share": {}, "score": {}}
    for k in dict.fromkeys(p["k"] for p in points):
        for high, low in combinations(arms, 2):
            if not {recovered_label(high, k), recovered_label(low, k)} <= set(figures.labels):
                continue
            row: dict[str, Any] = {"k": k, "arms": [high, low]}
            for kind in (kind for kind in KINDS if figures.has(kind)):
                states = [_point(points, k, arm).get(kind, {}).get("recovered_share") for arm in (high, low)]
                clear = all(isinstance(state, dict) for state in states)
                net = models is not None and clear and all(recovered_label(arm, 0) in figures.labels
                                                           for arm in (high, low))
                gap = _share_difference(figures, k, kind, high, low, models, net)
                share = figures.interval(gap) if clear else next(
                    (state for state in states if isinstance(state, str)), NO_CLEAR_DROP)
                ranks = (recovered_label(high, k), recovered_label(low, k))
                families["share"][(len(out), kind)] = gap if clear else None
                families["score"][(len(out), kind)] = (
                    lambda m, kind=kind, a=ranks: figures.mean(m, a[0], kind) - figures.mean(m, a[1], kind))
                score = figures.difference(*ranks, kind)
                row[kind] = {"share": share, "share_status": shown(share) if clear else "not shown",
                             **({"share_net_of_controls": net} if models is not None else {}),
                             "score": score, "score_status": shown(score)}
            out.append(row)
    for name, family in families.items():
        for (i, kind), ci in figures.family(family).items():
            out[i][kind][f"{name}_holm"] = ci
    return out


def _share_difference(figures: Figures, k: int, kind: str, high: str, low: str,
                      models: dict[str, str] | None = None, net: bool = False) -> Any:
    """The statistic (task means -> values) of high's recovered share minus low's."""
    share, own = (_net_share if net else _share), models or {}
    return lambda m: (share(figures, k, kind, m, high, own.get(high, ""))
                      - share(figures, k, kind, m, low, own.get(low, "")))


def _point(points: list[dict[str, Any]], k: int, arm: str | None = None) -> dict[str, Any]:
    return next(p for p in points if p["k"] == k and p.get("arm") == arm)


def ci_pct(ci: dict[str, Any] | str | None) -> str:
    """An interval in percent ('undefined' where there is none); a state that is text (no clear drop) as it is."""
    return ci if isinstance(ci, str) else format_interval(ci, missing="undefined")


def share_pct(ci: dict[str, Any] | str | None) -> str:
    """A share with its interval and the fraction of resamples on which it is undefined (no drop there)."""
    if not isinstance(ci, dict):
        return ci_pct(ci)
    return f"{ci_pct(ci)} (undefined {100 * (ci.get('undefined') or 0.0):.1f}%)"
