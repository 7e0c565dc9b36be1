"""Honest evaluation: calibration never sees an evaluated item, reports know their noise, bad data fails early."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, run_cli, write_rows
from layerprune.evaluate.project_tasks import probe_config
from layerprune.evaluate.task_specs import TASKS
from layerprune.prune.calib import arithmetic_calib

GSM_TEST = [{"question": f"Tom has {i} apples and buys {i + 2} more at the market. How many now?",
             "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"} for i in range(8)]
GSM_TRAIN = [{"question": f"Ann reads {i} pages a day for a whole week long. How many pages?",
              "answer": f"7 * {i} = {7 * i}\n#### {7 * i}"} for i in range(8)]


@pytest.fixture
def gsm_dir(data_dir: Path) -> Path:
    write_rows(data_dir, "gsm8k", "test", GSM_TEST)
    write_rows(data_dir, "gsm8k", "train", GSM_TRAIN)
    return data_dir


def eval_questions(task: str, seed: int = 0) -> set[str]:
    """The question lines of a probe task's evaluation items (what follows the few-shot prefix)."""
    rows = probe_config(TASKS.get(task), seed)["custom_dataset"]()["test"]
    return {row["prompt"].splitlines()[-1] for row in rows}


# 1. calibration never sees an evaluation item ---------------------------------------------------------------

@pytest.mark.parametrize("seed,count", [(0, 16), (0, 300), (3, 64), (11, 200)])
def test_generated_calibration_never_holds_an_evaluation_probe(seed, count):
    evaluated = set().union(*(eval_questions(t) for t in TASKS.names() if t.startswith("arith_")))
    calib = arithmetic_calib(count, seed, None)
    assert len(calib.items) == count
    lines = {line.rsplit("=", 1)[0] + "=" for item in calib.items for line in item.prompt.splitlines()}
    assert not lines & evaluated  # neither a question nor a few-shot example of calibration is evaluated
    assert len({item.prompt.splitlines()[-1] for item in calib.items}) == count  # distinct questions


def prune_tiny(capsys, model: Path, output: Path, calib: str, data_dir: Path, samples: int = 6) -> dict:
    code, _, err = run_cli(capsys, ["prune", "--model", str(model), "--output", str(output), "--calib", calib,
                                    "--calib-samples", str(samples), "--batch-size", "4", "--drop", "1",
                                    "--data-dir", str(data_dir)])
    assert code == 0, err
    return json.loads((output / "prune_report.json").read_text())


def test_prune_report_lists_items_and_the_auto_fallback(capsys, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    report = prune_tiny(capsys, tiny_llama, tmp_path / "p", "auto", tmp_path / "empty", samples=5)
    calibration = report["calibration"]
    assert "GSM8K train not reachable" in calibration["fallback"]
    assert len(calibration["items"]) == 5
    expected = arithmetic_calib(5, 0, None).items
    assert [(i["prompt"], i["answer"]) for i in calibration["items"]] == [(e.prompt, e.answer) for e in expected]


@pytest.fixture
def leaky_prune(capsys, tiny_llama, tmp_path, gsm_dir) -> Path:
    """A model pruned on a JSONL calibration file that copies 5 GSM8K test questions (and 3 train ones)."""
    rows = [{"prompt": f"Question: {r['question']}\nAnswer:", "answer": " " + r["answer"]}
            for r in GSM_TEST[1:6] + GSM_TRAIN[:3]]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prune_tiny(capsys, tiny_llama, tmp_path / "leaky", str(calib), gsm_dir, samples=8)
    return tmp_path / "leaky"


EVAL_FLAGS = ["--tasks", "gsm8k,arith_1dc", "--limit", "8", "--num-fewshot", "0", "--max-gen-toks", "2"]


def test_evaluating_on_calibration_items_is_refused(capsys, leaky_prune, tiny_llama, tmp_path, gsm_dir):
    common = [*EVAL_FLAGS, "--data-dir", str(gsm_dir), "--cache-dir", str(tmp_path / "c")]
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(leaky_prune), *common, "--output", str(tmp_path / "a")])
    assert_one_line_error(code, err, "gsm8k (5 documents)", "--allow-overlap")
    assert "arith_1dc" not in err
    code, _, err = run_cli(capsys, ["evaluate", "--baseline", str(tiny_llama), "--pruned", str(leaky_prune),
                                    "--model", str(leaky_prune), *common, "--output", str(tmp_path / "b")])
    assert_one_line_error(code, err, "gsm8k (5 documents)")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(leaky_prune), *common, "--limit", "1",
                                    "--output", str(tmp_path / "d")])
    assert code == 0, err  # only the first document is evaluated, and calibration did not copy it
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(leaky_prune), *common, "--allow-overlap",
                                    "--output", str(tmp_path / "e")])
    assert code == 0, err
    recorded = json.loads((tmp_path / "e" / "summary.json").read_text())["calibration_overlap"]
    assert recorded["allowed"] is True and recorded["tasks"] == {"gsm8k": 5}


