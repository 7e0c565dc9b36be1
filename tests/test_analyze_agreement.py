"""Agreement of two importance profiles (Spearman, critical-set Jaccard) with bootstrap intervals, constructed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from layerprune.analyze import metrics
from layerprune.analyze.agreement import profile_agreement, resampled_drops
from layerprune.core.paired import bootstrap_indices, score


def correctness_result(killed: dict[int, list[int]], items: int = 20, blocks: int = 4) -> dict:
    """A `generate`/`accuracy` task result: every item right with the full model; skipping block b makes the
    items killed[b] wrong. Drops and critical sets as the analysis would report them (threshold 0.2)."""
    ablated = [[i not in killed.get(b, []) for i in range(items)] for b in range(blocks)]
    drops = [1 - sum(row) / items for row in ablated]
    return {"per_item": {"base_item_correct": [True] * items, "ablated_item_correct": ablated},
            "drops": drops, "critical": [b for b, d in enumerate(drops) if d > 0.2]}


def test_identical_profiles_agree_fully_in_every_resample():
    a = correctness_result({1: list(range(20)), 3: list(range(10))})
    out = profile_agreement(a, a, "mean", 0.2, resamples=200)
    assert out["spearman"] == pytest.approx(1.0) and out["spearman_interval"] == pytest.approx([1.0, 1.0])
    assert out["critical_jaccard"] == 1.0 and out["jaccard_interval"] == [1.0, 1.0]
    assert out["critical"] == [[1, 3], [1, 3]]


def test_moved_critical_block_lowers_jaccard_and_spearman():
    a = correctness_result({1: list(range(20)), 3: list(range(10))})
    b = correctness_result({0: list(range(20)), 3: list(range(10))})
    out = profile_agreement(a, b, "mean", 0.2, resamples=300, seed=1)
    assert out["critical_jaccard"] == pytest.approx(1 / 3)  # {1, 3} vs {0, 3}
    assert out["spearman"] == pytest.approx(metrics.spearman(a["drops"], b["drops"]))
    low, high = out["jaccard_interval"]
    assert 0 < low <= 1 / 3 <= high < 1  # block 3 (half the items) falls under the threshold in some resamples
    low, high = out["spearman_interval"]  # the rank order of the drops is the same in every resample here
    assert low == pytest.approx(out["spearman"]) and high == pytest.approx(out["spearman"])


def test_resampled_drops_equal_a_naive_loop_for_both_scores():
    rng = np.random.default_rng(0)
    base_nll, ablated_nll = rng.uniform(0.5, 2, 12), rng.uniform(0.5, 4, (3, 12))
    tokens = rng.integers(1, 6, 12).astype(float)
    index = bootstrap_indices(12, 5, seed=3)
    drops = resampled_drops(base_nll, ablated_nll, tokens, "probability", index)
    for r, rows in enumerate(index):
        full = math.exp(-sum(base_nll[i] for i in rows) / sum(tokens[i] for i in rows))
        for b in range(3):
            skipped = math.exp(-sum(ablated_nll[b][i] for i in rows) / sum(tokens[i] for i in rows))
            assert drops[r, b] == pytest.approx((full - skipped) / full)
    correct = rng.integers(0, 2, 12).astype(float)
    ablated = rng.integers(0, 2, (3, 12)).astype(float)
    drops = resampled_drops(correct, ablated, None, "mean", index)
    for r, rows in enumerate(index):
        full = float(score(correct[rows], None, "mean"))
        for b in range(3):
            want = (full - ablated[b][rows].mean()) / full if full > 0 else None
            assert (np.isnan(drops[r, b]) if want is None else drops[r, b] == pytest.approx(want))


def test_profiles_of_different_depths_are_refused():
    with pytest.raises(ValueError, match="same items and depth"):
        profile_agreement(correctness_result({}, blocks=4), correctness_result({}, blocks=5), "mean", 0.2)


def matrix(ablated: list[list[int]], base: list[int] | None = None) -> tuple:
    """A correctness matrix (base [items], ablated [blocks, items], no tokens)."""
    rows = np.asarray(ablated, dtype=float)
    return (np.ones(rows.shape[1]) if base is None else np.asarray(base, dtype=float)), rows, None


# blocks x items; on items {0, 1} the drops are [1, 0, .5], on items {2, 3} they are [0, 1, .5]
SWAPPING = matrix([[0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 0, 1]])
STEADY = matrix([[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]])  # [1, 0, .5] on items {0, 1} and on {2, 3}


def test_cross_half_by_hand():
    from layerprune.analyze.agreement import cross_half

    a, b = np.array([[1.0, 1.0, 0.0, 0.0]]), np.array([[0.0, 0.0, 1.0, 1.0]])  # items 0-1 against items 2-3
    self_ = cross_half(SWAPPING, SWAPPING, "mean", 0.2, a, b)  # [1, 0, .5] vs [0, 1, .5]; {0, 2} vs {1, 2}
    assert self_["spearman"][0] == pytest.approx(-1.0) and self_["jaccard"][0] == pytest.approx(1 / 3)
    cross = cross_half(SWAPPING, STEADY, "mean", 0.2, a, b)  # (+1 and -1) / 2; (1 and 1/3) / 2
    assert cross["spearman"][0] == pytest.approx(0.0) and cross["jaccard"][0] == pytest.approx(2 / 3)


def test_half_splits_are_disjoint_equal_and_seeded():
    from layerprune.analyze.agreement import half_splits

    splits = half_splits(9, 3, seed=4)
    again = half_splits(9, 3, seed=4)
    assert len(splits) == 3
    assert all((x == y).all() for s, t in zip(splits, again, strict=True) for x, y in zip(s, t, strict=True))
    for a, b in splits:
        assert len(a) == len(b) == 4 and not set(a) & set(b)
    with pytest.raises(ValueError, match="at least 4 items"):
        half_splits(3, 1, 0)


def test_split_half_agreement_averages_the_splits():
    from layerprune.analyze.agreement import cross_half, half_masks, half_splits, split_half_agreement

    out = split_half_agreement(SWAPPING, SWAPPING, "mean", 0.2, splits=3, seed=2)
    want = [cross_half(SWAPPING, SWAPPING, "mean", 0.2, a, b) for a, b in half_masks(4, half_splits(4, 3, 2))]
    assert out["spearman"] == pytest.approx(np.mean([w["spearman"][0] for w in want]))
    assert out["half_items"] == 2 and len(out["per_split"]["jaccard"]) == 3
    same = matrix([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # every item tells the same story: [1, 0, 1]
    steady = split_half_agreement(same, same, "mean", 0.2, splits=3)
    assert steady["spearman"] == pytest.approx(1.0) and steady["jaccard"] == pytest.approx(1.0)


def test_row_jaccard_is_undefined_on_an_undefined_drop_or_two_empty_sets():
    from layerprune.analyze.agreement import row_jaccard

    x = np.array([[0.5, 0.3, 0.0], [0.5, np.nan, 0.0], [0.0, 0.1, 0.0]])
    y = np.array([[0.5, 0.0, 0.3], [0.5, 0.0, 0.0], [0.1, 0.0, 0.0]])
    got = row_jaccard(x, y, 0.2)
    assert got[0] == pytest.approx(1 / 3) and np.isnan(got[1]) and np.isnan(got[2])


def test_row_spearman_equals_scipy_per_row():
    from layerprune.analyze.agreement import row_spearman

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 4, (6, 5)).astype(float), rng.normal(size=(6, 5))
    x[0], y[1, 2] = 1.0, np.nan
    got = row_spearman(x, y)
    assert np.isnan(got[0]) and np.isnan(got[1])  # constant row; undefined drop
    for r in range(2, 6):
        assert got[r] == pytest.approx(metrics.spearman(x[r].tolist(), y[r].tolist()))


def test_relative_agreement_is_one_for_a_copy_and_low_for_a_moved_block():
    from layerprune.analyze.agreement import relative_agreement

    killed = {1: list(range(0, 20)), 3: list(range(0, 20, 2))}
    first = per_item_matrix(correctness_result(killed))
    same = relative_agreement(first, first, "mean", 0.2, splits=2, resamples=100)
    assert same["spearman"]["ratio"] == pytest.approx(1.0) and same["jaccard"]["ratio"] == pytest.approx(1.0)
    assert same["jaccard"]["ratio_interval"] == pytest.approx([1.0, 1.0])
    moved = per_item_matrix(correctness_result({0: list(range(0, 20)), 3: list(range(0, 20, 2))}))
    out = relative_agreement(first, moved, "mean", 0.2, splits=2, resamples=100)
    assert out["jaccard"]["ratio"] == pytest.approx(1 / 3)  # {1, 3} vs {0, 3} on every half; reliability 1
    assert out["jaccard"]["reliability"] == [1.0, 1.0] and out["jaccard"]["ratio_interval"][1] < 0.9
    assert out["spearman"]["ratio"] < 0.9


def per_item_matrix(result: dict) -> tuple:
    from layerprune.analyze.agreement import per_item

    return per_item(result, "mean")


def test_score_shift_is_paired():
    from layerprune.analyze.agreement import score_shift

    out = score_shift(matrix([[1] * 4], [1, 0, 0, 0]), matrix([[1] * 4], [1, 1, 1, 0]), "mean", resamples=200)
    assert out["before"] == 0.25 and out["after"] == 0.75 and out["shift"] == 0.5
    low, high = out["interval"]
    assert 0 <= low <= 0.5 <= high <= 1  # per-item differences are 0 or 1


def _ci(value: float, low: float, high: float) -> dict:
    return {"value": value, "low": low, "high": high}


def _measure(ratio: float | None, low: float = 0.0, high: float = 0.0, control: tuple | None = None,
             control_ratio: tuple | None = None) -> dict:
    """A ratio_comparison: ratio with its interval [low, high], ratio - control and the control's own ratio."""
    if ratio is None:
        return {"ratio": None, "vs_ceiling": None, "vs_control": None, "control_vs_ceiling": None}
    return {"ratio": ratio, "vs_ceiling": _ci(ratio - 1, low - 1, high - 1),
            "vs_control": None if control is None else _ci(*control),
            "control_vs_ceiling": None if control_ratio is None else _ci(*(r - 1 for r in control_ratio))}


