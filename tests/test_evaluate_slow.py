"""`evaluate` on the embedded SmolLM2-135M: same numbers as lm-eval's own CLI; reproducible probes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from layerprune.core.settings import RunSettings
from layerprune.evaluate import EvalSettings, evaluate_model, plan_tasks
from layerprune.evaluate.items import SAMPLES_DIR
from layerprune.evaluate.offline import write_task_yaml
from layerprune.evaluate.task_specs import TASKS
from layerprune.models import resolve_model

pytestmark = pytest.mark.slow
# every document's loglikelihoods are compared, not only the accuracy: a few documents are a sharper check than
# many documents' mean (the five-shot prompts are ~6x longer, so one of them: with lm-eval's CLI at 4 shots against
# our 5, document 0's loglikelihoods differ). One run of lm-eval's CLI scores both tasks (its start and the model's
# load are 16 of its 23 s of CPU on one task), each task's shots set in its YAML.
LIMIT = 10
FEWSHOT_LIMIT = 1
SHOTS = 5


@pytest.fixture(scope="module")
def lm_eval_cli(tmp_path_factory, shared_data) -> dict[str, tuple[dict, dict[int, list[float]]]]:
    """lm-eval's own CLI on the embedded model and the same local files (our task YAMLs include lm-eval's and swap
    the data): arc_easy zero-shot on LIMIT documents, arc_challenge SHOTS-shot from its training split on
    FEWSHOT_LIMIT; task -> (its results, each document's loglikelihoods by doc_id)."""
    folder = tmp_path_factory.mktemp("lm-eval-cli")
    model_dir = resolve_model("embedded", RunSettings(cache_dir=None)).location
    write_task_yaml(TASKS.get("arc_easy"), shared_data, folder / "tasks")
    fewshot = write_task_yaml(TASKS.get("arc_challenge"), shared_data, folder / "tasks", "train")
    fewshot.write_text(yaml.safe_dump({**yaml.safe_load(fewshot.read_text()), "num_fewshot": SHOTS}, sort_keys=False))
    documents = {"arc_easy": list(range(LIMIT)), "arc_challenge": list(range(FEWSHOT_LIMIT))}
    command = [str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
               f"pretrained={model_dir},dtype=float32", "--tasks", "arc_easy,arc_challenge", "--include_path",
               str(folder / "tasks"), "--samples", json.dumps(documents), "--batch_size", "8", "--device", "cpu",
               "--output_path", str(folder / "out"), "--log_samples"]
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    (result,) = (folder / "out").rglob("results_*.json")
    results = json.loads(result.read_text())
    assert {task: results["n-shot"][task] for task in documents} == {"arc_easy": 0, "arc_challenge": SHOTS}
    return {task: (results["results"][task], loglikelihoods(next((folder / "out").rglob(f"samples_{task}_*.jsonl"))))
            for task in documents}


def loglikelihoods(samples: Path) -> dict[int, list[float]]:
    """doc_id -> the loglikelihood of each choice, from lm-eval's per-document log (its `filtered_resps`)."""
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    return {d["doc_id"]: [float(r[0]) for r in d["filtered_resps"]] for d in docs}


def assert_same_documents(ours: Path, theirs: dict[int, list[float]], limit: int) -> None:
    mine = loglikelihoods(ours)
    assert sorted(mine) == sorted(theirs) == list(range(limit))
    for doc in mine:  # the same prompts, context and choices: every loglikelihood equal to float32 batching noise
        assert mine[doc] == pytest.approx(theirs[doc], abs=1e-3), doc


def test_classification_matches_lm_eval_cli(tmp_path, shared_data, lm_eval_cli):
    run = RunSettings(cache_dir=None)
    source = resolve_model("embedded", run)
    settings = EvalSettings(tasks=["arc_easy"], limit=LIMIT, batch_size="8", data_dir=shared_data, reuse=False)
    ours = {r.metric: r.value for r in evaluate_model(source, settings, run, tmp_path / "ours").results}
    theirs, documents = lm_eval_cli["arc_easy"]
    assert ours["acc"] == theirs["acc,none"] and ours["acc_norm"] == theirs["acc_norm,none"]
    assert_same_documents(tmp_path / "ours" / SAMPLES_DIR / "arc_easy.jsonl", documents, LIMIT)


def test_five_shot_from_training_split_matches_lm_eval_cli(tmp_path, shared_data, lm_eval_cli):
    run = RunSettings(cache_dir=None)
    source = resolve_model("embedded", run)
    settings = EvalSettings(tasks=["arc_challenge"], limit=FEWSHOT_LIMIT, num_fewshot=SHOTS, batch_size="8",
                            data_dir=shared_data, reuse=False)
    (planned,) = plan_tasks(settings, shared_data)[0]
    assert planned.fewshot_pool == "train"  # lm-eval's own pool, not the scored test split
    ours = {r.metric: r.value for r in evaluate_model(source, settings, run, tmp_path / "ours").results}
    theirs, documents = lm_eval_cli["arc_challenge"]
    assert ours["acc"] == theirs["acc,none"] and ours["acc_norm"] == theirs["acc_norm,none"]
    assert_same_documents(tmp_path / "ours" / SAMPLES_DIR / "arc_challenge.jsonl", documents, FEWSHOT_LIMIT)


def test_probes_are_reproducible(shared_data):
    settings = EvalSettings(tasks=["arith_1dc", "brackets_d2"], limit=8, reuse=False)
    first = evaluate_model("embedded", settings).results
    second = evaluate_model("embedded", settings).results
    assert [r.value for r in first] == [r.value for r in second]


def test_humaneval_reference_solutions_all_pass(shared_data, tmp_path):
    """The dataset's own canonical solutions pass every HumanEval+ problem (164/164): the machine and the harness
    hold (expected outputs outside the budget, EvalPlus's time limits, the end-of-checks marker)."""
    settings = EvalSettings(tasks=["humaneval_plus"], reference_solutions=True, data_dir=shared_data)
    summary = evaluate_model(None, settings, RunSettings(cache_dir=tmp_path / "cache"))
    (row,) = summary.results
    assert (row.value, row.n) == (1.0, 164), row.statuses
    assert row.statuses == {"passed": 164}
