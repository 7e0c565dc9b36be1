"""sweep.md of a pruning-ratio sweep: retention against k for classification and generative reasoning, pruned and
recovered, with paired intervals; a table, the loss curves, and verdicts computed from the intervals.

Every model answered the same items, so one clustered paired bootstrap (items drawn within each task, the same draw for
every model) gives every figure its interval: drops, chance-normalised retention (model - chance) / (original -
chance), the recovered share (recovered - pruned) / (original - pruned), and the differences the verdicts test.

With arms (several recoveries of every k), every figure is given per arm (a point carries its `arm`), the verdicts
per arm, and every pair of arms is compared at every k: the paired difference of their recovered shares and of their
recovered scores, two-level over runs and items where there are replicates, each also with its Holm interval over its
family (every pair of arms at every k and kind, in one format: the shares one family, the scores another); two arms
are said to differ only where that family-wise interval excludes 0. A share is stated only where the drop's interval
stays `paired.SHARE_MARGIN` above 0 (else 'unbounded'). The statistics are all core/paired.py's.
The recipe's declared comparisons (`comparisons`, pipeline/studies/comparisons.py) are drawn family by family, each
contrast with its paired interval and its Holm interval over exactly its family; a declared confirmatory family
replaces the every-pair family above, an exploratory one (declared after the results were read) is said so, beside it.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from layerprune.core import paired
from layerprune.core.errors import LayerpruneError
from layerprune.core.paired import NO_CLEAR_DROP, differ_text, format_interval, run_variance_note
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.paired_table import Figures, load_matrix
from layerprune.pipeline.studies.comparisons import (
    check_scored_items,
    draw_families,
    format_families,
    uses_default_family,
)
from layerprune.pipeline.studies.lr_search import lr_lines
from layerprune.pipeline.studies.sweep_grid import recovered_label

KINDS = ("classification", "generative")
CONTROL = "recovered-k0"  # the k = 0 control: the same recovery of the unpruned original (ARM-k0 with arms)
SIDE = {"shown": "above 0", "not shown": "holds 0", "contradicted": "below 0"}  # where a difference's interval lies


def point(study: Any, figures: Figures, k: int, arm: str | None = None, models: str = "") -> dict[str, Any]:
    """One k of the sweep (of one arm's recovery: the point carries `arm`): per kind the scores, drop,
    chance-normalised retention, recovered share (and, with the k = 0 control, the share net of the control's own
    change), the across-run spread; and the gap. `models`: the prefix of the original's and pruned models' labels
    the arm is measured against (sweeps joined with their own models: NAME:)."""
    out: dict[str, Any] = {"k": k, **({"arm": arm} if arm is not None else {})}
    control = recovered_label(arm, 0) in figures.labels
    rec, base, pruned = recovered_label(arm, k), f"{models}baseline", f"{models}pruned-k{k}"
    for kind in KINDS:
        if not figures.has(kind):
            continue
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
            for kind in KINDS if figures.has(kind)}


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
    detail = "; ".join(f"k={k}: {v['status']}, {_ci_pct(v['gap'])}" + ("" if v["costs"] else " (no clear drop)")
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
                     f"k={large}: {status} ({_ci_pct(ret[small]['retention_recovered'])} and "
                     f"{_ci_pct(ret[large]['retention_recovered'])}, difference {_ci_pct(diff)}; pruned alone "
                     f"{_ci_pct(ret[small]['retention_pruned'])} and {_ci_pct(ret[large]['retention_pruned'])}).")
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


def format_comparisons(rows: list[dict[str, Any]], replicates: int) -> list[str]:
    """One line per pair of arms, k and kind: 'local - lora at k = 3, generative: recovered share +18.0% [9.0,
    27.0] (undefined 0.0%), above 0; recovered score ...'."""
    runs = ("two-level over runs and items: run-to-run variance is in them" if replicates > 1 else
            "one replicate: item sampling only, run-to-run variance not measured")
    size = {name: max((c[f"{name}_holm"]["family"] for r in rows for kind, c in r.items() if kind in KINDS
                       and f"{name}_holm" in c), default=0) for name in ("share", "score")}
    lines = [f"Arms compared, paired on the same items (first - second arm, 95% intervals, {runs}; above 0: the "
             "interval is above 0, holds 0, or below 0). Each difference is one of a family declared here, every "
             f"pair of arms at every k and kind ({size['share']} share differences, {size['score']} score "
             "differences); Holm: its interval at the level Holm's step-down tests it at (core/paired.py "
             "holm_intervals), and two arms are said to differ only where that interval excludes 0:", ""]
    for row in rows:
        high, low = row["arms"]
        for kind in KINDS:
            if kind not in row:
                continue
            c = row[kind]
            share = (f"{_signed(c['share'])} (undefined {100 * (c['share'].get('undefined') or 0.0):.1f}%), "
                     f"{SIDE[c['share_status']]}" if isinstance(c["share"], dict) else c["share"])
            name = "recovered share net of each arm's control" if c.get("share_net_of_controls") else "recovered share"
            lines.append(f"- {high} - {low} at k = {row['k']}, {kind}: {name} {share}{_holm_text(c.get('share_holm'))};"
                         f" recovered score {_signed(c['score'])}, {SIDE[c['score_status']]}"
                         f"{_holm_text(c.get('score_holm'))}")
    return lines