def _agreement(spearman: dict, jaccard: dict) -> dict:
    return {"spearman": spearman, "jaccard": jaccard}


def test_invariance_verdict_rules():
    """Paper A's verdict from intervals: against the ceiling (margin 0.9) and against the positive control."""
    from layerprune.core.paired import invariance_verdict

    moved, still = {"shift": 0.3, "interval": [0.2, 0.4]}, {"shift": 0.01, "interval": [-0.02, 0.04]}
    good = _agreement(_measure(0.97, 0.93, 1.0, (0.3, 0.2, 0.4), (0.6, 0.5, 0.7)), _measure(1.0, 0.95, 1.0))
    assert invariance_verdict(moved, good, True)["verdict"] == "invariant"
    out = invariance_verdict(still, good, True)  # a pair that did not move
    assert out["verdict"] == "not shown" and "target moved +1.0 points" in out["reasons"][0]
    assert invariance_verdict({"shift": 0.12, "interval": [-0.01, 0.25]}, good, True)["verdict"] == "not shown"
    out = invariance_verdict({"shift": -0.3, "interval": [-0.4, -0.2]}, good, True)
    assert out["verdict"] == "not shown" and "target moved -30.0 points" in out["reasons"][0]
    assert invariance_verdict(moved, good, False)["reasons"] == ["no positive control"]
    # a point below the bar is not a difference: its interval must lie below it (the GRPO accuracy case)
    wide = _agreement(_measure(0.79, 0.66, 1.05), _measure(0.92, 0.88, 1.0))
    out = invariance_verdict(moved, wide, True)
    assert out["verdict"] == "not shown" and "reaches across 0.9" in out["reasons"][0]
    below = _agreement(_measure(0.7, 0.6, 0.8, (0.1, 0.02, 0.2)), _measure(0.95, 0.92, 1.0))
    out = invariance_verdict(moved, below, True)
    assert out["verdict"] == "different" and "above the control" in out["reasons"][0]
    # the variant within the margin but not above the control, or the control itself within it: cannot fail
    level = _agreement(_measure(0.97, 0.93, 1.0, (0.01, -0.05, 0.07), (0.96, 0.92, 1.0)), _measure(None))
    out = invariance_verdict(moved, level, True)
    assert out["verdict"] == "not shown" and "cannot fail" in out["reasons"][0]
    passing = _agreement(_measure(0.99, 0.97, 1.0, (0.04, 0.03, 0.06), (0.95, 0.92, 0.99)), _measure(None))
    assert "cannot fail" in invariance_verdict(moved, passing, True)["reasons"][0]  # grpo factual: the control passes


