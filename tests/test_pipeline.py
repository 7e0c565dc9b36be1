"""`layerprune run`: shipped recipes dry-run; a tiny end-to-end run; resume, --from and foreign run directories."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, fingerprint, run_cli
from layerprune.core.provenance import collect_provenance
from layerprune.core.recipe_loading import load_recipe, shipped_command, shipped_recipes

RUN_RECIPES = sorted(name for kind, name in shipped_recipes("run"))


def test_studies_cover_three_models_three_arms_two_recoveries():
    names = [name for name in RUN_RECIPES if name.startswith("limits-")]
    assert len(names) == 18
    for model in ("llama31-8b", "qwen25-7b", "mistral-7b"):
        for arm in ("reverse", "bi", "ablation"):
            assert sum(n.startswith(f"limits-{model}-{arm}") for n in names) == 2
    for name in RUN_RECIPES:
        data = load_recipe(name, "run")[0]
        if data["prune"].get("calib"):
            assert "test" not in data["prune"]["calib"]  # calibration never on test items
        command = shipped_command("run", name)
        assert command.startswith("layerprune run ") and name in command


@pytest.mark.parametrize("name", RUN_RECIPES)
def test_every_shipped_run_recipe_dry_runs(capsys, name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli(capsys, ["run", name, "--dry-run", "--output", str(tmp_path / "run")])
    assert code == 0, err
    assert "recipe: valid" in out and "memory" in out
    assert not (tmp_path / "run").exists()


def tiny_recipe(model: Path, output: Path, name: str = "tiny") -> dict:
    return {
        "name": name, "model": str(model), "output": str(output),
        "prune": {"drop": 2, "score": "ablation", "calib": "arithmetic", "calib_samples": 4},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "gsm8k", "samples": 4}, "generate": {"max_new_tokens": 8, "batch_size": 4},
            "train": {"max_steps": 2, "epochs": 1, "max_length": 512, "batch_size": 2, "eval_steps": 1,
                      "logging_steps": 1, "save_steps": 1, "held_out": 0.5}, "lora": {"r": 4, "alpha": 8}}},
        "evaluate": {"tasks": ["arith_1dc"], "limit": 4, "batch_size": "4"},
    }


ROLES = ("baseline", "pruned", "recovered")


def item_scores(run: Path, role: str, task: str = "arith_1dc") -> dict[int, float]:
    """doc_id -> exact_match of one model's per-item records (eval/<role>/samples)."""
    rows = map(json.loads, (run / "eval" / role / "samples" / f"{task}.jsonl").read_text().splitlines())
    return {row["doc_id"]: row["exact_match"] for row in rows}


def table_row(report: str, task: str, after: str = "## Evaluation") -> list[str]:
    """The cells of a task's row in the first table after the heading `after` (the lead table has no heading)."""
    line = next(line for line in report.partition(after)[2].splitlines() if line.startswith(f"| {task} |"))
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def assert_figures_are_the_records(run: Path, report: str) -> None:
    """The evaluation table's cells recomputed from the run folder: each model's mean from its per-item records
    (and the summary's value equal to it), the paired differences, their SE and b/c counts from the items paired by
    doc_id, retention and the recovered share (where the drop is clear) from the per-item means."""
    scores = {role: item_scores(run, role) for role in ROLES}
    results = {role: json.loads((run / "eval" / role / "summary.json").read_text())["results"][0] for role in ROLES}
    means = {role: statistics.fmean(scores[role].values()) for role in ROLES}
    row, n = table_row(report, "arith_1dc"), len(scores["baseline"])
    assert row[2] == str(n) and all(len(scores[role]) == results[role]["n"] == n for role in ROLES)
    for cell, role in zip(row[3:6], ROLES, strict=True):
        assert results[role]["value"] == pytest.approx(means[role])
        assert cell == f"{means[role]:.4f} ± {results[role]['stderr']:.4f}"
    for cell, (high, low) in zip(row[6:8], [("pruned", "baseline"), ("recovered", "pruned")], strict=True):
        diffs = [scores[high][doc] - scores[low][doc] for doc in scores[low]]
        b = sum(scores[low][doc] == 1 and scores[high][doc] == 0 for doc in scores[low])
        c = sum(scores[low][doc] == 0 and scores[high][doc] == 1 for doc in scores[low])
        se = statistics.stdev(diffs) / math.sqrt(n)
        assert cell.startswith(f"{statistics.fmean(diffs):+.4f} ± {se:.4f} [") and f"; b/c {b}/{c}, " in cell
    base, pruned, recovered = (means[role] for role in ROLES)
    glance = table_row(report, "arith_1dc", after="## Outcome at a glance")
    assert report.split("## Outcome at a glance\n\n", 1)[1].startswith("| task")  # the compact table leads
    assert glance[:6] == ["arith_1dc", "arithmetic", str(n), *(f"{100 * means[role]:.1f}" for role in ROLES)]
    assert glance[6] == ("no clear drop" if "(within noise)" in row[6] else row[12])
    if "(within noise)" in row[6]:
        assert row[8] == row[10] == row[12] == "n/a (no clear drop)"
    else:
        assert row[8].startswith(f"{100 * pruned / base:.1f}% [")
        assert row[10].startswith(f"{100 * recovered / base:.1f}% [")
        assert row[12].startswith(f"{100 * (recovered - pruned) / (base - pruned):.1f}% [")


