"""budget.md of a sweep with budgets (issue 58): the curves' comparisons (paired and Holm), the dedicated runs against
their checkpoints, the verdicts with the positive control's gate, and a study scored in part; on planted per-item
records in the layout the sweep writes (eval/<model>/summary.json and samples/<task>.jsonl)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.pipeline.results import study_kind
from layerprune.pipeline.stages import RunPaths, claim_run_dir
from layerprune.pipeline.studies import sweep, sweep_cells
from layerprune.pipeline.studies.budget_report import write_budget_report
from layerprune.pipeline.studies.sweep_grid import SweepStudy
from layerprune.pipeline.studies.sweep_join import read_sweep

BUDGETS = [8000, 32000, 128000, 256000]
TAGS = ["@8k", "@32k", "@128k", ""]
ITEMS = 200
ARMS = {"sft": {"method": "lora"}, "kd": {"method": "kd"},
        "local": {"method": "local", "local": {"steps": 2, "learning_rate": 1.0e-3}}, "kd-arith": {"method": "kd"}}
FLAT, RISING = [0.30, 0.31, 0.31, 0.30], [0.05, 0.20, 0.45, 0.70]  # shares of the drop at each budget
CONTROL = [0.30, 0.55, 0.80, 0.90]


def _study(model: Path, output: Path, **fields: object) -> SweepStudy:
    train = {"epochs": 6, "warmup_steps": 1, "max_length": 128, "batch_size": 2, "eval_steps": 1, "logging_steps": 1,
             "save_steps": 4, "held_out": 0.25}
    return SweepStudy.model_validate({
        "name": "tiny-budget", "model": str(model), "output": str(output), "ratios": [1, 2],
        "prune": {"drop": 2, "score": "ablation", "calib": "arithmetic", "calib_samples": 4},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "dolly", "samples": 8},
            "generate": {"max_new_tokens": 6, "batch_size": 4, "temperature": 0.0, "chat_template": False},
            "train": train, "lora": {"r": 4, "alpha": 8}}},
        "classification": ["arc_easy"],
        "probes": {"candidates": ["arith_2d_sub"], "items": 10, "low": 0.0, "high": 1.0},
        "gsm8k_gate": {"min_score": 1.0, "limit": 1},
        "evaluate": {"suite": "sweep-cpu", "batch_size": "4", "limit": 6, "max_gen_toks": 4},
        "arms": ARMS, "arm_prompts": {"kd-arith": {"source": "probes:arith_2d_sub"}}, "budgets": BUDGETS,
        "dedicated_at": 32000, "replicates": 3, "controls": True, **fields})


def _eval_folder(folder: Path, rows: dict[str, tuple[str, list[float]]], model_hash: str | None = None) -> None:
    """A synthetic eval folder as the sweep writes it: summary.json and samples/TASK.jsonl of per-item scores (the
    model hash: the folder's name unless given)."""
    from layerprune.evaluate import Summary, TaskResult

    (folder / "samples").mkdir(parents=True)
    results = []
    for task, (kind, scores) in rows.items():
        metric = "acc" if kind == "classification" else "exact_match"
        with (folder / "samples" / f"{task}.jsonl").open("w") as handle:
            for i, value in enumerate(scores):
                handle.write(json.dumps({"doc_id": i, "filter": "none", metric: value, "doc_hash": f"d{i}",
                                         "prompt_hash": f"p{i}", "arguments": [["q", "a"], ["q", "b"]]}) + "\n")
        results.append(TaskResult(task=task, kind=kind, metric=metric, value=sum(scores) / len(scores), stderr=None,
                                  n=len(scores), headline=True, settings={}, seconds=1.0))
    summary = Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash=model_hash or folder.name,
                      results=results)
    (folder / "summary.json").write_text(summary.model_dump_json())


BASE = np.r_[np.ones(180), np.zeros(ITEMS - 180)]
PRUNED = np.r_[np.ones(20), np.zeros(ITEMS - 20)]  # a drop of 160 items (80 points)
CLS = (np.random.default_rng(5).random(ITEMS) < 0.6).astype(float)  # arc_easy: no model changes it


def _winning(share: float, replicate: int, offset: int = 0) -> np.ndarray:
    """The pruned model's answers with `share` of the drop won back (replicate r: a run-to-run jitter of 2 items;
    `offset`: another set of items of the same size)."""
    scores = PRUNED.copy()
    scores[20 + offset:20 + offset + round(share * 160) + 2 * (replicate - 1)] = 1
    return scores


def _plant(root: Path, models: dict[str, np.ndarray], skip: set[str] = frozenset()) -> None:
    for label, scores in models.items():
        if label not in skip:
            _eval_folder(root / "eval" / label, {"arith_2d_sub": ("generative", scores.tolist()),
                                                 "arc_easy": ("classification", CLS.tolist())})


def _models(curves: dict[str, list[float]], dedicated: dict[str, float], replicates: int = 3) -> dict[str, np.ndarray]:
    """baseline, pruned-k1, each arm's budget points at k = 1 per replicate, the k = 0 controls (no change on the
    original) and the dedicated runs at 32k (their share of the drop)."""
    out = {"baseline": BASE, "pruned-k1": PRUNED}
    for r in range(replicates):
        rr = f"@r{r}" if r else ""
        for arm, shares in curves.items():
            out |= {f"{arm}-k1{tag}{rr}": _winning(share, r, 3 * i)
                    for i, (tag, share) in enumerate(zip(TAGS, shares, strict=True))}
            if arm != "local":
                out[f"{arm}-k0{rr}"] = BASE
        out |= {f"{arm}-k1@32k-dedicated{rr}": _winning(share, r, 5) for arm, share in dedicated.items()}
    return out


CURVES = {"sft": FLAT, "kd": RISING, "local": FLAT, "kd-arith": CONTROL}
AGREEING = {"sft": FLAT[1], "kd": RISING[1] + 0.25, "kd-arith": CONTROL[1]}  # kd's dedicated run: 25 points more


def test_the_default_family_gives_each_curve_contrast_its_paired_and_holm_interval(tiny_llama, tmp_path):
    """No budget family declared: each task's default family (rise, arm against arm, net of the control), Holm over
    it; a rising arm's rise is declared, a flat arm's is not. (No comparisons in budget.md before: a new feature.)"""
    study = _study(tiny_llama, tmp_path / "s")
    _plant(tmp_path / "s", _models(CURVES, AGREEING))
    text = write_budget_report(study, tmp_path / "s").read_text()
    data = json.loads((tmp_path / "s" / "budget.json").read_text())
    assert data["families"] == {} and set(data["default_families"]) == {"arith_2d_sub", "arc_easy"}
    family = {c["name"]: c for c in data["default_families"]["arith_2d_sub"]["contrasts"]}
    size = 4 * 2 + 6 * 2 + 3 * 2  # rise per arm, pairs of arms, net of the control (not local) at k = 1, 2
    assert len(family) == size and {c["holm"]["family"] for c in family.values()} == {size}
    rise, flat = family["kd-k1-rise-arith_2d_sub"], family["sft-k1-rise-arith_2d_sub"]
    assert rise["interval"]["value"] == pytest.approx(RISING[-1] - RISING[0], abs=0.01) and rise["holm"]["declared"]
    assert flat["interval"]["low"] < 0 < flat["interval"]["high"] and not flat["holm"]["declared"]
    assert flat["b_budget"] == 8000 and flat["budget"] is None  # the largest minus the smallest
    pair = family["sft-vs-kd-k1-arith_2d_sub"]
    assert pair["interval"]["value"] == pytest.approx(FLAT[-1] - RISING[-1], abs=0.01) and pair["holm"]["declared"]
    net = family["sft-k1-net-arith_2d_sub"]  # the control does not move the original: net = the share itself
    assert net["interval"]["value"] == pytest.approx(FLAT[-1], abs=0.01) and "local-k1-net-arith_2d_sub" not in family
    assert family["sft-k2-rise-arith_2d_sub"]["interval"].startswith("n/a (")  # k = 2 not scored: n/a, in the family
    assert rise["holm"]["low"] <= rise["interval"]["low"]
    assert "declares no confirmatory budget comparison" in text
    assert "Default comparisons, family arith_2d_sub (26" in text
    line = next(x for x in text.splitlines() if x.startswith("- kd-k1-rise-arith_2d_sub:"))
    assert "kd at k = 1 and the largest budget - kd at k = 1 and 8000 tokens" in line and "differ (Holm)" in line


