"""`layerprune study`: the recovery study on a tiny model, its table rules, and the shipped recipes' dry runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import run_cli
from layerprune.core.recipe_loading import shipped_command, shipped_recipes
from layerprune.pipeline.studies import recovery_report
from layerprune.pipeline.studies.recovery_grid import RecoveryStudy

STUDIES = sorted(name for _, name in shipped_recipes("recovery-study"))


def tiny_study(model: Path, output: Path) -> dict:
    return {
        "name": "tiny-study", "model": str(model), "output": str(output),
        "prune": {"layers": [2, 3]},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "probes:arith_2d_add", "samples": 8},
            "generate": {"max_new_tokens": 6, "batch_size": 4},
            "train": {"max_steps": 2, "max_length": 256, "batch_size": 2, "eval_steps": 1, "logging_steps": 1,
                      "save_steps": 2, "held_out": 0.25},
            "lora": {"r": 4, "alpha": 8}, "opd": {"max_new_tokens": 6}}},
        "arms": {"sft": {"method": "lora"}, "opd": {"method": "opd"}, "replace": {"method": "replace"}},
        "evaluate": {"tasks": ["arith_1dc"], "limit": 4, "batch_size": "4"},
    }


def test_tiny_study_prunes_once_recovers_each_arm_and_writes_one_table(capsys, tiny_llama, tmp_path, monkeypatch):
    """With the probe gate (calibrate-probes on the original; every model scored on evaluate's tasks plus the kept
    levels) and, the recovery data being chat-formatted, the probes scored in both formats."""
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "study.yaml"
    data = tiny_study(tiny_llama, tmp_path / "study")
    data["probes"] = {"candidates": ["arith_2d_add"], "items": 10}  # a random tiny model scores 0: none kept
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "study"
    gate = json.loads((root / "probes_calibrated.json").read_text())
    assert gate["kept"] == [] and gate["levels"]["arith_2d_add"]["reason"] == "below band"
    for model in ("baseline", "pruned", "sft", "opd", "replace"):
        plain = json.loads((root / "eval" / model / "summary.json").read_text())["results"]
        chat = json.loads((root / "eval-chat" / model / "summary.json").read_text())["results"]
        assert [r["task"] for r in plain] == [r["task"] for r in chat] == ["arith_1dc"]
        assert {r["settings"]["probe_format"] for r in chat} == {"chat"}
        assert "chat" not in {r["settings"].get("probe_format") for r in plain}
        assert [r["n"] for r in chat] == [r["n"] for r in plain]  # the same items
    chat_rows = {r["model"]: r for r in json.loads((root / "study_chat.json").read_text())}
    assert list(chat_rows) == ["baseline", "pruned", "sft", "opd", "replace"] and chat_rows["sft"]["probe_tasks"] == 1
    rows = {r["model"]: r for r in json.loads((root / "study.json").read_text())}
    assert list(rows) == ["baseline", "pruned", "sft", "opd", "replace"]
    reports = {arm: json.loads((root / "arms" / arm / "recover_report.json").read_text()) for arm in ("sft", "opd")}
    assert reports["sft"]["data"]["steps"] == reports["opd"]["data"]["steps"] == 2  # one budget
    assert rows["replace"]["steps"] == 0 and rows["opd"]["tokens"] > 0
    # replace's held-out loss stands against the pruned model's own, measured on the same held-out answers
    assert rows["pruned"]["held_out_ce"] == rows["replace"]["held_out_ce_pruned"] is not None
    assert rows["pruned"]["held_out_kl"] > 0 and rows["replace"]["held_out_kl"] is not None
    text = (root / "study.md").read_text()
    assert "| replace | replace |" in text and (root / "study.png").is_file()
    assert "## Held out, measured" in text and "| arith_1dc | 4 | 0 | 0 | 0 |" in text  # audited, not flagged
    assert "- [arithmetic] arith_2d_add: left out - 0% (95% CI 0-28%, 10 items) is below the band 30-90%" in text
    assert "Fixed probe tasks, scored whatever the gate keeps: arith_1dc (arithmetic)" in text
    assert "## Probes in both formats" in text and "Probe format: plain" in text and "Probe format: chat" in text
    # the arms reused the teacher answers the first arm generated
    assert reports["opd"]["data"]["generation"]["generated"] == 0
    assert run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])[0] == 0  # complete: every stage skipped


def test_recovered_share_says_no_clear_drop_within_two_standard_errors():
    assert recovery_report.recovered_share((0.30, 0.02), (0.10, 0.02), (0.20, 0.02)) == pytest.approx(0.5)
    assert recovery_report.recovered_share((0.30, 0.05), (0.25, 0.05), (0.30, 0.05)) == "n/a (no clear drop)"
    assert recovery_report.mean_with_se([]) is None


def test_study_schema_demands_a_matched_budget_and_known_arm_fields(tiny_llama):
    data = tiny_study(tiny_llama, Path("x"))
    del data["recover"]["overrides"]["train"]["max_steps"]
    with pytest.raises(Exception, match="max_steps"):
        RecoveryStudy.model_validate(data)
    data = tiny_study(tiny_llama, Path("x"))
    data["arms"]["sft"]["train"] = {"max_steps": 50}  # an arm may not buy itself more steps
    with pytest.raises(Exception, match="train"):
        RecoveryStudy.model_validate(data)
    data = tiny_study(tiny_llama, Path("x"))
    data["arms"]["bad"] = {"method": "opd", "opd": {"beta": 2}}
    with pytest.raises(Exception, match="beta"):
        RecoveryStudy.model_validate(data)


@pytest.mark.parametrize("name", STUDIES)
def test_every_shipped_recovery_study_dry_runs(capsys, name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli(capsys, ["study", name, "--dry-run", "--output", str(tmp_path / "s")])
    assert code == 0, err
    label = "opd" if "arm opd" in out else "kd"  # every study has a distillation arm
    assert "budget (every arm)" in out and f"arm {label}" in out and not (tmp_path / "s").exists()
    arm = out.split(f"arm {label}: method {label}\n")[1].split("\narm ")[0]
    assert "memory plan:" in arm and f"method {label}," in arm  # named as the arm's method, planned with its teacher
    assert "teacher (unpruned, beside the student)" in arm and "config was not readable" not in out
    assert shipped_command("recovery-study", name).startswith("layerprune study ")
    assert len(STUDIES) >= 3
    if name == "recovery-transfer-replicated-embedded":  # issue 36's rerun: the protocol as committed
        for line in ("16000 target (answer) tokens", "replicates: 5 per arm", "lr search local: 0.001, 0.003",
                     "controls (k = 0, the recipe on the original): sft, kd; n/a (no cut at k = 0): local, merge",
                     "probe formats: plain and chat", "kept above cosine similarity 0.65", "stages (100)"):
            assert line in out, line


def _summary(root: Path, label: str, scores: dict[str, float], evals: str = "eval") -> None:
    results = [{"task": task, "kind": "classification" if task == "piqa" else "generative", "metric": "acc",
                "value": value, "stderr": 0.01, "n": 100, "headline": True, "settings": {}, "seconds": 1.0}
               for task, value in scores.items()]
    path = root / evals / label / "summary.json"
    path.parent.mkdir(parents=True)
    model = {"spec": label, "location": label, "kind": "local"}
    path.write_text(json.dumps({"model": model, "model_hash": label, "results": results}))


def test_each_arm_is_reported_on_trained_and_on_unseen_skills(tmp_path):
    trained = recovery_report.trained_tasks("probes:arith_2d_add+arith_2d_mul+brackets_d6")
    assert trained == {"arith_2d_add", "arith_2d_mul", "brackets_d6"}  # by task: brackets_d5 stays unseen
    assert recovery_report.trained_tasks("gsm8k") == {"gsm8k"} and recovery_report.trained_tasks("dolly") == frozenset()
    assert recovery_report.trained_tasks("hf:openai/gsm8k:main") == {"gsm8k"}  # by its hub id too
    assert recovery_report.trained_tasks("hf:someone/gsm8k-like") == frozenset()
    _summary(tmp_path, "baseline", {"arith_2d_add": 0.8, "arith_2d_mul": 0.6, "brackets_d5": 0.5, "gsm8k": 0.2,
                                    "piqa": 0.6})
    _summary(tmp_path, "pruned", {"arith_2d_add": 0.2, "arith_2d_mul": 0.2, "brackets_d5": 0.1, "gsm8k": 0.1,
                                  "piqa": 0.5})
    _summary(tmp_path, "sft", {"arith_2d_add": 0.7, "arith_2d_mul": 0.5, "brackets_d5": 0.1, "gsm8k": 0.1,
                               "piqa": 0.5})
    rows = {r["model"]: r for r in recovery_report.study_rows(tmp_path, ["sft"], trained)}
    sft = rows["sft"]
    assert sft["probes_trained"][0] == pytest.approx(0.6) and sft["probes_unseen"][0] == pytest.approx(0.1)
    assert sft["probes_trained"][1] == pytest.approx(0.01 * 2 ** 0.5 / 2)  # sqrt(sum se^2) / k
    assert sft["recovered_share_trained"] == pytest.approx(0.8 / 1.0)  # (0.6 - 0.2) / (0.7 - 0.2)
    assert sft["recovered_share_unseen"] == pytest.approx(0.0)
    assert sft["recovered_share"] == pytest.approx((0.6 * 2 + 0.1 - 0.5) / (1.9 - 0.5))
    assert sft["trained_tasks"] == ["arith_2d_add", "arith_2d_mul"] and sft["unseen_tasks"] == ["brackets_d5"]
    assert sft["probe_items"] == {"arith_2d_add": 100, "arith_2d_mul": 100, "brackets_d5": 100}
    items = recovery_report.probe_items_text({"arith_2d_add": 100, "brackets_d2": 9, "brackets_d3": 20})
    assert items == "arith_2d_add 100, brackets_d2 9 (all there are), brackets_d3 20"  # 20 < 27: not all
    table = recovery_report.format_table(list(rows.values()))
    assert "trained probes (%)" in table and "GSM8K, unseen (%)" in table and "57% / 80% / 0%" in table
    note = " ".join(recovery_report.closing_note(list(rows.values())))
    assert ("trained probe tasks: sft (-), 80% of the drop recovered; judged by its point estimate (no interval), it "
            "reaches three quarters") in note  # no per-item samples here: the unpaired figures
    assert "unseen probe tasks: sft" in note and "0% of the drop recovered; judged by its point" in note
    assert all(r["pairing"].startswith("unpaired") for r in rows.values())


def _with_samples(root: Path, label: str, scores: dict[str, list[int]], evals: str = "eval",
                  first_id: int = 0) -> None:
    """A model's summary and per-item records; item i of every task under doc id first_id + i."""
    _summary(root, label, {task: sum(v) / len(v) for task, v in scores.items()}, evals)
    (root / evals / label / "samples").mkdir()
    for task, values in scores.items():
        lines = [json.dumps({"doc_id": i, "filter": "none", "acc": float(v), "doc_hash": f"{task}{i}",
                             "prompt_hash": f"p{i}", "arguments": [["a", "b"], ["a", "c"]]})
                 for i, v in enumerate(values, start=first_id)]
        (root / evals / label / "samples" / f"{task}.jsonl").write_text("\n".join(lines) + "\n")


