"""Few-shot examples come from the split lm-eval uses; the scored split only when asked, never the document itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import evaluate_cli, write_rows
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.evaluate import EvalSettings, evaluate_model, plan_tasks
from layerprune.evaluate.offline import SPLIT_KEYS, lm_eval_config, lm_eval_tasks_dir
from layerprune.evaluate.task_specs import TASKS

ARC = [{"id": f"q{i}", "question": f"Test question {i}?",
        "choices": {"text": [str(i + 1), str(i + 5), "blue", "seven"], "label": ["A", "B", "C", "D"]},
        "answerKey": "A"} for i in range(4)]
ARC_TRAIN = [{**row, "id": f"t{i}", "question": f"Train question {i}?"} for i, row in enumerate(ARC)]
PIQA = [{"goal": f"Goal number {i}", "sol1": "do it", "sol2": "do not", "label": i % 2} for i in range(3)]


@pytest.fixture
def data_dir(data_dir: Path) -> Path:
    write_rows(data_dir, "arc_easy", "test", ARC)
    write_rows(data_dir, "piqa", "validation", PIQA)
    write_rows(data_dir, "gsm8k", "test", [{"question": "1+1?", "answer": "2\n#### 2"}])
    return data_dir


def test_registered_splits_are_lm_evals_own():
    from lm_eval.tasks._yaml_loader import load_yaml

    for name in TASKS.names():
        spec = TASKS.get(name)
        if spec.source != "lm_eval" or spec.subtask_field is not None:
            continue
        config = load_yaml(lm_eval_tasks_dir() / spec.lm_eval_yaml, resolve_func=False)
        assert spec.splits == {key: config[key] for key in SPLIT_KEYS if config.get(key)}, name


def test_missing_pool_is_refused_naming_the_file(capsys, tmp_path, tiny_llama, data_dir):
    out = tmp_path / "o"
    code, _, err = evaluate_cli(capsys, "--model", str(tiny_llama), "--tasks", "arc_easy", "--num-fewshot", "2",
                                "--data-dir", str(data_dir), "--output", str(out))
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert str(data_dir / "arc_easy" / "train.jsonl") in err and "--fewshot-from-eval-split" in err
    with pytest.raises(LayerpruneError, match="gsm8k/train.jsonl is missing"):  # its own default: 5 shots
        plan_tasks(EvalSettings(tasks=["gsm8k"]), data_dir)
    assert plan_tasks(EvalSettings(tasks=["gsm8k", "arc_easy"], num_fewshot=0), data_dir)[0][0].fewshot_pool is None


@pytest.mark.parametrize("task, rows, field", [("arc_easy", ARC, "question"), ("piqa", PIQA, "goal")])
def test_eval_split_pool_never_holds_the_document(data_dir, task, rows, field):
    from lm_eval.tasks import TaskManager

    settings = EvalSettings(tasks=[task], num_fewshot=len(rows) - 1, fewshot_from_eval_split=True)
    (planned,) = plan_tasks(settings, data_dir)[0]
    assert planned.fewshot_pool == TASKS.get(task).eval_split
    config = lm_eval_config(planned.spec, data_dir, planned.fewshot_pool)
    lm_task = TaskManager(include_defaults=False).load([config])["tasks"][task]
    docs = list(lm_task.eval_docs)
    assert len(docs) == len(rows)
    for doc in docs:  # k = pool - 1: the shots are exactly the other documents, each once
        context = lm_task.fewshot_context(doc, len(rows) - 1)
        context = context if isinstance(context, str) else context[0]
        assert [context.count(row[field]) for row in rows] == [1] * len(rows)


def test_shots_from_training_split_and_recorded_per_result(tmp_path, tiny_llama, data_dir):
    write_rows(data_dir, "arc_easy", "train", ARC_TRAIN)
    settings = EvalSettings(tasks=["arc_easy", "piqa"], limit=2, num_fewshot=2, data_dir=data_dir,
                            fewshot_from_eval_split=True, batch_size="8")
    summary = evaluate_model(str(tiny_llama), settings, RunSettings(cache_dir=tmp_path / "c"),
                             output_dir=tmp_path / "o")
    recorded = {r.task: (r.settings["fewshot_split"], r.settings["fewshot_from_eval_split"]) for r in summary.results}
    assert recorded == {"arc_easy": ("train", False), "piqa": ("validation", True)}
    samples = [json.loads(line) for line in (tmp_path / "o" / "samples" / "arc_easy.jsonl").read_text().splitlines()]
    assert len(samples) == 2
    for sample in samples:
        prompt = json.dumps(sample["arguments"])
        assert prompt.count("Train question") == 2 * 4  # two shots in each of the four choices' contexts
        assert prompt.count("Test question") == 4  # the question itself, and no other test document