def assert_stage_figures_are_the_reports(run: Path, report: str) -> None:
    """The report's blocks, parameters, calibration size, speed and recovery figures equal the stages' own files."""
    prune = json.loads((run / "pruned" / "prune_report.json").read_text())
    assert f"Dropped (original numbering): {prune['dropped']}; protected: {prune['method']['protect']}." in report
    assert (f"- Blocks {prune['num_blocks_before']} -> {prune['num_blocks_after']}; parameters "
            f"{prune['params_before'] / 1e6:.1f}M -> {prune['params_after'] / 1e6:.1f}M;") in report
    assert f"seed 0; no evaluation probe among them), {len(prune['calibration']['items'])} items." in report
    speed = json.loads((run / "speed.json").read_text())
    before, after = speed["original"]["prefill_tokens_per_s"], speed["pruned"]["prefill_tokens_per_s"]
    assert f"prefill {before:.0f} -> {after:.0f} tokens/s ({after / before:.2f}x)" in report
    recover = json.loads((run / "recovered" / "recover_report.json").read_text())
    loss = recover["held_out_loss"]
    assert loss["before"] == recover["held_out_metrics"]["pruned"]["ce"]
    assert (f"held-out loss on teacher responses {loss['before']:.3f} -> {loss['after']:.3f}; "
            f"{recover['tokens_seen']} tokens seen;") in report


def rescore(run: Path, scores: dict[str, list[float]]) -> None:
    """Give each model's records (and its summary, as evaluate would write it) these per-item exact_match scores."""
    for role, values in scores.items():
        path = run / "eval" / role / "samples" / "arith_1dc.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(row | {"exact_match": v}) + "\n"
                                for row, v in zip(rows, values, strict=True)))
        summary = json.loads((run / "eval" / role / "summary.json").read_text())
        summary["results"][0] |= {"value": statistics.fmean(values),
                                  "stderr": statistics.stdev(values) / math.sqrt(len(values))}
        (run / "eval" / role / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def tiny_run(tiny_llama, tmp_path, shared_data, monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tiny_llama, tmp_path / "run")))
    return recipe, tmp_path / "run"


def test_tiny_pipeline_runs_resumes_and_reruns_from_a_stage(capsys, tiny_run, caplog):
    recipe, run = tiny_run
    code, out, err = run_cli(capsys, ["run", str(recipe)])
    assert code == 0, err
    for path in ("pruned/prune_report.json", "eval/baseline/summary.json", "eval/pruned/summary.json",
                 "recovered/recover_report.json", "eval/recovered/summary.json", "selfgen.jsonl", "gguf/export.json",
                 "report.md"):
        assert (run / path).exists(), path
    report = (run / "report.md").read_text()
    assert "## Evaluation: baseline / pruned / recovered" in report and "arith_1dc" in report
    assert "tokens/s" in report and "Dropped (original numbering)" in report
    assert "## Run it" in report and "No GGUF: export --gguf carries the tokenizer from the model's source" in report
    assert_figures_are_the_records(run, report)
    assert_stage_figures_are_the_reports(run, report)

    caplog.clear()
    with caplog.at_level("INFO"):
        code, _, err = run_cli(capsys, ["run", str(recipe)])
    assert code == 0, err
    assert caplog.text.count("complete, skipped") == 7

    # the tiny models score 0 everywhere: rescored records (a clear drop, half of it recovered) give the report's
    # arithmetic something to get wrong, and --from report redraws it from them
    rescore(run, {"baseline": [1.0, 1.0, 1.0, 1.0], "pruned": [0.0, 1.0, 0.0, 0.0], "recovered": [1.0, 1.0, 0.0, 0.0]})
    before = json.loads((run / "recovered" / "recover_report.json").read_text())
    code, _, err = run_cli(capsys, ["run", str(recipe), "--from", "report"])
    assert code == 0, err
    assert json.loads((run / "recovered" / "recover_report.json").read_text()) == before
    report = (run / "report.md").read_text()
    assert "(within noise)" not in table_row(report, "arith_1dc")[6]
    assert_figures_are_the_records(run, report)
    assert_stage_figures_are_the_reports(run, report)
    from huggingface_hub import ModelCard

    for role, values in (("pruned", [0.0, 1.0, 0.0, 0.0]), ("recovered", [1.0, 1.0, 0.0, 0.0])):  # the report stage
        card = ModelCard.load(run / role / "README.md")  # put each model's scores on its card (model-index)
        assert [(r.dataset_name, r.metric_value) for r in card.data.eval_results] == [
            ("arith_1dc", statistics.fmean(values))]
        assert "| task | measures | n | original | pruned | recovered |" in card.text


