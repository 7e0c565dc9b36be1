"""One token budget for every recovery method: unpadded target tokens, the same sequences in the same order, and
the training fields of recover_report.json."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerControl, TrainerState

from helpers import pruned_copy
from layerprune.cli import main
from layerprune.core.errors import LayerpruneError
from layerprune.models import drop_blocks
from layerprune.recover import budget, heldout, local, selfgen
from layerprune.recover.schema import GenerationSection

FIELDS = ("tokens_unpadded", "tokens_padded", "sequences", "optimizer_steps", "learning_rate")
FAST = ["--max-new-tokens", "8", "--no-generate-drop-truncated", "--temperature", "0", "--samples", "16",
        "--train-max-length", "96", "--train-batch-size", "2", "--train-grad-accum", "2", "--max-steps", "40",
        "--held-out", "0.25", "--train-warmup-steps", "0", "--no-train-gradient-checkpointing", "--learning-rate",
        "1e-3", "--lora-r", "4", "--train-eval-steps", "100", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"say {i} and {3 * i}" + " please" * (i % 4), "answer": str(4 * i)}
            for i in range(16)]  # no sum: 'what is 3 + 9?' asks a scored probe item and is excluded
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory) -> Path:
    """A tiny model minus blocks 2 and 3 (one span), with a prune_report.json naming its teacher."""
    return pruned_copy(tiny_models("llama", 6), tmp_path_factory.mktemp("pruned") / "p2", [2, 3])


def run(pruned: Path, prompts_file: Path, out: Path, *extra: str) -> dict:
    assert main(["recover", "--model", str(pruned), "--prompts", str(prompts_file), "-o", str(out), *FAST, *extra]) == 0
    return json.loads((out / "recover_report.json").read_text())


def trained_rows(out: Path, report: dict) -> list[dict]:
    """The rows the arm trained on, in training order (held-out prompts removed)."""
    held = set(report["held_out_metrics"]["prompts"])
    rows = [r for r in selfgen.read_responses(out / "data" / "responses.jsonl") if r["id"] not in held]
    return budget.order(rows, report["settings"]["seed"])


def hand_count(pruned: Path, out: Path, report: dict, n: int) -> int:
    """The completion tokens (labels != -100) of the first n rows in training order, tokenized here."""
    rows = trained_rows(out, report)[:n]
    encoded = heldout.encode_rows(AutoTokenizer.from_pretrained(pruned), rows, GenerationSection(), 96)
    assert len(encoded) == n
    return sum(len(ids) - start for ids, start in encoded)


def test_sft_counts_the_completion_tokens_of_the_data_by_hand(pruned, prompts_file, tmp_path):
    """Two steps of 2 x 2 sequences count exactly the completion tokens of the first 8 rows in budget.order."""
    report = run(pruned, prompts_file, tmp_path / "sft", "--method", "lora", "--max-steps", "2")
    assert report["tokens_unpadded"] == hand_count(pruned, tmp_path / "sft", report, 8) > 0
    assert report["sequences"] == 8 and report["optimizer_steps"] == 2 == report["data"]["steps"]
    assert report["tokens_padded"] > report["tokens_unpadded"]  # prompts and padding, for reference
    assert report["learning_rate"] == pytest.approx(1e-3)


def test_one_budget_stops_sft_kd_and_local_after_the_same_sequences_and_tokens(pruned, prompts_file, tmp_path):
    """The budget is the target tokens of the first two steps' rows: every arm stops there, on those rows."""
    probe = run(pruned, prompts_file, tmp_path / "probe", "--method", "merge")  # no training: the rows only
    assert all(probe[name] == 0 for name in FIELDS)
    tokens = hand_count(pruned, tmp_path / "probe", probe, 8)
    reports = {method: run(pruned, prompts_file, tmp_path / method, "--method", method, "--train-max-tokens",
                           str(tokens)) for method in ("lora", "kd", "local")}
    for method, report in reports.items():
        assert report["tokens_unpadded"] == pytest.approx(tokens, rel=0.01), method
        assert (report["sequences"], report["optimizer_steps"]) == (8, 2), method
    assert reports["local"]["learning_rate"] == reports["kd"]["learning_rate"] == pytest.approx(1e-3)
    one_more = run(pruned, prompts_file, tmp_path / "past", "--method", "local", "--train-max-tokens", str(tokens + 1))
    assert one_more["optimizer_steps"] == 3 and one_more["sequences"] == 12  # the step that reaches it, no further


def test_sft_and_kd_cut_a_sequence_past_max_length_alike(pruned, tmp_path):
    """Chat sequences longer than train.max_length (96 here; these prompts make 89-104 tokens): SFT and kd (GKD)
    train on, and count, the same tokens of each, cut at the end as the held-out rows are. Before, GKD's collator
    kept a sequence's last tokens (the prompt cut first): kd counted 136 target tokens where SFT counted 106."""
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"name {i} cities of over {3 * i} million people"
                                        + " please" * (i % 4)}) + "\n" for i in range(16)))
    probe = run(pruned, path, tmp_path / "probe", "--method", "merge")
    tokens = hand_count(pruned, tmp_path / "probe", probe, 8)
    reports = {method: run(pruned, path, tmp_path / method, "--method", method, "--train-max-tokens", str(tokens))
               for method in ("lora", "kd")}
    assert [(r["tokens_unpadded"], r["sequences"]) for r in reports.values()] == [(tokens, 8)] * 2


