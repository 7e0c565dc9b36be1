"""Agreement of two importance profiles (Spearman, critical-set Jaccard) with bootstrap intervals, constructed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from layerprune.analyze import metrics
from layerprune.analyze.agreement import profile_agreement, resampled_drops
from layerprune.analyze.stats import bootstrap_indices, score


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