def test_a_declared_budget_family_replaces_the_default_and_stays_out_of_sweep_md(tiny_llama, tmp_path):
    """A family naming a task or budget is budget.md's: drawn there with its own Holm, the default family then not
    drawn; sweep.md's draw leaves it out and keeps its own default family. (New: Contrast had no task or budget.)"""
    from layerprune.pipeline.studies.comparisons import draw_families, uses_default_family

    main = [{"name": "kd-rise", "a": "kd", "at": 1, "budget": 128000, "b_budget": 8000, "task": "arith_2d_sub"},
            {"name": "kd-vs-sft-32k", "a": "kd", "b": "sft", "at": 1, "budget": 32000, "task": "arith_2d_sub"}]
    study = _study(tiny_llama, tmp_path / "s", comparisons={"main": main})
    _plant(tmp_path / "s", _models(CURVES, AGREEING))
    text = write_budget_report(study, tmp_path / "s").read_text()
    data = json.loads((tmp_path / "s" / "budget.json").read_text())
    assert data["default_families"] == {} and list(data["families"]) == ["main"]
    drawn = {c["name"]: c for c in data["families"]["main"]["contrasts"]}
    assert drawn["kd-rise"]["interval"]["value"] == pytest.approx(RISING[2] - RISING[0], abs=0.01)
    assert drawn["kd-vs-sft-32k"]["interval"]["value"] == pytest.approx(RISING[1] - FLAT[1], abs=0.01)
    assert {c["holm"]["family"] for c in drawn.values()} == {2} and "Declared comparisons, family main (2" in text
    assert uses_default_family(study.comparisons) and draw_families(study.comparisons, None, str) == {}  # sweep.md's
    with pytest.raises(ValueError, match="a family's contrasts either all name a task or a budget"):
        _study(tiny_llama, tmp_path / "s", comparisons={"mixed": [main[0], {"a": "kd", "b": "sft", "at": 1}]})
    with pytest.raises(ValueError, match=r"comparisons.f.kd-rise: budget 16000 is not one of budgets \(8000"):
        _study(tiny_llama, tmp_path / "s", comparisons={"f": [{**main[0], "b_budget": 16000}]})  # refused on load


def test_a_dedicated_run_is_paired_with_its_checkpoint_per_task(tiny_llama, tmp_path):
    """At dedicated_at and k = lr_k, dedicated - checkpoint per task with its interval: 'agrees' where it holds 0,
    'differs' where not; local (no trainer) has no dedicated run. (The line did not exist before: a new feature.)"""
    study = _study(tiny_llama, tmp_path / "s")
    _plant(tmp_path / "s", _models(CURVES, AGREEING))
    text = write_budget_report(study, tmp_path / "s").read_text()
    rows = {r["arm"]: r for r in json.loads((tmp_path / "s" / "budget.json").read_text())["dedicated"]}
    assert set(rows) == {"sft", "kd", "kd-arith"} and rows["kd"]["checkpoint"] == "kd-k1@32k"
    assert rows["kd"]["dedicated"] == "kd-k1@32k-dedicated" and rows["kd"]["replicates"] == [0, 1, 2]
    kd, sft = rows["kd"]["tasks"]["arith_2d_sub"], rows["sft"]["tasks"]["arith_2d_sub"]
    assert kd["verdict"] == "differs" and kd["difference"]["value"] == pytest.approx(0.25 * 0.8, abs=0.01)
    assert kd["difference"]["low"] > 0
    assert sft["verdict"] == "agrees" and sft["difference"]["value"] == pytest.approx(0.0)
    assert sft["difference"]["low"] < 0 < sft["difference"]["high"]
    assert rows["kd"]["tasks"]["arc_easy"]["verdict"] == "agrees"
    assert kd["holm"]["family"] == 2 and kd["holm"]["low"] <= kd["difference"]["low"]  # Holm over the 2 tasks
    assert "## Dedicated runs against their checkpoints (32000 tokens, k = 1)" in text
    assert "- kd-k1@32k-dedicated - kd-k1@32k (replicates 0, 1, 2): arith_2d_sub 20.0% [" in text
    assert "(Holm 20.0% [" in text and not rows["sft"]["identical"] and "the same weights" not in text
    for r in ("", "@r1", "@r2"):  # the dedicated runs as the checkpoints' own weights: one model, bit for bit
        folder = tmp_path / "s" / "eval" / f"sft-k1@32k-dedicated{r}"
        shutil.rmtree(folder)
        _eval_folder(folder, {"arith_2d_sub": ("generative", _winning(FLAT[1], int(r[2:] or 0), 3).tolist()),
                              "arc_easy": ("classification", CLS.tolist())}, model_hash=f"sft-k1@32k{r}")
    text = write_budget_report(study, tmp_path / "s").read_text()
    rows = {r["arm"]: r for r in json.loads((tmp_path / "s" / "budget.json").read_text())["dedicated"]}
    assert rows["sft"]["identical"] and not rows["kd"]["identical"]
    assert rows["sft"]["tasks"]["arith_2d_sub"]["difference"]["value"] == 0
    line = next(x for x in text.splitlines() if x.startswith("- sft-k1@32k-dedicated - sft-k1@32k"))
    assert line.endswith("; the same weights in every pair (the model hashes of their evaluations are equal: a "
                         "difference of 0 by construction)")


def test_a_positive_control_under_half_means_the_instrument_cannot_show_a_limit(tiny_llama, tmp_path):
    """The control wins back 40% of the subtraction drop at the largest budget: a flat arm whose a stays under 50% is
    'not shown', and the report says why. (The verdict was already right before; the reason beside it is new.)"""
    study = _study(tiny_llama, tmp_path / "s")
    _plant(tmp_path / "s", _models({**CURVES, "kd-arith": [0.1, 0.2, 0.35, 0.4]}, AGREEING))
    text = write_budget_report(study, tmp_path / "s").read_text()
    data = json.loads((tmp_path / "s" / "budget.json").read_text())
    assert data["verdicts"]["sft-k1"] == "not shown" and data["gates"][0]["reached"] is False
    assert "but the positive control: won back under 50% of the drop, so the instrument cannot show a limit" in text
    _plant(tmp_path / "t", _models(CURVES, AGREEING))  # the same arm beside a control that reaches half
    assert json.loads((write_budget_report(study, tmp_path / "t").parent / "budget.json").read_text())[
        "verdicts"]["sft-k1"] == "limit structural at this scale"


