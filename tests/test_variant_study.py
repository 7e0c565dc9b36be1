"""`layerprune variant-study`: the shipped CPU recipe dry-runs offline; bad recipes are one-line errors."""

from __future__ import annotations

import yaml

from helpers import run_cli


def test_shipped_variant_study_dry_runs_offline(capsys, shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    code, out, err = run_cli(capsys, ["variant-study", "variant-embedded", "--dry-run", "--output",
                                      str(tmp_path / "v")])
    assert code == 0, err
    assert not (tmp_path / "v").exists()
    assert "recover recipe 'variant-sft-gsm8k' on embedded (teacher: itself), method full, 128 gsm8k train" in out
    assert "1 epoch(s) of 8 x 1 at lr 0.0001" in out
    assert "embedded / gsm8k: teacher-forced nll (no generation), 100 items x 31 runs" in out
    assert "embedded / factual: teacher-forced nll (no generation), 78 items x 31 runs" in out  # all the shipped ones
    assert "      | Question: " in out and "      > " in out  # the rendered example and its scored target


def test_bad_variant_study_recipes(capsys, tmp_path):
    good = yaml.safe_load(open(_shipped()).read())
    for change, needle in (({"importance": {"models": ["a"]}}, "sets itself"),
                           ({"importance": {"metirc": "nll"}}, "metirc"),
                           ({"variant": {"recipe": "variant-sft-gsm8k", "overrides": {"train": {"epochs": -1}}}},
                            "epochs"),
                           ({"resamples": 5}, "resamples")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**good, **change}))
        code, _, err = run_cli(capsys, ["variant-study", str(path), "--dry-run"])
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def _shipped():
    from layerprune.recipe_loading import shipped_recipes

    return shipped_recipes("variant-study")[("variant-study", "variant-embedded")]


def test_tiny_variant_study_runs_and_its_table_matches_the_agreement(capsys, tiny_llama, tmp_path, shared_data,
                                                                     monkeypatch):
    import json

    from layerprune.analyze.agreement import profile_agreement

    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    recipe = {"name": "tiny-variant", "model": str(tiny_llama), "output": str(tmp_path / "v"), "resamples": 100,
              "variant": {"recipe": "variant-sft-gsm8k", "overrides": {
                  "prompts": {"samples": 4}, "generate": {"max_new_tokens": 8, "batch_size": 4},
                  "train": {"max_steps": 2, "batch_size": 2, "max_length": 512, "held_out": 0.5, "eval_steps": 1,
                            "logging_steps": 1, "save_steps": 2, "learning_rate": 1.0e-2,
                            "warmup_steps": 0}}},
              "importance": {"tasks": ["arithmetic", "factual"], "samples": 6, "metric": "accuracy"}}
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml")])
    assert code == 0, err
    run = tmp_path / "v"
    assert (run / "variant" / "recover_report.json").is_file() and (run / "importance" / "heatmap.png").is_file()
    report = json.loads((run / "importance" / "importance.json").read_text())
    assert list(report["models"]) == [tiny_llama.name, "variant"]
    tasks = json.loads((run / "variant.json").read_text())["tasks"]
    for task, per_model in report["tasks"].items():
        original, variant = per_model.values()
        want = profile_agreement(original, variant, "mean", 0.2, 100, 0.05, 0)
        assert tasks[task]["spearman"] == want["spearman"]
        assert tasks[task]["jaccard_interval"] == want["jaccard_interval"]
        assert f"| {task} |" in out
    # the original's weights were linked, not changed: the variant is a new model
    from safetensors.torch import load_file

    before = load_file(str(tiny_llama / "model.safetensors"))
    after = load_file(str(run / "variant" / "model.safetensors"))
    assert any(not (before[k] == after[k]).all() for k in before if k in after)
