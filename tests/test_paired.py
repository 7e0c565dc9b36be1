"""Paired statistics: a hand-computed discordant table, refusal to pair mismatched items, and the comparison that
pairs models on the samples evaluate writes (falling back to the unpaired figure, and saying why)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from layerprune.core import paired

BEFORE = np.array([1, 1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=float)
AFTER = np.array([1, 0, 1, 1, 1, 1, 1, 0, 0, 0], dtype=float)


def test_mcnemar_exact_p_is_the_two_sided_binomial_tail():
    assert paired.mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 2**10)  # 0.0215
    assert paired.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert paired.mcnemar_exact(1, 2) == 1.0 and paired.mcnemar_exact(0, 0) == 1.0
    assert paired.mcnemar_exact(7, 3) == paired.mcnemar_exact(3, 7)


def test_paired_difference_of_a_hand_computed_table():
    out = paired.difference(BEFORE, AFTER, resamples=4000, seed=1)
    # d = [0,-1,0,0,0,1,1,0,0,0]: mean 0.1, sum of squared deviations 7 * 0.01 + 1.21 + 2 * 0.81 = 2.9
    assert out["diff"] == pytest.approx(0.1)
    assert out["se"] == pytest.approx(math.sqrt(2.9 / 9) / math.sqrt(10))
    assert (out["b"], out["c"]) == (1, 2) and out["mcnemar_p"] == 1.0
    assert out["low"] < 0 < out["high"] and out["within_noise"] is True and out["n"] == 10
    again = paired.difference(BEFORE, AFTER, resamples=4000, seed=1)
    assert (again["low"], again["high"]) == (out["low"], out["high"])  # seeded


def test_pairing_is_more_sensitive_than_two_independent_errors_when_models_agree():
    rng = np.random.default_rng(0)
    base = (rng.random(400) < 0.6).astype(float)
    flipped = base.copy()
    flipped[np.flatnonzero(base == 1)[:30]] = 0  # 30 items lost, none won: a clear paired drop
    out = paired.difference(base, flipped)
    unpaired = math.hypot(base.std(ddof=1), flipped.std(ddof=1)) / math.sqrt(400)
    assert out["se"] < unpaired / 2.5
    assert out["high"] < 0 and not out["within_noise"] and (out["b"], out["c"]) == (30, 0)
    assert out["mcnemar_p"] == pytest.approx(2 / 2**30)


def test_clustered_bootstrap_averages_task_means_and_shares_have_intervals():
    small = np.array([[1, 1, 0, 1], [0, 0, 0, 1], [1, 0, 0, 1]], dtype=float)  # base, pruned, recovered
    large = np.tile(np.array([[1, 0], [0, 0], [1, 0]], dtype=float), (1, 50))
    boot = paired.bootstrap([small, large], resamples=500, seed=0)
    assert boot.point.shape == (3, 2) and boot.resampled.shape == (500, 3, 2)
    assert boot.point[0].tolist() == [0.75, 0.5]  # each task's own mean, not pooled over 104 items
    share = boot.interval(lambda m: paired.share(m[..., 0, :].mean(-1), m[..., 1, :].mean(-1), m[..., 2, :].mean(-1)))
    assert share["value"] == pytest.approx(((0.5 + 0.5) / 2 - (0.25 + 0) / 2) / ((0.75 + 0.5) / 2 - 0.125))
    assert share["low"] <= share["value"] <= share["high"]


def test_chance_normalised_retention():
    assert paired.normalised(np.array(0.25), np.array(0.5), 0.25) == pytest.approx(0.0)  # at chance: keeps nothing
    assert paired.normalised(np.array(0.4), np.array(0.5), 0.0) == pytest.approx(0.8)
    assert np.isnan(paired.normalised(np.array(0.3), np.array(0.25), 0.25))  # an original at chance: undefined


# --- the comparison, from the samples evaluate writes -------------------------------------------------------------

def _summary(values: dict[str, float], kind: str = "generative"):  # noqa: ANN202 (a Summary)
    from layerprune.evaluate import Summary, TaskResult

    rows = [TaskResult(task=t, kind=kind, metric="exact_match", value=v, stderr=math.sqrt(v * (1 - v) / 10), n=10,
                       headline=True, settings={"limit": 10}, seconds=1.0) for t, v in values.items()]
    return Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash="h", results=rows)


def _samples(folder: Path, task: str, scores: np.ndarray, prompts: str = "p") -> Path:
    (folder / "samples").mkdir(parents=True, exist_ok=True)
    with (folder / "samples" / f"{task}.jsonl").open("w") as handle:
        for i, value in enumerate(scores):
            handle.write(json.dumps({"doc_id": i, "filter": "none", "exact_match": float(value),
                                     "doc_hash": f"d{i}", "prompt_hash": f"{prompts}{i}"}) + "\n")
    return folder


def test_comparison_pairs_items_and_refuses_mismatched_ones(tmp_path):
    from layerprune.evaluate import compare

    base, pruned = BEFORE, np.array([0, 0, 1, 1, 1, 0, 0, 0, 0, 0], dtype=float)
    folders = {"baseline": _samples(tmp_path / "b", "arith_1dc", base),
               "pruned": _samples(tmp_path / "p", "arith_1dc", pruned)}
    summaries = {"baseline": _summary({"arith_1dc": 0.5}), "pruned": _summary({"arith_1dc": 0.3})}
    row = compare(summaries, folders=folders)["rows"][0]
    drop = row["pruned_vs_baseline"]
    assert row["pairing"].startswith("paired (10 items")
    assert (drop["b"], drop["c"]) == (2, 0) and drop["se"] == pytest.approx(paired.paired_se(base, pruned))
    assert drop["mcnemar_p"] == pytest.approx(0.5)
    # another item set under the same settings: refused in one line before anything is written (issue 56; before,
    # the row quietly fell back to the unpaired figure)
    from layerprune.core.errors import LayerpruneError

    _samples(tmp_path / "p", "arith_1dc", np.append(pruned, 1.0))
    with pytest.raises(LayerpruneError, match=r"^models scored on different items: baseline and pruned on arith_1dc "
                       r"differ in 1 item\(s\)[^\n]*$"):
        compare(summaries, tmp_path / "out", folders=folders)
    assert not (tmp_path / "out").exists()
    # the same doc ids asked with other prompts (say, another chat template) are not the same items
    _samples(tmp_path / "p", "arith_1dc", pruned, prompts="q")
    with pytest.raises(LayerpruneError, match=r"baseline and pruned on arith_1dc differ in 10 item\(s\)"):
        compare(summaries, folders=folders)
    # roles run with different settings are flagged as not comparable, left unpaired: not refused
    other = _summary({"arith_1dc": 0.3})
    other.results[0].settings["limit"] = 11
    row = compare({"baseline": summaries["baseline"], "pruned": other}, folders=folders)["rows"][0]
    assert row["settings_differ"] and row["pairing"] == "unpaired: the roles ran with different settings"


def test_averages_are_paired_and_clustered_and_missing_errors_stay_unknown(tmp_path):
    from layerprune.evaluate import compare

    rng = np.random.default_rng(3)
    folders = {role: tmp_path / role for role in ("baseline", "pruned", "recovered")}
    values: dict[str, dict[str, float]] = {role: {} for role in folders}
    for task, size in (("arith_1dc", 10), ("brackets_d5", 10)):
        base = (rng.random(size) < 0.7).astype(float)
        scores = {"baseline": base, "pruned": base * 0, "recovered": base * (rng.random(size) < 0.5)}
        for role, vector in scores.items():
            _samples(folders[role], task, vector)
            values[role][task] = float(vector.mean())
    report = compare({role: _summary(v) for role, v in values.items()}, folders=folders)
    avg = report["averages"][0]
    assert avg["pairing"].startswith("paired (20 items") and avg["clear_drop"] is True
    share = avg["intervals"]["recovered_share"]
    assert share["low"] <= avg["recovered_share"] <= share["high"]
    assert "retention recovered (chance-norm.)" in report["table"]


# --- models scored on different items are refused, not paired on a subset (issue 56) -------------------------------

def test_differing_items_counts_ids_in_one_record_only_other_hashes_and_repeated_ids():
    from layerprune.core.errors import LayerpruneError

    base = [(f"/{i}", f"d{i}:p{i}") for i in range(10)]
    assert paired.differing_items(base, list(reversed(base))) == 0  # the order does not matter
    assert paired.differing_items(base, base[2:] + [("/10", "d10:p10"), ("/11", "d11:p11")]) == 4
    assert paired.differing_items(base, base[:3] + [("/3", "d3:q3")] + base[4:]) == 1  # same id, another prompt
    assert paired.differing_items(base, base + base[:2]) == 2  # items 0 and 1 recorded twice
    paired.check_same_items("arith_1dc", {"baseline": base, "pruned": list(base)})  # the same items: no error
    with pytest.raises(LayerpruneError, match=r"^models scored on different items: baseline and kd on "
                       r"arith_1dc differ in 4 item\(s\)"):
        paired.check_same_items("arith_1dc", {"baseline": base, "pruned": base, "kd": base[4:]})


def _scored(folder: Path, scores: dict[str, np.ndarray], ids: dict[str, list[int]] | None = None) -> Path:
    """A model's folder: summary.json (its headlines) and samples/<task>.jsonl, item i under doc id ids[task][i]."""
    from layerprune.evaluate.summary import write_summary

    for task, values in scores.items():
        (folder / "samples").mkdir(parents=True, exist_ok=True)
        docs = (ids or {}).get(task, list(range(len(values))))
        (folder / "samples" / f"{task}.jsonl").write_text("".join(
            json.dumps({"doc_id": d, "filter": "none", "exact_match": float(v), "doc_hash": f"d{d}",
                        "prompt_hash": f"p{d}"}) + "\n" for d, v in zip(docs, values, strict=True)))
    write_summary(folder, _summary({task: float(np.mean(v)) for task, v in scores.items()}))
    return folder