def test_a_control_short_of_its_replicates_is_not_judged_and_the_tokens_carry_their_interval(tiny_llama, tmp_path):
    """The control scored on r0 alone at its largest budget: 'not judged yet', no structural limit beside it (before:
    the gate passed on one run). The tokens for 25% and 50% carry their interval over the refits, and a share reached
    at or under the smallest budget reads '<= 8k' (before: a bare point, '0k' for a fit reaching it at 30 tokens)."""
    study = _study(tiny_llama, tmp_path / "s")
    _plant(tmp_path / "s", _models(CURVES, AGREEING), {"kd-arith-k1@r1", "kd-arith-k1@r2"})
    text = write_budget_report(study, tmp_path / "s").read_text()
    data = json.loads((tmp_path / "s" / "budget.json").read_text())
    gate = data["gates"][0]
    assert gate["pending"] and not gate["reached"] and gate["why"] == "kd-arith-k1 holds 1 of its 3 replicates yet"
    assert data["verdicts"]["sft-k1"] == "not shown"
    assert "but the positive control is not judged yet (kd-arith-k1 holds 1" in data["verdict_reasons"]["sft-k1"]
    assert "at k = 1: " in text and ": not judged yet (kd-arith-k1 holds 1 of its 3 replicates yet)" in text
    curves = {(c["arm"], c["task"]): c for c in data["curves"] if c["k"] == 1}
    half = curves["kd", "arith_2d_sub"]["tokens_for"]["0.5"]
    assert 128000 < half["value"] < 256000 and half["low"] < half["value"]
    assert half["high"] is None or half["high"] > half["value"]
    flat = curves["sft", "arith_2d_sub"]["tokens_for"]
    assert flat["0.25"]["value"] < 8000 and flat["0.5"] == {"value": None, "low": None, "high": None}
    line = next(x for x in text.splitlines() if x.startswith("| sft | 1 | arith_2d_sub |"))
    assert "| <= 8k [<= 8k, " in line and line.split("|")[-3] == " not reached "  # 50% at, before the run variance


def test_a_still_linear_fit_extrapolates_its_asymptote_and_is_never_a_structural_limit():
    """A curve falling along the budgets fits t at the grid's top (still linear) and a far below 0: a is extrapolated,
    not measured, so a's upper end under 50% is no structural limit. Before: 'limit structural at this scale' beside
    a table saying 'undetermined (still linear)'."""
    from layerprune.pipeline.studies.budget_fit import SCALES, saturating_fit
    from layerprune.pipeline.studies.budget_report import verdict

    a, t = saturating_fit(np.array(BUDGETS, dtype=float), np.array([0.02, 0.01, 0.0, -0.03]))
    assert t == SCALES[-1] and a < -1
    gate = {"reached": True, "why": ""}
    linear = {"asymptote": {"value": float(a), "low": float(a) - 1, "high": 0.2}, "scale": float(t),
              "rising": {"value": -0.03, "low": -0.06, "high": 0.0}, "replicates": 3}
    assert verdict(linear, gate, 3)[0] == "not shown"
    assert verdict({**linear, "scale": 1e5}, gate, 3)[0] == "limit structural at this scale"
    assert verdict({"fit": "none: 2 budgets for the fit's 2 parameters"}, gate, 3) == (
        "not shown", "no fit: 2 budgets for the fit's 2 parameters")
    one = verdict({**linear, "scale": 1e5, "replicates": 1}, gate, 3)  # one run's checkpoints: no run variance in a
    assert one == ("not shown", "the fit holds 1 of the 3 replicates: no verdict before every run is in its interval")


def test_a_curve_still_rising_at_its_largest_budget_is_never_a_structural_limit():
    """Shares growing by a step a doubling (10, 20, 30, 35%) fit the saturating form with a determined a just under
    the last point (t inside its grid): with the paired step to the largest budget above 0 the curve has not levelled
    off, so a's upper end under 50% is the form's, not a measured plateau. Before: 'limit structural at this scale'."""
    from layerprune.pipeline.studies.budget_fit import SCALES, saturating_fit
    from layerprune.pipeline.studies.budget_report import verdict

    a, t = saturating_fit(np.array(BUDGETS, dtype=float), np.array([0.10, 0.20, 0.30, 0.35]))
    assert t < SCALES[-1] and 0.3 < a < 0.36
    gate = {"reached": True, "why": ""}
    climbing = {"asymptote": {"value": float(a), "low": 0.3, "high": 0.4}, "scale": float(t),
                "rising": {"value": 0.05, "low": 0.01, "high": 0.09}, "replicates": 3}
    said, why = verdict(climbing, gate, 3)
    assert said == "not shown" and "still rises at the largest budget" in why
    level = {**climbing, "rising": {"value": 0.0, "low": -0.04, "high": 0.04}}
    assert verdict(level, gate, 3)[0] == "limit structural at this scale"


def test_the_table_names_the_budgets_whose_interval_holds_no_run_variance(tiny_llama, tmp_path):
    """Where the replicates' run variance is estimated at 0 (floored: identical runs here), the share's interval
    holds item variance alone: budget.md says at which budgets (before: nothing in budget.md said it)."""
    study = _study(tiny_llama, tmp_path / "s")
    models = _models(CURVES, AGREEING)
    models |= {f"sft-k1{tag}@r{r}": models[f"sft-k1{tag}"] for tag in TAGS for r in (1, 2)}  # sft's runs agree
    _plant(tmp_path / "s", models)
    text = write_budget_report(study, tmp_path / "s").read_text()
    rows = {tuple(cell.strip() for cell in line.split("|")[1:4]): line.split("|")[-2].strip()
            for line in text.splitlines() if line.startswith("| ") and "|" in line[2:]}
    assert rows[("sft", "1", "arith_2d_sub")] == "8k, 32k, 128k, 256k"
    assert rows[("kd", "1", "arith_2d_sub")] == "-"  # its replicates differ run to run
    assert "estimated at 0 (method of moments, floored)" in text


