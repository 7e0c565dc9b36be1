"""`layerprune run`: rep-n and self-BLEU of the original, pruned and recovered models' GSM8K answers in report.md."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import run_cli
from layerprune.analyze import metrics
from layerprune.tasks.data import read_jsonl
from test_pipeline import tiny_recipe

ANSWERS = {
    "baseline": ["Natalia sold 48 clips in April. She sold half as many in May. So she sold 72 clips in all.",
                 "He earns 12 dollars an hour. He worked 50 minutes. So he earned 10 dollars."],
    "pruned": ["The answer is 72. The answer is 72. The answer is 72. The answer is 72.",
               "so so so so so so so so so so"],
    "recovered": ["She sold 48 clips and then 24 clips. So she sold 72 clips. The answer is 72.",
                  "He earned 10 dollars for 50 minutes of work. The answer is 10."],
}


def expected(texts: list[str]) -> dict:
    return {**metrics.degeneration_stats(texts), **metrics.study_degeneration_stats(texts)}


def fake_run(tmp_path, task: str = "gsm8k"):
    """A run directory whose three evaluations saved lm-eval samples of `task` (resps as lm-eval nests them)."""
    from layerprune.pipeline.stages import RunPaths

    paths = RunPaths(tmp_path / "run")
    for role, texts in ANSWERS.items():
        folder = paths.eval(role)
        (folder / "samples").mkdir(parents=True)
        (folder / "summary.json").write_text("{}")
        rows = [{"doc_id": i, "resps": [[text]], "filtered_resps": ["72"]} for i, text in enumerate(texts)]
        (folder / "samples" / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


@pytest.mark.parametrize("task", ["gsm8k", "gsm8k_boxed_chat"])
def test_degeneration_from_evaluate_samples_equals_the_metrics(tmp_path, tiny_llama, task):
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.degeneration import degeneration_lines, measure_degeneration
    from layerprune.pipeline.recipe import RunRecipe

    paths = fake_run(tmp_path, task)
    recipe = RunRecipe.model_validate(tiny_recipe(tiny_llama, paths.root))  # degeneration.samples 0: nothing generated
    data = measure_degeneration(recipe, RunSettings(), paths)
    assert data is not None and task in data["source"]
    assert json.loads((paths.root / "degeneration.json").read_text())["models"].keys() == {
        "original", "pruned", "recovered"}
    for role, name in (("baseline", "original"), ("pruned", "pruned"), ("recovered", "recovered")):
        want = expected(ANSWERS[role])
        for key, value in want.items():
            assert data["models"][name][key] == pytest.approx(value), (name, key)
    assert data["models"]["pruned"]["study_rep_2"] > data["models"]["original"]["study_rep_2"]
    table = "\n".join(degeneration_lines(data))
    row = next(line for line in table.splitlines() if line.startswith("| pruned |"))
    assert f"{expected(ANSWERS['pruned'])['study_rep_2']:.2f}" in row
    assert not list(paths.root.rglob("degeneration_gsm8k_*.jsonl"))


def test_no_gsm8k_and_no_samples_says_not_measured(tmp_path, tiny_llama):
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.degeneration import degeneration_lines, measure_degeneration
    from layerprune.pipeline.recipe import RunRecipe

    paths = fake_run(tmp_path, "arith_1dc")
    recipe = RunRecipe.model_validate(tiny_recipe(tiny_llama, paths.root))
    assert measure_degeneration(recipe, RunSettings(), paths) is None
    assert not (paths.root / "degeneration.json").exists()
    assert "Not measured" in "\n".join(degeneration_lines(None))


def test_tiny_run_reports_degeneration_of_its_three_models(capsys, tiny_llama, tmp_path, shared_data, monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    body = tiny_recipe(tiny_llama, tmp_path / "run")
    body["degeneration"] = {"samples": 3, "max_new_tokens": 24, "batch_size": 3}
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(body))
    code, _, err = run_cli(capsys, ["run", str(recipe)])
    assert code == 0, err
    run = tmp_path / "run"
    report = (run / "report.md").read_text()
    assert "## Degeneration of GSM8K answers" in report
    data = json.loads((run / "degeneration.json").read_text())
    for role, name in (("baseline", "original"), ("pruned", "pruned"), ("recovered", "recovered")):
        saved = read_jsonl(run / "eval" / role / "degeneration_gsm8k_n3_t24.jsonl")
        assert len(saved) == 3 and all(row["output"] for row in saved)
        want = expected([row["output"] for row in saved])
        for key, value in want.items():
            assert data["models"][name][key] == pytest.approx(value), (name, key)
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        assert row.split("|")[2].strip() == "3"  # responses
    # changing only the degeneration settings keeps the run directory (no "another recipe"), renews the table
    body["degeneration"]["samples"] = 2
    recipe.write_text(yaml.safe_dump(body))
    code, _, err = run_cli(capsys, ["run", str(recipe), "--from", "report"])
    assert code == 0, err
    assert json.loads((run / "degeneration.json").read_text())["models"]["pruned"]["responses"] == 2