def test_kd_drops_a_row_cut_inside_its_prompt_as_sft_does(pruned):
    """Past max_length every kd row is cut at its end; a row whose prompt alone fills max_length has no completion
    token left and is dropped, as TRL's SFT drops it (else kd trains on a row SFT never sees, and every later batch
    shifts)."""
    from layerprune.recover import kd

    tokenizer = AutoTokenizer.from_pretrained(pruned)
    rows = [{"prompt": "say 1", "response": "one"}, {"prompt": "say 2" + " please" * 200, "response": "two"},
            {"prompt": "say 3", "response": "three"}]
    data = kd.messages_dataset(rows, GenerationSection(), tokenizer, 64)
    assert len(data) == 2 and all(1 in mask for mask in data["completion_mask"])
    assert data["input_ids"][1] == heldout.encode_row(tokenizer, rows[2], GenerationSection(), 64)[0]
    with pytest.raises(LayerpruneError, match="every training row is longer than train.max_length \\(64 tokens\\)"):
        kd.messages_dataset(rows[1:2], GenerationSection(), tokenizer, 64)  # not TRL's StopIteration on no rows


def test_a_completion_starts_where_the_conversation_leaves_its_prompt():
    """A template that renders the prompt alone otherwise than inside the conversation (Gemma 4's empty thought block
    after the generation prompt): the completion starts after the common prefix, as TRL's SFT takes it, not after
    the prompt's length (which would leave the answer's first token out)."""

    class Template:
        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
            return [1, 2, 3, 9] if add_generation_prompt else [1, 2, 3, 4, 5, 6]

    ids, start = heldout.encode_row(Template(), {"prompt": "q", "response": "a"}, GenerationSection(), 64)
    assert (ids, start) == ([1, 2, 3, 4, 5, 6], 3)


def test_batch_counts_take_the_loss_tokens_of_a_padded_batch_and_of_on_policy_completions():
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, 8, 9, 10]])  # row 0: the last token is padding
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": attention, "labels": labels}
    assert budget.batch_counts(batch) == (6, 10, 2)
    on_policy = {"prompt_ids": torch.ones(3, 4), "completion_ids": torch.ones(3, 2),
                 "completion_mask": torch.tensor([[1, 1], [1, 0], [0, 0]])}
    assert budget.batch_counts(on_policy) == (3, 18, 3)


def test_the_counts_stop_at_the_budget_and_resume_from_a_checkpoint():
    counter = budget.TargetTokens(max_tokens=10)
    state, control = TrainerState(), TrainerControl()
    counter.add({"labels": torch.tensor([[-100, 1, 2, 3]]), "input_ids": torch.ones(1, 4)})
    counter.on_step_end(None, state, control)
    assert counter.totals == {"tokens_unpadded": 3, "tokens_padded": 4, "sequences": 1}
    assert not control.should_training_stop
    counter.add({"labels": torch.tensor([[-100] + [1] * 7, [-100, -100] + [1] * 6]), "input_ids": torch.ones(2, 8)})
    counter.on_step_end(None, state, control)
    assert counter.totals["tokens_unpadded"] == 16 and control.should_training_stop
    resumed = TrainerState(global_step=2, stateful_callbacks=[counter])
    again = budget.TargetTokens(max_tokens=10)
    again.on_train_begin(None, resumed, TrainerControl())
    assert again.totals == counter.totals


def test_local_counts_the_answer_tokens_of_the_sequences_it_regresses(tiny_llama):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    drop_blocks(student, [2, 3])
    sequences = [[5 + (3 * i + j) % 300 for j in range(12)] for i in range(5)]
    answers = [4, 5, 6, 7, 8]
    fits = local.train_spans(student, teacher, [2, 3], sequences, "before",
                             local.LocalBudget(steps=10, sequences_per_step=2, learning_rate=1e-3, max_tokens=20),
                             answers)
    # steps of 2, 2 and 1 sequences (the last step of a pass shorter): 9, then 22 >= 20 answer tokens
    assert (fits[0]["steps"], fits[0]["sequences"], fits[0]["target_tokens"], fits[0]["tokens"]) == (2, 4, 22, 48)
    assert local.step_batches(5, 2, 4) == [[0, 1], [2, 3], [4], [0, 1]]


