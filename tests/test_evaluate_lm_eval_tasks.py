"""`evaluate --tasks` takes any task lm-eval knows and the user's own YAMLs (--include-path), as lm-eval's CLI does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerprune.cli import main
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.evaluate import EvalSettings, evaluate_model, plan_tasks

ROWS = [{"q": f"Is {i} even?", "options": ["yes", "no"], "gold": i % 2} for i in range(6)]
TASK_YAML = """\
task: my_parity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{q}}}}\\nAnswer:"
doc_to_choice: "{{{{options}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GROUP_YAML = """\
group: my_group
task: [my_parity]
aggregate_metric_list:
  - metric: acc
    weight_by_size: true
"""


@pytest.fixture
def tasks_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "my_tasks"
    folder.mkdir()
    data = tmp_path / "parity.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (folder / "parity.yaml").write_text(TASK_YAML.format(data=data))
    (folder / "group.yaml").write_text(GROUP_YAML)
    return folder


def lm_eval_own(model_dir: Path, task: str, folder: Path) -> dict:
    """lm-eval's own simple_evaluate with its TaskManager over the same folder, as its CLI runs it."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(model_dir), batch_size=8, device="cpu", dtype="float32")
    raw = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=1, log_samples=True,
                                  task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    return raw


def test_user_yaml_task_and_group_equal_lm_eval_own(tmp_path, tiny_llama, tasks_dir):
    settings = EvalSettings(tasks=["my_parity", "my_group"], include_path=tasks_dir, num_fewshot=1, batch_size="8")
    summary = evaluate_model(str(tiny_llama), settings, RunSettings(cache_dir=tmp_path / "c", dtype="float32"),
                             output_dir=tmp_path / "o")
    ours = {(r.task, r.metric): r.value for r in summary.results}
    raw = lm_eval_own(tiny_llama, "my_parity", tasks_dir)
    theirs = raw["results"]["my_parity"]
    assert ours[("my_parity", "acc")] == theirs["acc,none"]
    assert ours[("my_parity", "acc_norm")] == theirs["acc_norm,none"]
    mine = [json.loads(line) for line in (tmp_path / "o" / "samples" / "my_parity.jsonl").read_text().splitlines()]
    own = json.loads(json.dumps(raw["samples"]["my_parity"], default=str))
    assert [s["arguments"] for s in mine] == [s["arguments"] for s in own]  # the same prompts, shot included
    assert [s["filtered_resps"] for s in mine] == [s["filtered_resps"] for s in own]  # the same log-likelihoods
    assert ours[("my_group", "acc")] == ours[("my_parity", "acc")]
    assert {r.n for r in summary.results} == {6} and summary.headlines()["my_parity"].metric == "acc"
    samples = (tmp_path / "o" / "samples" / "my_group.jsonl").read_text().splitlines()
    assert len(samples) == 6 and json.loads(samples[0])["subtask"] == "my_parity"


def test_lm_eval_tasks_pass_through_by_name(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # a user with the hub: planning reads no data
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    planned = {t.spec.name: t for t in plan_tasks(EvalSettings(tasks=["lambada_openai", "mmlu_pro", "leaderboard",
                                                                      "arc_challenge_chat"]), None)[0]}
    assert planned["lambada_openai"].spec.kind == "classification" and planned["mmlu_pro"].spec.kind == "generative"
    assert planned["leaderboard"].spec.source == "lm_eval_index"
    bbh = [t.spec.name for t in plan_tasks(EvalSettings(tasks=["leaderboard_bbh_*"]), None)[0]]
    assert len(bbh) > 20 and "leaderboard_bbh_navigate" in bbh  # glob patterns, as lm-eval's CLI takes them
    chat = planned["arc_challenge_chat"].spec  # a plain YAML task of lm-eval's over a dataset the mirror holds
    assert (chat.source, chat.dataset, chat.eval_split, chat.fewshot_split) == ("lm_eval", "arc_challenge", "test",
                                                                                "train")


def test_lm_eval_task_reads_the_mirror(shared_data):
    from lm_eval.tasks import TaskManager

    from layerprune.evaluate.offline import lm_eval_config

    (planned,) = plan_tasks(EvalSettings(tasks=["arc_challenge_chat"], num_fewshot=2), shared_data)[0]
    assert planned.fewshot_pool == "train"
    config = lm_eval_config(planned.spec, shared_data, planned.fewshot_pool)
    task = TaskManager(include_defaults=False).load([config])["tasks"]["arc_challenge_chat"]
    assert len(task.eval_docs) == 1172 and len(task.fewshot_docs()) == 1119
    assert task.config.gen_prefix == "The best answer is"  # lm-eval's own prompt


def test_unknown_name_suggests_from_lm_evals_index(capsys, tmp_path, tiny_llama):
    capsys.readouterr()
    code = main(["evaluate", "--model", str(tiny_llama), "--tasks", "lambada_opneai", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "did you mean: lambada_openai" in err
    with pytest.raises(ValueError, match="did you mean: arc_easy"):
        EvalSettings(tasks=["arc_esay"])  # the settings themselves refuse it, before any planning
    with pytest.raises(LayerpruneError, match="'lambada_openai' reads 'EleutherAI/lambada_openai' from the hub, and"):
        plan_tasks(EvalSettings(tasks=["lambada_openai"]), None)  # conftest: the hub is offline
    with pytest.raises(LayerpruneError, match="'leaderboard' reads its data from the hub"):
        plan_tasks(EvalSettings(tasks=["leaderboard"]), None)
    with pytest.raises(LayerpruneError, match="--include-path .* is not a folder"):
        plan_tasks(EvalSettings(tasks=["my_parity"], include_path=tmp_path / "nowhere"), None)
