"""`layerprune variant-study`: the shipped CPU recipe dry-runs offline; bad recipes are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
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
                           ({"resamples": 5}, "resamples"),
                           ({"target": "mmlu"}, "target 'mmlu' is not one of the importance tasks"),
                           ({"control": {"skip_block": -1}}, "skip_block"),
                           ({"nmi": {"model": "x"}}, "nmi sets ['model']"),
                           ({"nmi": {"k": 1}}, "k"),
                           ({"variant": {"posttrain": "math-embedded", "recipe": "x"}}, "variant"),
                           ({"variant": {"posttrain": "no-such-variant"}}, "no-such-variant"),
                           ({"variant_seeds": [0, 1]}, "variant_seeds needs a posttrain variant"),
                           ({"variant": {"posttrain": "math-embedded"}, "variant_seeds": [1, 1]}, "distinct"),
                           ({"variant": {"posttrain": "math-embedded"}, "variant_seeds": []}, "variant_seeds")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**good, **change}))
        code, _, err = run_cli(capsys, ["variant-study", str(path), "--dry-run"])
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def _shipped():
    from layerprune.core.recipe_loading import shipped_recipes

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
              "importance": {"tasks": ["arithmetic", "factual"], "samples": 6, "metric": "accuracy"},
              "target": "arithmetic", "control": {"skip_block": 1}, "splits": 2,
              "nmi": {"calib": "arithmetic", "samples": 4, "k": 2, "seeds": 2, "pos": False}}
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml")])
    assert code == 0, err
    run = tmp_path / "v"
    assert (run / "variant" / "recover_report.json").is_file() and (run / "importance" / "heatmap.png").is_file()
    report = json.loads((run / "importance" / "importance.json").read_text())
    assert list(report["models"]) == [tiny_llama.name, "variant"]
    study = json.loads((run / "variant.json").read_text())
    tasks = study["tasks"]
    for task, per_model in report["tasks"].items():
        original, variant = per_model.values()
        want = profile_agreement(original, variant, "mean", 0.2, 100, 0.05, 0)
        assert tasks[task]["spearman"] == want["spearman"]
        assert tasks[task]["jaccard_interval"] == want["jaccard_interval"]
        assert f"| {task} |" in out
    check_the_control(run, report, study, out)
    check_the_nmi(run, report, study, out)
    # the original's weights were linked, not changed: the variant is a new model
    from safetensors.torch import load_file

    before = load_file(str(tiny_llama / "model.safetensors"))
    after = load_file(str(run / "variant" / "model.safetensors"))
    assert any(not (before[k] == after[k]).all() for k in before if k in after)


def check_the_control(run, report, study, table):
    """The control drops block 1 of the original; its profile is compared with the original's on the other blocks."""
    import json

    import numpy as np

    from layerprune.analyze.agreement import per_item, relative_agreement

    original = next(iter(report["tasks"]["arithmetic"].values()))
    block = study["control_block"]
    assert block == 1
    assert json.loads((run / "control-b1" / "config.json").read_text())["num_hidden_layers"] == original["depth"] - 1
    control = json.loads((run / "importance-control-b1" / "importance.json").read_text())
    for task, per_model in report["tasks"].items():
        base, ablated, tokens = per_item(next(iter(per_model.values())), "mean")
        kept = (base, np.delete(ablated, block, axis=0), tokens)
        scored = per_item(next(iter(control["tasks"][task].values())), "mean")
        assert study["tasks"][task]["control"] == relative_agreement(kept, scored, "mean", 0.2, 2, 100, 0.05, 0)
        assert study["tasks"][task]["verdict"]["verdict"] in ("invariant", "different", "not shown")
    assert study["target"]["task"] == "arithmetic" and "## Verdict" in table
    assert f"Control: the original with block {block} dropped" in table


def check_the_nmi(run, report, study, table):
    """Each model's NMI curve, its critical blocks the importance report's on the target task, in the table."""
    import json

    for role, (label, result) in zip(("original", "variant"), report["tasks"]["arithmetic"].items(), strict=True):
        nmi = json.loads((run / f"nmi-{role}" / "nmi.json").read_text())
        assert nmi["model"]["label"] == label and nmi["critical"] == result["critical"]
        assert len(nmi["nmi"]) == result["depth"] + 1 and nmi["config"]["critical_task"] == "arithmetic"
        assert study["nmi"][role]["elbow_block"] == nmi["elbow_block"]
        assert f"| {role} ({label}) | {result['critical']} | {nmi['elbow_block']} |" in table
    assert "## NMI near the critical blocks" in table


