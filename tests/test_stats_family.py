"""core/paired.py's family-wise intervals, the bounded share and the run-variance flag (issue 56)."""

from __future__ import annotations

import numpy as np
import pytest

from layerprune.core import paired


def test_holm_intervals_step_down_by_hand():
    """Three differences, 4000 draws each: the clearest tested at alpha / 3, the next at alpha / 2 while the first
    was declared, the step-down stops at the first not declared and the rest keep its level."""
    rng = np.random.default_rng(0)
    family = {"clear": (1.0, rng.normal(1.0, 0.3, 4000)), "edge": (0.5, rng.normal(0.5, 0.24, 4000)),
              "none": (0.1, rng.normal(0.1, 0.5, 4000))}
    out = paired.holm_intervals(family, 0.05)
    assert out["clear"]["level"] == pytest.approx(1 - 0.05 / 3) and out["clear"]["declared"]
    assert out["edge"]["level"] == pytest.approx(1 - 0.05 / 2)
    expected = 1 - 0.05 if out["edge"]["declared"] else out["edge"]["level"]
    assert out["none"]["level"] == pytest.approx(expected)
    assert not out["none"]["declared"] and out["none"]["low"] < 0 < out["none"]["high"]
    # the unadjusted 95% interval of "edge" excludes 0 (0.5 / 0.24 = 2.1 SDs); Holm's at 97.5% does too only if
    # its p is under 0.025: the decision and the interval agree either way
    assert out["edge"]["declared"] == (out["edge"]["low"] > 0) == (out["edge"]["p_holm"] < 0.05)
    for row in out.values():
        assert row["family"] == 3 and (row["p_holm"] < 0.05) == row["declared"]
    undefined = paired.holm_intervals({"a": (float("nan"), np.full(1, np.nan)), **family})
    assert undefined["a"]["low"] is None and not undefined["a"]["declared"] and undefined["clear"]["family"] == 4


def test_holm_adjusted_p_values():
    assert paired.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert paired.bootstrap_p(np.array([0.1, 0.2, 0.3, -0.1])) == (0.5, "above")


def test_a_share_over_a_drop_near_zero_is_unbounded_not_a_ratio():
    assert paired.share_state({"low": -0.01, "high": 0.05}) == paired.NO_CLEAR_DROP
    assert paired.share_state({"low": 0.015, "high": 0.15}).startswith("unbounded (the drop's interval [1.5, 15.0]")
    assert paired.share_state({"low": 0.03, "high": 0.15}) is None
    assert paired.share_state({"low": 0.015, "high": 0.15}, margin=0.01) is None


def test_the_demo_table_prints_an_unbounded_share_as_unbounded():
    """The demo's arc_easy: a drop of 8.5 points [1.5, 15.0] won back '11.8% [-150.0, 66.7]'; now unbounded."""
    from layerprune.evaluate.paired_figures import task_figures
    from layerprune.pipeline.report_glance import glance_table

    base = np.zeros(200)
    base[:100] = 1
    pruned, recovered = base.copy(), base.copy()
    pruned[:9], recovered[:7] = 0, 0  # a 4.5-point drop on 200 items: its interval reaches about 1.5 points
    figures = task_figures(["baseline", "pruned", "recovered"], [(np.stack([base, pruned, recovered]), np.zeros(200))])
    assert isinstance(figures["recovered_share"], str) and figures["recovered_share"].startswith("unbounded")
    row = {"task": "t", "kind": "generative", "n": {"baseline": 200}, "baseline": 0.5, "pruned": 0.455,
           "recovered": 0.465, "clear_drop": True, "recovered_share_note": figures["recovered_share"]}
    assert "unbounded" in glance_table([row], [], ["baseline", "pruned", "recovered"])


def test_the_run_variance_share_says_where_it_is_estimated_at_zero():
    rng = np.random.default_rng(1)
    truth = (rng.random(300) < 0.5).astype(float)
    alike = np.stack([np.where(rng.random(300) < 0.05, 1 - truth, truth) for _ in range(3)])  # item noise only
    apart = np.stack([np.clip(truth + (rng.random(300) < p), 0, 1) for p in (0.0, 0.3, 0.6)])  # real run effects
    spread = paired.spread([alike, apart], [0, 1, 2], [0])
    assert spread["run_variance"] == {"share": 0.0, "zero": 1, "tasks": 1}
    assert "estimated at 0 on 1 of 1" in paired.run_variance_note(spread)
    both = paired.spread([alike, apart], [0, 1, 2])["run_variance"]
    assert both["zero"] == 1 and both["tasks"] == 2 and 0 < both["share"] <= 0.5
    assert "run_variance" not in paired.spread([alike], [0])
