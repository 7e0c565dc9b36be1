"""How often paper A's agreement-ratio intervals hold the agreement they estimate, on synthetic profiles whose
population agreement is known: the plain percentile interval, the same with the estimate's own check (no interval
where the estimate lies outside the central 95% of its resamples or over 5% of them are undefined), and the
bias-corrected one (Efron's BC), side by side on the same trials.

Items: a latent difficulty u ~ U(0, 1) per item, shared by every block of a model (ablations nest, as real ones do); a
model is right on item i with block b removed when u_i < p_b, and 10% of item-block answers flip at random. Truth: the
Spearman of the population drops and the Jaccard of the population critical sets (drop above 0.2), between an original
and a variant that differ (Spearman 0.76, Jaccard 0.75) or are the same model (1.0). The split-half ratio
(analyze/agreement.relative_agreement_draws) is the estimate; every interval is read off its resampled ratios.

    python bench/bench_agreement_coverage.py [--items 150] [--trials 300] [--resamples 400]
"""

from __future__ import annotations

import argparse
import time
from statistics import NormalDist

import numpy as np
from scipy.stats import spearmanr

from layerprune.analyze.agreement import relative_agreement_draws
from layerprune.core.paired import checked_interval, percentile_interval

BASE, FLIP, THRESHOLD, BAR = 0.8, 0.1, 0.2, 0.9
ORIGINAL = BASE * (1 - np.r_[0.9, 0.6, 0.5, 0.35, 0.25, 0.1, 0.05, 0.3, 0.15, 0.02, 0.45, 0.08])
VARIANTS = {"different": BASE * (1 - np.r_[0.85, 0.3, 0.55, 0.1, 0.3, 0.25, 0.05, 0.35, 0.05, 0.1, 0.4, 0.15]),
            "same": ORIGINAL.copy()}
METHODS = ("percentile", "percentile, n/a where the estimate is outside", "bias-corrected")


def population_agreement(variant: np.ndarray) -> dict[str, float]:
    drops = [(BASE - (FLIP + (1 - 2 * FLIP) * p)) / BASE for p in (ORIGINAL, variant)]
    sets = [set(np.flatnonzero(d > THRESHOLD)) for d in drops]
    return {"spearman": float(spearmanr(*drops).statistic), "jaccard": len(sets[0] & sets[1]) / len(sets[0] | sets[1])}


def answers(p: np.ndarray, items: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, None]:
    u = rng.random(items)
    ablated = (u[None, :] < p[:, None]) ^ (rng.random((len(p), items)) < FLIP)
    return (u < BASE).astype(float), ablated.astype(float), None


def bias_corrected(value: float, draws: np.ndarray) -> tuple[float, float] | None:
    """Efron's BC interval (no acceleration), None where `checked_interval` gives none."""
    finite = draws[np.isfinite(draws)]
    if checked_interval(value, draws)["low"] is None:
        return None
    normal = NormalDist()
    z0 = normal.inv_cdf((np.sum(finite < value) + 0.5 * np.sum(finite == value)) / len(finite))
    z = normal.inv_cdf(0.975)
    low, high = np.quantile(finite, [normal.cdf(2 * z0 - z), normal.cdf(2 * z0 + z)])
    return float(low), float(high)


def intervals(value: float, draws: np.ndarray) -> dict[str, tuple[float, float] | None]:
    plain, checked = percentile_interval(value, draws), checked_interval(value, draws)
    return {METHODS[0]: (plain["low"], plain["high"]),
            METHODS[1]: None if checked["low"] is None else (checked["low"], checked["high"]),
            METHODS[2]: bias_corrected(value, draws)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=150)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--resamples", type=int, default=400)
    args = parser.parse_args()
    print(f"{args.items} items, 12 blocks, {args.trials} trials, {args.resamples} resamples; 95% intervals; "
          f"'invariant' when the interval's low end >= {BAR}, 'different' when its high end < {BAR}")
    print("| profiles | measure | truth | mean estimate | method | covers (of bounded) | n/a | says invariant | "
          "says different |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, variant in VARIANTS.items():
        truth, started = population_agreement(variant), time.time()
        counts = {(m, method): {"cover": 0, "na": 0, "inv": 0, "diff": 0} for m in truth for method in METHODS}
        estimates: dict[str, list[float]] = {m: [] for m in truth}
        for trial in range(args.trials):
            rng = np.random.default_rng(10_000 + trial)
            first, second = answers(ORIGINAL, args.items, rng), answers(variant, args.items, rng)
            relative, draws = relative_agreement_draws(first, second, "mean", THRESHOLD, splits=4,
                                                       resamples=args.resamples, seed=trial)
            for m in truth:
                value = relative[m]["ratio"]
                estimates[m].append(value)
                for method, ci in intervals(value, draws[m]).items():
                    c = counts[(m, method)]
                    if ci is None:
                        c["na"] += 1
                        continue
                    c["cover"] += ci[0] <= truth[m] <= ci[1]
                    c["inv"] += ci[0] >= BAR
                    c["diff"] += ci[1] < BAR
        for m in truth:
            for method in METHODS:
                c, bounded = counts[(m, method)], args.trials - counts[(m, method)]["na"]
                print(f"| {name} | {m} | {truth[m]:.2f} | {np.mean(estimates[m]):.3f} | {method} | "
                      f"{100 * c['cover'] / max(bounded, 1):.0f}% ({c['cover']}/{bounded}) | {c['na']} | "
                      f"{c['inv']} | {c['diff']} |")
        print(f"<!-- {name}: {time.time() - started:.0f} s -->")


if __name__ == "__main__":
    main()
