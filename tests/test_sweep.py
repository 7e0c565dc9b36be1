"""`layerprune study limits-sweep-*`: the pruning-ratio sweep on a tiny model (one ranking, every k recovered, the
same items for every model, paired intervals), its schema, and the shipped recipes' dry runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import find_recipe, load_recipe, shipped_command, shipped_recipes
from layerprune.pipeline.stages import in_brief
from layerprune.pipeline.studies import sweep_cells
from layerprune.pipeline.studies.figures import study_figures
from layerprune.pipeline.studies.sweep_cells import stage_names
from layerprune.pipeline.studies.sweep_grid import SweepStudy

SWEEPS = sorted(name for _, name in shipped_recipes("sweep-study")  # one k: the recovery studies (tests/test_study.py)
                if not name.startswith(("recovery-", "grain-")))  # with grains: the grain studies (tests/test_grain.py)


def tiny_sweep(model: Path, output: Path) -> dict:
    return {
        "name": "tiny-sweep", "model": str(model), "output": str(output), "ratios": [1, 2],
        "prune": {"drop": 2, "score": "ablation", "calib": "arithmetic", "calib_samples": 4},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "dolly", "samples": 8},
            "generate": {"max_new_tokens": 6, "batch_size": 4, "temperature": 0.0, "chat_template": False},
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
    recipe.write_text(yaml.safe_dump(chat_sweep(tiny_sweep(tiny_llama, tmp_path / "sweep"), controls=True),
                                     sort_keys=False))
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
    # the teacher answered once (for the first recovery, at k = 1); the other k and the control reused its answers
    generated = {k: json.loads((root / f"recovered-k{k}" / "recover_report.json").read_text())
                 ["data"]["generation"]["generated"] for k in (0, 1, 2)}
    assert generated[1] > 0 and generated[0] == generated[2] == 0
    change = data["control"]["generative"]["change"]
    assert change["low"] <= change["value"] <= change["high"]
    assert "recovered_share_net" in data["points"][0]["generative"]
    text = (root / "sweep.md").read_text()
    assert "(a)" in text and "(b)" in text and "| 1 | generative |" in text and "k = 0 control: the same" in text
    assert "run-to-run variance is not measured" in text and "not measured (one replicate)" in text
    assert "## Held out, measured" in text and "| copy_l3 | 6 | 0 | 0 | 0 |" in text  # audited, not flagged
    assert (root / "sweep.png").is_file() and (root / "sweep_loss.png").is_file()
    labels = ["baseline", "recovered-k0", "pruned-k1", "recovered-k1", "pruned-k2", "recovered-k2"]
    assert_records_kept(root, labels)
    # chat-formatted recovery data: the kept probe levels scored through the chat template too, the same items
    for label in labels:
        chat = json.loads((root / "eval-chat" / label / "summary.json").read_text())
        assert {r["task"]: r["n"] for r in chat["results"] if r["headline"]} == {"arith_1d_sum3": 6, "copy_l3": 6}
        assert all(r["settings"]["probe_format"] == "chat" for r in chat["results"] if r["headline"])
    assert set(data["chat"]["records"]) == set(labels) and "classification" not in data["chat"]["points"][0]
    chat_drop = data["chat"]["points"][0]["generative"]["drop"]
    assert chat_drop["low"] <= chat_drop["value"] <= chat_drop["high"]
    assert "## Probes through the chat template" in text
    # a second replicate: the same directory resumes, only the new stages run (seed + 1), the report is redone
    before = {label: (root / "eval" / label / "summary.json").stat().st_mtime_ns for label in labels}
    recipe.write_text(yaml.safe_dump(chat_sweep(tiny_sweep(tiny_llama, root), controls=True, replicates=2),
                                     sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    assert {label: (root / "eval" / label / "summary.json").stat().st_mtime_ns for label in labels} == before
    data = json.loads((root / "sweep.json").read_text())
    assert data["replicates"] == 2 and data["points"][0]["generative"]["spread"]["replicates"] == 2
    assert data["points"][0]["generative"]["spread"]["run_sd"] is not None
    assert "run-to-run variance is not measured" not in (root / "sweep.md").read_text()
    assert_records_kept(root, [*labels, "recovered-k0@r1", "recovered-k1@r1", "recovered-k2@r1"])
    assert run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])[0] == 0  # complete: every stage skipped
    assert_records_kept(root, [*labels, "recovered-k0@r1", "recovered-k1@r1", "recovered-k2@r1"])


def chat_sweep(recipe: dict, **fields: object) -> dict:
    """The tiny sweep with chat-formatted recovery data (the default of a recover recipe) and `fields`."""
    recipe["recover"]["overrides"]["generate"]["chat_template"] = True
    return {**recipe, **fields}


def assert_records_kept(root: Path, labels: list[str]) -> None:
    """Every scored model's per-item records are on disk and listed in sweep.json, so comparisons can be redone."""
    kept = json.loads((root / "sweep.json").read_text())["records"]
    assert sorted(kept) == sorted(labels)
    for label in labels:
        assert kept[label]["folder"] == f"eval/{label}" and not kept[label]["missing"]
        assert {Path(f).name for f in kept[label]["samples"]} == {"arc_easy.jsonl", "arith_1d_sum3.jsonl",
                                                                   "copy_l3.jsonl"}
        assert all((root / f).stat().st_size > 0 for f in kept[label]["samples"])


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
    assert ("run", "limits-sweep-embedded") not in shipped_recipes("run")


