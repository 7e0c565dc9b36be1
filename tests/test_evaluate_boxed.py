"""gsm8k_boxed_chat: the pruning study's zero-shot chat GSM8K protocol with a \\boxed{} answer."""

from __future__ import annotations

import json

import pytest

from layerprune.core.settings import RunSettings
from layerprune.evaluate.project_tasks import BOXED_INSTRUCTION, score_boxed
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import plan_tasks
from layerprune.tasks.grading import last_boxed

DOC = {"question": "Q?", "answer": "She has 3 + 4 = 7 apples.\n#### 1,200"}


def test_last_boxed_takes_the_last_box_and_nested_braces():
    assert last_boxed(r"first \boxed{3}, then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed("no box here") is None and last_boxed(r"\boxed{12") is None


@pytest.mark.parametrize("text, right", [(r"so \boxed{1200}", 1.0), (r"\boxed{1,200.}", 1.0), (r"\boxed{$1200}", 1.0),
                                         (r"\boxed{120}", 0.0), ("1200", 0.0), (r"\boxed{x}", 0.0),
                                         (r"\boxed{1200\%}", 1.0), (r"\boxed{1200.00}", 1.0),
                                         (r"\boxed{sNaN}", 0.0), (r"\boxed{Infinity}", 0.0)])
def test_score_boxed_compares_the_boxed_number_with_the_answer(text, right):
    assert score_boxed(DOC, [text]) == {"exact_match": right}


def test_paper_suite_offers_the_boxed_protocol_beside_lm_eval_gsm8k(shared_data):
    settings = EvalSettings(suite="paper", data_dir=shared_data, fewshot_from_eval_split=True)  # no hellaswag train
    planned, _ = plan_tasks(settings, shared_data)
    names = [t.spec.name for t in planned]
    assert "gsm8k" in names and "gsm8k_boxed_chat" in names
    boxed = next(t for t in planned if t.spec.name == "gsm8k_boxed_chat")
    assert boxed.num_fewshot in (0, None) and boxed.spec.chat_protocol


def test_boxed_task_runs_zero_shot_with_the_chat_template(tmp_path, tiny_llama, shared_data):
    from layerprune.evaluate import evaluate_model

    settings = EvalSettings(tasks=["gsm8k_boxed_chat"], limit=2, max_gen_toks=4, data_dir=shared_data, batch_size="2")
    summary = evaluate_model(str(tiny_llama), settings, RunSettings(cache_dir=tmp_path / "c"),
                             output_dir=tmp_path / "o")
    (row,) = [r for r in summary.results if r.task == "gsm8k_boxed_chat"]
    assert row.n == 2 and row.settings["chat_template"] is True and 0.0 <= row.value <= 1.0
    sample = json.loads((tmp_path / "o" / "samples" / "gsm8k_boxed_chat.jsonl").read_text().splitlines()[0])
    prompt = json.dumps(sample["arguments"])
    assert BOXED_INSTRUCTION.replace("\\", "\\\\") in prompt and "<|user|>" in prompt and "####" not in prompt