def test_a_study_scored_in_part_says_what_is_missing_and_draws_what_is_there(tiny_llama, tmp_path):
    """Replicates, budgets and the control's smaller budgets missing: listed, each figure from the cells there; the
    gate needs only the control's largest budget. Before: the control's incomplete curve hid it ('not shown'). A curve
    whose budgets have other replicates (local: r2 at 256k only missing) is not fitted: one run's checkpoints pair
    seed by seed, and the replicate draws are shared by position (before: r0, r1 at 256k drawn as if r0, r1, r2). A
    curve fitted on 2 of its 3 replicates gets no verdict (before: 'limit structural' from sft's r0 and r1); the
    control at k = 2, not scored, is 'not judged yet', not failed (before: 'cannot show a limit')."""
    study = _study(tiny_llama, tmp_path / "s")
    skip = {"sft-k1@r2", "sft-k1@8k@r2", "sft-k1@32k@r2", "sft-k1@128k@r2", "kd-k1@8k", "kd-k1@8k@r1",
            "kd-k1@8k@r2", "kd-arith-k1@8k", "kd-arith-k1@8k@r1", "kd-arith-k1@8k@r2", "kd-arith-k1@32k",
            "kd-k1@32k-dedicated@r1", "local-k1@r2"}
    _plant(tmp_path / "s", _models(CURVES, AGREEING), skip)
    text = write_budget_report(study, tmp_path / "s").read_text()
    data = json.loads((tmp_path / "s" / "budget.json").read_text())
    assert data["verdicts"]["sft-k1"] == "not shown"  # fitted on r0, r1 at every budget: no verdict before r2
    assert data["verdict_reasons"]["sft-k1"].startswith("the fit holds 2 of the 3 replicates")
    sft = next(c for c in data["curves"] if (c["arm"], c["k"], c["task"]) == ("sft", 1, "arith_2d_sub"))
    assert sft["replicates"] == 2 and "asymptote" in sft
    assert data["missing"]["sft-k1"] == {"replicates": [2], "of": 3} and "pruned-k1" not in data["missing"]
    local = next(c for c in data["curves"] if (c["arm"], c["k"], c["task"]) == ("local", 1, "arith_2d_sub"))
    assert local["fit"] == ("waits for the same replicates at every budget (8000: r0, r1, r2; 32000: r0, r1, r2; "
                            "128000: r0, r1, r2; 256000: r0, r1)") and "rising" not in local
    assert data["verdicts"]["local-k1"] == "not shown"
    rows = {r["name"]: r for f in data["default_families"].values() for r in f["contrasts"]}
    assert rows["local-k1-rise-arith_2d_sub"]["interval"] == (
        "n/a (local-k1 and local-k1@8k not scored on the same replicates yet)")
    assert data["missing"]["kd-k1@8k"]["replicates"] == [0, 1, 2] and data["missing"]["pruned-k2"]["of"] == 1
    assert "Not scored yet (" in text and "sft-k1 (replicate 2), " in text and "kd-k1@8k, " in text
    assert "pruned-k2, " in text
    curves = {(c["arm"], c["task"]): c for c in data["curves"] if c["k"] == 1}
    kd = curves["kd", "arith_2d_sub"]
    assert kd["shares"]["8000"] == "not scored" and kd["fit"] == "waits for 8000" and "asymptote" not in kd
    assert kd["rising"]["low"] > 0  # the two largest budgets are there
    assert data["verdicts"]["kd-k1"] == "not shown" and "no fit yet" in data["verdict_reasons"]["kd-k1"]
    assert data["gates"][0]["reached"] and data["gates"][1]["why"].startswith("pruned-k2, kd-arith-k2 not scored")
    assert data["gates"][1]["pending"] and "at k = 2: pruned-k2, kd-arith-k2 not scored yet: not judged yet" in text
    assert {r["arm"]: r["replicates"] for r in data["dedicated"]}["kd"] == [0, 2]  # paired on the seeds both have
    assert (tmp_path / "s" / "budget.png").stat().st_size > 0


def test_a_study_with_nothing_or_no_original_scored_yet_still_gets_its_report(tiny_llama, tmp_path):
    """Before: nothing scored crashed (load_matrix of no folder), an absent original too (labels.index)."""
    study = _study(tiny_llama, tmp_path / "s")
    (tmp_path / "s").mkdir()
    text = write_budget_report(study, tmp_path / "s").read_text()
    assert "Not scored yet (" in text and "baseline" in text
    _plant(tmp_path / "t", _models(CURVES, AGREEING), skip={"baseline"})
    text = write_budget_report(study, tmp_path / "t").read_text()
    data = json.loads((tmp_path / "t" / "budget.json").read_text())
    assert all(c["state"] == "n/a (baseline not scored)" for c in data["curves"])
    assert set(data["verdicts"].values()) == {"not shown"}
    assert data["missing"]["baseline"] == {"replicates": [0], "of": 1}


def test_models_scored_on_different_items_are_refused_in_one_line_and_nothing_is_written(tiny_llama, tmp_path):
    """kd-k1@32k@r1's arith_2d_sub record holds two items twice, then other items (doc ids 7..206): refused in one
    line naming the models and the task (issue 56), no budget.md, budget.json or budget.png. Before: the repeated rows
    were paired by their last record, and another item set left the task out of a report written anyway."""
    study = _study(tiny_llama, tmp_path / "s")
    _plant(tmp_path / "s", _models(CURVES, AGREEING))
    samples = tmp_path / "s" / "eval" / "kd-k1@32k@r1" / "samples" / "arith_2d_sub.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    one_line = r"^models scored on different items: baseline and kd-k1@32k@r1 on arith_2d_sub differ in {} item\(s\)"
    for planted, count in ((rows + rows[:2], 2), ([{**r, "doc_id": r["doc_id"] + 7, "doc_hash": f"d{r['doc_id'] + 7}",
                                                    "prompt_hash": f"p{r['doc_id'] + 7}"} for r in rows], 14)):
        samples.write_text("".join(json.dumps(r) + "\n" for r in planted))
        with pytest.raises(LayerpruneError, match=one_line.format(count) + r"[^\n]*$"):
            write_budget_report(study, tmp_path / "s")
        assert not any((tmp_path / "s" / name).exists() for name in ("budget.md", "budget.json", "budget.png"))


def test_every_point_says_what_it_spent_the_dedicated_runs_and_controls_included(tiny_llama, tmp_path):
    """budget.md's last section: tokens / steps / learning rate per arm, k and budget from each point's own
    recover_report.json (the spread over replicates), a dedicated run's at dedicated_at, a control's at the largest
    budget, '-' where nothing is recorded; and the rerun command."""
    study, root = _study(tiny_llama, tmp_path / "s"), tmp_path / "s"

    def report(label: str, tokens: int, steps: int, rate: float = 2e-4) -> None:
        (root / label).mkdir(parents=True)
        (root / label / "recover_report.json").write_text(json.dumps(
            {"tokens_unpadded": tokens, "optimizer_steps": steps, "learning_rate": rate, "recipe": {}, "data": {}}))

    report("kd-k1@32k", 32_010, 12)
    report("kd-k1@32k@r1", 32_050, 13)
    report("kd-k1@32k-dedicated", 32_020, 12, 3e-4)
    report("kd-k0@r2", 256_100, 99)
    text = write_budget_report(study, root).read_text().split("## What each point spent", 1)[1]
    assert "| kd | 1 | - | 32,010-32,050 / 12-13 / 0.0002 | - | - |" in text
    assert "| kd | 1 (dedicated) | - | 32,020 / 12 / 0.0003 | - | - |" in text
    assert "| kd | 0 (control) | - | - | - | 256,100 / 99 / 0.0002 |" in text
    assert "| local | 1 (dedicated) |" not in text and "| local | 0 (control) |" not in text  # none: local is a cut
    assert f"Rerun: `layerprune study tiny-budget --output {root}`" in text


def test_the_time_left_counts_local_teacher_states_once_a_cut_and_seed(tiny_llama, tmp_path):
    """local's runs at one cut and seed (a run per budget) share the teacher states the first of them captures: when
    it is complete, the states of that cut and seed are done whatever the others' state (before: weighted by the
    target tokens of the runs left, so a finished 8k run counted as a sliver of its cut's states)."""
    from layerprune.pipeline.studies.sweep_cells import cells
    from layerprune.pipeline.studies.sweep_plan import sizing
    from layerprune.pipeline.studies.sweep_time import left_seconds

    study = _study(tiny_llama, tmp_path / "s")
    seconds = sizing(study).seconds
    runs = [c for c in cells(study, study.run_dir()) if c.step == "recover" and c.arm == "local"]
    first, second = [c for c in runs if (c.k, c.replicate) == (2, 1)][:2]
    assert seconds["teacher states"] > 0 and (first.budget, second.budget) == (8000, 32000)
    only = {"teacher states": seconds["teacher states"]}
    second.output.parent.mkdir(parents=True)
    second.output.write_text("{}")  # a later run of the cut and seed: the states were the first's to capture
    assert left_seconds(study, only) == pytest.approx(only["teacher states"])
    first.output.parent.mkdir(parents=True)
    first.output.write_text("{}")
    assert left_seconds(study, only) == pytest.approx(only["teacher states"] * (1 - 2 / (3 * (1 + 2))))