def _holm_text(ci: dict[str, Any] | None) -> str:
    """' (Holm 99.2%: +3.0% [-1.0, 7.0], not shown to differ)', '' without one or where nothing can be stated."""
    if not ci or ci.get("low") is None:
        return ""
    return f" (Holm {100 * ci['level']:.1f}%: {_signed(ci)}, {differ_text(ci)})"


def _signed(ci: dict[str, Any]) -> str:
    """An interval printed with its sign: '+18.0% [9.0, 27.0]'."""
    text = format_interval(ci, missing="undefined")
    return f"+{text}" if (ci.get("value") or 0) > 0 else text


def _point(points: list[dict[str, Any]], k: int, arm: str | None = None) -> dict[str, Any]:
    return next(p for p in points if p["k"] == k and p.get("arm") == arm)


def _ci_pct(ci: dict[str, Any] | str | None) -> str:
    return ci if isinstance(ci, str) else format_interval(ci, missing="undefined")


def share_pct(ci: dict[str, Any] | str | None) -> str:
    """A share with its interval and the fraction of resamples on which it is undefined (no drop there)."""
    if not isinstance(ci, dict):
        return _ci_pct(ci)
    return f"{_ci_pct(ci)} (undefined {100 * (ci.get('undefined') or 0.0):.1f}%)"


def format_table(points: list[dict[str, Any]]) -> str:
    head = ["k", "kind", "original (%)", "pruned (%)", "drop (points)", "recovered (%)", "gain (points)",
            "retention pruned (chance-norm.)", "retention recovered (chance-norm.)", "recovered share"]
    net = any("recovered_share_net" in p.get(kind, {}) for p in points for kind in KINDS)
    head += ["recovered share net of the k = 0 control"] if net else []
    arms = any("arm" in p for p in points)
    head[1:1] = ["arm"] if arms else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        for kind in KINDS:
            row = p.get(kind)
            if row is None:
                continue
            cells = [str(p["k"]), kind, _ci_pct(row["baseline"]), _ci_pct(row["pruned"]), _ci_pct(row["drop"]),
                     _ci_pct(row.get("recovered")), _ci_pct(row.get("gain")), _ci_pct(row["retention_pruned"]),
                     _ci_pct(row.get("retention_recovered")), share_pct(row.get("recovered_share"))]
            cells += [share_pct(row.get("recovered_share_net"))] if net else []
            cells[1:1] = [p["arm"]] if arms else []
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_control(control: dict[str, Any] | None, chain: str, asked: bool, arm: str | None = None) -> str:
    """The k = 0 control's table (of `arm`), or why there is none."""
    of = "" if arm is None else f" of arm {arm}"
    if control is None:
        from layerprune.recover.methods import METHODS, cut_methods

        last = chain.split("+")[-1]
        identity = f" {METHODS.get(last).control_note}" if last in METHODS and METHODS.get(last).control_note else ""
        return (f"No k = 0 control{of}: {chain} needs a cut ({cut_methods()} change the blocks around one), "
                "so the recovered share is not net of what the recovery does to the unpruned original." + identity
                if asked else
                "No k = 0 control (controls: false): the recovered share is not net of what the recovery does to "
                "the unpruned original.")
    lines = [f"k = 0 control{of}: the same recovery applied to the unpruned original, scored on the same items "
             "(change = control - original, 95% paired interval).", "",
             "| kind | original (%) | control (%) | change (points) |", "|---|---|---|---|"]
    lines += [f"| {kind} | {_ci_pct(row['baseline'])} | {_ci_pct(row['control'])} | {_ci_pct(row['change'])} |"
              for kind, row in control.items()]
    return "\n".join(lines)