@pytest.mark.parametrize("name", SWEEPS)
def test_every_shipped_sweep_dry_runs(capsys, name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli(capsys, ["study", name, "--dry-run", "--output", str(tmp_path / "s")])
    assert code == 0, err
    # arms x 3 replicates at 3 k with the k = 0 controls (local has none), the baseline and one pruned model per k
    models = {"limits-sweep-arms-embedded": 25, "limits-sweep-math-embedded": 37,
              "limits-sweep-math-gsm8k-embedded": 16, "limits-sweep-math-dolly-embedded": 37,
              "limits-budget-math-embedded": 102}.get(name, 11)  # budgets: 4 points an arm at each k (kd-arith 2)
    assert "pruning-ratio sweep" in out and f"models evaluated: {models} " in out and "memory plan:" in out
    assert ("total about" in out) == name.endswith("embedded") and not (tmp_path / "s").exists()
    assert shipped_command("sweep-study", name).startswith(f"layerprune study {name} ")
    assert len(SWEEPS) == 10
    if name == "limits-sweep-arms-embedded":  # the issue's protocol: sft and local paired, 3 replicates, k 2-4
        assert "arms (2, each at every k, paired on the same items): sft, local" in out
        assert "3 replicates of every recovery" in out and "k = 0 controls" in out and "recoveries: 21;" in out
    if name == "limits-sweep-local-embedded":  # the local step's own budget and rate, not SFT's epochs
        assert "recovery at every k: local on 160" in out and "72 local steps, lr 0.001" in out
        assert "about 54k trained tokens per k" in out and "training 13 min" in out  # 72 x 4 x 188 at 340/s


def _figures(shares: dict[int, int], n: int = 200, control: int | None = None, lost: int = 100,
             gen_recovered: dict[int, float] | None = None):  # noqa: ANN202 (labels, Figures)
    """Synthetic sweep: classification keeps everything, generative loses `lost` of 150 right items at each k and the
    recovered model wins back shares[k] of them; with `control`, the unpruned original recovered the same way wins
    `control` of the 50 items the original got wrong. gen_recovered[k]: a recovered model that keeps only that share
    of its classification margin (classification of the others unchanged)."""
    import numpy as np

    from layerprune.pipeline.paired_table import Figures

    rng = np.random.default_rng(0)
    labels = ["baseline", *(["recovered-k0"] if control is not None else []),
              *(f"{r}-k{k}" for k in shares for r in ("pruned", "recovered"))]
    gen_base = np.r_[np.ones(150), np.zeros(n - 150)]
    cls_base = (rng.random(n) < 0.7).astype(float)
    gen, cls = [gen_base], [cls_base]
    if control is not None:
        ctrl = gen_base.copy()
        ctrl[150:150 + control] = 1
        gen.append(ctrl)
        cls.append(cls_base)
    for k, won in shares.items():
        pruned = gen_base.copy()
        pruned[:lost] = 0
        recovered = pruned.copy()
        recovered[:won] = 1
        worse = cls_base.copy()
        if gen_recovered and k in gen_recovered:  # classification falls to chance on all but that share
            right = np.flatnonzero(cls_base)
            worse[right[int(len(right) * gen_recovered[k]):]] = 0.5
        gen += [pruned, recovered]
        cls += [cls_base, worse]
    matrices = {"copy_l7": np.stack(gen), "piqa": np.stack(cls)}
    return labels, Figures(labels, matrices, {"copy_l7": 0.0, "piqa": 0.5},
                           {"classification": ["piqa"], "generative": ["copy_l7"]})


def test_sweep_verdicts_come_from_the_intervals():

    from layerprune.pipeline.studies import sweep_points, sweep_text

    study = SimpleNamespace(ratios=[1, 4])
    _, figures = _figures({1: 60, 4: 10})
    points = [sweep_points.point(study, figures, k) for k in study.ratios]
    gen = points[0]["generative"]
    assert gen["drop"]["value"] == pytest.approx(0.5) and gen["recovered_share"]["value"] == pytest.approx(0.6)
    assert gen["retention_recovered"]["value"] == pytest.approx(110 / 150)
    assert points[0]["classification"]["retention_recovered"]["value"] == pytest.approx(1.0)
    lines, tests = sweep_points.verdicts(study, figures, points)
    assert tests["a"]["holds"] and tests["b"]["holds"] and tests["b"]["difference"]["low"] > 0
    assert tests["a"]["shown_at"] == [1, 4] and "shown at every k where pruning costs something" in lines[0]
    assert lines[1].startswith("(b) ") and ": shown (shares 60.0% [" in lines[1] and "(undefined 0.0%)" in lines[1]
    assert tests["b_retention"]["status"] == "shown" and lines[2].startswith("(b, as retention)")
    # the same share at both k: (b) not shown, said with its interval
    _, figures = _figures({1: 30, 4: 30})
    points = [sweep_points.point(study, figures, k) for k in study.ratios]
    lines, tests = sweep_points.verdicts(study, figures, points)
    assert not tests["b"]["holds"] and tests["b"]["status"] == "not shown" and ": not shown (shares" in lines[1]
    assert "difference 0.0% [" in lines[1] and tests["b_retention"]["status"] == "not shown"
    assert "| 4 | generative |" in sweep_text.format_table(points)


def test_verdict_a_is_said_per_k_shown_not_shown_or_contradicted():

    from layerprune.pipeline.studies import sweep_points

    study = SimpleNamespace(ratios=[1, 2, 4])
    # k=1: generative wins back all (gap holds 0), k=2: classification keeps 95% (gap above 0), k=4: classification
    # keeps 20% of its margin while generative keeps 40% of its own (gap below 0)
    _, figures = _figures({1: 100, 2: 0, 4: 60}, gen_recovered={1: 1.0, 2: 0.95, 4: 0.2})
    points = [sweep_points.point(study, figures, k) for k in study.ratios]
    lines, tests = sweep_points.verdicts(study, figures, points)
    per_k = tests["a"]["per_k"]
    assert {k: v["status"] for k, v in per_k.items()} == {1: "not shown", 2: "shown", 4: "contradicted"}
    assert per_k[4]["gap"]["high"] < 0 < per_k[2]["gap"]["low"] and not tests["a"]["holds"]
    assert "shown at k = 2; not shown at k = 1; contradicted at k = 4" in lines[0]
    assert "k=4: contradicted, -" in lines[0]
    # no interval at all (an original at chance): not shown, and said so
    lines, tests = sweep_points._verdict_a([{"k": 1, "gap_recovered": {"value": None, "low": None, "high": None},
                                             "costs": False}])
    assert tests["a"]["not_shown_at"] == [1] and "not shown at k = 1 (gap" in lines[0] and "k=1: not shown, undefined" \
        in lines[0]


def test_the_k0_control_nets_the_recovered_share_and_every_share_says_how_often_it_is_undefined():

    from layerprune.pipeline.studies import sweep_points, sweep_text

    study = SimpleNamespace(ratios=[1, 4])
    # the recovery alone wins 20 of the original's 50 wrong items: +10 points that are no recovery of the cut
    _, figures = _figures({1: 60, 4: 10}, control=20)
    control = sweep_points.control_point(figures)
    assert control["generative"]["change"]["value"] == pytest.approx(0.1)
    assert control["classification"]["change"]["value"] == pytest.approx(0.0)
    points = [sweep_points.point(study, figures, k) for k in study.ratios]
    gen = points[0]["generative"]
    assert gen["recovered_share"]["value"] == pytest.approx(0.6)
    assert gen["recovered_share_net"]["value"] == pytest.approx((0.3 - 0.1) / 0.5)
    lines, tests = sweep_points.verdicts(study, figures, points)
    assert tests["b_net"]["difference"]["value"] == pytest.approx(0.4 - (0.05 - 0.1) / 0.5)
    assert any(line.startswith("(b, net of the control)") for line in lines)
    table = sweep_text.format_table(points)
    assert "recovered share net of the k = 0 control" in table and "40.0% [" in table
    text = sweep_text.format_control(control, "lora", False)
    assert "| generative | 75.0% [" in text and "| 10.0% [" in text
    assert "needs a cut" in sweep_text.format_control(None, "local", True)
    # a drop of 5 items of 200: clear, but its interval comes within 2 points of 0, so its share is unbounded, not a
    # ratio (issue 56); without that margin, on some resamples none of the 5 is drawn and the share is undefined there
    _, figures = _figures({1: 3, 4: 10}, lost=5)
    point = sweep_points.point(study, figures, 1)
    assert point["generative"]["recovered_share"].startswith("unbounded (the drop's interval [")
    assert "unbounded" in sweep_text.format_table([point])
    share = figures.interval(lambda m: sweep_points._share(figures, 1, "generative", m))
    assert 0 < share["undefined"] < 0.05
    assert f"(undefined {100 * share['undefined']:.1f}%)" in sweep_points.share_pct(share)


def _tiny_study(tiny_llama, tmp_path, **fields):  # noqa: ANN001, ANN202 (a SweepStudy)
    return SweepStudy.model_validate({**tiny_sweep(tiny_llama, tmp_path / "s"), **fields})


def _output(study: SweepStudy, root: Path, name: str) -> Path:
    """The output of the stage called `name` (the grid's cells give it; nothing parses a name back)."""

    return {cell.name: cell.output for cell in sweep_cells.cells(study, root)}[name]


def _recover(study: SweepStudy, settings: Any, root: Path, label: str) -> None:
    """The recover stage of `label` run as the runner runs it: given its cell (arm, k, replicate, budget, snapshots)."""
    from layerprune.pipeline.studies import sweep

    given = {cell.name: cell for cell in sweep_cells.cells(study, root)}
    sweep.recover_at(study, settings, root, given[f"recover-{label}"])


def test_a_run_order_runs_cut_by_cut_with_every_replicate_and_changes_no_stage_or_fingerprint(tiny_llama, tmp_path):
    from layerprune.pipeline.stages import recipe_fingerprint

    by_replicate = _tiny_study(tiny_llama, tmp_path, replicates=2, controls=True)
    by_cut = _tiny_study(tiny_llama, tmp_path, replicates=2, controls=True, run_order=[2, 0, 1])
    assert sweep_cells.stage_names(by_cut)[4:] == [
        "prune-k2", "eval-pruned-k2", "recover-k2", "eval-recovered-k2", "recover-k2@r1", "eval-recovered-k2@r1",
        "recover-k0", "eval-recovered-k0", "recover-k0@r1", "eval-recovered-k0@r1",
        "prune-k1", "eval-pruned-k1", "recover-k1", "eval-recovered-k1", "recover-k1@r1", "eval-recovered-k1@r1",
        "report"]
    root = tmp_path / "s"
    assert {c.name: c for c in sweep_cells.cells(by_cut, root)} == {c.name: c for c in sweep_cells.cells(
        by_replicate, root)}  # the same stages, each given the same: only when each runs differs
    assert recipe_fingerprint(by_cut) == recipe_fingerprint(by_replicate)  # a run in progress takes it on resume
    for order, why in (([2, 1], r"every cut once \(1, 2, 0; 0: the k = 0 controls\), not \[2, 1\]"),
                       ([2, 0, 1, 1], "every cut once"), ([3, 0, 1], "every cut once")):
        with pytest.raises(ValueError, match=why):
            _tiny_study(tiny_llama, tmp_path, replicates=2, controls=True, run_order=order)


def test_replicates_and_the_control_add_stages_and_leave_replicate_0_as_it_was(tiny_llama, tmp_path):
    from layerprune.pipeline.studies import sweep_grid

    plain = _tiny_study(tiny_llama, tmp_path)
    assert sweep_cells.stage_names(plain) == [
        "calibrate-probes", "score", "gate-gsm8k", "eval-baseline", "prune-k1", "eval-pruned-k1", "recover-k1",
        "eval-recovered-k1", "prune-k2", "eval-pruned-k2", "recover-k2", "eval-recovered-k2", "report"]
    more = _tiny_study(tiny_llama, tmp_path, replicates=2, controls=True)
    assert sweep_grid.models(more) == ["baseline", "recovered-k0", "recovered-k0@r1", "pruned-k1", "recovered-k1",
                                  "recovered-k1@r1", "pruned-k2", "recovered-k2", "recovered-k2@r1"]
    stages = sweep_cells.stage_names(more)
    # replicate by replicate: replicate 0 of every cut and its control before any stage of replicate 1
    assert stages[4:] == ["prune-k1", "eval-pruned-k1", "recover-k1", "eval-recovered-k1", "prune-k2",
                          "eval-pruned-k2", "recover-k2", "eval-recovered-k2", "recover-k0", "eval-recovered-k0",
                          "recover-k1@r1", "eval-recovered-k1@r1", "recover-k2@r1", "eval-recovered-k2@r1",
                          "recover-k0@r1", "eval-recovered-k0@r1", "report"]
    assert set(sweep_cells.stage_names(plain)) < set(stages) and len(stages) == 13 + 4 + 4
    root = tmp_path / "s"
    assert _output(more, root, "recover-k2@r1") == root / "recovered-k2@r1" / "recover_report.json"
    assert _output(more, root, "eval-recovered-k0@r1") == root / "eval" / "recovered-k0@r1" / "summary.json"
    chat = SweepStudy.model_validate(chat_sweep(tiny_sweep(tiny_llama, tmp_path / "s")))  # chat-formatted data
    assert sweep_cells.stage_names(chat) == [
        "calibrate-probes", "score", "gate-gsm8k", "eval-baseline", "eval-chat/baseline", "prune-k1",
        "eval-pruned-k1", "eval-chat/pruned-k1", "recover-k1", "eval-recovered-k1", "eval-chat/recovered-k1",
        "prune-k2", "eval-pruned-k2", "eval-chat/pruned-k2", "recover-k2", "eval-recovered-k2",
        "eval-chat/recovered-k2", "report"]
    assert _output(chat, root, "eval-chat/pruned-k1") == root / "eval-chat" / "pruned-k1" / "summary.json"
    chat_data = chat_sweep(tiny_sweep(tiny_llama, tmp_path / "s"))
    chat_data["evaluate"]["probe_format"] = "chat"
    with pytest.raises(Exception, match="leave it plain"):
        SweepStudy.model_validate(chat_data)
    local = _tiny_study(tiny_llama, tmp_path, controls=True)
    local.recover["overrides"]["method"] = "local"
    assert not sweep_grid.has_control(local) and "recover-k0" not in sweep_cells.stage_names(local)
    # more replicates or the control only add stages: the run directory stays this sweep's
    from layerprune.pipeline.stages import recipe_fingerprint

    assert recipe_fingerprint(plain) == recipe_fingerprint(more)
    assert recipe_fingerprint(plain) != recipe_fingerprint(
        _tiny_study(tiny_llama, tmp_path, ratios=[1, 3], prune={**plain.prune.model_dump(), "drop": 3}))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_replicate_r_recovers_with_seed_plus_r_and_shares_answers_only_when_greedy(tiny_llama, tmp_path, monkeypatch,
                                                                                   temperature):
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies import sweep

    calls = []
    monkeypatch.setattr(sweep, "recover_sharing_answers",
                        lambda recipe, job, shared: calls.append((recipe.model, job.output.name, job.settings.seed,
                                                                  shared.name)))
    study = _tiny_study(tiny_llama, tmp_path, replicates=3, controls=True)
    study.recover["overrides"]["generate"]["temperature"] = temperature
    root = tmp_path / "s"
    for label in ("k2", "k2@r1", "k0@r2"):
        _recover(study, RunSettings(seed=5), root, label)
    own = temperature > 0
    assert calls == [(str(root / "pruned-k2"), "recovered-k2", 5, "selfgen.jsonl"),
                     (str(root / "pruned-k2"), "recovered-k2@r1", 6, "selfgen@r1.jsonl" if own else "selfgen.jsonl"),
                     (str(root / "original"), "recovered-k0@r2", 7, "selfgen@r2.jsonl" if own else "selfgen.jsonl")]
    assert (root / "original" / "config.json").is_file()  # the control's student: the original, a folder apart,
    weights = root / "original" / "model.safetensors"  # its files linked: no second copy of the weights on disk
    assert weights.stat().st_ino == (tiny_llama / "model.safetensors").stat().st_ino


def test_the_dry_run_lists_the_replicates_and_the_control(capsys, tiny_llama, tmp_path):
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(yaml.safe_dump({**tiny_sweep(tiny_llama, tmp_path / "s"), "replicates": 2, "controls": True}))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert code == 0, err
    assert "models evaluated: 9 (baseline, recovered-k0, recovered-k0@r1, pruned-k1," in out
    assert "2 replicates of every recovery (seeds settings.seed + 0..1" in out and "k = 0 control: the same" in out
    assert "recoveries: 6; stages: 21 (eval 9, " in out and "; in order: " in out  # 21 names in brief
    names = stage_names(SweepStudy.model_validate(yaml.safe_load(recipe.read_text())))
    assert len(names) == 21 and "recover-k0@r1, eval-recovered-k0@r1" in ", ".join(names)
    assert not (tmp_path / "s").exists()
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run", "--replicates", "3"])  # the flag beats it
    assert code == 0, err
    assert "3 replicates of every recovery (seeds settings.seed + 0..2" in out


def _eval_folder(folder: Path, rows: dict[str, tuple[str, list[float]]]) -> None:
    """A synthetic eval folder: summary.json and samples/TASK.jsonl of per-item scores (two choices per
    classification item)."""
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
    summary = Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash="h", results=results)
    (folder / "summary.json").write_text(summary.model_dump_json())