def test_posttrain_variant_is_made_once_through_the_cache(capsys, tiny_llama, tmp_path, shared_data, monkeypatch):
    import json

    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({
        "kind": "variant", "method": "sft", "model": "ignored: the study's", "data": {"probes": {"arith_2d_add": 8}},
        "train": {"batch_size": 4, "grad_accum": 1, "max_steps": 1, "learning_rate": 1e-3, "logging_steps": 1}}))
    recipe = {"name": "tiny-posttrain", "model": str(tiny_llama), "output": str(tmp_path / "v"), "resamples": 100,
              "variant": {"posttrain": str(tmp_path / "sft.yaml")}, "splits": 2,
              "importance": {"tasks": ["arithmetic"], "samples": 6, "metric": "accuracy"}}
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml"), "--dry-run"])
    assert code == 0, err
    assert f"variant: posttrain recipe '{tmp_path / 'sft.yaml'}' on {tiny_llama}" in out
    assert "verdict: target none (never invariant)" in out
    code, out, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml")])
    assert code == 0, err
    study = json.loads((tmp_path / "v" / "variant.json").read_text())
    made = Path(study["variant_dir"])
    assert made.parent == tmp_path / "cache" / "variants" and (made / "config.json").is_file()
    verdict = study["tasks"]["arithmetic"]["verdict"]  # a random tiny model scores 0: nothing is defined
    assert verdict["verdict"] == "not shown" and verdict["reasons"][0].startswith("no drops to compare: original: ")
    stamp = (made / "config.json").stat().st_mtime_ns
    code, _, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml"), "--output", str(tmp_path / "w")])
    assert code == 0, err
    assert json.loads((tmp_path / "w" / "variant.json").read_text())["variant_dir"] == str(made)
    assert (made / "config.json").stat().st_mtime_ns == stamp  # not trained again


def test_the_critical_control_block_is_the_largest_drop_on_the_target():
    from layerprune.core.errors import LayerpruneError
    from layerprune.pipeline.studies.variant import control_block
    from layerprune.pipeline.studies.variant_grid import VariantStudy

    study = VariantStudy.model_validate({"name": "s", "variant": {"recipe": "variant-sft-gsm8k"}, "target": "factual",
                                         "importance": {"tasks": ["arithmetic", "factual"]}, "control": {}})
    report = {"tasks": {"arithmetic": {"m": {"drops": [0.9, 0.1, 0.0], "depth": 3}},
                        "factual": {"m": {"drops": [0.1, None, 0.4], "depth": 3}}}}
    assert control_block(study, report) == 2
    report["tasks"]["factual"]["m"]["drops"] = [None, None, None]
    with pytest.raises(LayerpruneError, match="undefined"):
        control_block(study, report)
    study.control.skip_block = 3
    with pytest.raises(LayerpruneError, match="past the original's 3 blocks"):
        control_block(study, report)


def test_a_living_control_drops_the_largest_drop_whose_removal_keeps_the_original_above_the_floor():
    """variant-math-embedded's control (the original without block 0) scored 1e-7 to 6e-4 on every task: a collapsed
    model, whose profile disagrees with anything. 'critical-alive' passes over such blocks."""
    from layerprune.pipeline.studies.variant import control_block
    from layerprune.pipeline.studies.variant_grid import VariantStudy

    study = VariantStudy.model_validate({"name": "s", "variant": {"recipe": "variant-sft-gsm8k"},
                                         "target": "arithmetic", "importance": {"tasks": ["arithmetic", "factual"]},
                                         "control": {}})
    report = {"config": {"min_base_score": 0.05}, "tasks": {
        "arithmetic": {"m": {"drops": [0.99, 0.5, 0.3], "scores": [0.001, 0.2, 0.3], "depth": 3}},
        "factual": {"m": {"drops": [0.9, 0.8, 0.1], "scores": [0.01, 0.01, 0.4], "depth": 3}}}}
    assert control_block(study, report) == 0
    study.control.skip_block = "critical-alive"
    assert control_block(study, report) == 2  # block 1 keeps arithmetic alive but not factual