def test_a_model_without_drops_is_not_compared_and_gets_no_verdict():
    """Below min_base_score the analysis gives no drops and an empty critical set: that is not 'no critical block',
    so neither the Jaccard point (0 against anything) nor the resamples' interval is reported, and the verdict is
    'not shown' even where the half-item ratios (which apply no floor) fall below the bar."""
    from layerprune.core.paired import invariance_verdict

    a = correctness_result({1: list(range(20)), 3: list(range(10))})
    floor = {**a, "drops": [None] * 4, "critical": [], "undefined": "full-model score 0.01 is below min_base_score"}
    out = profile_agreement(a, floor, "mean", 0.2, resamples=100)
    assert out["critical_jaccard"] is None and out["jaccard_interval"] is None and out["spearman_interval"] is None
    assert "below min_base_score" in out["undefined"]
    moved, low = {"shift": 0.3, "interval": [0.2, 0.4]}, _agreement(_measure(0.2, 0.1, 0.3), _measure(0.3, 0.2, 0.4))
    assert invariance_verdict(moved, low, True)["verdict"] == "different"
    out = invariance_verdict(moved, low, True, undefined=["variant: below the floor"])
    assert out == {"verdict": "not shown", "reasons": ["no drops to compare: variant: below the floor"]}


def test_the_ratio_s_resamples_share_their_items_across_the_splits():
    """One resample of the items for every split (an item's copies kept in its half), so the splits' estimates move
    together as the estimate's do: resampling each split's halves on draws of their own averaged that shared noise
    out, and the intervals came out about 35% too narrow (bench/bench_agreement_coverage.py). On 60 items whose
    profiles are noisy, the resampled ratios' spread is at least that of the ratio over independent item samples
    (1.55 times it here); the old construction's was 0.76 times it."""
    from layerprune.analyze.agreement import relative_agreement_draws

    base = 0.8 * (1 - np.r_[0.9, 0.6, 0.5, 0.35, 0.25, 0.1, 0.05, 0.3])
    other = 0.8 * (1 - np.r_[0.85, 0.3, 0.55, 0.1, 0.3, 0.25, 0.05, 0.35])

    def sample(p: np.ndarray, rng: np.random.Generator, items: int = 60) -> tuple:
        u = rng.random(items)
        flips = rng.random((len(p), items)) < 0.1
        return (u < 0.8).astype(float), ((u[None, :] < p[:, None]) ^ flips).astype(float), None

    estimates, spreads = [], []
    for trial in range(80):
        rng = np.random.default_rng(trial)
        out, draws = relative_agreement_draws(sample(base, rng), sample(other, rng), "mean", 0.2, splits=4,
                                              resamples=200, seed=trial)
        estimates.append(out["spearman"]["ratio"])
        spreads.append(np.nanstd(draws["spearman"]))
    assert np.mean(spreads) > np.std(estimates)