def test_a_sweep_refuses_models_scored_on_different_items_instead_of_leaving_the_task_out(tmp_path):
    """Planted records: kd-k1 was scored on other copy_l7 items (doc ids 5..44, not 0..39), then on copy_l7's items
    with two of them recorded twice; the sweep used to leave copy_l7 out and pair the rest (or pair the repeated rows
    by their last record)."""
    from layerprune.core.errors import LayerpruneError
    from layerprune.pipeline.studies.figures import items_of, study_figures

    rng = np.random.default_rng(0)
    scores = {label: {"copy_l7": (rng.random(40) < 0.6).astype(float), "arith_1dc": (rng.random(40) < 0.5) * 1.0}
              for label in ("baseline", "pruned-k1", "kd-k1")}
    folders = {label: _scored(tmp_path / label, s) for label, s in scores.items()}
    figures, _ = study_figures(folders)  # the same items: paired
    assert set(figures.tasks) == {"copy_l7", "arith_1dc"} and figures.labels == ["baseline", "pruned-k1", "kd-k1"]
    _scored(folders["kd-k1"], scores["kd-k1"], {"copy_l7": list(range(5, 45))})
    with pytest.raises(LayerpruneError, match=r"^models scored on different items: baseline and kd-k1 on copy_l7 "
                       r"differ in 10 item\(s\)"):
        study_figures(folders)
    joined, _ = study_figures(folders, common=True)  # a join across runs pairs on the items in common, as stated
    assert items_of(joined)["copy_l7"] == 35 and joined.matrices[joined.tasks.index("copy_l7")].shape[0] == 3
    twice = {"copy_l7": np.r_[scores["kd-k1"]["copy_l7"], [1.0, 1.0]], "arith_1dc": scores["kd-k1"]["arith_1dc"]}
    _scored(folders["kd-k1"], twice, {"copy_l7": [*range(40), 0, 1]})
    with pytest.raises(LayerpruneError, match=r"baseline and kd-k1 on copy_l7 differ in 2 item\(s\)"):
        study_figures(folders)


