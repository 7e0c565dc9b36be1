"""`layerprune study grain-*`: blocks, attention or MLP sublayers removed at matched savings, before and after one
replicated recovery: the matching rule, the schema, the verdicts (the study can fail), and a tiny study end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from helpers import run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.models.sublayers import Sublayer
from layerprune.pipeline.studies import grain, grain_grid, grain_report
from layerprune.pipeline.studies.sweep_grid import SweepStudy
from layerprune.prune import matched
from test_sweep import _eval_folder
from tiny import tiny_config, tiny_tokenizer


@pytest.fixture(scope="module")
def nas_source(tmp_path_factory) -> Path:
    """A tiny 6-block Llama whose MLP width the Nemotron-NAS layout can carry (a multiple of 256)."""
    root = tmp_path_factory.mktemp("grain") / "source"
    config = tiny_config("llama", 6)
    config.intermediate_size = 256
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tiny_tokenizer().save_pretrained(root)
    return root


def tiny_grain(model: Path | str, output: Path, **fields) -> dict:
    """A tiny grain study (a sweep with `grains`); `compare`, `match`, `tolerance`, `speed_repeats` and `gates` go to
    its grains section, anything else to the recipe."""
    grains = {"compare": ["attention", "mlp"], "tolerance": 0.25,
              **{key: fields.pop(key) for key in ("compare", "match", "tolerance", "speed_repeats", "gates")
                 if key in fields}}
    recipe = {
        "name": "tiny-grain", "model": str(model), "output": str(output), "ratios": [1], "grains": grains,
        "prune": {"drop": 1, "score": "ablation", "calib": "arithmetic", "calib_samples": 4, "calib_seq_len": 64},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "dolly", "samples": 8},
            "generate": {"max_new_tokens": 6, "batch_size": 4, "temperature": 0.0, "drop_truncated": False},
            "train": {"max_steps": 2, "max_tokens": 40, "max_length": 256, "batch_size": 4, "eval_steps": 1,
                      "logging_steps": 1, "save_steps": 4, "held_out": 0.25, "warmup_steps": 0,
                      "gradient_checkpointing": False, "learning_rate": 1e-2},
            "lora": {"r": 4, "alpha": 8}}},
        "arms": {"kd": {"method": "kd"}}, "replicates": 2, "controls": True, "probes": None, "gsm8k_gate": None,
        "classification": ["arc_easy"], "fixed": ["copy_l3"],
        "evaluate": {"suite": "sweep-cpu", "batch_size": "4", "limit": 6, "max_gen_toks": 4},
    }
    return {**recipe, **fields}


def grain_study(model: Path | str, output: Path, **fields) -> SweepStudy:
    return SweepStudy.model_validate(tiny_grain(model, output, **fields))


def test_the_plan_matches_every_grain_to_the_block_arms_savings(nas_source, tmp_path):
    from layerprune.core.settings import RunSettings

    study = grain_study(nas_source, tmp_path / "g")
    sizes = grain.study_sizes(study, RunSettings(device="cpu"))
    order = matched.order_rankings(grain_grid.grain_names(study), 6, [0])
    plan = matched.plan_matched(grain_grid.matching(study), sizes, order)
    # a block: attention 2 x 64^2 + 2 x 64 x 32 + norm = 12,352 parameters; MLP 3 x 64 x 256 + norm = 49,216
    assert plan["block-k1"]["removals"] == [5] and plan["block-k1"]["params_removed"] == 12_352 + 49_216
    assert plan["attention-k1"]["removals"] == [f"{b}.attn" for b in (1, 2, 3, 4, 5)]  # 5 x 12,352: +0.3%
    assert plan["mlp-k1"]["removals"] == ["5.mlp"]  # 49,216: -20%, the nearest
    assert [plan[n]["kv_fraction"] for n in ("block-k1", "attention-k1", "mlp-k1")] == [1 / 6, 5 / 6, 0]
    for name, c in plan.items():
        assert abs(c["gap"]) <= study.grains.tolerance, name
    spec = grain_grid.matching(study)
    wide = matched.plan_matched(dataclasses.replace(spec, levels=[1, 2], grains=["block", "mlp"]), sizes, order)
    assert wide["mlp-k2"]["removals"] == ["3.mlp", "4.mlp", "5.mlp"]  # +19.9% beats -20.1%
    with pytest.raises(LayerpruneError, match=r"cannot match 61,568 params removed within 5%: .* 1 removals"):
        matched.plan_matched(dataclasses.replace(spec, tolerance=0.05), sizes, order)
    with pytest.raises(LayerpruneError, match=r"within 25%: the nearest of 5 candidates, 5 removals"):
        matched.plan_matched(dataclasses.replace(spec, levels=[2]), sizes, order)  # 10 attention: only 5 unprotected


def test_sublayer_rankings_are_prefixes_the_layout_serves(tmp_path):
    from layerprune.models.nas_surgery import removal_refusal

    record = {"grain": "attention", "depth": 3, "protect": [],
              "scores": {"0.attn": -1.0, "1.attn": 0.5, "2.attn": 0.2}}  # 0.attn least important, never servable alone
    grain_grid.score_file(tmp_path, "attention").parent.mkdir()
    grain_grid.score_file(tmp_path, "attention").write_text(json.dumps(record))
    ranked = grain.read_ranking(tmp_path, "attention")
    assert ranked == [Sublayer(2, "attn"), Sublayer(1, "attn")]  # 0.attn: the first kept block's, or the last one
    assert all(removal_refusal(3, ranked[:n]) is None for n in range(1, len(ranked) + 1))
    study = grain_study("x", tmp_path, compare=["attention"],
                                                       prune={"drop": 1, "protect": []})
    assert matched.order_rankings(grain_grid.grain_names(study), 3, [])["attention"] == ranked


def test_a_level_no_servable_prefix_reaches_is_refused_before_any_scoring(capsys, tmp_path):
    """3 blocks whose MLP is twice their attention: one block is matched by all 3 attention sublayers, which the
    layout cannot serve (it keeps one); 2 are 33% short."""
    source = tmp_path / "source"
    config = tiny_config("llama", 3)
    config.intermediate_size = 128
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    recipe = tmp_path / "grain.yaml"
    fields = tiny_grain(source, tmp_path / "study", compare=["attention"], prune={
        "drop": 1, "score": "ablation", "calib": "arithmetic", "calib_samples": 4, "calib_seq_len": 64, "protect": []})
    recipe.write_text(yaml.safe_dump(fields, sort_keys=False))
    code, _, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code != 0 and "cannot match 36,992 params removed within 25%: the nearest of 2 candidates" in err
    assert not (tmp_path / "study").exists()


def test_the_matched_prefix_is_the_nearest_and_the_shorter_on_a_tie():
    from layerprune.prune.target import Cost, ModelSizes

    costs = {Sublayer(b, "attn"): Cost(params=10) for b in range(4)}
    sizes = ModelSizes(Cost(params=100), costs, "float32")
    ranked = [Sublayer(b, "attn") for b in (3, 2, 1, 0)]
    assert matched.matched_prefix(ranked, sizes, 24, "params", 0.5) == ranked[:2]  # 20 beats 30
    assert matched.matched_prefix(ranked, sizes, 25, "params", 0.5) == ranked[:2]  # a tie: the shorter
    assert matched.matched_prefix(ranked, sizes, 29, "params", 0.5) == ranked[:3]
    with pytest.raises(LayerpruneError, match="within 10%"):
        matched.matched_prefix(ranked, sizes, 25, "params", 0.1)


@pytest.mark.parametrize(("fields", "message"), [
    ({"compare": ["attention", "attention"]}, "each once"),
    ({"compare": ["block"]}, "Input should be 'attention' or 'mlp'"),
    ({"match": "kv-cache"}, "an MLP sublayer saves no KV cache"),
    ({"arms": {"local": {"method": "local"}}}, "does not train the kept weights"),
    ({"arms": {"kd": {"method": "kd"}, "sft": {"method": "lora"}}}, "one arm"),
    ({"ratios": [2, 1]}, "increasing order"),
    ({"prune": {"drop": 2, "calib": "arithmetic"}}, "largest ratio"),
    ({"prune": {"drop": 1, "score": "angular"}}, "ranks no sublayers"),
    ({"prune": {"drop": 1, "iterative": True}}, "one one-shot ranking"),
    ({"probes": {"candidates": ["arith_2d_sub"]}}, "the instrument is fixed"),
    ({"lr_grid": {"kd": [1e-3]}}, "at one budget"),
    ({"arm_prompts": {"kd": {"source": "probes:arith_2d_sub"}}}, "at one budget"),
    ({"gsm8k_gate": {}}, "the instrument is fixed"),
    ({"prune": {"drop": 1, "score": "ablation", "granularity": "attention"}}, "no layers, target or granularity"),
    ({"comparisons": {"f": [{"name": "c", "a": "kd", "at": 1}]}}, "comparisons are fixed"),
    ({"run_order": [1, 0]}, "a grain study runs replicate by replicate"),
    ({"classification": [], "fixed": []}, "name the instrument"),
])
def test_the_schema_refuses_what_the_study_cannot_compare(tmp_path, fields, message):
    with pytest.raises(ValidationError, match=message):
        grain_study("x", tmp_path, **fields)


def test_a_grain_study_without_max_steps_or_a_plain_sweep_without_classification_is_refused(tmp_path):
    data = tiny_grain("x", tmp_path)
    del data["recover"]["overrides"]["train"]["max_steps"]
    with pytest.raises(ValidationError, match="set train.max_steps"):
        SweepStudy.model_validate(data)
    plain = {**tiny_grain("x", tmp_path), "classification": []}
    del plain["grains"]
    with pytest.raises(ValidationError, match="name at least one classification task"):
        SweepStudy.model_validate(plain)


def test_a_file_of_the_retired_grain_study_kind_is_told_how_to_write_it(capsys, tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(yaml.safe_dump({"kind": "grain-study", "name": "old", "levels": [1]}))
    code, _, err = run_cli(capsys, ["study", str(recipe), "--dry-run"])
    assert code != 0 and "kind grain-study is gone (issue 56)" in err and "grains: {compare" in err


def test_a_grain_study_scores_its_cells_against_their_own_calibration_and_recovers_the_original_copy(tmp_path):
    """Each evaluation records the calibration items of its cell's pruned model (the original's and the controls':
    the first cell's), each recovery trains its cell's pruned model (the controls: the original, copied at run time),
    and the run checks the data of the instrument only."""
    from layerprune.pipeline.studies import sweep_cells
    from layerprune.pipeline.studies.sweep_grid import instrument

    study = grain_study("x", tmp_path, compare=["attention"])
    grid = {cell.name: cell for cell in sweep_cells.cells(study, tmp_path)}
    first = tmp_path / "pruned" / "block-k1"
    assert grid["eval-baseline"].calibration == first and grid["eval-baseline"].model is None
    assert grid["eval-control@r1"].calibration == first
    assert grid["eval-control@r1"].model == tmp_path / "controls" / "control@r1"
    assert grid["eval-attention-k1@r1"].calibration == tmp_path / "pruned" / "attention-k1"
    assert grid["eval-pruned-attention-k1"].model == tmp_path / "pruned" / "attention-k1"
    assert grid["recover-attention-k1@r1"].model == tmp_path / "pruned" / "attention-k1"
    assert grid["recover-control"].model is None and grid["recover-control@r1"].replicate == 1
    assert instrument(study).evaluate.only == ["arc_easy", "copy_l3"]
    names = list(grid)  # replicate by replicate after the cuts, as a sweep runs: replicate 0 whole before replicate 1
    assert names[5:9] == ["eval-baseline", "recover-control", "eval-control", "eval-pruned-block-k1"]
    replicates = [cell.replicate for cell in grid.values()][:-1]  # the report last
    assert replicates == sorted(replicates) and names.index("recover-control@r1") > names.index("eval-attention-k1")


def _synthetic(root: Path, finer: float, study: SweepStudy, **right: int) -> dict:
    """Eval folders where the original gets 90 of 120 copy items, the pruned block arm 40 and its recoveries 60; the
    attention arm gets `finer` x those scores (`right`: other counts by label, '@' written '_'); the plan and the
    controls alongside."""
    n, rng = 120, np.random.default_rng(0)
    cls = (rng.random(n) < 0.7).astype(float).tolist()

    def scores(right: int) -> list[float]:
        return [1.0] * right + [0.0] * (n - right)

    rows = {"baseline": 90, "control": 89, "control@r1": 91, "pruned-block-k1": 40, "block-k1": 60,
            "block-k1@r1": 62, "pruned-attention-k1": int(40 * finer), "attention-k1": int(60 * finer),
            "attention-k1@r1": int(62 * finer), **{k.replace("_", "-").replace("-r1", "@r1"): v
                                                   for k, v in right.items()}}
    for label, right in rows.items():
        _eval_folder(root / "eval" / label, {"arc_easy": ("classification", cls),
                                             "copy_l3": ("generative", scores(right))})
    plan = {f"{g}-k1": {"grain": g, "level": 1, "removals": [5] if g == "block" else ["5.attn"],
                        "params_fraction": 0.1, "kv_fraction": 0.2, "gap": 0.0} for g in ("block", "attention")}
    (root / grain_grid.PLAN_FILE).write_text(json.dumps({"cells": plan}))
    return grain_report.grain_record(study, root)


@pytest.mark.parametrize(("finer", "verdict"), [(1.5, "costs less"), (0.5, "costs more"), (1.0, "not distinguished")])
def test_the_verdicts_come_from_the_paired_intervals_and_can_falsify_the_claim(tmp_path, finer, verdict):
    study = grain_study("x", tmp_path, compare=["attention"])
    record = _synthetic(tmp_path, finer, study)
    assert {(c["stage"], c["verdict"]) for c in record["comparisons"]} == {("pruned", verdict),
                                                                         ("recovered", verdict)}
    attention = next(c for c in record["cells"] if c["cell"] == "attention-k1")
    for stage in ("pruned", "recovered"):
        score = attention[stage]["score"]
        assert score["low"] <= score["value"] <= score["high"]
    assert attention["recovered"]["spread"]["replicates"] == 2
    assert record["control"]["passed"]
    text = grain_report.format_report(study, record)
    assert "| 1 | attention | recovered |" in text and verdict in text


def test_a_level_without_a_clear_drop_is_uninformative_and_a_moving_control_fails_its_gate(tmp_path):
    study = grain_study("x", tmp_path, compare=["attention"],
                                                       gates={"control_shift": 0.0})
    record = _synthetic(tmp_path, 1.5, study)
    assert record["control"]["passed"]  # 89 and 91 of 120 against 90: no shift shown
    for label in ("control", "control@r1"):
        folder = tmp_path / "eval" / label
        shutil.rmtree(folder)
        _eval_folder(folder, {"arc_easy": ("classification", [1.0] * 120), "copy_l3": ("generative", [1.0] * 120)})
    record = grain_report.grain_record(study, tmp_path)
    assert not record["control"]["passed"]
    assert "FAILED" in grain_report.format_report(study, record)


def test_a_level_whose_block_arm_keeps_the_original_score_is_uninformative(tmp_path):
    study = grain_study("x", tmp_path, compare=["attention"])
    record = _synthetic(tmp_path, 1.5, study, pruned_block_k1=90)  # no drop: the finer arm's +20 items say nothing
    assert record["comparisons"][0]["difference"]["high"] < 0  # the interval alone would call "costs more"
    assert [c["verdict"] for c in record["comparisons"]] == ["uninformative (no clear drop at this level)"] * 2
    assert [c["p_holm"] for c in record["comparisons"]] == [1.0, 1.0]  # in the family, never called


def test_cells_scored_on_different_items_are_refused_in_one_line_before_any_report(tmp_path):
    """attention-k1@r1's copy_l3 record holds two items twice, then other items (doc ids 5..124): refused in one line
    naming the models and the task (issue 56), nothing written. Before: the repeated rows were paired by their last
    record without a word, and another item set ended in another message."""
    study = grain_study("x", tmp_path, compare=["attention"])
    _synthetic(tmp_path, 1.0, study)  # the same items: the report is drawn
    samples = tmp_path / "eval" / "attention-k1@r1" / "samples" / "copy_l3.jsonl"
    lines = samples.read_text().splitlines()
    samples.write_text("\n".join([*lines, *lines[:2]]) + "\n")
    one_line = r"^models scored on different items: baseline and attention-k1@r1 on copy_l3 differ in {} item\(s\)"
    with pytest.raises(LayerpruneError, match=one_line.format(2) + r"[^\n]*$"):
        grain_report.write_grain_report(study, tmp_path)
    shifted = [json.loads(line) for line in lines]
    samples.write_text("".join(json.dumps({**row, "doc_id": row["doc_id"] + 5, "doc_hash": f"d{row['doc_id'] + 5}",
                                           "prompt_hash": f"p{row['doc_id'] + 5}"}) + "\n" for row in shifted))
    with pytest.raises(LayerpruneError, match=one_line.format(10)):
        grain_report.write_grain_report(study, tmp_path)
    assert not any((tmp_path / name).exists() for name in ("grain.md", "grain.json", "grain.png"))


def test_holm_adjusts_in_the_step_down_order():
    assert grain_report.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert grain_report.holm([0.2, 0.01]) == pytest.approx([0.2, 0.02])
    assert grain_report.tail_p(np.array([0.1, 0.2, 0.3, -0.1]), 0.0) == (0.5, "costs less")
    assert grain_report.tail_p(np.array([-0.3, -0.2, -0.2, 0.1]), 0.15) == (0.5, "costs more")


def test_the_family_of_comparisons_is_held_at_five_percent_where_each_alone_would_call(tmp_path):
    """4 of 120 copy items right for the finer arm alone at both stages: each 95% interval lies above 0, but their
    bootstrap p-values (about 0.03 each) are not below 5% / 2 and 5% in Holm's order."""
    study = grain_study("x", tmp_path, compare=["attention"])
    record = _synthetic(tmp_path, 1.0, study, pruned_attention_k1=44, attention_k1=64, attention_k1_r1=64,
                        block_k1_r1=60)  # no run-to-run spread: items alone
    rows = record["comparisons"]
    assert all(r["difference"]["low"] > 0 and r["p"] < 0.05 for r in rows)  # unadjusted: "costs less" twice
    assert record["family"] == {"method": "holm", "comparisons": 2, "alpha": 0.05}
    assert [r["verdict"] for r in rows] == ["not distinguished"] * 2 and min(r["p_holm"] for r in rows) >= 0.05
    assert "Holm's step-down over the family of the 2 planned comparisons" in grain_report.format_report(study,
                                                                                                         record)


