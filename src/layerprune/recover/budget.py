"""A token budget for training (train.max_tokens), in one unit for every method: unpadded target tokens.

A target token is one the loss is taken on: a completion (answer) token of a training sequence that is neither
padding nor masked out (labels != -100 after the causal shift; the on-policy trainer's completion mask). Padded
input tokens (transformers' `num_input_tokens_seen`) depend on the batch size and on how unequal the lengths of a
batch are, and prompt tokens on the prompt source; neither is what an arm learns from, so two arms given one
budget in such a unit train on different amounts of text. Counted from the batches themselves (`attach` wraps the
trainer's compute_loss), the same for SFTTrainer, the KD/GKD trainers and TRL's DistillationTrainer; the local
step counts the answer tokens of the sequences it regresses (local.py). The budget is checked after each
optimizer step, so a run ends at the step that reaches it (at most one step past it); a run resumed from a
checkpoint that already reached it trains no step (`train`).

Every arm also trains on the same sequences in the same order for a given seed (`order`, and trainers that read
their data sequentially), so one budget stops every arm after the same sequences and the same target tokens. A
sequence longer than train.max_length is cut at its end by every trainer (kd.messages_dataset gives GKD, whose
collator would cut its start, the ids SFT trains on); local cuts at local.max_length.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

log = logging.getLogger(__name__)

COUNTS = ("tokens_unpadded", "tokens_padded", "sequences")


def order(rows: list[Any], seed: int, key: Callable[[Any], str] = lambda row: row["id"]) -> list[Any]:
    """The training rows (or prompts) in the order every method trains on them: by a seeded hash of their prompt
    id, so the order does not depend on which other rows are there; every epoch repeats it (the trainers read
    sequentially, see train.training_arguments)."""
    return sorted(rows, key=lambda row: hashlib.sha256(f"order:{seed}:{key(row)}".encode()).hexdigest())


def batch_counts(inputs: dict[str, Any]) -> tuple[int, int, int]:
    """(target tokens, input tokens with padding, sequences) of one training micro-batch: labels != -100 after the
    causal shift (and not padding), or the on-policy trainer's completion mask (and tool mask)."""
    if "labels" in inputs:
        labels = inputs["labels"]
        mask = labels[:, 1:] != -100
        if inputs.get("attention_mask") is not None:
            mask &= inputs["attention_mask"][:, 1:].bool()
        padded = inputs["input_ids"] if "input_ids" in inputs else labels
        return int(mask.sum()), int(padded.numel()), int(labels.shape[0])
    mask = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        mask = mask * inputs["tool_mask"]
    padded = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
    return int(mask.sum()), int(padded), int(mask.shape[0])


class TargetTokens(TrainerCallback, ExportableState):
    """Count the target tokens, padded tokens and sequences the trainer trained on (over every process), the
    optimizer steps and the peak learning rate; stop once `max_tokens` target tokens are reached (None: count
    only). The counts live in the checkpoints, so a resumed run counts on from them."""

    def __init__(self, max_tokens: int | None = None, reduce: Any = None, device: Any = None) -> None:
        self.max_tokens = max_tokens
        self.reduce, self.device = reduce, device
        self.totals = dict.fromkeys(COUNTS, 0)
        self.pending = [0, 0, 0]
        self.learning_rate = 0.0
        self.spent = False  # resumed from a checkpoint that already reached max_tokens

    def add(self, inputs: dict[str, Any]) -> None:
        """Count one training micro-batch of this process."""
        for i, value in enumerate(batch_counts(inputs)):
            self.pending[i] += value

    def _sync(self) -> None:
        pending = torch.tensor(self.pending, dtype=torch.long, device=self.device)
        if self.reduce is not None:
            pending = self.reduce(pending, reduction="sum")
        for name, value in zip(COUNTS, pending.tolist(), strict=True):
            self.totals[name] += int(value)
        self.pending = [0, 0, 0]

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, dict) and state.global_step > 0:  # resumed: count on from the checkpoint
            attributes = saved.get("attributes", {})
            self.totals = {name: int(attributes.get(name, 0)) for name in COUNTS}
            self.learning_rate = float(attributes.get("learning_rate", 0.0))
            self.spent = self.max_tokens is not None and self.totals["tokens_unpadded"] >= self.max_tokens

    def on_epoch_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        """Resumed at or over the budget: stop before any batch is drawn or generated (`train`), after every
        callback's on_train_begin (a snapshot due at the checkpoint is taken there)."""
        if self.spent:
            raise BudgetSpent
        return control

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
        if optimizer is not None:  # before the scheduler steps: the rate this step used
            self.learning_rate = max(self.learning_rate, *(float(g["lr"]) for g in optimizer.param_groups))

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._sync()
        if self.max_tokens is not None and self.totals["tokens_unpadded"] >= self.max_tokens:
            control.should_training_stop = True
            control.should_log = True
        return control

    def state(self) -> dict[str, Any]:
        return {"args": {"max_tokens": self.max_tokens},
                "attributes": {**self.totals, "learning_rate": self.learning_rate}}

    def summary(self, optimizer_steps: int) -> dict[str, Any]:
        """The report's training fields (see report.TrainingCounts)."""
        return {**self.totals, "optimizer_steps": optimizer_steps, "learning_rate": self.learning_rate}