def test_run_refuses_overlap_before_evaluating(capsys, tiny_llama, tmp_path, gsm_dir):
    rows = [{"text": f"Question: {r['question']}\nAnswer: {r['answer']}"} for r in GSM_TEST[:5]]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"name": "leak", "model": str(tiny_llama), "output": str(tmp_path / "run"), "recover": None,
              "prune": {"drop": 1, "calib": str(calib), "calib_samples": 5, "data_dir": str(gsm_dir)},
              "evaluate": {"tasks": ["gsm8k"], "limit": 8, "num_fewshot": 0, "max_gen_toks": 2,
                           "data_dir": str(gsm_dir)}}
    path = tmp_path / "leak.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = run_cli(capsys, ["run", str(path), "--cache-dir", str(tmp_path / "c")])
    assert_one_line_error(code, err, "gsm8k (5 documents)")
    assert not (tmp_path / "run" / "eval").exists()
    code, _, err = run_cli(capsys, ["run", str(path), "--cache-dir", str(tmp_path / "c"), "--allow-overlap"])
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "eval" / "pruned" / "summary.json").read_text())
    assert summary["calibration_overlap"]["tasks"] == {"gsm8k": 5} and summary["calibration_overlap"]["allowed"]


# 4. reports that know their noise and their settings ----------------------------------------------------------

def summary_of(values: dict[str, tuple[float, float]], **settings):  # noqa: ANN201 (a Summary)
    from layerprune.evaluate import Summary, TaskResult

    kinds = {"arc_easy": "classification", "piqa": "classification", "boolq": "classification",
             "arith_1dc": "generative", "brackets_d5": "generative"}
    rows = [TaskResult(task=t, kind=kinds[t], metric="acc", value=v, stderr=se, n=300, headline=True,
                       settings={"limit": 300, **settings.get(t, {})}, seconds=1.0) for t, (v, se) in values.items()]
    return Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash="h", results=rows)


def test_comparison_marks_noise_and_shows_retention_only_for_a_clear_drop(tmp_path):
    from layerprune.evaluate import compare

    summaries = {"baseline": summary_of({"arc_easy": (0.500, 0.029), "piqa": (0.600, 0.028),
                                         "arith_1dc": (0.30, 0.03)}),
                 "pruned": summary_of({"arc_easy": (0.499, 0.029), "piqa": (0.640, 0.028), "arith_1dc": (0.05, 0.01)}),
                 "recovered": summary_of({"arc_easy": (0.530, 0.029), "piqa": (0.62, 0.028), "arith_1dc": (0.1, 0.02)})}
    report = compare(summaries, tmp_path / "r")
    rows = {r["task"]: r for r in report["rows"]}
    # a 0.001 drop and a gain are noise: no retention, no recovered share (were 3100% and -150%)
    for task in ("arc_easy", "piqa"):
        assert rows[task]["recovered_share"] is None and rows[task]["retention_pruned"] is None
        assert rows[task]["pruned_vs_baseline"]["within_noise"] is True
    assert rows["arith_1dc"]["retention_pruned"] == pytest.approx(0.05 / 0.30)
    assert rows["arith_1dc"]["recovered_share"] == pytest.approx(0.05 / 0.25)
    assert rows["arith_1dc"]["pruned_vs_baseline"]["se"] == pytest.approx((0.03 ** 2 + 0.01 ** 2) ** 0.5)
    line = next(row for row in report["table"].splitlines() if row.startswith("| arc_easy "))
    assert "0.5000 ± 0.0290" in line and "(within noise)" in line and "n/a (no clear drop)" in line
    assert "3100" not in report["table"] and "-150" not in report["table"]
    cls = report["averages"][0]
    assert cls["baseline_stderr"] == pytest.approx((0.029 ** 2 + 0.028 ** 2) ** 0.5 / 2)
    saved = json.loads((tmp_path / "r" / "comparison.json").read_text())
    assert saved["rows"][0]["baseline_stderr"] == 0.029 and "within noise" in saved["noise_rule"]
    assert "within noise" in (tmp_path / "r" / "comparison.md").read_text()


