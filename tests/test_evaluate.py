"""`evaluate`: suites, offline mapping, bad inputs, caching and the comparison report (tiny models, dummy LM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import evaluate_cli, write_rows
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.evaluate import EvalSettings, Summary, TaskResult, compare, load_suites, plan_tasks
from layerprune.evaluate.handle import ModelHandle, applies_chat
from layerprune.evaluate.offline import lm_eval_config, write_task_yaml
from layerprune.evaluate.project_tasks import probe_config, score_exact
from layerprune.evaluate.runner import evaluate_task
from layerprune.evaluate.suites import PlannedTask
from layerprune.evaluate.task_specs import TASKS

ARC_ROWS = [{"id": f"q{i}", "question": f"What is {i} plus one?",
             "choices": {"text": [str(i + 1), str(i + 5), "blue", "seven"], "label": ["A", "B", "C", "D"]},
             "answerKey": "A"} for i in range(6)]
ARC_TRAIN = [{**row, "id": f"t{i}", "question": f"Train question {i}?"} for i, row in enumerate(ARC_ROWS)]
GSM_ROWS = [{"question": f"Tom has {i} apples and buys 2 more. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
            for i in range(6)]


@pytest.fixture
def data_dir(data_dir: Path) -> Path:
    write_rows(data_dir, "arc_easy", "test", ARC_ROWS)
    write_rows(data_dir, "arc_easy", "train", ARC_TRAIN)
    write_rows(data_dir, "gsm8k", "train", GSM_ROWS)
    write_rows(data_dir, "gsm8k", "test", GSM_ROWS)
    return data_dir


# suites and names ---------------------------------------------------------------------------------------

def known_to_lm_eval_or_runnable(planned: PlannedTask, data_dir: Path) -> None:
    """The task is what lm-eval's own task index calls by its name, a probe that generates items, or our
    protocol over files that are in the mirror; every file the plan reads is there."""
    from layerprune.evaluate.lm_eval_index import index_entry
    from layerprune.evaluate.offline import lm_eval_tasks_dir, needed_splits
    from layerprune.tasks.probes import generate_probes

    spec = planned.spec
    if spec.source == "lm_eval":
        entry = index_entry(spec.name, None)
        assert entry is not None and entry.yaml_path is not None, spec.name
        where = Path(entry.yaml_path).relative_to(lm_eval_tasks_dir())
        assert spec.lm_eval_yaml in (str(where), str(where.parent)), (spec.name, where)
    if spec.source == "probe":
        items = generate_probes(spec.probe, 2, seed=0)
        assert len(items) == 2 and all(item.prompt and item.answer for item in items), spec.name
    if spec.dataset is not None:
        for split in needed_splits(spec, planned.fewshot_pool):
            assert (data_dir / spec.dataset / f"{split}.jsonl").is_file(), (spec.name, split)


def test_every_suite_expands_to_known_tasks(shared_data):
    from layerprune.evaluate.offline import needed_splits
    from layerprune.evaluate.suites import expand

    for name in load_suites():  # paper's 5 shots: hellaswag, piqa, winogrande and boolq lack their pool offline
        leaves = {task for task, _ in expand(name)}
        try:
            planned, skipped = plan_tasks(EvalSettings(suite=name, fewshot_from_eval_split=True), shared_data)
        except LayerpruneError as exc:  # factual: triviaqa is not in the mirror
            assert "nothing to evaluate" in str(exc) and name == "factual", exc
            planned, skipped = [], dict.fromkeys(leaves, "")
        assert {t.spec.name for t in planned} | set(skipped) == leaves, name  # nothing dropped silently
        for task in skipped:  # optional, and a file it needs is really not in the mirror
            spec = TASKS.get(task)
            files = [shared_data / spec.dataset / f"{split}.jsonl" for split in needed_splits(spec)]
            assert spec.optional and not all(f.is_file() for f in files), task
        for task in planned:
            known_to_lm_eval_or_runnable(task, shared_data)
    assert set(load_suites()) >= {"classification", "reasoning", "algorithmic", "factual", "quick", "paper"}


def test_quick_covers_classification_and_reasoning_with_limits(shared_data):
    planned, _ = plan_tasks(EvalSettings(suite="quick"), shared_data)
    names = {t.spec.name for t in planned}
    assert {"arc_easy", "boolq", "gsm8k", "humaneval_plus", "arith_1dc", "arith_5d_mul", "brackets_d8"} <= names
    assert all(t.limit is not None and t.limit <= 40 for t in planned)


def test_paper_protocol_settings(shared_data):
    with pytest.raises(LayerpruneError, match="hellaswag/train.jsonl is missing"):
        plan_tasks(EvalSettings(suite="paper"), shared_data)
    planned = {t.spec.name: t for t in plan_tasks(EvalSettings(suite="paper", fewshot_from_eval_split=True),
                                                   shared_data)[0]}
    assert (planned["arc_easy"].num_fewshot, planned["arc_easy"].limit) == (5, 0.2)
    assert (planned["arc_easy"].fewshot_pool, planned["hellaswag"].fewshot_pool) == ("train", "validation")
    assert planned["gsm8k"].num_fewshot == 0 and planned["gsm8k"].limit is None


def test_cli_flag_beats_suite(shared_data):
    planned = plan_tasks(EvalSettings(suite="quick", limit=3), shared_data)[0]
    assert {t.limit for t in planned} == {3}


def test_list(capsys):
    code, out, _ = evaluate_cli(capsys, "--list")
    assert code == 0 and "quick" in out and "brackets_d8" in out and "arith_1dc" in out


def test_factual_without_data_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayerpruneError, match="triviaqa"):
        plan_tasks(EvalSettings(suite="factual"), tmp_path / "empty")


@pytest.mark.parametrize("argv, expected", [
    (["--tasks", "arc_esay"], "did you mean: arc_easy"),
    (["--suite", "quik"], "did you mean: quick"),
    (["--tasks", "reasoning"], "is a suite; use --suite reasoning"),
    (["--limit", "0"], "--limit must be above 0"),
    (["--limit", "-3"], "--limit must be above 0"),
    (["--batch-size", "zero"], "--batch-size"),
])
def test_bad_input_is_one_line(capsys, tmp_path, tiny_llama, argv, expected):
    out = tmp_path / "out"
    code, _, err = evaluate_cli(capsys, "--model", str(tiny_llama), "--output", str(out), *argv)
    assert code == 2 and expected in err and err.count("\n") == 1
    assert not out.exists()


def test_num_fewshot_larger_than_pool(capsys, tmp_path, tiny_llama, data_dir):
    write_rows(data_dir, "arc_easy", "train", ARC_ROWS[:5])
    code, _, err = evaluate_cli(capsys, "--model", str(tiny_llama), "--tasks", "arc_easy", "--num-fewshot", "6",
                                "--data-dir", str(data_dir), "--output", str(tmp_path / "o"))
    assert code == 2 and "few-shot pool" in err and "5 examples" in err


def test_missing_data_names_dataset_and_path(capsys, tmp_path, tiny_llama, data_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code, _, err = evaluate_cli(capsys, "--model", str(tiny_llama), "--tasks", "piqa", "--data-dir", str(data_dir),
                                "--output", str(tmp_path / "o"))
    assert code == 2 and "piqa" in err and str(data_dir / "piqa" / "validation.jsonl") in err


def test_model_without_tokenizer_files(capsys, tmp_path, tiny_llama, data_dir):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    code, _, err = evaluate_cli(capsys, "--model", str(bare), "--tasks", "arith_1dc", "--limit", "1",
                                "--output", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"))
    assert code == 2 and "no tokenizer files" in err


def test_existing_output_is_not_overwritten(capsys, tmp_path, tiny_llama):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    code, _, err = evaluate_cli(capsys, "--model", str(tiny_llama), "--tasks", "arith_1dc", "--output", str(out))
    assert code == 2 and "already exists" in err and (out / "keep").read_text() == "x"


# offline mapping ----------------------------------------------------------------------------------------

def test_offline_mapping_keeps_prompts_and_swaps_data(data_dir):
    from lm_eval.tasks import TaskManager

    config = lm_eval_config(TASKS.get("arc_easy"), data_dir)
    assert config["dataset_path"] == "json" and config["dataset_name"] is None
    assert config["dataset_kwargs"]["data_files"] == {"test": str((data_dir / "arc_easy" / "test.jsonl").resolve())}
    assert config["doc_to_text"] == "Question: {{question}}\nAnswer:" and config["training_split"] is None
    task = TaskManager(include_defaults=False).load([config])["tasks"]["arc_easy"]
    docs = list(task.test_docs())
    assert len(docs) == 6 and task.doc_to_text(docs[0]) == "Question: What is 0 plus one?\nAnswer:"
    assert task.doc_to_target(docs[0]) == 0


def test_task_yaml_for_lm_eval_cli_matches(data_dir, tmp_path):
    from lm_eval.tasks import TaskManager

    write_task_yaml(TASKS.get("gsm8k"), data_dir, tmp_path / "yaml")
    manager = TaskManager(include_defaults=False, include_path=str(tmp_path / "yaml"))
    task = manager.load(["gsm8k"])["tasks"]["gsm8k"]
    ours = TaskManager(include_defaults=False).load([lm_eval_config(TASKS.get("gsm8k"), data_dir)])["tasks"]["gsm8k"]
    assert task.config.dataset_kwargs == ours.config.dataset_kwargs
    assert task.config.filter_list == ours.config.filter_list and len(list(task.test_docs())) == 6


def test_probe_tasks_are_deterministic():
    spec = TASKS.get("brackets_d4")
    rows = probe_config(spec, 0)["custom_dataset"]()["test"]
    assert rows[0] == probe_config(spec, 0)["custom_dataset"]()["test"][0]
    assert rows[0] != probe_config(spec, 1)["custom_dataset"]()["test"][0]
    assert score_exact({"answer": " } ] )"}, [" } ] ) "]) == {"exact_match": 1.0}
    assert score_exact({"answer": " 42"}, [" 41"]) == {"exact_match": 0.0}


def test_distinct_items_is_what_a_bracket_task_can_give():
    from layerprune.tasks.probes import distinct_items, generate_probes, probe_tasks

    for task in ("brackets_d2", "brackets_d3"):
        assert len(generate_probes(probe_tasks()[task], 100, 0)) == distinct_items(task) < 100
    assert distinct_items("arith_2d_add") is None and distinct_items("gsm8k") is None


def test_chat_template_rule():
    gsm, arc = (PlannedTask(TASKS.get(n), None, None, None) for n in ("gsm8k", "arc_easy"))
    assert applies_chat(gsm, "auto", True) and not applies_chat(arc, "auto", True)
    assert applies_chat(arc, "on", True) and not applies_chat(gsm, "off", True)
    assert not applies_chat(gsm, "on", False)


# runs with lm-eval's dummy model and with tiny models ---------------------------------------------------

def test_dummy_lm_results_are_summarized_and_cached(tmp_path, data_dir, tiny_llama, monkeypatch):
    from lm_eval.models.dummy import DummyLM
    from transformers import AutoTokenizer

    from layerprune.evaluate import runner
    from layerprune.models import resolve_model

    dummy = DummyLM()
    dummy.__dict__["tokenizer"] = AutoTokenizer.from_pretrained(tiny_llama)  # its default is a hub tokenizer
    handle = ModelHandle(resolve_model(str(tiny_llama)), RunSettings(), lm=dummy, digest="d" * 64)
    task = PlannedTask(TASKS.get("gsm8k"), 4, 2, 8)
    settings = EvalSettings(data_dir=data_dir)
    entry = evaluate_task(handle, task, settings, False, data_dir, tmp_path / "cache")
    metrics = [r["metric"] for r in entry["rows"]]
    assert metrics == ["exact_match,strict-match", "exact_match,flexible-extract"]
    assert entry["rows"][0]["n"] == 4 and entry["rows"][0]["settings"]["num_fewshot"] == 2
    assert len(entry["samples"]) == 8  # one per document and filter (strict, flexible)

    monkeypatch.setattr(runner, "run_task", lambda *a, **k: pytest.fail("re-evaluated a cached task"))
    again = evaluate_task(handle, task, settings, False, data_dir, tmp_path / "cache")
    assert again["rows"][0]["cached"] and again["rows"][0]["value"] == entry["rows"][0]["value"]
    with pytest.raises(pytest.fail.Exception):  # other settings: a new key, so it would run again
        evaluate_task(handle, PlannedTask(TASKS.get("gsm8k"), 3, 2, 8), settings, False, data_dir, tmp_path / "cache")


def test_lm_eval_describes_the_environment_once_per_process(tmp_path, data_dir, tiny_llama, monkeypatch):
    """lm-eval's environment record (collect_env's programs, git describe) is made on the first task and copied to
    the next: the same fields in both results, one collect_env."""
    import torch.utils.collect_env
    from lm_eval.models.dummy import DummyLM
    from transformers import AutoTokenizer

    from layerprune.evaluate import lm_eval_env
    from layerprune.evaluate.runner import run_task
    from layerprune.models import resolve_model

    calls = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: calls.append(1) or "the env")
    monkeypatch.setattr(lm_eval_env, "_RECORDS", {})  # as a fresh process
    dummy = DummyLM()
    dummy.__dict__["tokenizer"] = AutoTokenizer.from_pretrained(tiny_llama)
    handle = ModelHandle(resolve_model(str(tiny_llama)), RunSettings(), lm=dummy, digest="d" * 64)
    settings = EvalSettings(data_dir=data_dir)
    first = run_task(handle, PlannedTask(TASKS.get("gsm8k"), 2, 0, 8), settings, False, data_dir)
    second = run_task(handle, PlannedTask(TASKS.get("gsm8k"), 3, 0, 8), settings, False, data_dir)
    assert len(calls) == 1
    assert first["pretty_env_info"] == second["pretty_env_info"] == "the env"
    assert first["git_hash"] == second["git_hash"] and "transformers_version" in second


def test_tiny_model_end_to_end_and_cache(capsys, tmp_path, tiny_llama, data_dir, shared_data):
    import shutil

    write_rows(data_dir, "humaneval_plus", "test",
               [json.loads(line) for line in (shared_data / "humaneval_plus" / "test.jsonl").open()][:2])
    args = ["--model", str(tiny_llama), "--tasks", "arc_easy,gsm8k,arith_1dc,brackets_d2,humaneval_plus",
            "--limit", "2", "--max-gen-toks", "4", "--data-dir", str(data_dir), "--output", str(tmp_path / "o"),
            "--cache-dir", str(tmp_path / "c"), "--num-fewshot", "1"]
    code, out, err = evaluate_cli(capsys, *args)
    assert code == 0, err
    summary = Summary.model_validate_json((tmp_path / "o" / "summary.json").read_text())
    assert {r.task for r in summary.results} == {"arc_easy", "gsm8k", "arith_1dc", "brackets_d2", "humaneval_plus"}
    assert summary.model.has_chat_template and summary.model.chat_template == "auto"
    assert next(r for r in summary.results if r.task == "gsm8k").settings["chat_template"] is True
    assert next(r for r in summary.results if r.task == "arc_easy").settings["num_fewshot"] == 1
    raw = json.loads((tmp_path / "o" / "results" / "gsm8k.json").read_text())
    assert "exact_match,flexible-extract" in raw["results"]["gsm8k"]
    assert (tmp_path / "o" / "samples" / "humaneval_plus.jsonl").read_text().count("\n") == 2
    shutil.rmtree(tmp_path / "o")
    code, out, _ = evaluate_cli(capsys, *args)
    assert code == 0 and "| no |" not in out and out.count("| yes |") == len(summary.results)


def test_comparison_with_tokenizer_warning(capsys, tmp_path, tiny_models, caplog):
    from transformers import AutoTokenizer

    baseline, pruned = tiny_models("llama", 4), tiny_models("llama", 2)
    other = tmp_path / "other-tok"
    import shutil

    shutil.copytree(baseline, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(other)
    code, out, err = evaluate_cli(capsys, "--model", str(pruned), "--baseline", str(other), "--pruned", str(pruned),
                                  "--tasks", "brackets_d2", "--limit", "2", "--output", str(tmp_path / "cmp"),
                                  "--cache-dir", str(tmp_path / "c"))
    assert code == 0, err
    assert "different tokenizer" in caplog.text
    for name in ("comparison.md", "comparison.json", "tasks_generative.png", "averages.png"):
        assert (tmp_path / "cmp" / name).is_file()
    assert (tmp_path / "cmp" / "baseline" / "summary.json").is_file()
    # retention columns are hidden when every baseline score is 0 (a tiny random model), so check the roles only
    assert "| task | metric | n | baseline | pruned | recovered |" in out


# report -------------------------------------------------------------------------------------------------

def fake_summary(values: dict[str, float]) -> Summary:
    kinds = {"arc_easy": "classification", "boolq": "classification", "gsm8k": "generative", "arith_1dc": "generative"}
    rows = [TaskResult(task=t, kind=kinds[t], metric="acc", value=v, stderr=0.01, n=10, headline=True, settings={},
                       seconds=1.0) for t, v in values.items()]
    return Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash="h", results=rows)


def test_compare_retention_and_recovered_share(tmp_path):
    summaries = {"baseline": fake_summary({"arc_easy": 0.8, "boolq": 0.6, "gsm8k": 0.4, "arith_1dc": 0.5}),
                 "pruned": fake_summary({"arc_easy": 0.6, "boolq": 0.6, "gsm8k": 0.1, "arith_1dc": 0.1}),
                 "recovered": fake_summary({"arc_easy": 0.7, "boolq": 0.5, "gsm8k": 0.25, "arith_1dc": 0.3})}
    report = compare(summaries, tmp_path / "r")
    arc = next(r for r in report["rows"] if r["task"] == "arc_easy")
    assert arc["retention_pruned"] == pytest.approx(0.75) and arc["recovered_share"] == pytest.approx(0.5)
    boolq = next(r for r in report["rows"] if r["task"] == "boolq")
    assert boolq["recovered_share"] is None  # no drop to recover
    cls, gen = report["averages"]
    assert cls["baseline"] == pytest.approx(0.7) and cls["recovered"] == pytest.approx(0.6)
    assert gen["pruned"] == pytest.approx(0.1) and gen["recovered_share"] == pytest.approx((0.275 - 0.1) / (0.45 - 0.1))
    assert ("| arc_easy | acc | 10 | 0.8000 ± 0.0100 | 0.6000 ± 0.0100 | 0.7000 ± 0.0100 | -0.2000 ± 0.0141 | "
            "+0.1000 ± 0.0141 | 75.0% | 87.5% | 50.0% |") in report["table"]
    for name in ("comparison.md", "tasks_classification.png", "tasks_generative.png", "averages.png"):
        assert (tmp_path / "r" / name).stat().st_size > 0


# mmlu: lm-eval's 57 subject tasks over one local file, aggregated like lm-eval's group ---------------------

def mmlu_subjects() -> list[str]:
    import yaml

    from layerprune.evaluate.offline import lm_eval_tasks_dir

    files = sorted((lm_eval_tasks_dir() / "mmlu" / "default").glob("mmlu_*.yaml"))
    return [yaml.safe_load(path.read_text())["dataset_name"] for path in files]


def write_mmlu(root: Path, per_subject: int = 2) -> list[str]:
    subjects = mmlu_subjects()
    for split in ("test", "dev"):
        write_rows(root, "mmlu", split, [
            {"question": f"{split} {subject} question {i}?", "subject": subject,
             "choices": [f"{subject} {i}", "two", "three", "four"], "answer": i % 4}
            for subject in subjects for i in range(per_subject)])
    return subjects


def test_mmlu_is_in_classification_only_where_its_data_is(tmp_path, data_dir, shared_data, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    planned, skipped = plan_tasks(EvalSettings(suite="classification", limit=2), data_dir)
    assert "mmlu" not in {t.spec.name for t in planned} and str(data_dir / "mmlu") in skipped["mmlu"]
    assert "mmlu" in {t.spec.name for t in plan_tasks(EvalSettings(suite="classification"), None)[0]}  # hub user
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "mmlu" in {t.spec.name for t in plan_tasks(EvalSettings(suite="classification"), shared_data)[0]}
    with pytest.raises(LayerpruneError, match="no data for task 'arc_easy'.*hub is offline"):  # before any model loads
        plan_tasks(EvalSettings(suite="classification"), None)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    write_mmlu(data_dir)
    assert "mmlu" in {t.spec.name for t in plan_tasks(EvalSettings(suite="classification"), data_dir)[0]}
    assert "mmlu" not in {t.spec.name for t in plan_tasks(EvalSettings(suite="quick"), data_dir)[0]}


def test_mmlu_subjects_read_their_own_rows_and_shots(data_dir):
    from lm_eval.tasks import TaskManager

    from layerprune.evaluate.offline import lm_eval_configs

    subjects = write_mmlu(data_dir)
    assert len(subjects) == 57
    configs = lm_eval_configs(TASKS.get("mmlu"), data_dir, pool="dev")
    task = TaskManager(include_defaults=False).load([configs[3]])["tasks"][configs[3]["task"]]
    subject = subjects[3]
    assert {d["subject"] for d in task.test_docs()} == {subject} and len(task.test_docs()) == 2
    assert [d["question"] for d in task.fewshot_docs()] == [f"dev {subject} question {i}?" for i in range(2)]
    assert task.config.description.endswith(f"about {subject.replace('_', ' ')}.\n\n")  # lm-eval's own prompt


def test_mmlu_fewshot_pool_is_per_subject(data_dir):
    write_mmlu(data_dir, per_subject=2)
    with pytest.raises(LayerpruneError, match="few-shot pool of 'mmlu' .2 examples.*subject"):
        plan_tasks(EvalSettings(tasks=["mmlu"], num_fewshot=3), data_dir)


def test_mmlu_group_score_is_lm_eval_size_weighted_mean(tmp_path, data_dir, tiny_llama):
    from layerprune.evaluate import evaluate_model

    write_mmlu(data_dir, per_subject=2)
    settings = EvalSettings(tasks=["mmlu"], limit=2, num_fewshot=1, data_dir=data_dir, batch_size="16")
    summary = evaluate_model(str(tiny_llama), settings, RunSettings(cache_dir=tmp_path / "c"),
                             output_dir=tmp_path / "o")
    (row,) = [r for r in summary.results if r.task == "mmlu"]
    raw = json.loads((tmp_path / "o" / "results" / "mmlu.json").read_text())
    subs = {k: v for k, v in raw["results"].items() if k.startswith("mmlu_")}
    assert len(subs) == 57 and row.n == 114
    assert row.value == pytest.approx(sum(v["acc,none"] for v in subs.values()) / 57)
    samples = (tmp_path / "o" / "samples" / "mmlu.jsonl").read_text().splitlines()
    assert len(samples) == 114 and all(json.loads(s)["subtask"].startswith("mmlu_") for s in samples)