def format_spread(points: list[dict[str, Any]], control: dict[str, Any] | None,
                  controls: dict[str, dict[str, Any] | None] | None = None) -> str:
    """Across-run SD over the replicates beside the item-sampling SE, per recovered point (with arms: per arm, and
    each arm's control in `controls`); one replicate: run variance not measured."""
    rows = [(None, 0, kind, row["spread"]) for kind, row in (control or {}).items()]
    rows += [(arm, 0, kind, row["spread"]) for arm, c in (controls or {}).items() for kind, row in (c or {}).items()]
    rows += [(p.get("arm"), p["k"], kind, p[kind]["spread"]) for p in points for kind in KINDS
             if "spread" in p.get(kind, {})]
    arms = any(arm is not None for arm, *_ in rows)
    lines = ["| k |" + (" arm |" if arms else "") + " kind | replicates | across-run SD (points) | item SE (points) | "
             "run-variance share in the interval |", "|---|---|---|---|---|---|" + ("---|" if arms else "")]
    for arm, k, kind, sp in rows:
        run = f"{100 * sp['run_sd']:.1f}" if sp.get("run_sd") is not None else "not measured (one replicate)"
        lines.append(f"| {k} |" + (f" {arm} |" if arms else "")
                     + f" {kind} | {sp['replicates']} | {run} | {100 * sp['item_se']:.1f} | {run_variance_note(sp)} |")
    return "\n".join(lines)