def test_roles_evaluated_with_different_settings_are_marked_and_left_out_of_averages():
    from layerprune.evaluate import compare

    values = {"arc_easy": (0.7, 0.02), "piqa": (0.6, 0.02)}
    summaries = {"baseline": summary_of(values), "pruned": summary_of(
        {"arc_easy": (0.5, 0.02), "piqa": (0.5, 0.02)}, piqa={"limit": 50, "num_fewshot": 5})}
    report = compare(summaries)
    piqa = next(r for r in report["rows"] if r["task"] == "piqa")
    assert set(piqa["settings_differ"]) == {"limit", "num_fewshot"} and piqa["retention_pruned"] is None
    assert any("piqa was evaluated with different limit" in w for w in report["warnings"])
    assert report["table"].startswith("**WARNING: piqa")
    assert "**piqa (SETTINGS DIFFER)**" in report["table"]
    assert report["averages"][0]["task"] == "average (classification, 1 tasks)"
    assert report["averages"][0]["baseline"] == pytest.approx(0.7)


def test_cache_key_follows_data_content_and_layerprune_version(tmp_path, monkeypatch):
    from layerprune.core.settings import RunSettings
    from layerprune.evaluate import cache
    from layerprune.evaluate.cache import task_settings
    from layerprune.evaluate.schema import EvalSettings
    from layerprune.evaluate.suites import PlannedTask

    write_rows(tmp_path, "gsm8k", "test", GSM_TEST)
    task, settings = PlannedTask(TASKS.get("gsm8k"), 4, 0, 8), EvalSettings(data_dir=tmp_path)
    before = task_settings(task, settings, RunSettings(), False)
    fixed = [dict(r, answer=r["answer"].replace("#### 2", "#### 3")) for r in GSM_TEST]  # same size, other gold
    write_rows(tmp_path, "gsm8k", "test", fixed)
    assert (tmp_path / "gsm8k" / "test.jsonl").stat().st_size == len("".join(json.dumps(r) + "\n" for r in GSM_TEST))
    after = task_settings(task, settings, RunSettings(), False)
    assert before["data"] != after["data"]
    monkeypatch.setattr(cache, "__version__", "9.9.9")
    assert task_settings(task, settings, RunSettings(), False) != after


def test_probe_questions_are_distinct_and_few_where_the_family_is_small():
    for task, distinct in (("brackets_d2", 9), ("brackets_d3", 27), ("brackets_d4", 81), ("arith_2d_add", 500)):
        rows = probe_config(TASKS.get(task), 0)["custom_dataset"]()["test"]
        questions = [row["prompt"].splitlines()[-2:] for row in rows]
        assert len(rows) == distinct and len({tuple(q) for q in questions}) == distinct, task


def test_run_report_verdict_speaks_of_noise_not_ratios_of_noise():
    from layerprune.evaluate import compare
    from layerprune.pipeline.report import verdict

    base = {"arc_easy": (0.50, 0.03), "piqa": (0.60, 0.03), "arith_1dc": (0.30, 0.03), "brackets_d5": (0.20, 0.03)}
    pruned = {"arc_easy": (0.52, 0.03), "piqa": (0.59, 0.03), "arith_1dc": (0.02, 0.01), "brackets_d5": (0.01, 0.01)}
    recovered = {"arc_easy": (0.51, 0.03), "piqa": (0.60, 0.03), "arith_1dc": (0.03, 0.01), "brackets_d5": (0.02, 0.01)}
    averages = compare({"baseline": summary_of(base), "pruned": summary_of(pruned),
                        "recovered": summary_of(recovered)})["averages"]
    pruning, recovery = verdict(averages)
    assert "classification shows no clear drop" in pruning and "suffered more, as the study describes" in pruning
    assert "generative -" not in recovery and "generative +0.010" in recovery and "within noise" in recovery
    flat = {t: (v, se) for t, (v, se) in base.items()}
    averages = compare({"baseline": summary_of(base), "pruned": summary_of(flat)})["averages"]
    assert "did NOT drop clearly" in verdict(averages)[0]