@pytest.mark.filterwarnings("ignore:No artists with labels")  # Axes.plot is recorded, not drawn
def test_the_plot_orders_cells_of_equal_savings_and_leaves_out_a_missing_retention(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, xs, ys, *a, **k: drawn.append((xs, ys)))

    def cell(grain: str, value: float | None) -> dict:
        return {"grain": grain, "params_fraction": 0.1, "pruned": {"retention": {"value": value}}}

    record = {"cells": [cell("block", 0.5), cell("attention", 0.6), cell("attention", None)]}
    grain_report.plot_grains(record, tmp_path / "grain.png")
    assert drawn == [([0.0, 10.0], [1.0, 0.5]), ([0.0, 10.0], [1.0, 0.6])]


@pytest.mark.filterwarnings("ignore:No artists with labels")
def test_a_speed_matched_report_plots_and_tabulates_the_measured_speedup(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn, labels = [], []
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, xs, ys, *a, **k: drawn.append((xs, ys)))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel", lambda self, text, *a, **k: labels.append(text))

    def cell(grain: str, speedup: float, fraction: float) -> dict:
        return {"cell": f"{grain}-k3", "grain": grain, "removals": [1], "params_fraction": fraction,
                "kv_fraction": 0.1, "gap": 0.0, "speedup": speedup, "pruned": {"retention": {"value": 0.5}}}

    record = {"match": "speedup", "cells": [cell("block", 1.2, 0.1), cell("attention", 1.19, 0.05)]}
    grain_report.plot_grains(record, tmp_path / "grain.png")
    assert drawn == [([1.0, 1.2], [1.0, 0.5]), ([1.0, 1.19], [1.0, 0.5])] and labels == ["measured speedup (x)"]
    study = grain_study("x", tmp_path, match="speedup")
    text = grain_report.format_report(study, {**record, "baseline": None, "tasks": ["arc_easy"], "comparisons": [],
                                              "family": {"alpha": 0.05, "comparisons": 0}, "control": None})
    assert "| measured speedup |" in text and "| 1.190x |" in text