def test_paired_study_verdict_needs_the_share_interval_to_clear_the_threshold(tmp_path):
    """A share of 55% whose paired interval reaches below 50% does not 'reach half' (the point estimate did)."""
    n = 40
    base = [1] * 30 + [0] * 10
    pruned = [1] * 10 + [0] * 30
    sft = [1] * 21 + [0] * 19  # 11 of the 20 lost items back: 55%
    for label, vector in (("baseline", base), ("pruned", pruned), ("sft", sft)):
        _with_samples(tmp_path, label, {"arith_2d_add": vector, "piqa": [1, 0] * (n // 2)})
    rows = {r["model"]: r for r in recovery_report.study_rows(tmp_path, ["sft"], frozenset({"arith_2d_add"}))}
    share = rows["sft"]["recovered_share_trained"]
    assert rows["sft"]["pairing"] == "paired" and share["value"] == pytest.approx(0.55)
    assert share["low"] < 0.5 < share["value"] < share["high"]
    note = " ".join(recovery_report.closing_note(list(rows.values())))
    assert "judged by its interval's lower end, it does NOT reach half" in note
    assert rows["sft"]["intervals"]["classification"]["value"] == pytest.approx(0.5)


def test_embedded_study_recovers_on_plain_arithmetic_prompts_only():
    shared = RecoveryStudy.load("recovery-methods-embedded").shared_recipe("<pruned>")
    assert shared.generate.chat_template is False and shared.prompts.samples == 160
    trained = recovery_report.trained_tasks(shared.prompts.source)
    assert trained == {"arith_1dc", "arith_2d_add", "arith_2d_sub", "arith_2d_mul", "arith_3d_add", "arith_3d_sub"}


def test_trained_skills_come_from_the_prompts_kept():
    """brackets_d2 has 9 questions, all evaluation items: its prompts are all excluded, so it trained nothing."""
    from layerprune.recover.prompts import load_prompts
    from layerprune.recover.schema import PromptSource

    source = "probes:arith_2d_add+brackets_d2"
    kept, _ = load_prompts(PromptSource(source=source, samples=16), None)
    assert recovery_report.trained_tasks(source) == {"arith_2d_add", "brackets_d2"}  # by name
    assert recovery_report.trained_tasks(source, [p.text for p in kept]) == {"arith_2d_add"}  # by what was kept


def test_paired_report_gives_the_classification_share_the_goal_and_flags_an_arm_that_loses_a_skill(tmp_path):
    """Every scored skill unseen: the classification drop's share and each arm's classification against the first
    arm's, the issue's goal per arm (half of the drop, interval above 25%, classification no worse than the first
    arm's), and a flag on an arm that scores below the pruned model it started from."""
    n = 60
    copy = {"baseline": [1] * 50 + [0] * 10, "pruned": [1] * 10 + [0] * 50,
            "sft": [1] * 22 + [0] * 38, "local": [1] * 40 + [0] * 20, "merge": [0] * n}
    cls = {"baseline": [1] * 45 + [0] * 15, "pruned": [1] * 30 + [0] * 30, "sft": [1] * 33 + [0] * 27,
           "local": [1] * 34 + [0] * 26, "merge": [1] * 12 + [0] * 48}
    for label in copy:
        _with_samples(tmp_path, label, {"copy_l7": copy[label], "piqa": cls[label]})
    rows = {r["model"]: r for r in recovery_report.study_rows(tmp_path, ["sft", "local", "merge"], frozenset())}
    local, merge = rows["local"], rows["merge"]
    assert local["recovered_share_unseen"]["value"] == pytest.approx(30 / 40)
    assert local["recovered_share_classification"]["value"] == pytest.approx(4 / 15)
    assert local["classification_vs_sft"]["value"] == pytest.approx(1 / 60)
    assert local["skills_lost"] == [] and [s["task"] for s in merge["skills_lost"]] == ["copy_l7", "piqa"]
    note = "\n".join(recovery_report.closing_note(list(rows.values())))
    goal = next(line for line in note.splitlines() if line.startswith("Goal"))
    assert "sft falls short" in goal and "local meets it (75%" in goal and "merge falls short" in goal
    assert "FLAG: merge loses skills the pruned model had: copy_l7 -16.7 [" in note and "piqa -30.0 [" in note
    assert "FLAG: local" not in note and "FLAG: sft" not in note
    table = recovery_report.format_table(list(rows.values()))
    assert "recovered share of the classification drop" in table


def test_tiny_study_with_replicates_controls_and_an_lr_grid(capsys, tiny_llama, tmp_path, monkeypatch):
    """Two replicates of one trained arm (their own seeds: other held-out prompts, other weights), its k = 0 control
    on the unpruned model, and a two-rate grid whose choice is the argmin of the recorded held-out losses."""
    from safetensors.numpy import load_file

    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    data = tiny_study(tiny_llama, tmp_path / "study")
    data.update(arms={"sft": {"method": "lora"}}, replicates=2, controls=True, lr_grid={"sft": [1e-4, 5e-3]})
    data["recover"]["overrides"]["generate"]["chat_template"] = False  # plain recovery data: one probe format
    recipe = tmp_path / "study.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "study"
    search = json.loads((root / "lr_search" / "sft.json").read_text())
    losses = {c["learning_rate"]: c["held_out_loss"] for c in search["candidates"]}
    assert set(losses) == {1e-4, 5e-3} and search["chosen"] == min(losses, key=losses.get)
    assert [c["folder"] for c in search["candidates"] if c["learning_rate"] == search["chosen"]] == ["arms/sft"]
    reports = {name: json.loads((root / folder / "recover_report.json").read_text())
               for name, folder in (("sft", "arms/sft"), ("sft@r1", "arms/sft@r1"), ("control", "controls/sft"),
                                    ("control@r1", "controls/sft@r1"))}
    assert all(r["recipe"]["train"]["learning_rate"] == search["chosen"] for r in reports.values())
    held = {name: reports[name]["held_out_metrics"]["prompts"] for name in reports}
    assert held["sft"] != held["sft@r1"] and held["control"] == held["sft"]  # replicate 1: its own held-out split
    # sampled teacher answers (demo: temperature > 0): replicate 1 drew its own, the control shared replicate 0's
    answers = {name: (root / folder / "data" / "responses.jsonl").read_text()
               for name, folder in (("sft", "arms/sft"), ("sft@r1", "arms/sft@r1"), ("control", "controls/sft"))}
    assert answers["sft"] != answers["sft@r1"] and answers["control"] == answers["sft"]
    weights = {name: load_file(root / "arms" / name / "model.safetensors") for name in ("sft", "sft@r1")}
    assert any((weights["sft"][k] != weights["sft@r1"][k]).any() for k in weights["sft"])  # and other weights
    # the control trained the unpruned original (6 blocks; the arm's student has 4), its teacher the original too
    control = reports["control"]
    assert Path(control["student"]["location"]).resolve() == (root / "control-student").resolve()
    assert json.loads((root / "controls" / "sft" / "config.json").read_text())["num_hidden_layers"] == 6
    assert json.loads((root / "arms" / "sft" / "config.json").read_text())["num_hidden_layers"] == 4
    for name in ("sft", "sft@r1", "control-sft", "control-sft@r1"):
        assert (root / "eval" / name / "summary.json").is_file()
    rows = {r["model"]: r for r in json.loads((root / "study.json").read_text())}
    assert list(rows) == ["baseline", "pruned", "sft", "control-sft"] and rows["sft"]["replicates"] == 2
    scores = [json.loads((root / "eval" / n / "summary.json").read_text())["results"][0]["value"]
              for n in ("sft", "sft@r1")]
    assert rows["sft"]["probes"][0] == pytest.approx(sum(scores) / 2)  # the arm's figure: the mean of its runs
    text = (root / "study.md").read_text()
    assert "k = 0 controls" in text and "- sft: control change" in text and "Learning rate of sft" in text
    assert not (root / "eval-chat").exists() and "Probes in both formats" not in text and "the gate" not in text
    assert run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])[0] == 0  # complete: every stage skipped


def test_study_schema_checks_the_lr_grid_and_reserved_labels(tiny_llama):
    data = tiny_study(tiny_llama, Path("x"))
    assert RecoveryStudy.model_validate(data).replicates == 1 and not RecoveryStudy.model_validate(data).controls
    for grid, message in (({"kd": [1e-4]}, "'kd' is no arm"), ({"sft": []}, "one or more"),
                          ({"replace": [1e-4]}, "trains nothing")):
        with pytest.raises(Exception, match=message):
            RecoveryStudy.model_validate({**data, "lr_grid": grid})
    with pytest.raises(Exception, match="taken"):
        RecoveryStudy.model_validate({**data, "arms": {"control-sft": {"method": "lora"}}})
    with pytest.raises(Exception, match="replicates"):
        RecoveryStudy.model_validate({**data, "replicates": 0})
    study = RecoveryStudy.model_validate({**data, "lr_grid": {"sft": [1e-4, 1e-3]}})
    assert study.arm_recipe("sft", "<pruned>", 1e-3).train.learning_rate == 1e-3
    local = RecoveryStudy.model_validate({**data, "arms": {"local": {"method": "local"}}})
    assert local.arm_recipe("local", "<pruned>", 3e-3).local.learning_rate == 3e-3  # local's own rate


def test_study_dry_run_lists_replicate_control_and_lr_stages_the_flag_beating_the_recipe(capsys, tiny_llama,
                                                                                          tmp_path):
    data = tiny_study(tiny_llama, tmp_path / "s")
    data.update(replicates=1, controls=True, lr_grid={"opd": [1e-4, 1e-3]})
    recipe = tmp_path / "study.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run", "--replicates", "2"])
    assert code == 0, err
    assert "replicates: 2 per arm" in out and "controls (k = 0, the recipe on the original): sft, opd; " \
        "n/a (no cut at k = 0): replace" in out and "lr search opd: 0.0001, 0.001" in out
    stages = out.split("stages (")[1]
    names = stages.split("): ")[1].split(", ")
    # chat-formatted recovery data (demo: generate.chat_template true): every evaluation has its chat-format twin
    assert int(stages.split(")")[0]) == len(names) == 5 + 2 * 3 * 3 + 1 + 2 * 2 * 3 + 1
    assert names[5:12] == ["recover-sft", "eval-sft", "eval-chat/sft", "recover-sft@r1", "eval-sft@r1",
                           "eval-chat/sft@r1", "lr-opd"]
    assert "control-opd@r1" in names and "eval-control-sft" in names and "control-replace" not in names
    assert not (tmp_path / "s").exists()
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert "replicates: 1 per arm" in out and "the run-to-run variance is not measured" in out