# the demo shows its contrast with paired intervals, in under 25 minutes ------------------------------------------

UNPLANNED_S = 120 + 208 + 21 + 30  # not in the sweep's plan: installs, prune (ablation over 30 blocks), report, GGUF


def demo_plan_seconds(planned: list, recover) -> dict[str, float]:
    """The demo's stages at the measured 2-core rates, planned as the sweep's dry run plans them (sweep.RATES and
    its training plan): three evaluations of the planned items, the teacher's answers, the recovery's tokens."""
    from layerprune.pipeline.studies.cells import RATES
    from layerprune.pipeline.studies.recovery_plan import training as _training

    docs = {kind: sum(t.limit for t in planned if t.spec.kind == kind) for kind in ("classification", "generative")}
    trained, _, rate = _training(recover)
    return {"evaluation": 3 * (docs["classification"] / RATES["classification docs/s"]
                               + docs["generative"] / RATES["probe items/s"]),
            "teacher answers": recover.prompts.samples * recover.generate.max_new_tokens / RATES["teacher tokens/s"],
            "training": trained / rate}


def test_demo_recipe_is_the_local_sweeps_clearest_point_and_fits_in_25_minutes(shared_data):
    """The demo is the local sweep's k = 3 point: its cut, its recovery (the transfer study's best arm, local) and its
    instrument (same tasks and item counts); its planned work (the items it scores, the answers it generates, the
    tokens it trains on), at the rates the sweep's dry run plans with, fits 25 minutes with the unplanned stages."""
    from layerprune.evaluate.suites import plan_tasks
    from layerprune.pipeline.plan import load_run_recipe
    from layerprune.pipeline.studies.sweep_grid import SweepStudy

    recipe = load_run_recipe("recipes/demo.yaml")
    sweep = SweepStudy.load("limits-sweep-local-embedded")
    assert recipe.prune.drop in sweep.ratios and recipe.prune.model_dump(exclude={"drop"}) == sweep.prune.model_dump(
        exclude={"drop"})
    assert recipe.recover.overrides == sweep.recover["overrides"]
    planned, skipped = plan_tasks(recipe.evaluate, shared_data)
    assert not skipped
    for task in planned:
        if task.spec.kind == "classification":
            assert task.spec.name in sweep.classification and task.limit >= 200, task.spec.name
        else:
            assert task.spec.source == "probe" and task.limit >= 300, task.spec.name
    assert {t.spec.kind for t in planned} == {"classification", "generative"}
    resolved = recipe.recover.resolve("<pruned>", recipe.model)
    assert resolved.method == "local"
    seconds = demo_plan_seconds(planned, resolved)
    assert all(v > 0 for v in seconds.values()) and sum(seconds.values()) + UNPLANNED_S < 25 * 60, seconds
    # the same plan with twice the teacher's answers and twice the items scored would not fit
    doubled = resolved.model_copy(update={"prompts": resolved.prompts.model_copy(
        update={"samples": 2 * resolved.prompts.samples})})
    twice = [dataclasses.replace(task, limit=2 * task.limit) for task in planned]
    assert sum(demo_plan_seconds(twice, doubled).values()) + UNPLANNED_S > 25 * 60