def test_a_tiny_grain_study_runs_end_to_end_with_two_replicates(capsys, nas_source, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "grain.yaml"
    fields = tiny_grain(nas_source, tmp_path / "study", compare=["attention"])  # mlp: planned above
    recipe.write_text(yaml.safe_dump(fields, sort_keys=False))
    code, out, err = run_cli(capsys, ["study", str(recipe), "--dry-run", "--device", "cpu"])
    assert code == 0, err
    assert "attention-k1: 5 removals" in out and "stages: 21 (" in out and "in order: score-block, " in out
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "study"
    plan = json.loads((root / grain_grid.PLAN_FILE).read_text())["cells"]
    assert {name: len(c["removals"]) for name, c in plan.items()} == {"block-k1": 1, "attention-k1": 5}
    config = json.loads((root / "pruned" / "attention-k1" / "config.json").read_text())
    assert sum(b["attention"].get("no_op", False) for b in config["block_configs"]) == 5
    record = json.loads((root / "grain.json").read_text())
    assert [c["cell"] for c in record["cells"]] == ["block-k1", "attention-k1"]
    for c in record["cells"]:
        for stage in ("pruned", "recovered"):
            score = c[stage]["score"]
            assert score["low"] <= score["value"] <= score["high"], (c["cell"], stage)
        assert c["recovered"]["spread"]["replicates"] == 2
        assert len(c["budget"]) == 2 and all(0 < b["optimizer_steps"] <= 2 and b["learning_rate"] == 1e-2
                                             for b in c["budget"])  # every recovery within the stated budget
    assert {(c["grain"], c["stage"]) for c in record["comparisons"]} == {("attention", "pruned"),
                                                                        ("attention", "recovered")}
    assert record["control"]["spread"]["replicates"] == 2
    later = json.loads((root / "recovered" / "attention-k1@r1" / "recover_report.json").read_text())
    assert later["data"]["generation"]["generated"] == 0  # the teacher answered once for every recovery
    assert (root / "grain.png").is_file() and "## k = 0 control" in (root / "grain.md").read_text()


@pytest.mark.parametrize(("name", "tasks"), [("grain-embedded", "arc_easy, piqa, copy_l7"),
                                           ("grain-math-embedded", "arith_2d_sub, arith_3d_sub, brackets_mix")])
def test_the_shipped_protocol_dry_runs_matched_and_sized(capsys, monkeypatch, tmp_path, name, tasks):
    from layerprune.core.recipe_loading import find_recipe, shipped_command

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kind, _ = find_recipe(name)
    assert kind == "sweep-study" and shipped_command(kind, name).startswith(f"layerprune study {name} ")
    code, out, err = run_cli(capsys, ["study", name, "--dry-run", "--output", str(tmp_path / "s")])
    assert f"evaluation: 3 tasks ({tasks})" in out
    assert code == 0, err
    for level, attention, mlp in ((3, 12, 4), (6, 24, 8)):  # one block = 4 attention = 4/3 MLP sublayers
        assert f"attention-k{level}: {attention} removals" in out and f"mlp-k{level}: {mlp} removals" in out
    assert "models evaluated: 28, each on the instrument" in out and "recoveries: 21; stages: 60 (" in out
    assert "memory plan" in out and not (tmp_path / "s").exists()
    minutes = int(out.rsplit("total about ", 1)[1].split()[0])
    assert minutes <= 90  # sized for the 2-core CPU


def test_the_shipped_speed_protocol_dry_runs_with_its_timing_sized(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli(capsys, ["study", "grain-speed-embedded", "--dry-run", "--output", str(tmp_path / "s")])
    assert code == 0, err
    assert "matched on speedup within 30%" in out and "timed at the plan stage" in out
    assert "block-k3: 3 removals" in out and "predicted speedup 1.086x" in out and "timing 4 min" in out
    assert int(out.rsplit("total about ", 1)[1].split()[0]) <= 90 and not (tmp_path / "s").exists()


def test_more_replicates_resume_the_directory_and_another_protocol_is_refused(tmp_path):
    from layerprune.pipeline.stages import RunPaths, claim_run_dir

    paths = RunPaths(tmp_path / "study")
    study = grain_study("x", paths.root)
    claim_run_dir(paths, study, overwrite=False)
    more = study.model_copy(update={"replicates": 5, "controls": False})
    claim_run_dir(paths, more, overwrite=False)  # only adds stages: the same directory
    other = study.model_copy(update={"grains": study.grains.model_copy(update={"tolerance": 0.5})})
    with pytest.raises(LayerpruneError, match="holds outputs of another recipe"):
        claim_run_dir(paths, other, overwrite=False)


def _speeds(table: dict[int, float], asked: list[int]):
    """A speed function from a table of prefix lengths (blocks and sublayers alike), recording what it timed."""
    def speed(removals: list) -> float:
        asked.append(len(removals))
        return table[len(removals)]
    return speed


def _sizes(count: int):
    from layerprune.prune.target import Cost, ModelSizes

    costs = {Sublayer(b, "attn"): Cost(params=10, flops_per_token=10) for b in range(count)}
    return ModelSizes(Cost(params=1000, flops_per_token=1000), costs, "float32")


def test_the_speed_matched_prefix_is_the_nearest_measured_one_searched_from_the_prediction():
    ranked = [Sublayer(b, "attn") for b in reversed(range(12))]
    sizes = _sizes(12)  # n removals predict 1000 / (1000 - 10 n): 1.042x at 4, 1.053x at 5, 1.075x at 7, 1.087x at 8
    noisy = dict(enumerate([1.01, 1.02, 1.06, 1.05, 1.09, 1.11, 1.12, 1.13, 1.15, 1.16, 1.17, 1.18], 1))
    asked: list[int] = []
    chosen, timed = matched.matched_speed_prefix(ranked, sizes, 1.045, _speeds(noisy, asked), 0.5)
    assert asked == [5, 4, 3, 2]  # from the prediction down while the shorter prefix still reaches 1.045x
    assert chosen == ranked[:4] and timed[4] == 1.05  # the nearest timed, though 3 was timed faster than 4
    asked.clear()
    chosen, _ = matched.matched_speed_prefix(ranked, sizes, 1.085, _speeds(noisy, asked), 0.5)
    assert asked == [8, 7, 6, 5, 4] and chosen == ranked[:5]
    slow = {n: 1 + 0.005 * n for n in range(1, 13)}  # slower than predicted: the search goes up
    asked.clear()
    chosen, _ = matched.matched_speed_prefix(ranked, sizes, 1.03, _speeds(slow, asked), 0.5)
    assert asked == [3, 4, 5, 6] and chosen == ranked[:6]
    with pytest.raises(LayerpruneError, match=r"within 10% of its speed gain: .* 5 removals, measured 1.090x"):
        matched.matched_speed_prefix(ranked, sizes, 1.075, _speeds(noisy, []), 0.1)
    only_all = {1: 1.001, 2: 1.005, 3: 1.015}  # only the whole ranking reaches the goal: it is timed too
    three = [Sublayer(b, "attn") for b in (2, 1, 0)]
    chosen, timed = matched.matched_speed_prefix(three, _sizes(3), 1.015, _speeds(only_all, []), 0.1)
    assert chosen == three and timed[3] == 1.015
    with pytest.raises(LayerpruneError, match="measured 0.990x: no speed gained"):
        matched.matched_speed_prefix(ranked, sizes, 0.99, _speeds(noisy, []), 0.5)


def test_a_speed_matched_plan_times_the_block_arm_and_keeps_every_measurement(nas_source, tmp_path):
    from layerprune.core.settings import RunSettings

    study = grain_study(nas_source, tmp_path / "g", match="speedup", tolerance=0.5)
    sizes = grain.study_sizes(study, RunSettings(device="cpu"))
    order, spec = matched.order_rankings(grain_grid.grain_names(study), 6, [0]), grain_grid.matching(study)
    calls: list[list] = []

    def speed(removals: list) -> float:  # blocks are worth 1.2x each, attention sublayers 1.05x, MLP 1.12x
        calls.append(list(removals))
        per = {int: 0.2, Sublayer: 0.0}[type(removals[0])] or (0.05 if removals[0].part == "attn" else 0.12)
        return 1 + per * len(removals)

    plan = matched.plan_matched(spec, sizes, order, speed)
    assert calls[0] == [5] and plan["block-k1"]["speedup"] == pytest.approx(1.2)
    assert plan["attention-k1"]["removals"] == [f"{b}.attn" for b in (2, 3, 4, 5)]  # 4 x 0.05: exactly 1.2x
    assert plan["mlp-k1"]["removals"] == ["4.mlp", "5.mlp"]  # 1.24x (gap +20%) beats 1.12x (-40%)
    assert plan["mlp-k1"]["gap"] == pytest.approx(0.2) and set(plan["mlp-k1"]["timed"]) == {"1", "2"}
    predicted = matched.plan_matched(spec, sizes, order)  # the dry run's stand-in: the FLOP model
    assert predicted["block-k1"]["speedup"] == pytest.approx(predicted["block-k1"]["predicted_speedup"])
    real, bench = matched.measured_speed(study.model, RunSettings(device="cpu"), 1)
    assert real([5]) > 0 and real([Sublayer(5, "attn")]) > 0  # a block dropped, a sublayer as the layout runs it
    assert bench["clock"] == "cpu" and bench["repeats"] == 1 and bench["device"] == "cpu" and bench["threads"] == 1
    assert bench["new_tokens"] == 32


def test_speed_is_timed_on_one_thread_and_the_thread_count_comes_back(nas_source, monkeypatch):
    from layerprune.core.settings import RunSettings
    from layerprune.models import speed as speed_module

    seen: list[int] = []
    monkeypatch.setattr(speed_module, "measured_speedup", lambda *a: seen.append(torch.get_num_threads()) or
                        {"speedup": 1.1})
    study = grain_study(nas_source, Path("g"), match="speedup")
    speed, _ = matched.measured_speed(study.model, RunSettings(device="cpu"), study.grains.speed_repeats)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert speed([5]) == 1.1 and seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_speed_match_is_its_own_protocol_and_a_params_run_keeps_its_fingerprint(tmp_path):
    from layerprune.pipeline.stages import RunPaths, claim_run_dir

    paths = RunPaths(tmp_path / "study")
    study = grain_study("x", paths.root)
    assert "speed_repeats" not in study.model_dump(exclude_defaults=True)["grains"]
    claim_run_dir(paths, study, overwrite=False)
    speedup = study.grains.model_copy(update={"match": "speedup"})
    with pytest.raises(LayerpruneError, match="holds outputs of another recipe"):
        claim_run_dir(paths, study.model_copy(update={"grains": speedup}), overwrite=False)