def test_control_change_and_net_share_from_the_paired_bootstrap(tmp_path):
    """The control measures what the recipe does to the unpruned model: the arm's share net of that change."""
    n = 40
    vectors = {"baseline": [1] * 30 + [0] * 10, "pruned": [1] * 10 + [0] * 30, "sft": [1] * 24 + [0] * 16,
               "control-sft": [1] * 26 + [0] * 14}  # the recipe alone costs the original 4 items
    for label, vector in vectors.items():
        _with_samples(tmp_path, label, {"arith_2d_add": vector, "piqa": [1, 0] * (n // 2)})
    rows = {r["model"]: r for r in recovery_report.study_rows(tmp_path, ["sft", "control-sft"], frozenset())}
    sft = rows["sft"]
    assert sft["control_change"]["probes"]["value"] == pytest.approx(-4 / n)
    assert sft["recovered_share_unseen"]["value"] == pytest.approx(14 / 20)
    assert sft["recovered_share_unseen_net"]["value"] == pytest.approx((14 + 4) / 20)  # (arm-pruned-(ctl-base))/drop
    assert sft["recovered_share_classification_net"] == "n/a (no clear drop)"
    assert "recovered_share" not in rows["control-sft"] or rows["control-sft"]["recovered_share"] is None
    lines = "\n".join(recovery_report.control_lines(list(rows.values()), True, ["replace"]))
    assert "- sft: control change probes -10.0 [" in lines and "unseen 90% [" in lines
    closing = " ".join(recovery_report.closing_note(list(rows.values())))
    assert "control-sft" not in closing  # a control is no arm
    assert "not measured" in recovery_report.replicate_line(list(rows.values()))


def test_an_arm_with_replicates_is_reported_as_their_mean_with_the_run_sd(tmp_path):
    """Two runs of sft: its figures are their means, its intervals two-level (wider than one run's), the run SD
    beside the item SE; the one-run arm says its run-to-run variance is not measured."""
    n = 40
    vectors = {"baseline": [1] * 30 + [0] * 10, "pruned": [1] * 10 + [0] * 30, "sft": [1] * 20 + [0] * 20,
               "sft@r1": [1] * 26 + [0] * 14, "kd": [1] * 22 + [0] * 18}
    for label, vector in vectors.items():
        _with_samples(tmp_path, label, {"arith_2d_add": vector, "piqa": [1, 0] * (n // 2)})
    runs = {"sft": ["sft", "sft@r1"], "kd": ["kd"]}
    rows = {r["model"]: r for r in recovery_report.study_rows(tmp_path, ["sft", "kd"], frozenset(), runs)}
    sft, kd = rows["sft"], rows["kd"]
    assert sft["replicates"] == 2 and sft["probes"][0] == pytest.approx(23 / 40)  # mean of 20/40 and 26/40
    assert sft["intervals"]["probes"]["value"] == pytest.approx(23 / 40)
    assert sft["recovered_share_unseen"]["value"] == pytest.approx((23 - 10) / 20)
    assert sft["spread"]["probes"]["replicates"] == 2 and sft["spread"]["probes"]["run_sd"] > 0.05
    assert kd["spread"]["probes"]["run_sd"] is None
    one = {r["model"]: r for r in recovery_report.study_rows(tmp_path, ["sft"], frozenset())}["sft"]
    width = sft["intervals"]["probes"]["high"] - sft["intervals"]["probes"]["low"]
    assert width > one["intervals"]["probes"]["high"] - one["intervals"]["probes"]["low"]  # run noise included
    table = recovery_report.format_table(list(rows.values()))
    assert "| sft | - |" in table and " | 2 | 10.6 / " in table and " | 1 | not measured / " in table
    assert "| baseline |" in table and " | 1 | - / " in table  # no training, no run variance
    assert "two-level bootstrap" in recovery_report.replicate_line(list(rows.values()))


def test_each_arm_shows_its_budget_and_learning_rate_or_a_dash_from_older_reports(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    recipe = {"method": "merge", "merge": {"then": "local"}, "train": {"learning_rate": 2e-4},
              "local": {"learning_rate": 1e-3}}
    old.write_text(json.dumps({"recipe": recipe, "data": {}}))
    new.write_text(json.dumps({"recipe": {"method": "lora", "train": {"learning_rate": 2e-4}}, "data": {},
                               "tokens_unpadded": 5000, "sequences": 40, "optimizer_steps": 10}))
    assert recovery_report.budget_spent(old) == {"learning_rate": 1e-3, "tokens_unpadded": None, "sequences": None,
                                              "optimizer_steps": None}  # local's own rate
    spent = recovery_report.budget_spent(new)
    assert spent == {"learning_rate": 2e-4, "tokens_unpadded": 5000, "sequences": 40, "optimizer_steps": 10}
    table = recovery_report.format_table([{"model": "sft", "probes": None, "gsm8k": None, "classification": None,
                                        "retention_probes": None, "retention_classification": None, **spent}])
    assert table.endswith("| 5000 | 40 | 10 | 0.0002 |")


def test_study_dry_run_lists_the_gate_and_both_probe_formats_or_refuses_a_model_without_a_chat_template(
        capsys, tiny_llama, tmp_path):
    import shutil

    from helpers import assert_one_line_error

    data = tiny_study(tiny_llama, tmp_path / "s")
    data.update(arms={"sft": {"method": "lora"}}, probes={"candidates": ["arith_2d_add", "brackets_d3"]})
    recipe = tmp_path / "study.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert code == 0, err
    assert "probe gate (calibrate-probes, on the original): 2 candidate levels x 100 calibration-stream items; " \
        "keep 30-90%, at most 1 per family (arithmetic, brackets); every model scored on arith_1dc plus the kept " \
        "levels" in out
    assert "probe formats: plain and chat" in out and "arith_1dc, the kept levels scored both ways" in out
    assert "chat template: present" in out
    names = out.split("stages (")[1].split("): ")[1].strip().split(", ")
    assert names == ["calibrate-probes", "prune", "eval-baseline", "eval-chat/baseline", "eval-pruned",
                     "eval-chat/pruned", "recover-sft", "eval-sft", "eval-chat/sft", "report"]
    data["recover"]["overrides"]["generate"]["chat_template"] = False
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert "probe format: plain only (the recovery data is plain text" in out and "eval-chat" not in out
    plain = tmp_path / "plain"  # a model without a chat template: refused before any work
    shutil.copytree(tiny_llama, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    data = tiny_study(plain, tmp_path / "s")
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    for args in (["--dry-run"], ["--device", "cpu"]):
        code, out, err = run_cli(capsys, ["study", str(recipe), *args])
        assert_one_line_error(code, err, "has no chat template", "probe_format chat")
    assert not (tmp_path / "s").exists()


def test_study_schema_checks_the_gate_and_keeps_its_fingerprint_without_one(tiny_llama):
    from layerprune.pipeline.stages import recipe_fingerprint
    from layerprune.pipeline.studies.recovery_grid import both_formats, stage_names

    data = tiny_study(tiny_llama, Path("x"))
    study = RecoveryStudy.model_validate(data)
    assert study.probes is None and "probes" not in study.model_dump(exclude_defaults=True)
    gated = RecoveryStudy.model_validate({**data, "probes": {}})
    assert "probes" in gated.model_dump(exclude_defaults=True)
    assert recipe_fingerprint(gated) != recipe_fingerprint(study)
    plain = copy_with(data, generate={"chat_template": False})
    assert not both_formats(RecoveryStudy.model_validate(plain))
    assert stage_names(RecoveryStudy.model_validate(plain)) == [
        "prune", "eval-baseline", "eval-pruned", "recover-sft", "eval-sft", "recover-opd", "eval-opd",
        "recover-replace", "eval-replace", "report"]  # no gate, plain data: the stages of before
    with pytest.raises(Exception, match="name the fixed tasks in evaluate.only"):
        RecoveryStudy.model_validate({**data, "evaluate": {"suite": "sweep-cpu"}, "probes": {}})
    with pytest.raises(Exception, match="suite 'sweep-cpu' has no level arith_2d_mul"):
        RecoveryStudy.model_validate({**data, "evaluate": {"suite": "sweep-cpu", "only": ["piqa"]},
                                      "probes": {"candidates": ["arith_2d_add", "arith_2d_mul"]}})
    with pytest.raises(Exception, match="leave it plain"):
        RecoveryStudy.model_validate({**data, "evaluate": {"tasks": ["arith_1dc"], "probe_format": "chat"}})


def test_a_gated_study_scores_its_fixed_tasks_plus_the_kept_levels_and_the_probes_alone_in_chat(tiny_llama,
                                                                                               tmp_path):
    from layerprune.pipeline.studies.recovery_grid import chat_eval_settings, eval_settings

    data = tiny_study(tiny_llama, tmp_path)
    data.update(evaluate={"suite": "sweep-cpu", "only": ["arc_easy", "piqa", "copy_l7"]},
                probes={"candidates": ["arith_2d_add", "brackets_d3", "copy_l7"]})
    study = RecoveryStudy.model_validate(data)
    with pytest.raises(Exception, match="calibrate-probes stage first"):
        eval_settings(study, tmp_path)
    (tmp_path / "probes_calibrated.json").write_text(json.dumps({"kept": ["brackets_d3", "copy_l7"], "levels": {}}))
    settings = eval_settings(study, tmp_path)
    assert settings.only == ["arc_easy", "piqa", "copy_l7", "brackets_d3"] and settings.suite == "sweep-cpu"
    chat = chat_eval_settings(study, tmp_path)
    assert chat.only == ["copy_l7", "brackets_d3"] and chat.probe_format == "chat" and chat.suite == "sweep-cpu"
    ungated = RecoveryStudy.model_validate({**data, "probes": None})
    assert eval_settings(ungated, tmp_path) == ungated.evaluate and chat_eval_settings(ungated, tmp_path).only == \
        ["copy_l7"]
    assert chat_eval_settings(RecoveryStudy.model_validate({**data, "probes": None, "evaluate": {
        "suite": "sweep-cpu", "only": ["piqa"]}}), tmp_path) is None  # no probe task: nothing to score in chat


def copy_with(data: dict, **overrides: dict) -> dict:
    """The tiny study with recover overrides merged section by section."""
    import copy

    out = copy.deepcopy(data)
    for section, fields in overrides.items():
        out["recover"]["overrides"].setdefault(section, {}).update(fields)
    return out


def test_gate_levels_are_listed_by_family_and_the_probes_reported_in_both_formats(tmp_path):
    """Synthetic eval/ and eval-chat/ folders: the chat rows get their own paired shares and control change; the
    gate's record gives each candidate its family, score, interval and reason."""
    from layerprune.evaluate.calibrated import ProbeCalibration, calibrate_probes

    rates = {"arith_2d_add": 0.5, "arith_2d_sub": 1.0, "brackets_d3": 0.6, "copy_l3": 0.7}
    settings = ProbeCalibration(candidates=list(rates), items=20)
    record = calibrate_probes(None, None, settings, scorer=lambda task, items: [
        i < rates[task] * len(items) for i in range(len(items))])
    (tmp_path / "probes_calibrated.json").write_text(json.dumps(record))
    lines = "\n".join(recovery_report.gate_lines(tmp_path, ["piqa", "copy_l7"]))
    assert "Kept: arith_2d_add, brackets_d3, copy_l3." in lines
    assert "- [arithmetic] arith_2d_add: kept - 50% (95% CI 30-70%, 20 items) is in the band" in lines
    assert "- [arithmetic] arith_2d_sub: left out - 100% (95% CI 84-100%, 20 items) is above the band 30-90%" in lines
    assert "- [brackets] brackets_d3: kept" in lines and "- [retrieval (copy)] copy_l3: kept" in lines
    assert "Fixed probe tasks, scored whatever the gate keeps: copy_l7 (retrieval (copy))" in lines
    assert recovery_report.gate_lines(tmp_path / "none", ["copy_l7"]) == []
    n = 40
    plain = {"baseline": [1] * 30 + [0] * 10, "pruned": [1] * 10 + [0] * 30, "sft": [1] * 20 + [0] * 20,
             "control-sft": [1] * 30 + [0] * 10}
    chat = {"baseline": [1] * 32 + [0] * 8, "pruned": [1] * 12 + [0] * 28, "sft": [1] * 28 + [0] * 12,
            "control-sft": [1] * 36 + [0] * 4}  # the chat format: more of the drop back, and the control gains
    for label in plain:
        _with_samples(tmp_path, label, {"arith_2d_add": plain[label], "piqa": [1, 0] * (n // 2)})
        _with_samples(tmp_path, label, {"arith_2d_add": chat[label]}, evals="eval-chat")
    rows = recovery_report.study_rows(tmp_path, ["sft", "control-sft"], frozenset())
    chat_rows = recovery_report.study_rows(tmp_path, ["sft", "control-sft"], frozenset(), evals="eval-chat")
    sft = {r["model"]: r for r in chat_rows}["sft"]
    assert sft["recovered_share"]["value"] == pytest.approx(16 / 20) and sft["classification"] is None
    assert sft["control_change"]["probes"]["value"] == pytest.approx(4 / n)
    text = "\n".join(recovery_report.format_lines(rows, chat_rows))
    plain_part, chat_part = text.split("Probe format: plain")[1].split("Probe format: chat")
    assert "| sft | 50.0 ± 1.0 | [35.0, 65.0] | - | 50.0 ± 1.0 | 50% [" in plain_part and "| +0.0 [" in plain_part
    assert "| sft | 70.0 ± 1.0 | [55.0, 85.0] | - | 70.0 ± 1.0 | 80% [" in chat_part
    assert "| +10.0 [" in chat_part and "| 60% [" in chat_part  # net: (70 - 30 - 10) / 50
    assert recovery_report.format_lines(rows, []) == []


def test_study_figure_draws_each_arms_two_level_interval_not_its_item_se(tmp_path: Path, monkeypatch) -> None:
    """The figure's error bar of a replicated arm is its paired interval (run-to-run variance in it), asymmetric as
    the bootstrap gives it; only a measure without an interval falls back to +-1 SE."""
    from matplotlib.axes import Axes

    drawn: list[list[list[float]]] = []
    real_bar = Axes.bar

    def bar(self, x, height, width, **kw):
        drawn.append([list(part) for part in kw["yerr"]])
        return real_bar(self, x, height, width, **kw)

    monkeypatch.setattr(Axes, "bar", bar)
    rows = [{"model": "pruned", "probes": (0.15, 0.03)},
            {"model": "sft", "probes": (0.30, 0.045),
             "intervals": {"probes": {"value": 0.30, "low": 0.156, "high": 0.439}}}]
    recovery_report.plot_study(rows, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 0
    (below, above), = drawn
    assert below[0] == pytest.approx(3.0) and above[0] == pytest.approx(3.0)  # no interval: +-1 SE
    assert below[1] == pytest.approx(14.4) and above[1] == pytest.approx(13.9)  # the interval, not +-4.5


# --- declared comparisons (issue 56) -------------------------------------------------------------------------------

COPY = {"baseline": [1] * 50 + [0] * 10, "pruned": [1] * 10 + [0] * 50, "sft": [1] * 22 + [0] * 38,
        "opd": [1] * 40 + [0] * 20, "replace": [1] * 12 + [0] * 48, "control-sft": [1] * 46 + [0] * 14}
PIQA = {"baseline": [1] * 45 + [0] * 15, "pruned": [1] * 30 + [0] * 30, "sft": [1] * 33 + [0] * 27,
        "opd": [1] * 34 + [0] * 26, "replace": [1] * 31 + [0] * 29, "control-sft": [1] * 45 + [0] * 15}
DECLARED = {"main": [{"a": "opd", "b": "sft", "kind": "probes_unseen"},
                     {"a": "sft", "b": "pruned", "measure": "score", "kind": "classification"},
                     {"a": "sft", "net_of_control": True}],
            "late": {"exploratory": True, "contrasts": [{"a": "replace", "b": "opd"}]}}


def _study_with(tiny_llama: Path, tmp_path: Path, **fields: object) -> RecoveryStudy:
    return RecoveryStudy.model_validate({**tiny_study(tiny_llama, tmp_path / "s"), "controls": True, **fields})


def _planted(root: Path) -> tuple[list[dict], object]:
    """Every model scored on the same 60 copy_l7 (a probe task, unseen) and 60 piqa items."""
    for label in COPY:
        _with_samples(root, label, {"copy_l7": COPY[label], "piqa": PIQA[label]})
    return recovery_report.study_tables(root, ["sft", "opd", "replace", "control-sft"], frozenset())


def test_recovery_comparisons_are_declared_without_a_k_and_checked_on_load(capsys, tiny_llama, tmp_path):
    import re

    from pydantic import ValidationError

    from helpers import assert_one_line_error

    study = _study_with(tiny_llama, tmp_path, comparisons=DECLARED)
    assert [c.label for c in study.comparisons["main"].contrasts] == [
        "opd-vs-sft-share", "sft-vs-pruned-score", "sft-share-net"]
    bad = {"a k": ({"f": [{"a": "opd", "b": "sft", "at": 2}]}, "comparisons.f.opd-k2-vs-sft-k2-share: names at, "
                   "which only a sweep's contrast takes (a recovery study has one cut and one budget)"),
           "a task": ({"f": [{"a": "opd", "task": "copy_l7"}]}, "names task, which only a sweep's contrast takes"),
           "unknown arm": ({"f": [{"a": "kd", "b": "sft"}]}, "arm 'kd' is not in arms (sft, opd, replace)"),
           "unknown b": ({"f": [{"a": "sft", "b": "baseline"}]}, "b 'baseline' is neither an arm"),
           "no control": ({"f": [{"a": "replace", "net_of_control": True}]}, "'replace' has no k = 0 control"),
           "pruned's control": ({"f": [{"a": "sft", "b": "pruned", "net_of_control": True}]},
                                "'pruned' has no k = 0 control"),
           "itself": ({"f": [{"a": "sft", "b": "sft"}]}, "compares sft with itself"),
           "duplicate": ({"f": [{"a": "sft", "b": "opd"}], "g": [{"a": "sft", "b": "opd"}]}, "a duplicate name")}
    for families, message in bad.values():
        with pytest.raises(ValidationError, match=re.escape(message)):
            _study_with(tiny_llama, tmp_path, comparisons=families)
    recipe = tmp_path / "bad.yaml"  # the CLI says it in one line
    recipe.write_text(yaml.safe_dump({**tiny_study(tiny_llama, tmp_path / "s"), "comparisons": bad["unknown arm"][0]}))
    code, _, err = run_cli(capsys, ["recipes", "validate", str(recipe), "--kind", "recovery-study"])
    assert_one_line_error(code, err, "arm 'kd' is not in arms")
    from layerprune.pipeline.studies.comparisons import ComparisonFamily, check_comparisons

    for contrast, said in (({"a": "sft", "b": "opd", "at": 1, "kind": "probes_unseen"}, "kind probes_unseen is a "
                            "recovery study's measure"), ({"a": "sft", "b": "opd"}, "name the k of the first side")):
        with pytest.raises(ValueError, match=re.escape(said)):  # a sweep's contrast: its own kinds, and a k
            check_comparisons({"f": ComparisonFamily.model_validate([contrast])}, ["sft", "opd"], [1, 2],
                              lambda _: False)


def test_without_a_declared_family_every_pair_of_arms_is_compared_on_every_measure(tiny_llama, tmp_path):
    """The report used to print each arm minus the first arm (sft), a family nobody declared; now the default family:
    every pair of arms on each measure, Holm over all of them, 'differ' only where a Holm interval excludes 0."""
    rows, figures = _planted(tmp_path)
    study = _study_with(tiny_llama, tmp_path)
    drawn = recovery_report.draw_comparisons(study, figures)
    family = drawn["default"]["default"]
    contrasts = {c["name"]: c for c in family["contrasts"]}
    pairs = ("sft-vs-opd", "sft-vs-replace", "opd-vs-replace")  # the recipe's order, every pair
    measures = ("share-probe-average", "share-unseen-probe-tasks", "share-classification-average",
                "score-classification-average")  # no trained probe task here: that share is not drawn
    assert sorted(contrasts) == sorted(f"{p}-{m}" for p in pairs for m in measures) and drawn["declared"] == {}
    assert {c["holm"]["family"] for c in contrasts.values()} == {12}
    assert contrasts["sft-vs-opd-share-probe-average"]["interval"]["value"] == pytest.approx(12 / 40 - 30 / 40)
    assert contrasts["opd-vs-replace-share-classification-average"]["interval"]["value"] == pytest.approx(
        4 / 15 - 1 / 15)
    assert contrasts["sft-vs-opd-score-classification-average"]["interval"]["value"] == pytest.approx(-1 / 60)
    text = "\n".join(recovery_report.comparison_lines(study, drawn, rows))
    assert "so the default family is drawn" in text and "Default comparisons, family default (12 contrasts;" in text
    for row in contrasts.values():  # 'differ' only from a Holm interval that excludes 0
        said = next(x for x in text.splitlines() if x.startswith(f"- {row['name']}:"))
        assert ("differ (Holm)" in said) == row["holm"]["declared"]
    assert contrasts["opd-vs-replace-share-probe-average"]["holm"]["declared"]  # 70 points apart on 60 items
    assert not contrasts["sft-vs-opd-score-classification-average"]["holm"]["declared"]
    note = "\n".join(recovery_report.closing_note(rows))
    assert "minus sft" not in note and "Holm" not in note  # the undeclared family, gone from the rows too
    assert "recovered_share_vs_sft" not in json.dumps(rows) and "_holm" not in json.dumps(rows)
    assert "whether two arms differ: the comparisons below" in note


def test_declared_families_replace_the_default_and_an_exploratory_one_is_labelled(tiny_llama, tmp_path):
    """Arm against arm, an arm against the pruned model and an arm net of its k = 0 control, Holm over exactly the
    three; the exploratory family drawn apart and labelled."""
    rows, figures = _planted(tmp_path)
    study = _study_with(tiny_llama, tmp_path, comparisons=DECLARED)
    drawn = recovery_report.draw_comparisons(study, figures)
    assert drawn["default"] == {} and set(drawn["declared"]) == {"main", "late"}
    main = {c["name"]: c for c in drawn["declared"]["main"]["contrasts"]}
    assert {c["holm"]["family"] for c in main.values()} == {3}
    assert main["opd-vs-sft-share"]["interval"]["value"] == pytest.approx(30 / 40 - 12 / 40)
    assert main["sft-vs-pruned-score"]["interval"]["value"] == pytest.approx(3 / 60)
    assert main["sft-share-net"]["interval"]["value"] == pytest.approx((12 + 4) / 40)  # the recipe costs 4 items
    late = drawn["declared"]["late"]
    assert late["exploratory"] and late["contrasts"][0]["holm"]["family"] == 1
    text = "\n".join(recovery_report.comparison_lines(study, drawn, rows))
    assert "default family" not in text and "Declared comparisons, family main (3 contrasts; 95%" in text
    assert "family late (1 contrast, exploratory (declared after the results were read);" in text
    assert "- sft-vs-pruned-score: sft - pruned, classification average, recovered score: +5.0% [" in text
    assert "- sft-share-net: sft, probe average, recovered share net of the k = 0 control: +40.0% [" in text
    only_late = _study_with(tiny_llama, tmp_path, comparisons={"late": DECLARED["late"]})
    assert recovery_report.draw_comparisons(only_late, figures)["default"]  # exploratory only: the default as well


def test_a_recovery_study_refuses_models_scored_on_different_items(tmp_path):
    """Planted records: opd was scored on other copy_l7 items (doc ids 5..64, not 0..59). The report used to fall back
    to unpaired figures without a word in study.md; now it stops with one line naming the models, task and count."""
    from layerprune.core.errors import LayerpruneError

    for label in ("baseline", "pruned", "sft"):
        _with_samples(tmp_path, label, {"copy_l7": COPY[label], "piqa": PIQA[label]})
    _with_samples(tmp_path, "opd", {"copy_l7": COPY["opd"]}, first_id=5)
    (tmp_path / "eval" / "opd" / "samples" / "piqa.jsonl").write_text(
        (tmp_path / "eval" / "sft" / "samples" / "piqa.jsonl").read_text())
    with pytest.raises(LayerpruneError, match=r"^models scored on different items: baseline and opd on copy_l7 "
                       r"differ in 10 item\(s\)"):
        recovery_report.study_rows(tmp_path, ["sft", "opd"], frozenset())