def test_replicates_are_one_point_their_mean_with_the_run_sd_beside_the_item_se(tmp_path):
    import numpy as np

    from layerprune.pipeline.studies import sweep_points, sweep_text

    rng = np.random.default_rng(1)
    n = 120
    cls = (rng.random(n) < 0.8).astype(float).tolist()
    base = np.r_[np.ones(90), np.zeros(n - 90)]
    runs = {"recovered-k1": 40, "recovered-k1@r1": 50, "recovered-k1@r2": 60}  # items won back by each replicate
    gen = {"baseline": base, "pruned-k1": np.r_[np.zeros(80), base[80:]]}
    for label, won in runs.items():
        gen[label] = gen["pruned-k1"].copy()
        gen[label][:won] = 1
    folders = {}
    for label, scores in gen.items():
        folders[label] = tmp_path / "eval" / label
        _eval_folder(folders[label], {"piqa": ("classification", cls), "copy_l7": ("generative", scores.tolist())})
    figures, _ = study_figures(folders)
    assert figures.labels == ["baseline", "pruned-k1", "recovered-k1"] and figures.matrices[1].shape == (5, n)
    point = sweep_points.point(SimpleNamespace(ratios=[1]), figures, 1)
    won = [np.mean(gen[label]) for label in runs]
    assert point["generative"]["recovered"]["value"] == pytest.approx(np.mean(won))
    spread = point["generative"]["spread"]
    assert spread["replicates"] == 3 and spread["run_sd"] == pytest.approx(np.std(won, ddof=1))
    assert point["classification"]["spread"]["run_sd"] == pytest.approx(0.0)
    table = sweep_text.format_spread([point], None)
    assert f"| 1 | generative | 3 | {100 * np.std(won, ddof=1):.1f} | {100 * spread['item_se']:.1f} |" in table


def test_records_list_every_models_samples_and_say_when_they_are_gone(tmp_path):
    from layerprune.pipeline.studies import figures

    folders = {}
    for label in ("baseline", "pruned-k1", "recovered-k1"):
        folders[label] = tmp_path / "eval" / label
        (folders[label] / "samples").mkdir(parents=True)
        (folders[label] / "samples" / "copy_l3.jsonl").write_text("{}\n")
    kept = figures.records(tmp_path, folders)
    assert kept["recovered-k1"] == {"folder": "eval/recovered-k1",
                                    "samples": ["eval/recovered-k1/samples/copy_l3.jsonl"],
                                    "missing": False}
    (folders["pruned-k1"] / "samples" / "copy_l3.jsonl").unlink()
    kept = figures.records(tmp_path, folders)
    assert kept["pruned-k1"]["missing"] and "MISSING for pruned-k1" in figures.records_line(kept)


ARMS = {"lora": {"method": "lora"}, "local": {"method": "local", "local": {"steps": 2, "learning_rate": 1.0e-3}}}


def test_arms_recover_every_k_with_every_arm_and_a_sweep_without_arms_is_as_it_was(tiny_llama, tmp_path):
    from layerprune.pipeline.stages import recipe_fingerprint
    from layerprune.pipeline.studies import sweep_grid

    study = _tiny_study(tiny_llama, tmp_path, arms=ARMS, replicates=2, controls=True)
    assert sweep_grid.models(study) == ["baseline", "lora-k0", "lora-k0@r1", "pruned-k1", "lora-k1", "lora-k1@r1",
                                   "local-k1", "local-k1@r1", "pruned-k2", "lora-k2", "lora-k2@r1", "local-k2",
                                   "local-k2@r1"]  # local needs a cut: no k = 0 control
    stages = sweep_cells.stage_names(study)
    assert stages[4:8] == ["prune-k1", "eval-pruned-k1", "recover-lora-k1", "eval-lora-k1"]
    grid = sweep_cells.cells(study, tmp_path)[4:-1]
    first = [cell.replicate for cell in grid]
    assert all(cell.name.endswith(f"@r{cell.replicate}") == (cell.replicate > 0) for cell in grid if cell.label)
    assert first == sorted(first) and stages[stages.index("recover-lora-k1@r1") - 2:][:2] == [
        "recover-lora-k0", "eval-lora-k0"]  # replicate 0 whole (its cuts, then its control) before replicate 1
    assert len(stages) == 4 + 4 + 2 * (2 + 8) + 1 and "recover-local-k0" not in stages
    root = tmp_path / "s"
    assert _output(study, root, "recover-local-k2@r1") == root / "local-k2@r1" / "recover_report.json"
    assert _output(study, root, "eval-local-k2") == root / "eval" / "local-k2" / "summary.json"
    # each arm's recipe is the recovery study's derivation from the shared one (the probe seed excluded too)
    assert study.arm_recipe("local", "p").method == "local" and study.arm_recipe("lora", "p").method == "lora"
    assert study.evaluate.probe_seed in study.arm_recipe("lora", "p").prompts.exclude_probe_seeds
    assert study.arm_recipe(None, "p") == study.shared_recipe("p")
    # without arms: the same labels, stages and fingerprint as before arms existed
    plain = _tiny_study(tiny_llama, tmp_path)
    assert "arms" not in plain.model_dump(exclude_defaults=True)
    assert recipe_fingerprint(plain) != recipe_fingerprint(study)
    one = _tiny_study(tiny_llama, tmp_path, arms=ARMS)  # more replicates (or the controls) resume the arms' sweep
    assert recipe_fingerprint(one) == recipe_fingerprint(study)
    for label in ("pruned", "recovered", "a@r1", "baseline"):
        with pytest.raises(Exception, match=f"arm label '{label}'"):
            _tiny_study(tiny_llama, tmp_path, arms={label: {"method": "lora"}})
    with pytest.raises(Exception, match="arm 'bad'"):
        _tiny_study(tiny_llama, tmp_path, arms={"bad": {"method": "lora", "lora": {"r": -1}}})


def test_every_arm_recovers_with_its_recipe_and_shares_the_teacher_answers(tiny_llama, tmp_path, monkeypatch):
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies import sweep

    calls = []
    monkeypatch.setattr(sweep, "recover_sharing_answers",
                        lambda recipe, job, shared: calls.append((recipe.method, recipe.model, job.output.name,
                                                                  job.settings.seed, shared.name)))
    study = _tiny_study(tiny_llama, tmp_path, arms=ARMS, replicates=2, controls=True)
    root = tmp_path / "s"
    for label in ("lora-k2", "local-k1@r1", "lora-k0@r1"):
        _recover(study, RunSettings(seed=5), root, label)
    assert calls == [("lora", str(root / "pruned-k2"), "lora-k2", 5, "selfgen.jsonl"),
                     ("local", str(root / "pruned-k1"), "local-k1@r1", 6, "selfgen.jsonl"),
                     ("lora", str(root / "original"), "lora-k0@r1", 6, "selfgen.jsonl")]