def test_the_dry_run_shares_local_steps_out_over_the_cuts_spans(tiny_llama, tmp_path, monkeypatch):
    """local.steps are shared out over the cut's spans (a block trained per span): 90k steps of 2 sequences of 6
    tokens reach 256k target tokens with one span but not with two. Before the scoring pass, as if the k = 2 cut's
    blocks were apart (a warning); with its ranking, the spans it has (adjacent blocks: one span, no warning).
    Before, the dry run counted every step for every span and never warned."""
    from layerprune.pipeline.studies import sweep_inputs
    from layerprune.pipeline.studies.recovery_plan import budget_lines

    arms = {**ARMS, "local": {"method": "local", "local": {"steps": 30000, "learning_rate": 1.0e-3}}}
    study = _study(tiny_llama, tmp_path / "s", arms=arms)
    line = next(s for s in budget_lines(study) if s.startswith("arm local:"))
    assert "WARNING: at most 180000 target tokens reachable" in line
    assert "raise local.steps, shared out over the cut's spans: 2 at most (the blocks not ranked yet" in line
    (tmp_path / "s" / "scored").mkdir(parents=True)
    (tmp_path / "s" / "scored" / "prune_report.json").write_text("{}")
    monkeypatch.setattr(sweep_inputs, "ranking", lambda root, ratios, layers=None: {1: [3], 2: [3, 4]})
    assert "WARNING" not in next(s for s in budget_lines(study) if s.startswith("arm local:"))
    monkeypatch.setattr(sweep_inputs, "ranking", lambda root, ratios, layers=None: {1: [3], 2: [1, 4]})
    apart = next(s for s in budget_lines(study) if s.startswith("arm local:"))
    assert apart.endswith("raise local.steps, shared out over the cut's spans: 2 at most")


def test_an_arm_with_prompts_of_its_own_answers_them_in_its_own_format(tiny_llama, tmp_path):
    """arm_generate: the positive control's probe prompts answered and trained as the probes are scored (plain text
    to the line's end), the other arms in the shared chat format; a format for an arm that shares the teacher
    answers, or a field generate does not have, is refused before any stage runs. Before, an arm could set only its
    prompts: the math variant answered the kd-arith prompts through the chat template (arith_2d_sub 5.3% there, 70%
    in plain text), all 528 answers seen cut at 128 tokens."""
    plain = {"kd-arith": {"chat_template": False, "max_new_tokens": 16}}
    study = _study(tiny_llama, tmp_path / "s", arm_generate=plain)
    control, other = study.arm_recipe("kd-arith", "<pruned>"), study.arm_recipe("kd", "<pruned>")
    assert (control.generate.chat_template, control.generate.max_new_tokens, control.generate.stop) == (False, 16, "\n")
    assert other.generate.max_new_tokens == 6  # the shared recipe's (the tiny study's is plain already)
    assert control.prompts.source == "probes:arith_2d_sub"
    from layerprune.pipeline.studies.cells import RATES
    from layerprune.pipeline.studies.recovery_plan import answers
    from layerprune.pipeline.studies.sweep_plan import sizing

    seconds = sizing(study).seconds  # the dry run: its answers of at most 16 tokens, the shared ones of 6
    assert seconds["teacher answers kd-arith"] == pytest.approx(answers(control) * 16 / RATES["teacher tokens/s"])
    assert seconds["teacher answers"] == pytest.approx(answers(other) * 6 / RATES["teacher tokens/s"])
    with pytest.raises(ValueError, match="arm_generate: kd has no prompts of its own"):
        _study(tiny_llama, tmp_path / "s", arm_generate={"kd": {"chat_template": False}})
    with pytest.raises(ValueError, match="chat_templates"):
        _study(tiny_llama, tmp_path / "s", arm_generate={"kd-arith": {"chat_templates": False}})


def test_a_rate_chosen_at_an_end_of_its_grid_says_so_with_each_candidates_kl(tmp_path):
    """The rate chosen at the grid's top or bottom: the report says a better one may lie beyond it; each candidate's
    held-out KL beside its CE where its report kept it (the criterion stays the CE). The budget study's three
    searches all chose an end (sft-dolly 1e-3 and local-dolly 2e-3 the top, kd-dolly 2e-4 the bottom)."""
    from layerprune.recover.lr_search import lr_lines, write_search

    rows = []
    for i, (rate, ce, kl) in enumerate([(2e-4, 0.61, 0.23), (5e-4, 0.53, 0.35), (1e-3, 0.50, 0.32)]):
        folder = tmp_path / "lr_search" / "sft" / f"lr{i}"
        folder.mkdir(parents=True)
        (folder / "recover_report.json").write_text(json.dumps({"held_out_metrics": {"after": {"ce": ce, "kl": kl}}}))
        rows.append({"learning_rate": rate, "held_out_loss": ce, "folder": f"lr_search/sft/lr{i}"})
    write_search(tmp_path, {"arm": "sft", "k": 2, "chosen": 1e-3, "candidates": rows})
    line = lr_lines(tmp_path, ["sft"], "scope")[0]
    assert "0.0002 -> 0.6100 (KL 0.2300), 0.0005 -> 0.5300 (KL 0.3500), 0.001 -> 0.5000 (KL 0.3200)" in line
    assert line.endswith("It is the highest rate of the grid: a better one may lie beyond it, untried.")
    write_search(tmp_path, {"arm": "sft", "k": 2, "chosen": 5e-4, "candidates": rows})
    assert lr_lines(tmp_path, ["sft"], "scope")[0].endswith("; scope.")


def test_the_dry_run_plans_an_arms_training_from_the_answers_its_lr_search_trained_on(tiny_llama, tmp_path):
    """Planned, a target token costs (max_new_tokens + 60) / max_new_tokens trained tokens: every answer as long as
    it may be. Once the arm's lr search has trained on its answers, the measured ratio (tokens_padded /
    tokens_unpadded) is used: 4-token arithmetic answers after a 40-token few-shot prompt cost 14 tokens a target
    token, not the 4.75 planned at 16 new tokens (kd-arith's 256k runs: about 3.5 times the hours first planned)."""
    from layerprune.pipeline.studies.cells import RATES
    from layerprune.pipeline.studies.recovery_plan import budget_runs, budget_seconds, held_out_seconds

    study = _study(tiny_llama, tmp_path / "s")
    runs = [float(t) for t in budget_runs(study, "kd")]
    planned, held = budget_seconds(study, "kd"), held_out_seconds(study, "kd", runs)
    assert planned == pytest.approx(sum(runs) * (6 + 60) / 6 / RATES["trained tokens/s"])
    report = tmp_path / "s" / "lr_search" / "kd" / "lr0" / "recover_report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"tokens_unpadded": 4000, "tokens_padded": 56000, "sequences": 1000}))
    assert budget_seconds(study, "kd") == pytest.approx(sum(runs) * 14 / RATES["trained tokens/s"])
    assert held_out_seconds(study, "kd", runs) > held  # 4 target tokens a sequence: more steps, more evaluations
    assert budget_seconds(study, "sft") == pytest.approx(sum(budget_runs(study, "sft")) * 11 / RATES[
        "trained tokens/s"])  # another arm: still planned