def plot_retention(points: list[dict[str, Any]], depth: int | None, path: Path) -> None:
    """Chance-normalised retention against the pruning ratio: classification and generative, pruned and recovered
    (one line per arm with arms), with 95% paired intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    arms = list(dict.fromkeys(p.get("arm") for p in points))
    styles: dict[tuple[str, str, str | None], tuple[str, str]] = {
        ("classification", "pruned", arms[0] if arms else None): ("tab:blue", "--o"),
        ("generative", "pruned", arms[0] if arms else None): ("tab:red", "--s")}
    palette = ["tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:olive", "tab:cyan", "tab:pink", "tab:gray"]
    for i, arm in enumerate(arms):
        for kind, color, style in (("classification", "tab:blue", "-o"), ("generative", "tab:red", "-s")):
            styles[(kind, "recovered", arm)] = (color if arm is None else palette[i % len(palette)], style)
    for (kind, role, arm), (color, style) in styles.items():
        series = [(p["k"], p[kind].get(f"retention_{role}")) for p in points if kind in p and p.get("arm") == arm]
        series = [(k, ci) for k, ci in series if ci and ci.get("value") is not None]
        if not series:
            continue
        xs = [100 * k / depth if depth else k for k, _ in series]
        ys = [100 * ci["value"] for _, ci in series]
        errors = [[100 * (ci["value"] - (ci["low"] if ci["low"] is not None else ci["value"])) for _, ci in series],
                  [100 * ((ci["high"] if ci["high"] is not None else ci["value"]) - ci["value"]) for _, ci in series]]
        ax.errorbar(xs, ys, yerr=errors, fmt=style, color=color, capsize=3,
                    label=f"{kind}, {role}" if arm is None or role == "pruned" else f"{kind}, {arm}")
    ax.axhline(100, color="grey", lw=0.6)
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xlabel("blocks dropped (% of depth)" if depth else "blocks dropped")
    ax.set_ylabel("retention above chance (%)")
    ax.set_title("Retention against pruning ratio (95% paired intervals)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_curves(study: Any, root: Path) -> dict[int | str, dict[str, Any]]:
    """Per k (with arms: per ARM-kK), replicate 0: the held-out loss curve, tokens trained and optimizer steps from
    its recover report."""
    from layerprune.pipeline.studies.sweep_grid import arm_names, stage_output
    from layerprune.recover.report import RECOVER_REPORT, read_recover_report

    out: dict[int | str, dict[str, Any]] = {}
    for k, arm in ((k, arm) for k in study.ratios for arm in arm_names(study)):
        label = recovered_label(arm, k)
        folder = stage_output(root, "recover-" + label.removeprefix("recovered-")).parent
        if (folder / RECOVER_REPORT).is_file():
            report = read_recover_report(folder)
            out[k if arm is None else label] = {
                "held_out": report.loss_curve.get("held_out", []), "tokens": report.tokens_seen,
                "steps": report.data.get("steps"), "seconds": report.seconds.training,
                "answers": report.data.get("filter", {}), "tokens_unpadded": report.tokens_unpadded,
                "sequences": report.sequences, "optimizer_steps": report.optimizer_steps,
                "learning_rate": report.learning_rate}
    return out


def budget_text(curve: dict[str, Any]) -> str:
    """What one recovery spent: unpadded target tokens, sequences, optimizer steps and learning rate where its report
    has them (the trainer's padded count otherwise), its time and how its held-out loss flattened."""
    if curve.get("tokens_unpadded") is None:
        spent = f"{curve['tokens']} tokens (padded), {curve['steps']} steps"
    else:
        spent = (f"{curve['tokens_unpadded']} unpadded target tokens, {curve['sequences']} sequences, "
                 f"{curve['optimizer_steps']} optimizer steps, lr {curve['learning_rate']:.1e} ({curve['tokens']} "
                 "tokens as the trainer counts them)")
    return f"{spent}, {curve['seconds']:.0f} s, held-out loss {flattening(curve['held_out'])}"


def flattening(curve: list[list[float | None]]) -> str:
    """How much the held-out loss still fell over the last quarter of training (relative to its whole fall)."""
    values = [(s, v) for s, v in curve if v is not None]
    if len(values) < 3:
        return "too few held-out points"
    first, last = values[0][1], values[-1][1]
    quarter = [v for s, v in values if s >= 0.75 * values[-1][0]]
    fall = first - last
    late = quarter[0] - last if quarter else 0.0
    share = late / fall if fall > 0 else float("nan")
    return f"{first:.3f} -> {last:.3f}; the last quarter of the steps gave {100 * share:.0f}% of the fall"


def curve_name(key: int | str) -> str:
    """'k=3' for a sweep's k, the label itself (ARM-kK) with arms."""
    return f"k={key}" if isinstance(key, int) else key


def plot_losses(curves: dict[int | str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k, info in curves.items():
        points = [(s, v) for s, v in info["held_out"] if v is not None]
        ax.plot([s for s, _ in points], [v for _, v in points], "-o", ms=3, label=curve_name(k))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss (teacher answers)")
    ax.set_title("Recovery: held-out loss per k" + (" and arm" if any(isinstance(k, str) for k in curves) else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep_report(study: Any, root: Path, curves: dict[int | str, dict[str, Any]] | None = None) -> Path:
    """sweep.md, sweep.json, sweep.png (retention against k) and sweep_loss.png in the sweep directory. `curves`: the
    held-out loss curves where the recover reports cannot give them (a records archive's, whose reports are scrubbed);
    else read from them."""
    from layerprune.pipeline.audit_report import audit_section
    from layerprune.pipeline.studies.cells import CALIBRATION_FILE
    from layerprune.pipeline.studies.sweep_grid import arm_names, ranking

    folders = evaluated(study, root)
    figures, matrices, kinds = sweep_figures(folders)
    arms = arm_names(study)
    points, controls, pairs = arm_figures(study, figures)
    declared = draw_families(study.comparisons, figures, recovered_label)
    judged = {arm: verdicts(study, figures, [p for p in points if p.get("arm") == arm], arm) for arm in arms}
    depth = _depth(study, root)
    plot_retention(points, depth, root / "sweep.png")
    curves = loss_curves(study, root) if curves is None else curves
    plot_losses(curves, root / "sweep_loss.png")
    gate = root / CALIBRATION_FILE
    calibration = json.loads(gate.read_text()) if study.probes is not None and gate.is_file() else None
    items = {t: int(m.shape[1]) for t, m in matrices.items()}
    unpaired = {t: why for t, why in kinds.items() if why.startswith("unpaired")}
    kept = records(root, folders)
    chat, chat_text = chat_figures(study, root, [t for t, kind in kinds.items() if kind == "generative"])
    one = study.arms is None
    (root / "sweep.json").write_text(json.dumps(paired_json({
        "points": points, "control": controls[None] if one else controls, "replicates": study.replicates,
        "verdicts": judged[None][1] if one else {arm: tests for arm, (_, tests) in judged.items()}, "items": items,
        "unpaired": unpaired, "curves": curves, "calibration": calibration,
        "ranking": ranking(root, study.ratios, study.prune.layers),
        "records": kept, **({"chat": chat} if chat else {}),
        **({} if one else {"arms": {arm: study.arm_recipe(arm, "<pruned>").chain_name() for arm in study.arms},
                           "comparisons": pairs}),
        **({"declared_comparisons": declared} if declared else {})}), indent=1))
    verdict_lines = [f"- {'' if arm is None else f'{arm}: '}{v}" for arm, (lines, _) in judged.items() for v in lines]
    title = "Pruning-ratio sweep" if len(study.ratios) > 1 else f"Recovery at one cut (k = {study.ratios[0]})"
    text = [f"# {title}: {study.name}", "", study.description, "", *verdict_lines, "",
            "![retention against pruning ratio](sweep.png)", "", format_table(points), "",
            *_recovery_sections(study, points, controls, pairs, declared), *(chat_text + [""] if chat_text else []),
            *_method_lines(study, root, figures, items, calibration, curves, unpaired, depth), "",
            _records_line(kept), "",
            "![held-out loss per k](sweep_loss.png)", *audit_section(root), "",
            f"Rerun: `layerprune study {study.name} --output {root}` (complete stages are skipped)."]
    (root / "sweep.md").write_text("\n".join(text) + "\n")
    return root / "sweep.md"


def _recovery_sections(study: Any, points: list[dict[str, Any]], controls: dict[str | None, dict[str, Any] | None],
                       pairs: list[dict[str, Any]], declared: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """The k = 0 control(s), the run-to-run spread, with arms the arms compared pairwise at every k (unless the recipe
    declares a confirmatory family), and the recipe's declared comparisons, family by family."""
    from layerprune.pipeline.studies.sweep_grid import arm_names, has_control

    chains = {arm: study.arm_recipe(arm, "<pruned>").chain_name() for arm in arm_names(study)}
    text = [line for arm in chains for line in (
        format_control(controls[arm], chains[arm], study.controls and not has_control(study, arm), arm), "")] \
        if study.controls or study.arms is None else [format_control(None, "", False), ""]
    text += [f"Run-to-run spread ({study.replicates} replicate(s) of every recovery, seeds settings.seed + r):", "",
             format_spread(points, controls[None]) if study.arms is None else
             format_spread(points, None, {arm: c for arm, c in controls.items() if arm is not None}), ""]
    default = study.arms and uses_default_family(study.comparisons)
    return text + ([*format_comparisons(pairs, study.replicates), ""] if default else []) \
        + format_families(declared or {}, study.replicates)


def evaluated(study: Any, root: Path, evals: str = "eval") -> dict[str, Path]:
    """The eval folder of every model the sweep scored (physical labels: replicates apart); `evals`: eval, or
    eval-chat (the probe levels through the chat template)."""
    from layerprune.pipeline.studies.sweep_grid import models

    return {m: root / evals / m for m in models(study) if (root / evals / m / SUMMARY_FILE).is_file()}


def arm_figures(study: Any, figures: Figures) -> tuple[list[dict[str, Any]], dict[str | None, dict[str, Any] | None],
                                                     list[dict[str, Any]]]:
    """Every k's point per arm, each arm's k = 0 control and, with arms, the arms compared pairwise (today's family:
    drawn unless the recipe declares a confirmatory family of its own)."""
    from layerprune.pipeline.studies.sweep_grid import arm_names

    arms = arm_names(study)
    points = [point(study, figures, k, arm) for k in study.ratios if f"pruned-k{k}" in figures.labels for arm in arms]
    controls = {arm: control_point(figures, arm) for arm in arms}
    default = study.arms and uses_default_family(study.comparisons)
    return points, controls, comparisons(figures, points, list(study.arms)) if default else []


def chat_figures(study: Any, root: Path, plain_generative: list[str]) -> tuple[dict[str, Any] | None, list[str]]:
    """The probe levels scored through the chat template (eval-chat/<model>), as the plain figures are: per arm and
    k the scores, drop, retention and recovered share, the controls, the spread and the arms compared; (None, [])
    where the recovery data is plain, (None, a line) where nothing was scored that way. `plain_generative`: the
    generative tasks of the plain figures (GSM8K among them where it passed its gate)."""
    from layerprune.pipeline.studies.sweep_grid import both_formats

    if not both_formats(study):
        return None, []
    folders = evaluated(study, root, "eval-chat")
    if "baseline" not in folders:
        return None, ["Probes through the chat template: not scored (the gate kept no probe level, or the eval-chat "
                      "stages have not run)."]
    figures, matrices, _ = sweep_figures(folders)
    probes = list(matrices)
    plain_more = bool(set(plain_generative) - set(probes))
    points, controls, pairs = arm_figures(study, figures)
    declared = draw_families(study.comparisons, figures, recovered_label)
    data = {"points": points, "control": controls[None] if study.arms is None else controls, "comparisons": pairs,
            "records": records(root, folders), **({"declared_comparisons": declared} if declared else {})}
    text = ["## Probes through the chat template", "",
            "The recovery data is chat-formatted, so every model's kept probe levels (" + ", ".join(probes) + ") were "
            "also scored through the chat template, on the same items (eval-chat/<model>); the figures as above for "
            "those levels" + (" (the plain generative figures above also hold GSM8K, which is scored through the "
                              "chat template either way, so compare the probe levels' own rows in eval/)"
                              if plain_more else "") + ". Where the plain and chat figures part, the recovery moved "
            "the model's format as well as its skill.", "",
            format_table(points), "", *_recovery_sections(study, points, controls, pairs, declared)]
    return data, text


def sweep_figures(folders: dict[str, Path],
                  common: bool = False) -> tuple[Figures, dict[str, np.ndarray], dict[str, str]]:
    """Figures over the logical labels (a recovered point's replicates are one label: their mean, the interval with
    the run-to-run variance), the per-task matrices and the tasks' kinds; `common`: on the items every model
    answered (sweeps joined across runs, which say so), else models scored on different items are refused
    (LayerpruneError: `check_scored_items`), not left out."""
    from layerprune.pipeline.studies.cells import split_label

    if not common:
        check_scored_items(folders)
    labels, matrices, chance, kinds = load_matrix(folders, common)
    if not matrices:
        raise LayerpruneError("no task pairs across the models (" + "; ".join(
            f"{task}: {why}" for task, why in kinds.items()) + ")")
    replicates: dict[str, list[str]] = {}
    for label in labels:
        replicates.setdefault(split_label(label)[0], []).append(label)
    groups = {kind: [t for t in matrices if kinds[t] == kind] for kind in KINDS}
    return Figures(labels, matrices, chance, groups, replicates=replicates), matrices, kinds


def records(root: Path, folders: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Where each scored model's per-item records lie (relative to the sweep directory): its eval folder and the
    samples/*.jsonl that pair it with the others; `missing` when its samples are gone."""
    from layerprune.evaluate.items import SAMPLES_DIR

    out = {}
    for label, folder in folders.items():
        files = sorted(p.relative_to(root).as_posix() for p in (folder / SAMPLES_DIR).glob("*.jsonl"))
        out[label] = {"folder": folder.relative_to(root).as_posix(), "samples": files, "missing": not files}
    return out


def _records_line(kept: dict[str, dict[str, Any]]) -> str:
    missing = [label for label, r in kept.items() if r["missing"]]
    return ("Per-item records (kept, listed in sweep.json `records`, so any comparison can be redone paired): "
            "eval/MODEL/samples/*.jsonl for " + ", ".join(kept) + "."
            + (f" MISSING for {', '.join(missing)}: those models could not be paired." if missing else ""))


def _depth(study: Any, root: Path) -> int | None:
    """The original's block count, from the scoring pass's report (a given cut's: its pruned model's)."""
    from layerprune.prune.report import read_prune_report

    return read_prune_report(root / ("scored" if not study.prune.layers else f"pruned-k{study.ratios[0]}")) \
        .num_blocks_before


def gate_line(study: Any, calibration: dict[str, Any] | None) -> str:
    """What the probe gate kept and left out (or that there is none), and the fixed tasks scored beside it."""
    fixed = (f" Fixed tasks, scored on every model whatever the gates keep (never gated): {', '.join(study.fixed)}."
             if getattr(study, "fixed", None) else "")
    if calibration is None:
        return "No probe gate (probes: null): the probe tasks scored are the fixed ones." + fixed
    kept = ", ".join(f"{t} ({100 * r['score']:.0f}%)" for t, r in calibration["levels"].items() if r["kept"])
    left = ", ".join(f"{t} ({r['why']})" for t, r in calibration["levels"].items() if not r["kept"])
    return (f"probes-calibrated (calibration stream, {calibration['settings']['items']} items a level, kept "
            f"{100 * calibration['settings']['low']:.0f}-{100 * calibration['settings']['high']:.0f}%, at most "
            f"{calibration['settings']['per_family']} a family): kept {kept or 'none'}; left out {left or 'none'}."
            + fixed)


def _method_lines(study: Any, root: Path, figures: Figures, items: dict[str, int],
                  calibration: dict[str, Any] | None, curves: dict[int | str, dict[str, Any]],
                  unpaired: dict[str, str], depth: int | None) -> list[str]:
    from layerprune.pipeline.studies.sweep_grid import ranking

    cuts = ranking(root, study.ratios, study.prune.layers)
    groups = {kind: [figures.tasks[i] for i in idx] for kind, idx in figures.groups.items()}
    groups = {kind: groups.get(kind, []) for kind in KINDS}
    how = "the cut given, prune.layers" if study.prune.layers else f"one {study.prune.score} ranking"
    lines = [f"Blocks dropped at each k ({how}, original numbering, of {depth}): "
             + "; ".join(f"k={k}: {v}" for k, v in cuts.items()) + ".",
             f"Items per task (the same for every model): {', '.join(f'{t} {n}' for t, n in items.items())}. "
             f"Classification: {', '.join(groups['classification']) or 'none'} (chance "
             f"{100 * figures.chance['classification']:.0f}%); generative: "
             f"{', '.join(groups['generative']) or 'none'} (chance 0).",
             gate_line(study, calibration),
             f"The teacher answered generic instructions ({study.shared_recipe('<pruned>').prompts.source}); "
             "how far each scored skill is held out from them is measured, not assumed (Held out, measured, below).",
             f"Recovery budget per k{' and arm' if study.arms else ''} (replicate 0): " + "; ".join(
                 f"{curve_name(k)}: {budget_text(c)}" for k, c in curves.items()) + ".",
             *lr_lines(root, list(study.lr_grid), "every k, replicate and control of the arm trained at it (the "
                       "search's own runs are not scored)"),
             f"Intervals: 95% percentile intervals of one clustered paired bootstrap ({figures.boot.resamples} "
             f"resamples, seed {figures.boot.seed}; items drawn within each task, the same draw for every model)"
             + (f"; a recovered point is the mean of its {study.replicates} replicates, its interval two-level "
                "(runs drawn, then items), so it holds the run-to-run variance" if study.replicates > 1 else
                "; one replicate per recovery: the intervals hold item sampling only, run-to-run variance is not "
                "measured") + ". "
             "Retention is chance-normalised, (model - chance) / (original - chance); the recovered share is "
             "(recovered - pruned) / (original - pruned), net of the control (recovered - pruned - (control - "
             "original)) / (original - pruned); a share is undefined on resamples without a drop, and the fraction "
             "of such resamples is printed beside it."]
    if unpaired:
        lines.append("Left out (could not be paired): " + "; ".join(f"{t}: {w}" for t, w in unpaired.items()))
    return lines


def paired_json(value: Any) -> Any:
    """JSON-safe: numpy numbers as floats, NaN as null, int keys as strings."""
    if isinstance(value, dict):
        return {str(k): paired_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [paired_json(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return None if not np.isfinite(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value
