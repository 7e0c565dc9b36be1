"""`layerprune study` at one cut: the recovery study as a sweep of one k (issue 56: its own engine is gone), on a tiny
model; its schema (the fixed tasks, a given cut, no gate), its dry run, its report, and the shipped recovery recipes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from helpers import assert_one_line_error, run_cli
from layerprune.core.recipe_loading import shipped_command, shipped_recipes
from layerprune.pipeline.studies import figures as figures_module
from layerprune.pipeline.studies import (
    sweep_cells,
    sweep_curves,
    sweep_grid,
    sweep_inputs,
    sweep_points,
    sweep_report,
    sweep_text,
)
from layerprune.pipeline.studies.figures import study_figures
from layerprune.pipeline.studies.sweep_grid import SweepStudy

STUDIES = sorted(name for _, name in shipped_recipes("sweep-study") if name.startswith("recovery-"))


def tiny_study(model: Path, output: Path) -> dict:
    """One cut given (blocks 2 and 3 of 6), three arms at one budget, arc_easy and a fixed probe task, no gates."""
    return {
        "name": "tiny-study", "model": str(model), "output": str(output), "ratios": [2],
        "prune": {"layers": [2, 3]},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "probes:arith_2d_add", "samples": 8},
            "generate": {"max_new_tokens": 6, "batch_size": 4},
            "train": {"max_steps": 2, "max_length": 256, "batch_size": 2, "eval_steps": 1, "logging_steps": 1,
                      "save_steps": 2, "held_out": 0.25},
            "lora": {"r": 4, "alpha": 8}, "opd": {"max_new_tokens": 6}}},
        "arms": {"sft": {"method": "lora"}, "opd": {"method": "opd"}, "replace": {"method": "replace"}},
        "classification": ["arc_easy"], "fixed": ["arith_1dc"], "probes": None, "gsm8k_gate": None,
        "evaluate": {"suite": "sweep-cpu", "limit": 4, "batch_size": "4", "max_gen_toks": 4},
    }


def plain(data: dict) -> dict:
    """The study with plain-text recovery data (one probe format)."""
    data["recover"]["overrides"]["generate"]["chat_template"] = False
    return data


def write_recipe(tmp_path: Path, data: dict) -> Path:
    recipe = tmp_path / "study.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


def headline_tasks(path: Path) -> dict[str, int]:
    return {r["task"]: r["n"] for r in json.loads(path.read_text())["results"] if r["headline"]}


def test_tiny_one_k_study_prunes_once_recovers_each_arm_and_scores_the_fixed_task_ungated(capsys, tiny_llama,
                                                                                          tmp_path, monkeypatch):
    """The gate keeps no level on a random tiny model, yet the fixed probe task is scored on every model, in both
    formats (chat-formatted recovery data); the arms share the teacher answers and one budget; the report reads as
    one cut (no k-against-k verdict) with the control's absence, the budget spent and the audit."""
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    data = tiny_study(tiny_llama, tmp_path / "study")
    data["probes"] = {"candidates": ["arith_2d_add"], "items": 10}  # a random tiny model scores 0: none kept
    recipe = write_recipe(tmp_path, data)
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "study"
    gate = json.loads((root / "probes_calibrated.json").read_text())
    assert gate["kept"] == [] and gate["levels"]["arith_2d_add"]["reason"] == "below band"
    assert not (root / "scored").exists()  # the cut is given: no scoring pass
    assert json.loads((root / "pruned-k2" / "prune_report.json").read_text())["dropped"] == [2, 3]
    for model in ("baseline", "pruned-k2", "sft-k2", "opd-k2", "replace-k2"):
        plain_tasks = headline_tasks(root / "eval" / model / "summary.json")
        chat_tasks = headline_tasks(root / "eval-chat" / model / "summary.json")
        assert plain_tasks == {"arc_easy": 4, "arith_1dc": 4} and chat_tasks == {"arith_1dc": 4}  # the same items
        chat = json.loads((root / "eval-chat" / model / "summary.json").read_text())["results"]
        assert {r["settings"]["probe_format"] for r in chat} == {"chat"}
    reports = {arm: json.loads((root / f"{arm}-k2" / "recover_report.json").read_text())
               for arm in ("sft", "opd", "replace")}
    assert reports["sft"]["data"]["steps"] == reports["opd"]["data"]["steps"] == 2  # one budget
    assert reports["opd"]["data"]["generation"]["generated"] == 0  # the teacher answered once, for sft
    result = json.loads((root / "sweep.json").read_text())
    assert [(p["k"], p["arm"]) for p in result["points"]] == [(2, "sft"), (2, "opd"), (2, "replace")]
    assert result["calibration"] is None or result["calibration"]["kept"] == []
    assert all("b" not in tests and "b_retention" not in tests for tests in result["verdicts"].values())
    assert {row["arms"][0] for row in result["comparisons"]} == {"sft", "opd"}  # every pair of arms at k = 2
    text = (root / "sweep.md").read_text()
    assert text.startswith("# Recovery at one cut (k = 2): tiny-study")
    assert "(a)" in text and "(b" not in text  # k against k does not apply to one k
    assert "Blocks dropped at each k (the cut given, prune.layers, original numbering, of 6): k=2: [2, 3]" in text
    assert "Fixed tasks, scored on every model whatever the gates keep (never gated): arith_1dc." in text
    assert "No k = 0 control (controls: false)" in text and "## Probes through the chat template" in text
    assert "Recovery budget per k and arm (replicate 0): sft-k2: " in text and "replace-k2: " in text
    assert "## Held out, measured" in text and "| arith_1dc | 4 | 0 | 0 | 0 |" in text  # audited, not flagged
    assert run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])[0] == 0  # complete: every stage skipped