def test_the_dry_run_plans_every_arm_at_its_own_rate(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = load_recipe("limits-sweep-embedded", "sweep-study")[0]
    data.update(ratios=[2, 3, 4], replicates=3, controls=True, output=str(tmp_path / "s"),
                arms={"sft": {"method": "lora"}, "local": {"method": "local", "local": {"steps": 72,
                                                                                       "learning_rate": 1.0e-3}}})
    data["prune"]["drop"] = 4
    recipe = tmp_path / "arms.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert code == 0, err
    assert "arms (2, each at every k, paired on the same items): sft, local; every arm on the same 160" in out
    assert "arm sft: lora, 2 epochs, lr 0.0005: about 54k trained tokens per k; 12 recoveries" in out
    assert "arm local: local, 72 local steps, lr 0.001: about 54k trained tokens per k; 9 recoveries" in out
    assert "k = 0 controls (the arm's recovery of the unpruned original, ARM-k0): sft; none for local" in out
    assert "models evaluated: 25 (baseline, sft-k0, sft-k0@r1, sft-k0@r2, pruned-k2, sft-k2," in out
    assert "recoveries: 21; stages: 78 (" in out and "arm local: memory" in out.replace("\n", " ")
    names = ", ".join(stage_names(SweepStudy.model_validate(data)))
    assert "eval-sft-k2, eval-chat/sft-k2, recover-local-k2" in names  # chat-formatted answers: both probe formats
    assert "stages: 78 (eval 25, eval-chat 25, recover 21, " in out
    assert "probe format: plain few-shot text and, as the recovery data is chat-formatted, through the chat" in out
    assert "training sft 64 min, training local 24 min" in out  # 12 x 54k at 170/s; 9 x 72 x 4 x 188 at 340/s
    assert not (tmp_path / "s").exists()


def test_arms_are_compared_pairwise_at_every_k_with_the_two_level_interval(tmp_path):
    import numpy as np

    from layerprune.pipeline.studies import sweep_curves, sweep_points, sweep_text

    rng = np.random.default_rng(2)
    n = 200
    cls = (rng.random(n) < 0.8).astype(float).tolist()
    base = np.r_[np.ones(150), np.zeros(n - 150)]
    won = {"lora": {1: (20, 30), 2: (10, 20)}, "local": {1: (60, 70), 2: (20, 30)}}  # items won back per replicate
    gen = {"baseline": base}
    for k in (1, 2):
        gen[f"pruned-k{k}"] = np.r_[np.zeros(100), base[100:]]
        for arm, per_k in won.items():
            for r, items in enumerate(per_k[k]):
                gen[f"{arm}-k{k}" + (f"@r{r}" if r else "")] = np.r_[np.ones(items), gen[f"pruned-k{k}"][items:]]
    folders = {}
    for label, scores in gen.items():
        folders[label] = tmp_path / "eval" / label
        _eval_folder(folders[label], {"piqa": ("classification", cls), "copy_l7": ("generative", scores.tolist())})
    figures, _ = study_figures(folders)
    study = SimpleNamespace(ratios=[1, 2])
    points = [sweep_points.point(study, figures, k, arm) for k in (1, 2) for arm in ("local", "lora")]
    assert points[0]["arm"] == "local" and points[0]["generative"]["recovered_share"]["value"] == pytest.approx(0.65)
    assert points[0]["generative"]["spread"]["replicates"] == 2
    rows = sweep_points.comparisons(figures, points, ["local", "lora"])
    assert [(r["k"], r["arms"]) for r in rows] == [(1, ["local", "lora"]), (2, ["local", "lora"])]
    share = rows[0]["generative"]["share"]
    assert share["value"] == pytest.approx(0.4) and rows[0]["generative"]["share_status"] == "shown"
    assert rows[0]["generative"]["score"]["value"] == pytest.approx(40 / n)
    assert rows[1]["generative"]["share"]["value"] == pytest.approx(0.1)
    assert rows[0]["classification"]["share"] == sweep_points.NO_CLEAR_DROP
    assert rows[0]["classification"]["score_status"] == "not shown"
    text = "\n".join(sweep_text.format_comparisons(rows, replicates=2))
    assert f"- local - lora at k = 1, generative: recovered share +40.0% [{100 * share['low']:.1f}, " in text
    assert "recovered score +20.0% [" in text and "run-to-run variance is in them" in text
    # each difference also has its Holm interval over the declared family: every pair at every k and kind (2 x 2)
    holm = rows[0]["generative"]["share_holm"]
    assert holm["family"] == 4 and holm["level"] >= 0.95 and holm["low"] <= share["low"]
    assert holm["declared"] == (holm["low"] > 0) and "(4 share differences, 4 score differences)" in text
    assert f"(Holm {100 * holm['level']:.1f}%: +40.0% [{100 * holm['low']:.1f}, " in text
    # per arm: the verdicts on its own points, one table with an arm column, the spread per arm
    lines, tests = sweep_points.verdicts(study, figures, [p for p in points if p["arm"] == "local"], "local")
    assert tests["b"]["difference"]["value"] == pytest.approx(0.65 - 0.25) and tests["b"]["status"] == "shown"
    assert "| 2 | lora | generative |" in sweep_text.format_table(points)
    assert "| 1 | local | generative | 2 |" in sweep_text.format_spread(points, None, {"local": None})
    sweep_curves.plot_retention(points, 30, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_tiny_sweep_with_two_arms_recovers_every_k_both_ways_and_compares_them_paired(capsys, tiny_llama, tmp_path,
                                                                                      monkeypatch):
    """Two arms at every k, lora's learning rate chosen from a grid (local keeps its own)."""
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "sweep.yaml"
    grid = {"lora": [1e-5, 5e-3]}
    recipe.write_text(yaml.safe_dump({**tiny_sweep(tiny_llama, tmp_path / "sweep"), "arms": ARMS, "lr_grid": grid},
                                     sort_keys=False))
    planned = run_cli(capsys, ["study", str(recipe), "--dry-run"])[1]
    assert "epochs, lr from the grid 1e-05, 0.005" in planned  # before: the recipe's rate, which no run trains at
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "sweep"
    search = json.loads((root / "lr_search" / "lora.json").read_text())
    assert f"epochs, lr {search['chosen']:g} chosen by lr-lora from the grid 1e-05, 0.005" in run_cli(
        capsys, ["study", str(recipe), "--dry-run"])[1]
    other = tmp_path / "other.yaml"  # another grid: the run there is another recipe's, its search not this one's
    other.write_text(recipe.read_text().replace("0.005", "0.004"))
    assert "epochs, lr from the grid 1e-05, 0.004" in run_cli(capsys, ["study", str(other), "--dry-run"])[1]
    losses = {c["learning_rate"]: c["held_out_loss"] for c in search["candidates"]}
    assert set(losses) == set(grid["lora"]) and search["k"] == 1 and losses[1e-5] != losses[5e-3]
    assert search["chosen"] == min(losses, key=losses.get) and search["seed_offset"] == 1000
    held = {name: json.loads((root / folder / "recover_report.json").read_text())["held_out_metrics"]["prompts"]
            for name, folder in (("search", search["chosen_folder"]), ("lora-k1", "lora-k1"))}
    assert held["search"] != held["lora-k1"]  # a seed of its own: the scored replicate 0 is not the chosen run
    for label in ("lora-k1", "lora-k2"):  # every k trained at the chosen rate; the search's runs are not scored
        report = json.loads((root / label / "recover_report.json").read_text())
        assert report["recipe"]["train"]["learning_rate"] == search["chosen"]
    local = json.loads((root / "local-k1" / "recover_report.json").read_text())
    assert local["recipe"]["local"]["learning_rate"] == ARMS["local"]["local"]["learning_rate"]  # no grid: its own
    assert sorted(p.name for p in (root / "eval").iterdir()) == ["baseline", "gate-gsm8k", "local-k1", "local-k2",
                                                                  "lora-k1", "lora-k2", "pruned-k1", "pruned-k2"]
    data = json.loads((root / "sweep.json").read_text())
    assert [(p["k"], p["arm"]) for p in data["points"]] == [(1, "lora"), (1, "local"), (2, "lora"), (2, "local")]
    assert data["arms"] == {"lora": "lora", "local": "local"} and set(data["verdicts"]) == {"lora", "local"}
    assert [(c["k"], c["arms"]) for c in data["comparisons"]] == [(1, ["lora", "local"]), (2, ["lora", "local"])]
    score = data["comparisons"][0]["generative"]["score"]
    assert score["low"] <= score["value"] <= score["high"]
    assert set(data["curves"]) == {"lora-k1", "local-k1", "lora-k2", "local-k2"}
    for folder in ("lr_search/lora/lr0", "lr_search/lora/lr1", "lora-k1", "local-k1", "lora-k2", "local-k2"):
        report = json.loads((root / folder / "recover_report.json").read_text())  # the teacher answered once
        assert (report["data"]["generation"]["generated"] > 0) == (folder == "lr_search/lora/lr0")
    assert_records_kept(root, ["baseline", "pruned-k1", "lora-k1", "local-k1", "pruned-k2", "lora-k2", "local-k2"])
    text = (root / "sweep.md").read_text()
    assert "- lora: (a)" in text and "- local: (b" in text and "| 2 | local | generative |" in text
    assert "- lora - local at k = 1, generative: recovered share" in text
    assert "No k = 0 control (controls: false)" in text and "Recovery budget per k and arm" in text
    for label in ("lora-k1", "local-k1"):  # every arm's budget in one unit: unpadded target tokens, with its lr
        curve = data["curves"][label]
        assert curve["tokens_unpadded"] > 0 and curve["sequences"] > 0 and curve["learning_rate"] > 0
        assert f"{label}: {curve['tokens_unpadded']} unpadded target tokens, {curve['sequences']} sequences" in text
    assert "Every scored skill is unseen" not in text and "measured, not assumed" in text
    assert f"Learning rate of lora: {search['chosen']:g}, the lowest held-out CE" in text


def test_a_missing_control_says_why_and_local_s_would_be_the_original():
    from layerprune.pipeline.studies.sweep_text import format_control

    local = format_control(None, "local", True, "local")
    assert local.startswith("No k = 0 control of arm local: local needs a cut")
    assert "loss and gradient are zero" in local
    assert "gradient" not in format_control(None, "replace", True, "replace")
    assert format_control(None, "", False).startswith("No k = 0 control (controls: false)")


def test_the_2_core_rates_estimate_a_variant_of_the_embedded_model_and_nothing_else(tmp_path):
    from layerprune.pipeline.studies.cells import rates_apply

    other = tmp_path / "v.yaml"
    other.write_text(yaml.safe_dump({"kind": "variant", "method": "sft", "model": "Qwen/Qwen2.5-7B",
                                     "data": {"probes": {"arith_2d_add": 8}}}))
    assert rates_apply(None) and rates_apply("embedded") and rates_apply("variant:math-embedded")
    assert not rates_apply(f"variant:{other}") and not rates_apply(str(tmp_path))


def test_the_sweep_s_lr_grid_is_a_stage_per_arm_checked_and_out_of_a_gridless_fingerprint(tiny_llama, tmp_path):
    from layerprune.pipeline.stages import recipe_fingerprint

    study = _tiny_study(tiny_llama, tmp_path, arms=ARMS, lr_grid={"local": [1e-3, 3e-3]})
    assert sweep_cells.stage_names(study)[3:5] == ["eval-baseline", "lr-local"] and study.lr_k == 1
    assert _output(study, tmp_path, "lr-local") == tmp_path / "lr_search" / "local.json"
    assert _tiny_study(tiny_llama, tmp_path, arms=ARMS, lr_grid={"lora": [1e-4]}, lr_at=2).lr_k == 2
    for fields, message in (({"lr_grid": {"lora": [1e-4]}}, "name the recovery methods in arms"),
                            ({"arms": ARMS, "lr_grid": {"kd": [1e-4]}}, "'kd' is no arm"),
                            ({"arms": ARMS, "lr_grid": {"lora": []}}, "one or more"),
                            ({"arms": ARMS, "lr_grid": {"lora": [1e-4]}, "lr_at": 3}, "lr_at: one of ratios"),
                            ({"arms": ARMS, "lr_at": 1}, "with an lr_grid")):
        with pytest.raises(Exception, match=message):
            _tiny_study(tiny_llama, tmp_path, **fields)
    gridless = _tiny_study(tiny_llama, tmp_path, arms=ARMS)
    dumped = gridless.model_dump(exclude_defaults=True)
    assert "lr_grid" not in dumped and "lr_at" not in dumped  # at their defaults: out of the fingerprint
    assert recipe_fingerprint(gridless) != recipe_fingerprint(study)


@pytest.mark.parametrize("name", ["limits-sweep-math-gsm8k-embedded", "limits-sweep-arms-embedded"])
def test_a_field_added_at_its_default_changes_no_fingerprint_and_older_runs_keep_their_folder(name, tmp_path):
    """One rule for every recipe and study: the non-default fields in a canonical order. A schema field added later at
    its default leaves every fingerprint alone (no per-field shim), and a folder claimed under an older rule (its
    run.json's fingerprint) is still this recipe's: its stored recipe is fingerprinted by today's rule."""
    from pydantic import Field

    from layerprune.core.reports import read_report, write_report
    from layerprune.pipeline.stages import RunPaths, RunState, claim_run_dir, recipe_fingerprint
    from layerprune.pipeline.studies.sweep_grid import SweepStudy

    class Later(SweepStudy):  # the schema as a later release might have it
        added_later: int = Field(3, description="a new knob at its default")

    study = SweepStudy.load(name)
    assert recipe_fingerprint(Later.model_validate(study.model_dump())) == recipe_fingerprint(study)
    reordered = SweepStudy.model_validate(dict(reversed(list(study.model_dump().items()))))
    assert recipe_fingerprint(reordered) == recipe_fingerprint(study)
    paths = RunPaths(tmp_path / "run")
    claim_run_dir(paths, study, overwrite=False)
    state = read_report(paths.state, RunState)
    write_report(paths.state, state.model_copy(update={"fingerprint": "0123456789abcdef"}))  # an older rule's
    claim_run_dir(paths, study, overwrite=False)  # resumes: not refused as another recipe's


def test_a_finished_sweep_given_another_arm_resumes_and_a_changed_arm_is_still_refused(tiny_llama, tmp_path):
    from layerprune.core.errors import LayerpruneError
    from layerprune.core.reports import read_report
    from layerprune.pipeline.stages import RunPaths, RunState, claim_run_dir
    from layerprune.pipeline.studies import sweep, sweep_plan

    lora = {"lora": ARMS["lora"]}
    first = _tiny_study(tiny_llama, tmp_path, arms=lora, replicates=2, controls=True)
    paths = RunPaths(tmp_path / "s")
    claim_run_dir(paths, first, overwrite=False)
    provenance = read_report(paths.state, RunState).provenance
    changed = _tiny_study(tiny_llama, tmp_path, arms={**ARMS, "lora": {"method": "lora", "lora": {"r": 4}}})
    other_cut = _tiny_study(tiny_llama, tmp_path, arms=ARMS, ratios=[1, 3],
                            prune={**first.prune.model_dump(), "drop": 3})
    other_recovery = _tiny_study(tiny_llama, tmp_path, arms=ARMS)
    other_recovery.recover["overrides"]["train"]["learning_rate"] = 1e-3  # the shared recovery every arm derives from
    for study in (changed, other_cut, other_recovery, first):  # an arm changed, another cut or shared recovery,
        assert sweep.adopt_added_arms(study, paths) == []  # nothing added: run.json untouched
    (line,) = sweep_plan.progress_lines(other_cut, paths.root)
    assert "holds another recipe's run" in line and "would be refused" in line
    with pytest.raises(LayerpruneError, match="holds outputs of another recipe"):
        claim_run_dir(paths, changed, overwrite=False)
    more = _tiny_study(tiny_llama, tmp_path, arms={**lora, "local": ARMS["local"]}, replicates=3, controls=True)
    assert sweep.adopt_added_arms(more, paths) == ["local"]
    claim_run_dir(paths, more, overwrite=False)  # the directory is now this sweep's
    state = read_report(paths.state, RunState)
    assert set(state.recipe["arms"]) == {"lora", "local"} and state.provenance == provenance
    assert sweep.adopt_added_arms(more, paths) == []  # adopted once
    for stage in ("calibrate-probes", "recover-lora-k1"):  # the dry run says what is done and what is left
        _output(more, paths.root, stage).parent.mkdir(parents=True, exist_ok=True)
        _output(more, paths.root, stage).write_text("{}")
    stages = [name for name in sweep_cells.stage_names(more) if name != "report"]
    (line,) = sweep_plan.progress_lines(more, paths.root)
    assert "holds a run of this sweep:" in line and f"2 of {len(stages)} stages complete" in line
    left = [name for name in stages if name not in ("calibrate-probes", "recover-lora-k1")]
    assert f"left: {in_brief(left)}" in line and "in order: score, gate-gsm8k, " in line
    assert "recover-local-k1" in left and "eval-local-k1" in left and "recover-lora-k1" not in left
    assert sweep_plan.progress_lines(more, tmp_path / "elsewhere") == []
    # a grid for the added arm alone is the added arm's business; a run recorded without arms is not adopted
    grid = _tiny_study(tiny_llama, tmp_path, arms={**more.arms, "kd": {"method": "kd"}}, lr_grid={"kd": [1e-4, 1e-3]})
    assert "arms kd would be added" in sweep_plan.progress_lines(grid, paths.root)[0]
    assert sweep.adopt_added_arms(grid, paths) == ["kd"]
    armless = RunPaths(tmp_path / "armless")
    claim_run_dir(armless, _tiny_study(tiny_llama, tmp_path), overwrite=False)
    assert sweep.adopt_added_arms(more, armless) == []
    armless.state.write_text("{not json")  # a torn run.json: left to claim_run_dir's one-line error
    assert sweep.adopt_added_arms(more, armless) == []
    assert "would be refused" in sweep_plan.progress_lines(more, armless.root)[0]
    assert sweep.adopt_added_arms(_tiny_study(tiny_llama, tmp_path), paths) == []  # no arms: nothing to add


def test_a_budget_checkpoint_is_saved_at_the_step_whose_target_tokens_first_reach_it(tmp_path):
    """budget.Snapshots: the step that first reaches a budget is saved (should_save), its weights (not the
    optimizer) copied with the counts; a budget kept by an earlier run of a resumed one is not taken again."""
    from layerprune.recover import budget

    counter = budget.TargetTokens()
    snapshots = budget.Snapshots(counter, [20, 30, 100], tmp_path / "snap")
    args = SimpleNamespace(output_dir=str(tmp_path / "trainer"))
    saved = []
    for step, tokens in enumerate([12, 7, 2, 14, 10], start=1):  # cumulative 12, 19, 21, 35, 45
        counter.totals["tokens_unpadded"] += tokens
        state = SimpleNamespace(global_step=step, is_world_process_zero=True)
        control = snapshots.on_step_end(args, state, SimpleNamespace(should_save=False))
        if control.should_save:
            checkpoint = tmp_path / "trainer" / f"checkpoint-{step}"
            checkpoint.mkdir(parents=True)
            (checkpoint / "adapter_model.safetensors").write_text(str(step))
            (checkpoint / "optimizer.pt").write_text("state")
            snapshots.on_save(args, state, control)
            saved.append(step)
    assert saved == [3, 4]  # 21 >= 20 at step 3 (19 before), 35 >= 30 at step 4; 100 never
    for target, step, reached in ((20, 3, 21), (30, 4, 35)):
        folder = tmp_path / "snap" / str(target)
        record = json.loads((folder / "snapshot.json").read_text())
        assert record["budget"] == target and record["tokens_unpadded"] == reached
        assert record["optimizer_steps"] == step and (folder / "adapter_model.safetensors").read_text() == str(step)
        assert not (folder / "optimizer.pt").exists()
    assert budget.Snapshots(counter, [20, 30, 100], tmp_path / "snap").budgets == [100]  # resumed: kept ones stay


def _budget_sweep(tiny_llama: Path, output: Path, **fields: object) -> dict:
    data = {**tiny_sweep(tiny_llama, output), "arms": ARMS, **fields}
    data["recover"]["overrides"]["train"].update(epochs=6, warmup_steps=1)
    return data


def test_a_sweep_without_arms_writes_each_budget_point_where_its_evaluation_reads_it(tiny_llama, tmp_path):
    """Without arms a recovered point is recovered-kK...: its dedicated run is written to recovered-k1@20-dedicated
    (the name parsed back gave k1@20-dedicated, a folder no evaluation read), and the run at the largest budget saves
    its checkpoints where their evaluations read them."""
    data = _budget_sweep(tiny_llama, tmp_path / "s", budgets=[20, 40000], dedicated_at=20, replicates=2)
    del data["arms"]
    study = SweepStudy.model_validate(data)
    root = tmp_path / "s"
    grid = {cell.name: cell for cell in sweep_cells.cells(study, root)}
    dedicated = grid["recover-k1@20-dedicated@r1"]
    assert dedicated.output == root / "recovered-k1@20-dedicated@r1" / "recover_report.json"
    assert grid["eval-recovered-k1@20-dedicated@r1"].label == dedicated.label
    assert (dedicated.budget, dedicated.snapshots) == (20, ())
    run = grid["recover-k1@r1"]
    assert (run.budget, run.snapshots) == (40000, ((20, "recovered-k1@20@r1"),))
    assert "eval-recovered-k1@20@r1" in grid and "recover-k1@20@r1" not in grid  # a checkpoint, not a run


def test_bad_budgets_are_one_line_errors(capsys, tiny_llama, tmp_path):
    cases = [({"budgets": [50, 20]}, "increasing order"), ({"budgets": [20]}, "two or more"),
             ({"budgets": [20, 50], "arms": {"merge": {"method": "merge"}}}, "trains nothing"),
             ({"budgets": [20, 50], "dedicated_at": 50}, "below the largest")]
    for fields, needle in cases:
        recipe = tmp_path / "bad.yaml"
        recipe.write_text(yaml.safe_dump(_budget_sweep(tiny_llama, tmp_path / "s", **fields)))
        assert_one_line_error(*run_cli(capsys, ["study", str(recipe), "--dry-run"])[::2], needle)
    decaying = _budget_sweep(tiny_llama, tmp_path / "s", budgets=[20, 50])
    decaying["recover"]["overrides"]["train"]["lr_scheduler"] = "cosine"
    recipe.write_text(yaml.safe_dump(decaying))
    assert_one_line_error(*run_cli(capsys, ["study", str(recipe), "--dry-run"])[::2], "decays its rate", "cosine")


def test_budget_points_are_labelled_staged_and_trained_to_their_budget(tiny_llama, tmp_path, monkeypatch):
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies import sweep, sweep_grid

    study = SweepStudy.model_validate(_budget_sweep(tiny_llama, tmp_path / "s", budgets=[20, 32768, 40000],
                                                    replicates=2, controls=True, dedicated_at=20))
    assert sweep_grid.models(study)[:9] == ["baseline", "lora-k0", "lora-k0@r1", "pruned-k1", "lora-k1@20",
                                       "lora-k1@20@r1", "lora-k1@32768", "lora-k1@32768@r1", "lora-k1"]
    stages = sweep_cells.stage_names(study)  # a checkpoint is scored after its run; local trains each budget on its own
    assert stages.index("eval-lora-k1@20@r1") > stages.index("recover-lora-k1@r1")
    assert "recover-lora-k1@20" not in stages and "recover-local-k1@20@r1" in stages
    assert "eval-lora-k2@32768" in stages and not any(s.startswith("eval-lora-k0@2") for s in stages)
    dedicated = [s for s in stages if "dedicated" in s]  # beside the checkpoint, at lr_k only, trainer arms only
    assert dedicated == ["recover-lora-k1@20-dedicated", "eval-lora-k1@20-dedicated", "recover-lora-k1@20-dedicated@r1",
                         "eval-lora-k1@20-dedicated@r1"]
    calls = []
    monkeypatch.setattr(sweep, "recover_sharing_answers", lambda recipe, job, shared: calls.append(
        (job.output.name, recipe.train.max_tokens, {b: p.name for b, p in job.snapshots.items()},
         job.states and job.states.relative_to(tmp_path))))
    for label in ("lora-k1@r1", "local-k1@20@r1", "local-k2", "lora-k0", "lora-k1@20-dedicated@r1"):
        _recover(study, RunSettings(), tmp_path / "s", label)
    states = Path("s") / sweep.STATES  # local's runs, one a budget, share the teacher's states; a trainer's keep none
    assert calls == [("lora-k1@r1", 40000, {20: "lora-k1@20@r1", 32768: "lora-k1@32768@r1"}, None),
                     ("local-k1@20@r1", 20, {}, states / "k1-r1"), ("local-k2", 40000, {}, states / "k2-r0"),
                     ("lora-k0", 40000, {}, None), ("lora-k1@20-dedicated@r1", 20, {}, None)]


def test_a_cut_and_seeds_teacher_states_go_once_no_stage_left_reads_them(tiny_llama, tmp_path, monkeypatch):
    """local's states were kept to the sweep's end: 6 cuts and seeds of about 1.5-3 GB at the budget study's size
    beside its 48 GB of models. Now each cut and seed keeps a folder of its own, and before each recovery or search
    whatever no stage left reads goes: a cut and seed whose local runs are complete, the search's once it is, and
    the one-folder layout's files."""
    from layerprune.pipeline.studies import sweep

    study = SweepStudy.model_validate(_budget_sweep(tiny_llama, tmp_path / "s", budgets=[20, 4000], replicates=2,
                                                    lr_grid={"local": [1e-3, 2e-3]}))
    root = study.run_dir()
    states = root / sweep.STATES
    for name in ("k1-r0", "k1-r1", "k2-r0", "lr"):
        (states / name).mkdir(parents=True)
        (states / name / "a.pt").write_bytes(b"x")
    (states / "old-layout.pt").write_bytes(b"x")
    grid = sweep_cells.cells(study, root)
    done = [c for c in grid if c.step == "lr" or (c.step == "recover" and c.arm == "local" and c.k == 1
                                                   and c.replicate == 0)]
    done += [next(c for c in grid if c.step == "recover" and c.arm == "local" and (c.k, c.replicate) == (1, 1))]
    for cell in done:
        cell.output.parent.mkdir(parents=True, exist_ok=True)
        cell.output.write_text("{}")
    sweep.release_states(study, root)
    assert sorted(p.name for p in states.iterdir()) == ["k1-r1", "k2-r0"]  # k1-r1: its 4000 run is still to come
    assert (states / "k1-r1" / "a.pt").is_file()
    (states / "lr").mkdir()
    (states / "lr" / "a.pt").write_bytes(b"x")
    monkeypatch.setattr(sweep.shutil, "rmtree", lambda path: (_ for _ in ()).throw(PermissionError(13, "denied")))
    sweep.release_states(study, root)  # a removal that fails costs disk, not the stage
    assert (states / "lr" / "a.pt").is_file()


def test_the_estimate_counts_held_out_evaluations_and_local_states_captured_once_a_cut_and_seed(tiny_llama, tmp_path):
    """The dry run's estimate had no held-out evaluations (a trainer's every eval_steps) and no local teacher states:
    45 h for the budget study, not 36. Local's states are counted once a cut and seed where its runs share them."""
    from layerprune.pipeline.studies import recovery_plan, sweep, sweep_plan
    from layerprune.pipeline.studies.cells import RATES

    study = SweepStudy.model_validate(_budget_sweep(tiny_llama, tmp_path / "s", budgets=[20, 4000], replicates=3,
                                                    arms={"kd": {"method": "kd"}, **ARMS}))
    recipe = study.arm_recipe("kd", "<pruned>")
    per_eval = 8 * 0.25 * (6 + 60)  # samples x held_out x (max_new_tokens + 60) tokens, one sequence at a time
    per_step = 2 * 1 * 6  # batch x accum x max_new_tokens target tokens
    assert recipe.train.eval_steps == 1
    runs = [per_step * 5, per_step * 2]  # 5 and 2 steps: a callback evaluation each, and teacher, before and after
    assert recovery_plan.held_out_seconds(study, "kd", runs) == pytest.approx((8 + 5) * per_eval / RATES[
        "forward tokens/s"])
    assert recovery_plan.held_out_seconds(study, "lora", runs) == pytest.approx((12 + 5) * per_eval / RATES[
        "forward tokens/s"])  # SFT's trainer: also at its start and its last step, then the saved weights
    assert recovery_plan.held_out_seconds(study, "local", runs) == pytest.approx(2 * 4 * per_eval / RATES[
        "forward tokens/s"])  # no trainer: before, after the local step, after, and the teacher
    forwards = (1 + 2) * 3  # k x replicates (no lr grid), half the model deep each
    sequences = 8 * 0.75 * 66
    assert recovery_plan.states_seconds(study, "local") == pytest.approx(forwards / 2 * sequences / RATES[
        "forward tokens/s"])
    assert recovery_plan.states_seconds(study, "kd") == 0.0
    searched = study.model_copy(update={"lr_grid": {"local": [1e-3, 2e-3]}})  # its grid: two runs, one cut
    assert sweep.states_folder(searched, tmp_path, "local", search=True) == tmp_path / sweep.STATES / "lr"
    unbudgeted = searched.model_copy(update={"budgets": None})  # one run a cut and seed: nothing to share but the grid
    assert sweep.states_folder(unbudgeted, tmp_path, "local") is None
    assert sweep.states_folder(unbudgeted, tmp_path, "local", search=True) == tmp_path / sweep.STATES / "lr"
    assert recovery_plan.states_seconds(searched, "local") == pytest.approx((forwards + 1) / 2 * sequences / RATES[
        "forward tokens/s"])
    seconds = sweep_plan.sizing(study).seconds
    assert seconds["held-out evaluations"] > 0 and seconds["teacher states"] > 0


def test_tiny_budget_sweep_saves_and_scores_a_checkpoint_at_each_budget(capsys, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(yaml.safe_dump(_budget_sweep(tiny_llama, tmp_path / "sweep", budgets=[20, 50],
                                                   arms={"lora": ARMS["lora"]}), sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert code == 0, err
    assert "budget points (unpadded target tokens): 20, 50" in out
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "sweep"
    for k in (1, 2):
        final = json.loads((root / f"lora-k{k}" / "recover_report.json").read_text())
        point = json.loads((root / f"lora-k{k}@20" / "recover_report.json").read_text())
        assert final["recipe"]["train"]["max_tokens"] == 50 and final["tokens_unpadded"] >= 50
        assert 20 <= point["tokens_unpadded"] < final["tokens_unpadded"]
        per_step = final["tokens_unpadded"] / final["optimizer_steps"]
        assert point["tokens_unpadded"] < 20 + 3 * per_step  # the first step that reaches it, not a later one
        assert point["optimizer_steps"] < final["optimizer_steps"]
        assert any("on reaching 20 target tokens" in note for note in point["notes"])
        assert (root / "eval" / f"lora-k{k}@20" / "summary.json").is_file()
    from safetensors.torch import load_file

    early, late = (load_file(root / name / "model.safetensors") for name in ("lora-k1@20", "lora-k1"))
    assert any(not (early[name] == late[name]).all() for name in early)  # another model than the run's end
    assert not (root / "lora-k1.work").exists()
    text = (root / "budget.md").read_text()
    assert "| lora | 1 |" in text  # the report stage draws the curves too
    spent = text.split("## What each point spent", 1)[1]  # every point's budget: tokens, steps and lr as trained
    point = json.loads((root / "lora-k2@20" / "recover_report.json").read_text())
    final = json.loads((root / "lora-k2" / "recover_report.json").read_text())
    rate = [r.get("learning_rate") or r["recipe"]["train"]["learning_rate"] for r in (point, final)]
    assert (f"| lora | 2 | {point['tokens_unpadded']:,} / {point['optimizer_steps']} / {rate[0]:g} | "
            f"{final['tokens_unpadded']:,} / {final['optimizer_steps']} / {rate[1]:g} |") in spent
    assert f"Rerun: `layerprune study tiny-sweep --output {root}`" in spent
    from layerprune.pipeline import results

    archived = json.loads((root / "budget.json").read_text())
    assert results.study_kind(root) == "sweep"  # its results page: the sweep's report, then the budget curves
    page, data = results.KINDS["sweep"][1](root, tmp_path / "out")
    assert "## Budget curves: tiny-sweep" in page and "![budget curves](budget.png)" in page
    assert results.differences(archived, data["budget.json"]) == []


# --- declared comparisons (issue 56) -------------------------------------------------------------------------------

def _armed_figures(won: dict[str, dict[int, int]], n: int = 200):  # noqa: ANN202 (Figures)
    """Synthetic sweep with arms: generative loses 100 of the original's 150 right items at each k, arm ARM at k wins
    back won[ARM][k] of them; classification unchanged."""
    import numpy as np

    from layerprune.pipeline.paired_table import Figures

    cls = (np.random.default_rng(3).random(n) < 0.7).astype(float)
    base = np.r_[np.ones(150), np.zeros(n - 150)]
    pruned = np.r_[np.zeros(100), base[100:]]
    gen = {"baseline": base, **{f"pruned-k{k}": pruned for k in (1, 2)}}
    gen |= {f"{arm}-k{k}": np.r_[np.ones(items), pruned[items:]] for arm, per_k in won.items()
            for k, items in per_k.items()}
    labels = list(gen)
    return Figures(labels, {"copy_l7": np.stack(list(gen.values())), "piqa": np.stack([cls] * len(labels))},
                   {"copy_l7": 0.0, "piqa": 0.5}, {"classification": ["piqa"], "generative": ["copy_l7"]})


WON = {"lora": {1: 20, 2: 10}, "local": {1: 60, 2: 20}}
MAIN = [{"name": "local-vs-lora-k1", "a": "local", "b": "lora", "at": 1, "measure": "share"},
        {"a": "local", "at": 1, "b_at": 2, "measure": "share"},
        {"a": "lora", "at": 2, "measure": "gap"}]


def test_declared_comparisons_are_checked_when_the_recipe_loads(capsys, tiny_llama, tmp_path):
    import re

    from pydantic import ValidationError

    from layerprune.pipeline.stages import recipe_fingerprint

    study = _tiny_study(tiny_llama, tmp_path, arms=ARMS, comparisons={"main": MAIN})
    assert [c.label for c in study.comparisons["main"].contrasts] == [
        "local-vs-lora-k1", "local-k1-vs-local-k2-share", "lora-k2-gap"]
    assert recipe_fingerprint(study) == recipe_fingerprint(_tiny_study(tiny_llama, tmp_path, arms=ARMS))  # the run
    bad = {"unknown arm": ({"f": [{"a": "sft", "b": "lora", "at": 1}]}, "arm 'sft' is not in arms (lora, local)"),
           "unknown k": ({"f": [{"a": "lora", "b": "local", "at": 3}]}, "k = 3 is not in ratios (1, 2)"),
           "unknown b_at": ({"f": [{"a": "lora", "at": 1, "b_at": 4}]}, "k = 4 is not in ratios"),
           "duplicate": ({"f": MAIN[:1], "g": MAIN[:1]}, "comparisons.g.local-vs-lora-k1: a duplicate name"),
           "no control": ({"f": [{"a": "local", "at": 1, "b_at": 2, "net_of_control": True}]},
                          "arm 'local' has no k = 0 control"),
           "itself": ({"f": [{"a": "lora", "b": "lora", "at": 1}]}, "compares lora at k = 1 with itself"),
           "net gap": ({"f": [{"a": "lora", "at": 1, "measure": "gap", "net_of_control": True}]},
                       "net_of_control applies to share and score")}
    for families, message in bad.values():
        with pytest.raises(ValidationError, match=re.escape(message)):
            _tiny_study(tiny_llama, tmp_path, arms=ARMS, controls=True, comparisons=families)
        recipe = tmp_path / "bad.yaml"  # the CLI says it in one line before any stage runs, --dry-run included
        recipe.write_text(yaml.safe_dump({**tiny_sweep(tiny_llama, tmp_path / "s"), "arms": ARMS, "controls": True,
                                          "comparisons": families}))
        code, _, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
        assert_one_line_error(code, err, message.split(" (")[0])
        code, _, err = run_cli(capsys, ["recipes", "validate", str(recipe), "--kind", "sweep-study"])
        assert_one_line_error(code, err, message.split(" (")[0])
        assert not (tmp_path / "s").exists()
    without_arms = _tiny_study(tiny_llama, tmp_path, comparisons={"f": [{"a": "recovered", "at": 1, "b_at": 2}]})
    assert without_arms.comparisons["f"].contrasts[0].sides == [("recovered", 1), ("recovered", 2)]


def test_a_declared_family_gets_its_holm_interval_over_exactly_its_contrasts(tiny_llama, tmp_path):
    from layerprune.pipeline.studies import sweep_report
    from layerprune.pipeline.studies.comparisons import draw_families
    from layerprune.pipeline.studies.sweep_grid import recovered_label

    study = _tiny_study(tiny_llama, tmp_path, arms=ARMS, comparisons={
        "main": MAIN, "one": [{"name": "lora-score-k1-vs-k2", "a": "lora", "at": 1, "b_at": 2, "measure": "score"}]})
    figures = _armed_figures(WON)
    points, controls, pairs = sweep_report.arm_figures(study, figures)
    assert pairs == []  # a confirmatory family is declared: today's every-pair family is not drawn beside it
    drawn = draw_families(study.comparisons, figures, recovered_label)
    main = {c["name"]: c for c in drawn["main"]["contrasts"]}
    assert drawn["main"]["size"] == 3 and {c["holm"]["family"] for c in main.values()} == {3}
    assert main["local-vs-lora-k1"]["interval"]["value"] == pytest.approx(0.6 - 0.2)
    assert main["local-k1-vs-local-k2-share"]["interval"]["value"] == pytest.approx(0.6 - 0.2)
    assert main["lora-k2-gap"]["interval"]["value"] == pytest.approx(1.0 - 60 / 150)
    for row in main.values():  # each Holm interval at least as wide as its plain one, at a level Holm tests it at
        assert row["holm"]["low"] <= row["interval"]["low"] and row["holm"]["level"] >= 0.95
    one = drawn["one"]["contrasts"][0]
    assert one["holm"]["family"] == 1 and one["holm"]["level"] == pytest.approx(0.95)  # a family of one: as is
    assert (one["holm"]["low"], one["holm"]["high"]) == pytest.approx((one["interval"]["low"], one["interval"]["high"]))
    assert one["interval"]["value"] == pytest.approx(10 / 200)
    text = "\n".join(sweep_report._recovery_sections(study, points, controls, pairs, drawn))
    assert "Arms compared" not in text and "family main (3 contrasts; " in text and "family one (1 contrast; " in text
    assert "exploratory" not in text
    line = next(x for x in text.splitlines() if x.startswith("- local-vs-lora-k1: local at k = 1 - lora at k = 1"))
    assert f"(Holm {100 * main['local-vs-lora-k1']['holm']['level']:.1f}% over 3: +40.0% [" in line
    for row in main.values():  # 'differ' only where the Holm interval excludes 0
        said = next(x for x in text.splitlines() if x.startswith(f"- {row['name']}:"))
        assert ("differ" in said.replace("not shown to differ", "")) == row["holm"]["declared"]
    assert "differs from 0 (Holm)" in text  # the gap, against 0


def test_an_exploratory_family_is_reported_as_such_beside_todays_family(tiny_llama, tmp_path):
    from layerprune.pipeline.studies import sweep_report
    from layerprune.pipeline.studies.comparisons import EXPLORATORY, draw_families, uses_default_family
    from layerprune.pipeline.studies.sweep_grid import recovered_label

    study = _tiny_study(tiny_llama, tmp_path, arms=ARMS, comparisons={"late": {"exploratory": True, "contrasts": MAIN}})
    figures = _armed_figures(WON)
    points, controls, pairs = sweep_report.arm_figures(study, figures)
    assert [p["k"] for p in pairs] == [1, 2] and pairs[0]["generative"]["share_holm"]["family"] == 4  # today's
    drawn = draw_families(study.comparisons, figures, recovered_label)
    assert drawn["late"]["exploratory"] and {c["holm"]["family"] for c in drawn["late"]["contrasts"]} == {3}
    text = "\n".join(sweep_report._recovery_sections(study, points, controls, pairs, drawn))
    assert "(4 share differences, 4 score differences)" in text
    assert f"Declared comparisons, family late (3 contrasts, {EXPLORATORY};" in text
    assert EXPLORATORY == "exploratory (declared after the results were read)"
    shipped = SweepStudy.load("limits-sweep-math-dolly-embedded")  # its results were read: every family exploratory
    assert shipped.comparisons and uses_default_family(shipped.comparisons)


def test_an_arm_with_its_own_prompts_gets_its_own_teacher_answers_without_evaluation_items(tiny_llama, tmp_path,
                                                                                              monkeypatch):
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies import sweep

    arms = {"lora": ARMS["lora"], "aligned": {"method": "lora"}}
    own = {"source": "probes:arith_1d_sum3", "samples": 8}
    study = SweepStudy.model_validate(_budget_sweep(tiny_llama, tmp_path / "s", arms=arms, arm_prompts={
        "aligned": own}, replicates=2))
    recipe = study.arm_recipe("aligned", "<pruned>")
    assert recipe.prompts.source == own["source"] and study.evaluate.probe_seed in recipe.prompts.exclude_probe_seeds
    assert study.arm_recipe("lora", "<pruned>").prompts.source == "dolly"
    calls = []
    monkeypatch.setattr(sweep, "recover_sharing_answers",
                        lambda recipe, job, shared: calls.append((job.output.name, shared.name)))
    for label in ("aligned-k1", "aligned-k2@r1", "lora-k1"):
        _recover(study, RunSettings(), tmp_path / "s", label)
    assert calls == [("aligned-k1", "selfgen-aligned.jsonl"), ("aligned-k2@r1", "selfgen-aligned.jsonl"),
                     ("lora-k1", "selfgen.jsonl")]
    with pytest.raises(Exception, match="not among the arms"):
        SweepStudy.model_validate(_budget_sweep(tiny_llama, tmp_path / "s", arm_prompts={"kd": own}))


def test_the_saturating_fit_recovers_a_and_t_and_says_when_a_is_undetermined():
    import numpy as np

    from layerprune.pipeline.studies.budget_fit import SCALES, saturating_fit, tokens_for

    tokens = np.array([8000.0, 32000.0, 128000.0, 256000.0])
    a, t = saturating_fit(tokens, 0.4 * (1 - np.exp(-tokens / 30000.0)))
    assert float(a) == pytest.approx(0.4, rel=0.03) and float(t) == pytest.approx(30000.0, rel=0.05)
    assert tokens_for(0.4, 30000.0, 0.25, 256000) == pytest.approx(-30000.0 * np.log(1 - 0.25 / 0.4))
    assert tokens_for(0.4, 30000.0, 0.5, 256000) is None  # never reached below its asymptote
    a, t = saturating_fit(tokens, 0.4 * tokens / tokens[-1])  # still linear: t at the grid's end, a far past 1
    assert float(t) == SCALES[-1] and float(a) > 1
    assert np.isnan(saturating_fit(tokens, np.array([0.1, np.nan, 0.2, 0.3]))[0])


def test_the_budget_report_gives_each_curve_its_shares_fit_and_verdict(tiny_llama, tmp_path):
    import numpy as np

    from layerprune.pipeline.studies.budget_report import write_budget_report

    arms = {"sft": {"method": "lora"}, "kd": {"method": "kd"}, "kd-arith": {"method": "kd"}}
    study = SweepStudy.model_validate(_budget_sweep(tiny_llama, tmp_path / "s", arms=arms, budgets=[
        8000, 32000, 128000, 256000], arm_prompts={"kd-arith": {"source": "probes:arith_2d_sub"}}))
    root = tmp_path / "s"
    base = np.r_[np.ones(180), np.zeros(20)]
    pruned = np.r_[np.ones(20), np.zeros(180)]  # a drop of 160 items
    curves = {"sft": [0.2, 0.3, 0.35, 0.36], "kd": [0.0125, 0.05, 0.2, 0.4], "kd-arith": [0.3, 0.55, 0.8, 0.9]}
    rows = {"baseline": base, "pruned-k1": pruned}
    for arm, shares in curves.items():
        for tag, share in zip(["@8k", "@32k", "@128k", ""], shares, strict=True):
            rows[f"{arm}-k1{tag}"] = pruned.copy()
            rows[f"{arm}-k1{tag}"][20:20 + round(share * 160)] = 1
    for label, scores in rows.items():
        _eval_folder(root / "eval" / label, {"arith_2d_sub": ("generative", scores.tolist())})
    text = write_budget_report(study, root).read_text()
    data = json.loads((root / "budget.json").read_text())
    by_arm = {c["arm"]: c for c in data["curves"]}
    assert set(by_arm) == set(arms) and data["control_arm"] == "kd-arith"
    assert by_arm["sft"]["shares"]["32000"]["value"] == pytest.approx(0.3)
    assert by_arm["sft"]["asymptote"]["high"] < 0.5 and by_arm["sft"]["asymptote"]["value"] == pytest.approx(0.36,
                                                                                                          abs=0.02)
    assert data["verdicts"] == {"sft-k1": "limit structural at this scale", "kd-k1": "budget-bound"}
    assert by_arm["kd-arith"]["tokens_for"]["0.5"]["value"] is not None
    assert by_arm["sft"]["tokens_for"]["0.5"]["value"] is None
    assert "| sft | 1 | arith_2d_sub |" in text and "- kd-k1: budget-bound" in text
    assert "undetermined (still linear)" in text and "- positive control kd-arith at k = 1: 90.0%" in text
    assert (root / "budget.png").stat().st_size > 0 and "![budget curves](budget.png)" in text


def test_a_probe_candidate_or_classification_task_outside_the_suite_is_refused_on_load(tiny_llama, tmp_path):
    """Every candidate level and classification task is scored with the suite's settings, so each must be a task of
    evaluate.suite: refused when the recipe loads (dry run included), not at the first evaluation after hours of
    training. (The budget protocol's arith_3d_add and brackets_d6 were not in sweep-cpu: its run stopped at
    eval-baseline; sweep-cpu now holds them, as its description says: every candidate probe level.)"""
    data = tiny_sweep(tiny_llama, tmp_path / "s")
    with pytest.raises(ValueError, match=r"evaluate.suite 'sweep-cpu' has no task arith_4d_add \(every"):
        SweepStudy.model_validate({**data, "probes": {**data["probes"], "candidates": ["arith_4d_add"]}})
    with pytest.raises(ValueError, match=r"has no task boolq"):
        SweepStudy.model_validate({**data, "classification": ["boolq"]})
    from layerprune.core.recipe_loading import build_from_recipe

    shipped = build_from_recipe(SweepStudy, SweepStudy.kind, "limits-budget-math-embedded", {})
    assert {"arith_3d_add", "brackets_d6"} <= set(shipped.probes.candidates)


def test_max_hours_refuses_a_study_over_its_estimate_before_any_stage_runs(capsys, tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = load_recipe("limits-sweep-embedded", "sweep-study")[0]
    data.update(output=str(tmp_path / "s"))
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--max-hours", "0.5"])
    assert_one_line_error(code, err, "limits-sweep-embedded: the estimate is about", "over --max-hours 0.5",
                          "nothing ran")
    assert not (tmp_path / "s").exists()
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run", "--max-hours", "100"])  # under it: the plan
    assert code == 0, err
    total = float(out.rsplit("total about ", 1)[1].split(" min")[0]) / 60
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run", "--max-hours", f"{0.9 * total:.3f}"])
    assert_one_line_error(code, err, f"the estimate is about {int(total)}.")  # the dry run's own estimate
    tiny = tmp_path / "tiny.yaml"  # no measured rates for another model: no estimate to hold it to
    tiny.write_text(yaml.safe_dump(tiny_sweep(tiny_llama, tmp_path / "t")))
    code, out, err = run_cli(capsys, ["study", str(tiny), "--max-hours", "10"])
    assert_one_line_error(code, err, "--max-hours:", "has no time estimate")
    assert not (tmp_path / "t").exists()
    with pytest.raises(SystemExit):  # argparse's usage error
        run_cli(capsys, ["study", str(tiny), "--max-hours", "-1"])
    assert "expected a number of hours above 0, not '-1'" in capsys.readouterr().err


def test_max_hours_sums_a_grids_cells():
    from layerprune.cli.study import check_max_hours
    from layerprune.core.errors import LayerpruneError
    from layerprune.core.settings import RunSettings

    def estimate(study, settings):  # noqa: ANN001, ANN202
        return study.seconds

    cells = [SimpleNamespace(name=f"cell{i}", seconds=5400.0) for i in range(2)]  # 1.5 h each
    check_max_hours(estimate, cells, RunSettings(), 3.0)  # 3.0 h: not over
    with pytest.raises(LayerpruneError, match=r"the grid: the estimate is about 3.0 h over 2 cells, over --max-hours"):
        check_max_hours(estimate, cells, RunSettings(), 2.9)


def test_a_sweep_checks_the_data_of_the_tasks_it_can_score_not_of_its_whole_suite(tiny_llama, tmp_path, monkeypatch):
    """The run checks every data file it reads before any stage (a bad line there ends it in one line: the tasks it
    can score, the recoveries' prompts), and only those: piqa is in sweep-cpu but not scored by this sweep, so a
    broken piqa file stops neither the run nor its dry run (issue 56: the run checked every task of the suite)."""
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies import sweep, sweep_plan
    from layerprune.pipeline.studies.sweep_grid import instrument
    from layerprune.tasks.data import resolve_data_dir

    mirror = tmp_path / "data"
    mirror.mkdir()
    for entry in resolve_data_dir(None).iterdir():
        if entry.name not in ("piqa", "arc_easy"):
            (mirror / entry.name).symlink_to(entry)
    for task in ("piqa", "arc_easy"):
        (mirror / task).mkdir()
        for split in resolve_data_dir(None).joinpath(task).iterdir():
            (mirror / task / split.name).write_bytes(split.read_bytes())
    (mirror / "piqa" / "validation.jsonl").write_text("{not json\n")
    data = tiny_sweep(tiny_llama, tmp_path / "s")
    study = SweepStudy.model_validate({**data, "evaluate": {**data["evaluate"], "data_dir": str(mirror)}})
    assert instrument(study).evaluate.only == ["arc_easy", "arith_1d_sum3", "copy_l3", "gsm8k"]
    ran: list[int] = []
    monkeypatch.setattr(sweep, "run_stages", lambda stages, root, times=None: ran.append(len(list(stages))))
    sweep.run_sweep(study, RunSettings())
    assert ran, "the run stopped on the data of a task it does not score"
    assert "pruning-ratio sweep" in sweep_plan.dry_run(study, RunSettings())  # the dry run and --max-hours alike
    assert sweep_plan.estimate_seconds(study, RunSettings()) is None  # a tiny model: no rates, but no refusal
    (mirror / "dolly").unlink()  # the recovery's prompts: checked before any stage, not at the first recovery
    (mirror / "dolly").mkdir()
    (mirror / "dolly" / "train.jsonl").write_text("{not json\n")
    with pytest.raises(LayerpruneError, match="dolly"):
        sweep.run_sweep(study, RunSettings())
    (mirror / "arc_easy" / "test.jsonl").write_text("{not json\n")
    with pytest.raises(LayerpruneError, match="arc_easy"):
        sweep.run_sweep(study, RunSettings())
    assert len(ran) == 1