def test_run_directory_of_another_recipe_is_refused(capsys, tiny_run, tiny_llama, tmp_path):
    recipe, run = tiny_run
    run.mkdir()
    recorded = yaml.safe_load(recipe.read_text()) | {"name": "other"}
    (run / "run.json").write_text(json.dumps({"name": "other", "fingerprint": "x", "recipe": recorded,
                                              "provenance": collect_provenance().model_dump(mode="json")}))
    code, _, err = run_cli(capsys, ["run", str(recipe)])
    assert_one_line_error(code, err, "another recipe", "--overwrite")
    assert json.loads((run / "run.json").read_text())["name"] == "other"


def test_run_json_of_an_older_version_is_one_line_naming_the_field(capsys, tiny_run):
    recipe, run = tiny_run
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"name": "other", "fingerprint": "x", "recipe": {}}))
    before = fingerprint(run)
    code, _, err = run_cli(capsys, ["run", str(recipe)])
    assert_one_line_error(code, err, "run.json", "'provenance' missing", "--overwrite")
    assert fingerprint(run) == before


def test_bad_run_recipes(capsys, tiny_llama, tmp_path):
    bad = tiny_recipe(tiny_llama, tmp_path / "r")
    bad["prune"]["dorp"] = 2
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(bad))
    code, _, err = run_cli(capsys, ["run", str(tmp_path / "a.yaml"), "--dry-run"])
    assert_one_line_error(code, err, "dorp")

    bad = tiny_recipe(tiny_llama, tmp_path / "r")
    bad["recover"]["overrides"]["train"]["learning_rate"] = -1
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(bad))
    code, _, err = run_cli(capsys, ["run", str(tmp_path / "b.yaml"), "--dry-run"])
    assert_one_line_error(code, err, "learning_rate")

    bad = tiny_recipe(tmp_path / "missing-model", tmp_path / "r")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(bad))
    code, _, err = run_cli(capsys, ["run", str(tmp_path / "c.yaml"), "--dry-run"])
    assert_one_line_error(code, err, "not found")

    code, _, err = run_cli(capsys, ["run", "no-such-recipe"])
    assert_one_line_error(code, err, "recipe")


def test_from_unknown_stage(capsys, tiny_run):
    recipe, _ = tiny_run
    code, _, err = run_cli(capsys, ["run", str(recipe), "--from", "recovr"])
    assert_one_line_error(code, err, "did you mean: recover")


@pytest.mark.parametrize("name", ["importance-qwen25-7b", "importance-llama31-8b"])
def test_importance_study_recipes_load_and_flags_override_them(name):
    from layerprune.cli import build_parser
    from layerprune.cli.analyze import build_config

    args = build_parser().parse_args(["analyze", "importance", "--recipe", name, "--samples", "3"])
    config, _ = build_config(args)
    assert len(config.models) == 4 and config.tasks == ["gsm8k", "triviaqa"]
    assert config.samples == 3  # the flag beats the recipe's 200


def test_run_directory_is_claimed_by_recipe_not_by_path_or_execution_settings(tiny_llama, tmp_path):
    from layerprune.core.errors import LayerpruneError
    from layerprune.pipeline.recipe import RunRecipe
    from layerprune.pipeline.stages import RunPaths, claim_run_dir

    body = tiny_recipe(tiny_llama, tmp_path / "r")
    recipe = RunRecipe.model_validate(body)
    run = tmp_path / "elsewhere"
    run.mkdir()
    # an older run.json: its fingerprint hashed the output path too; the recipe it records decides
    recorded = recipe.model_dump(mode="json") | {"output": "some/other/path"}
    recorded["prune"]["stack_candidates"] = 0
    provenance = collect_provenance().model_dump(mode="json")
    (run / "run.json").write_text(json.dumps({"name": recipe.name, "fingerprint": "old-rule", "recipe": recorded,
                                              "provenance": provenance}))
    claim_run_dir(RunPaths(run), recipe, overwrite=False)  # same recipe: accepted, nothing removed
    assert json.loads((run / "run.json").read_text())["fingerprint"] == "old-rule"
    recorded["prune"]["drop"] = recipe.prune.n_drop + 1
    (run / "run.json").write_text(json.dumps({"name": recipe.name, "fingerprint": "old-rule", "recipe": recorded,
                                              "provenance": provenance}))
    with pytest.raises(LayerpruneError, match="another recipe"):
        claim_run_dir(RunPaths(run), recipe, overwrite=False)


def test_the_run_s_recover_stage_removes_the_work_folder_an_interrupted_recovery_left(tmp_path):
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.recipe import RunRecipe
    from layerprune.pipeline.stages import RunPaths, stages_of_run

    recipe = RunRecipe.model_validate(tiny_recipe(tmp_path / "model", tmp_path / "run"))
    paths = RunPaths(tmp_path / "run")
    leftovers = {stage.name: stage.leftover for stage in stages_of_run(recipe, RunSettings(), paths)}
    assert leftovers["recover"] == paths.recovered.parent / f"{paths.recovered.name}.work"
    assert all(folder is None for name, folder in leftovers.items() if name != "recover")