def test_tiny_one_k_study_with_replicates_controls_and_an_lr_grid(capsys, tiny_llama, tmp_path, monkeypatch):
    """Two replicates of one trained arm (their own seeds: other held-out prompts, other weights), its k = 0 control
    on the unpruned model, and a two-rate grid whose choice is the argmin of the recorded held-out losses."""
    from safetensors.numpy import load_file

    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    data = plain(tiny_study(tiny_llama, tmp_path / "study"))
    data.update(arms={"sft": {"method": "lora"}}, replicates=2, controls=True, lr_grid={"sft": [1e-4, 5e-3]})
    recipe = write_recipe(tmp_path, data)
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "study"
    search = json.loads((root / "lr_search" / "sft.json").read_text())
    losses = {c["learning_rate"]: c["held_out_loss"] for c in search["candidates"]}
    assert set(losses) == {1e-4, 5e-3} and search["chosen"] == min(losses, key=losses.get) and search["k"] == 2
    runs = ("sft-k2", "sft-k2@r1", "sft-k0", "sft-k0@r1")
    reports = {name: json.loads((root / name / "recover_report.json").read_text()) for name in runs}
    assert all(r["recipe"]["train"]["learning_rate"] == search["chosen"] for r in reports.values())
    held = {name: reports[name]["held_out_metrics"]["prompts"] for name in runs}
    assert held["sft-k2"] != held["sft-k2@r1"] and held["sft-k0"] == held["sft-k2"]  # replicate 1: its own split
    # sampled teacher answers (demo: temperature > 0): replicate 1 drew its own, the control shared replicate 0's
    answers = {name: (root / name / "data" / "responses.jsonl").read_text() for name in ("sft-k2", "sft-k2@r1",
                                                                                          "sft-k0")}
    assert answers["sft-k2"] != answers["sft-k2@r1"] and answers["sft-k0"] == answers["sft-k2"]
    weights = {name: load_file(root / name / "model.safetensors") for name in ("sft-k2", "sft-k2@r1")}
    assert any((weights["sft-k2"][k] != weights["sft-k2@r1"][k]).any() for k in weights["sft-k2"])
    # the control trained the unpruned original (6 blocks; the arm's student has 4), its teacher the original too
    assert Path(reports["sft-k0"]["student"]["location"]).resolve() == (root / "original").resolve()
    assert json.loads((root / "sft-k0" / "config.json").read_text())["num_hidden_layers"] == 6
    assert json.loads((root / "sft-k2" / "config.json").read_text())["num_hidden_layers"] == 4
    for name in runs:
        assert (root / "eval" / name / "summary.json").is_file()
    result = json.loads((root / "sweep.json").read_text())
    scores = [json.loads((root / "eval" / n / "summary.json").read_text()) for n in ("sft-k2", "sft-k2@r1")]
    copy = [next(r["value"] for r in s["results"] if r["task"] == "arith_1dc") for s in scores]
    generative = result["points"][0]["generative"]
    assert generative["recovered"]["value"] == pytest.approx(sum(copy) / 2)  # the arm's figure: its runs' mean
    assert generative["spread"]["replicates"] == 2 and "change" in result["control"]["sft"]["generative"]
    text = (root / "sweep.md").read_text()
    assert "k = 0 control of arm sft: the same recovery applied to the unpruned original" in text
    assert "Learning rate of sft: " in text and "Run-to-run spread (2 replicate(s)" in text
    assert not (root / "eval-chat").exists() and "Probes through the chat template" not in text
    assert run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])[0] == 0  # complete: every stage skipped


