"""The tables and lines of a sweep's figures (sweep_points.py) as sweep.md and `layerprune analyze sweeps`
(sweep_join.py) print them: the table of every k, the k = 0 control's table, the run-to-run spread, and the arms
compared pairwise with their Holm intervals."""

from __future__ import annotations

from typing import Any

from layerprune.core.paired import differ_text, format_signed, run_variance_note
from layerprune.pipeline.studies.figures import KINDS, SPLIT
from layerprune.pipeline.studies.sweep_points import ci_pct, share_pct

SIDE = {"shown": "above 0", "not shown": "holds 0", "contradicted": "below 0"}  # where a difference's interval lies


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
            share = (f"{format_signed(c['share'])} (undefined {100 * (c['share'].get('undefined') or 0.0):.1f}%), "
                     f"{SIDE[c['share_status']]}" if isinstance(c["share"], dict) else c["share"])
            name = "recovered share net of each arm's control" if c.get("share_net_of_controls") else "recovered share"
            lines.append(f"- {high} - {low} at k = {row['k']}, {kind}: {name} {share}{_holm_text(c.get('share_holm'))};"
                         f" recovered score {format_signed(c['score'])}, {SIDE[c['score_status']]}"
                         f"{_holm_text(c.get('score_holm'))}")
    return lines


def _holm_text(ci: dict[str, Any] | None) -> str:
    """' (Holm 99.2%: +3.0% [-1.0, 7.0], not shown to differ)', '' without one or where nothing can be stated."""
    if not ci or ci.get("low") is None:
        return ""
    return f" (Holm {100 * ci['level']:.1f}%: {format_signed(ci)}, {differ_text(ci)})"


def format_table(points: list[dict[str, Any]]) -> str:
    head = ["k", "kind", "original (%)", "pruned (%)", "drop (points)", "recovered (%)", "gain (points)",
            "retention pruned (chance-norm.)", "retention recovered (chance-norm.)", "recovered share"]
    net = any("recovered_share_net" in p.get(kind, {}) for p in points for kind in KINDS)
    head += ["recovered share net of the k = 0 control"] if net else []
    arms = any("arm" in p for p in points)
    head[1:1] = ["arm"] if arms else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        for kind in (*KINDS, *SPLIT):
            row = p.get(kind)
            if row is None:
                continue
            cells = [str(p["k"]), kind, ci_pct(row["baseline"]), ci_pct(row["pruned"]), ci_pct(row["drop"]),
                     ci_pct(row.get("recovered")), ci_pct(row.get("gain")), ci_pct(row["retention_pruned"]),
                     ci_pct(row.get("retention_recovered")), share_pct(row.get("recovered_share"))]
            cells += [share_pct(row["recovered_share_net"]) if "recovered_share_net" in row else
                      "- (no control scored)" if "recovered" in row else ci_pct(None)] if net else []
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
    lines += [f"| {kind} | {ci_pct(row['baseline'])} | {ci_pct(row['control'])} | {ci_pct(row['change'])} |"
              for kind, row in control.items()]
    return "\n".join(lines)


def format_spread(points: list[dict[str, Any]], control: dict[str, Any] | None,
                  controls: dict[str, dict[str, Any] | None] | None = None) -> str:
    """Across-run SD over the replicates beside the item-sampling SE, per recovered point (with arms: per arm, and
    each arm's control in `controls`); one replicate: run variance not measured."""
    rows = [(None, 0, kind, row["spread"]) for kind, row in (control or {}).items()]
    rows += [(arm, 0, kind, row["spread"]) for arm, c in (controls or {}).items() for kind, row in (c or {}).items()]
    rows += [(p.get("arm"), p["k"], kind, p[kind]["spread"]) for p in points for kind in (*KINDS, *SPLIT)
             if "spread" in p.get(kind, {})]
    arms = any(arm is not None for arm, *_ in rows)
    lines = ["| k |" + (" arm |" if arms else "") + " kind | replicates | across-run SD (points) | item SE (points) | "
             "run-variance share in the interval |", "|---|---|---|---|---|---|" + ("---|" if arms else "")]
    for arm, k, kind, sp in rows:
        run = f"{100 * sp['run_sd']:.1f}" if sp.get("run_sd") is not None else "not measured (one replicate)"
        lines.append(f"| {k} |" + (f" {arm} |" if arms else "")
                     + f" {kind} | {sp['replicates']} | {run} | {100 * sp['item_se']:.1f} | {run_variance_note(sp)} |")
    return "\n".join(lines)