def test_demo_math_is_the_math_sweeps_k2_local_point_and_fits_in_25_minutes_once_the_variant_is_made(shared_data):
    """demo-math is limits-sweep-math-dolly-embedded's k = 2 point recovered by its local-dolly arm (the same cut and
    recovery; the sweep's tasks, on more items), on the variant, and scores 2-digit subtraction beside classification;
    its planned work
    fits 25 minutes like the demo's, the variant's make (16-21 minutes, cached) aside."""
    from layerprune.evaluate.suites import plan_tasks
    from layerprune.pipeline.plan import load_run_recipe
    from layerprune.pipeline.studies.sweep_grid import SweepStudy

    recipe = load_run_recipe("recipes/demo-math.yaml")
    sweep = SweepStudy.load("limits-sweep-math-dolly-embedded")
    assert recipe.model == sweep.model == "variant:math-embedded" and recipe.prune.drop == sweep.ratios[0]
    assert recipe.prune.model_dump(exclude={"drop"}) == sweep.prune.model_dump(exclude={"drop"})
    resolved = recipe.recover.resolve("<pruned>", recipe.model)
    assert resolved.model_dump(exclude={"name"}) == sweep.arm_recipe("local-dolly", "<pruned>").model_dump(
        exclude={"name"})
    planned, skipped = plan_tasks(recipe.evaluate, shared_data)
    assert not skipped
    assert {t.spec.name: t.limit for t in planned} == {"arc_easy": 200, "piqa": 200, "arith_2d_sub": 500}
    assert {t.spec.name for t in planned} <= set(sweep.classification) | set(sweep.probes.candidates)
    seconds = demo_plan_seconds(planned, resolved)
    assert sum(seconds.values()) + UNPLANNED_S < 25 * 60, seconds


def test_overlap_finds_copied_probe_items_and_not_longer_numbers():
    from layerprune.evaluate.overlap import contains, count_overlap, evaluated_rows
    from layerprune.evaluate.schema import EvalSettings
    from layerprune.evaluate.suites import PlannedTask

    task = PlannedTask(TASKS.get("arith_1dc"), 16, 0, None)
    rows = probe_config(TASKS.get("arith_1dc"), 0)["custom_dataset"]()["test"]
    docs = evaluated_rows(task, EvalSettings(), None)
    assert len(docs) == 16
    assert count_overlap(docs, [rows[i]["prompt"] + rows[i]["answer"] for i in range(10, 40)]) == 6
    assert contains("x 12 + 3 = 15", "12 + 3 =") and not contains("112 + 3 = 115", "12 + 3 =")


# 5. bad data, found before any model loads ----------------------------------------------------------------

NO_MODEL = "/nonexistent/model"  # planning must fail on the data before this is even looked at


def arc_rows(n: int) -> list[dict]:
    return [{"id": f"q{i}", "question": f"What is {i} plus one, said plainly?", "answerKey": "A",
             "choices": {"text": [str(i + 1), "blue"], "label": ["A", "B"]}} for i in range(n)]