def test_a_positive_control_with_budgets_of_its_own_is_scored_and_gated_at_its_largest(tiny_llama, tmp_path):
    """arm_budgets: kd-arith trains to 32k (its runs and its k = 0 control), a checkpoint at 8k, no dedicated run (its
    run is the 32k one); the gate reads its share at 32k, its curve has its two budgets, each arm is compared with
    it at 32k (the largest both reach), and what it spent sits in its budgets' columns. A list that does not start
    at the smallest budget is refused.
    Before, every arm trained to the largest: a 256k run of 4-token answers is about 8 h here."""
    from layerprune.pipeline.studies.budget_report import write_budget_report
    from layerprune.pipeline.studies.recovery_plan import budget_runs
    from layerprune.pipeline.studies.sweep_cells import cells
    from layerprune.pipeline.studies.sweep_grid import models

    study = _study(tiny_llama, tmp_path / "s", arm_budgets={"kd-arith": [8000, 32000]})
    grid = models(study)
    assert {"kd-arith-k1@8k", "kd-arith-k1", "kd-arith-k0@r2"} <= set(grid)
    assert not [m for m in grid if m.startswith("kd-arith") and ("@32k" in m or "@128k" in m)]
    run = next(c for c in cells(study, tmp_path / "s") if c.name == "recover-kd-arith-k1")
    assert run.budget == 32000 and [b for b, _ in run.snapshots] == [8000]
    assert max(budget_runs(study, "kd-arith")) == 32000 and max(budget_runs(study, "kd")) == 256000
    planted = _models({arm: shares for arm, shares in CURVES.items() if arm != "kd-arith"}, AGREEING)
    for r in range(3):
        rr = f"@r{r}" if r else ""
        planted |= {f"kd-arith-k1@8k{rr}": _winning(0.30, r), f"kd-arith-k1{rr}": _winning(0.55, r, 3),
                    f"kd-arith-k0{rr}": BASE}
    _plant(tmp_path / "s", planted)
    text = write_budget_report(study, tmp_path / "s").read_text()
    data = json.loads((tmp_path / "s" / "budget.json").read_text())
    gate = data["gates"][0]
    assert gate["budget"] == 32000 and gate["reached"] and gate["share"]["value"] == pytest.approx(0.55, abs=0.02)
    assert "of the arith_2d_sub drop won back at 32k" in text
    control = next(c for c in data["curves"] if (c["arm"], c["k"], c["task"]) == ("kd-arith", 1, "arith_2d_sub"))
    assert list(control["shares"]) == ["8000", "32000"]
    assert control["fit"] == "none: 2 budgets for the fit's 2 parameters" and "asymptote" not in control
    rows = {r["name"]: r for f in data["default_families"].values() for r in f["contrasts"]}
    pair = rows["sft-vs-kd-arith-k1-arith_2d_sub"]
    assert pair["budget"] == 32000 and pair["interval"]["value"] == pytest.approx(0.31 - 0.55, abs=0.02)
    assert rows["sft-vs-kd-k1-arith_2d_sub"]["budget"] is None  # both at the largest
    spent = next(r for r in data["spent"] if r["arm"] == "kd-arith" and r["k"] == 1)
    assert [len(p) for p in spent["points"]] == [0, 0, 0, 0]  # nothing trained here: planted evaluations only
    assert len(spent["points"]) == 4
    row = next(line for line in text.splitlines() if line.startswith("| kd-arith | 1 | arith_2d_sub |"))
    assert "| 55.0% [46.9, 63.2] | - | - |" in row  # 128k and 256k: not its budgets
    from layerprune.pipeline.studies.figures import evaluated, study_figures
    from layerprune.pipeline.studies.sweep_report import arm_figures, table_lines

    points = arm_figures(study, study_figures(evaluated(study, tmp_path / "s"))[0])[0]
    note = table_lines(study, points)[2]  # sweep.md: its row is at 32k, beside the others' 256k
    assert note.startswith("Rows at a budget of their own (arm_budgets): kd-arith at 32,000 target tokens, the "
                           "other arms' at 256,000."), note
    assert len(table_lines(study, [p for p in points if p.get("arm") != "kd-arith"])) == 2  # no row, no note
    skipping = _study(tiny_llama, tmp_path / "s", arm_budgets={"kd-arith": [8000, 256000]})
    assert len(table_lines(skipping, points)) == 2  # its own budgets, but it ends at 256k with the others
    with pytest.raises(ValueError, match="arm_budgets.kd-arith: two or more of budgets in order, the smallest"):
        _study(tiny_llama, tmp_path / "s", arm_budgets={"kd-arith": [32000, 256000]})


def test_arms_with_budgets_of_their_own_are_compared_where_both_have_a_point(tiny_llama, tmp_path):
    """Two arms of their own budgets (kd-arith to 32k, sft to 128k): their pair at 8k, the largest budget both have
    (not the smaller of their largest, 32k: no point of sft's), each rise from its own largest; a declared
    contrast at a budget its arm does not train to is refused when the recipe is read, not when the report is drawn.
    Before, both ended in the report stage's error (at_budget)."""
    from layerprune.pipeline.studies.budget_report import at_budget, default_families

    own = {"kd-arith": [8000, 32000], "sft": [8000, 128000]}
    study = _study(tiny_llama, tmp_path / "s", arm_budgets=own)
    rows = {c.label: c for c in default_families(study, ["arith_2d_sub"])["arith_2d_sub"].contrasts}
    assert rows["sft-vs-kd-arith-k1-arith_2d_sub"].budget == 8000
    assert rows["sft-vs-kd-k1-arith_2d_sub"].budget == 128000 and rows["kd-vs-local-k1-arith_2d_sub"].budget is None
    assert (rows["sft-k1-rise-arith_2d_sub"].budget, rows["kd-k1-rise-arith_2d_sub"].budget) == (128000, None)
    for contrast in rows.values():
        for arm, k, budget in contrast.points:
            at_budget(study, arm, k, budget or study.budgets_of(arm)[-1])  # every side names a point the arm has
    declared = {"late": {"contrasts": [{"name": "x", "a": "kd-arith", "at": 1, "budget": 128000,
                                        "task": "arith_2d_sub"}]}}
    with pytest.raises(ValueError, match="budget 128000 is not one of kd-arith's budgets \\(8000, 32000\\)"):
        _study(tiny_llama, tmp_path / "s", arm_budgets=own, comparisons=declared)


def test_the_dry_run_and_the_start_say_when_the_models_left_will_not_fit_on_disk(tiny_llama, tmp_path, monkeypatch,
                                                                                 caplog):
    """The models a study has still to save (cuts, recoveries with the budget points they keep, lr candidates), at
    the original's bytes a weight less the blocks cut, against the space free: a line of the dry run, and a warning
    when a run starts where they will not fit. A recovery done leaves its own and its points out. (New: the budget
    study saves about 100 models of 0.5 GB; a full disk would have ended it hours in.)"""
    import shutil
    from collections import namedtuple

    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies import sweep
    from layerprune.pipeline.studies.sweep_cells import cells, disk_need
    from layerprune.pipeline.studies.sweep_plan import dry_run

    study, root, settings = _study(tiny_llama, tmp_path / "s"), tmp_path / "s", RunSettings()
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama).parameters())
    grid = cells(study, root)
    recoveries = [c for c in grid if c.step == "recover"]
    expected = sum(1 + len(c.snapshots) for c in recoveries) + sum(c.step == "prune" for c in grid) \
        + sum(len(g) for g in study.lr_grid.values())
    disk = disk_need(study, settings, root)
    assert disk.models == expected and disk.need <= expected * params * 4
    control = next(c for c in recoveries if c.k == 0)
    control.output.parent.mkdir(parents=True)
    control.output.write_text("{}")  # a control done: its model (no points at k = 0) is left out
    after = disk_need(study, settings, root)
    assert after.models == expected - 1 - len(control.snapshots)
    assert after.need == pytest.approx(disk.need - (1 + len(control.snapshots)) * params * 4)
    assert f"disk: {after.models} models still to save" in dry_run(study, settings)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1, 1, 1000))
    assert dry_run(study, settings).split("disk: ")[1].split("\n")[0].endswith(
        "not enough: free space or choose another --output")
    monkeypatch.setattr(sweep, "run_stages", lambda stages, root, times=None: None)  # the start only: no stage runs
    with caplog.at_level("WARNING"):
        sweep.run_sweep(_study(tiny_llama, tmp_path / "t"), settings)
    assert any("not enough: free space" in r.getMessage() for r in caplog.records)