def test_a_collapsed_control_cannot_show_that_the_comparison_can_fail():
    from layerprune.core.paired import invariance_verdict

    def measure(ratio: float, control: float) -> dict:
        return {"ratio": ratio, "vs_ceiling": {"value": ratio - 1, "low": ratio - 1.03, "high": 0.0},
                "vs_control": {"value": ratio - control, "low": ratio - control - 0.05, "high": ratio - control + 0.05},
                "control_vs_ceiling": {"value": control - 1, "low": control - 1.1, "high": control - 0.9}}

    agree = {"spearman": measure(0.97, 0.05), "jaccard": measure(0.95, 0.3)}
    moved = {"shift": 0.3, "interval": [0.2, 0.4]}
    assert invariance_verdict(moved, agree, True)["verdict"] == "invariant"
    out = invariance_verdict(moved, agree, True, control_undefined="full-model score 1e-07 is below 0.05")
    assert out["verdict"] == "not shown" and "positive control has no drops" in out["reasons"][0]


def test_the_control_may_drop_a_block_prune_protects(tiny_llama, tmp_path):
    """The critical block is often block 0, which prune protects by default: the control names its block itself."""
    import json

    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies.variant import make_control
    from layerprune.pipeline.studies.variant_grid import VariantStudy

    study = VariantStudy.model_validate({"name": "s", "model": str(tiny_llama), "control": {"skip_block": 0},
                                         "variant": {"recipe": "variant-sft-gsm8k"}})
    made = make_control(study, RunSettings(), tmp_path, 0)
    assert made == tmp_path / "control-b0"
    assert json.loads((made / "prune_report.json").read_text())["dropped"] == [0]
    assert json.loads((made / "config.json").read_text())["num_hidden_layers"] == 5


def synthetic(base: list[bool], ablated: list[list[bool]]) -> dict:
    """An accuracy task result as importance.json keeps it (drops relative to the full score, threshold 0.2)."""
    full = sum(base) / len(base)
    drops = [(full - sum(row) / len(row)) / full for row in ablated]
    return {"per_item": {"base_item_correct": base, "ablated_item_correct": ablated}, "base_score": full,
            "drops": drops, "critical": [b for b, d in enumerate(drops) if d > 0.2]}


def test_the_study_verdict_needs_a_move_an_agreement_near_its_ceiling_and_a_control_that_fails():
    from layerprune.pipeline.studies.variant_grid import VariantStudy
    from layerprune.pipeline.studies.variant_report import compare, variant_table

    n = 40

    def profile(right: int) -> dict:  # right answers on the first `right` items; block 1 kills all, block 3 evens
        base = [i < right for i in range(n)]
        return synthetic(base, [base, [False] * n, base, [b and i % 2 == 1 for i, b in enumerate(base)]])

    moved = {"config": {"metric": "accuracy", "threshold": 0.2},
             "tasks": {"arithmetic": {"original": profile(30), "variant": profile(40)}}}
    full = [True] * n  # the control: the original without block 1; now block 0 kills all, block 2 kills evens
    control = (1, {"tasks": {"arithmetic": {"control": synthetic(
        [i < 30 for i in range(n)], [[False] * n, full[:30] + [False] * 10,
                                     [i < 30 and i % 2 == 1 for i in range(n)]])}}})
    study = VariantStudy.model_validate({"name": "s", "variant": {"recipe": "variant-sft-gsm8k"},
                                         "target": "arithmetic", "importance": {"tasks": ["arithmetic"]},
                                         "control": {}, "resamples": 200})
    result = compare(study, moved, 0, control)
    row = result["tasks"]["arithmetic"]
    assert result["target"]["shift"] == pytest.approx(0.25) and result["target"]["interval"][0] > 0
    assert row["relative"]["spearman"]["ratio"] == pytest.approx(1.0)
    assert row["control"]["spearman"]["ratio"] < 0.9
    assert row["verdict"] == {"verdict": "invariant", "reasons": []}
    assert "| arithmetic | 1.00 / 1.00 = 1.00" in variant_table(study, result) and "**invariant**" in \
        variant_table(study, result)
    still = {**moved, "tasks": {"arithmetic": {"original": profile(40), "variant": profile(40)}}}
    assert compare(study, still, 0, control)["tasks"]["arithmetic"]["verdict"]["verdict"] == "not shown"
    assert compare(study, moved, 0, None)["tasks"]["arithmetic"]["verdict"]["reasons"] == ["no positive control"]
    # a variant whose function moved (block 0 kills all, block 1 nothing, as in the control) is "different"
    shuffled = [i < 40 for i in range(n)]
    elsewhere = synthetic(shuffled, [[False] * n, shuffled, [i % 2 == 1 for i in range(n)], shuffled])
    other = compare(study, {**moved, "tasks": {"arithmetic": {"original": profile(30), "variant": elsewhere}}}, 0,
                    control)["tasks"]["arithmetic"]
    assert other["relative"]["spearman"]["ratio"] < 0.9 and other["verdict"]["verdict"] == "different"