def test_a_one_k_study_refuses_arm_fields_it_cannot_take_and_checks_the_lr_grid_and_labels(tiny_llama):
    data = tiny_study(tiny_llama, Path("x"))
    study = SweepStudy.model_validate(data)
    assert study.replicates == 1 and not study.controls and study.given_cut and study.ratios == [2]
    bad = {"an arm buying itself more steps": ({"sft": {"method": "lora", "train": {"max_steps": 50}}}, "train"),
           "a section field the method lacks": ({"bad": {"method": "opd", "opd": {"beta": 2}}}, "beta"),
           "a label naming another model": ({"pruned": {"method": "lora"}}, "none of baseline, pruned")}
    for arms, message in bad.values():
        with pytest.raises(Exception, match=message):
            SweepStudy.model_validate({**data, "arms": {**data["arms"], **arms}})
    for grid, message in (({"kd": [1e-4]}, "'kd' is no arm"), ({"sft": []}, "one or more"),
                          ({"replace": [1e-4]}, "trains nothing")):
        with pytest.raises(Exception, match=message):
            SweepStudy.model_validate({**data, "lr_grid": grid})
    with pytest.raises(Exception, match="replicates"):
        SweepStudy.model_validate({**data, "replicates": 0})
    from layerprune.recover.lr_search import with_learning_rate

    local = SweepStudy.model_validate({**data, "arms": {"local": {"method": "local"}}})
    assert with_learning_rate(local.arm_recipe("local", "<pruned>"), 3e-3).local.learning_rate == 3e-3  # its own


def test_a_given_cut_is_one_k_and_the_fixed_tasks_are_checked_against_the_suite_on_load(capsys, tiny_llama,
                                                                                         tmp_path):
    data = tiny_study(tiny_llama, Path("x"))
    refused = {"ratios": ({"ratios": [3]}, "prune.layers gives one cut: set ratios: [2]"),
               "two ks": ({"ratios": [1, 2]}, "prune.layers gives one cut"),
               "suite": ({"fixed": ["arith_1dc", "arith_2d_mul"]}, "suite 'sweep-cpu' has no task arith_2d_mul"),
               "gated": ({"fixed": ["arith_1dc"], "probes": {"candidates": ["arith_1dc"]}},
                         "fixed: arith_1dc: a fixed task is scored whatever the gate keeps"),
               "classification": ({"fixed": ["arc_easy"]}, "fixed: arc_easy"),
               "only": ({"evaluate": {"suite": "sweep-cpu", "only": ["piqa"]}}, "evaluate.only / evaluate.tasks")}
    for fields, message in refused.values():
        with pytest.raises(Exception, match=re.escape(message)):
            SweepStudy.model_validate({**data, **fields})
    recipe = write_recipe(tmp_path, {**data, "fixed": ["arith_2d_mul"], "output": str(tmp_path / "s")})
    code, _, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])  # on load, in one line, before any work
    assert_one_line_error(code, err, "suite 'sweep-cpu' has no task arith_2d_mul")
    assert not (tmp_path / "s").exists()


