"""`layerprune study limits-sweep-*`: the pruning-ratio sweep on a tiny model (one ranking, every k recovered, the
same items for every model, paired intervals), its schema, and the shipped recipes' dry runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, run_cli
from layerprune.pipeline.sweep import SweepStudy
from layerprune.recipe_loading import find_recipe, shipped_recipes

SWEEPS = sorted(p for (kind, _), p in shipped_recipes("sweep-study").items())


def tiny_sweep(model: Path, output: Path) -> dict:
    return {
        "name": "tiny-sweep", "model": str(model), "output": str(output), "ratios": [1, 2],
        "prune": {"drop": 2, "score": "ablation", "calib": "arithmetic", "calib_samples": 4},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "dolly", "samples": 8},
            "generate": {"max_new_tokens": 6, "batch_size": 4, "temperature": 0.0},
            "train": {"epochs": 1, "max_length": 128, "batch_size": 2, "eval_steps": 1, "logging_steps": 1,
                      "save_steps": 4, "held_out": 0.25},
            "lora": {"r": 4, "alpha": 8}}},
        "classification": ["arc_easy"],
        "probes": {"candidates": ["arith_1d_sum3", "copy_l3"], "items": 10, "low": 0.0, "high": 1.0},
        "gsm8k_gate": {"min_score": 1.0, "limit": 1},
        "evaluate": {"suite": "sweep-cpu", "batch_size": "4", "limit": 6, "max_gen_toks": 4},
    }


def test_tiny_sweep_cuts_one_ranking_recovers_every_k_and_pairs_every_model(capsys, tiny_llama, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(yaml.safe_dump(tiny_sweep(tiny_llama, tmp_path / "sweep"), sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "sweep"
    data = json.loads((root / "sweep.json").read_text())
    cuts = data["ranking"]
    assert len(cuts["1"]) == 1 and set(cuts["1"]) < set(cuts["2"])  # one ranking, nested cuts
    for k in (1, 2):
        report = json.loads((root / f"pruned-k{k}" / "prune_report.json").read_text())
        assert report["dropped"] == cuts[str(k)]
    calibration = json.loads((root / "probes_calibrated.json").read_text())
    assert calibration["stream"] == "calib" and set(calibration["kept"]) == {"arith_1d_sum3", "copy_l3"}
    summary = json.loads((root / "eval" / "recovered-k1" / "summary.json").read_text())
    assert {r["task"] for r in summary["results"] if r["headline"]} == {"arc_easy", "arith_1d_sum3", "copy_l3"}
    assert data["items"] == {"arc_easy": 6, "arith_1d_sum3": 6, "copy_l3": 6}  # gsm8k left out by its gate
    point = data["points"][0]
    drop = point["generative"]["drop"]
    assert drop["low"] <= drop["value"] <= drop["high"]
    assert set(data["curves"]) == {"1", "2"} and data["curves"]["1"]["tokens"] > 0
    # the teacher answered once; the second k reused its answers
    second = json.loads((root / "recovered-k2" / "recover_report.json").read_text())
    assert second["data"]["generation"]["generated"] == 0
    text = (root / "sweep.md").read_text()
    assert "(a)" in text and "(b)" in text and "| 1 | generative |" in text
    assert (root / "sweep.png").is_file() and (root / "sweep_loss.png").is_file()
    assert run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])[0] == 0  # complete: every stage skipped


def test_sweep_schema_demands_one_ranking(tiny_llama):
    data = tiny_sweep(tiny_llama, Path("x"))
    data["prune"]["drop"] = 3
    with pytest.raises(Exception, match="largest ratio"):
        SweepStudy.model_validate(data)
    data = tiny_sweep(tiny_llama, Path("x"))
    data["ratios"] = [2, 1]
    with pytest.raises(Exception, match="increasing"):
        SweepStudy.model_validate(data)
    data = tiny_sweep(tiny_llama, Path("x"))
    data["probes"]["candidates"] = ["arith_9d_add"]
    with pytest.raises(Exception, match="unknown probe task"):
        SweepStudy.model_validate(data)


def test_only_picks_tasks_of_the_suite_and_names_a_missing_one(capsys, tiny_llama, tmp_path):
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(tiny_llama), "--suite", "sweep-cpu", "--only",
                                    "arc_easy,boolq", "-o", str(tmp_path / "e")])
    assert_one_line_error(code, err, "suite 'sweep-cpu' has no task boolq")
    assert not (tmp_path / "e").exists()


def test_the_sweep_recipe_is_its_own_kind():
    assert find_recipe("limits-sweep-embedded")[0] == "sweep-study"
    assert ("study", "limits-sweep-embedded") not in shipped_recipes("study")


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_every_shipped_sweep_dry_runs(capsys, path, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli(capsys, ["study", str(path), "--dry-run", "--output", str(tmp_path / "s")])
    assert code == 0, err
    assert "pruning-ratio sweep" in out and "models evaluated: 11" in out and "memory plan:" in out
    assert ("total about" in out) == path.stem.endswith("embedded") and not (tmp_path / "s").exists()
    assert path.read_text().startswith(f"# layerprune study {path.stem} ")
    assert len(SWEEPS) == 5
    if path.stem == "limits-sweep-local-embedded":  # the local step's own budget and rate, not SFT's epochs
        assert "recovery at every k: local on 160" in out and "72 local steps, lr 0.001" in out
        assert "about 54k trained tokens per k" in out and "training 13 min" in out  # 72 x 4 x 188 at 340/s


def _figures(shares: dict[int, int], n: int = 200):  # noqa: ANN202 (labels, Figures)
    """Synthetic sweep: classification keeps everything, generative loses 100 of 150 right items at each k and the
    recovered model wins back shares[k] of them."""
    import numpy as np

    from layerprune.pipeline.paired_table import Figures

    rng = np.random.default_rng(0)
    labels = ["baseline", *(f"{r}-k{k}" for k in shares for r in ("pruned", "recovered"))]
    gen_base = np.r_[np.ones(150), np.zeros(n - 150)]
    cls_base = (rng.random(n) < 0.7).astype(float)
    gen, cls = [gen_base], [cls_base]
    for won in shares.values():
        pruned = gen_base.copy()
        pruned[:100] = 0
        recovered = pruned.copy()
        recovered[:won] = 1
        gen += [pruned, recovered]
        cls += [cls_base, cls_base]
    matrices = {"copy_l7": np.stack(gen), "piqa": np.stack(cls)}
    return labels, Figures(labels, matrices, {"copy_l7": 0.0, "piqa": 0.5},
                           {"classification": ["piqa"], "generative": ["copy_l7"]})


def test_sweep_verdicts_come_from_the_intervals():
    from types import SimpleNamespace

    from layerprune.pipeline import sweep_report

    study = SimpleNamespace(ratios=[1, 4])
    _, figures = _figures({1: 60, 4: 10})
    points = [sweep_report.point(study, figures, k) for k in study.ratios]
    gen = points[0]["generative"]
    assert gen["drop"]["value"] == pytest.approx(0.5) and gen["recovered_share"]["value"] == pytest.approx(0.6)
    assert gen["retention_recovered"]["value"] == pytest.approx(110 / 150)
    assert points[0]["classification"]["retention_recovered"]["value"] == pytest.approx(1.0)
    lines, tests = sweep_report.verdicts(study, figures, points)
    assert tests["a"]["holds"] and tests["b"]["holds"] and tests["b"]["difference"]["low"] > 0
    assert lines[0].startswith("(a)") and "HOLDS" in lines[0] and "HOLDS" in lines[1]
    # the same share at both k: (b) does not hold, and says so with its interval
    _, figures = _figures({1: 30, 4: 30})
    points = [sweep_report.point(study, figures, k) for k in study.ratios]
    lines, tests = sweep_report.verdicts(study, figures, points)
    assert not tests["b"]["holds"] and "does NOT hold" in lines[1] and "difference 0.0% [" in lines[1]
    assert "| 4 | generative |" in sweep_report.format_table(points)