def test_shipped_math_variant_study_dry_runs_offline(capsys, shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    code, out, err = run_cli(capsys, ["variant-study", "variant-math-embedded", "--dry-run", "--output",
                                      str(tmp_path / "v")])
    assert code == 0, err
    assert not (tmp_path / "v").exists()
    assert "variant: posttrain recipe 'math-embedded' on embedded (made once, cached by fingerprint)" in out
    assert "control: the original with its most critical block (the largest drop on arith_2d_add) dropped" in out
    assert "verdict: target arith_2d_add; invariant needs a rise >= 10 points" in out
    assert "embedded / arith_2d_add: teacher-forced nll (no generation), 100 items" in out


def test_probe_levels_are_importance_tasks_with_the_probe_gates_items():
    from layerprune.analyze.tasks import task_items
    from layerprune.tasks.probes import generate_probes, probe_tasks

    items = task_items("arith_3d_sub", 5, 0, 1, None)
    probes = generate_probes(probe_tasks()["arith_3d_sub"], 5, 0)
    assert [i.prompt for i in items] == [p.prompt for p in probes]
    assert [i.answer for i in items] == [p.answer.strip() for p in probes] and items[0].target.startswith(" ")


def test_a_study_unpacked_elsewhere_reuses_its_analyses(tmp_path):
    """Paths inside the study's folder compare by their place in it: the run unpacked from its records under another
    folder is the same run; a path that differs there, another seed or another setting is not."""
    import json
    import shutil

    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies.variant import made_alike

    first = tmp_path / "first"
    (first / "importance-control-b0").mkdir(parents=True)
    config = {"models": [str(first / "control-b0")], "samples": 100, "data_dir": None}
    (first / "importance-control-b0" / "importance.json").write_text(json.dumps(
        {"config": config, "run": {"settings": {"seed": 0}}}))
    moved = tmp_path / "elsewhere" / "study"
    shutil.copytree(first, moved)
    done = moved / "importance-control-b0" / "importance.json"
    assert made_alike(done, {**config, "models": [str(moved / "control-b0")]}, RunSettings())
    assert not made_alike(done, {**config, "models": [str(moved / "control-b1")]}, RunSettings())
    assert not made_alike(done, {**config, "models": [str(moved / "control-b0")], "samples": 50}, RunSettings())
    assert not made_alike(done, {**config, "models": [str(moved / "control-b0")]}, RunSettings(seed=1))
    assert not made_alike(moved / "nmi" / "nmi.json", config, RunSettings())
    two = {**config, "models": [str(first / "control-b0"), "/elsewhere/x/control-b1"]}  # made in two places at once
    (moved / "importance-control-b0" / "importance.json").write_text(json.dumps(
        {"config": two, "run": {"settings": {"seed": 0}}}))
    assert not made_alike(done, {**config, "models": [str(moved / "control-b0"), str(moved / "control-b1")]},
                          RunSettings())


# --- the variant made under several seeds (issue 58 part 5) --------------------------------------------------------

def _seeds_study(seeds: list[int]):
    from layerprune.pipeline.studies.variant_grid import VariantStudy

    return VariantStudy.model_validate({"name": "s", "variant": {"posttrain": "math-embedded"}, "target": "arithmetic",
                                        "importance": {"tasks": ["arithmetic"]}, "control": {}, "resamples": 200,
                                        "variant_seeds": seeds})


def _profile(right: int, n: int = 40) -> dict:
    """Right answers on the first `right` items; block 1 kills all, block 3 the even items (as the verdict test's)."""
    base = [i < right for i in range(n)]
    return synthetic(base, [base, [False] * n, base, [b and i % 2 == 1 for i, b in enumerate(base)]])


def _elsewhere(right: int, n: int = 40) -> dict:
    """A variant whose function moved: block 0 kills all, block 1 nothing, block 2 the evens, block 3 nothing."""
    base = [i < right for i in range(n)]
    return synthetic(base, [[False] * n, base, [b and i % 2 == 1 for i, b in enumerate(base)], base])


def _control(n: int = 40) -> tuple[int, dict]:
    full = [True] * n
    return 1, {"tasks": {"arithmetic": {"control": synthetic(
        [i < 30 for i in range(n)], [[False] * n, full[:30] + [False] * 10,
                                     [i < 30 and i % 2 == 1 for i in range(n)]])}}}


def _report(variant: dict) -> dict:
    return {"config": {"metric": "accuracy", "threshold": 0.2},
            "tasks": {"arithmetic": {"original": _profile(30), "variant": variant}}}


def test_makes_that_disagree_widen_the_verdict_intervals_and_the_report_gives_their_spread():
    """Seed 0's make kept the original's profile (alone: 'invariant'), seed 1's moved it (alone: 'different'): as one
    variant the ratio is their mean, its interval draws the makes too, so it is wider than either make's own and the
    verdict is 'not shown'; makes that agree give the one make's interval exactly."""
    from layerprune.pipeline.studies.variant_report import compare, variant_table

    study, control = _seeds_study([0, 1]), _control()
    kept, moved = _report(_profile(40)), _report(_elsewhere(36))
    alone = [compare(_seeds_study([s]), r, 0, control)["tasks"]["arithmetic"] for s, r in ((0, kept), (1, moved))]
    assert [a["verdict"]["verdict"] for a in alone] == ["invariant", "different"]
    result = compare(study, kept, 0, control, {0: kept, 1: moved})
    row = result["tasks"]["arithmetic"]
    assert row["spread"]["values"] == {"0": 1.0, "1": 0.9} and row["spread"]["sd"] == pytest.approx(0.0707, abs=1e-4)
    assert row["base_scores"] == [0.75, pytest.approx(0.95)]
    for measure in ("spearman", "jaccard"):
        ratios = [a["relative"][measure]["ratio"] for a in alone]
        pooled = row["relative"][measure]
        assert pooled["ratio"] == pytest.approx(sum(ratios) / 2) and pooled["ratios"] == {"0": ratios[0],
                                                                                          "1": ratios[1]}
        width = pooled["ratio_interval"][1] - pooled["ratio_interval"][0]
        assert width > 2 * max(b - a for a, b in (x["relative"][measure]["ratio_interval"] for x in alone))
    assert row["verdict"]["verdict"] == "not shown"
    assert [row["seeds"][s]["spearman"] for s in ("0", "1")] == [a["spearman"] for a in alone]
    assert result["target"]["shift"] == pytest.approx((0.25 + 0.15) / 2)
    assert result["target"]["seeds"]["1"]["shift"] == pytest.approx(0.15)
    table = variant_table(study, result)
    assert "## The variant across its seeds" in table and "| arithmetic | 0.75 | 1.00 | 0.90 | 0.95 | 0.07 |" in table
    assert "| arithmetic (seed 1) | 0.75 / 0.90 |" in table and "draws the makes, then the items" in table
    same = compare(study, kept, 0, control, {0: kept, 1: kept})["tasks"]["arithmetic"]
    assert same["relative"]["spearman"]["ratio_interval"] == alone[0]["relative"]["spearman"]["ratio_interval"]
    assert same["spread"]["sd"] == 0.0 and same["verdict"]["verdict"] == "invariant"


def test_one_seed_reads_as_before():
    """The default seed: no new key in variant.json's study (so `layerprune records` fingerprints it as before) and
    the comparison and table of a study without seeds; the archives redraw unchanged (tests/test_records_redraw.py)."""
    from layerprune.pipeline.studies.variant_report import compare, variant_table

    study, control, report = _seeds_study([0]), _control(), _report(_profile(40))
    assert "variant_seeds" not in study.record() and not study.replicated()
    assert _seeds_study([2]).record()["variant_seeds"] == [2]
    assert compare(study, report, 0, control, {0: report}) == compare(study, report, 0, control)
    assert "across its seeds" not in variant_table(study, compare(study, report, 0, control))
    assert study.importance_dir(0) == "importance" and _seeds_study([3, 1]).importance_dir(1) == "importance-seed1"


def test_pooled_draws_of_item_means_match_the_two_level_bootstrap_of_replicates():
    """For an item mean, pooling the makes' item-resampled draws gives `bootstrap`'s interval for a replicated model:
    the same item and replicate draws, the run share estimated from the draws instead of the interaction mean square."""
    import numpy as np

    from layerprune.core.paired import bootstrap, bootstrap_indices, pool_replicate_draws

    rng = np.random.default_rng(5)
    for run_sd in (0.0, 0.08):
        runs = (rng.random((3, 200)) < np.clip(0.5 + rng.normal(0, run_sd, (3, 1)), 0, 1)).astype(float)
        boot = bootstrap([runs], 2000, 0, replicates=[[0, 1, 2]])
        want = boot.interval(lambda m: m[..., 0, 0])
        index = bootstrap_indices(200, 2000, 0)
        value, draws = pool_replicate_draws(list(runs.mean(axis=1)), [r[index].mean(axis=1) for r in runs], 0)
        low, high = np.quantile(draws, [0.025, 0.975])
        assert value == pytest.approx(want["value"])
        assert low == pytest.approx(want["low"], abs=0.01) and high == pytest.approx(want["high"], abs=0.01)
    value, draws = pool_replicate_draws([0.5], [np.arange(4.0)])
    assert value == 0.5 and list(draws) == [0.0, 1.0, 2.0, 3.0]  # one make: its own draws


def test_a_study_of_two_seeds_makes_two_variants_and_scores_each(capsys, tiny_llama, tmp_path, shared_data,
                                                                 monkeypatch):
    import json

    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({
        "kind": "variant", "method": "sft", "model": "ignored: the study's", "data": {"probes": {"arith_2d_add": 8}},
        "train": {"batch_size": 4, "grad_accum": 1, "max_steps": 1, "learning_rate": 1e-2, "logging_steps": 1}}))
    recipe = {"name": "tiny-seeds", "model": str(tiny_llama), "output": str(tmp_path / "v"), "resamples": 100,
              "variant": {"posttrain": str(tmp_path / "sft.yaml")}, "splits": 2, "variant_seeds": [0, 1],
              "importance": {"tasks": ["arithmetic", "factual"], "samples": 6, "metric": "accuracy"}}
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml"), "--dry-run"])
    assert code == 0, err
    assert "variant seeds 0, 1: one make under each (cached by fingerprint); made already: none; to make: 0, 1 " \
           "(2 x " in out and "importance-seed1/" in out
    code, out, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml")])
    assert code == 0, err
    run = tmp_path / "v"
    study = json.loads((run / "variant.json").read_text())
    made = {int(s): Path(p) for s, p in study["variant_dirs"].items()}
    assert sorted(made) == [0, 1] and made[0] != made[1] and study["variant_dir"] == str(made[0])
    assert sorted((tmp_path / "cache" / "variants").iterdir()) == sorted(made.values())
    seeds = [json.loads((made[s] / "variant_report.json").read_text())["settings"]["seed"] for s in (0, 1)]
    assert seeds == [0, 1]
    for folder, variant in (("importance", made[0]), ("importance-seed1", made[1])):
        report = json.loads((run / folder / "importance.json").read_text())
        assert report["config"]["models"] == [str(tiny_llama), str(variant)]
    for task, row in study["tasks"].items():
        assert set(row["spread"]["values"]) == {"0", "1"} and set(row["seeds"]) == {"0", "1"}
        assert f"| {task} (seed 1) |" in out
    assert study["variant_seeds"] == [0, 1] and "## The variant across its seeds" in out
    code, out, err = run_cli(capsys, ["variant-study", str(tmp_path / "v.yaml"), "--dry-run"])
    assert code == 0 and "made already: 0, 1; to make: none (0 x " in out  # found again in the cache


def test_the_shipped_seeds_cell_plans_three_makes(capsys, shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, ["variant-study", "variant-math-accuracy-seeds-embedded", "--dry-run"])
    assert code == 0, err
    assert "variant seeds 0, 1, 2: one make under each (cached by fingerprint); made already: none; to make: 0, 1, " \
           "2 (3 x " in out and " min on 2 idle CPU cores, training only)" in out
    assert "embedded / arith_2d_add: teacher-forced accuracy (no generation), 100 items" in out