def test_the_fixed_tasks_are_scored_on_every_model_beside_the_kept_levels_never_gated(tiny_llama, tmp_path):
    from layerprune.pipeline.stages import recipe_fingerprint

    data = tiny_study(tiny_llama, tmp_path)
    gated = SweepStudy.model_validate({**data, "fixed": ["copy_l7"],
                                       "probes": {"candidates": ["arith_2d_add", "brackets_d3"]}})
    with pytest.raises(FileNotFoundError):
        sweep_inputs.evaluated_tasks(gated, tmp_path)  # the gate's record is read: its stage runs first
    (tmp_path / "probes_calibrated.json").write_text(json.dumps({"kept": ["brackets_d3"], "levels": {}}))
    assert sweep_inputs.evaluated_tasks(gated, tmp_path) == ["arc_easy", "copy_l7", "brackets_d3"]  # no GSM8K gate
    assert sweep_inputs.chat_tasks(gated, tmp_path) == ["copy_l7", "brackets_d3"]
    (tmp_path / "probes_calibrated.json").write_text(json.dumps({"kept": [], "levels": {}}))
    assert sweep_inputs.evaluated_tasks(gated, tmp_path) == ["arc_easy", "copy_l7"]  # the fixed task stays
    ungated = SweepStudy.model_validate(data)
    assert sweep_inputs.evaluated_tasks(ungated, tmp_path / "none") == ["arc_easy", "arith_1dc"]
    assert sweep_inputs.chat_tasks(ungated, tmp_path / "none") == ["arith_1dc"] and sweep_grid.both_formats(ungated)
    no_probe = SweepStudy.model_validate({**data, "fixed": ["gsm8k"]})
    assert sweep_inputs.evaluated_tasks(no_probe, tmp_path / "none") == ["arc_easy", "gsm8k"]  # fixed: no gate stage
    assert not sweep_grid.both_formats(no_probe)  # chat-formatted data, but no probe task to score in chat
    assert sweep_cells.stage_names(SweepStudy.model_validate(plain(tiny_study(tiny_llama, tmp_path)))) == [
        "eval-baseline", "prune-k2", "eval-pruned-k2", "recover-sft-k2", "eval-sft-k2", "recover-opd-k2",
        "eval-opd-k2", "recover-replace-k2", "eval-replace-k2", "report"]  # no gate, no scoring pass, one format
    # the new fields at their defaults leave a sweep's fingerprint as it was; no gate is a recipe of its own
    scored = {**data, "prune": {"drop": 2, "score": "ablation", "calib": "arithmetic"}, "fixed": [], "gsm8k_gate": {}}
    default = {key: value for key, value in scored.items() if key not in ("fixed", "probes", "gsm8k_gate")}
    assert recipe_fingerprint(SweepStudy.model_validate(scored | {"probes": {}})) == \
        recipe_fingerprint(SweepStudy.model_validate(default))
    assert recipe_fingerprint(SweepStudy.model_validate(scored)) != \
        recipe_fingerprint(SweepStudy.model_validate(default))
    assert "score" in sweep_cells.stage_names(SweepStudy.model_validate(scored))


def test_the_one_k_dry_run_lists_the_fixed_tasks_replicates_controls_and_lr_grid_the_flag_beating_the_recipe(
        capsys, tiny_llama, tmp_path):
    data = tiny_study(tiny_llama, tmp_path / "s")
    data.update(replicates=1, controls=True, lr_grid={"opd": [1e-4, 1e-3]})
    recipe = write_recipe(tmp_path, data)
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run", "--replicates", "2"])
    assert code == 0, err
    assert out.startswith("one-cut sweep (k = 2: a recovery study) 'tiny-study'")
    assert "cut given: blocks [2, 3] (prune.layers; no scoring pass), k = 2" in out
    assert "probes-calibrated: no gate (probes: null)" in out and "gsm8k: not scored (gsm8k_gate: null)" in out
    assert "on the same items each: arc_easy 4; fixed (every model, never gated): arith_1dc 4" in out
    assert "2 replicates of every recovery" in out and "k = 0 controls (the arm's recovery of the unpruned " \
        "original, ARM-k0): sft, opd; none for replace" in out and "lr from the grid 0.0001, 0.001" in out
    assert "arm sft: lora, 2 optimizer steps, lr" in out
    stages = out.split("; stages: ")[1].split("\n")[0]
    names = sweep_cells.stage_names(SweepStudy.model_validate({**data, "replicates": 2}))
    # chat-formatted recovery data (demo) and a fixed probe task: every evaluation has its chat-format twin
    assert int(stages.split(" ")[0]) == len(names) == 2 + 1 + 3 + 3 * 2 * 3 + 2 * 2 * 3 + 1
    # a long list in brief: the count per kind, the first six in order and the last
    assert stages == (f"{len(names)} (eval 12, eval-chat 12, recover 10, lr 1, prune 1, report 1; in order: "
                      f"{', '.join(names[:6])}, ... report)")
    assert names[:6] == ["eval-baseline", "eval-chat/baseline", "lr-opd", "prune-k2", "eval-pruned-k2",
                         "eval-chat/pruned-k2"]
    assert "recover-opd-k0@r1" in names and "eval-sft-k0" in names and "recover-replace-k0" not in names
    assert not (tmp_path / "s").exists()
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert "1 replicate of every recovery (run-to-run variance not measured)" in out