def test_a_budget_point_that_ends_short_of_its_budget_is_refused_and_writes_nothing(pruned, prompts_file, tmp_path,
                                                                                    monkeypatch, capsys):
    """A plain recover run takes train.max_tokens as a cap (local's 2 steps end first). A study's budget point
    (RecoverJob.reach_budget) that ends before it is refused in one line before its output is written: it would be
    labelled with tokens it never trained on. Before, only a run with checkpoints at budgets was checked (local's
    points, runs of their own, were not)."""
    from layerprune.recover import job as job_module

    capped = run(pruned, prompts_file, tmp_path / "cap", "--method", "local", "--max-steps", "2",
                 "--train-max-tokens", "100000")
    assert capped["optimizer_steps"] == 2 and capped["tokens_unpadded"] < 100000
    monkeypatch.setattr(job_module, "RecoverJob", functools.partial(job_module.RecoverJob, reach_budget=True))
    capsys.readouterr()
    code = main(["recover", "--model", str(pruned), "--prompts", str(prompts_file), "-o", str(tmp_path / "point"),
                 *FAST, "--method", "local", "--max-steps", "2", "--train-max-tokens", "100000"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "before the budget 100000" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "point").exists()


def test_a_run_started_over_drops_the_snapshots_an_abandoned_run_left(tmp_path):
    """A run that starts from step 0 (no checkpoint to resume) removes the snapshots a crashed run left, and takes
    every budget itself; a resumed run keeps them. Before, a run started over took an abandoned run's 8k point."""

    class Trainer:
        def __init__(self) -> None:
            self.callbacks: list = []

        def add_callback(self, callback: object) -> None:
            self.callbacks.append(callback)

    kept = tmp_path / "snapshots" / "8"
    kept.mkdir(parents=True)
    (kept / budget.SNAPSHOT_RECORD).write_text("{}")
    resumed = budget.attach_snapshots(Trainer(), budget.TargetTokens(), [8, 16], tmp_path / "snapshots", fresh=False)
    assert resumed.budgets == [16] and kept.is_dir()
    fresh = budget.attach_snapshots(Trainer(), budget.TargetTokens(), [8, 16], tmp_path / "snapshots", fresh=True)
    assert fresh.budgets == [8, 16] and not kept.exists()


def _budget_trainer(model_dir: Path, out: Path, max_tokens: int, snapshots: list[int]) -> tuple:
    """A plain trainer on sequences of 5 target tokens each, a checkpoint every step, counted by budget.attach."""
    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": torch.arange(4 + i, 10 + i), "attention_mask": torch.ones(6, dtype=torch.long),
             "labels": torch.arange(4 + i, 10 + i)} for i in range(12)]
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=1, max_steps=12,
                             save_strategy="steps", save_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True,
                             disable_tqdm=True, logging_steps=1, seed=0)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=rows)
    counter = budget.attach(trainer, max_tokens)
    budget.attach_snapshots(trainer, counter, snapshots, out / "snapshots", fresh=False)
    return trainer, counter


def test_a_run_resumed_at_its_budget_trains_no_further_step(tiny_llama, tmp_path):
    """A run stopped after its last step (the budget, 12 target tokens, reached at step 3 with 15), with a
    checkpoint there, resumes to that checkpoint's weights and step: before, the trainer took step 4 first."""
    from safetensors.torch import load_file

    first, _ = _budget_trainer(tiny_llama, tmp_path, 12, [])
    budget.train(first, None)
    assert first.state.global_step == 3
    checkpoint = tmp_path / "trainer" / "checkpoint-3"
    again, counter = _budget_trainer(tiny_llama, tmp_path, 12, [])
    steps = []  # no batch drawn: an on-policy trainer generates (and counts) in training_step, before its loss
    inner = again.training_step
    again.training_step = lambda *args, **kwargs: steps.append(1) or inner(*args, **kwargs)
    budget.train(again, checkpoint)
    assert steps == []
    assert again.state.global_step == 3 and counter.totals["tokens_unpadded"] == 15
    saved = load_file(checkpoint / "model.safetensors")
    weights = again.model.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in saved.items())


def test_a_snapshot_cut_off_after_its_checkpoint_is_taken_from_that_checkpoint(tiny_llama, tmp_path, monkeypatch):
    """A run stopped between saving the checkpoint that reached a budget (step 3, 15 target tokens >= 12) and copying
    it to snapshots/ takes the snapshot from that checkpoint when resumed. Before, it was taken at step 4."""
    real = budget.keep_snapshot

    def cut_off(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(budget, "keep_snapshot", cut_off)
    first, _ = _budget_trainer(tiny_llama, tmp_path, 30, [12])
    with pytest.raises(KeyboardInterrupt):
        budget.train(first, None)
    assert (tmp_path / "trainer" / "checkpoint-3").is_dir() and not (tmp_path / "snapshots" / "12").exists()
    monkeypatch.setattr(budget, "keep_snapshot", real)
    again, _ = _budget_trainer(tiny_llama, tmp_path, 30, [12])
    budget.train(again, tmp_path / "trainer" / "checkpoint-3")
    record = json.loads((tmp_path / "snapshots" / "12" / budget.SNAPSHOT_RECORD).read_text())
    assert (record["optimizer_steps"], record["tokens_unpadded"]) == (3, 15)
    assert again.state.global_step == 6  # 30 target tokens