def attach(trainer: Any, max_tokens: int | None) -> TargetTokens:
    """Count what `trainer` trains on, from each training batch its compute_loss receives (after any on-policy
    generation), and stop it at `max_tokens` target tokens (None: no budget); the counter."""
    accelerator = trainer.accelerator
    counter = TargetTokens(max_tokens, accelerator.reduce if accelerator.num_processes > 1 else None,
                           accelerator.device if accelerator.num_processes > 1 else None)
    inner = trainer.compute_loss

    def compute_loss(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if model.training:
            counter.add(inputs)
        return inner(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss
    trainer.add_callback(counter)
    return counter


class BudgetSpent(Exception):
    """The run was resumed from a checkpoint that had already reached its budget (see `train`)."""


def train(trainer: Any, resume_from: Any) -> None:
    """`trainer.train()`, resumed from the checkpoint `resume_from` (None: from the start). A checkpoint that had
    already reached the budget (a run stopped after its last step, with a checkpoint there) is taken as the end:
    the trainer loads its weights and state and stops before its first batch (no on-policy generation, no count),
    where resuming would train one more step past the budget."""
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except BudgetSpent:
        log.info("%s had already reached the budget: no step trained after it", resume_from)


def combine(*parts: dict[str, Any] | None) -> dict[str, Any]:
    """The training fields of a chain's steps together (counts and steps add up; the peak rate is the highest)."""
    given = [p for p in parts if p]
    out: dict[str, Any] = {name: sum(int(p[name]) for p in given) for name in (*COUNTS, "optimizer_steps")}
    out["learning_rate"] = max((float(p["learning_rate"]) for p in given), default=0.0)
    return out


SNAPSHOTS = "snapshots"  # the work folder's budget checkpoints: snapshots/<budget>/ (weights and snapshot.json)
SNAPSHOT_RECORD = "snapshot.json"
NOT_WEIGHTS = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*", "training_args.bin", "trainer_state.json")


class Snapshots(TrainerCallback):
    """Save the model when its target tokens (`counter`'s, budget.py's unit) first reach each budget: the step that
    reaches one is saved as a trainer checkpoint (should_save, so the step is the one the counter stopped at) and its
    weights are copied to `directory`/<budget>/ with the counts then (snapshot.json). A budget already kept there
    (a resumed run) is not taken again. Counted from the batches, not from steps computed in advance."""

    def __init__(self, counter: TargetTokens, budgets: list[int], directory: Any) -> None:
        from pathlib import Path

        self.counter, self.directory = counter, Path(directory)
        self.budgets = sorted(b for b in budgets if not (self.directory / str(b) / SNAPSHOT_RECORD).is_file())
        self.due: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        """Resumed from a checkpoint whose counts (restored by `counter`, added before this) already reach a budget
        not kept: a run stopped after saving the checkpoint that reached it and before copying it. It is taken from
        that checkpoint now; waiting for the next step would keep a model one step past the budget."""
        from pathlib import Path

        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.global_step > 0 and checkpoint.is_dir():
            self.due = [b for b in self.budgets if b <= self.counter.totals["tokens_unpadded"]]
            if self.due:
                self.on_save(args, state, control)
        return control

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        reached = self.counter.totals["tokens_unpadded"]
        self.due = [b for b in self.budgets if b <= reached]
        if self.due:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.due and state.is_world_process_zero:
            from pathlib import Path

            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            for target in self.due:
                keep_snapshot(checkpoint, self.directory / str(target),
                              {"budget": target, **self.counter.summary(state.global_step)})
        self.budgets = [b for b in self.budgets if b not in self.due]
        self.due = []
        return control


def keep_snapshot(checkpoint: Any, destination: Any, record: dict[str, Any]) -> None:
    """A trainer checkpoint's weights (an adapter, or the whole model) copied to `destination` with `record`, the
    record written last (a snapshot without one was cut off and is taken again)."""
    import json
    import shutil

    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(checkpoint, destination, ignore=shutil.ignore_patterns(*NOT_WEIGHTS))
    (destination / SNAPSHOT_RECORD).write_text(json.dumps(record, indent=2))


def attach_snapshots(trainer: Any, counter: TargetTokens, budgets: list[int], directory: Any,
                     fresh: bool = True) -> Snapshots | None:
    """Save `trainer`'s model at each of `budgets` target tokens into `directory` (none: nothing added). `fresh`: the
    run starts from step 0 (not resumed from a checkpoint), so a snapshot left in `directory` is an abandoned run's
    (a crash, then a run started over) and is removed, never taken as this run's."""
    import shutil
    from pathlib import Path

    if fresh and Path(directory).exists():
        shutil.rmtree(directory)
    if not budgets:
        return None
    snapshots = Snapshots(counter, budgets, directory)
    trainer.add_callback(snapshots)
    return snapshots