def test_the_one_k_dry_run_lists_the_gate_and_both_probe_formats_or_refuses_a_model_without_a_chat_template(
        capsys, tiny_llama, tmp_path):
    import shutil

    data = tiny_study(tiny_llama, tmp_path / "s")
    data.update(arms={"sft": {"method": "lora"}}, probes={"candidates": ["arith_2d_add", "brackets_d3"]})
    recipe = write_recipe(tmp_path, data)
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert code == 0, err
    assert "probes-calibrated: 2 candidate levels x 100 calibration-stream items; keep 30-90%, at most 1 per " \
        "family (2 families: arithmetic, brackets)" in out
    assert "probe format: plain few-shot text and, as the recovery data is chat-formatted, through the chat " \
        "template too" in out and "chat template: present" in out
    names = out.split("; stages: ")[1].split(" (", 1)[1].split(")\n")[0].split(", ")
    assert names == ["calibrate-probes", "eval-baseline", "eval-chat/baseline", "prune-k2", "eval-pruned-k2",
                     "eval-chat/pruned-k2", "recover-sft-k2", "eval-sft-k2", "eval-chat/sft-k2", "report"]
    recipe = write_recipe(tmp_path, plain(data))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert "probe format: plain few-shot text (the recovery data is plain" in out and "eval-chat" not in out
    bare = tmp_path / "plain"  # a model without a chat template: refused before any work
    shutil.copytree(tiny_llama, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    recipe = write_recipe(tmp_path, tiny_study(bare, tmp_path / "s"))
    for args in (["--dry-run"], ["--device", "cpu"]):
        code, out, err = run_cli(capsys, ["study", str(recipe), *args])
        assert_one_line_error(code, err, "has no chat template", "probe_format chat")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("name", STUDIES)
def test_every_shipped_recovery_study_is_a_one_k_sweep_that_dry_runs(capsys, name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli(capsys, ["study", name, "--dry-run", "--output", str(tmp_path / "s")])
    assert code == 0, err
    study = SweepStudy.load(name)
    k, = study.ratios
    assert out.startswith(f"one-cut sweep (k = {k}: a recovery study) '{name}'") and not (tmp_path / "s").exists()
    assert f"arms ({len(study.arms)}, each at every k, paired on the same items): {', '.join(study.arms)}" in out
    label = "opd" if "opd" in study.arms else "kd"  # every study has a distillation arm
    arm = out.split(f"arm {label}: memory plan: ")[1].split("\narm ")[0]
    assert f"method {label}," in arm and "teacher (unpruned, beside the student)" in arm
    assert "config was not readable" not in out and "fixed (every model, never gated): " in out
    assert shipped_command("sweep-study", name).startswith("layerprune study ")
    assert len(STUDIES) == 5  # the 7-8B grid's two cells among them
    if name == "recovery-transfer-replicated-embedded":  # issue 36's rerun: the protocol as committed
        for line in ("200 optimizer steps or 16000 target (answer) tokens", "5 replicates of every recovery",
                     "lr from the grid 0.001, 0.003", "ARM-k0): sft, kd; none for local, merge",
                     "through the chat template too", "8 candidate levels x 100", "arc_easy 100, piqa 100; fixed "
                     "(every model, never gated): copy_l7 100", "gsm8k: not scored", "models evaluated: 32 ",
                     "stages: 101 "):
            assert line in out, line
    if name == "recovery-methods-embedded":  # the cut as given, the suite's generative tasks fixed, one format
        assert "cut given: blocks [4, 5, 13, 25, 26, 27]" in out and "gsm8k: fixed, scored on every model (20" in out
        assert "probe format: plain few-shot text" in out and "brackets_d5 100, gsm8k 20" in out


def test_the_embedded_study_recovers_on_plain_arithmetic_prompts_only():
    from layerprune.recover.prompts import probe_task_names

    study = SweepStudy.load("recovery-methods-embedded")
    shared = study.shared_recipe("<pruned>")
    assert shared.generate.chat_template is False and shared.prompts.samples == 160
    assert set(probe_task_names(shared.prompts.source)) == {"arith_1dc", "arith_2d_add", "arith_2d_sub",
                                                           "arith_2d_mul", "arith_3d_add", "arith_3d_sub"}
    assert set(probe_task_names(shared.prompts.source)) < set(study.fixed)  # trained skills among the scored ones


def test_a_recipe_still_saying_recovery_study_is_refused_in_one_line_naming_the_sweep(capsys, tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(yaml.safe_dump({"kind": "recovery-study", "name": "old", "prune": {"drop": 3},
                                      "arms": {"sft": {"method": "lora"}}}))
    for command in (["study", str(recipe), "--dry-run"], ["recipes", "validate", str(recipe)],
                    ["recipes", "show", str(recipe)]):
        code, _, err = run_cli(capsys, command)
        assert_one_line_error(code, err, "old.yaml: kind recovery-study is gone (issue 56)", "kind: sweep-study",
                              "ratios: [N]")
    assert not shipped_recipes("recovery-study")


# --- the report of one k, from synthetic per-item records -----------------------------------------------------------

def _one_k(won: dict[str, int], control: int | None = None, n: int = 60):  # noqa: ANN202 (Figures)
    """baseline right on 50 of 60 copy_l7 items, pruned-k3 on 10; each arm wins back won[arm] of the 40 lost; with
    `control`, sft's k = 0 control (sft-k0) loses `control` of the original's right items. piqa: a drop of 15 of 45
    right items, each arm winning 4 back."""
    from layerprune.pipeline.paired_table import Figures

    base = np.r_[np.ones(50), np.zeros(n - 50)]
    pruned = np.r_[np.zeros(40), base[40:]]
    cls_base, cls_pruned = np.r_[np.ones(45), np.zeros(n - 45)], np.r_[np.ones(30), np.zeros(n - 30)]
    rows = {"baseline": (base, cls_base), "pruned-k3": (pruned, cls_pruned)}
    if control is not None:
        rows["sft-k0"] = (np.r_[np.zeros(control), base[control:]], cls_base)
    for arm, back in won.items():
        rows[f"{arm}-k3"] = (np.r_[np.ones(back), pruned[back:]], np.r_[np.ones(34), np.zeros(n - 34)])
    labels = list(rows)
    matrices = {"copy_l7": np.stack([g for g, _ in rows.values()]), "piqa": np.stack([c for _, c in rows.values()])}
    return Figures(labels, matrices, {"copy_l7": 0.0, "piqa": 0.5},
                   {"classification": ["piqa"], "generative": ["copy_l7"]})


def test_one_k_gives_each_arm_its_share_won_back_net_of_its_control_and_no_k_against_k_verdict():
    study = SimpleNamespace(ratios=[3], controls=True)
    figures = _one_k({"sft": 12, "opd": 30}, control=4)
    points = [sweep_points.point(study, figures, 3, arm) for arm in ("sft", "opd")]
    sft, opd = (p["generative"] for p in points)
    assert sft["recovered_share"]["value"] == pytest.approx(12 / 40)
    assert opd["recovered_share"]["value"] == pytest.approx(30 / 40)
    assert sft["recovered_share_net"]["value"] == pytest.approx((12 + 4) / 40)  # the recipe alone costs 4 items
    assert "recovered_share_net" not in opd  # opd has no control here
    assert points[0]["classification"]["recovered_share"]["value"] == pytest.approx(4 / 15)
    control = sweep_points.control_point(figures, "sft")
    assert control["generative"]["change"]["value"] == pytest.approx(-4 / 60)
    lines, tests = sweep_points.verdicts(study, figures, [points[0]], "sft")
    assert set(tests) == {"a"} and lines[0].startswith("(a)") and not any(line.startswith("(b") for line in lines)
    pairs = sweep_points.comparisons(figures, points, ["sft", "opd"])
    assert len(pairs) == 1 and pairs[0]["k"] == 3 and pairs[0]["arms"] == ["sft", "opd"]
    assert pairs[0]["generative"]["share"]["value"] == pytest.approx(12 / 40 - 30 / 40)
    assert pairs[0]["generative"]["share_holm"]["family"] == 2  # one pair, two kinds
    table = sweep_text.format_table(points)
    assert "| 3 | sft | generative |" in table and "recovered share net of the k = 0 control" in table


def test_the_gate_line_lists_kept_and_left_levels_and_the_fixed_tasks():
    from layerprune.evaluate.calibrated import ProbeCalibration, calibrate_probes

    rates = {"arith_2d_add": 0.5, "arith_2d_sub": 1.0, "brackets_d3": 0.6}
    record = calibrate_probes(None, None, ProbeCalibration(candidates=list(rates), items=20), scorer=lambda task,
                              items: [i < rates[task] * len(items) for i in range(len(items))])
    study = SimpleNamespace(fixed=["copy_l7"])
    line = sweep_report.gate_line(study, record)
    assert "kept arith_2d_add (50%), brackets_d3 (60%); left out arith_2d_sub (" in line
    assert line.endswith("Fixed tasks, scored on every model whatever the gates keep (never gated): copy_l7.")
    assert sweep_report.gate_line(study, None).startswith("No probe gate (probes: null)")
    assert "Fixed" not in sweep_report.gate_line(SimpleNamespace(fixed=[]), record)


def test_each_recovery_shows_its_budget_and_learning_rate_or_the_padded_count_from_older_reports(tmp_path):
    from layerprune.recover.lr_search import budget_spent

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    recipe = {"method": "merge", "merge": {"then": "local"}, "train": {"learning_rate": 2e-4},
              "local": {"learning_rate": 1e-3}}
    old.write_text(json.dumps({"recipe": recipe, "data": {}}))
    new.write_text(json.dumps({"recipe": {"method": "lora", "train": {"learning_rate": 2e-4}}, "data": {},
                               "tokens_unpadded": 5000, "sequences": 40, "optimizer_steps": 10}))
    assert budget_spent(old) == {"learning_rate": 1e-3, "tokens_unpadded": None, "sequences": None,
                                 "optimizer_steps": None}  # local's own rate
    spent = budget_spent(new)
    assert spent == {"learning_rate": 2e-4, "tokens_unpadded": 5000, "sequences": 40, "optimizer_steps": 10}
    curve = {"tokens": 9000, "steps": 10, "seconds": 12.0, "held_out": [], **spent}
    assert sweep_curves.budget_text(curve).startswith("5000 unpadded target tokens, 40 sequences, 10 optimizer "
                                                      "steps, lr 2.0e-04 (9000 tokens as the trainer counts them)")
    older = {**curve, "tokens_unpadded": None}
    assert sweep_curves.budget_text(older).startswith("9000 tokens (padded), 10 steps")


def _records(root: Path, label: str, scores: dict[str, list[int]], first_id: int = 0) -> Path:
    """A model's summary and per-item records; item i of every task under doc id first_id + i."""
    folder = root / "eval" / label
    (folder / "samples").mkdir(parents=True)
    results = []
    for task, values in scores.items():
        kind = "classification" if task == "piqa" else "generative"
        results.append({"task": task, "kind": kind, "metric": "acc", "value": sum(values) / len(values),
                        "stderr": 0.01, "n": len(values), "headline": True, "settings": {}, "seconds": 1.0})
        lines = [json.dumps({"doc_id": i, "filter": "none", "acc": float(v), "doc_hash": f"{task}{i}",
                             "prompt_hash": f"p{i}", "arguments": [["a", "b"], ["a", "c"]]})
                 for i, v in enumerate(values, start=first_id)]
        (folder / "samples" / f"{task}.jsonl").write_text("\n".join(lines) + "\n")
    model = {"spec": label, "location": label, "kind": "local"}
    (folder / "summary.json").write_text(json.dumps({"model": model, "model_hash": label, "results": results}))
    return folder


def test_a_one_k_study_refuses_models_scored_on_different_items(tmp_path):
    """opd was scored on other copy_l7 items (doc ids 5..64, not 0..59): the report stops with one line naming the
    models, task and count, rather than pairing a subset."""
    from layerprune.core.errors import LayerpruneError

    copy = {"baseline": [1] * 50 + [0] * 10, "pruned-k3": [1] * 10 + [0] * 50, "sft-k3": [1] * 22 + [0] * 38}
    folders = {label: _records(tmp_path, label, {"copy_l7": v, "piqa": [1, 0] * 30}) for label, v in copy.items()}
    folders["opd-k3"] = _records(tmp_path, "opd-k3", {"copy_l7": [1] * 40 + [0] * 20}, first_id=5)
    (folders["opd-k3"] / "samples" / "piqa.jsonl").write_text((folders["sft-k3"] / "samples" / "piqa.jsonl")
                                                              .read_text())
    with pytest.raises(LayerpruneError, match=r"^models scored on different items: baseline and opd-k3 on copy_l7 "
                       r"differ in 10 item\(s\)"):
        study_figures(folders)


def test_a_one_k_study_s_comparisons_name_its_k_and_are_checked_on_load(capsys, tiny_llama, tmp_path):
    from pydantic import ValidationError

    data = {**tiny_study(tiny_llama, tmp_path / "s"), "controls": True}
    declared = {"main": [{"a": "opd", "b": "sft", "at": 2}, {"a": "sft", "at": 2, "net_of_control": True}]}
    study = SweepStudy.model_validate({**data, "comparisons": declared})
    assert [c.label for c in study.comparisons["main"].contrasts] == ["opd-k2-vs-sft-k2-share", "sft-k2-share-net"]
    bad = {"no k": ({"f": [{"a": "opd", "b": "sft"}]}, "name the k of the first side (at: one of ratios)"),
           "another k": ({"f": [{"a": "opd", "b": "sft", "at": 3}]}, "k = 3 is not in ratios (2)"),
           "unknown arm": ({"f": [{"a": "kd", "b": "sft", "at": 2}]}, "arm 'kd' is not in arms (sft, opd, replace)"),
           "no control": ({"f": [{"a": "replace", "at": 2, "net_of_control": True}]},
                          "arm 'replace' has no k = 0 control"),
           "a recovery study's kind": ({"f": [{"a": "sft", "b": "opd", "at": 2, "kind": "probes_unseen"}]},
                                       "kind"),
           "duplicate": ({"f": [{"a": "sft", "b": "opd", "at": 2}], "g": [{"a": "sft", "b": "opd", "at": 2}]},
                         "a duplicate name")}
    for families, message in bad.values():
        with pytest.raises(ValidationError, match=re.escape(message)):
            SweepStudy.model_validate({**data, "comparisons": families})
    recipe = write_recipe(tmp_path, {**data, "comparisons": bad["unknown arm"][0]})  # the CLI says it in one line
    code, _, err = run_cli(capsys, ["recipes", "validate", str(recipe), "--kind", "sweep-study"])
    assert_one_line_error(code, err, "arm 'kd' is not in arms")


def test_the_shared_recovery_data_names_its_trained_skills_task_by_task(tiny_llama, tmp_path):
    """A probes: source trains the tasks it names, GSM8K's trains gsm8k, generic data none; where the teacher's
    answers are kept, a named task none of whose prompts is among them trained nothing (the old recovery report's
    split, lost when the recovery study became a one-k sweep and restored)."""
    from layerprune.recover.prompts import prompts_of_task

    def study(source: str) -> SweepStudy:
        data = plain(tiny_study(tiny_llama, tmp_path / "study"))
        data["recover"]["overrides"]["prompts"]["source"] = source
        return SweepStudy.model_validate(data)

    root = tmp_path / "study"
    both = study("probes:arith_2d_add+arith_1dc")
    assert sweep_inputs.trained_tasks(both, root) == {"arith_2d_add", "arith_1dc"}  # no answers yet: the source
    assert sweep_inputs.trained_tasks(study("gsm8k"), root) == {"gsm8k"}
    assert sweep_inputs.trained_tasks(study("dolly"), root) == frozenset()
    root.mkdir(parents=True)
    prompts = sorted(prompts_of_task("arith_2d_add", 4))[:4]
    (root / "selfgen.jsonl").write_text("".join(json.dumps({"prompt": p, "response": "1"}) + "\n" for p in prompts))
    assert sweep_inputs.trained_tasks(both, root) == {"arith_2d_add"}


def test_a_task_aligned_recovery_is_reported_on_its_trained_and_unseen_skills(monkeypatch):
    """study_figures splits the generative tasks into trained and unseen; every point and the table carry both, and
    the default every-pair family stays over the two kinds (its Holm family does not grow)."""
    n = 40
    labels = ["baseline", "pruned-k3", "sft-k3", "opd-k3"]
    trained = np.stack([np.ones(n), np.zeros(n), np.r_[np.ones(30), np.zeros(10)], np.r_[np.ones(10), np.zeros(30)]])
    unseen = np.stack([np.ones(n), np.zeros(n), np.r_[np.ones(4), np.zeros(36)], np.r_[np.ones(20), np.zeros(20)]])
    cls = np.stack([np.r_[np.ones(30), np.zeros(10)]] * 4)
    matrices = {"arith_2d_add": trained, "brackets_d6": unseen, "piqa": cls}
    kinds = {"arith_2d_add": "generative", "brackets_d6": "generative", "piqa": "classification"}
    monkeypatch.setattr(figures_module, "check_scored_items", lambda folders: None)
    monkeypatch.setattr(figures_module, "load_matrix", lambda folders, common: (
        labels, matrices, {"arith_2d_add": 0.0, "brackets_d6": 0.0, "piqa": 0.5}, kinds))
    figures, _ = study_figures({}, trained=frozenset({"arith_2d_add", "gsm8k"}))
    assert [figures.tasks[i] for i in figures.groups["trained"]] == ["arith_2d_add"]
    assert [figures.tasks[i] for i in figures.groups["unseen"]] == ["brackets_d6"]
    study = SimpleNamespace(ratios=[3], controls=False)
    points = [sweep_points.point(study, figures, 3, arm) for arm in ("sft", "opd")]
    assert points[0]["trained"]["recovered_share"]["value"] == pytest.approx(30 / 40)
    assert points[0]["unseen"]["recovered_share"]["value"] == pytest.approx(4 / 40)
    assert points[1]["unseen"]["recovered_share"]["value"] == pytest.approx(20 / 40)
    table = sweep_text.format_table(points)
    assert "| 3 | sft | trained |" in table and "| 3 | opd | unseen |" in table
    pairs = sweep_points.comparisons(figures, points, ["sft", "opd"])
    assert set(pairs[0]) == {"k", "arms", "classification", "generative"}
    assert pairs[0]["generative"]["share_holm"]["family"] == 2
    assert "Trained skills (their own prompts in the recovery data, task by task): arith_2d_add; unseen" \
        in sweep_report._split_line(figures)[0]
    none, _ = study_figures({})  # generic data: no split
    assert not none.has("trained") and sweep_report._split_line(none) == []
