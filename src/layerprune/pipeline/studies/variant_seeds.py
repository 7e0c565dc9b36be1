"""A variant study's variant made under several seeds (`variant_seeds`): one logical model, the mean of its makes.

Each seed's variant is compared with the original as a study of one seed compares it, every seed on the same halves
and item resamples. Here: the make-to-make spread of the variant's full scores, the seeds' mean ratio to the
split-half ceiling with its two-level draws (the seeds drawn, then the items: `core.paired.pool_replicate_draws`),
and the report's lines for them. Paper A's verdict then reads intervals that hold the variant's training variance,
not only the items'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layerprune.core.paired import format_bounded, format_estimate

if TYPE_CHECKING:
    import numpy as np


def score_spread(values: dict[int, float]) -> dict[str, Any]:
    """The variant's full score on one task per seed, their mean and make-to-make SD (ddof 1)."""
    import numpy as np

    scores = np.asarray(list(values.values()), dtype=np.float64)
    return {"values": {str(s): float(v) for s, v in values.items()}, "mean": float(scores.mean()),
            "sd": float(scores.std(ddof=1)) if len(scores) > 1 else None}


def pooled_relative(relatives: dict[int, dict[str, Any]], draws: dict[int, dict[str, np.ndarray]], seed: int,
                    alpha: float) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The seeds' `relative_agreement` (each seed's, by seed) as one logical variant's, and its ratio's two-level
    draws per measure: the ratio is the mean of the seeds' ratios; agreement, ceiling and the variant's reliability
    are the seeds' means (shown beside it; the ratio is not their quotient); `ratios`: each seed's."""
    from layerprune.analyze.agreement import agreement_interval
    from layerprune.core.paired import MEASURES_A, pool_replicate_draws

    first = next(iter(relatives.values()))
    out: dict[str, Any] = {key: first[key] for key in ("splits", "half_items", "resamples", "alpha")}
    pooled = {}
    for m in MEASURES_A:
        value, pooled[m] = pool_replicate_draws([r[m]["ratio"] for r in relatives.values()],
                                                [draws[s][m] for s in relatives], seed, alpha)
        out[m] = {"agreement": _mean([r[m]["agreement"] for r in relatives.values()]),
                  "ceiling": _mean([r[m]["ceiling"] for r in relatives.values()]),
                  "reliability": [first[m]["reliability"][0],
                                  _mean([r[m]["reliability"][1] for r in relatives.values()])],
                  "ratio": value, "ratio_interval": agreement_interval(value, pooled[m], alpha),
                  "ratios": {str(s): r[m]["ratio"] for s, r in relatives.items()}}
    return out, pooled


def _mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)  # type: ignore[arg-type, misc]


def agreement_row(name: str, pair: dict[str, Any]) -> str:
    """One row of the first table: the pair's base scores, its agreements with their intervals, its critical sets."""
    base = " / ".join(format_estimate(v) for v in pair["base_scores"])
    return (f"| {name} | {base} | {format_bounded(pair['spearman'], pair['spearman_interval'])} | "
            f"{format_bounded(pair['critical_jaccard'], pair['jaccard_interval'])} | {pair['critical'][0]} | "
            f"{pair['critical'][1]} |")


def seeds_lines(result: dict[str, Any], level: str) -> list[str]:
    """The section on the variant across its seeds: each task's full score per seed, mean and make-to-make SD, each
    seed's ratios to the ceiling, and the target's shift per seed."""
    from layerprune.core.paired import run_inflation

    seeds = [str(s) for s in result["variant_seeds"]]
    alpha = next(iter(result["tasks"].values()))["relative"]["alpha"]
    lines = ["", "## The variant across its seeds", "",
             f"The variant was made {len(seeds)} times, under seeds {', '.join(seeds)} (one make each; their folders "
             f"in variant.json's variant_dirs), and each make was scored on the same items (importance/ for seed "
             f"{seeds[0]}, importance-seed<N>/ for the others). Per task: the original's full "
             "score, each make's, their mean and make-to-make SD (ddof 1), and each make's ratio to the split-half "
             "ceiling. The verdict below reads the makes' mean ratio; its "
             f"{level} interval draws the makes, then the items (two-level, as core/paired.py draws replicates: the "
             f"makes' deviations scaled by c({len(seeds)}) = {run_inflation(len(seeds), alpha):.2f} times the share "
             "of their spread that is not item noise).", "",
             f"| task | original | {' | '.join(f'seed {s}' for s in seeds)} | mean | make-to-make SD | "
             "ratio per seed (Spearman) | ratio per seed (Jaccard) |", "|---" * (len(seeds) + 6) + "|"]
    for task, row in result["tasks"].items():
        spread, relative = row["spread"], row["relative"]
        per_seed = " | ".join(format_estimate(spread["values"][s]) for s in seeds)
        ratios = [", ".join(format_estimate(relative[m]["ratios"][s]) for s in seeds) for m in ("spearman", "jaccard")]
        mean, sd = format_estimate(spread["mean"]), format_estimate(spread["sd"])
        lines.append(f"| {task} | {format_estimate(row['base_scores'][0])} | {per_seed} | {mean} | {sd} | "
                     f"{ratios[0]} | {ratios[1]} |")
    shift = result["target"]
    if shift is not None:
        lines += ["", f"Target {shift['task']} per seed (shift over the original, item-only interval): " + "; ".join(
            f"seed {s} {format_estimate(one['after'])} ({one['shift']:+.2f} [{one['interval'][0]:+.2f}, "
            f"{one['interval'][1]:+.2f}])" if one["interval"] else f"seed {s} {format_estimate(one['after'])}"
            for s, one in shift["seeds"].items())]
    return lines