def test_the_dry_run_of_a_run_in_part_says_what_its_stages_left_will_take(tiny_llama, tmp_path, monkeypatch):
    """A run to resume: the estimate's seconds still to spend, each phase's times the share of its work not done
    (evaluations by model; an arm's training and all held-out evaluations by the target tokens of the runs left).
    (New: the dry run gave only the whole study's estimate, complete stages counted.)"""
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies import sweep_plan
    from layerprune.pipeline.studies.sweep_cells import cells
    from layerprune.pipeline.studies.sweep_plan import dry_run, sizing
    from layerprune.pipeline.studies.sweep_time import left_seconds

    study = _study(tiny_llama, tmp_path / "s")
    seconds, root = sizing(study).seconds, study.run_dir()
    assert left_seconds(study, seconds) == pytest.approx(sum(seconds.values()))
    assert "left (the stages not complete)" not in dry_run(study, RunSettings())  # no run there yet
    grid = cells(study, root)
    evals = [c for c in grid if c.step == "eval"]
    runs = [c for c in grid if c.step == "recover"]
    control = next(c for c in runs if (c.arm, c.k, c.replicate) == ("kd", 0, 0))
    for cell in (evals[0], control):
        cell.output.parent.mkdir(parents=True, exist_ok=True)
        cell.output.write_text("{}")
    kd = sum(c.budget for c in runs if c.arm == "kd")
    every = sum(c.budget for c in runs)  # no lr grid in this study
    expected = sum(seconds.values()) - seconds["evaluation"] / len(evals) - seconds["training kd"] * 256000 / kd \
        - seconds["held-out evaluations"] * 256000 / every
    assert control.budget == 256000 and left_seconds(study, seconds) == pytest.approx(expected)
    monkeypatch.setattr(sweep_plan, "rates_apply", lambda model: True)  # the tiny model has no measured rates
    assert f"left (the stages not complete) about {expected / 60:.0f} min" in dry_run(study, RunSettings())
    assert "in run order" not in dry_run(study, RunSettings())
    ordered = _study(tiny_llama, tmp_path / "s", run_order=[1, 0, 2])  # the same run, cut by cut: when each is whole
    first = left_seconds(ordered, seconds, among=lambda c: c.cut in (None, 1))
    controls = left_seconds(ordered, seconds, among=lambda c: c.cut in (None, 1, 0))
    answers = seconds["teacher answers"] + seconds["teacher answers kd-arith"]  # whole in every count
    assert 0 < first < controls < expected and controls == pytest.approx(
        expected - left_seconds(ordered, seconds, among=lambda c: c.cut == 2) + answers)
    assert (f"in run order (run_order): k = 1 whole after about {first / 60:.0f} min, the k = 0 controls whole after "
            f"about {controls / 60:.0f} min, k = 2 whole after about {expected / 60:.0f} min") in dry_run(
        ordered, RunSettings())


def test_two_arms_ending_at_other_budgets_are_compared_only_at_a_budget_the_contrast_names(tiny_llama, tmp_path):
    """kd-arith ends at 32k (arm_budgets), sft at 256k: a declared contrast of the two that names no budget would set
    one's 32k beside the other's 256k (sweep.md drew it so, under a note saying kd-arith was left out): refused on
    load, naming the budget both have; at a named budget, or an arm against itself, it stands."""
    fields = {"arm_budgets": {"kd-arith": [8000, 32000]}}
    with pytest.raises(ValueError, match=r"comparisons.main.sft-vs-arith: sft ends at 256000 target tokens and "
                                         r"kd-arith at 32000: name the budget they are compared at \(budget: 32000;"):
        _study(tiny_llama, tmp_path / "s", comparisons={"main": [{"name": "sft-vs-arith", "a": "sft", "b": "kd-arith",
                                                                  "at": 1}]}, **fields)
    with pytest.raises(ValueError, match="sft ends at 256000 target tokens and kd-arith at 32000"):
        _study(tiny_llama, tmp_path / "s", comparisons={"m": [{"a": "sft", "b": "kd-arith", "at": 1,
                                                               "task": "arith_2d_sub"}]}, **fields)
    named = {"m": [{"a": "sft", "b": "kd-arith", "at": 1, "budget": 32000, "task": "arith_2d_sub"},
                   {"a": "kd-arith", "at": 1, "b_at": 2}, {"a": "sft", "b": "kd", "at": 1}]}
    assert len(_study(tiny_llama, tmp_path / "s", comparisons={"m": named["m"][:1]}, **fields).comparisons["m"]
               .contrasts) == 1
    assert _study(tiny_llama, tmp_path / "s", comparisons={"n": named["m"][1:]}, **fields).comparisons


def test_sweep_md_of_a_budget_study_names_the_controls_own_prompts_and_an_arm_without_a_control(tiny_llama, tmp_path,
                                                                                                 monkeypatch):
    """sweep.md of the same run: the method line said every arm's teacher answered the shared generic prompts (kd-arith
    answered its own arithmetic ones), and an arm with no k = 0 control (local) read 'undefined' in the net column,
    as an undefined ratio would."""
    from layerprune.pipeline.studies import sweep_inputs, sweep_report

    monkeypatch.setattr(sweep_inputs, "ranking", lambda root, ratios, layers=None: {k: list(range(k)) for k in ratios})
    monkeypatch.setattr(sweep_report, "_depth", lambda study, root: 10)
    study = _study(tiny_llama, tmp_path / "s")
    _plant(tmp_path / "s", _models(CURVES, AGREEING))
    sweep_report.write_sweep_report(study, tmp_path / "s", curves={})
    text = (tmp_path / "s" / "sweep.md").read_text()
    assert "The teacher answered generic instructions (dolly); arm kd-arith its own prompts (probes:arith_2d_sub);" \
        in text
    local = next(row for row in text.splitlines() if row.startswith("| 1 | local | generative |"))
    assert local.endswith("(undefined 0.0%) | - (no control scored) |")