def test_an_agreement_interval_is_given_only_where_it_holds_its_estimate():
    """A statistic whose resamples sit to one side of it (paper A's Jaccard ratio 0.42 with a percentile interval
    [0.43, 0.52]): the percentile interval where the estimate lies within the central 95% of its draws (then it holds
    it), none where it lies outside or over 5% of the draws are undefined (a ratio over a ceiling of 0.09, undefined
    on 27% of its resamples, had the interval [0.10, 3.71])."""
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(200_000)
    out = paired.checked_interval(0.0, 0.5 + noise)
    plain = paired.percentile_interval(0.0, 0.5 + noise)
    assert (out["low"], out["high"]) == (plain["low"], plain["high"]) and out["low"] <= 0.0 <= out["high"]
    assert out["bias"] == pytest.approx(0.5, abs=0.01)
    above = paired.checked_interval(0.42, np.linspace(0.43, 0.52, 100))
    assert above["low"] is None and "100.0% of the resampled values lie above" in above["undetermined"]
    edge = paired.checked_interval(0.0, np.concatenate([[-1.0] * 2, np.linspace(0.1, 1.0, 98)]))
    assert edge["low"] is None and "98.0%" in edge["undetermined"]
    for shift in (0.0, 0.5, 1.0, 1.9):  # within the central 95%: the interval holds the value
        ci = paired.checked_interval(0.0, shift + noise[:5000])
        assert ci["low"] <= 0.0 <= ci["high"]
    assert paired.checked_interval(None, noise)["low"] is None
    with_nan = paired.checked_interval(0.0, np.concatenate([noise[:1000], [np.nan] * 40]))
    assert with_nan["undefined"] == pytest.approx(40 / 1040) and with_nan["low"] < 0 < with_nan["high"]
    mostly_nan = paired.checked_interval(0.0, np.concatenate([noise[:1000], [np.nan] * 370]))
    assert mostly_nan["low"] is None and "undefined on 27.0% of the resamples" in mostly_nan["undetermined"]


def test_ratio_comparison_and_agreements_use_the_checked_interval():
    """Paper A's ratio - 1 and ratio - control read the checked interval, as the agreements' intervals do."""
    from layerprune.analyze.agreement import agreement_interval

    rng = np.random.default_rng(1)
    draws = 0.5 + 0.02 + 0.02 * rng.standard_normal(20_000)  # resamples read the ratio 0.02 too high
    out = paired.ratio_comparison(0.5, draws, (0.8, 0.8 + 0.02 * rng.standard_normal(20_000)))
    assert out["vs_ceiling"]["high"] == pytest.approx(-0.5 + 0.02 + 1.96 * 0.02, abs=0.005)
    assert out["vs_control"]["high"] < -0.3 + 0.02 + 2 * 1.96 * 0.02
    assert agreement_interval(0.5, draws, 0.05)[1] == pytest.approx(0.5 + 0.02 + 1.96 * 0.02, abs=0.005)
    assert agreement_interval(0.5, [None, 0.6, 0.7], 0.05) is None  # every draw above: no interval
    assert agreement_interval(0.5, draws + 0.1, 0.05) is None  # the estimate below 97.5% of its draws
    assert paired.ratio_comparison(0.5, draws + 0.1, None)["vs_ceiling"]["low"] is None