def evaluate_err(capsys, tmp_path, data: Path, *argv: str) -> tuple[int, str]:
    code, _, err = run_cli(capsys, ["evaluate", "--model", NO_MODEL, "--data-dir", str(data),
                                    "--output", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()
    return code, err


def test_empty_and_malformed_data_files_fail_at_planning(capsys, tmp_path):
    data = tmp_path / "data"
    write_rows(data, "arc_easy", "test", [])
    code, err = evaluate_err(capsys, tmp_path, data, "--tasks", "arith_1dc,arc_easy")
    assert_one_line_error(code, err, "arc_easy/test.jsonl is empty")
    write_rows(data, "arc_easy", "test", arc_rows(4))
    path = data / "arc_easy" / "test.jsonl"
    path.write_text(path.read_text().replace('{"id": "q2"', '{"id": q2', 1))
    code, err = evaluate_err(capsys, tmp_path, data, "--tasks", "arith_1dc,arc_easy")
    assert_one_line_error(code, err, "test.jsonl:3: not valid JSON")


def test_default_fewshot_pool_smaller_than_k(capsys, tmp_path):
    data = tmp_path / "data"
    write_rows(data, "gsm8k", "test", GSM_TEST)
    write_rows(data, "gsm8k", "train", GSM_TRAIN[:3])  # lm-eval's gsm8k takes 5 examples from train
    code, err = evaluate_err(capsys, tmp_path, data, "--tasks", "gsm8k")
    assert_one_line_error(code, err, "--num-fewshot 5 is larger than the few-shot pool of 'gsm8k'", "3 examples")


def test_safetensors_header_that_is_json_but_not_an_object(capsys, tiny_llama, tmp_path):
    import shutil
    import struct

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    for header in (b"[1, 2]", b'{"w": 5}'):
        (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
        code, _, err = run_cli(capsys, ["prune", "--model", str(model), "--drop", "1", "--score", "last",
                                        "--output", str(tmp_path / "out")])
        assert_one_line_error(code, err, "corrupt safetensors file")
    assert not (tmp_path / "out").exists()


def test_triviaqa_needs_only_the_split_it_scores(tmp_path, monkeypatch):
    from layerprune.core.errors import LayerpruneError
    from layerprune.evaluate.offline import lm_eval_config
    from layerprune.evaluate.schema import EvalSettings
    from layerprune.evaluate.suites import plan_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(LayerpruneError, match="triviaqa/validation.jsonl"):
        plan_tasks(EvalSettings(tasks=["triviaqa"]), data)
    write_rows(data, "triviaqa", "validation", [{"question": "Who wrote the play Hamlet, in English?",
                                                  "answer": {"aliases": ["Shakespeare"], "value": "Shakespeare"}}])
    planned, _ = plan_tasks(EvalSettings(tasks=["triviaqa"]), data)
    assert planned[0].spec.name == "triviaqa"
    config = lm_eval_config(planned[0].spec, data)
    assert set(config["dataset_kwargs"]["data_files"]) == {"validation"} and config["training_split"] is None


def test_bad_calibration_file_fails_before_the_model_loads(capsys, tiny_llama, tmp_path, monkeypatch):
    from layerprune.prune import in_memory as api

    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"text": "fine"}\n{"text": broken}\n')
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded before the data was read"))
    code, _, err = run_cli(capsys, ["prune", "--model", str(tiny_llama), "--drop", "1", "--calib", str(calib),
                                    "--output", str(tmp_path / "out")])
    assert_one_line_error(code, err, "calib.jsonl:2: not valid JSON")


def test_run_checks_every_data_file_before_its_first_stage(capsys, tiny_llama, tmp_path, gsm_dir, monkeypatch):
    from layerprune.prune import in_memory as api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("a stage started before the data was checked"))
    write_rows(gsm_dir, "arc_easy", "test", [])
    recipe = {"name": "bad", "model": str(tiny_llama), "output": str(tmp_path / "run"), "recover": None,
              "prune": {"drop": 1, "calib": "gsm8k", "calib_samples": 4, "data_dir": str(gsm_dir)},
              "evaluate": {"tasks": ["gsm8k", "arc_easy"], "limit": 4, "data_dir": str(gsm_dir)}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = run_cli(capsys, ["run", str(path)])
    assert_one_line_error(code, err, "arc_easy/test.jsonl is empty")
    assert not (tmp_path / "run").exists()


def test_a_gguf_exported_from_a_pruned_directory_answers_for_its_calibration(leaky_prune, tmp_path, gsm_dir):
    """`evaluate --backend llamacpp` on an export: the overlap check follows the file's export record back to the
    directory whose calibration chose the blocks."""
    from layerprune.core.errors import LayerpruneError
    from layerprune.evaluate.overlap import calibration_overlap, recorded_calibration
    from layerprune.evaluate.schema import EvalSettings
    from layerprune.evaluate.suites import plan_tasks

    exported = tmp_path / "leaky.q8_0.gguf"
    exported.write_bytes(b"GGUF")
    assert recorded_calibration(exported) is None  # no export record: nothing known of it
    exported.with_suffix(".export.json").write_text(json.dumps({"model": str(leaky_prune), "outtype": "q8_0"}))
    assert recorded_calibration(exported)[0] == leaky_prune / "prune_report.json"
    settings = EvalSettings(tasks=["gsm8k"], limit=8, num_fewshot=0, data_dir=gsm_dir)
    with pytest.raises(LayerpruneError, match=r"gsm8k \(5 documents\)"):
        calibration_overlap(plan_tasks(settings, gsm_dir)[0], settings, gsm_dir, exported)