def test_the_dry_run_sets_the_stages_the_runner_timed_beside_their_estimate(tiny_llama, tmp_path, monkeypatch):
    """stage_times.json (the runner's, every attempt) against the estimate for the same complete stages, per family
    (evaluations, recoveries), and the time left with each family's phases scaled by its ratio. A stage timed but
    not complete, or complete but not timed (a part run before the times were kept), is left out. (New.)"""
    import json

    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.runner import TIMES
    from layerprune.pipeline.studies import sweep_plan
    from layerprune.pipeline.studies.sweep_cells import cells
    from layerprune.pipeline.studies.sweep_plan import dry_run, sizing
    from layerprune.pipeline.studies.sweep_time import left_seconds, measured, measured_line

    study = _study(tiny_llama, tmp_path / "s")
    seconds, root = sizing(study).seconds, study.run_dir()
    grid = cells(study, root)
    evals = [c for c in grid if c.step == "eval"]
    run = next(c for c in grid if c.step == "recover" and (c.arm, c.k, c.replicate) == ("sft", 1, 0))
    for cell in (evals[0], evals[1], evals[2], run):
        cell.output.parent.mkdir(parents=True, exist_ok=True)
        cell.output.write_text("{}")
    attempts = [(evals[0], 60.0, True), (evals[1], 30.0, False), (evals[1], 30.0, True), (evals[3], 99.0, False),
                (run, 600.0, True)]  # evals[2]: complete, never timed; evals[3]: timed, not complete
    root.joinpath(TIMES).write_text(json.dumps({"attempts": [
        {"stage": cell.name, "seconds": spent, "done": done} for cell, spent, done in attempts]}))
    found = measured(study, seconds)
    per_eval = seconds["evaluation"] / len(evals)
    assert found["eval"] == (2, 120.0, pytest.approx(2 * per_eval)) and "chat" not in found
    sft = sum(c.budget for c in grid if c.step == "recover" and c.arm == "sft")
    every = sum(c.budget for c in grid if c.step == "recover")
    assert found["recover"][:2] == (1, 600.0)
    assert found["recover"][2] == pytest.approx(seconds["training sft"] * run.budget / sft
                                                + seconds["held-out evaluations"] * run.budget / every)
    ratios = {"eval": 120.0 / (2 * per_eval), "recover": 600.0 / found["recover"][2]}
    scaled = left_seconds(study, seconds, ratios)
    plain = left_seconds(study, seconds)
    assert scaled == pytest.approx(plain + (ratios["eval"] - 1) * seconds["evaluation"] * (len(evals) - 3) / len(evals)
                                   + (ratios["recover"] - 1) * (plain - left_seconds(study, {
                                       k: v for k, v in seconds.items() if not k.startswith(("training", "held-out",
                                                                                             "teacher states"))})))
    line = measured_line(study, seconds)
    assert line.startswith("timed by the runner (stage_times.json, every attempt;")
    assert f"evaluations 2 (2 min; the estimate {2 * per_eval / 60:.0f} min, x{ratios['eval']:.2f})" in line
    assert f"left at these ratios about {scaled / 60:.0f} min" in line
    monkeypatch.setattr(sweep_plan, "rates_apply", lambda model: True)  # the tiny model has no measured rates
    assert line in dry_run(study, RunSettings())
    root.joinpath(TIMES).unlink()
    assert measured_line(study, seconds) is None


def test_the_report_of_a_run_in_parts_is_drawn_on_demand_and_runs_nothing(tiny_llama, tmp_path, capsys,
                                                                          monkeypatch, shared_data):
    """`layerprune study RECIPE --report`: sweep.md and budget.md from the cells scored so far, headed by what is not
    run yet, no stage run, and the report stage still draws the study's own at the end; refused in one line where the
    directory holds no run of the recipe, another recipe's, no cut or no evaluation of the original yet, with flags
    that run something, or for a grid none of whose cells has a run. Before: the report came only with the last
    stage, so a run in parts (the budget study: about 33 h) could not be read before its end."""
    from layerprune.pipeline.studies import study_reports

    root = tmp_path / "s"
    study = _study(tiny_llama, root, run_order=[1, 0, 2])
    recipe = tmp_path / "tiny-budget.yaml"
    recipe.write_text(yaml.safe_dump({"kind": "sweep-study", **study.model_dump(mode="json", exclude_defaults=True)}))
    code, _, err = run_cli(capsys, ["study", str(recipe), "--report"])
    assert_one_line_error(code, err, "holds no run of tiny-budget", "nothing to report")
    assert not root.exists()
    claim_run_dir(RunPaths(root), study, overwrite=False)
    code, _, err = run_cli(capsys, ["study", str(recipe), "--report"])
    assert_one_line_error(code, err, "nothing to report before its score stage has run")
    grid = sweep_cells.cells(study, root)
    sweep.score(study, RunSettings(), root, next(c for c in grid if c.step == "score"))
    code, _, err = run_cli(capsys, ["study", str(recipe), "--report"])
    assert_one_line_error(code, err, "nothing to report before its eval-baseline stage has run")
    _plant(root, {"baseline": BASE})
    code, _, err = run_cli(capsys, ["study", str(recipe), "--report"])  # the original alone: every cell not scored
    assert code == 0, err
    shutil.rmtree(root / "eval" / "baseline")
    _plant(root, _models(CURVES, AGREEING), skip={"sft-k1@r2", "kd-k1@8k"})
    for flag in ("--dry-run", "--max-hours=1"):
        code, _, err = run_cli(capsys, ["study", str(recipe), "--report", flag])
        assert_one_line_error(code, err, "runs nothing: not with --dry-run")
    code, out, err = run_cli(capsys, ["study", str(recipe), "--report"])
    assert code == 0, err
    assert f"report of tiny-budget (the stages complete so far): {root / 'sweep.md'}" in out
    data = json.loads((root / "budget.json").read_text())
    assert data["missing"]["sft-k1"] == {"replicates": [2], "of": 3} and "Not scored yet (" in (
        root / "budget.md").read_text()
    left = json.loads((root / "sweep.json").read_text())["partial"]["left"]
    assert "recover-sft-k1" in left and "eval-sft-k1" not in left and data["partial"]["left"] == left
    for name in ("sweep.md", "budget.md"):
        assert (root / name).read_text().startswith("> **Drawn from a run in progress** (`layerprune study "
                                                    "tiny-budget --report`): ")
    assert not [c.name for c in grid if c.step not in ("score", "eval") and c.output.exists()]  # nothing ran, and
    # the report stage is not complete: it draws the study's report at the end, with no banner
    for kind in ("sweep.json", "budget.json"):  # nothing takes a partial report for the study's result
        with pytest.raises(LayerpruneError, match=f"its {kind} was drawn from a run in progress"):
            if kind == "sweep.json":
                read_sweep(root)
            else:
                (root / "sweep.json").rename(root / "kept.json")
                study_kind(root)
    (root / "kept.json").rename(root / "sweep.json")
    study_reports.write_reports(study, RunSettings(), root, grid[-1])
    assert grid[-1].output.exists() and not (root / "sweep.md").read_text().startswith("> **Drawn")
    assert "partial" not in json.loads((root / "budget.json").read_text())
    assert run_cli(capsys, ["study", str(recipe), "--report"])[0] == 0  # drawn over the stage's: it draws again
    assert not grid[-1].output.exists()
    done = tmp_path / "done"  # a finished run given stages since (replicates, arms): its reports are drawn again
    finished = [c.output for c in sweep_cells.cells(study, done)]
    for path in finished:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    study_reports.unmark_if_left(study, done)
    assert finished[-1].exists()
    finished[3].unlink()
    study_reports.unmark_if_left(study, done)
    assert not finished[-1].exists()
    other = tmp_path / "other.yaml"
    other.write_text(recipe.read_text().replace("drop: 2", "drop: 3").replace("- 2\n", "- 3\n"))
    code, _, err = run_cli(capsys, ["study", str(other), "--report"])
    assert_one_line_error(code, err, "holds another recipe's run")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    code, _, err = run_cli(capsys, ["study", "limits-sweep-7b-8b", "--report"])  # a grid: no cell has a run
    assert_one_line_error(code, err, "no cell of the grid has a report to draw", "holds no run of")
