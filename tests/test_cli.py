"""The command line in-process through main(argv): --recipe on prune and evaluate, -o/--output on every writer."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from helpers import run_cli
from layerprune.cli import build_parser
from layerprune.cli.evaluate import build_settings
from layerprune.cli.prune import build_recipe
from layerprune.evaluate.summary import Summary


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_prune_recipe_file_with_a_flag_that_overrides_it(capsys, tiny_llama, tmp_path):
    recipe = write_yaml(tmp_path / "last3.yaml", {"drop": 3, "score": "last", "verify": False})
    out = tmp_path / "pruned"
    code, stdout, err = run_cli(capsys, ["prune", "--recipe", str(recipe), "--model", str(tiny_llama), "--drop", "2",
                                         "-o", str(out)])
    assert code == 0, err
    assert "logits not compared (--no-verify)" in stdout  # a streamed save without verification says so
    report = json.loads((out / "prune_report.json").read_text())
    assert report["method"]["score"] == "last"  # from the recipe
    assert report["dropped"] == [4, 5]  # --drop 2 beat the recipe's 3


def test_shipped_prune_recipe_by_name_and_a_cli_false_beats_its_true():
    parse = build_parser().parse_args
    shipped = build_recipe(parse(["prune", "--recipe", "ablation-gsm8k"]))
    assert shipped.drop == 8 and shipped.iterative is True and shipped.calib == "gsm8k"
    changed = build_recipe(parse(["prune", "--recipe", "ablation-gsm8k", "--drop", "2", "--no-iterative"]))
    assert changed.drop == 2 and changed.iterative is False and changed.calib_samples == 128
    assert build_recipe(parse(["prune", "--drop", "1"])).iterative is False  # no recipe: the schema's default


def test_evaluate_recipe_with_a_flag_that_overrides_it_and_output(capsys, tiny_llama, tmp_path):
    recipe = write_yaml(tmp_path / "probe.yaml", {"tasks": ["arith_1dc"], "limit": 3, "max_gen_toks": 4,
                                                  "batch_size": "4"})
    settings, _ = build_settings(build_parser().parse_args(["evaluate", "--recipe", "paper", "--limit", "5"]))
    assert settings.suite == "paper" and settings.fewshot_from_eval_split and settings.limit == 5
    out = tmp_path / "eval"
    code, _, err = run_cli(capsys, ["evaluate", "--recipe", str(recipe), "--model", str(tiny_llama), "--limit", "2",
                                    "--cache-dir", str(tmp_path / "cache"), "-o", str(out)])
    assert code == 0, err
    headline = Summary.model_validate_json((out / "summary.json").read_text()).headlines()
    assert list(headline) == ["arith_1dc"] and headline["arith_1dc"].n == 2  # the flag beat the recipe's limit of 3


def test_output_short_flag_for_pipeline_analysis_and_recipes(capsys, tiny_llama, tmp_path):
    run_recipe = write_yaml(tmp_path / "run.yaml", {
        "name": "tiny", "model": str(tiny_llama), "output": str(tmp_path / "recipe-dir"), "recover": None,
        "prune": {"drop": 2, "score": "last"}, "evaluate": {"tasks": ["arith_1dc"], "limit": 2}})
    code, out, err = run_cli(capsys, ["run", str(run_recipe), "-o", str(tmp_path / "run"), "--dry-run"])
    assert code == 0, err
    assert f"-> {tmp_path / 'run'}" in out

    study = write_yaml(tmp_path / "study.yaml", {  # a one-cut sweep (a recovery study)
        "kind": "sweep-study", "name": "tiny-study", "model": str(tiny_llama), "ratios": [2],
        "prune": {"layers": [2, 3]}, "arms": {"sft": {"method": "lora"}},
        "recover": {"recipe": "demo", "overrides": {"train": {"max_steps": 2}}}, "classification": ["arc_easy"],
        "fixed": ["arith_1dc"], "probes": None, "gsm8k_gate": None, "evaluate": {"suite": "sweep-cpu"}})
    code, out, err = run_cli(capsys, ["study", str(study), "-o", str(tmp_path / "s"), "--dry-run"])
    assert code == 0, err
    assert f"-> {tmp_path / 's'}" in out

    generations = tmp_path / "gen.jsonl"
    generations.write_text('{"prompt": "p", "output": "one two one two."}\n')
    code, _, err = run_cli(capsys, ["analyze", "degeneration", "--generations", str(generations), "-o",
                                    str(tmp_path / "deg")])
    assert code == 0, err
    assert (tmp_path / "deg" / "degeneration.json").is_file()

    code, _, err = run_cli(capsys, ["recipes", "cp", "ablation-gsm8k", "-o", str(tmp_path / "mine.yaml")])
    assert code == 0, err
    assert yaml.safe_load((tmp_path / "mine.yaml").read_text())["score"] == "ablation"
    code, _, err = run_cli(capsys, ["recipes", "cp", "ablation-gsm8k", str(tmp_path / "a.yaml"), "-o",
                                    str(tmp_path / "b.yaml")])
    assert code == 2 and "once" in err and not (tmp_path / "a.yaml").exists()
